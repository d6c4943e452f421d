"""Regression tests of the API's edges that an audit of the contract found: window bounds past
int32, quantizing values a block's fp16 scale cannot hold, quantize_into's index and dtype checks,
strided pyopencl views, merge_states with empty parts that hold NaN, and float64 or non-finite
variant arrays."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import flashcl
from flashcl import reference
from flashcl.opencl.runtime import get_device

from ._check import TOL, rel_err


# --------------------------------------------------------------------------- window bounds

@pytest.mark.parametrize("window", [(0, 2**31 - 1), (2**31 - 1, 2**31 - 1), (2**31, 0), (2**40, 3), (5, 2**63)])
@pytest.mark.parametrize("causal", [False, True])
def test_prefill_window_bounds_past_int32(cpu_device, window, causal):
    """A bound past int32 (INT_MAX written for "unbounded") is as wide as -1, not an overflow."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 2, 5, 32)).astype(np.float32)
    k, v = (rng.standard_normal((1, 2, 9, 32)).astype(np.float32) for _ in range(2))
    got = flashcl.prefill(q, k, v, causal=causal, window=window, device=cpu_device)
    ref = reference.attention(q, k, v, causal=causal, window=window)
    assert rel_err(got, ref) < TOL["float32"]


def test_decode_window_bound_past_int32(cpu_device):
    rng = np.random.default_rng(1)
    q = rng.standard_normal((2, 4, 32)).astype(np.float32)
    k, v = (rng.standard_normal((2, 2, 40, 32)).astype(np.float32) for _ in range(2))
    lens = np.array([40, 17], np.int32)
    got = flashcl.decode(q, k, v, context_lens=lens, window=(2**35, 0), device=cpu_device)
    ref = reference.decode_attention(q, k, v, context_lens=lens)
    assert rel_err(got, ref) < TOL["float32"]


# --------------------------------------------------------------------------- quantize's range

def test_float16_values_whose_scale_rounds_past_float16_are_refused():
    """q8_0: d = 65504 / 127 rounds up to 516 in fp16, and 127 x 516 is inf in a float16 cache.
    q4_0's d = max / -8 is exact, so its largest value decodes to itself."""
    x = np.zeros((2, 64), np.float16)
    x[1, 40] = 65504.0
    with pytest.raises(ValueError, match="past float16's 65504"):
        flashcl.quantize(x, "q8_0")
    assert flashcl.dequantize(flashcl.quantize(x, "q4_0"))[1, 40] == 65504.0
    x[1, 40] = 60000.0  # within range: it round-trips finite
    assert np.isfinite(flashcl.dequantize(flashcl.quantize(x, "q8_0"))).all()


@pytest.mark.parametrize("fmt, top", [("q8_0", 1e7), ("q4_0", 6e5)])
def test_values_whose_scale_is_not_finite_in_fp16_are_refused(fmt, top):
    x = np.ones((1, 32), np.float32)
    x[0, 3] = top
    with pytest.raises(ValueError, match="finite in fp16"):
        flashcl.quantize(x, fmt)
    torch = pytest.importorskip("torch")
    with pytest.raises(ValueError, match="finite in fp16"):
        flashcl.quantize(torch.from_numpy(x), fmt)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
def test_blocks_holding_nan_or_inf_quantize_as_before(fmt):
    """An unwritten cache's garbage (NaN, inf) is not refused: those blocks stay non-finite and
    the others round-trip."""
    x = np.random.default_rng(6).standard_normal((3, 64)).astype(np.float16)
    x[0, 5], x[1, 40] = np.nan, np.inf
    back = flashcl.dequantize(flashcl.quantize(x, fmt)).astype(np.float32)
    assert not np.isfinite(back[0, :32]).all() and not np.isfinite(back[1, 32:]).all()
    assert np.isfinite(back[2]).all() and np.isfinite(back[0, 32:]).all() and np.isfinite(back[1, :32]).all()


def test_float32_values_of_the_largest_fp16_scale_round_trip():
    """A float32 cache holds 127 x 516 = 65532: the block is not refused, and comes back finite."""
    x = np.zeros((1, 32), np.float32)
    x[0, 0] = 65504.0
    back = flashcl.dequantize(flashcl.quantize(x, "q8_0"))
    assert back[0, 0] == 65532.0


