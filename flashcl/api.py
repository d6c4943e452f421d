"""The public API: validate inputs, pick a backend, dispatch (docs/design.md §1).

Everything here runs before any kernel: a malformed call raises ValueError/TypeError naming the
argument, what it received and what was expected.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import sys
from typing import TYPE_CHECKING, Any, Dict, Optional, Sequence, Tuple, Union

import numpy as np

from . import quant
from .quant import BLOCK_BYTES, QK, QuantizedTensor, check_layout
from .quant import dtype_name as _dtype_name
from .reference import MASK_HIDES_AT
from .tables import check_tables, torch_readable
from .variants import DECODE_GROUP_ROWS, DECODE_ROWS, Variants

if TYPE_CHECKING:  # the array types the API takes; none is imported at run time
    import pyopencl
    import pyopencl.array
    import torch

    Array = Union[np.ndarray, torch.Tensor, pyopencl.array.Array]
    Device = Union[str, pyopencl.Device, pyopencl.Context, pyopencl.CommandQueue, None]
else:
    Array = Any
    Device = Any
Params = Optional[Dict[str, Any]]

MIN_HEAD_DIM, MAX_HEAD_DIM, HEAD_DIM_STEP = 8, 256, 8
_BACKENDS = ("auto", "opencl", "triton")
_LOG2E = 1.0 / math.log(2.0)


# --------------------------------------------------------------------------- input kinds

def _is_torch(x) -> bool:
    torch = sys.modules.get("torch")  # isinstance, not a module-name test: torch.compile traces it
    return torch is not None and isinstance(x, torch.Tensor)


def _is_cl_array(x) -> bool:
    return type(x).__module__.startswith("pyopencl") and hasattr(x, "queue")


def _kind(x, name: str) -> str:
    if isinstance(x, QuantizedTensor):  # where its bytes live
        return _kind(x.data, f"{name}.data")
    if isinstance(x, np.ndarray):
        return "numpy"
    if _is_torch(x):
        return "cuda" if x.is_cuda else "torch-cpu"
    if _is_cl_array(x):
        return "cl"
    raise TypeError(
        f"{name}: expected a numpy array, a torch tensor or a pyopencl Array, got {type(x).__name__}"
    )


def _check_head_dim(name: str, d: int) -> None:
    if not (MIN_HEAD_DIM <= d <= MAX_HEAD_DIM and d % HEAD_DIM_STEP == 0):
        raise ValueError(
            f"{name}: head dim {d} is not supported; expected a multiple of {HEAD_DIM_STEP} "
            f"from {MIN_HEAD_DIM} to {MAX_HEAD_DIM}"
        )


MAX_BLOCK_SIZE = 256


def check_block_size(name: str, block_size: int) -> None:
    """A paged cache's block size: a power of two from 1 to MAX_BLOCK_SIZE."""
    if block_size < 1 or block_size > MAX_BLOCK_SIZE or block_size & (block_size - 1):
        raise ValueError(f"{name}: block size {block_size} is not supported; expected a power of two "
                         f"from 1 to {MAX_BLOCK_SIZE}")


def _common_kind(tensors: dict) -> str:
    kinds = {name: _kind(x, name) for name, x in tensors.items()}
    if len(set(kinds.values())) > 1:
        quantized = {n for n, x in tensors.items() if isinstance(x, QuantizedTensor)}
        desc = ", ".join(f"{n}={k}" + (" (a QuantizedTensor's data)" if n in quantized else "")
                         for n, k in kinds.items())
        raise TypeError(f"inputs must all be of one kind (numpy, torch CPU, torch CUDA or pyopencl); got {desc}")
    return next(iter(kinds.values()))


def _common_dtype(tensors: dict, allowed: tuple[str, ...], backend: str) -> str:
    dtypes = {name: _dtype_name(x) for name, x in tensors.items()}
    first = next(iter(dtypes.values()))
    if any(d != first for d in dtypes.values()):
        desc = ", ".join(f"{n}={d}" for n, d in dtypes.items())
        raise TypeError(f"inputs must share one dtype; got {desc}")
    if first not in allowed:
        hint = " (bfloat16 as torch tensors or numpy arrays of ml_dtypes.bfloat16)" if backend == "OpenCL" else ""
        raise TypeError(f"dtype {first} is not supported by the {backend} backend; expected one of {allowed}{hint}")
    return first


def _check_scale(scale):
    if scale is None:
        return None
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating, np.integer)):
        raise TypeError(f"scale: expected a float, got {type(scale).__name__}")
    if not math.isfinite(float(scale)):
        raise ValueError(f"scale: expected a finite float, got {scale}")
    # The kernels compute in float32, with the scale folded into a base-2 exponent.
    if abs(float(scale)) * _LOG2E > float(np.finfo(np.float32).max):
        raise ValueError(f"scale: {scale} is not finite in float32 once multiplied by log2(e), "
                         f"which the kernels do; expected |scale| < {np.finfo(np.float32).max / _LOG2E:.3g}")
    return float(scale)


