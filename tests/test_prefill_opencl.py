"""OpenCL prefill against the float64 oracle, on every OpenCL device present (see conftest.py)."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from flashcl import reference, tuning
from flashcl.opencl.prefill import PrefillKernel, PrefillProblem, choose_params
from flashcl.opencl.runtime import get_device
from flashcl.variants import DECODE_GROUP_ROWS

from ._check import assert_close, naive_attention

cla = pytest.importorskip("pyopencl.array")


def _inputs(rng, b, h_q, h_kv, n_q, n_kv, dk, dv, dtype, logit_scale=1.0):
    q = rng.standard_normal((b, h_q, n_q, dk)) * logit_scale
    k = rng.standard_normal((b, h_kv, n_kv, dk))
    v = rng.standard_normal((b, h_kv, n_kv, dv))
    return q.astype(dtype), k.astype(dtype), v.astype(dtype)


def run_poisoned(device, q, k, v, causal, params=None, scale=None):
    """Run the kernel on outputs pre-filled with NaN, so an element it forgets to write fails."""
    h = get_device(device)
    (b, h_q, n_q, dk), (_, h_kv, n_kv, _), dv = q.shape, k.shape, v.shape[3]
    prob = PrefillProblem(b, h_q, h_kv, n_q, n_kv, dk, dv, causal, q.dtype.name)
    choice = choose_params(h, prob, params)
    kern = PrefillKernel(h, prob, choice.params, write_lse=True)
    qd, kd, vd = (cla.to_device(h.queue, x) for x in (q, k, v))
    out = cla.to_device(h.queue, np.full((b, h_q, n_q, dv), np.nan, dtype=q.dtype))
    lse = cla.to_device(h.queue, np.full((b, h_q, n_q), np.nan, dtype=np.float32))
    scale = dk ** -0.5 if scale is None else scale
    kern(qd, kd, vd, out, lse, scale).wait()
    return out.get(), lse.get(), choice.params


def check(device, q, k, v, causal, params=None, what=""):
    out, lse, used = run_poisoned(device, q, k, v, causal, params)
    scale = q.shape[-1] ** -0.5
    ref_out, ref_lse = reference.attention(q, k, v, causal=causal, return_lse=True)
    dtype = q.dtype.name
    what = f"{what} params={used} causal={causal} q{q.shape} k{k.shape} v{v.shape} {dtype}"
    naive = naive_attention(q, k, v, causal, scale, q.dtype) if dtype == "float16" else None
    assert_close(out, ref_out, dtype, what, naive=naive)
    finite = np.isfinite(ref_lse)
    assert np.array_equal(np.isfinite(lse), finite), f"{what}: lse finiteness differs"
    assert np.all(np.isneginf(lse[~finite])), f"{what}: rows with no visible key need lse = -inf"
    np.testing.assert_allclose(lse[finite], ref_lse[finite], rtol=1e-5, atol=1e-5, err_msg=what)
    return out


# (B, H_q, H_kv, N_q, N_kv): N=1, tile edges (64, 65), a long odd N, chunked prefill (N_q < N_kv),
# GQA 4:1, MQA, B > 1
SHAPES = [
    (1, 2, 2, 1, 1), (1, 4, 1, 1, 100), (2, 4, 2, 7, 7), (1, 4, 1, 64, 64), (2, 2, 2, 65, 65),
    (1, 8, 2, 65, 200), (1, 4, 1, 513, 513), (1, 2, 1, 64, 1000),
]
HEAD_DIMS = [(64, 64), (80, 80), (128, 128), (192, 128), (256, 256)]


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dk,dv", HEAD_DIMS, ids=[f"{a}x{b}" for a, b in HEAD_DIMS])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"B{s[0]}H{s[1]}/{s[2]}N{s[3]}x{s[4]}" for s in SHAPES])
def test_prefill_matches_oracle(cl_device, shape, dk, dv, causal, dtype):
    b, h_q, h_kv, n_q, n_kv = shape
    if n_q * n_kv * h_q * (dk + dv) > 3e8:
        pytest.skip("kept small for CPU drivers")  # only (513, 513) x 256: covered at 128
    # a seed fixed per case: hash() of strings changes between processes (PYTHONHASHSEED)
    rng = np.random.default_rng(zlib.crc32(repr((shape, dk, dv, causal, dtype)).encode()))
    check(cl_device, *_inputs(rng, b, h_q, h_kv, n_q, n_kv, dk, dv, dtype), causal)


# Tile configurations: every DV_TILE dividing DV=128 and DV=80, BLOCK_N at and below VEC
# multiples, BLOCK_M from one work-item to several subgroups/warps (32 on NVIDIA, 64 on Adreno).
TILES = [
    dict(BLOCK_M=1, BLOCK_N=4, DV_TILE=16, VEC=4),
    dict(BLOCK_M=16, BLOCK_N=8, DV_TILE=32, VEC=8),
    dict(BLOCK_M=64, BLOCK_N=32, DV_TILE=64, VEC=4),
    dict(BLOCK_M=64, BLOCK_N=16, DV_TILE=128, VEC=16),
    dict(BLOCK_M=128, BLOCK_N=64, DV_TILE=128, VEC=4),
    dict(BLOCK_M=256, BLOCK_N=16, DV_TILE=16, VEC=16),
    dict(BLOCK_M=96, BLOCK_N=12, DV_TILE=32, VEC=4),
]
TILES_80 = [dict(BLOCK_M=32, BLOCK_N=8, DV_TILE=t, VEC=4) for t in (16, 20, 40, 80)] + [
    dict(BLOCK_M=128, BLOCK_N=16, DV_TILE=80, VEC=16)]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("params", TILES, ids=lambda p: "M{BLOCK_M}N{BLOCK_N}T{DV_TILE}V{VEC}".format(**p))
def test_tile_parameters_d128(cl_device, params, causal):
    h = get_device(cl_device)
    if params["BLOCK_M"] > h.max_work_group:
        pytest.skip(f"device max work-group {h.max_work_group}")
    if tuning.local_bytes("prefill", params, 128, 128) > h.local_mem:
        pytest.skip(f"device local memory {h.local_mem} B (test_api checks the error message)")
    rng = np.random.default_rng(1)
    for n_q, n_kv in ((1, 37), (65, 130), (130, 130)):
        check(cl_device, *_inputs(rng, 1, 4, 2, n_q, n_kv, 128, 128, "float32"), causal, params,
              what=f"N={n_q}x{n_kv}")


@pytest.mark.parametrize("params", TILES_80, ids=lambda p: "M{BLOCK_M}N{BLOCK_N}T{DV_TILE}V{VEC}".format(**p))
def test_tile_parameters_d80(cl_device, params):
    rng = np.random.default_rng(2)
    check(cl_device, *_inputs(rng, 2, 3, 1, 33, 71, 80, 80, "float16"), True, params)


# The micro-tiled layout (clkernels/prefill_tiles.cl): every micro-tile width, DV passes (DV_TILE
# < DV), DK != DV, fp16, work-groups from one warp to several, full and partial unrolls.
TILED = [
    dict(VARIANT="tiles", BLOCK_M=8, BLOCK_N=8, DV_TILE=32, TILE_M=2, TILE_N=2),
    dict(VARIANT="tiles", BLOCK_M=64, BLOCK_N=16, DV_TILE=64, TILE_M=8, TILE_N=2, UNROLL_K=4),
    dict(VARIANT="tiles", BLOCK_M=32, BLOCK_N=32, DV_TILE=32, TILE_M=4, TILE_N=4, UNROLL_K=8),
    dict(VARIANT="tiles", BLOCK_M=128, BLOCK_N=16, DV_TILE=64, TILE_M=4, TILE_N=8),
    dict(VARIANT="tiles", BLOCK_M=16, BLOCK_N=64, DV_TILE=64, TILE_M=8, TILE_N=8, UNROLL_K=2),
]
TILED_PROBLEMS = [  # (B, H_q, H_kv, N_q, N_kv, DK, DV, dtype)
    (1, 4, 1, 1, 37, 64, 64, "float32"), (2, 2, 2, 65, 65, 64, 64, "float16"),
    (1, 4, 2, 33, 100, 128, 64, "float32"), (1, 2, 1, 40, 11, 32, 32, "float32"),
]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("params", TILED, ids=lambda p: "M{BLOCK_M}N{BLOCK_N}T{DV_TILE}_{TILE_M}x{TILE_N}".format(**p))
def test_tiled_layout(cl_device, params, causal):
    h = get_device(cl_device)
    rng = np.random.default_rng(5)
    for b, h_q, h_kv, n_q, n_kv, dk, dv, dtype in TILED_PROBLEMS:
        if tuning.check_params("prefill", params, dk, dv, local_mem=h.local_mem, max_work_group=h.max_work_group):
            continue  # DV_TILE not a divisor of this DV, or over this device's limits
        check(cl_device, *_inputs(rng, b, h_q, h_kv, n_q, n_kv, dk, dv, dtype), causal, params,
              what=f"tiles N={n_q}x{n_kv}")


@pytest.mark.parametrize("section", [1, 3, 5, 16])
@pytest.mark.parametrize("variant", [None, dict(VARIANT="tiles", BLOCK_M=16, BLOCK_N=8, DV_TILE=16, TILE_M=4,
                                                TILE_N=2)], ids=["rows", "tiles"])
def test_launch_order_sections(cl_device, monkeypatch, section, variant):
    """Every (batch, head, query block, DV slice) is computed once whatever the launch-order
    section (tile_of_group): sections that do not divide B * H_q leave a short last one; 16 is
    more than the 6 pairs (one section). Causal and not, two DV passes, GQA 3:1, B = 2."""
    monkeypatch.setattr(PrefillKernel, "head_section", lambda self: section)
    params = variant or dict(BLOCK_M=16, BLOCK_N=8, DV_TILE=16, VEC=4)
    rng = np.random.default_rng(section)
    for causal in (False, True):
        check(cl_device, *_inputs(rng, 2, 3, 1, 37, 45, 32, 32, "float32"), causal, params,
              what=f"section={section}")


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_huge_logits(cl_device, dtype):
    """Logits around +-200: the online softmax must subtract the max, not overflow."""
    rng = np.random.default_rng(3)
    q, k, v = _inputs(rng, 1, 4, 1, 70, 150, 64, 64, "float64", logit_scale=45.0)
    s = np.einsum("bhqd,bkd->bhqk", q, k[:, 0]) / 8.0
    assert 150 < np.abs(s).max() < 400
    for causal in (False, True):
        check(cl_device, q.astype(dtype), k.astype(dtype), v.astype(dtype), causal)


def test_rows_that_see_no_key_are_zero(cl_device):
    """Causal with N_q > N_kv: the first N_q - N_kv rows see nothing (zeros, lse -inf, no NaN)."""
    rng = np.random.default_rng(4)
    q, k, v = _inputs(rng, 1, 2, 1, 50, 20, 32, 32, "float32")
    out = check(cl_device, q, k, v, True)
    assert np.all(out[:, :, :30] == 0)


hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies


@st.composite
def _problems(draw):
    from flashcl import tuning

    h_kv = draw(st.integers(1, 2))
    group = draw(st.sampled_from([1, 2, 4]))
    n_q = draw(st.integers(1, 80))
    n_kv = draw(st.integers(1, 100))
    dk = draw(st.sampled_from(range(8, 161, 8)))
    dv = draw(st.sampled_from(range(8, 161, 8)))
    block_n = draw(st.sampled_from([4, 8, 16, 24, 32, 64]))
    dv_tile = draw(st.sampled_from([t for t in range(4, dv + 1, 4) if dv % t == 0]))
    vec = draw(st.sampled_from([w for w in (4, 8, 16) if block_n % w == 0 and dv_tile % w == 0]))
    params = {"BLOCK_M": draw(st.sampled_from([1, 8, 32, 33, 64, 128])), "BLOCK_N": block_n,
              "DV_TILE": dv_tile, "VEC": vec}
    assert not tuning.check_params("prefill", params, dk, dv, local_mem=1 << 30, max_work_group=1 << 30)
    return (draw(st.integers(1, 2)), h_kv * group, h_kv, n_q, n_kv, dk, dv,
            draw(st.booleans()), draw(st.sampled_from(["float32", "float16"])), params,
            draw(st.integers(0, 2**31)))


@hypothesis.settings(max_examples=30, deadline=None, derandomize=True,
                     suppress_health_check=list(hypothesis.HealthCheck))
@hypothesis.given(problem=_problems())
def test_random_shapes_and_parameters(cl_device, problem):
    b, h_q, h_kv, n_q, n_kv, dk, dv, causal, dtype, params, seed = problem
    h = get_device(cl_device)
    if (params["BLOCK_M"] > h.max_work_group
            or 4 * params["BLOCK_N"] * (dk + params["DV_TILE"]) > h.local_mem):
        hypothesis.reject()
    rng = np.random.default_rng(seed)
    check(cl_device, *_inputs(rng, b, h_q, h_kv, n_q, n_kv, dk, dv, dtype), causal, params)


@pytest.mark.parametrize("n_q", [1, 2, 3, 5, 17, 33])
def test_short_queries_on_cpus_run_a_block_of_their_size(cpu_device, n_q):
    """On a CPU device a call with N_q below the block's rows runs BLOCK_M = N_q's next power of
    two (rows_for_short_queries: the work-items run one after another, so idle rows cost as much
    as real ones); those builds match the oracle on NaN-poisoned outputs, causal (N_q < N_kv)
    or not, and through flashcl.prefill with a padding mask."""
    import flashcl
    from flashcl.opencl.prefill import rows_for_short_queries

    h = get_device(cpu_device)
    rng = np.random.default_rng(n_q)
    for causal in (False, True):
        q, k, v = _inputs(rng, 2, 4, 2, n_q, 100, 64, 64, "float32")
        prob = PrefillProblem(2, 4, 2, n_q, 100, 64, 64, causal, "float32")
        params = rows_for_short_queries(h, prob, choose_params(h, prob).params)
        assert params["BLOCK_M"] == 1 << (n_q - 1).bit_length()
        check(cpu_device, q, k, v, causal, params)
    mask = np.ones((2, 1, n_q, 100), bool)
    mask[1, :, :, :37] = False  # the second sequence left-padded by 37 keys
    out = flashcl.prefill(q, k, v, mask=mask, device=cpu_device)
    assert_close(out, reference.attention(q, k, v, mask=mask), "float32", f"n_q={n_q} padding mask")
    wide = PrefillProblem(1, 4, 2, 200, 200, 64, 64, True, "float32")
    tiled = {"VARIANT": "tiles", "BLOCK_M": 64, "BLOCK_N": 32, "DV_TILE": 64, "TILE_M": 4, "TILE_N": 2}
    assert rows_for_short_queries(h, wide, choose_params(h, wide).params) == choose_params(h, wide).params
    assert rows_for_short_queries(h, prob, tiled) == tiled


def test_one_query_row_runs_as_decode_or_its_gqa_group_as_rows(cpu_device, monkeypatch):
    """On a CPU device a call with one query row runs as a decode where its mask, if any, shows
    each sequence a suffix of its keys (_prefill_rows_as_decode: no mask, causal, padding masks
    bool or additive, broadcast or not, rank 3, lse, softcap, window, sinks, ALiBi, q8_0 K/V); any
    other mask runs each GQA group's heads as the rows of its KV head (_prefill_group_as_rows)
    unless a window, sinks or ALiBi (per row position or head) keep it unpacked. All match the
    oracle, with NaN in the keys a padding mask hides."""
    import flashcl
    from flashcl.opencl import prefill as cl_prefill

    routes = []
    for name, tag in (("_prefill_group_as_rows", "packed"), ("_prefill_rows_as_decode", "decode")):
        real = getattr(cl_prefill, name)
        monkeypatch.setattr(cl_prefill, name, lambda *a, _real=real, _tag=tag, **kw: routes.append(_tag) or _real(*a, **kw))
    rng = np.random.default_rng(7)
    b, h_q, h_kv, n_kv, d = 3, 8, 2, 150, 64
    q, k, v = _inputs(rng, b, h_q, h_kv, 1, n_kv, d, d, "float32")
    padding = np.ones((b, 1, 1, n_kv), bool)
    padding[1, ..., :61] = False
    padding[2] = False  # every key hidden
    kn, vn = k.copy(), v.copy()  # for the masks that hide them
    kn[1, :, :61] = np.nan
    vn[1, :, :61] = np.nan
    per_head = (rng.random((b, h_q, 1, n_kv)) < 0.7) & padding
    biased = np.where(padding, rng.standard_normal(padding.shape), -np.inf).astype(np.float32)
    additive = np.where(padding, 0.0, -np.inf).astype(np.float32)
    sinks, slopes = rng.standard_normal(h_q).astype(np.float32), rng.random(h_q).astype(np.float32)
    cases = [(dict(mask=per_head), "packed"), (dict(mask=biased), "packed"), (dict(mask=padding), "decode"),
             (dict(mask=additive), "decode"), (dict(mask=np.broadcast_to(padding, (b, h_q, 1, n_kv))), "decode"),
             (dict(mask=padding[:1]), "decode"), (dict(causal=True), "decode"), (dict(), "decode"),
             (dict(mask=padding, softcap=3.0), "decode"), (dict(mask=padding, window=(20, 0)), "decode"),
             (dict(mask=padding, sinks=sinks, alibi_slopes=slopes), "decode"),
             (dict(mask=per_head, window=(20, 0)), None), (dict(mask=per_head, sinks=sinks), None)]
    for kw, route in cases:
        routes.clear()
        hides = kw.get("mask") is not None and kw["mask"].shape[0] == b
        kk, vv = (kn, vn) if hides else (k, v)
        out, lse = flashcl.prefill(q, kk, vv, return_lse=True, device=cpu_device, **kw)
        ref_out, ref_lse = reference.attention(q, kk, vv, return_lse=True, **kw)
        assert routes == ([route] if route else []), (sorted(kw), routes)
        assert_close(out, ref_out, "float32", f"{route} {sorted(kw)}")
        np.testing.assert_allclose(lse, ref_lse, rtol=1e-5, atol=1e-5)
    routes.clear()
    out3 = flashcl.prefill(q[0], k[0], v[0], device=cpu_device)
    assert_close(out3, reference.attention(q[:1], k[:1], v[:1])[0], "float32", "decode rank 3")
    out3 = flashcl.prefill(q[0], k[0], k[0], device=cpu_device)  # k is v: one buffer
    assert_close(out3, reference.attention(q[:1], k[:1], k[:1])[0], "float32", "decode rank 3, k is v")
    x = q[:, :2]  # q is k is v (N_kv = 1): q's view is copied, not a second buffer over K/V
    assert_close(flashcl.prefill(x, x, x, device=cpu_device), reference.attention(x, x, x), "float32", "q is k is v")
    qk, qv = flashcl.quantize(k, "q8_0"), flashcl.quantize(v, "q8_0")
    out = flashcl.prefill(q, qk, qv, mask=padding, device=cpu_device)
    ref = reference.attention(q, flashcl.dequantize(qk), flashcl.dequantize(qv), mask=padding)
    assert_close(out, ref, "float32", "decode q8_0")
    assert routes == ["decode"] * 4


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_few_query_rows_run_as_decode(cl_device, monkeypatch, dtype):
    """On every device 2 to 16 query rows run as a decode with each query head's rows as heads of
    its group (_prefill_rows_as_decode), causal (QUERY_ROWS: bottom-right, N_q < N_kv, = N_kv and
    > N_kv, whose first rows see nothing) or not, with softcap and sinks, a window and ALiBi on
    causal rows (each at its own position), MHA and GQA, DK != DV, rank 3 and q8_0 K/V; a mask
    other than a left padding (read per row, ROW_MASK) on causal rows; a window, ALiBi or such a
    mask on rows that are not causal, and explicit tiles keep the prefill kernels. All against
    the oracle."""
    import flashcl
    from flashcl.opencl import prefill as cl_prefill

    routes = []
    real = cl_prefill._prefill_rows_as_decode
    monkeypatch.setattr(cl_prefill, "_prefill_rows_as_decode",
                        lambda *a, **kw: routes.append(kw["shapes"][0][2]) or real(*a, **kw))
    rng = np.random.default_rng(11)
    sinks = rng.standard_normal(8).astype(np.float32)
    head_dim = cl_prefill.decode_head_dim(get_device(cl_device))
    for b, h_q, h_kv, n_q, n_kv, dk, dv in [(2, 8, 2, 2, 90, 64, 64), (1, 8, 8, 16, 40, 32, 48),
                                            (3, 8, 1, 5, 5, 64, 64), (1, 8, 4, 7, 3, 32, 32),
                                            (1, 8, 2, 16, 70, 64, 64),  # 64 rows a KV head
                                            (1, 4, 2, 3, 40, 256, 256)]:  # GPUs only
        q, k, v = _inputs(rng, b, h_q, h_kv, n_q, n_kv, dk, dv, dtype)
        slopes = rng.uniform(0.05, 0.5, (b, h_q)).astype(np.float32)
        for kw in (dict(causal=True), dict(), dict(causal=True, softcap=5.0, sinks=sinks[:h_q]),
                   dict(causal=True, window=(2, 0)), dict(causal=True, window=(n_q + 3, 5), alibi_slopes=slopes),
                   dict(causal=True, alibi_slopes=slopes[0], sinks=sinks[:h_q])):
            routes.clear()
            out, lse = flashcl.prefill(q, k, v, return_lse=True, device=cl_device, **kw)
            ref_out, ref_lse = reference.attention(q, k, v, return_lse=True, **kw)
            takes = h_q // h_kv * n_q <= DECODE_GROUP_ROWS and max(dk, dv) <= head_dim
            assert routes == ([n_q] if takes else []), (n_q, sorted(kw), routes)
            assert_close(out, ref_out, dtype, f"({b},{h_q}/{h_kv},{n_q},{n_kv}) {sorted(kw)}")
            seen = np.isfinite(ref_lse)
            assert (np.isfinite(lse) == seen).all() and not out[~seen].any()
            np.testing.assert_allclose(lse[seen], ref_lse[seen], rtol=1e-3, atol=1e-3)
    q, k, v = _inputs(rng, 1, 8, 2, 4, 60, 64, 64, dtype)
    routes.clear()
    kp, vp = k.copy(), v.copy()  # keys only the later rows see: inf and NaN reach none of the others
    kp[:, :, -1], vp[:, :, -1], vp[:, :, -2] = np.nan, np.inf, np.nan
    got = flashcl.prefill(q, kp, vp, causal=True, device=cl_device)
    assert_close(got[:, :, :2], reference.attention(q, k, v, causal=True)[:, :, :2], dtype, "poisoned tail")
    assert_close(flashcl.prefill(q[0], k[0], v[0], causal=True, device=cl_device),
                 reference.attention(q[0], k[0], v[0], causal=True), dtype, "rank 3")
    if dtype == "float32":
        qk, qv = flashcl.quantize(k, "q8_0"), flashcl.quantize(v, "q8_0")
        assert_close(flashcl.prefill(q, qk, qv, causal=True, device=cl_device),
                     reference.attention(q, flashcl.dequantize(qk), flashcl.dequantize(qv), causal=True),
                     dtype, "q8_0")
    assert routes == [4] * (3 if dtype == "float32" else 2)
    import pyopencl.array as cla

    queue = get_device(cl_device).queue  # device arrays: the route views them with new shapes
    got = flashcl.prefill(*(cla.to_device(queue, x) for x in (q, kp, vp)), causal=True)
    assert_close(got.get()[:, :, :2], reference.attention(q, k, v, causal=True)[:, :, :2], dtype, "device arrays")
    assert routes == [4] * (4 if dtype == "float32" else 3)
    routes.clear()
    mask = np.ones((1, 1, 4, 60), bool)
    mask[..., :9] = False
    mask[..., 2, 30] = False  # a hole: not a left padding, read per row (ROW_MASK) where the rows are causal
    kp, vp = k.copy(), v.copy()
    kp[..., :9, :], vp[..., :9, :] = np.nan, np.inf  # hidden from every row
    got = flashcl.prefill(q, kp, vp, causal=True, mask=mask, device=cl_device)
    assert_close(got, reference.attention(q, k, v, causal=True, mask=mask), dtype, "a mask read per row")
    assert routes == [4]
    routes.clear()
    for kw in (dict(causal=False, window=(20, 3)), dict(causal=False, alibi_slopes=np.ones(8, np.float32)),
               dict(causal=False, mask=mask),
               dict(causal=True, params=dict(choose_params(get_device(cl_device),
                                                           PrefillProblem(1, 8, 2, 4, 60, 64, 64, True, dtype)).params))):
        out = flashcl.prefill(q, k, v, device=cl_device, **kw)
        ref_kw = {n: x for n, x in kw.items() if n != "params"}
        assert_close(out, reference.attention(q, k, v, **ref_kw), dtype, f"kept {sorted(kw)}")
    assert routes == []


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_few_query_rows_with_left_padding_run_as_decode(cl_device, monkeypatch, dtype):
    """Causal rows of a left-padded batch (a chunk through a cache) take the few-row route with
    each sequence's first key (mask_key_start), with and without a window, NaN/inf in the
    padding never read; a mask with a hole is read per row instead."""
    import flashcl
    from flashcl.opencl import prefill as cl_prefill

    routes = []
    real = cl_prefill._prefill_rows_as_decode
    monkeypatch.setattr(cl_prefill, "_prefill_rows_as_decode",
                        lambda *a, **kw: routes.append(kw["key_start"]) or real(*a, **kw))
    rng = np.random.default_rng(12)
    b, n_q, n_kv = 3, 6, 50
    q, k, v = _inputs(rng, b, 8, 2, n_q, n_kv, 64, 64, dtype)
    pads = np.array([0, 17, 47])  # the last sequence's first rows see nothing
    mask = np.arange(n_kv)[None, None, None, :] >= pads[:, None, None, None]
    kp, vp = k.copy(), v.copy()
    for i, pad in enumerate(pads):
        kp[i, :, :pad], vp[i, :, :pad] = np.nan, np.inf
    for kw in (dict(), dict(window=(9, 0)), dict(window=(2, 0), softcap=5.0)):
        routes.clear()
        out, lse = flashcl.prefill(q, kp, vp, causal=True, mask=mask, return_lse=True, device=cl_device, **kw)
        ref_out, ref_lse = reference.attention(q, k, v, causal=True, mask=mask, return_lse=True, **kw)
        assert len(routes) == 1, routes
        if "window" not in kw:  # with one, any start left of every row's window is the same
            assert routes[0].tolist() == pads.tolist(), routes
        assert_close(out, ref_out, dtype, f"left padding {sorted(kw)}")
        seen = np.isfinite(ref_lse)
        assert (np.isfinite(lse) == seen).all() and not out[~seen].any()
    holed = np.broadcast_to(mask, (b, 1, n_q, n_kv)).copy()
    holed[1, 0, 3, 30] = False
    routes.clear()
    got = flashcl.prefill(q, kp, vp, causal=True, mask=holed, device=cl_device)
    # read per row (ROW_MASK), the padding before every row's first key skipped (key_start)
    assert len(routes) == 1 and routes[0].tolist() == pads.tolist(), routes
    assert_close(got, reference.attention(q, k, v, causal=True, mask=holed), dtype, "a hole")


def test_mask_key_start_matches_its_definition():
    """mask_key_start: each sequence's first visible key where every row of it sees a suffix of
    its keys, the same for every head; None otherwise."""
    from flashcl.opencl.prefill import mask_key_start

    rng = np.random.default_rng(3)
    for _ in range(300):
        bm, hm, n = rng.choice([1, 3]), rng.choice([1, 2]), int(rng.integers(1, 40))
        starts = rng.integers(0, n + 1, size=(bm, 1))
        if rng.random() < 0.3:
            starts = np.broadcast_to(starts, (bm, hm)).copy()
            starts[rng.integers(bm), rng.integers(hm)] = rng.integers(0, n + 1)
        mask = np.arange(n) >= np.broadcast_to(starts, (bm, hm))[:, :, None, None]
        if rng.random() < 0.2:
            mask[rng.integers(bm), rng.integers(hm), 0, rng.integers(n)] ^= True
        per_row = [np.flatnonzero(r) for r in mask[:, :, 0].reshape(-1, n)]
        suffix = all(len(r) == 0 or (r[-1] == n - 1 and len(r) == n - r[0]) for r in per_row)
        firsts = np.array([r[0] if len(r) else n for r in per_row]).reshape(bm, hm)
        want = (np.broadcast_to(firsts[:, 0], (3,)) if suffix and (firsts == firsts[:, :1]).all() else None)
        for m in (mask, np.where(mask, 0.0, -np.inf).astype(np.float32)):
            got = mask_key_start(m, 3)
            if want is None:
                assert got is None
            else:
                assert got is not None and got.dtype == np.int32 and (got == want).all()
    assert mask_key_start(np.where(mask, 0.5, -np.inf).astype(np.float32), 3) is None


def test_mask_key_start_of_several_rows():
    """mask_key_start over N_q rows with causal and a window: a per-sequence first key where the
    mask, within each row's band, shows exactly the band's keys from it on; checked against the
    definition row by row on random left paddings, holes and per-row differences."""
    from flashcl.opencl.prefill import mask_key_start

    rng = np.random.default_rng(4)
    for _ in range(400):
        bm, n_q = int(rng.choice([1, 3])), int(rng.integers(1, 7))
        n_kv = int(rng.integers(n_q, 30)) if rng.random() < 0.8 else int(rng.integers(1, 8))
        causal = bool(rng.random() < 0.8)
        window = (int(rng.integers(-1, 9)), int(rng.integers(-1, 3))) if rng.random() < 0.5 else None
        pad = rng.integers(0, n_kv + 1, size=bm)
        mask = np.broadcast_to(np.arange(n_kv) >= pad[:, None, None, None], (bm, 1, n_q, n_kv)).copy()
        if rng.random() < 0.3:
            mask[rng.integers(bm), 0, rng.integers(n_q), rng.integers(n_kv)] ^= True
        pos = np.arange(n_q)[:, None] + n_kv - n_q
        key = np.arange(n_kv)[None, :]
        band = (key <= pos) if causal else np.ones((n_q, n_kv), bool)
        if window is not None and window[0] >= 0:
            band &= key >= pos - window[0]
        if window is not None and window[1] >= 0:
            band &= key <= pos + window[1]
        want = []
        for bi in range(bm):  # the definition: some start s with mask & band == (key >= s) & band
            seen = mask[bi, 0] & band
            fits = [st for st in range(n_kv + 1) if ((key >= st) & band == seen).all()]
            want.append(fits)
        got = mask_key_start(mask, 3 if bm == 3 else 2, causal=causal, window=window)
        if any(not f for f in want):
            assert got is None, (mask, causal, window)
        else:
            assert got is not None, (mask, causal, window, want)
            assert all(int(g) in f for g, f in zip(got, want * (2 if bm == 1 else 1))), (got, want)