# --------------------------------------------------------------------------- quantize_into

@pytest.mark.parametrize("bad, match", [
    ([-1], r"\[0, 4\)"),
    ([4], r"\[0, 4\)"),
    ([1.9], "integers"),
    ([True], "integers"),
])
def test_quantize_into_checks_torch_cpu_indices(bad, match):
    torch = pytest.importorskip("torch")
    cache = flashcl.quantize(torch.zeros(4, 4, 1, 32), "q8_0")
    before = cache.data.clone()
    with pytest.raises(ValueError, match=match):
        flashcl.quantize_into(cache, torch.tensor(bad), torch.tensor([0]), torch.ones(1, 1, 32))
    assert torch.equal(cache.data, before)


def test_quantize_into_judges_the_range_for_the_cache_dtype():
    """torch float16 tokens into a numpy float16 cache (made float32 numpy on the way) are still
    checked as float16: 65504 would dequantize to inf there."""
    torch = pytest.importorskip("torch")
    cache = flashcl.quantize(np.zeros((2, 2, 1, 32), np.float16), "q8_0")
    x = torch.zeros(1, 1, 32, dtype=torch.float16)
    x[0, 0, 0] = 65504.0
    with pytest.raises(ValueError, match="past float16's 65504"):
        flashcl.quantize_into(cache, np.array([0]), np.array([0]), x)
    flashcl.quantize_into(cache, np.array([0]), np.array([0]), np.ones((1, 1, 32), ">f2"))  # either byte order
    assert (flashcl.dequantize(cache)[0, 0, 0] == 1).all()


def test_quantize_into_refuses_tokens_of_another_dtype():
    cache = flashcl.quantize(np.zeros((2, 2, 1, 32), np.float16), "int8")
    x = np.ones((1, 1, 32), np.float32)
    with pytest.raises(TypeError, match="x: the cache holds float16"):
        flashcl.quantize_into(cache, np.array([0]), np.array([0]), x)
    flashcl.quantize_into(cache, np.array([0]), np.array([0]), x.astype(np.float16))
    assert (flashcl.dequantize(cache)[0, 0, 0] == 1).all()


# --------------------------------------------------------------------------- strided pyopencl views

@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "int8"])
def test_quantize_takes_strided_pyopencl_views(cpu_device, fmt):
    import pyopencl.array as cla

    handle = get_device(cpu_device)
    host = np.random.default_rng(2).standard_normal((6, 96)).astype(np.float32)
    arr = cla.to_device(handle.queue, host)
    for view, want in ((arr[::2], host[::2]), (arr[:, 32:], host[:, 32:]), (arr[1:5, 32:96], host[1:5, 32:96])):
        got = flashcl.dequantize(flashcl.quantize(view, fmt)).get()
        np.testing.assert_array_equal(got, flashcl.dequantize(flashcl.quantize(want, fmt)))


# --------------------------------------------------------------------------- merge_states

def _two_parts():
    rng = np.random.default_rng(3)
    out = rng.standard_normal((1, 2, 3, 8)).astype(np.float32)
    return out, rng.standard_normal((1, 2, 3)).astype(np.float32)


@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_merge_states_ignores_the_out_of_empty_parts(lib):
    """An empty part (lse -inf) may hold NaN in out (SDPA's fully masked rows): it adds nothing."""
    out, lse = _two_parts()
    empty_out, empty_lse = np.full_like(out, np.nan), np.full_like(lse, -np.inf)
    parts = ([out, empty_out], [lse, empty_lse])
    if lib == "torch":
        torch = pytest.importorskip("torch")
        parts = tuple([torch.from_numpy(x) for x in p] for p in parts)
    got, got_lse = flashcl.merge_states(*parts)
    np.testing.assert_allclose(np.asarray(got), out, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(got_lse), lse, rtol=1e-6)


@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_merge_states_makes_a_positive_infinite_lse_nan(lib):
    out, lse = _two_parts()
    bad = lse.copy()
    bad[0, 1, 2] = np.inf
    parts = ([out, out], [bad, lse])
    if lib == "torch":
        torch = pytest.importorskip("torch")
        parts = tuple([torch.from_numpy(x) for x in p] for p in parts)
    got, got_lse = (np.asarray(x) for x in flashcl.merge_states(*parts))
    assert np.isnan(got[0, 1, 2]).all() and np.isnan(got_lse[0, 1, 2])
    assert np.isfinite(np.delete(got_lse.reshape(-1), 5)).all()


