"""What a flashcl.decode / flashcl.prefill call on pyopencl arrays costs the host, and what the
device spends per call when calls are enqueued back to back (as a model's decode loop does).

    python benchmarks/opencl_call_overhead.py [--device nvidia] [--small] [--host-inputs]

For each case: the host's time per call (the API call alone, no wait; 5 rounds of 200 calls,
median) and the device's span per call over the same rounds (first kernel start to last kernel
end, over the 200 calls, from OpenCL profiling events). Where the host's time is the larger,
the device waits on the host. ``--small``: shapes a CPU device runs quickly. ``--host-inputs``:
float32 torch CPU tensors in and out instead (what the transformers integration passes): the
whole call, its copies to the device and its read-back included (5 rounds of 200 calls, median),
then contiguous float32 and float16 caches with torch's SDPA on the same tensors beside them
(5 rounds of 20). Run it from two trees (PYTHONPATH) to compare them. docs/notes/opencl-host.md cites it.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import pyopencl.array as cla

import flashcl
from flashcl.opencl.runtime import get_device
from flashcl.tools.bench_decode import _inputs


def per_call(queue, call, n: int = 200, rounds: int = 5) -> tuple[float, float]:
    """(host us a call, device span us a call), medians over ``rounds`` of ``n`` calls."""
    for _ in range(5):
        call()
    queue.finish()
    host, span = [], []
    for _ in range(rounds):
        t = time.perf_counter()
        outs = [call() for _ in range(n)]
        host.append(1e6 * (time.perf_counter() - t) / n)
        first, last = outs[0].events[0], outs[-1].events[-1]  # before finish() empties them
        queue.finish()
        span.append(1e-3 * (last.profile.end - first.profile.start) / n)
    return statistics.median(host), statistics.median(span)


def whole_call(call, n: int = 200, rounds: int = 5) -> float:
    """us a call of a call that returns host results (it waits for the device itself)."""
    for _ in range(5):
        call()
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(n):
            call()
        times.append(1e6 * (time.perf_counter() - t) / n)
    return statistics.median(times)


def host_inputs(opt, h_q: int, h_kv: int, d: int, contexts, n: int) -> None:
    import torch

    rng = np.random.default_rng(0)
    for ctx in contexts:
        q, k, v, table, lens = (torch.from_numpy(x) for x in
                                _inputs(rng, (1, h_q, h_kv, ctx), "float32", 16, "random", d))
        us = whole_call(lambda: flashcl.decode(q, k, v, block_table=table, context_lens=lens, device=opt.device))
        print(f"decode (1, {h_q}/{h_kv}, {ctx}) float32 paged 16, torch CPU in and out: {us:7.1f} us a call")
    # a contiguous (B, H_kv, N, D) cache, as transformers passes it, with torch's SDPA on the same tensors
    for ctx in contexts:
        for dtype in (torch.float32, torch.float16):
            q = torch.randn(1, h_q, d, dtype=dtype)
            k, v = (torch.randn(1, h_kv, ctx, d, dtype=dtype) for _ in range(2))
            us = whole_call(lambda: flashcl.decode(q, k, v, device=opt.device), n=20)
            sdpa = whole_call(lambda: torch.nn.functional.scaled_dot_product_attention(
                q[:, :, None], k, v, enable_gqa=True), n=20)
            print(f"decode (1, {h_q}/{h_kv}, {ctx}) {str(dtype)[6:]} contiguous, torch CPU in and out: "
                  f"{us:7.1f} us a call; torch SDPA {sdpa:7.1f} us")
    x = torch.from_numpy(rng.standard_normal((1, h_q, n, d)).astype(np.float32))
    us = whole_call(lambda: flashcl.prefill(x, x, x, causal=True, device=opt.device))
    print(f"prefill (1, {h_q}, {n}, {d}) causal float32, torch CPU in and out: {us:7.1f} us a call")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default=None, help="as flashcl's device= (default: the first GPU)")
    ap.add_argument("--small", action="store_true", help="small shapes (CPU devices)")
    ap.add_argument("--host-inputs", action="store_true", help="torch CPU tensors in and out (module docstring)")
    opt = ap.parse_args()
    queue = get_device(opt.device).queue
    rng = np.random.default_rng(0)
    h_q, h_kv, d = (8, 2, 64) if opt.small else (32, 8, 128)
    print(f"# {queue.device.name.strip()} ({queue.device.platform.name.strip()})")
    if opt.host_inputs:
        host_inputs(opt, h_q, h_kv, d, (256,) if opt.small else (1024, 4096, 8192), 64 if opt.small else 256)
        return
    for ctx in (256,) if opt.small else (1024, 4096):
        q, k, v, table, lens = _inputs(rng, (1, h_q, h_kv, ctx), "float16", 16, "random", d)
        qd, kd, vd, td, ld = (cla.to_device(queue, x) for x in (q, k, v, table, lens))
        kq, vq = (flashcl.quantize(x, "q8_0") for x in (kd, vd))
        for fmt, (kc, vc) in (("float16", (kd, vd)), ("q8_0", (kq, vq))):
            host, span = per_call(queue, lambda: flashcl.decode(qd, kc, vc, block_table=td, context_lens=ld))
            print(f"decode (1, {h_q}/{h_kv}, {ctx}) {fmt} paged 16: host {host:7.1f} us a call, "
                  f"device span {span:7.1f} us a call")
    n = 64 if opt.small else 256
    x = cla.to_device(queue, rng.standard_normal((1, h_q, n, d)).astype(np.float16))
    host, span = per_call(queue, lambda: flashcl.prefill(x, x, x, causal=True))
    print(f"prefill (1, {h_q}, {n}, {d}) causal float16: host {host:7.1f} us a call, device span {span:7.1f} us a call")


if __name__ == "__main__":
    main()
