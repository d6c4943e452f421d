"""Quantized KV formats: quantize, dequantize, write new tokens into a quantized paged cache
(quantize_into) or into a contiguous one with room for them (with_room, write_tokens).

Every format quantizes along the last (head) dim, so contiguous (B, H_kv, N, D) caches and paged
(num_blocks, block_size, H_kv, D) caches both work, as does any other leading shape.

    format     data                                        scales
    q8_0       uint8 (..., D/32, 34): ggml's block_q8_0     float16 (..., D/32), a view of each
               bytes (fp16 d, then 32 int8 qs)              block's d inside ``data``
    q4_0       uint8 (..., D/32, 18): ggml's block_q4_0     float16 (..., D/32), as for q8_0
               bytes (fp16 d, then 16 bytes of nibbles)
    int8       int8 (..., D)                                float32 (..., 1): amax/127 per row
    fp8_e4m3   torch.float8_e4m3fn (..., D)                 float32 (), amax/448 per tensor

q8_0 and q4_0 reproduce ggml's reference quantizers (quantize_row_q8_0_ref, quantize_row_q4_0_ref)
byte for byte, all arithmetic in float32, so ``qt.data[row].tobytes()`` is ggml's row.

Where the math runs follows the input's kind, and data/scales come back in that kind:
- numpy: NumPy on the host.
- torch: CUDA tensors (q8_0, q4_0, int8) in one Triton launch (flashcl/triton/quantize.py, the
  same arithmetic), nothing syncing with the host; without Triton, and fp8_e4m3, in torch ops on
  their device, the same bytes as NumPy (one quantizer body serves both, through
  ``_NumpyOps``/``_TorchOps``). CPU tensors in NumPy's ops (fewer microseconds a call; float32
  ones on their own memory), data/scales back as torch.
- pyopencl Array: NumPy on the host, data/scales uploaded to the input's queue (OpenCL's float
  division need not be correctly rounded, so a device quantizer would not give ggml's bytes on
  every device). ggml scales are then a strided view of ``data``: read them through ``data``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

QK = 32                                   # values per ggml block
BLOCK_BYTES = {"q8_0": 2 + QK, "q4_0": 2 + QK // 2}
FORMATS = ("q8_0", "q4_0", "int8", "fp8_e4m3")
FP8_E4M3_MAX = 448.0


@dataclass(frozen=True)
class QuantizedTensor:
    """A tensor quantized along its last dim; ``shape`` and ``dtype`` are the original's."""

    data: Any            # numpy array, torch tensor (always for fp8_e4m3) or pyopencl Array
    scales: Any          # see the module docstring's table; the same kind as ``data``
    fmt: str
    shape: tuple
    dtype: Any           # numpy dtype (numpy/pyopencl inputs, fp8_e4m3 of numpy) or torch.dtype

    @property
    def axis(self) -> int:
        """The quantization axis: the last (head) dim."""
        return len(self.shape) - 1


# --------------------------------------------------------------------------- kinds

def _is_torch(x) -> bool:
    return type(x).__module__.split(".")[0] == "torch"


def _is_cl(x) -> bool:
    return type(x).__module__.split(".")[0] == "pyopencl" and hasattr(x, "queue")


def kind_of(x) -> str:
    """"numpy", "torch" or "cl" (pyopencl Array): where an array lives and which math serves it."""
    if _is_torch(x):
        return "torch"
    if _is_cl(x):
        return "cl"
    return "numpy"


# --------------------------------------------------------------------------- the two array kinds

class _NumpyOps:
    """The operations the quantizers need that NumPy and torch spell differently."""

    trunc, sign, abs = staticmethod(np.trunc), staticmethod(np.sign), staticmethod(np.abs)
    concat, where, clip = staticmethod(np.concatenate), staticmethod(np.where), staticmethod(np.clip)

    @staticmethod
    def f32(value, like):
        return np.float32(value)

    @staticmethod
    def amax(x, keepdims=False):
        return x.max(axis=-1, keepdims=keepdims)

    @staticmethod
    def first_absmax(x):
        """The signed value of largest magnitude along the last dim, the first one on ties."""
        return np.take_along_axis(x, np.abs(x).argmax(axis=-1)[..., None], axis=-1)[..., 0]

    @staticmethod
    def reciprocal_or_zero(d):
        return np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)

    @staticmethod
    def cast(x, dtype: str):
        return x.astype(dtype)

    @staticmethod
    def view(x, dtype: str):
        return x.view(np.dtype(dtype).newbyteorder("<") if dtype == "float16" else dtype)