def _choose_backend(backend: str, kind: str) -> str:
    if backend not in _BACKENDS:
        raise ValueError(f"backend: expected one of {_BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if kind == "cuda" else "opencl"
    if backend == "opencl" and kind == "cuda":
        raise TypeError("backend='opencl' takes numpy arrays, torch CPU tensors or pyopencl Arrays, "
                        "not torch CUDA tensors")
    if backend == "triton":
        if kind == "torch-cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise TypeError("backend='triton' needs torch CUDA tensors (or CPU tensors with TRITON_INTERPRET=1)")
        if kind not in ("cuda", "torch-cpu"):
            raise TypeError(f"backend='triton' needs torch tensors, got {kind} inputs")
    return backend


# --------------------------------------------------------------------------- quantized K/V

# The QuantizedTensor formats (flashcl.quant) each backend's kernels take as K/V; an empty entry
# takes none. Layouts and scales: docs/quantized-formats.md.
QUANTIZED_KV_FORMATS = {
    ("opencl", "prefill"): ("q8_0", "q4_0", "int8"),
    ("triton", "prefill"): ("q8_0", "q4_0", "int8", "fp8_e4m3"),
    ("opencl", "decode"): ("q8_0", "q4_0", "int8"),
    ("triton", "decode"): ("q8_0", "q4_0", "int8", "fp8_e4m3"),
}


def _check_quantized(kernel: str, backend: str, q, kv: dict) -> None:
    """Each QuantizedTensor of ``kv`` (name -> k/v or k_cache/v_cache): a format the backend's
    kernel takes, q's dtype as its logical dtype, whole ggml blocks, data/scales that hold it."""
    if isinstance(q, QuantizedTensor):
        raise TypeError("q: got a QuantizedTensor; only the K/V caches may be quantized "
                        "(pass q as a float array)")
    takes = QUANTIZED_KV_FORMATS[(backend, kernel)]
    for name, x in kv.items():
        if not isinstance(x, QuantizedTensor):
            continue
        if not takes:
            raise TypeError(f"{kernel}: quantized K/V caches are not supported yet on {backend}; "
                            "dequantize them with flashcl.dequantize(...)")
        if x.fmt not in takes:
            hint = " (a torch-only format: run it on the triton backend)" if x.fmt == "fp8_e4m3" else ""
            raise TypeError(f"{name}: {kernel} on {backend} takes quantized caches in "
                            f"{', '.join(takes)}; got {x.fmt!r}{hint}")
        if _dtype_name(x) != _dtype_name(q):
            raise TypeError(f"{name}: a QuantizedTensor's logical dtype (the dtype it was quantized "
                            f"from) must be q's, {_dtype_name(q)}; got {_dtype_name(x)}")
        dim = "DK" if name.startswith("k") else "DV"
        if x.fmt in BLOCK_BYTES and x.shape[-1] % QK:
            raise ValueError(f"{name}: {x.fmt} packs the head dim in blocks of {QK}; got {dim}={x.shape[-1]}")
        check_layout(x, name)


@functools.lru_cache(maxsize=None)
def _triton_quantizer():
    """flashcl/triton/quantize.py, which quantizes CUDA tensors in one launch; None without Triton."""
    try:
        from .triton import quantize
    except ImportError:
        return None
    return quantize


quant.set_cuda_quantizer(_triton_quantizer)  # quant, below the backends, cannot import them


# --------------------------------------------------------------------------- variants

def _host_array(x, name: str) -> np.ndarray:
    """A small per-call array (sinks, slopes, mask) as numpy, from numpy, torch or pyopencl."""
    if isinstance(x, np.ndarray):
        return x
    if _is_torch(x):
        return x.detach().cpu().numpy() if str(x.dtype) != "torch.bfloat16" else x.detach().cpu().float().numpy()
    if _is_cl_array(x):
        return x.get()
    if isinstance(x, (list, tuple)):
        return np.asarray(x)
    raise TypeError(f"{name}: expected a numpy array, a torch tensor or a pyopencl Array, got {type(x).__name__}")


def _check_bool(x, name: str) -> None:
    if not isinstance(x, (bool, np.bool_)):
        raise TypeError(f"{name}: expected a bool, got {type(x).__name__}")


def _check_window(window) -> Optional[Tuple[int, int]]:
    if window is None:
        return None
    ok = isinstance(window, (tuple, list)) and len(window) == 2 and all(
        isinstance(w, (int, np.integer)) and not isinstance(w, bool) and w >= -1 for w in window)
    if not ok:
        raise ValueError(f"window: expected (left, right), two ints >= 0 or -1 (unbounded), got {window!r}")
    # a bound past 2^30 is wider than any sequence: held there, kernels add it to positions in int32
    left, right = (min(int(w), 1 << 30) for w in window)
    return None if (left, right) == (-1, -1) else (left, right)


def _check_softcap(softcap) -> Optional[float]:
    if softcap is None:
        return None
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float, np.floating, np.integer)):
        raise TypeError(f"softcap: expected a float, got {type(softcap).__name__}")
    if not (math.isfinite(float(softcap)) and float(softcap) > 0):
        raise ValueError(f"softcap: expected a finite float > 0, got {softcap}")
    _check_kernel_range(np.asarray([float(softcap)]), "softcap")
    return float(softcap)


