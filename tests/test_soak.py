"""A short ``flashcl soak`` (the long run is a command: ``flashcl soak --calls 10000``)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from flashcl.tools import soak
from flashcl.cli import main


def test_soak_short_run_is_exact_and_bounded(cpu_device):
    res = CliRunner().invoke(main, ["soak", "--device", cpu_device, "--calls", "160", "--every", "20",
                                    "--check-every", "8", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)  # stdout only: a compiler warning on stderr is not part of the JSON
    assert out["ok"] and out["checked"] >= 30 and len(out["rows"]) == 8
    from flashcl.opencl import runtime

    assert all(len(h.programs) <= runtime.MAX_PROGRAMS for h in runtime._handles.values())
    assert len(runtime._handles) <= runtime.MAX_HANDLES


def test_growth_verdict():
    flat = [soak.Sample(i, 100_000, 1, 10, 0.0) for i in range(8)]
    grow = [soak.Sample(i, 100_000 + 5_000 * i, 1, 10, 0.0) for i in range(8)]
    assert soak.judge(flat)[0] and not soak.judge(grow)[0]
    assert soak.judge(flat[:3])[0]  # too few samples: no verdict


def test_program_cache_is_bounded(cpu_device, monkeypatch):
    """Past MAX_PROGRAMS the least recently used program is dropped, and rebuilt on demand."""
    from flashcl.opencl import runtime

    h = runtime.get_device(cpu_device)
    monkeypatch.setattr(runtime, "MAX_PROGRAMS", 2)
    defines = [{"HEAD_DK": 16, "HEAD_DV": 16, "BLOCK_M": m, "BLOCK_N": 4, "DV_TILE": 16, "VEC": 4}
               for m in (1, 2, 4)]
    first = runtime.build(h, "prefill.cl", defines[0], kernel="prefill")
    runtime.build(h, "prefill.cl", defines[1], kernel="prefill")
    assert runtime.build(h, "prefill.cl", defines[0], kernel="prefill") is first  # now most recent
    runtime.build(h, "prefill.cl", defines[2], kernel="prefill")                 # evicts defines[1]
    assert len(h.programs) <= 2
    assert runtime.build(h, "prefill.cl", defines[0], kernel="prefill") is first


def test_cuda_soak_short_run():
    """The CUDA long run (flashcl soak --backend triton) on a few calls: flat allocator, exact;
    without a GPU the command says so in one line and exits 3."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("triton")
    from click.testing import CliRunner

    from flashcl import cli
    from flashcl.tools import triton_soak as cuda_soak

    if not torch.cuda.is_available():
        res = CliRunner().invoke(cli.main, ["soak", "--backend", "triton", "--calls", "1"])
        assert res.exit_code == 3 and "CUDA" in res.output, res.output
        return
    res = cuda_soak.run(40, every=10, check_every=5)
    assert res["ok"], res
    assert [s["call"] for s in res["samples"]] == [10, 20, 30, 40]
