"""Quantized bytes to values in the Triton kernels: 32-bit words (or 16-bit byte pairs) of a
quantized row turned into fp16 through PTX byte permutes where q is fp16 on a GPU, or into float32
through shifts and casts elsewhere (the interpreter, other q types). Shared by the decode's word
tiles (decode._load_words), the ggml block gathers of the decode and the prefill (ggml_blocks),
the decode's stored-order q4_0 and q8_0 tiles (ggml_stored) and the Gluon GQA kernel's words
and ggml windows (decode_gluon: word_to_f16x2_ptx)."""

from __future__ import annotations

import triton
import triton.language as tl


# fp16 of a byte u: take 0x64 as its upper byte, the fp16 1024 + u, then subtract the bias exactly:
# int8 values are u = x + 128 (bias 1024 + 128), q4_0's nibbles n (value n - 8: bias 1024 + 8).
F16_BIAS = {"int8": "0x64806480", "q4_0": "0x64086408"}


def word_to_f16x2_ptx(fmt: str, src: str, tmp: list, out: list, subtract: bool = True) -> list:
    """PTX lines turning the 32-bit word in register ``src`` into fp16 pairs, exactly (less the
    bias F16_BIAS[fmt], which register ``bias`` must hold; ``subtract`` false: the caller
    subtracts it): "int8" (q8_0's quants too) into out[0] = values (0, 1), out[1] = (2, 3),
    through tmp[0]; "q4_0" into out[0..3] = the low nibbles of bytes (0, 1), (2, 3), then the
    high ones, through tmp[0..1]."""
    if fmt == "int8":
        lines = [f"xor.b32 {tmp[0]}, {src}, 0x80808080;"]
        spread = [(tmp[0], "0x4140"), (tmp[0], "0x4342")]
    else:
        assert fmt == "q4_0", fmt
        lines = [f"and.b32 {tmp[0]}, {src}, 0x0F0F0F0F;", f"shr.u32 {tmp[1]}, {src}, 4;",
                 f"and.b32 {tmp[1]}, {tmp[1]}, 0x0F0F0F0F;"]
        spread = [(tmp[0], "0x4140"), (tmp[0], "0x4342"), (tmp[1], "0x4140"), (tmp[1], "0x4342")]
    lines += [f"prmt.b32 {o}, {t}, 0x64646464, {sel};" for o, (t, sel) in zip(out, spread)]
    return lines + [f"sub.rn.f16x2 {o}, {o}, bias;" for o in out if subtract]


# The four 1-byte values of a 32-bit word ($4) as fp16 ($0 .. $3, in order), exactly (the asm of
# inline_asm_elementwise with constraints "=h,=h,=h,=h,r"; decode_gluon's GQA kernel uses them
# too).
INT8_F16_PTX = tl.constexpr("\n".join(
    ["{", ".reg .b32 u, bias, lo, hi;", f"mov.b32 bias, {F16_BIAS['int8']};"]
    + word_to_f16x2_ptx("int8", "$4", ["u"], ["lo", "hi"])
    + ["mov.b32 {$0, $1}, lo;", "mov.b32 {$2, $3}, hi;", "}"]))
# The eight nibbles of a 32-bit word ($8) less 8 as fp16: nibble h of byte k at $(2 k + h)
Q4_0_F16_PTX = tl.constexpr("\n".join(
    ["{", ".reg .b32 lo, hi, bias, a, b, c, e;", f"mov.b32 bias, {F16_BIAS['q4_0']};"]
    + word_to_f16x2_ptx("q4_0", "$8", ["lo", "hi"], ["a", "b", "c", "e"])
    + ["mov.b32 {$0, $2}, a;", "mov.b32 {$4, $6}, b;", "mov.b32 {$1, $3}, c;", "mov.b32 {$5, $7}, e;", "}"]))
# fp8_e4m3: the convert instruction of sm_89+, a pair at a time
FP8_F16_PTX = tl.constexpr("""{
.reg .b16 a, b;
.reg .b32 lo, hi;
mov.b32 {a, b}, $4;
cvt.rn.f16x2.e4m3x2 lo, a;
cvt.rn.f16x2.e4m3x2 hi, b;
mov.b32 {$0, $1}, lo;
mov.b32 {$2, $3}, hi;
}""")


