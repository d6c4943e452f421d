"""Quantized KV caches (q8_0, q4_0, int8 of flashcl.quant) in the OpenCL decode kernel decode.cl,
against the float64 oracle on the same QuantizedTensor (it attends the dequantized values), on
every OpenCL device present (conftest.py), and a tiny case of each format under Oclgrind.

The grid is sampled, not crossed: each case picks a format pair (K and V may differ, or one be
plain), a layout (contiguous, paged of block size 1 / 16 / 64), a GQA group (MHA, GQA, MQA), a
head dim (64 / 128 / 256) and several split counts, so that every value of every axis appears.
The values span four decades across blocks (and rows), some blocks are all zero, outputs are
NaN-poisoned before each run, and the cache rows past each context and the unused table entries
hold garbage / bad ids that must never be read.
"""

from __future__ import annotations

import dataclasses
import json
import zlib
from pathlib import Path

import numpy as np
import pytest

import flashcl
from flashcl import quant, reference
from flashcl.opencl.decode import DecodeKernel, DecodeProblem, _mma_shape_ok, choose_params, quantized_to_device
from flashcl.opencl.runtime import get_device

from ._check import assert_close
from .test_decode_opencl import LAYOUTS, params_for

cla = pytest.importorskip("pyopencl.array")
REPO = Path(__file__).resolve().parent.parent


# --------------------------------------------------------------------------- inputs

