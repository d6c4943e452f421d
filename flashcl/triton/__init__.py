"""Triton (CUDA) kernels registered as torch custom ops."""

import contextlib
import os


def interpreting() -> bool:
    """TRITON_INTERPRET=1: the kernels run in Triton's CPU interpreter (how CI tests them). Its
    tl.dot multiplies bfloat16 operands as their raw uint16 bits (triton 3.9 interpreter), so
    there the kernels run bf16 dots on fp32 copies."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def on_device_of(t):
    """A context in which ``t``'s GPU is the current CUDA device: Triton launches on the current
    device and its stream, whatever device the arguments are on. No-op for CPU tensors."""
    import torch

    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()
