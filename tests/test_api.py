"""flashcl.prefill as users call it: input kinds in and out, 3-D/4-D, lse, params, and the
errors raised before any kernel runs."""

from __future__ import annotations

import numpy as np
import pytest

import flashcl
from flashcl import reference
from flashcl.opencl.runtime import get_device

from ._check import assert_close


def _qkv(rng, shape_q=(2, 4, 17, 64), h_kv=2, n_kv=23, dv=48, dtype="float32"):
    b, h_q, n_q, dk = shape_q
    q = rng.standard_normal(shape_q).astype(dtype)
    k = rng.standard_normal((b, h_kv, n_kv, dk)).astype(dtype)
    v = rng.standard_normal((b, h_kv, n_kv, dv)).astype(dtype)
    return q, k, v


def test_numpy_in_numpy_out_with_lse(cl_device):
    rng = np.random.default_rng(0)
    q, k, v = _qkv(rng)
    out, lse = flashcl.prefill(q, k, v, causal=True, device=cl_device, return_lse=True)
    assert isinstance(out, np.ndarray) and out.dtype == np.float32 and out.shape == (2, 4, 17, 48)
    assert lse.dtype == np.float32 and lse.shape == (2, 4, 17)
    ref, ref_lse = reference.attention(q, k, v, causal=True, return_lse=True)
    assert_close(out, ref, "float32", "numpy path")
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-5)


def test_three_d_inputs_give_three_d_outputs(cl_device):
    rng = np.random.default_rng(1)
    q, k, v = (x[0] for x in _qkv(rng, dtype="float16"))
    out, lse = flashcl.prefill(q, k, v, device=cl_device, return_lse=True)
    assert out.shape == (4, 17, 48) and out.dtype == np.float16 and lse.shape == (4, 17)
    assert_close(out, reference.attention(q, k, v), "float16", "3-D path")


def test_scale_and_non_contiguous_inputs(cl_device):
    rng = np.random.default_rng(2)
    q, k, v = _qkv(rng, shape_q=(1, 4, 33, 32))
    qt = np.swapaxes(np.ascontiguousarray(np.swapaxes(q, 1, 2)), 1, 2)  # (B, N, H, D) storage
    assert not qt.flags.c_contiguous
    out = flashcl.prefill(qt, k, v[..., ::2], scale=0.3, device=cl_device)
    assert_close(out, reference.attention(q, k, v[..., ::2], scale=0.3), "float32", "strided inputs")


def test_torch_cpu_in_torch_out(cl_device):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    q, k, v = _qkv(rng)
    out = flashcl.prefill(*(torch.from_numpy(x) for x in (q, k, v)), causal=True, device=cl_device)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32
    assert_close(out.numpy(), reference.attention(q, k, v, causal=True), "float32", "torch path")


def test_pyopencl_arrays_stay_on_the_device(cl_device):
    import pyopencl.array as cla

    h = get_device(cl_device)
    rng = np.random.default_rng(4)
    q, k, v = _qkv(rng)
    qd, kd, vd = (cla.to_device(h.queue, x) for x in (q, k, v))
    out, lse = flashcl.prefill(qd, kd, vd, causal=True, return_lse=True)
    assert isinstance(out, cla.Array) and isinstance(lse, cla.Array)
    assert_close(out.get(), reference.attention(q, k, v, causal=True), "float32", "pyopencl path")


def test_device_may_name_where_pyopencl_arrays_are(cl_device):
    """device= beside pyopencl Array inputs: their device (by name, handle or Device), queue or
    context runs the call on their queue; another queue, context or device is a ValueError."""
    import pyopencl as cl
    import pyopencl.array as cla

    h = get_device(cl_device)
    q, k, v = _qkv(np.random.default_rng(5))
    qd, kd, vd = (cla.to_device(h.queue, x) for x in (q, k, v))
    ref = reference.attention(q, k, v, causal=True)
    for dev in (cl_device, h, h.device, h.queue, h.context):
        out = flashcl.prefill(qd, kd, vd, causal=True, device=dev)
        assert out.queue == h.queue
        assert_close(out.get(), ref, "float32", f"device={dev!r}")
    other_context = cl.Context([h.device])
    others = [d for p in cl.get_platforms() for d in p.get_devices() if d != h.device]
    for dev in [cl.CommandQueue(other_context), other_context] + others[:1]:
        with pytest.raises(ValueError, match="not where the pyopencl Array inputs are"):
            flashcl.prefill(qd, kd, vd, device=dev)


