"""The OpenCL decode of an uneven batch: one long sequence and seven short ones (8 x 32/8 heads,
d = 128, paged 16 in random order, fp16), at the split counts of both automatic rules (lengths
on the host, device tables) and their power-of-two neighbours.

    python benchmarks/decode_uneven_batch.py --long 131072 --short 1024 [--device nvidia]

Times are OpenCL profiling events (split kernel start to merge end: split-k as two launches, as
the figures docs/notes/opencl-decode-nvidia.md cites were measured), the median of 5 interleaved
rounds of 10 calls.
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np
import pyopencl.array as cla

from flashcl.opencl.decode import DecodeKernel, DecodeProblem, choose_params
from flashcl.opencl.runtime import event_times, get_device


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--long", type=int, default=131072, help="keys of the long sequence")
    ap.add_argument("--short", type=int, default=1024, help="keys of each of the seven others")
    ap.add_argument("--device", default="nvidia")
    ap.add_argument("--rounds", type=int, default=5)
    opt = ap.parse_args()

    handle = get_device(opt.device)
    queue = handle.queue
    b, h_q, h_kv, d, bs = 8, 32, 8, 128, 16
    lens = np.array([opt.long] + [opt.short] * (b - 1), np.int32)
    per_seq = -(-opt.long // bs)
    rng = np.random.default_rng(0)
    k = rng.standard_normal((per_seq * b, bs, h_kv, d)).astype(np.float16)
    v = rng.standard_normal((per_seq * b, bs, h_kv, d)).astype(np.float16)
    q = rng.standard_normal((b, h_q, d)).astype(np.float16)
    table = rng.permutation(per_seq * b).reshape(b, per_seq).astype(np.int32)
    qd, kd, vd, td, ld = (cla.to_device(queue, x) for x in (q, k, v, table, lens))
    out = cla.empty(queue, (b, h_q, d), np.float16)
    lse = cla.empty(queue, (b, h_q), np.float32)

    prob = DecodeProblem(b, h_q, h_kv, d, d, True, "float16")
    kern = DecodeKernel(handle, prob, choose_params(handle, prob, None, opt.long).params, fused_merge=False)
    device_rule = kern.auto_splits(opt.long)
    host_rule = kern.auto_splits(opt.long, mean_ctx=float(lens.mean()))
    counts = sorted({4, 8, 16, 32, 64, device_rule, host_rule})
    times: dict[int, list[float]] = {s: [] for s in counts}
    for _ in range(opt.rounds):
        for s in counts:
            times[s] += event_times(lambda i, s=s: kern(qd, kd, vd, out, lse, td, ld, d ** -0.5, s), 10,
                                    warmup=2)
    print(f"{handle.describe()}, {kern.path}: one sequence of {opt.long} keys, {b - 1} of {opt.short}; "
          f"automatic splits {host_rule} (lengths on the host), {device_rule} (device tables)")
    for s in counts:
        print(f"  {s:3d} splits: {statistics.median(times[s]) * 1e3:8.1f} us")


if __name__ == "__main__":
    main()
