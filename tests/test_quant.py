"""Quantized KV formats: ggml's q8_0/q4_0 bytes written out by hand, for every input kind (NumPy,
torch through the torch ops that CUDA runs, pyopencl), round-trip error bounds per format, each
kind in -> the same kind out, paged and contiguous caches, and writes into a paged cache."""

import struct
from decimal import ROUND_HALF_UP, Decimal
from typing import Callable, NamedTuple

import numpy as np
import pytest

import flashcl
from flashcl import reference as ref
from flashcl.quant import FORMATS, QK, QuantizedTensor, check_layout

torch = pytest.importorskip("torch")


class Kind(NamedTuple):
    name: str
    wrap: Callable        # numpy -> an array of this kind


def _host(x) -> np.ndarray:
    """Any kind -> numpy; a strided pyopencl view (ggml scales) is read through its buffer."""
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu()
        return (x.float() if x.dtype == torch.float8_e4m3fn else x).numpy()
    if type(x).__module__.startswith("pyopencl"):
        import pyopencl as cl
        raw = np.empty(x.base_data.size, np.uint8)
        cl.enqueue_copy(x.queue, raw, x.base_data)
        return np.ndarray(x.shape, x.dtype, buffer=raw, offset=x.offset, strides=x.strides).copy()
    return np.asarray(x)


@pytest.fixture(params=["numpy", "torch", "cl"])
def kind(request) -> Kind:
    """The input kinds quantize serves: torch on the CPU runs the same torch ops as on CUDA; cl
    is a pyopencl Array on the first OpenCL CPU device's queue."""
    if request.param == "numpy":
        return Kind("numpy", lambda a: a)
    if request.param == "torch":
        return Kind("torch", lambda a: torch.from_numpy(np.ascontiguousarray(a)))
    import pyopencl.array as cla
    from flashcl.opencl.runtime import get_device
    queue = get_device(request.getfixturevalue("cpu_device")).queue
    return Kind("cl", lambda a: cla.to_device(queue, np.ascontiguousarray(a)))


def _bytes(qt) -> bytes:
    return _host(qt.data).tobytes()


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

def test_q8_0_block_bytes_by_hand(kind):
    x = np.arange(32, dtype=np.float32)           # amax 31: d = 31/127, q = roundf(j * 127/31)
    qs = [0, 4, 8, 12, 16, 20, 25, 29, 33, 37, 41, 45, 49, 53, 57, 61,
          66, 70, 74, 78, 82, 86, 90, 94, 98, 102, 107, 111, 115, 119, 123, 127]
    qt = flashcl.quantize(kind.wrap(x), "q8_0")
    assert tuple(qt.data.shape) == (1, 34) and _host(qt.data).dtype == np.uint8
    assert _bytes(qt) == struct.pack("<e", 31 / 127) + struct.pack("32b", *qs)


def test_q8_0_rounds_halves_away_from_zero(kind):
    x = np.zeros(32, np.float32)
    x[:6] = [127, 2.5, -2.5, 0.5, -0.5, 1.5]     # d = 1: every x/d is exact
    qt = flashcl.quantize(kind.wrap(x), "q8_0")
    assert _bytes(qt) == struct.pack("<e", 1.0) + struct.pack("32b", 127, 3, -3, 1, -1, 2, *[0] * 26)


def test_q4_0_block_bytes_by_hand(kind):
    x = np.arange(32, dtype=np.float32)           # max 31: d = -3.875, q = min(15, floor(8.5 - j/3.875))
    q = [8, 8, 7, 7, 7, 7, 6, 6, 6, 6, 5, 5, 5, 5, 4, 4,
         4, 4, 3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0]
    packed = bytes(q[j] | (q[j + 16] << 4) for j in range(16))
    qt = flashcl.quantize(kind.wrap(x), "q4_0")
    assert tuple(qt.data.shape) == (1, 18)
    assert _bytes(qt) == struct.pack("<e", -3.875) + packed
    np.testing.assert_array_equal(_host(flashcl.dequantize(qt)), (np.array(q, np.float32) - 8) * -3.875)