# --------------------------------------------------------------------------- variant arrays

@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16])
def test_mask_past_the_kernels_range(cpu_device, dtype):
    """A positive value past the kernels' range (x log2(e) in float32) or +inf is refused; a
    negative one at or below MASK_HIDES_AT hides the key, as float32's and float64's minimum
    (transformers' "hide") mean it to, and no mask dtype's range check or cast warns."""
    q = np.zeros((1, 1, 2, 32), np.float32)
    k = v = np.ones((1, 1, 4, 32), np.float32)
    mask = np.zeros((2, 4), dtype)
    for bad, match in ((3e38, "3e\\+38 is past the kernels' range"), (np.inf, "holds \\+inf")):
        if dtype == np.float16 and np.isfinite(bad):
            continue  # past float16's range
        mask[1, 0] = bad
        with pytest.raises(ValueError, match=f"mask: .*{match}"):
            flashcl.prefill(q, k, v, mask=mask, device=cpu_device)
    hides = [-np.inf] if dtype == np.float16 else [-np.inf, np.finfo(np.float32).min, reference.MASK_HIDES_AT]
    hides += [np.finfo(np.float64).min, -1e39] if dtype == np.float64 else []
    for hide in hides:
        mask[1, 0], mask[0] = 0.0, hide
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            out = flashcl.prefill(q, k, v, mask=mask, device=cpu_device)
        assert (out[0, 0, 0] == 0).all() and (out[0, 0, 1] == 1).all()


@pytest.mark.parametrize("name, value, match", [
    ("sinks", np.nan, "finite values or -inf"),
    ("sinks", np.inf, "finite values or -inf"),
    ("sinks", 1e300, "past the kernels' range"),
    ("sinks", 3e38, "past the kernels' range"),
    ("alibi_slopes", -1e300, "past the kernels' range"),
    ("alibi_slopes", 3e38, "past the kernels' range"),
    ("alibi_slopes", np.nan, "finite values"),
    ("alibi_slopes", -np.inf, "finite values"),
])
@pytest.mark.parametrize("call", ["prefill", "decode"])
def test_non_finite_sinks_and_slopes_are_refused(cpu_device, name, value, match, call):
    arr = np.array([0.5, value])
    q = np.zeros((1, 2, 1, 32), np.float32)
    k = v = np.ones((1, 1, 4, 32), np.float32)
    with pytest.raises(ValueError, match=f"{name}: .*{match}"):
        if call == "prefill":
            flashcl.prefill(q, k, v, device=cpu_device, **{name: arr})
        else:
            flashcl.decode(q[:, :, 0], k, v, device=cpu_device, **{name: arr})


def test_a_sink_of_minus_inf_is_no_sink(cpu_device):
    rng = np.random.default_rng(4)
    q = rng.standard_normal((1, 2, 3, 32)).astype(np.float32)
    k, v = (rng.standard_normal((1, 1, 5, 32)).astype(np.float32) for _ in range(2))
    got = flashcl.prefill(q, k, v, sinks=np.array([-np.inf, -np.inf], np.float32), device=cpu_device)
    assert rel_err(got, reference.attention(q, k, v)) < TOL["float32"]


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "int8", "fp8_e4m3"])
def test_quantize_takes_either_byte_order(fmt):
    if fmt == "fp8_e4m3":
        pytest.importorskip("torch")
    x = np.random.default_rng(5).standard_normal((3, 64)).astype(np.float32)
    swapped = x.astype(">f4")
    assert flashcl.quantize(swapped, fmt).dtype == np.float32
    got, want = (flashcl.dequantize(flashcl.quantize(a, fmt)) for a in (swapped, x))
    np.testing.assert_array_equal(got, want)


