r"""Flash-attention forward (prefill) in Triton, registered as the torch op ``flashcl::prefill``.

    q   (B, H_q,  N_q,  DK)      any strides; H_q % H_kv == 0 (MHA, GQA, MQA: K/V are never repeated)
    k   (B, H_kv, N_kv, DK)      DK, DV independent multiples of 8 in 8..256
    v   (B, H_kv, N_kv, DV)
    out (B, H_q,  N_q,  DV)      input dtype (float32, float16, bfloat16), contiguous
    lse (B, H_q,  N_q)           float32, natural log; -inf where a row sees no key

One program computes BLOCK_M query rows of one (batch, query head) against all the keys it sees,
streaming K/V in tiles of BLOCK_N rows (FlashAttention-2, online softmax in the exp2 domain):

          keys ->   0        BLOCK_N  ...                         N_kv
                  +--------+--------+--------+--------+--------+
    BLOCK_M rows  | full   | full   | full   | diag   |  (skipped: above the diagonal)
    of queries    |        |        |        |  \     |
                  +--------+--------+--------+--------+
                  '--- loop 1: no masks ----''- loop 2: masked (causal diagonal, N_kv tail)

``causal=True`` is bottom-right aligned: query i sees keys j <= i + N_kv - N_q. Tiles wholly above
the diagonal are never loaded (the loop bounds stop before them); only the tiles the diagonal
crosses, and the ragged last tile of a non-causal row, go through the masked loop.

Variants (flashcl.variants; each a compile-time flag, all off: the plain kernel, instruction for
instruction): WINDOW narrows the loop to the tiles the block's window reaches,

          keys ->   0   lo       full_start           full_end  hi      N_kv
                  +----+--------+--------+--------+--------+--------+----+
    BLOCK_M rows  |skip|  \     | full   | full   | full   |  \     |skip|
                  +----+--------+--------+--------+--------+--------+----+
                        loop 0    '------ loop 1 ---------'  loop 2

(loop 0 masks the left edge, loop 2 the right edge or the causal diagonal); SOFTCAP and ALIBI
change the scores of every tile (_variant_scores); SINKS start each row's state at the sink
(m = sink, l = 1, so lse includes it); MASK (bool or additive) visits what flashcl.triton.mask_tiles
lists per query block (from the mask, causal and the window): a run of tiles every
row sees in full as loop 1, then the other visible tiles through the masked path, reading the
mask tile with the scores (by TMA where the mask's strides allow, MASK_TMA).

Quantized K/V (flashcl.quant: q8_0, q4_0, int8, fp8_e4m3; K and V each in its own format or
plain, a contiguous QuantizedTensor of (B, H_kv, N_kv, D)): the op takes its data, format and
scales; K_FMT / V_FMT specialize the kernel ("" is the plain kernel, instruction for instruction)
and each tile is dequantized after its pointer load (_load_kv; no TMA): ggml blocks with their
fp16 d in float32, int8 / fp8 values exactly in q's dtype with their scale applied per key to the
scores (int8 K), to P (int8 V), or once per tensor (fp8: folded into the score scale, applied to
the finished rows).

Accumulation is float32; float32 inputs take tf32x3 dots (FLOAT32_DOTS; Triton's default, one TF32
product, keeps 10 bits of each operand).

Non-finite inputs: a key a row cannot see never reaches that row, whatever its K or V holds: the
masked tiles select scores with tl.where, keys past N_kv load as 0, and a causal, windowed or
masked block whose acc comes out non-finite is redone with V cleaned (_careful_block), a path
finite inputs never take.
A row whose q or a visible K holds NaN/inf gets NaN out and lse (never lse = -inf); one that
sees a non-finite V gets NaN in its whole output row if causal, else NaN/inf in that column
(its lse stays exact).

SOFTMAX_OVERLAP (a tile option, chosen for long rows on sm_90, see _overlap_pays) reorders loop 1
so that each tile's softmax runs while the tensor cores do the previous tile's P @ V
(_attend_full_tiles_overlapped): the same sums in the same order (its first trip adds P = 0 times tile 0).

Launch order (a 1-D grid, dispatched in program order): the (batch, query head) pairs are cut into
sections of HEAD_GROUP heads whose K/V fit in a share of L2 together (head_group()); a section's
programs run last query block first, the heads of the section interleaved (FlashAttention-3's
longest-first scheduler with an L2 swizzle). The programs in flight then share a few heads' K/V
in L2, and the longest causal rows of every head start first, so the short ones fill the tail of
the launch (HEAD_GROUP = 1 is plain head-by-head order). On sm_90+ with 16-byte aligned inputs the
autotuner also times a config that moves tiles with tensor descriptors (TMA), built once per call
on the host over the 4-D tensors; everywhere else the kernel uses plain pointer loads (sm_80+).
Autotune key: (N_q bucket, N_kv bucket, B * H_q bucket, DK, DV, causal, TMA possible, the variant
flags, the K/V formats, whether the mask is read by TMA, dtypes);
the candidate configs come from _TILE_SPACE through the named filter _prune_configs.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ..errors import KernelLaunchError
from ..quant import BLOCK_BYTES, FORMATS, QK, QuantizedTensor
from ..variants import DECODE_GROUP_ROWS, DECODE_ROWS, Variants, window_bounds
from . import FLOAT32_DOTS, interpreting, mask_tiles, on_device_of, quant_words, skips_dispatcher
from .score_variants import MASK_HIDES_AT
from .mask_tiles import LIST_HEADER, MAP_GRAIN, MAP_PAD, MAP_SEEN

LOG2E = 1.4426950408889634  # scores are kept in log2 units: exp(s) = exp2(s * log2(e))
LOG2E_K = tl.constexpr(LOG2E)  # the same, for kernels (they read only constexpr globals)
MASK_BOOL = tl.constexpr(1)  # values of the kernel's MASK flag (0: no mask)
MASK_ADD = tl.constexpr(2)
SOFTCAP_EXACT = tl.constexpr(1)  # values of the kernel's SOFTCAP flag (0: no softcap), see _tanh
SOFTCAP_FAST = tl.constexpr(2)


# --------------------------------------------------------------------------- kernel

@triton.jit
def _load_tile(src, off_b, off_hkv, start_n, offs_n, offs_d, stride_n, N_KV,
               D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
               MASKED: tl.constexpr, USE_TMA: tl.constexpr):
    """Rows start_n .. start_n + BLOCK_N of K or V, (BLOCK_N, BLOCK_D), padded head dims 0.

    src: the (B, H_kv, N_kv, D) tensor descriptor (USE_TMA: the copy engine reads rows past N_kv
    and padded head dims as 0; (off_b, off_hkv) pick the head) or the pointer tile at key 0 of
    this head. MASKED: rows past N_kv may occur (pointer loads mask them to 0)."""
    if USE_TMA:
        t = src.load([off_b, off_hkv, start_n, 0]).reshape(BLOCK_N, BLOCK_D)
    elif MASKED:
        t = tl.load(src + start_n * stride_n,
                    mask=((start_n + offs_n)[:, None] < N_KV) & (offs_d[None, :] < D), other=0.0)
    elif D != BLOCK_D:
        t = tl.load(src + start_n * stride_n, mask=offs_d[None, :] < D, other=0.0)
    else:
        t = tl.load(src + start_n * stride_n)
    return t


@triton.jit
def _kv_rows(base, offs_n, offs_d, stride_n, stride_d, FMT: tl.constexpr):
    """What _load_kv reads a head's K or V through: the pointer tile of its keys 0 .. BLOCK_N - 1
    (plain), or its first byte (quantized: _load_quant_tile addresses the rows itself)."""
    if FMT == "":
        src = base + offs_n[:, None] * stride_n + offs_d[None, :] * stride_d
    else:
        src = base
    return src


@triton.jit
def _load_quant_tile(base, start_n, offs_n, offs_d, stride_n, N_KV, DTYPE: tl.constexpr, FMT: tl.constexpr,
                     D: tl.constexpr, BLOCK_D: tl.constexpr, MASKED: tl.constexpr):
    """Rows start_n .. start_n + BLOCK_N of a quantized K or V (flashcl.quant) from ``base``, its
    head's first byte, rows stride_n bytes apart, each row's bytes contiguous; rows past N_kv
    (MASKED) and padded head dims 0.

    Returned in DTYPE. q8_0 / q4_0: ggml blocks of 32 values behind their fp16 d
    (quant_words.ggml_blocks, in float32: the tile serves BLOCK_M query rows). int8 / fp8_e4m3:
    the stored values, exact in DTYPE (their scales are applied per key or per tensor by the
    caller)."""
    rows = start_n + offs_n
    row_ok = rows < N_KV
    if not MASKED:
        row_ok = tl.full(row_ok.shape, 1, tl.int1)
    if FMT == "q8_0" or FMT == "q4_0":  # [rows, blocks]: each block's first byte
        BLOCK_BYTES: tl.constexpr = 34 if FMT == "q8_0" else 18
        blocks = tl.arange(0, BLOCK_D // 32)
        t = quant_words.ggml_blocks(base + (rows * stride_n)[:, None] + (blocks * BLOCK_BYTES)[None, :],
                                    row_ok[:, None] & (blocks[None, :] * 32 < D), FMT, False)
    else:
        tl.static_assert(FMT == "int8" or FMT == "fp8_e4m3", "quantized formats: q8_0, q4_0, int8, fp8_e4m3")
        ptrs = base + (rows * stride_n)[:, None] + offs_d[None, :]
        mask = row_ok[:, None] & (offs_d[None, :] < D)
        if FMT == "int8":
            t = tl.load(ptrs, mask=mask, other=0)
        else:  # read as bytes: a masked element is the byte 0 (+0.0)
            t = tl.load(ptrs.to(tl.pointer_type(tl.uint8), bitcast=True), mask=mask, other=0)
            t = t.to(tl.float8e4nv, bitcast=True)
    return t.to(DTYPE)


@triton.jit
def _load_kv(src, scales, off_b, off_hkv, start_n, offs_n, offs_d, stride_n, stride_sn, N_KV,
             DTYPE: tl.constexpr, FMT: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
             BLOCK_N: tl.constexpr, MASKED: tl.constexpr, USE_TMA: tl.constexpr):
    """(tile, row scales) of keys start_n .. start_n + BLOCK_N of K or V (src: _kv_rows, or a
    tensor descriptor). FMT "": _load_tile, row scales 1. Quantized: _load_quant_tile's values in
    DTYPE (exact for int8 and fp8), and for int8 the keys' scales from ``scales`` (the pointers of
    keys 0 .. BLOCK_N - 1, stride_sn apart; 0 past N_kv), else 1."""
    row_scales = 1.0
    if FMT == "":
        t = _load_tile(src, off_b, off_hkv, start_n, offs_n, offs_d, stride_n, N_KV, D, BLOCK_D,
                       BLOCK_N, MASKED, USE_TMA)
    else:
        t = _load_quant_tile(src, start_n, offs_n, offs_d, stride_n, N_KV, DTYPE, FMT, D, BLOCK_D, MASKED)
        if FMT == "int8" and MASKED:
            row_scales = tl.load(scales + start_n * stride_sn, mask=(start_n + offs_n) < N_KV, other=0.0)
        elif FMT == "int8":
            row_scales = tl.load(scales + start_n * stride_sn)
    return t, row_scales


@triton.jit
def _row_scales(Scales, off_b, off_hkv, offs_n, stride_sb, stride_sh, stride_sn, FMT: tl.constexpr):
    """int8: the pointers to the scales of keys 0 .. BLOCK_N - 1 of this head (_load_kv reads
    them per tile); any other format: Scales as it is."""
    ptrs = Scales
    if FMT == "int8":
        ptrs = (Scales + off_b.to(tl.int64) * stride_sb + off_hkv.to(tl.int64) * stride_sh
                + offs_n * stride_sn)
    return ptrs


@triton.jit
def _tensor_v_scale(acc, VScales, V_FMT: tl.constexpr):
    """acc times fp8 V's scale, one per tensor: once per row block, after the last tile."""
    if V_FMT == "fp8_e4m3":
        acc = acc * tl.load(VScales)
    return acc


