"""Wall time of the first prefill and decode calls of a fresh process (compile or cache load).

    python benchmarks/first_call.py DEVICE [--runs 2]

Each run is a new process; the device is opened and probed before the timing. With an empty
$FLASHCL_CACHE_DIR the first run compiles and later runs show what the caches save.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

_CHILD = r'''
import json, sys, time
import numpy as np
import flashcl
from flashcl.opencl.runtime import capabilities, get_device
h = get_device(sys.argv[1]); capabilities(h.device)
rng = np.random.default_rng(0)
res = {}
for dtype in ("float32", "float16"):
    q = rng.standard_normal((1, 8, 256, 64)).astype(dtype)
    t0 = time.perf_counter(); flashcl.prefill(q, q[:, :2], q[:, :2], causal=True, device=h.context)
    res[f"prefill {dtype} ms"] = round(1e3 * (time.perf_counter() - t0), 1)
    qd = rng.standard_normal((1, 8, 64)).astype(dtype)
    kc = rng.standard_normal((1, 2, 256, 64)).astype(dtype)
    t0 = time.perf_counter(); flashcl.decode(qd, kc, kc, device=h.context)
    res[f"decode {dtype} ms"] = round(1e3 * (time.perf_counter() - t0), 1)
print(json.dumps(res))
'''


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("device")
    ap.add_argument("--runs", type=int, default=2)
    args = ap.parse_args()
    for i in range(args.runs):
        out = subprocess.run([sys.executable, "-c", _CHILD, args.device], capture_output=True, text=True,
                             check=True).stdout.strip().splitlines()[-1]
        print(f"process {i + 1}: {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
