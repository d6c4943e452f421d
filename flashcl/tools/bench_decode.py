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

``variants`` (e.g. {"window": (1023, 0), "softcap": 30.0}; "sinks" and "alibi_slopes" True draw
values): the same inputs are also timed with the variants on, at their own automatic split count
(from the windowed length), and the row gives both times and their ratio. Bytes of the variant run
count the keys its query sees.

``kv_format`` ("q8_0", "q4_0", "int8"): the same K/V values quantized (flashcl.quantize) are timed
at the automatic split count next to the plain cache, in copies that rotate past the cache like
the plain ones; bytes are counted as stored (DecodeProblem.bytes_moved), and the row gives the
quantized time, its TB/s and its ratio to the plain time (``quant_plain_ms``: the plain call timed
in turns with the quantized one, ``rounds`` times). With ``variants`` too, the quantized cache is
also timed with the variants on (what a model with both runs), in the same turns, and the row
gives that time and its ratio to the quantized call without them.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field, replace

import numpy as np
import pyopencl as cl
import pyopencl.array as cla

from .. import quant, reference
from . import shapes
from .bench_prefill import conditions, cpu_peer_dtype, median_wall_ms, rows_as_dicts  # noqa: F401  (CLI)
from ..opencl.decode import (DecodeKernel, DecodeProblem, DecodeVariants, choose_params, is_rows, layout_params,
                             mean_keys_seen, quantized_to_device)
from ..variants import Variants
from ..opencl.arrays import from_stored, storage_dtype, stored_values, to_stored
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
    variants: str = ""       # the variants timed next to the plain call ("" none)
    var_auto_splits: int = 0
    var_ms: float = float("nan")       # median, variants on, at var_auto_splits
    var_gbps: float = float("nan")     # bytes of the keys the query sees
    var_ratio: float = float("nan")    # var_ms / auto_ms
    var_rel_err: float = float("nan")
    var_forced_ms: dict = field(default_factory=dict)   # variants on, every forced split count
    kv_format: str = ""      # the quantized cache timed next to the plain one ("" none)
    quant_kernel: str = ""
    quant_auto_splits: int = 0
    quant_bytes: int = 0               # as stored
    quant_ms: float = float("nan")     # median at quant_auto_splits
    quant_tbps: float = float("nan")
    quant_plain_ms: float = float("nan")  # the plain call at auto splits, timed in turns with the quantized one
    quant_ratio: float = float("nan")  # quant_ms / quant_plain_ms
    quant_rel_err: float = float("nan")
    peer: str = ""                     # CPU devices: torch's CPU SDPA on the same problem
    peer_ms: float = float("nan")
    wall_ms: float = float("nan")      # flashcl's wall clock a call at auto splits (launch to wait), beside the peer
    peer_speedup: float = float("nan")  # peer_ms / wall_ms
    quant_var_ms: float = float("nan")     # the quantized cache with the variants on
    quant_var_ratio: float = float("nan")  # quant_var_ms / quant_ms
    quant_var_rel_err: float = float("nan")


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


