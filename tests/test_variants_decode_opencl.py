"""Attention variants in the OpenCL decode kernels (decode.cl, and decode_mma.cl through its
emulated PTX) against the float64 oracle, on every OpenCL device present (conftest.py).

The query of sequence b sits at position ctx[b] - 1: a window (left, right) shows it the keys
[ctx - 1 - left, ctx); softcap and ALiBi change each score; a sink joins the normalizer once, in
the single pass or in one split of split-k. Outputs are NaN-poisoned before each run, and the keys
a row cannot see are NaN/inf in K and V, so a key read or an element left unwritten fails. Each
flag set is one program build, so the tests vary what is a run-time argument (windows, split
counts, context lengths, block tables) within a few builds.
"""

from __future__ import annotations

import numpy as np
import pytest

import flashcl
from flashcl import reference
from flashcl.opencl import decode as cl_decode
from flashcl.opencl.decode import DecodeKernel, DecodeProblem, DecodeVariants, choose_params
from flashcl.opencl.runtime import get_device
from flashcl.variants import Variants

from ._check import assert_close
from .test_decode_opencl import LAYOUTS, params_for

cla = pytest.importorskip("pyopencl.array")

ALL = ("window", "softcap", "sinks", "alibi")


# --------------------------------------------------------------------------- helpers

def _variants(rng, names, b, h_q, window=(37, 0)) -> dict:
    """Oracle keywords of the variants ``names``; per-batch ALiBi slopes, sinks of both signs."""
    kw = {}
    if "window" in names:
        kw["window"] = window
    if "softcap" in names:
        kw["softcap"] = 2.5          # below the logits' spread: the cap is active
    if "sinks" in names:
        kw["sinks"] = (rng.standard_normal(h_q) * 2).astype(np.float32)
    if "alibi" in names:
        kw["alibi_slopes"] = (rng.random((b, h_q)) * 0.2).astype(np.float32)
    return kw