def _per_head(x, name: str, shapes: tuple):
    """sinks / alibi_slopes as float32 of one of ``shapes``: a torch tensor stays torch on its
    device (no host round trip under CUDA graphs or torch.compile), anything else becomes numpy."""
    if not isinstance(x, (list, tuple)) and not hasattr(x, "dtype"):
        raise TypeError(f"{name}: expected an array of float32 values, got {type(x).__name__}")
    kind = _dtype_name(x) if not isinstance(x, (list, tuple)) else "list"
    if kind not in ("float32", "float64", "float16", "bfloat16", "list"):
        raise TypeError(f"{name}: expected float32 values, got {kind}")
    arr = x if _is_torch(x) else _host_array(x, name)
    if tuple(arr.shape) not in shapes:
        raise ValueError(f"{name}: expected shape {' or '.join(map(str, shapes))}, got {tuple(arr.shape)}")
    if _values_checkable(arr):
        host = _host_array(arr, name).astype(np.float64)
        # a sink of -inf is no sink for that head; NaN or +inf has no meaning in a normalizer
        bad = np.isnan(host) | (np.isinf(host) if name == "alibi_slopes" else np.isposinf(host))
        if bad.any():
            allowed = "finite values" if name == "alibi_slopes" else "finite values or -inf (no sink)"
            raise ValueError(f"{name}: expected {allowed}, got {host[bad].flat[0]}")
        _check_kernel_range(host, name, both_signs=name == "alibi_slopes")
    if _is_torch(arr):
        import torch

        return arr.detach().to(torch.float32).contiguous()
    return np.ascontiguousarray(arr, dtype=np.float32)


def _values_checkable(x) -> bool:
    """Whether a small per-call array's values may be read on the host (tables.torch_readable;
    numpy and pyopencl arrays always)."""
    return not _is_torch(x) or torch_readable(x)


# The largest value the kernels take (sinks, slopes, masks, softcap): they compute x log2(e) in
# float32. A mask's or a sink's value at or below -KERNEL_RANGE hides the key or the sink instead.
KERNEL_RANGE = -MASK_HIDES_AT


def _check_kernel_range(x: np.ndarray, name: str, both_signs: bool = False) -> None:
    """Finite values above KERNEL_RANGE (both signs: in magnitude) would become inf in the kernels."""
    finite = x[np.isfinite(x)]
    top = float((np.abs(finite) if both_signs else finite).max(initial=0.0))  # float16 cannot hold the range
    if top > KERNEL_RANGE:
        raise ValueError(f"{name}: {top:.3g} is past the kernels' range, {KERNEL_RANGE:.4g} (they compute "
                         "in float32, in log2 units: it would become inf)")


def _slopes(x, b: int, h_q: int):
    """alibi_slopes validated and broadcast to (B, H_q)."""
    x = _per_head(x, "alibi_slopes", ((h_q,), (b, h_q)))
    if _is_torch(x):
        return x.expand(b, h_q).contiguous()
    return np.ascontiguousarray(np.broadcast_to(x, (b, h_q)))


def _check_mask(mask, b: int, h_q: int, n_q: int, n_kv: int) -> np.ndarray:
    """The mask as a 4-D (B or 1, H_q or 1, N_q, N_kv) numpy array: bool, or float32 additive."""
    kind = _dtype_name(mask) if hasattr(mask, "dtype") else "unknown"
    if kind != "bool" and kind not in ("float32", "float16", "bfloat16", "float64"):
        raise TypeError(f"mask: expected bool (True = may attend) or an additive float mask, got {kind}")
    if _is_torch(mask):  # stays on its device (a CUDA mask is not copied through the host)
        return _check_mask_torch(mask, kind, b, h_q, n_q, n_kv)
    arr = _host_array(mask, "mask")
    if arr.ndim > 4:
        raise ValueError(f"mask: expected at most 4 dims broadcastable to (B, H_q, N_q, N_kv) = "
                         f"{(b, h_q, n_q, n_kv)}, got shape {tuple(arr.shape)}")
    shape4 = (1,) * (4 - arr.ndim) + tuple(arr.shape)
    full = (b, h_q, n_q, n_kv)
    if any(s not in (1, f) for s, f in zip(shape4, full)):
        raise ValueError(f"mask: shape {tuple(arr.shape)} does not broadcast to (B, H_q, N_q, N_kv) = {full}")
    if kind != "bool":
        _check_additive_mask(arr)
    target = (shape4[0], shape4[1], n_q, n_kv)
    arr = np.broadcast_to(arr.reshape(shape4), target)
    with np.errstate(over="ignore"):  # float64 values below float32's range hide their key as -inf does
        return np.ascontiguousarray(arr, dtype=np.bool_ if kind == "bool" else np.float32)


