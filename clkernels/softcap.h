/* The logit softcap without a libm tanh, shared by the decode and prefill kernels.
 *
 * The softcap of a score s in log2 units: c2 tanh(s / c2), c2 = c log2(e), to ~3e-7 of tanh
 * relative, in one of two forms (libm's tanh made an fp32 decode.cl 1.6x slower on an H200 and
 * cost PoCL's prefill 12-18%: docs/notes/variants.md):
 * - GPUs: 1 - 2 / (1 + 2^(2x log2 e)) for |x| >= 0.55 from the hardware's exp2 and reciprocal;
 *   below, where that cancels (an absolute error of c2 2^-23), x (1 + x^2 P(x^2)), P a
 *   least-squares fit of (tanh(x) / x - 1) / x^2 on [0, 0.55].
 * - CPU builds (x86-64, AArch64), whose exp2 is a polynomial of its own: x P(x^2) / Q(x^2), P of
 *   degree 6 and Q of degree 3 fitted to tanh(x) / x on |x| <= 9 for the least relative error
 *   (9e-9 exact, ~3e-7 in float32); beyond 9, 1 - tanh(x) < 3e-8 and x is clamped (a NaN kept).
 *   PoCL prefill +5-6% over plain, against +10-11% for the exp2 form (which wins on an H200).
 */
#ifndef FLASHCL_SOFTCAP_H
#define FLASHCL_SOFTCAP_H

#include "target.h"

#if FLASHCL_CPU_BUILD
/* NAME(s, cap_log2, inv_cap) for scores of type T (a float or a vector of them: the ternary
 * selects lane by lane) with the given 2^x (unused here) and 1/x; inv_cap = 1 / cap_log2 */
#define FLASHCL_SOFTCAP_FN(T, NAME, EXP2, RECIP)                                                \
static inline T NAME(const T s, const float cap_log2, const float inv_cap)                        \
{                                                                                                \
    const T x0 = s * inv_cap;                                                                    \
    const T x = fabs(x0) > 9.0f ? copysign((T)(9.0f), x0) : x0;  /* NaN stays NaN */             \
    const T y = x * x;                                                                           \
    const T p = fma(fma(fma(fma(fma(fma((T)(-8.549242525e-14f), y, (T)(5.300786222e-11f)), y,    \
                (T)(-2.027133693e-08f)), y, (T)(1.116545885e-05f)), y, (T)(3.105014300e-03f)), y, \
                (T)(1.308495700e-01f)), y, (T)(9.999999956e-01f));                               \
    const T q = fma(fma(fma((T)(2.547689756e-04f), y, (T)(2.449938946e-02f)), y,                \
                        (T)(4.641828468e-01f)), y, (T)(1.0f));                                   \
    return cap_log2 * (x * p * RECIP(q));                                                        \
}
#else
#define FLASHCL_SOFTCAP_FN(T, NAME, EXP2, RECIP)                                                \
static inline T NAME(const T s, const float cap_log2, const float inv_cap)                        \
{                                                                                                \
    const T x = s * inv_cap;                                                                     \
    const T tanh_far = fma((T)(-2.0f), RECIP((T)(1.0f) + EXP2(x * (2.0f * M_LOG2E_F))), (T)(1.0f)); \
    const T x2 = x * x;                                                                          \
    const T p = fma(fma(fma((T)(0.017424671f), x2, (T)(-0.053210378f)), x2, (T)(0.133293122f)), x2, \
                    (T)(-0.333333105f));                                                         \
    const T tanh_near = fma(x * x2, p, x);                                                       \
    return cap_log2 * (fabs(x) < 0.55f ? tanh_near : tanh_far);                                  \
}
#endif

#endif
