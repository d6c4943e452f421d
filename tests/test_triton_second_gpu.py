"""Triton kernels on a GPU that is not the current CUDA device: Triton launches on the current
device, so the ops make the tensors' device current (needs two GPUs; skipped otherwise)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import flashcl  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                reason="needs two CUDA GPUs")


def _on(device, *xs):
    return [x.to(device) for x in xs]


def test_prefill_with_mask_and_quantized_cache_on_the_second_gpu():
    torch.cuda.set_device(0)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 200, 64, generator=g).half() for _ in range(3))
    k, v = k[:, :2], v[:, :2]
    mask = torch.rand(2, 1, 200, 200, generator=g) < 0.8
    for kw in ({"causal": True}, {"causal": True, "mask": mask, "window": (70, 0)}):
        want = flashcl.prefill(*_on("cuda:0", q, k, v), backend="triton",
                               **{n: (x.to("cuda:0") if torch.is_tensor(x) else x) for n, x in kw.items()})
        got = flashcl.prefill(*_on("cuda:1", q, k, v), backend="triton",
                              **{n: (x.to("cuda:1") if torch.is_tensor(x) else x) for n, x in kw.items()})
        assert got.device == torch.device("cuda:1") and torch.equal(got.cpu(), want.cpu())
    kq = flashcl.quantize(k.to("cuda:1"), "q8_0")
    got = flashcl.prefill(q.to("cuda:1"), kq, v.to("cuda:1"), causal=True, backend="triton")
    want = flashcl.prefill(q.to("cuda:1"), flashcl.dequantize(kq), v.to("cuda:1"), causal=True, backend="triton")
    assert torch.allclose(got, want, atol=2e-3, rtol=1e-2)
    assert torch.cuda.current_device() == 0


def test_paged_decode_on_the_second_gpu():
    torch.cuda.set_device(0)
    g = torch.Generator().manual_seed(1)
    b, h_q, h_kv, d, bs, blocks = 3, 8, 2, 128, 16, 40
    q = torch.randn(b, h_q, d, generator=g).half()
    k, v = (torch.randn(blocks, bs, h_kv, d, generator=g).half() for _ in range(2))
    table = torch.randperm(blocks, generator=g)[: b * 12].reshape(b, 12).int()
    lens = torch.tensor([190, 5, 77], dtype=torch.int32)
    outs = []
    for dev in ("cuda:0", "cuda:1"):
        outs.append(flashcl.decode(*_on(dev, q, k, v), block_table=table.to(dev), context_lens=lens.to(dev),
                                   backend="triton", window=(40, 0)).cpu())
    assert torch.equal(outs[0], outs[1])
    kq = flashcl.quantize(k.to("cuda:1"), "int8")
    out = flashcl.decode(q.to("cuda:1"), kq, v.to("cuda:1"), block_table=table.to("cuda:1"),
                         context_lens=lens.to("cuda:1"), backend="triton")
    assert out.device == torch.device("cuda:1") and torch.isfinite(out).all()
    assert torch.cuda.current_device() == 0
