"""The variants of the decode kernels (decode's Triton kernel and decode_gluon's GQA kernel, which
calls these Triton functions as they are): the softcap and ALiBi on scores, a sink joined to an
online-softmax state, all in the log2 domain."""

from __future__ import annotations

import triton
import triton.language as tl

from ..reference import MASK_HIDES_AT as _MASK_HIDES_AT

_LOG2E = 1.4426950408889634  # the kernels work in base 2: exp(x) = exp2(x * log2(e))
LOG2E = tl.constexpr(_LOG2E)  # the same, for the kernels
MASK_HIDES_AT = tl.constexpr(_MASK_HIDES_AT)  # an additive mask value at or below it hides its key


@triton.jit
def score_variants(s, slope, dist, softcap_log2, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr):
    """The scores (log2 domain) after the softcap, ``c tanh(s / c)`` (``softcap_log2`` = c log2 e),
    then ALiBi, ``- slope * dist`` (``dist`` = p - j >= 0 for every key the query sees)."""
    if SOFTCAP:
        # tanh from one exp2 of -2|x| (no overflow): (1 - e) / (1 + e), the sign put back
        x = s / softcap_log2
        e = tl.exp2(tl.abs(x) * (-2.0 * LOG2E))
        t = (1.0 - e) / (1.0 + e)
        s = softcap_log2 * tl.where(x < 0, -t, t)
    if ALIBI:
        s = s - slope * dist.to(tl.float32)
    return s


@triton.jit
def join_sink(m, l, sink):
    """The state (m, l) with the sink logit ``sink`` joined once: (m', l', alpha), alpha the factor
    the state's accumulator takes. A sink of -inf with no key leaves l = 0 (no 0/0 later)."""
    m_new = tl.maximum(m, sink)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - m_safe)
    return m_new, l * alpha + tl.exp2(sink - m_safe), alpha
