"""Benchmarks of the OpenCL kernels (commands, never tests; docs/design.md §7).

Prefill: GFLOP/s = FLOPs / median kernel time, with FLOPs = 2·B·H_q·(DK + DV)·(visible query-key
pairs) — 4·B·H·N²·d for square non-causal attention, about half of it causal, and only the pairs
inside the window with one. Times come from OpenCL profiling events (warm-up first, then
``repeats`` runs, median and spread). The error is the relative error against the float64 oracle
on batch 0's first KV group and its last CHECK_ROWS query rows (the oracle is too slow and too
large for the whole problem; with bottom-right alignment the last rows keep their positions, and
causal they are the longest). On a CPU device torch's CPU SDPA runs in the same process on the
same inputs, and the ratio is printed.

With ``variants`` (e.g. ``{"window": (1023, 0), "softcap": 30.0}``) every shape is timed without
them and with them in the same run, on the same inputs, the two calls taking turns: the variant
row gives both times and their ratio (> 1: the variant run is faster, as a window should be;
< 1: its overhead). ``{"mask": "causal"}`` times the causal rule as a bool mask with causal off
against causal=True (causal shapes only): the cost of a mask that skips what causal skips.

With ``kv_format`` ("q8_0", "q4_0", "int8": api.QUANTIZED_KV_FORMATS, the CLI's --kv-format) every
shape is also timed with K and V quantized to it (flashcl.quantize of the same values), the two
calls taking turns, each on the tiles its own problem resolves to (the same ``params`` override).
The row gives the quantized time, its GFLOP/s (same FLOP count), its ratio to the plain time
(quantized / plain: < 1 faster), the K/V bytes as stored of both, and the quantized call's error
against the oracle on the dequantized K/V.
"""

from __future__ import annotations

import datetime as _dt
import platform
import statistics
import time
from dataclasses import asdict, dataclass

import numpy as np
import pyopencl.array as cla

from .. import quant, reference
from ..api import QUANTIZED_KV_FORMATS
from . import shapes
from .._version import __version__
from ..opencl.arrays import from_stored, row_bytes, storage_dtype, stored_values, to_stored
from ..opencl.decode import quantized_to_device
from ..opencl.prefill import PrefillKernel, PrefillProblem, choose_params
from ..opencl.runtime import DeviceHandle, event_times
from ..variants import Variants

PREFILL_PRESETS = shapes.PREFILL_PRESETS  # (B, H_q, H_kv, N, d, causal)
CHECK_ROWS = 1024  # query rows checked against the oracle (the last ones)
BENCH_VARIANTS = ("window", "softcap", "mask")  # what a benchmark can turn on: no per-head arrays to invent
BENCH_MASKS = ("causal",)  # the causal rule as a (1, 1, N, N) bool mask, against causal=True


@dataclass
class PrefillRow:
    shape: str
    dtype: str
    causal: bool
    params: str
    params_source: str
    median_ms: float
    min_ms: float
    max_ms: float
    gflops: float
    rel_err: float
    spill: str
    peer: str = ""
    peer_gflops: float = float("nan")
    wall_ms: float = float("nan")       # flashcl's call, launch to wait (what the peer's time is)
    ratio: float = float("nan")         # peer ms / wall_ms: > 1 flashcl faster
    variants: str = ""                  # the variants of this row ("" = plain attention)
    plain_ms: float = float("nan")      # the same shape without them, same run
    vs_plain: float = float("nan")      # plain_ms / median_ms: > 1 faster, < 1 slower
    kv_bytes: int = 0                   # K and V as stored
    kv_format: str = ""                 # the quantized K/V timed next to this row ("" none)
    quant_params: str = ""
    quant_kv_bytes: int = 0             # as stored (data, and int8's row scales)
    quant_ms: float = float("nan")      # median, same run, taking turns with the plain call
    quant_min_ms: float = float("nan")
    quant_max_ms: float = float("nan")
    quant_gflops: float = float("nan")  # the plain call's FLOP count over quant_ms
    quant_ratio: float = float("nan")   # quant_ms / median_ms: < 1 faster
    quant_rel_err: float = float("nan")  # against the oracle on the dequantized K/V