@triton.jit
def _initial_state(Sinks, off_h, ROWS: tl.constexpr, SINKS: tl.constexpr):
    """(m, l) of ROWS rows before any key: the empty state, or the sink's (a key of logit
    sinks[h] and value 0: m = sink in log2 units, l = 1)."""
    if SINKS:
        m_i = tl.full([ROWS], 0.0, dtype=tl.float32) + tl.load(Sinks + off_h) * LOG2E_K
        l_i = tl.full([ROWS], 1.0, dtype=tl.float32)
    else:
        m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([ROWS], dtype=tl.float32)
    return m_i, l_i


@triton.jit
def _scores(q, k, DOT_PRECISION: tl.constexpr, UPCAST_DOTS: tl.constexpr, k_scales=1.0,
            ROW_SCALES: tl.constexpr = False):
    """Q @ K^T in float32 (q is upcast already where UPCAST_DOTS); ROW_SCALES (int8 K): times
    each key's scale, one multiply per score rather than one per element of K."""
    if UPCAST_DOTS:
        k = k.to(tl.float32)
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    if ROW_SCALES:
        qk = qk * k_scales[None, :]
    return qk


@triton.jit
def _add_pv(acc, p, v, DOT_PRECISION: tl.constexpr, UPCAST_DOTS: tl.constexpr, v_scales=1.0,
            ROW_SCALES: tl.constexpr = False):
    """acc + P @ V, P rounded to V's storage dtype for the tensor-core dot (the interpreter then
    upcasts both: it multiplies bfloat16 as raw bits; bfloat16 products are exact in float32).
    ROW_SCALES (int8 V): P times each key's scale first, one multiply per key and row."""
    if ROW_SCALES:
        p = p * v_scales[None, :]
    p = p.to(v.dtype)
    if UPCAST_DOTS:
        p, v = p.to(tl.float32), v.to(tl.float32)
    return tl.dot(p, v, acc, input_precision=DOT_PRECISION)


@triton.jit
def _full_tile_softmax(qk, m_i, qk_scale):
    """(P, alpha, new row max) of a tile every row sees in full: P = exp2(scores - max) with the
    scale * log2(e) folded into one multiply-add, alpha the factor that moves the old state to
    the new max. qk_scale >= 0 (the host flips the sign of q otherwise), so max(qk) * scale is
    the max of the scaled scores."""
    m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    p = tl.math.exp2(qk * qk_scale - m_ij[:, None])
    alpha = tl.math.exp2(m_i - m_ij)
    return p, alpha, m_ij


@triton.jit
def _hide_nonfinite_v(p, v, seen, v_scales=1.0, ROW_SCALES: tl.constexpr = False):
    """P and V of a tile of _careful_block: P is 0 at a key a row cannot see, but 0 * inf and
    0 * NaN are NaN in the dot, so non-finite V values become 0, and a row that sees such a key
    gets P = NaN on it: NaN in its whole output row (lse stays exact). ROW_SCALES (int8 V): a
    non-finite scale of a key counts as its values do and becomes 0; returns (P, V, scales)."""
    finite = tl.abs(v) < float("inf")  # false for NaN and +-inf
    key_bad = tl.max(tl.where(finite, 0, 1), 1)
    if ROW_SCALES:
        scale_ok = tl.abs(v_scales) < float("inf")
        key_bad = tl.where(scale_ok, key_bad, 1)
        v_scales = tl.where(scale_ok, v_scales, 0.0)
    p = tl.where(seen & (key_bad[None, :] != 0), float("nan"), p)
    return p, tl.where(finite, v, 0.0), v_scales


@triton.jit
def _tanh(x, FAST: tl.constexpr):
    """tanh in float32. FAST: PTX's tanh.approx (one MUFU op, relative error <= 2^-11, below what
    16-bit inputs resolve); else from one exp2 and a division, odd by construction, exact at
    +-inf, NaN stays NaN (libdevice's tanh has no interpreter twin)."""
    if FAST:
        t = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32,
                                      is_pure=True, pack=1)
    else:
        e = tl.math.exp2(tl.abs(x) * -2.8853900817779268)  # exp(-2|x|)
        t = (1.0 - e) / (1.0 + e)
        t = tl.where(x < 0, -t, t)
    return t


@triton.jit
def _variant_scores(qk, qk_scale, softcap_scale, softcap_log2, alibi_log2, row_pos, key_pos,
                    SOFTCAP: tl.constexpr, ALIBI: tl.constexpr):
    """Scores of a tile in log2 units: scale, then softcap c * tanh(s / c) (SOFTCAP_EXACT or
    SOFTCAP_FAST, see _tanh), then ALiBi - slope * |p - j| (flashcl.variants' order). With
    neither, the plain qk * qk_scale."""
    if SOFTCAP:
        s = softcap_log2 * _tanh(qk * softcap_scale, SOFTCAP == SOFTCAP_FAST)
    else:
        s = qk * qk_scale
    if ALIBI:
        # float distances (exact below 2^24): one subtract per score, no int-to-float convert
        dist = row_pos.to(tl.float32)[:, None] - key_pos.to(tl.float32)[None, :]
        s = s - alibi_log2 * tl.abs(dist)
    return s


@triton.jit
def _tile_in_map(map_rows, start_n, BLOCK_N: tl.constexpr):
    """Whether the block map holds a visible key in key tile start_n of these map rows
    (map_rows: (rows, 1) pointers to the MAP_GRAIN x MAP_GRAIN entries of the query block)."""
    cols = start_n // MAP_GRAIN + tl.arange(0, BLOCK_N // MAP_GRAIN)
    return (tl.max(tl.load(map_rows + cols[None, :])) & MAP_SEEN) != 0


@triton.jit
def _attend_tile(acc, l_i, m_i, q, k_src, v_src, off_b, off_hkv, start_n, offs_n, offs_dk, offs_dv,
                 stride_kn, stride_vn, N_KV, row_last, qk_scale,
                 DK: tl.constexpr, DV: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
                 BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CLEAN_V: tl.constexpr,
                 DOT_PRECISION: tl.constexpr, UPCAST_DOTS: tl.constexpr, USE_TMA: tl.constexpr,
                 EARLY_V: tl.constexpr,
                 row_first=None, row_pos=None, softcap_scale=None, softcap_log2=None,
                 alibi_log2=None, mask_rows=None, stride_mk=None,
                 WINDOW: tl.constexpr = False, SOFTCAP: tl.constexpr = False,
                 ALIBI: tl.constexpr = False, MASK: tl.constexpr = 0,
                 k_scales=None, v_scales=None, stride_ksn=None, stride_vsn=None,
                 K_FMT: tl.constexpr = "", V_FMT: tl.constexpr = "", MASK_TMA: tl.constexpr = False,
                 mask_desc=None, mask_at=None):
    """Fold one BLOCK_N tile of keys into the running state (acc, l_i, m_i) of BLOCK_M rows.

    k_src/v_src: see _kv_rows; K_FMT/V_FMT, k_scales/v_scales, stride_ksn/stride_vsn: see
    _load_kv (int8 scales reach the scores in _scores and P in _add_pv). MASKED: row i sees the
    keys j <= row_last[i] (row_last < N_kv folds the causal limit, the window's right edge and the
    ragged end), and j >= row_first[i] under WINDOW. CLEAN_V (masked tiles): _hide_nonfinite_v.
    EARLY_V: V is loaded with K, before QK^T (with the software pipeline's stages both then wait on
    one barrier; see the notes next to _TILE_SPACE). SOFTCAP, ALIBI: _variant_scores (row_pos =
    the rows' positions p). MASK (masked tiles only): MASK_BOOL / MASK_ADD, read through
    mask_rows, (BLOCK_M, 1) row pointers, or with MASK_TMA by the copy engine through mask_desc
    at (batch, head, first row) mask_at: it lands in shared memory, from where the tile is read
    straight into the scores' layout (a pointer load's tile changes layout through shared
    memory, and the scores with it: +15% at N = 4096, docs/notes/variants.md)."""
    k, k_row_scales = _load_kv(k_src, k_scales, off_b, off_hkv, start_n, offs_n, offs_dk, stride_kn,
                               stride_ksn, N_KV, q.dtype, K_FMT, DK, BLOCK_DK, BLOCK_N, MASKED, USE_TMA)
    if EARLY_V:
        v, v_row_scales = _load_kv(v_src, v_scales, off_b, off_hkv, start_n, offs_n, offs_dv, stride_vn,
                                   stride_vsn, N_KV, q.dtype, V_FMT, DV, BLOCK_DV, BLOCK_N, MASKED, USE_TMA)
    qk = _scores(q, k, DOT_PRECISION, UPCAST_DOTS, k_row_scales, K_FMT == "int8")

    # -- new running max and probabilities (scale * log2(e) folded into one multiply-add)
    offs_kv = start_n + offs_n
    if MASKED:
        seen = offs_kv[None, :] <= row_last[:, None]
        if WINDOW:
            seen = seen & (offs_kv[None, :] >= row_first[:, None])
        s = _variant_scores(qk, qk_scale, softcap_scale, softcap_log2, alibi_log2, row_pos, offs_kv,
                            SOFTCAP, ALIBI)
        if MASK != 0:
            # keys past N_kv read 0 (TMA) or the last key's entry (unmasked loads need fewer
            # registers): row_last hides them anyway; rows past N_q are clamped the same way
            if MASK_TMA:
                mask_tile = mask_desc.load([mask_at[0], mask_at[1], mask_at[2], start_n])
                mask_tile = mask_tile.reshape(mask_tile.shape[2], BLOCK_N)
            else:
                mask_tile = tl.load(mask_rows + tl.minimum(offs_kv, N_KV - 1)[None, :] * stride_mk)
            if MASK == MASK_BOOL:
                allowed = mask_tile != 0
            else:
                allowed = mask_tile > MASK_HIDES_AT
                s = s + mask_tile * LOG2E_K
            # a select, as for seen below; seen itself takes the mask only where CLEAN_V reads it
            # (folding it in there costs registers: ptxas spilled and serialized the wgmma)
            s = tl.where(allowed, s, float("-inf"))
            if CLEAN_V:
                seen = seen & allowed
        qk = tl.where(seen, s, float("-inf"))  # a select: a NaN/inf K at a hidden key goes too
        m_ij = tl.maximum(m_i, tl.max(qk, 1))
        # a row that has seen no key yet keeps m = -inf: shift it by 0 so exp2 gives 0, not NaN
        m_shift = tl.where(m_ij == float("-inf"), 0.0, m_ij)
        p = tl.math.exp2(qk - m_shift[:, None])
        alpha = tl.math.exp2(m_i - m_shift)
    elif SOFTCAP or ALIBI:
        s = _variant_scores(qk, qk_scale, softcap_scale, softcap_log2, alibi_log2, row_pos, offs_kv,
                            SOFTCAP, ALIBI)
        p, alpha, m_ij = _full_tile_softmax(s, m_i, 1.0)
    else:
        p, alpha, m_ij = _full_tile_softmax(qk, m_i, qk_scale)
    l_ij = tl.sum(p, 1)

    # -- rescale acc to the new max, then add P @ V
    if not EARLY_V:
        v, v_row_scales = _load_kv(v_src, v_scales, off_b, off_hkv, start_n, offs_n, offs_dv, stride_vn,
                                   stride_vsn, N_KV, q.dtype, V_FMT, DV, BLOCK_DV, BLOCK_N, MASKED, USE_TMA)
    if MASKED and CLEAN_V:
        p, v, v_row_scales = _hide_nonfinite_v(p, v, seen, v_row_scales, V_FMT == "int8")
    acc = acc * alpha[:, None]
    acc = _add_pv(acc, p, v, DOT_PRECISION, UPCAST_DOTS, v_row_scales, V_FMT == "int8")
    l_i = l_i * alpha + l_ij  # after the dot, as in Triton's tutorial: shorter live ranges
    return acc, l_i, m_ij


