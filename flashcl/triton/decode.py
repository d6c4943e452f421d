"""Paged-KV decode (flash-decoding) in Triton, registered as the torch op ``flashcl::decode``.

One new query token per sequence attends over its KV cache. Two cache layouts, one kernel:

    q        (B, H_q, DK)
    paged    k_cache (num_blocks, PAGE_SIZE, H_kv, DK)   v_cache (num_blocks, PAGE_SIZE, H_kv, DV)
             block_table (B, max_blocks) int32, context_lens (B,) int32       (vLLM layout)
    contig.  k_cache (B, H_kv, N_max, DK)                v_cache (B, H_kv, N_max, DV)
             context_lens (B,) int32 or None (= N_max)
    out      (B, H_q, DV) in the input dtype          lse (B, H_q) float32, natural log

A contiguous cache is the paged kernel with one "block chain" per sequence: the row of token t of
sequence b is ``b * stride_kblk + t * stride_kpos`` instead of ``block_table[b, t // PAGE_SIZE] *
stride_kblk + (t % PAGE_SIZE) * stride_kpos`` -- the same strides, no copy into pages. Where the
plan of a contiguous cache's paged view (``_as_pages``: blocks of its own rows) is the Gluon GQA
kernel, which reads pages only, that kernel reads the view.

Work decomposition (grid = (H_kv, B, splits))::

    program (b, h_kv, s):  Q tile = the GQA group of h_kv, padded to BLOCK_G >= 16 rows for tl.dot
                           KV tokens [s * chunk, (s + 1) * chunk) of sequence b, BLOCK_N at a time
         tokens ->   | tile 0 | tile 1 | ... |            chunk = ceil(bound / splits), whole tiles,
                                                          clipped to the sequence's context_len
         each K/V row is read once for the whole group (GQA/MQA reuse in registers)

    splits == 1: the program normalizes and writes out/lse itself (single pass).
    splits  > 1: it writes the unnormalized state (m, l, acc) in fp32 (log2 domain for m), and the
                 splits are merged exactly, in one of two ways (see "fused_reduce" below): by the
                 last split program of each (b, h_kv) to finish (fused), or by ``_reduce_kernel``
                 (grid (cdiv(H_q, 4), B)) launched after the decode kernel. A split that lies past the
                 sequence's end writes the empty state (-inf, 0, 0), a no-op of the merge.

Attention variants (flashcl.variants; each a tl.constexpr flag, off: the plain kernel). The query
of sequence b sits at p = context_lens[b] - 1. ``window`` (left, right) shows it the keys
[max(0, p - left), p]: the split partition then cuts [that key rounded down to a page, length),
at most left + one page of tokens whatever the length, so the cost follows the window; the
loads of a windowed launch are row-masked (a hidden row's K/V never reach the row). ``softcap``
and ``alibi_slopes`` ((B, H_q)) change the scores (score_variants); ``sinks`` join the
normalizer once: in the single pass, else as the merge's starting state (both merges).
``key_start`` (B,) (decode's, beside the variants) hides each sequence's keys before
key_start[b]: the partition cuts [the later of that key and the window's first, length) as a
window's does. The Gluon GQA kernel takes them the same way, except that its splits cut [the
first key, length) unrounded (it looks up each row's page); the Gluon MHA kernel takes none, and
the plan runs such launches on this kernel (decode_plan.VARIANTS). ``QUERY_ROWS`` (a decode's
rows; prefill's route for few query rows, prefill._rows_as_decode) makes head h causal row
h % QUERY_ROWS of its sequence's last positions, with its own causal cut, window and ALiBi
distances; the Gluon GQA kernel takes them the same way (its columns), a row mask only this one.

Quantized caches (flashcl.quant: q8_0, q4_0, int8, fp8_e4m3; K and V each in its own format or
plain): the op takes a QuantizedTensor's data in place of the cache, its format and scales; the
dot path dequantizes each tile after its load (_load_quant): ggml blocks with their fp16 d, int8 /
fp8 values exactly in q's type with their scale applied per key to the scores (K) or to p (V).
int8 and fp8 rows on 4-byte boundaries are read as 32-bit words (_load_words: pipelined loads, no
byte gather) turned into fp16 by byte permutes (quant_words) where q is fp16. q4_0 K and V with
such rows are read in stored order, their blocks' scales applied on stacked rows of the dots
(ggml_stored; BLOCK_G is then the group's rows per block). q8_0 reads its values as byte pairs,
or in stored order under float32 q at head dim 128 (decode_plan.stored_order). With float32 q,
int8 / fp8 / stored q4_0 and q8_0 tiles stay bf16 (their values exactly) and q and p enter the
dots as three bf16 parts (K_PARTS / V_PARTS, quant_words.dot). The plan keeps quantized caches
off the MHA loop (decode_plan.QUANTIZED); where it gives the Gluon GQA kernel a launch, that
kernel also reads every format with fp16 q (decode_plan.GQA_QUANTIZED).
docs/notes/quantized-decode.md has the measurements.

The launch plan (which kernel, tile, split count and merge) is ``decode_plan.plan`` of the shapes
(max_blocks * PAGE_SIZE bounds the context) and the device's facts, never of context_lens values:
the launch path does no host sync and is CUDA-graph capturable.

Nothing the tables hold can make a kernel read or write out of bounds, and they are never read
back: a context length outside [0, bound] reads no key, a block id outside [0, num_blocks) is
clamped into the cache where it is used (_clamp_pages, then _pages_in_cache; entries past a
sequence's end are never used, so never checked), and either makes that sequence's out and lse
NaN, the other sequences untouched. Keys past context_lens[b] never reach the row, whatever their K/V hold: their scores
are selected away (tl.where) and their V rows read as zeros or as a real row of the sequence. A
row whose q or a visible K holds NaN/inf gets NaN out and lse (its l is NaN, never taken for 0).

Launch knobs (``decode_plan._KNOBS``: keys of ``plan``'s / ``_launch``'s ``config``, next to
BLOCK_N, num_warps and num_stages; benchmarks force them on or off, the op uses the defaults):

    early_pages   (default on) the split partition comes from the context bound, so the first
                  block-table load does not wait for the context_lens load. Off: chunk =
                  ceil(context_len / splits), the per-sequence length split evenly.
    fused_reduce  (default: on for 2..4 splits) the last split program of each (b, h_kv) to finish
                  merges the partials, counted in an int32 workspace per (device, stream) kept
                  at zero: no second kernel. A workspace first needed inside a CUDA-graph capture
                  is zeroed by a memset recorded in the graph.
    pdl           (default: on from 2 splits; sm_90+ only) programmatic dependent launch.
    merge_stages  software-pipeline depth of the fused merge's loop over the splits (3).
    whole_pages   (default on; paged, early_pages, BLOCK_N a multiple of the block size) the
                  in-page row offsets are hoisted out of the loop, offsets are 32-bit when every
                  element of the cache is within 2^31 of its start, and the rows of a tile past the
                  sequence's end point at the tile's first row (a real one) instead of being
                  masked: no K/V load mask, and no block-table entry past the end is ever used.
                  Blocks larger than the tile (BLOCK_N dividing the block size, e.g. 256-token
                  blocks) take the same path as tiles inside one page (PAGE_TILES): one
                  block-table entry per tile instead of one per row.
    mha_fma       (default: MHA with 2-byte K/V and more programs than SMs, head dims 65..128,
                  and up to 64 where the Gluon kernel takes the launch; needs whole_pages) the
                  K/V loop of a one-query-row program on CUDA cores, the next tile loaded into
                  registers while this one is computed (``_mha_fma_loop``), instead of tl.dot on
                  a 16-row padded Q tile behind a shared-memory ring.
    gluon_mha     (default on) the MHA loop's one-split launches of head dims <= 128 run as the
                  Gluon kernel of ``decode_gluon`` where it fits: the same loop, the row slots
                  merged without Triton's cross-warp reductions (about 1 us less per launch).
    kv_evict_first (default on) the MHA loops' in-loop K/V loads into registers (mha_fma,
                  gluon_mha, gluon_gqa) are marked L1::evict_first: +0.5-4.5% on H100.
    gluon_gqa     (default: groups of 4 to 8, head dim 128, at the kernel's own split count of
                  two programs per SM where that gives 1.5 programs per SM or more and splits of
                  1024 tokens or more; int8, fp8 and q4_0 K and V then run three per SM,
                  capped at 168 registers) the GQA kernel of ``decode_gluon``; split launches
                  are merged by ``_reduce_kernel``.
    gqa_programs_per_sm (default: decode_plan.GQA_PROGRAMS_PER_SM) the GQA kernel's programs per
                  SM: its split count and, past two, its register cap.
    sort_pages    (default on) the Gluon kernels (gluon_mha, gluon_gqa) visit the pages of
                  splits of 256 to 1024 pages in ascending order of address, sorted in the kernel
                  into an int32 scratch array per program (``decode_gluon.sort_size``): +1.2% at
                  (8, 32/32, 8k) and +1.3% at (1, 32/8, 128k) on H100. Not with a window or ALiBi
                  (the sort moves keys, whose positions those read).

``decode_plan`` holds the rules for the automatic ones; docs/notes/decode-h100.md the measurements.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch
import triton
import triton.language as tl
from triton.language.extra import cuda as tl_cuda

from ..quant import QuantizedTensor
from . import (FLOAT32_DOTS, decode_gluon, decode_plan, ggml_stored, interpreting, on_device_of, quant_words,
               skips_dispatcher)
from .decode_plan import DecodePlan, DecodeProblem, DeviceFacts, _next_pow2, facts_of
from .score_variants import _LOG2E, LOG2E, MASK_HIDES_AT, join_sink, score_variants

# --------------------------------------------------------------------------- kernels


# num_splits, the context bound and the block count vary from call to call: no recompilation for
# their values
@triton.jit(do_not_specialize=["n_ctx_max", "num_splits", "num_blocks", "window_left"])
def _decode_kernel(
    Q, K, V, BlockTable, ContextLens, Out, Lse, PartM, PartL, PartAcc, Counters, Sinks, Slopes, KeyStart,
    RowMask, MaskWords, KScales, VScales, qk_scale_log2, n_ctx_max, num_splits, num_blocks, window_left,
    softcap_log2,
    stride_qb, stride_qh, stride_qd,
    stride_kblk, stride_kpos, stride_kh, stride_kd,
    stride_vblk, stride_vpos, stride_vh, stride_vd,
    stride_btb, stride_btn,
    stride_ob, stride_oh, stride_od,
    stride_lseb, stride_lseh,
    stride_pmb, stride_pmh, stride_pms,
    stride_pab, stride_pah, stride_pas, stride_pad,
    stride_slb, stride_rmb, stride_rmh, stride_rmq, stride_rmk, stride_mwb, stride_mwh,
    stride_ksblk, stride_kspos, stride_ksh, stride_vsblk, stride_vspos, stride_vsh,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
    DK: tl.constexpr, DV: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
    PAGED: tl.constexpr, HAS_LENS: tl.constexpr, SPLIT: tl.constexpr, UPCAST_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    # the launch knobs (see _KNOBS)
    EARLY_PAGES: tl.constexpr = False, USE_PDL: tl.constexpr = False,
    FUSED: tl.constexpr = False, MERGE_STAGES: tl.constexpr = 3, BLOCK_GM: tl.constexpr = 1,
    WHOLE_PAGES: tl.constexpr = False, OFFS32: tl.constexpr = False, MHA_FMA: tl.constexpr = False,
    PAGE_TILES: tl.constexpr = False, KV_EVICT: tl.constexpr = "",
    # the attention variants (flashcl.variants; off: the plain kernel)
    WINDOW: tl.constexpr = False, SOFTCAP: tl.constexpr = False, SINKS: tl.constexpr = False,
    ALIBI: tl.constexpr = False, KEY_START: tl.constexpr = False,
    # quantized K / V (flashcl.quant formats; "": plain), dequantized after the load
    K_FMT: tl.constexpr = "", V_FMT: tl.constexpr = "",
    # int8 / fp8 K / V read as aligned 32-bit words (_load_words); CVT_ASM: quantized bytes become
    # fp16 through PTX byte permutes (quant_words), not per-element casts
    K_WORDS: tl.constexpr = False, V_WORDS: tl.constexpr = False, CVT_ASM: tl.constexpr = False,
    # float32 q against int8 / fp8 / stored q4_0 and q8_0 K or V: their tiles in bf16, q or p in
    # three bf16 parts (quant_words.dot)
    K_PARTS: tl.constexpr = False, V_PARTS: tl.constexpr = False,
    # ggml K and V read in stored order, their blocks on stacked rows (ggml_stored; BLOCK_G is then
    # the group's rows per block); TAIL_K / TAIL_V: the positions of a row past its head dim;
    # STORED_ALIGN: the 32-bit words every row starts on (the loads' width)
    STORED: tl.constexpr = False, TAIL_K: tl.constexpr = 16, TAIL_V: tl.constexpr = 16,
    STORED_ALIGN: tl.constexpr = 1,
    # > 1: query head h is causal row h % QUERY_ROWS of its sequence's last positions (a prefill
    # of few rows run as this decode, prefill._rows_as_decode): its own causal cut, window and
    # ALiBi distances
    QUERY_ROWS: tl.constexpr = 1,
    # prefill's mask on that route: 1 bool, 2 additive; MASK_PER_KEY: the group reads one row of it
    # (it hides keys); else bool as MaskWords (bit g % WORD_ROWS: group row g), additive per row
    # (query head h is row h % QUERY_ROWS of prefill's head h // QUERY_ROWS)
    ROW_MASK: tl.constexpr = 0, MASK_PER_KEY: tl.constexpr = False, WORD_ROWS: tl.constexpr = 1,
):
    tl.static_assert(MHA_FMA or STORED or BLOCK_G >= 16, "tl.dot needs at least 16 rows: pad the GQA group")
    tl.static_assert(BLOCK_G >= GROUP)
    tl.static_assert(BLOCK_DK >= DK and BLOCK_DV >= DV)
    tl.static_assert(BLOCK_N >= 16)
    tl.static_assert((PAGE_SIZE & (PAGE_SIZE - 1)) == 0, "page size must be a power of two")
    tl.static_assert(not MHA_FMA or (PAGED and WHOLE_PAGES and GROUP == 1), "MHA_FMA: MHA over whole pages")
    tl.static_assert(not PAGE_TILES or (PAGED and EARLY_PAGES and PAGE_SIZE % BLOCK_N == 0),
                     "PAGE_TILES: tiles inside one page")
    tl.static_assert((K_FMT == "" and V_FMT == "") or not MHA_FMA, "quantized K/V: the dot path")
    # the group's rows see different keys
    ROWS_DIFFER: tl.constexpr = QUERY_ROWS > 1 or (ROW_MASK != 0 and not MASK_PER_KEY)
    tl.static_assert(not ROWS_DIFFER or not (MHA_FMA or STORED), "query rows: the dot path")
    tl.static_assert(ROW_MASK == 0 or not (MHA_FMA or STORED), "a mask: the dot path")
    tl.static_assert(not MASK_PER_KEY or (ROW_MASK != 0 and QUERY_ROWS == 1), "one mask row for the group")
    tl.static_assert(GROUP % QUERY_ROWS == 0, "a query head's rows lie in one group")

    if USE_PDL:  # programmatic dependent launch: nothing global is touched before the wait
        tl_cuda.gdc_wait()
        tl_cuda.gdc_launch_dependents()

    # the KV heads of one sequence are adjacent in launch order: they read the same pages at the
    # same time (one page holds every head's rows), which keeps DRAM accesses local
    pid_h = tl.program_id(0)
    pid_b = tl.program_id(1)
    pid_s = tl.program_id(2)

    offs_g = tl.arange(0, BLOCK_G)
    offs_n = tl.arange(0, BLOCK_N)
    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_g = offs_g < GROUP
    heads = pid_h * GROUP + offs_g  # query heads of this KV head's group
    bt_base = BlockTable + pid_b.to(tl.int64) * stride_btb

    # this split's tokens [lo, hi): the context cut into num_splits chunks of whole tiles (empty
    # past the end). EARLY_PAGES cuts the context bound instead of the length, so the first
    # block-table load is issued without waiting for the context_lens load (one dependent DRAM
    # round trip less before the K/V stream starts); same partition when every sequence has the
    # bound length. A window or a key start cuts [the first key, length) instead, which needs the
    # length first, the first key rounded down to ALIGN (tiles of whole pages start on a page, a
    # tile inside a page on a tile; other addressings start anywhere), so the first tile holds the
    # first key and no tile is wholly hidden: a window's at most window_left + ALIGN tokens
    # whatever the length, a key start's the rest of its sequence.
    LATE_START: tl.constexpr = WINDOW or KEY_START  # keys before first_key are hidden
    if EARLY_PAGES and not LATE_START:
        chunk = tl.cdiv(tl.cdiv(n_ctx_max, num_splits), BLOCK_N) * BLOCK_N
        lo = pid_s * chunk
        page, page_lo = _early_entries(bt_base, lo, offs_n, n_ctx_max, stride_btn, PAGE_SIZE, PAGED, WHOLE_PAGES,
                                       PAGE_TILES)
    if HAS_LENS:
        n_ctx = tl.load(ContextLens + pid_b)
    else:
        n_ctx = n_ctx_max
    # device tables are never read back: a length outside [0, bound] reads no key, and it or a
    # block id outside the cache (clamped at use, checked after the loop) makes the rows NaN
    tables_ok = (n_ctx >= 0) & (n_ctx <= n_ctx_max)
    n_ctx = tl.where(tables_ok, n_ctx, 0)
    last_block = (num_blocks - 1).to(tl.uint32)
    first_key = 0  # the first key the query (position n_ctx - 1) sees
    if LATE_START:
        ALIGN: tl.constexpr = BLOCK_N if PAGE_TILES else (PAGE_SIZE if WHOLE_PAGES else 1)
        span = n_ctx_max
        if WINDOW:  # the first row's window (the query's, QUERY_ROWS 1)
            first_key = tl.maximum(n_ctx - QUERY_ROWS - window_left, 0)
            span = tl.minimum(n_ctx_max, window_left + QUERY_ROWS - 1 + ALIGN)
        if KEY_START:  # at most the window's span where both are on; none past the end
            first_key = tl.maximum(first_key, tl.minimum(tl.load(KeyStart + pid_b), n_ctx))
            span = tl.where(first_key < n_ctx, n_ctx - (first_key // ALIGN) * ALIGN, 0)
        chunk = tl.cdiv(tl.cdiv(span, num_splits), ALIGN) * ALIGN
        lo = (first_key // ALIGN) * ALIGN + pid_s * chunk
        if EARLY_PAGES:
            page, page_lo = _early_entries(bt_base, lo, offs_n, n_ctx_max, stride_btn, PAGE_SIZE, PAGED,
                                           WHOLE_PAGES, PAGE_TILES)
    elif not EARLY_PAGES:
        chunk = tl.cdiv(tl.cdiv(n_ctx, num_splits), BLOCK_N) * BLOCK_N
        lo = pid_s * chunk
    hi = tl.minimum(lo + chunk, n_ctx)
    if PAGED and WHOLE_PAGES:
        page = tl.where(lo + offs_n < hi, page, page_lo)

    k_base = K + pid_h.to(tl.int64) * stride_kh
    v_base = V + pid_h.to(tl.int64) * stride_vh
    if PAGED:
        first_entries = _first_entries(bt_base, lo, hi, stride_btn, PAGE_SIZE)

    # the block-table entries of the first tile (already loaded with EARLY_PAGES); the loop fetches
    # those of the next tile one iteration ahead, so the K/V addresses do not wait on a load of the
    # same iteration
    if PAGED and not EARLY_PAGES:
        page = tl.load(bt_base + ((lo + offs_n) // PAGE_SIZE) * stride_btn, mask=lo + offs_n < hi, other=0)
    if WHOLE_PAGES:
        # every tile starts on a page boundary: a row's offset inside its page is loop-invariant
        in_page_k = (offs_n % PAGE_SIZE) * stride_kpos
        in_page_v = (offs_n % PAGE_SIZE) * stride_vpos
        in_page_ks = (offs_n % PAGE_SIZE) * stride_kspos  # int8's row scales (unused otherwise)
        in_page_vs = (offs_n % PAGE_SIZE) * stride_vspos
    if MHA_FMA:
        # one query row: CUDA cores, K/V in registers one tile ahead (see _mha_fma_loop)
        q_row = Q + pid_b.to(tl.int64) * stride_qb + pid_h * stride_qh + offs_dk * stride_qd
        slope = 0.0
        if ALIBI:
            slope = tl.load(Slopes + pid_b.to(tl.int64) * stride_slb + pid_h) * LOG2E
        m_i, l_i, acc = _mha_fma_loop(
            q_row, qk_scale_log2, k_base, v_base, bt_base, page, page_lo, in_page_k, in_page_v,
            lo, hi, n_ctx_max, last_block, stride_kblk, stride_kd, stride_vblk, stride_vd, stride_btn,
            BLOCK_N, DK, DV, BLOCK_DK, BLOCK_DV, PAGE_SIZE, OFFS32, KV_EVICT,
            first_key, n_ctx, softcap_log2, slope, LATE_START, SOFTCAP, ALIBI)
    else:
        # Q tile: the whole group; padding rows are zeros and are never stored
        if STORED:  # stacked per K block, in stored order; acc stacked per V block
            q, q_tail = ggml_stored.load_q(Q + pid_b.to(tl.int64) * stride_qb + heads * stride_qh, mask_g,
                                           stride_qd, DK, TAIL_K, K_FMT)
            acc = tl.zeros([DV // 32 * BLOCK_G, DV], dtype=tl.float32)
            acc_tail = tl.zeros([BLOCK_G, BLOCK_N, TAIL_V], dtype=tl.float32)
        else:
            q_ptrs = Q + pid_b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_dk[None, :] * stride_qd
            if BLOCK_DK == DK:
                q = tl.load(q_ptrs, mask=mask_g[:, None], other=0.0)
            else:
                q = tl.load(q_ptrs, mask=mask_g[:, None] & (offs_dk[None, :] < DK), other=0.0)
            acc = tl.zeros([BLOCK_G, BLOCK_DV], dtype=tl.float32)
        if UPCAST_DOT:
            q = q.to(tl.float32)
            if STORED:
                q_tail = q_tail.to(tl.float32)
        # the dequantized tiles' type (the interpreter's int8 -> bf16 casts reinterpret bits: float32 there)
        tl.static_assert(not K_PARTS or K_FMT == "int8" or K_FMT == "fp8_e4m3" or STORED, "K_PARTS: values bf16 holds")
        tl.static_assert(not V_PARTS or V_FMT == "int8" or V_FMT == "fp8_e4m3" or STORED, "V_PARTS: values bf16 holds")
        k_type = tl.bfloat16 if K_PARTS and not UPCAST_DOT else q.dtype
        v_type = tl.bfloat16 if V_PARTS and not UPCAST_DOT else q.dtype
        m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
        if ALIBI:  # the group's slopes, in the log2 domain
            slopes = tl.load(Slopes + pid_b.to(tl.int64) * stride_slb + heads, mask=mask_g, other=0.0) * LOG2E
        row_pos = n_ctx - QUERY_ROWS + offs_g % QUERY_ROWS  # each row's position (QUERY_ROWS > 1)
        if MASK_PER_KEY:  # the row of the group's first head, which every head reads
            key_mask_base = RowMask + pid_b.to(tl.int64) * stride_rmb + (pid_h * GROUP).to(tl.int64) * stride_rmh
        elif ROW_MASK == 1:  # the words of this KV head's group (or of every group: stride 0)
            word_base = MaskWords + pid_b.to(tl.int64) * stride_mwb + pid_h.to(tl.int64) * stride_mwh
            row_bit = tl.full([BLOCK_G], 1, MaskWords.dtype.element_ty) << (offs_g % WORD_ROWS)
        elif ROW_MASK == 2:  # each query head's row of the mask (GROUP is a multiple of QUERY_ROWS)
            row_mask_base = (RowMask + pid_b.to(tl.int64) * stride_rmb + (heads // QUERY_ROWS) * stride_rmh
                             + (offs_g % QUERY_ROWS) * stride_rmq)
        for start_n in range(lo, hi, BLOCK_N):
            tok = start_n + offs_n
            valid = tok < hi
            if LATE_START:  # the first tile may begin before the first key
                valid = valid & (tok >= first_key)
            if MASK_PER_KEY:  # a key the mask hides is not valid: its K/V rows are not read
                key_mask = tl.load(key_mask_base + tok * stride_rmk, mask=valid, other=0)
                valid = valid & ((key_mask != 0) if ROW_MASK == 1 else (key_mask > MASK_HIDES_AT))
            elif ROW_MASK == 1:  # and a key no row's mask shows (a padded sequence's)
                key_words = tl.load(word_base + tok, mask=valid, other=0)
                valid = valid & (key_words != 0)
            # locate each token's row: through the block table, or along the sequence's one chain
            if PAGED and WHOLE_PAGES:
                # a row past the end reads the tile's first row (a real one, whose page `page` holds
                # for it): the K/V loads need no row mask, and those rows' scores are -inf below
                page = _clamp_pages(page, last_block)
                row_k = _page_rows(page, valid, in_page_k, stride_kblk, OFFS32)
                row_v = _page_rows(page, valid, in_page_v, stride_vblk, OFFS32)
                srow_k = _page_rows(page, valid, in_page_ks, stride_ksblk, OFFS32)
                srow_v = _page_rows(page, valid, in_page_vs, stride_vsblk, OFFS32)
                # the next tile's entries, its rows past the end at its first token; clamped to the
                # bound, so the load after the last tile stays in the table too (its values go unused)
                nxt = tok + BLOCK_N
                page = _table_entries(bt_base, tl.where(nxt < hi, nxt, start_n + BLOCK_N), n_ctx_max, stride_btn,
                                      PAGE_SIZE)
            elif PAGED and PAGE_TILES:
                # the tile is BLOCK_N consecutive rows of one page; a row past the end reads the
                # tile's first row (a real one): no row mask, as with whole pages
                in_page = (start_n % PAGE_SIZE) + tl.where(valid, offs_n, 0)
                page = _clamp_pages(page, last_block)
                row_k = _page_rows(page, True, in_page * stride_kpos, stride_kblk, OFFS32)
                row_v = _page_rows(page, True, in_page * stride_vpos, stride_vblk, OFFS32)
                srow_k = _page_rows(page, True, in_page * stride_kspos, stride_ksblk, OFFS32)
                srow_v = _page_rows(page, True, in_page * stride_vspos, stride_vsblk, OFFS32)
                # the next tile's entry (one iteration ahead; past the end it goes unused)
                page = _table_entries(bt_base, start_n + BLOCK_N, n_ctx_max, stride_btn, PAGE_SIZE)
            elif PAGED:
                page = _clamp_pages(page, last_block)
                row_k = page.to(tl.int64) * stride_kblk + (tok % PAGE_SIZE) * stride_kpos
                row_v = page.to(tl.int64) * stride_vblk + (tok % PAGE_SIZE) * stride_vpos
                # the row scales of int8 K/V (unused otherwise)
                srow_k = page.to(tl.int64) * stride_ksblk + (tok % PAGE_SIZE) * stride_kspos
                srow_v = page.to(tl.int64) * stride_vsblk + (tok % PAGE_SIZE) * stride_vspos
                nxt = tok + BLOCK_N
                page = tl.load(bt_base + (nxt // PAGE_SIZE) * stride_btn, mask=nxt < hi, other=0)
            else:
                row_k = pid_b.to(tl.int64) * stride_kblk + tok.to(tl.int64) * stride_kpos
                row_v = pid_b.to(tl.int64) * stride_vblk + tok.to(tl.int64) * stride_vpos
                srow_k = pid_b.to(tl.int64) * stride_ksblk + tok.to(tl.int64) * stride_kspos
                srow_v = pid_b.to(tl.int64) * stride_vsblk + tok.to(tl.int64) * stride_vspos
            k_ptrs = k_base + row_k[:, None] + offs_dk[None, :] * stride_kd
            v_ptrs = v_base + row_v[:, None] + offs_dv[None, :] * stride_vd
            # with whole pages or tiles inside a page every row address is a real row: no row mask,
            # unless a window or key start hides some of them (their K/V may hold anything)
            mask_rows: tl.constexpr = (LATE_START or MASK_PER_KEY or ROW_MASK == 1
                                       or not (PAGED and (WHOLE_PAGES or PAGE_TILES)))
            if STORED:
                rows_ok = valid
                if not mask_rows:
                    rows_ok = tl.full(valid.shape, 1, tl.int1)
                # rows from the caches' starts (aligned), not from this head's (136 bytes at d = 128)
                row_k = row_k + pid_h * stride_kh
                row_v = row_v + pid_h * stride_vh
                k, k_tail = ggml_stored.tile(K, row_k, rows_ok, DK, TAIL_K, CVT_ASM, STORED_ALIGN, K_FMT)
                d_k = ggml_stored.scales(K, row_k, rows_ok, DK // 32, K_FMT)
                v, v_tail = ggml_stored.tile(V, row_v, rows_ok, DV, TAIL_V, CVT_ASM, STORED_ALIGN, V_FMT)
                d_v = ggml_stored.scales(V, row_v, rows_ok, DV // 32, V_FMT)
                s = ggml_stored.scores(q, q_tail, k.to(k_type), k_tail.to(q.dtype), d_k, BLOCK_G, K_PARTS,
                                       UPCAST_DOT, DOT_PRECISION) * qk_scale_log2
            else:
                k, k_scale = _load_kv(k_ptrs, k_base, row_k, KScales + pid_h.to(tl.int64) * stride_ksh + srow_k,
                                      offs_dk, valid, stride_kd, K_FMT, DK, BLOCK_DK, mask_rows, K_WORDS, CVT_ASM,
                                      k_type)
                v, v_scale = _load_kv(v_ptrs, v_base, row_v, VScales + pid_h.to(tl.int64) * stride_vsh + srow_v,
                                      offs_dv, valid, stride_vd, V_FMT, DV, BLOCK_DV, mask_rows, V_WORDS, CVT_ASM,
                                      v_type)
                if UPCAST_DOT:
                    k = k.to(tl.float32)
                    v = v.to(tl.float32)
                s = quant_words.dot(q, tl.trans(k), None, K_PARTS, UPCAST_DOT, DOT_PRECISION) * qk_scale_log2

            # scores in the log2 domain; tokens past the end are -inf
            if K_FMT == "int8" or K_FMT == "fp8_e4m3":
                s = s * k_scale[None, :]
            if ALIBI:
                if QUERY_ROWS > 1:
                    dist = row_pos[:, None] - tok[None, :]
                else:  # the query's: one row of distances for the group
                    dist = (n_ctx - 1 - tok)[None, :]
                s = score_variants(s, slopes[:, None], dist, softcap_log2, SOFTCAP, ALIBI)
            else:
                s = score_variants(s, 0.0, 0, softcap_log2, SOFTCAP, ALIBI)
            if ROWS_DIFFER:  # each row's causal cut, window and mask
                seen = valid[None, :] & (tok[None, :] <= row_pos[:, None])
                if WINDOW:
                    seen = seen & (tok[None, :] >= row_pos[:, None] - window_left)
                if ROW_MASK == 1:
                    seen = seen & ((key_words[None, :] & row_bit[:, None]) != 0)
                elif ROW_MASK == 2:  # additive: -inf (or any value at or below MASK_HIDES_AT) hides the key
                    row_mask = tl.load(row_mask_base[:, None] + tok[None, :] * stride_rmk,
                                       mask=mask_g[:, None] & valid[None, :], other=0)
                    seen = seen & (row_mask > MASK_HIDES_AT)
                    s = s + row_mask * LOG2E
                s = tl.where(seen, s, float("-inf"))
                # a row may see no key of a tile yet: shift it by 0, so exp2 gives 0, not NaN
                m_new = tl.maximum(m_i, tl.max(s, 1))
                m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.exp2(m_i - m_use)
                p = tl.exp2(s - m_use[:, None])
                l_i = l_i * alpha + tl.sum(p, 1)  # the scores' alone: a V of inf or NaN leaves lse as it is
                # only tiles with a key one row sees and another does not (or, loads unmasked, a
                # slot past the end) hide inf/NaN V (_hide_unseen_nonfinite); an additive mask's
                # tile checks every tile (in its layout the gate cost more: triton-prefill.md)
                if ROW_MASK == 2:
                    rows_disagree = 1
                else:
                    seen_by = tl.sum(tl.where(seen & mask_g[:, None], 1, 0), 0)
                    if mask_rows:  # keys not valid were read as zeros
                        rows_disagree = tl.max(tl.where(valid & (seen_by != GROUP), 1, 0), 0)
                    else:
                        rows_disagree = tl.max(tl.where(valid & (seen_by == GROUP), 0, 1), 0)
                if rows_disagree != 0:
                    p, v = _hide_unseen_nonfinite(p, v, seen)
                    if V_FMT == "int8" or V_FMT == "fp8_e4m3":
                        p, v_scale = _hide_unseen_nonfinite_scales(p, v_scale, seen)
            else:
                if MASK_PER_KEY and ROW_MASK == 2:
                    s = s + key_mask[None, :] * LOG2E
                s = tl.where(valid[None, :], s, float("-inf"))
                # online softmax: rescale acc to the new max (m_new is finite: each tile has a valid
                # token, unless a mask hides them all: then shift by 0, so exp2 gives 0, not NaN)
                m_new = tl.maximum(m_i, tl.max(s, 1))
                m_use = m_new
                if MASK_PER_KEY:
                    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.exp2(m_i - m_use)
                p = tl.exp2(s - m_use[:, None])
                l_i = l_i * alpha + tl.sum(p, 1)
            if STORED:  # d of rows past the end may be anything: 0 (their p is 0)
                acc, acc_tail = ggml_stored.accumulate(acc, acc_tail, alpha, p, tl.where(valid[None, :], d_v, 0.0),
                                                       v.to(v_type), v_tail.to(q.dtype), V_PARTS, UPCAST_DOT,
                                                       DOT_PRECISION)
            elif V_PARTS:
                acc = quant_words.dot(p * v_scale[None, :], v, acc * alpha[:, None], True, UPCAST_DOT, DOT_PRECISION)
            elif V_FMT == "int8" or V_FMT == "fp8_e4m3":
                acc = acc * alpha[:, None] + tl.dot((p * v_scale[None, :]).to(v.dtype), v,
                                                    input_precision=DOT_PRECISION)
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new

    if PAGED:
        tables_ok = tables_ok & _pages_in_cache(first_entries, bt_base, lo, hi, stride_btn, last_block, PAGE_SIZE)
    l_i = tl.where(tables_ok, l_i, float("nan"))

    if SPLIT:
        # unnormalized partial state; an empty split stores (-inf, 0, 0)
        pm_off = pid_b.to(tl.int64) * stride_pmb + heads * stride_pmh + pid_s * stride_pms
        tl.store(PartM + pm_off, m_i, mask=mask_g)
        tl.store(PartL + pm_off, l_i, mask=mask_g)
        if STORED:
            ggml_stored.store(PartAcc + pid_b.to(tl.int64) * stride_pab + heads * stride_pah + pid_s * stride_pas,
                              mask_g, stride_pad, acc, tl.sum(acc_tail, 1), DV, TAIL_V, V_FMT)
        else:
            pa_ptrs = (PartAcc + pid_b.to(tl.int64) * stride_pab + heads[:, None] * stride_pah
                       + pid_s * stride_pas + offs_dv[None, :] * stride_pad)
            tl.store(pa_ptrs, acc, mask=mask_g[:, None] & (offs_dv[None, :] < DV))
        if FUSED:
            # Fused reduce: the last split of (b, h_kv) to arrive merges all of them. Ordering (the
            # CUTLASS semaphore pattern): a CTA barrier orders every thread's partial stores before
            # the arrive, a gpu-scope acq_rel atomic by one thread (release: publishes this CTA's
            # stores; acquire: synchronizes with every earlier arrive, so the merger observes all
            # the other splits' stores); Triton broadcasts its result through shared memory behind
            # another barrier, which orders the merger's loads after the acquire (PTX causality is
            # transitive through bar.sync). The merger puts the counter back to 0: the workspace is
            # zero between launches (stream order), so CUDA-graph replays need no memset.
            tl.debug_barrier()
            cnt_ptr = Counters + pid_b * tl.num_programs(0) + pid_h
            arrived = tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu")
            if arrived == num_splits - 1:
                tl.atomic_xchg(cnt_ptr, 0, sem="relaxed", scope="gpu")
                _merge_group(PartM, PartL, PartAcc, Out, Lse, Sinks, pid_b, pid_h * GROUP, num_splits,
                             stride_pmb, stride_pmh, stride_pms, stride_pab, stride_pah, stride_pas, stride_pad,
                             stride_ob, stride_oh, stride_od, stride_lseb, stride_lseh,
                             GROUP, BLOCK_GM, DV, BLOCK_DV, MERGE_STAGES, SINKS)
    else:
        if SINKS:  # the sink joins the normalizer once, here (split launches: in the merge)
            m_i, l_i, alpha = join_sink(m_i, l_i, tl.load(Sinks + heads, mask=mask_g, other=0.0) * LOG2E)
            if STORED:
                acc = acc * ggml_stored.stack(alpha, DV // 32)[:, None]
                acc_tail = acc_tail * alpha[:, None, None]
            else:
                acc = acc * alpha[:, None]
        # context_len 0: out 0, lse -inf (no 0/0); a NaN l (NaN/inf in q or a seen K, a bad
        # table) is not 0: out and lse NaN
        seen = l_i != 0.0
        l_safe = tl.where(seen, l_i, 1.0)
        if STORED:
            l_rows = ggml_stored.stack(l_safe, DV // 32)[:, None]
            ggml_stored.store(Out + pid_b.to(tl.int64) * stride_ob + heads * stride_oh, mask_g, stride_od,
                              acc / l_rows, tl.sum(acc_tail, 1) / l_safe[:, None], DV, TAIL_V, V_FMT)
        else:
            out = acc / l_safe[:, None]
            o_ptrs = Out + pid_b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_dv[None, :] * stride_od
            tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=mask_g[:, None] & (offs_dv[None, :] < DV))
        # back from log2 to natural log: lse = (m + log2 l) * ln 2
        lse = tl.where(seen, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
        tl.store(Lse + pid_b.to(tl.int64) * stride_lseb + heads * stride_lseh, lse, mask=mask_g)


@triton.jit
def _hide_unseen_nonfinite(p, v, seen):
    """P and V of a tile whose rows see different keys: 0 x a V of inf or NaN must not reach a row
    that does not see its key; such a V row becomes 0, and a row that sees it gets P = NaN there
    (its output NaN; in a tile every row sees whole, the plain P V gives inf or NaN)."""
    v_ok = tl.abs(v.to(tl.float32)) < float("inf")
    key_bad = tl.max(tl.where(v_ok, 0, 1), 1)
    p = tl.where(seen & (key_bad[None, :] != 0), float("nan"), p)
    return p, tl.where(v_ok, v, 0.0).to(v.dtype)


@triton.jit
def _hide_unseen_nonfinite_scales(p, v_scale, seen):
    """As _hide_unseen_nonfinite for V's row scales (int8 / fp8): a scale of inf or NaN becomes 0,
    and the rows that see its key get P = NaN there."""
    scale_ok = tl.abs(v_scale) < float("inf")
    return tl.where(seen & ~scale_ok[None, :], float("nan"), p), tl.where(scale_ok, v_scale, 0.0)


@triton.jit
def _load_kv(ptrs, base, row, scale_ptrs, offs_d, valid, stride_d, FMT: tl.constexpr, D: tl.constexpr,
             BLOCK_D: tl.constexpr, MASK_ROWS: tl.constexpr, WORDS: tl.constexpr, CVT_ASM: tl.constexpr, DTYPE):
    """A K or V tile and its row scales (1 unless int8 / fp8): plain rows at ``ptrs`` (_load_rows),
    or a quantized tile (_load_quant) in ``DTYPE``, q's type."""
    if FMT == "":
        x = _load_rows(ptrs, valid, offs_d, D, BLOCK_D, MASK_ROWS, "")
        row_scale = 1.0
    else:
        x, row_scale = _load_quant(base, row, scale_ptrs, offs_d, valid, stride_d, FMT, D, BLOCK_D, MASK_ROWS, WORDS,
                                   CVT_ASM)
        x = x.to(DTYPE)
    return x, row_scale


