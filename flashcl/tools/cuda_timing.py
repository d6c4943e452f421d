"""GPU timing for the CUDA benchmarks (docs/design.md §7): CUDA-graph replay, inputs rotated past L2,
median and spread, and the device's copy bandwidth measured in the same run.

Only the benchmarks import this module; it needs torch with CUDA.
"""

from __future__ import annotations

import statistics
from typing import Callable, Sequence

import torch


def l2_bytes(device=None) -> int:
    props = torch.cuda.get_device_properties(device or torch.cuda.current_device())
    return int(getattr(props, "L2_cache_size", 50 * 2**20))


def rotation_count(bytes_per_input: int, device=None, factor: float = 3.0, cap: int = 64) -> int:
    """How many input sets make the working set exceed ``factor`` x L2 (at least 1)."""
    need = int(factor * l2_bytes(device) / max(bytes_per_input, 1)) + 1
    return max(1, min(cap, need))


def time_graph(calls: Sequence[Callable[[], object]], *, warmup: int = 3, reps: int = 20,
               inner: int | None = None) -> dict:
    """Time one pass over ``calls`` (each with its own input set) by CUDA-graph replay.

    All calls are captured into one graph, run ``inner`` times per replay so short kernels are not
    dominated by launch latency. Returns the median/min/max milliseconds of ONE call.
    """
    calls = list(calls)
    inner = inner or 1
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (and trigger compilation) outside the capture
        for _ in range(warmup):
            for c in calls:
                c()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(inner):
            for c in calls:
                c()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    per = len(calls) * inner
    for _ in range(reps):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / per)
    return {"median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times)}


def host_us(call: Callable[[], object], n: int = 100, rounds: int = 5) -> float:
    """The host's microseconds a call of ``call`` (eager, no synchronize inside a round): the least
    of ``rounds`` rounds of ``n`` calls, after 5 warm-up calls."""
    import time

    for _ in range(5):
        call()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(n):
            call()
        best = min(best, 1e6 * (time.perf_counter() - t) / n)
        torch.cuda.synchronize()
    return best


def interleaved_rounds(timers: dict, rounds: int) -> dict:
    """Take turns: each of ``rounds`` rounds runs every timer once (a callable returning
    milliseconds), the first to run rotating from round to round, so clock and temperature drift
    over a run fall on all of them alike (an H100 runs the first ~0.1 s after a pause up to 10%
    faster, then settles: one timer after another would favour whoever goes first).
    Returns {name: {"median_ms", "min_ms", "max_ms", "round_ms"}} over the round results."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    names = list(timers)
    ms = {n: [] for n in names}
    for r in range(rounds):
        first = r % len(names) if names else 0
        for n in names[first:] + names[:first]:
            ms[n].append(float(timers[n]()))
    return {n: {"median_ms": statistics.median(v), "min_ms": min(v), "max_ms": max(v), "round_ms": v}
            for n, v in ms.items()}


def device_and_host(calls: dict, sets: Sequence, rounds: int) -> dict:
    """Each of ``calls`` (name -> a function of one input set) over the input ``sets``: its device
    time a call in CUDA-graph replay of every set, in ``rounds`` interleaved rounds, and its host
    time a call on the first set (host_us). Returns {name: {"median_ms", "min_ms", "max_ms",
    "host_us"}}."""
    timers = {name: (lambda call=call: time_graph([lambda x=x: call(x) for x in sets])["median_ms"])
              for name, call in calls.items()}
    out = interleaved_rounds(timers, rounds)
    for name, call in calls.items():
        out[name]["host_us"] = host_us(lambda call=call: call(sets[0]))
    return out


def _copy_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def _copy(src, dst, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)

    return _copy


def copy_bandwidth(nbytes: int = 1 << 30, device=None) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write counted), graph-timed.

    The best of the driver's memcpy (``copy_``) and a plain vectorized Triton copy kernel: on an
    H100 the driver's DtoD memcpy stays near 2.4 TB/s while a copy kernel streams ~3 TB/s, and a
    ceiling must be what the memory system actually sustains.
    """
    n = nbytes // 8  # float32 elements per buffer: two buffers of nbytes / 2
    src = torch.empty(n, dtype=torch.float32, device=device or "cuda")
    dst = torch.empty_like(src)
    best = time_graph([lambda: dst.copy_(src)], warmup=2, reps=10)["median_ms"]
    try:
        kernel, block = _copy_kernel(), 4096
        grid = (triton_cdiv(n, block),)
        best = min(best, time_graph([lambda: kernel[grid](src, dst, n, BLOCK=block)],
                                    warmup=2, reps=10)["median_ms"])
    except Exception as exc:  # the memcpy figure still stands; say why the kernel one is missing
        import warnings

        warnings.warn(f"copy-kernel bandwidth not measured ({exc}); using the driver memcpy only")
    return 2 * n * 4 / (best * 1e-3)


def _read_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def _read(src, out, n_tiles, tiles_per_prog, BLOCK: tl.constexpr):
        # one contiguous run of tiles per program, the next tile in flight while this one is
        # summed (L1::evict_first: nothing is read twice); the sum is stored so that nothing is
        # optimized away. The loop's last load re-reads the run's last tile (an L2 hit)
        pid = tl.program_id(0)
        t0 = pid * tiles_per_prog
        t1 = tl.minimum(t0 + tiles_per_prog, n_tiles)
        offs = tl.arange(0, BLOCK)
        nxt = tl.load(src + tl.minimum(t0, n_tiles - 1).to(tl.int64) * BLOCK + offs)
        acc = tl.zeros([BLOCK], tl.float32)
        for t in range(t0 + 1, t1 + 1):
            cur = nxt
            nxt = tl.load(src + tl.minimum(t, t1 - 1).to(tl.int64) * BLOCK + offs, eviction_policy="evict_first")
            acc += cur
        tl.store(out + pid, tl.sum(acc))

    return _read


def read_bandwidth(nbytes: int = 1 << 30, device=None) -> float:
    """Streaming-read bandwidth in bytes/s: the best a kernel that only reads ``nbytes`` of
    contiguous memory sustains (graph-timed; one contiguous run per program, 16 KB tiles on 8
    warps, two and sixteen programs per SM, the faster counts). This is the ceiling of a decode
    kernel, which reads the cache and writes next to nothing. On an H100 80GB HBM3 it is about 5%
    above the copy bandwidth (read + write counted) and within 0.5% of cuDNN's SDPA on the largest
    reference decode shape (docs/notes/decode-h100.md)."""
    block = 4096  # float32: 16 KB per tile
    n_tiles = max(1, nbytes // (4 * block))
    dev = torch.device(device or "cuda")
    src = torch.zeros(n_tiles * block, dtype=torch.float32, device=dev)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    kernel = _read_kernel()
    best = float("inf")
    for per_sm in (2, 16):
        programs = min(n_tiles, per_sm * sms)
        per = triton_cdiv(n_tiles, programs)
        out = torch.empty(programs, dtype=torch.float32, device=dev)
        best = min(best, time_graph([lambda: kernel[(programs,)](src, out, n_tiles, per, BLOCK=block, num_warps=8)],
                                    warmup=2, reps=10)["median_ms"])
    return n_tiles * block * 4 / (best * 1e-3)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def driver_version() -> str:
    """The NVIDIA driver version as nvidia-smi reports it, plus the CUDA runtime torch uses."""
    import subprocess

    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout.strip().splitlines()
        drv = out[0] if out else "unknown"
    except (OSError, subprocess.SubprocessError):
        drv = "unknown"
    return f"{drv} (CUDA {torch.version.cuda})"


def device_summary() -> dict:
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return {
        "device": props.name,
        "sm_count": props.multi_processor_count,
        "capability": f"{props.major}.{props.minor}",
        "driver": driver_version(),
        "torch": torch.__version__,
    }
