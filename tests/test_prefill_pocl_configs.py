"""The OpenCL prefill in the builds that PoCL's work-group compiler gets wrong, against the float64
oracle, on the OpenCL CPU device (PoCL; conftest.py's ``cpu_device``).

PoCL turns a kernel into a loop over the work-items of a group, split at barriers. Its 3.x releases
run two kinds of build wrong, which Oclgrind (race, uninitialized-value and bounds checks) runs
right with nothing reported:

* prefill.cl unrolled (UNROLL_LOOPS=1: what ``flashcl export`` writes for GPU profiles, whose
  example may then run on PoCL) with a mask: at BLOCK_N = VEC = 4 the per-key branch of the
  guarded P V loop is taken for a branch between two copies of the loop's barrier, which the
  OpenCL rules make uniform, and every work-item follows work-item 0 (relative error 0.1-0.4).
  prefill_tiles.cl unrolled, with a window and a mask, likewise.
* prefill_tiles.cl rolled (UNROLL_LOOPS=0, flashcl's CPU build) with micro-tiles such as 2x2 at
  BLOCK_N = 8: with PoCL's "horizontal" inner loops (one iteration for every work-item, then the
  next) the V tile is never staged, and P V reads the K tile left in the same local buffer.

So prefill_common.h builds the rolled loops on PoCL whatever UNROLL_LOOPS says, and in
prefill_tiles.cl every rolled innermost loop but the scores' takes a trip count that PoCL cannot
prove uniform (PER_ITEM), which keeps it inside each work-item. Outputs are NaN-poisoned.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from flashcl import reference
from flashcl.opencl import prefill as cl_prefill
from flashcl.opencl.prefill import PrefillKernel, PrefillProblem
from flashcl.opencl.runtime import get_device
from flashcl.variants import Variants

from ._check import assert_close

cla = pytest.importorskip("pyopencl.array")


@pytest.fixture
def unrolled(monkeypatch):
    """Build the kernels with UNROLL_LOOPS=1 whatever the device, as ``flashcl export`` writes
    them for a GPU profile (the apple and intel profiles default to BLOCK_N = VEC = 4)."""
    program = cl_prefill.program
    monkeypatch.setattr(cl_prefill, "program", lambda *a, **kw: program(*a, **{**kw, "unroll_loops": True}))


def _run(device, params, *, n_q, n_kv, dk=16, dv=32, causal=False, window=None, mask=None):
    """The kernel's out and lse on NaN-poisoned buffers against the oracle, B=1, H_q=2 over one KV
    head."""
    rng = np.random.default_rng(zlib.crc32(repr((params, n_q, n_kv, causal, window, mask)).encode()))
    h = get_device(device)
    q = rng.standard_normal((1, 2, n_q, dk)).astype(np.float32) * 2.0  # peaked rows: softmax errors show
    k = rng.standard_normal((1, 1, n_kv, dk)).astype(np.float32)
    v = rng.standard_normal((1, 1, n_kv, dv)).astype(np.float32)
    mask_arr = None
    if mask is not None:
        hidden = rng.random((1, 1, n_q, n_kv)) < 0.4
        mask_arr = ~hidden if mask == "bool" else np.where(hidden, -np.inf, rng.standard_normal(hidden.shape))
        mask_arr = mask_arr.astype(np.bool_ if mask == "bool" else np.float32)
    variants = Variants(window=window, mask=mask_arr) if window or mask else None
    prob = PrefillProblem(1, 2, 1, n_q, n_kv, dk, dv, causal, "float32")
    kern = PrefillKernel(h, prob, params, write_lse=True, flags=variants.flags() if variants else None)
    qd, kd, vd = (cla.to_device(h.queue, x) for x in (q, k, v))
    out = cla.to_device(h.queue, np.full((1, 2, n_q, dv), np.nan, np.float32))
    lse = cla.to_device(h.queue, np.full((1, 2, n_q), np.nan, np.float32))
    kern(qd, kd, vd, out, lse, dk ** -0.5, variants=variants).wait()
    ref, ref_lse = reference.attention(q, k, v, causal=causal, window=window, mask=mask_arr, return_lse=True)
    what = f"{kern.defines} causal={causal} window={window} mask={mask} N={n_q}x{n_kv}"
    assert_close(out.get(), ref, "float32", what)
    np.testing.assert_allclose(lse.get(), ref_lse, rtol=1e-5, atol=1e-5, err_msg=what)  # -inf where ref's is


ROWS_VEC4 = dict(BLOCK_M=16, BLOCK_N=4, DV_TILE=16, VEC=4)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("mask", ["bool", "add"])
def test_unrolled_rows_with_a_mask(cpu_device, unrolled, mask, causal):
    _run(cpu_device, ROWS_VEC4, n_q=37, n_kv=37, mask=mask, causal=causal)


def test_unrolled_tiles_with_a_window_and_a_mask(cpu_device, unrolled):
    params = dict(VARIANT="tiles", BLOCK_M=16, BLOCK_N=2, DV_TILE=16, TILE_M=4, TILE_N=2)
    _run(cpu_device, params, n_q=37, n_kv=37, window=(5, 2), mask="bool")


# Micro-tiles that the rolled build ran wrong: the smallest (one KV tile, one work-group of 4), the
# brief's 2x2 at BLOCK_N = 8, and wider ones up to 8x4 micro-tiles and work-groups of 128.
TILES_ROLLED = [
    dict(VARIANT="tiles", BLOCK_M=8, BLOCK_N=2, DV_TILE=4, TILE_M=2, TILE_N=2),
    dict(VARIANT="tiles", BLOCK_M=64, BLOCK_N=8, DV_TILE=16, TILE_M=2, TILE_N=2),
    dict(VARIANT="tiles", BLOCK_M=128, BLOCK_N=8, DV_TILE=32, TILE_M=4, TILE_N=2),
    dict(VARIANT="tiles", BLOCK_M=256, BLOCK_N=16, DV_TILE=16, TILE_M=8, TILE_N=4),
]


@pytest.mark.parametrize("params", TILES_ROLLED,
                         ids=lambda p: "M{BLOCK_M}N{BLOCK_N}T{DV_TILE}_{TILE_M}x{TILE_N}".format(**p))
def test_rolled_tiles(cpu_device, params):
    _run(cpu_device, params, n_q=2, n_kv=2)     # one key tile, rows past N_q in the work-group
    _run(cpu_device, params, n_q=37, n_kv=70)   # several key tiles, chunked prefill


# The guarded builds (causal, window, mask) of the same tiles, whose loops also take PER_ITEM counts
@pytest.mark.parametrize("variant", ["causal", "window+mask"])
def test_rolled_tiles_with_variants(cpu_device, variant):
    _run(cpu_device, TILES_ROLLED[1], n_q=37, n_kv=70, causal=variant == "causal",
         window=(5, 2) if "window" in variant else None, mask="add" if "mask" in variant else None)