def copy_count(handle: DeviceHandle, nbytes: int) -> int:
    """How many copies of ``nbytes`` of cache make the working set exceed 3x the device's cache
    (at most 8, within a third of its memory)."""
    cache, memory = int(handle.device.global_mem_cache_size), int(handle.device.global_mem_size) // 3
    return int(max(1, min(-(-3 * cache // max(nbytes, 1)), memory // max(nbytes, 1), 8)))


def device_sets(handle: DeviceHandle, rng, q, k, v, table, lens, block_order: str = "random",
                dtype: str | None = None) -> list:
    """The inputs on the device (q, k, v stored as ``dtype``; None: as they are), copy_count copies
    of them rotated through by the timed calls so that every call reads its K/V from DRAM; each
    copy past the first with its own block table."""
    if dtype is not None:
        q, k, v = (to_stored(x, dtype) for x in (q, k, v))
    b, copies = table.shape[0], copy_count(handle, k.nbytes + v.nbytes)
    return [[cla.to_device(handle.queue, x) for x in
             (q, k, v, table if c == 0 else _block_table(rng, k.shape[0], b, block_order), lens)]
            for c in range(copies)]


def _inputs(rng, shape, dtype, block_size, block_order="random", head_dim: int = HEAD_DIM):
    """q and a paged cache holding every sequence ctx long, blocks in ``block_order``: values of
    ``dtype`` (bfloat16's as float32; device_sets stores them)."""
    if block_order not in BLOCK_ORDERS:
        raise ValueError(f"block_order: expected one of {BLOCK_ORDERS}, got {block_order!r}")
    b, h_q, h_kv, ctx = shape
    blocks = -(-ctx // block_size)
    num_blocks = b * blocks
    q, k, v = (stored_values(rng.standard_normal(s, dtype=np.float32), dtype)
               for s in ((b, h_q, head_dim), *[(num_blocks, block_size, h_kv, head_dim)] * 2))
    table = _block_table(rng, num_blocks, b, block_order)
    return q, k, v, table, np.full(b, ctx, dtype=np.int32)


def _cpu_peer(q, k, v, table, ctx: int, scale: float, repeats: int, copies: int, flashcl_ms: float,
              dtype: str) -> dict:
    """torch's CPU SDPA on the same decode, the peer a CPU user would call: float32 (bfloat16 for
    a bfloat16 run, as a bfloat16 model calls it), GQA by enable_gqa, the paged cache gathered into
    contiguous copies outside the timing and rotated through as many as flashcl's run rotates;
    wall clock a call, as ``flashcl_ms`` (flashcl's enqueue-to-wait time a call) is. {} without
    torch, or one without enable_gqa (< 2.5)."""
    try:
        import torch
    except ImportError:
        return {}
    b, h_q, d = q.shape
    on = cpu_peer_dtype(torch, dtype)
    rows = lambda x: x[table].reshape(b, -1, *x.shape[2:])[:, :ctx].transpose(0, 2, 1, 3)  # noqa: E731
    kc, vc = (np.ascontiguousarray(rows(x), dtype=np.float32) for x in (k, v))
    sets = [[torch.from_numpy(x.copy()).to(on) for x in (kc, vc)] for _ in range(copies)]
    qt = torch.from_numpy(np.ascontiguousarray(q[:, :, None], dtype=np.float32)).to(on)
    f = torch.nn.functional.scaled_dot_product_attention
    kw = {"scale": scale, "enable_gqa": h_q != k.shape[2]}
    try:
        f(qt, *sets[0], **kw)
    except TypeError:  # a torch without enable_gqa
        return {}
    ms = median_wall_ms(lambda i: f(qt, *sets[i % copies], **kw), repeats * copies)
    return dict(peer=f"torch {torch.__version__} CPU SDPA ({torch.get_num_threads()} threads) on contiguous "
                     f"{str(on).removeprefix('torch.')} copies of the cache", peer_ms=ms,
                wall_ms=flashcl_ms, peer_speedup=ms / flashcl_ms)


def _bench_variants(variants: dict, b: int, h_q: int) -> dict:
    """Oracle keywords for ``variants``: window and softcap as given, sinks and ALiBi slopes
    (True) drawn as models use them (sinks ~ N(0, 1), slopes 2^(-8 (h + 1) / H_q))."""
    unknown = set(variants) - {"window", "softcap", "sinks", "alibi_slopes"}
    if unknown:
        raise ValueError(f"variants: unknown {sorted(unknown)}; decode takes window, softcap, sinks, alibi_slopes")
    kw = {k: variants[k] for k in ("window", "softcap") if variants.get(k) is not None}
    if variants.get("sinks") is not None:
        sinks = variants["sinks"]
        kw["sinks"] = np.random.default_rng(1).standard_normal(h_q).astype(np.float32) if sinks is True else sinks
    if variants.get("alibi_slopes") is not None:
        slopes = variants["alibi_slopes"]
        if slopes is True:
            slopes = np.broadcast_to(2.0 ** (-8.0 * np.arange(1, h_q + 1) / h_q), (b, h_q))
        kw["alibi_slopes"] = np.ascontiguousarray(np.broadcast_to(slopes, (b, h_q)), dtype=np.float32)
    return kw


def bench_decode(handle: DeviceHandle, shapes, *, dtype: str = "float16", block_size: int = 16,
                 repeats: int = 10, splits=DEFAULT_SPLITS, params: dict | None = None,
                 check: bool = True, verbose_build: bool = False, progress=None,
                 block_order: str = "random", head_dim: int = HEAD_DIM,
                 variants: dict | None = None, kv_format: str | None = None,
                 tensor_cores: bool | None = None, layout: str | None = None, rounds: int = 1) -> list[DecodeRow]:
    """Time single pass, the automatic split count and every forced count of ``splits``, head dim
    ``head_dim`` for q, K and V; with ``variants``, also the call with them on (module docstring).
    ``tensor_cores``: DecodeKernel's (None: decode_mma.cl where it applies; False: the layout's
    file); ``layout`` ("lanes": decode.cl, "rows": decode_cpu.cl): that layout's untuned
    parameters where ``params`` is None (None: the device's choice). ``rounds``: with
    ``kv_format``, the plain call and the quantized one take turns this many times, ``repeats``
    runs each, and the ratio is of their medians over the rounds (a CPU shared with the host moves
    one call's time between runs)."""
    rng = np.random.default_rng(0)

    def choose(prob, ctx):
        """The call's own choice (a tuned entry too), or the layout's untuned parameters where
        that choice is of another layout."""
        choice = choose_params(handle, prob, params, ctx)
        if params is None and layout is not None and is_rows(choice.params) != (layout == "rows"):
            choice = choose_params(handle, prob, layout_params(handle, prob, layout), ctx)
            choice = replace(choice, source=f"untuned {layout} layout (--kernel)", reason="")
        return choice

    queue = handle.queue
    copy_gbps = copy_bandwidth(handle)
    rows = []
    for shape in shapes:
        b, h_q, h_kv, ctx = shape
        prob = DecodeProblem(b, h_q, h_kv, head_dim, head_dim, True, dtype)
        choice = choose(prob, ctx)
        kern = DecodeKernel(handle, prob, choice.params, verbose=verbose_build, tensor_cores=tensor_cores)
        q, k, v, table, lens = _inputs(rng, shape, dtype, block_size, block_order, head_dim)
        sets = device_sets(handle, rng, q, k, v, table, lens, block_order, dtype)
        copies = len(sets)
        out = cla.empty(queue, (b, h_q, head_dim), storage_dtype(dtype))
        lse = cla.empty(queue, (b, h_q), np.float32)
        scale = head_dim ** -0.5

        def run(num_splits):
            def go(i):
                qd, kd, vd, td, ld = sets[i]
                return kern(qd, kd, vd, out, lse, td, ld, scale, num_splits)
            return go

        # the count flashcl.decode picks with the lengths on the host (numpy / torch tables)
        mean_ctx = mean_keys_seen(lens, None)
        auto = kern.auto_splits(ctx, mean_ctx=mean_ctx)
        timed = {}
        for s in sorted({1, auto, *splits}):
            timed[s] = event_times(lambda i, go=run(s): go(i % copies), repeats)  # rotate the copies
        med = {s: statistics.median(t) for s, t in timed.items()}
        forced = {s: med[s] for s in sorted({1, *splits})}
        best = min(forced, key=forced.get)
        nbytes = prob.bytes_moved(b * ctx)

        g = h_q // h_kv

        def rel_err_of_first(kw, k=k, v=v):
            """Relative error of sequence 0's first GQA group against the oracle (on the cache k, v)."""
            got = from_stored(out.get(), dtype)[:1, :g].astype(np.float64)
            kw = {**kw, **{n: kw[n][..., :g] for n in ("sinks", "alibi_slopes") if n in kw}}
            if "alibi_slopes" in kw:
                kw["alibi_slopes"] = kw["alibi_slopes"][:1]
            ref = reference.decode_attention(q[:1, :g], k[:, :, :1], v[:, :, :1], block_table=table[:1],
                                             context_lens=lens[:1], **kw)
            return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))

        err = float("nan")
        if check:
            for ev in run(auto)(0):
                ev.wait()
            err = rel_err_of_first({})
        gbps = lambda ms: nbytes / (ms * 1e-3) / 1e9  # noqa: E731

        var_fields = {}
        var = on_device = kw = None
        if variants:
            kw = _bench_variants(variants, b, h_q)
            var = DecodeVariants.of(Variants(**kw), prob)
            if var is None:
                raise ValueError(f"variants {variants}: nothing changes the plain call (a window's left -1 hides no key)")
            on_device = DecodeVariants(var.window_left, var.softcap,
                                       *(None if x is None else cla.to_device(queue, x)
                                         for x in (var.sinks, var.alibi_slopes)))
            vkern = DecodeKernel(handle, prob, choice.params, verbose=verbose_build, variant_flags=var.flags(),
                                 tensor_cores=tensor_cores)
            vauto = vkern.auto_splits(var.keys_seen(ctx), mean_ctx=mean_keys_seen(lens, var))

            def run_var_splits(num_splits):
                def go(i):
                    qd, kd, vd, td, ld = sets[i % copies]
                    return vkern(qd, kd, vd, out, lse, td, ld, scale, num_splits, variants=on_device)
                return go

            var_med = {s_: statistics.median(event_times(run_var_splits(s_), repeats))
                       for s_ in sorted({1, vauto, *splits})}
            run_var = run_var_splits(vauto)
            var_ms = var_med[vauto]
            var_err = float("nan")
            if check:
                for ev in run_var(0):
                    ev.wait()
                var_err = rel_err_of_first(kw)
            var_bytes = prob.bytes_moved(b * var.keys_seen(ctx))
            var_fields = dict(variants=" ".join(f"{k_}={v_}" for k_, v_ in variants.items()),
                              var_auto_splits=vauto, var_ms=var_ms, var_gbps=var_bytes / (var_ms * 1e-3) / 1e9,
                              var_ratio=var_ms / med[auto], var_rel_err=var_err,
                              var_forced_ms={s_: var_med[s_] for s_ in sorted({1, *splits})})
        quant_fields = {}
        if kv_format:
            qprob = DecodeProblem(b, h_q, h_kv, head_dim, head_dim, True, dtype, kv_format, kv_format)
            qchoice = choose(qprob, ctx)
            qkern = DecodeKernel(handle, qprob, qchoice.params, verbose=verbose_build, tensor_cores=tensor_cores)
            qk, qv = quant.quantize(k, kv_format), quant.quantize(v, kv_format)
            qbytes = qprob.bytes_moved(b * ctx)
            stored = sum(x.nbytes for x in (qk.data, qv.data)) + (
                qk.scales.nbytes + qv.scales.nbytes if kv_format == "int8" else 0)
            # the same bytes at other addresses, as many copies as the plain cache's rule gives
            qcopies = copy_count(handle, stored)
            qsets = [[quantized_to_device(x, queue) for x in (qk, qv)] for _ in range(qcopies)]
            qauto = qkern.auto_splits(ctx, mean_ctx=mean_ctx)

            def run_quant(i):
                qd, _, _, td, ld = sets[i % copies]
                kd, vd = qsets[i % qcopies]
                return qkern(qd, kd, vd, out, lse, td, ld, scale, qauto)

            run_quant_var = None
            if var is not None:  # what a model with both runs (e.g. softcap on a q8_0 cache)
                qvkern = DecodeKernel(handle, qprob, qchoice.params, verbose=verbose_build,
                                      variant_flags=var.flags(), tensor_cores=tensor_cores)
                qvauto = qvkern.auto_splits(var.keys_seen(ctx), mean_ctx=mean_keys_seen(lens, var))

                def run_quant_var(i):
                    qd, _, _, td, ld = sets[i % copies]
                    kd, vd = qsets[i % qcopies]
                    return qvkern(qd, kd, vd, out, lse, td, ld, scale, qvauto, variants=on_device)

            # the plain call, the quantized one (and with the variants) in turns, so that a
            # shared machine's slower stretches fall on each of them alike
            plain_turns, quant_turns, qv_turns = [], [], []
            for _ in range(rounds):
                plain_turns += event_times(lambda i, go=run(auto): go(i % copies), repeats)
                quant_turns += event_times(run_quant, repeats)
                if run_quant_var is not None:
                    qv_turns += event_times(run_quant_var, repeats)
            quant_ms, plain_turn_ms = statistics.median(quant_turns), statistics.median(plain_turns)
            quant_err = float("nan")
            if check:
                # the oracle reads KV head 0, its values rounded to dtype as the kernel rounds them
                k_deq, v_deq = (stored_values(quant.dequantize(x)[:, :, :1], dtype) for x in (qk, qv))
                for ev in run_quant(0):
                    ev.wait()
                quant_err = rel_err_of_first({}, k_deq, v_deq)
            if run_quant_var is not None:
                qv_ms = statistics.median(qv_turns)
                qv_err = float("nan")
                if check:
                    for ev in run_quant_var(0):
                        ev.wait()
                    qv_err = rel_err_of_first(kw, k_deq, v_deq)
                quant_fields.update(quant_var_ms=qv_ms, quant_var_ratio=qv_ms / quant_ms, quant_var_rel_err=qv_err)
            quant_fields.update(kv_format=kv_format, quant_kernel=qkern.path, quant_auto_splits=qauto,
                                quant_bytes=qbytes, quant_ms=quant_ms,
                                quant_tbps=qbytes / (quant_ms * 1e-3) / 1e12,
                                quant_plain_ms=plain_turn_ms, quant_ratio=quant_ms / plain_turn_ms,
                                quant_rel_err=quant_err)
            del qsets
        peer_fields = {}
        if handle.is_cpu:  # the peer's time is wall clock: so is flashcl's here, launch to wait
            wall = median_wall_ms(lambda i: run(auto)(i % copies)[-1].wait(), repeats * copies)
            peer_fields = _cpu_peer(q, k, v, table, ctx, scale, repeats, copies, wall, dtype)
        row = DecodeRow(
            shape=f"({b},{h_q}/{h_kv},{ctx},{head_dim})", dtype=dtype, block_size=block_size,
            block_order=block_order,
            params=" ".join(f"{k_}={v_}" for k_, v_ in choice.params.items()),
            params_source=choice.source, bytes_moved=nbytes, copies=copies, auto_splits=auto,
            single_ms=med[1], single_gbps=gbps(med[1]), auto_ms=med[auto],
            auto_min_ms=min(timed[auto]), auto_max_ms=max(timed[auto]), auto_gbps=gbps(med[auto]),
            copy_gbps=copy_gbps, pct_copy=100.0 * gbps(med[auto]) / copy_gbps, best_split=best, best_ms=forced[best],
            auto_ok=med[auto] <= AUTO_TOLERANCE * forced[best], rel_err=err, forced_ms=forced,
            kernel=kern.path, **var_fields, **quant_fields, **peer_fields)
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
    if any(r.variants for r in rows):
        lines.append("# with variants (auto splits from the keys the query sees; ratio = variant ms / plain auto ms):")
        for r in rows:
            lines.append(f"#   {r.shape:24} {r.variants}: splits {r.var_auto_splits}, {r.var_ms:.3f} ms vs "
                         f"{r.auto_ms:.3f} ms plain, ratio {r.var_ratio:.3f} (plain / variant {1 / r.var_ratio:.2f}), "
                         f"{r.var_gbps:.1f} GB/s, rel err {r.var_rel_err:.1e}; forced splits (ms): "
                         + " ".join(f"{s}:{t:.3f}" for s, t in r.var_forced_ms.items()))
    if any(r.kv_format for r in rows):
        lines.append("# quantized cache (bytes as stored; ratio = quantized ms / plain ms, both at auto splits, "
                     "timed in turns over the rounds):")
        for r in rows:
            lines.append(f"#   {r.shape:24} {r.kv_format}: {r.quant_bytes / 1e6:.1f} MB, splits {r.quant_auto_splits}, "
                         f"{r.quant_ms:.3f} ms vs {r.quant_plain_ms:.3f} ms {r.dtype}, ratio {r.quant_ratio:.3f}, "
                         f"{r.quant_tbps * 1e3:.1f} GB/s vs {r.bytes_moved / (r.quant_plain_ms * 1e-3) / 1e9:.1f}, "
                         f"rel err {r.quant_rel_err:.1e} "
                         f"[{r.quant_kernel}]")
            if r.variants and not np.isnan(r.quant_var_ms):
                lines.append(f"#     with {r.variants}: {r.quant_var_ms:.3f} ms, ratio {r.quant_var_ratio:.3f} to "
                             f"{r.kv_format} without them, rel err {r.quant_var_rel_err:.1e}")
    if any(r.peer for r in rows):
        lines.append(f"# peer: {rows[0].peer}, rotated as flashcl's; "
                     f"both wall clock a call (flashcl: launch to wait; speedup = peer ms / flashcl ms):")
        for r in rows:
            lines.append(f"#   {r.shape:24} {r.peer_ms:.3f} ms vs {r.wall_ms:.3f} ms, speedup {r.peer_speedup:.2f}")
    lines.append("# decode kernel: " + "; ".join(sorted({r.kernel for r in rows})))
    sources = sorted({r.params_source for r in rows})
    lines.append("# params from: " + "; ".join(sources) + "; params: " + "; ".join(sorted({r.params for r in rows})))
    return "\n".join(lines)
