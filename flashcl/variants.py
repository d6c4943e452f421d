"""Attention variants (docs/design.md §2, "Variants"): sliding window, logit softcap, learned
sinks, ALiBi and masks, as one validated description that the API hands to every backend.

Score of query row i (bottom-right aligned position ``p = i + N_kv - N_q``) against key j, in
this order:

    s  = scale * q_i . k_j
    s  = softcap * tanh(s / softcap)             if softcap
    s -= slope[b, h] * |p - j|                   if alibi_slopes
    s += mask[b, h, i, j]                        if mask is additive (float)

Key j is visible to row i when every rule that is on allows it: causal (``j <= p``), window
(``p - left <= j <= p + right``, -1 unbounded), a boolean mask's True, an additive mask's value
above ``reference.MASK_HIDES_AT`` (-inf, and float32's finfo.min, which transformers pads with,
hide: scores are in log2 units in the kernels, where such a value overflows). A hidden key never
influences the row (its K or V may hold NaN or inf). A sink is a key of value zero with logit
``sinks[h]`` that every row sees: it joins the softmax normalizer, adds nothing to the output, and
is part of the returned lse.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional, Tuple

import numpy as np

from .reference import MASK_HIDES_AT

# A decode of several query rows per sequence (flashcl.decode of a 4-D q; prefill's few-row
# routes) runs each query head's rows as heads of its KV head's group (the kernels' QUERY_ROWS).
DECODE_ROWS = 16        # query rows per sequence
DECODE_GROUP_ROWS = 64  # rows per KV head: the query heads of its group x their rows


@dataclass(frozen=True)
class Variants:
    """The variants of one call, validated and normalized by the API.

    window        (left, right) ints, each >= 0 or -1 (unbounded); None when off. A window of
                  (-1, -1) is normalized to None.
    softcap       float > 0, or None.
    sinks         float32 (H_q,) array of the call's array family (numpy for OpenCL, torch on the
                  inputs' device for Triton), or None.
    alibi_slopes  float32 (B, H_q) (a (H_q,) input is broadcast over the batch), or None.
    mask          prefill only: 4-D (B or 1, H_q or 1, N_q, N_kv), bool (True = may attend) or
                  float32 (additive; -inf and values at or below MASK_HIDES_AT hide), or None.
    """

    window: Optional[Tuple[int, int]] = None
    softcap: Optional[float] = None
    sinks: Any = None
    alibi_slopes: Any = None
    mask: Any = None

    @property
    def active(self) -> bool:
        return any(x is not None for x in (self.window, self.softcap, self.sinks,
                                            self.alibi_slopes, self.mask))

    @property
    def mask_is_bool(self) -> bool:
        return self.mask is not None and "bool" in str(self.mask.dtype)

    def per_row(self, n_q: int) -> "Variants":
        """These variants for each query head's N_q rows run as heads of its group (the decode
        kernels' QUERY_ROWS): sinks and ALiBi slopes repeated per row, the rest as they are."""
        def rows(x):
            if x is None:
                return None
            return x.repeat_interleave(n_q, dim=-1) if hasattr(x, "repeat_interleave") else np.repeat(x, n_q, axis=-1)

        return replace(self, sinks=rows(self.sinks), alibi_slopes=rows(self.alibi_slopes))

    def flags(self) -> dict:
        """Which variants are on, by name (what kernels specialize on at compile time)."""
        return {"window": self.window is not None, "softcap": self.softcap is not None,
                "sinks": self.sinks is not None, "alibi": self.alibi_slopes is not None,
                "mask": None if self.mask is None else ("bool" if self.mask_is_bool else "add")}


def window_bounds(window: Optional[Tuple[int, int]]) -> Tuple[int, int]:
    """(left, right) with -1 (unbounded) and anything wider than 2^30 replaced by 2^30, a bound
    larger than any sequence that kernels can add positions to in int32."""
    if window is None:
        return (1 << 30, 1 << 30)
    return tuple(1 << 30 if w < 0 else min(w, 1 << 30) for w in window)


def key_range(first_pos: int, last_pos: int, n_kv: int, *, causal: bool,
              window: Optional[Tuple[int, int]]) -> Tuple[int, int]:
    """The keys [lo, hi) that rows at positions first_pos..last_pos may see under causal and
    window (a mask can only hide more). lo >= hi means none."""
    left, right = window_bounds(window)
    lo = max(0, first_pos - left)
    hi = n_kv if not causal else min(n_kv, last_pos + 1)
    hi = min(hi, max(0, last_pos + right + 1)) if window is not None else hi
    return lo, max(lo, hi)


def mask_visible(mask: np.ndarray) -> np.ndarray:
    """Where a bool mask is True or an additive one above MASK_HIDES_AT (-inf and finfo.min hide)."""
    return mask if mask.dtype == np.bool_ else mask > MASK_HIDES_AT


def mask_block_map(mask: np.ndarray, block_m: int, block_n: int) -> np.ndarray:
    """uint8 (Bm, Hm, ceil(N_q / block_m), ceil(N_kv / block_n)): 1 where the (query block, key
    tile) holds a key some row may see, 0 where the tile is wholly hidden and is skipped."""
    visible = mask_visible(mask)
    bm, hm, n_q, n_kv = visible.shape
    tq, tk = -(-n_q // block_m), -(-n_kv // block_n)
    padded = np.zeros((bm, hm, tq * block_m, tk * block_n), dtype=bool)
    padded[:, :, :n_q, :n_kv] = visible
    return padded.reshape(bm, hm, tq, block_m, tk, block_n).any(axis=(3, 5)).astype(np.uint8)
