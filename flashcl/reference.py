"""The float64 oracle every flashcl kernel is checked against (NumPy only).

Shapes (SDPA order; a 3-D ``(H, N, D)`` array is treated as batch 1):

    q    (B, H_q,  N_q,  DK)
    k    (B, H_kv, N_kv, DK)       H_q % H_kv == 0  (MHA, GQA, MQA)
    v    (B, H_kv, N_kv, DV)       DK and DV independent
    out  (B, H_q,  N_q,  DV)
    lse  (B, H_q,  N_q)            natural-log sum-exp of the scaled scores of each row

``causal=True`` is bottom-right aligned: query ``i`` sees keys ``j <= i + N_kv - N_q``. A row that
sees no key has output 0 and lse ``-inf``.

The attention-state algebra: a partial result over a subset of the keys is the unnormalized state

    m    (B, H_q, N_q)         row max of the visible scaled scores (-inf if none visible)
    l    (B, H_q, N_q)         sum of exp(s - m)                    (0 if none visible)
    acc  (B, H_q, N_q, DV)     sum of exp(s - m) * v                (0 if none visible)

Two states over disjoint key sets merge exactly by rescaling both to their shared max; the merge
is commutative and associative and the empty state ``(-inf, 0, 0)`` is its identity. Split-k
decode, cascade (shared-prefix) attention and multi-device splits are all this one algorithm.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np

from .quant import QuantizedTensor, dequantize


# Relative error allowed against this oracle, by the dtype a kernel stores in (it always
# accumulates in float32). bfloat16 keeps 8 mantissa bits: rounding the output alone costs ~2e-3.
TOLERANCE = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1e-2}

# An additive mask value at or below this hides its key, as -inf does: the kernels score in log2
# units, where a lower value overflows float32 (transformers pads float32 masks with finfo.min).
MASK_HIDES_AT = -2.3586e38


def rel_err(got, ref) -> float:
    """``||got - ref|| / ||ref||`` in float64; against an all-zero reference, ``||got||``."""
    got = np.asarray(got, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    den = np.linalg.norm(ref)
    return float(np.linalg.norm(got - ref) / (den if den > 0 else 1.0))


class AttentionState(NamedTuple):
    m: np.ndarray
    l: np.ndarray
    acc: np.ndarray


def _dense(x):
    """A QuantizedTensor dequantized (the oracle attends the values the cache holds); else x."""
    if isinstance(x, QuantizedTensor):
        x = dequantize(x)
    if type(x).__module__.split(".")[0] == "torch":
        x = x.detach().cpu().float().numpy()
    elif type(x).__module__.startswith("pyopencl"):
        x = x.get()
    return x


def _as4d(x: np.ndarray) -> np.ndarray:
    x = np.asarray(_dense(x), dtype=np.float64)
    if x.ndim == 3:
        return x[None]
    if x.ndim != 4:
        raise ValueError(f"expected a 3-D (H, N, D) or 4-D (B, H, N, D) array, got shape {x.shape}")
    return x


def _expand_kv_heads(x: np.ndarray, h_q: int) -> np.ndarray:
    """Repeat each KV head over its GQA group of query heads: (B, H_kv, ...) -> (B, H_q, ...)."""
    h_kv = x.shape[1]
    if h_q % h_kv:
        raise ValueError(f"H_q={h_q} is not a multiple of H_kv={h_kv}")
    return np.repeat(x, h_q // h_kv, axis=1)


def causal_mask(n_q: int, n_kv: int) -> np.ndarray:
    """Boolean (N_q, N_kv) mask, True where bottom-right-aligned causal attention sees the key."""
    rows = np.arange(n_q)[:, None]
    cols = np.arange(n_kv)[None, :]
    return cols <= rows + (n_kv - n_q)


def window_mask(n_q: int, n_kv: int, window) -> np.ndarray:
    """Boolean (N_q, N_kv) mask of a (left, right) window around each row's bottom-right aligned
    position p = i + N_kv - N_q: key j is seen when p - left <= j <= p + right (-1: unbounded)."""
    left, right = (min(int(w), n_q + n_kv) for w in window)  # wider is the same, and fits int64
    pos = np.arange(n_q)[:, None] + (n_kv - n_q)
    cols = np.arange(n_kv)[None, :]
    seen = np.ones((n_q, n_kv), dtype=bool)
    if left >= 0:
        seen &= cols >= pos - left
    if right >= 0:
        seen &= cols <= pos + right
    return seen


def empty_state(b: int, h: int, n_q: int, dv: int) -> AttentionState:
    """The identity of ``merge``: a partition that saw no key."""
    return AttentionState(
        np.full((b, h, n_q), -np.inf), np.zeros((b, h, n_q)), np.zeros((b, h, n_q, dv))
    )


def sink_state(sinks, b: int, n_q: int, dv: int) -> AttentionState:
    """The state of the learned sinks (H_q,): one key per head with logit ``sinks[h]`` and value 0.
    Merged once into a row's state, it adds exp(sink - m) to the normalizer and nothing to acc."""
    s = np.asarray(sinks, dtype=np.float64)
    m = np.broadcast_to(s[None, :, None], (b, s.shape[0], n_q)).copy()
    return AttentionState(m, np.ones_like(m), np.zeros((b, s.shape[0], n_q, dv)))


