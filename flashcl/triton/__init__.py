"""Triton (CUDA) kernels registered as torch custom ops."""

import os


def interpreting() -> bool:
    """TRITON_INTERPRET=1: the kernels run in Triton's CPU interpreter (how CI tests them). Its
    tl.dot multiplies bfloat16 operands as their raw uint16 bits (triton 3.9 interpreter), so
    there the kernels run bf16 dots on fp32 copies."""
    return os.environ.get("TRITON_INTERPRET") == "1"
