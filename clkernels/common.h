/* What every flashcl kernel shares: the host-defined problem constants (checked here), token
 * pasting for width-generic vector names, 64-byte aligned local arrays, and the lse formula. */
#ifndef FLASHCL_COMMON_H
#define FLASHCL_COMMON_H

#ifndef HEAD_DK
#error "HEAD_DK (query/key head dim) must be defined by the host"
#endif
#ifndef HEAD_DV
#error "HEAD_DV (value head dim) must be defined by the host"
#endif
#ifndef STORE_HALF
#define STORE_HALF 0      // 1: q/k/v/out are stored as half (computed in float32)
#endif

#define FLASHCL_CAT_(a, b) a##b
#define FLASHCL_CAT(a, b) FLASHCL_CAT_(a, b)

/* Local arrays read through vector-typed pointers are declared with this: vloadN only promises
 * element alignment, so a compiler may split it into scalar loads (NVIDIA's does), while a
 * vector-typed access is one wide load -- valid because the array is aligned and every offset is
 * a multiple of the vector width. */
#define LDS_ALIGNED __attribute__((aligned(64)))

/* Natural-log sum-exp of an online-softmax state kept in log2 units (max m, sum l of exp2(s - m));
 * a row that saw no key (l = 0) has lse = -inf. */
static inline float lse_of_state(const float m, const float l)
{
    return (l > 0.0f) ? (m + log2(l)) * M_LN2_F : -INFINITY;
}

#endif
