"""Quantizing CUDA tensors in one Triton launch: q8_0, q4_0 and int8 rows (flashcl/quant.py's
formats), written where a cache's buffer wants them.

torch's ops took ~15 launches per quantize, about 0.4 ms of host time a call, twice per layer
and step in a quantized cache (docs/notes/opencl-host.md, "A quantized cache inside a model").
The arithmetic is quant.py's, op for op in float32 with correctly rounded divisions and no fused
multiply-adds, so the bytes are ggml's (and NumPy's) on every finite block but those whose largest
magnitude is under ~4e-37 (1/d overflows; C's conversion of the quotient is undefined there, and
every path dequantizes them to 0). A block holding NaN gets d NaN (NumPy's 0x7E00) and q 0.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import on_device_of

_FORMATS = {"q8_0": 0, "q4_0": 1, "int8": 2}
_BLOCK_BYTES = {"q8_0": 34, "q4_0": 18}
_ROWS = 16  # rows a program quantizes


@triton.jit
def _round_half_away(v):
    """C's roundf for finite |v| < 2**31 (truncation through int32, then the half away from zero)."""
    r = v.to(tl.int32).to(tl.float32)
    return r + tl.where(tl.abs(v - r) >= 0.5, tl.where(v < 0, -1.0, 1.0), 0.0)


@triton.jit
def _store_d(data, at, d, mask):
    """d as ggml's little-endian fp16, at byte offsets ``at`` (a NaN as NumPy's 0x7E00)."""
    bits = tl.where(d != d, 0x7E00, d.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32))
    tl.store(data + at, (bits & 0xFF).to(tl.uint8), mask=mask)
    tl.store(data + at + 1, ((bits >> 8) & 0xFF).to(tl.uint8), mask=mask)


@triton.jit
def _quantize_rows(x, data, scales, rows, tokens, capacity, at,
                   FMT: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, NB: tl.constexpr, NBP: tl.constexpr,
                   BB: tl.constexpr, ROWS: tl.constexpr):
    """Rows r of x (rows, D), each token r % tokens of a sequence r // tokens, quantized into row
    (r // tokens) * capacity + at + r % tokens of data (and int8's scales)."""
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    live = r < rows
    out = (r // tokens) * capacity + at + r % tokens
    src = r * D
    if FMT == 2:
        c = tl.arange(0, DP)
        ok = live[:, None] & (c < D)[None, :]
        v = tl.load(x + src[:, None] + c[None, :], mask=ok, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(v), axis=1)
        amax = tl.where(tl.sum((v != v).to(tl.int32), axis=1) > 0, float("nan"), amax)
        scale = tl.math.div_rn(amax, 127.0)
        safe = tl.where(scale == 0, 1.0, scale)
        t = tl.math.div_rn(v, safe[:, None])
        q = tl.where(t != t, 0.0, tl.minimum(tl.maximum(_round_half_away(t), -127.0), 127.0))
        tl.store(data + out[:, None] * D + c[None, :], q.to(tl.int8), mask=ok)
        tl.store(scales + out, scale, mask=live)
    else:
        b = tl.arange(0, NBP)
        j = tl.arange(0, 32)
        ok = live[:, None, None] & (b < NB)[None, :, None]
        at_x = src[:, None, None] + b[None, :, None] * 32
        v = tl.load(x + at_x + j[None, None, :], mask=ok, other=0.0).to(tl.float32)
        mag = tl.abs(v)
        amax = tl.max(mag, axis=2)
        nan = tl.sum((v != v).to(tl.int32), axis=2) > 0
        at_d = out[:, None] * (NB * BB) + b[None, :] * BB
        blocks = live[:, None] & (b < NB)[None, :]
        if FMT == 0:
            d = tl.math.div_rn(tl.where(nan, float("nan"), amax), 127.0)
            inv = tl.where(d != 0, tl.math.div_rn(1.0, d), 0.0)
            t = v * inv[:, :, None]
            q = tl.where(t != t, 0.0, _round_half_away(t)).to(tl.int8).to(tl.uint8, bitcast=True)
            tl.store(data + at_d[:, :, None] + 2 + j[None, None, :], q, mask=ok)
        else:
            # the signed value of the largest magnitude, the first of equals (ggml's strict <)
            first = tl.min(tl.where(mag == amax[:, :, None], j[None, None, :], 32), axis=2)
            mx = tl.sum(tl.where(j[None, None, :] == first[:, :, None], v, 0.0), axis=2)
            mx = tl.where(nan, float("nan"), tl.where(mx == 0, 0.0, mx))
            d = tl.math.div_rn(mx, -8.0)
            inv = tl.where(d != 0, tl.math.div_rn(1.0, d), 0.0)
            h = tl.arange(0, 16)
            lo = tl.load(x + at_x + h[None, None, :], mask=ok, other=0.0).to(tl.float32)
            hi = tl.load(x + at_x + 16 + h[None, None, :], mask=ok, other=0.0).to(tl.float32)
            # x*id + 8.5 lies in [0.5, 16.5] on a finite block (the truncation a floor); clipped
            # before the conversion, as NumPy's, where 1/d overflows
            q_lo = lo * inv[:, :, None] + 8.5
            q_hi = hi * inv[:, :, None] + 8.5
            q_lo = tl.where(q_lo != q_lo, 0, tl.minimum(tl.maximum(q_lo, 0.0), 15.0).to(tl.int32))
            q_hi = tl.where(q_hi != q_hi, 0, tl.minimum(tl.maximum(q_hi, 0.0), 15.0).to(tl.int32))
            tl.store(data + at_d[:, :, None] + 2 + h[None, None, :], (q_lo | (q_hi << 4)).to(tl.uint8), mask=ok)
        _store_d(data, at_d, d, blocks)


def quantize_rows(x, fmt: str, data, scales, at: int = 0) -> None:
    """Quantize ``x`` (..., T, D), a CUDA tensor (or a CPU one under the interpreter), into
    tokens [at, at + T) of ``data`` (..., C, D/32, block bytes) or, for int8, ``data`` (..., C, D)
    and ``scales`` (..., C, 1): C-contiguous buffers whose leading dims are x's."""
    d = int(x.shape[-1])
    tokens, capacity = int(x.shape[-2]), int(data.shape[len(x.shape) - 2])
    x = x.contiguous()
    rows = x.numel() // d
    if rows == 0:
        return
    nb = max(d // 32, 1)
    with on_device_of(x):
        _quantize_rows[(triton.cdiv(rows, _ROWS),)](
            x, data, scales if scales is not None else data, rows, tokens, capacity, at,
            FMT=_FORMATS[fmt], D=d, DP=triton.next_power_of_2(d), NB=nb, NBP=triton.next_power_of_2(nb),
            BB=_BLOCK_BYTES.get(fmt, 1), ROWS=_ROWS, enable_fp_fusion=False)
