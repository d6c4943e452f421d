/* What every flashcl kernel shares: the host-defined problem constants (checked here), the
 * work-group size declaration, token pasting for width-generic vector names, 64-byte aligned local arrays, and the lse formula. */
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

#ifndef FIXED_WG
/* 1: kernels declare reqd_work_group_size. NVIDIA's compiler turns it into a launch bound
 * (.reqntid), and ptxas then ignores -cl-nv-maxrregcount; builds with a register cap (flashcl
 * tune on a GPU standing in for a smaller register file) use 0. */
#define FIXED_WG 1
#endif
#if FIXED_WG
#define FLASHCL_REQD_WG(n) __attribute__((reqd_work_group_size((n), 1, 1)))
#else
#define FLASHCL_REQD_WG(n)
#endif

#define FLASHCL_CAT_(a, b) a##b
#define FLASHCL_CAT(a, b) FLASHCL_CAT_(a, b)

/* An additive mask value at or below this hides its key, as -inf does: scores are in log2 units,
 * where a lower value overflows float32 (flashcl.reference.MASK_HIDES_AT; finfo(float32).min). */
#define MASK_HIDES_AT (-2.3586e38f)

/* Local arrays read through vector-typed pointers are declared with this: vloadN only promises
 * element alignment, so a compiler may split it into scalar loads (NVIDIA's does), while a
 * vector-typed access is one wide load -- valid because the array is aligned and every offset is
 * a multiple of the vector width. */
#define LDS_ALIGNED __attribute__((aligned(64)))

/* Natural-log sum-exp of an online-softmax state kept in log2 units (max m, sum l of exp2(s - m));
 * a row that saw no key (l = 0) has lse = -inf, a NaN state (NaN in q or in a visible K, which
 * makes out NaN too) has lse = NaN: never -inf, which would read as "saw no key". */
static inline float lse_of_state(const float m, const float l)
{
    return (l == 0.0f) ? -INFINITY : (m + log2(l)) * M_LN2_F;
}

#endif