def _check_additive_mask(arr: np.ndarray) -> None:
    """No NaN, no +inf, nothing past the kernels' range (one pass: the largest value)."""
    top = arr.max(initial=-np.inf)
    if np.isnan(top):
        raise ValueError("mask: an additive mask holds NaN (use -inf to hide a key)")
    if np.isposinf(top):
        raise ValueError("mask: an additive mask holds +inf (use -inf to hide a key)")
    _check_kernel_range(np.asarray([top]), "mask")


def _check_mask_torch(mask, kind: str, b: int, h_q: int, n_q: int, n_kv: int):
    import torch

    full = (b, h_q, n_q, n_kv)
    if mask.dim() > 4:
        raise ValueError(f"mask: expected at most 4 dims broadcastable to (B, H_q, N_q, N_kv) = "
                         f"{full}, got shape {tuple(mask.shape)}")
    shape4 = (1,) * (4 - mask.dim()) + tuple(mask.shape)
    if any(s not in (1, f) for s, f in zip(shape4, full)):
        raise ValueError(f"mask: shape {tuple(mask.shape)} does not broadcast to (B, H_q, N_q, N_kv) = {full}")
    if kind != "bool" and _values_checkable(mask):
        _check_additive_mask(mask.detach().float().numpy() if kind == "bfloat16" else mask.detach().numpy())
    out = mask.reshape(shape4).expand(shape4[0], shape4[1], n_q, n_kv)
    return out.to(torch.bool if kind == "bool" else torch.float32).contiguous()


def _variants(*, b: int, h_q: int, n_q: Optional[int], n_kv: Optional[int], window, softcap, sinks,
              alibi_slopes, mask=None) -> Optional[Variants]:
    """Validate the variant keywords; None when none is on (the plain kernels run)."""
    var = Variants(
        window=_check_window(window),
        softcap=_check_softcap(softcap),
        sinks=None if sinks is None else _per_head(sinks, "sinks", ((h_q,),)),
        alibi_slopes=None if alibi_slopes is None else _slopes(alibi_slopes, b, h_q),
        mask=None if mask is None else _check_mask(mask, b, h_q, n_q, n_kv),
    )
    return var if var.active else None


def _variants_on_host(var: Optional[Variants]) -> Optional[Variants]:
    """The variants' arrays as numpy (the OpenCL backends' family); torch CPU tensors are viewed."""
    if var is None:
        return None
    conv = (lambda x: x.detach().cpu().numpy() if _is_torch(x) else x)
    return dataclasses.replace(var, sinks=conv(var.sinks), alibi_slopes=conv(var.alibi_slopes),
                               mask=conv(var.mask))


def _variants_on_torch(var: Optional[Variants], like) -> Optional[Variants]:
    """The variants' arrays as torch tensors on ``like``'s device (the Triton backend's family)."""
    if var is None:
        return None
    import torch

    def conv(x):
        if x is None or _is_torch(x):
            return None if x is None else x.to(like.device)
        return torch.from_numpy(np.array(x)).to(like.device)  # a writable copy

    return Variants(var.window, var.softcap, conv(var.sinks), conv(var.alibi_slopes), conv(var.mask))


# --------------------------------------------------------------------------- prefill

def _prefill_shapes(q, k, v) -> tuple[int, tuple, tuple, tuple]:
    """Validate (B, H, N, D) / (H, N, D) shapes; return the rank and the 4-D shapes."""
    ranks = {"q": len(q.shape), "k": len(k.shape), "v": len(v.shape)}
    if any(r not in (3, 4) for r in ranks.values()) or len(set(ranks.values())) > 1:
        raise ValueError(f"q, k, v must all be 3-D (H, N, D) or all 4-D (B, H, N, D); got ranks {ranks}")
    rank = ranks["q"]
    qs, ks, vs = (tuple(int(s) for s in x.shape) for x in (q, k, v))
    if rank == 3:
        qs, ks, vs = (1, *qs), (1, *ks), (1, *vs)
    (b, h_q, n_q, dk), (bk, h_kv, n_kv, dkk), (bv, h_v, n_v, dv) = qs, ks, vs
    if not (b == bk == bv):
        raise ValueError(f"batch sizes differ: q {b}, k {bk}, v {bv}")
    if h_kv != h_v:
        raise ValueError(f"k has {h_kv} heads but v has {h_v}")
    if dk != dkk:
        raise ValueError(f"q has head dim {dk} but k has {dkk}")
    if n_kv != n_v:
        raise ValueError(f"k has {n_kv} keys but v has {n_v}")
    check_prefill_problem(b, h_q, h_kv, n_q, n_kv, dk, dv)
    return rank, qs, ks, vs


