"""The PTX that turns quantized bytes into fp16 in the Triton decode kernels, run on the CPU by a
small interpreter of the instructions it emits: windows of q8_0 / q4_0 rows in the Gluon GQA kernel
(decode_gluon.ggml_ptx) at every window offset a lane can have, each value checked against q * d
rounded to fp16, and int8 and q4_0 words (quant_words.INT8_F16_PTX, Q4_0_F16_PTX). The kernels
run only on a GPU (tests/test_quant_triton_decode.py); this keeps their byte selection checked in
CI."""

import re

import numpy as np
import pytest

pytest.importorskip("triton")
from flashcl.triton import decode_gluon  # noqa: E402


def _f16x2(x: int) -> np.ndarray:
    return np.frombuffer(int(x).to_bytes(4, "little"), np.float16)


def _bits(h: np.ndarray) -> int:
    return int.from_bytes(np.asarray(h, np.float16).tobytes(), "little")


def _run(ptx: str, constraints: str, inputs: list) -> list:
    """The outputs (ints: 32-bit registers, or 16-bit for "=h") of ``ptx`` given its inputs in
    operand order (ints; 64-bit for "l")."""
    kinds = constraints.split(",")
    n_out = sum(k.startswith("=") for k in kinds)
    assert len(inputs) == len(kinds) - n_out
    ops = {n_out + i: v for i, v in enumerate(inputs)}
    out, reg = {}, {}

    def val(tok):
        tok = tok.strip()
        if tok.startswith("$"):
            return ops[int(tok[1:])]
        return int(tok, 0) if tok[0].isdigit() else reg[tok]

    def put(tok, x):
        if tok.startswith("$"):
            out[int(tok[1:])] = x
        else:
            reg[tok] = x & 0xFFFFFFFF

    for line in ptx.splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        m = re.fullmatch(r"\{(.*), (.*)\}, (.*)", args)
        if op == "mov.b64":  # {lo, hi}, 64-bit operand
            x = val(m.group(3))
            put(m.group(1), x & 0xFFFFFFFF)
            put(m.group(2), x >> 32)
            continue
        if op == "mov.b32" and m:  # {$a, $b}, f16x2: two 16-bit outputs
            x = val(m.group(3))
            put(m.group(1), x & 0xFFFF)
            put(m.group(2), x >> 16)
            continue
        a = [t.strip() for t in args.split(",")]
        if op == "mov.b32" and a[1].startswith("{"):  # d, {$h, $h}: a 16-bit operand twice
            h = val(a[1].strip("{}"))
            put(a[0], h | h << 16)
        elif op == "mov.b32":
            put(a[0], val(a[1]))
        elif op == "prmt.b32":
            src = (val(a[2]) << 32 | val(a[1])).to_bytes(8, "little")
            sel = val(a[3])
            assert not sel & 0x8888, "prmt's sign-replicate mode is not interpreted"
            put(a[0], int.from_bytes(bytes(src[(sel >> 4 * i) & 7] for i in range(4)), "little"))
        elif op in ("xor.b32", "and.b32", "shr.u32"):
            x, y = val(a[1]), val(a[2])
            put(a[0], x ^ y if op == "xor.b32" else x & y if op == "and.b32" else x >> y)
        elif op in ("sub.rn.f16x2", "mul.rn.f16x2"):
            x, y = _f16x2(val(a[1])), _f16x2(val(a[2]))
            put(a[0], _bits(x - y if op.startswith("sub") else x * y))
        else:
            raise AssertionError(f"instruction not interpreted: {line}")
    assert sorted(out) == list(range(n_out))
    return [out[i] for i in range(n_out)]


def _selectors(o: int) -> tuple[int, int]:
    """(shift, sel) for quants at byte o of a window, as the kernel's _ggml_selectors computes them
    (a jit function, which does not run on the CPU)."""
    shift = 0x7654 if o >= 6 else 0x3210
    sel = 0x5432 if o % 4 == 2 else (0x7654 if o in (4, 8) else 0x3210)
    return shift, sel


def _window(rng, pack: int, o: int, quant_bytes: bytes, d: np.float16, d_at=None) -> list:
    """pack + 1 little-endian 8-byte units of random bytes with ``quant_bytes`` at byte o (and d at
    byte ``d_at``)."""
    w = bytearray(rng.integers(0, 256, 8 * (pack + 1), dtype=np.uint8).tobytes())
    w[o:o + len(quant_bytes)] = quant_bytes
    if d_at is not None:
        w[d_at:d_at + 2] = d.tobytes()
    return [int.from_bytes(w[8 * u:8 * u + 8], "little") for u in range(pack + 1)]