def test_pyopencl_array_views_with_offsets(cl_device):
    """A slice of a larger device array (non-zero offset, strided heads) is read in place."""
    import pyopencl.array as cla

    h = get_device(cl_device)
    rng = np.random.default_rng(5)
    big_q = rng.standard_normal((2, 6, 20, 32)).astype(np.float32)
    k = rng.standard_normal((1, 2, 20, 32)).astype(np.float32)
    v = rng.standard_normal((1, 2, 20, 32)).astype(np.float32)
    qd = cla.to_device(h.queue, big_q)[1:, 2:]  # offset into the buffer, strided over heads
    out = flashcl.prefill(qd, cla.to_device(h.queue, k), cla.to_device(h.queue, v))
    assert_close(out.get(), reference.attention(big_q[1:, 2:], k, v), "float32", "view path")


def test_params_override_is_used(cl_device):
    rng = np.random.default_rng(6)
    q, k, v = _qkv(rng)
    a = flashcl.prefill(q, k, v, device=cl_device, params={"BLOCK_M": 16, "BLOCK_N": 8, "DV_TILE": 16})
    b = flashcl.prefill(q, k, v, device=cl_device, params={"BLOCK_M": 32, "BLOCK_N": 16, "DV_TILE": 48, "VEC": 16})
    ref = reference.attention(q, k, v)
    assert_close(a, ref, "float32", "override a")
    assert_close(b, ref, "float32", "override b")


def test_device_selection_by_profile_name_and_env(monkeypatch):
    h = get_device("cpu") if any("cpu" in d["profile"] for d in __import__(
        "flashcl.opencl.runtime", fromlist=["x"]).list_devices()) else None
    if h is None:
        pytest.skip("no CPU OpenCL device")
    monkeypatch.setenv("FLASHCL_DEVICE", "cpu")
    assert get_device(None) is h
    with pytest.raises(ValueError, match="matches no OpenCL device"):
        get_device("no-such-gpu")
    with pytest.raises(ValueError, match="no OpenCL device 9:9"):
        get_device("9:9")


def _all_cl_devices():
    import pyopencl as cl

    return [d for p in cl.get_platforms() for d in p.get_devices()]


def test_selection_takes_the_first_device_whose_compiler_works(cpu_device, monkeypatch):
    """Where several devices match, the first whose compiler builds is taken; a single candidate is
    taken as it is. The verdict on the other device is set here (on most machines every compiler
    works); the probe itself runs on the real device (tests/test_probe.py)."""
    import pyopencl as cl
    from flashcl.opencl import probe, runtime

    pi, di = (int(x) for x in cpu_device.split(":"))
    dev = cl.get_platforms()[pi].get_devices()[di]
    assert runtime.compiler_error(dev) is None
    other = next((d for d in _all_cl_devices() if d != dev), None)
    if other is None:
        pytest.skip("needs a second OpenCL device (Oclgrind: pip install 'flashcl[oclgrind]')")
    broken_log = "error: unknown target CPU 'generic'"
    broken = {other.int_ptr}
    real = runtime.capabilities
    monkeypatch.setattr(runtime, "capabilities", lambda d: probe.Capabilities(
        {probe.BASELINE: probe.Verdict(False, broken_log)}) if d.int_ptr in broken else real(d))
    assert runtime._first_usable([other, dev]) == dev
    assert runtime._first_usable([dev, other]) == dev
    assert runtime._first_usable([other]) == other  # alone: taken, its builds raise with the log
    broken.add(dev.int_ptr)
    assert runtime._first_usable([other, dev]) == other  # none works: the first


def test_a_compiler_that_does_not_know_the_cpu_says_what_to_install():
    """Where a PoCL that cannot build on this CPU is installed (PoCL 3.0 from PyPI on AMD Zen 5),
    a build on it raises KernelBuildError with the compiler's log and the remedy."""
    from flashcl.opencl import runtime

    broken = [d for d in _all_cl_devices() if "unknown target CPU" in (runtime.compiler_error(d) or "")]
    if not broken:
        pytest.skip("every OpenCL compiler here knows the host CPU")
    q = np.zeros((1, 4, 16), np.float32)
    with pytest.raises(flashcl.KernelBuildError, match="apt-get install pocl-opencl-icd"):
        flashcl.prefill(q, q, q, device=broken[0])


# --------------------------------------------------------------------------- errors before launch

