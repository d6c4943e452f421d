"""Where the kernel sources and the shipped tuning data live (one function each).

Installed, setup.cfg maps the repository's top-level ``clkernels/`` and ``tuning/`` into the
package as ``flashcl/clkernels`` and ``flashcl/tuning``; from a source checkout they sit beside
``flashcl/``.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent


def _locate(name: str, marker: str) -> Path:
    for candidate in (_PACKAGE / name, _PACKAGE.parent / name):
        if any(candidate.glob(marker)):
            return candidate
    raise FileNotFoundError(f"flashcl's {name}/ folder was not found next to {_PACKAGE}")


@lru_cache(maxsize=None)
def kernel_dir() -> Path:
    """The folder holding the OpenCL ``.cl`` sources (passed to the compiler with ``-I``)."""
    return _locate("clkernels", "*.cl")


@lru_cache(maxsize=None)
def shipped_tuning_dir() -> Path:
    """The folder holding the tuning database shipped with flashcl."""
    return _locate("tuning", "*.json")