@triton.jit
def _attend_full_tiles_overlapped(acc, l_i, m_i, q, k_src, v_src, off_b, off_hkv, full_start, full_end,
                                  offs_n, offs_dk, offs_dv, stride_kn, stride_vn, N_KV, qk_scale,
                                  DK: tl.constexpr, DV: tl.constexpr, BLOCK_DK: tl.constexpr,
                                  BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr,
                                  BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
                                  UPCAST_DOTS: tl.constexpr, USE_TMA: tl.constexpr,
                                  row_pos=None, softcap_scale=None, softcap_log2=None, alibi_log2=None,
                                  SOFTCAP: tl.constexpr = False, ALIBI: tl.constexpr = False,
                                  k_scales=None, v_scales=None, stride_ksn=None, stride_vsn=None,
                                  K_FMT: tl.constexpr = "", V_FMT: tl.constexpr = ""):
    """Loop 1 (the tiles [full_start, full_end) every row sees in full) with each tile's softmax
    running under a tensor-core dot (FlashAttention-3's intra-warpgroup overlap; measured next to
    _TILE_SPACE): trip j issues QK^T of tile j, then P @ V of tile j - 1, then the
    softmax of tile j while that P @ V runs. P waits one trip, in float32; the first trip
    multiplies P = 0 by tile 0 and the P @ V of the last tile follows the loop. SOFTCAP, ALIBI:
    _variant_scores; quantized K/V: as in _attend_tile."""
    p = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    alpha = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    for start_n in range(full_start, full_end, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        # K of this tile and V of the previous one (the first tile again on the first trip, where P = 0)
        k, k_row_scales = _load_kv(k_src, k_scales, off_b, off_hkv, start_n, offs_n, offs_dk, stride_kn,
                                   stride_ksn, N_KV, q.dtype, K_FMT, DK, BLOCK_DK, BLOCK_N, False, USE_TMA)
        v, v_row_scales = _load_kv(v_src, v_scales, off_b, off_hkv, tl.maximum(start_n - BLOCK_N, full_start),
                                   offs_n, offs_dv, stride_vn, stride_vsn, N_KV, q.dtype, V_FMT, DV, BLOCK_DV,
                                   BLOCK_N, False, USE_TMA)
        qk = _scores(q, k, DOT_PRECISION, UPCAST_DOTS, k_row_scales, K_FMT == "int8")
        # Triton waits for QK^T right after it (its result is used in this trip); P @ V's
        # result is only carried to the next trip, so its wait moves past the softmax below
        acc = acc * alpha[:, None]
        acc = _add_pv(acc, p, v, DOT_PRECISION, UPCAST_DOTS, v_row_scales, V_FMT == "int8")
        if SOFTCAP or ALIBI:
            s = _variant_scores(qk, qk_scale, softcap_scale, softcap_log2, alibi_log2, row_pos,
                                start_n + offs_n, SOFTCAP, ALIBI)
            p, alpha, m_i = _full_tile_softmax(s, m_i, 1.0)
        else:
            p, alpha, m_i = _full_tile_softmax(qk, m_i, qk_scale)
        l_i = l_i * alpha + tl.sum(p, 1)
    if full_end > full_start:
        v, v_row_scales = _load_kv(v_src, v_scales, off_b, off_hkv, full_end - BLOCK_N, offs_n, offs_dv,
                                   stride_vn, stride_vsn, N_KV, q.dtype, V_FMT, DV, BLOCK_DV, BLOCK_N, False,
                                   USE_TMA)
        acc = acc * alpha[:, None]
        acc = _add_pv(acc, p, v, DOT_PRECISION, UPCAST_DOTS, v_row_scales, V_FMT == "int8")
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["stride_lb", "stride_lh", "H_Q", "GQA_GROUP", "N_Q", "N_KV",
                              "Q_BUCKET", "KV_BUCKET", "BH_BUCKET", "TMA_OK", "HEAD_GROUP",
                              "window_left", "window_right"])
