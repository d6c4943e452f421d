"""The MHA decode loop in Gluon, for the merge of its row slots after the loop.

``decode._mha_fma_loop`` keeps an online-softmax state per row slot of its 64-row tile (no
reduction across rows inside the loop) and merges the 64 states once at the end. Written in
Triton, that merge took about 2,300 cycles in every program, whatever the context length: each
cross-warp ``tl.max``/``tl.sum`` is lowered with its own shared-memory rounds and barriers (11
barriers after the loop). This kernel runs the same loop on the same distribution of the tile,
but lays the tile out 4-D, [R, W, 2, D] (register repeat, warp, lane pair, head dim), so that the
merge can be written step by step: the R slots a thread holds in registers, the lane pair with
one shuffle, then the W warps' states (m, l, acc) through shared memory behind one barrier, each
thread finishing one column of the output.

Measured on H100 (fp16, paged block 16 in random order, CUDA-graph replay; .lead/g1_bench.py,
2026-11-22), ratio to SDPA on contiguous KV in the same run, the op's Triton MHA loop (gluon_mha
off) in brackets: (8, 32/32, 64 tokens) 1.057 (0.899), 256 tokens 1.045 (0.974), (16, 32/32, 1k)
0.997 (0.972), (8, 32/32, 2k) 0.999 (0.986), 8k 0.991 (0.990). A copy of the kernel with no
merge at all ran within 1% of it (.lead/g1_test.py): the merge costs about 0.1 us.

It takes the launches it ``fits``: MHA over whole pages (block_size dividing 64) with context
lengths, one split, 2-byte K/V of head dims 65 to 128 (padded to 128; the masked columns read no
bytes), 32-bit cache offsets, CUDA devices of compute capability 8.0 or newer, and a Triton with
Gluon. Everything else, and the interpreter (which has no Gluon), takes the Triton kernel; the
``gluon_mha`` knob turns this path off. Run with Triton 3.6 (H100); compiled with Triton 3.6 for
sm_80, sm_89 and sm_90, and with Triton 3.9 for sm_90. At head dim 96 (.lead/gd_bench.py,
2026-11-22, ratio to SDPA, the Triton MHA loop in brackets): 64 tokens 1.122 (0.937), 256 tokens
1.073 (0.996), (16, 32/32, 1k) 0.972 (0.946), 2k 0.969 (0.964), 8k 0.932 (0.933).
"""

from __future__ import annotations

import torch

from . import interpreting

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
except ImportError:  # a Triton without Gluon
    gluon = None

_BLOCK_N = 64  # rows per tile: R = 8 per thread, on 4 warps of 2 x 16 lanes
_NUM_WARPS = 4
_BLOCK_D = 128  # 16 lanes x 8 columns; head dims 65..128 (the op's MHA loop takes no others)


def available() -> bool:
    return gluon is not None and not interpreting()


def fits(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
         context_lens, num_splits: int, cfg: dict) -> bool:
    """Whether a launch that the op sends to the MHA loop (whole pages, 32-bit offsets) runs here."""
    return (available() and cfg["gluon_mha"] and num_splits == 1 and context_lens is not None
            and q.is_cuda and torch.cuda.get_device_capability(q.device)[0] >= 8
            and q.element_size() == 2 and q.shape[2] == v_cache.shape[3] and _BLOCK_D // 2 < q.shape[2] <= _BLOCK_D
            and cfg["BLOCK_N"] == _BLOCK_N and cfg["num_warps"] == _NUM_WARPS
            and block_table.shape[1] >= 1 and block_table.stride(1) == 1
            and q.stride(2) == 1 and k_cache.stride(3) == 1 and v_cache.stride(3) == 1)


