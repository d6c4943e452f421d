"""OpenCL flash-decoding against the float64 oracle, on every OpenCL device present (conftest.py).

The kernels run through ``run_poisoned`` (outputs pre-filled with NaN, so an element a kernel
forgets to write fails); the public ``flashcl.decode`` is checked for input kinds, the cascade use
of ``merge_states`` and its error messages. Each distinct define set is one program build (about a
second under PoCL), so the tests share a few problem classes and vary what is a run-time argument:
split counts, context lengths, block sizes, block tables.
"""

from __future__ import annotations

import numpy as np
import pytest

import flashcl
from flashcl import reference
from flashcl.opencl import decode as cl_decode
from flashcl.opencl.decode import DecodeKernel, DecodeProblem, choose_num_splits, choose_params
from flashcl.opencl.runtime import get_device

from ._check import assert_close, naive_attention

cl = pytest.importorskip("pyopencl")
cla = pytest.importorskip("pyopencl.array")


# --------------------------------------------------------------------------- helpers

def _paged(rng, b, h_q, h_kv, dk, dv, lens, block_size, dtype, logit_scale=1.0, spare_blocks=3):
    """q and a paged cache whose blocks are a random permutation (plus unused blocks, and table
    entries past each sequence's end that point at garbage ids: they must never be read)."""
    max_blocks = max(1, max(-(-n // block_size) for n in lens))
    num_blocks = b * max_blocks + spare_blocks
    q = (rng.standard_normal((b, h_q, dk)) * logit_scale).astype(dtype)
    k = rng.standard_normal((num_blocks, block_size, h_kv, dk)).astype(dtype)
    v = rng.standard_normal((num_blocks, block_size, h_kv, dv)).astype(dtype)
    table = rng.permutation(num_blocks)[: b * max_blocks].reshape(b, max_blocks).astype(np.int32)
    lens = np.asarray(lens, dtype=np.int32)
    for i, n in enumerate(lens):
        table[i, -(-n // block_size):] = -7  # unused entries: out of range on purpose
    return q, k, v, table, lens


def _contiguous(rng, b, h_q, h_kv, dk, dv, n_max, dtype, logit_scale=1.0):
    q = (rng.standard_normal((b, h_q, dk)) * logit_scale).astype(dtype)
    k = rng.standard_normal((b, h_kv, n_max, dk)).astype(dtype)
    v = rng.standard_normal((b, h_kv, n_max, dv)).astype(dtype)
    return q, k, v


def params_for(h, prob, params, layout):
    """``params``, or where they are None and ``layout`` is given, that layout's untuned ones."""
    return cl_decode.layout_params(h, prob, layout) if params is None and layout is not None else params


def run_poisoned(device, q, k, v, table, lens, num_splits, params=None, scale=None, row_shuffle=None,
                 tensor_cores=None, layout=None):
    """Run the decode kernels on out/lse pre-filled with NaN; contiguous caches when table is None
    (lens None: every sequence is N_max long). ``layout``: that layout's untuned parameters
    (LAYOUTS) where ``params`` is None; neither: the device's choice."""
    h = get_device(device)
    b, h_q, dk = q.shape
    paged = table is not None
    h_kv, dv = (k.shape[2], v.shape[3]) if paged else (k.shape[1], v.shape[3])
    prob = DecodeProblem(b, h_q, h_kv, dk, dv, paged, q.dtype.name)
    choice = choose_params(h, prob, params_for(h, prob, params, layout))
    kern = DecodeKernel(h, prob, choice.params, row_shuffle=row_shuffle, tensor_cores=tensor_cores)
    if lens is None:
        lens = np.full(b, k.shape[2], dtype=np.int32)
    qd, kd, vd, lens_d = (cla.to_device(h.queue, x) for x in (q, k, v, lens))
    table_d = cla.to_device(h.queue, table) if paged else lens_d
    out = cla.to_device(h.queue, np.full((b, h_q, dv), np.nan, dtype=q.dtype))
    lse = cla.to_device(h.queue, np.full((b, h_q), np.nan, dtype=np.float32))
    scale = dk ** -0.5 if scale is None else scale
    for ev in kern(qd, kd, vd, out, lse, table_d, lens_d, scale, num_splits):
        ev.wait()
    return out.get(), lse.get(), choice.params


def _naive(q, k, v, table, lens, scale):
    """Plain same-dtype attention per sequence (the fp16 yardstick), gathered like the oracle."""
    outs = []
    for i in range(q.shape[0]):
        n = k.shape[2] if lens is None else int(lens[i])
        if table is None:
            ks, vs = k[i][:, :n], v[i][:, :n]
        else:
            bs = k.shape[1]
            blocks = table[i, : -(-n // bs)]
            ks = k[blocks].reshape(-1, *k.shape[2:])[:n].transpose(1, 0, 2)
            vs = v[blocks].reshape(-1, *v.shape[2:])[:n].transpose(1, 0, 2)
        if n == 0:
            outs.append(np.zeros((q.shape[1], v.shape[-1]), dtype=q.dtype))
            continue
        outs.append(naive_attention(q[i][:, None], ks, vs, False, scale, q.dtype)[:, 0])
    return np.stack(outs)


def check(device, q, k, v, table, lens, num_splits, params=None, what="", row_shuffle=None,
          tensor_cores=None, layout=None):
    out, lse, used = run_poisoned(device, q, k, v, table, lens, num_splits, params, row_shuffle=row_shuffle,
                                  tensor_cores=tensor_cores, layout=layout)
    scale = q.shape[-1] ** -0.5
    ref_out, ref_lse = reference.decode_attention(q, k, v, block_table=table, context_lens=lens,
                                                  return_lse=True)
    dtype = q.dtype.name
    lens_txt = None if lens is None else lens.tolist()
    what = (f"{what} splits={num_splits} params={used} q{q.shape} k{k.shape} v{v.shape} "
            f"{'paged' if table is not None else 'contiguous'} lens={lens_txt} {dtype}")
    naive = _naive(q, k, v, table, lens, scale) if dtype == "float16" else None
    assert_close(out, ref_out, dtype, what, naive=naive)
    finite = np.isfinite(ref_lse)
    assert np.array_equal(np.isfinite(lse), finite), f"{what}: lse finiteness differs"
    assert np.all(np.isneginf(lse[~finite])), f"{what}: a sequence with no key needs lse = -inf"
    assert np.all(out[~finite] == 0), f"{what}: a sequence with no key needs out = 0"
    np.testing.assert_allclose(lse[finite], ref_lse[finite], rtol=1e-5, atol=1e-5, err_msg=what)
    return out, lse


# decode.cl's work-items across a row (GPUs, Adreno) and decode_cpu.cl's whole rows (CPUs): both
# run on every device, whichever it defaults to
LAYOUTS = ["lanes", "rows"]


# --------------------------------------------------------------------------- split counts, lengths

SPLITS = [1, 2, 3, 7, 32, 200]  # 200 > every sequence's block count: surplus splits are empty


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_split_counts_and_context_lengths(cl_device, dtype, layout):
    """block_size 16: context 0, 1, bs-1, bs, bs+1 and 1000 in one batch, every split count."""
    rng = np.random.default_rng(10)
    lens = [1, 15, 16, 17, 1000, 0]
    q, k, v, table, lens = _paged(rng, len(lens), 8, 2, 64, 64, lens, 16, dtype)
    for s in SPLITS:
        check(cl_device, q, k, v, table, lens, s, layout=layout)


@pytest.mark.parametrize("block_size", [1, 16, 64, 256])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_block_sizes(cl_device, block_size, layout):
    """Partial last blocks (bs-1, bs+1), one-token blocks, 256-token blocks, permuted tables; GQA 8:1."""
    rng = np.random.default_rng(block_size)
    lens = [1, max(1, block_size - 1), block_size, block_size + 1, 300]
    q, k, v, table, lens = _paged(rng, len(lens), 16, 2, 128, 128, lens, block_size, "float16")
    for s in (1, 3, None):
        check(cl_device, q, k, v, table, lens, s or cl_decode.choose_num_splits(
            int(get_device(cl_device).device.max_compute_units), len(lens) * 2, 300), layout=layout)


# (B, H_q, H_kv): MHA, GQA 4:1, GQA 8:1, MQA
GROUPS = [(2, 4, 4), (2, 8, 2), (1, 16, 2), (2, 16, 1)]


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("heads", GROUPS, ids=["MHA", "GQA4", "GQA8", "MQA"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_head_groups_contiguous(cl_device, heads, dtype, layout):
    b, h_q, h_kv = heads
    rng = np.random.default_rng(h_q * 10 + h_kv)
    q, k, v = _contiguous(rng, b, h_q, h_kv, 128, 128, 333, dtype)
    check(cl_device, q, k, v, None, None, 1, what="N_max", layout=layout)
    lens = np.array([333, 40][:b], dtype=np.int32)
    for s in (2, 5):
        check(cl_device, q, k, v, None, lens, s, layout=layout)


@pytest.mark.parametrize("dk,dv", [(80, 80), (192, 128), (96, 64)], ids=["80", "192x128", "96x64"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_head_dims(cl_device, dk, dv, layout):
    """Non-power-of-two head dims and DK != DV (lanes past DK or DV idle)."""
    rng = np.random.default_rng(dk + dv)
    q, k, v, table, lens = _paged(rng, 2, 8, 2, dk, dv, [77, 16], 16, "float16")
    for s in (1, 4):
        check(cl_device, q, k, v, table, lens, s, layout=layout)


# Tile configurations: direct loads (HEAD_TILE = G) and a staged K/V tile (HEAD_TILE < G), one
# row slot and many, several keys per work-item; the work-groups span several subgroups.
TILES = [
    dict(ROWS=1, UNROLL=1, HEAD_TILE=4, MERGE_WG=32),
    dict(ROWS=8, UNROLL=1, HEAD_TILE=4, MERGE_WG=64),
    dict(ROWS=4, UNROLL=4, HEAD_TILE=2, MERGE_WG=128),
    dict(ROWS=2, UNROLL=2, HEAD_TILE=1, MERGE_WG=16),
    dict(ROWS=16, UNROLL=2, HEAD_TILE=1, MERGE_WG=64),
]


@pytest.mark.parametrize("params", TILES, ids=lambda p: "R{ROWS}U{UNROLL}T{HEAD_TILE}M{MERGE_WG}".format(**p))
def test_tile_parameters(cl_device, params):
    h = get_device(cl_device)
    errs = cl_decode.check_params(params, 4, 64, 64, "float32", local_mem=h.local_mem,
                                  max_work_group=h.max_work_group)
    if errs:
        pytest.skip("; ".join(errs))
    rng = np.random.default_rng(5)
    q, k, v, table, lens = _paged(rng, 3, 8, 2, 64, 64, [1, 65, 250], 16, "float32")
    prob = DecodeProblem(3, 8, 2, 64, 64, True, "float32")
    try:
        DecodeKernel(h, prob, params)
    except ValueError as exc:  # the built kernel's register use caps its work-group below ours
        if "the kernel allows" not in str(exc):
            raise
        pytest.skip(str(exc))
    for s in (1, 3, 40):
        check(cl_device, q, k, v, table, lens, s, params)


# decode_cpu.cl: one key a softmax step, a tile that never divides the lengths, the widest; every
# vector width (float32 head dim 40: VEC 16 does not divide it, and is refused)
ROWS_CONFIGS = [
    dict(VARIANT="rows", BLOCK_N=1, VEC=4, MERGE_WG=64),
    dict(VARIANT="rows", BLOCK_N=5, VEC=8, MERGE_WG=32),
    dict(VARIANT="rows", BLOCK_N=64, VEC=16, MERGE_WG=256),
]


@pytest.mark.parametrize("params", ROWS_CONFIGS, ids=lambda p: "B{BLOCK_N}V{VEC}".format(**p))
def test_rows_parameters(cl_device, params):
    h = get_device(cl_device)
    rng = np.random.default_rng(params["BLOCK_N"])
    q, k, v, table, lens = _paged(rng, 3, 8, 2, 64, 64, [1, 64, 203], 16, "float32")
    for s in (1, 3, 32):
        check(cl_device, q, k, v, table, lens, s, params)
    errs = cl_decode.check_params(params, 4, 40, 40, "float32", local_mem=h.local_mem,
                                  max_work_group=h.max_work_group)
    assert bool(errs) == (params["VEC"] == 16), errs
    if errs:
        assert "VEC=16 must divide DK=40" in errs[0]


@pytest.mark.parametrize("dk", [64, 128, 256])
def test_row_shuffle(cl_device, dk):
    """The NVIDIA warp-shuffle score sums (ROW_SHUFFLE; 8, 16 and 32 lanes per K row in fp16)
    against the oracle, next to the local-memory sums on the same inputs; elsewhere forcing it
    is refused."""
    h = get_device(cl_device)
    params = dict(ROWS=4, UNROLL=1, HEAD_TILE=4, MERGE_WG=64)
    rng = np.random.default_rng(dk)
    q, k, v, table, lens = _paged(rng, 3, 8, 2, dk, dk, [1, 17, 300], 16, "float16", logit_scale=4.0)
    if not cl_decode.row_shuffle_ok(h, params, 4, dk, dk, "float16"):
        with pytest.raises(ValueError, match="row_shuffle"):
            DecodeKernel(h, DecodeProblem(3, 8, 2, dk, dk, True, "float16"), params, row_shuffle=True)
        return
    for shuffle in (True, False):
        for s in (1, 5):
            check(cl_device, q, k, v, table, lens, s, params, what=f"row_shuffle={shuffle}", row_shuffle=shuffle)


# (H_q, H_kv, DK, DV): GQA groups of 4, 16 (both n-tiles of 8 heads), 12 (a partial second one),
# 1 (7 padding heads), 32 (two work-groups per KV head); DK 32..128 and DK != DV
MMA_CASES = [(8, 2, 128, 128), (16, 1, 64, 64), (12, 1, 96, 128), (2, 2, 32, 64), (32, 1, 64, 64)]


def _mma_mode(h, prob):
    """decode_mma.cl's real PTX where it applies, its emulation elsewhere."""
    return True if cl_decode.tensor_cores_ok(h, prob) else "emulate"


@pytest.mark.parametrize("h_q,h_kv,dk,dv", MMA_CASES)
def test_tensor_cores(cl_device, h_q, h_kv, dk, dv):
    """decode_mma.cl against the oracle: on NVIDIA (sm_80+) with the real warp instructions
    (mma.sync, movmatrix, shfl.sync), on every other device with their emulation (the same
    fragment bookkeeping, checked by PoCL in CI). Partial tiles, 1-key sequences, more splits
    than keys, a contiguous
    cache with an empty sequence, logits around +-200."""
    h = get_device(cl_device)
    prob = DecodeProblem(3, h_q, h_kv, dk, dv, True, "float16")
    mode = _mma_mode(h, prob)
    if mode == "emulate":
        with pytest.raises(ValueError, match="tensor_cores"):
            DecodeKernel(h, prob, choose_params(h, prob).params, tensor_cores=True)
    rng = np.random.default_rng(h_q * dk + dv)
    q, k, v, table, lens = _paged(rng, 3, h_q, h_kv, dk, dv, [1, 17, 300], 16, "float16", logit_scale=4.0)
    for s in (1, 3, 200):
        check(cl_device, q, k, v, table, lens, s, what=f"tensor_cores={mode}", tensor_cores=mode)
    q, k, v = _contiguous(rng, 2, h_q, h_kv, dk, dv, 97, "float64", logit_scale=60.0)
    s = np.einsum("hd,hnd->hn", q[0].reshape(h_kv, -1, dk)[:, 0], k[0]) * dk ** -0.5
    assert np.abs(s).max() > 150
    q, k, v = (x.astype("float16") for x in (q, k, v))
    check(cl_device, q, k, v, None, np.array([97, 0], np.int32), 2, what=f"tensor_cores={mode}",
          tensor_cores=mode)


@pytest.mark.parametrize("h_q,h_kv,dk,dv", MMA_CASES)
def test_tensor_cores_fused_merge(cl_device, h_q, h_kv, dk, dv):
    """flash_decode_fused (split-k in one launch: the last work-group of a head tile merges)
    against the oracle, one kernel over several split counts and calls (its arrival counts must
    go back to zero), with empty and 1-key sequences; emulated off NVIDIA, and not under Oclgrind
    (OpenCL 1.2 orders nothing between work-groups: NVIDIA's membar.gl does)."""
    h = get_device(cl_device)
    prob = DecodeProblem(3, h_q, h_kv, dk, dv, True, "float16")
    mode = _mma_mode(h, prob)
    kern = DecodeKernel(h, prob, choose_params(h, prob).params, tensor_cores=mode, fused_merge=True)
    rng = np.random.default_rng(h_q * dk + dv + 1)
    q, k, v, table, lens = _paged(rng, 3, h_q, h_kv, dk, dv, [1, 0, 300], 16, "float16", logit_scale=4.0)
    qd, kd, vd, td, ld = (cla.to_device(h.queue, x) for x in (q, k, v, table, lens))
    ref_out, ref_lse = reference.decode_attention(q, k, v, block_table=table, context_lens=lens, return_lse=True)
    for s in (2, 7, 2, 200):
        out = cla.to_device(h.queue, np.full((3, h_q, dv), np.nan, np.float16))
        lse = cla.to_device(h.queue, np.full((3, h_q), np.nan, np.float32))
        events = kern(qd, kd, vd, out, lse, td, ld, dk ** -0.5, s)
        assert len(events) == 1, "split-k in one launch"
        events[-1].wait()
        assert_close(out.get(), ref_out, "float16", f"fused merge, {s} splits")
        got_lse = lse.get()
        assert np.all(np.isneginf(got_lse[1])) and np.all(out.get()[1] == 0), "the empty sequence"
        np.testing.assert_allclose(got_lse[[0, 2]], ref_lse[[0, 2]], rtol=1e-5, atol=1e-5)
    counts = np.empty(kern.arrivals().size // 4, np.int32)
    cl.enqueue_copy(h.queue, counts, kern.arrivals())
    assert not counts.any(), "arrival counts left non-zero"


def test_tensor_cores_fused_merge_variants(cl_device):
    """flash_decode_fused with every variant (the sink joins split 0's state once) gives what the
    two launches give, on a bad block id too (NaN for that sequence in both)."""
    h = get_device(cl_device)
    b, h_q, h_kv, d = 2, 8, 2, 64
    prob = DecodeProblem(b, h_q, h_kv, d, d, True, "float16")
    mode = _mma_mode(h, prob)
    rng = np.random.default_rng(11)
    q, k, v, table, lens = _paged(rng, b, h_q, h_kv, d, d, [300, 90], 16, "float16", logit_scale=4.0)
    table = table.copy()
    table[1, 2] = 10 ** 6   # a used block id out of range: sequence 1 is NaN
    var = cl_decode.DecodeVariants(100, 30.0, rng.standard_normal(h_q).astype(np.float32),
                                   (rng.random((b, h_q)) * 0.1).astype(np.float32))
    qd, kd, vd, td, ld = (cla.to_device(h.queue, x) for x in (q, k, v, table, lens))
    got = {}
    for fused in (False, True):
        kern = DecodeKernel(h, prob, choose_params(h, prob).params, tensor_cores=mode, variant_flags=var.flags(),
                            fused_merge=fused)
        out = cla.to_device(h.queue, np.zeros((b, h_q, d), np.float16))
        lse = cla.to_device(h.queue, np.zeros((b, h_q), np.float32))
        kern(qd, kd, vd, out, lse, td, ld, d ** -0.5, 3, variants=var)[-1].wait()
        got[fused] = (out.get().astype(np.float64), lse.get())
    (o2, l2), (o1, l1) = got[False], got[True]
    assert np.all(np.isnan(o1[1])) and np.all(np.isnan(l1[1])), "the bad table's sequence"
    np.testing.assert_allclose(o1[0], o2[0], rtol=2e-3, atol=2e-3)
    np.testing.assert_allclose(l1[0], l2[0], rtol=1e-5, atol=1e-5)


def test_tensor_cores_split_choice():
    """decode_mma.cl's split rule (2 resident work-groups per SM, >= 256 keys per split) on an
    H100 / H200 (132 SMs). Lengths on the host (equal here): the count that fills the device
    once, the best forced count both cards measured on the reference shapes and (B, 32/8, ctx)
    at B = 2, 4, 8 (ties within 4%). Device tables: at most 4096 keys a split, which splits the
    long sequence of an uneven batch (and costs 11-21% at (8, 32/32, 8k) and (8, 32/8, 32k))."""
    shapes = [(8, 32, 32, 2048), (8, 32, 32, 8192), (8, 32, 8, 2048), (32, 32, 8, 2048),
              (4, 64, 8, 2048), (8, 64, 8, 2048), (16, 32, 1, 4096), (1, 32, 8, 32768),
              (1, 32, 8, 131072), (8, 32, 8, 32768), (4, 32, 8, 32768), (2, 32, 8, 65536)]

    def pick(b, h_q, h_kv, ctx, **kw):
        return choose_num_splits(132, b * h_kv * cl_decode.mma_tiles(h_q // h_kv), ctx,
                                 waves=cl_decode.MMA_WAVES, min_keys=cl_decode.MMA_MIN_KEYS_PER_SPLIT,
                                 short_keys=cl_decode.MMA_SHORT_SPLIT_KEYS, **kw)

    host = [pick(*s, keys_per_split=None, mean_ctx=s[3]) for s in shapes]
    assert host == [1, 1, 4, 1, 4, 4, 8, 32, 32, 4, 8, 16]
    device = [pick(*s, keys_per_split=cl_decode.MMA_KEYS_PER_SPLIT) for s in shapes]
    assert device == [1, 2, 4, 1, 4, 4, 8, 32, 32, 8, 8, 16]
    # uneven batches split the long sequence further: the counts the H200 measured best for one
    # sequence of 128k keys and seven of 1k, and for one of 32k and seven of 4k
    assert pick(8, 32, 8, 131072, keys_per_split=None, mean_ctx=(131072 + 7 * 1024) / 8) == 32
    assert pick(8, 32, 8, 32768, keys_per_split=None, mean_ctx=(32768 + 7 * 4096) / 8) == 16
    # short contexts (and windows: their keys seen): at least 256 keys a split, and splits under
    # 512 keys one work-group an SM at most; the H200's best forced counts, or within 10% of them
    short = [(1, 32, 8, 1024), (1, 32, 8, 2048), (1, 32, 8, 4096), (1, 32, 8, 8192), (4, 32, 8, 1024),
             (1, 32, 32, 1024), (2, 32, 8, 2048), (1, 16, 8, 4096), (1, 32, 4, 2048), (1, 32, 8, 256)]
    assert [pick(*s, keys_per_split=None, mean_ctx=s[3]) for s in short] == [4, 8, 16, 16, 4, 4, 8, 16, 8, 1]


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_huge_logits(cl_device, dtype, layout):
    """Logits around +-200: every split and the merge must subtract the max, not overflow."""
    rng = np.random.default_rng(6)
    q, k, v, table, lens = _paged(rng, 2, 8, 2, 64, 64, [300, 90], 16, "float64", logit_scale=60.0)
    s = np.einsum("hd,nd->hn", q[0, :4], k[table[0, :19]].reshape(-1, 2, 64)[:300, 0]) / 8.0
    assert 150 < np.abs(s).max() < 400
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    for n in (1, 7):
        check(cl_device, q, k, v, table, lens, n, layout=layout)


def test_automatic_split_choice():
    """The heuristic's documented cases on an H100 (132 CUs) and a 2-core CPU (pure host logic)."""
    h100 = [choose_num_splits(132, b * h_kv, ctx) for b, h_kv, ctx in [
        (8, 32, 2048), (8, 32, 8192), (8, 8, 2048), (32, 8, 2048), (4, 8, 2048), (8, 8, 2048),
        (16, 1, 4096), (1, 8, 32768), (1, 8, 131072)]]
    assert h100 == [4, 16, 8, 4, 8, 8, 16, 64, 64]
    assert choose_num_splits(132, 1000, 300) == 1         # device full, short context
    assert choose_num_splits(132, 8, 100) == 1            # too few keys to split
    assert choose_num_splits(2, 256, 8192) == 16          # long contexts split even on a full device
    assert choose_num_splits(132, 1, 10**6) == cl_decode.MAX_SPLITS


# --------------------------------------------------------------------------- the public API

def test_input_kinds(cl_device):
    """numpy in -> numpy out, torch CPU -> torch, pyopencl Arrays -> pyopencl Arrays (on device)."""
    rng = np.random.default_rng(7)
    q, k, v, table, lens = _paged(rng, 2, 8, 2, 64, 64, [50, 17], 16, "float32")
    ref, ref_lse = reference.decode_attention(q, k, v, block_table=table, context_lens=lens,
                                              return_lse=True)
    out, lse = flashcl.decode(q, k, v, block_table=table, context_lens=lens, device=cl_device,
                              return_lse=True)
    assert isinstance(out, np.ndarray) and out.shape == (2, 8, 64) and lse.shape == (2, 8)
    assert_close(out, ref, "float32", "numpy")
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-5)

    torch = pytest.importorskip("torch")
    out_t = flashcl.decode(*(torch.from_numpy(x) for x in (q, k, v)), block_table=torch.from_numpy(table),
                           context_lens=torch.from_numpy(lens), device=cl_device, num_splits=3)
    assert isinstance(out_t, torch.Tensor) and out_t.dtype == torch.float32
    assert_close(out_t.numpy(), ref, "float32", "torch")

    h = get_device(cl_device)
    arrs = [cla.to_device(h.queue, x) for x in (q, k, v, table, lens)]
    out_d, lse_d = flashcl.decode(arrs[0], arrs[1], arrs[2], block_table=arrs[3], context_lens=arrs[4],
                                  return_lse=True)
    assert isinstance(out_d, cla.Array)
    assert_close(out_d.get(), ref, "float32", "pyopencl")
    np.testing.assert_allclose(lse_d.get(), ref_lse, rtol=1e-5)

    qc, kc, vc = _contiguous(rng, 2, 8, 2, 64, 64, 40, "float32")
    out_c = flashcl.decode(qc, kc, vc, device=cl_device)  # context_lens None: every row N_max long
    assert_close(out_c, reference.decode_attention(qc, kc, vc), "float32", "contiguous, no lens")


def test_cascade_shared_prefix(cl_device):
    """A shared prefix attended once for all requests (their block tables all point at the same
    prefix blocks), each request's own suffix separately, merged per request with merge_states:
    equal to dense attention over prefix + suffix."""
    rng = np.random.default_rng(8)
    reqs, h_q, h_kv, d, bs, prefix, suffixes = 3, 8, 2, 64, 16, 100, [1, 16, 45]
    pre_blocks = -(-prefix // bs)
    suf_blocks = max(-(-n // bs) for n in suffixes)
    num_blocks = pre_blocks + reqs * suf_blocks
    k = rng.standard_normal((num_blocks, bs, h_kv, d)).astype(np.float32)
    v = rng.standard_normal((num_blocks, bs, h_kv, d)).astype(np.float32)
    q = rng.standard_normal((reqs, h_q, d)).astype(np.float32)
    ids = rng.permutation(num_blocks).astype(np.int32)
    pre_ids, suf_ids = ids[:pre_blocks], ids[pre_blocks:].reshape(reqs, suf_blocks)

    pre_table = np.tile(pre_ids, (reqs, 1))
    out_p, lse_p = flashcl.decode(q, k, v, block_table=pre_table,
                                  context_lens=np.full(reqs, prefix, np.int32), device=cl_device,
                                  return_lse=True)
    out_s, lse_s = flashcl.decode(q, k, v, block_table=suf_ids,
                                  context_lens=np.array(suffixes, np.int32), device=cl_device,
                                  num_splits=2, return_lse=True)
    out, lse = flashcl.merge_states([out_p, out_s], [lse_p, lse_s])

    for r in range(reqs):
        rows = lambda cache, blocks, n: cache[blocks].reshape(-1, h_kv, d)[:n]  # noqa: E731
        kk = np.concatenate([rows(k, pre_ids, prefix), rows(k, suf_ids[r], suffixes[r])]).transpose(1, 0, 2)
        vv = np.concatenate([rows(v, pre_ids, prefix), rows(v, suf_ids[r], suffixes[r])]).transpose(1, 0, 2)
        ref, ref_lse = reference.attention(q[r][:, None], kk, vv, return_lse=True)
        assert_close(out[r], ref[:, 0], "float32", f"cascade request {r}")
        np.testing.assert_allclose(lse[r], ref_lse[:, 0], rtol=1e-5, atol=1e-5)


def test_bad_tables_raise(cl_device):
    rng = np.random.default_rng(9)
    q, k, v, table, lens = _paged(rng, 2, 4, 2, 64, 64, [20, 33], 16, "float32")
    num_blocks = k.shape[0]

    def call(**kw):
        args = dict(block_table=table, context_lens=lens, device=cl_device)
        args.update(kw)
        return flashcl.decode(q, k, v, **args)

    bad = table.copy()
    bad[1, 2] = num_blocks
    with pytest.raises(ValueError, match=r"block_table\[1, 2\] = %d is out of range" % num_blocks):
        call(block_table=bad)
    bad[1, 2] = -1
    with pytest.raises(ValueError, match=r"block_table\[1, 2\] = -1"):
        call(block_table=bad)
    with pytest.raises(ValueError, match=r"context_lens\[0\] = -3 is negative"):
        call(context_lens=np.array([-3, 5], np.int32))
    cap = table.shape[1] * 16
    with pytest.raises(ValueError, match=r"context_lens\[1\] = %d exceeds the cache" % (cap + 1)):
        call(context_lens=np.array([5, cap + 1], np.int32))
    with pytest.raises(TypeError, match="block_table: expected int32, got int64"):
        call(block_table=table.astype(np.int64))
    with pytest.raises(TypeError, match="context_lens: expected int32, got float32"):
        call(context_lens=lens.astype(np.float32))
    with pytest.raises(ValueError, match="needs context_lens"):
        call(context_lens=None)
    with pytest.raises(ValueError, match="num_splits"):
        call(num_splits=0)
    with pytest.raises(TypeError, match="inputs must share one dtype"):
        flashcl.decode(q.astype(np.float16), k, v, block_table=table, context_lens=lens, device=cl_device)
    with pytest.raises(ValueError, match="params: HEAD_TILE=3 must divide"):
        call(params=dict(ROWS=1, UNROLL=1, HEAD_TILE=3, MERGE_WG=32))

    qc, kc, vc = _contiguous(rng, 2, 4, 2, 64, 64, 30, "float32")
    with pytest.raises(ValueError, match=r"context_lens\[0\] = 31 exceeds the cache \(N_max = 30\)"):
        flashcl.decode(qc, kc, vc, context_lens=np.array([31, 2], np.int32), device=cl_device)


@pytest.mark.parametrize("block_order", ["random", "sequential", "ascending"])
def test_bench_block_orders(block_order):
    """The benchmark's block tables use every block once, in the order the name promises."""
    from flashcl.tools import bench_decode as bd

    table = bd._block_table(np.random.default_rng(0), 24, 3, block_order)
    assert table.shape == (3, 8) and table.dtype == np.int32
    assert np.array_equal(np.sort(table, axis=None), np.arange(24))
    ascending = bool((np.diff(table, axis=1) > 0).all())
    assert ascending == (block_order != "random")
    assert np.array_equal(table, np.arange(24).reshape(3, 8)) == (block_order == "sequential")


def test_mean_keys_seen():
    """The mean length decode_mma.cl's splits balance: host tables only, a window's keys at most."""
    lens = np.array([100, 3000, 0], np.int32)
    assert cl_decode.mean_keys_seen(lens, None) == pytest.approx(3100 / 3)
    var = cl_decode.DecodeVariants(1023, None, None, None)   # window (1023, 0)
    assert cl_decode.mean_keys_seen(lens, var) == pytest.approx(1124 / 3)
    assert cl_decode.mean_keys_seen(None, None) is None


def test_keys_seen_count_the_window_and_key_start():
    """The split count is sized from the keys each query sees: a host key_start hides the keys
    before it (past the length: none seen), with a window the later first key wins; a device
    key_start is not read back and hides nothing here."""
    lens = np.array([100, 3000, 0, 50], np.int32)
    starts = np.array([40, 2500, 7, 80], np.int32)
    var = cl_decode.DecodeVariants(None, None, None, None, key_start=starts)
    assert cl_decode.keys_seen(lens, var).tolist() == [60, 500, 0, 0]
    windowed = cl_decode.DecodeVariants(1023, None, None, None, key_start=starts)
    assert cl_decode.keys_seen(lens, windowed).tolist() == [60, 500, 0, 0]
    windowed = cl_decode.DecodeVariants(99, None, None, None, key_start=starts)
    assert cl_decode.keys_seen(lens, windowed).tolist() == [60, 100, 0, 0]
    assert cl_decode.keys_seen(None, var) is None


def test_split_count_follows_key_start(cpu_device):
    """A left-padded batch whose queries see 200 keys of a 4096-key cache is split as 200 keys
    would be (the keys the split rule gets), with the result of forced splits."""
    rng = np.random.default_rng(3)
    b, h_kv, n, d = 2, 2, 4096, 64
    q = rng.standard_normal((b, 4, d)).astype(np.float32)
    k, v = (rng.standard_normal((b, h_kv, n, d)).astype(np.float32) for _ in range(2))
    lens = np.full(b, n, np.int32)
    starts = np.array([n - 200, n - 100], np.int32)
    asked = []
    real = cl_decode.DecodeKernel.auto_splits
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cl_decode.DecodeKernel, "auto_splits",
                   lambda self, n_ctx, mean_ctx=None: asked.append((n_ctx, mean_ctx)) or real(self, n_ctx, mean_ctx))
        plain = flashcl.decode(q, k, v, context_lens=lens, device=cpu_device)
        padded = flashcl.decode(q, k, v, context_lens=lens, key_start=starts, device=cpu_device)
    assert asked == [(n, n), (200, 150)], asked
    ref = reference.decode_attention(q, k, v, context_lens=lens, key_start=starts)
    forced = flashcl.decode(q, k, v, context_lens=lens, key_start=starts, num_splits=8, device=cpu_device)
    assert_close(padded, ref, "float32", "key_start, automatic splits")
    assert_close(forced, ref, "float32", "key_start, the unpadded call's splits")
    assert_close(plain, reference.decode_attention(q, k, v, context_lens=lens), "float32", "plain")
