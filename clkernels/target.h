/* Whether this build's compiler targets a CPU: a CPU driver's clang (PoCL) defines its host
 * architecture, a GPU compiler does not. The CPU builds take the forms measured faster there
 * (row prefetches, vector fp16 reads, the rational softcap). */
#ifndef FLASHCL_TARGET_H
#define FLASHCL_TARGET_H

#if defined(__x86_64__) || defined(__aarch64__)
#define FLASHCL_CPU_BUILD 1
#else
#define FLASHCL_CPU_BUILD 0
#endif

#endif
