"""Quantized KV formats: quantize, dequantize and write new tokens into a quantized paged cache.

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

The math runs in NumPy; torch inputs go through the host and the result comes back as torch
tensors on the input's device. The attention kernels do not take QuantizedTensor yet.
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

    data: Any            # numpy array, or torch tensor for torch inputs and always for fp8_e4m3
    scales: Any          # see the module docstring's table
    fmt: str
    shape: tuple
    dtype: Any           # numpy dtype (dequantize returns numpy) or torch.dtype (returns torch)

    @property
    def axis(self) -> int:
        """The quantization axis: the last (head) dim."""
        return len(self.shape) - 1


def _is_torch(x) -> bool:
    return type(x).__module__.split(".")[0] == "torch"


def _round_half_away(v: np.ndarray) -> np.ndarray:
    """C's roundf: halves away from zero, exact for every float32 (no ``floor(v + 0.5)`` error)."""
    r = np.trunc(v)
    return r + np.where(np.abs(v - r) >= 0.5, np.sign(v), 0).astype(v.dtype)


def _ggml_blocks(x: np.ndarray) -> np.ndarray:
    if x.shape[-1] % QK:
        raise ValueError(f"q8_0/q4_0 quantize blocks of {QK} along the head dim; "
                         f"head dim {x.shape[-1]} is not a multiple of {QK}")
    return x.reshape(*x.shape[:-1], x.shape[-1] // QK, QK)


def _pack(d: np.ndarray, qs: np.ndarray) -> np.ndarray:
    d_bytes = d.astype("<f2")[..., None].view(np.uint8)
    return np.concatenate([d_bytes, qs.view(np.uint8)], axis=-1)


def _quantize_q8_0(x: np.ndarray) -> np.ndarray:
    b = _ggml_blocks(x)
    d = np.abs(b).max(axis=-1) / np.float32(127)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)
    qs = _round_half_away(b * inv[..., None]).astype(np.int8)
    return _pack(d, qs)


