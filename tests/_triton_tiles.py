"""The forced Triton prefill tile of the variant and quantized-cache tests: the interpreter's small
tile on CPU, one 64 x 64 tile on CUDA (one compile per flag set instead of an autotune)."""

from __future__ import annotations

from flashcl.triton import prefill as tp

CUDA_PARAMS = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}


def forced_params(device: str, **extra) -> dict:
    base = dict(tp._INTERPRETER_PARAMS) if device == "cpu" else dict(CUDA_PARAMS)
    return {**base, **extra}


def forced_tile(device: str) -> int:
    """BLOCK_N of forced_params: the key tile whose edges the tests place windows and masks on."""
    return forced_params(device)["BLOCK_N"]
