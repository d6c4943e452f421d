"""What a prefill mask leaves for the Triton prefill to visit, built on the mask's device by two
small kernels; the mask is read once.

- The block map (``block_map``, once per call): one uint8 entry per MAP_GRAIN x MAP_GRAIN block of
  (queries, keys), bit MAP_SEEN where the block holds a visible key, MAP_PLAIN where every key is
  visible with nothing to add (bool True, additive 0). Rows and columns are padded to MAP_PAD
  with MAP_PLAIN alone: padding neither shows a key nor spoils a plain tile.
- The tile lists (``list_tiles``, per tile config): for each query block of BLOCK_M rows, the run
  of key tiles of BLOCK_N that every row sees in full (the longest such run, under causal and the
  window as well), which the prefill attends without reading the mask, then the other tiles some
  row may see, in increasing order, which it attends with the mask. A row of the list is

      [run_first, run_end, n_partial, partial tile, ...]       (tile indices)

  A run rather than a list of full tiles keeps the unmasked loop the plain kernel's own (its
  software pipeline, the softmax overlap): indices loaded in that loop were staged through
  shared memory and left room for one program per SM instead of two (docs/notes/variants.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .score_variants import MASK_HIDES_AT

MAP_GRAIN = tl.constexpr(16)  # the smallest tile of the prefill's tile space: one map serves all
MAP_PAD = tl.constexpr(128)   # map rows and columns padded to the largest tile (no bounds checks)
MAP_SEEN = tl.constexpr(1)     # block-map bits
MAP_PLAIN = tl.constexpr(2)
LIST_HEADER = tl.constexpr(3)  # run_first, run_end, n_partial
_CHUNK_TILES = 64             # key tiles per step of the list kernel
_MAP_KEYS = 512               # keys per program of the map kernel (8 KB of a bool mask)


@triton.jit
def _block_map_kernel(Mask, Map, stride_mb, stride_mh, stride_mq, stride_pb, stride_ph, stride_pq,
                      H_M, N_Q, N_KV, MAP_COLS, ADDITIVE: tl.constexpr, GRAIN: tl.constexpr,
                      COLS: tl.constexpr):
    """One program: GRAIN query rows x COLS keys of one (batch, head) of the mask, COLS / GRAIN
    map entries (those below MAP_COLS)."""
    bh = tl.program_id(0)
    rows = tl.program_id(1) * GRAIN + tl.arange(0, GRAIN)
    cols = tl.program_id(2) * COLS + tl.arange(0, COLS)
    inside = (rows[:, None] < N_Q) & (cols[None, :] < N_KV)
    ptrs = (Mask + (bh // H_M).to(tl.int64) * stride_mb + (bh % H_M).to(tl.int64) * stride_mh
            + rows.to(tl.int64)[:, None] * stride_mq + cols[None, :])
    if ADDITIVE:
        x = tl.load(ptrs, mask=inside, other=0.0)
        seen = x > MASK_HIDES_AT
        plain = x == 0.0
    else:
        seen = tl.load(ptrs, mask=inside, other=1) != 0
        plain = seen
    # padding: plain, never seen
    code = (seen & inside).to(tl.int32) * MAP_SEEN + plain.to(tl.int32) * MAP_PLAIN
    blocks = tl.reshape(code, [GRAIN, COLS // GRAIN, GRAIN])
    entry = (tl.max(tl.max(blocks & MAP_SEEN, 2), 0) | tl.min(tl.min(blocks & MAP_PLAIN, 2), 0))
    at = tl.program_id(2) * (COLS // GRAIN) + tl.arange(0, COLS // GRAIN)
    dst = Map + (bh // H_M) * stride_pb + (bh % H_M) * stride_ph + tl.program_id(1) * stride_pq + at
    tl.store(dst, entry.to(tl.uint8), mask=at < MAP_COLS)


def block_map(mask: torch.Tensor) -> torch.Tensor:
    """uint8 (Bm, Hm, rows, cols) block map of a contiguous (Bm, Hm, N_q, N_kv) bool or float32
    additive mask, on its device (module docstring)."""
    bm, hm, n_q, n_kv = mask.shape
    pad, grain = MAP_PAD.value, MAP_GRAIN.value
    rows, cols = (-(-n // pad) * pad for n in (n_q, n_kv))
    out = torch.empty((bm, hm, rows // grain, cols // grain), dtype=torch.uint8, device=mask.device)
    data = mask.view(torch.uint8) if mask.dtype == torch.bool else mask
    _block_map_kernel[(bm * hm, rows // grain, triton.cdiv(cols, _MAP_KEYS))](
        data, out, *mask.stride()[:3], *out.stride()[:3], hm, n_q, n_kv, cols // grain,
        ADDITIVE=mask.dtype != torch.bool, GRAIN=grain, COLS=_MAP_KEYS, num_warps=4)
    return out


@triton.jit
def _running_max(a, b):
    return tl.maximum(a, b)


@triton.jit
def _tile_classes(map_rows, t, tk, lo, hi, full_lo, full_hi, FM: tl.constexpr, FN: tl.constexpr,
                  BLOCK_N: tl.constexpr):
    """For key tiles t [CHUNK] of one query block (map_rows: [FM, 1, 1] pointers to its map rows):
    whether some row may see a key of the tile (seen), and whether every row sees all of it
    with nothing to add (full)."""
    cols = t[None, :, None] * FN + tl.arange(0, FN)[None, None, :]
    e = tl.load(map_rows + cols, mask=t[None, :, None] < tk, other=0).to(tl.int32)
    start = t * BLOCK_N
    seen = (tl.max(tl.max(e & MAP_SEEN, 2), 0) != 0) & (start < hi) & (start + BLOCK_N > lo)
    full = (seen & (tl.min(tl.min(e & MAP_PLAIN, 2), 0) != 0) & (start >= full_lo)
            & (start + BLOCK_N <= full_hi))
    return seen, full


@triton.jit
def _tile_list_kernel(Map, Tiles, stride_pb, stride_ph, stride_pq, stride_tb, stride_th, stride_tq,
                      H_M, N_Q, N_KV, window_left, window_right, IS_CAUSAL: tl.constexpr,
                      WINDOW: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      GRAIN: tl.constexpr, CHUNK: tl.constexpr):
    """One program: the list row of one query block of one (batch, head) (module docstring)."""
    bh = tl.program_id(0)
    qb = tl.program_id(1)
    FM: tl.constexpr = BLOCK_M // GRAIN
    FN: tl.constexpr = BLOCK_N // GRAIN
    tk = tl.cdiv(N_KV, BLOCK_N)
    # the keys [lo, hi) some row of the block may see and [full_lo, full_hi) every row sees,
    # under causal and the window (rows at positions first .. last, bottom-right aligned)
    first = qb * BLOCK_M + N_KV - N_Q
    last = tl.minimum(first + BLOCK_M - 1, N_KV - 1)  # the last real row sits at N_kv - 1
    lo = 0
    full_lo = 0
    hi = N_KV
    full_hi = N_KV
    if IS_CAUSAL:
        hi = tl.minimum(hi, last + 1)
        full_hi = tl.minimum(full_hi, first + 1)
    if WINDOW:
        lo = tl.maximum(first - window_left, 0)
        full_lo = tl.maximum(last - window_left, 0)
        hi = tl.minimum(hi, tl.maximum(last + window_right + 1, 0))
        full_hi = tl.minimum(full_hi, tl.maximum(first + window_right + 1, 0))
    map_rows = (Map + (bh // H_M) * stride_pb + (bh % H_M) * stride_ph
                + (qb * FM + tl.arange(0, FM))[:, None, None] * stride_pq)
    # pass 1: the longest run of full tiles [best_end - best_len, best_end)
    best_len = 0
    best_end = 0
    run_first = 0  # first tile of the run of full tiles in progress
    for c0 in range(0, tk, CHUNK):
        t = c0 + tl.arange(0, CHUNK)
        seen, full = _tile_classes(map_rows, t, tk, lo, hi, full_lo, full_hi, FM, FN, BLOCK_N)
        firsts = tl.associative_scan(tl.where(full, run_first, t + 1), 0, _running_max)
        lens = tl.where(full, t + 1 - firsts, 0)
        chunk_len = tl.max(lens, 0)
        chunk_end = tl.max(tl.where(lens == chunk_len, t + 1, 0), 0)
        better = chunk_len > best_len
        best_end = tl.where(better, chunk_end, best_end)
        best_len = tl.where(better, chunk_len, best_len)
        run_first = tl.max(firsts, 0)
    # pass 2: every other tile some row may see, in increasing order
    row = Tiles + (bh // H_M) * stride_tb + (bh % H_M) * stride_th + qb * stride_tq
    n_partial = 0
    for c0 in range(0, tk, CHUNK):
        t = c0 + tl.arange(0, CHUNK)
        seen, full = _tile_classes(map_rows, t, tk, lo, hi, full_lo, full_hi, FM, FN, BLOCK_N)
        listed = seen & ((t < best_end - best_len) | (t >= best_end))
        at = n_partial + tl.cumsum(listed.to(tl.int32), 0) - 1
        tl.store(row + LIST_HEADER + at, t, mask=listed)
        n_partial += tl.sum(listed.to(tl.int32), 0)
    tl.store(row, best_end - best_len)
    tl.store(row + 1, best_end)
    tl.store(row + 2, n_partial)


def tile_lists(bmap: torch.Tensor) -> torch.Tensor:
    """An int32 (Bm, Hm, rows, LIST_HEADER + cols) tensor for ``list_tiles`` to fill."""
    shape = (*bmap.shape[:3], LIST_HEADER.value + bmap.shape[3])
    return torch.empty(shape, dtype=torch.int32, device=bmap.device)


def list_tiles(bmap: torch.Tensor, tiles: torch.Tensor, *, block_m: int, block_n: int, n_q: int,
               n_kv: int, causal: bool, window_left: int = 0, window_right: int = 0,
               window: bool = False) -> None:
    """Fill ``tiles`` (``tile_lists``) for one tile config from the block map ``bmap``."""
    bm, hm = bmap.shape[:2]
    _tile_list_kernel[(bm * hm, triton.cdiv(n_q, block_m))](
        bmap, tiles, *bmap.stride()[:3], *tiles.stride()[:3], hm, n_q, n_kv, window_left,
        window_right, IS_CAUSAL=causal, WINDOW=window, BLOCK_M=block_m, BLOCK_N=block_n,
        GRAIN=MAP_GRAIN.value, CHUNK=_CHUNK_TILES, num_warps=2)
