"""The OpenCL decode kernel of an NVIDIA GPU launched through the CUDA driver, so that Nsight
Compute (which profiles CUDA launches, not OpenCL ones) can measure it.

    ncu --kernel-name flash_decode_split --launch-skip 1 --launch-count 1 --section SpeedOfLight \\
        python benchmarks/opencl_under_ncu.py --format q8_0 [--format fp16 ...] \\
        [--shape 1,32,8,131072] [--define KV_EVICT_FIRST=0 ...] [--reps 2]

Without ncu it prints the decode kernel's time alone (CUDA events, the same inputs every launch).
Each format's DecodeKernel is built and run once through OpenCL as flashcl runs it; its first
launch (decode_mma.cl's split kernel on sm_80+) is then loaded from the program's PTX with
cuModuleLoadData and launched with copies of the same buffers and scalars. The PTX reads the
work-group offset NVIDIA's OpenCL passes in %envreg0..2 (get_group_id); a CUDA launch has none,
so those reads become 0.
"""

from __future__ import annotations

import argparse
import ctypes
import re
import statistics

import numpy as np
import pyopencl as cl
import pyopencl.array as cla
import torch

from flashcl import quant
from flashcl.opencl.decode import DecodeKernel, DecodeProblem, choose_params, quantized_to_device
from flashcl.opencl.runtime import get_device, launch_sequence
from flashcl.tools.bench_decode import _inputs

_ENVREG = re.compile(rb"mov\.b32\s+(%r\d+), %envreg\d+;")


def _check(result: int, what: str) -> None:
    if result != 0:
        raise RuntimeError(f"{what}: CUresult {result}")


def cuda_launch(kernel_name: bytes, ptx: bytes, gsize, lsize, args, queue):
    """A callable that launches ``kernel_name`` of ``ptx`` with the OpenCL launch's sizes and
    arguments (buffers copied to torch CUDA tensors, scalars by their numpy type)."""
    cuda = ctypes.CDLL("libcuda.so.1")
    mod, fn = ctypes.c_void_p(), ctypes.c_void_p()
    _check(cuda.cuModuleLoadData(ctypes.byref(mod), ctypes.c_char_p(_ENVREG.sub(rb"mov.b32 \1, 0;", ptx) + b"\0")),
           "cuModuleLoadData")
    _check(cuda.cuModuleGetFunction(ctypes.byref(fn), mod, kernel_name), "cuModuleGetFunction")
    copies, values = {}, []
    for a in args:
        if isinstance(a, cl.Buffer):
            if a.int_ptr not in copies:
                host = np.empty(a.size, np.uint8)
                cl.enqueue_copy(queue, host, a)
                copies[a.int_ptr] = torch.from_numpy(host).cuda()
            values.append(ctypes.c_uint64(copies[a.int_ptr].data_ptr()))
        elif isinstance(a, (np.int32, np.uint64, np.float32)):
            values.append({np.int32: ctypes.c_int32, np.uint64: ctypes.c_uint64,
                           np.float32: ctypes.c_float}[type(a)](a.item()))
        else:
            raise TypeError(f"argument of type {type(a).__name__}: not a buffer or a scalar")
    params = (ctypes.c_void_p * len(values))(*[ctypes.cast(ctypes.byref(x), ctypes.c_void_p) for x in values])
    grid = [g // l_ for g, l_ in zip(gsize, lsize)] + [1] * (3 - len(gsize))
    block = list(lsize) + [1] * (3 - len(lsize))

    def go():
        _check(cuda.cuLaunchKernel(fn, *grid, *block, 0, None, params, None), "cuLaunchKernel")
    go.keep = (mod, copies, values, params)  # alive as long as the callable
    return go


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--format", action="append", choices=["fp16", "q8_0", "q4_0", "int8"])
    ap.add_argument("--shape", default="1,32,8,131072", help="B,H_q,H_kv,ctx (paged 16, random order)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--define", action="append", default=[], help="KEY=VALUE, a -D option of the build")
    ap.add_argument("--reps", type=int, default=20)
    opt = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("opencl_under_ncu: needs a CUDA GPU (and its driver's OpenCL)")
    b, h_q, h_kv, ctx = (int(x) for x in opt.shape.split(","))
    handle = get_device("nvidia")
    queue = handle.queue
    rng = np.random.default_rng(0)
    q, k, v, table, lens = _inputs(rng, (b, h_q, h_kv, ctx), "float16", 16, "random", opt.head_dim)
    qd, kd, vd, td, ld = (cla.to_device(queue, x) for x in (q, k, v, table, lens))
    out = cla.empty(queue, (b, h_q, opt.head_dim), np.float16)
    lse = cla.empty(queue, (b, h_q), np.float32)
    torch.zeros(1, device="cuda")  # the CUDA context the driver calls use
    for fmt in opt.format or ["fp16"]:
        f = None if fmt == "fp16" else fmt
        prob = DecodeProblem(b, h_q, h_kv, opt.head_dim, opt.head_dim, True, "float16", f, f)
        # the split kernel alone (the two-launch split-k): the fused one would merge as well
        kern = DecodeKernel(handle, prob, choose_params(handle, prob, None, ctx).params,
                            extra_options=[f"-D{d}" for d in opt.define], fused_merge=False)
        kk, vv = ((quantized_to_device(quant.quantize(x, f), queue) for x in (k, v)) if f else (kd, vd))
        seq = kern.launches(qd, kk, vv, out, lse, td, ld, opt.head_dim ** -0.5, kern.auto_splits(ctx))
        for ev in launch_sequence(handle, seq, params=kern.params):
            ev.wait()  # the OpenCL run: the buffers the copies are taken from are written
        _, kernel, gsize, lsize, args = seq[0]
        ptx = kern.built_decode.program.get_info(cl.program_info.BINARIES)[0]
        go = cuda_launch(kernel.function_name.encode(), ptx, gsize, lsize, args, queue)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(opt.reps):
            start.record()
            go()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        print(f"{fmt} {opt.shape}: {kernel.function_name} alone, grid {gsize} / {lsize}, "
              f"median {statistics.median(times):.1f} us over {opt.reps} launches", flush=True)


if __name__ == "__main__":
    main()
