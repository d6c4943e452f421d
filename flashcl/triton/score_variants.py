"""The score variants of the decode kernels (decode's Triton kernel and decode_gluon's GQA kernel,
which calls this Triton function as it is): the softcap and ALiBi, on scores in the log2 domain."""

from __future__ import annotations

import triton
import triton.language as tl

_LOG2E = 1.4426950408889634  # the kernels work in base 2: exp(x) = exp2(x * log2(e))
LOG2E = tl.constexpr(_LOG2E)  # the same, for the kernels


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
