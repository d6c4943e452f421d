"""Decode kernels in Gluon: the MHA loop (for the merge of its row slots after the loop) and a GQA
kernel with one online-softmax state per warp (``_gqa_decode``, at the end, its layouts next to
``launch_gqa``).

``decode._mha_fma_loop`` keeps an online-softmax state per row slot of its tile (no reduction
across rows inside the loop) and merges the slots' states once at the end. Written in
Triton, that merge took about 2,300 cycles in every program, whatever the context length: each
cross-warp ``tl.max``/``tl.sum`` is lowered with its own shared-memory rounds and barriers (11
barriers after the loop). This kernel runs the same loop on the same distribution of the tile,
but lays the tile out 4-D, [R, W, LP, D] (register repeat, warp, lane group, head dim; LP = 2
rows per warp instruction at d = 128, 4 at 64, 8 at 32), so that the merge can be written step by
step: the R slots a thread holds in registers, then the W LP states (m, l, acc) of the warps' lane
groups through shared memory behind one barrier, each thread finishing one column of the output.

The MHA loop in this form reads 0.99-1.06 of SDPA where Triton's reads 0.90-0.99, its merge
costing about 0.1 us (docs/notes/decode-h100.md, "The MHA kernel in Gluon" and "The Gluon MHA
kernel's tiles").

Which launches the kernels take is decided by the launch plan (``decode_plan``: gluon_takes,
gluon_tile, gqa_takes, gqa_splits: 2-byte K/V, head dims up to 128, 32-bit cache offsets, a CUDA
device of compute capability 8.0 or newer, a Triton with Gluon, not the interpreter); the launch
then checks the tensors (``operands_fit``) and otherwise runs decode's Triton kernel. The
``gluon_mha`` and ``gluon_gqa`` knobs turn them off. Run with Triton 3.6 (H100); compiled with
Triton 3.6 for sm_80, sm_89 and sm_90, and with Triton 3.9 for sm_90.

The GQA kernel (``launch_gqa``) replaces the dot path's cp.async ring and its per-tile cross-warp
softmax by K and V loaded a tile or two ahead (gqa_tiles_ahead) into registers in the mma operand
layouts, each warp running its own softmax over its 16 keys of a tile, keys as the mma's rows. Its loads take the same L1::evict_first hint
("GQA in Gluon with the L1 hint"). It also reads int8, fp8, q8_0 and q4_0 caches (fp16 q): int8
and fp8 tiles in the same places as 32-bit words, q8_0 / q4_0 rows as 8-byte units around each
lane's block, turned into fp16 values in registers (docs/notes/quantized-decode.md, "q8_0 and
q4_0 in the Gluon GQA kernel", "int8 and fp8 in the Gluon GQA kernel").
"""

from __future__ import annotations

import functools

import torch
import triton.language as tl

from . import interpreting
from .decode_plan import gluon_block_d as _block_d
from .quant_words import F16_BIAS, FP8_F16_PTX, INT8_F16_PTX, word_to_f16x2_ptx
from .score_variants import LOG2E, join_sink, score_variants

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2
except ImportError:  # a Triton without Gluon
    gluon = None

# Python called by the kernels at compile time (Gluon's constexpr functions); plain functions without Gluon
_compile_time = gluon.constexpr_function if gluon is not None else (lambda fn: fn)


def available() -> bool:
    return gluon is not None and not interpreting()


def operands_fit(q, k_cache, v_cache, block_table, context_lens, kv_formats=("", "")) -> bool:
    """What both kernels need of the tensors, past what the plan decides from the shapes
    (decode_plan: gluon_takes, gqa_takes, 32-bit offsets): context lengths given, unit strides
    along the head dim and along the block table's rows; a quantized cache (``kv_formats``) that
    takes the view the GQA kernel reads (_takes_word_view)."""
    if not (context_lens is not None and block_table.shape[1] >= 1 and block_table.stride(1) == 1
            and q.stride(2) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1):
        return False
    return all(_takes_word_view(data, fmt) for data, fmt in zip((k_cache, v_cache), kv_formats))


def _takes_word_view(data, fmt: str) -> bool:
    """Whether a quantized cache's data takes the view _as_words gives the kernel (a plain one needs
    none): int8 / fp8 rows as 32-bit words, q8_0 / q4_0 rows (whole blocks in one piece, a whole
    number of units) as 8-byte units; the rows, the pointer and the storage offset on the word's
    boundary (a storage of unaligned base would make the view raise)."""
    if not fmt:
        return True
    size = 8 if fmt in GGML_BLOCK_BYTES else 4
    if fmt in GGML_BLOCK_BYTES and not (data.shape[4] == GGML_BLOCK_BYTES[fmt] and data.stride(4) == 1
                                        and data.stride(3) == data.shape[4]
                                        and data.shape[3] * data.shape[4] % size == 0):
        return False
    return (data.data_ptr() % size == 0 and data.storage_offset() % size == 0
            and all(st % size == 0 for st in data.stride()[:3]))


def launch(q, k_cache, v_cache, block_table, context_lens, out, lse, qk_scale_log2: float, block_n: int,
           num_warps: int, evict_first: bool = True, sort_pages: bool = True) -> None:
    """out/lse of MHA decode over a paged cache whose offsets fit 32 bits (see ``operands_fit``), tiles of
    ``block_n`` rows on ``num_warps`` warps; ``evict_first``: the K/V loads marked L1::evict_first
    (decode's kv_evict_first knob); ``sort_pages``: the pages of sequences of 256 to 1024 pages
    visited in address order (sort_size; decode's sort_pages knob)."""
    b, h, d = q.shape
    keys, order = _page_order(block_table, k_cache.shape[1], 1, block_n, h * b, sort_pages, lse)
    _mha_decode[(h, b)](
        q, k_cache, v_cache, block_table, context_lens, out, lse, order, qk_scale_log2, block_table.shape[1],
        k_cache.shape[0],
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_table.stride(0),
        out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
        BLOCK_N=block_n, D=d, BLOCK_D=_block_d(d), PAGE=k_cache.shape[1], EVICT="evict_first" if evict_first else "",
        SORT_N=keys, num_warps=num_warps)


# ---- GQA: one online-softmax state per warp, mma.sync ----------------------------------------

# The kernel's rule (which launches it takes, at which split count) is decode_plan's gqa_takes and
# gqa_splits; split launches are merged by decode's reduce kernel.


@functools.lru_cache(maxsize=None)
def _gqa_layouts(warps: int, rows: int):
    """The kernel's layouts for ``warps`` warps (see _gqa_decode); ``rows``: the query rows its
    merge exchanges (8 for groups up to 8, else 16)."""
    mma = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[warps, 1, 1], instr_shape=[1, 16, 8])
    # K tile [W, 16 keys, 128 d]: lane 4 n + c holds keys n and 8 + n, columns [32 c, 32 c + 32)
    k_layout = gl.BlockedLayout([1, 1, 32], [1, 8, 4], [warps, 1, 1], [2, 1, 0])
    # V tile [W, 16 keys, 128 d]: lane 4 n + c holds keys 2c, 2c + 1, 8 + 2c, 9 + 2c, columns
    # [16 n, 16 n + 16); registers run along the columns first, so the loads are 16-byte vectors
    v_layout = gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 0, 8], [0, 1, 0], [0, 8, 0]],
        lane_bases=[[0, 2, 0], [0, 4, 0], [0, 0, 16], [0, 0, 32], [0, 0, 64]],
        warp_bases=[[1 << i, 0, 0] for i in range(warps.bit_length() - 1)], block_bases=[], shape=[warps, 16, 128])
    # q^T [W, 128 d, R rows], loaded once and converted to the B operand
    q_layout = gl.BlockedLayout([1, 8, 1], [1, 4, 8], [warps, 1, 1], [1, 2, 0])
    # the merge: the W states of an element in one thread
    merge = gl.BlockedLayout([warps, 1, 4], [1, rows // warps, 32 * warps // rows], [1, warps, 1], [2, 1, 0])
    return mma, k_layout, v_layout, q_layout, merge


@functools.lru_cache(maxsize=None)
def _gqa_word_layouts(warps: int):
    """The K and V tiles of 1-byte values as 32-bit words, [W, 16 keys, 32 words]: each lane holds
    the words of the values it holds in the fp16 layouts (K: 8 words of each of its 2 keys, V: 4
    of each of its 4), so that the values they turn into land there without data movement."""
    k_words = gl.BlockedLayout([1, 1, 8], [1, 8, 4], [warps, 1, 1], [2, 1, 0])
    v_words = gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [0, 0, 2], [0, 1, 0], [0, 8, 0]],
        lane_bases=[[0, 2, 0], [0, 4, 0], [0, 0, 4], [0, 0, 8], [0, 0, 16]],
        warp_bases=[[1 << i, 0, 0] for i in range(warps.bit_length() - 1)], block_bases=[], shape=[warps, 16, 32])
    return k_words, v_words


# ggml blocks (q8_0, q4_0) in the GQA kernel: a row at d = 128 is 4 blocks (136 or 72 bytes, 17 or 9
# 8-byte units). Each lane holds a window of units where its block (K) or half block (V) lies:
# the units K_UNITS / V_UNITS along the last axis of _gqa_ggml_layouts, one more in its slice.
GGML_BLOCK_BYTES = {"q8_0": 34, "q4_0": 18}
_K_UNITS = {"q8_0": 4, "q4_0": 2}
_V_UNITS = {"q8_0": 2, "q4_0": 1}


@functools.lru_cache(maxsize=None)
def _gqa_ggml_layouts(warps: int, fmt: str):
    """The K and V tiles of ggml rows as 8-byte units, 4-D [W, 16 keys, lane column group, unit]:
    K [W, 16, 4, K_UNITS]: lane 4 n + c holds the units where block c (its d, then its values)
    starts, of keys n and 8 + n; V [W, 16, 8, V_UNITS]: lane 4 n + c holds those where half n % 2
    of block n // 2 starts, of keys 2c, 2c + 1, 8 + 2c, 9 + 2c. One more unit a lane (a tensor in
    SliceLayout(3, ...): no unit axis) ends each window (_ggml_values)."""
    k_units = gl.BlockedLayout([1, 1, 1, _K_UNITS[fmt]], [1, 8, 4, 1], [warps, 1, 1, 1], [3, 2, 1, 0])
    v_units = gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 0, 1]] * (_V_UNITS[fmt] == 2) + [[0, 1, 0, 0], [0, 8, 0, 0]],
        lane_bases=[[0, 2, 0, 0], [0, 4, 0, 0], [0, 0, 1, 0], [0, 0, 2, 0], [0, 0, 4, 0]],
        warp_bases=[[1 << i, 0, 0, 0] for i in range(warps.bit_length() - 1)], block_bases=[],
        shape=[warps, 16, 8, _V_UNITS[fmt]])
    return k_units, v_units