@pytest.mark.parametrize("first, d", [(5.0, -0.625), (-5.0, 0.625)])
def test_q4_0_scale_is_the_first_signed_max(kind, first, d):
    x = np.zeros(32, np.float32)
    x[3], x[20] = first, -first
    qt = flashcl.quantize(kind.wrap(x), "q4_0")
    assert float(_host(qt.scales)[0]) == d
    assert _host(flashcl.dequantize(qt))[3] == first     # the max itself is exact: q = 0 -> -8 * d


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "int8"])
def test_all_zero_blocks(kind, fmt):
    x = _kv((3, 64))
    x[1] = 0
    x[2, :32] = 0
    x[1, 0] = -0.0                                # a leading negative zero does not change ggml's d
    qt = flashcl.quantize(kind.wrap(x), fmt)
    out = _host(flashcl.dequantize(qt))
    assert np.all(out[1] == 0) and np.all(out[2, :32] == 0) and np.isfinite(out).all()
    if fmt in ("q8_0", "q4_0"):
        # q8_0: d = +0 and q = 0; q4_0: d = 0 / -8 = -0 (fp16 0x8000) and nibbles 8, as in ggml
        block = (b"\x00\x00" + bytes(QK)) if fmt == "q8_0" else (b"\x00\x80" + b"\x88" * (QK // 2))
        data = _host(qt.data)
        assert data[1].tobytes() == block * 2 and data[2, 0].tobytes() == block


def test_fp8_all_zero_blocks():
    x = _kv((3, 64))
    x[1] = 0
    out = flashcl.dequantize(flashcl.quantize(x, "fp8_e4m3"))
    assert np.all(out[1] == 0) and np.isfinite(out).all()


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


def _hard_blocks(n: int, seed: int) -> np.ndarray:
    """(n, 32) blocks that stress a quantizer: magnitudes from 1e-30 to 1e5 (fp16-subnormal and
    zero d included; q4_0's d = max/8 must stay below fp16's 65504), exact halves of a step,
    equal maxima of both signs, all-zero blocks."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, QK)).astype(np.float32)
    x *= (10.0 ** rng.uniform(-30, 5, (n, 1))).astype(np.float32)
    step = (2.0 ** rng.integers(-30, 8, (n, 1))).astype(np.float32)
    halves = (rng.integers(-127, 127, (n, QK)) + np.float32(0.5)) * step
    halves[:, 0] = 127 * step[:, 0]                       # d = step exactly: x/d is k + 1/2
    x[1::5] = halves[1::5]
    tie = np.abs(x[2::5]).max(-1)                           # the max magnitude twice, both signs
    x[2::5, 7], x[2::5, 3] = -tie, tie
    x[3::5] = np.round(x[3::5] / step[3::5]) * step[3::5]   # integer multiples of a power of two
    x[4::10] = 0
    tight = _last_bit_blocks(rng)
    x[0::5] = tight[np.arange(len(x[0::5])) % len(tight)]
    return x


def _last_bit_blocks(rng) -> np.ndarray:
    """q8_0 blocks whose qs change when d = amax/127 is off in its last bit (as a product with
    the reciprocal of 127 would make it): values within 3 ulps of (k + 1/2) d."""
    amax = (rng.uniform(1, 2, 2000) * 2.0 ** rng.integers(-20, 10, 2000)).astype(np.float32)
    d = amax / np.float32(127)
    off = amax * (np.float32(1) / np.float32(127))
    amax, d, off = amax[d != off], d[d != off], off[d != off]
    half_steps = ((np.arange(127, dtype=np.float32) + np.float32(0.5))[None, :] * d[:, None]).astype(np.float32)
    inv_d, inv_off = (np.float32(1) / d)[:, None], (np.float32(1) / off)[:, None]
    blocks = np.zeros((len(amax), QK), np.float32)
    blocks[:, 0] = amax
    filled = np.ones(len(amax), int)
    for ulps in range(-3, 4):
        x = (half_steps.view(np.int32) + ulps).view(np.float32)
        flips = np.floor(x * inv_d + np.float32(0.5)) != np.floor(x * inv_off + np.float32(0.5))
        for row, col in zip(*np.nonzero(flips)):
            if filled[row] < QK:
                blocks[row, filled[row]] = x[row, col] * (1 if (row + col) % 2 else -1)
                filled[row] += 1
    return blocks[filled == QK]


def _roundf(v: np.float32) -> int:
    return int(Decimal(float(v)).quantize(Decimal(1), rounding=ROUND_HALF_UP))   # ties away from 0


def _ggml_row_ref(x: np.ndarray, fmt: str) -> bytes:
    """quantize_row_q8_0_ref / quantize_row_q4_0_ref transliterated, one float32 scalar at a time."""
    out = b""
    for blk in x.reshape(-1, QK).astype(np.float32):
        amax, mx = np.float32(0), np.float32(0)
        for v in blk:
            if amax < abs(v):                             # strict: the first of equal magnitudes
                amax, mx = abs(v), v
        d = amax / np.float32(127) if fmt == "q8_0" else mx / np.float32(-8)
        inv = np.float32(1) / d if d else np.float32(0)
        out += struct.pack("<e", float(d))
        if fmt == "q8_0":
            out += struct.pack("32b", *(_roundf(v * inv) for v in blk))
        else:
            q = [min(15, int(v * inv + np.float32(8.5))) for v in blk]   # (int8_t) truncates
            out += bytes(q[j] | (q[j + QK // 2] << 4) for j in range(QK // 2))
    return out


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
@pytest.mark.parametrize("kind_name", ["numpy", "torch"])
def test_ggml_bytes_match_a_scalar_transliteration(fmt, kind_name):
    x = _hard_blocks(240, seed=12).reshape(60, 4, 32)
    qt = flashcl.quantize(torch.from_numpy(x) if kind_name == "torch" else x, fmt)
    assert _bytes(qt) == _ggml_row_ref(x, fmt)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "int8", "fp8_e4m3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_torch_ops_give_the_numpy_bytes(fmt, dtype):
    """The torch path (the one CUDA tensors take; CPU tensors quantize through NumPy) against the
    NumPy path, byte for byte."""
    hard = _hard_blocks(400, seed=7) if dtype != torch.float16 else _kv((400, QK), seed=8)
    x = torch.from_numpy(hard.reshape(50, 4, 64)).to(dtype)
    got = flashcl.quant._quantize(x, fmt, str(dtype).removeprefix("torch."), torch_ops=True)
    want = flashcl.quantize(x.float().numpy(), fmt)
    assert torch.equal(flashcl.quantize(x, fmt).data.view(torch.uint8), got.data.view(torch.uint8))
    np.testing.assert_array_equal(_host(got.data), _host(want.data))
    np.testing.assert_array_equal(_host(got.scales), _host(want.scales))
    back = flashcl.dequantize(got)
    assert back.dtype == dtype
    assert torch.equal(back, torch.from_numpy(np.asarray(flashcl.dequantize(want), np.float32)).to(dtype))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "int8", "fp8_e4m3"])
def test_cuda_stays_on_device_with_the_numpy_bytes(fmt):
    x = torch.from_numpy(_hard_blocks(4000, seed=9).reshape(500, 4, 64))
    if fmt == "fp8_e4m3":
        x = torch.from_numpy(_kv((500, 4, 64), seed=10))
    on_device = x.cuda()                                   # (a copy from pageable memory syncs)
    torch.cuda.set_sync_debug_mode("error")              # any host sync below raises
    try:
        got = flashcl.quantize(on_device, fmt)
        back = flashcl.dequantize(got)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert got.data.is_cuda and got.scales.is_cuda and back.is_cuda
    want = flashcl.quantize(x, fmt)
    assert torch.equal(got.data.cpu().view(torch.uint8), want.data.view(torch.uint8))
    assert torch.equal(back.cpu(), flashcl.dequantize(want))


@pytest.mark.parametrize("fmt, d", [("q8_0", 64), ("q8_0", 96), ("q4_0", 64), ("q4_0", 96), ("int8", 64),
                                    ("int8", 80)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # NumPy under the interpreter: both sides of tl.where
def test_the_triton_quantizer_writes_the_numpy_bytes_into_room(fmt, d, dtype, triton_device):
    """flashcl/triton/quantize.py (how CUDA tensors quantize, and write_tokens writes them) puts
    tokens into a buffer's room with the bytes NumPy gives the whole tensor, the tokens around
    them untouched; rows holding NaN or inf dequantize as torch's ops' do, and blocks too small
    for 1/d as NumPy's."""
    from flashcl.triton.quantize import quantize_rows

    n = 50 * 4 * d
    hard = _hard_blocks(n // QK, seed=7) if dtype != torch.float16 else _kv((n // QK, QK), seed=8)
    x = torch.from_numpy(hard.reshape(50, 4, d)).to(dtype)
    want = flashcl.quantize(x, fmt)
    buf = flashcl.quant.with_room(flashcl.quantize(x[:, :2].to(triton_device), fmt), 9)
    quantize_rows(x[:, 2:].to(triton_device), fmt, buf.data, buf.scales if fmt == "int8" else None, at=5)
    for (start, stop), (w_start, w_stop) in (((0, 2), (0, 2)), ((5, 7), (2, 4))):
        got, expected = flashcl.quant.tokens(buf, start, stop), flashcl.quant.tokens(want, w_start, w_stop)
        assert torch.equal(got.data.cpu().view(torch.uint8), expected.data.view(torch.uint8)), (start, stop)
        assert torch.equal(got.scales.cpu(), expected.scales)
    assert not flashcl.quant.tokens(buf, 2, 5).data.any() and not flashcl.quant.tokens(buf, 7, 9).data.any()
    # a whole tensor as flashcl.quantize quantizes a CUDA one (here on the interpreter's CPU, too)
    whole = flashcl.quant._quantize_on_cuda(x.to(triton_device), fmt, flashcl.quant._cuda_quantizer())
    check_layout(whole, "whole")
    assert torch.equal(whole.data.cpu().view(torch.uint8), want.data.view(torch.uint8))
    assert torch.equal(whole.scales.cpu(), want.scales) and whole.shape == want.shape and whole.dtype == dtype
    special = torch.randn(3, 2, d, generator=torch.Generator().manual_seed(3))
    special[0, 0, 3], special[1, 1, d - 1], special[2, 0, :32] = float("nan"), float("inf"), 0.0
    special = special.to(dtype)
    out = flashcl.quant.with_room(flashcl.quantize(special[:, :0].to(triton_device), fmt), 2)
    quantize_rows(special.to(triton_device), fmt, out.data, out.scales if fmt == "int8" else None)
    torch_ops = flashcl.quant._quantize(special, fmt, str(dtype).removeprefix("torch."), torch_ops=True)
    # the same values, NaN where torch's has NaN (a NaN's sign and payload may differ)
    torch.testing.assert_close(flashcl.dequantize(out).cpu(), flashcl.dequantize(torch_ops), rtol=0, atol=0,
                               equal_nan=True)
    # magnitudes under ~4e-37, where 1/d overflows: q4_0 and int8 bytes as NumPy's; q8_0 (whose q
    # there is C's undefined conversion of an infinity) dequantizes to zeros as NumPy's does
    tiny = special.nan_to_num(0.0, 0.0, 0.0).float() * 1e-38  # float32: bf16 would make them subnormal
    out = flashcl.quant.with_room(flashcl.quantize(tiny[:, :0].to(triton_device), fmt), 2)
    quantize_rows(tiny.to(triton_device), fmt, out.data, out.scales if fmt == "int8" else None)
    host = flashcl.quantize(tiny, fmt)
    if fmt != "q8_0":
        assert torch.equal(out.data.cpu().view(torch.uint8), host.data.view(torch.uint8))
    assert torch.equal(flashcl.dequantize(out).cpu(), flashcl.dequantize(host))


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "int8"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_pyopencl_in_pyopencl_out(cpu_device, fmt, dtype):
    import pyopencl.array as cla
    from flashcl.opencl.runtime import get_device
    queue = get_device(cpu_device).queue
    x = _kv((3, 5, 2, 64), seed=11).astype(dtype)
    qt = flashcl.quantize(cla.to_device(queue, x), fmt)
    want = flashcl.quantize(x, fmt)
    assert isinstance(qt.data, cla.Array) and isinstance(qt.scales, cla.Array)
    assert qt.data.queue is queue and qt.scales.queue is queue
    assert qt.shape == x.shape and qt.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(_host(qt.data), want.data)
    np.testing.assert_array_equal(_host(qt.scales), want.scales)   # ggml: a strided view into data
    out = flashcl.dequantize(qt)
    assert isinstance(out, cla.Array) and out.queue is queue and out.dtype == dtype
    np.testing.assert_array_equal(out.get(), flashcl.dequantize(want))


def test_fp8_refuses_pyopencl(cpu_device):
    import pyopencl.array as cla
    from flashcl.opencl.runtime import get_device
    x = cla.to_device(get_device(cpu_device).queue, _kv((2, 32)))
    with pytest.raises(TypeError, match="fp8_e4m3 is a torch format"):
        flashcl.quantize(x, "fp8_e4m3")


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


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("wrap", [np.asarray, torch.from_numpy], ids=["numpy", "torch"])
def test_strided_inputs_give_contiguous_parts(fmt, wrap):
    x = _kv((2, 5, 3, 64), seed=13)                         # stored (B, N, H, D), viewed (B, H, N, D)
    strided = wrap(x).transpose(1, 2) if wrap is torch.from_numpy else x.transpose(0, 2, 1, 3)
    qt = flashcl.quantize(strided, fmt)
    want = flashcl.quantize(np.ascontiguousarray(x.transpose(0, 2, 1, 3)), fmt)
    for part in (qt.data, qt.scales if fmt == "int8" else qt.data):
        assert part.is_contiguous() if isinstance(part, torch.Tensor) else part.flags.c_contiguous
    np.testing.assert_array_equal(_host(qt.data), _host(want.data))
    np.testing.assert_array_equal(_host(qt.scales), _host(want.scales))


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
@pytest.mark.parametrize("index_kind", ["host", "tensor"])
def test_quantize_into_paged_cache(kind, fmt, index_kind):
    nb, bs, h, d = 6, 4, 2, 64
    cache = _kv((nb, bs, h, d), seed=1)
    new = _kv((5, h, d), seed=2)
    block_ids, slots = np.array([5, 0, 3, 3, 1]), np.array([0, 3, 1, 2, 0])
    qt = flashcl.quantize(kind.wrap(cache), fmt)
    untouched = _host(qt.data).copy()
    if index_kind == "tensor":       # indices of the cache's kind (a torch cache: no host copy)
        block_ids, slots = kind.wrap(block_ids.astype(np.int32)), kind.wrap(slots.astype(np.int32))
    flashcl.quantize_into(qt, block_ids, slots, kind.wrap(new))
    expect = cache.copy()
    expect[_host(block_ids), _host(slots)] = new
    want = flashcl.quantize(expect, fmt)
    got_data = _host(qt.data)
    np.testing.assert_array_equal(got_data, want.data)
    np.testing.assert_array_equal(_host(qt.scales), want.scales)   # ggml scales are views: they follow
    assert (got_data != untouched).any()


def test_quantize_into_moves_new_tokens_to_the_cache_kind():
    """numpy tokens into a torch cache and torch (bfloat16) tokens into a numpy cache."""
    cache, new = _kv((3, 2, 2, 32), seed=3), _kv((2, 2, 32), seed=4)
    expect = cache.copy()
    expect[[2, 0], [1, 1]] = new
    into_torch = flashcl.quantize(torch.from_numpy(cache), "q8_0")
    flashcl.quantize_into(into_torch, [2, 0], [1, 1], new)
    np.testing.assert_array_equal(into_torch.data.numpy(), flashcl.quantize(expect, "q8_0").data)
    into_numpy = flashcl.quantize(cache, "int8")
    flashcl.quantize_into(into_numpy, [2, 0], [1, 1], torch.from_numpy(new).bfloat16())
    expect[[2, 0], [1, 1]] = torch.from_numpy(new).bfloat16().float().numpy()
    np.testing.assert_array_equal(into_numpy.data, flashcl.quantize(expect, "int8").data)


@pytest.mark.parametrize("block_ids, slots, match", [
    ([0, 6], [0, 0], r"block_ids: values must lie in \[0, 6\), got 0..6"),
    ([0, 1], [-1, 0], r"slots: values must lie in \[0, 4\), got -1..0"),
    ([0], [0, 1], r"block_ids: expected 2 integers \(one per token\)"),
    ([0.0, 1.0], [0, 1], r"block_ids: expected 2 integers"),
])
def test_quantize_into_checks_host_indices(block_ids, slots, match):
    qt = flashcl.quantize(_kv((6, 4, 2, 32)), "q4_0")
    before = qt.data.copy()
    with pytest.raises(ValueError, match=match):
        flashcl.quantize_into(qt, block_ids, slots, _kv((2, 2, 32)))
    np.testing.assert_array_equal(qt.data, before)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "int8"])
def test_quantize_into_on_cuda_does_not_sync(fmt):
    cache, new = _kv((64, 16, 4, 128), seed=5), _kv((8, 4, 128), seed=6)
    block_ids, slots = np.arange(8) * 7 % 64, np.arange(8) % 16
    qt = flashcl.quantize(torch.from_numpy(cache).cuda(), fmt)
    ids_d, slots_d = torch.from_numpy(block_ids).cuda(), torch.from_numpy(slots).cuda()
    new_d = torch.from_numpy(new).cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")              # a decode step: any host sync raises
    try:
        flashcl.quantize_into(qt, ids_d, slots_d, new_d)
        flashcl.quantize_into(qt, block_ids, slots, new_d)   # host indices: pinned, no wait
    finally:
        torch.cuda.set_sync_debug_mode("default")
    expect = cache.copy()
    expect[block_ids, slots] = new
    assert torch.equal(qt.data.cpu(), flashcl.quantize(torch.from_numpy(expect), fmt).data)


def test_quantize_into_refuses_fp8_and_bad_shapes():
    qt = flashcl.quantize(_kv((2, 4, 2, 32)), "fp8_e4m3")
    with pytest.raises(ValueError, match="per tensor"):
        flashcl.quantize_into(qt, [0], [0], _kv((1, 2, 32)))
    qt = flashcl.quantize(_kv((2, 4, 2, 32)), "int8")
    with pytest.raises(ValueError, match="paged cache"):
        flashcl.quantize_into(qt, [0], [0], _kv((1, 3, 32)))


# --- a QuantizedTensor's parts agree with its format and shape ---

@pytest.mark.parametrize("fmt", FORMATS)
def test_check_layout_accepts_what_quantize_makes(fmt):
    check_layout(flashcl.quantize(_kv((3, 4, 64)), fmt), "k")


@pytest.mark.parametrize("fmt, part, bad, match", [
    ("q8_0", "data", np.zeros((3, 4, 2, 33), np.uint8), r"k: a q8_0 QuantizedTensor of shape \(3, 4, 64\) needs data uint8 \(3, 4, 2, 34\), got uint8 \(3, 4, 2, 33\)"),
    ("q4_0", "data", np.zeros((3, 4, 2, 18), np.int8), r"needs data uint8 \(3, 4, 2, 18\), got int8"),
    ("int8", "scales", np.zeros((3, 4), np.float32), r"needs scales float32 \(3, 4, 1\), got float32 \(3, 4\)"),
    ("int8", "scales", torch.zeros((3, 4, 1)), r"data and scales are of different kinds"),
    ("q5_0", "data", np.zeros(1), r"unknown quantized format 'q5_0'"),
])
def test_check_layout_names_the_part_that_does_not_fit(fmt, part, bad, match):
    qt = flashcl.quantize(_kv((3, 4, 64)), "int8" if fmt == "int8" else ("q4_0" if fmt == "q4_0" else "q8_0"))
    fields = dict(data=qt.data, scales=qt.scales, fmt=fmt, shape=qt.shape, dtype=qt.dtype)
    fields[part] = bad
    with pytest.raises((ValueError, TypeError), match=match):
        check_layout(QuantizedTensor(**fields), "k")


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


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "int8"])
def test_tokens_written_into_room_are_the_quantized_whole(fmt):
    """with_room keeps a cache's tokens and zeros after them; write_tokens quantizes new tokens
    into them in place, giving the bytes of quantizing the whole tensor (scales per block or row:
    the cached tokens keep theirs); tokens copies or views a range of them, select_batch a batch's
    sequences, the ggml scales staying views of the data. fp8_e4m3, other shapes, dtypes and
    ranges are refused."""
    torch = pytest.importorskip("torch")
    x = torch.randn(2, 3, 11, 64) * torch.logspace(-2, 2, 11)[:, None]
    buf = flashcl.quant.with_room(flashcl.quantize(x[:, :, :4], fmt), 16)
    assert buf.shape == (2, 3, 16, 64) and not buf.data.narrow(2, 4, 12).any()
    flashcl.quant.write_tokens(buf, 4, x[:, :, 4:])
    whole = flashcl.quantize(x, fmt)
    view = flashcl.quant.tokens(buf, 0, 11, copy=False)
    middle = flashcl.quant.tokens(buf, 3, 9, copy=False)
    assert view.data.data_ptr() == buf.data.data_ptr()
    assert middle.data.untyped_storage().data_ptr() == buf.data.data_ptr()
    beams = torch.tensor([1, 1, 0])
    for got, want in ((view, whole), (flashcl.quant.tokens(whole, 0, 5), flashcl.quantize(x[:, :, :5], fmt)),
                      (middle, flashcl.quantize(x[:, :, 3:9], fmt)),
                      (flashcl.quant.select_batch(middle, beams), flashcl.quantize(x[beams, :, 3:9], fmt))):
        check_layout(got, "got")
        assert got.shape == want.shape and got.dtype == want.dtype
        assert torch.equal(got.data, want.data) and torch.equal(got.scales, want.scales)
        if fmt != "int8":
            assert got.scales.data_ptr() == got.data.data_ptr()
    with pytest.raises(ValueError, match="one scale per tensor"):
        flashcl.quant.write_tokens(flashcl.quantize(x, "fp8_e4m3"), 0, x)
    for at, tokens in ((14, x[:, :, :4]), (0, x[:, :2])):
        with pytest.raises(ValueError, match="write_tokens"):
            flashcl.quant.write_tokens(buf, at, tokens)
    with pytest.raises(TypeError, match="float32"):
        flashcl.quant.write_tokens(buf, 11, x[:, :, :1].half())
    with pytest.raises(ValueError, match="cannot hold"):
        flashcl.quant.with_room(whole, 5)
    for start, stop in ((0, 12), (6, 5), (-1, 3)):
        with pytest.raises(ValueError, match=r"tokens: \[" + str(start)):
            flashcl.quant.tokens(whole, start, stop)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "int8"])
def test_empty_torch_tensors_quantize_and_write(fmt):
    """No tokens quantize to empty parts with torch's own strides (the ggml scales a view of them),
    and writing no tokens leaves the cache's bytes."""
    torch = pytest.importorskip("torch")
    empty = flashcl.quantize(torch.randn(2, 3, 0, 64), fmt)
    check_layout(empty, "empty")
    assert empty.data.is_contiguous() and empty.shape == (2, 3, 0, 64)
    qt = flashcl.quantize(torch.randn(2, 3, 4, 64), fmt)
    before = qt.data.clone()
    flashcl.quant.write_tokens(qt, 4, torch.randn(2, 3, 0, 64))
    assert torch.equal(qt.data, before)