@triton.jit
def values(w, FMT: tl.constexpr, CVT_ASM: tl.constexpr):
    """Words w [rows, W] of a quantized row as [rows, W * values per word], in stored order:
    "int8" (also q8_0's values) and "fp8_e4m3" 4 bytes per word, "q4_0" 8 nibbles less 8,
    unscaled (nibble h of byte k of word c at 8 c + 2 k + h). fp16 with CVT_ASM (words_to_f16);
    else float32 (int8, q4_0) or fp8 from shifts and casts."""
    if FMT == "q4_0":
        if CVT_ASM:
            t0, t1, t2, t3, t4, t5, t6, t7 = words_to_f16(w, FMT)
        else:
            t0 = ((w & 15) - 8).to(tl.float32)
            t1 = (((w >> 4) & 15) - 8).to(tl.float32)
            t2 = (((w >> 8) & 15) - 8).to(tl.float32)
            t3 = (((w >> 12) & 15) - 8).to(tl.float32)
            t4 = (((w >> 16) & 15) - 8).to(tl.float32)
            t5 = (((w >> 20) & 15) - 8).to(tl.float32)
            t6 = (((w >> 24) & 15) - 8).to(tl.float32)
            t7 = (((w >> 28) & 15) - 8).to(tl.float32)
        # nested joins stack on new last dims: the order t0 .. t7
        x = tl.join(tl.join(tl.join(t0, t4), tl.join(t2, t6)), tl.join(tl.join(t1, t5), tl.join(t3, t7)))
        x = tl.reshape(x, [w.shape[0], w.shape[1] * 8])
    else:
        if CVT_ASM:
            t0, t1, t2, t3 = words_to_f16(w, FMT)
        elif FMT == "int8":  # each byte sign-extended by an arithmetic shift
            t0 = ((w << 24) >> 24).to(tl.float32)
            t1 = ((w << 16) >> 24).to(tl.float32)
            t2 = ((w << 8) >> 24).to(tl.float32)
            t3 = (w >> 24).to(tl.float32)
        else:
            tl.static_assert(FMT == "fp8_e4m3")
            t0 = (w & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True)
            t1 = ((w >> 8) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True)
            t2 = ((w >> 16) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True)
            t3 = ((w >> 24) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True)
        x = tl.join(tl.join(t0, t2), tl.join(t1, t3))  # the order t0 t1 t2 t3
        x = tl.reshape(x, [w.shape[0], w.shape[1] * 4])
    return x


@triton.jit
def ggml_blocks(blk, blk_ok, FMT: tl.constexpr, CVT_ASM: tl.constexpr):
    """Dequantized ggml blocks (q8_0 / q4_0) [rows, NB * 32] in column order: ``blk`` [rows, NB]
    points at each block's first byte (its fp16 d, at an even address), blocks where ``blk_ok``
    is false read as zeros. The values are gathered as 16-bit words (2-byte aligned: half the loads
    of a byte gather) and multiplied by d as flashcl.quant does: fp16 products with CVT_ASM
    (q8_0's pairs through pair_to_f16; correctly rounded, as the float32 product cast to fp16),
    else float32."""
    ROWS: tl.constexpr = blk.shape[0]
    NB: tl.constexpr = blk.shape[1]
    d = tl.load(blk.to(tl.pointer_type(tl.float16), bitcast=True), mask=blk_ok, other=0.0)
    WORDS: tl.constexpr = 16 if FMT == "q8_0" else 8
    w = tl.load((blk[:, :, None] + 2).to(tl.pointer_type(tl.int16), bitcast=True)
                + tl.arange(0, WORDS)[None, None, :], mask=blk_ok[:, :, None], other=0)
    if FMT == "q8_0":  # value 2i in the low byte of word i, 2i + 1 in the high one
        if CVT_ASM:
            lo, hi = pair_to_f16(w)
        else:  # sign-extended by arithmetic shifts
            lo = ((w << 8) >> 8).to(tl.float32)
            hi = (w >> 8).to(tl.float32)
            d = d.to(tl.float32)
        qs = tl.join(lo, hi)
    else:
        tl.static_assert(FMT == "q4_0")
        # byte b: value b in its low nibble, b + 16 in its high one; join, then the halves in order
        half: tl.constexpr = [ROWS, NB, 16]
        low = tl.reshape(tl.join(w & 15, (w >> 8) & 15), half)
        high = tl.reshape(tl.join((w >> 4) & 15, (w >> 12) & 15), half)
        qs = (tl.permute(tl.join(low, high), (0, 1, 3, 2)) - 8).to(tl.float32)
        d = d.to(tl.float32)
    return tl.reshape(qs * d[:, :, None, None], [ROWS, NB * 32])


