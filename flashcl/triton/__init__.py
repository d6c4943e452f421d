"""Triton (CUDA) kernels registered as torch custom ops."""

import contextlib
import os
import threading

_INTERPRETER = threading.Lock()


def _float32_dots() -> str:
    """How float32 dots run: $FLASHCL_TRITON_FLOAT32_DOTS, "tf32x3" (the default) or "ieee"."""
    value = os.environ.get("FLASHCL_TRITON_FLOAT32_DOTS", "tf32x3")
    if value not in ("tf32x3", "ieee"):
        raise ValueError(f"FLASHCL_TRITON_FLOAT32_DOTS: expected 'tf32x3' or 'ieee', got {value!r}")
    return value


# float32 dots as three TF32 tensor-core products (hi*hi + hi*lo + lo*hi): as close to the float64
# oracle as IEEE dots on CUDA cores, 2.5-5x their speed (docs/notes/triton-prefill.md, "float32 dots");
# "ieee" keeps FMA dots on CUDA cores, and float32 tiles against quantized caches
FLOAT32_DOTS = _float32_dots()


def interpreting() -> bool:
    """TRITON_INTERPRET=1: the kernels run in Triton's CPU interpreter (how CI tests them). Its
    tl.dot multiplies bfloat16 operands as their raw uint16 bits (triton 3.9 interpreter), so
    there the kernels run bf16 dots on fp32 copies."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def one_call_at_a_time():
    """A context that runs one flashcl call at a time under the interpreter, whose launches share
    process state (threads calling at once failed with its internal errors); a no-op on GPUs and
    while torch.compile traces (a lock cannot enter its graph)."""
    import torch

    if not interpreting() or torch.compiler.is_compiling():
        return contextlib.nullcontext()
    return _INTERPRETER


def on_device_of(t):
    """A context in which ``t``'s GPU is the current CUDA device: Triton launches on the current
    device and its stream, whatever device the arguments are on. No-op for CPU tensors."""
    import torch

    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def skips_dispatcher(*tensors) -> bool:
    """Whether a call may run its op's implementation directly, not through ``torch.ops``: in eager
    mode the dispatcher costs 50-180 us a call, several times the kernels (docs/notes/triton-host.md).
    Only where nothing should see the op: no compile, trace, vmap or other functorch transform,
    torch-function or dispatch mode, or profiler running, and plain tensors (None is skipped) with
    no gradient to record."""
    import torch

    if (torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack()
            or torch._C._is_torch_function_mode_enabled() or torch._C._are_functorch_transforms_active()
            or torch._C._get_tracing_state() is not None or torch._C._autograd._profiler_enabled()):
        return False
    grad = torch.is_grad_enabled()
    return all(t is None or (type(t) is torch.Tensor and not (grad and t.requires_grad)) for t in tensors)
