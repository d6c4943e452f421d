"""Quantized K/V through flashcl.prefill/decode: every error raised before a kernel (naming the
argument, what it received and what is expected), the QuantizedTensor reaching each backend
unchanged, and the oracle attending a QuantizedTensor as its dequantized values."""

from __future__ import annotations

import numpy as np
import pytest

import flashcl
from flashcl import reference
from flashcl.api import QUANTIZED_KV_FORMATS
from flashcl.quant import QuantizedTensor

from ._check import assert_close

torch = pytest.importorskip("torch")


def _decode_inputs(seed=0, b=2, h_q=4, h_kv=2, n=40, dk=64, dv=64, dtype=np.float32):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, h_q, dk)).astype(dtype)
    k = rng.standard_normal((b, h_kv, n, dk)).astype(dtype)
    v = rng.standard_normal((b, h_kv, n, dv)).astype(dtype)
    return q, k, v


def _paged_inputs(seed=1, num_blocks=7, block_size=4, h_kv=2, dk=64, dv=32):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((2, 4, dk)).astype(np.float32)
    k = rng.standard_normal((num_blocks, block_size, h_kv, dk)).astype(np.float32)
    v = rng.standard_normal((num_blocks, block_size, h_kv, dv)).astype(np.float32)
    table = np.array([[3, 0, 6], [5, 1, 2]], np.int32)
    lens = np.array([11, 9], np.int32)
    return q, k, v, table, lens


class _Boundary:
    """Stands in for a backend's decode: records what reached it and returns zeros."""

    def __init__(self):
        self.calls = []

    def __call__(self, q, k_cache, v_cache, **kwargs):
        self.calls.append((q, k_cache, v_cache, kwargs))
        out = np.zeros((q.shape[0], q.shape[1], v_cache.shape[-1]), np.float32)
        return torch.from_numpy(out) if isinstance(q, torch.Tensor) else out


@pytest.fixture
def opencl_boundary(monkeypatch):
    from flashcl.opencl import decode as cl_decode
    boundary = _Boundary()
    monkeypatch.setattr(cl_decode, "decode", boundary)
    return boundary


@pytest.fixture
def triton_boundary(monkeypatch, triton_device):
    from flashcl.triton import decode as triton_decode
    boundary = _Boundary()
    monkeypatch.setattr(triton_decode, "decode", boundary)
    return boundary


# --- prefill: OpenCL takes q8_0/q4_0/int8 (tests/test_quant_prefill_opencl.py), Triton all four
# (tests/test_quant_triton_prefill.py) ---

def test_fp8_is_refused_by_opencl_prefill():
    q, k, v = (torch.from_numpy(x) for x in _decode_inputs())
    q = q[:, :, None].repeat(1, 1, 3, 1).contiguous()
    with pytest.raises(TypeError, match=r"^k: prefill on opencl takes quantized caches in q8_0, q4_0, "
                                        r"int8; got 'fp8_e4m3' \(a torch-only format"):
        flashcl.prefill(q, flashcl.quantize(k, "fp8_e4m3"), v, backend="opencl")


def test_prefill_and_decode_read_the_one_format_table():
    assert QUANTIZED_KV_FORMATS[("opencl", "prefill")] == ("q8_0", "q4_0", "int8")
    assert set(QUANTIZED_KV_FORMATS[("triton", "prefill")]) == set(flashcl.quant.FORMATS)
    assert QUANTIZED_KV_FORMATS[("opencl", "decode")] == ("q8_0", "q4_0", "int8")
    assert set(QUANTIZED_KV_FORMATS[("triton", "decode")]) == set(flashcl.quant.FORMATS)


# --- decode: what is validated before the backend ---

def test_fp8_is_refused_by_opencl_decode(opencl_boundary):
    q, k, v = (torch.from_numpy(x) for x in _decode_inputs())
    with pytest.raises(TypeError, match=r"^k_cache: decode on opencl takes quantized caches in q8_0, q4_0, "
                                        r"int8; got 'fp8_e4m3' \(a torch-only format: run it on the triton"):
        flashcl.decode(q, flashcl.quantize(k, "fp8_e4m3"), v, backend="opencl")
    assert not opencl_boundary.calls


@pytest.mark.parametrize("which", ["k_cache", "v_cache"])
def test_logical_dtype_must_be_q_dtype(opencl_boundary, which):
    q, k, v = _decode_inputs()
    caches = {"k_cache": k, "v_cache": v}
    caches[which] = flashcl.quantize(caches[which].astype(np.float16), "q4_0")
    with pytest.raises(TypeError, match=rf"^{which}: a QuantizedTensor's logical dtype \(the dtype it was "
                                        r"quantized from\) must be q's, float32; got float16$"):
        flashcl.decode(q, caches["k_cache"], caches["v_cache"])
    assert not opencl_boundary.calls


def test_q_cannot_be_quantized(opencl_boundary):
    q, k, v = _decode_inputs()
    with pytest.raises(TypeError, match=r"^q: got a QuantizedTensor; only the K/V caches may be quantized"):
        flashcl.decode(flashcl.quantize(q, "int8"), k, v)
    assert not opencl_boundary.calls


