"""q4_0 and q8_0 K/V read in stored order: the Triton decode's path for q4_0 caches, and for
q8_0 caches under float32 q.

A ggml row is blocks of 32 values: the block's fp16 scale d, then the values, 16 bytes of nibbles
for q4_0 (byte i holds value i in its low nibble, value i + 16 in its high one; 18-byte blocks),
32 int8 bytes for q8_0 (34-byte blocks), so a block's values never sit on the 4-byte boundaries
that pipelined loads need. Here the row is loaded as it is stored, 32-bit words in order, and
every nibble (q4_0) or byte (q8_0) becomes one position of the tile, d's included. The tile is
never rearranged; the block structure goes into rows instead, which the MMA has spare (a GQA
group of 4 pads to 16 rows):

    K:  q stacked per block: row (j, m) holds query m's values at block j's positions, zeros
        elsewhere (d's positions too), so  S[(j, m), n] = q_m . block j of key n  in one dot, and
        the score is  s[m, n] = sum_j d_j[n] * S[(j, m), n]  (fp32: exact integers times q).
    V:  p stacked per block: row (j, m) holds p[m, n] * d_j[n], so  A = P @ values  holds at
        row (j, m) and each position of block j query m's output for that value; the epilogue
        stores each position of row (j, m) whose block is j at its head-dim column.

A row is D positions (the head dim: whole words) and a tail past them (2 bytes a block: 4 q4_0
nibbles or 2 q8_0 bytes), all of the last block, computed on CUDA cores (a dot of so few
positions would take padding and registers). A row of V's stacked p takes d_j times 2^-e_j, e_j
the exponent of block j's largest d in the tile, scaled back in fp32 after the dot: p * d in fp16
would leave the normal range for small d.

Rows must lie on 4-byte boundaries, the head dim be 64, 128 or 256 (rows of whole words) and
the stacked rows few enough (``decode_plan.stored_order``); other caches take
``decode._load_quant``'s gather. With fp16 or bf16 q, q8_0 measured slower this way than by its
byte-pair gather (docs/notes/quantized-decode.md, "Stored order"); with float32 q, whose dots
take the values in bf16, stored order keeps them exact where the gather's value x d would not be
("float32 q"; head dim 128 only).
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import quant_words

# a block's bytes: d, then 16 bytes of nibbles (q4_0) or 32 values (q8_0)
_Q4_0_BYTES = tl.constexpr(18)
_Q8_0_BYTES = tl.constexpr(34)


def row_words_aligned(data) -> int:
    """The 32-bit words (4, 2 or 1) that every row's start is a multiple of (0: not even one):
    the loads' vector width (rows of 72 bytes at d = 128: 8-byte loads)."""
    for words in (4, 2, 1):
        if data.data_ptr() % (4 * words) == 0 and all(st % (4 * words) == 0 for st in data.stride()[:3]):
            return words
    return 0