def visible_pairs(n_q: int, n_kv: int, causal: bool, window) -> int:
    """(query, key) pairs a (left, right) window and the causal rule leave visible (bottom-right
    aligned: row i sits at p = i + N_kv - N_q)."""
    pos = np.arange(n_q, dtype=np.int64) + (n_kv - n_q)
    left, right = window if window is not None else (-1, -1)
    lo = np.maximum(0, pos - left) if left >= 0 else np.zeros_like(pos)
    hi = np.full_like(pos, n_kv - 1)
    if causal:
        hi = np.minimum(hi, pos)
    if right >= 0:
        hi = np.minimum(hi, pos + right)
    return int(np.maximum(0, hi - lo + 1).sum())


def _bench_variants(variants: dict | None) -> Variants | None:
    if not variants:
        return None
    unknown = set(variants) - set(BENCH_VARIANTS)
    if unknown:
        raise ValueError(f"variants: the benchmark takes {', '.join(BENCH_VARIANTS)}, got {sorted(unknown)}")
    if variants.get("mask") not in (None,) + BENCH_MASKS:
        raise ValueError(f"variants: the benchmark's masks are {', '.join(BENCH_MASKS)}, got {variants['mask']!r}")
    window = variants.get("window")
    softcap = variants.get("softcap")
    return Variants(window=tuple(int(w) for w in window) if window is not None else None,
                    softcap=float(softcap) if softcap is not None else None)


def _shape_variants(var: Variants, mask: str | None, n: int, causal: bool) -> tuple[Variants, bool]:
    """The variants of one shape's variant call and its causal flag: with the "causal" mask, the
    causal rule as a bool mask and causal off."""
    if mask is None:
        return var, causal
    if not causal:
        raise ValueError("the causal mask stands in for causal=True: causal shapes only")
    rule = np.tril(np.ones((n, n), dtype=bool))[None, None]
    return Variants(window=var.window, softcap=var.softcap, mask=rule), False


def kv_bytes(b: int, h_kv: int, n: int, d: int, dtype: str, kv_format: str | None = None) -> int:
    """K and V as stored: B·H_kv·N rows of d values each (opencl.arrays.row_bytes)."""
    return 2 * b * h_kv * n * row_bytes(kv_format, d, dtype)


def _params_text(params: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in params.items())


def _describe(var: Variants) -> str:
    mask = "causal rule (causal off)" if var.mask is not None else None
    return " ".join(f"{k}={v}" for k, v in (("window", var.window), ("softcap", var.softcap), ("mask", mask))
                    if v is not None)


def _check(q, k, v, out, causal, scale, var: Variants | None) -> float:
    """Relative error of batch 0's first KV group, last CHECK_ROWS rows of ``out`` (its values, on
    the host), against the oracle (k and v as the kernel attended them: dequantized for a
    quantized call)."""
    g = q.shape[1] // k.shape[1]
    rows = min(CHECK_ROWS, q.shape[2])
    kw = {} if var is None else {"window": var.window, "softcap": var.softcap}
    if var is not None and var.mask is not None:
        kw["mask"] = var.mask[:1, :1, -rows:]
    ref = reference.attention(q[:1, :g, -rows:], k[:1, :1], v[:1, :1], causal=causal, scale=scale, **kw)
    return reference.rel_err(out[:1, :g, -rows:], ref)


def cpu_peer_dtype(torch, dtype: str):
    """The dtype torch's CPU SDPA runs in beside a ``dtype`` run: bfloat16 for bfloat16 (as a
    bfloat16 model calls it), float32 otherwise (its float16 CPU path is no peer a user picks)."""
    return torch.bfloat16 if dtype == "bfloat16" else torch.float32


