"""decode_mma.cl / decode.cl builds with extra compiler options against the default build, on
one device, interleaved in one process; each build's output compared with the default's.

    python benchmarks/opencl_decode_builds.py --ctx 32768,131072 --formats fp16,q8_0,q4_0,int8 \\
        --build default --build default@48 --build=FIXED_WG=0+-cl-nv-maxrregcount=168@48

A build is "default" or options joined by "+": NAME=VALUE is a -D define (a kernel macro the
host does not size the launch by, not a tile parameter such as ROWS), anything that
starts with "-" a compiler option as it is; "@N" forces N splits (else the automatic count). The
first --build is the baseline.

Shape (1, 32/8, ctx), d = 128, paged 16 in random order, fp16 q; OpenCL profiling events (first
kernel start to last end), inputs rotated past 3x the device's cache, ``--rounds`` rounds of 10
calls after 2 warm-ups, median. Prints each build's register and spill lines from the NVIDIA
compiler's log, then its time, x the default build and x the fp16 cache of the same build.
docs/notes/opencl-decode-nvidia.md cites it.
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np
import pyopencl as cl
import pyopencl.array as cla

from flashcl import quant
from flashcl.opencl.decode import DecodeKernel, DecodeProblem, choose_params, quantized_to_device
from flashcl.opencl.runtime import event_times, get_device
from flashcl.tools.bench_decode import _inputs, device_sets


def parse_build(spec: str) -> tuple[list[str], int | None]:
    """(compiler options, forced split count or None) of one --builds entry."""
    opts, _, splits = spec.partition("@")
    parts = [] if opts == "default" else opts.split("+")
    return [p if p.startswith("-") else f"-D{p}" for p in parts], (int(splits) if splits else None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="nvidia")
    ap.add_argument("--ctx", default="32768,131072", help="context lengths, comma-separated")
    ap.add_argument("--formats", default="fp16,q8_0,q4_0,int8", help="fp16 and/or quantized formats")
    ap.add_argument("--build", action="append", dest="builds",
                    help="a build (repeatable; the first is the baseline; default: default)")
    ap.add_argument("--rounds", type=int, default=5)
    opt = ap.parse_args()
    opt.builds = opt.builds or ["default"]
    handle = get_device(opt.device)
    queue = handle.queue
    fmts = opt.formats.split(",")
    print(f"# {handle.name} ({handle.driver})")
    for ctx in (int(c) for c in opt.ctx.split(",")):
        rng = np.random.default_rng(0)
        q, k, v, table, lens = _inputs(rng, (1, 32, 8, ctx), "float16", 16, "random", 128)
        sets = device_sets(handle, rng, q, k, v, table, lens)
        copies = len(sets)
        stored = {f: [[quantized_to_device(quant.quantize(x, f), queue) for x in (k, v)] for _ in range(copies)]
                  for f in fmts if f != "fp16"}
        out = cla.empty(queue, (1, 32, 128), np.float16)
        lse = cla.empty(queue, (1, 32), np.float32)
        runs = {}
        for fmt in fmts:
            f = None if fmt == "fp16" else fmt
            prob = DecodeProblem(1, 32, 8, 128, 128, True, "float16", f, f)
            for spec in opt.builds:
                options, splits = parse_build(spec)
                kern = DecodeKernel(handle, prob, choose_params(handle, prob, None, ctx).params,
                                    extra_options=(["-cl-nv-verbose"] if handle.is_nvidia else []) + options)
                log = kern.built_decode.program.get_build_info(handle.device, cl.program_build_info.LOG)
                report = [ln.split(":")[-1].strip() for ln in log.splitlines()
                          if "Used" in ln or ("spill" in ln and " 0 bytes spill stores" not in ln)]
                print(f"# ctx {ctx} {fmt} {spec}: {report[:2]}", flush=True)
                n_splits = splits or kern.auto_splits(ctx, mean_ctx=float(ctx))

                def go(i, kern=kern, fmt=fmt, n_splits=n_splits):
                    qd, kd, vd, td, ld = sets[i % copies]
                    if fmt != "fp16":
                        kd, vd = stored[fmt][i % copies]
                    return kern(qd, kd, vd, out, lse, td, ld, 128 ** -0.5, n_splits)
                runs[(fmt, spec)] = go
        for (fmt, spec), go in runs.items():  # every build against its format's default build
            for ev in go(0):
                ev.wait()
            got = out.get().astype(np.float32)
            if spec == opt.builds[0]:
                base_out = got
            diff = float(np.max(np.abs(got - base_out)))
            if diff:
                print(f"# ctx {ctx} {fmt} {spec}: max difference to the default build {diff:.2e}")
        times = {key: [] for key in runs}
        for _ in range(opt.rounds):
            for key, go in runs.items():
                times[key] += event_times(go, 10, warmup=2)
        med = {key: statistics.median(t) for key, t in times.items()}
        for (fmt, spec), t in med.items():
            fp16 = med.get(("fp16", spec))
            print(f"ctx {ctx} {fmt:5s} {spec:40s} {t * 1e3:8.1f} us  x default {t / med[(fmt, opt.builds[0])]:.3f}"
                  + (f"  x fp16 of this build {t / fp16:.3f}" if fp16 else ""), flush=True)


if __name__ == "__main__":
    main()
