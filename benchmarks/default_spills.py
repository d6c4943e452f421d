"""Whether the profile defaults spill under the device's own compiler (ptxas on NVIDIA).

    python benchmarks/default_spills.py [DEVICE]

Builds prefill's and decode's profile defaults (not any tuned entry) at d = 64, 128 and 256 with
the compiler's verbose report and prints each kernel's registers and spill stores.
"""

from __future__ import annotations

import sys

from flashcl.opencl import decode as cd
from flashcl.opencl import prefill as cp
from flashcl.opencl.runtime import get_device


def main() -> int:
    h = get_device(sys.argv[1] if len(sys.argv) > 1 else "nvidia")
    print(f"# {h.describe()}, profile {h.profile.name}")
    spilled = 0
    for d in (64, 128, 256):
        for dtype in ("float32", "float16"):
            prob = cp.PrefillProblem(1, 32, 8, 2048, 2048, d, d, True, dtype)
            params = cp.tuning.default_params("prefill", h.profile, d, d, local_mem=h.local_mem,
                                              max_work_group=h.max_work_group)
            info = cp.PrefillKernel(h, prob, params, verbose=True).spills()
            spilled += bool(info.get("spill_stores"))
            print(f"prefill d={d} {dtype} {params}: {info.get('registers')} registers, "
                  f"{info.get('spill_stores')} B spill stores")
            for group in (1, 4, 8):
                dprob = cd.DecodeProblem(4, 8 * group, 8, d, d, True, dtype)
                dparams = cd.default_params(h.profile, group, d, d, dtype, local_mem=h.local_mem,
                                            max_work_group=h.max_work_group)
                kern = cd.DecodeKernel(h, dprob, dparams, verbose=True)
                for name, info in kern.spills().items():
                    spilled += bool(info.get("spill_stores"))
                    print(f"  decode d={d} {dtype} G={group} {kern.path} {name}: {info.get('registers')} "
                          f"registers, {info.get('spill_stores')} B spill stores")
    print(f"# kernels with spill stores: {spilled}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