def _prefill_kernel(
    Q, K, V, Out, Lse,
    DescQ, DescK, DescV, DescO,    # USE_TMA: host-built descriptors of q, k, v, out (else None)
    DescMask,                      # MASK_TMA: the mask's descriptor (else None)
    Sinks, Alibi, Mask,            # the variants' tensors, None where off (see _VariantArgs)
    MaskMap, MaskTiles,            # MASK: block map and per-block tile lists (_VariantArgs)
    KScales, VScales,              # int8 / fp8_e4m3 K, V: their flashcl.quant scales, else None
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_lb, stride_lh, stride_lm,
    stride_ab, stride_ah,          # Alibi (B, H_q)
    stride_mb, stride_mh, stride_mq, stride_mk,  # Mask (Bm, Hm, N_q, N_kv); 0 on a broadcast dim
    stride_pb, stride_ph, stride_pq,             # MaskMap (Bm, Hm, rows, cols), unit last stride
    stride_tb, stride_th, stride_tq,             # MaskTiles (Bm, Hm, rows, 3 + cols), unit last
    stride_ksb, stride_ksh, stride_ksn,          # KScales (B, H_kv, N_kv, 1) of int8 K, else None
    stride_vsb, stride_vsh, stride_vsn,          # VScales of int8 V, else None
    qk_scale,                      # softmax scale * log2(e), >= 0
    window_left, window_right,     # WINDOW: keys p - left .. p + right (unbounded: 2^30)
    softcap_scale, softcap_log2,   # SOFTCAP: scale / softcap and softcap * log2(e)
    H_Q, GQA_GROUP, N_Q, N_KV,     # GQA_GROUP = H_q // H_kv query heads per KV head
    Q_BUCKET, KV_BUCKET,           # sequence-length buckets: autotune keys only, unused here
    BH_BUCKET,                     # B * H_q bucket (how many programs fill the GPU): autotune key
    TMA_OK,                        # 1 if tensor descriptors may be used: autotune key only
    HEAD_GROUP,                    # launch order: (batch, head) pairs per L2 section (see above)
    DK: tl.constexpr, DV: tl.constexpr,
    BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,  # head dims padded to powers of two (>= 16)
    IS_CAUSAL: tl.constexpr, RETURN_LSE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    UPCAST_DOTS: tl.constexpr,     # interpreter only: it multiplies bfloat16 as raw uint16 bits
    WINDOW: tl.constexpr, SINKS: tl.constexpr, ALIBI: tl.constexpr,
    SOFTCAP: tl.constexpr,         # 0, SOFTCAP_EXACT or SOFTCAP_FAST
    MASK: tl.constexpr,            # 0, MASK_BOOL or MASK_ADD
    K_FMT: tl.constexpr, V_FMT: tl.constexpr,  # "" (plain) or the flashcl.quant format of K, V
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_TMA: tl.constexpr,         # sm_90+: tiles moved by the copy engine (TMA) via DescQ..DescO
    SOFTMAX_OVERLAP: tl.constexpr,  # loop 1 runs each softmax under a tensor-core dot
    MASK_TMA: tl.constexpr,        # USE_TMA and MASK: mask tiles read through DescMask
):
    tl.static_assert(BLOCK_DK >= DK and BLOCK_DV >= DV, "head dims must fit their padded blocks")
    tl.static_assert(BLOCK_DK >= 16 and BLOCK_DV >= 16, "tl.dot needs every dimension >= 16")
    tl.static_assert(BLOCK_M >= 16 and BLOCK_N >= 16, "tl.dot needs every dimension >= 16")
    tl.static_assert(BLOCK_M <= MAP_PAD and BLOCK_N <= MAP_PAD, "the block map is padded to MAP_PAD")
    tl.static_assert((K_FMT == "" and V_FMT == "") or not USE_TMA, "quantized K/V: pointer loads")

    # Program order: sections of HEAD_GROUP (batch, head) pairs (the last one may be shorter);
    # inside a section the query blocks go last to first, the section's heads interleaved. Causal
    # rows near the end see the most keys, so every head's long programs start first and the
    # short ones fill the tail; the programs in flight read the K/V of one section, kept in L2.
    num_m = tl.cdiv(N_Q, BLOCK_M)
    pid = tl.program_id(0)
    first_bh = pid // (HEAD_GROUP * num_m) * HEAD_GROUP
    heads = tl.minimum(HEAD_GROUP, tl.num_programs(0) // num_m - first_bh)
    in_section = pid - first_bh * num_m
    off_bh = first_bh + in_section % heads
    start_m = num_m - 1 - in_section // heads
    off_b = off_bh // H_Q
    off_h = off_bh % H_Q
    off_hkv = off_h // GQA_GROUP

    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)
    if MASK != 0:
        # the block's run of full tiles (see below), read before q so their loads overlap
        tiles = MaskTiles + off_b * stride_tb + off_h * stride_th + start_m * stride_tq
        run_start = tl.load(tiles) * BLOCK_N
        run_end = tl.load(tiles + 1) * BLOCK_N

    if USE_TMA:
        # 4-D descriptors built on the host (blocks [1, 1, rows, padded head dim]): a descriptor
        # made in the kernel costs every program global stores and proxy fences before its
        # first load (measured next to _TILE_SPACE)
        q = DescQ.load([off_b, off_h, start_m * BLOCK_M, 0]).reshape(BLOCK_M, BLOCK_DK)
        k_src = DescK
        v_src = DescV
    else:
        q_base = Q + off_b.to(tl.int64) * stride_qb + off_h.to(tl.int64) * stride_qh
        k_base = K + off_b.to(tl.int64) * stride_kb + off_hkv.to(tl.int64) * stride_kh
        v_base = V + off_b.to(tl.int64) * stride_vb + off_hkv.to(tl.int64) * stride_vh
        q = tl.load(q_base + offs_m[:, None] * stride_qm + offs_dk[None, :] * stride_qd,
                    mask=(offs_m[:, None] < N_Q) & (offs_dk[None, :] < DK), other=0.0)
        k_src = _kv_rows(k_base, offs_n, offs_dk, stride_kn, stride_kd, K_FMT)
        v_src = _kv_rows(v_base, offs_n, offs_dv, stride_vn, stride_vd, V_FMT)
    if UPCAST_DOTS:
        q = q.to(tl.float32)
    k_scales = _row_scales(KScales, off_b, off_hkv, offs_n, stride_ksb, stride_ksh, stride_ksn, K_FMT)
    v_scales = _row_scales(VScales, off_b, off_hkv, offs_n, stride_vsb, stride_vsh, stride_vsn, V_FMT)
    if K_FMT == "fp8_e4m3":  # one scale per tensor: folded into the scores' scales
        qk_scale = qk_scale * tl.load(KScales)
        softcap_scale = softcap_scale * tl.load(KScales)

    m_i, l_i = _initial_state(Sinks, off_h, BLOCK_M, SINKS)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

    # -- key range of this query block: [0, full_end) needs no mask, [full_end, hi) does
    causal_shift = N_KV - N_Q  # bottom-right alignment: row i sees keys j <= i + causal_shift
    if IS_CAUSAL:
        first_row_last_key = start_m * BLOCK_M + causal_shift  # every row of the block sees <= this
        hi = tl.minimum(N_KV, (start_m + 1) * BLOCK_M + causal_shift)
        full_end = (tl.maximum(first_row_last_key + 1, 0) // BLOCK_N) * BLOCK_N
    else:
        hi = N_KV
        full_end = (N_KV // BLOCK_N) * BLOCK_N

    # the last key each row sees: the causal limit, and the end of the keys
    if IS_CAUSAL:
        row_last = tl.minimum(offs_m + causal_shift, N_KV - 1)
    else:
        row_last = tl.full([BLOCK_M], N_KV - 1, dtype=tl.int32)

    # -- the variants' view of the block: a window narrows the key range to [lo, hi) with the
    # full tiles [full_start, full_end) inside it
    row_pos = offs_m + causal_shift
    row_first = row_last  # read only under WINDOW
    lo = 0
    full_start = 0
    if WINDOW:
        lo, hi, full_start, full_end = _window_tiles(start_m * BLOCK_M + causal_shift, hi, full_end,
                                                     window_left, window_right, BLOCK_M, BLOCK_N)
        row_first = row_pos - window_left
        row_last = tl.minimum(row_last, row_pos + window_right)
    alibi_log2 = 0.0
    if ALIBI:
        alibi_log2 = tl.load(Alibi + off_b * stride_ab + off_h * stride_ah) * LOG2E_K

    if MASK != 0:
        # what the mask, causal and the window leave to this block, listed for this config
        # (_list_mask_tiles): a run of tiles every row sees in full, attended as loop 1
        # (no mask read), then the other tiles some row sees, with the mask. A hidden tile is
        # never reached, and neither loop has a branch to keep it from being software-pipelined
        full_start = run_start
        full_end = run_end
    elif WINDOW:
        # loop 0: tiles crossed by the window's left edge
        acc, l_i, m_i = _attend_masked_tiles(
            acc, l_i, m_i, q, k_src, v_src, off_b, off_hkv, lo, full_start, offs_n, offs_dk,
            offs_dv, stride_kn, stride_vn, N_KV, row_first, row_last, row_pos, qk_scale,
            softcap_scale, softcap_log2, alibi_log2, None, None, None, DK, DV, BLOCK_DK,
            BLOCK_DV, BLOCK_N, DOT_PRECISION, UPCAST_DOTS, USE_TMA, SOFTMAX_OVERLAP, WINDOW,
            SOFTCAP, ALIBI, 0, False, None, k_scales, v_scales, stride_ksn, stride_vsn, K_FMT, V_FMT)
    # loop 1: tiles every row sees in full
    if SOFTMAX_OVERLAP:
        acc, l_i, m_i = _attend_full_tiles_overlapped(
            acc, l_i, m_i, q, k_src, v_src, off_b, off_hkv, full_start, full_end, offs_n, offs_dk,
            offs_dv, stride_kn, stride_vn, N_KV, qk_scale, DK, DV, BLOCK_DK, BLOCK_DV, BLOCK_M,
            BLOCK_N, DOT_PRECISION, UPCAST_DOTS, USE_TMA, row_pos, softcap_scale, softcap_log2,
            alibi_log2, SOFTCAP, ALIBI, k_scales, v_scales, stride_ksn, stride_vsn, K_FMT, V_FMT)
    else:
        for start_n in range(full_start, full_end, BLOCK_N):
            start_n = tl.multiple_of(start_n, BLOCK_N)
            acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, k_src, v_src, off_b, off_hkv, start_n,
                                         offs_n, offs_dk, offs_dv, stride_kn, stride_vn, N_KV,
                                         row_last, qk_scale, DK, DV, BLOCK_DK, BLOCK_DV, BLOCK_N,
                                         False, False, DOT_PRECISION, UPCAST_DOTS, USE_TMA, False,
                                         row_first, row_pos, softcap_scale, softcap_log2,
                                         alibi_log2, None, None, False, SOFTCAP, ALIBI, 0, k_scales,
                                         v_scales, stride_ksn, stride_vsn, K_FMT, V_FMT)
    if MASK != 0:
        # the listed tiles that need the mask (its row pointers made here: not live in loop 1).
        # Two stages: the mask tile's layout change takes shared memory beside the K/V stages,
        # and with three this loop needed more than loop 1 (one program per SM, not two)
        mask_rows = (Mask + off_b.to(tl.int64) * stride_mb + off_h.to(tl.int64) * stride_mh
                     + tl.minimum(offs_m, N_Q - 1).to(tl.int64)[:, None] * stride_mq)
        # the descriptor's (batch, head, row) of this block: 0 on a broadcast dim
        mask_at = (tl.where(stride_mb == 0, 0, off_b), tl.where(stride_mh == 0, 0, off_h), start_m * BLOCK_M)
        for i in tl.range(0, tl.load(tiles + 2), num_stages=2):
            start_n = tl.multiple_of(tl.load(tiles + LIST_HEADER + i) * BLOCK_N, BLOCK_N)
            acc, l_i, m_i = _attend_tile(
                acc, l_i, m_i, q, k_src, v_src, off_b, off_hkv, start_n, offs_n, offs_dk, offs_dv,
                stride_kn, stride_vn, N_KV, row_last, qk_scale, DK, DV, BLOCK_DK, BLOCK_DV, BLOCK_N,
                True, False, DOT_PRECISION, UPCAST_DOTS, USE_TMA, SOFTMAX_OVERLAP, row_first, row_pos,
                softcap_scale, softcap_log2, alibi_log2, mask_rows, stride_mk, WINDOW, SOFTCAP, ALIBI,
                MASK, k_scales, v_scales, stride_ksn, stride_vsn, K_FMT, V_FMT, MASK_TMA and USE_TMA,
                DescMask, mask_at)
    else:
        # loop 2: tiles crossed by the causal diagonal or the window's right edge, and the ragged
        # last tile
        acc, l_i, m_i = _attend_masked_tiles(
            acc, l_i, m_i, q, k_src, v_src, off_b, off_hkv, full_end, hi, offs_n, offs_dk, offs_dv,
            stride_kn, stride_vn, N_KV, row_first, row_last, row_pos, qk_scale, softcap_scale,
            softcap_log2, alibi_log2, None, None, None, DK, DV, BLOCK_DK, BLOCK_DV, BLOCK_N,
            DOT_PRECISION, UPCAST_DOTS, USE_TMA, SOFTMAX_OVERLAP, WINDOW, SOFTCAP, ALIBI, 0, False, None,
            k_scales, v_scales, stride_ksn, stride_vsn, K_FMT, V_FMT)
    redo = False
    if IS_CAUSAL or WINDOW or MASK != 0:
        # a masked tile multiplies a hidden key's V by P = 0, and 0 * inf is NaN: rather than
        # clean V on every such tile, a block whose acc comes out non-finite (rare) is redone
        total = tl.sum(tl.sum(acc, 1), 0)
        redo = total - total != 0.0
    if redo:
        _careful_block(Q, K, V, Out, Lse, Sinks, Alibi, Mask, MaskMap, off_b, off_h, off_hkv, start_m,
                       hi, causal_shift, N_Q, N_KV, qk_scale, window_left, window_right, softcap_scale,
                       softcap_log2, stride_qb, stride_qh, stride_qm, stride_qd, stride_kb, stride_kh,
                       stride_kn, stride_kd, stride_vb, stride_vh, stride_vn, stride_vd, stride_ob,
                       stride_oh, stride_om, stride_od, stride_lb, stride_lh, stride_lm, stride_ab,
                       stride_ah, stride_mb, stride_mh, stride_mq, stride_mk, stride_pb, stride_ph,
                       stride_pq, DK, DV, BLOCK_DK, BLOCK_DV, BLOCK_M, IS_CAUSAL, RETURN_LSE,
                       DOT_PRECISION, UPCAST_DOTS, WINDOW, SOFTCAP, SINKS, ALIBI, MASK, KScales, VScales,
                       stride_ksb, stride_ksh, stride_ksn, stride_vsb, stride_vsh, stride_vsn, K_FMT, V_FMT)
    else:
        acc = _tensor_v_scale(acc, VScales, V_FMT)
        _finish_rows(acc, l_i, m_i, Out, Lse, DescO, off_b, off_h, start_m * BLOCK_M, offs_m, offs_dv, N_Q,
                     stride_ob, stride_oh, stride_om, stride_od, stride_lb, stride_lh, stride_lm,
                     DV, BLOCK_DV, BLOCK_M, RETURN_LSE, USE_TMA)


@triton.jit
def _window_tiles(first_pos, hi, full_end, window_left, window_right,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(lo, hi, full_start, full_end) of a query block whose rows sit at positions first_pos ..
    first_pos + BLOCK_M - 1 under a window: its keys [lo, hi) start at the tile of the first row's
    left edge and stop at the last row's right edge; the tiles [full_start, full_end) are seen in
    full by every row (lo <= full_start <= full_end). hi, full_end: the causal / N_kv ones."""
    last_pos = first_pos + BLOCK_M - 1
    lo = (tl.maximum(first_pos - window_left, 0) // BLOCK_N) * BLOCK_N
    hi = tl.minimum(hi, tl.maximum(last_pos + window_right + 1, 0))
    full_end = tl.minimum(full_end, (tl.maximum(first_pos + window_right + 1, 0) // BLOCK_N) * BLOCK_N)
    full_end = tl.maximum(full_end, lo)
    full_start = tl.minimum(tl.cdiv(tl.maximum(last_pos - window_left, 0), BLOCK_N) * BLOCK_N, full_end)
    return lo, hi, full_start, full_end


@triton.jit
def _map_rows(MaskMap, off_b, off_h, start_m, stride_pb, stride_ph, stride_pq, BLOCK_M: tl.constexpr):
    """(BLOCK_M / MAP_GRAIN, 1) pointers to the block-map rows of query block start_m."""
    rows = start_m * (BLOCK_M // MAP_GRAIN) + tl.arange(0, BLOCK_M // MAP_GRAIN)
    return MaskMap + off_b * stride_pb + off_h * stride_ph + rows[:, None] * stride_pq


@triton.jit
def _attend_masked_tiles(acc, l_i, m_i, q, k_src, v_src, off_b, off_hkv, start, end, offs_n, offs_dk,
                         offs_dv, stride_kn, stride_vn, N_KV, row_first, row_last, row_pos, qk_scale,
                         softcap_scale, softcap_log2, alibi_log2, mask_rows, stride_mk, map_rows,
                         DK: tl.constexpr, DV: tl.constexpr, BLOCK_DK: tl.constexpr,
                         BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
                         UPCAST_DOTS: tl.constexpr, USE_TMA: tl.constexpr, EARLY_V: tl.constexpr,
                         WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
                         MASK: tl.constexpr, CLEAN_V: tl.constexpr = False,
                         NUM_STAGES: tl.constexpr = None,
                         k_scales=None, v_scales=None, stride_ksn=None, stride_vsn=None,
                         K_FMT: tl.constexpr = "", V_FMT: tl.constexpr = ""):
    """The masked tiles [start, end) (see _attend_tile); under a mask, the tiles whose block-map
    entries are all 0 are skipped, neither loaded nor computed. NUM_STAGES: the loop's software
    pipeline depth (None: the config's)."""
    for start_n in tl.range(start, end, BLOCK_N, num_stages=NUM_STAGES):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        if MASK != 0:
            if _tile_in_map(map_rows, start_n, BLOCK_N):
                acc, l_i, m_i = _attend_tile(
                    acc, l_i, m_i, q, k_src, v_src, off_b, off_hkv, start_n, offs_n, offs_dk, offs_dv,
                    stride_kn, stride_vn, N_KV, row_last, qk_scale, DK, DV, BLOCK_DK, BLOCK_DV,
                    BLOCK_N, True, CLEAN_V, DOT_PRECISION, UPCAST_DOTS, USE_TMA, EARLY_V, row_first,
                    row_pos, softcap_scale, softcap_log2, alibi_log2, mask_rows, stride_mk, WINDOW,
                    SOFTCAP, ALIBI, MASK, k_scales, v_scales, stride_ksn, stride_vsn, K_FMT, V_FMT)
        else:
            acc, l_i, m_i = _attend_tile(
                acc, l_i, m_i, q, k_src, v_src, off_b, off_hkv, start_n, offs_n, offs_dk, offs_dv,
                stride_kn, stride_vn, N_KV, row_last, qk_scale, DK, DV, BLOCK_DK, BLOCK_DV,
                BLOCK_N, True, CLEAN_V, DOT_PRECISION, UPCAST_DOTS, USE_TMA, EARLY_V, row_first,
                row_pos, softcap_scale, softcap_log2, alibi_log2, mask_rows, stride_mk, WINDOW,
                SOFTCAP, ALIBI, MASK, k_scales, v_scales, stride_ksn, stride_vsn, K_FMT, V_FMT)
    return acc, l_i, m_i


@triton.jit
def _finish_rows(acc, l_i, m_i, Out, Lse, DescO, off_b, off_h, row0, offs_m, offs_dv, N_Q,
                 stride_ob, stride_oh, stride_om, stride_od, stride_lb, stride_lh, stride_lm,
                 DV: tl.constexpr, BLOCK_DV: tl.constexpr, ROWS: tl.constexpr, RETURN_LSE: tl.constexpr,
                 USE_TMA: tl.constexpr):
    """Normalize and store the rows offs_m (row0, row0 + 1, ..) of a finished state."""
    # a row that saw no key has l = 0, acc = 0: it stores 0 and lse = -inf (a NaN l, from NaN/inf
    # in q or a seen K, is not 0: NaN out and lse)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc * (1.0 / l_safe)[:, None]
    if USE_TMA:  # the copy engine clips rows past N_q and padded head dims
        DescO.store([off_b, off_h, row0, 0], out.to(Out.dtype.element_ty).reshape(1, 1, ROWS, BLOCK_DV))
    else:
        o_base = Out + off_b.to(tl.int64) * stride_ob + off_h.to(tl.int64) * stride_oh
        tl.store(o_base + offs_m[:, None] * stride_om + offs_dv[None, :] * stride_od,
                 out.to(Out.dtype.element_ty),
                 mask=(offs_m[:, None] < N_Q) & (offs_dv[None, :] < DV))
    if RETURN_LSE:
        # log2 units -> natural log; -inf (not log2(0)) where no key was seen
        lse = tl.where(l_i == 0.0, float("-inf"), (m_i + tl.math.log2(l_safe)) * 0.6931471805599453)
        l_base = Lse + off_b.to(tl.int64) * stride_lb + off_h.to(tl.int64) * stride_lh
        tl.store(l_base + offs_m * stride_lm, lse, mask=offs_m < N_Q)


@triton.jit
def _careful_block(Q, K, V, Out, Lse, Sinks, Alibi, Mask, MaskMap, off_b, off_h, off_hkv, start_m, hi,
                   causal_shift, N_Q, N_KV, qk_scale, window_left, window_right, softcap_scale,
                   softcap_log2, stride_qb, stride_qh, stride_qm, stride_qd, stride_kb, stride_kh,
                   stride_kn, stride_kd, stride_vb, stride_vh, stride_vn, stride_vd, stride_ob,
                   stride_oh, stride_om, stride_od, stride_lb, stride_lh, stride_lm, stride_ab,
                   stride_ah, stride_mb, stride_mh, stride_mq, stride_mk, stride_pb, stride_ph,
                   stride_pq, DK: tl.constexpr, DV: tl.constexpr, BLOCK_DK: tl.constexpr,
                   BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, IS_CAUSAL: tl.constexpr,
                   RETURN_LSE: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST_DOTS: tl.constexpr,
                   WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, SINKS: tl.constexpr,
                   ALIBI: tl.constexpr, MASK: tl.constexpr, KScales, VScales, stride_ksb, stride_ksh,
                   stride_ksn, stride_vsb, stride_vsh, stride_vsn, K_FMT: tl.constexpr,
                   V_FMT: tl.constexpr):
    """A query block (causal, windowed or masked) redone and stored with V cleaned on every tile
    (_hide_nonfinite_v): 16 rows by 16 keys at a time with pointer loads, unpipelined, so that
    this rare path needs fewer registers and less shared memory than the fast one and leaves the
    kernel's as they are. qk_scale and softcap_scale hold fp8 K's scale already."""
    SUB: tl.constexpr = 16
    offs_s = tl.arange(0, SUB)
    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)
    q_base = Q + off_b.to(tl.int64) * stride_qb + off_h.to(tl.int64) * stride_qh
    k_src = _kv_rows(K + off_b.to(tl.int64) * stride_kb + off_hkv.to(tl.int64) * stride_kh, offs_s, offs_dk,
                     stride_kn, stride_kd, K_FMT)
    v_src = _kv_rows(V + off_b.to(tl.int64) * stride_vb + off_hkv.to(tl.int64) * stride_vh, offs_s, offs_dv,
                     stride_vn, stride_vd, V_FMT)
    k_scales = _row_scales(KScales, off_b, off_hkv, offs_s, stride_ksb, stride_ksh, stride_ksn, K_FMT)
    v_scales = _row_scales(VScales, off_b, off_hkv, offs_s, stride_vsb, stride_vsh, stride_vsn, V_FMT)
    alibi_log2 = 0.0
    if ALIBI:
        alibi_log2 = tl.load(Alibi + off_b * stride_ab + off_h * stride_ah) * LOG2E_K
    for row0 in tl.range(start_m * BLOCK_M, (start_m + 1) * BLOCK_M, SUB, num_stages=1):
        offs_m = row0 + offs_s
        q = tl.load(q_base + offs_m[:, None] * stride_qm + offs_dk[None, :] * stride_qd,
                    mask=(offs_m[:, None] < N_Q) & (offs_dk[None, :] < DK), other=0.0)
        if UPCAST_DOTS:
            q = q.to(tl.float32)
        m_i, l_i = _initial_state(Sinks, off_h, SUB, SINKS)
        acc = tl.zeros([SUB, BLOCK_DV], dtype=tl.float32)
        row_pos = offs_m + causal_shift
        sub_lo = 0
        sub_hi = hi
        if IS_CAUSAL:
            row_last = tl.minimum(row_pos, N_KV - 1)
            sub_hi = tl.minimum(hi, row0 + SUB + causal_shift)
        else:
            row_last = tl.full([SUB], N_KV - 1, dtype=tl.int32)
        row_first = row_last
        if WINDOW:
            sub_lo, sub_hi, _, _ = _window_tiles(row0 + causal_shift, sub_hi, sub_hi, window_left,
                                                 window_right, SUB, SUB)
            row_first = row_pos - window_left
            row_last = tl.minimum(row_last, row_pos + window_right)
        mask_rows = Mask
        map_rows = MaskMap
        if MASK != 0:
            mask_rows = (Mask + off_b.to(tl.int64) * stride_mb + off_h.to(tl.int64) * stride_mh
                         + tl.minimum(offs_m, N_Q - 1).to(tl.int64)[:, None] * stride_mq)
            map_rows = _map_rows(MaskMap, off_b, off_h, row0 // SUB, stride_pb, stride_ph, stride_pq, SUB)
        acc, l_i, m_i = _attend_masked_tiles(
            acc, l_i, m_i, q, k_src, v_src, off_b, off_hkv, sub_lo, sub_hi, offs_s, offs_dk, offs_dv,
            stride_kn, stride_vn, N_KV, row_first, row_last, row_pos, qk_scale, softcap_scale,
            softcap_log2, alibi_log2, mask_rows, stride_mk, map_rows, DK, DV, BLOCK_DK, BLOCK_DV,
            SUB, DOT_PRECISION, UPCAST_DOTS, False, False, WINDOW, SOFTCAP, ALIBI, MASK, True, 1,
            k_scales, v_scales, stride_ksn, stride_vsn, K_FMT, V_FMT)
        acc = _tensor_v_scale(acc, VScales, V_FMT)
        _finish_rows(acc, l_i, m_i, Out, Lse, None, off_b, off_h, row0, offs_m, offs_dv, N_Q,
                     stride_ob, stride_oh, stride_om, stride_od, stride_lb, stride_lh, stride_lm,
                     DV, BLOCK_DV, SUB, RETURN_LSE, False)


# --------------------------------------------------------------------------- tuning space

# (BLOCK_M, BLOCK_N, num_warps, num_stages, USE_TMA, maxnreg). BLOCK_M 128 x BLOCK_N 64/128 with
# 8 warps and 2-3 stages is FlashAttention-2's shape (cp.async pointer loads, sm_80+). On sm_90+
# a TMA 64 x 64 tile with host-built descriptors replaces the pointer tiles where it fits
# (_tile_fits): it led them on every shape timed. What each candidate measured, and the variants
# that lost: docs/notes/triton-prefill.md.
_TILE_SPACE = [
    (128, 128, 8, 3, False, None, False),
    (128, 128, 8, 2, False, None, False),
    (128, 64, 8, 3, False, None, False),
    (128, 64, 8, 2, False, None, False),
    (64, 64, 4, 3, False, None, False),
    (64, 64, 4, 3, True, None, False),
    (64, 64, 4, 3, True, None, True),
    (128, 32, 8, 2, False, None, False),
    (64, 32, 4, 2, False, None, False),
    (64, 32, 8, 2, False, None, False),
    (32, 32, 8, 2, False, None, False),
    (32, 16, 8, 2, False, None, False),
]
_PARAM_KEYS = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "USE_TMA", "maxnreg", "SOFTMAX_OVERLAP")


def _set_descriptor_blocks(nargs) -> None:
    """Config pre-hook: the host-built descriptors' blocks follow the config's tile rows
    ([1, 1, BLOCK_M or BLOCK_N, padded head dim]); no-op where no descriptors were passed."""
    if nargs["DescQ"] is None:
        return
    bm, bn, bdk, bdv = nargs["BLOCK_M"], nargs["BLOCK_N"], nargs["BLOCK_DK"], nargs["BLOCK_DV"]
    nargs["DescQ"].block_shape = [1, 1, bm, bdk]
    nargs["DescK"].block_shape = [1, 1, bn, bdk]
    nargs["DescV"].block_shape = [1, 1, bn, bdv]
    nargs["DescO"].block_shape = [1, 1, bm, bdv]
    if nargs["DescMask"] is not None:
        nargs["DescMask"].block_shape = [1, 1, bm, bn]


def _list_mask_tiles(nargs) -> None:
    """Config pre-hook (MASK): the tile lists of this config's BLOCK_M and BLOCK_N in MaskTiles
    (flashcl.triton.mask_tiles). No-op without a mask."""
    if nargs["MaskTiles"] is None:
        return
    mask_tiles.list_tiles(nargs["MaskMap"], nargs["MaskTiles"], block_m=nargs["BLOCK_M"],
                          block_n=nargs["BLOCK_N"], n_q=nargs["N_Q"], n_kv=nargs["N_KV"],
                          causal=nargs["IS_CAUSAL"], window=nargs["WINDOW"],
                          window_left=nargs["window_left"], window_right=nargs["window_right"])


def _config_pre_hook(nargs) -> None:
    """Config pre-hook: what depends on the config's tiles (descriptor blocks, mask tile lists)."""
    _set_descriptor_blocks(nargs)
    _list_mask_tiles(nargs)


_CONFIGS = [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "USE_TMA": tma, "SOFTMAX_OVERLAP": overlap},
                          num_warps=w, num_stages=s, maxnreg=mr, pre_hook=_config_pre_hook)
            for bm, bn, w, s, tma, mr, overlap in _TILE_SPACE]
