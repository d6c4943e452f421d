"""The on-disk binary cache: a second process loads built programs instead of compiling, and an
edited include (same top-level source) is a miss."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

_CHILD = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    import numpy as np
    from flashcl.opencl import runtime

    runtime.kernel_dir = lambda: Path(sys.argv[2])  # a private kernels folder, as clkernels/
    h = runtime.get_device(sys.argv[1])
    built = runtime.build(h, "t.cl", {"SCALE": 3}, kernel="t")
    import pyopencl.array as cla
    out = cla.empty(h.queue, 4, np.int32)
    built.kernel("t")(h.queue, (4,), None, out.data)
    print(json.dumps({"origin": built.origin, "out": out.get().tolist()}))
""")


def _run(spec: str, kdir, cache) -> dict:
    env = dict(os.environ, FLASHCL_CACHE_DIR=str(cache), FLASHCL_PROGRAM_CACHE="on")  # CPUs: off by default
    done = subprocess.run([sys.executable, "-c", _CHILD, spec, str(kdir)], env=env,
                          capture_output=True, text=True, timeout=300, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_second_process_hits_and_edited_include_misses(cpu_device, tmp_path):
    kdir, cache = tmp_path / "kernels", tmp_path / "cache"
    kdir.mkdir()
    (kdir / "t.h").write_text("#define BASE 10\n")
    (kdir / "t.cl").write_text('#include "t.h"\n'
                               "__kernel void t(__global int *o) { o[get_global_id(0)] = BASE * SCALE; }\n")
    assert _run(cpu_device, kdir, cache) == {"origin": "compiled", "out": [30] * 4}
    assert _run(cpu_device, kdir, cache) == {"origin": "disk cache", "out": [30] * 4}
    (kdir / "t.h").write_text("#define BASE 20\n")  # only the header changes
    assert _run(cpu_device, kdir, cache) == {"origin": "compiled", "out": [60] * 4}
    assert _run(cpu_device, kdir, cache) == {"origin": "disk cache", "out": [60] * 4}


def test_verbose_builds_bypass_and_damaged_files_rebuild(cpu_device, tmp_path, monkeypatch):
    from pathlib import Path

    from flashcl.opencl import runtime

    kdir = tmp_path / "kernels"
    kdir.mkdir()
    (kdir / "t.cl").write_text("__kernel void t(__global int *o) { o[0] = SCALE; }\n")
    monkeypatch.setattr(runtime, "kernel_dir", lambda: Path(kdir))
    monkeypatch.setenv("FLASHCL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("FLASHCL_PROGRAM_CACHE", "on")
    h = runtime.get_device(cpu_device)
    defines = {"SCALE": os.getpid()}  # no other test builds it, so memory holds neither build
    runtime.build(h, "t.cl", defines, kernel="t", verbose=True)
    assert not (tmp_path / "cache" / "programs").exists()
    h.programs.clear()
    assert runtime.build(h, "t.cl", defines, kernel="t").origin == "compiled"
    (path,) = (tmp_path / "cache" / "programs").glob("*.bin")
    path.write_bytes(path.read_bytes()[:40])  # a truncated file: a miss, then stored again
    h.programs.clear()
    assert runtime.build(h, "t.cl", defines, kernel="t").origin == "compiled"
    h.programs.clear()
    assert runtime.build(h, "t.cl", defines, kernel="t").origin == "disk cache"


def test_cpu_devices_leave_caching_to_their_driver(cpu_device, monkeypatch):
    """auto (the default): CPU devices keep no binaries (PoCL compiles every kernel to hand one
    out; its own cache serves the next process); on and off force it; anything else is an error."""
    import pytest

    from flashcl.opencl import runtime

    h = runtime.get_device(cpu_device)
    monkeypatch.delenv("FLASHCL_PROGRAM_CACHE", raising=False)
    assert runtime.caches_binaries(h) is False
    monkeypatch.setenv("FLASHCL_PROGRAM_CACHE", "on")
    assert runtime.caches_binaries(h) is True
    monkeypatch.setenv("FLASHCL_PROGRAM_CACHE", "maybe")
    with pytest.raises(ValueError, match="FLASHCL_PROGRAM_CACHE"):
        runtime.caches_binaries(h)
