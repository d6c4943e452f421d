"""decode_mma.cl's split-k as two launches (split kernel, then flash_decode_merge) against one
(flash_decode_fused), at the automatic split count, on an NVIDIA GPU through its OpenCL driver.

    python benchmarks/decode_fused_merge.py 1,32,8,4096 1,32,8,32768:q8_0 1,32,8,32768::1023

Each argument is B,H_q,H_kv,ctx[:FORMAT[:WINDOW_LEFT]] (d = 128, paged 16 in random order, fp16
q). Times are OpenCL profiling events (first kernel start to last end), inputs rotated past L2,
the median of 5 interleaved rounds of 10 calls. docs/notes/opencl-decode-nvidia.md cites them.
"""

from __future__ import annotations

import statistics
import sys

import numpy as np
import pyopencl.array as cla

from flashcl import quant
from flashcl.opencl.decode import DecodeKernel, DecodeProblem, DecodeVariants, choose_params, quantized_to_device
from flashcl.opencl.runtime import event_times, get_device
from flashcl.tools.bench_decode import _inputs, device_sets


def run_case(handle, spec: str) -> None:
    queue = handle.queue
    parts = spec.split(":")
    b, h_q, h_kv, ctx = (int(x) for x in parts[0].split(","))
    fmt = parts[1] if len(parts) > 1 and parts[1] else None
    var = DecodeVariants(int(parts[2]), None, None, None) if len(parts) > 2 else None
    rng = np.random.default_rng(0)
    q, k, v, table, lens = _inputs(rng, (b, h_q, h_kv, ctx), "float16", 16, "random", 128)
    sets = device_sets(handle, rng, q, k, v, table, lens)
    copies = len(sets)
    if fmt:
        qk, qv = quant.quantize(k, fmt), quant.quantize(v, fmt)
        quantized = [[quantized_to_device(x, queue) for x in (qk, qv)] for _ in range(copies)]
    out = cla.empty(queue, (b, h_q, 128), np.float16)
    lse = cla.empty(queue, (b, h_q), np.float32)
    prob = DecodeProblem(b, h_q, h_kv, 128, 128, True, "float16", fmt, fmt)
    params = choose_params(handle, prob, None, ctx).params
    kerns = {fused: DecodeKernel(handle, prob, params, variant_flags=var.flags() if var else None,
                                 tensor_cores=True, fused_merge=fused) for fused in (False, True)}
    seen = var.keys_seen(ctx) if var else ctx
    splits = kerns[False].auto_splits(seen, mean_ctx=float(seen))

    def runner(kern):
        def go(i):
            qd, kd, vd, td, ld = sets[i % copies]
            if fmt:
                kd, vd = quantized[i % copies]
            return kern(qd, kd, vd, out, lse, td, ld, 128 ** -0.5, splits, variants=var)
        return go

    outs = {}
    for fused, kern in kerns.items():
        for ev in runner(kern)(0):
            ev.wait()
        outs[fused] = out.get().astype(np.float64)
    times: dict[bool, list[float]] = {fused: [] for fused in kerns}
    for _ in range(5):
        for fused, kern in kerns.items():
            times[fused] += event_times(runner(kern), 10, warmup=2)
    two, one = (statistics.median(times[f]) * 1e3 for f in (False, True))
    print(f"{spec:28s} splits {splits:3d}: two launches {two:7.1f} us, one {one:7.1f} us, x {one / two:.3f}; "
          f"max |diff| {np.abs(outs[False] - outs[True]).max():.1e}", flush=True)


def main() -> None:
    handle = get_device("nvidia")
    print(handle.describe())
    for spec in sys.argv[1:] or ["1,32,8,4096", "1,32,8,32768"]:
        run_case(handle, spec)


if __name__ == "__main__":
    main()