class _TorchOps:
    """As _NumpyOps, in torch ops on the tensors' device. Divisors are always tensors: CUDA turns
    a division by a CPU scalar into a product with its reciprocal, one ulp off NumPy's quotient."""

    @staticmethod
    def f32(value, like):
        import torch
        return torch.full((), value, dtype=torch.float32, device=like.device)

    @staticmethod
    def trunc(x):
        return x.trunc()

    @staticmethod
    def sign(x):
        return x.sign()

    @staticmethod
    def abs(x):
        return x.abs()

    @staticmethod
    def concat(parts, axis=-1):
        import torch
        return torch.cat(parts, dim=axis)

    @staticmethod
    def where(cond, a, b):
        import torch
        return torch.where(cond, a, b)

    @staticmethod
    def amax(x, keepdims=False):
        return x.amax(dim=-1, keepdim=keepdims)

    @staticmethod
    def first_absmax(x):
        # torch.argmax returns the first maximal index, as NumPy's does
        return x.gather(-1, x.abs().argmax(dim=-1, keepdim=True))[..., 0]

    @staticmethod
    def reciprocal_or_zero(d):
        import torch
        return torch.where(d != 0, torch.ones_like(d) / d, torch.zeros_like(d))

    @staticmethod
    def clip(x, lo, hi):
        return x.clamp(lo, hi)

    @staticmethod
    def cast(x, dtype: str):
        import torch
        return x.to(getattr(torch, dtype))

    @staticmethod
    def view(x, dtype: str):
        import torch
        return x.view(getattr(torch, dtype))


def _ops(x):
    return _TorchOps if _is_torch(x) else _NumpyOps


# --------------------------------------------------------------------------- the formats

def _round_half_away(v, ops):
    """C's roundf: halves away from zero, exact for every float32 (no ``floor(v + 0.5)`` error)."""
    r = ops.trunc(v)
    return r + ops.where(ops.abs(v - r) >= 0.5, ops.sign(v), ops.f32(0, v))


