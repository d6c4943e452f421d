/* Problem constants every flashcl kernel takes from the host (-D), checked in one place. */
#ifndef FLASHCL_PROBLEM_H
#define FLASHCL_PROBLEM_H

#ifndef HEAD_DK
#error "HEAD_DK (query/key head dim) must be defined by the host"
#endif
#ifndef HEAD_DV
#error "HEAD_DV (value head dim) must be defined by the host"
#endif
#ifndef STORE_HALF
#define STORE_HALF 0      // 1: q/k/v/out are stored as half (computed in float32)
#endif

#endif
