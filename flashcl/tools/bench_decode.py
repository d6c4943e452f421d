"""Benchmark of the OpenCL flash-decoding kernels (a command, never a test; docs/design.md §7).

For each decode shape (B, H_q, H_kv, ctx), d = 128: a paged cache (block_size 16 by default) whose
blocks are a random permutation (``block_order="sequential"``: in allocation order; "ascending": a
random set of blocks per sequence in address order), every sequence ctx long. Times are OpenCL
profiling events from the start of the decode kernel to the end of the merge kernel (when there is
one), median and spread over ``repeats`` runs after a warm-up; the inputs rotate over several
copies so that the working set exceeds 3x the device's global-memory cache where memory allows (a
real decode step reads each layer's KV once, cold). Bytes moved (the least a decode step must
move):

    bytes = B · H_kv · ctx · (DK + DV) · e   (every K/V row read once per GQA group)
          + B · H_q · (DK + DV) · e          (q read, out written)

GB/s = bytes / median time, reported as a percentage of the copy bandwidth measured in the same
run (a buffer-to-buffer clEnqueueCopyBuffer larger than the cache: 2 · size bytes per copy). Each
shape runs single pass (num_splits=1), the automatic split count, and every forced count in
``splits``; the row says which forced count was best and whether auto is within 5% of it.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

import numpy as np
import pyopencl as cl
import pyopencl.array as cla

from .. import reference
from . import shapes
from .bench_prefill import conditions, rows_as_dicts  # noqa: F401  (re-exported for the CLI)
from ..opencl.decode import DecodeKernel, DecodeProblem, choose_params
from ..opencl.runtime import DeviceHandle, event_times

HEAD_DIM = 128
AUTO_TOLERANCE = 1.05  # auto must be within 5% of the best forced split count

DECODE_PRESETS = shapes.DECODE_PRESETS  # (B, H_q, H_kv, ctx)
DEFAULT_SPLITS = (1, 2, 4, 8, 16, 32, 64)


@dataclass
class DecodeRow:
    shape: str
    dtype: str
    block_size: int
    block_order: str         # of the block table: random or sequential
    params: str
    params_source: str
    bytes_moved: int
    copies: int              # input copies rotated through
    auto_splits: int
    single_ms: float
    single_gbps: float
    auto_ms: float
    auto_min_ms: float
    auto_max_ms: float
    auto_gbps: float
    copy_gbps: float         # device copy bandwidth measured in this run
    pct_copy: float          # auto GB/s as % of copy_gbps
    best_split: int
    best_ms: float
    auto_ok: bool            # auto within 5% of the best forced split
    rel_err: float
    forced_ms: dict = field(default_factory=dict)
    kernel: str = ""         # which decode kernel ran (DecodeKernel.path)


def copy_bandwidth(handle: DeviceHandle, nbytes: int | None = None, repeats: int = 10) -> float:
    """Device copy bandwidth in GB/s: clEnqueueCopyBuffer of a buffer larger than the cache,
    counting its read and its write (2 · size per copy); median of ``repeats``."""
    dev = handle.device
    if nbytes is None:
        cache = int(dev.global_mem_cache_size) or (64 << 20)
        nbytes = min(max(8 * cache, 256 << 20), int(dev.max_mem_alloc_size) // 2, int(dev.global_mem_size) // 8)
    nbytes = nbytes // 64 * 64
    mf = cl.mem_flags
    src = cl.Buffer(handle.context, mf.READ_WRITE, nbytes)
    dst = cl.Buffer(handle.context, mf.READ_WRITE, nbytes)
    cl.enqueue_fill_buffer(handle.queue, src, np.uint8(1), 0, nbytes).wait()
    cl.enqueue_copy(handle.queue, dst, src).wait()
    times = []
    for _ in range(repeats):
        ev = cl.enqueue_copy(handle.queue, dst, src)
        ev.wait()
        times.append((ev.profile.end - ev.profile.start) * 1e-9)
    return 2 * nbytes / statistics.median(times) / 1e9


BLOCK_ORDERS = ("random", "sequential", "ascending")


def _block_table(rng, num_blocks: int, b: int, block_order: str) -> np.ndarray:
    """(b, num_blocks // b) int32: the blocks in random order, in allocation order, or a random set
    per sequence in ascending order."""
    order = np.arange(num_blocks) if block_order == "sequential" else rng.permutation(num_blocks)
    table = order.astype(np.int32).reshape(b, -1)
    return np.sort(table, axis=1) if block_order == "ascending" else table


def _inputs(rng, shape, dtype, block_size, block_order="random", head_dim: int = HEAD_DIM):
    """q and a paged cache holding every sequence ctx long, blocks in ``block_order``."""
    if block_order not in BLOCK_ORDERS:
        raise ValueError(f"block_order: expected one of {BLOCK_ORDERS}, got {block_order!r}")
    b, h_q, h_kv, ctx = shape
    blocks = -(-ctx // block_size)
    num_blocks = b * blocks
    q = rng.standard_normal((b, h_q, head_dim), dtype=np.float32).astype(dtype)
    k = rng.standard_normal((num_blocks, block_size, h_kv, head_dim), dtype=np.float32).astype(dtype)
    v = rng.standard_normal((num_blocks, block_size, h_kv, head_dim), dtype=np.float32).astype(dtype)
    table = _block_table(rng, num_blocks, b, block_order)
    return q, k, v, table, np.full(b, ctx, dtype=np.int32)


def bench_decode(handle: DeviceHandle, shapes, *, dtype: str = "float16", block_size: int = 16,
                 repeats: int = 10, splits=DEFAULT_SPLITS, params: dict | None = None,
                 check: bool = True, verbose_build: bool = False, progress=None,
                 block_order: str = "random", head_dim: int = HEAD_DIM) -> list[DecodeRow]:
    """Time single pass, the automatic split count and every forced count of ``splits``, head dim
    ``head_dim`` for q, K and V."""
    rng = np.random.default_rng(0)
    dev = handle.device
    cache = int(dev.global_mem_cache_size)
    mem_budget = int(dev.global_mem_size) // 3
    queue = handle.queue
    copy_gbps = copy_bandwidth(handle)
    rows = []
    for shape in shapes:
        b, h_q, h_kv, ctx = shape
        prob = DecodeProblem(b, h_q, h_kv, head_dim, head_dim, True, dtype)
        choice = choose_params(handle, prob, params, ctx)
        kern = DecodeKernel(handle, prob, choice.params, verbose=verbose_build)
        q, k, v, table, lens = _inputs(rng, shape, dtype, block_size, block_order, head_dim)
        kv_bytes = k.nbytes + v.nbytes
        copies = int(max(1, min(-(-3 * cache // kv_bytes), mem_budget // max(kv_bytes, 1), 8)))
        sets = []
        for c in range(copies):
            perm = table if c == 0 else _block_table(rng, k.shape[0], b, block_order)
            sets.append([cla.to_device(queue, x) for x in (q, k, v, perm, lens)])
        out = cla.empty(queue, (b, h_q, head_dim), np.dtype(dtype))
        lse = cla.empty(queue, (b, h_q), np.float32)
        scale = head_dim ** -0.5

        def run(num_splits):
            def go(i):
                qd, kd, vd, td, ld = sets[i]
                return kern(qd, kd, vd, out, lse, td, ld, scale, num_splits)
            return go

        auto = kern.auto_splits(ctx)
        timed = {}
        for s in sorted({1, auto, *splits}):
            timed[s] = event_times(lambda i, go=run(s): go(i % copies), repeats)  # rotate the copies
        med = {s: statistics.median(t) for s, t in timed.items()}
        forced = {s: med[s] for s in sorted({1, *splits})}
        best = min(forced, key=forced.get)
        nbytes = prob.bytes_moved(b * ctx)

        err = float("nan")
        if check:
            for ev in run(auto)(0):
                ev.wait()
            g = h_q // h_kv
            got = out.get()[:1, :g].astype(np.float64)
            ref = reference.decode_attention(q[:1, :g], k[:, :, :1], v[:, :, :1], block_table=table[:1],
                                             context_lens=lens[:1])
            err = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
        gbps = lambda ms: nbytes / (ms * 1e-3) / 1e9  # noqa: E731
        row = DecodeRow(
            shape=f"({b},{h_q}/{h_kv},{ctx},{head_dim})", dtype=dtype, block_size=block_size,
            block_order=block_order,
            params=" ".join(f"{k_}={v_}" for k_, v_ in choice.params.items()),
            params_source=choice.source, bytes_moved=nbytes, copies=copies, auto_splits=auto,
            single_ms=med[1], single_gbps=gbps(med[1]), auto_ms=med[auto],
            auto_min_ms=min(timed[auto]), auto_max_ms=max(timed[auto]), auto_gbps=gbps(med[auto]),
            copy_gbps=copy_gbps, pct_copy=100.0 * gbps(med[auto]) / copy_gbps, best_split=best, best_ms=forced[best],
            auto_ok=med[auto] <= AUTO_TOLERANCE * forced[best], rel_err=err, forced_ms=forced,
            kernel=kern.path)
        rows.append(row)
        if progress:
            progress(row)
        del sets
    return rows


def format_decode(rows, cond: dict) -> str:
    lines = [f"# flashcl decode on {cond['device']} ({cond['platform']}, driver {cond['driver']}), "
             f"flashcl {cond['flashcl']}, {cond['date']}",
             f"# command: {cond['command']}",
             "# time: OpenCL profiling events (decode start .. merge end), median [min-max] of the runs;"
             " bytes = K+V read once per GQA group + q + out",
             ]
    if rows:
        lines.append(f"# copy bandwidth (clEnqueueCopyBuffer, read+write) measured in this run: "
                     f"{rows[0].copy_gbps:.1f} GB/s")
        lines.append(f"# paged cache: block_size {rows[0].block_size}, block table in {rows[0].block_order} order")
    lines.append(f"{'shape (B,Hq/Hkv,ctx,d)':24} {'dtype':7} {'bs':>3} {'MB':>8} {'1-pass ms':>9} "
                 f"{'GB/s':>7} {'auto':>4} {'auto ms':>8} {'[min-max]':>17} {'GB/s':>7} {'%copy':>6} "
                 f"{'best':>4} {'best ms':>8} {'auto<=5%':>8} {'rel err':>8}")
    for r in rows:
        lines.append(
            f"{r.shape:24} {r.dtype:7} {r.block_size:3d} {r.bytes_moved / 1e6:8.1f} {r.single_ms:9.3f} "
            f"{r.single_gbps:7.1f} {r.auto_splits:4d} {r.auto_ms:8.3f} [{r.auto_min_ms:7.3f}-{r.auto_max_ms:7.3f}] "
            f"{r.auto_gbps:7.1f} {r.pct_copy:6.1f} {r.best_split:4d} {r.best_ms:8.3f} "
            f"{'yes' if r.auto_ok else 'NO':>8} {r.rel_err:8.1e}")
    lines.append("# forced split sweep (ms): " + "; ".join(
        f"{r.shape} " + " ".join(f"{s}:{t:.3f}" for s, t in r.forced_ms.items()) for r in rows))
    lines.append("# decode kernel: " + "; ".join(sorted({r.kernel for r in rows})))
    sources = sorted({r.params_source for r in rows})
    lines.append("# params from: " + "; ".join(sources) + "; params: " + "; ".join(sorted({r.params for r in rows})))
    return "\n".join(lines)