def _torch_cpu_sdpa(q, k, v, causal, scale, repeats, dtype: str):
    """torch's CPU SDPA on copies in cpu_peer_dtype, median ms a call."""
    try:
        import torch
    except ImportError:
        return None
    on = cpu_peer_dtype(torch, dtype)
    qt, kt, vt = (torch.from_numpy(np.asarray(x, np.float32)).to(on) for x in (q, k, v))
    kw = {"is_causal": causal, "scale": scale, "enable_gqa": q.shape[1] != k.shape[1]}
    if causal and q.shape[2] != k.shape[2]:
        return None  # SDPA's is_causal is top-left aligned; only square causal is comparable
    f = torch.nn.functional.scaled_dot_product_attention
    f(qt, kt, vt, **kw)
    return median_wall_ms(lambda i: f(qt, kt, vt, **kw), repeats)


def median_wall_ms(call, repeats: int) -> float:
    """The median wall clock of ``call(i)`` (a whole call, to its result) over ``repeats`` calls."""
    times = []
    for i in range(repeats):
        t0 = time.perf_counter()
        call(i)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _spill_text(info: dict, is_cpu: bool) -> str:
    if is_cpu:  # PoCL reports the same private size for every kernel; CPUs have no register cliff
        return "n/a (CPU)"
    parts = []
    if "spill_stores" in info:
        parts.append(f"ptxas spill st/ld {info['spill_stores']}/{info['spill_loads']} B")
    if "registers" in info:
        parts.append(f"{info['registers']} regs")
    if "private_mem" in info:
        parts.append(f"private {info['private_mem']} B")
    return ", ".join(parts) or "no signal"


def _interleaved_times(runs, repeats: int) -> list[list[float]]:
    """event_times of several runs taken in turn, one of each per round, so that load from other
    processes falls on all of them alike (their ratio is what a variant benchmark reports)."""
    for run in runs:
        event_times(run, 0)  # warm-up
    times = [[] for _ in runs]
    for _ in range(repeats):
        for run, ts in zip(runs, times):
            ts += event_times(run, 1, warmup=0)
    return times


