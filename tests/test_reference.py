"""The oracle's state algebra: partitioning the keys and merging the parts is exact."""

import numpy as np
import pytest

from flashcl import reference as ref


def _inputs(seed=0, b=2, h_q=4, h_kv=2, n_q=9, n_kv=23, dk=16, dv=12):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((b, h_q, n_q, dk)), rng.standard_normal((b, h_kv, n_kv, dk)),
            rng.standard_normal((b, h_kv, n_kv, dv)))


def _naive(q, k, v, causal, scale=None):
    """Textbook softmax(q k^T) v, one row at a time, for a check independent of attend_partial."""
    b, h_q, n_q, dk = q.shape
    g = h_q // k.shape[1]
    scale = 1 / np.sqrt(dk) if scale is None else scale
    out = np.zeros((b, h_q, n_q, v.shape[3]))
    for bi in range(b):
        for h in range(h_q):
            for i in range(n_q):
                n_vis = k.shape[2] if not causal else i + k.shape[2] - n_q + 1
                if n_vis <= 0:
                    continue
                s = k[bi, h // g, :n_vis] @ q[bi, h, i] * scale
                p = np.exp(s - s.max())
                out[bi, h, i] = p @ v[bi, h // g, :n_vis] / p.sum()
    return out


@pytest.mark.parametrize("causal", [False, True])
def test_dense_matches_textbook(causal):
    q, k, v = _inputs()
    np.testing.assert_allclose(ref.attention(q, k, v, causal=causal), _naive(q, k, v, causal), rtol=1e-12, atol=1e-12)


def test_causal_is_bottom_right_aligned():
    m = ref.causal_mask(2, 4)
    assert m.tolist() == [[True, True, True, False], [True, True, True, True]]


def test_rows_that_see_no_key_are_zero_with_lse_minus_inf():
    q, k, v = _inputs(n_q=6, n_kv=3)
    out, lse = ref.attention(q, k, v, causal=True, return_lse=True)
    assert np.all(out[:, :, :3] == 0) and np.all(np.isneginf(lse[:, :, :3]))
    assert np.all(np.isfinite(lse[:, :, 3:]))


def test_one_partition_round_trips():
    q, k, v = _inputs()
    out, lse = ref.attention(q, k, v, return_lse=True)
    out1, lse1 = ref.partitioned_attention(q, k, v, 1, return_lse=True)
    np.testing.assert_array_equal(out, out1)
    np.testing.assert_array_equal(lse, lse1)


@pytest.mark.parametrize("parts", [2, 3, 7, 32, 100])
@pytest.mark.parametrize("causal", [False, True])
def test_partitions_equal_dense(parts, causal):
    """32 and 100 partitions over 23 keys: more partitions than keys, so some are empty."""
    q, k, v = _inputs(seed=parts)
    out, lse = ref.attention(q, k, v, causal=causal, return_lse=True)
    outp, lsep = ref.partitioned_attention(q, k, v, parts, causal=causal, return_lse=True)
    np.testing.assert_allclose(outp, out, rtol=0, atol=1e-12)
    np.testing.assert_allclose(lsep, lse, rtol=0, atol=1e-12)


def _chunk_states(q, k, v, bounds):
    return [ref.attend_partial(q, k[:, :, lo:hi], v[:, :, lo:hi]) for lo, hi in zip(bounds[:-1], bounds[1:])]


def test_merge_order_does_not_matter():
    q, k, v = _inputs(seed=3)
    states = _chunk_states(q, k, v, [0, 4, 4, 11, 17, 23])  # includes one empty chunk
    expect, _ = ref.finalize(ref.merge_partials(states))
    rng = np.random.default_rng(0)
    for order in (states[::-1], [states[i] for i in rng.permutation(len(states))]):
        got, _ = ref.finalize(ref.merge_partials(order))
        np.testing.assert_allclose(got, expect, rtol=0, atol=1e-12)


def test_merging_merges_is_attending_the_union():
    q, k, v = _inputs(seed=4)
    s = _chunk_states(q, k, v, [0, 3, 9, 10, 16, 23])
    tree = ref.merge(ref.merge(s[0], ref.merge(s[1], s[2])), ref.merge(s[3], s[4]))
    union = ref.attend_partial(q, k, v)
    for a, b in zip(tree, union):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)


def test_empty_state_is_the_identity_and_never_nan():
    q, k, v = _inputs(seed=5)
    st = ref.attend_partial(q, k, v)
    e = ref.empty_state(*q.shape[:3], v.shape[3])
    for merged in (ref.merge(st, e), ref.merge(e, st)):
        for a, b in zip(merged, st):
            np.testing.assert_array_equal(a, b)
    both = ref.merge(e, e)
    assert np.all(np.isneginf(both.m)) and np.all(both.l == 0) and not np.isnan(both.acc).any()


def test_huge_logit_in_one_partition_is_exact_and_finite():
    q, k, v = _inputs(seed=6, b=1, h_q=1, h_kv=1, n_q=3, n_kv=40)
    # one key aligned with the query gives a logit of about 200; the rest stay O(1)
    k[0, 0, 17] = q[0, 0, 0] / np.linalg.norm(q[0, 0, 0]) * 200 * np.sqrt(16) / np.linalg.norm(q[0, 0, 0])
    s = (q[0, 0, 0] @ k[0, 0, 17]) / np.sqrt(16)
    assert 150 < s < 250
    out, lse = ref.partitioned_attention(q, k, v, 5, return_lse=True)
    dense, dlse = ref.attention(q, k, v, return_lse=True)
    assert np.all(np.isfinite(out)) and np.all(np.isfinite(lse))
    np.testing.assert_allclose(out, dense, rtol=0, atol=1e-12)
    np.testing.assert_allclose(lse, dlse, rtol=1e-14)


def test_decode_reference_paged_equals_contiguous():
    rng = np.random.default_rng(7)
    b, h_q, h_kv, d, bs = 3, 4, 2, 16, 4
    lens = np.array([1, 9, 12], dtype=np.int32)
    kc = rng.standard_normal((b, h_kv, 12, d))
    vc = rng.standard_normal((b, h_kv, 12, d))
    q = rng.standard_normal((b, h_q, d))
    perm = rng.permutation(b * 3)
    kp = np.zeros((b * 3, bs, h_kv, d))
    vp = np.zeros((b * 3, bs, h_kv, d))
    table = perm.reshape(b, 3).astype(np.int32)
    for i in range(b):
        for j in range(3):
            kp[table[i, j]] = kc[i, :, j * bs:(j + 1) * bs].transpose(1, 0, 2)
            vp[table[i, j]] = vc[i, :, j * bs:(j + 1) * bs].transpose(1, 0, 2)
    a = ref.decode_attention(q, kc, vc, context_lens=lens)
    p = ref.decode_attention(q, kp, vp, block_table=table, context_lens=lens)
    np.testing.assert_allclose(a, p, rtol=1e-13, atol=1e-13)


def test_decode_attention_reads_torch_bfloat16():
    """q, K and V as torch bfloat16 tensors (what the OpenCL and Triton calls take) read as their values."""
    torch = pytest.importorskip("torch")
    q, k, v = (torch.randn(shape).to(torch.bfloat16) for shape in ((2, 4, 16), (2, 2, 9, 16), (2, 2, 9, 16)))
    got = ref.decode_attention(q, k, v, context_lens=np.array([9, 4]))
    want = ref.decode_attention(*(x.double().numpy() for x in (q, k, v)), context_lens=np.array([9, 4]))
    np.testing.assert_array_equal(got, want)
