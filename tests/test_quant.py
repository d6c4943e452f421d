"""Quantized KV formats: ggml's q8_0/q4_0 bytes written out by hand, round-trip error bounds per
format, torch in -> torch out, paged and contiguous caches, and writes into a paged cache."""

import struct

import numpy as np
import pytest

import flashcl
from flashcl import reference as ref
from flashcl.quant import FORMATS, QK

torch = pytest.importorskip("torch")


def _kv(shape, seed=0, spread=True):
    """Random values whose magnitude changes by up to 1e4 from one 32-block to the next."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32)
    if spread:
        blocks = x.reshape(*shape[:-1], shape[-1] // QK, QK)
        blocks *= (10.0 ** rng.uniform(-2, 2, blocks.shape[:-1] + (1,))).astype(np.float32)
    return x


def _assert_within(err, bound, what):
    bad = np.argwhere(err > bound)
    assert bad.size == 0, (f"{what}: {len(bad)} elements over the bound, first at {tuple(bad[0])}: "
                           f"error {err[tuple(bad[0])]:.3g} > bound {bound[tuple(bad[0])]:.3g}")


# --- ggml's bytes, worked out by hand from quantize_row_q8_0_ref / quantize_row_q4_0_ref ---

def test_q8_0_block_bytes_by_hand():
    x = np.arange(32, dtype=np.float32)           # amax 31: d = 31/127, q = roundf(j * 127/31)
    qs = [0, 4, 8, 12, 16, 20, 25, 29, 33, 37, 41, 45, 49, 53, 57, 61,
          66, 70, 74, 78, 82, 86, 90, 94, 98, 102, 107, 111, 115, 119, 123, 127]
    qt = flashcl.quantize(x, "q8_0")
    assert qt.data.shape == (1, 34) and qt.data.dtype == np.uint8
    assert qt.data.tobytes() == struct.pack("<e", 31 / 127) + struct.pack("32b", *qs)


def test_q8_0_rounds_halves_away_from_zero():
    x = np.zeros(32, np.float32)
    x[:6] = [127, 2.5, -2.5, 0.5, -0.5, 1.5]     # d = 1: every x/d is exact
    qt = flashcl.quantize(x, "q8_0")
    assert qt.data.tobytes() == struct.pack("<e", 1.0) + struct.pack("32b", 127, 3, -3, 1, -1, 2, *[0] * 26)


def test_q4_0_block_bytes_by_hand():
    x = np.arange(32, dtype=np.float32)           # max 31: d = -3.875, q = min(15, floor(8.5 - j/3.875))
    q = [8, 8, 7, 7, 7, 7, 6, 6, 6, 6, 5, 5, 5, 5, 4, 4,
         4, 4, 3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0]
    packed = bytes(q[j] | (q[j + 16] << 4) for j in range(16))
    qt = flashcl.quantize(x, "q4_0")
    assert qt.data.shape == (1, 18)
    assert qt.data.tobytes() == struct.pack("<e", -3.875) + packed
    np.testing.assert_array_equal(flashcl.dequantize(qt), (np.array(q, np.float32) - 8) * -3.875)


@pytest.mark.parametrize("first, d", [(5.0, -0.625), (-5.0, 0.625)])
def test_q4_0_scale_is_the_first_signed_max(first, d):
    x = np.zeros(32, np.float32)
    x[3], x[20] = first, -first
    qt = flashcl.quantize(x, "q4_0")
    assert float(qt.scales[0]) == d
    assert flashcl.dequantize(qt)[3] == first     # the max itself is exact: q = 0 -> -8 * d


@pytest.mark.parametrize("fmt", FORMATS)
def test_all_zero_blocks(fmt):
    x = _kv((3, 64))
    x[1] = 0
    x[2, :32] = 0
    x[1, 0] = -0.0                                # a leading negative zero does not change ggml's d
    qt = flashcl.quantize(x, fmt)
    out = flashcl.dequantize(qt)
    assert np.all(out[1] == 0) and np.all(out[2, :32] == 0) and np.isfinite(out).all()
    if fmt in ("q8_0", "q4_0"):
        # q8_0: d = +0 and q = 0; q4_0: d = 0 / -8 = -0 (fp16 0x8000) and nibbles 8, as in ggml
        block = (b"\x00\x00" + bytes(QK)) if fmt == "q8_0" else (b"\x00\x80" + b"\x88" * (QK // 2))
        assert qt.data[1].tobytes() == block * 2 and qt.data[2, 0].tobytes() == block


# --- round-trip error bounds ---

def test_q8_0_round_trip_within_half_a_step():
    x = _kv((2, 4, 7, 128))
    qt = flashcl.quantize(x, "q8_0")
    d32 = np.abs(x.reshape(2, 4, 7, 4, QK)).max(-1) / np.float32(127)
    d16 = qt.scales.astype(np.float32)
    # half a step, plus |q| <= 127 times the fp16 rounding of d
    bound = np.repeat(np.abs(d16) / 2 + 127 * np.abs(d16 - d32) + 1e-6 * np.abs(d16), QK, axis=-1)
    _assert_within(np.abs(flashcl.dequantize(qt) - x), bound, "q8_0")


def test_q4_0_round_trip_within_a_step():
    x = _kv((2, 4, 7, 64))
    qt = flashcl.quantize(x, "q4_0")
    d16 = np.abs(qt.scales.astype(np.float32))
    # half a step, except values near +8|d| that clamp to q = 15: up to one step; plus fp16 rounding
    bound = np.repeat(d16 * (1 + 2.0 ** -9), QK, axis=-1)
    _assert_within(np.abs(flashcl.dequantize(qt) - x), bound, "q4_0")


def test_int8_round_trip_within_half_a_step():
    x = _kv((2, 4, 7, 96), spread=False) * np.float32(30)
    qt = flashcl.quantize(x, "int8")
    assert qt.data.dtype == np.int8 and qt.scales.shape == (2, 4, 7, 1) and qt.scales.dtype == np.float32
    np.testing.assert_array_equal(qt.scales, np.abs(x).max(-1, keepdims=True) / np.float32(127))
    bound = np.broadcast_to(qt.scales * (0.5 + 1e-6), x.shape)
    _assert_within(np.abs(flashcl.dequantize(qt) - x), bound, "int8")


def test_fp8_round_trip_within_its_precision():
    x = _kv((2, 3, 5, 64), spread=False)
    qt = flashcl.quantize(x, "fp8_e4m3")
    assert qt.data.dtype == torch.float8_e4m3fn and qt.scales.shape == ()
    assert np.isclose(float(qt.scales), np.abs(x).max() / 448)
    err = np.abs(flashcl.dequantize(qt) - x)
    # 3 mantissa bits: relative 2^-4 for normals; subnormal step 2^-9 (times the scale) below
    _assert_within(err, np.maximum(np.abs(x) * 2.0 ** -4, 2.0 ** -10 * float(qt.scales)), "fp8_e4m3")


# --- kinds, dtypes and shapes ---

@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_torch_in_torch_out(fmt, dtype):
    x = torch.from_numpy(_kv((2, 2, 5, 64), spread=False)).to(dtype)
    qt = flashcl.quantize(x, fmt)
    out = flashcl.dequantize(qt)
    assert isinstance(out, torch.Tensor) and out.dtype == dtype and out.device == x.device
    assert out.shape == x.shape and qt.shape == tuple(x.shape) and qt.dtype == dtype
    assert isinstance(qt.data, torch.Tensor)
    # the same bytes as the numpy path on the float32 values
    np_qt = flashcl.quantize(x.float().numpy(), fmt)
    np.testing.assert_array_equal(qt.data.float().numpy() if fmt == "fp8_e4m3" else qt.data.numpy(),
                                  np_qt.data.float().numpy() if fmt == "fp8_e4m3" else np_qt.data)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", [(2, 3, 17, 64), (5, 16, 2, 32), (64,)],
                         ids=["contiguous", "paged", "one-row"])
def test_shapes_and_numpy_dtypes(fmt, shape):
    for dtype in (np.float32, np.float16):
        x = _kv(shape, spread=False).astype(dtype)
        qt = flashcl.quantize(x, fmt)
        out = flashcl.dequantize(qt)
        assert isinstance(out, np.ndarray) and out.dtype == dtype and out.shape == shape
        assert qt.axis == len(shape) - 1
        assert np.abs(out.astype(np.float32) - x).max() <= 0.15 * np.abs(x).max()


def test_q8_0_row_bytes_are_one_ggml_row():
    x = _kv((3, 2, 128))
    qt = flashcl.quantize(x, "q8_0")
    assert qt.data.shape == (3, 2, 4, 34)
    for i in range(4):                            # a row is its blocks back to back
        assert qt.data[1, 0].tobytes()[34 * i: 34 * (i + 1)] == flashcl.quantize(x[1, 0, 32 * i: 32 * (i + 1)], "q8_0").data.tobytes()


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
def test_bad_head_dim(fmt):
    with pytest.raises(ValueError, match="head dim 48 is not a multiple of 32"):
        flashcl.quantize(np.ones((2, 48), np.float32), fmt)


def test_unknown_format_and_dtype():
    with pytest.raises(ValueError, match="unknown quantized format"):
        flashcl.quantize(np.ones((2, 32), np.float32), "q5_0")
    with pytest.raises(TypeError, match="float32 or float16"):
        flashcl.quantize(np.ones((2, 32), np.int32), "int8")


def test_quantized_tensor_is_frozen():
    qt = flashcl.quantize(np.ones((2, 32), np.float32), "int8")
    with pytest.raises(Exception):
        qt.fmt = "q8_0"


# --- writing tokens into a quantized paged cache ---

@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "int8"])
@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_quantize_into_paged_cache(fmt, kind):
    nb, bs, h, d = 6, 4, 2, 64
    cache = _kv((nb, bs, h, d), seed=1)
    new = _kv((5, h, d), seed=2)
    block_ids, slots = np.array([5, 0, 3, 3, 1]), np.array([0, 3, 1, 2, 0])
    wrap = (lambda a: torch.from_numpy(a)) if kind == "torch" else (lambda a: a)
    qt = flashcl.quantize(wrap(cache), fmt)
    flashcl.quantize_into(qt, block_ids, slots, wrap(new))
    expect = cache.copy()
    expect[block_ids, slots] = new
    want = flashcl.quantize(expect, fmt)
    got_data = qt.data.numpy() if kind == "torch" else qt.data
    np.testing.assert_array_equal(got_data, want.data)
    got_scales = qt.scales.numpy() if kind == "torch" else qt.scales
    np.testing.assert_array_equal(got_scales, want.scales)   # ggml scales are views: they follow


def test_quantize_into_refuses_fp8_and_bad_shapes():
    qt = flashcl.quantize(_kv((2, 4, 2, 32)), "fp8_e4m3")
    with pytest.raises(ValueError, match="per tensor"):
        flashcl.quantize_into(qt, [0], [0], _kv((1, 2, 32)))
    qt = flashcl.quantize(_kv((2, 4, 2, 32)), "int8")
    with pytest.raises(ValueError, match="paged cache"):
        flashcl.quantize_into(qt, [0], [0], _kv((1, 3, 32)))


# --- the oracle on dequantized caches ---

def test_reference_decode_on_a_dequantized_paged_cache():
    rng = np.random.default_rng(3)
    k = _kv((6, 4, 2, 64), seed=4, spread=False)
    v = _kv((6, 4, 2, 64), seed=5, spread=False)
    q = rng.standard_normal((2, 4, 64))
    bt, lens = np.array([[2, 0, 5], [1, 4, 3]]), np.array([9, 12])
    kq, vq = flashcl.quantize(k, "q8_0"), flashcl.quantize(v, "q8_0")
    exact = ref.decode_attention(q, k, v, block_table=bt, context_lens=lens)
    quant = ref.decode_attention(q, flashcl.dequantize(kq), flashcl.dequantize(vq), block_table=bt, context_lens=lens)
    assert ref.rel_err(quant, exact) < 2e-2