def prefill(q: Array, k: Array, v: Array, *, causal: bool = False, scale: Optional[float] = None,
            device: Device = None, params: Params = None, backend: str = "auto",
            return_lse: bool = False, window: Optional[Tuple[int, int]] = None,
            softcap: Optional[float] = None, sinks: Optional[Array] = None,
            alibi_slopes: Optional[Array] = None,
            mask: Optional[Array] = None) -> Union[Array, Tuple[Array, Array]]:
    """Exact attention of q over k/v (flash-attention prefill).

    q (B, H_q, N_q, DK), k (B, H_kv, N_kv, DK), v (B, H_kv, N_kv, DV), or the same without B.
    k and/or v may be a flashcl.QuantizedTensor in a format the backend takes
    (QUANTIZED_KV_FORMATS), dequantized inside the kernel.
    ``causal=True`` is bottom-right aligned (query i sees keys j <= i + N_kv - N_q).
    Returns out (.., H_q, N_q, DV) in the input's type and dtype, and lse (.., H_q, N_q) float32
    when ``return_lse``. Variants (flashcl.variants, all off by default): ``window=(left, right)``,
    ``softcap``, ``sinks`` (H_q,), ``alibi_slopes`` (H_q,) or (B, H_q), ``mask`` (bool or additive,
    broadcastable to (B, H_q, N_q, N_kv)).
    """
    kind = _common_kind({"q": q, "k": k, "v": v})
    chosen = _choose_backend(backend, kind)
    rank, qs, ks, vs = _prefill_shapes(q, k, v)
    _check_quantized("prefill", chosen, q, {"k": k, "v": v})
    scale = _check_scale(scale)
    _check_bool(causal, "causal")
    _check_bool(return_lse, "return_lse")
    if params is not None and not isinstance(params, dict):
        raise TypeError(f"params: expected a dict of tile parameters, got {type(params).__name__}")
    if scale is None:
        scale = 1.0 / math.sqrt(qs[3])
    variants = _variants(b=qs[0], h_q=qs[1], n_q=qs[2], n_kv=ks[2], window=window, softcap=softcap,
                         sinks=sinks, alibi_slopes=alibi_slopes, mask=mask)

    if chosen == "triton":
        _common_dtype({"q": q, "k": k, "v": v}, ("float32", "float16", "bfloat16"), "Triton")
        from .triton import one_call_at_a_time, prefill as triton_prefill

        with one_call_at_a_time():
            return triton_prefill.prefill(q, k, v, causal=bool(causal), scale=scale,
                                          return_lse=return_lse, params=params,
                                          variants=_variants_on_torch(variants, q))

    _common_dtype({"q": q, "k": k, "v": v}, ("float32", "float16", "bfloat16"), "OpenCL")
    from .opencl import prefill as cl_prefill

    variants = _variants_on_host(variants)
    return cl_prefill.prefill(q, k, v, rank=rank, shapes=(qs, ks, vs), causal=bool(causal),
                              scale=scale, device=device, params=params, return_lse=return_lse,
                              variants=variants)


# --------------------------------------------------------------------------- decode