def ggml_ptx(fmt: str, pack: int, d_in_window: bool) -> str:
    """PTX for inline_asm_elementwise(pack=``pack``) that turns windows of a q8_0 or q4_0 row into
    the fp16 values q * d of the 8 pack bytes of quants each lane holds: ``pack`` 8-byte units and
    one more (a window: 2 pack + 2 words w), per-lane byte permute selectors for the window's
    offset, and d (in the window's first two words with ``d_in_window``, else an fp16 operand).
    The quants start at byte o of the window: x_j = w_j, or w_(j+1) where o >= 6 (``shift``), then
    word k of quants is the 4 bytes of (x_k, x_(k+1)) from o, less 4 where shifted (``sel``).
    q8_0: each word's 4 int8 become fp16 as int8 does (INT8_F16_PTX); q4_0: its 8 nibbles less 8
    (bias 1024 + 8). Each value is then multiplied by d (correctly rounded, as the float32
    product cast to fp16). Outputs, f16x2 registers (fp16 pairs with pack 1) in this order:
    q8_0, quants (4 k, 4 k + 1), (4 k + 2, 4 k + 3) of word k; q4_0 with pack 2, the low nibbles
    (4 k, 4 k + 1), (4 k + 2, 4 k + 3), then the high ones, of word k; with pack 1, the low
    nibbles of both words, then the high ones. Built for the kernel's four (fmt, pack): q8_0 with
    pack 4 (K) and 2 (V), q4_0 with 2 (K) and 1 (V)."""
    assert (fmt, pack) in (("q8_0", 4), ("q8_0", 2), ("q4_0", 2), ("q4_0", 1)), (fmt, pack)
    q8 = fmt == "q8_0"
    words, out_regs = 2 * pack + 2, (4 if q8 else 8) * pack
    main = out_regs if pack > 1 or q8 else 2 * out_regs  # pack 1 q4_0: 16-bit outputs
    extra = main + pack
    if d_in_window:
        shift, sel, sel_d = extra + pack, extra + 2 * pack, extra + 3 * pack
    else:
        d_op = extra + pack
        shift, sel = d_op + 1, d_op + 1 + pack
    L = ["{", f".reg .b32 w<{words}>, x<{words - 1}>, r, lo, hi, d, bias, o<4>;"]
    L += [f"mov.b64 {{w{2 * u}, w{2 * u + 1}}}, ${main + u};" for u in range(pack)]
    L.append(f"mov.b64 {{w{words - 2}, w{words - 1}}}, ${extra};")
    if d_in_window:
        L.append(f"prmt.b32 d, w0, w1, ${sel_d};")
    else:
        L.append(f"mov.b32 d, ${d_op};" if pack > 1 else f"mov.b32 d, {{${d_op}, ${d_op}}};")
    L += [f"prmt.b32 x{j}, w{j}, w{j + 1}, ${shift};" for j in range(words - 1)]
    L.append(f"mov.b32 bias, {F16_BIAS['int8' if q8 else 'q4_0']};")
    for k in range(words - 2):
        L.append(f"prmt.b32 r, x{k}, x{k + 1}, ${sel};")
        outs = [f"o{i}" for i in range(2 if q8 else 4)]
        L += word_to_f16x2_ptx("int8" if q8 else "q4_0", "r", ["r"] if q8 else ["lo", "hi"], outs, subtract=False)
        if q8 or pack > 1:
            regs = [(len(outs) * k + i, o) for i, o in enumerate(outs)]
        else:  # fp16 outputs: low nibbles 0..7 of the two words first
            regs = [(4 * k + 2 * i, f"o{i}") for i in range(2)]
            regs += [(8 + 4 * k + 2 * i, f"o{2 + i}") for i in range(2)]
        for out, reg in regs:  # each pair less the bias, times d
            L.append(f"sub.rn.f16x2 {reg}, {reg}, bias;")
            if pack > 1 or q8:
                L.append(f"mul.rn.f16x2 ${out}, {reg}, d;")
            else:
                L += [f"mul.rn.f16x2 {reg}, {reg}, d;", f"mov.b32 {{${out}, ${out + 1}}}, {reg};"]
    L.append("}")
    return "\n".join(L)


def ggml_constraints(fmt: str, pack: int, d_in_window: bool) -> str:
    """The constraints of ggml_ptx(fmt, pack, d_in_window)."""
    q8 = fmt == "q8_0"
    outs = ["=r"] * ((4 if q8 else 8) * pack) if pack > 1 or q8 else ["=h"] * 16
    d = [] if d_in_window else ["r" if pack > 1 else "h"]
    return ",".join(outs + ["l"] * (2 * pack) + d + ["r"] * ((3 if d_in_window else 2) * pack))


# the kernel's (constexpr: read from jit code): K windows hold their block's d, V's do not
_Q8_0_K_ASM = tl.constexpr((ggml_ptx("q8_0", 4, True), ggml_constraints("q8_0", 4, True)))
_Q8_0_V_ASM = tl.constexpr((ggml_ptx("q8_0", 2, False), ggml_constraints("q8_0", 2, False)))
_Q4_0_K_ASM = tl.constexpr((ggml_ptx("q4_0", 2, True), ggml_constraints("q4_0", 2, True)))
_Q4_0_V_ASM = tl.constexpr((ggml_ptx("q4_0", 1, False), ggml_constraints("q4_0", 1, False)))


# ---- the page sort (both kernels) ------------------------------------------------------------

# Both kernels visit the pages of a split (in the MHA kernel: of the sequence) in ascending order of
# address where it holds SORT_MIN_PAGES to SORT_MAX_PAGES pages. Before its first loads each
# program sorts its table entries into an int32 scratch array (_sorted_table; the last page, which
# may be partial, keeps its place) and reads them from there: every program then sweeps the cache
# from low to high addresses, all at about the same pace. The W warps sort together (_sort_keys):
# each warp a row of SORT_N / W keys (bitonic_ptx), then log2 W levels of bitonic merges across
# the rows (rows_merge_ptx, on the rows a thread holds after a layout conversion through shared
# memory). Below 256 pages a split it did not pay ("The page sort's measurements").
SORT_MIN_PAGES = 256
SORT_MAX_PAGES = 1024  # 8 keys a lane on 4 warps, 4 on 8