def _with_head_dim(qt: QuantizedTensor, d: int) -> QuantizedTensor:
    """A hand-built QuantizedTensor claiming head dim ``d`` (quantize itself refuses d % 32)."""
    return QuantizedTensor(qt.data, qt.scales, qt.fmt, qt.shape[:-1] + (d,), qt.dtype)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
def test_ggml_formats_need_head_dims_in_blocks_of_32(opencl_boundary, fmt):
    q, k, v = _decode_inputs(dk=80, dv=80)
    k_qt = _with_head_dim(flashcl.quantize(k[..., :64], fmt), 80)
    with pytest.raises(ValueError, match=rf"^k_cache: {fmt} packs the head dim in blocks of 32; got DK=80$"):
        flashcl.decode(q, k_qt, v)
    v_qt = _with_head_dim(flashcl.quantize(v[..., :64], fmt), 80)
    with pytest.raises(ValueError, match=rf"^v_cache: {fmt} packs the head dim in blocks of 32; got DV=80$"):
        flashcl.decode(q, k, v_qt)
    assert not opencl_boundary.calls


def test_int8_takes_any_supported_head_dim(opencl_boundary):
    q, k, v = _decode_inputs(dk=40, dv=72)
    flashcl.decode(q, flashcl.quantize(k, "int8"), flashcl.quantize(v, "int8"))
    assert len(opencl_boundary.calls) == 1


def test_logical_shape_is_checked_like_a_plain_cache(opencl_boundary):
    q, k, v = _decode_inputs()
    with pytest.raises(ValueError, match=r"v_cache \(2, 2, 39, 64\) must match k_cache \(2, 2, 40, 64\)"):
        flashcl.decode(q, flashcl.quantize(k, "q8_0"), flashcl.quantize(v[:, :, :39], "q8_0"))
    with pytest.raises(ValueError, match="q has head dim 64 but k_cache has 32"):
        flashcl.decode(q, flashcl.quantize(k[..., :32], "q8_0"), v)
    with pytest.raises(ValueError, match="v_cache: head dim 4 is not supported"):
        flashcl.decode(q, k, flashcl.quantize(v[..., :4], "int8"))
    qp, kp, vp, table, lens = _paged_inputs(block_size=3)
    with pytest.raises(ValueError, match=r"k_cache.shape\[1\]: block size 3 is not supported"):
        flashcl.decode(qp, flashcl.quantize(kp, "q4_0"), vp, block_table=table, context_lens=lens)
    assert not opencl_boundary.calls


def test_a_quantized_tensor_whose_parts_do_not_fit_is_refused(opencl_boundary):
    q, k, v = _decode_inputs()
    good = flashcl.quantize(k, "q8_0")
    short = QuantizedTensor(good.data[:, :, :30], good.scales, "q8_0", good.shape, good.dtype)
    with pytest.raises(ValueError, match=r"^k_cache: a q8_0 QuantizedTensor of shape \(2, 2, 40, 64\) needs "
                                        r"data uint8 \(2, 2, 40, 2, 34\), got uint8 \(2, 2, 30, 2, 34\)$"):
        flashcl.decode(q, short, v)
    assert not opencl_boundary.calls


# --- kinds ---

def test_quantized_kind_comes_from_its_data(opencl_boundary):
    q, k, v = _decode_inputs()
    torch_qt = flashcl.quantize(torch.from_numpy(k), "q8_0")
    with pytest.raises(TypeError, match=r"got q=numpy, k_cache=torch-cpu \(a QuantizedTensor's data\), "
                                        r"v_cache=numpy"):
        flashcl.decode(q, torch_qt, v)
    with pytest.raises(TypeError, match=r"got q=torch-cpu, k_cache=torch-cpu, v_cache=numpy \(a QuantizedTensor's"):
        flashcl.decode(torch.from_numpy(q), torch.from_numpy(k), flashcl.quantize(v, "int8"))
    # fp8_e4m3 data is torch even when quantized from numpy
    with pytest.raises(TypeError, match=r"k_cache=torch-cpu \(a QuantizedTensor's data\)"):
        flashcl.decode(q, flashcl.quantize(k, "fp8_e4m3"), v)
    assert not opencl_boundary.calls


def test_pyopencl_quantized_cache_with_numpy_q_is_refused(cpu_device, opencl_boundary):
    import pyopencl.array as cla
    from flashcl.opencl.runtime import get_device
    q, k, v = _decode_inputs()
    cl_qt = flashcl.quantize(cla.to_device(get_device(cpu_device).queue, k), "q4_0")
    with pytest.raises(TypeError, match=r"got q=numpy, k_cache=cl \(a QuantizedTensor's data\), v_cache=numpy"):
        flashcl.decode(q, cl_qt, v)
    assert not opencl_boundary.calls


# --- the QuantizedTensor reaches the backend as it is ---