def _decode_shapes(q, k_cache, v_cache, block_table, context_lens, key_start=None) -> dict:
    """Validate a decode call; return its geometry. Values of host block_table/context_lens are
    checked by tables.check_tables (a device tensor is not read back); key_start's need no check
    (any int32 has a meaning)."""
    if len(q.shape) not in (3, 4):
        raise ValueError(f"q: expected (B, H_q, DK) or (B, H_q, N_q, DK) for decode, got shape {tuple(q.shape)}")
    b, h_q, dk = (int(s) for s in (*q.shape[:2], q.shape[-1]))
    n_q = int(q.shape[2]) if len(q.shape) == 4 else 1
    if not 1 <= n_q <= DECODE_ROWS:
        raise ValueError(f"q: a decode takes 1 to {DECODE_ROWS} query rows per sequence (q.shape[2]), got "
                         f"{n_q}; longer chunks run as a prefill over a contiguous cache")
    if len(k_cache.shape) != 4 or len(v_cache.shape) != 4:
        raise ValueError(f"k_cache/v_cache must be 4-D, got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    ks, vs = tuple(int(s) for s in k_cache.shape), tuple(int(s) for s in v_cache.shape)
    paged = block_table is not None
    if paged:
        num_blocks, block_size, h_kv, dkk = ks
        if vs[:3] != ks[:3]:
            raise ValueError(f"paged v_cache {vs} must match k_cache {ks} in (num_blocks, block_size, H_kv)")
        check_block_size("k_cache.shape[1]", block_size)
        if len(block_table.shape) != 2 or int(block_table.shape[0]) != b:
            raise ValueError(f"block_table: expected (B={b}, max_blocks), got shape {tuple(block_table.shape)}")
        if _dtype_name(block_table) != "int32":
            raise TypeError(f"block_table: expected int32, got {_dtype_name(block_table)}")
        if context_lens is None:
            raise ValueError("a paged cache (block_table given) needs context_lens (B,) int32")
        n_max = int(block_table.shape[1]) * block_size
    else:
        bk, h_kv, n_max, dkk = ks
        if vs[:3] != ks[:3]:
            raise ValueError(f"v_cache {vs} must match k_cache {ks} in (B, H_kv, N_max)")
        if bk != b:
            raise ValueError(f"k_cache batch {bk} differs from q batch {b}")
        block_size = num_blocks = None
        if n_max == 0:
            raise ValueError(f"empty cache: k_cache shape {ks}")
    if context_lens is not None:
        if tuple(context_lens.shape) != (b,):
            raise ValueError(f"context_lens: expected shape ({b},), got {tuple(context_lens.shape)}")
        if _dtype_name(context_lens) != "int32":
            raise TypeError(f"context_lens: expected int32, got {_dtype_name(context_lens)}")
    if key_start is not None:
        if tuple(key_start.shape) != (b,):
            raise ValueError(f"key_start: expected shape ({b},), got {tuple(key_start.shape)}")
        if _dtype_name(key_start) != "int32":
            raise TypeError(f"key_start: expected int32, got {_dtype_name(key_start)}")
    if dkk != dk:
        raise ValueError(f"q has head dim {dk} but k_cache has {dkk}")
    if h_kv == 0 or h_q % h_kv:
        raise ValueError(f"H_q={h_q} must be a multiple of H_kv={h_kv} (MHA, GQA or MQA)")
    if n_q > 1 and h_q // h_kv * n_q > DECODE_GROUP_ROWS:
        raise ValueError(f"q: {n_q} query rows of a group of {h_q // h_kv} query heads make {h_q // h_kv * n_q} "
                         f"rows per KV head; a decode takes at most {DECODE_GROUP_ROWS}")
    if b == 0:
        raise ValueError("empty batch: q.shape[0] == 0")
    if h_q == 0:
        raise ValueError("no query heads: q.shape[1] == 0")
    _check_head_dim("q/k_cache", dk)
    _check_head_dim("v_cache", vs[3])
    return {"B": b, "H_q": h_q, "H_kv": h_kv, "DK": dk, "DV": vs[3], "paged": paged,
            "block_size": block_size, "num_blocks": num_blocks, "N_max": n_max, "N_q": n_q}


def _as_rows(q, variants: Optional[Variants], geo: dict):
    """A decode of q (B, H_q, N_q, DK) as the kernels run it: q (B, H_q N_q, DK), the geometry's
    H_q the rows, sinks and ALiBi slopes repeated per row (a head's rows are its values')."""
    n_q = geo["N_q"]
    if _is_cl_array(q) and not q.flags.c_contiguous:
        raise ValueError("q: a 4-D pyopencl Array for decode must be C-contiguous (its rows become heads)")
    rows = q.reshape(geo["B"], geo["H_q"] * n_q, geo["DK"])
    return rows, None if variants is None else variants.per_row(n_q), {**geo, "H_q": geo["H_q"] * n_q}


def _of_rows(result, geo: dict, return_lse: bool):
    """A decode's out (B, H_q N_q, DV) and lse (B, H_q N_q) as the call's (B, H_q, N_q, ...)."""
    out, lse = result if return_lse else (result, None)
    b, h_q, n_q = geo["B"], geo["H_q"], geo["N_q"]
    out = out.reshape(b, h_q, n_q, geo["DV"])
    return (out, lse.reshape(b, h_q, n_q)) if return_lse else out


def _check_num_splits(num_splits):
    if num_splits is None:
        return None
    if isinstance(num_splits, bool) or not isinstance(num_splits, (int, np.integer)) or num_splits < 1:
        raise ValueError(f"num_splits: expected None or an int >= 1, got {num_splits!r}")
    return int(num_splits)


def decode(q: Array, k_cache: Array, v_cache: Array, *, block_table: Optional[Array] = None,
           context_lens: Optional[Array] = None, scale: Optional[float] = None,
           num_splits: Optional[int] = None, device: Device = None, params: Params = None,
           backend: str = "auto", return_lse: bool = False,
           window: Optional[Tuple[int, int]] = None, softcap: Optional[float] = None,
           sinks: Optional[Array] = None, alibi_slopes: Optional[Array] = None,
           key_start: Optional[Array] = None) -> Union[Array, Tuple[Array, Array]]:
    """New query tokens of each sequence attending over its KV cache (flash-decoding).

    q (B, H_q, DK), one token per sequence, or (B, H_q, N_q, DK): each sequence's last N_q tokens
    (1 to DECODE_ROWS; with N_q > 1 at most DECODE_GROUP_ROWS rows per KV head counting its
    group's heads; speculative decoding's verification; a pyopencl q C-contiguous), causal among
    themselves: row i sits at position context_lens[b] - N_q + i, as prefill's bottom-right causal.
    Contiguous cache: k_cache (B, H_kv, N_max, DK), v_cache (B, H_kv, N_max, DV),
    optional context_lens (B,) int32. Paged cache (vLLM layout): k_cache (num_blocks, block_size,
    H_kv, DK), v_cache (num_blocks, block_size, H_kv, DV), block_table (B, max_blocks) int32,
    context_lens (B,) int32. ``num_splits``: None picks the split-k count, 1 is single pass.
    Either cache may be a flashcl.QuantizedTensor of q's kind and dtype, in a format the backend
    takes (QUANTIZED_KV_FORMATS); it reaches the kernels as it is, dequantized inside them.
    Returns out (B, H_q, DV) and, on request, lse (B, H_q) float32 (with N_q: (B, H_q, N_q, DV) and
    (B, H_q, N_q)). Variants as for prefill (no mask), at each row's position (a 3-D q's:
    context_lens[b] - 1). ``key_start`` (B,)
    int32, the same kind as q: sequence b sees no key before key_start[b] (a left-padded batch's
    padding; values <= 0 hide nothing, at or past the length every key: that row is zeros).
    """
    tensors = {"q": q, "k_cache": k_cache, "v_cache": v_cache}
    kind = _common_kind(tensors)
    for name, x in (("block_table", block_table), ("context_lens", context_lens), ("key_start", key_start)):
        if x is not None and _kind(x, name) != kind:
            raise TypeError(f"{name} must be the same kind of array as q ({kind}), got {_kind(x, name)}")
    chosen = _choose_backend(backend, kind)
    geo = _decode_shapes(q, k_cache, v_cache, block_table, context_lens, key_start)
    _check_quantized("decode", chosen, q, {"k_cache": k_cache, "v_cache": v_cache})
    scale = _check_scale(scale)
    _check_bool(return_lse, "return_lse")
    num_splits = _check_num_splits(num_splits)
    if params is not None and not isinstance(params, dict):
        raise TypeError(f"params: expected a dict of tile parameters, got {type(params).__name__}")
    if scale is None:
        scale = 1.0 / math.sqrt(geo["DK"])
    variants = _variants(b=geo["B"], h_q=geo["H_q"], n_q=None, n_kv=None, window=window,
                         softcap=softcap, sinks=sinks, alibi_slopes=alibi_slopes)
    rows = len(q.shape) == 4  # each query head's rows run as heads of its group (QUERY_ROWS)
    q_run, variants_run, geo_run = _as_rows(q, variants, geo) if rows else (q, variants, geo)
    result = _decode_on(chosen, q_run, k_cache, v_cache, geo=geo_run, block_table=block_table,
                        context_lens=context_lens, scale=scale, num_splits=num_splits, device=device, params=params,
                        return_lse=return_lse, variants=variants_run, key_start=key_start, query_rows=geo["N_q"])
    return _of_rows(result, geo, return_lse) if rows else result


def _decode_on(chosen: str, q, k_cache, v_cache, *, geo: dict, block_table, context_lens, scale: float,
               num_splits, device, params, return_lse: bool, variants, key_start, query_rows: int = 1):
    """A validated decode on the backend ``chosen`` (``query_rows``: _as_rows's QUERY_ROWS)."""
    tensors = {"q": q, "k_cache": k_cache, "v_cache": v_cache}
    if chosen == "triton":
        _common_dtype(tensors, ("float32", "float16", "bfloat16"), "Triton")
        check_tables(geo, block_table, context_lens)  # torch CPU tables (the interpreter's); CUDA ones are not read
        from .triton import decode as triton_decode, one_call_at_a_time

        with one_call_at_a_time():
            return triton_decode.decode(q, k_cache, v_cache, block_table=block_table,
                                        context_lens=context_lens, scale=scale,
                                        num_splits=num_splits, return_lse=return_lse,
                                        variants=_variants_on_torch(variants, q), key_start=key_start,
                                        query_rows=query_rows)

    _common_dtype(tensors, ("float32", "float16", "bfloat16"), "OpenCL")
    from .opencl import decode as cl_decode

    variants = _variants_on_host(variants)
    if _is_torch(key_start):
        key_start = key_start.detach().numpy()
    return cl_decode.decode(q, k_cache, v_cache, geo=geo, block_table=block_table,
                            context_lens=context_lens, scale=scale, num_splits=num_splits,
                            device=device, params=params, return_lse=return_lse,
                            variants=variants, key_start=key_start, query_rows=query_rows)


# --------------------------------------------------------------------------- merge

def _merge_inputs(outs, lses) -> str:
    """Validate merge_states' inputs as prefill's are; return their kind ("numpy" or "torch")."""
    for name, parts in (("outs", outs), ("lses", lses)):
        if not isinstance(parts, (list, tuple)):
            raise TypeError(f"{name}: expected a list or tuple of arrays, got {type(parts).__name__}")
    if len(outs) != len(lses) or not outs:
        raise ValueError(f"merge_states needs equally many outs and lses (>= 1), got {len(outs)} and {len(lses)}")
    kinds = {f"{name}[{i}]": _kind(x, f"{name}[{i}]") for name, parts in (("outs", outs), ("lses", lses))
             for i, x in enumerate(parts)}
    if "cl" in kinds.values():
        raise TypeError("merge_states takes numpy arrays or torch tensors; call .get() on pyopencl Arrays")
    families = {k: ("numpy" if v == "numpy" else "torch") for k, v in kinds.items()}
    if len(set(families.values())) > 1:
        desc = ", ".join(f"{n}={kinds[n]}" for n in kinds)
        raise TypeError(f"merge_states: inputs must all be numpy arrays or all torch tensors; got {desc}")
    devices = {str(x.device) for x in (*outs, *lses)} if families["outs[0]"] == "torch" else set()
    if len(devices) > 1:
        raise TypeError(f"merge_states: torch inputs must share one device, got {sorted(devices)}")
    shape = tuple(outs[0].shape)
    if len(shape) < 1:
        raise ValueError(f"outs[0]: expected (..., DV), got shape {shape}")
    out_dtype = _dtype_name(outs[0])
    for i, (o, l) in enumerate(zip(outs, lses)):
        if tuple(o.shape) != shape:
            raise ValueError(f"outs[{i}]: shape {tuple(o.shape)} differs from outs[0]'s {shape}")
        if tuple(l.shape) != shape[:-1]:
            raise ValueError(f"lses[{i}]: expected shape {shape[:-1]} (outs' shape without DV), got {tuple(l.shape)}")
        if _dtype_name(o) != out_dtype:
            raise TypeError(f"outs[{i}]: dtype {_dtype_name(o)} differs from outs[0]'s {out_dtype}")
        if _dtype_name(o) not in ("float32", "float16", "bfloat16", "float64"):
            raise TypeError(f"outs[{i}]: expected a floating dtype, got {_dtype_name(o)}")
        if _dtype_name(l) not in ("float32", "float64"):
            raise TypeError(f"lses[{i}]: expected float32 (as return_lse gives), got {_dtype_name(l)}")
    return families["outs[0]"]


def merge_states(outs: Sequence[Array], lses: Sequence[Array]) -> Tuple[Array, Array]:
    """Exact merge of normalized partial results over disjoint key sets.

    ``outs[i]`` (..., DV) and ``lses[i]`` (...) from calls with ``return_lse=True``; returns the
    merged (out, lse). Each part is weighted by exp(lse_i - lse_max); parts with lse -inf (no key
    seen) contribute nothing, whatever their out holds (SDPA gives NaN there), and a row no part
    saw stays (0, -inf). A row whose lse is NaN or +inf in any part is NaN in both results; NaN in
    the out of a part that saw keys reaches only those columns of out.
    """
    if _merge_inputs(outs, lses) == "torch":
        import torch

        xp_o = torch.stack([o.float() for o in outs])
        xp_l = torch.stack([l.float() for l in lses])
        m = xp_l.amax(0)
        m_safe = torch.where(torch.isinf(m) & (m < 0), torch.zeros_like(m), m)
        w = torch.exp(xp_l - m_safe)
        den = w.sum(0)
        part = torch.where(torch.isneginf(xp_l)[..., None], torch.zeros_like(xp_o), w[..., None] * xp_o)
        out = part.sum(0) / torch.where(den > 0, den, torch.ones_like(den))[..., None]
        lse = torch.where(den > 0, m_safe + torch.log(torch.where(den > 0, den, torch.ones_like(den))),
                          torch.full_like(den, -float("inf")))
        bad = (torch.isnan(xp_l) | torch.isposinf(xp_l)).any(0)
        out = torch.where(bad[..., None], torch.full_like(out, float("nan")), out)
        lse = torch.where(bad, torch.full_like(lse, float("nan")), lse)
        return out.to(outs[0].dtype), lse
    o = np.stack([np.asarray(x, dtype=np.float64) for x in outs])
    l = np.stack([np.asarray(x, dtype=np.float64) for x in lses])
    m = l.max(0)
    m_safe = np.where(np.isneginf(m) | np.isnan(m), 0.0, m)
    with np.errstate(invalid="ignore"):
        w = np.exp(l - m_safe)
        den = w.sum(0)
        seen = den > 0
        part = np.where(np.isneginf(l)[..., None], 0.0, w[..., None] * o)
        out = part.sum(0) / np.where(seen, den, 1.0)[..., None]
        lse = np.where(seen, m_safe + np.log(np.where(seen, den, 1.0)), -np.inf)
    bad = (np.isnan(l) | np.isposinf(l)).any(0)
    out[bad] = np.nan
    lse[bad] = np.nan
    return out.astype(np.asarray(outs[0]).dtype), lse.astype(np.float32)


# --------------------------------------------------------------------------- problem checks

def check_prefill_problem(b: int, h_q: int, h_kv: int, n_q: int, n_kv: int, dk: int, dv: int) -> None:
    """The checks ``prefill`` applies to a problem's sizes (it calls this), for callers that hold
    sizes rather than arrays (``flashcl tune``, ``bench``, ``show-config``): ValueError naming the
    size that is wrong and what is expected."""
    if h_kv < 1 or h_q % h_kv:
        raise ValueError(f"H_q={h_q} must be a multiple of H_kv={h_kv} (MHA, GQA or MQA)")
    if min(b, h_q, n_q, n_kv) < 1:
        raise ValueError(f"empty input: B={b}, H_q={h_q}, N_q={n_q}, N_kv={n_kv} (every dimension must be >= 1)")
    _check_head_dim("q/k", dk)
    _check_head_dim("v", dv)