def sort_size(table_width: int, page: int, num_splits: int, block_n: int = 64) -> int:
    """The power of two (keys) _sorted_table sorts per program of a launch of ``block_n``-token
    tiles, 0 for no sort: a split's pages, where that is SORT_MIN_PAGES to SORT_MAX_PAGES and a
    tile holds whole pages."""
    # a split's tokens, as _gqa_decode cuts them: ceil(bound / splits) rounded up to whole tiles
    tokens = -(-table_width * page // num_splits)
    pages = -(-tokens // block_n) * block_n // page
    if block_n % page or not SORT_MIN_PAGES <= pages <= SORT_MAX_PAGES:
        return 0
    return 1 << (pages - 1).bit_length()


def _page_order(block_table, page: int, num_splits: int, block_n: int, programs: int, sort_pages: bool,
                stand_in: torch.Tensor):
    """(SORT_N, scratch) of a launch: the keys each program sorts (sort_size; 0 without
    ``sort_pages``) and its int32 scratch for the sorted copies, one per program (``stand_in``
    where none is read)."""
    keys = sort_size(block_table.shape[1], page, num_splits, block_n) if sort_pages else 0
    if not keys:
        return 0, stand_in
    return keys, torch.empty(programs * keys, dtype=torch.int32, device=block_table.device)


@_compile_time
def asm_constraints(regs: int) -> str:
    """The constraints of the sort's inline PTX: ``regs`` 32-bit outputs, then as many inputs."""
    return ",".join(["=r"] * regs + ["r"] * regs)


@_compile_time
def bitonic_ptx(n: int, merge_only: bool = False) -> str:
    """PTX for inline_asm_elementwise(pack=n / 32): one warp sorts n = 32 R int32
    keys ascending, R per lane (key lane * R + r in register r, the order of a BlockedLayout([R],
    [32], ...) tensor). A bitonic network: for k = 2, 4, .., n and j = k / 2, .., 1, the pair
    (i, i ^ j) keeps its minimum at the lower index where i & k is 0, at the higher one otherwise.
    Distances below R pair registers of a lane; the others pair lanes, by shfl.bfly (both lanes
    of a pair compute the same min and max and keep one each). ``merge_only``: the last level
    alone (k = n), which sorts a bitonic sequence. Straight-line code: 36 steps for 256 keys."""
    R = n // 32
    assert n == 32 * R and R & (R - 1) == 0
    L = ["{", f".reg .b32 x<{R}>, y, t, u, lane, w;", ".reg .pred pk, pd;", "mov.u32 lane, %laneid;"]
    L += [f"mov.b32 x{r}, ${R + r};" for r in range(R)]
    k = n if merge_only else 2
    while k <= n:
        j = k // 2
        while j >= 1:
            if j < R:  # registers r and r | j of every lane
                lane_dir = R <= k < n  # the direction bit i & k is a lane bit
                if lane_dir:
                    L += [f"and.b32 w, lane, {k // R};", "setp.ne.u32 pd, w, 0;"]
                for r in range(R):
                    if r & j:
                        continue
                    a, b = f"x{r}", f"x{r | j}"
                    if lane_dir:
                        L += [f"min.s32 t, {a}, {b};", f"max.s32 u, {a}, {b};",
                              f"selp.b32 {a}, u, t, pd;", f"selp.b32 {b}, t, u, pd;"]
                    else:
                        lo, hi = (b, a) if k < n and r & k else (a, b)
                        L += [f"min.s32 t, {a}, {b};", f"max.s32 {hi}, {a}, {b};", f"mov.b32 {lo}, t;"]
            else:  # lanes l and l ^ (j / R): the minimum where (i & j == 0) == (i & k == 0)
                m = j // R
                L += [f"and.b32 w, lane, {m};", "setp.eq.u32 pk, w, 0;"]
                if k < n:
                    L += [f"and.b32 w, lane, {k // R};", "setp.ne.u32 pd, w, 0;", "xor.pred pk, pk, pd;"]
                for r in range(R):
                    L += [f"shfl.sync.bfly.b32 y, x{r}, {m}, 0x1f, 0xffffffff;",
                          f"min.s32 t, x{r}, y;", f"max.s32 u, x{r}, y;", f"selp.b32 x{r}, t, u, pk;"]
            j //= 2
        k *= 2
    L += [f"mov.b32 ${r}, x{r};" for r in range(R)]
    L.append("}")
    return "\n".join(L)


@_compile_time
def rows_merge_ptx(rows: int, top: int) -> str:
    """PTX for inline_asm_elementwise(pack=rows): the registers r and r ^ j of a
    thread, for j = top, top / 2, .., 1, keep their minimum at the lower one (the steps of a
    bitonic merge, ascending, over the rows a thread holds)."""
    L = ["{", f".reg .b32 x<{rows}>, t;"] + [f"mov.b32 x{r}, ${rows + r};" for r in range(rows)]
    j = top
    while j >= 1:
        for r in range(rows):
            if not r & j:
                L += [f"min.s32 t, x{r}, x{r | j};", f"max.s32 x{r | j}, x{r}, x{r | j};", f"mov.b32 x{r}, t;"]
        j //= 2
    L += [f"mov.b32 ${r}, x{r};" for r in range(rows)]
    L.append("}")
    return "\n".join(L)


def launch_gqa(q, k_cache, v_cache, block_table, context_lens, out, lse, qk_scale_log2: float,
               evict_first: bool = True, num_splits: int = 1, partials=None, sort_pages: bool = True,
               k_format: str = "", v_format: str = "", k_scales=None, v_scales=None, window_left: int = -1,
               softcap_log2: float = 0.0, sinks=None, alibi_slopes=None, max_registers: int = 0,
               key_start=None, query_rows: int = 1) -> None:
    """GQA decode (groups up to 16, head dim 128) over a paged cache whose offsets fit 32 bits,
    one program per (KV head, sequence, split) of 4 warps: out/lse with one split; with more, the
    unnormalized states into ``partials`` (part_m, part_l, part_acc in decode's split layout, for
    its reduce kernel). ``sort_pages``: the pages of long splits visited in address order
    (sort_size; decode's sort_pages knob). ``k_format`` / ``v_format``: "int8", "fp8_e4m3" or
    "q8_0" / "q4_0" for a quantized cache's data (decode_plan.GQA_QUANTIZED, fp16 q; see operands_fit);
    ``k_scales`` / ``v_scales``: its scales as decode reads them, (tensor, (block, position, head)
    strides) (decode._scale_operand: int8's per row, fp8's one at every row; ggml's d lie in
    its data). The variants as decode's kernel takes them: ``window_left`` >= 0 (-1: none; its
    splits cut the window), ``softcap_log2`` > 0 (c log2 e; 0: none), ``sinks`` (H_q,) (one
    split: joined here; more: the reduce kernel's), ``alibi_slopes`` (B, H_q), unit head stride,
    ``key_start`` int32 (B,) (decode's: its splits cut [the first key, length)); with a window,
    ALiBi or a key start, which read a key's position, the pages keep their order (no sort).
    ``max_registers``: a register cap for the build (the plan's gqa_registers), 0 for none.
    ``query_rows`` > 1: q's heads are each query head's causal rows (decode's QUERY_ROWS), the
    group counting them."""
    b, h_q, _ = q.shape
    h_kv = k_cache.shape[2]
    group = h_q // h_kv
    if group % query_rows:
        raise ValueError(f"query rows: a group of {group} heads is not whole query heads of {query_rows} rows")
    warps = 4
    mma, k_layout, v_layout, q_layout, merge = _gqa_layouts(warps, 8 if group <= 8 else 16)
    split = num_splits > 1
    part_m, part_l, part_acc = partials if split else (lse, lse, lse)
    s_pm = (part_m.stride(0), part_m.stride(1), part_m.stride(2)) if split else (0, 0, 0)
    s_pa = (part_acc.stride(0), part_acc.stride(1), part_acc.stride(2)) if split else (0, 0, 0)
    window = window_left >= 0
    # the page sort visits keys out of place: not with what reads a key's position (the variants, rows)
    keys, order = _page_order(block_table, k_cache.shape[1], num_splits, 16 * warps, h_kv * b * num_splits,
                              sort_pages and not window and alibi_slopes is None and key_start is None
                              and query_rows == 1, lse)
    k_cache, v_cache = _as_words(k_cache, k_format), _as_words(v_cache, v_format)
    k_sc, s_ks = k_scales or (lse, (0, 0, 0))
    v_sc, s_vs = v_scales or (lse, (0, 0, 0))
    k_words, v_words = _gqa_word_layouts(warps)
    # the layouts the tiles are loaded in: ggml rows' lane slices of their unit layouts (K4 / V4),
    # int8 / fp8 words, or the fp16 values' own
    k_units = _gqa_ggml_layouts(warps, k_format)[0] if k_format in GGML_BLOCK_BYTES else k_layout
    v_units = _gqa_ggml_layouts(warps, v_format)[1] if v_format in GGML_BLOCK_BYTES else v_layout
    kl, vl = k_layout, v_layout
    if k_format:
        kl = gl.SliceLayout(3, k_units) if k_format in GGML_BLOCK_BYTES else k_words
    if v_format:
        vl = gl.SliceLayout(3, v_units) if v_format in GGML_BLOCK_BYTES else v_words
    _gqa_decode[(h_kv, b, num_splits)](
        q, k_cache, v_cache, block_table, context_lens, out, lse, part_m, part_l, part_acc, order, k_sc, v_sc,
        lse if sinks is None else sinks, lse if alibi_slopes is None else alibi_slopes,
        lse if key_start is None else key_start, qk_scale_log2, block_table.shape[1], num_splits, k_cache.shape[0], max(window_left, 0),
        softcap_log2 if softcap_log2 > 0 else 1.0,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_table.stride(0),
        out.stride(0), out.stride(1), lse.stride(0), lse.stride(1), *s_pm, *s_pa, *s_ks, *s_vs,
        0 if alibi_slopes is None else alibi_slopes.stride(0),
        WINDOW=window, SOFTCAP=softcap_log2 > 0, SINKS=sinks is not None, ALIBI=alibi_slopes is not None,
        KEY_START=key_start is not None, GROUP=group, QUERY_ROWS=query_rows, PAGE=k_cache.shape[1],
        EVICT="evict_first" if evict_first else "", SPLIT=split,
        SORT_N=keys, K_FMT=k_format, V_FMT=v_format, AHEAD=gqa_tiles_ahead(k_format, v_format),
        MMA=mma, KL=kl, VL=vl, KF=k_layout, VF=v_layout, K4=k_units, V4=v_units, QL=q_layout, CL=merge,
        num_warps=warps, **({"maxnreg": max_registers} if max_registers else {}))


def gqa_tiles_ahead(k_format: str, v_format: str) -> int:
    """Tiles of K/V the GQA kernel keeps in flight ahead of the one it computes: 2 for q8_0 and
    q4_0 K and V (a quarter to a half of fp16's bytes a tile: one tile in flight a warp left them
    waiting on memory), else 1 (fp16 measured slower with two, fp8 no faster at three programs
    per SM; int8 reads its row scales one tile ahead). docs/notes/quantized-decode.md, "Keys as
    the mma's rows"."""
    return 2 if k_format == v_format and k_format in GGML_BLOCK_BYTES else 1


def _as_words(cache, fmt: str):
    """A cache as the kernel reads it (operands_fit checks the views are possible): int8 / fp8
    values as 32-bit words, four to a word; q8_0 / q4_0 rows as 8-byte units; a plain one as it is."""
    if fmt in GGML_BLOCK_BYTES:
        return cache.flatten(3).view(torch.int64)
    if fmt == "fp8_e4m3":
        cache = cache.view(torch.uint8)
    return cache.view(torch.int32) if fmt else cache


if gluon is not None:
    # thread_barrier in Triton 3.6, barrier in 3.9
    _cta_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier

    @gluon.jit
    def _index(n: gl.constexpr, axis: gl.constexpr, L4: gl.constexpr, RANK: gl.constexpr):
        """arange(0, n) along ``axis`` of a tensor of size 1 on its other axes: 4-D in L4
        (RANK 4), or 3-D in SliceLayout(3, L4) (RANK 3: one value per row of the tile)."""
        if axis == 3:
            x = gl.arange(0, n, gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, L4))))
            x = gl.expand_dims(gl.expand_dims(gl.expand_dims(x, 0), 1), 2)
        else:
            if axis == 0:
                x = gl.arange(0, n, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, L4))))
                x = gl.expand_dims(gl.expand_dims(x, 1), 2)
            elif axis == 1:
                x = gl.arange(0, n, gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, L4))))
                x = gl.expand_dims(gl.expand_dims(x, 0), 2)
            else:
                x = gl.arange(0, n, gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, L4))))
                x = gl.expand_dims(gl.expand_dims(x, 0), 1)
            if RANK == 4:
                x = gl.expand_dims(x, 3)
        return x

    @gluon.jit
    def _merge_states(m, l, acc, axis: gl.constexpr):
        """The online-softmax states (log2 domain) along ``axis`` merged exactly into one (kept as
        a size-1 axis); an empty state is (-inf, 0, 0)."""
        m_all = gl.max(m, axis, keep_dims=True)
        w = gl.exp2(m - gl.where(m_all == float("-inf"), 0.0, m_all))  # both empty: no inf - inf
        return m_all, gl.sum(l * w, axis, keep_dims=True), gl.sum(acc * w, axis, keep_dims=True)

    @gluon.jit
    def _load_cols(ptrs, cols, D: gl.constexpr, BLOCK_D: gl.constexpr, EVICT: gl.constexpr):
        """A tile's rows; the padding columns of a head dim below BLOCK_D read as zeros (the
        scores and the output then ignore them: q is zero there too). ``EVICT``: the L1 eviction
        policy ("" or "evict_first")."""
        if D == BLOCK_D:
            x = gl.load(ptrs, eviction_policy=EVICT)
        else:
            x = gl.load(ptrs, mask=cols, other=0.0, eviction_policy=EVICT)
        return x

    @gluon.jit
    def _context_len(ContextLens, pid_b, capacity):
        """(context_lens[b], whether it lies in [0, capacity]); outside, 0: no key is read, and the
        kernels make the sequence's rows NaN (device tables are never read back; see decode)."""
        n = gl.load(ContextLens + pid_b)
        ok = (n >= 0) & (n <= capacity)
        return gl.where(ok, n, 0), ok

    @gluon.jit
    def _safe_pages(page, last_block):
        """decode._safe_pages: (block ids about to be used, clamped into the cache with one
        unsigned min, and the ids as unsigned, for the caller's running maximum that is compared
        with the last block once after the loop)."""
        page = page.to(gl.uint32)
        return gl.minimum(page, last_block).to(gl.int32), page

    @gluon.jit
    def _row_scales(Scales, pid_h, page, pos, valid, stride_blk, stride_pos, stride_h, ON: gl.constexpr):
        """int8's row scales at in-page positions ``pos`` of ``page`` (0 where ``valid`` is false;
        every one read where it is None); 1.0 where the cache is not int8 (``ON`` false)."""
        if ON:
            ptrs = Scales + pid_h * stride_h + page * stride_blk + pos * stride_pos
            if valid is None:
                x = gl.load(ptrs)
            else:
                x = gl.load(ptrs, mask=valid, other=0.0)
        else:
            x = 1.0
        return x

    @gluon.jit
    def _words_to_f16(w, FMT: gl.constexpr, LF: gl.constexpr):
        """Words [W, 16, n] of four 1-byte values each as the fp16 values [W, 16, 4 n] in layout LF
        (which holds each word's values where the word's layout holds the word: no data
        movement), exactly: int8 through byte permutes (quant_words.words_to_f16), fp8_e4m3 by
        the sm_89+ convert."""
        if FMT == "int8":
            t0, t1, t2, t3 = gl.inline_asm_elementwise(INT8_F16_PTX, "=h,=h,=h,=h,r", [w],
                                                       dtype=(gl.float16,) * 4, is_pure=True, pack=1)
        else:
            t0, t1, t2, t3 = gl.inline_asm_elementwise(FP8_F16_PTX, "=h,=h,=h,=h,r", [w],
                                                       dtype=(gl.float16,) * 4, is_pure=True, pack=1)
        x = gl.join(gl.join(t0, t2), gl.join(t1, t3))  # [.., n, 2, 2]: value 4 i + 2 a + b at [i, a, b]
        x = gl.reshape(x, [w.shape[0], w.shape[1], 4 * w.shape[2]])
        return gl.convert_layout(x, LF, assert_trivial=True)

    @gluon.jit
    def _fp16_rows(q):
        """q [W, D, R] (float32 of bf16) in fp16 for the mma with fp16 K values, each row r at the power
        of two that puts its largest |q| in [2^13, 2^14): its values exact down to 2^-27 of that one
        (bf16 has 8 significant bits, fp16 11); and the inverse powers [W, R], for its scores."""
        top = (gl.max(gl.abs(q), 1).to(gl.int32, bitcast=True) >> 23) & 0xFF  # the biased exponent
        e = gl.minimum(140 - top, 126)  # 2^e |q| < 2^14; 2^-126 the least inverse (a normal float)
        scale = ((e + 127) << 23).to(gl.float32, bitcast=True)
        inv = ((127 - e) << 23).to(gl.float32, bitcast=True)
        return (q * gl.expand_dims(scale, 1)).to(gl.float16), inv

    @gluon.jit
    def _ggml_load(base, row, col, mask, EVICT: gl.constexpr, L4: gl.constexpr, IS_K: gl.constexpr,
                   FMT: gl.constexpr):
        """A q8_0 / q4_0 tile's windows (_gqa_ggml_layouts): the units of each lane ([W, 16, C, U]
        in L4) and the one that ends its window ([W, 16, C] in SliceLayout(3, L4)); V also its
        block's d (fp16, [W, 16, C]). ``row``: each key's first unit ([W, 16, 1]), ``col``: the
        lane's column group ([1, 1, C]: K's block, V's half block); rows where ``mask`` is false
        (None: none) read as zeros."""
        BLOCK: gl.constexpr = 34 if FMT == "q8_0" else 18
        U: gl.constexpr = (4 if FMT == "q8_0" else 2) if IS_K else (2 if FMT == "q8_0" else 1)
        unit = _index(U, 3, L4, 4)
        if IS_K:  # block c: d at byte 2 c of its window, quants from 2 c + 2
            first = row + (BLOCK * col) // 8
            last = first + U
        else:  # half h of block b: quants from byte 2 + (BLOCK - 2) h / 2 of it; the window stays in the row
            start = BLOCK * (col // 2) + 2 + (BLOCK - 2) // 2 * (col % 2)
            first = row + start // 8
            last = row + gl.minimum(start // 8 + U, (4 * BLOCK) // 8 - 1)
        main_ptrs = base + gl.expand_dims(first, 3) + unit
        if mask is None:
            main = gl.load(main_ptrs, eviction_policy=EVICT)
            tail = gl.load(base + last, eviction_policy=EVICT)
        else:
            main = gl.load(main_ptrs, mask=gl.expand_dims(mask, 3), other=0)
            tail = gl.load(base + last, mask=mask, other=0)
        d = 0.0
        if not IS_K:  # d: the block's first halfword
            d_ptrs = base.to(gl.pointer_type(gl.float16), bitcast=True) + 4 * row + (BLOCK // 2) * (col // 2)
            if mask is None:
                d = gl.load(d_ptrs, eviction_policy=EVICT)
            else:
                d = gl.load(d_ptrs, mask=mask, other=0.0)
        return main, tail, d

    @gluon.jit
    def _gqa_tile(k_base, v_base, page_k, page_v, t_k, t_v, col_k, col_v, stride_kblk, stride_kpos, stride_vblk,
                  stride_vpos, PAGE: gl.constexpr, EVICT: gl.constexpr, K4: gl.constexpr, V4: gl.constexpr,
                  K_FMT: gl.constexpr, V_FMT: gl.constexpr):
        """A tile's K and V rows (tokens t_k / t_v on pages page_k / page_v, unmasked: the caller
        clamps rows past the end) as the GQA loop reads them: (k, K's ggml window ends, v, V's
        ggml window ends, V's ggml d), 0.0 where the format has none."""
        K_GGML: gl.constexpr = (K_FMT == "q8_0") or (K_FMT == "q4_0")
        V_GGML: gl.constexpr = (V_FMT == "q8_0") or (V_FMT == "q4_0")
        kt = 0.0
        vt = 0.0
        vd = 0.0
        if K_GGML:
            k, kt, _ = _ggml_load(k_base, page_k * stride_kblk + (t_k % PAGE) * stride_kpos, col_k, None, EVICT,
                                  K4, True, K_FMT)
        else:
            k = gl.load(k_base + page_k * stride_kblk + (t_k % PAGE) * stride_kpos + col_k, eviction_policy=EVICT)
        if V_GGML:
            v, vt, vd = _ggml_load(v_base, page_v * stride_vblk + (t_v % PAGE) * stride_vpos, col_v, None, EVICT,
                                   V4, False, V_FMT)
        else:
            v = gl.load(v_base + page_v * stride_vblk + (t_v % PAGE) * stride_vpos + col_v, eviction_policy=EVICT)
        return k, kt, v, vt, vd

    @gluon.jit
    def _ggml_selectors(L4: gl.constexpr, IS_K: gl.constexpr):
        """The byte permute selectors of each lane's window (ggml_ptx), [1, 1, C, 1] in L4: the word
        shift, the quant words' bytes, and (K) d's halfword. Its quants start at byte o of the
        window, for q8_0 and q4_0 alike: K's block c at 2 c + 2, V's half block of block b at
        (2 b + 2) % 8."""
        if IS_K:
            c = _index(4, 2, L4, 4)
            o = 2 * c + 2
            sel_d = 0x1010 + 0x2222 * c  # d: bytes 2 c, 2 c + 1 of the first two words, twice
        else:
            o = (2 * (_index(8, 2, L4, 4) // 2) + 2) % 8
            sel_d = 0
        shift = gl.where(o >= 6, 0x7654, 0x3210)  # x_j = w_(j+1) past the first word and a half
        sel = gl.where(o % 4 == 0, gl.where((o == 4) | (o == 8), 0x7654, 0x3210), 0x5432)
        return shift, sel, sel_d

    @gluon.jit
    def _join8(r):
        """Results r[0] .. r[7] stacked on three new last axes: [.., m % 2, m / 2 % 2, m / 4]."""
        return gl.join(gl.join(gl.join(r[0], r[1]), gl.join(r[2], r[3])), gl.join(gl.join(r[4], r[5]),
                                                                              gl.join(r[6], r[7])))

    @gluon.jit
    def _ggml_values(main, tail, d, shift, sel, sel_d, LF: gl.constexpr, IS_K: gl.constexpr,
                     FMT: gl.constexpr):
        """A q8_0 / q4_0 tile's values q * d (fp16, [W, 16, 128] in LF) from its windows
        (_ggml_load) and the lanes' selectors (_ggml_selectors), through ggml_ptx, each lane's
        values where LF holds them (no data movement): K's block in order; V's half block h of
        block b in order for q8_0, for q4_0 the values 8 h .. 8 h + 7 then 16 + 8 h .. (the
        low and the high nibbles of its 8 bytes: _ggml_v_column)."""
        tail = gl.expand_dims(tail, 3)
        if FMT == "q8_0":
            ASM: gl.constexpr = _Q8_0_K_ASM if IS_K else _Q8_0_V_ASM
        else:
            ASM: gl.constexpr = _Q4_0_K_ASM if IS_K else _Q4_0_V_ASM
        N: gl.constexpr = 8 if FMT == "q8_0" else 16  # the asm's fp16 results
        if IS_K:
            args = (main, tail, shift, sel, sel_d)
        else:
            args = (main, tail, gl.expand_dims(d, 3), shift, sel)
        r = gl.inline_asm_elementwise(ASM[0], ASM[1], args, dtype=(gl.float16,) * N, is_pure=True,
                                      pack=main.shape[3])
        if FMT == "q8_0":
            # [W, 16, C, e, m % 2, m / 2 % 2, m / 4] (a join's axis is the last): quant E m + e
            x = gl.permute(_join8(r), [0, 1, 2, 6, 5, 4, 3])
        else:
            x = gl.join(_join8(r[:8]), _join8(r[8:]))  # [W, 16, C, E, t % 2, t / 2 % 2, t / 4 % 2, t / 8]
            if IS_K:  # result t = 4 k + s, element e: value 16 (s / 2) + 4 k + 2 (s % 2) + e
                x = gl.permute(x, [0, 1, 2, 5, 7, 6, 4, 3])
            else:  # result t: value t of the lane's 16
                x = gl.permute(x, [0, 1, 2, 7, 6, 5, 4, 3])
        x = gl.reshape(x, [x.shape[0], x.shape[1], 128])
        return gl.convert_layout(x, LF, assert_trivial=True)

    @gluon.jit
    def _ggml_v_column(m, FMT: gl.constexpr):
        """The head-dim column of row m of O^T = V^T P^T (A operand order: logical m = 16 t + 8 h + g
        is register j = 2 t + h of lane group g): 16 g + j, for q4_0 V 32 (g / 2) + 8 (g % 2) + j % 8
        + 16 (j / 8) (_ggml_values)."""
        g = m % 8
        j = 2 * (m // 16) + (m // 8) % 2
        if FMT == "q4_0":
            col = 32 * (g // 2) + 8 * (g % 2) + j % 8 + 16 * (j // 8)
        else:
            col = 16 * g + j
        return col

    @gluon.jit(do_not_specialize=["num_blocks"])
    def _mha_decode(Q, K, V, BlockTable, ContextLens, Out, Lse, Order, qk_scale_log2, max_blocks, num_blocks,
                    stride_qb, stride_qh, stride_kblk, stride_kpos, stride_kh,
                    stride_vblk, stride_vpos, stride_vh, stride_btb,
                    stride_ob, stride_oh, stride_lseb, stride_lseh,
                    BLOCK_N: gl.constexpr, D: gl.constexpr, BLOCK_D: gl.constexpr, PAGE: gl.constexpr,
                    EVICT: gl.constexpr, SORT_N: gl.constexpr):
        """One program per (head, sequence); the loop of decode._mha_fma_loop over whole pages.
        A head dim D below BLOCK_D reads its padding columns as zeros."""
        W: gl.constexpr = gl.num_warps()
        LC: gl.constexpr = BLOCK_D // 8  # lanes per row
        LP: gl.constexpr = 32 // LC  # rows per warp and register
        R: gl.constexpr = BLOCK_N // (LP * W)
        gl.static_assert(LC * LP == 32 and R >= 1 and D <= BLOCK_D and BLOCK_N % PAGE == 0)
        # Triton's blocked layout of the op's [BLOCK_N, BLOCK_D] tile ([1, 8] per thread, [LP, LC]
        # lanes, [W, 1] warps), with the row split into (register repeat, warp, lane group)
        L4: gl.constexpr = gl.BlockedLayout([1, 1, 1, 8], [1, 1, LP, LC], [1, W, 1, 1], [3, 2, 1, 0])
        ROWS: gl.constexpr = gl.SliceLayout(3, L4)  # per-row values, one copy per thread
        pid_h = gl.program_id(0)
        pid_b = gl.program_id(1)
        # row n of a tile (token start + n) sits at (n // (LP W), (n // LP) % W, n % LP)
        tok0 = _index(R, 0, L4, 3) * (LP * W) + _index(W, 1, L4, 3) * LP + _index(LP, 2, L4, 3)
        d4 = _index(BLOCK_D, 3, L4, 4)
        cols = d4 < D  # the head dim's columns (all of them when D == BLOCK_D)
        bt = BlockTable + pid_b.to(gl.int64) * stride_btb
        k_base = K + pid_h.to(gl.int64) * stride_kh
        v_base = V + pid_h.to(gl.int64) * stride_vh

        # the first tile's entries are loaded with the length, not after it (clamped to the
        # table's width); its rows past the end are masked (the sequence may be empty). Its loads
        # keep the default L1 policy: with EVICT as well, 2-4% slower at 1k-2k tokens (7% faster
        # at 64: decode._KNOBS, kv_evict_first)
        if SORT_N > 0:  # the pages in address order (_sorted_table) before the first tile's loads
            order = Order + (pid_b.to(gl.int64) * gl.num_programs(0) + pid_h) * SORT_N
            bt = _sorted_table(bt, order, 0, _context_len(ContextLens, pid_b, max_blocks * PAGE)[0], max_blocks,
                               PAGE, SORT_N)
        page = gl.load(bt + gl.minimum(tok0 // PAGE, max_blocks - 1))
        n_ctx, lens_ok = _context_len(ContextLens, pid_b, max_blocks * PAGE)
        last = gl.maximum(n_ctx - 1, 0)  # the last token (token 0 of an empty sequence: never read)
        last_block = (num_blocks - 1).to(gl.uint32)
        q = gl.load(Q + pid_b.to(gl.int64) * stride_qb + pid_h * stride_qh + d4, mask=cols,
                    other=0.0).to(gl.float32) * qk_scale_log2
        in_page = tok0 % PAGE
        first = gl.expand_dims(tok0 < n_ctx, 3) & cols  # & cols: the row mask over the tile
        # the largest block id used, one per slot of a thread (its R slots reduced in registers)
        page, used = _safe_pages(gl.where(tok0 < n_ctx, page, 0), last_block)
        top = gl.max(used, 0, keep_dims=True)
        k_next = gl.load(k_base + gl.expand_dims(page * stride_kblk + in_page * stride_kpos, 3) + d4,
                         mask=first, other=0.0)
        v_next = gl.load(v_base + gl.expand_dims(page * stride_vblk + in_page * stride_vpos, 3) + d4,
                         mask=first, other=0.0)
        page = gl.load(bt + gl.minimum(tok0 + BLOCK_N, last) // PAGE)

        m_r = gl.full([R, W, LP], float("-inf"), gl.float32, ROWS)
        l_r = gl.zeros([R, W, LP], gl.float32, ROWS)
        acc = gl.zeros([R, W, LP, BLOCK_D], gl.float32, L4)
        for start in range(0, n_ctx, BLOCK_N):
            k = k_next
            v = v_next
            # the next tile into registers while this one is computed; its rows past the end
            # read the last token's row (real, no mask; their scores are -inf), and the block
            # table is read one tile further ahead, never past the sequence's last entry
            tok = gl.minimum(start + BLOCK_N + tok0, last)
            page, used = _safe_pages(page, last_block)
            top = gl.maximum(top, gl.max(used, 0, keep_dims=True))
            k_next = _load_cols(k_base + gl.expand_dims(page * stride_kblk + (tok % PAGE) * stride_kpos, 3) + d4,
                                cols, D, BLOCK_D, EVICT)
            v_next = _load_cols(v_base + gl.expand_dims(page * stride_vblk + (tok % PAGE) * stride_vpos, 3) + d4,
                                cols, D, BLOCK_D, EVICT)
            page = gl.load(bt + gl.minimum(start + 2 * BLOCK_N + tok0, last) // PAGE)

            s = gl.sum(k.to(gl.float32) * q, 3)
            s = gl.where(start + tok0 < n_ctx, s, float("-inf"))
            m_new = gl.maximum(m_r, s)
            m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)  # a slot with no token yet
            alpha = gl.exp2(m_r - m_safe)
            p = gl.exp2(s - m_safe)
            l_r = l_r * alpha + p
            acc = acc * gl.expand_dims(alpha, 3) + v.to(gl.float32) * gl.expand_dims(p, 3)
            m_r = m_new

        l_r = gl.where((top <= last_block) & lens_ok, l_r, float("nan"))  # a bad table: NaN row
        # the merge: the R slots of a thread in registers, [1, W, LP, BLOCK_D] states in L4 (one
        # per warp and lane group), then those W LP states through shared memory behind one
        # barrier, each thread merging the states of one column. m and l are stored for every
        # column, so that no two threads store the same element (the per-row values that the LC
        # lanes of a row share made write-write hazards in compute-sanitizer's racecheck)
        m_w, l_w, acc_w = _merge_states(gl.expand_dims(m_r, 3), gl.expand_dims(l_r, 3), acc, 0)
        cols_of = gl.zeros([1, W, LP, BLOCK_D], gl.float32, L4)
        smem: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [3, 2, 1, 0])
        acc_s = gl.allocate_shared_memory(gl.float32, [1, W, LP, BLOCK_D], smem)
        m_s = gl.allocate_shared_memory(gl.float32, [1, W, LP, BLOCK_D], smem)
        l_s = gl.allocate_shared_memory(gl.float32, [1, W, LP, BLOCK_D], smem)
        acc_s.store(acc_w)
        m_s.store(m_w + cols_of)
        l_s.store(l_w + cols_of)
        _cta_barrier()
        COLS: gl.constexpr = gl.BlockedLayout([1, W, LP, 1], [1, 1, 1, 32], [1, 1, 1, W], [3, 2, 1, 0])
        m, l, acc_row = _merge_states(m_s.load(COLS), l_s.load(COLS), acc_s.load(COLS), 2)
        m, l, acc_row = _merge_states(m, l, acc_row, 1)  # [1, 1, 1, BLOCK_D]
        seen = l != 0.0  # context_len 0: out 0, lse -inf (no 0/0); a NaN l: NaN out and lse
        l_safe = gl.where(seen, l, 1.0)
        col = _index(BLOCK_D, 3, COLS, 4)
        gl.store(Out + pid_b.to(gl.int64) * stride_ob + pid_h * stride_oh + col,
                 (acc_row / l_safe).to(Out.dtype.element_ty), mask=col < D)
        # back from log2 to natural log: lse = (m + log2 l) * ln 2; every column holds it, column 0 stores
        lse = gl.where(seen, (m + gl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
        gl.store(Lse + pid_b * stride_lseb + pid_h * stride_lseh + col * 0,
                 lse + gl.zeros([1, 1, 1, BLOCK_D], gl.float32, COLS), mask=col == 0)

    @gluon.jit
    def _vec3(n: gl.constexpr, axis: gl.constexpr, LAY: gl.constexpr):
        """arange(0, n) along ``axis`` of a rank-3 layout, size 1 along the other two."""
        if axis == 0:
            x = gl.arange(0, n, gl.SliceLayout(1, gl.SliceLayout(2, LAY)))
            x = gl.expand_dims(gl.expand_dims(x, 1), 2)
        elif axis == 1:
            x = gl.arange(0, n, gl.SliceLayout(0, gl.SliceLayout(2, LAY)))
            x = gl.expand_dims(gl.expand_dims(x, 0), 2)
        else:
            x = gl.arange(0, n, gl.SliceLayout(0, gl.SliceLayout(1, LAY)))
            x = gl.expand_dims(gl.expand_dims(x, 0), 1)
        return x

    @gluon.constexpr_function
    def _warp_rows(keys, warps):
        """[warps, keys / warps]: row w in warp w, keys / warps / 32 consecutive ones a lane."""
        return gl.BlockedLayout([1, keys // warps // 32], [1, 32], [warps, 1], [1, 0])

    @gluon.constexpr_function
    def _thread_rows(warps):
        """[warps, n]: the warps rows of a column in one thread's registers."""
        return gl.BlockedLayout([warps, 1], [1, 32], [1, warps], [0, 1])

    @gluon.constexpr_function
    def _log2(n):
        return n.bit_length() - 1

    @gluon.jit
    def _sort_index(N: gl.constexpr):
        """0 .. N - 1 as [W, N / W] in _warp_rows (row-major: row w holds w N / W ..)."""
        W: gl.constexpr = gl.num_warps()
        LA: gl.constexpr = _warp_rows(N, W)
        row = gl.expand_dims(gl.arange(0, W, gl.SliceLayout(1, LA)), 1)
        col = gl.expand_dims(gl.arange(0, N // W, gl.SliceLayout(0, LA)), 0)
        return row * (N // W) + col

    @gluon.jit
    def _sort_keys(x, N: gl.constexpr):
        """The N int32 keys of x ([W, N / W] in _warp_rows) in ascending row-major order. Each warp
        sorts its row (bitonic_ptx), then log2 W levels of a bitonic merge double the sorted
        runs: the steps between rows on the rows a thread holds (rows_merge_ptx, after a layout
        conversion through shared memory), the steps within a row back in the warp
        (bitonic_ptx, merge_only). The runs a level merges in descending order are negated
        around it, so that every network sorts ascending (a permutation whatever the keys)."""
        W: gl.constexpr = gl.num_warps()
        P: gl.constexpr = N // W
        LA: gl.constexpr = _warp_rows(N, W)
        row = gl.expand_dims(gl.arange(0, W, gl.SliceLayout(1, LA)), 1)
        for level in gl.static_range(0, _log2(W) + 1):  # level l > 0 merges runs of 2^(l - 1) rows
            down = ((row >> level) % 2) == 1  # runs this level leaves descending (none at the last)
            x = gl.where(down, -x, x)
            if level > 0:
                x = gl.convert_layout(x, _thread_rows(W))
                x = gl.inline_asm_elementwise(rows_merge_ptx(W, 1 << (level - 1)), asm_constraints(W), [x],
                                              dtype=gl.int32, is_pure=True, pack=W)
                x = gl.convert_layout(x, LA)
            x = gl.inline_asm_elementwise(bitonic_ptx(P, level > 0), asm_constraints(P // 32), [x],
                                          dtype=gl.int32, is_pure=True, pack=P // 32)
            x = gl.where(down, -x, x)
        return x

    @gluon.jit
    def _sorted_table(bt, order, lo, hi, max_blocks, PAGE: gl.constexpr, SORT_N: gl.constexpr):
        """The split [lo, hi)'s table entries in ``order`` (SORT_N int32 of scratch), all but the
        last in ascending order of address, and the pointer that indexes them by token as ``bt``
        does. The last page keeps its place: it may be partial, and the scores' masks are
        positional. The warps sort the entries together (_sort_keys); one barrier, then any
        thread reads any entry. Positions past the split hold the table's (clamped) entries."""
        i = _sort_index(SORT_N)
        table = gl.load(bt + gl.minimum(lo // PAGE + i, max_blocks - 1))
        sortable = gl.cdiv(hi - lo, PAGE) - 1  # the split's pages but the last
        keys = _sort_keys(gl.where(i < sortable, table, 0x7FFFFFFF), SORT_N)
        gl.store(order + i, gl.where(i < sortable, keys, table))
        _cta_barrier()
        return order - lo // PAGE

    @gluon.jit
    def _hide_unseen_nonfinite(p, v, seen, MMA: gl.constexpr):
        """P^T [W, 16 keys, R rows] and V [W, 16 keys, D] of a tile whose rows see different keys,
        as decode's _hide_unseen_nonfinite: 0 x a V of inf or NaN must not reach a row that does not
        see its key. Such a V row becomes 0, and the rows that see it get P = NaN there; the P of a
        key a row does not see is 0 (not 0 x an int8 row scale of inf)."""
        v_ok = gl.abs(v.to(gl.float32)) < float("inf")
        bad = gl.max(gl.where(v_ok, 0, 1), 2)
        bad = gl.expand_dims(gl.convert_layout(bad, gl.SliceLayout(2, MMA)), 2)
        p = gl.where(seen, gl.where(bad != 0, float("nan"), p), 0.0)
        return p, gl.where(v_ok, v, 0.0).to(v.dtype)

    @gluon.jit(do_not_specialize=["num_splits", "num_blocks", "window_left"])
    def _gqa_decode(Q, K, V, BlockTable, ContextLens, Out, Lse, PartM, PartL, PartAcc, Order, KScales, VScales,
                    Sinks, Slopes, KeyStart, qk_scale_log2, max_blocks, num_splits, num_blocks, window_left,
                    softcap_log2,
                    stride_qb, stride_qh, stride_kblk, stride_kpos, stride_kh,
                    stride_vblk, stride_vpos, stride_vh, stride_btb,
                    stride_ob, stride_oh, stride_lseb, stride_lseh,
                    stride_pmb, stride_pmh, stride_pms, stride_pab, stride_pah, stride_pas,
                    stride_ksblk, stride_kspos, stride_ksh, stride_vsblk, stride_vspos, stride_vsh, stride_slb,
                    WINDOW: gl.constexpr, SOFTCAP: gl.constexpr, SINKS: gl.constexpr, ALIBI: gl.constexpr,
                    KEY_START: gl.constexpr, GROUP: gl.constexpr, QUERY_ROWS: gl.constexpr, PAGE: gl.constexpr,
                    EVICT: gl.constexpr, SPLIT: gl.constexpr,
                    SORT_N: gl.constexpr, K_FMT: gl.constexpr, V_FMT: gl.constexpr, AHEAD: gl.constexpr,
                    MMA: gl.constexpr, KL: gl.constexpr, VL: gl.constexpr, KF: gl.constexpr, VF: gl.constexpr,
                    K4: gl.constexpr, V4: gl.constexpr, QL: gl.constexpr, CL: gl.constexpr):
        """One program per (KV head, sequence). Each of the W warps owns 16 keys of every 16 W-key tile
        and runs its own flash attention on them with mma.sync (m16n8k16), transposed so that the
        keys fill the mma's 16 rows and the group's query rows its n columns (8, or 16 for groups
        past 8): S_w^T = K_w Q^T, acc_w^T += V_w^T P_w^T, its own (m, l, acc) in registers, no
        exchange between warps in the loop; the W states merge once after it, through shared memory
        behind one barrier. With the rows as the mma's rows, a group of up to 8 would pad them to 16:
        twice the mma work, the accumulator and the q operand. P^T reaches the B operand through
        warp shuffles. K and V are loaded AHEAD tiles ahead (gqa_tiles_ahead) into
        registers laid out for the mma operands: S sums over d, so the operand's k index may stand for
        any column of K as long as q's does too (logical k = 16 s + 8 h + 2 c + e is column 32 c + 4 s
        + 2 h + e: each lane loads 64 contiguous bytes of a K row), and the rows of V^T P^T may be
        permuted as long as the store undoes it (logical m = 16 t + 8 h + g is column 16 g + 2 t + h:
        32 contiguous bytes of a V row). The reshapes and permutes that name those orders move no
        data (assert_trivial).

        Quantized K/V (K_FMT / V_FMT, decode_plan.GQA_QUANTIZED): the same tiles of 1-byte
        values, loaded as 32-bit words in layouts that hold each word where its values go (half
        the registers), become fp16 after the load (_words_to_f16: exact); q8_0 / q4_0 rows, loaded as
        8-byte units around the block (K) or half block (V) each lane holds (K4, V4; KL and VL
        their lane slices), become q * d in the same places (_ggml_values). int8's row scales,
        read a tile ahead in the scores' layout, multiply the fp32 scores (K) and p before its
        fp16 rounding (V), as the Triton kernel applies them; fp8's one scale per tensor
        multiplies the score scale (K) and the state's acc at the end (V). The mma with quantized
        values is fp16's: a bf16 q enters it scaled per row by a power of two (_fp16_rows), P in fp16.

        The variants (WINDOW, SOFTCAP, ALIBI, SINKS, KEY_START) as decode's kernel applies them,
        with its functions: the softcap and ALiBi on each warp's scores (score_variants), the sink
        once in the single pass (join_sink; with splits, the reduce kernel's); the splits of a
        window or a key start begin at the first key. QUERY_ROWS > 1: column c is causal row
        c % QUERY_ROWS of its head, at position length - QUERY_ROWS + c % QUERY_ROWS, with its own
        cut, window and ALiBi distances; a tile whose rows see different keys hides V's inf and NaN
        from the rows that do not see them."""
        W: gl.constexpr = gl.num_warps()
        D: gl.constexpr = 128
        BLOCK_N: gl.constexpr = 16 * W
        R: gl.constexpr = 8 if GROUP <= 8 else 16  # the query rows: the mma's n, what the merge exchanges
        A_L: gl.constexpr = gl.DotOperandLayout(0, MMA, 2)
        B_L: gl.constexpr = gl.DotOperandLayout(1, MMA, 2)
        ROWS: gl.constexpr = gl.SliceLayout(1, MMA)  # per (warp, query row)
        pid_h = gl.program_id(0)
        pid_b = gl.program_id(1)
        pid_s = gl.program_id(2)
        bt = BlockTable + pid_b.to(gl.int64) * stride_btb
        k_base = K + pid_h.to(gl.int64) * stride_kh
        v_base = V + pid_h.to(gl.int64) * stride_vh
        # this split's tokens [lo, hi): the table's bound cut into num_splits chunks of whole
        # tiles, as decode's kernel cuts it (early_pages): the first entries need no length. A
        # window or a key start cuts [the first key, length) instead (the length first): a
        # window's at most window_left + 1 keys whatever the length, a key start's the rest of its
        # sequence, from the first key on (a row's page is looked up per token)
        LATE_START: gl.constexpr = WINDOW or KEY_START
        gl.static_assert(not ((LATE_START or ALIBI or QUERY_ROWS > 1) and SORT_N > 0),
                         "the page sort moves keys: no positional variant, no query rows")
        if LATE_START:
            n_ctx, lens_ok = _context_len(ContextLens, pid_b, max_blocks * PAGE)
            if KEY_START:  # at most the window's keys where both are on
                first_key = gl.minimum(gl.maximum(gl.load(KeyStart + pid_b), 0), n_ctx)
                if WINDOW:
                    first_key = gl.maximum(first_key, n_ctx - QUERY_ROWS - window_left)
                span = n_ctx - first_key
            else:  # the first row's window
                first_key = gl.maximum(n_ctx - QUERY_ROWS - window_left, 0)
                span = gl.minimum(max_blocks * PAGE, window_left + QUERY_ROWS)
            chunk = gl.cdiv(gl.cdiv(span, num_splits), BLOCK_N) * BLOCK_N
            lo = first_key + pid_s * chunk
        else:
            chunk = gl.cdiv(gl.cdiv(max_blocks * PAGE, num_splits), BLOCK_N) * BLOCK_N
            lo = pid_s * chunk

        # a tile's token offsets in the K and V layouts: warp w holds keys 16 w .. 16 w + 15
        tok_k = lo + _vec3(W, 0, KL) * 16 + _vec3(16, 1, KL)
        # a row's columns in KL / VL: D values, D / 4 words of 1-byte values, or ggml's lane groups
        K_GGML: gl.constexpr = (K_FMT == "q8_0") or (K_FMT == "q4_0")
        V_GGML: gl.constexpr = (V_FMT == "q8_0") or (V_FMT == "q4_0")
        K_COLS: gl.constexpr = 4 if K_GGML else D // 4 if K_FMT != "" else D
        V_COLS: gl.constexpr = 8 if V_GGML else D // 4 if V_FMT != "" else D
        col_k = _vec3(K_COLS, 2, KL)
        tok_v = lo + _vec3(W, 0, VL) * 16 + _vec3(16, 1, VL)
        col_v = _vec3(V_COLS, 2, VL)
        # the first tile's entries are loaded with the length (clamped to the table's width); its
        # rows past the end are masked (the split may be empty). With SORT_N, all entries from
        # this program's sorted copy of the split's (_sorted_table), sorted before these loads
        if SORT_N > 0:
            order = Order + ((pid_s.to(gl.int64) * gl.num_programs(1) + pid_b) * gl.num_programs(0) + pid_h) * SORT_N
            n_sort = _context_len(ContextLens, pid_b, max_blocks * PAGE)[0]
            bt = _sorted_table(bt, order, lo, gl.minimum(lo + chunk, n_sort), max_blocks, PAGE, SORT_N)
        page_k = gl.load(bt + gl.minimum(tok_k // PAGE, max_blocks - 1))
        page_v = gl.load(bt + gl.minimum(tok_v // PAGE, max_blocks - 1))
        if not LATE_START:
            n_ctx, lens_ok = _context_len(ContextLens, pid_b, max_blocks * PAGE)
        hi = gl.minimum(lo + chunk, n_ctx)
        last = gl.maximum(hi - 1, 0)
        last_block = (num_blocks - 1).to(gl.uint32)

        # q^T in the operand's k order (see above); rows past the group are zeros
        k_q = _vec3(D, 1, QL)
        col_q = 32 * ((k_q // 2) % 4) + 4 * (k_q // 16) + 2 * ((k_q // 8) % 2) + k_q % 2
        row_q = _vec3(R, 2, QL)
        q = gl.load(Q + pid_b.to(gl.int64) * stride_qb + (pid_h * GROUP + row_q) * stride_qh + col_q
                    + _vec3(W, 0, QL) * 0, mask=(row_q < GROUP) & (col_q < D), other=0.0)
        if K_FMT != "" and Q.dtype.element_ty != gl.float16:  # bf16 q against fp16 K values
            q, q_inv = _fp16_rows(q.to(gl.float32))
            qk_scale_log2 = qk_scale_log2 * gl.expand_dims(gl.convert_layout(q_inv, ROWS), 1)
        q = gl.convert_layout(q, B_L)

        # K and V read the same entries: top follows K's (the masked rows use none)
        page_k, top = _safe_pages(gl.where(tok_k < hi, page_k, 0), last_block)
        page_v = gl.minimum(page_v.to(gl.uint32), last_block).to(gl.int32)
        if K_GGML:
            k_next, kt_next, _ = _ggml_load(k_base, page_k * stride_kblk + (tok_k % PAGE) * stride_kpos, col_k,
                                            (tok_k < hi) & (col_k < K_COLS), EVICT, K4, True, K_FMT)
            k_sel = _ggml_selectors(K4, True)
        else:
            k_next = gl.load(k_base + page_k * stride_kblk + (tok_k % PAGE) * stride_kpos + col_k,
                             mask=(tok_k < hi) & (col_k < K_COLS), other=0)
        if V_GGML:
            v_next, vt_next, vd_next = _ggml_load(v_base, page_v * stride_vblk + (tok_v % PAGE) * stride_vpos,
                                                  col_v, (tok_v < hi) & (col_v < V_COLS), EVICT, V4, False, V_FMT)
            v_sel = _ggml_selectors(V4, False)
        else:
            v_next = gl.load(v_base + page_v * stride_vblk + (tok_v % PAGE) * stride_vpos + col_v,
                             mask=(tok_v < hi) & (col_v < V_COLS), other=0)
        page_k = gl.load(bt + gl.minimum(BLOCK_N + tok_k, last) // PAGE)  # the second tile's
        page_v = gl.load(bt + gl.minimum(BLOCK_N + tok_v, last) // PAGE)

        key_s = _vec3(W, 0, MMA) * 16 + _vec3(16, 1, MMA)  # the key of each score row
        ROW_SCALES: gl.constexpr = (K_FMT == "int8") or (V_FMT == "int8")
        PV_T: gl.constexpr = gl.float16 if V_FMT != "" else V.dtype.element_ty  # V^T P^T's operand type
        if K_FMT == "fp8_e4m3":
            qk_scale_log2 = qk_scale_log2 * gl.load(KScales)
        if ROW_SCALES:
            # int8's row scales of the first tile (masked past the end, as its rows), then the
            # table entries of the second: the same one-tile-ahead chain as K's, in the scores' layout
            tok_s = lo + key_s
            page_s = gl.load(bt + gl.minimum(tok_s // PAGE, max_blocks - 1))
            page_s = gl.minimum(gl.where(tok_s < hi, page_s, 0).to(gl.uint32), last_block).to(gl.int32)
            ks_next = _row_scales(KScales, pid_h, page_s, tok_s % PAGE, tok_s < hi, stride_ksblk, stride_kspos,
                                  stride_ksh, K_FMT == "int8")
            vs_next = _row_scales(VScales, pid_h, page_s, tok_s % PAGE, tok_s < hi, stride_vsblk, stride_vspos,
                                  stride_vsh, V_FMT == "int8")
            page_s = gl.load(bt + gl.minimum(BLOCK_N + tok_s, last) // PAGE)
        if ALIBI:  # the group's slopes, in the log2 domain, per score row
            row_s = _vec3(R, 2, MMA)
            slopes = gl.load(Slopes + pid_b.to(gl.int64) * stride_slb + pid_h * GROUP + row_s, mask=row_s < GROUP,
                             other=0.0) * LOG2E
        else:
            slopes = 0.0
        split_a = lo  # the tiles [lo, split_a) and [split_b, hi) are those whose rows see different keys
        split_b = hi
        if QUERY_ROWS > 1:  # column c is row c % QUERY_ROWS of its head, at its own position
            row_pos = n_ctx - QUERY_ROWS + _vec3(R, 2, MMA) % QUERY_ROWS
            # the first tile with a key after the first row's (or a slot past the end), and with
            # a window the first whose keys the last row's window holds
            split_b = gl.minimum(lo + gl.maximum(n_ctx - QUERY_ROWS + 1 - lo, 0) // BLOCK_N * BLOCK_N, hi)
            if WINDOW:
                split_a = gl.minimum(lo + gl.cdiv(gl.maximum(n_ctx - 1 - window_left - lo, 0), BLOCK_N) * BLOCK_N, hi)
                split_b = gl.maximum(split_a, split_b)
        m_i = gl.full([W, R], float("-inf"), gl.float32, ROWS)
        l_i = gl.zeros([W, R], gl.float32, ROWS)
        acc = gl.zeros([W, D, R], gl.float32, MMA)  # O^T
        gl.static_assert(AHEAD == 1 or not ROW_SCALES, "int8's row scales are read one tile ahead only")
        if AHEAD == 2:
            # quantized tiles are a few registers a lane: the second tile in flight too. Its rows
            # past the end read the last token's row, as the loop's; the masked ones use no entry
            t_k = gl.minimum(BLOCK_N + tok_k, last)
            t_v = gl.minimum(BLOCK_N + tok_v, last)
            page_k, used = _safe_pages(page_k, last_block)
            top = gl.maximum(top, gl.where(BLOCK_N + tok_k < hi, used, 0))
            page_v = gl.minimum(page_v.to(gl.uint32), last_block).to(gl.int32)
            k_next2, kt_next2, v_next2, vt_next2, vd_next2 = _gqa_tile(
                k_base, v_base, page_k, page_v, t_k, t_v, col_k, col_v, stride_kblk, stride_kpos, stride_vblk,
                stride_vpos, PAGE, EVICT, K4, V4, K_FMT, V_FMT)
            page_k = gl.load(bt + gl.minimum(2 * BLOCK_N + tok_k, last) // PAGE)  # the third tile's
            page_v = gl.load(bt + gl.minimum(2 * BLOCK_N + tok_v, last) // PAGE)
        # with query rows, the tiles whose rows see different keys (a window's first ones, the last
        # rows' keys) run in their own loops (phases 0 and 2), which hide V's inf and NaN from the rows
        # that do not see them: a branch in one loop cost 18-35% (quantized-decode.md, "Query rows")
        for phase in gl.static_range(0 if QUERY_ROWS > 1 and WINDOW else 1, 3 if QUERY_ROWS > 1 else 2):
            if phase == 0:
                tiles_lo, tiles_hi = lo, split_a
            elif phase == 1:
                tiles_lo, tiles_hi = split_a, split_b
            else:
                tiles_lo, tiles_hi = split_b, hi
            for start in range(tiles_lo, tiles_hi, BLOCK_N):
                k = k_next
                v = v_next
                if K_GGML:
                    k_tail = kt_next
                if V_GGML:
                    v_tail = vt_next
                    v_d = vd_next
                if ROW_SCALES:
                    ks = ks_next
                    vs = vs_next
                # the tile AHEAD tiles on into registers while this one is computed (L1::evict_first:
                # see decode._KNOBS, kv_evict_first); rows past the end read the last token's row
                # (real, no mask; their scores are -inf); the block table one tile further ahead
                t_k = gl.minimum(start - lo + AHEAD * BLOCK_N + tok_k, last)
                t_v = gl.minimum(start - lo + AHEAD * BLOCK_N + tok_v, last)
                page_k, used = _safe_pages(page_k, last_block)
                top = gl.maximum(top, used)
                page_v = gl.minimum(page_v.to(gl.uint32), last_block).to(gl.int32)
                kn, ktn, vn, vtn, vdn = _gqa_tile(k_base, v_base, page_k, page_v, t_k, t_v, col_k, col_v, stride_kblk,
                                                  stride_kpos, stride_vblk, stride_vpos, PAGE, EVICT, K4, V4, K_FMT,
                                                  V_FMT)
                if AHEAD == 2:
                    k_next, kt_next, v_next, vt_next, vd_next = k_next2, kt_next2, v_next2, vt_next2, vd_next2
                    k_next2, kt_next2, v_next2, vt_next2, vd_next2 = kn, ktn, vn, vtn, vdn
                else:
                    k_next, kt_next, v_next, vt_next, vd_next = kn, ktn, vn, vtn, vdn
                page_k = gl.load(bt + gl.minimum(start - lo + (AHEAD + 1) * BLOCK_N + tok_k, last) // PAGE)
                page_v = gl.load(bt + gl.minimum(start - lo + (AHEAD + 1) * BLOCK_N + tok_v, last) // PAGE)
                if ROW_SCALES:
                    t_s = gl.minimum(start - lo + BLOCK_N + tok_s, last)
                    page_s = gl.minimum(page_s.to(gl.uint32), last_block).to(gl.int32)
                    ks_next = _row_scales(KScales, pid_h, page_s, t_s % PAGE, None, stride_ksblk, stride_kspos,
                                          stride_ksh, K_FMT == "int8")
                    vs_next = _row_scales(VScales, pid_h, page_s, t_s % PAGE, None, stride_vsblk, stride_vspos,
                                          stride_vsh, V_FMT == "int8")
                    page_s = gl.load(bt + gl.minimum(start - lo + 2 * BLOCK_N + tok_s, last) // PAGE)
                if K_GGML:
                    k = _ggml_values(k, k_tail, 0.0, k_sel[0], k_sel[1], k_sel[2], KF, True, K_FMT)
                elif K_FMT != "":
                    k = _words_to_f16(k, K_FMT, KF)
                if V_GGML:
                    v = _ggml_values(v, v_tail, v_d, v_sel[0], v_sel[1], v_sel[2], VF, False, V_FMT)
                elif V_FMT != "":
                    v = _words_to_f16(v, V_FMT, VF)

                # K [W, 16, (c, s, h, e)] -> the A operand [W, 16, (s, h, c, e)]
                ka = gl.permute(gl.reshape(k, [W, 16, 4, 8, 2, 2]), [0, 1, 3, 4, 2, 5])
                ka = gl.convert_layout(gl.reshape(ka, [W, 16, D]), A_L, assert_trivial=True)
                s = mma_v2(ka, q, gl.zeros([W, 16, R], gl.float32, MMA)) * qk_scale_log2  # S^T: keys x rows
                key = start + key_s
                if K_FMT == "int8":
                    s = s * ks
                if QUERY_ROWS > 1:  # each row's causal cut, window and distances
                    s = score_variants(s, slopes, row_pos - key, softcap_log2, SOFTCAP, ALIBI)
                    seen = (key < hi) & (key <= row_pos)
                    if WINDOW:
                        seen = seen & (key >= row_pos - window_left)
                    s = gl.where(seen, s, float("-inf"))
                else:
                    s = score_variants(s, slopes, n_ctx - 1 - key, softcap_log2, SOFTCAP, ALIBI)
                    s = gl.where(key < hi, s, float("-inf"))
                m_new = gl.maximum(m_i, gl.max(s, 1))
                m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)  # a warp with no key yet
                alpha = gl.exp2(m_i - m_safe)
                p = gl.exp2(s - gl.expand_dims(m_safe, 1))
                l_i = l_i * alpha + gl.sum(p, 1)
                m_i = m_new
                if V_FMT == "int8":
                    p = p * vs
                if phase != 1:
                    p, v = _hide_unseen_nonfinite(p, v, seen, MMA)
                pb = gl.convert_layout(p.to(PV_T), B_L)  # P^T, the B operand: lanes exchange its rows
                # V [W, 16, (g, t, h)] -> the A operand V^T [W, (t, h, g), 16]
                va = gl.permute(gl.reshape(v, [W, 16, 8, 8, 2]), [0, 3, 4, 2, 1])
                va = gl.convert_layout(gl.reshape(va, [W, D, 16]), A_L, assert_trivial=True)
                acc = acc * gl.expand_dims(alpha, 1)
                acc = mma_v2(va, pb, acc)

        tables_ok = (gl.max(gl.max(gl.max(top, 2), 1), 0) <= last_block) & lens_ok
        # the warps' states through shared memory behind one barrier
        acc_s = gl.allocate_shared_memory(gl.float32, [W, R, D], gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0]))
        m_s = gl.allocate_shared_memory(gl.float32, [W, R], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        l_s = gl.allocate_shared_memory(gl.float32, [W, R], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        acc_s.store(gl.permute(acc, [0, 2, 1]))
        m_s.store(m_i)
        l_s.store(l_i)
        _cta_barrier()
        m_w = gl.expand_dims(m_s.load(gl.SliceLayout(2, CL)), 2)
        l_w = gl.expand_dims(l_s.load(gl.SliceLayout(2, CL)), 2)
        m = gl.max(m_w, 0, keep_dims=True)
        w = gl.exp2(m_w - gl.where(m == float("-inf"), 0.0, m))  # all empty: no inf - inf
        l = gl.sum(l_w * w, 0, keep_dims=True)
        l = gl.where(tables_ok, l, float("nan"))  # a bad table: NaN rows
        o = gl.sum(acc_s.load(CL) * w, 0, keep_dims=True)  # [1, R, D]
        if V_FMT == "fp8_e4m3":
            o = o * gl.load(VScales)
        row = _vec3(R, 1, CL)
        if SINKS and not SPLIT:  # the sink joins the normalizer once, here (splits: in the reduce kernel)
            m, l, alpha = join_sink(m, l, gl.load(Sinks + pid_h * GROUP + row, mask=row < GROUP, other=0.0) * LOG2E)
            o = o * alpha
        n = _vec3(D, 2, CL)
        col = _ggml_v_column(n, V_FMT)  # the output column of logical column n
        if SPLIT:
            # the unnormalized state (an empty split stores (-inf, 0, 0)) for the reduce kernel
            heads = pid_b.to(gl.int64) * stride_pmb + (pid_h * GROUP + row) * stride_pmh + pid_s * stride_pms
            first = (row < GROUP) & (n == 0)
            gl.store(PartM + heads + n * 0, m + gl.zeros([1, R, D], gl.float32, CL), mask=first)
            gl.store(PartL + heads + n * 0, l + gl.zeros([1, R, D], gl.float32, CL), mask=first)
            gl.store(PartAcc + pid_b.to(gl.int64) * stride_pab + (pid_h * GROUP + row) * stride_pah
                     + pid_s * stride_pas + col, o, mask=(row < GROUP) & (n < D))
            return
        seen = l != 0.0  # context_len 0: out 0, lse -inf (no 0/0); a NaN l: NaN out and lse
        l_safe = gl.where(seen, l, 1.0)
        gl.store(Out + pid_b.to(gl.int64) * stride_ob + (pid_h * GROUP + row) * stride_oh + col,
                 (o / l_safe).to(Out.dtype.element_ty), mask=(row < GROUP) & (n < D))
        # back from log2 to natural log; every column holds it, column 0 stores
        lse = gl.where(seen, (m + gl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
        gl.store(Lse + pid_b * stride_lseb + (pid_h * GROUP + row) * stride_lseh + n * 0,
                 lse + gl.zeros([1, R, D], gl.float32, CL), mask=(row < GROUP) & (n == 0))