def _paged(rng, b, h_q, h_kv, dk, dv, lens, block_size, dtype, logit_scale=2.0):
    """q and a paged cache in permuted blocks; table entries past each sequence's end are bad ids."""
    max_blocks = max(1, max(-(-n // block_size) for n in lens))
    num_blocks = b * max_blocks + 2
    q = (rng.standard_normal((b, h_q, dk)) * logit_scale).astype(dtype)
    k = rng.standard_normal((num_blocks, block_size, h_kv, dk)).astype(dtype)
    v = rng.standard_normal((num_blocks, block_size, h_kv, dv)).astype(dtype)
    table = rng.permutation(num_blocks)[: b * max_blocks].reshape(b, max_blocks).astype(np.int32)
    lens = np.asarray(lens, dtype=np.int32)
    for i, n in enumerate(lens):
        table[i, -(-n // block_size):] = -7
    return q, k, v, table, lens


def _poison_outside_window(k, v, table, lens, left, block_size=None):
    """NaN in K and inf in V at every key left of each sequence's window (never to be read)."""
    k, v = k.copy(), v.copy()
    for i, n in enumerate(lens):
        for j in range(max(0, int(n) - 1 - left)):
            if table is None:
                k[i, :, j], v[i, :, j] = np.nan, np.inf
            else:
                blk, slot = table[i, j // block_size], j % block_size
                k[blk, slot], v[blk, slot] = np.nan, np.inf
    return k, v


def run_variants(device, q, k, v, table, lens, num_splits, kw, *, params=None, tensor_cores=None, layout=None,
                 key_start=None, query_rows=1, row_mask=None):
    """The decode kernels with the variants ``kw`` (oracle keywords) on NaN-poisoned out/lse;
    ``layout``: that layout's untuned parameters where ``params`` is None; ``key_start``: each
    sequence's first key (DecodeVariants.key_start); ``query_rows``, ``row_mask``: DecodeVariants'."""
    h = get_device(device)
    b, h_q, dk = q.shape
    paged = table is not None
    h_kv, dv = (k.shape[2], v.shape[3]) if paged else (k.shape[1], v.shape[3])
    prob = DecodeProblem(b, h_q, h_kv, dk, dv, paged, q.dtype.name)
    var = DecodeVariants.of(Variants(**kw) if kw else None, prob, key_start, query_rows, row_mask)
    choice = choose_params(h, prob, params_for(h, prob, params, layout))
    kern = DecodeKernel(h, prob, choice.params, tensor_cores=tensor_cores,
                        variant_flags=var.flags() if var else None)
    qd, kd, vd, lens_d = (cla.to_device(h.queue, x) for x in (q, k, v, lens))
    table_d = cla.to_device(h.queue, table) if paged else lens_d
    out = cla.to_device(h.queue, np.full((b, h_q, dv), np.nan, dtype=q.dtype))
    lse = cla.to_device(h.queue, np.full((b, h_q), np.nan, dtype=np.float32))
    for ev in kern(qd, kd, vd, out, lse, table_d, lens_d, dk ** -0.5, num_splits, variants=var):
        ev.wait()
    return out.get(), lse.get()


def check(got, q, k, v, table, lens, kw, what):
    out, lse = got
    ref_out, ref_lse = reference.decode_attention(q, k, v, block_table=table, context_lens=lens,
                                                  return_lse=True, **kw)
    dtype = q.dtype.name
    assert_close(out, ref_out, dtype, f"{what}: out")
    finite = np.isfinite(ref_lse)
    assert np.array_equal(finite, np.isfinite(lse)), f"{what}: lse finite at {np.isfinite(lse)}, expected {finite}"
    assert np.array_equal(lse[~finite], ref_lse[~finite]), f"{what}: lse {lse[~finite]} vs {ref_lse[~finite]}"
    if finite.any():
        assert_close(lse[finite], ref_lse[finite], dtype, f"{what}: lse")


# --------------------------------------------------------------------------- each variant, combined

@pytest.mark.parametrize("names", [("window",), ("softcap",), ("sinks",), ("alibi",), ALL],
                         ids=lambda n: "+".join(n))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_variant_and_all(cl_device, names, layout):
    """GQA 4:1, paged block 16, contexts of 1, a partial block and several tiles, left of the
    window poisoned; single pass, split-k, more splits than keys."""
    rng = np.random.default_rng(1)
    b, h_q, h_kv, d, bs = 3, 8, 2, 64, 16
    lens = [1, 45, 200]
    q, k, v, table, lens = _paged(rng, b, h_q, h_kv, d, d, lens, bs, np.float32)
    kw = _variants(rng, names, b, h_q)
    if "window" in names:
        k, v = _poison_outside_window(k, v, table, lens, kw["window"][0], bs)
    for splits in (1, 3, 64):
        got = run_variants(cl_device, q, k, v, table, lens, splits, kw, layout=layout)
        check(got, q, k, v, table, lens, kw, f"{names} splits={splits}")


@pytest.mark.parametrize("d,heads", [(128, (16, 4)), (64, (8, 1))])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_softcap_range_fp32(cl_device, d, heads, layout):
    """The softcap's hardware exp2 / reciprocal keep fp32's tolerance from a cap far below the
    logits (every score near +-cap) to one far above them (the cap inactive); on NVIDIA the fp32
    build spreads a row's caps over its lanes (d = 128: a 32-lane row, 64: two rows a warp)."""
    rng = np.random.default_rng(21)
    h_q, h_kv = heads
    q, k, v, table, lens = _paged(rng, 2, h_q, h_kv, d, d, [333, 70], 16, np.float32, logit_scale=4.0)
    for cap in (0.05, 1.0, 30.0, 1e4):
        for splits in (1, 4):
            got = run_variants(cl_device, q, k, v, table, lens, splits, {"softcap": cap}, layout=layout)
            check(got, q, k, v, table, lens, {"softcap": cap}, f"softcap {cap} splits={splits}")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_all_variants_fp16_d128(cl_device, layout):
    """Every variant on the path the device picks for an fp16 cache at d = 128 (decode_mma.cl on
    NVIDIA tensor cores, elsewhere the layout's file), GQA 8:1, paged block 16, several split counts."""
    rng = np.random.default_rng(9)
    b, h_q, h_kv, d = 2, 16, 2, 128
    q, k, v, table, lens = _paged(rng, b, h_q, h_kv, d, d, [300, 81], 16, np.float16)
    kw = _variants(rng, ALL, b, h_q, window=(100, 0))
    k, v = _poison_outside_window(k, v, table, lens, 100, 16)
    for splits in (1, 2, 9):
        got = run_variants(cl_device, q, k, v, table, lens, splits, kw, layout=layout)
        check(got, q, k, v, table, lens, kw, f"fp16 d=128 splits={splits}")


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_window_edges(cl_device, dtype, layout):
    """Windows at and around the tile edges, wider than the context, right side > 0 (nothing for
    decode); a contiguous cache poisoned left of each window. One build: left is an argument."""
    rng = np.random.default_rng(2)
    b, h_q, h_kv, d, n_max = 2, 4, 1, 64, 150
    h = get_device(cl_device)
    prob = DecodeProblem(b, h_q, h_kv, d, d, False, dtype)
    params = cl_decode.layout_params(h, prob, layout)
    tile = params["BLOCK_N"] if cl_decode.is_rows(params) else params["ROWS"] * params["UNROLL"]
    lens = np.array([150, 2 * tile + 3], dtype=np.int32)
    q = (rng.standard_normal((b, h_q, d)) * 2).astype(dtype)
    k0 = rng.standard_normal((b, h_kv, n_max, d)).astype(dtype)
    v0 = rng.standard_normal((b, h_kv, n_max, d)).astype(dtype)
    for left in (0, 1, tile - 1, tile, tile + 1, 2 * tile + 2, 1000):
        for right in (0, 5):
            k, v = _poison_outside_window(k0, v0, None, lens, left)
            kw = {"window": (left, right)}
            for splits in (1, 4):
                got = run_variants(cl_device, q, k, v, None, lens, splits, kw, layout=layout)
                check(got, q, k, v, None, lens, kw, f"window {(left, right)} splits={splits}")


@pytest.mark.parametrize("block_size", [1, 16])
def test_staged_head_tiles_fp16(cl_device, block_size):
    """Every variant with the K/V tile staged in local memory for two head tiles (HEAD_TILE < G),
    DK != DV, fp16, MQA (one KV head for 8 query heads)."""
    rng = np.random.default_rng(3)
    b, h_q, h_kv, dk, dv = 2, 8, 1, 64, 32
    q, k, v, table, lens = _paged(rng, b, h_q, h_kv, dk, dv, [70, 33], block_size, np.float16)
    kw = _variants(rng, ALL, b, h_q, window=(20, 0))
    k, v = _poison_outside_window(k, v, table, lens, 20, block_size)
    params = {"ROWS": 4, "UNROLL": 2, "HEAD_TILE": 4, "MERGE_WG": 64}
    for splits in (1, 5):
        got = run_variants(cl_device, q, k, v, table, lens, splits, kw, params=params)
        check(got, q, k, v, table, lens, kw, f"staged bs={block_size} splits={splits}")


def test_tensor_core_kernel_emulated(cl_device):
    """decode_mma.cl (its warp instructions emulated) with every variant: G = 4 (padding
    heads in the MMAs' n-tile), single pass and split-k."""
    rng = np.random.default_rng(4)
    b, h_q, h_kv, d = 2, 8, 2, 64
    q, k, v, table, lens = _paged(rng, b, h_q, h_kv, d, d, [150, 40], 16, np.float16)
    kw = _variants(rng, ALL, b, h_q, window=(70, 0))
    k, v = _poison_outside_window(k, v, table, lens, 70, 16)
    for splits in (1, 3):
        got = run_variants(cl_device, q, k, v, table, lens, splits, kw, tensor_cores="emulate")
        check(got, q, k, v, table, lens, kw, f"decode_mma.cl emulated splits={splits}")


# --------------------------------------------------------------------------- sinks, empty rows

@pytest.mark.parametrize("layout", LAYOUTS)
def test_sinks_split_k_and_empty_sequences(cl_device, layout):
    """A sink counts once however many splits (and empty splits) there are; a sequence of 0 keys
    returns zeros with lse = the sink; huge sinks dominate the normalizer."""
    rng = np.random.default_rng(5)
    b, h_q, h_kv, d = 3, 4, 2, 32
    q, k, v, table, lens = _paged(rng, b, h_q, h_kv, d, d, [0, 5, 90], 16, np.float32)
    sinks = np.array([-3.0, 0.5, 30.0, -np.inf], dtype=np.float32)
    kw = {"sinks": sinks}
    for splits in (1, 2, 7, 128):
        out, lse = run_variants(cl_device, q, k, v, table, lens, splits, kw, layout=layout)
        check((out, lse), q, k, v, table, lens, kw, f"sinks splits={splits}")
        assert np.all(out[0] == 0), out[0]
        np.testing.assert_allclose(lse[0], sinks, rtol=1e-6)  # through log2 units and back


@pytest.mark.parametrize("layout", LAYOUTS)
def test_alibi_slopes_per_batch_row(cl_device, layout):
    """Per-batch slopes: swapping two sequences' slopes changes exactly their outputs."""
    rng = np.random.default_rng(6)
    b, h_q, h_kv, d = 2, 4, 4, 32
    q, k, v, table, lens = _paged(rng, b, h_q, h_kv, d, d, [60, 60], 8, np.float32)
    slopes = np.array([[0.0, 0.05, 0.3, 1.0], [0.7, 0.0, 0.01, 0.2]], dtype=np.float32)
    for s in (slopes, slopes[::-1].copy()):
        kw = {"alibi_slopes": s}
        for splits in (1, 4):
            got = run_variants(cl_device, q, k, v, table, lens, splits, kw, layout=layout)
            check(got, q, k, v, table, lens, kw, f"alibi {s.tolist()} splits={splits}")


# --------------------------------------------------------------------------- host side

def test_public_api_and_window_splits(cl_device, monkeypatch):
    """flashcl.decode takes the variants; the automatic split count is chosen from the windowed
    length, and a window that hides nothing (left -1) runs the plain kernels."""
    rng = np.random.default_rng(7)
    b, h_q, h_kv, d, n = 1, 4, 1, 32, 4096
    q = rng.standard_normal((b, h_q, d)).astype(np.float32)
    k = rng.standard_normal((b, h_kv, n, d)).astype(np.float32)
    v = rng.standard_normal((b, h_kv, n, d)).astype(np.float32)
    seen = []
    call = DecodeKernel.__call__

    def spy(self, *a, variants=None, **kw_):
        seen.append((a[8], dict(self.variant_flags)))
        return call(self, *a, variants=variants, **kw_)

    monkeypatch.setattr(DecodeKernel, "__call__", spy)
    kw = {"window": (63, 0), "softcap": 3.0, "sinks": rng.standard_normal(h_q).astype(np.float32),
          "alibi_slopes": rng.random(h_q).astype(np.float32) * 0.1}
    out, lse = flashcl.decode(q, k, v, device=cl_device, return_lse=True, **kw)
    ref_out, ref_lse = reference.decode_attention(q, k, v, return_lse=True, **kw)
    assert_close(out, ref_out, "float32", "api out")
    assert_close(lse, ref_lse, "float32", "api lse")
    h = get_device(cl_device)
    prob = DecodeProblem(b, h_q, h_kv, d, d, False, "float32")
    kern = DecodeKernel(h, prob, choose_params(h, prob).params)
    assert seen[-1] == (kern.auto_splits(64), {"WINDOW": 1, "SOFTCAP": 1, "SINKS": 1, "ALIBI": 1})
    assert kern.auto_splits(64) < kern.auto_splits(n) or kern.auto_splits(n) == 1

    flashcl.decode(q, k, v, device=cl_device, window=(-1, 8))
    assert seen[-1][1] == {}, "a window that hides no key must run the plain kernels"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_plain_path_and_errors(cl_device, layout):
    """No variant: the defines and argument list are the plain kernels'; a kernel built for one
    flag set refuses calls with another; decode refuses a mask."""
    h = get_device(cl_device)
    prob = DecodeProblem(1, 2, 1, 32, 32, False, "float32")
    params = cl_decode.layout_params(h, prob, layout)
    defines = cl_decode.rows_defines if layout == "rows" else cl_decode.program_defines
    plain = defines(prob, params)
    assert not {"WINDOW", "SOFTCAP", "SINKS", "ALIBI"} & set(plain)
    assert DecodeVariants.of(Variants(window=(-1, 3)), prob) is None
    with pytest.raises(ValueError, match="mask"):
        DecodeVariants.of(Variants(mask=np.ones((1, 1, 1, 4), dtype=bool)), prob)

    rng = np.random.default_rng(8)
    q = rng.standard_normal((1, 2, 32)).astype(np.float32)
    k = rng.standard_normal((1, 1, 40, 32)).astype(np.float32)
    lens = np.array([40], dtype=np.int32)
    with pytest.raises(ValueError, match="built for"):
        kern = DecodeKernel(h, prob, params, variant_flags={"SOFTCAP": 1})
        qd, kd, ld = (cla.to_device(h.queue, x) for x in (q, k, lens))
        out = cla.empty(h.queue, (1, 2, 32), np.float32)
        lse = cla.empty(h.queue, (1, 2), np.float32)
        kern(qd, kd, kd, out, lse, ld, ld, 1.0, 1)
    got = run_variants(cl_device, q, k, k, None, lens, 2, {}, layout=layout)
    check(got, q, k, k, None, lens, {}, "plain")


# --------------------------------------------------------------------------- key_start

def check_key_start(got, q, k, v, lens, starts, kw, what):
    """Each sequence against the oracle's decode of its keys [start, ctx) alone: a key's distance
    to the query, and so ALiBi and a window, are the same there."""
    out, lse = got
    for i, (n, s) in enumerate(zip(lens, starts)):
        s = min(int(s), int(n))
        sub = {**kw, **({"alibi_slopes": kw["alibi_slopes"][i:i + 1]} if "alibi_slopes" in kw else {})}
        one = (out[i:i + 1], lse[i:i + 1])
        check(one, q[i:i + 1], k[i:i + 1, :, s:n], v[i:i + 1, :, s:n], None, np.array([n - s], np.int32), sub,
              f"{what} b={i}")


def _key_start_case(rng, dtype=np.float32):
    """Contiguous GQA 4 cache, NaN/inf in every key before each sequence's start: starts 0, inside,
    at a tile edge, at the context's end (no key) and past it."""
    b, h_q, h_kv, d, n_max = 5, 8, 2, 32, 40
    q, k, v = (x.astype(dtype) for x in (rng.standard_normal((b, h_q, d)) * 2,
                                           rng.standard_normal((b, h_kv, n_max, d)),
                                           rng.standard_normal((b, h_kv, n_max, d))))
    lens = np.array([40, 33, 40, 17, 9], np.int32)
    starts = np.array([0, 13, 16, 17, 30], np.int32)
    for i, s in enumerate(starts):
        k[i, :, :s], v[i, :, :s] = np.nan, np.inf
    return q, k, v, lens, starts


@pytest.mark.parametrize("names", [(), ALL], ids=["plain", "all"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_key_start_hides_each_sequences_first_keys(cl_device, names, layout):
    """DecodeVariants.key_start (a left-padded row of prefill run as a decode): no key before a
    sequence's start is read, alone and with every variant, single pass and split-k."""
    rng = np.random.default_rng(31)
    q, k, v, lens, starts = _key_start_case(rng)
    kw = _variants(rng, names, 5, 8, window=(20, 0))
    for splits in (1, 3, 64):
        got = run_variants(cl_device, q, k, v, None, lens, splits, kw, layout=layout, key_start=starts)
        check_key_start(got, q, k, v, lens, starts, kw, f"{names} splits={splits}")


def check_query_rows(got, q4, k, v, kw, what):
    """QUERY_ROWS against the oracle's causal prefill of q4 (B, H_q, N_q, D), whose rows the kernel
    ran as heads (B, H_q N_q, D); the sinks were repeated per row."""
    out, lse = got
    ref_out, ref_lse = reference.attention(q4, k, v, causal=True, return_lse=True, **kw)
    assert_close(out.reshape(ref_out.shape), ref_out, q4.dtype.name, f"{what}: out")
    seen = np.isfinite(ref_lse)
    lse = lse.reshape(ref_lse.shape)
    assert np.array_equal(np.isfinite(lse), seen), what
    assert_close(lse[seen], ref_lse[seen], q4.dtype.name, f"{what}: lse")


def _query_rows_case(rng, n_q=3, n_kv=21, dtype=np.float32, d=32):
    """GQA 2 with 3 causal rows over a contiguous cache of two sequences, softcap and sinks."""
    b, h_q, h_kv = 2, 4, 2
    q4 = (rng.standard_normal((b, h_q, n_q, d)) * 2).astype(dtype)
    k, v = (rng.standard_normal((b, h_kv, n_kv, d)).astype(dtype) for _ in range(2))
    kw = {"softcap": 4.0, "sinks": rng.standard_normal(h_q).astype(np.float32)}
    rows_kw = {**kw, "sinks": np.repeat(kw["sinks"], n_q)}
    return q4, k, v, np.full(b, n_kv, np.int32), kw, rows_kw


# Every decode kernel takes QUERY_ROWS: decode_cpu.cl at 4-key tiles, decode.cl at small tiles
# (several row slots and head tiles: the scores through local memory), decode.cl with the
# defaults, and decode_mma.cl (fp16 and DV 64: its warp instructions emulated); the tiles, the MMA
# emulation, the dtype and the head dim
QUERY_ROWS_KERNELS = {"rows": ({"VARIANT": "rows", "BLOCK_N": 4, "VEC": 8, "MERGE_WG": 16}, None, np.float32, 32),
                      "lanes": ({"ROWS": 2, "UNROLL": 2, "HEAD_TILE": 2, "MERGE_WG": 16}, None, np.float32, 32),
                      "lanes-default": (None, None, np.float32, 32),
                      "mma": (None, "emulate", np.float16, 64)}


def _run_rows(device, kernel, q3, k, v, lens, splits, kw, n_q, row_mask=None):
    params, tensor_cores = QUERY_ROWS_KERNELS[kernel][:2]
    return run_variants(device, q3, k, v, None, lens, splits, kw, params=params, tensor_cores=tensor_cores,
                        layout="lanes" if params is None and tensor_cores is None else None, query_rows=n_q,
                        row_mask=row_mask)


@pytest.mark.parametrize("kernel", list(QUERY_ROWS_KERNELS))
def test_query_rows_are_causal_rows(cl_device, kernel):
    """DecodeVariants.query_rows (prefill's few-row route): head h is causal row h % N_q at the
    sequence's end, single pass and split-k (splits that only some rows see); contexts longer,
    equal to and shorter than N_q (rows that see no key)."""
    rng = np.random.default_rng(35)
    dtype, d = QUERY_ROWS_KERNELS[kernel][2:]
    for n_q, n_kv in ((3, 21), (5, 5), (6, 4)):
        q4, k, v, lens, kw, rows_kw = _query_rows_case(rng, n_q, n_kv, dtype, d)
        q3 = np.ascontiguousarray(q4.reshape(q4.shape[0], -1, q4.shape[3]))
        for splits in (1, 3, 16):
            got = _run_rows(cl_device, kernel, q3, k, v, lens, splits, rows_kw, n_q)
            check_query_rows(got, q4, k, v, kw, f"{kernel} n_q={n_q} n_kv={n_kv} splits={splits}")
    # the last key, which only the last row sees, holds inf and NaN: no other row reads it
    kp, vp = k.copy(), v.copy()
    kp[:, :, -1], vp[:, :, -1] = np.nan, np.inf
    out, _ = _run_rows(cl_device, kernel, q3, kp, vp, lens, 3, rows_kw, q4.shape[2])
    ref = reference.attention(q4, k, v, causal=True, **kw)
    assert_close(out.reshape(ref.shape)[:, :, :-1], ref[:, :, :-1], dtype.__name__, f"{kernel}: hidden inf/NaN")
    assert not np.isfinite(out.reshape(ref.shape)[:, :, -1]).any(), f"{kernel}: the last row sees the inf"


@pytest.mark.parametrize("kernel", list(QUERY_ROWS_KERNELS))
def test_query_rows_with_a_window_and_alibi(cl_device, kernel):
    """QUERY_ROWS with a window and ALiBi: each row's window and distances from its own position,
    windows of 0, 1, around a 4-key tile and past the context, contexts shorter than N_q, split-k
    and splits that only some rows see; keys left of the first row's window hold NaN / inf, and
    the one key only the first row sees holds them for the other rows."""
    rng = np.random.default_rng(36)
    dtype, d = QUERY_ROWS_KERNELS[kernel][2:]
    for n_q, n_kv in ((3, 21), (5, 5), (6, 4), (16, 40)):
        q4, k, v, lens, kw, rows_kw = _query_rows_case(rng, n_q, n_kv, dtype, d)
        q3 = np.ascontiguousarray(q4.reshape(q4.shape[0], -1, q4.shape[3]))
        slopes = rng.uniform(0.05, 0.5, (q4.shape[0], q4.shape[1])).astype(np.float32)
        for left in (0, 1, 3, 4, 5, 9, 100):
            first = max(0, n_kv - n_q - left)  # the first row's first key
            kp, vp = k.copy(), v.copy()
            kp[:, :, :first], vp[:, :, :first] = np.nan, np.inf
            for extra in ({"window": (left, 0)}, {"window": (left, 0), "alibi_slopes": slopes}):
                ref_kw = {**kw, **extra}
                var_kw = {**rows_kw, **extra}
                if "alibi_slopes" in extra:
                    var_kw["alibi_slopes"] = np.repeat(slopes, n_q, axis=-1)
                for splits in (1, 3, 16):
                    got = _run_rows(cl_device, kernel, q3, kp, vp, lens, splits, var_kw, n_q)
                    check_query_rows(got, q4, k, v, ref_kw, f"{kernel} n_q={n_q} n_kv={n_kv} left={left} "
                                                            f"{sorted(extra)} splits={splits}")
    # the key only row 0 sees (its window's first) holds NaN / inf: every other row is untouched
    n_q, n_kv, left = 4, 30, 6
    q4, k, v, lens, kw, rows_kw = _query_rows_case(rng, n_q, n_kv, dtype, d)
    q3 = np.ascontiguousarray(q4.reshape(q4.shape[0], -1, q4.shape[3]))
    kp, vp = k.copy(), v.copy()
    kp[:, :, n_kv - n_q - left], vp[:, :, n_kv - n_q - left] = np.nan, np.inf
    for splits in (1, 3):
        out, _ = _run_rows(cl_device, kernel, q3, kp, vp, lens, splits, {**rows_kw, "window": (left, 0)}, n_q)
        ref = reference.attention(q4, k, v, causal=True, window=(left, 0), **kw)
        assert_close(out.reshape(ref.shape)[:, :, 1:], ref[:, :, 1:], dtype.__name__, f"{kernel}: row 0's key, "
                                                                                      f"{splits} splits")


@pytest.mark.parametrize("kernel", list(QUERY_ROWS_KERNELS))
def test_query_rows_with_a_mask(cl_device, kernel):
    """ROW_MASK (prefill's mask read per row): a bool mask per sequence with holes and a row that
    sees nothing, and an additive one per head (biases, -inf holes) with a window; split-k; K/V
    of NaN / inf at the keys a sequence's mask hides from every row never reach any."""
    rng = np.random.default_rng(37)
    dtype, d = QUERY_ROWS_KERNELS[kernel][2:]
    for n_q, n_kv in ((3, 21), (6, 40)):
        q4, k, v, lens, kw, rows_kw = _query_rows_case(rng, n_q, n_kv, dtype, d)
        b, h_q = q4.shape[:2]
        q3 = np.ascontiguousarray(q4.reshape(b, -1, d))
        holes = rng.random((b, 1, n_q, n_kv)) > 0.3
        holes[:, :, 0] = False
        holes[1, :, :, 5:9] = False  # hidden from every row of sequence 1
        kp, vp = k.copy(), v.copy()
        kp[1, :, 5:9], vp[1, :, 5:9] = np.nan, np.inf
        bias = np.where(rng.random((b, h_q, n_q, n_kv)) > 0.25, rng.standard_normal((b, h_q, n_q, n_kv)),
                        -np.inf).astype(np.float32)
        for mask, extra in ((holes, {}), (bias, {"window": (4, 0)})):
            for splits in (1, 3, 16):
                got = _run_rows(cl_device, kernel, q3, kp if mask is holes else k, vp if mask is holes else v,
                                lens, splits, {**rows_kw, **extra}, n_q, row_mask=mask)
                check_query_rows(got, q4, k, v, {**kw, **extra, "mask": mask},
                                 f"{kernel} n_q={n_q} {mask.dtype} splits={splits}")


# --------------------------------------------------------------------------- Oclgrind

# Every variant at once, GQA 4, paged blocks of 4, contexts of 1 key, a partial tile and several:
# decode.cl at small tiles, decode_cpu.cl at 4-key tiles (the whole-tile vector softcap and exp2
# and the partial last tile), single pass and split-k with its sink on split 0.
OCLGRIND_PARAMS = {"lanes": {"ROWS": 2, "UNROLL": 2, "HEAD_TILE": 2, "MERGE_WG": 16},
                   "rows": {"VARIANT": "rows", "BLOCK_N": 4, "VEC": 8, "MERGE_WG": 16}}


def _oclgrind_worker(layout: str) -> None:
    """One case on the Oclgrind device (in a subprocess started by test_under_oclgrind)."""
    import pyopencl.characterize

    from tests.test_oclgrind import keep_decode_workspaces

    pyopencl.characterize.nv_compute_capability = lambda dev: None  # see tests/test_oclgrind.py
    keep_decode_workspaces()  # two split-k cases in one process
    rng = np.random.default_rng(12)
    q, k, v, table, lens = _paged(rng, 3, 8, 2, 32, 32, [1, 7, 30], 4, np.float32)
    kw = _variants(rng, ALL, 3, 8, window=(9, 0))
    for splits in (1, 3):
        got = run_variants("oclgrind", q, k, v, table, lens, splits, kw, params=OCLGRIND_PARAMS[layout])
        check(got, q, k, v, table, lens, kw, f"oclgrind {layout} splits={splits}")
    q, k, v, lens, starts = _key_start_case(rng)
    kw = _variants(rng, ALL, 5, 8, window=(20, 0))
    for splits in (1, 3):
        got = run_variants("oclgrind", q, k, v, None, lens, splits, kw, params=OCLGRIND_PARAMS[layout],
                           key_start=starts)
        check_key_start(got, q, k, v, lens, starts, kw, f"oclgrind {layout} key_start splits={splits}")
    q4, k, v, lens, kw, rows_kw = _query_rows_case(rng)
    q3 = np.ascontiguousarray(q4.reshape(q4.shape[0], -1, q4.shape[3]))
    slopes = rng.uniform(0.05, 0.5, q4.shape[:2]).astype(np.float32)
    extra = {"window": (5, 0), "alibi_slopes": slopes}
    rows_extra = {**extra, "alibi_slopes": np.repeat(slopes, q4.shape[2], axis=-1)}
    for splits in (1, 3):
        got = run_variants("oclgrind", q3, k, v, None, lens, splits, rows_kw, params=OCLGRIND_PARAMS[layout],
                           query_rows=q4.shape[2])
        check_query_rows(got, q4, k, v, kw, f"oclgrind query_rows splits={splits}")
        got = run_variants("oclgrind", q3, k, v, None, lens, splits, {**rows_kw, **rows_extra},
                           params=OCLGRIND_PARAMS[layout], query_rows=q4.shape[2])
        check_query_rows(got, q4, k, v, {**kw, **extra}, f"oclgrind query_rows window alibi splits={splits}")
        holes = rng.random((q4.shape[0], 1, q4.shape[2], k.shape[2])) > 0.3
        got = run_variants("oclgrind", q3, k, v, None, lens, splits, rows_kw, params=OCLGRIND_PARAMS[layout],
                           query_rows=q4.shape[2], row_mask=holes)
        check_query_rows(got, q4, k, v, {**kw, "mask": holes}, f"oclgrind query_rows mask splits={splits}")
    print("OCLGRIND-CASE-OK")


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_under_oclgrind(layout, tmp_path):
    """Races, out-of-bounds and uninitialized reads in the variants' code of both decode layouts
    (Oclgrind's checks, tests/test_oclgrind.py's settings); any report fails."""
    from tests.test_oclgrind import _oclgrind_present, run_under_oclgrind

    if not _oclgrind_present():
        pytest.skip("Oclgrind is not installed (pip install 'flashcl[oclgrind]')")
    run_under_oclgrind("tests.test_variants_decode_opencl:_oclgrind_worker", layout, f"decode variants {layout}",
                       tmp_path)


@pytest.mark.parametrize("kind", ["numpy", "torch", "cl"])
def test_decode_key_start_through_the_api(cl_device, kind):
    """flashcl.decode(key_start=) on each input kind over a paged cache, with a window: the
    oracle's keys [start, ctx) (starts below 0, inside, at and past the end), NaN and inf before
    each start never read; a key_start of zeros gives the plain call's bits."""
    rng = np.random.default_rng(33)
    starts = np.array([-2, 13, 17, 30], np.int32)
    q, k, v, table, lens = _paged(rng, 4, 8, 2, 32, 32, [40, 33, 17, 9], 8, np.float32)
    clean = (q.copy(), k.copy(), v.copy())
    for i, s in enumerate(starts):  # poison the rows of every hidden key of the context
        for t in range(min(max(int(s), 0), int(lens[i]))):
            k[table[i, t // 8], t % 8], v[table[i, t // 8], t % 8] = np.nan, np.inf
    if kind == "cl":
        queue = get_device(cl_device).queue
        conv, back = (lambda x: cla.to_device(queue, x)), (lambda x: x.get())
    elif kind == "torch":
        import torch

        conv, back = torch.from_numpy, np.asarray
    else:
        conv = back = (lambda x: x)
    args = [conv(x) for x in (q, k, v)]
    tables = {"block_table": conv(table), "context_lens": conv(lens), "device": None if kind == "cl" else cl_device}
    out, lse = flashcl.decode(*args, **tables, key_start=conv(starts), window=(20, 0), return_lse=True,
                              num_splits=3)
    check((back(out), back(lse)), *clean, table, lens, {"window": (20, 0), "key_start": starts}, kind)
    plain = flashcl.decode(*args, **tables)
    started = flashcl.decode(*args, **tables, key_start=conv(np.zeros(4, np.int32)))
    np.testing.assert_array_equal(back(plain), back(started))


def test_decode_key_start_errors(cl_device):
    """key_start is checked before launch: shape, dtype and kind."""
    import torch

    rng = np.random.default_rng(34)
    q, k, v, table, lens = _paged(rng, 2, 4, 2, 32, 32, [5, 9], 4, np.float32)
    call = lambda ks: flashcl.decode(q, k, v, block_table=table, context_lens=lens, key_start=ks,  # noqa: E731
                                     device=cl_device)
    with pytest.raises(ValueError, match="key_start: expected shape"):
        call(np.zeros(3, np.int32))
    with pytest.raises(TypeError, match="key_start: expected int32"):
        call(np.zeros(2, np.int64))
    with pytest.raises(TypeError, match="key_start must be the same kind"):
        call(torch.zeros(2, dtype=torch.int32))
