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
#ifndef STORE_BF16
#define STORE_BF16 0      // 1: q/k/v/out are stored as bfloat16 (computed in float32)
#endif
#if STORE_HALF && STORE_BF16
#error "STORE_HALF and STORE_BF16 exclude each other"
#endif
#define STORE_2B (STORE_HALF || STORE_BF16)  // 2-byte elements: rows are read 8 to a 16-byte chunk

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

/* bfloat16 is the high half of a float32: widening is a shift, narrowing rounds to nearest even
 * (NaN stays a quiet NaN; float32 values past bf16's largest round to inf, as torch rounds them). */
#define BF16_LOAD(N, i, p) FLASHCL_CAT(as_float, N)(FLASHCL_CAT(convert_uint, N)(FLASHCL_CAT(vload, N)((i), (p))) << 16)
#define FLASHCL_BF16_ROUND(N)                                                                \
static inline ushort##N bf16_round##N(const float##N x)                                      \
{                                                                                            \
    const uint##N u = as_uint##N(x);                                                         \
    const uint##N r = (u + (uint##N)(0x7fffu) + ((u >> 16) & (uint##N)(1u))) >> 16;          \
    return convert_ushort##N(select(r, (u >> 16) | (uint##N)(0x40u), as_uint##N(isnan(x))));   \
}
FLASHCL_BF16_ROUND(4)
FLASHCL_BF16_ROUND(8)
FLASHCL_BF16_ROUND(16)
#define BF16_STORE(N, x, i, p) FLASHCL_CAT(vstore, N)(FLASHCL_CAT(bf16_round, N)(x), (i), (p))
static inline ushort bf16_round(const float x)
{
    const uint u = as_uint(x);
    return (ushort)(isnan(x) ? (u >> 16) | 0x40u : (u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* Natural-log sum-exp of an online-softmax state kept in log2 units (max m, sum l of exp2(s - m));
 * a row that saw no key (l = 0) has lse = -inf, a NaN state (NaN in q or in a visible K, which
 * makes out NaN too) has lse = NaN: never -inf, which would read as "saw no key". */
static inline float lse_of_state(const float m, const float l)
{
    return (l == 0.0f) ? -INFINITY : (m + log2(l)) * M_LN2_F;
}

#endif