def tail_positions(d: int, fmt: str) -> int:
    """Positions of a stored row past its head dim: 2 bytes a block, 4 q4_0 nibbles or 2 q8_0 bytes."""
    return (d // 32) * {"q4_0": 4, "q8_0": 2}[fmt]


@triton.jit
def columns(pos, D: tl.constexpr, FMT: tl.constexpr):
    """(block, head-dim column) of stored-order positions ``pos`` of a row of head dim D: q4_0's
    position 8 w + 2 k + h is nibble h (high: value + 16) of byte k of word w, q8_0's position is
    its byte; column -1 for d's."""
    tl.static_assert((FMT == "q4_0") or (FMT == "q8_0"), "stored order: q4_0 or q8_0")
    BYTES: tl.constexpr = _Q4_0_BYTES if FMT == "q4_0" else _Q8_0_BYTES
    if FMT == "q4_0":
        byte = (pos // 8) * 4 + (pos % 8) // 2
        high = 16 * (pos % 2)
    else:
        byte = pos
        high = 0
    blk = byte // BYTES
    off = byte % BYTES
    value = (off >= 2) & (byte < BYTES * (D // 32))
    return blk, tl.where(value, 32 * blk + off - 2 + high, -1)


@triton.jit
def tile(base, row, rows_ok, D: tl.constexpr, TAIL: tl.constexpr, CVT_ASM: tl.constexpr, ALIGN: tl.constexpr,
         FMT: tl.constexpr):
    """A K or V tile in stored order: (main [rows, D], tail [rows, TAIL]) values of the rows at
    ``row`` (byte offsets from ``base``, multiples of 4 ``ALIGN`` words: the loads' width), q4_0's
    nibbles less 8 or q8_0's bytes; rows where ``rows_ok`` is false are zeros. fp16 through byte
    permutes with CVT_ASM, else float32 (exact integers either way)."""
    PER_WORD: tl.constexpr = 8 if FMT == "q4_0" else 4
    VALUES: tl.constexpr = "q4_0" if FMT == "q4_0" else "int8"
    BYTES: tl.constexpr = _Q4_0_BYTES if FMT == "q4_0" else _Q8_0_BYTES
    words = base.to(tl.pointer_type(tl.int32), bitcast=True) + tl.multiple_of(row // 4, ALIGN)[:, None]
    main = tl.load(words + tl.arange(0, D // PER_WORD)[None, :], mask=rows_ok[:, None], other=0)
    tl.static_assert(D // PER_WORD + TAIL // PER_WORD == (D // 32) * BYTES // 4)
    tail = tl.load(words + (D // PER_WORD + tl.arange(0, TAIL // PER_WORD))[None, :], mask=rows_ok[:, None], other=0)
    return quant_words.values(main, VALUES, CVT_ASM), quant_words.values(tail, VALUES, CVT_ASM)


@triton.jit
def scales(base, row, rows_ok, NB: tl.constexpr, FMT: tl.constexpr):
    """The blocks' d of rows ``row`` as float32 [NB, rows], each read in the 32-bit word that
    holds it (pipelined like the values); rows where ``rows_ok`` is false 0."""
    byte = tl.arange(0, NB) * (_Q4_0_BYTES if FMT == "q4_0" else _Q8_0_BYTES)
    words = base.to(tl.pointer_type(tl.int32), bitcast=True) + (row // 4)[None, :] + (byte // 4)[:, None]
    w = tl.load(words, mask=rows_ok[None, :], other=0)
    bits = tl.where((byte % 4 == 2)[:, None], w >> 16, w) & 0xFFFF
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def stack(x, NB: tl.constexpr):
    """[G] -> [NB * G]: x repeated for each block's rows (row j * G + m holds x[m])."""
    G: tl.constexpr = x.shape[0]
    return tl.reshape(tl.broadcast_to(x[None, :], [NB, G]), [NB * G])


@triton.jit
def per_block(x, G: tl.constexpr):
    """[NB] -> [NB * G]: x[j] at every row of block j."""
    NB: tl.constexpr = x.shape[0]
    return tl.reshape(tl.broadcast_to(x[:, None], [NB, G]), [NB * G])


@triton.jit
def last_block(d):
    """d [NB, rows] -> the last block's [rows]."""
    NB: tl.constexpr = d.shape[0]
    return tl.sum(tl.where((tl.arange(0, NB) == NB - 1)[:, None], d, 0.0), 0)


@triton.jit
def _stacked(rows, heads_ok, stride_d, D: tl.constexpr, TAIL: tl.constexpr, FMT: tl.constexpr):
    """Addresses of a head-dim row in stored order, for rows ``rows[m]`` ([G] pointers; ``heads_ok``
    whether each is a head): main (pointers [NB * G, D], mask: row j * G + m at block j's values)
    and tail (pointers [G, TAIL], mask), each position at its head-dim column."""
    NB: tl.constexpr = D // 32
    G: tl.constexpr = rows.shape[0]
    blk, col = columns(tl.arange(0, D), D, FMT)
    main = stack(rows, NB)[:, None] + col[None, :] * stride_d
    main_ok = (stack(heads_ok, NB)[:, None] & (blk[None, :] == (tl.arange(0, NB * G) // G)[:, None])
               & (col[None, :] >= 0))
    _, col = columns(D + tl.arange(0, TAIL), D, FMT)
    return main, main_ok, rows[:, None] + col[None, :] * stride_d, heads_ok[:, None]


@triton.jit
def load_q(q_rows, heads_ok, stride_d, D: tl.constexpr, TAIL: tl.constexpr, FMT: tl.constexpr):
    """q at a K tile's positions: main stacked per block [NB * G, D] (row j * G + m holds query
    m's values at block j's positions, zeros elsewhere), tail [G, TAIL] (the last block's).
    ``q_rows[m]``: query m's row, ``heads_ok[m]``: whether it is one ([G] each)."""
    main, main_ok, tail, tail_ok = _stacked(q_rows, heads_ok, stride_d, D, TAIL, FMT)
    return tl.load(main, mask=main_ok, other=0.0), tl.load(tail, mask=tail_ok, other=0.0)


@triton.jit
def scores(q_main, q_tail, k_main, k_tail, d_k, G: tl.constexpr, PARTS: tl.constexpr, UPCAST: tl.constexpr,
           DOT_PRECISION: tl.constexpr):
    """s [G, rows] = sum over blocks j of d_k[j] * (q's block j . K's block j), fp32: the main
    positions by one dot of the stacked q (quant_words.dot), the tail on CUDA cores."""
    NB: tl.constexpr = d_k.shape[0]
    s = quant_words.dot(q_main, tl.trans(k_main), None, PARTS, UPCAST, DOT_PRECISION)
    s = tl.sum(tl.reshape(s, [NB, G, k_main.shape[0]]) * d_k[:, None, :], 0)
    t = tl.sum(q_tail.to(tl.float32)[:, None, :] * k_tail.to(tl.float32)[None, :, :], 2)
    return s + t * last_block(d_k)[None, :]


@triton.jit
def accumulate(acc_main, acc_tail, alpha, p, d_v, v_main, v_tail, PARTS: tl.constexpr, UPCAST: tl.constexpr,
               DOT_PRECISION: tl.constexpr):
    """acc * alpha + P @ V: main per stacked row, P's row (j, m) p[m] * d_v[j] (fp32 p [G, rows],
    d_v [NB, rows], zeros at rows past the end) scaled by 2^-e_j into the dot's type (PARTS: kept
    float32 for quant_words.dot to split); the tail [G, rows, TAIL] per key on CUDA cores (summed
    over the keys once, at the end)."""
    NB: tl.constexpr = d_v.shape[0]
    G: tl.constexpr = p.shape[0]
    # 2^-e_j and 2^e_j from the exponent of block j's largest |d| (bits of fp32; never 0 or 255)
    e = tl.minimum(tl.maximum((tl.max(tl.abs(d_v), 1).to(tl.int32, bitcast=True) >> 23) & 0xFF, 1), 253)
    down = ((254 - e) << 23).to(tl.float32, bitcast=True)
    up = per_block((e << 23).to(tl.float32, bitcast=True), G)[:, None]
    pp = p[None, :, :] * (d_v * down[:, None])[:, None, :]
    pp = tl.reshape(pp, [NB * G, p.shape[1]])
    if not PARTS:
        pp = pp.to(v_main.dtype)
    pv = quant_words.dot(pp, v_main, None, PARTS, UPCAST, DOT_PRECISION)
    acc_main = acc_main * stack(alpha, NB)[:, None] + pv * up
    tail = (last_block(d_v)[:, None] * v_tail.to(tl.float32))[None, :, :]
    acc_tail = acc_tail * alpha[:, None, None] + p[:, :, None] * tail
    return acc_main, acc_tail


@triton.jit
def store(out_rows, heads_ok, stride_d, acc_main, out_tail, D: tl.constexpr, TAIL: tl.constexpr,
          FMT: tl.constexpr):
    """Store the stacked rows ``acc_main``: position c of row (j, m) at column(c) of ``out_rows[m]``
    where c is a value of block j (each column once); ``out_tail`` [G, TAIL] at the tail's
    columns. ``out_rows``, ``heads_ok``: [G]."""
    main, main_ok, tail, tail_ok = _stacked(out_rows, heads_ok, stride_d, D, TAIL, FMT)
    tl.store(main, acc_main.to(out_rows.dtype.element_ty), mask=main_ok)
    tl.store(tail, out_tail.to(out_rows.dtype.element_ty), mask=tail_ok)