def _values(rng, shape, dtype):
    """Normal values whose 32-value blocks (and so rows; whole rows where d is not a multiple of
    32) are scaled by 10^[-2, 2]; one block in seven all zero (a zero ggml d, a zero int8 row
    scale where the whole row is zero)."""
    lead, d = shape[:-1], shape[-1]
    blk = 32 if d % 32 == 0 else d
    x = rng.standard_normal((*lead, d // blk, blk))
    x *= 10.0 ** rng.uniform(-2, 2, size=(*lead, d // blk, 1))
    x[rng.random((*lead, d // blk)) < 1 / 7] = 0.0
    x = x.reshape(shape)
    x[..., :1, :] = 0.0  # a whole zero row (int8 scale 0)
    return x.astype(dtype)


def _cache(rng, fmt, shape, dtype):
    x = _values(rng, shape, dtype)
    return flashcl.quantize(x, fmt) if fmt else x


def _inputs(rng, b, h_q, h_kv, dk, dv, lens, block_size, dtype, k_fmt, v_fmt):
    """q, K, V (QuantizedTensors or plain), table (None: contiguous), lens."""
    q = rng.standard_normal((b, h_q, dk)).astype(dtype) * 4  # large logits: scale errors show
    lens = np.asarray(lens, dtype=np.int32)
    if block_size is None:
        n_max = int(lens.max()) + 3
        k = _cache(rng, k_fmt, (b, h_kv, n_max, dk), dtype)
        v = _cache(rng, v_fmt, (b, h_kv, n_max, dv), dtype)
        return q, k, v, None, lens
    max_blocks = max(1, max(-(-int(n) // block_size) for n in lens))
    num_blocks = b * max_blocks + 2
    k = _cache(rng, k_fmt, (num_blocks, block_size, h_kv, dk), dtype)
    v = _cache(rng, v_fmt, (num_blocks, block_size, h_kv, dv), dtype)
    table = rng.permutation(num_blocks)[: b * max_blocks].reshape(b, max_blocks).astype(np.int32)
    for i, n in enumerate(lens):
        table[i, -(-int(n) // block_size):] = -5  # unused entries: out of range on purpose
    return q, k, v, table, lens


def run_quantized(device, q, k, v, table, lens, num_splits, params=None, tensor_cores=None, layout=None):
    """The decode kernels on NaN-poisoned out/lse, K/V QuantizedTensors uploaded as stored;
    ``layout``: that layout's untuned parameters where ``params`` is None."""
    h = get_device(device)
    b, h_q, dk = q.shape
    paged = table is not None
    h_kv = k.shape[2] if paged else k.shape[1]
    dv = v.shape[3]
    fmt = lambda x: x.fmt if isinstance(x, flashcl.QuantizedTensor) else None  # noqa: E731
    prob = DecodeProblem(b, h_q, h_kv, dk, dv, paged, q.dtype.name, fmt(k), fmt(v))
    kern = DecodeKernel(h, prob, choose_params(h, prob, params_for(h, prob, params, layout)).params,
                        tensor_cores=tensor_cores)
    kd, vd = (quantized_to_device(x, h.queue) if fmt(x) else cla.to_device(h.queue, x) for x in (k, v))
    qd, lens_d = cla.to_device(h.queue, q), cla.to_device(h.queue, lens)
    table_d = cla.to_device(h.queue, table) if paged else lens_d
    out = cla.to_device(h.queue, np.full((b, h_q, dv), np.nan, dtype=q.dtype))
    lse = cla.to_device(h.queue, np.full((b, h_q), np.nan, dtype=np.float32))
    for ev in kern(qd, kd, vd, out, lse, table_d, lens_d, dk ** -0.5, num_splits):
        ev.wait()
    return out.get(), lse.get()


def mma_k(k):
    """K as decode_mma.cl attends it: an int8 K's values q * scale in float32, not rounded to its
    float16 dtype (its row scale goes on the scores, outside the fp16 products;
    docs/quantized-formats.md, "What the kernels attend"); any other K as it is."""
    if isinstance(k, flashcl.QuantizedTensor) and k.fmt == "int8":
        return quant.dequantize(dataclasses.replace(k, dtype=np.dtype(np.float32)))
    return k


def check(got, q, k, v, table, lens, what):
    out, lse = got
    ref_out, ref_lse = reference.decode_attention(q, k, v, block_table=table, context_lens=lens,
                                                  return_lse=True)
    dtype = q.dtype.name
    assert_close(out, ref_out, dtype, f"{what}: out")
    finite = np.isfinite(ref_lse)
    assert np.array_equal(finite, np.isfinite(lse)), f"{what}: lse {lse} vs {ref_lse}"
    assert_close(lse[finite], ref_lse[finite], dtype, f"{what}: lse")


# --------------------------------------------------------------------------- the sampled grid

# (K format, V format, layout block size (None: contiguous), (H_q, H_kv), head dim, dtype)
CASES = [
    ("q8_0", "q8_0", 16, (8, 2), 128, "float16"),
    ("q4_0", "q4_0", 1, (4, 4), 64, "float32"),
    ("int8", "int8", None, (8, 1), 128, "float16"),
    ("q8_0", "q4_0", 64, (8, 1), 64, "float32"),
    ("int8", "q8_0", 16, (4, 2), 256, "float16"),
    ("q4_0", "int8", None, (2, 2), 256, "float32"),
    ("q8_0", None, 1, (8, 2), 64, "float16"),
    (None, "q4_0", 64, (4, 1), 128, "float16"),
    ("int8", None, 16, (6, 2), 64, "float32"),
]


@pytest.mark.parametrize("k_fmt,v_fmt,block_size,heads,d,dtype", CASES,
                         ids=lambda x: "plain" if x is None else str(x).replace(" ", ""))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_quantized_caches(cl_device, k_fmt, v_fmt, block_size, heads, d, dtype, layout):
    """Contexts of 1 key, a partial block and several tiles; single pass, split-k and more splits
    than tiles."""
    rng = np.random.default_rng(zlib.crc32(f"{k_fmt}{v_fmt}{block_size}{heads}{d}".encode()))
    h_q, h_kv = heads
    q, k, v, table, lens = _inputs(rng, 3, h_q, h_kv, d, d, [1, 37, 150], block_size, dtype, k_fmt, v_fmt)
    for splits in (1, 3, 40):
        got = run_quantized(cl_device, q, k, v, table, lens, splits, layout=layout)
        check(got, q, k, v, table, lens, f"K {k_fmt} V {v_fmt} bs {block_size} splits {splits}")


@pytest.mark.parametrize("dk, dv", [(40, 24), (8, 72)])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_int8_head_dims_of_any_multiple_of_8_in_float16(cl_device, dk, dv, layout):
    """A float16 lane reads 8 int8 values (one uint2): rows need 8-byte alignment, not 16."""
    rng = np.random.default_rng(dk * 1000 + dv)
    q, k, v, table, lens = _inputs(rng, 2, 4, 2, dk, dv, [1, 37], 16, "float16", "int8", "int8")
    for splits in (1, 3):
        got = run_quantized(cl_device, q, k, v, table, lens, splits, layout=layout)
        check(got, q, k, v, table, lens, f"int8 DK {dk} DV {dv} splits {splits}")


def test_staged_tile_and_dk_ne_dv(cl_device):
    """The K/V tile staged in local memory for two head tiles (HEAD_TILE < G) carries the packed
    quant pieces unchanged; DK != DV (a lane reads K only, another V only)."""
    rng = np.random.default_rng(11)
    q, k, v, table, lens = _inputs(rng, 2, 8, 2, 128, 64, [70, 9], 16, "float16", "q4_0", "int8")
    for splits in (1, 4):
        got = run_quantized(cl_device, q, k, v, table, lens, splits,
                            params={"ROWS": 4, "UNROLL": 2, "HEAD_TILE": 2, "MERGE_WG": 64})
        check(got, q, k, v, table, lens, f"staged splits {splits}")


def test_public_api_and_bad_block_ids(cl_device):
    """flashcl.decode takes QuantizedTensor caches (numpy data; and the oracle's answer), and a
    used block id out of range on a device-resident table gives that sequence NaN, not a read."""
    rng = np.random.default_rng(12)
    q, k, v, table, lens = _inputs(rng, 2, 4, 1, 64, 64, [40, 20], 16, "float32", "q8_0", "int8")
    out, lse = flashcl.decode(q, k, v, block_table=table, context_lens=lens, device=cl_device,
                              return_lse=True, window=(15, 0), softcap=20.0)
    ref_out, ref_lse = reference.decode_attention(q, k, v, block_table=table, context_lens=lens,
                                                  return_lse=True, window=(15, 0), softcap=20.0)
    assert_close(out, ref_out, "float32", "api out")
    assert_close(lse, ref_lse, "float32", "api lse")

    bad = table.copy()
    bad[1, 0] = 10_000
    out, lse = run_quantized(cl_device, q, k, v, bad, lens, 2)
    assert np.all(np.isnan(out[1])) and np.all(np.isnan(lse[1])), (out[1], lse[1])
    check((out[:1], lse[:1]), q[:1], k, v, table[:1], lens[:1], "the other sequence")


@pytest.mark.parametrize("k_fmt,v_fmt,dk,dv,block_size", [("q8_0", "q4_0", 128, 64, 16),
                                                          ("int8", "q8_0", 32, 128, None),
                                                          ("q4_0", "int8", 64, 128, 1),
                                                          ("q4_0", "q8_0", 128, 128, 16),
                                                          ("q8_0", "q4_0", 256, 128, None),
                                                          ("int8", "int8", 128, 128, 16),
                                                          ("q4_0", "q4_0", 128, 128, 16)])
def test_tensor_core_kernel_emulated(cl_device, k_fmt, v_fmt, dk, dv, block_size):
    """decode_mma.cl's dequantized fragments (its warp instructions emulated): K quarters of
    two, one, half and a quarter ggml block, V eighths of 8 and 16 dims; int8 K as integers with
    the row scales on the scores, V read a tile ahead; G = 5 (padding heads in the MMAs' n-tile)."""
    rng = np.random.default_rng(zlib.crc32(f"{k_fmt}{v_fmt}{dk}".encode()))
    # 300 keys in one split: 5 rounds of 64, so the loads (and table entries) read ahead in the loop
    q, k, v, table, lens = _inputs(rng, 2, 10, 2, dk, dv, [300, 9], block_size, "float16", k_fmt, v_fmt)
    for splits in (1, 3):
        got = run_quantized(cl_device, q, k, v, table, lens, splits, tensor_cores="emulate")
        check(got, q, mma_k(k), v, table, lens, f"decode_mma.cl emulated K {k_fmt} V {v_fmt} splits {splits}")


@pytest.mark.parametrize("k_fmt,dk", [("q8_0", 96), ("q4_0", 160), ("int8", 224), ("q8_0", 192)])
def test_tensor_core_kernel_takes_no_split_blocks(cl_device, k_fmt, dk):
    """A quantized K of DK 96 (Phi-3), 160, 192 or 224: a work-item's quarter of the row would
    straddle ggml blocks (int8: miss its 16-byte alignment), so decode_mma.cl does not take it,
    decode.cl does, exactly; a plain K of that DK still takes decode_mma.cl."""
    assert not _mma_shape_ok(DecodeProblem(2, 10, 2, dk, 64, True, "float16", k_fmt, "q8_0"))
    assert _mma_shape_ok(DecodeProblem(2, 10, 2, dk, 64, True, "float16", None, "q8_0"))
    rng = np.random.default_rng(dk)
    q, k, v, table, lens = _inputs(rng, 2, 10, 2, dk, 64, [70, 9], 16, "float16", k_fmt, "q8_0")
    with pytest.raises(ValueError, match="quantized K"):
        run_quantized(cl_device, q, k, v, table, lens, 2, tensor_cores="emulate")
    check(run_quantized(cl_device, q, k, v, table, lens, 2), q, k, v, table, lens, f"DK {dk} K {k_fmt}")


@pytest.mark.parametrize("k_fmt,v_fmt", [("q8_0", "q4_0"), ("int8", "int8")])
def test_tensor_core_kernel_emulated_bad_block_id(cl_device, k_fmt, v_fmt):
    """decode_mma.cl (emulated): a used block id out of range gives that sequence NaN and reads
    nothing; the table entries read a tile ahead of their rows leave the other sequence exact."""
    rng = np.random.default_rng(14)
    q, k, v, table, lens = _inputs(rng, 2, 10, 2, 128, 128, [70, 300], 16, "float16", k_fmt, v_fmt)
    for block, splits in ((2, 2), (9, 1)):  # in the first round; one read ahead inside the loop
        bad = table.copy()
        bad[1, block] = -3
        out, lse = run_quantized(cl_device, q, k, v, bad, lens, splits, tensor_cores="emulate")
        assert np.all(np.isnan(out[1])) and np.all(np.isnan(lse[1])), (block, out[1], lse[1])
        check((out[:1], lse[:1]), q[:1], mma_k(k), v, table[:1], lens[:1],
              f"the other sequence (block {block})")


def test_errors(cl_device):
    """A format decode.cl cannot read, and non-contiguous int8 data, fail before launch."""
    h = get_device(cl_device)
    rng = np.random.default_rng(13)
    q, k, v, _, lens = _inputs(rng, 1, 2, 1, 64, 64, [10], None, "float32", "int8", None)
    kd = quantized_to_device(k, h.queue)
    strided = flashcl.QuantizedTensor(kd.data[:, :, ::2], kd.scales[:, :, ::2], "int8",
                                      (1, 1, kd.shape[2] // 2 + kd.shape[2] % 2, 64), k.dtype)
    prob = DecodeProblem(1, 2, 1, 64, 64, False, "float32", "int8", None)
    kern = DecodeKernel(h, prob, choose_params(h, prob).params)
    qd, ld, vd = cla.to_device(h.queue, q), cla.to_device(h.queue, lens), cla.to_device(h.queue, v)
    out, lse = cla.empty(h.queue, (1, 2, 64), np.float32), cla.empty(h.queue, (1, 2), np.float32)
    with pytest.raises(ValueError, match="C-contiguous"):
        kern(qd, strided, vd, out, lse, ld, ld, 0.125, 1)
    fp8 = flashcl.QuantizedTensor(None, None, "fp8_e4m3", (1, 1, 10, 64), np.float32)
    with pytest.raises(TypeError, match="fp8_e4m3"):
        from flashcl.opencl.decode import _quant_format
        _quant_format(fp8, "k_cache")


# --------------------------------------------------------------------------- Oclgrind

def _oclgrind_worker(spec_json: str) -> None:
    """One tiny case on the Oclgrind device (in a subprocess started by test_under_oclgrind)."""
    import pyopencl.characterize

    pyopencl.characterize.nv_compute_capability = lambda dev: None  # see tests/test_oclgrind.py
    spec = json.loads(spec_json)
    rng = np.random.default_rng(zlib.crc32(spec_json.encode()))
    dk, dv = spec.get("dk", 32), spec.get("dv", 32)
    q, k, v, table, lens = _inputs(rng, 2, 4, 2, dk, dv, spec.get("lens", [5, 19]), spec["block_size"],
                                   spec["dtype"], spec["fmt"], spec["fmt"])
    for splits in (1, 3):
        got = run_quantized("oclgrind", q, k, v, table, lens, splits,
                            params=spec.get("params", {"ROWS": 2, "UNROLL": 2, "HEAD_TILE": 2, "MERGE_WG": 16}),
                            tensor_cores=spec.get("tensor_cores"))
        check(got, q, k, v, table, lens, f"oclgrind {spec}")
    print("OCLGRIND-CASE-OK")


def _oclgrind_present() -> bool:
    from tests.test_oclgrind import _oclgrind_present as present

    return present()


@pytest.mark.slow
@pytest.mark.parametrize("spec", [{"fmt": "q8_0", "block_size": 4, "dtype": "float16"},
                                  {"fmt": "q4_0", "block_size": None, "dtype": "float32"},
                                  {"fmt": "int8", "block_size": 8, "dtype": "float16"},
                                  {"fmt": "int8", "block_size": 8, "dtype": "float16", "dk": 40, "dv": 24},
                                  # decode_cpu.cl: two ggml pieces a 16-wide vector (race and API checks
                                  # only: tests/test_oclgrind.py, NO_UNINIT_CHECK_VEC16), one piece an
                                  # 8-wide one; int8 rows 8 at a time
                                  {"fmt": "q4_0", "block_size": 4, "dtype": "float32", "dv": 32,
                                   "params": {"VARIANT": "rows", "BLOCK_N": 3, "VEC": 16, "MERGE_WG": 16},
                                   "env": {"OCLGRIND_UNINITIALIZED": "0"}},
                                  {"fmt": "q8_0", "block_size": 4, "dtype": "float16", "dv": 32,
                                   "params": {"VARIANT": "rows", "BLOCK_N": 3, "VEC": 8, "MERGE_WG": 16}},
                                  {"fmt": "int8", "block_size": None, "dtype": "float32",
                                   "params": {"VARIANT": "rows", "BLOCK_N": 8, "VEC": 8, "MERGE_WG": 16}},
                                  # decode_mma.cl's loads (its warp instructions emulated)
                                  {"fmt": "q8_0", "block_size": 16, "dtype": "float16", "dv": 64,
                                   "tensor_cores": "emulate"},
                                  {"fmt": "q4_0", "block_size": None, "dtype": "float16", "dv": 64,
                                   "tensor_cores": "emulate"},
                                  # whole-block K spans (3 chunks for q8_0), loads ahead in the loop
                                  {"fmt": "q8_0", "block_size": 16, "dtype": "float16", "dk": 128, "dv": 128,
                                   "lens": [150, 3], "tensor_cores": "emulate"}],
                         ids=lambda s: s["fmt"] + ("-mma-emulated" if s.get("tensor_cores") else
                                                   "-rows" if s.get("params") else ""))
def test_under_oclgrind(spec, tmp_path):
    """Races, out-of-bounds and uninitialized reads in the quantized loads (Oclgrind's checks,
    tests/test_oclgrind.py's settings); any report fails."""
    if not _oclgrind_present():
        pytest.skip("Oclgrind is not installed (pip install 'flashcl[oclgrind]')")
    from tests.test_oclgrind import run_under_oclgrind

    run_under_oclgrind("tests.test_quant_decode_opencl:_oclgrind_worker", json.dumps(spec), str(spec), tmp_path,
                       spec.get("env"))