def logits(q, k, *, scale: float | None = None, causal: bool = False, window=None,
           softcap: float | None = None, alibi_slopes=None, mask=None):
    """Scores and visibility of every (row, key): ``(s, visible)``, both (B, H_q, N_q, N_kv).

    Order (flashcl.variants): scale, softcap ``c * tanh(s / c)``, ALiBi ``- slope * |p - j|``
    with p = i + N_kv - N_q, additive mask. Visible: causal, window, a boolean mask's True, an
    additive mask's value above MASK_HIDES_AT. ``alibi_slopes`` is (H_q,) or (B, H_q); ``mask`` is
    broadcastable to (B, H_q, N_q, N_kv), bool or float.
    """
    q, k = _as4d(q), _as4d(k)
    b, h_q, n_q, dk = q.shape
    n_kv = k.shape[2]
    scale = 1.0 / np.sqrt(dk) if scale is None else float(scale)
    s = np.einsum("bhqd,bhkd->bhqk", q, _expand_kv_heads(k, h_q)) * scale
    if softcap is not None:
        s = softcap * np.tanh(s / softcap)
    if alibi_slopes is not None:
        slopes = np.broadcast_to(np.asarray(alibi_slopes, dtype=np.float64), (b, h_q))
        dist = np.abs(np.arange(n_q)[:, None] + (n_kv - n_q) - np.arange(n_kv)[None, :])
        s = s - slopes[:, :, None, None] * dist
    visible = np.ones((n_q, n_kv), dtype=bool)
    if causal:
        visible = visible & causal_mask(n_q, n_kv)
    if window is not None:
        visible = visible & window_mask(n_q, n_kv, window)
    if mask is not None:
        mask = np.asarray(mask)
        if mask.dtype == np.bool_:
            visible = visible & mask
        else:
            add = mask.astype(np.float64)
            hidden = add <= MASK_HIDES_AT
            s = s + np.where(hidden, 0.0, add)
            visible = visible & ~hidden
    return s, np.broadcast_to(visible, s.shape)


def state_of_scores(s, visible, v) -> AttentionState:
    """Unnormalized state of the scores ``s`` (B, H_q, N_q, N) over the values v (B, H_kv, N, DV)
    where ``visible``; a hidden key contributes nothing, whatever its score or value."""
    v = _as4d(v)
    b, h_q, n_q, n = s.shape
    if n == 0:
        return empty_state(b, h_q, n_q, v.shape[3])
    v = _expand_kv_heads(v, h_q)
    s = np.where(visible, s, -np.inf)
    m = s.max(axis=-1)
    m_safe = np.where(np.isneginf(m), 0.0, m)  # a fully hidden row: every p becomes exp(-inf) = 0
    p = np.exp(s - m_safe[..., None])
    if np.isfinite(v).all():
        acc = np.einsum("bhqk,bhkd->bhqd", p, v)
    else:  # a hidden key's NaN/inf must not reach the row (p = 0 times inf is NaN); a visible one does
        vis = np.broadcast_to(visible, p.shape)
        with np.errstate(invalid="ignore"):
            acc = np.where(vis[..., None], p[..., None] * v[:, :, None], 0.0).sum(axis=3)
    return AttentionState(m, p.sum(axis=-1), acc)


def attend_partial(q, k, v, *, scale: float | None = None, mask=None) -> AttentionState:
    """Unnormalized attention state of q over the keys k/v (any subset of the sequence).

    ``mask`` is a boolean array broadcastable to (B, H_q, N_q, N_chunk); False hides a key.
    """
    q, k = _as4d(q), _as4d(k)
    s, visible = logits(q, k, scale=scale, mask=mask)
    return state_of_scores(s, visible, v)


def merge(a: AttentionState, b: AttentionState) -> AttentionState:
    """Exact merge of two states over disjoint key sets (rescale both to the shared max)."""
    m = np.maximum(a.m, b.m)
    m_safe = np.where(np.isneginf(m), 0.0, m)  # both empty: keep (-inf, 0, 0), no inf - inf
    wa = np.exp(a.m - m_safe)
    wb = np.exp(b.m - m_safe)
    return AttentionState(m, a.l * wa + b.l * wb, a.acc * wa[..., None] + b.acc * wb[..., None])


def merge_partials(states: Sequence[AttentionState]) -> AttentionState:
    """Merge any number of states (order does not matter)."""
    if not states:
        raise ValueError("merge_partials needs at least one state")
    out = states[0]
    for s in states[1:]:
        out = merge(out, s)
    return out


def finalize(state: AttentionState) -> tuple[np.ndarray, np.ndarray]:
    """Normalize a state: (out, lse). Rows that saw no key give out 0 and lse -inf; rows whose
    scores hold NaN (NaN in q or in a key they see) give out and lse NaN."""
    seen = state.l > 0
    broken = np.isnan(state.l) | np.isnan(state.m)
    l_safe = np.where(seen, state.l, 1.0)
    out = np.where(seen[..., None], state.acc / l_safe[..., None], 0.0)
    lse = np.where(seen, state.m + np.log(l_safe), -np.inf)
    out = np.where(broken[..., None], np.nan, out)
    lse = np.where(broken, np.nan, lse)
    return out, lse


