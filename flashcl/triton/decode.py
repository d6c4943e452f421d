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
stride_kblk + (t % PAGE_SIZE) * stride_kpos`` -- the same strides, no copy into pages.

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

The split count is chosen on the host from shapes only (max_blocks * PAGE_SIZE bounds the context),
never from context_lens values: the launch path does no host sync and is CUDA-graph capturable.

Nothing the tables hold can make a kernel read or write out of bounds, and they are never read
back: a context length outside [0, bound] reads no key, a block id outside [0, num_blocks) is
clamped into the cache where it is used (_clamp_pages, then _pages_in_cache; entries past a
sequence's end are never used, so never checked), and either makes that sequence's out and lse
NaN, the other sequences untouched. Keys past context_lens[b] never reach the row, whatever their K/V hold: their scores
are selected away (tl.where) and their V rows read as zeros or as a real row of the sequence. A
row whose q or a visible K holds NaN/inf gets NaN out and lse (its l is NaN, never taken for 0).

Launch knobs (``_KNOBS``: keys of ``launch_plan``'s / ``_launch``'s ``config``, next to BLOCK_N,
num_warps and num_stages; benchmarks force them on or off, the op uses the defaults):

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
                  gluon_mha, gluon_gqa) are marked L1::evict_first (see ``_KNOBS``): +0.5-4.5% on H100.
    gluon_gqa     (default: groups of 4 to 8, head dim 128, at the kernel's own split count of
                  two programs per SM where that gives 1.5 programs per SM or more and splits of
                  1024 tokens or more) the GQA kernel of ``decode_gluon``; split launches are
                  merged by ``_reduce_kernel``.
    sort_pages    (default on) the Gluon kernels (gluon_mha, gluon_gqa) visit the pages of
                  splits of 256 to 1024 pages in ascending order of address, sorted in the kernel
                  into an int32 scratch array per program (``decode_gluon.sort_size``): +1.2% at
                  (8, 32/32, 8k) and +1.3% at (1, 32/8, 128k) on H100.

``_auto_knobs`` holds the rule for the automatic ones and the measurements behind it.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
import triton.language as tl
from triton.language.extra import cuda as tl_cuda

from . import decode_gluon, interpreting

_LOG2E = 1.4426950408889634  # the kernels work in base 2: exp(x) = exp2(x * log2(e))

# --------------------------------------------------------------------------- kernels


