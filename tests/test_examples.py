"""Every program in examples/ runs as a user would run it, on the first OpenCL CPU device."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = sorted((Path(__file__).resolve().parent.parent / "examples").glob("*.py"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_runs(path, cpu_device):
    env = dict(os.environ, FLASHCL_DEVICE=cpu_device)
    proc = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, env=env,
                          cwd=path.parent, timeout=600)
    assert proc.returncode == 0, f"{path.name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