def _ok(rng=np.random.default_rng(7)):
    return _qkv(rng, shape_q=(1, 4, 8, 64), n_kv=8, dv=64)


@pytest.mark.parametrize("mutate,exc,match", [
    (lambda q, k, v: (q[0, 0], k, v), ValueError, r"all be 3-D .* or all 4-D"),
    (lambda q, k, v: (q[None], k[None], v[None]), ValueError, r"all be 3-D .* or all 4-D"),
    (lambda q, k, v: (q, k[:, :1].repeat(3, axis=1), v[:, :1].repeat(3, axis=1)), ValueError, "multiple of H_kv=3"),
    (lambda q, k, v: (q, k[..., :32], v), ValueError, "q has head dim 64 but k has 32"),
    (lambda q, k, v: (q, k, v[:, :, :5]), ValueError, "k has 8 keys but v has 5"),
    (lambda q, k, v: (q, k, v[:, :1]), ValueError, "k has 2 heads but v has 1"),
    (lambda q, k, v: (q[:, :, :0], k, v), ValueError, "empty input"),
    (lambda q, k, v: (q, k[:, :, :0], v[:, :, :0]), ValueError, "empty input"),
    (lambda q, k, v: (np.concatenate([q, q]), k, v), ValueError, "batch sizes differ"),
    (lambda q, k, v: (q.astype(np.float64), k.astype(np.float64), v.astype(np.float64)), TypeError, "float64 is not supported"),
    (lambda q, k, v: (q, k.astype(np.float16), v), TypeError, "share one dtype"),
    (lambda q, k, v: (q.astype(np.int32), k.astype(np.int32), v.astype(np.int32)), TypeError, "int32 is not supported"),
    (lambda q, k, v: (q[..., :60], k[..., :60], v), ValueError, "head dim 60 is not supported"),
    (lambda q, k, v: (q, k, np.zeros((1, 2, 8, 264), np.float32)), ValueError, "head dim 264"),
    (lambda q, k, v: (q.tolist(), k, v), TypeError, "q: expected a numpy array"),
])
def test_malformed_inputs_raise_before_launch(mutate, exc, match):
    q, k, v = mutate(*_ok())
    with pytest.raises(exc, match=match):
        flashcl.prefill(q, k, v)


@pytest.mark.parametrize("kwargs,exc,match", [
    ({"scale": float("nan")}, ValueError, "scale: expected a finite float"),
    ({"scale": "0.1"}, TypeError, "scale: expected a float"),
    ({"causal": "yes"}, TypeError, "causal: expected a bool"),
    ({"backend": "cuda"}, ValueError, "backend: expected one of"),
    ({"params": [64, 32]}, TypeError, "params: expected a dict"),
])
def test_malformed_options_raise(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        flashcl.prefill(*_ok(), **kwargs)


@pytest.mark.parametrize("params,match", [
    ({"BLOCK_M": 64, "BLOCK_N": 32, "DV_TILE": 48}, "DV_TILE=48 must divide DV=64"),
    ({"BLOCK_M": 64, "BLOCK_N": 30, "DV_TILE": 64, "VEC": 4}, "multiples of VEC=4"),
    ({"BLOCK_M": 64, "BLOCK_N": 32}, "missing"),
    ({"BLOCK_M": 64, "BLOCK_N": 32, "DV_TILE": 64, "TILE_K": 4}, "unknown"),
    ({"BLOCK_M": 0, "BLOCK_N": 32, "DV_TILE": 64}, "BLOCK_M=0 must be a positive int"),
    ({"BLOCK_M": 1 << 20, "BLOCK_N": 32, "DV_TILE": 64}, "exceeds the device's max work-group"),
    ({"BLOCK_M": 64, "BLOCK_N": 256, "DV_TILE": 64, "VEC": 4}, None),  # may or may not fit: see below
])
def test_bad_params_name_the_limit(cl_device, params, match):
    h = get_device(cl_device)
    q, k, v = _ok()
    if match is None:  # 256 x (64 + 64) x 4 B = 128 KiB of local memory
        if h.local_mem >= 256 * 128 * 4:
            pytest.skip("this device has enough local memory for the tile")
        match = "bytes of local memory"
    with pytest.raises(ValueError, match=match):
        flashcl.prefill(q, k, v, device=cl_device, params=params)


def test_triton_backend_needs_torch_tensors():
    with pytest.raises(TypeError, match="backend='triton'"):
        flashcl.prefill(*_ok(), backend="triton")