def _ggml_blocks(x):
    if x.shape[-1] % QK:
        raise ValueError(f"q8_0/q4_0 quantize blocks of {QK} along the head dim; "
                         f"head dim {x.shape[-1]} is not a multiple of {QK}")
    return x.reshape(*x.shape[:-1], x.shape[-1] // QK, QK)


def _pack(d, qs, ops):
    """ggml's block: the fp16 d (little-endian) then the quant bytes."""
    d_bytes = ops.view(ops.cast(d, "float16")[..., None], "uint8")
    return ops.concat([d_bytes, ops.view(qs, "uint8")], axis=-1)


def _quantize_q8_0(x, ops):
    b = _ggml_blocks(x)
    d = ops.amax(ops.abs(b)) / ops.f32(127, b)
    qs = ops.cast(_round_half_away(b * ops.reciprocal_or_zero(d)[..., None], ops), "int8")
    return _pack(d, qs, ops)


def _quantize_q4_0(x, ops):
    b = _ggml_blocks(x)
    mx = ops.first_absmax(b)                          # ggml's strict `<`: the first on ties
    mx = ops.where(mx == 0, ops.f32(0, mx), mx)      # ggml's max starts at +0: an all-zero block has d = -0
    d = mx / ops.f32(-8, mx)
    # x*id + 8.5 lies in [0.5, 16.5], so the (int8_t) truncation is a floor
    q = ops.cast(ops.clip(ops.trunc(b * ops.reciprocal_or_zero(d)[..., None] + ops.f32(8.5, b)), 0, 15),
                 "uint8")
    return _pack(d, q[..., : QK // 2] | (q[..., QK // 2:] << 4), ops)


def _quantize_int8(x, ops):
    scale = ops.amax(ops.abs(x), keepdims=True) / ops.f32(127, x)
    safe = ops.where(scale == 0, ops.f32(1, scale), scale)
    q = ops.cast(ops.clip(_round_half_away(x / safe, ops), -127, 127), "int8")
    return q, scale


def _ggml_scales(data):
    """The fp16 d of every block, viewed in place inside ``data`` (..., D/32)."""
    if _is_cl(data):
        return data.view(np.float16)[..., 0]      # strided: kernels read it, .get() does not
    return _ops(data).view(data[..., :2], "float16")[..., 0]


def _dequantize_ggml(data, fmt: str, ops):
    d = ops.cast(ops.view(data[..., :2], "float16"), "float32")      # (..., D/32, 1)
    if fmt == "q8_0":
        q = ops.cast(ops.view(data[..., 2:], "int8"), "float32")
    else:
        nib = data[..., 2:]
        q = ops.cast(ops.concat([nib & 0x0F, nib >> 4], axis=-1), "float32") - ops.f32(8, d)
    out = q * d
    return out.reshape(*out.shape[:-2], out.shape[-2] * out.shape[-1])  # -1 fails on 0 rows


# --------------------------------------------------------------------------- entry points

_FLOAT_NAMES = ("float32", "float16", "bfloat16")


def _float32_of(x):
    """x as float32 in the kind its math runs in (torch on its device, else NumPy)."""
    if _is_torch(x):
        if dtype_name(x) not in _FLOAT_NAMES:
            raise TypeError(f"quantize takes float32, float16 or bfloat16 tensors, got {x.dtype}")
        return x.detach().float()
    x = _cl_to_host(x) if _is_cl(x) else np.asarray(x)
    if dtype_name(x) not in ("float32", "float16"):  # either byte order: astype swaps
        raise TypeError(f"quantize takes float32 or float16 arrays (bfloat16 as torch), got {x.dtype}")
    return x.astype(np.float32)


def _check_fmt(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"unknown quantized format {fmt!r}; choose one of {', '.join(FORMATS)}")


def quantize(x, fmt: str) -> QuantizedTensor:
    """Quantize ``x`` (numpy float32/float16, torch float32/float16/bfloat16 on any device, or a
    pyopencl Array of float32/float16; any shape ending in the head dim) to ``fmt`` (one of
    FORMATS) along its last dim. data/scales are of ``x``'s kind (torch on its device, pyopencl
    on its queue)."""
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        raise TypeError(f"quantize takes a numpy array, a torch tensor or a pyopencl Array, got {type(x).__name__}")
    return _quantize(x, fmt, dtype_name(x))


_DTYPE_NAMES: dict = {}  # dtype -> name: numpy's name lookup costs ~3 us, and a call asks ~10 times


def dtype_name(x) -> str:
    """The name of ``x``'s dtype ('float16', ...; numpy of either byte order, torch, pyopencl); a
    QuantizedTensor's is its logical dtype (the one it was quantized from)."""
    dtype = x.dtype
    if type(dtype).__module__ == "torch":  # not through the cache: torch.compile cannot hash its numpy keys
        return str(dtype).replace("torch.", "")
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = np.dtype(dtype).name
        _DTYPE_NAMES[dtype] = name
    return name


def _quantize(x, fmt: str, logical: str, torch_ops: bool = False) -> QuantizedTensor:
    """quantize, its range checks judged for a cache of dtype ``logical`` (quantize_into: the
    cache's, whatever kind the new tokens came in). A torch CPU tensor's math runs as NumPy's on
    the same memory, the same bytes in a quarter of the time for a step's few tokens (170 -> 42
    us a q8_0 token); ``torch_ops``: torch's own ops, as on CUDA (tests compare the two)."""
    _check_fmt(fmt)
    if len(x.shape) < 1 or x.shape[-1] == 0:
        raise ValueError(f"quantize needs a head dim (the last) of at least 1, got shape {tuple(x.shape)}")
    if fmt == "fp8_e4m3":
        return _quantize_fp8(x)
    quantizer = None if torch_ops else _triton_quantizer(x)
    if quantizer is not None and dtype_name(x) in _FLOAT_NAMES:
        return _quantize_on_cuda(x, fmt, quantizer)
    xf = _float32_of(x)
    on_host = _is_torch(xf) and xf.device.type == "cpu" and not torch_ops
    if on_host:
        xf = xf.numpy()
    ops = _ops(xf)
    # a d past fp16 is refused below (_check_ggml_range); NaN and inf blocks pass through as they are
    with np.errstate(over="ignore", invalid="ignore"):
        if fmt == "int8":
            data, scales = _quantize_int8(xf, ops)
        else:
            data = _quantize_q8_0(xf, ops) if fmt == "q8_0" else _quantize_q4_0(xf, ops)
            scales = None
    # C-contiguous whatever x's strides (elementwise ops keep a transposed input's layout)
    data, scales = _contiguous(data), None if scales is None else _contiguous(scales)
    if fmt in BLOCK_BYTES and not (_is_torch(data) and data.device.type != "cpu"):  # no device sync
        _check_ggml_range(xf, data, fmt, logical)
    if on_host:
        data, scales = _as_torch(data), None if scales is None else _as_torch(scales)
    if _is_cl(x):
        import pyopencl.array as cla
        data = cla.to_device(x.queue, data)
        scales = None if scales is None else cla.to_device(x.queue, scales)
    if scales is None:
        scales = _ggml_scales(data)
    dtype = x.dtype if _is_torch(x) else np.dtype(x.dtype).newbyteorder("=")
    return QuantizedTensor(data, scales, fmt, tuple(int(s) for s in x.shape), dtype)


# How CUDA tensors quantize in one launch (flashcl/triton/quantize.py): a function returning that
# module, or None where Triton is missing. The API layer installs it (set_cuda_quantizer), this
# layer being below the backends; until then CUDA tensors quantize in torch's ops.
_cuda_quantizer = None


def set_cuda_quantizer(load) -> None:
    """Install ``load`` (no arguments -> the Triton quantizer module or None) for CUDA tensors."""
    global _cuda_quantizer
    _cuda_quantizer = load


def _triton_quantizer(x):
    """The Triton quantizer for a CUDA tensor (one launch, the same bytes as torch's ops in ~15),
    else None."""
    if _cuda_quantizer is None or not (_is_torch(x) and x.is_cuda):
        return None
    return _cuda_quantizer()


def _quantize_on_cuda(x, fmt: str, quantizer) -> QuantizedTensor:
    import torch

    shape, d = tuple(int(s) for s in x.shape), int(x.shape[-1])
    rows = x.detach().reshape(-1, 1, d)  # (..., D) as rows of one token each
    if fmt == "int8":
        data = torch.empty(shape, dtype=torch.int8, device=x.device)
        scales = torch.empty(shape[:-1] + (1,), dtype=torch.float32, device=x.device)
        quantizer.quantize_rows(rows, fmt, data.view(-1, 1, d), scales.view(-1, 1, 1))
    else:
        _ggml_blocks(x)  # the head dim's check
        data = torch.empty(shape[:-1] + (d // QK, BLOCK_BYTES[fmt]), dtype=torch.uint8, device=x.device)
        quantizer.quantize_rows(rows, fmt, data.view(-1, 1, d // QK, BLOCK_BYTES[fmt]), None)
        scales = _ggml_scales(data)
    return QuantizedTensor(data, scales, fmt, shape, x.dtype)


def _as_torch(a: np.ndarray):
    """A C-contiguous NumPy array as a torch CPU tensor on its memory; an empty one copied into
    torch's own strides (NumPy gives it strides of 0, which the ggml scales' view refuses)."""
    import torch

    t = torch.from_numpy(a)
    return t if a.size else t.clone(memory_format=torch.contiguous_format)


def _contiguous(a):
    return a.contiguous() if _is_torch(a) else np.ascontiguousarray(a)


def _check_ggml_range(xf, data, fmt: str, dtype: str) -> None:
    """ValueError where a block of finite values gets a d that is not finite in fp16 (|x| past
    127 x 65504 for q8_0, 8 x 65504 for q4_0), or a largest value, 127 d or -8 d, that rounds past
    a float16 cache's range (d rounded up: a float16 65504 becomes 127 x 516). A block holding NaN
    or inf (an unwritten slot's garbage) stays non-finite, as it went in."""
    if not data.shape[-2]:
        return
    d = _ggml_scales(data)
    d = np.abs((d.float().numpy() if _is_torch(d) else d).astype(np.float64))
    finite = np.isfinite(np.abs(_ggml_blocks(xf.numpy() if _is_torch(xf) else xf)).max(-1))
    top = d * (127 if fmt == "q8_0" else 8)
    if (finite & ~np.isfinite(d)).any():
        limit = "127" if fmt == "q8_0" else "8"
        raise ValueError(f"x: {fmt} needs each block's scale d finite in fp16, so |x| <= {limit} x 65504; "
                         "the values are past that")
    if dtype == "float16" and (finite & (top >= 65520)).any():
        raise ValueError(f"x: a {fmt} block's largest value dequantizes to {top[finite].max():g} (its fp16 d "
                         "rounded up), past float16's 65504: scale the cache down or quantize it from float32")


def _quantize_fp8(x) -> QuantizedTensor:
    if _is_cl(x):
        raise TypeError("fp8_e4m3 is a torch format (torch.float8_e4m3fn); pick q8_0, q4_0 or int8 "
                        "for pyopencl Arrays")
    try:
        import torch
    except ImportError:
        raise ImportError("fp8_e4m3 needs torch (torch.float8_e4m3fn); install torch or pick "
                          "q8_0, q4_0 or int8") from None
    dtype = x.dtype if _is_torch(x) else np.dtype(np.asarray(x).dtype).newbyteorder("=")
    xf = _float32_of(x)
    if not _is_torch(xf):
        xf = torch.from_numpy(xf)
    scale = xf.abs().amax() / _TorchOps.f32(FP8_E4M3_MAX, xf) if xf.numel() else \
        torch.zeros((), device=xf.device)
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    data = (xf / safe).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).contiguous()
    return QuantizedTensor(data, scale.float(), "fp8_e4m3", tuple(int(s) for s in x.shape), dtype)


def dequantize(qt: QuantizedTensor):
    """The values ``qt`` holds, in its original dtype and kind (numpy, torch on its device, or a
    pyopencl Array on its queue)."""
    if not isinstance(qt, QuantizedTensor):
        raise TypeError(f"dequantize takes a flashcl.QuantizedTensor, got {type(qt).__name__}")
    _check_fmt(qt.fmt)
    if qt.fmt == "fp8_e4m3":
        out = qt.data.float() * qt.scales
        if isinstance(qt.dtype, np.dtype):
            return out.cpu().numpy().astype(qt.dtype)
        return out.to(qt.dtype)
    kind = kind_of(qt.data)
    data = qt.data.get() if kind == "cl" else qt.data
    ops = _ops(data)
    if qt.fmt == "int8":
        scales = qt.scales.get() if kind == "cl" else qt.scales
        out = ops.cast(data, "float32") * scales
    else:
        out = _dequantize_ggml(data, qt.fmt, ops)
    if kind == "torch":
        return out.to(qt.dtype)
    out = out.astype(qt.dtype)
    if kind == "cl":
        import pyopencl.array as cla
        return cla.to_device(qt.data.queue, out)
    return out


# --------------------------------------------------------------------------- writes into a cache

def _indices(ids, name: str, n: int, bound: int, like):
    """block_ids/slots as indices of ``like``'s kind. Host values are checked against ``bound``;
    device tensors are not read back (that would sync the decode loop that calls this)."""
    if _is_torch(ids) and _is_torch(like) and ids.device == like.device and ids.device.type != "cpu":
        if tuple(ids.shape) != (n,) or ids.is_floating_point() or ids.is_complex() or str(ids.dtype) == "torch.bool":
            raise ValueError(f"{name}: expected {n} integers (one per token), got {ids.dtype} {tuple(ids.shape)}")
        return ids.long()
    host = _cl_to_host(ids) if _is_cl(ids) else (ids.cpu().numpy() if _is_torch(ids) else np.asarray(ids))
    if host.shape != (n,) or (n and host.dtype.kind not in "iu"):
        raise ValueError(f"{name}: expected {n} integers (one per token), got {host.dtype} {host.shape}")
    if n and (host.min() < 0 or host.max() >= bound):
        raise ValueError(f"{name}: values must lie in [0, {bound}), got {host.min()}..{host.max()}")
    if not _is_torch(like):
        return host.astype(np.int64)
    import torch
    t = torch.from_numpy(host.astype(np.int64))
    # pinned and non_blocking: a pageable host-to-device copy would wait for the whole stream
    return t.pin_memory().to(like.device, non_blocking=True) if like.is_cuda else t


def _as_kind_of(x, like):
    """The new tokens ``x`` in the cache's kind: torch on its device, else host NumPy."""
    if _is_torch(like):
        import torch
        if not _is_torch(x):
            x = torch.from_numpy(np.ascontiguousarray(_cl_to_host(x) if _is_cl(x) else np.asarray(x)))
        return x.to(like.device)
    if _is_torch(x):
        return x.detach().cpu().float().numpy()
    return _cl_to_host(x) if _is_cl(x) else np.asarray(x)


def _cl_to_host(x) -> np.ndarray:
    """A pyopencl Array as numpy, a strided view too (Array.get takes only contiguous ones): the
    bytes its elements span, viewed with its strides on the host."""
    if x.flags.c_contiguous or x.size == 0:
        return x.get()
    import pyopencl as cl
    span = [(n - 1) * st for n, st in zip(x.shape, x.strides)]
    lo = x.offset + sum(min(0, v) for v in span)
    hi = x.offset + sum(max(0, v) for v in span) + x.dtype.itemsize
    raw = np.empty(hi - lo, np.uint8)
    cl.enqueue_copy(x.queue, raw, x.base_data, src_offset=lo, wait_for=x.events, is_blocking=True)
    return np.ndarray(x.shape, x.dtype, buffer=raw, offset=x.offset - lo, strides=x.strides).copy()


def _scatter_rows(dst, block_ids, slots, rows) -> None:
    """dst[block_ids[i], slots[i]] = rows[i] for a numpy, torch or (contiguous) pyopencl ``dst``."""
    if not _is_cl(dst):
        dst[block_ids, slots] = rows
        return
    import pyopencl as cl
    import pyopencl.array as cla
    if not dst.flags.c_contiguous:
        raise ValueError("quantize_into needs a C-contiguous pyopencl cache (as quantize makes it)")
    queue, row_bytes = dst.queue, int(np.prod(dst.shape[2:], dtype=np.int64)) * dst.dtype.itemsize
    src = cla.to_device(queue, np.ascontiguousarray(rows))
    # one device-side copy per token: nothing of the cache comes back to the host
    for i, (blk, slot) in enumerate(zip(block_ids.tolist(), slots.tolist())):
        event = cl.enqueue_copy(queue, dst.base_data, src.base_data, byte_count=row_bytes,
                                src_offset=src.offset + i * row_bytes,
                                dst_offset=dst.offset + (blk * dst.shape[1] + slot) * row_bytes,
                                wait_for=dst.events + src.events)
        dst.add_event(event)


def quantize_into(qt: QuantizedTensor, block_ids, slots, x) -> None:
    """Quantize ``x`` (n, H_kv, D) and write token i at ``qt[block_ids[i], slots[i]]`` of a paged
    cache ``qt`` (num_blocks, block_size, H_kv, D), in place. Scales are per block of 32 (q8_0,
    q4_0) or per row (int8), so written tokens never change the others; fp8_e4m3's scale is per
    tensor and a write would have to requantize the whole cache, so it is refused.

    A torch cache is written by torch ops on its device: with ``x`` on that device nothing syncs,
    whether block_ids/slots are tensors there or host values (checked, then copied through
    pinned memory without waiting). Index tensors on a GPU are not range-checked."""
    if qt.fmt == "fp8_e4m3":
        raise ValueError("fp8_e4m3 has one scale per tensor: writing tokens would require "
                         "requantizing the whole cache; quantize the updated tensor instead")
    if len(qt.shape) != 4 or len(x.shape) != 3 or tuple(x.shape[1:]) != qt.shape[2:]:
        raise ValueError("quantize_into writes x (n, H_kv, D) into a paged cache (num_blocks, "
                         f"block_size, H_kv, D); got x {tuple(x.shape)} and cache {qt.shape}")
    x_dtype, cache_dtype = dtype_name(x), dtype_name(qt)
    if x_dtype != cache_dtype and cache_dtype != "float32":  # 16-bit tokens widen into float32 exactly
        raise TypeError(f"x: the cache holds {cache_dtype} values (quantized from {cache_dtype}); got {x_dtype}")
    n = int(x.shape[0])
    block_ids = _indices(block_ids, "block_ids", n, qt.shape[0], qt.data)
    slots = _indices(slots, "slots", n, qt.shape[1], qt.data)
    new = _quantize(_as_kind_of(x, qt.data), qt.fmt, cache_dtype)
    _scatter_rows(qt.data, block_ids, slots, new.data)
    if qt.fmt == "int8":
        _scatter_rows(qt.scales, block_ids, slots, new.scales)


def _refuse_new_fp8_tokens(qt: QuantizedTensor) -> None:
    if qt.fmt == "fp8_e4m3":
        raise ValueError("fp8_e4m3 has one scale per tensor: new tokens would require requantizing "
                         "the whole cache; use int8, q8_0 or q4_0")


def _over(qt: QuantizedTensor, data, rows, shape: tuple) -> QuantizedTensor:
    """``qt``'s format over new ``data`` of ``shape``: the ggml scales viewed inside it, fp8's
    tensor scale kept, int8's per-row scales ``rows(qt.scales)`` (the same rows data took)."""
    if qt.fmt in BLOCK_BYTES:
        scales = _ggml_scales(data)
    else:
        scales = qt.scales if qt.fmt == "fp8_e4m3" else rows(qt.scales)
    return QuantizedTensor(data, scales, qt.fmt, shape, qt.dtype)


def tokens(qt: QuantizedTensor, start: int, stop: int, copy: bool = True) -> QuantizedTensor:
    """Tokens [start, stop) of a contiguous torch cache (..., N, D): copied, or with ``copy``
    false a view of the cache's memory (fp8_e4m3 keeps its tensor's scale)."""
    if not _is_torch(qt.data):
        raise TypeError(f"tokens takes a torch cache, got {kind_of(qt.data)}")
    if len(qt.shape) < 2 or not 0 <= start <= stop <= qt.shape[-2]:
        raise ValueError(f"tokens: [{start}, {stop}) of a cache of shape {qt.shape} (tokens on axis -2)")
    axis, n = len(qt.shape) - 2, stop - start

    def cut(a):
        a = a.narrow(axis, start, n)
        return a.contiguous() if copy else a

    return _over(qt, cut(qt.data), cut, qt.shape[:-2] + (n, qt.shape[-1]))


def select_batch(qt: QuantizedTensor, index) -> QuantizedTensor:
    """A torch cache's entries ``index`` (1-D int64, on its device) along its first axis, copied:
    a contiguous (B, H_kv, N, D) cache's sequences, reordered, dropped or repeated (beam search,
    a batch's selection)."""
    if not _is_torch(qt.data):
        raise TypeError(f"select_batch takes a torch cache, got {kind_of(qt.data)}")

    def take(a):
        return a.index_select(0, index)

    return _over(qt, take(qt.data), take, (int(index.shape[0]),) + tuple(qt.shape[1:]))


def with_room(qt: QuantizedTensor, capacity: int) -> QuantizedTensor:
    """A contiguous torch cache of ``capacity`` tokens (..., capacity, D) whose first hold ``qt``'s
    and the rest zeros (write_tokens fills them)."""
    import torch

    _refuse_new_fp8_tokens(qt)
    axis = len(qt.shape) - 2
    n = qt.shape[-2]
    if capacity < n:
        raise ValueError(f"with_room: {capacity} tokens cannot hold the cache's {n}")

    def grown(a):
        out = torch.zeros(a.shape[:axis] + (capacity,) + a.shape[axis + 1:], dtype=a.dtype, device=a.device)
        out.narrow(axis, 0, n).copy_(a)
        return out

    return _over(qt, grown(qt.data), grown, qt.shape[:-2] + (capacity, qt.shape[-1]))


def write_tokens(qt: QuantizedTensor, at: int, x) -> None:
    """Quantize ``x`` (..., T, D) in ``qt``'s format and write it at tokens [at, at + T) of a
    contiguous torch cache ``qt`` (..., C, D), in place: what a growing cache does each step (a
    paged one: quantize_into). Scales are per block of 32 (q8_0, q4_0) or per row (int8), so the
    other tokens keep their bytes; fp8_e4m3's one scale per tensor is refused."""
    _refuse_new_fp8_tokens(qt)
    if not (_is_torch(qt.data) and _is_torch(x)):
        raise TypeError(f"write_tokens takes a torch cache and torch tokens, got {kind_of(qt.data)} and {kind_of(x)}")
    fits = len(qt.shape) >= 2 and len(x.shape) == len(qt.shape) and tuple(x.shape[:-2]) == qt.shape[:-2]
    if not (fits and x.shape[-1] == qt.shape[-1] and 0 <= at <= qt.shape[-2] - x.shape[-2]):
        raise ValueError(f"write_tokens: x {tuple(x.shape)} at token {at} of a cache of shape {qt.shape}")
    t = int(x.shape[-2])
    if dtype_name(x) != dtype_name(qt) or x.device != qt.data.device:
        raise TypeError(f"x: the cache was quantized from {dtype_name(qt)} on {qt.data.device}; got "
                        f"{dtype_name(x)} on {x.device}")
    quantizer = _triton_quantizer(x)
    if quantizer is not None and qt.data.is_contiguous() and (qt.fmt != "int8" or qt.scales.is_contiguous()):
        quantizer.quantize_rows(x.detach(), qt.fmt, qt.data, qt.scales if qt.fmt == "int8" else None, at)
        return
    new = _quantize(x, qt.fmt, dtype_name(qt))
    axis = len(qt.shape) - 2  # the token axis of data and of int8's scales alike
    qt.data.narrow(axis, at, t).copy_(new.data)
    if qt.fmt == "int8":
        qt.scales.narrow(axis, at, t).copy_(new.scales)


# --------------------------------------------------------------------------- validation

def check_layout(qt: QuantizedTensor, name: str) -> None:
    """ValueError/TypeError naming ``name`` when ``qt``'s data/scales do not hold ``qt.shape`` in
    ``qt.fmt`` (a hand-built QuantizedTensor would otherwise send kernels past its buffers)."""
    _check_fmt(qt.fmt)
    shape = tuple(qt.shape)
    if not shape or any(not isinstance(s, (int, np.integer)) or s < 0 for s in shape):
        raise ValueError(f"{name}: QuantizedTensor.shape must be a tuple of sizes, got {qt.shape!r}")
    kinds = {kind_of(qt.data), kind_of(qt.scales)}
    if len(kinds) > 1:
        raise TypeError(f"{name}: QuantizedTensor data and scales are of different kinds ({sorted(kinds)})")
    if _is_torch(qt.data) and qt.data.device != qt.scales.device:
        raise TypeError(f"{name}: QuantizedTensor data on {qt.data.device} but scales on {qt.scales.device}")
    lead, d = shape[:-1], shape[-1]
    if qt.fmt in BLOCK_BYTES:
        if d % QK:
            raise ValueError(f"{name}: {qt.fmt} packs the head dim in blocks of {QK}; got D={d}")
        want = {"data": ("uint8", lead + (d // QK, BLOCK_BYTES[qt.fmt])),
                "scales": ("float16", lead + (d // QK,))}
    elif qt.fmt == "int8":
        want = {"data": ("int8", shape), "scales": ("float32", lead + (1,))}
    else:
        want = {"data": ("float8_e4m3fn", shape), "scales": ("float32", ())}
    for part, (dtype, part_shape) in want.items():
        arr = getattr(qt, part)
        got = (str(arr.dtype).replace("torch.", ""), tuple(int(s) for s in arr.shape))
        if got != (dtype, part_shape):
            raise ValueError(f"{name}: a {qt.fmt} QuantizedTensor of shape {shape} needs {part} "
                             f"{dtype} {part_shape}, got {got[0]} {got[1]}")