def _quantize_q4_0(x: np.ndarray) -> np.ndarray:
    b = _ggml_blocks(x)
    # the signed value of largest magnitude, the first one on ties (ggml's strict `<`)
    mx = np.take_along_axis(b, np.abs(b).argmax(axis=-1)[..., None], axis=-1)[..., 0]
    mx = np.where(mx == 0, np.float32(0), mx)     # ggml's max starts at +0: an all-zero block has d = -0
    d = mx / np.float32(-8)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)
    # x*id + 8.5 lies in [0.5, 16.5], so the (int8_t) truncation is a floor
    q = np.minimum(15, np.trunc(b * inv[..., None] + np.float32(8.5))).astype(np.uint8)
    return _pack(d, q[..., : QK // 2] | (q[..., QK // 2:] << 4))


def _ggml_scales(data):
    """The fp16 d of every block, viewed in place inside ``data`` (..., D/32)."""
    if _is_torch(data):
        import torch
        return data[..., :2].view(torch.float16)[..., 0]
    return data[..., :2].view("<f2")[..., 0]


def _dequantize_ggml(data: np.ndarray, fmt: str) -> np.ndarray:
    d = data[..., :2].copy().view("<f2")[..., 0].astype(np.float32)[..., None]
    if fmt == "q8_0":
        q = data[..., 2:].view(np.int8).astype(np.float32)
    else:
        nib = data[..., 2:]
        q = np.concatenate([nib & 0x0F, nib >> 4], axis=-1).astype(np.float32) - 8
    out = q * d
    return out.reshape(*out.shape[:-2], -1)


def _quantize_int8(x: np.ndarray):
    scale = np.abs(x).max(axis=-1, keepdims=True) / np.float32(127)
    safe = np.where(scale == 0, np.float32(1), scale)
    q = np.clip(_round_half_away(x / safe), -127, 127).astype(np.int8)
    return q, scale.astype(np.float32)


def _to_numpy_f32(x) -> np.ndarray:
    if _is_torch(x):
        return x.detach().to("cpu").float().numpy()
    x = np.asarray(x)
    if x.dtype not in (np.float32, np.float16):
        raise TypeError(f"quantize takes float32 or float16 arrays (bfloat16 as torch), got {x.dtype}")
    return x.astype(np.float32)


def _check_fmt(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"unknown quantized format {fmt!r}; choose one of {', '.join(FORMATS)}")


def quantize(x, fmt: str) -> QuantizedTensor:
    """Quantize ``x`` (numpy float32/float16 or torch float32/float16/bfloat16, any shape ending
    in the head dim) to ``fmt`` (one of FORMATS) along its last dim."""
    _check_fmt(fmt)
    if x.ndim < 1:
        raise ValueError("quantize needs at least one dim (the head dim)")
    if fmt == "fp8_e4m3":
        return _quantize_fp8(x)
    if _is_torch(x):
        import torch
        if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise TypeError(f"quantize takes float32, float16 or bfloat16 tensors, got {x.dtype}")
    xf = _to_numpy_f32(x)
    if fmt == "int8":
        data, scales = _quantize_int8(xf)
    else:
        data = _quantize_q8_0(xf) if fmt == "q8_0" else _quantize_q4_0(xf)
        scales = None
    if _is_torch(x):
        import torch
        data = torch.from_numpy(data).to(x.device)
        scales = torch.from_numpy(scales).to(x.device) if scales is not None else None
    if scales is None:
        scales = _ggml_scales(data)
    dtype = x.dtype if _is_torch(x) else np.dtype(x.dtype)
    return QuantizedTensor(data, scales, fmt, tuple(x.shape), dtype)


def _quantize_fp8(x) -> QuantizedTensor:
    try:
        import torch
    except ImportError:
        raise ImportError("fp8_e4m3 needs torch (torch.float8_e4m3fn); install torch or pick "
                          "q8_0, q4_0 or int8") from None
    dtype = x.dtype if _is_torch(x) else np.dtype(np.asarray(x).dtype)
    if not _is_torch(x):
        x = torch.from_numpy(_to_numpy_f32(x))
    xf = x.float()
    scale = xf.abs().amax() / FP8_E4M3_MAX if xf.numel() else torch.zeros((), device=x.device)
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    data = (xf / safe).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return QuantizedTensor(data, scale.float(), "fp8_e4m3", tuple(x.shape), dtype)


def dequantize(qt: QuantizedTensor):
    """The values ``qt`` holds, in its original dtype and kind (numpy, or torch on its device)."""
    _check_fmt(qt.fmt)
    if qt.fmt == "fp8_e4m3":
        out = qt.data.float() * qt.scales
        if isinstance(qt.dtype, np.dtype):
            return out.cpu().numpy().astype(qt.dtype)
        return out.to(qt.dtype)
    torch_out = not isinstance(qt.dtype, np.dtype)
    data = qt.data.cpu().numpy() if _is_torch(qt.data) else qt.data
    if qt.fmt == "int8":
        scales = qt.scales.cpu().numpy() if _is_torch(qt.scales) else qt.scales
        out = data.astype(np.float32) * scales
    else:
        out = _dequantize_ggml(data, qt.fmt)
    if torch_out:
        import torch
        return torch.from_numpy(out).to(device=qt.data.device, dtype=qt.dtype)
    return out.astype(qt.dtype)


def quantize_into(qt: QuantizedTensor, block_ids, slots, x) -> None:
    """Quantize ``x`` (n, H_kv, D) and write token i at ``qt[block_ids[i], slots[i]]`` of a paged
    cache ``qt`` (num_blocks, block_size, H_kv, D), in place. Scales are per block of 32 (q8_0,
    q4_0) or per row (int8), so written tokens never change the others; fp8_e4m3's scale is per
    tensor and a write would have to requantize the whole cache, so it is refused."""
    if qt.fmt == "fp8_e4m3":
        raise ValueError("fp8_e4m3 has one scale per tensor: writing tokens would require "
                         "requantizing the whole cache; quantize the updated tensor instead")
    if len(qt.shape) != 4 or tuple(x.shape[1:]) != qt.shape[2:]:
        raise ValueError("quantize_into writes x (n, H_kv, D) into a paged cache (num_blocks, "
                         f"block_size, H_kv, D); got x {tuple(x.shape)} and cache {qt.shape}")
    new = quantize(x, qt.fmt)
    if _is_torch(qt.data):
        import torch
        block_ids = torch.as_tensor(block_ids, device=qt.data.device, dtype=torch.long)
        slots = torch.as_tensor(slots, device=qt.data.device, dtype=torch.long)
        move = (lambda t: t.to(qt.data.device)) if _is_torch(new.data) else \
            (lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(qt.data.device))
    else:
        block_ids, slots = np.asarray(block_ids), np.asarray(slots)
        move = (lambda t: t.cpu().numpy()) if _is_torch(new.data) else (lambda a: a)
    qt.data[block_ids, slots] = move(new.data)
    if qt.fmt == "int8":
        qt.scales[block_ids, slots] = move(new.scales)