def _expected(fmt: str, quant_bytes: bytes, d: np.float16) -> np.ndarray:
    """The lane's values in the order the PTX returns them (ggml_ptx's docstring), as fp16 q * d."""
    q = np.frombuffer(quant_bytes, np.uint8)
    if fmt == "q8_0":
        values = q.view(np.int8).astype(np.float32)
    else:  # value k: low nibble of byte k; value 16 + k (K) or 8 + k (V's half block): the high one
        values = np.concatenate([q & 15, q >> 4]).astype(np.float32) - 8
    return (values * np.float32(d)).astype(np.float16)


@pytest.mark.parametrize("fmt,pack,side", [("q8_0", 4, "K"), ("q8_0", 2, "V"), ("q4_0", 2, "K"), ("q4_0", 1, "V")])
def test_ggml_ptx_reads_every_window_offset(fmt, pack, side):
    """K lanes c = 0..3 (quants at byte 2 c + 2 of the window, d at 2 c) and V lanes of blocks
    b = 0..3 (quants at (2 b + 2) % 8, d an operand), d from tiny to large, 20 windows each."""
    rng = np.random.default_rng(10 * pack + (fmt == "q4_0"))
    ptx, cons = decode_gluon.ggml_ptx(fmt, pack, side == "K"), decode_gluon.ggml_constraints(fmt, pack, side == "K")
    n_bytes = 8 * pack  # quant bytes a lane holds: 2 pack words
    for lane in range(4):
        o = 2 * lane + 2 if side == "K" else (2 * lane + 2) % 8
        shift, sel = _selectors(o)
        for _ in range(20):
            d = np.float16(rng.choice([-1, 1]) * 10.0 ** rng.uniform(-4, 2))
            quants = rng.integers(0, 256, n_bytes, dtype=np.uint8).tobytes()
            units = _window(rng, pack, o, quants, d, d_at=2 * lane if side == "K" else None)
            main, tail = units[:pack], [units[pack]] * pack
            if side == "K":
                args = main + tail + [shift] * pack + [sel] * pack + [0x1010 + 0x2222 * lane] * pack
            else:  # d: an fp16 pair in one register, or with pack 1 one 16-bit operand
                d_op = _bits(np.array([d, d])) if pack > 1 else _bits(d)
                args = main + tail + [d_op] + [shift] * pack + [sel] * pack
            regs = _run(ptx, cons, args)
            if cons.startswith("=h"):
                got = np.array([_f16x2(r)[0] for r in regs], np.float16)
            else:
                got = np.concatenate([_f16x2(r) for r in regs])
            want = _expected(fmt, quants, d)
            if fmt == "q4_0" and side == "K":  # register 4 k + s: lows (4 k ..), (4 k + 2 ..), highs (16 + 4 k ..)
                order = [16 * (s // 2) + 4 * k + 2 * (s % 2) + e for k in range(4) for s in range(4) for e in range(2)]
                want = want[order]
            np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16),
                                          err_msg=f"{fmt} {side} lane {lane} (o={o}) d={d}")


def test_int8_words_ptx():
    """quant_words.INT8_F16_PTX (int8 words in both decode paths, and q8_0's quants above): the
    four bytes of a word as fp16, exactly, every byte value."""
    from flashcl.triton import quant_words

    ptx = quant_words.INT8_F16_PTX.value  # a tl.constexpr
    for start in range(0, 256, 4):
        word = bytes(range(start, start + 4))
        got = [_f16x2(h)[0] for h in _run(ptx, "=h,=h,=h,=h,r", [int.from_bytes(word, "little")])]
        np.testing.assert_array_equal(np.array(got, np.float16), np.frombuffer(word, np.int8).astype(np.float16))


def test_q4_0_words_ptx():
    """quant_words.Q4_0_F16_PTX (q4_0 words in the Triton decode): nibble h of byte k less 8 as
    fp16 at output 2 k + h, every nibble value in both halves of every byte."""
    from flashcl.triton import quant_words

    ptx = quant_words.Q4_0_F16_PTX.value
    for start in range(0, 256, 4):
        word = bytes((start + i) % 256 for i in range(4))
        got = [_f16x2(h)[0] for h in _run(ptx, ",".join(["=h"] * 8 + ["r"]), [int.from_bytes(word, "little")])]
        want = [(b >> (4 * h) & 15) - 8 for b in word for h in range(2)]
        np.testing.assert_array_equal(np.array(got, np.float16), np.array(want, np.float16))
