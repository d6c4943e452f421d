"""The oracle's attention variants (flashcl.variants) against direct, independent formulas, and
the API's validation of the variant keywords (errors before any kernel runs)."""

from __future__ import annotations

import numpy as np
import pytest

import flashcl
from flashcl import reference as ref
from flashcl.variants import key_range, mask_block_map


def _qkv(b=2, h_q=4, h_kv=2, n_q=7, n_kv=11, dk=16, dv=8, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((b, h_q, n_q, dk)), rng.standard_normal((b, h_kv, n_kv, dk)),
            rng.standard_normal((b, h_kv, n_kv, dv)))


def _naive(q, k, v, *, bias=None, visible=None, sinks=None, softcap=None, scale=None):
    """Row by row softmax over explicit logits, the sink as one more column (gpt-oss's eager)."""
    b, h_q, n_q, dk = q.shape
    g = h_q // k.shape[1]
    scale = 1 / np.sqrt(dk) if scale is None else scale
    out = np.zeros((b, h_q, n_q, v.shape[3]))
    lse = np.full((b, h_q, n_q), -np.inf)
    for bi in range(b):
        for h in range(h_q):
            s = q[bi, h] @ k[bi, h // g].T * scale
            if softcap is not None:
                s = softcap * np.tanh(s / softcap)
            if bias is not None:
                s = s + bias[bi, h]
            for i in range(n_q):
                cols = np.flatnonzero(visible[bi, h, i]) if visible is not None else np.arange(s.shape[1])
                logits = list(s[i, cols]) + ([sinks[h]] if sinks is not None else [])
                if not logits:
                    continue
                m = max(logits)
                w = np.exp(np.array(logits) - m)
                den = w.sum()
                out[bi, h, i] = (w[: len(cols)] @ v[bi, h // g][cols]) / den
                lse[bi, h, i] = m + np.log(den)
    return out, lse


@pytest.mark.parametrize("window", [(0, 0), (1, 0), (3, 2), (-1, 1), (2, -1), (100, 100)])
@pytest.mark.parametrize("causal", [False, True])
def test_window_is_the_band_around_the_bottom_right_position(window, causal):
    q, k, v = _qkv()
    n_q, n_kv = q.shape[2], k.shape[2]
    p = np.arange(n_q)[:, None] + n_kv - n_q
    j = np.arange(n_kv)[None, :]
    left, right = window
    vis = np.ones((n_q, n_kv), bool)
    vis &= (j >= p - left) if left >= 0 else True
    vis &= (j <= p + right) if right >= 0 else True
    if causal:
        vis &= j <= p
    want = _naive(q, k, v, visible=np.broadcast_to(vis, (2, 4, n_q, n_kv)))
    got = ref.attention(q, k, v, causal=causal, window=window, return_lse=True)
    np.testing.assert_allclose(got[0], want[0], atol=1e-12)
    np.testing.assert_allclose(got[1], want[1], atol=1e-12)


def test_softcap_alibi_and_additive_mask_in_order():
    q, k, v = _qkv(seed=1)
    q = q * 8  # large scores, where the cap matters
    b, h_q, n_q, _ = q.shape
    n_kv = k.shape[2]
    slopes = np.random.default_rng(2).uniform(0.1, 1.0, (b, h_q))
    add = np.random.default_rng(3).standard_normal((b, 1, n_q, n_kv))
    add[0, 0, 2, :] = -np.inf          # a row that sees nothing
    add[1, 0, :, 4] = -np.inf          # a key nobody sees
    dist = np.abs(np.arange(n_q)[:, None] + n_kv - n_q - np.arange(n_kv)[None, :])
    bias = -slopes[:, :, None, None] * dist + np.where(np.isinf(add), 0, add)
    vis = np.broadcast_to(~np.isinf(add), (b, h_q, n_q, n_kv))
    want = _naive(q, k, v, bias=bias, visible=vis, softcap=5.0)
    got = ref.attention(q, k, v, softcap=5.0, alibi_slopes=slopes, mask=add, return_lse=True)
    np.testing.assert_allclose(got[0], want[0], atol=1e-12)
    np.testing.assert_allclose(got[1], want[1], atol=1e-12)
    assert np.all(got[0][0, :, 2] == 0) and np.all(np.isneginf(got[1][0, :, 2]))


def test_bool_and_additive_masks_agree():
    q, k, v = _qkv(seed=4)
    keep = np.random.default_rng(5).random((2, 4, 7, 11)) > 0.4
    a = ref.attention(q, k, v, mask=keep, return_lse=True)
    b = ref.attention(q, k, v, mask=np.where(keep, 0.0, -np.inf), return_lse=True)
    np.testing.assert_allclose(a[0], b[0])
    np.testing.assert_allclose(a[1], b[1])


@pytest.mark.parametrize("parts", [1, 2, 3, 5, 20])
def test_sinks_count_once_across_partitions(parts):
    q, k, v = _qkv(seed=6)
    sinks = np.array([0.5, -1.0, 3.0, 10.0])
    want = _naive(q, k, v, sinks=sinks, visible=np.broadcast_to(ref.causal_mask(7, 11), (2, 4, 7, 11)))
    got = ref.partitioned_attention(q, k, v, parts, causal=True, sinks=sinks, return_lse=True)
    np.testing.assert_allclose(got[0], want[0], atol=1e-12)
    np.testing.assert_allclose(got[1], want[1], atol=1e-12)


def test_cascade_with_sinks_in_one_part_merges_exactly():
    q, k, v = _qkv(seed=7)
    sinks = np.array([1.0, 2.0, -3.0, 0.0])
    full = ref.attention(q, k, v, sinks=sinks, return_lse=True)
    a = ref.attention(q, k[:, :, :4], v[:, :, :4], sinks=sinks, return_lse=True)
    b = ref.attention(q, k[:, :, 4:], v[:, :, 4:], return_lse=True)
    out, lse = flashcl.merge_states([a[0], b[0]], [a[1], b[1]])
    np.testing.assert_allclose(out, full[0], atol=1e-12)
    np.testing.assert_allclose(lse, full[1], atol=1e-6)


def test_a_row_that_sees_nothing_with_a_sink_is_zero_with_lse_the_sink():
    q, k, v = _qkv(seed=8)
    hide = np.zeros((1, 1, 7, 11), bool)
    out, lse = ref.attention(q, k, v, mask=hide, sinks=np.array([1.0, 2.0, 3.0, 4.0]), return_lse=True)
    assert np.all(out == 0)
    np.testing.assert_allclose(lse, np.broadcast_to(np.array([1.0, 2.0, 3.0, 4.0])[None, :, None], lse.shape))


def test_nan_outside_the_window_does_not_leak():
    q, k, v = _qkv(seed=9)
    k[:, :, :2] = np.nan   # row 0 sits at position 4 and sees keys 2..4
    v[:, :, :2] = np.inf
    out, lse = ref.attention(q, k, v, causal=True, window=(2, 0), return_lse=True)
    assert np.isfinite(out).all() and np.isfinite(lse).all()


def test_decode_oracle_places_the_query_at_the_last_position():
    rng = np.random.default_rng(10)
    q = rng.standard_normal((2, 4, 16))
    kc = rng.standard_normal((2, 2, 20, 16))
    vc = rng.standard_normal((2, 2, 20, 8))
    lens = np.array([20, 9], np.int32)
    slopes = rng.uniform(0, 1, (2, 4))
    got = ref.decode_attention(q, kc, vc, context_lens=lens, window=(4, 0), softcap=3.0,
                               sinks=np.ones(4), alibi_slopes=slopes, return_lse=True)
    for i, n in enumerate(lens):
        want = ref.attention(q[i][:, None], kc[i, :, :n], vc[i, :, :n], window=(4, 0), softcap=3.0,
                             sinks=np.ones(4), alibi_slopes=slopes[i], return_lse=True)
        np.testing.assert_allclose(got[0][i], want[0][:, 0])
        np.testing.assert_allclose(got[1][i], want[1][:, 0])


def test_oracle_attends_a_quantized_cache_dequantized():
    rng = np.random.default_rng(11)
    q = rng.standard_normal((1, 4, 32)).astype(np.float32)
    kc = rng.standard_normal((1, 2, 40, 32)).astype(np.float32)
    vc = rng.standard_normal((1, 2, 40, 32)).astype(np.float32)
    qk = flashcl.quantize(kc, "q8_0")
    got = ref.decode_attention(q, qk, vc)
    want = ref.decode_attention(q, flashcl.dequantize(qk), vc)
    np.testing.assert_array_equal(got, want)


def test_key_range_and_block_map():
    assert key_range(10, 13, 20, causal=True, window=(3, 0)) == (7, 14)
    assert key_range(10, 13, 20, causal=False, window=(3, 2)) == (7, 16)
    assert key_range(10, 13, 20, causal=False, window=None) == (0, 20)
    assert key_range(0, 0, 20, causal=True, window=(-1, 0)) == (0, 1)
    m = np.zeros((1, 1, 5, 9), bool)
    m[0, 0, 4, 8] = True
    got = mask_block_map(m, 2, 4)
    assert got.shape == (1, 1, 3, 3) and got.sum() == 1 and got[0, 0, 2, 2] == 1
    add = np.where(m, 0.0, -np.inf).astype(np.float32)
    np.testing.assert_array_equal(mask_block_map(add, 2, 4), got)


# --------------------------------------------------------------------------- API validation

def _small():
    rng = np.random.default_rng(0)
    return (rng.standard_normal((1, 4, 5, 32)).astype(np.float32),
            rng.standard_normal((1, 2, 6, 32)).astype(np.float32),
            rng.standard_normal((1, 2, 6, 32)).astype(np.float32))


@pytest.mark.parametrize("kwargs, exc, words", [
    ({"window": (3,)}, ValueError, "window"),
    ({"window": (-2, 0)}, ValueError, "window"),
    ({"window": (1.5, 0)}, ValueError, "window"),
    ({"softcap": 0.0}, ValueError, "softcap"),
    ({"softcap": float("inf")}, ValueError, "softcap"),
    ({"softcap": "3"}, TypeError, "softcap"),
    ({"sinks": np.zeros(3, np.float32)}, ValueError, "sinks"),
    ({"sinks": np.zeros(4, np.int32)}, TypeError, "sinks"),
    ({"alibi_slopes": np.zeros((2, 4), np.float32)}, ValueError, "alibi_slopes"),
    ({"mask": np.ones((5, 7), bool)}, ValueError, "mask"),
    ({"mask": np.ones((1, 1, 1, 1, 1), bool)}, ValueError, "mask"),
    ({"mask": np.ones((5, 6), np.int32)}, TypeError, "mask"),
    ({"mask": np.full((5, 6), np.nan, np.float32)}, ValueError, "NaN"),
])
def test_prefill_rejects_bad_variant_arguments_by_name(kwargs, exc, words):
    q, k, v = _small()
    with pytest.raises(exc, match=words):
        flashcl.prefill(q, k, v, **kwargs)


def test_decode_takes_no_mask_and_checks_slopes():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 4, 32)).astype(np.float32)
    kc = rng.standard_normal((2, 2, 8, 32)).astype(np.float32)
    with pytest.raises(TypeError, match="mask"):
        flashcl.decode(q, kc, kc, mask=np.ones((2, 4, 1, 8), bool))
    with pytest.raises(ValueError, match="alibi_slopes"):
        flashcl.decode(q, kc, kc, alibi_slopes=np.zeros((3, 4), np.float32))


def test_unbounded_window_is_plain_attention():
    """window=(-1, -1) hides nothing: the API normalizes it away (the plain kernel runs)."""
    from flashcl import api

    assert api._variants(b=1, h_q=4, n_q=5, n_kv=6, window=(-1, -1), softcap=None, sinks=None,
                         alibi_slopes=None) is None
