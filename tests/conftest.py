"""Device gating for the whole suite (in one place; nothing touched at import).

OpenCL tests take the ``cl_device`` fixture, parametrized over every OpenCL device present
(Oclgrind left out unless asked; of two installs of one platform, such as PoCL from PyPI beside
the system's, the one flashcl picks). Narrow with FLASHCL_TEST_DEVICES=substring[,substring...];
``all`` takes every device but Oclgrind.
Triton tests take ``triton_device``: "cuda" when a GPU is present, else "cpu" under
TRITON_INTERPRET=1, which must be set before triton compiles anything, hence here.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import pytest

_HAS_TORCH = importlib.util.find_spec("torch") is not None
_HAS_TRITON = importlib.util.find_spec("triton") is not None


def _cuda_available() -> bool:
    if not _HAS_TORCH:
        return False
    import torch

    return torch.cuda.is_available()


if _HAS_TRITON and not _cuda_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# Devices left out, name -> why: a compiler that fails while another device of its type works (a
# PoCL 3.0 from PyPI next to a newer PoCL on a CPU that its LLVM 14 does not know), or a second
# install of a platform already tested (the suite's OpenCL half would run twice).
_LEFT_OUT: dict = {}


@functools.lru_cache(maxsize=None)
def _opencl_devices():
    """(id, "P:D") for every usable OpenCL device, Oclgrind excluded. A device whose compiler
    fails is left out only where another device of its type (CPU, GPU) builds; alone, it stays,
    and its tests fail with the build log. Unless FLASHCL_TEST_DEVICES names devices, a platform
    installed twice is tested once, on the device of it that builds first (flashcl's own pick)."""
    try:
        import pyopencl as cl
    except ImportError:  # the OpenCL tests are not collected
        return []
    try:
        platforms = cl.get_platforms()
    except cl.Error as e:  # no platform: none collected; anything else must not pass as "no device"
        if "PLATFORM_NOT_FOUND" not in str(e):
            raise
        return []
    from flashcl.opencl.runtime import compiler_error

    wanted = [w.strip().lower() for w in os.environ.get("FLASHCL_TEST_DEVICES", "").split(",") if w.strip()]
    chosen = bool(wanted)  # FLASHCL_TEST_DEVICES set: every device it takes is tested
    if wanted == ["all"]:
        wanted = []
    found = []
    for pi, p in enumerate(platforms):
        for di, d in enumerate(p.get_devices()):
            name = f"{p.name}:{d.name}"
            if "oclgrind" in name.lower() and not any("oclgrind" in w for w in wanted):
                continue
            if wanted and not any(w in name.lower() for w in wanted):
                continue
            found.append((f"{p.name.split()[0]}-{d.name.split()[0]}-{pi}:{di}", f"{pi}:{di}", d))
    kind = lambda d: d.type & (cl.device_type.CPU | cl.device_type.GPU)  # noqa: E731
    working = {kind(d) for _, _, d in found if compiler_error(d) is None}
    tested: dict = {}  # (platform name, device type) -> (id, driver) of its device that is tested
    for dev_id, _, d in found:
        error = compiler_error(d)
        if error is not None and kind(d) in working:
            lines = error.splitlines() or ["?"]
            _LEFT_OUT[dev_id] = next((x.strip() for x in lines if x.strip().startswith("error:")), lines[0])
            continue
        same = (d.platform.name, kind(d))
        if same in tested and not chosen:
            first, first_driver = tested[same]
            _LEFT_OUT[dev_id] = (f"a second install of {d.platform.name} (driver {d.driver_version}; {first} "
                                 f"runs {first_driver}); FLASHCL_TEST_DEVICES=all tests it too")
            continue
        tested.setdefault(same, (dev_id, d.driver_version))
    return [(dev_id, spec) for dev_id, spec, _ in found if dev_id not in _LEFT_OUT]


def pytest_report_header(config):
    _opencl_devices()
    return [f"OpenCL device left out: {dev_id}: {why}" for dev_id, why in _LEFT_OUT.items()]


def pytest_generate_tests(metafunc):
    if "cl_device" in metafunc.fixturenames:
        devs = _opencl_devices()
        metafunc.parametrize("cl_device", [d[1] for d in devs], ids=[d[0] for d in devs])


@pytest.fixture
def triton_device():
    if not (_HAS_TORCH and _HAS_TRITON):
        pytest.skip("torch and triton are not installed (pip install .[cuda])")
    # the backend loaded, so that torch.ops.flashcl.* exist in a test that runs alone
    importlib.import_module("flashcl.triton.decode")
    importlib.import_module("flashcl.triton.prefill")
    return "cuda" if _cuda_available() else "cpu"


@pytest.fixture
def cpu_device():
    """The first OpenCL CPU device (PoCL), for tests that need a real compiler and runtime."""
    for dev_id, spec in _opencl_devices():
        import pyopencl as cl

        pi, di = (int(x) for x in spec.split(":"))
        if cl.get_platforms()[pi].get_devices()[di].type & cl.device_type.CPU:
            return spec
    pytest.skip("no OpenCL CPU device (pip install 'flashcl[pocl]')")


@pytest.fixture(autouse=True)
def tuning_dir(tmp_path, monkeypatch):
    """A fresh, empty user tuning database ($FLASHCL_TUNING_DIR) for every test, so that what a
    developer tuned on this machine never changes what the tests run; the shipped one still
    applies."""
    d = tmp_path / "tuning"
    monkeypatch.setenv("FLASHCL_TUNING_DIR", str(d))
    return d