def test_triton_host_tables_are_checked():
    """The Triton route reads torch CPU tables (the interpreter's) as the OpenCL one does: bad
    values raise before any launch, naming the entry (CUDA tables are not read back)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("triton")
    q = torch.zeros(2, 4, 32)
    pages = torch.zeros(6, 4, 2, 32)
    table = torch.tensor([[5, 40, 3], [1, 2, 4]], dtype=torch.int32)

    def call(table, lens):
        flashcl.decode(q, pages, pages, block_table=table, context_lens=torch.tensor(lens, dtype=torch.int32),
                       backend="triton")

    with pytest.raises(ValueError, match=r"block_table\[0, 1\] = 40 is out of range"):
        call(table, [11, 5])
    with pytest.raises(ValueError, match=r"context_lens\[1\] = -1 is negative"):
        call(table, [2, -1])
    with pytest.raises(ValueError, match=r"context_lens\[0\] = 13 exceeds the cache"):
        call(table, [13, 5])
    with pytest.raises(ValueError, match=r"context_lens\[1\] = 9 exceeds the cache \(N_max = 8\)"):
        flashcl.decode(q, torch.zeros(2, 2, 8, 32), torch.zeros(2, 2, 8, 32),
                       context_lens=torch.tensor([3, 9], dtype=torch.int32), backend="triton")


def test_quantize_refuses_what_it_cannot_take():
    """Not an array, an empty head dim, not a QuantizedTensor: clear errors. Empty leading dims
    quantize and dequantize in every format."""
    with pytest.raises(TypeError, match="quantize takes a numpy array"):
        flashcl.quantize([[1.0] * 32], "q8_0")
    with pytest.raises(ValueError, match="head dim"):
        flashcl.quantize(np.zeros((3, 0), np.float32), "int8")
    with pytest.raises(TypeError, match="dequantize takes a flashcl.QuantizedTensor"):
        flashcl.dequantize(np.ones(3))
    for fmt in ("q8_0", "q4_0", "int8"):
        assert flashcl.dequantize(flashcl.quantize(np.zeros((0, 2, 64), np.float32), fmt)).shape == (0, 2, 64)


def test_flags_and_per_head_arrays_are_typed(cpu_device):
    q = np.zeros((1, 2, 4, 32), np.float32)
    k = v = np.zeros((1, 1, 4, 32), np.float32)
    with pytest.raises(TypeError, match="return_lse: expected a bool, got str"):
        flashcl.prefill(q, k, v, device=cpu_device, return_lse="no")
    with pytest.raises(TypeError, match="return_lse: expected a bool, got int"):
        flashcl.decode(q[:, :, 0], k, v, device=cpu_device, return_lse=1)
    with pytest.raises(TypeError, match="sinks: expected an array of float32 values, got float"):
        flashcl.prefill(q, k, v, device=cpu_device, sinks=1.0)
    with pytest.raises(ValueError, match="no query heads"):
        flashcl.decode(np.zeros((1, 0, 32), np.float32), k, v, device=cpu_device)
    with pytest.raises(ValueError, match="softcap: .* past the kernels' range"):
        flashcl.prefill(q, k, v, device=cpu_device, softcap=3e38)


def test_triton_calls_from_several_threads():
    """Prefill and decode calls from several threads at once give each thread's single-threaded
    result (under the interpreter, whose launches share process state, one at a time)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("triton")
    from concurrent.futures import ThreadPoolExecutor

    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, h, 24, 32, generator=gen) for h in (4, 2, 2))
    table = torch.tensor([[2, 0, 1]], dtype=torch.int32)
    pages = k[0].transpose(0, 1).reshape(3, 8, 2, 32)
    lens = torch.tensor([21], dtype=torch.int32)
    calls = [lambda: flashcl.prefill(q, k, v, causal=True, backend="triton"),
             lambda: flashcl.decode(q[:, :, -1], pages, pages, block_table=table, context_lens=lens,
                                    backend="triton", num_splits=2),
             lambda: flashcl.prefill(q[:, :, :3], k, v, causal=True, backend="triton")]  # the few-row route
    alone = [call() for call in calls]
    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(lambda i: calls[i % 3](), range(18)))
    for i, got in enumerate(results):
        assert torch.equal(got, alone[i % 3]), i


def test_a_dtype_opencl_lacks_names_the_backend_and_those_it_takes(cpu_device):
    x = np.zeros((1, 2, 4, 32))  # float64 (bfloat16 torch tensors run: test_bfloat16_opencl.py)
    with pytest.raises(TypeError, match=r"float64 is not supported by the OpenCL backend; expected one of "
                                        r"\('float32', 'float16', 'bfloat16'\)"):
        flashcl.prefill(x, x, x, device=cpu_device)
