"""The fp16 helpers of clkernels/kv_formats.h, bit for bit against numpy, on every OpenCL device.

A quantized value reaches the kernels' arithmetic rounded to fp16 (as_stored4/8/16) and a ggml
block's d is read as fp16 (ggml_block_d). On x86 CPU drivers the rounding takes the F16C
instructions through clang builtins and d a vector vload_half; elsewhere, and with
FLASHCL_NO_F16C, OpenCL's vstore_half_rte / vload_half. Both forms run here on values where a
rounding goes wrong easily (ties, subnormals, overflow), and the build must take F16C wherever
its compiler has it.
"""

from __future__ import annotations

import numpy as np
import pytest

from flashcl._resources import kernel_dir
from flashcl.opencl.runtime import get_device

cl = pytest.importorskip("pyopencl")

SOURCE = """
#include "kv_formats.h"

__kernel void round_trip(__global const float *x, __global float *y4, __global float *y8,
                         __global float *y16, __global int *path)
{
    const int i = get_global_id(0);
    if (i == 0) {
#if defined(__F16C__)
        path[0] = 1;
#else
        path[0] = 0;
#endif
        path[1] = FLASHCL_F16C;
    }
    vstore4(as_stored4(vload4(i, x)), i, y4);
    if (i % 2 == 0)
        vstore8(as_stored8(vload8(i / 2, x)), i / 2, y8);
    if (i % 4 == 0)
        vstore16(as_stored16(vload16(i / 4, x)), i / 4, y16);
}

/* every fp16 bit pattern as a ggml block's d, read at consecutive even byte offsets */
__kernel void block_d(__global const uchar *blocks, __global float *d)
{
    const int i = get_global_id(0);
    d[i] = ggml_block_d(blocks + 2 * i);
}
"""


def _hard_values() -> np.ndarray:
    """float32 values where fp16 rounding is easy to get wrong, padded to a multiple of 16."""
    h = np.float32
    ulp1 = h(2.0 ** -10)  # fp16's ulp in [1, 2)
    sub = h(2.0 ** -24)   # fp16's smallest subnormal
    vals = [
        0.0, -0.0, 1.0, -1.0,
        1 + ulp1 / 2, 1 + 3 * ulp1 / 2, -(1 + ulp1 / 2), 1 + ulp1 / 2 + h(2.0 ** -20),  # ties, near tie
        sub / 2, 3 * sub / 2, sub / 4, -5 * sub / 2, h(2.0 ** -14) - sub / 2,            # subnormal ties
        65504.0, 65519.0, 65520.0, -65520.0, 1e6, np.inf, -np.inf, np.nan,              # overflow
        1e-30, 3.0e-8, 0.1, 1 / 3, 2.0 ** 15 + 16,
    ]
    rng = np.random.default_rng(0)
    rand = (rng.standard_normal(2048) * np.exp2(rng.integers(-30, 18, 2048))).astype(np.float32)
    x = np.concatenate([np.array(vals, np.float32), rand])
    return np.concatenate([x, np.zeros(-len(x) % 16, np.float32)])


@pytest.mark.parametrize("store_half, no_f16c", [(1, False), (1, True), (0, False)],
                         ids=["half", "half-opencl-form", "float"])
def test_as_stored_is_numpy_fp16_rounding(cl_device, store_half, no_f16c):
    handle = get_device(cl_device)
    options = [f"-I{kernel_dir()}", f"-DSTORE_HALF={store_half}"] + (["-DFLASHCL_NO_F16C"] if no_f16c else [])
    prg = cl.Program(handle.context, SOURCE).build(options=options)
    x = _hard_values()
    mf = cl.mem_flags
    xb = cl.Buffer(handle.context, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=x)
    outs = [cl.Buffer(handle.context, mf.WRITE_ONLY, x.nbytes) for _ in range(3)]
    path = np.zeros(2, np.int32)
    path_buf = cl.Buffer(handle.context, mf.WRITE_ONLY, path.nbytes)
    prg.round_trip(handle.queue, (len(x) // 4,), None, xb, *outs, path_buf)
    cl.enqueue_copy(handle.queue, path, path_buf)
    has_f16c, took_f16c = path
    assert took_f16c == (has_f16c and store_half and not no_f16c), (has_f16c, took_f16c)
    with np.errstate(over="ignore"):
        want = x.astype(np.float16).astype(np.float32) if store_half else x
    for width, buf in zip((4, 8, 16), outs):
        got = np.empty_like(x)
        cl.enqueue_copy(handle.queue, got, buf)
        bad = ~((got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want)))
        assert not bad.any(), f"as_stored{width}: {x[bad][:8]} -> {got[bad][:8]}, numpy {want[bad][:8]}"


def test_ggml_block_d_reads_every_fp16(cl_device):
    handle = get_device(cl_device)
    prg = cl.Program(handle.context, SOURCE).build(options=[f"-I{kernel_dir()}", "-DSTORE_HALF=1"])
    bits = np.arange(1 << 16, dtype=np.uint16)
    mf = cl.mem_flags
    src = cl.Buffer(handle.context, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=bits)
    out = cl.Buffer(handle.context, mf.WRITE_ONLY, 4 * len(bits))
    prg.block_d(handle.queue, (len(bits),), None, src, out)
    got = np.empty(len(bits), np.float32)
    cl.enqueue_copy(handle.queue, got, out)
    want = bits.view(np.float16).astype(np.float32)
    same = (got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))
    assert same.all(), f"{bits[~same][:8]} -> {got[~same][:8]}, numpy {want[~same][:8]}"