def bench_prefill(handle: DeviceHandle, shapes, *, dtype: str = "float16", repeats: int = 10,
                  params: dict | None = None, check: bool = True, peer: bool = True, progress=None,
                  variants: dict | None = None, kv_format: str | None = None):
    var = _bench_variants(variants)
    if kv_format is not None and kv_format not in QUANTIZED_KV_FORMATS[("opencl", "prefill")]:
        raise ValueError(f"kv_format: the OpenCL prefill kernels take "
                         f"{', '.join(QUANTIZED_KV_FORMATS[('opencl', 'prefill')])}; got {kv_format!r}")
    rng = np.random.default_rng(0)
    rows = []
    for (b, h_q, h_kv, n, d, causal) in shapes:
        prob = PrefillProblem(b, h_q, h_kv, n, n, d, d, causal, dtype)
        choice = choose_params(handle, prob, params)
        kern = PrefillKernel(handle, prob, choice.params, write_lse=False, verbose=handle.is_nvidia)
        # values of dtype (bfloat16's as float32), stored as dtype on the device
        q, k, v = (stored_values(rng.standard_normal(s), dtype)
                   for s in ((b, h_q, n, d), (b, h_kv, n, d), (b, h_kv, n, d)))
        scale = 1.0 / np.sqrt(d)
        qd, kd, vd = (cla.to_device(handle.queue, to_stored(x, dtype)) for x in (q, k, v))
        out = cla.empty(handle.queue, (b, h_q, n, d), storage_dtype(dtype))
        # the calls of this shape, timed taking turns: plain first, then each extra one
        runs = {"plain": lambda i: kern(qd, kd, vd, out, None, scale)}
        if var is not None:
            vvar, vcausal = _shape_variants(var, variants.get("mask"), n, causal)
            vprob = PrefillProblem(b, h_q, h_kv, n, n, d, d, vcausal, dtype)
            vchoice = choose_params(handle, vprob, params)
            vkern = PrefillKernel(handle, vprob, vchoice.params, write_lse=False, verbose=handle.is_nvidia,
                                  flags=vvar.flags())
            vout = cla.empty(handle.queue, (b, h_q, n, d), storage_dtype(dtype))
            runs["variants"] = lambda i: vkern(qd, kd, vd, vout, None, scale, variants=vvar)
        if kv_format is not None:
            qprob = PrefillProblem(b, h_q, h_kv, n, n, d, d, causal, dtype, kv_format, kv_format)
            qchoice = choose_params(handle, qprob, params)
            qkern = PrefillKernel(handle, qprob, qchoice.params, write_lse=False, verbose=handle.is_nvidia)
            qk, qv = quant.quantize(k, kv_format), quant.quantize(v, kv_format)
            qkd, qvd = (quantized_to_device(x, handle.queue) for x in (qk, qv))
            qout = cla.empty(handle.queue, (b, h_q, n, d), storage_dtype(dtype))
            runs["quant"] = lambda i: qkern(qd, qkd, qvd, qout, None, scale)
        if len(runs) == 1:
            timed = {"plain": event_times(runs["plain"], repeats)}
        else:
            timed = dict(zip(runs, _interleaved_times(list(runs.values()), repeats)))
        times = timed["plain"]
        med = statistics.median(times)
        err = _check(q, k, v, from_stored(out.get(), dtype), causal, scale, None) if check else float("nan")
        row = PrefillRow(
            shape=f"({b},{h_q}/{h_kv},{n},{d})", dtype=dtype, causal=causal,
            params=_params_text(choice.params),
            params_source=choice.source, median_ms=med, min_ms=min(times), max_ms=max(times),
            gflops=prob.flops / (med * 1e-3) / 1e9, rel_err=err, spill=_spill_text(kern.spills(), handle.is_cpu),
            kv_bytes=kv_bytes(b, h_kv, n, d, dtype))
        if kv_format is not None:
            qtimes = timed["quant"]
            qmed = statistics.median(qtimes)
            qerr = float("nan")
            if check:
                qk_deq, qv_deq = (stored_values(quant.dequantize(x), dtype) for x in (qk, qv))  # as the kernel rounds
                qerr = _check(q, qk_deq, qv_deq, from_stored(qout.get(), dtype), causal, scale, None)
            row.kv_format, row.quant_kv_bytes = kv_format, kv_bytes(b, h_kv, n, d, dtype, kv_format)
            row.quant_params = _params_text(qchoice.params)
            row.quant_ms, row.quant_min_ms, row.quant_max_ms = qmed, min(qtimes), max(qtimes)
            row.quant_gflops = prob.flops / (qmed * 1e-3) / 1e9
            row.quant_ratio, row.quant_rel_err = qmed / med, qerr
        if peer and handle.is_cpu:
            peer_ms = _torch_cpu_sdpa(q, k, v, causal, scale, max(3, repeats // 2), dtype)
            if peer_ms is not None:
                import torch

                row.peer = (f"torch {torch.__version__} CPU SDPA ({torch.get_num_threads()} threads, "
                            f"{str(cpu_peer_dtype(torch, dtype)).removeprefix('torch.')})")
                row.peer_gflops = prob.flops / (peer_ms * 1e-3) / 1e9
                row.wall_ms = median_wall_ms(lambda i: (runs["plain"](i), handle.queue.finish()),
                                              max(3, repeats // 2))
                row.ratio = peer_ms / row.wall_ms
        rows.append(row)
        if progress:
            progress(row)
        if var is not None:
            vtimes = timed["variants"]
            vmed = statistics.median(vtimes)
            # FLOPs of the pairs the window leaves visible (softcap adds no pair; the causal mask
            # leaves causal's)
            vflops = prob.flops * visible_pairs(n, n, causal, var.window) / visible_pairs(n, n, causal, None)
            vrow = PrefillRow(
                shape=row.shape, dtype=dtype, causal=vcausal,
                params=_params_text(vchoice.params), params_source=vchoice.source,
                median_ms=vmed, min_ms=min(vtimes), max_ms=max(vtimes), gflops=vflops / (vmed * 1e-3) / 1e9,
                rel_err=(_check(q, k, v, from_stored(vout.get(), dtype), vcausal, scale, vvar) if check
                         else float("nan")),
                spill=_spill_text(vkern.spills(), handle.is_cpu), variants=_describe(vvar), plain_ms=med,
                vs_plain=med / vmed, kv_bytes=row.kv_bytes)
            rows.append(vrow)
            if progress:
                progress(vrow)
    return rows


def conditions(handle: DeviceHandle, command: str) -> dict:
    return {"backend": "opencl", "device": handle.name, "platform": handle.platform, "driver": handle.driver,
            "profile": handle.profile.name, "is_cpu": handle.is_cpu, "flashcl": __version__,
            "date": _dt.datetime.now().isoformat(timespec="seconds"), "host": platform.node(),
            "command": command}


def format_prefill(rows, cond: dict) -> str:
    lines = [f"# flashcl prefill on {cond['device']} ({cond['platform']}, driver {cond['driver']}), "
             f"flashcl {cond['flashcl']}, {cond['date']}",
             f"# command: {cond['command']}",
             "# time: OpenCL profiling events, median of the runs [min-max]; err: relative to float64",
             f"{'shape (B,Hq/Hkv,N,d)':22} {'causal':6} {'dtype':7} {'params':40} {'ms':>9} {'[min-max]':>17} "
             f"{'GFLOP/s':>9} {'rel err':>8}  {'peer GFLOP/s':>12} {'ratio':>6}  spill signals"]
    for r in rows:
        lines.append(
            f"{r.shape:22} {str(r.causal):6} {r.dtype:7} {r.params:40} {r.median_ms:9.3f} "
            f"[{r.min_ms:7.3f}-{r.max_ms:7.3f}] {r.gflops:9.1f} {r.rel_err:8.1e}  "
            f"{r.peer_gflops:12.1f} {r.ratio:6.2f}  {r.spill}")
        if r.variants:
            lines.append(f"{'':22}   ^ with {r.variants}: {r.median_ms:.3f} ms against {r.plain_ms:.3f} ms "
                         f"without, x{r.vs_plain:.2f} ({'faster' if r.vs_plain >= 1 else 'slower'}); "
                         f"GFLOP/s counts the visible pairs")
    lines += format_quant_block(rows)
    sources = sorted({r.params_source for r in rows})
    lines.append("# params from: " + "; ".join(sources))
    peers = sorted({r.peer for r in rows if r.peer})
    if peers:
        lines.append("# peer: " + "; ".join(peers) + "; ratio = peer ms / flashcl ms, both wall clock a call "
                     "(launch to wait: " + ", ".join(f"{r.wall_ms:.3f}" for r in rows if r.peer) + " ms flashcl)")
    elif cond.get("is_cpu"):
        lines.append("# peer: none -- torch is not installed (pip install torch for CPU SDPA beside flashcl)")
    return "\n".join(lines)


def format_quant_block(rows) -> list[str]:
    """The quantized K/V lines of the rows that timed one (none when no row did)."""
    q_rows = [r for r in rows if r.kv_format]
    if not q_rows:
        return []
    lines = [f"# K/V quantized to {q_rows[0].kv_format} (same run, the calls taking turns; bytes as stored; "
             "ratio = quantized ms / plain ms; GFLOP/s over the same FLOPs):"]
    for r in q_rows:
        lines.append(f"#   {r.shape:22} causal={str(r.causal):5} {r.quant_ms:.3f} ms [{r.quant_min_ms:.3f}-"
                     f"{r.quant_max_ms:.3f}] vs {r.median_ms:.3f} ms {r.dtype}, ratio {r.quant_ratio:.3f}, "
                     f"{r.quant_gflops:.1f} vs {r.gflops:.1f} GFLOP/s, K/V {r.quant_kv_bytes / 1e6:.3g} MB vs "
                     f"{r.kv_bytes / 1e6:.3g} MB, rel err {r.quant_rel_err:.1e}"
                     + (f" [params {r.quant_params}]" if r.quant_params != r.params else ""))
    return lines


def rows_as_dicts(rows):
    return [asdict(r) for r in rows]