# num_splits, the context bound and the block count vary from call to call: no recompilation for
# their values
@triton.jit(do_not_specialize=["n_ctx_max", "num_splits", "num_blocks"])
def _decode_kernel(
    Q, K, V, BlockTable, ContextLens, Out, Lse, PartM, PartL, PartAcc, Counters,
    qk_scale_log2, n_ctx_max, num_splits, num_blocks,
    stride_qb, stride_qh, stride_qd,
    stride_kblk, stride_kpos, stride_kh, stride_kd,
    stride_vblk, stride_vpos, stride_vh, stride_vd,
    stride_btb, stride_btn,
    stride_ob, stride_oh, stride_od,
    stride_lseb, stride_lseh,
    stride_pmb, stride_pmh, stride_pms,
    stride_pab, stride_pah, stride_pas, stride_pad,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
    DK: tl.constexpr, DV: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
    PAGED: tl.constexpr, HAS_LENS: tl.constexpr, SPLIT: tl.constexpr, UPCAST_DOT: tl.constexpr,
    # the launch knobs (see _KNOBS)
    EARLY_PAGES: tl.constexpr = False, USE_PDL: tl.constexpr = False,
    FUSED: tl.constexpr = False, MERGE_STAGES: tl.constexpr = 3, BLOCK_GM: tl.constexpr = 1,
    WHOLE_PAGES: tl.constexpr = False, OFFS32: tl.constexpr = False, MHA_FMA: tl.constexpr = False,
    PAGE_TILES: tl.constexpr = False, KV_EVICT: tl.constexpr = "",
):
    tl.static_assert(MHA_FMA or BLOCK_G >= 16, "tl.dot needs at least 16 rows: pad the GQA group")
    tl.static_assert(BLOCK_G >= GROUP)
    tl.static_assert(BLOCK_DK >= DK and BLOCK_DV >= DV)
    tl.static_assert(BLOCK_N >= 16)
    tl.static_assert((PAGE_SIZE & (PAGE_SIZE - 1)) == 0, "page size must be a power of two")
    tl.static_assert(not MHA_FMA or (PAGED and WHOLE_PAGES and GROUP == 1), "MHA_FMA: MHA over whole pages")
    tl.static_assert(not PAGE_TILES or (PAGED and EARLY_PAGES and PAGE_SIZE % BLOCK_N == 0),
                     "PAGE_TILES: tiles inside one page")

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
    # bound length.
    if EARLY_PAGES:
        chunk = tl.cdiv(tl.cdiv(n_ctx_max, num_splits), BLOCK_N) * BLOCK_N
        lo = pid_s * chunk
        if PAGED and WHOLE_PAGES:
            # clamped to the bound, every entry read lies in the table; the entries of tokens past
            # this sequence's end are replaced by the first token's once the length is known
            page = _table_entries(bt_base, lo + offs_n, n_ctx_max, stride_btn, PAGE_SIZE)
            page_lo = _table_entries(bt_base, lo, n_ctx_max, stride_btn, PAGE_SIZE)
        elif PAGED and PAGE_TILES:
            # a tile lies inside one page: one entry per tile, clamped to the table's bound
            page = _table_entries(bt_base, lo, n_ctx_max, stride_btn, PAGE_SIZE)
        elif PAGED:
            page = tl.load(bt_base + ((lo + offs_n) // PAGE_SIZE) * stride_btn, mask=lo + offs_n < n_ctx_max,
                           other=0)
    if HAS_LENS:
        n_ctx = tl.load(ContextLens + pid_b)
    else:
        n_ctx = n_ctx_max
    # device tables are never read back: a length outside [0, bound] reads no key, and it or a
    # block id outside the cache (clamped at use, checked after the loop) makes the rows NaN
    tables_ok = (n_ctx >= 0) & (n_ctx <= n_ctx_max)
    n_ctx = tl.where(tables_ok, n_ctx, 0)
    last_block = (num_blocks - 1).to(tl.uint32)
    if not EARLY_PAGES:
        chunk = tl.cdiv(tl.cdiv(n_ctx, num_splits), BLOCK_N) * BLOCK_N
        lo = pid_s * chunk
    hi = tl.minimum(lo + chunk, n_ctx)
    if PAGED and WHOLE_PAGES:
        page = tl.where(lo + offs_n < hi, page, page_lo)

    k_base = K + pid_h.to(tl.int64) * stride_kh
    v_base = V + pid_h.to(tl.int64) * stride_vh

    # the block-table entries of the first tile (already loaded with EARLY_PAGES); the loop fetches
    # those of the next tile one iteration ahead, so the K/V addresses do not wait on a load of the
    # same iteration
    if PAGED and not EARLY_PAGES:
        page = tl.load(bt_base + ((lo + offs_n) // PAGE_SIZE) * stride_btn, mask=lo + offs_n < hi, other=0)
    if WHOLE_PAGES:
        # every tile starts on a page boundary: a row's offset inside its page is loop-invariant
        in_page_k = (offs_n % PAGE_SIZE) * stride_kpos
        in_page_v = (offs_n % PAGE_SIZE) * stride_vpos
    if MHA_FMA:
        # one query row: CUDA cores, K/V in registers one tile ahead (see _mha_fma_loop)
        q_row = Q + pid_b.to(tl.int64) * stride_qb + pid_h * stride_qh + offs_dk * stride_qd
        m_i, l_i, acc = _mha_fma_loop(
            q_row, qk_scale_log2, k_base, v_base, bt_base, page, page_lo, in_page_k, in_page_v,
            lo, hi, n_ctx_max, last_block, stride_kblk, stride_kd, stride_vblk, stride_vd, stride_btn,
            BLOCK_N, DK, DV, BLOCK_DK, BLOCK_DV, PAGE_SIZE, OFFS32, KV_EVICT)
    else:
        # Q tile: the whole group; padding rows are zeros and are never stored
        q_ptrs = Q + pid_b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_dk[None, :] * stride_qd
        if BLOCK_DK == DK:
            q = tl.load(q_ptrs, mask=mask_g[:, None], other=0.0)
        else:
            q = tl.load(q_ptrs, mask=mask_g[:, None] & (offs_dk[None, :] < DK), other=0.0)
        if UPCAST_DOT:
            q = q.to(tl.float32)
        m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_DV], dtype=tl.float32)
        for start_n in range(lo, hi, BLOCK_N):
            tok = start_n + offs_n
            valid = tok < hi
            # locate each token's row: through the block table, or along the sequence's one chain
            if PAGED and WHOLE_PAGES:
                # a row past the end reads the tile's first row (a real one, whose page `page` holds
                # for it): the K/V loads need no row mask, and those rows' scores are -inf below
                page = _clamp_pages(page, last_block)
                row_k = _page_rows(page, valid, in_page_k, stride_kblk, OFFS32)
                row_v = _page_rows(page, valid, in_page_v, stride_vblk, OFFS32)
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
                # the next tile's entry (one iteration ahead; past the end it goes unused)
                page = _table_entries(bt_base, start_n + BLOCK_N, n_ctx_max, stride_btn, PAGE_SIZE)
            elif PAGED:
                page = _clamp_pages(page, last_block)
                row_k = page.to(tl.int64) * stride_kblk + (tok % PAGE_SIZE) * stride_kpos
                row_v = page.to(tl.int64) * stride_vblk + (tok % PAGE_SIZE) * stride_vpos
                nxt = tok + BLOCK_N
                page = tl.load(bt_base + (nxt // PAGE_SIZE) * stride_btn, mask=nxt < hi, other=0)
            else:
                row_k = pid_b.to(tl.int64) * stride_kblk + tok.to(tl.int64) * stride_kpos
                row_v = pid_b.to(tl.int64) * stride_vblk + tok.to(tl.int64) * stride_vpos
            k_ptrs = k_base + row_k[:, None] + offs_dk[None, :] * stride_kd
            v_ptrs = v_base + row_v[:, None] + offs_dv[None, :] * stride_vd
            # with whole pages or tiles inside a page every row address is a real row: no row mask
            k = _load_rows(k_ptrs, valid, offs_dk, DK, BLOCK_DK, not (PAGED and (WHOLE_PAGES or PAGE_TILES)), "")
            v = _load_rows(v_ptrs, valid, offs_dv, DV, BLOCK_DV, not (PAGED and (WHOLE_PAGES or PAGE_TILES)), "")
            if UPCAST_DOT:
                k = k.to(tl.float32)
                v = v.to(tl.float32)

            # scores in the log2 domain; tokens past the end are -inf
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale_log2
            s = tl.where(valid[None, :], s, float("-inf"))
            # online softmax: rescale acc to the new max (m_new is finite: each tile has a valid token)
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            m_i = m_new

    if PAGED:
        tables_ok = tables_ok & _pages_in_cache(bt_base, lo, hi, stride_btn, last_block, PAGE_SIZE)
    l_i = tl.where(tables_ok, l_i, float("nan"))

    if SPLIT:
        # unnormalized partial state; an empty split stores (-inf, 0, 0)
        pm_off = pid_b.to(tl.int64) * stride_pmb + heads * stride_pmh + pid_s * stride_pms
        tl.store(PartM + pm_off, m_i, mask=mask_g)
        tl.store(PartL + pm_off, l_i, mask=mask_g)
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
                _merge_group(PartM, PartL, PartAcc, Out, Lse, pid_b, pid_h * GROUP, num_splits,
                             stride_pmb, stride_pmh, stride_pms, stride_pab, stride_pah, stride_pas, stride_pad,
                             stride_ob, stride_oh, stride_od, stride_lseb, stride_lseh,
                             GROUP, BLOCK_GM, DV, BLOCK_DV, MERGE_STAGES)
    else:
        # context_len 0: out 0, lse -inf (no 0/0); a NaN l (NaN/inf in q or a seen K, a bad
        # table) is not 0: out and lse NaN
        seen = l_i != 0.0
        l_safe = tl.where(seen, l_i, 1.0)
        out = acc / l_safe[:, None]
        o_ptrs = Out + pid_b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_dv[None, :] * stride_od
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=mask_g[:, None] & (offs_dv[None, :] < DV))
        # back from log2 to natural log: lse = (m + log2 l) * ln 2
        lse = tl.where(seen, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
        tl.store(Lse + pid_b.to(tl.int64) * stride_lseb + heads * stride_lseh, lse, mask=mask_g)


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
def _pages_in_cache(bt_base, lo, hi, stride_btn, last_block, PAGE_SIZE: tl.constexpr):
    """Whether the block-table entries of tokens [lo, hi) all lie in [0, last_block]. Read after
    the K/V loop that clamped them (from L1 by then) rather than tracked in it: the loop keeps
    its registers and carries no flag."""
    offs = tl.arange(0, 128)
    top = tl.zeros([128], dtype=tl.uint32)
    n_pages = tl.cdiv(hi, PAGE_SIZE)
    for first in tl.range(lo // PAGE_SIZE, n_pages, 128, num_stages=1):
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
                  OFFS32: tl.constexpr, KV_EVICT: tl.constexpr):
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
    longer at (8, 32/32, 2k), 1.3% at 256 tokens and 3% at 64 (H100)."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = tl.load(q_row, mask=offs_dk < DK, other=0.0).to(tl.float32) * qk_scale_log2

    valid = lo + offs_n < hi
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
                            BLOCK_DK, False, KV_EVICT)
        v_next = _load_rows(v_base + row_v[:, None] + offs_dv[None, :] * stride_vd, valid_next, offs_dv, DV,
                            BLOCK_DV, False, KV_EVICT)
        page = _table_entries(bt_base, tok_next + BLOCK_N, n_ctx_max, stride_btn, PAGE_SIZE)

        s = tl.sum(k.to(tl.float32) * q[None, :], 1)
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
def _merge_group(PartM, PartL, PartAcc, Out, Lse, pid_b, head0, num_splits,
                 stride_pmb, stride_pmh, stride_pms, stride_pab, stride_pah, stride_pas, stride_pad,
                 stride_ob, stride_oh, stride_od, stride_lseb, stride_lseh,
                 GROUP: tl.constexpr, BLOCK_GM: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr,
                 MERGE_STAGES: tl.constexpr):
    """Exact merge of the num_splits partial states of query heads [head0, head0 + GROUP) of
    sequence pid_b: an online merge, one split per iteration ([GROUP, DV] fp32 tile), the loads
    software-pipelined MERGE_STAGES deep (independent of the running state)."""
    offs_gm = tl.arange(0, BLOCK_GM)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_gm = offs_gm < GROUP
    mask_a = mask_gm[:, None] & (offs_dv[None, :] < DV)
    heads = head0 + offs_gm
    pm_ptrs = PartM + pid_b.to(tl.int64) * stride_pmb + heads * stride_pmh
    pl_ptrs = PartL + pid_b.to(tl.int64) * stride_pmb + heads * stride_pmh
    pa_ptrs = (PartAcc + pid_b.to(tl.int64) * stride_pab + heads[:, None] * stride_pah
               + offs_dv[None, :] * stride_pad)
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
    PartM, PartL, PartAcc, Out, Lse,
    num_splits, num_heads,
    stride_pmb, stride_pmh, stride_pms,
    stride_pab, stride_pah, stride_pas, stride_pad,
    stride_ob, stride_oh, stride_od,
    stride_lseb, stride_lseh,
    DV: tl.constexpr, BLOCK_DV: tl.constexpr, HEADS: tl.constexpr, CHUNK_S: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    """Exact merge of the split states of HEADS adjacent query heads of one sequence (grid
    (cdiv(H_q, HEADS), B)): out = sum_s w_s acc_s / sum_s w_s l_s with w_s = exp2(m_s - max m).
    One pass, CHUNK_S splits at a time, merged online across chunks: up to CHUNK_S splits cost one
    round trip to memory, not two (max, then sums). The last chunk is padded with the empty-state
    sentinel (m = -inf, l = 0, acc = 0), so any split count works with bounded registers and one
    compiled kernel per CHUNK_S."""
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


# --------------------------------------------------------------------------- launch parameters

# Shared memory the K/V software pipeline may take per program: num_stages - 1 K+V tiles in flight
# (Triton's pipeliner keeps num_stages - 1 buffers). 72 KiB fits sm_89 (99 KiB per block) and
# lets three programs share an sm_90 SM (228 KiB), two an sm_80 one (164 KiB). A sweep on H100
# (BLOCK_N 32..128, 4/8 warps, 2..5 stages) moved TB/s by under 3%: this is not the bottleneck.
# Deeper pipelines for the one-program-per-SM MQA shape (2026-11-22, (16, 32/1, 4k), 8 splits,
# ratio vs SDPA): 3 stages 0.92, 4: 0.90, 5: 0.83, 6: 0.79; BLOCK_N 128 x 3 stages 0.88. A guess,
# not verified: a tile's K/V addresses need its block-table entries, fetched one iteration ahead,
# so more stages add buffers and prologue, not loads in flight.
_SMEM_BUDGET = 72 * 1024
_NUM_STAGES = 3
_NUM_WARPS = 4  # GQA groups of 2 to 4 run the default tile on 2 (_two_warps_pay)


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _tile_config(elt_bytes: int, block_dk: int, block_dv: int) -> dict:
    """BLOCK_N, num_warps, num_stages: the largest KV tile (<= 64 rows) whose pipeline fits the
    shared-memory budget. 64 rows x d=128 x fp16 = 16 KiB per K tile, 64 KiB of K+V in flight per
    program: far above what HBM needs per SM (Little's law: ~3 TB/s x ~1 us / 132 SMs ~ 23 KB)."""
    block_n = 64
    while block_n > 16 and (_NUM_STAGES - 1) * block_n * (block_dk + block_dv) * elt_bytes > _SMEM_BUDGET:
        block_n //= 2
    return {"BLOCK_N": block_n, "num_warps": _NUM_WARPS, "num_stages": _NUM_STAGES}


# The long tile: a grid of at most one program per SM whose splits are long streams. One program
# then has the SM to itself, and what it keeps in flight is what the SM keeps in flight: 128-row
# tiles on 8 warps hold 2 x 64 KB of K+V in flight instead of 2 x 32 KB. Measured on H100
# (2026-11-22, .lead/td_prof.py, op graph time against SDPA, three runs): (1, 32/8, 128k), 16
# splits of 8192 tokens: 0.980-0.995 against 0.966-0.979 with the 64-row tile. Where the splits
# are short it loses: (1, 32/8, 32k), 2048-token splits, 1.007 against 1.012; MQA (16, 32/1, 4k),
# 512-token splits, 1.020 against 1.046; the fused 2..4-split shapes (512-1024 tokens) 1-3% behind.
# With more than one program per SM it would cost a second wave (~140 KB of shared memory each).
# 4 stages (3 tiles in flight) were 1.5% behind 3 on 128k. Only for heads padded to 128 or more:
# at d = 64 and 32 the same 128 rows on 8 warps read (1, 32/8, 128k) at 0.930 and 0.753 of SDPA,
# where the small-head rows on 4 warps (_small_head_rows, one program per SM) read 0.952 (128
# rows) and 0.925 (256 rows); at d = 64, 32k, 0.978 against 0.998 (.lead/sd3.py, 2026-11-22).
_LONG_TILE = {"BLOCK_N": 128, "num_warps": 8}
_LONG_SPLIT = 4096          # tokens per split from which a one-wave grid takes the long tile
_SMEM_HEADROOM = 24 * 1024  # Q, P and layout-conversion scratch next to the K/V ring (<= 20 KB seen)


def _long_tile_fits(smem_per_block: int, elt_bytes: int, block_dk: int, block_dv: int) -> bool:
    return _ring_fits(_LONG_TILE["BLOCK_N"], smem_per_block, elt_bytes, block_dk, block_dv)


def _ring_fits(block_n: int, smem_per_block: int, elt_bytes: int, block_dk: int, block_dv: int) -> bool:
    ring = (_NUM_STAGES - 1) * block_n * (block_dk + block_dv) * elt_bytes
    return ring + _SMEM_HEADROOM <= smem_per_block


# Tile rows for small heads. The default tile has 64 rows whatever the head dim, so at d = 32 it is
# 8 KB of K+V instead of 32 KB at d = 128, and a program keeps a quarter of the bytes in flight.
# For head dims below 128, rows are doubled (up to _MAX_ROWS, and while the ring fits the device's
# shared memory) until a K+V tile holds _TILE_BYTES, or _TILE_BYTES_ALONE where a program has its
# SM to itself (at most one program per SM). Measured on H100 (2026-11-22,
# .lead/sd_sweep.py, fp16, random blocks, ratio to SDPA in the same run; the 64-row default in
# brackets): d = 32: (8, 32/32, 2k) 128 rows 0.969 (0.866; the MHA loop the op ran there 0.584),
# 8k 0.961 (0.829; 0.531), (32, 32/8, 2k) 128 rows 0.929 (0.856), (1, 32/8, 32k) 256 rows 0.974
# (0.686; 128 rows 0.861); d = 64: (1, 32/8, 32k) 128 rows 0.990 (0.879), while at 256 programs 64
# rows lead (0.965 against 0.951 at (8, 32/32, 2k), 0.955 against 0.950 at (32, 32/8, 2k)); d = 96:
# (1, 32/8, 32k) 128 rows 0.968 (0.946). 8 warps did no better; 4 stages gained 1% at d = 64, 32k
# (1.000) and lost 5-11% on the d = 32 shapes of 256 programs.
# Not for MQA-sized groups: at d = 32, (16, 32/1, 4k) read 1.004 with 256 rows against 1.132 with
# 64 (d = 64: 0.983 with 128 rows, 0.991 with 64); nor for the MHA loop, whose registers hold 64 rows
# of 128 columns.
_TILE_BYTES = 16 * 1024
_TILE_BYTES_ALONE = 32 * 1024
_MAX_ROWS = 256
_SMALL_HEAD_MAX_GROUP = 16


def _small_head_rows(block_n: int, dk: int, dv: int, elt_bytes: int, block_dk: int, block_dv: int,
                     alone: bool, smem_per_block: int) -> int:
    if max(dk, dv) >= 128:
        return block_n  # measured at d = 128 and above with the default tile
    target = _TILE_BYTES_ALONE if alone else _TILE_BYTES
    while (block_n < _MAX_ROWS and block_n * (dk + dv) * elt_bytes < target
           and _ring_fits(2 * block_n, smem_per_block, elt_bytes, block_dk, block_dv)):
        block_n *= 2
    return block_n


@functools.lru_cache(maxsize=None)
def _cuda_facts(device_index: int) -> tuple[int, int]:
    """(streaming multiprocessors, opt-in shared memory one block may use in bytes: 227 KiB on
    sm_90, 163 on sm_80, 99 on sm_89) of a CUDA device, queried once per device."""
    props = torch.cuda.get_device_properties(device_index)
    smem = getattr(props, "shared_memory_per_block_optin", props.shared_memory_per_block)
    return props.multi_processor_count, int(smem)


def _cuda_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _device_smem(device: torch.device) -> int:
    if device.type != "cuda":
        return 0  # TRITON_INTERPRET on CPU: the default tile only
    return _cuda_facts(_cuda_index(device))[1]


def _device_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # TRITON_INTERPRET on CPU: any small number exercises the split path
    return _cuda_facts(_cuda_index(device))[0]


# Split-k heuristic constants (see choose_num_splits).
_MIN_FILL = 0.75            # below this fraction of the SMs busy, take one more split
_MIN_TILES_PER_SPLIT = 4    # a split streams >= 4 KV tiles (256 tokens), or the reduce dominates
_MAX_SPLITS = 128
# The reduce kernel (measured on H100 2026-11-22, .lead/td_prof.py: kernel time from CUPTI, and the
# op's graph-replay time against SDPA). One program per query head with a 16-split chunk took 3.23
# us on (16, 32/1, 4k) at 8 splits, against 2.56 for cuDNN's split reduction in SDPA. Four heads
# per program (128 programs instead of 512) and the chunk cut to the split count: 2.05-2.11 us
# (1 or 2 heads: 2.1-2.3; 8 heads: 2.2; 4 warps ahead of 2 and 1); 1.86 against 2.11 at
# (1, 32/8, 32k), 16 splits. That first version kept the per-head statistics as [HEADS] tensors,
# and Triton moved them between layouts through shared memory, replicated threads storing the
# same value to one address: racecheck reported write-write hazards. The all-3-D form has none
# (racecheck and memcheck clean, .lead/sanitize_dec.py) and costs 0.5% of the op's time on MQA
# and 32k (reduce 2.08-2.18 us).
_REDUCE_HEADS = 4            # query heads per reduce program (fewer for many splits: _reduce_shape)
_REDUCE_TILE = 8192          # HEADS x CHUNK_S x BLOCK_DV fp32 values per step: 64 per thread on 4 warps


def _reduce_step(block_dv: int, heads: int) -> int:
    """Splits the reduce kernel merges per step, one round trip to memory each, with ``heads``
    query heads per program: 16 at d = 128, 32 at d = 64 with 4 heads. A step more costs about
    1.4 us ((8, 32/1, 8k), d = 64, 32 splits in two steps of 16: 3.74 us against 2.30 for 16
    splits in one; H100, CUPTI, 2026-11-22)."""
    return max(1, _REDUCE_TILE // (heads * block_dv))


def _reduce_shape(num_splits: int, block_dv: int) -> tuple[int, int]:
    """(query heads per reduce program, splits per step): _REDUCE_HEADS heads, halved until one
    step merges every split (down to one head), so that many splits cost one round trip to memory
    instead of several. Measured on H100 (2026-11-22, .lead/rh_test.py, op graph time against
    SDPA in the same run, random blocks; 4 heads, 2, 1): (1, 32/1, 128k), d = 128, 128 splits:
    0.914, 1.022, 1.064; (2, 32/1, 32k), 66 splits: 0.949, 1.030, 1.038; (4, 32/1, 16k), 33:
    1.009, 1.050, 1.078; (1, 32/4, 128k), 33: 0.955, 0.967, 0.972; d = 64, (1, 32/1, 128k), 128:
    1.070, 1.114, 1.174; (2, 32/1, 32k), 66: 1.110, 1.114, 1.308. Where 4 heads already merge
    every split in one step fewer heads only add programs: (1, 32/8, 128k), 16 splits, 0.994,
    0.992, 0.992."""
    heads = _REDUCE_HEADS
    while heads > 1 and num_splits > _reduce_step(block_dv, heads):
        heads //= 2
    return heads, min(_next_pow2(num_splits), _reduce_step(block_dv, heads))


def choose_num_splits(batch_heads: int, n_ctx_bound: int, block_n: int, sm_count: int) -> int:
    """Split-k count from shapes only (never the context_lens values).

    Decode streams the KV cache once, so it runs at HBM speed only when (nearly) every SM streams.
    One program keeps num_stages - 1 K+V tiles in flight (64 KiB at d=128 fp16), more than an SM
    needs for its share of HBM (Little's law: ~23 KB on H100), so the target is one program per
    SM: the largest split count with B * H_kv * splits <= SMs; a program more than the SM count
    is a second wave on the SMs that take it (they finish last). Only if that leaves more than a
    quarter of the SMs idle, one split more. Extra splits cost an fp32 (m, l, acc) write + read
    (G * DV * 4 bytes against 2 * chunk * D * 2 bytes of KV) and a pipeline prologue each.

    Measured on H100 (132 SMs, fp16, d=128, splits forced; bench_decode): B * H_kv = 256 fastest
    unsplit; 64 at 2 (1 split: -32%); 32 at 4; 16 at 8; 8 at 16 (17 splits, 136 programs: -4..6%,
    more than 32: -5..20%; 256 at 2, 3 or 4 splits: 0.93-0.95 of SDPA against 0.98-0.99
    unsplit). A split keeps >= _MIN_TILES_PER_SPLIT tiles. Where one program's tiles are small
    (MQA-sized groups at heads up to 64), launch_plan asks for two programs per SM
    (_two_programs_per_sm).

    What else was tried for the paged decode on H100, and where the rest of the gap to SDPA lies
    (DRAM efficiency, the block order, the GPCs' finishing times): docs/decode-h100-notes.md.
    """
    if batch_heads >= sm_count:
        return 1
    n_tiles = triton.cdiv(n_ctx_bound, block_n)
    max_splits = max(1, min(_MAX_SPLITS, n_tiles // _MIN_TILES_PER_SPLIT))
    splits = sm_count // batch_heads
    if batch_heads * splits < _MIN_FILL * sm_count:
        splits += 1
    return max(1, min(max_splits, splits))


# --------------------------------------------------------------------------- the torch op


# Launch knobs, keys of the ``config`` dict next to BLOCK_N / num_warps / num_stages. None = chosen
# by _auto_knobs from the split count; benchmarks force True / False.
_KNOBS = {
    # the split partition from the context bound (max_blocks * page_size), not context_lens: the
    # first block-table load is issued without waiting for the length
    "early_pages": True,
    # the last split program of each (b, h_kv) to finish merges the partials itself (no
    # _reduce_kernel launch); arrival counters in a per-(device, stream) int32 workspace kept at zero
    "fused_reduce": None,
    # programmatic dependent launch (sm_90+; ignored elsewhere): the kernels wait
    # (griddepcontrol.wait) before any global access and let the next kernel in the stream launch
    # early, which hides launch latency
    "pdl": None,
    # software-pipeline depth of the fused merge's loop over the splits
    "merge_stages": 3,
    # paged KV whose tiles hold whole pages (BLOCK_N % block_size == 0; needs early_pages): in-page
    # row offsets hoisted out of the loop, 32-bit offsets where the cache allows, rows past the end
    # pointed at a real row instead of masked
    "whole_pages": True,
    # MHA (H_q == H_kv) over whole pages: the K/V loop on CUDA cores with register double
    # buffering instead of tl.dot behind a shared-memory ring (_mha_fma_loop; num_stages unused).
    # None: on where _mha_fma_pays
    "mha_fma": None,
    # the MHA loop's launches that decode_gluon.fits run as its Gluon kernel (the row slots merged
    # with one shared-memory exchange instead of Triton's cross-warp reductions)
    "gluon_mha": True,
    # the in-loop K/V loads into registers of the MHA loops (mha_fma, gluon_mha) and of the GQA
    # kernel (gluon_gqa) marked L1::evict_first (each row is read once). H100, ratio to SDPA,
    # same SASS schedule with only the hint changed: (16, 32/32, 1k) 0.999 -> 1.044, (8, 32/32,
    # 2k) 1.005 -> 1.029, 8k 0.993 -> 0.999, d = 64 and 96 +3-5%. The first tile's loads stay
    # plain: marked as well, they cost 2-4% at 1k-2k. Why L1 allocation slows these streams is
    # not established (docs/decode-h100-notes.md, "The L1 eviction policy of the MHA loops")
    "kv_evict_first": True,
    # GQA launches of head dim 128 run decode_gluon's GQA kernel (one online-softmax state per
    # warp, mma.sync, K/V one tile ahead in registers) instead of the dot path. None: where
    # decode_gluon.gqa_takes measured it faster, at its own split count (gqa_splits) unless one
    # is given; True: wherever it can run, at the dot path's split count
    "gluon_gqa": None,
    # the Gluon kernels visit the pages of splits of 256 to 1024 pages in ascending order of address,
    # sorted in the kernel (decode_gluon.sort_size; ratio to SDPA, .lead/s21h.py): (8, 32/32, 8k)
    # 0.997 -> 1.009, (1, 32/8, 128k) 0.996 -> 1.009
    "sort_pages": True,
}


def _auto_knobs(num_splits: int) -> dict:
    """fused_reduce and pdl for a launch of num_splits splits: fused_reduce on for 2..4 splits, pdl
    on from 2 splits (the decode kernel and, beyond 4 splits, the reduce kernel after it).

    Measured on H100 (fp16, d=128, paged block 16, CUDA graph, .lead/td_sweep.py; time ratio vs
    torch SDPA, > 1 is faster; base = all knobs off, two-kernel merge):
      1 split:  pdl costs 3-10% ((8,32,32,2k) 0.983 -> 0.884, (32,32,8,2k) 0.972 -> 0.887,
                (8,32,32,8k) 0.990 -> 0.963); fused does nothing (nothing to merge).
      2-4:      fused+pdl gains 8-10% ((8,32,8,2k) 2 splits 0.959 -> 1.033, (8,64,8,2k) 2 splits
                0.925 -> 1.012, (4,64,8,2k) 4 splits 0.917 -> 1.013; with early_pages 1.030..1.041);
                fused alone +5..7%, pdl alone +1..2%.
      8-16:     fused costs up to 4% ((16,32,1,4k) 8 splits 0.886 -> 0.850, (1,32,8,32k) 16 splits
                0.956 -> 0.940, (1,32,8,128k) 16 splits 0.959 -> 0.952: one program merges every
                split serially); pdl is within 1% either way.
    early_pages is on for every shape (_KNOBS): -0.1..+4% against base.
    PDL with the dependent launch moved after the K/V loop (2026-11-22, .lead/pp/decode_late.py;
    ratio vs SDPA, random blocks): 1 split within noise of no PDL ((8,32,32,2k) 0.984 against
    0.982, (32,32,8,2k) 0.980 against 0.978, (8,32,32,8k) 0.984 against 0.986), and worse than
    PDL at program start with 8-16 splits ((16,32,1,4k) 0.864 against 0.957, (1,32,8,128k) 0.907
    against 0.965): not used.
    2026-11-22, fourth session, with the four-heads reduce kernel (.lead/td_prof.py; op graph time
    against SDPA in the same run): pdl pays beyond 4 splits as well, the reduce kernel's launch
    hidden under the decode kernel's tail: (16,32/1,4k) 8 splits 0.970 -> 1.035 (19.79 -> 18.54
    us), (1,32/8,32k) 16 splits 0.993 -> 1.014.
    Only the split count decides, a function of the shapes: no host sync, CUDA-graph capturable.
    """
    return {"fused_reduce": 2 <= num_splits <= 4, "pdl": num_splits >= 2}


def _mha_fma_pays(group: int, elt_bytes: int, block_dk: int, block_dv: int, programs: int, sms: int,
                  gluon: bool) -> bool:
    """Whether an MHA launch takes the CUDA-core loop (_mha_fma_loop): 2-byte K/V and more programs
    than SMs (two programs share an SM, each with one 32 KB tile in flight while it computes the
    other), for head dims 65 to 128, padded to 128 (the tile and its successor in registers take
    251 of 255 registers at 64 rows on 4 warps; fp32 or wider heads would spill), and for head dims
    up to 64 where the launch can run as the Gluon kernel (``gluon``: decode_gluon.takes, one
    split), whose tile for small heads (decode_gluon.tile) holds more rows.

    Up to d = 64 the Triton loop loses to the dot path (_small_head_rows): its tile keeps too few
    bytes in flight, or with more rows its cross-warp merge costs more. Same runs (.lead/sd2.py,
    .lead/gl_hd.py, 2026-11-22, ratio to SDPA): d = 64, (8, 32/32, 2k) the dot path 0.964-0.970,
    the Triton loop with 64 rows on 4 warps 0.950, 128 on 8 0.975-0.980, the Gluon kernel with 128
    on 8 1.002; 8k 0.959-0.961, 0.933, 0.971-0.980, 0.987; d = 32, (8, 32/32, 2k) 0.983, the
    Triton loop with 128 rows on 8 warps 0.851, the Gluon kernel 1.046. At d = 96 the loop (as the
    Gluon kernel) leads: 0.963 and 0.938 against 0.943 and 0.928.

    Measured on H100 (2026-11-22, .lead/td_prof.py with .lead/pp/decode_lr.py, op graph time
    against SDPA in the same run, random blocks; the dot path in brackets): (8, 32/32, 2k) 0.991
    and 0.997 (0.983, 0.987) in two runs, (8, 32/32, 8k) 0.992 (0.987), (16, 32/32, 1k) with 512
    programs 0.975 (0.973). At one program per SM or fewer it loses: the 64-row tile 0.80-0.92 on
    (4, 32/32, 4k), (2, 32/32, 8k), (1, 32/32, 32k) and (1, 16/16, 128k); 128 rows on 8 warps
    (one program per SM by registers) ties, 0.977-1.004 against 0.979-1.004. Without the register
    double buffering the loop waits for each tile: 0.50 (64 rows, 4 warps), 0.85 (128, 8 warps);
    the dot path with the same double buffering: 0.96-0.97 (64 rows), 0.90-0.95 (128). More in
    docs/decode-h100-notes.md."""
    return (group == 1 and elt_bytes == 2 and programs > sms
            and (block_dk == block_dv == 128 or (gluon and block_dk == block_dv <= 64)))


def _two_programs_per_sm(group: int, block_n: int, block_dk: int, block_dv: int, elt_bytes: int) -> bool:
    """Whether a split launch aims at two programs per SM instead of one: groups of 17 to 32 query
    heads, whose tile keeps the default rows at small heads (_small_head_rows), where that tile's
    K+V, padded, is under _TILE_BYTES_ALONE: heads up to 64 in 2-byte types. One program per SM
    then keeps two 16 KB tiles in flight at d = 64 instead of two 32 KB ones at d = 128.
    launch_plan takes the count for two per SM where the launch is split anyway.

    Measured on H100 (2026-11-22, .lead/mq_verify.py, bench_decode with forced splits, random
    blocks; time at the one-per-SM count over time at the two-per-SM count, > 1: faster):
    d = 64: (16, 32/1, 4k) 16 splits against 8: 1.069; (8, 32/1, 8k) 32 against 16: 1.096;
    (32, 32/1, 2k) 8 against 4: 1.110; (8, 64/2, 4k) 1.065; (64, 32/1, 1k) 4 against 2: 1.024;
    with the reduce at fewer heads per program (_reduce_shape): (4, 32/1, 16k) 64 against 33:
    1.068; (2, 32/1, 32k) 128 against 66: 1.074; (8, 32/1, 16k) 33 against 16: 1.117; (4, 32/1,
    32k) 66 against 33: 1.119. d = 32: 1.046, 1.156, 1.021, 1.052, 1.049, (4, 32/1, 16k) 64
    against 33: 1.121, (2, 32/1, 32k) 1.091, (8, 32/1, 16k) 1.229. The count taken was within 1%
    of the best forced power of two or SM multiple on all of them. The decode kernel alone at
    (8, 32/1, 8k), d = 64: 7.49 us at 32 splits against 8.99 at 16 (CUPTI). Where two per SM
    loses: an unsplit launch taken to 2 splits ((128, 32/1, 512), d = 64: 0.97); counts the
    reduce merged in several steps, before _reduce_step and _reduce_shape ((8, 32/1, 8k) at 32
    splits in two steps of 16: 0.993 of SDPA against 1.045 at 16); groups of 64, 7% either way
    by shape ((16, 64/1, 4k) at d = 64 and (32, 64/1, 2k) at d = 32 lose, the other two gain);
    groups of 16, which _small_head_rows gives 32 KB tiles: within 3% either way. Heads padded to
    128: at d = 80 and 96 it gained 2-13% on three shapes but lost 4-6% at (64, 32/1, 1k); at
    d = 112 it lost 2-11% on three of four; at d = 128 MQA (16, 32/1, 4k) 16 splits read 1.024 of
    SDPA against 1.066 at 8. They keep one per SM."""
    return (_SMALL_HEAD_MAX_GROUP < group <= 32
            and block_n * (block_dk + block_dv) * elt_bytes < _TILE_BYTES_ALONE)


def _two_warps_pay(group: int, elt_bytes: int, block_dk: int, block_dv: int) -> bool:
    """Whether the dot path's default tile (64 rows, 3 stages) runs on 2 warps instead of 4: GQA
    groups of 2 to 4 query heads, 2-byte K/V, head dims 128.

    The 16-row padded score tile [16, 64] is split over the warps along the keys, so each tile's
    row max, row sum and the P operand of the second dot cross warps through shared memory
    behind barriers. Without the softmax the loop is 1.3-1.6% faster (ablation, .lead/pp/
    decode_ab.py: (32, 32/8, 2k) 0.997 of SDPA against 0.981-0.984, (8, 32/32, 2k) 1.001-1.004
    against 0.988-0.991). On 2 warps half of that comes back. Measured on H100 (2026-11-22,
    .lead/td_prof.py, op graph time against SDPA in the same run, random blocks; 4 warps in
    brackets): (32, 32/8, 2k) 0.991, 0.984, 0.987, 0.988, 0.991 (0.984, 0.979, 0.975, 0.977,
    0.984); (1, 32/8, 32k) 1.014, 1.016 (1.001, 1.001); (8, 32/8, 2k) 1.061, 1.063 (1.057,
    1.066). Groups of 8 tie or lose ((4, 64/8, 2k) 1.088 against 1.090, (8, 64/8, 2k) 1.049
    against 1.054), MQA loses 5% (32 query rows), MHA on tl.dot ties (0.990 against 0.988), at
    128k the 64-row tile on 2 warps is behind the long tile (0.980 against 0.997), and 1 warp
    gains nothing (0.983). Smaller heads keep 4 warps: at d = 64 2 warps gained 0.6% at (32, 32/8,
    2k); at d = 32, on the 128-row tile, 1.5% there but 2-13% lost on the split shapes
    (docs/decode-h100-notes.md, "Head dims below 128"). Not measured: fp32, which keeps 4 warps."""
    return 2 <= group <= 4 and elt_bytes == 2 and block_dk == block_dv == 128


def launch_plan(b: int, h_q: int, h_kv: int, dk: int, dv: int, n_ctx_bound: int, elt_bytes: int,
                device: torch.device, config: Optional[dict] = None, num_splits: int = 0,
                page_size: int = 16) -> dict:
    """Tile configuration (with the knobs resolved), padded tile sizes and the split count of one
    decode shape. ``config`` keys override the defaults (tile sizes and _KNOBS); ``num_splits`` > 0
    overrides the automatic split count (the automatic knobs then follow the given count).
    ``config["pdl"]`` is the request: the launch uses PDL only where the device supports it.
    Unless the config sets the tile, a grid of at most one program per SM whose splits are at least
    _LONG_SPLIT tokens and whose heads pad to 128 or more takes _LONG_TILE where the device's shared
    memory holds it, the dot path's default tile takes more rows for heads below 128
    (_small_head_rows), and its 64-row tile runs on 2 warps where _two_warps_pay. The automatic
    split count aims at two programs per SM instead of one where _two_programs_per_sm.
    ``page_size`` is the paged cache's block size, 0 for a contiguous cache: the MHA loop of heads
    up to 64 needs tiles of whole pages."""
    group = h_q // h_kv
    block_dk, block_dv = max(16, _next_pow2(dk)), max(16, _next_pow2(dv))
    cfg = {**_tile_config(elt_bytes, block_dk, block_dv), **_KNOBS, **(config or {})}
    unknown = set(cfg) - set(_KNOBS) - {"BLOCK_N", "num_warps", "num_stages"}
    if unknown:
        raise KeyError(f"unknown decode config keys {sorted(unknown)}")
    sms = _device_sms(device)
    auto_splits = choose_num_splits(b * h_kv, n_ctx_bound, cfg["BLOCK_N"], sms)
    if auto_splits > 1 and _two_programs_per_sm(group, cfg["BLOCK_N"], block_dk, block_dv, elt_bytes):
        auto_splits = choose_num_splits(b * h_kv, n_ctx_bound, cfg["BLOCK_N"], 2 * sms)
    splits = num_splits if num_splits > 0 else auto_splits
    tile_forced = bool(set(config or {}) & {"BLOCK_N", "num_warps", "num_stages"})
    # decode_gluon's GQA kernel: forced, wherever it can run; by default where its rule takes the
    # launch at its own split count (two programs per SM) or at the one given
    gluon_gqa = False
    if cfg["gluon_gqa"] is not False and not tile_forced and page_size > 0:
        if cfg["gluon_gqa"] is True:
            gluon_gqa = decode_gluon.gqa_takes(group, dk, dv, elt_bytes, splits, b * h_kv, n_ctx_bound, sms,
                                               device, forced=True)
        else:
            g_splits = num_splits if num_splits > 0 else decode_gluon.gqa_splits(b * h_kv, sms)
            if decode_gluon.gqa_takes(group, dk, dv, elt_bytes, g_splits, b * h_kv, n_ctx_bound, sms, device):
                gluon_gqa, splits = True, g_splits
    long_tile = False
    alone = b * h_kv * splits <= sms
    if (not tile_forced and alone and max(block_dk, block_dv) >= 128
            and triton.cdiv(n_ctx_bound, splits) >= _LONG_SPLIT
            and _long_tile_fits(_device_smem(device), elt_bytes, block_dk, block_dv)):
        cfg.update(_LONG_TILE)
        long_tile = True
    for key, on in _auto_knobs(splits).items():
        cfg[key] = on if cfg[key] is None else bool(cfg[key])
    if gluon_gqa:
        cfg["fused_reduce"] = False  # the GQA kernel's splits are merged by the reduce kernel
    gluon_tile = None  # the Gluon kernel's tile (decode_gluon.tile), where it can take the launch
    if cfg["mha_fma"] is None:
        if (not tile_forced and cfg["gluon_mha"] and page_size > 0
                and decode_gluon.takes(dk, dv, elt_bytes, splits, device)):
            gluon_tile = decode_gluon.tile(dv, b * h_kv * splits, sms)
            if gluon_tile[0] % page_size:
                gluon_tile = None  # not whole pages
        cfg["mha_fma"] = _mha_fma_pays(group, elt_bytes, block_dk, block_dv, b * h_kv * splits, sms,
                                       gluon_tile is not None)
    cfg["early_pages"] = bool(cfg["early_pages"])
    cfg["whole_pages"] = bool(cfg["whole_pages"])
    # the MHA loop reads tiles of whole pages (blocks larger than its tile take the dot path)
    mha_rows = gluon_tile[0] if gluon_tile else cfg["BLOCK_N"]
    cfg["mha_fma"] = bool(cfg["mha_fma"]) and group == 1 and page_size > 0 and mha_rows % page_size == 0
    default_tile = not (tile_forced or long_tile or cfg["mha_fma"])  # the dot path's, not set by the config
    if default_tile and group <= _SMALL_HEAD_MAX_GROUP:
        cfg["BLOCK_N"] = _small_head_rows(cfg["BLOCK_N"], dk, dv, elt_bytes, block_dk, block_dv, alone,
                                          _device_smem(device))
    if default_tile and cfg["BLOCK_N"] == 64 and _two_warps_pay(group, elt_bytes, block_dk, block_dv):
        cfg["num_warps"] = 2
    if cfg["mha_fma"] and gluon_tile:
        cfg["BLOCK_N"], cfg["num_warps"] = gluon_tile
    cfg["gluon_gqa"] = gluon_gqa
    return {"config": cfg, "BLOCK_G": max(16, _next_pow2(group)), "BLOCK_DK": block_dk, "BLOCK_DV": block_dv,
            "sm_count": sms, "auto_splits": auto_splits, "num_splits": splits}


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


_OFFS32_LIMIT = 2**31  # caches whose every element lies below this offset use 32-bit row offsets


def _max_offset(t: torch.Tensor) -> int:
    """The largest element offset of a tensor view from its first element (strides are >= 0)."""
    return sum((n - 1) * st for n, st in zip(t.shape, t.stride()))


def _pdl_ok(device: torch.device) -> bool:
    return (not interpreting() and device.type == "cuda"
            and torch.cuda.get_device_capability(device)[0] >= 9)


def _launch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            block_table: Optional[torch.Tensor], context_lens: Optional[torch.Tensor],
            scale: float, num_splits: int, config: Optional[dict] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Allocate out/lse (and the split partials) and launch; ``config`` overrides the tile
    configuration (BLOCK_N, num_warps, num_stages) and the _KNOBS for benchmark sweeps.
    num_splits <= 0: the automatic split count."""
    b, h_q, dk = q.shape
    dv = v_cache.shape[3]
    paged = block_table is not None
    if context_lens is not None:
        context_lens = context_lens.contiguous()  # the kernels read context_lens[b] at offset b
    if paged:
        num_blocks, page_size, h_kv, _ = k_cache.shape
        if num_blocks == 0:  # the kernels clamp block ids into the cache: it needs a block
            raise ValueError("paged k_cache/v_cache hold no block (k_cache.shape[0] == 0)")
        n_ctx_bound = block_table.shape[1] * page_size
        # (num_blocks, PAGE_SIZE, H_kv, D): block / position-in-block / head / dim
        sk = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.stride(3))
        sv = (v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), v_cache.stride(3))
        s_bt = (block_table.stride(0), block_table.stride(1))
    else:
        _, h_kv, n_ctx_bound, _ = k_cache.shape
        page_size = 1
        # (B, H_kv, N_max, D): the sequence is one block chain, so "block" = sequence
        sk = (k_cache.stride(0), k_cache.stride(2), k_cache.stride(1), k_cache.stride(3))
        sv = (v_cache.stride(0), v_cache.stride(2), v_cache.stride(1), v_cache.stride(3))
        s_bt = (0, 0)
        block_table = q  # never read (PAGED=False); any pointer will do
        num_blocks = 1
    group = h_q // h_kv
    plan = launch_plan(b, h_q, h_kv, dk, dv, n_ctx_bound, q.element_size(), q.device, config, max(0, num_splits),
                       page_size if paged else 0)
    cfg, block_g, block_dk, block_dv = plan["config"], plan["BLOCK_G"], plan["BLOCK_DK"], plan["BLOCK_DV"]
    num_splits = plan["num_splits"]

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

    fused = split and bool(cfg["fused_reduce"])
    counters = _counters(q.device, b * h_kv) if fused else None
    pdl = cfg["pdl"] and _pdl_ok(q.device)
    knobs = {"EARLY_PAGES": cfg["early_pages"], "USE_PDL": pdl}
    gluon_ran = False
    num_stages = cfg["num_stages"]
    if paged and cfg["whole_pages"] and cfg["early_pages"]:
        # the block size and BLOCK_N are powers of two: a tile holds whole pages or lies inside one
        whole = cfg["BLOCK_N"] % page_size == 0
        knobs.update(WHOLE_PAGES=whole, PAGE_TILES=not whole,
                     OFFS32=max(_max_offset(k_cache), _max_offset(v_cache)) < _OFFS32_LIMIT)
        if whole and cfg["mha_fma"]:
            knobs.update(MHA_FMA=True, KV_EVICT="evict_first" if cfg["kv_evict_first"] else "")
            num_stages = 1  # no shared-memory ring: the next tile waits in registers
            block_g = 1  # no tl.dot: the epilogue stores the one head unpadded
            if knobs["OFFS32"] and decode_gluon.fits(q, k_cache, v_cache, block_table, context_lens,
                                                     num_splits, cfg):
                decode_gluon.launch(q, k_cache, v_cache, block_table, context_lens, out, lse, scale * _LOG2E,
                                    cfg["BLOCK_N"], cfg["num_warps"], evict_first=bool(cfg["kv_evict_first"]),
                                    sort_pages=bool(cfg["sort_pages"]))
                return out, lse
        if (cfg["gluon_gqa"] and knobs["OFFS32"]
                and decode_gluon.gqa_fits(q, k_cache, v_cache, block_table, context_lens)):
            decode_gluon.launch_gqa(q, k_cache, v_cache, block_table, context_lens, out, lse, scale * _LOG2E,
                                    evict_first=bool(cfg["kv_evict_first"]), num_splits=num_splits,
                                    partials=(part_m, part_l, part_acc) if split else None,
                                    sort_pages=bool(cfg["sort_pages"]))
            if not split:
                return out, lse
            gluon_ran = True  # its splits are merged by the reduce kernel (fused_reduce is off)
    if fused:
        knobs.update(FUSED=True, MERGE_STAGES=int(cfg["merge_stages"]), BLOCK_GM=_next_pow2(group))
    launch_opts = {"launch_pdl": True} if pdl else {}

    if not gluon_ran:
        grid = (h_kv, b, num_splits)
        _decode_kernel[grid](
            q, k_cache, v_cache, block_table, context_lens if context_lens is not None else q,
            out, lse, part_m, part_l, part_acc, counters if fused else lse,
            scale * _LOG2E, n_ctx_bound, num_splits, num_blocks,
            q.stride(0), q.stride(1), q.stride(2),
            *sk, *sv, *s_bt,
            out.stride(0), out.stride(1), out.stride(2),
            lse.stride(0), lse.stride(1),
            *s_pm, *s_pa,
            GROUP=group, BLOCK_G=block_g,
            DK=dk, DV=dv, BLOCK_DK=block_dk, BLOCK_DV=block_dv,
            BLOCK_N=cfg["BLOCK_N"], PAGE_SIZE=page_size,
            PAGED=paged, HAS_LENS=context_lens is not None, SPLIT=split,
            UPCAST_DOT=q.dtype == torch.bfloat16 and interpreting(),
            num_warps=cfg["num_warps"], num_stages=num_stages, **knobs, **launch_opts,
        )
    if split and not fused:
        heads, chunk = _reduce_shape(num_splits, block_dv)
        _reduce_kernel[(triton.cdiv(h_q, heads), b)](
            part_m, part_l, part_acc, out, lse,
            num_splits, h_q,
            *s_pm, *s_pa,
            out.stride(0), out.stride(1), out.stride(2),
            lse.stride(0), lse.stride(1),
            DV=dv, BLOCK_DV=block_dv, HEADS=heads, CHUNK_S=chunk,
            USE_PDL=pdl, num_warps=4, **launch_opts,
        )
    return out, lse


@torch.library.custom_op("flashcl::decode", mutates_args=())
def decode_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              block_table: Optional[torch.Tensor], context_lens: Optional[torch.Tensor],
              scale: float, num_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """flashcl::decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor? block_table,
    Tensor? context_lens, float scale, int num_splits) -> (Tensor out, Tensor lse)

    q (B, H_q, DK); paged (block_table given) or contiguous cache as in the module docstring.
    num_splits 0 = choose from the shapes and the SM count; out (B, H_q, DV) q.dtype,
    lse (B, H_q) float32. Inputs are not mutated.
    """
    return _launch(q, k_cache, v_cache, block_table, context_lens, scale, num_splits)


@decode_op.register_fake
def _(q, k_cache, v_cache, block_table, context_lens, scale, num_splits):
    b, h_q, _ = q.shape
    return q.new_empty((b, h_q, v_cache.shape[3])), q.new_empty((b, h_q), dtype=torch.float32)


def decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *,
           block_table: Optional[torch.Tensor] = None, context_lens: Optional[torch.Tensor] = None,
           scale: float, num_splits: Optional[int] = None, return_lse: bool = False):
    """Backend entry of ``flashcl.decode`` (inputs already validated there). Traceable by
    torch.compile (fullgraph) and capturable in a CUDA graph: nothing here syncs with the device."""
    out, lse = torch.ops.flashcl.decode(q, k_cache, v_cache, block_table, context_lens,
                                        float(scale), 0 if num_splits is None else int(num_splits))
    return (out, lse) if return_lse else out