def attention(q, k, v, *, causal: bool = False, scale: float | None = None, return_lse: bool = False,
              window=None, softcap: float | None = None, sinks=None, alibi_slopes=None, mask=None):
    """Dense float64 attention with every variant (flashcl.variants); 3-D inputs give 3-D outputs.

    With ``sinks`` the lse includes the sink term: log(sum_j exp(s_j) + exp(sink)).
    """
    return partitioned_attention(q, k, v, 1, causal=causal, scale=scale, return_lse=return_lse,
                                 window=window, softcap=softcap, sinks=sinks,
                                 alibi_slopes=alibi_slopes, mask=mask)


def partitioned_attention(q, k, v, num_partitions: int, *, causal: bool = False,
                          scale: float | None = None, return_lse: bool = False, window=None,
                          softcap: float | None = None, sinks=None, alibi_slopes=None, mask=None):
    """Attention computed as ``num_partitions`` contiguous key chunks merged together, the sinks
    merged once. More partitions than keys is allowed: the surplus chunks are empty no-ops."""
    squeeze = np.ndim(q) == 3
    q4, k4, v4 = _as4d(q), _as4d(k), _as4d(v)
    n_q, n_kv = q4.shape[2], k4.shape[2]
    s, visible = logits(q4, k4, scale=scale, causal=causal, window=window, softcap=softcap,
                        alibi_slopes=alibi_slopes, mask=mask)
    bounds = np.linspace(0, n_kv, num_partitions + 1).round().astype(int)
    states = [state_of_scores(s[..., lo:hi], visible[..., lo:hi], v4[:, :, lo:hi])
              for lo, hi in zip(bounds[:-1], bounds[1:])]
    if sinks is not None:
        states.append(sink_state(sinks, q4.shape[0], n_q, v4.shape[3]))
    out, lse = finalize(merge_partials(states))
    if squeeze:
        out, lse = out[0], lse[0]
    return (out, lse) if return_lse else out


def decode_attention(q, k_cache, v_cache, *, block_table=None, context_lens=None,
                     scale: float | None = None, return_lse: bool = False, window=None,
                     softcap: float | None = None, sinks=None, alibi_slopes=None, key_start=None):
    """Decode against a contiguous or paged cache (see flashcl.decode for layouts).

    q (B, H_q, DK), or (B, H_q, N_q, DK): the sequence's last N_q tokens, causal among themselves;
    contiguous k_cache (B, H_kv, N_max, DK) with optional context_lens (B,); paged k_cache
    (num_blocks, block_size, H_kv, DK) with block_table (B, max_blocks). Row i of sequence b sits
    at position context_lens[b] - N_q + i (N_q = 1 for a 3-D q; for window and ALiBi) and sees no
    key before key_start[b] where given. Caches may be QuantizedTensors (attended dequantized).
    Returns out (B, H_q, DV) and, on request, lse (B, H_q), each with an N_q axis before the last
    for a 4-D q.
    """
    k_cache, v_cache = _dense(k_cache), _dense(v_cache)
    q = np.asarray(_dense(q), dtype=np.float64)
    b, h_q = q.shape[:2]
    slopes = None if alibi_slopes is None else np.broadcast_to(
        np.asarray(alibi_slopes, dtype=np.float64), (b, h_q))
    outs, lses = [], []
    for i in range(b):
        if block_table is None:
            n = k_cache.shape[2] if context_lens is None else int(context_lens[i])
            k = np.asarray(k_cache[i, :, :n], dtype=np.float64)
            v = np.asarray(v_cache[i, :, :n], dtype=np.float64)
        else:
            n = int(context_lens[i])
            bs = k_cache.shape[1]
            blocks = np.asarray(block_table[i][: (n + bs - 1) // bs])
            # (blocks, block_size, H_kv, D) -> (H_kv, tokens, D)
            k = np.asarray(k_cache[blocks], dtype=np.float64).reshape(-1, *k_cache.shape[2:])[:n]
            v = np.asarray(v_cache[blocks], dtype=np.float64).reshape(-1, *v_cache.shape[2:])[:n]
            k, v = k.transpose(1, 0, 2), v.transpose(1, 0, 2)
        seen = None if key_start is None else np.arange(n) >= int(key_start[i])
        rows = q[i] if q.ndim == 4 else q[i][:, None, :]
        o, lse = attention(rows, k, v, causal=True, scale=scale, return_lse=True, window=window,
                           softcap=softcap, sinks=sinks,
                           alibi_slopes=None if slopes is None else slopes[i], mask=seen)
        outs.append(o if q.ndim == 4 else o[:, 0])
        lses.append(lse if q.ndim == 4 else lse[:, 0])
    out, lse = np.stack(outs), np.stack(lses)
    return (out, lse) if return_lse else out