# The interpreter (TRITON_INTERPRET=1, CPU CI) runs one small config: nothing to time there.
_INTERPRETER_PARAMS = {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 1, "num_stages": 1, "USE_TMA": False,
                       "maxnreg": None, "SOFTMAX_OVERLAP": False}

# fp32 registers per thread for the accumulator plus the score tile, (BLOCK_M x (BLOCK_DV +
# BLOCK_N)) / (32 x num_warps), above which ptxas spilled (sm_90, 16-bit inputs: 144 fits,
# 160 spilled at 4 warps, 192 spilled at 4 warps)
_MAX_TILE_REGS = 144


def _shared_mem_limit(device_index: int) -> int:
    props = triton.runtime.driver.active.utils.get_device_properties(device_index)
    return int(props["max_shared_mem"])


def _overlap_pays(*, elt: int, dk: int, dv: int, q_bucket: int, kv_bucket: int, tma_ok: bool) -> bool:
    """Whether the TMA 64 x 64 tile runs its softmax under the tensor cores (SOFTMAX_OVERLAP):
    measured (next to _TILE_SPACE) for 16-bit inputs 3-7% ahead with head dims exactly 128 and
    N_q, N_kv > 2048 (buckets from 4096), 1-3% behind below (its first trip multiplies P = 0,
    about half a tile more work per program); with head dims exactly 64, even or ahead (up to
    5%) from N = 1024 on; 2-4% behind for head dims 80 and 96 at every length timed."""
    min_bucket = 1024 if dk == 64 else 4096
    return (tma_ok and elt == 2 and dk == dv and dk in (64, 128)
            and q_bucket >= min_bucket and kv_bucket >= min_bucket)