@pytest.mark.parametrize("k_fmt, v_fmt", [("q8_0", None), (None, "q4_0"), ("q8_0", "int8"), ("q4_0", "q4_0")])
def test_opencl_decode_gets_the_quantized_tensor_unchanged(opencl_boundary, k_fmt, v_fmt):
    q, k, v, table, lens = _paged_inputs()
    k_in = flashcl.quantize(k, k_fmt) if k_fmt else k
    v_in = flashcl.quantize(v, v_fmt) if v_fmt else v
    flashcl.decode(q, k_in, v_in, block_table=table, context_lens=lens, num_splits=2)
    (_, k_got, v_got, kwargs), = opencl_boundary.calls
    assert k_got is k_in and v_got is v_in
    assert kwargs["geo"]["DK"] == 64 and kwargs["geo"]["DV"] == 32 and kwargs["geo"]["paged"]
    assert kwargs["num_splits"] == 2


def test_opencl_decode_gets_torch_cpu_and_pyopencl_quantized_tensors(cpu_device, opencl_boundary):
    import pyopencl.array as cla
    from flashcl.opencl.runtime import get_device
    q, k, v = _decode_inputs()
    k_qt = flashcl.quantize(torch.from_numpy(k), "int8")
    flashcl.decode(torch.from_numpy(q), k_qt, torch.from_numpy(v))
    queue = get_device(cpu_device).queue
    q_cl, k_cl, v_cl = (cla.to_device(queue, x) for x in (q, k, v))
    v_qt = flashcl.quantize(v_cl, "q8_0")
    flashcl.decode(q_cl, k_cl, v_qt)
    assert opencl_boundary.calls[0][1] is k_qt and opencl_boundary.calls[1][2] is v_qt


@pytest.mark.parametrize("k_fmt, v_fmt", [("fp8_e4m3", "fp8_e4m3"), ("q8_0", None), ("int8", "q4_0")])
def test_triton_decode_gets_the_quantized_tensor_unchanged(triton_boundary, triton_device, k_fmt, v_fmt):
    q, k, v = (torch.from_numpy(x).to(triton_device) for x in _decode_inputs())
    k_in = flashcl.quantize(k, k_fmt) if k_fmt else k
    v_in = flashcl.quantize(v, v_fmt) if v_fmt else v
    flashcl.decode(q, k_in, v_in, backend="triton")
    (_, k_got, v_got, _), = triton_boundary.calls
    assert k_got is k_in and v_got is v_in


# --- end to end on an OpenCL device ---

@pytest.mark.parametrize("k_fmt, v_fmt", [("q8_0", "q8_0"), ("q4_0", None), ("int8", "q8_0")])
def test_opencl_decode_attends_the_quantized_values(cpu_device, k_fmt, v_fmt):
    q, k, v, table, lens = _paged_inputs()
    k_in = flashcl.quantize(k, k_fmt)
    v_in = flashcl.quantize(v, v_fmt) if v_fmt else v
    out, lse = flashcl.decode(q, k_in, v_in, block_table=table, context_lens=lens,
                              device=cpu_device, return_lse=True)
    ref, ref_lse = reference.decode_attention(q, k_in, v_in, block_table=table, context_lens=lens,
                                              return_lse=True)
    assert_close(out, ref, "float32", f"decode K {k_fmt} V {v_fmt}")
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-5)


# --- the oracle attends a QuantizedTensor as its dequantized values ---

@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "int8", "fp8_e4m3"])
@pytest.mark.parametrize("wrap", [np.asarray, torch.from_numpy], ids=["numpy", "torch"])
def test_reference_decode_dequantizes(fmt, wrap):
    q, k, v, table, lens = _paged_inputs()
    k_qt, v_qt = flashcl.quantize(wrap(k), fmt), flashcl.quantize(wrap(v), fmt)
    dense = [np.asarray(flashcl.dequantize(x), np.float32) for x in (k_qt, v_qt)]
    got = reference.decode_attention(q, k_qt, v_qt, block_table=table, context_lens=lens, return_lse=True)
    want = reference.decode_attention(q, *dense, block_table=table, context_lens=lens, return_lse=True)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    exact = reference.decode_attention(q, k, v, block_table=table, context_lens=lens)
    assert 0 < reference.rel_err(got[0], exact) < 0.15     # the quantized values, not the originals


@pytest.mark.parametrize("fmt", ["q8_0", "int8"])
def test_reference_attention_dequantizes_k_or_v(fmt):
    rng = np.random.default_rng(4)
    q = rng.standard_normal((2, 4, 5, 64)).astype(np.float32)
    k = rng.standard_normal((2, 2, 9, 64)).astype(np.float32)
    v = rng.standard_normal((2, 2, 9, 32)).astype(np.float32)
    k_qt, v_qt = flashcl.quantize(k, fmt), flashcl.quantize(v, fmt)
    np.testing.assert_array_equal(reference.attention(q, k_qt, v, causal=True),
                                  reference.attention(q, flashcl.dequantize(k_qt), v, causal=True))
    np.testing.assert_array_equal(reference.attention(q, k, v_qt, causal=True),
                                  reference.attention(q, k, flashcl.dequantize(v_qt), causal=True))