def launch(q, k_cache, v_cache, block_table, context_lens, out, lse, qk_scale_log2: float) -> None:
    """out/lse of MHA decode over a paged cache whose offsets fit 32 bits (see ``fits``)."""
    b, h, _ = q.shape
    _mha_decode[(h, b)](
        q, k_cache, v_cache, block_table, context_lens, out, lse, qk_scale_log2, block_table.shape[1],
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_table.stride(0),
        out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
        BLOCK_N=_BLOCK_N, D=q.shape[2], BLOCK_D=_BLOCK_D, PAGE=k_cache.shape[1], num_warps=_NUM_WARPS)


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
    def _load_cols(ptrs, cols, D: gl.constexpr, BLOCK_D: gl.constexpr):
        """A tile's rows; the padding columns of a head dim below BLOCK_D read as zeros (the
        scores and the output then ignore them: q is zero there too)."""
        if D == BLOCK_D:
            x = gl.load(ptrs)
        else:
            x = gl.load(ptrs, mask=cols, other=0.0)
        return x

    @gluon.jit
    def _mha_decode(Q, K, V, BlockTable, ContextLens, Out, Lse, qk_scale_log2, max_blocks,
                    stride_qb, stride_qh, stride_kblk, stride_kpos, stride_kh,
                    stride_vblk, stride_vpos, stride_vh, stride_btb,
                    stride_ob, stride_oh, stride_lseb, stride_lseh,
                    BLOCK_N: gl.constexpr, D: gl.constexpr, BLOCK_D: gl.constexpr, PAGE: gl.constexpr):
        """One program per (head, sequence); the loop of decode._mha_fma_loop over whole pages.
        A head dim D below BLOCK_D reads its padding columns as zeros."""
        W: gl.constexpr = gl.num_warps()
        R: gl.constexpr = BLOCK_N // (2 * W)
        gl.static_assert(BLOCK_D == 128 and D <= BLOCK_D and BLOCK_N % PAGE == 0)
        # Triton's blocked layout of the op's [BLOCK_N, BLOCK_D] tile ([1, 8] per thread, [2, 16]
        # lanes, [W, 1] warps), with the row split into (register repeat, warp, lane pair)
        L4: gl.constexpr = gl.BlockedLayout([1, 1, 1, 8], [1, 1, 2, 16], [1, W, 1, 1], [3, 2, 1, 0])
        ROWS: gl.constexpr = gl.SliceLayout(3, L4)  # per-row values, one copy per thread
        pid_h = gl.program_id(0)
        pid_b = gl.program_id(1)
        # row n of a tile (token start + n) sits at (n // 2W, (n // 2) % W, n % 2)
        tok0 = _index(R, 0, L4, 3) * (2 * W) + _index(W, 1, L4, 3) * 2 + _index(2, 2, L4, 3)
        d4 = _index(BLOCK_D, 3, L4, 4)
        cols = d4 < D  # the head dim's columns (all of them when D == BLOCK_D)
        bt = BlockTable + pid_b.to(gl.int64) * stride_btb
        k_base = K + pid_h.to(gl.int64) * stride_kh
        v_base = V + pid_h.to(gl.int64) * stride_vh

        # the first tile's entries are loaded with the length, not after it (clamped to the
        # table's width); its rows past the end are masked (the sequence may be empty)
        page = gl.load(bt + gl.minimum(tok0 // PAGE, max_blocks - 1))
        n_ctx = gl.load(ContextLens + pid_b)
        last = gl.maximum(n_ctx - 1, 0)  # the last token (token 0 of an empty sequence: never read)
        q = gl.load(Q + pid_b.to(gl.int64) * stride_qb + pid_h * stride_qh + d4, mask=cols,
                    other=0.0).to(gl.float32) * qk_scale_log2
        in_page = tok0 % PAGE
        first = gl.expand_dims(tok0 < n_ctx, 3) & cols  # & cols: the row mask over the tile
        k_next = gl.load(k_base + gl.expand_dims(page * stride_kblk + in_page * stride_kpos, 3) + d4,
                         mask=first, other=0.0)
        v_next = gl.load(v_base + gl.expand_dims(page * stride_vblk + in_page * stride_vpos, 3) + d4,
                         mask=first, other=0.0)
        page = gl.load(bt + gl.minimum(tok0 + BLOCK_N, last) // PAGE)

        m_r = gl.full([R, W, 2], float("-inf"), gl.float32, ROWS)
        l_r = gl.zeros([R, W, 2], gl.float32, ROWS)
        acc = gl.zeros([R, W, 2, BLOCK_D], gl.float32, L4)
        for start in range(0, n_ctx, BLOCK_N):
            k = k_next
            v = v_next
            # the next tile into registers while this one is computed; its rows past the end
            # read the last token's row (real, no mask; their scores are -inf), and the block
            # table is read one tile further ahead, never past the sequence's last entry
            tok = gl.minimum(start + BLOCK_N + tok0, last)
            k_next = _load_cols(k_base + gl.expand_dims(page * stride_kblk + (tok % PAGE) * stride_kpos, 3) + d4,
                                cols, D, BLOCK_D)
            v_next = _load_cols(v_base + gl.expand_dims(page * stride_vblk + (tok % PAGE) * stride_vpos, 3) + d4,
                                cols, D, BLOCK_D)
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

        # the merge, as [.., 1] tensors of L4: the R slots of a thread in registers, then the lane
        # pair (one shuffle): one state per warp, [1, W, 1, BLOCK_D]
        m_w, l_w, acc_w = _merge_states(gl.expand_dims(m_r, 3), gl.expand_dims(l_r, 3), acc, 0)
        m_w, l_w, acc_w = _merge_states(m_w, l_w, acc_w, 2)
        # then the warps' states through shared memory behind one barrier, each thread merging the
        # W states of one column
        smem: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [3, 2, 1, 0])
        acc_s = gl.allocate_shared_memory(gl.float32, [1, W, 1, BLOCK_D], smem)
        m_s = gl.allocate_shared_memory(gl.float32, [1, W, 1, 1], smem)
        l_s = gl.allocate_shared_memory(gl.float32, [1, W, 1, 1], smem)
        acc_s.store(acc_w)
        m_s.store(m_w)
        l_s.store(l_w)
        _cta_barrier()
        COLS: gl.constexpr = gl.BlockedLayout([1, W, 1, 1], [1, 1, 1, 32], [1, 1, 1, W], [3, 2, 1, 0])
        m, l, acc_row = _merge_states(m_s.load(COLS), l_s.load(COLS), acc_s.load(COLS), 1)  # [.., D]
        seen = l > 0.0  # context_len 0: out 0, lse -inf (no 0/0)
        l_safe = gl.where(seen, l, 1.0)
        col = _index(BLOCK_D, 3, COLS, 4)
        gl.store(Out + pid_b.to(gl.int64) * stride_ob + pid_h * stride_oh + col,
                 (acc_row / l_safe).to(Out.dtype.element_ty), mask=col < D)
        # back from log2 to natural log: lse = (m + log2 l) * ln 2; every column holds it, column 0 stores
        lse = gl.where(seen, (m + gl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
        gl.store(Lse + pid_b * stride_lseb + pid_h * stride_lseh + col * 0,
                 lse + gl.zeros([1, 1, 1, BLOCK_D], gl.float32, COLS), mask=col == 0)