@triton.jit
def pair_to_f16(pairs):
    """The two int8 values of each 16-bit pair as fp16 (lower byte, upper byte), through a byte
    permute as in words_to_f16 (fp16 q on a GPU)."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 u, bias;
        cvt.u32.u16 u, $2;
        xor.b32 u, u, 0x8080;
        prmt.b32 u, u, 0x64646464, 0x4140;
        mov.b32 bias, 0x64806480;
        sub.rn.f16x2 u, u, bias;
        mov.b32 {$0, $1}, u;
        }""",
        constraints="=h,=h,h", args=[pairs], dtype=(tl.float16, tl.float16), is_pure=True, pack=1)


@triton.jit
def words_to_f16(w, FMT: tl.constexpr):
    """The fp16 values of 32-bit words of a quantized row, through byte permutes (sm_89+ for
    fp8): an 8-bit value u becomes the fp16 1024 + u by taking 0x64 as its upper byte, then an
    exact subtract of the bias. int8 / fp8: ``w`` holds 4 values, returned in order; q4_0: 8
    nibbles, returned less 8 (nibble h of byte k at 2 k + h)."""
    if FMT == "fp8_e4m3":
        return tl.inline_asm_elementwise(asm=FP8_F16_PTX, constraints="=h,=h,=h,=h,r", args=[w],
                                         dtype=(tl.float16,) * 4, is_pure=True, pack=1)
    elif FMT == "int8":
        return tl.inline_asm_elementwise(asm=INT8_F16_PTX, constraints="=h,=h,=h,=h,r", args=[w],
                                         dtype=(tl.float16,) * 4, is_pure=True, pack=1)
    else:
        tl.static_assert(FMT == "q4_0")
        return tl.inline_asm_elementwise(
            asm=Q4_0_F16_PTX,
            constraints="=h,=h,=h,=h,=h,=h,=h,=h,r", args=[w], dtype=(tl.float16,) * 8, is_pure=True, pack=1)


@triton.jit
def dot(a, b, acc, PARTS: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """acc + a @ b (acc None: a @ b). PARTS: a is float32 and b a bf16 tile of values bf16 holds
    exactly (int8, fp8_e4m3, q4_0's nibbles); a goes as three bf16 parts, 8 bits each and all 24 of
    float32's, so a is their sum exactly for |a| in [2^-110, 3.39e38] (below, bits under 2^-133 are
    dropped; above, bf16's largest, the part and the row become NaN), and the three 16-bit dots lose
    nothing to a float32 tile's (the cache's values never widened to float32 nor split for tf32x3).
    UPCAST (the interpreter): the 16-bit dots in float32. Else one dot of ``DOT_PRECISION``."""
    if PARTS:
        a0 = a.to(tl.bfloat16)
        rest = a - a0.to(tl.float32)
        a1 = rest.to(tl.bfloat16)
        a2 = (rest - a1.to(tl.float32)).to(tl.bfloat16)
        if UPCAST:
            b = b.to(tl.float32)
            acc = tl.dot(a2.to(tl.float32), b, acc, input_precision="ieee")
            acc = tl.dot(a1.to(tl.float32), b, acc, input_precision="ieee")
            acc = tl.dot(a0.to(tl.float32), b, acc, input_precision="ieee")
        else:  # the smallest part first: the tensor cores' sums truncate, relative to their largest term
            acc = tl.dot(a2, b, acc)
            acc = tl.dot(a1, b, acc)
            acc = tl.dot(a0, b, acc)
    else:
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    return acc