@triton.jit
def _load_quant(base, row, scale_ptrs, offs_d, valid, stride_d, FMT: tl.constexpr, D: tl.constexpr,
                BLOCK_D: tl.constexpr, MASK_ROWS: tl.constexpr, WORDS: tl.constexpr, CVT_ASM: tl.constexpr):
    """A quantized K or V tile [BLOCK_N, BLOCK_D] (flashcl.quant's formats) as (values, row
    scales): rows ``row`` (element offsets of the data) of ``base``, rows past the end (``valid``
    false) and head-dim padding (>= D) zeros. q8_0 / q4_0: ggml blocks of 32 values, the fp16 d in
    the block's first two bytes, applied here (row scale 1). int8 / fp8_e4m3: the stored values,
    exact in any 16-bit float, and their scale per row at ``scale_ptrs`` (fp8's one per tensor at
    every row), applied by the caller to the scores or to p: one multiply per key instead of one
    per element. Without MASK_ROWS every row address is a real row (whole pages, tiles inside a
    page) and the loads take no row mask; the caller selects those scores away. WORDS: the row as
    aligned 32-bit words (_load_words; int8 / fp8, D == BLOCK_D, rows on 4-byte boundaries); with
    CVT_ASM the values come back in fp16."""
    if not MASK_ROWS:
        valid = tl.full(valid.shape, 1, tl.int1)
    mask = valid[:, None] & (offs_d[None, :] < D)
    row_scale = 1.0
    if WORDS:
        x = _load_words(base, row, valid, FMT, D, CVT_ASM)
        row_scale = tl.load(scale_ptrs, mask=valid, other=0.0)
    elif FMT == "q8_0" or FMT == "q4_0":  # [rows, blocks]: each block's first byte
        BLOCK_BYTES: tl.constexpr = 34 if FMT == "q8_0" else 18
        blocks = tl.arange(0, BLOCK_D // 32)
        x = quant_words.ggml_blocks(base + row[:, None] + (blocks * BLOCK_BYTES)[None, :],
                                    valid[:, None] & (blocks[None, :] * 32 < D), FMT, CVT_ASM)
    else:
        tl.static_assert(FMT == "int8" or FMT == "fp8_e4m3", "quantized formats: q8_0, q4_0, int8, fp8_e4m3")
        ptrs = base + row[:, None] + offs_d[None, :] * stride_d
        if FMT == "int8":
            x = tl.load(ptrs, mask=mask, other=0)
        else:  # fp8 read as its bytes: a masked element is the byte 0 (+0.0)
            x = tl.load(ptrs.to(tl.pointer_type(tl.uint8), bitcast=True), mask=mask, other=0)
            x = x.to(tl.float8e4nv, bitcast=True)
        row_scale = tl.load(scale_ptrs, mask=valid, other=0.0)
    return x, row_scale


@triton.jit
def _load_words(base, row, valid, FMT: tl.constexpr, D: tl.constexpr, CVT_ASM: tl.constexpr):
    """An int8 or fp8 tile [BLOCK_N, D] read as 32-bit words (pipelined loads, rows 16 bytes at a
    time, in place of byte-wide shared-memory reads): rows ``row`` (byte offsets, multiples of 4)
    of ``base``, rows where ``valid`` is false zeros; the stored values, in order, fp16 through
    byte permutes with CVT_ASM (quant_words.values), else float32 (int8) or fp8 from casts."""
    words = base.to(tl.pointer_type(tl.int32), bitcast=True) + (row // 4)[:, None]
    w = tl.load(words + tl.arange(0, D // 4)[None, :], mask=valid[:, None], other=0)
    return quant_words.values(w, FMT, CVT_ASM)


@triton.jit
def _early_entries(bt_base, lo, offs_n, n_ctx_max, stride_btn, PAGE_SIZE: tl.constexpr, PAGED: tl.constexpr,
                   WHOLE_PAGES: tl.constexpr, PAGE_TILES: tl.constexpr):
    """(entries of the tile at ``lo``, entry of token ``lo``), loaded before the length is known
    (EARLY_PAGES); the second is used by whole pages only."""
    if PAGED and WHOLE_PAGES:
        # clamped to the bound, every entry read lies in the table; the entries of tokens past
        # this sequence's end are replaced by the first token's once the length is known
        page = _table_entries(bt_base, lo + offs_n, n_ctx_max, stride_btn, PAGE_SIZE)
        page_lo = _table_entries(bt_base, lo, n_ctx_max, stride_btn, PAGE_SIZE)
    elif PAGED and PAGE_TILES:
        # a tile lies inside one page: one entry per tile, clamped to the table's bound
        page = _table_entries(bt_base, lo, n_ctx_max, stride_btn, PAGE_SIZE)
        page_lo = page
    elif PAGED:
        page = tl.load(bt_base + ((lo + offs_n) // PAGE_SIZE) * stride_btn, mask=lo + offs_n < n_ctx_max, other=0)
        page_lo = page
    else:  # a contiguous cache has no table
        page = lo
        page_lo = lo
    return page, page_lo


@triton.jit
def _table_entries(bt_base, tok, n_ctx_max, stride_btn, PAGE_SIZE: tl.constexpr):
    """The block-table entries of tokens ``tok``, clamped to the table's bound (an entry past a
    sequence's end is read, never used as an address by whole-page tiles)."""
    return tl.load(bt_base + (tl.minimum(tok, n_ctx_max - 1) // PAGE_SIZE) * stride_btn)


@triton.jit
def _clamp_pages(page, last_block):
    """Block ids about to address the cache, clamped into it: one unsigned min (a negative id is
    huge). Whether any was out of it is checked after the loop (_pages_in_cache)."""
    return tl.minimum(page.to(tl.uint32), last_block).to(tl.int32)


@triton.jit
def _first_entries(bt_base, lo, hi, stride_btn, PAGE_SIZE: tl.constexpr):
    """The first 128 block-table entries of tokens [lo, hi), as unsigned ints (0 past the end):
    loaded before the K/V loop and checked after it (_pages_in_cache), so that their latency hides
    behind the loop instead of ending every program with a dependent round trip."""
    offs = tl.arange(0, 128)
    first = lo // PAGE_SIZE
    n_pages = tl.cdiv(hi, PAGE_SIZE)
    return tl.load(bt_base + (first + offs) * stride_btn, mask=first + offs < n_pages, other=0).to(tl.uint32)


@triton.jit
def _pages_in_cache(first_entries, bt_base, lo, hi, stride_btn, last_block, PAGE_SIZE: tl.constexpr):
    """Whether the block-table entries of tokens [lo, hi) all lie in [0, last_block]: the first 128
    (``first_entries``), then any beyond them (splits of more than 128 pages), read after the loop
    that clamped them rather than tracked in it: the loop keeps its registers and carries no flag."""
    offs = tl.arange(0, 128)
    top = first_entries
    n_pages = tl.cdiv(hi, PAGE_SIZE)
    for first in tl.range(lo // PAGE_SIZE + 128, n_pages, 128, num_stages=1):
        entry = tl.load(bt_base + (first + offs) * stride_btn, mask=first + offs < n_pages, other=0)
        top = tl.maximum(top, entry.to(tl.uint32))
    return tl.max(top, 0) <= last_block


@triton.jit
def _page_rows(page, valid, in_page, stride_blk, OFFS32: tl.constexpr):
    """Row offsets of a tile of whole pages: row ``in_page`` of ``page``; a row past the end
    (``valid`` false) at row 0 of its page entry, a real row, so the loads need no row mask. 32-bit
    only where the whole cache lies within 2^31 elements."""
    blk = page
    if not OFFS32:
        blk = page.to(tl.int64)
    return blk * stride_blk + tl.where(valid, in_page, 0)


@triton.jit
def _load_rows(ptrs, valid, offs_d, D: tl.constexpr, BLOCK_D: tl.constexpr, MASK_ROWS: tl.constexpr,
               EVICT: tl.constexpr):
    """A K or V tile [BLOCK_N, BLOCK_D]: rows past the end (``valid`` false) read as zeros when
    MASK_ROWS, head-dim columns of the padding (>= D) always. ``EVICT``: the loads' L1 eviction
    policy ("" or "evict_first"; Triton's async copies into shared memory ignore it)."""
    if MASK_ROWS:
        if BLOCK_D == D:
            tile = tl.load(ptrs, mask=valid[:, None], other=0.0, eviction_policy=EVICT)
        else:
            tile = tl.load(ptrs, mask=valid[:, None] & (offs_d[None, :] < D), other=0.0,
                           eviction_policy=EVICT)
    else:
        if BLOCK_D == D:
            tile = tl.load(ptrs, eviction_policy=EVICT)
        else:
            tile = tl.load(ptrs, mask=offs_d[None, :] < D, other=0.0, eviction_policy=EVICT)
    return tile


@triton.jit
def _mha_fma_loop(q_row, qk_scale_log2, k_base, v_base, bt_base, page, page_lo, in_page_k, in_page_v,
                  lo, hi, n_ctx_max, last_block, stride_kblk, stride_kd, stride_vblk, stride_vd, stride_btn,
                  BLOCK_N: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                  BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, PAGE_SIZE: tl.constexpr,
                  OFFS32: tl.constexpr, KV_EVICT: tl.constexpr,
                  first_key, n_ctx, softcap_log2, slope, LATE_START: tl.constexpr, SOFTCAP: tl.constexpr,
                  ALIBI: tl.constexpr):
    """The K/V loop of an MHA program (one query row) over whole pages, on CUDA cores.

    tl.dot needs 16 rows (15 of them padding here) and takes K and V through shared memory in its
    operand layout; with one query row, q.k is a multiply and a sum over d and p.v a scaled add, in
    the layout the rows are loaded in. Without the shared-memory ring of the dot path, tile i+1's
    K/V loads are issued into registers before tile i is computed (register double buffering),
    and the block-table entries run one tile further ahead. Each row slot n of the tile keeps its
    own online-softmax state over the tokens it sees (n, n + BLOCK_N, ...), so the loop has no
    reduction across rows; the BLOCK_N states are merged once at the end.

    Rows past the end read row 0 of the split's first page (real; their scores are -inf); the
    first tile's rows past the end are masked instead, as the split may be empty. Returns (m, l,
    acc) of the program's one head, log2 domain, shaped as a group of one ([1], [1], [1,
    BLOCK_DV]; the launch sets BLOCK_G = 1) so that the kernel's epilogue stores it from the
    merge's own layout. Padded to the dot path's 16-row tile instead, the same output took 0.2%
    longer at (8, 32/32, 2k), 1.3% at 256 tokens and 3% at 64 (H100).

    Variants: the scores take the softcap and ALiBi (``slope`` log2 domain, query at n_ctx - 1);
    LATE_START (a window or a key start) hides the keys before ``first_key``, which only the first
    tile (masked) can hold, and masks the rows past the end too, whose stand-in row may be one of
    them."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = tl.load(q_row, mask=offs_dk < DK, other=0.0).to(tl.float32) * qk_scale_log2

    valid = lo + offs_n < hi
    if LATE_START:
        valid = valid & (lo + offs_n >= first_key)
    page = _clamp_pages(page, last_block)
    row_k = _page_rows(page, valid, in_page_k, stride_kblk, OFFS32)
    row_v = _page_rows(page, valid, in_page_v, stride_vblk, OFFS32)
    # the first tile's loads keep the default L1 policy; only the loop's are KV_EVICT (see _KNOBS)
    k_next = _load_rows(k_base + row_k[:, None] + offs_dk[None, :] * stride_kd, valid, offs_dk, DK, BLOCK_DK,
                        True, "")
    v_next = _load_rows(v_base + row_v[:, None] + offs_dv[None, :] * stride_vd, valid, offs_dv, DV, BLOCK_DV,
                        True, "")
    page = _table_entries(bt_base, lo + BLOCK_N + offs_n, n_ctx_max, stride_btn, PAGE_SIZE)

    m_r = tl.full([BLOCK_N], float("-inf"), dtype=tl.float32)
    l_r = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc_r = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    for start_n in range(lo, hi, BLOCK_N):
        k = k_next
        v = v_next
        valid = start_n + offs_n < hi
        # the next tile's loads; after the last tile they read the first page's row 0 (unused)
        tok_next = start_n + BLOCK_N + offs_n
        valid_next = tok_next < hi
        page = _clamp_pages(tl.where(valid_next, page, page_lo), last_block)
        row_k = _page_rows(page, valid_next, in_page_k, stride_kblk, OFFS32)
        row_v = _page_rows(page, valid_next, in_page_v, stride_vblk, OFFS32)
        k_next = _load_rows(k_base + row_k[:, None] + offs_dk[None, :] * stride_kd, valid_next, offs_dk, DK,
                            BLOCK_DK, LATE_START, KV_EVICT)
        v_next = _load_rows(v_base + row_v[:, None] + offs_dv[None, :] * stride_vd, valid_next, offs_dv, DV,
                            BLOCK_DV, LATE_START, KV_EVICT)
        page = _table_entries(bt_base, tok_next + BLOCK_N, n_ctx_max, stride_btn, PAGE_SIZE)

        s = tl.sum(k.to(tl.float32) * q[None, :], 1)
        s = score_variants(s, slope, n_ctx - 1 - (start_n + offs_n), softcap_log2, SOFTCAP, ALIBI)
        if LATE_START:
            valid = valid & (start_n + offs_n >= first_key)
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m_r, s)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a slot with no token yet
        alpha = tl.exp2(m_r - m_safe)
        p = tl.exp2(s - m_safe)
        l_r = l_r * alpha + p
        acc_r = acc_r * alpha[:, None] + v.to(tl.float32) * p[:, None]
        m_r = m_new

    m = tl.max(m_r, 0)
    w = tl.exp2(m_r - tl.where(m == float("-inf"), 0.0, m))
    l = tl.sum(l_r * w, 0)
    acc = tl.sum(acc_r * w[:, None], 0, keep_dims=True)
    return m + tl.zeros([1], tl.float32), l + tl.zeros([1], tl.float32), acc


@triton.jit
def _merge_group(PartM, PartL, PartAcc, Out, Lse, Sinks, pid_b, head0, num_splits,
                 stride_pmb, stride_pmh, stride_pms, stride_pab, stride_pah, stride_pas, stride_pad,
                 stride_ob, stride_oh, stride_od, stride_lseb, stride_lseh,
                 GROUP: tl.constexpr, BLOCK_GM: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr,
                 MERGE_STAGES: tl.constexpr, SINKS: tl.constexpr = False):
    """Exact merge of the num_splits partial states of query heads [head0, head0 + GROUP) of
    sequence pid_b: an online merge, one split per iteration ([GROUP, DV] fp32 tile), the loads
    software-pipelined MERGE_STAGES deep (independent of the running state). SINKS: the merge
    starts from the sinks' state (m = sink, l = 1, acc = 0) instead of the empty one."""
    offs_gm = tl.arange(0, BLOCK_GM)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_gm = offs_gm < GROUP
    mask_a = mask_gm[:, None] & (offs_dv[None, :] < DV)
    heads = head0 + offs_gm
    pm_ptrs = PartM + pid_b.to(tl.int64) * stride_pmb + heads * stride_pmh
    pl_ptrs = PartL + pid_b.to(tl.int64) * stride_pmb + heads * stride_pmh
    pa_ptrs = (PartAcc + pid_b.to(tl.int64) * stride_pab + heads[:, None] * stride_pah
               + offs_dv[None, :] * stride_pad)
    if SINKS:
        m = tl.load(Sinks + heads, mask=mask_gm, other=0.0) * LOG2E
        l = tl.full([BLOCK_GM], 1.0, dtype=tl.float32)
    else:
        m = tl.full([BLOCK_GM], float("-inf"), dtype=tl.float32)
        l = tl.zeros([BLOCK_GM], dtype=tl.float32)
    acc = tl.zeros([BLOCK_GM, BLOCK_DV], dtype=tl.float32)
    for s in tl.range(0, num_splits, num_stages=MERGE_STAGES):
        m_s = tl.load(pm_ptrs + s * stride_pms, mask=mask_gm, other=float("-inf"), cache_modifier=".cg")
        l_s = tl.load(pl_ptrs + s * stride_pms, mask=mask_gm, other=0.0, cache_modifier=".cg")
        a_s = tl.load(pa_ptrs + s * stride_pas, mask=mask_a, other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m, m_s)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # both empty: no inf - inf
        w_old = tl.exp2(m - m_safe)
        w_s = tl.exp2(m_s - m_safe)
        l = l * w_old + l_s * w_s
        acc = acc * w_old[:, None] + a_s * w_s[:, None]
        m = m_new
    seen = l != 0.0  # a NaN l stays NaN: out and lse NaN
    l_safe = tl.where(seen, l, 1.0)
    o_ptrs = Out + pid_b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_dv[None, :] * stride_od
    tl.store(o_ptrs, (acc / l_safe[:, None]).to(Out.dtype.element_ty), mask=mask_a)
    lse = tl.where(seen, (m + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    tl.store(Lse + pid_b.to(tl.int64) * stride_lseb + heads * stride_lseh, lse, mask=mask_gm)


@triton.jit(do_not_specialize=["num_splits"])
def _reduce_kernel(
    PartM, PartL, PartAcc, Out, Lse, Sinks,
    num_splits, num_heads,
    stride_pmb, stride_pmh, stride_pms,
    stride_pab, stride_pah, stride_pas, stride_pad,
    stride_ob, stride_oh, stride_od,
    stride_lseb, stride_lseh,
    DV: tl.constexpr, BLOCK_DV: tl.constexpr, HEADS: tl.constexpr, CHUNK_S: tl.constexpr,
    USE_PDL: tl.constexpr = False, SINKS: tl.constexpr = False,
):
    """Exact merge of the split states of HEADS adjacent query heads of one sequence (grid
    (cdiv(H_q, HEADS), B)): out = sum_s w_s acc_s / sum_s w_s l_s with w_s = exp2(m_s - max m).
    One pass, CHUNK_S splits at a time, merged online across chunks: up to CHUNK_S splits cost one
    round trip to memory, not two (max, then sums). The last chunk is padded with the empty-state
    sentinel (m = -inf, l = 0, acc = 0), so any split count works with bounded registers and one
    compiled kernel per CHUNK_S. SINKS: the merge starts from the sinks' state (m = sink, l = 1,
    acc = 0), so the sink joins the normalizer once."""
    tl.static_assert(BLOCK_DV >= DV)
    tl.static_assert((CHUNK_S & (CHUNK_S - 1)) == 0)
    if USE_PDL:
        tl_cuda.gdc_wait()
        tl_cuda.gdc_launch_dependents()
    # every tensor is 3-D, [HEADS, CHUNK_S or 1, BLOCK_DV or 1]: the per-head statistics reduce
    # and broadcast against the acc partials without a layout conversion inside the loop
    pid_b = tl.program_id(1)
    heads = (tl.program_id(0) * HEADS + tl.arange(0, HEADS))[:, None, None]
    splits = tl.arange(0, CHUNK_S)[None, :, None]
    offs_dv = tl.arange(0, BLOCK_DV)[None, None, :]
    mask_h = heads < num_heads
    pm_base = pid_b.to(tl.int64) * stride_pmb + heads * stride_pmh
    pa_base = PartAcc + pid_b.to(tl.int64) * stride_pab + heads * stride_pah + offs_dv * stride_pad

    if SINKS:
        m_run = tl.load(Sinks + heads, mask=mask_h, other=0.0) * LOG2E
        l_run = tl.full([HEADS, 1, 1], 1.0, dtype=tl.float32)
    else:
        m_run = tl.full([HEADS, 1, 1], float("-inf"), dtype=tl.float32)
        l_run = tl.zeros([HEADS, 1, 1], dtype=tl.float32)
    acc = tl.zeros([HEADS, 1, BLOCK_DV], dtype=tl.float32)
    for s0 in range(0, num_splits, CHUNK_S):
        s_idx = s0 + splits
        live = mask_h & (s_idx < num_splits)  # [HEADS, CHUNK_S, 1]
        m_c = tl.load(PartM + pm_base + s_idx * stride_pms, mask=live, other=float("-inf"))
        l_c = tl.load(PartL + pm_base + s_idx * stride_pms, mask=live, other=0.0)
        a_c = tl.load(pa_base + s_idx * stride_pas, mask=live & (offs_dv < DV), other=0.0)
        m_new = tl.maximum(m_run, tl.max(m_c, 1, keep_dims=True))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # all empty so far: no inf - inf
        w_run = tl.exp2(m_run - m_safe)
        w = tl.exp2(m_c - m_safe)
        l_run = l_run * w_run + tl.sum(w * l_c, 1, keep_dims=True)
        acc = acc * w_run + tl.sum(a_c * w, 1, keep_dims=True)
        m_run = m_new

    seen = l_run != 0.0  # a NaN l stays NaN: out and lse NaN
    l_safe = tl.where(seen, l_run, 1.0)
    o_ptrs = Out + pid_b.to(tl.int64) * stride_ob + heads * stride_oh + offs_dv * stride_od
    tl.store(o_ptrs, (acc / l_safe).to(Out.dtype.element_ty), mask=mask_h & (offs_dv < DV))
    lse = tl.where(seen, (m_run + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    tl.store(Lse + pid_b.to(tl.int64) * stride_lseb + heads * stride_lseh, lse, mask=mask_h)


@triton.jit
def _bit_or(a, b):
    return a | b


@triton.jit
def _row_mask_words_kernel(Mask, Words, stride_mb, stride_mh, stride_mq, stride_mk, stride_wb, stride_wh,
                           n_kv, word_heads, GROUP: tl.constexpr, QUERY_ROWS: tl.constexpr,
                           WORD_ROWS: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_K: tl.constexpr):
    """One program: BLOCK_K keys of one (batch, word head) of a bool rows' mask as words, bit r
    set where group row r (< WORD_ROWS) sees the key: row r of a KV head's group is row
    r % QUERY_ROWS of prefill's head (head * GROUP + r) // QUERY_ROWS (stride_mh 0: every head's)."""
    pid = tl.program_id(0)
    b, hw = pid // word_heads, pid % word_heads
    rows = tl.arange(0, BLOCK_W)
    keys = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    heads = (hw * GROUP + rows) // QUERY_ROWS
    ptrs = (Mask + b.to(tl.int64) * stride_mb + heads.to(tl.int64)[:, None] * stride_mh
            + (rows % QUERY_ROWS)[:, None] * stride_mq + keys.to(tl.int64)[None, :] * stride_mk)
    seen = tl.load(ptrs, mask=(rows < WORD_ROWS)[:, None] & (keys < n_kv)[None, :], other=0) != 0
    bits = tl.where(seen, (tl.full([BLOCK_W], 1, Words.dtype.element_ty) << rows)[:, None], 0)
    tl.store(Words + b.to(tl.int64) * stride_wb + hw * stride_wh + keys, tl.reduce(bits, 0, _bit_or),
             mask=keys < n_kv)


def row_mask_words(mask: torch.Tensor, h_kv: int, group: int, query_rows: int) -> tuple[torch.Tensor, int]:
    """(words, rows a word holds): a bool rows' mask (Bm, Hm, N_q, N_kv) as the decode kernel's
    bit words (MaskWords): (Bm, 1, N_kv) over the N_q rows when Hm is 1, else (Bm, H_kv, N_kv)
    over each KV head's group of rows (at most 64); int32 words for up to 32 rows, else int64. A
    key's word is a vector the scores' layout takes as is, where a [rows, keys] mask tile pulled
    the softmax into the tile's own layout (twice the instructions: docs/notes/triton-prefill.md)."""
    bm, hm, _, n_kv = mask.shape
    if group > 64:
        raise ValueError(f"row_mask_words: at most 64 rows a KV head's group, got {group}")
    word_rows, word_heads = (query_rows, 1) if hm == 1 else (group, h_kv)
    words = _empty((bm, word_heads, n_kv), torch.int32 if word_rows <= 32 else torch.int64, mask.device)
    st = _broadcast_strides(mask)
    block_k = 128
    _row_mask_words_kernel[(bm * word_heads, triton.cdiv(n_kv, block_k))](
        mask, words, *st, words.stride(0), words.stride(1), n_kv, word_heads, GROUP=group,
        QUERY_ROWS=query_rows, WORD_ROWS=word_rows, BLOCK_W=max(2, triton.next_power_of_2(word_rows)),
        BLOCK_K=block_k)
    return words, word_rows


# --------------------------------------------------------------------------- the launch


def _broadcast_strides(t: torch.Tensor) -> tuple:
    """t's strides, 0 along a dim of 1 (which the kernels broadcast)."""
    return tuple(st if n > 1 else 0 for st, n in zip(t.stride(), t.shape))


def _empty(shape, dtype, device) -> torch.Tensor:
    """Every buffer the launch allocates (tests patch this to hand out NaN-poisoned memory)."""
    return torch.empty(shape, dtype=dtype, device=device)


# Fused-reduce arrival counters: one int32 per (b, h_kv), zero between launches (each merger puts
# its counter back). One buffer per (device, stream): launches on one stream run one after the
# other, so they can share it; launches on two streams may overlap, so they get two buffers.
# Never freed: a captured CUDA graph keeps the raw pointer. Inside a capture a new buffer is
# zeroed by a memset that becomes part of the graph (redundant after the first replay, harmless).
# Left to the caller: replaying two graphs captured on one stream concurrently on two streams.
_COUNTERS: dict = {}
_COUNTERS_KEEP: list = []


def _counters(device: torch.device, n: int) -> torch.Tensor:
    """A zeroed int32 buffer of >= n counters private to the current stream of ``device``."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device.type, device.index, stream)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        buf = torch.zeros(max(4096, _next_pow2(n)), dtype=torch.int32, device=device)
        _COUNTERS[key] = buf
        _COUNTERS_KEEP.append(buf)
    return buf


# A contiguous cache read as pages (_as_pages): the Gluon GQA kernel reads paged caches only. The
# view's blocks are _VIEW_PAGE rows, the page size its measurements used (one build of the kernel
# a format). Tables of up to _VIEW_TABLES shapes are kept, never freed (a captured CUDA graph
# keeps their pointers); others are made per call, as are those made inside a capture.
_VIEW_PAGE = 16
_VIEW_TABLES = 64
_PAGE_TABLES: dict = {}


def _as_pages(caches: tuple, n_max: int) -> Optional[tuple]:
    """Contiguous-layout tensors (B, H_kv, N_max, ...) (K/V data, int8 row scales) as the paged
    layout (blocks, _VIEW_PAGE, H_kv, ...): block b Q + j holds tokens [j P, (j + 1) P) of
    sequence b, Q the sequence stride in blocks. Views of the same elements (the last block ends
    where the tensor does); (views, Q), or None where N_max or the sequence strides are not whole
    blocks, or differ between the tensors."""
    page, b = _VIEW_PAGE, caches[0].shape[0]
    seq_rows = 0  # one sequence: its stride is never used
    if b > 1:
        strides = {t.stride(0) // t.stride(2) if t.stride(2) and t.stride(0) % t.stride(2) == 0 else -1
                   for t in caches}
        if len(strides) != 1:
            return None
        (seq_rows,) = strides
    if seq_rows < 0 or seq_rows % page or n_max % page:
        return None
    seq_blocks = seq_rows // page
    return tuple(t.as_strided((seq_blocks * (b - 1) + n_max // page, page, t.shape[1], *t.shape[3:]),
                              (page * t.stride(2), t.stride(2), t.stride(1), *t.stride()[3:]))
                 for t in caches), seq_blocks


def _page_table(device: torch.device, b: int, seq_blocks: int, pages: int) -> tuple:
    """(block table (B, pages) with entry b seq_blocks + j, lengths (B,) of pages * _VIEW_PAGE), int32."""
    key = (device, b, seq_blocks, pages)
    tables = _PAGE_TABLES.get(key)
    if tables is None:
        seq = torch.arange(b, dtype=torch.int32, device=device)
        tables = (seq[:, None] * seq_blocks + torch.arange(pages, dtype=torch.int32, device=device),
                  torch.full((b,), pages * _VIEW_PAGE, dtype=torch.int32, device=device))
        capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if not capturing and len(_PAGE_TABLES) < _VIEW_TABLES:
            _PAGE_TABLES[key] = tables
    return tables


def _max_offset(t: torch.Tensor) -> int:
    """The largest element offset of a tensor view from its first element (strides are >= 0)."""
    return sum((n - 1) * st for n, st in zip(t.shape, t.stride()))


# ggml blocks (flashcl.quant): data (..., D / 32, bytes per block) holds D values per row
_GGML = ("q8_0", "q4_0")


def _head_dim(cache: torch.Tensor, fmt: str) -> int:
    """The head dim of a cache (its quantized data where ``fmt``)."""
    return cache.shape[3] * 32 if fmt in _GGML else cache.shape[3]


def problem_of(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               block_table: Optional[torch.Tensor], window_left: int = -1, softcap: float = 0.0,
               sinks: Optional[torch.Tensor] = None, alibi_slopes: Optional[torch.Tensor] = None,
               kv_formats: tuple = ("", ""), key_start: Optional[torch.Tensor] = None,
               query_rows: int = 1, row_mask: bool = False) -> DecodeProblem:
    """The decode problem of these tensors (the layouts of the module docstring): its context bound
    is max_blocks * block size (paged) or N_max (contiguous, page_size 0); the variants as the op
    takes them (``window_left`` -1 and ``softcap`` 0: off). A window that reaches the first key
    of the longest context hides nothing and is off (for every row: none sits past the query).
    ``kv_formats``: K's and V's quantized formats ("" plain), the caches then their data;
    ``query_rows`` / ``row_mask``: the kernel's QUERY_ROWS / whether a ROW_MASK is on."""
    b, h_q, dk = q.shape
    if block_table is not None:
        _, page_size, h_kv = k_cache.shape[:3]
        n_ctx_bound = block_table.shape[1] * page_size
    else:
        _, h_kv, n_ctx_bound = k_cache.shape[:3]
        page_size = 0
    window_left = window_left if 0 <= window_left < n_ctx_bound - 1 else -1
    flags = {"window": window_left >= 0, "softcap": softcap > 0, "sinks": sinks is not None,
             "alibi": alibi_slopes is not None, "key_start": key_start is not None}
    ggml = all(f in _GGML for f in kv_formats)
    row_words = min(ggml_stored.row_words_aligned(c) for c in (k_cache, v_cache)) if ggml else 1
    return DecodeProblem(b, h_q, h_kv, dk, _head_dim(v_cache, kv_formats[1]), n_ctx_bound, q.element_size(),
                         page_size, max(_max_offset(k_cache), _max_offset(v_cache)),
                         tuple(sorted(name for name, on in flags.items() if on)), window_left, tuple(kv_formats),
                         str(q.dtype).removeprefix("torch."), query_rows, row_mask, row_words)


def _launch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            block_table: Optional[torch.Tensor], context_lens: Optional[torch.Tensor],
            scale: float, num_splits: int, config: Optional[dict] = None, facts: Optional[DeviceFacts] = None,
            plan: Optional[DecodePlan] = None, window_left: int = -1, softcap: float = 0.0,
            sinks: Optional[torch.Tensor] = None, alibi_slopes: Optional[torch.Tensor] = None,
            k_scales: Optional[torch.Tensor] = None, v_scales: Optional[torch.Tensor] = None,
            k_format: str = "", v_format: str = "",
            key_start: Optional[torch.Tensor] = None, query_rows: int = 1,
            row_mask: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Allocate out/lse (and the split partials) and launch the plan of these tensors: ``plan``
    where given (made by decode_plan.plan for their problem; ``num_splits``, ``config`` and
    ``facts`` are then unused), else the plan for ``facts`` (default: those of q's device),
    ``config`` (tile and _KNOBS overrides for benchmark sweeps) and ``num_splits`` (<= 0: automatic).
    Variants and quantized caches as the op takes them (see ``_decode_impl``); ``query_rows``: q's
    heads are each query head's causal rows (the kernel's QUERY_ROWS; prefill's few-row route);
    ``row_mask``: that prefill's mask (Bm, Hm, N_q, N_kv), bool or float32 additive, contiguous,
    Bm in {1, B}, Hm in {1, H_q / query_rows} (the kernel's ROW_MASK; MASK_PER_KEY where every
    head of a group reads the same row of it; else a bool one for at most 64 rows a group, as
    prefill's route has)."""
    b, h_q, dk = q.shape
    dv = _head_dim(v_cache, v_format)
    paged = block_table is not None
    if context_lens is not None:
        context_lens = context_lens.contiguous()  # the kernels read context_lens[b] at offset b
    if key_start is not None:
        key_start = key_start.contiguous()  # and key_start[b] likewise
    problem = problem_of(q, k_cache, v_cache, block_table, window_left, softcap, sinks, alibi_slopes,
                         (k_format, v_format), key_start, query_rows, row_mask is not None)
    if not paged and plan is None and config is None and row_mask is None:
        # a contiguous cache goes to the Gluon GQA kernel as pages where that kernel takes them
        facts = facts if facts is not None else facts_of(q.device)
        launched = _launch_as_pages(q, k_cache, v_cache, context_lens, scale, num_splits, facts, problem,
                                    window_left=window_left, softcap=softcap, sinks=sinks,
                                    alibi_slopes=alibi_slopes, k_scales=k_scales, v_scales=v_scales,
                                    k_format=k_format, v_format=v_format, key_start=key_start,
                                    query_rows=query_rows)
        if launched is not None:
            return launched
    flags = set(problem.variants)
    if paged:
        num_blocks, page_size, h_kv = k_cache.shape[:3]
        if num_blocks == 0:  # the kernels clamp block ids into the cache: it needs a block
            raise ValueError("paged k_cache/v_cache hold no block (k_cache.shape[0] == 0)")
        # (num_blocks, PAGE_SIZE, H_kv, D): block / position-in-block / head / dim
        sk = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.stride(3))
        sv = (v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), v_cache.stride(3))
        s_bt = (block_table.stride(0), block_table.stride(1))
    else:
        h_kv = k_cache.shape[1]
        page_size = 1
        # (B, H_kv, N_max, D): the sequence is one block chain, so "block" = sequence
        sk = (k_cache.stride(0), k_cache.stride(2), k_cache.stride(1), k_cache.stride(3))
        sv = (v_cache.stride(0), v_cache.stride(2), v_cache.stride(1), v_cache.stride(3))
        s_bt = (0, 0)
        block_table = q  # never read (PAGED=False); any pointer will do
        num_blocks = 1
    if plan is None:
        facts = facts if facts is not None else facts_of(q.device)
        plan = (decode_plan.planned(problem, facts, max(0, num_splits)) if config is None
                else decode_plan.plan(problem, facts, config, max(0, num_splits)))
    elif not plan.serves(problem):
        raise ValueError(f"the decode plan was made for {plan.problem}, not {problem}")
    group = h_q // h_kv
    num_splits = plan.num_splits

    out = _empty((b, h_q, dv), q.dtype, q.device)
    lse = _empty((b, h_q), torch.float32, q.device)
    split = num_splits > 1
    if split:
        part_m = _empty((b, h_q, num_splits), torch.float32, q.device)
        part_l = _empty((b, h_q, num_splits), torch.float32, q.device)
        part_acc = _empty((b, h_q, num_splits, dv), torch.float32, q.device)
    else:
        part_m = part_l = part_acc = lse  # never written (SPLIT=False)
    s_pm = (part_m.stride(0), part_m.stride(1), part_m.stride(2)) if split else (0, 0, 0)
    s_pa = (part_acc.stride(0), part_acc.stride(1), part_acc.stride(2), part_acc.stride(3)) if split else (0, 0, 0, 0)

    fused = plan.merge == "fused"
    counters = _counters(q.device, b * h_kv) if fused else None
    knobs = {"EARLY_PAGES": plan.early_pages, "USE_PDL": plan.pdl}
    if plan.whole_pages or plan.page_tiles:
        knobs.update(WHOLE_PAGES=plan.whole_pages, PAGE_TILES=plan.page_tiles, OFFS32=plan.offs32)
    if plan.mha_loop:
        knobs.update(MHA_FMA=True, KV_EVICT=plan.kv_evict)
    # the variants: flags of the kernel and the merges, their values as arguments (stand-ins when off)
    var_knobs = {"WINDOW": "window" in flags, "SOFTCAP": "softcap" in flags, "SINKS": "sinks" in flags,
                 "ALIBI": "alibi" in flags, "KEY_START": "key_start" in flags}
    var_args = tuple(x if x is not None else lse for x in (sinks, alibi_slopes, key_start))
    var_values = (problem.window_left if "window" in flags else 0,
                  softcap * _LOG2E if "softcap" in flags else 1.0)
    stride_slb = alibi_slopes.stride(0) if alibi_slopes is not None else 0
    # the rows' mask: a dim of 1 broadcasts (stride 0); a bool one the group does not read as one
    # row goes as bit words (row_mask_words: bit g % WORD_ROWS for group row g)
    stride_rm = (0, 0, 0, 0) if row_mask is None else _broadcast_strides(row_mask)
    mask_per_key = row_mask is not None and query_rows == 1 and (stride_rm[1] == 0 or group == 1)
    words, stride_mw, word_rows = lse, (0, 0), 1
    if row_mask is not None and row_mask.dtype == torch.bool and not mask_per_key:
        words, word_rows = row_mask_words(row_mask, h_kv, group, query_rows)
        stride_mw = _broadcast_strides(words)[:2]
    # quantized K/V: the formats, the scales (int8: per row, strided as the rows; fp8: one)
    cvt_asm = _cvt_asm(q, (k_format, v_format))
    block_g = plan.block_g
    quant = {"K_FMT": k_format, "V_FMT": v_format, "CVT_ASM": cvt_asm}
    if plan.stored_order:  # ggml caches in stored order (decode_plan.stored_order: rows aligned)
        block_g = decode_plan.stacked_rows(group, dk, dv)
        quant.update(STORED=True, TAIL_K=ggml_stored.tail_positions(dk, k_format),
                     TAIL_V=ggml_stored.tail_positions(dv, v_format), STORED_ALIGN=problem.ggml_row_words)
    else:
        quant.update(K_WORDS=_reads_words(k_cache, k_format, dk, cvt_asm),
                     V_WORDS=_reads_words(v_cache, v_format, dv, cvt_asm))
    # float32 q against values that bf16 holds exactly: 16-bit tiles, q and p in parts (quant_words.dot)
    exact = ("int8", "fp8_e4m3", "q4_0", "q8_0") if quant.get("STORED") else ("int8", "fp8_e4m3")
    parts = decode_plan.q_in_parts(problem.q_dtype)
    quant.update(K_PARTS=parts and k_format in exact, V_PARTS=parts and v_format in exact)
    scale_args = [_scale_operand(sc, fmt, paged, lse) for sc, fmt in ((k_scales, k_format), (v_scales, v_format))]
    if plan.kernel in ("gluon_mha", "gluon_gqa") and decode_gluon.operands_fit(q, k_cache, v_cache, block_table,
                                                                               context_lens, (k_format, v_format)):
        if plan.kernel == "gluon_mha":  # one split: out and lse
            decode_gluon.launch(q, k_cache, v_cache, block_table, context_lens, out, lse, scale * _LOG2E,
                                plan.block_n, plan.num_warps, evict_first=plan.evict_first,
                                sort_pages=plan.sort_pages)
            return out, lse
        decode_gluon.launch_gqa(q, k_cache, v_cache, block_table, context_lens, out, lse, scale * _LOG2E,
                                evict_first=plan.evict_first, num_splits=num_splits,
                                partials=(part_m, part_l, part_acc) if split else None,
                                sort_pages=plan.sort_pages, k_format=k_format, v_format=v_format,
                                k_scales=scale_args[0], v_scales=scale_args[1],
                                window_left=problem.window_left, sinks=sinks, alibi_slopes=alibi_slopes,
                                key_start=key_start, query_rows=query_rows,
                                softcap_log2=var_values[1] if "softcap" in flags else 0.0,
                                max_registers=plan.gqa_registers)
    else:
        if fused:
            knobs.update(FUSED=True, MERGE_STAGES=plan.merge_stages, BLOCK_GM=plan.block_gm)
        grid = (h_kv, b, num_splits)
        _decode_kernel[grid](
            q, k_cache, v_cache, block_table, context_lens if context_lens is not None else q,
            out, lse, part_m, part_l, part_acc, counters if fused else lse, *var_args,
            row_mask if row_mask is not None else lse, words, scale_args[0][0], scale_args[1][0],
            scale * _LOG2E, problem.n_ctx_bound, num_splits, num_blocks, *var_values,
            q.stride(0), q.stride(1), q.stride(2),
            *sk, *sv, *s_bt,
            out.stride(0), out.stride(1), out.stride(2),
            lse.stride(0), lse.stride(1),
            *s_pm, *s_pa, stride_slb, *stride_rm, *stride_mw, *scale_args[0][1], *scale_args[1][1],
            GROUP=group, BLOCK_G=block_g,
            DK=dk, DV=dv, BLOCK_DK=plan.block_dk, BLOCK_DV=plan.block_dv,
            BLOCK_N=plan.block_n, PAGE_SIZE=page_size,
            PAGED=paged, HAS_LENS=context_lens is not None, SPLIT=split,
            UPCAST_DOT=interpreting() and (q.dtype == torch.bfloat16 or quant["K_PARTS"] or quant["V_PARTS"]),
            QUERY_ROWS=query_rows,
            DOT_PRECISION=FLOAT32_DOTS if q.dtype == torch.float32 else "ieee",
            ROW_MASK=0 if row_mask is None else 1 if row_mask.dtype == torch.bool else 2,
            MASK_PER_KEY=mask_per_key, WORD_ROWS=word_rows,
            num_warps=plan.num_warps, num_stages=plan.num_stages, **knobs, **var_knobs, **quant,
            **({"launch_pdl": True} if plan.pdl else {}),
        )
    if plan.merge == "reduce":
        _reduce_kernel[(triton.cdiv(h_q, plan.reduce_heads), b)](
            part_m, part_l, part_acc, out, lse, var_args[0],
            num_splits, h_q,
            *s_pm, *s_pa,
            out.stride(0), out.stride(1), out.stride(2),
            lse.stride(0), lse.stride(1),
            DV=dv, BLOCK_DV=plan.block_dv, HEADS=plan.reduce_heads, CHUNK_S=plan.reduce_chunk,
            USE_PDL=plan.pdl, SINKS=var_knobs["SINKS"], num_warps=4, **({"launch_pdl": True} if plan.pdl else {}),
        )
    return out, lse


def _launch_as_pages(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     context_lens: Optional[torch.Tensor], scale: float, num_splits: int, facts: DeviceFacts,
                     problem: DecodeProblem, k_scales: Optional[torch.Tensor] = None,
                     v_scales: Optional[torch.Tensor] = None, k_format: str = "", v_format: str = "",
                     **variants) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """A contiguous cache's decode (``_launch``'s arguments, ``problem`` its problem) launched on
    its paged view (_as_pages) where the plan of that view is the Gluon GQA kernel, else None
    (nothing launched). The view's problem is the cache's with its page size: the same bound and
    offsets. Its pages lie in address order: the kernel does not sort them."""
    plan = decode_plan.planned(replace(problem, page_size=_VIEW_PAGE), facts, max(0, num_splits))
    if plan.kernel != "gluon_gqa":
        return None
    n_max = k_cache.shape[2]
    row_scales = [sc for sc, fmt in ((k_scales, k_format), (v_scales, v_format)) if fmt == "int8"]
    pages = _as_pages((k_cache, v_cache, *row_scales), n_max)
    if pages is None:
        return None
    views, seq_blocks = pages
    k_scales = views[2] if k_format == "int8" else k_scales  # K's row scales come first, then V's
    v_scales = views[-1] if v_format == "int8" else v_scales
    table, full = _page_table(q.device, q.shape[0], seq_blocks, n_max // _VIEW_PAGE)
    lens = context_lens if context_lens is not None else full
    if not decode_gluon.operands_fit(q, views[0], views[1], table, lens, (k_format, v_format)):
        return None
    return _launch(q, views[0], views[1], table, lens, scale, num_splits, plan=replace(plan, sort_pages=False),
                   k_scales=k_scales, v_scales=v_scales, k_format=k_format, v_format=v_format, **variants)


def _reads_words(data: torch.Tensor, fmt: str, d: int, cvt_asm: bool) -> bool:
    """Whether the kernel reads this int8 or fp8 cache as 32-bit words (_load_words): head dims 16
    or more that are their own padded size, unit stride, every row on a 4-byte boundary, the words
    turned into fp16 through byte permutes (``cvt_asm``; under the interpreter the same words
    take per-element casts). q4_0 has its own word path (ggml_stored), and q8_0 under float32 q;
    otherwise q8_0 keeps the byte-pair gather: its words measured slower both ways
    (docs/notes/quantized-decode.md)."""
    if fmt not in ("int8", "fp8_e4m3") or d != _next_pow2(d) or d < 16 or data.stride(-1) != 1:
        return False
    if not (cvt_asm or interpreting()):
        return False
    return data.data_ptr() % 4 == 0 and all(st % 4 == 0 for st in data.stride()[:3])


def _cvt_asm(q: torch.Tensor, formats: tuple) -> bool:
    """Whether quantized words become fp16 through PTX byte permutes (quant_words.words_to_f16): fp16 q on a
    GPU (not the interpreter), sm_89+ where a cache is fp8 (its convert instruction)."""
    if q.dtype != torch.float16 or interpreting() or not any(formats):
        return False
    return "fp8_e4m3" not in formats or torch.cuda.get_device_capability(q.device) >= (8, 9)


def _scale_operand(scales: Optional[torch.Tensor], fmt: str, paged: bool, stand_in: torch.Tensor):
    """(pointer, (block, position, head) strides) of a quantized cache's scales as the kernel reads
    them: int8's (..., 1) per row, strided as its rows; fp8_e4m3's one scale at every row (zero
    strides); ggml's d lies in the data (the stand-in, unused)."""
    if fmt == "int8":
        st = scales.stride()
        return scales, ((st[0], st[1], st[2]) if paged else (st[0], st[2], st[1]))
    if fmt == "fp8_e4m3":
        return scales, (0, 0, 0)
    return stand_in, (0, 0, 0)


def _decode_impl(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_table: Optional[torch.Tensor], context_lens: Optional[torch.Tensor],
                 scale: float, num_splits: int, window_left: int = -1, softcap: float = 0.0,
                 sinks: Optional[torch.Tensor] = None, alibi_slopes: Optional[torch.Tensor] = None,
                 k_scales: Optional[torch.Tensor] = None, v_scales: Optional[torch.Tensor] = None,
                 k_format: str = "", v_format: str = "",
                 key_start: Optional[torch.Tensor] = None, query_rows: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """flashcl::decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor? block_table,
    Tensor? context_lens, float scale, int num_splits, int window_left=-1, float softcap=0.,
    Tensor? sinks=None, Tensor? alibi_slopes=None, Tensor? k_scales=None, Tensor? v_scales=None,
    str k_format="", str v_format="", Tensor? key_start=None, int query_rows=1) -> (Tensor out, Tensor lse)

    q (B, H_q, DK); paged (block_table given) or contiguous cache as in the module docstring.
    num_splits 0 = choose from the shapes and the SM count; out (B, H_q, DV) q.dtype,
    lse (B, H_q) float32. Variants (flashcl.variants): ``window_left`` >= 0 the keys
    [ctx - 1 - window_left, ctx) (-1: all), ``softcap`` > 0 (0: off), ``sinks`` float32 (H_q,),
    ``alibi_slopes`` float32 (B, H_q) (row stride free, unit head stride), ``key_start`` int32
    (B,) contiguous: sequence b sees no key before key_start[b]. Quantized caches
    (flashcl.quant): k_cache / v_cache are a QuantizedTensor's ``data``, ``k_format`` /
    ``v_format`` its format ("" plain), ``k_scales`` / ``v_scales`` its ``scales`` (int8,
    fp8_e4m3; q8_0 and q4_0 read d from the data). ``query_rows`` > 1: head h is causal row
    h % query_rows of its sequence's last positions (flashcl.decode of several rows). Inputs are
    not mutated.
    """
    with on_device_of(q):
        return _launch(q, k_cache, v_cache, block_table, context_lens, scale, num_splits,
                       window_left=window_left, softcap=softcap, sinks=sinks, alibi_slopes=alibi_slopes,
                       k_scales=k_scales, v_scales=v_scales, k_format=k_format, v_format=v_format,
                       key_start=key_start, query_rows=query_rows)


# the op, for torch.compile, tracing and dispatch modes; eager calls may skip it (skips_dispatcher)
decode_op = torch.library.custom_op("flashcl::decode", mutates_args=())(_decode_impl)


@decode_op.register_fake
def _(q, k_cache, v_cache, block_table, context_lens, scale, num_splits, window_left=-1, softcap=0.0, sinks=None,
      alibi_slopes=None, k_scales=None, v_scales=None, k_format="", v_format="", key_start=None, query_rows=1):
    b, h_q, _ = q.shape
    return q.new_empty((b, h_q, _head_dim(v_cache, v_format))), q.new_empty((b, h_q), dtype=torch.float32)


def decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *,
           block_table: Optional[torch.Tensor] = None, context_lens: Optional[torch.Tensor] = None,
           scale: float, num_splits: Optional[int] = None, return_lse: bool = False, variants=None,
           key_start: Optional[torch.Tensor] = None, query_rows: int = 1):
    """Backend entry of ``flashcl.decode`` (inputs already validated there). Traceable by
    torch.compile (fullgraph) and capturable in a CUDA graph: nothing here syncs with the device.
    ``variants``: a flashcl.variants.Variants (no mask) or None; k_cache / v_cache may be
    QuantizedTensors (flashcl.quant), passed to the op as their data, format and scales;
    ``key_start``: int32 (B,), moved to q's device; ``query_rows``: the op's (flashcl.api._as_rows)."""
    var = {"query_rows": query_rows} if query_rows > 1 else {}
    if key_start is not None:
        var["key_start"] = key_start.to(q.device)
    if variants is not None:
        if variants.mask is not None:
            raise ValueError("decode takes no mask (a mask is prefill only)")
        var.update(op_variants(variants, q))
    quant = {}
    for name, cache in (("k", k_cache), ("v", v_cache)):
        if isinstance(cache, QuantizedTensor):
            quant.update({f"{name}_format": cache.fmt,
                          f"{name}_scales": cache.scales if cache.fmt in ("int8", "fp8_e4m3") else None})
    k_cache, v_cache = (c.data if isinstance(c, QuantizedTensor) else c for c in (k_cache, v_cache))
    tensors = (q, k_cache, v_cache, block_table, context_lens, var.get("sinks"), var.get("alibi_slopes"),
               quant.get("k_scales"), quant.get("v_scales"), var.get("key_start"))
    op = _decode_impl if skips_dispatcher(*tensors) else torch.ops.flashcl.decode
    out, lse = op(q, k_cache, v_cache, block_table, context_lens, float(scale),
                  0 if num_splits is None else int(num_splits), **var, **quant)
    return (out, lse) if return_lse else out


def op_variants(variants, q: torch.Tensor) -> dict:
    """A flashcl.variants.Variants (no mask) as the op's keywords for q (B, H_q, DK): window_left
    (-1: none), softcap (0: off), sinks (H_q,) and alibi_slopes (B, H_q) as the kernels read them."""
    window = variants.window
    return {"window_left": window[0] if window is not None and window[0] >= 0 else -1,
            "softcap": float(variants.softcap or 0.0),
            "sinks": _per_head(variants.sinks, q, (q.shape[1],), "sinks"),
            "alibi_slopes": _per_head(variants.alibi_slopes, q, (q.shape[0], q.shape[1]), "alibi_slopes")}


def _per_head(x: Optional[torch.Tensor], q: torch.Tensor, shape: tuple, name: str) -> Optional[torch.Tensor]:
    """sinks / alibi_slopes as the kernels read them: float32 on q's device, unit stride over heads."""
    if x is None:
        return None
    if tuple(x.shape) != shape:
        raise ValueError(f"{name}: expected shape {shape}, got {tuple(x.shape)}")
    x = x.to(device=q.device, dtype=torch.float32)
    return x if x.stride(-1) == 1 else x.contiguous()
