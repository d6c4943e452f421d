"""``flashcl bench prefill --backend triton --mask KIND``: its refusals and the masks it times
(the timing itself needs a CUDA GPU; the OpenCL causal mask is timed in
test_variants_prefill_opencl.py)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from flashcl import cli

torch = pytest.importorskip("torch")
tb = pytest.importorskip("flashcl.tools.triton_bench_prefill")


def _usage_error(*args) -> str:
    r = CliRunner().invoke(cli.main, ["bench", "prefill", *args], catch_exceptions=False)
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output
    return r.stderr


def test_padding_mask_needs_the_triton_backend():
    assert "--backend triton" in _usage_error("--mask", "padding", "--shape", "1,2,1,64,32,1")


def test_causal_mask_needs_causal_shapes():
    assert "causal" in _usage_error("--backend", "triton", "--mask", "causal", "--shape", "1,2,1,64,32,0")
    with pytest.raises(ValueError, match="causal"):
        tb.run(shapes=[(1, 2, 1, 64, 32, False)], variants={"mask": "causal"})


def test_mask_with_kv_format_is_refused():
    assert "--mask" in _usage_error("--backend", "triton", "--mask", "padding", "--kv-format", "q8_0",
                                    "--shape", "1,2,1,64,32,1")


def test_masks_and_their_pairs():
    n, b = 8, 2
    causal = tb.mask_tensor("causal", b, n, device="cpu")
    assert causal.shape == (1, 1, n, n) and torch.equal(causal[0, 0], torch.ones(n, n, dtype=torch.bool).tril())
    assert tb.mask_pairs(causal, causal=False) == n * (n + 1) / 2
    pad = tb.mask_tensor("padding", b, n, device="cpu")
    assert pad.shape == (b, 1, n, n)
    assert pad[0].all() and not pad[1, :, :, :2].any() and pad[1, :, :, 2:].all()  # 1 * 8 // 4 keys
    # sequence 0 sees all 64 pairs, sequence 1 hides 2 keys from 8 rows: (64 + 48) / 2
    assert tb.mask_pairs(pad, causal=False) == 56
    # with causal on top: 36 pairs, less the hidden keys 0 and 1 below the diagonal (8 + 7)
    assert tb.mask_pairs(pad, causal=True) == (36 + 36 - 15) / 2
    with pytest.raises(ValueError, match="mask"):
        tb.mask_tensor("diagonal", b, n, device="cpu")
