"""Eager calls of the Triton backend skip torch's dispatcher (flashcl.triton.skips_dispatcher); every
caller that should see the ops still does: dispatch modes, the profiler, tensors with a gradient to
record. Both routes give the same bits. ``triton_device``: CUDA, else the Triton interpreter."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import flashcl  # noqa: E402
from flashcl import reference  # noqa: E402
from flashcl.triton import skips_dispatcher  # noqa: E402


class _Seen(TorchDispatchMode):
    """Records the ops dispatched under it."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _inputs(device, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, 5, 32, generator=g).to(device)
    k, v = (torch.randn(2, 2, 9, 32, generator=g).to(device) for _ in range(2))
    return q, k, v


def test_plain_eager_tensors_skip_the_dispatcher():
    t = torch.ones(3)
    assert skips_dispatcher(t, None, t)
    with torch.profiler.profile():
        assert not skips_dispatcher(t)
    with _Seen():
        assert not skips_dispatcher(t)
    with torch.autograd.profiler_legacy.profile():
        assert not skips_dispatcher(t)
    with torch.device("cpu"):  # a torch-function mode
        assert not skips_dispatcher(t)
    w = torch.ones(3, requires_grad=True)
    assert not skips_dispatcher(t, w)
    with torch.no_grad():
        assert skips_dispatcher(t, w)


@pytest.mark.parametrize("kernel", ["prefill", "decode"])
def test_vmap_takes_the_op(triton_device, kernel):
    """Under torch.func.vmap the inputs are batched tensors the kernels cannot read: the op runs
    (torch loops over the samples), each sample as its own call."""
    g = torch.Generator().manual_seed(4)
    q = torch.randn(3, 1, 4, 32, generator=g).to(triton_device)
    k, v = (torch.randn(3, 1, 2, 9, 32, generator=g).to(triton_device) for _ in range(2))
    if kernel == "decode":
        call = lambda q, k, v: flashcl.decode(q, k, v, backend="triton")  # noqa: E731
    else:
        q = q[:, :, :, None]
        call = lambda q, k, v: flashcl.prefill(q, k, v, causal=True, backend="triton")  # noqa: E731
    got = torch.func.vmap(call)(q, k, v)
    for i in range(3):
        assert torch.equal(got[i], call(q[i], k[i], v[i]))


@pytest.mark.parametrize("kernel", ["prefill", "decode"])
def test_both_routes_give_the_same_bits(triton_device, kernel, monkeypatch):
    """The direct call and the op under a dispatch mode (which sees it) agree to the bit, and with
    the oracle; a q that needs a gradient takes the op too."""
    from flashcl.triton import decode as triton_decode
    from flashcl.triton import prefill as triton_prefill

    module, name = (triton_decode, "_decode_impl") if kernel == "decode" else (triton_prefill, "_prefill_impl")
    impl, direct_calls = getattr(module, name), []

    def counted(*args, **kwargs):  # the op keeps the original: only direct calls pass here
        direct_calls.append(1)
        return impl(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    q, k, v = _inputs(triton_device)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], device=triton_device)
    if kernel == "decode":
        q = q[:, :, 0]
        call = lambda q, s: flashcl.decode(q, k, v, sinks=s, backend="triton", return_lse=True)  # noqa: E731
        ref = reference.decode_attention(*(x.double().cpu().numpy() for x in (q, k, v)), sinks=sinks.cpu().numpy(),
                                         return_lse=True)
    else:
        call = lambda q, s: flashcl.prefill(q, k, v, causal=True, sinks=s, backend="triton",  # noqa: E731
                                         return_lse=True)
        ref = reference.attention(*(x.double().cpu().numpy() for x in (q, k, v)), causal=True,
                                  sinks=sinks.cpu().numpy(), return_lse=True)
    direct = call(q, sinks)
    assert len(direct_calls) == 1
    with _Seen() as seen:
        traced = call(q, sinks)
    assert f"flashcl.{kernel}.default" in seen.ops and len(direct_calls) == 1
    for a, b in zip(direct, traced):
        assert torch.equal(a, b)
    np.testing.assert_allclose(direct[0].double().cpu().numpy(), ref[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(direct[1].double().cpu().numpy(), ref[1], rtol=1e-5, atol=1e-5)
    learner = q.clone().requires_grad_(True)
    call(learner, sinks)
    assert len(direct_calls) == 1
    with torch.no_grad():
        call(learner, sinks)
    assert len(direct_calls) == 2
