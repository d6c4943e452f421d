"""The device probe: kernel variants are built and launched in a subprocess, so a compiler that
aborts the process (PoCL 3.0 from PyPI on a 16-wide fma) costs a variant, never the caller."""

from __future__ import annotations

import json
import textwrap

import numpy as np
import pytest

import flashcl
from flashcl import reference
from flashcl.opencl import probe, runtime

from ._check import assert_close


def _device(spec: str):
    import pyopencl as cl

    pi, di = (int(x) for x in spec.split(":"))
    return cl.get_platforms()[pi].get_devices()[di]


@pytest.fixture
def fresh_probe(tmp_path, monkeypatch):
    """An empty probe cache, on disk and in memory."""
    monkeypatch.setenv("FLASHCL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(probe, "_memo", {})
    return tmp_path


def _crash_on(tmp_path, monkeypatch, variant: str):
    """Make the probe's child abort (SIGABRT, as LLVM's instruction selection does) on ``variant``:
    a sitecustomize on the child's path wraps the variant runner."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(textwrap.dedent(f"""
        import os
        import flashcl.opencl.probe as p
        _run = p._run_variant
        def _crashing(spec, name):
            if name == {variant!r}:
                os.abort()
            return _run(spec, name)
        p._run_variant = _crashing
    """))
    monkeypatch.setenv("PYTHONPATH", str(site))


def test_probe_finds_what_the_device_builds_and_caches_it(cpu_device, fresh_probe):
    dev = _device(cpu_device)
    caps = probe.capabilities(dev)
    assert caps.error is None and all(v.ok for v in caps.verdicts.values()), caps.verdicts
    files = list((fresh_probe / "cache" / "probe").glob("*.json"))
    assert len(files) == 1
    assert json.loads(files[0].read_text())["identity"]["device"] == dev.name.strip()
    probe._memo.clear()
    assert probe.capabilities(dev).verdicts == caps.verdicts  # read back from disk, no child


def test_a_variant_that_kills_the_compiler_is_left_out(cpu_device, fresh_probe, monkeypatch):
    """The child aborts on VEC=16: the probe survives, marks that variant, probes the rest; the
    device's defaults avoid it, and asking for it is a KernelBuildError with the crash report."""
    _crash_on(fresh_probe, monkeypatch, "prefill-vec16")
    dev = _device(cpu_device)
    caps = probe.capabilities(dev)
    assert not caps.works("prefill-vec16")
    assert "signal 6" in caps.failure("prefill-vec16")
    assert caps.error is None and caps.max_vec == 8
    assert all(caps.works(n) for n in probe.VARIANTS if n != "prefill-vec16")
    assert caps.summary() == "yes, not vec16"

    import pyopencl as cl

    handle = runtime.get_device(cl.Context([dev]))  # a new handle: its profile sees the probe
    assert handle.profile.simd == 8
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((2, 70, 64)).astype(np.float32) for _ in range(3))
    out = flashcl.prefill(q, k, v, causal=True, device=handle.context)
    assert_close(out, reference.attention(q, k, v, causal=True), "float32", "prefill after the probe")
    with pytest.raises(flashcl.KernelBuildError, match="signal 6"):
        flashcl.prefill(q, k, v, device=handle.context,
                        params={"BLOCK_M": 16, "BLOCK_N": 16, "DV_TILE": 64, "VEC": 16})


def test_a_child_that_dies_after_its_last_verdict_keeps_them(cpu_device, fresh_probe, monkeypatch):
    """A driver that aborts at exit (or a child timed out after its last verdict) costs nothing:
    every verdict stands (it was a StopIteration out of the probe)."""
    site = fresh_probe / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import atexit, os\natexit.register(os.abort)\n")
    monkeypatch.setenv("PYTHONPATH", str(site))
    caps = probe.capabilities(_device(cpu_device))
    assert caps.error is None and all(v.ok for v in caps.verdicts.values()), caps.verdicts


def test_a_device_whose_compiler_fails_is_reported_not_selected(cpu_device, fresh_probe, monkeypatch):
    """A device failing the baseline variant does not build: `compiler_error` says why, and a
    call on it raises KernelBuildError with that log before anything is built."""
    _crash_on(fresh_probe, monkeypatch, probe.BASELINE)
    dev = _device(cpu_device)
    assert "signal 6" in runtime.compiler_error(dev)
    assert probe.capabilities(dev).summary() == "NO"
    q = np.ones((1, 4, 32), np.float32)
    with pytest.raises(flashcl.KernelBuildError, match="probed in a subprocess"):
        flashcl.prefill(q, q, q, device=dev)