def _tile_fits(bm: int, bn: int, num_warps: int, num_stages: int, use_tma: bool, maxnreg,
               overlap: bool, *, elt: int, dk: int, dv: int, bdk: int, bdv: int, q_bucket: int,
               kv_bucket: int, smem: int, wgmma: bool, tma_ok: bool) -> bool:
    """Whether a tile config can work well; each rule carries its reason.

    - BLOCK_M beyond the query length (bucket) only computes padding rows.
    - TMA needs sm_90+ and 16-byte aligned bases and strides (``tma_ok``, checked per call);
      where it is available the TMA 64 x 64 tile replaces the pointer one, and the pointer-based
      128-row tiles are left out but for 128 x 64 x 3 stages, the portable baseline (fewer configs
      to compile and time); for 16-bit inputs with head dims 33..128 and queries from 1024 on,
      that one too (measured: next to _TILE_SPACE).
    - The TMA 64 x 64 tile comes in two variants, with and without SOFTMAX_OVERLAP; where
      _overlap_pays the overlapped one is the only one timed, elsewhere the plain one.
    - float32 (tf32x3 dots, FLOAT32_DOTS) takes tiles of 32 rows too (at head dim 256 nothing
      larger fits), any BLOCK_N, and 3/4 of the shared memory for the K/V ring and Q: the rest
      goes to the dots' operand splits (H200: 160 KiB by the formula below ran, 192 KiB did not).
    - The accumulator and score tile must fit _MAX_TILE_REGS. 16-bit: wgmma (sm_90) works on
      64-row slices per warpgroup, so BLOCK_M >= 64; BLOCK_N 32 only pays where K/V tiles are
      large (DK + DV >= 512).
    - The K/V pipeline, num_stages x BLOCK_N x (DK + DV), plus on sm_90 the Q tile that wgmma
      reads from shared memory, must fit (sm_89 ~100 KB, A100 ~164 KB, H100 ~227 KB).
    """
    if bm > max(64, q_bucket):
        return False
    if use_tma and not tma_ok:
        return False
    pays = _overlap_pays(elt=elt, dk=dk, dv=dv, q_bucket=q_bucket, kv_bucket=kv_bucket, tma_ok=tma_ok)
    if overlap != (use_tma and pays):
        return False
    if tma_ok and not use_tma and bm == 128 and bn >= 64 and (bn, num_stages) != (64, 3):
        return False
    if tma_ok and not use_tma and (bm, bn) == (64, 64):
        return False  # its TMA twin was faster on every shape timed (next to _TILE_SPACE)
    if tma_ok and not use_tma and bm == 128 and elt == 2 and bdk in (64, 128) and q_bucket >= 1024:
        return False  # the baseline too: TMA led it on every such shape, the autotuner did not see it
    if bm * (bdv + bn) // (32 * num_warps) > _MAX_TILE_REGS:
        return False
    if elt == 4:
        smem = smem * 3 // 4
    elif bm < 64 or (bn < 64 and bdk + bdv < 512):
        return False
    q_tile = bm * bdk * elt if wgmma else 0
    return num_stages * bn * (bdk + bdv) * elt + q_tile <= smem


def _device_facts(device) -> dict:
    index = device.index if device.index is not None else torch.cuda.current_device()
    major = torch.cuda.get_device_capability(index)[0]
    return dict(smem=_shared_mem_limit(index), wgmma=major == 9)


def _mask_by_tma(tma_ok: bool, var: "_VariantArgs") -> bool:
    """MASK_TMA: a call whose tiles may move by TMA (``tma_ok``) reads its mask's tiles so too,
    where the mask's strides allow a descriptor."""
    mask_data = var.tensors[2]
    return tma_ok and mask_data is not None and _tma_ok(mask_data)


def _tma_ok(*tensors) -> bool:
    """Tensor descriptors need sm_90+, non-empty tensors, unit last strides, 16-byte aligned
    bases and strides."""
    t0 = tensors[0]
    if interpreting() or t0.device.type != "cuda" or torch.cuda.get_device_capability(t0.device)[0] < 9:
        return False
    for t in tensors:
        elt = t.element_size()
        if t.numel() == 0:  # a descriptor needs every dimension >= 1
            return False
        if t.stride(-1) != 1 or t.data_ptr() % 16 or any((s * elt) % 16 for s in t.stride()[:-1]):
            return False
    return True


def _smallest(tiles):
    return min(tiles, key=lambda t: (t[0] * t[1], t[3]))


def _prune_configs(configs, named_args, **kwargs):
    """Autotune filter: the configs that pass _tile_fits for this call (at least one survives)."""
    args = {**named_args, **kwargs}  # positional arguments by name, constexprs as keywords
    q = args["Q"]
    facts = dict(elt=q.element_size(), dk=args["DK"], dv=args["DV"], bdk=args["BLOCK_DK"],
                 bdv=args["BLOCK_DV"], q_bucket=args["Q_BUCKET"], kv_bucket=args["KV_BUCKET"],
                 tma_ok=bool(args["TMA_OK"]), **_device_facts(q.device))
    tiles = {c: (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages,
                 c.kwargs["USE_TMA"], c.maxnreg, c.kwargs["SOFTMAX_OVERLAP"]) for c in configs}
    kept = [c for c in configs if _tile_fits(*tiles[c], **facts)]
    if not kept:  # the smallest pointer-based tile is the one most likely to fit
        small = _smallest([t for t in tiles.values() if not t[4]])
        kept = [c for c in configs if tiles[c] == small]
    return kept


def candidate_params(dtype, dk: int, dv: int, n_q: int, device=None, tma_ok: bool | None = None,
                     n_kv: int | None = None) -> list[dict]:
    """The tile configs the autotuner would time for such a call, as ``params`` dicts.

    ``tma_ok`` defaults to whether the device has TMA (aligned contiguous inputs), ``n_kv`` to
    ``n_q``. Under the interpreter this is the single interpreter config.
    """
    if interpreting():
        return [dict(_INTERPRETER_PARAMS)]
    device = torch.device(device if device is not None else "cuda")
    if tma_ok is None:
        tma_ok = torch.cuda.get_device_capability(device)[0] >= 9
    elt = torch.empty((), dtype=dtype).element_size()
    facts = dict(elt=elt, dk=dk, dv=dv, bdk=_padded_head_dim(dk), bdv=_padded_head_dim(dv),
                 q_bucket=_seq_bucket(n_q), kv_bucket=_seq_bucket(n_q if n_kv is None else n_kv),
                 tma_ok=tma_ok, **_device_facts(device))
    kept = [t for t in _TILE_SPACE if _tile_fits(*t, **facts)]
    if not kept:
        kept = [_smallest([t for t in _TILE_SPACE if not t[4]])]
    return [dict(zip(_PARAM_KEYS, t)) for t in kept]


_prefill_autotuned = triton.autotune(
    configs=_CONFIGS,
    # The tensors' dtypes are appended to the key by Triton itself.
    key=["Q_BUCKET", "KV_BUCKET", "BH_BUCKET", "DK", "DV", "IS_CAUSAL", "TMA_OK",
         "WINDOW", "SOFTCAP", "SINKS", "ALIBI", "MASK", "K_FMT", "V_FMT", "MASK_TMA"],
    prune_configs_by={"early_config_prune": _prune_configs},
)(_prefill_kernel)


def _seq_bucket(n: int) -> int:
    """Autotune bucket of a sequence length: the next power of two, clamped to [64, 16384]."""
    return min(16384, max(64, triton.next_power_of_2(n)))


def _bh_bucket(bh: int) -> int:
    """Autotune bucket of B * H_q: the next power of two, clamped to [16, 256]."""
    return min(256, max(16, triton.next_power_of_2(bh)))


def _padded_head_dim(d: int) -> int:
    return max(16, triton.next_power_of_2(d))


def best_config(q_len: int, kv_len: int, dk: int, dv: int, causal: bool, dtype, batch_heads: int,
                tma_ok: bool = True, variants=None, kv_formats: tuple = ("", "")) -> dict | None:
    """The config the autotuner picked for this key (None if that key was not tuned yet);
    ``batch_heads`` is B * H_q, ``variants`` the call's flashcl.variants.Variants,
    ``kv_formats`` the flashcl.quant formats of K and V ("" plain)."""
    var = _VariantArgs.of(variants, dtype)
    flags = var.flags
    k_fmt, v_fmt = kv_formats
    tma_ok = tma_ok and not (k_fmt or v_fmt)
    # a mask read by TMA tunes its own entry: its tiles load and lay out differently (MASK_TMA)
    mask_tma = _mask_by_tma(tma_ok, var)
    # Triton appends the dtype of every tensor argument: q, k, v, out, lse, then the variants',
    # then the scales of int8 / fp8 K and V
    variant_dtypes = ((torch.float32,) * (flags["SINKS"] + flags["ALIBI"])
                      + {0: (), 1: (torch.uint8, torch.uint8, torch.int32),
                         2: (torch.float32, torch.uint8, torch.int32)}[flags["MASK"]])
    scale_dtypes = tuple(torch.float32 for f in kv_formats if f in ("int8", "fp8_e4m3"))
    k_dtype, v_dtype = (_DATA_DTYPES.get(f, dtype) for f in kv_formats)
    key = ((_seq_bucket(q_len), _seq_bucket(kv_len), _bh_bucket(batch_heads), dk, dv, causal, int(tma_ok),
            *flags.values(), k_fmt, v_fmt, mask_tma) + tuple(map(str, (dtype, k_dtype, v_dtype, dtype, torch.float32)))
           + tuple(map(str, variant_dtypes + scale_dtypes)))
    cfg = _prefill_autotuned.cache.get(key)
    if cfg is None:
        return None
    return {**cfg.kwargs, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages, "maxnreg": cfg.maxnreg}


# --------------------------------------------------------------------------- launcher

def _descriptors(q, k, v, out, bdk: int, bdv: int):
    """TMA descriptors of the four (B, H, N, D) tensors, any 16-byte aligned strides: the copy
    engine reads rows past N and head dims past D as 0 and clips stores there. Their blocks are
    set per config (_set_descriptor_blocks); these placeholders are the 64-row ones."""
    return tuple(TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, 64, bd])
                 for t, bd in ((q, bdk), (k, bdk), (v, bdv), (out, bdv)))


_L2_SHARE = 0.64  # of L2 for one section's K/V: FlashAttention-3 assumes 32 MB of the H100's 50 MB
_l2_cache: dict = {}


def _l2_bytes(device) -> int:
    if device.type != "cuda":
        return 50 * 2**20  # the interpreter: any value works
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _l2_cache:
        props = torch.cuda.get_device_properties(index)
        _l2_cache[index] = int(getattr(props, "L2_cache_size", 0)) or 40 * 2**20
    return _l2_cache[index]


