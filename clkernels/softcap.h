/* The logit softcap without a libm tanh, shared by the decode and prefill kernels.
 *
 * The softcap of a score s in log2 units: c2 tanh(s / c2), c2 = c log2(e), within ~2.5e-7 of
 * tanh relative. |x| >= 0.55: tanh(x) = 1 - 2 / (1 + 2^(2 log2(e) x)) from the hardware's exp2 and
 * reciprocal approximations (a precise division or libm tanh per score made an fp32 decode.cl
 * 1.6x slower on an H200, and PoCL's vector tanh cost prefill 12-18%); below, where 1 - 2 / (...)
 * cancels (an absolute error of c2 2^-23: 1e-3 at a cap of 1e4), x (1 + x^2 P(x^2)), P a
 * least-squares fit of (tanh(x) / x - 1) / x^2 on [0, 0.55].
 */
#ifndef FLASHCL_SOFTCAP_H
#define FLASHCL_SOFTCAP_H

/* NAME(s, cap_log2, inv_cap) for scores of type T (a float, or a vector of scores: the ternary
 * selects lane by lane) with the given 2^x and 1/x; inv_cap = 1 / cap_log2 */
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