def head_group(device, batch_heads: int, gqa_group: int, n_kv: int, dk: int, dv: int, elt: int) -> int:
    """Launch order: how many (batch, query head) pairs one section of the grid covers.

    The largest power of two of KV heads whose K/V, counted twice (FlashAttention-3's margin for
    the other data in L2), fit in _L2_SHARE of L2, times the query heads per KV head (those share
    their K/V anyway); at least 1, at most ``batch_heads``."""
    kv_head = 2 * max(n_kv, 1) * (dk + dv) * elt
    fit = max(1, int(_L2_SHARE * _l2_bytes(device)) // kv_head)
    return max(1, min(batch_heads, (1 << (fit.bit_length() - 1)) * gqa_group))


class _VariantArgs:
    """The kernel's variant arguments of one call: the tensors (Sinks, Alibi, Mask, MaskMap; None
    where off), their strides, the window and softcap scalars and the compile-time flags."""

    def __init__(self, window, softcap, sinks, alibi_slopes, mask, scale: float, block_map: bool,
                 fast_tanh: bool):
        left, right = window_bounds(window)
        softcap_mode = 0 if softcap is None else (SOFTCAP_FAST.value if fast_tanh else SOFTCAP_EXACT.value)
        self.flags = dict(WINDOW=window is not None, SOFTCAP=softcap_mode,
                          SINKS=sinks is not None, ALIBI=alibi_slopes is not None,
                          MASK=0 if mask is None else (1 if mask.dtype == torch.bool else 2))
        data, mask_map, tiles = None, None, None
        mask_strides, map_strides, tile_strides = (0, 0, 0, 0), (0, 0, 0), (0, 0, 0)
        if mask is not None:
            # bool data read as bytes; a broadcast dim (size 1) gets stride 0
            data = mask.view(torch.uint8) if mask.dtype == torch.bool else mask
            mask_strides = tuple(0 if mask.shape[i] == 1 else mask.stride(i) for i in range(4))
        if mask is not None and block_map:
            mask_map = mask_tiles.block_map(mask)
            tiles = mask_tiles.tile_lists(mask_map)  # filled per config (_list_mask_tiles)
            map_strides, tile_strides = (tuple(0 if mask.shape[i] == 1 else t.stride(i) for i in range(3))
                                         for t in (mask_map, tiles))
        self.tensors = (sinks, alibi_slopes, data, mask_map, tiles)
        alibi_strides = tuple(alibi_slopes.stride()) if alibi_slopes is not None else (0, 0)
        self.strides = (*alibi_strides, *mask_strides, *map_strides, *tile_strides)
        cap = softcap or 1.0
        self.scalars = (left, right, scale / cap, cap * LOG2E)

    @classmethod
    def of(cls, variants, dtype, scale: float = 1.0, block_map: bool = False) -> "_VariantArgs":
        """``dtype``: the inputs'; 16-bit ones on a GPU take the fast tanh (_tanh)."""
        if variants is None:
            return cls(None, None, None, None, None, scale, False, False)
        fast = dtype != torch.float32 and not interpreting()
        return cls(variants.window, variants.softcap, variants.sinks, variants.alibi_slopes,
                   variants.mask, scale, block_map, fast)


def _launch(q, k, v, causal: bool, scale: float, return_lse: bool, params: dict | None,
            head_group_override: int | None = None, variants=None, k_format: str = "",
            v_format: str = "", k_scales=None, v_scales=None):
    """Run the kernel; ``params`` forces a config, and
    ``head_group_override`` replaces head_group()'s launch order (benchmarks compare them).
    ``variants``: a flashcl.variants.Variants of torch tensors on q's device, or None.
    ``k_format``/``v_format``: "" or the flashcl.quant format of k/v, then a QuantizedTensor's
    data, with its scales in ``k_scales``/``v_scales`` (int8, fp8_e4m3)."""
    b, h_q, n_q, dk = q.shape
    h_kv, n_kv, dv = k.shape[1], k.shape[2], _head_dim(v, v_format)
    if scale < 0:  # keep the kernel's scale >= 0 (see _attend_tile); negation is exact
        q, scale = -q, -scale
    var = _VariantArgs.of(variants, q.dtype, scale, block_map=True)
    k_strides, k_scales, k_scale_strides = _kv_operand(k, k_format, k_scales)
    v_strides, v_scales, v_scale_strides = _kv_operand(v, v_format, v_scales)
    out = torch.empty((b, h_q, n_q, dv), dtype=q.dtype, device=q.device)
    lse = torch.empty((b, h_q, n_q) if return_lse else (1, 1, 1), dtype=torch.float32, device=q.device)
    # quantized tiles are dequantized from pointer loads: no tensor descriptors for them
    tma_ok = not (k_format or v_format) and _tma_ok(q, k, v, out)
    bdk, bdv = _padded_head_dim(dk), _padded_head_dim(dv)
    if v_format:
        # a dequantized V tile of 32-column (64-byte) rows: with a mask, Triton 3.6's sm_90 P @ V
        # read past its shared-memory operand (compute-sanitizer); 64 columns read right
        bdv = max(bdv, 64)
    descs = _descriptors(q, k, v, out, bdk, bdv) if tma_ok else (None,) * 4
    mask_data = var.tensors[2]
    mask_tma = _mask_by_tma(tma_ok, var)
    # placeholder block, set per config (_set_descriptor_blocks)
    descs += (TensorDescriptor(mask_data, list(mask_data.shape), list(mask_data.stride()), [1, 1, 64, 64])
              if mask_tma else None,)
    group = head_group_override or head_group(q.device, b * h_q, h_q // h_kv, n_kv, dk, dv,
                                              q.element_size())
    args = (
        q, k, v, out, lse, *descs, *var.tensors, k_scales, v_scales,
        *q.stride(), *k_strides, *v_strides, *out.stride(), *lse.stride(), *var.strides,
        *k_scale_strides, *v_scale_strides,
        scale * LOG2E, *var.scalars, h_q, h_q // h_kv, n_q, n_kv, _seq_bucket(n_q), _seq_bucket(n_kv),
        _bh_bucket(b * h_q), int(tma_ok), max(1, min(int(group), b * h_q)),
    )
    # bfloat16 products are exact in float32, so the interpreter's upcast changes no result bit
    # beyond summation order; on GPUs 16-bit dots run on tensor cores with float32 accumulation.
    upcast = interpreting() and q.dtype == torch.bfloat16
    meta = dict(DK=dk, DV=dv, BLOCK_DK=bdk, BLOCK_DV=bdv,
                IS_CAUSAL=causal, RETURN_LSE=return_lse, UPCAST_DOTS=upcast, **var.flags,
                K_FMT=k_format, V_FMT=v_format, MASK_TMA=mask_tma,
                DOT_PRECISION=FLOAT32_DOTS if q.dtype == torch.float32 else "ieee" if upcast else "tf32")

    def grid(META):  # 1-D: the kernel maps program ids to (query block, batch * head) itself
        return (triton.cdiv(n_q, META["BLOCK_M"]) * b * h_q,)

    if params is None and interpreting():
        params = _INTERPRETER_PARAMS
    if params is not None:  # the optional keys (see _tile_params) default to off
        params = {"USE_TMA": False, "maxnreg": None, "SOFTMAX_OVERLAP": False, **params}
    if params is not None and params.get("USE_TMA") and not tma_ok:
        raise ValueError("params['USE_TMA']: tensor descriptors need an sm_90+ GPU, plain (not "
                         "quantized) K/V and inputs with unit last strides and 16-byte aligned bases "
                         "and strides")
    try:
        if params is None:
            _prefill_autotuned[grid](*args, **meta)
        else:
            _config_pre_hook({**dict(zip(_prefill_kernel.arg_names, args)), **meta, **params})
            _prefill_kernel[grid](*args, **meta, **params)
    except triton.runtime.errors.OutOfResources as e:
        raise KernelLaunchError("_prefill_kernel", {**meta, **(params or {"autotuned": True})},
                                _device_name(q.device), str(e)) from e
    return out, lse


# the dtype of a QuantizedTensor's data per format (flashcl.quant)
_DATA_DTYPES = {"q8_0": torch.uint8, "q4_0": torch.uint8, "int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}


def _head_dim(x: torch.Tensor, fmt: str) -> int:
    """The head dim of K or V given as a tensor, or as a QuantizedTensor's data in ``fmt``."""
    return x.shape[3] * QK if fmt in BLOCK_BYTES else x.shape[3]


def _kv_operand(data: torch.Tensor, fmt: str, scales):
    """How the kernel reads K or V (``data`` of format ``fmt``, "" plain): its (b, h, n, d)
    strides in elements (ggml: bytes, d unused), the scales it reads (int8, fp8_e4m3; else None)
    and int8's (b, h, n) scale strides (else None: the kernel compiles them out)."""
    if fmt in BLOCK_BYTES:
        return (*data.stride()[:3], 1), None, (None,) * 3
    if fmt == "int8":
        return tuple(data.stride()), scales, tuple(scales.stride()[:3])
    return tuple(data.stride()), (scales if fmt == "fp8_e4m3" else None), (None,) * 3


def _device_name(device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{device} (Triton interpreter)"


# --------------------------------------------------------------------------- torch op

_SCHEMA = ("(Tensor q, Tensor k, Tensor v, bool causal, float scale, bool return_lse, "
           "int block_m=0, int block_n=0, int num_warps=0, int num_stages=0, bool use_tma=False, "
           "int maxnreg=0, bool softmax_overlap=False, int[]? window=None, float? softcap=None, "
           "Tensor? sinks=None, Tensor? alibi_slopes=None, Tensor? mask=None, Tensor? k_scales=None, "
           "Tensor? v_scales=None, str k_format=\"\", str v_format=\"\") -> (Tensor, Tensor)")


def _prefill_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                  return_lse: bool, block_m: int = 0, block_n: int = 0, num_warps: int = 0,
                  num_stages: int = 0, use_tma: bool = False, maxnreg: int = 0,
                  softmax_overlap: bool = False, window=None, softcap=None, sinks=None,
                  alibi_slopes=None, mask=None, k_scales=None, v_scales=None, k_format: str = "",
                  v_format: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    """``flashcl::prefill(Tensor q, Tensor k, Tensor v, bool causal, float scale, bool return_lse,
    int block_m=0, int block_n=0, int num_warps=0, int num_stages=0, bool use_tma=False,
    int maxnreg=0, bool softmax_overlap=False, int[]? window=None, float? softcap=None,
    Tensor? sinks=None, Tensor? alibi_slopes=None, Tensor? mask=None, Tensor? k_scales=None,
    Tensor? v_scales=None, str k_format="", str v_format="") -> (Tensor out, Tensor lse)``

    Stable schema. q (B, H_q, N_q, DK), k (B, H_kv, N_kv, DK), v (B, H_kv, N_kv, DV): 4-D, any
    strides, one dtype of float32/float16/bfloat16. ``scale`` is the softmax scale (no default
    here). Returns out (B, H_q, N_q, DV) contiguous in the input dtype, and lse (B, H_q, N_q)
    float32 when ``return_lse``, else an empty float32 tensor of shape (0,). block_m, block_n,
    num_warps, num_stages all 0: autotuned; all > 0: that tile config, with tiles moved by tensor
    descriptors when ``use_tma`` (sm_90+, aligned inputs), registers capped at ``maxnreg``
    per thread when > 0, and each softmax of the unmasked tiles run under a tensor-core dot
    when ``softmax_overlap`` (same results up to rounding; see _attend_full_tiles_overlapped).
    The variants (flashcl.variants, normalized as flashcl.prefill hands them on): ``window``
    [left, right] (-1 unbounded), ``softcap``, ``sinks`` float32 (H_q,), ``alibi_slopes`` float32
    (B, H_q), ``mask`` (Bm, Hm, N_q, N_kv) contiguous, bool or float32 additive, Bm in {1, B},
    Hm in {1, H_q}; all None: the plain kernel. Quantized caches (flashcl.quant): k / v are a
    contiguous QuantizedTensor's ``data``, ``k_format`` / ``v_format`` its format ("" plain),
    ``k_scales`` / ``v_scales`` its ``scales`` (int8, fp8_e4m3; q8_0 and q4_0 read d from the
    data). The arguments after q .. return_lse have defaults, so calls written before them keep
    working.
    """
    tiles = (block_m, block_n, num_warps, num_stages)
    params = (dict(zip(_PARAM_KEYS, (*tiles, use_tma, maxnreg or None, softmax_overlap)))
              if all(t > 0 for t in tiles) else None)
    variants = None
    if any(x is not None for x in (window, softcap, sinks, alibi_slopes, mask)):
        variants = Variants(None if window is None else tuple(window), softcap, sinks, alibi_slopes, mask)
    with on_device_of(q):
        if params is None and _runs_as_decode(q, k, causal, variants):
            out, lse = _rows_as_decode(q, k, v, causal, scale, variants, k_format=k_format, v_format=v_format,
                                       k_scales=k_scales, v_scales=v_scales)
        else:
            out, lse = _launch(q, k, v, causal, scale, return_lse, params, variants=variants, k_format=k_format,
                               v_format=v_format, k_scales=k_scales, v_scales=v_scales)
    return out, (lse if return_lse else lse.new_empty((0,)))


def _runs_as_decode(q, k, causal: bool, variants) -> bool:
    """Whether a prefill of few query rows runs as the decode of the same keys (_rows_as_decode):
    the prefill kernel's programs each take one query head's rows over all of N_kv (32 programs
    at (1, 32/8)), where the decode splits the keys over the device and reads each K/V row once
    for a KV head's whole group of rows (docs/notes/triton-prefill.md). Plain or quantized K/V;
    a window, ALiBi or a mask on more than one row only when causal (QUERY_ROWS: each row's
    position and its row of the mask)."""
    b, h_q, n_q, _ = q.shape
    h_kv, n_kv = k.shape[1], k.shape[2]
    if not 1 <= n_q <= DECODE_ROWS or h_q // h_kv * n_q > DECODE_GROUP_ROWS or n_kv == 0:
        return False
    if variants is None:
        return True
    per_row = variants.window is not None or variants.alibi_slopes is not None or variants.mask is not None
    return causal or n_q == 1 or not per_row


def _rows_as_decode(q, k, v, causal: bool, scale: float, variants, *, k_format: str = "", v_format: str = "",
                    k_scales=None, v_scales=None):
    """prefill of q (B, H_q, N_q, DK) as the decode of (B, H_q N_q, DK) over K/V as a contiguous
    cache (quantized ones as the op takes them: data, format, scales): each query head's rows are
    heads of its KV head's group, causal rows through the kernel's QUERY_ROWS (row i at
    N_kv - N_q + i, prefill's bottom-right causal), the sinks and ALiBi slopes repeated per row,
    a mask read per row in the kernel (ROW_MASK). Rows that are not causal all see every key
    (one row at N_kv - 1 is either)."""
    from . import decode as triton_decode

    b, h_q, n_q, dk = q.shape
    rows = q.reshape(b, h_q * n_q, dk)
    var, row_mask = {}, None
    if variants is not None:
        row_mask = variants.mask
        var = triton_decode.op_variants(replace(variants, mask=None).per_row(n_q), rows)
    out, lse = triton_decode._launch(rows, k, v, None, None, scale, 0, k_format=k_format, v_format=v_format,
                                     k_scales=k_scales, v_scales=v_scales, row_mask=row_mask,
                                     query_rows=n_q if causal and n_q > 1 else 1, **var)
    return out.view(b, h_q, n_q, out.shape[-1]), lse.view(b, h_q, n_q)


# the op, for torch.compile, tracing and dispatch modes; eager calls may skip it (skips_dispatcher)
_prefill_op = torch.library.custom_op("flashcl::prefill", mutates_args=(), schema=_SCHEMA)(_prefill_impl)


@_prefill_op.register_fake
def _prefill_fake(q, k, v, causal, scale, return_lse, block_m=0, block_n=0, num_warps=0,
                  num_stages=0, use_tma=False, maxnreg=0, softmax_overlap=False, window=None,
                  softcap=None, sinks=None, alibi_slopes=None, mask=None, k_scales=None,
                  v_scales=None, k_format="", v_format=""):
    b, h_q, n_q, _ = q.shape
    out = q.new_empty((b, h_q, n_q, _head_dim(v, v_format)))
    lse = q.new_empty((b, h_q, n_q) if return_lse else (0,), dtype=torch.float32)
    return out, lse


# --------------------------------------------------------------------------- entry point

def _tile_params(params: dict | None, dtype: torch.dtype) -> tuple[int, int, int, int, bool, int, bool]:
    """Validate a ``params`` dict for inputs of ``dtype``: BLOCK_M, BLOCK_N, num_warps, num_stages,
    optionally USE_TMA, maxnreg (a register cap per thread) and SOFTMAX_OVERLAP."""
    if params is None:
        return (0, 0, 0, 0, False, 0, False)
    unknown = set(params) - set(_PARAM_KEYS)
    missing = set(_PARAM_KEYS[:4]) - set(params)
    if unknown or missing:
        raise ValueError(f"params: the Triton prefill takes the keys {_PARAM_KEYS[:4]} and optionally "
                         f"{_PARAM_KEYS[4:]}; got {sorted(params)}")
    for name in _PARAM_KEYS[:4]:
        val = params[name]
        if isinstance(val, bool) or not isinstance(val, int) or val < 1:
            raise ValueError(f"params[{name!r}]: expected a positive int, got {val!r}")
    for name in ("BLOCK_M", "BLOCK_N"):
        if params[name] < 16 or params[name] & (params[name] - 1):
            raise ValueError(f"params[{name!r}]: expected a power of two >= 16, got {params[name]}")
    tile = (params["BLOCK_M"], params["BLOCK_N"], params["num_warps"])
    if dtype == torch.float32 and FLOAT32_DOTS == "tf32x3" and tile == (64, 16, 8):
        # H200, Triton 3.6: at every head dim and stage count tried; no other tile (triton-prefill.md)
        raise ValueError("params: a 64 x 16 tile on 8 warps makes an illegal memory access with float32 "
                         f"inputs ({FLOAT32_DOTS} dots); take another tile (4 warps, or BLOCK_N >= 32)")
    use_tma, overlap = params.get("USE_TMA", False), params.get("SOFTMAX_OVERLAP", False)
    for name, flag in (("USE_TMA", use_tma), ("SOFTMAX_OVERLAP", overlap)):
        if not isinstance(flag, bool):
            raise ValueError(f"params[{name!r}]: expected a bool, got {flag!r}")
    maxnreg = params.get("maxnreg") or 0
    if isinstance(maxnreg, bool) or not isinstance(maxnreg, int) or maxnreg < 0:
        raise ValueError(f"params['maxnreg']: expected None or a positive int, got {maxnreg!r}")
    return (*(params[n] for n in _PARAM_KEYS[:4]), use_tma, maxnreg, overlap)


def _variant_op_args(variants, q, k) -> tuple:
    """(window, softcap, sinks, alibi_slopes, mask) for flashcl::prefill from a Variants (or
    None), checked against q (B, H_q, N_q, DK) and k: a mismatch is a ValueError before launch."""
    if variants is None:
        return (None,) * 5
    b, h_q, n_q, n_kv = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    sinks, slopes, mask = variants.sinks, variants.alibi_slopes, variants.mask
    for name, t, shape in (("sinks", sinks, (h_q,)), ("alibi_slopes", slopes, (b, h_q))):
        if t is not None and (not isinstance(t, torch.Tensor) or tuple(t.shape) != shape
                              or t.dtype != torch.float32 or t.device != q.device):
            raise ValueError(f"variants.{name}: expected a float32 tensor of shape {shape} on {q.device}, "
                             f"got {t!r:.80}")
    if mask is not None:
        ok = (isinstance(mask, torch.Tensor) and mask.dim() == 4 and mask.shape[0] in (1, b)
              and mask.shape[1] in (1, h_q) and tuple(mask.shape[2:]) == (n_q, n_kv)
              and mask.dtype in (torch.bool, torch.float32) and mask.device == q.device)
        if not ok:
            raise ValueError(f"variants.mask: expected a bool or float32 tensor (1 or {b}, 1 or {h_q}, "
                             f"{n_q}, {n_kv}) on {q.device}, got {mask!r:.80}")
    window = None if variants.window is None else [int(w) for w in variants.window]
    return window, variants.softcap, sinks, slopes, mask


def _quant_op_args(x, name: str, q: torch.Tensor, rank: int) -> tuple:
    """(tensor, format, scales) for flashcl::prefill of K or V ``x``: a plain tensor as it is
    (format ""), a QuantizedTensor (flashcl.quant) as its data, format and scales (int8,
    fp8_e4m3), each of rank ``rank`` (+1 for ggml data). What the kernel relies on is checked
    here, a mismatch a ValueError/TypeError before launch."""
    if not isinstance(x, QuantizedTensor):
        return x, "", None
    fmt, data, scales = x.fmt, x.data, x.scales
    if fmt not in FORMATS:
        raise ValueError(f"{name}: unknown quantized format {fmt!r}; the Triton prefill takes "
                         f"{', '.join(FORMATS)}")
    if not (isinstance(data, torch.Tensor) and data.dtype == _DATA_DTYPES[fmt] and data.device == q.device):
        raise TypeError(f"{name}: {fmt} data must be a {_DATA_DTYPES[fmt]} tensor on {q.device}, "
                        f"got {data!r:.80}")
    ggml = fmt in BLOCK_BYTES
    if data.dim() != rank + ggml:
        raise ValueError(f"{name}: prefill takes a contiguous (B, H_kv, N_kv, D) or (H_kv, N_kv, D) "
                         f"cache, got {fmt} data of shape {tuple(data.shape)}")
    if data.stride(-1) != 1 or (ggml and data.stride(-2) != BLOCK_BYTES[fmt]):
        raise ValueError(f"{name}: the kernel reads each row of the {fmt} data as contiguous bytes; "
                         f"got strides {tuple(data.stride())}")
    if fmt == "fp8_e4m3" and q.is_cuda and torch.cuda.get_device_capability(q.device) < (8, 9):
        raise ValueError(f"{name}: fp8_e4m3 caches need an sm_89+ GPU (its convert instruction); "
                         "quantize to int8 or q8_0 instead")
    if fmt not in ("int8", "fp8_e4m3"):
        return data, fmt, None
    want = tuple(data.shape[:-1]) + (1,) if fmt == "int8" else ()
    if not (isinstance(scales, torch.Tensor) and tuple(scales.shape) == want
            and scales.dtype == torch.float32 and scales.device == q.device):
        raise ValueError(f"{name}: {fmt} data of shape {tuple(data.shape)} needs float32 scales of shape "
                         f"{want} on {q.device}, got {scales!r:.80}")
    return data, fmt, scales


def prefill(q, k, v, *, causal: bool = False, scale: float | None = None, return_lse: bool = False,
            params: dict | None = None, variants=None):
    """Flash-attention prefill of torch tensors (called by ``flashcl.prefill``, which validates).

    Inputs all 3-D (H, N, D) or all 4-D (B, H, N, D); returns out with the input's rank and dtype,
    plus lse (..., H_q, N_q) float32 when ``return_lse``. ``params`` forces a tile config
    ({"BLOCK_M", "BLOCK_N", "num_warps", "num_stages"}, optionally "USE_TMA", "maxnreg",
    "SOFTMAX_OVERLAP"); None autotunes. ``variants``: a flashcl.variants.Variants whose arrays are
    torch tensors on q's device (as flashcl.prefill normalizes them), or None for the plain kernel.
    k and/or v may be contiguous QuantizedTensors (flashcl.quant, any format), dequantized in the
    kernel. Traceable by torch.compile(fullgraph=True): the kernel runs inside the
    ``flashcl::prefill`` op.
    """
    (k, k_format, k_scales), (v, v_format, v_scales) = (_quant_op_args(x, name, q, q.dim())
                                                        for x, name in ((k, "k"), (v, "v")))
    squeeze = q.dim() == 3
    if squeeze:
        q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
        # int8's row scales gain the batch dim; fp8's one scale (0-d) stays as it is
        k_scales, v_scales = (s.unsqueeze(0) if s is not None and s.dim() else s
                              for s in (k_scales, v_scales))
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    var = _variant_op_args(variants, q, k)
    op = _prefill_impl if skips_dispatcher(q, k, v, *var[2:], k_scales, v_scales) else _prefill_op
    out, lse = op(q, k, v, bool(causal), float(scale), bool(return_lse), *_tile_params(params, q.dtype), *var,
                  k_scales, v_scales, k_format, v_format)
    if squeeze:
        out = out.squeeze(0)
        lse = lse.squeeze(0) if return_lse else lse
    return (out, lse) if return_lse else out
