"""Every OpenCL kernel under Oclgrind: data races, uninitialized values, API misuse (issue 7).

Oclgrind (``pip install 'flashcl[oclgrind]'``) is an OpenCL platform that interprets kernels and
checks every memory access: out-of-bounds reads and writes, work-group data races through local
and global memory, barrier divergence, uses of uninitialized values, and (OCLGRIND_CHECK_API)
invalid API calls. It prints what it finds from inside the process — kernel diagnostics to the
file named by OCLGRIND_LOG, API errors to stderr — and never fails the call: an aborted kernel
simply leaves its outputs unwritten. So each case runs in a subprocess with its own log, and ANY
report (log or stderr) fails the test, as does a wrong answer (outputs are NaN-poisoned first and
compared against the float64 oracle by the same ``check`` helpers as the PoCL tests).

The cases sit on the corners of each kernel's parameter space — smallest and largest tiles,
work-groups of one work-item and of several subgroups, partial tiles on both axes, causal and
not, N_q != N_kv, float16 and float32 storage; for decode single pass and split-k with the merge,
more splits than blocks (empty splits), block_size 1, paged and contiguous, MHA and GQA with the
K/V tile staged or not — with problems a few dozen keys long: Oclgrind is ~1000x slower than PoCL.
The hardening cases run checks of tests/test_hardening_kernels.py on small shapes: the guarded
P V product of causal prefill with poisoned K/V, and decode on out-of-range device-resident
tables, where Oclgrind's bounds checks are what proves that nothing is read out of bounds. The
bfloat16 cases run tests/test_bfloat16_opencl.py's checks (torch CPU tensors) on small shapes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# Oclgrind's checks, and what makes them usable here:
#  * -cl-opt-disable: at -O2 clang emits LLVM `freeze` instructions, which Oclgrind's
#    uninitialized-value plugin does not implement (it aborts the kernel with "OCLGRIND FATAL
#    ERROR ... Unsupported instruction: freeze"). Races and uninitialized reads are properties of
#    the source, so the unoptimized program is the one to check.
#  * OCLGRIND_LOCAL_MEM_SIZE: Oclgrind charges each kernel for the __local arrays of every
#    kernel in its program (decode.cl: flash_decode + flash_decode_split + the merge's, so about
#    twice what one decode kernel declares), then refuses launches above its 32 KiB default with
#    CL_OUT_OF_RESOURCES. 128 KiB covers that; the parameters of every case below are also
#    valid for 32 KiB by flashcl's own local-memory model.
#  * PYOPENCL_NO_CACHE: PyOpenCL's binary cache does not key on OCLGRIND_BUILD_OPTIONS, so a
#    program cached from an optimized build would come back with its `freeze`s.
OCLGRIND_ENV = {
    "OCLGRIND_DATA_RACES": "1",
    "OCLGRIND_UNINITIALIZED": "1",
    "OCLGRIND_CHECK_API": "1",
    "OCLGRIND_BUILD_OPTIONS": "-cl-opt-disable",
    "OCLGRIND_LOCAL_MEM_SIZE": str(128 * 1024),
    "PYOPENCL_NO_CACHE": "1",
}
CASE_TIMEOUT_S = 240


def _oclgrind_present() -> bool:
    try:
        import pyopencl as cl

        return any("oclgrind" in p.name.lower() for p in cl.get_platforms())
    except Exception:  # no ICD loader or no platform at all
        return False


pytestmark = pytest.mark.skipif(not _oclgrind_present(),
                                reason="Oclgrind is not installed (pip install 'flashcl[oclgrind]')")


# --------------------------------------------------------------------------- cases

def P(name, *, b=1, h_q=2, h_kv=1, n_q, n_kv, dk=32, dv=32, causal, dtype, **params):
    env = params.pop("env", {})
    return pytest.param({"kernel": "prefill", "shape": (b, h_q, h_kv, n_q, n_kv, dk, dv),
                         "causal": causal, "dtype": dtype, "params": params, "env": env}, id=name)


# A false positive of Oclgrind 21.10's uninitialized-value plugin, not of the kernel: a builtin
# called on the upper half of a float16 (fmax(x.s89ab, ...), as VEC=16's HMAX_V does) is
# "Controlflow depends on uninitialized value" even when all 16 lanes were just loaded from an
# initialized buffer; x.s89ab + x.s89ab, fmax of a float8's halves and fmax of a whole float16 are
# clean. Reproducer: test_fmax_of_float16_upper_half_false_positive below. VEC=16 cases therefore
# run with the race and API checks only.
NO_UNINIT_CHECK_VEC16 = {"OCLGRIND_UNINITIALIZED": "0"}


# Prefill: BLOCK_M is the work-group (one query row per work-item); BLOCK_N the KV tile in local
# memory, loaded cooperatively and read by every row: the barrier pair around it is what the race
# detector checks, and it only matters once the work-group is wider than a subgroup (32-64).
PREFILL_CASES = [
    # smallest everything: one work-item, 4-key tiles, 4-column DV passes (DV/4 work-groups)
    P("min-tiles-causal-f32", n_q=5, n_kv=7, dk=16, dv=16, causal=True, dtype="float32",
      BLOCK_M=1, BLOCK_N=4, DV_TILE=4, VEC=4),
    # BLOCK_M 64 > subgroup; partial M (70 = 64 + 6) and N (37 = 2*16 + 5) tiles; 2 DV passes; GQA
    P("m64-partial-tiles-f16", n_q=70, n_kv=37, causal=False, dtype="float16",
      BLOCK_M=64, BLOCK_N=16, DV_TILE=16, VEC=4),
    # BLOCK_M 128, largest BLOCK_N, single DV pass, VEC 16, q re-read per tile; chunked causal
    # prefill (N_q < N_kv) with partial tiles on both axes
    P("m128-n64-q-reread-causal-f32", n_q=130, n_kv=141, causal=True, dtype="float32",
      BLOCK_M=128, BLOCK_N=64, DV_TILE=32, VEC=16, Q_IN_REGS=0, env=NO_UNINIT_CHECK_VEC16),
    # causal with N_q > N_kv: the first rows see no key (zeros, lse -inf); whole tiles skipped;
    # DK != DV, VEC 8, B 2
    P("m32-causal-nq-gt-nkv-f16", b=2, h_q=2, h_kv=2, n_q=40, n_kv=11, dk=40, dv=16, causal=True,
      dtype="float16", BLOCK_M=32, BLOCK_N=8, DV_TILE=8, VEC=8),
    # BLOCK_M 128 and BLOCK_N 128 (the kernel's widest KV tile), square causal, partial tiles
    P("m128-n128-causal-square-f32", h_q=1, n_q=131, n_kv=131, causal=True, dtype="float32",
      BLOCK_M=128, BLOCK_N=128, DV_TILE=32, VEC=4),
    # head dim 128 in four DV passes, q re-read per tile, VEC 8, chunked causal with GQA
    P("d128-dv-passes-q-reread-f16", h_q=4, h_kv=2, n_q=20, n_kv=33, dk=128, dv=128, causal=True,
      dtype="float16", BLOCK_M=16, BLOCK_N=32, DV_TILE=32, VEC=8, Q_IN_REGS=0),
    # the largest work-group of the tuning space, MQA, N_kv = 1
    P("m256-mqa-nkv1-f32", h_q=3, n_q=9, n_kv=1, dk=16, dv=16, causal=False, dtype="float32",
      BLOCK_M=256, BLOCK_N=4, DV_TILE=16, VEC=4),
    # micro-tiled layout: K^T and V share one local buffer (overwritten between two barriers),
    # P^T and the row partials are written and read across work-items. Smallest tiles, causal
    # with rows that see no key, DK != DV, two DV passes
    P("tiles-2x2-causal-nq-gt-nkv-f32", n_q=12, n_kv=7, dk=16, dv=32, causal=True, dtype="float32",
      VARIANT="tiles", BLOCK_M=4, BLOCK_N=4, DV_TILE=16, TILE_M=2, TILE_N=2),
    # 8x8 micro-tiles, work-group of 2 x 8 = 16, partial tiles on both axes, fp16, GQA, unroll 2
    P("tiles-8x8-partial-f16", h_q=4, h_kv=2, n_q=21, n_kv=70, causal=False, dtype="float16",
      VARIANT="tiles", BLOCK_M=16, BLOCK_N=64, DV_TILE=32, TILE_M=8, TILE_N=8, UNROLL_K=2),
    # the H100 winner's shape of tile: 8x2, a work-group of 64 (wider than a warp), chunked causal
    P("tiles-8x2-wg64-causal-f32", n_q=70, n_kv=90, causal=True, dtype="float32",
      VARIANT="tiles", BLOCK_M=64, BLOCK_N=16, DV_TILE=32, TILE_M=8, TILE_N=2, UNROLL_K=4),
]


def D(name, *, b, h_q, h_kv, dk=32, dv=32, lens, block_size=None, n_max=None, dtype, splits,
      tensor_cores=None, env=None, **params):
    return pytest.param({"kernel": "decode", "heads": (b, h_q, h_kv), "dims": (dk, dv),
                         "lens": lens, "block_size": block_size, "n_max": n_max, "dtype": dtype,
                         "splits": splits, "tensor_cores": tensor_cores, "params": params, "env": env or {}},
                        id=name)


# Decode: WG = LANES x ROWS x (G / HEAD_TILE) with LANES = max(DK, DV) / (4 floats | 8 halves).
# splits 1 runs flash_decode; more run flash_decode_split then flash_decode_merge. Split counts
# above the sequence's tile count leave splits empty (the (-inf, 0, 0) state the merge skips).
DECODE_CASES = [
    # block_size 1, GQA 4 with 2 head tiles (K/V staged in local memory), WG 8*2*2 = 32;
    # context 0 (no key at all), 1 and a partial tile; 16 splits > every sequence's tiles
    D("paged-bs1-gqa4-staged-f32", b=3, h_q=8, h_kv=2, lens=[0, 1, 9], block_size=1,
      dtype="float32", splits=[1, 3, 16], ROWS=2, UNROLL=2, HEAD_TILE=2, MERGE_WG=16),
    # contiguous MHA, one row slot (no row-slot merge), WG 8 lanes; N_max 37 not a tile multiple
    D("contig-mha-rows1-f16", b=2, h_q=2, h_kv=2, dk=64, dv=64, n_max=37, lens=None,
      dtype="float16", splits=[1, 5], ROWS=1, UNROLL=4, HEAD_TILE=1, MERGE_WG=32),
    # GQA 8 in one head tile (direct loads), 8 row slots: WG 64 (several subgroups); block_size 16
    # with a partial last block, a permuted table; MERGE_WG 128 > num_splits
    D("paged-bs16-gqa8-direct-f16", b=2, h_q=8, h_kv=1, lens=[17, 50], block_size=16,
      dtype="float16", splits=[1, 2, 7], ROWS=8, UNROLL=1, HEAD_TILE=8, MERGE_WG=128),
    # contiguous GQA 4, head tile 1 (4 head tiles share a staged tile), DK != DV: WG 16*4*4 = 256,
    # context lengths below N_max
    D("contig-gqa4-staged-wg256-f32", b=2, h_q=4, h_kv=1, dk=64, dv=32, n_max=23, lens=[23, 6],
      dtype="float32", splits=[1, 4], ROWS=4, UNROLL=1, HEAD_TILE=1, MERGE_WG=64),
    # head dim 256 in half (32 lanes), 16 row slots, 2 keys each: WG 512, the largest here;
    # MERGE_WG 256 with 3 splits (most merge work-items hold the empty-state sentinel)
    D("contig-d256-rows16-wg512-f16", b=1, h_q=2, h_kv=1, dk=256, dv=256, n_max=45, lens=None,
      dtype="float16", splits=[1, 3], ROWS=16, UNROLL=2, HEAD_TILE=2, MERGE_WG=256),
    # block_size 4, MQA-like group 2 staged, many more splits than keys (64 splits, 10 keys)
    D("paged-bs4-splits64-f32", b=1, h_q=2, h_kv=1, lens=[10], block_size=4, dtype="float32",
      splits=[64], ROWS=1, UNROLL=1, HEAD_TILE=1, MERGE_WG=32),
    # decode_mma.cl with its warp instructions emulated through local memory (barriers inside
    # every MMA and shuffle, 4 warps): GQA 20 = two work-groups per KV head, the second with 4
    # real rows of 16; DK != DV; a 1-key sequence and one of 40 keys in a 64-key round
    D("mma-emulated-gqa20-f16", b=2, h_q=20, h_kv=1, dk=32, dv=64, lens=[1, 40], block_size=16,
      dtype="float16", splits=[1, 3], tensor_cores="emulate", ROWS=2, UNROLL=1, HEAD_TILE=20,
      MERGE_WG=32),
    # decode_cpu.cl (one work-item a work-group): block_size 1, GQA 4, contexts 0, 1 and a partial
    # 4-key step, 16 splits > every sequence's steps
    D("rows-paged-bs1-gqa4-f32", b=3, h_q=8, h_kv=2, lens=[0, 1, 9], block_size=1, dtype="float32",
      splits=[1, 3, 16], VARIANT="rows", BLOCK_N=4, VEC=8, MERGE_WG=16),
    # decode_cpu.cl in half, DK != DV, N_max 37 not a multiple of the 5-key step; 8-wide vectors,
    # and 16-wide ones with the race and API checks only (NO_UNINIT_CHECK_VEC16: its float16
    # products trip the false positive above, which the 8-wide build of the same case does not)
    D("rows-contig-mha-vec8-f16", b=2, h_q=2, h_kv=2, dk=64, dv=32, n_max=37, lens=None,
      dtype="float16", splits=[1, 5], VARIANT="rows", BLOCK_N=5, VEC=8, MERGE_WG=32),
    D("rows-contig-mha-vec16-f16", b=2, h_q=2, h_kv=2, dk=64, dv=32, n_max=37, lens=None,
      dtype="float16", splits=[1, 5], VARIANT="rows", BLOCK_N=5, VEC=16, MERGE_WG=32,
      env=NO_UNINIT_CHECK_VEC16),
    # decode_cpu.cl's group tiles: GQA groups of 49 heads as 25 + 24 (a padding head), 2 KV heads
    D("rows-paged-gqa49-tiles-f32", b=2, h_q=98, h_kv=2, dk=16, dv=16, lens=[5, 20], block_size=4,
      dtype="float32", splits=[1, 3], VARIANT="rows", BLOCK_N=4, VEC=4, MERGE_WG=16),
]


def H(name, call, **kwargs):
    return pytest.param({"kernel": "hardening", "call": call, "kwargs": kwargs}, id=name)


# Checks of test_hardening_kernels.py (poison: a key of its POISONS; decode paths: its DECODE_PATHS,
# whose params want a GQA group of 4).
HARDENING_CASES = [
    # prefill, both layouts, the diagonal crossing two KV tiles per query block; chunked causal
    # (N_q < N_kv) with NaN and square causal with inf past each batch entry's cut
    H("prefill-rows-poisoned-chunked-causal", "check_prefill_poisoned", n_q=6, n_kv=11, causal=True,
      dtype="float32", poison="nan", d=16, h_q=1, pad=2,
      params=dict(BLOCK_M=8, BLOCK_N=4, DV_TILE=8, VEC=4)),
    H("prefill-tiles-poisoned-causal-f16", "check_prefill_poisoned", n_q=9, n_kv=9, causal=True,
      dtype="float16", poison="inf", d=16, h_q=1, pad=2,
      params=dict(VARIANT="tiles", BLOCK_M=8, BLOCK_N=4, DV_TILE=8, TILE_M=2, TILE_N=2)),
    # decode on device tables holding every class of bad value: decode.cl direct loads (paged),
    # decode_cpu.cl (paged), the staged tile (contiguous: bad context lengths only), decode_mma.cl
    # emulated (paged)
    H("decode-bad-tables-direct-paged", "check_bad_device_tables", path="direct-f32", layout="paged",
      splits=[1, 2], public_api=False, h_q=4, h_kv=1, d=32, block_size=4, n=10),
    H("decode-bad-tables-rows-paged", "check_bad_device_tables", path="rows-f32", layout="paged",
      splits=[1, 2], public_api=False, h_q=4, h_kv=1, d=32, block_size=4, n=10),
    H("decode-bad-tables-staged-contig", "check_bad_device_tables", path="staged-f16",
      layout="contiguous", splits=[1, 2], public_api=False, h_q=4, h_kv=1, d=32, block_size=4, n=10),
    # (one split: its 64-key rounds hold every sequence here, a second split would be empty)
    H("decode-bad-tables-mma-emulated-paged", "check_bad_device_tables", path="mma-f16",
      layout="paged", splits=[1], public_api=False, h_q=4, h_kv=1, d=64, block_size=4, n=10),
]


def B(name, check, **kwargs):
    return pytest.param({"kernel": "bfloat16", "call": check, "kwargs": kwargs}, id=name)


# test_bfloat16_opencl.py's checks on small shapes: each kernel's bfloat16 loads and rounded stores
BFLOAT16_CASES = [
    B("bf16-prefill-rows-causal", "check_prefill", layout="rows", causal=True, n_q=9, n_kv=20, dk=32, dv=16),
    B("bf16-prefill-tiles", "check_prefill", layout="tiles", causal=False, n_q=9, n_kv=20, dk=32, dv=32),
    B("bf16-decode-lanes-paged-split", "check_decode", kernel="decode.cl", paged=True, splits=3, n=40, dk=32,
      dv=16),
    B("bf16-decode-rows-paged-split", "check_decode", kernel="decode_cpu.cl", paged=True, splits=3, n=40,
      dk=32, dv=16),
    # decode_mma.cl emulated: the bf16 MMA's two P parts, GQA 20 (two work-groups per KV head), DK != DV
    B("bf16-decode-mma-emulated", "check_tensor_core_kernel", h_q=20, h_kv=1, dk=32, dv=64, fused=False,
      lens=[1, 40], splits=[1, 3]),
    # (not the few-row route: its default decode_cpu.cl tile is VEC=16, NO_UNINIT_CHECK_VEC16's case)
    B("bf16-q4_0-prefill-and-decodes", "check_quantized", fmt="q4_0", n=40, n_q=3, layouts=["rows"]),
]


# --------------------------------------------------------------------------- subprocess worker

def keep_decode_workspaces() -> None:
    """Never release a split-k workspace in this (short-lived, Oclgrind) process. Oclgrind 21.10's
    uninitialized-value tracking goes stale when a buffer is released and a new one reuses its
    slot: in a process that already ran a split-k decode, the next decode's merge reports
    "Controlflow depends on uninitialized value" on every part_m / part_acc read, although the
    split kernel wrote them (each split count alone is clean; the same sequence on PoCL with the
    workspace NaN-poisoned is exact; filling the new workspace first does not help; keeping the
    old one alive does)."""
    from flashcl.opencl.decode import DecodeKernel

    workspace, kept = DecodeKernel.workspace, []

    def workspace_kept_alive(self, num_splits):
        ws = workspace(self, num_splits)
        kept.append(ws)
        return ws

    DecodeKernel.workspace = workspace_kept_alive


def _worker(spec_json: str) -> None:
    """Run one case on the Oclgrind device (in a subprocess started by ``_run_case``)."""
    import numpy as np
    import pyopencl.characterize

    # PyOpenCL probes CL_DEVICE_COMPUTE_CAPABILITY_MAJOR_NV on every build (to know whether the
    # driver caches builds itself); Oclgrind's API checker rightly reports that NVIDIA-only query
    # as CL_INVALID_VALUE. Answer it here so that every API report left is flashcl's own.
    pyopencl.characterize.nv_compute_capability = lambda dev: None

    from tests import test_decode_opencl as dec
    from tests import test_prefill_opencl as pre

    keep_decode_workspaces()
    spec = json.loads(spec_json)
    rng = np.random.default_rng(zlib.crc32(spec_json.encode()))  # same data every run
    if spec["kernel"] == "hardening":
        from tests import test_hardening_kernels as hard

        kwargs = dict(spec["kwargs"])
        if "poison" in kwargs:
            kwargs["poison"] = hard.POISONS[kwargs["poison"]]
        getattr(hard, spec["call"])("oclgrind", **kwargs)
    elif spec["kernel"] == "bfloat16":
        from tests import test_bfloat16_opencl as bf

        getattr(bf, spec["call"])("oclgrind", **spec["kwargs"])
    elif spec["kernel"] == "prefill":
        b, h_q, h_kv, n_q, n_kv, dk, dv = spec["shape"]
        q, k, v = pre._inputs(rng, b, h_q, h_kv, n_q, n_kv, dk, dv, spec["dtype"])
        pre.check("oclgrind", q, k, v, spec["causal"], spec["params"], what="oclgrind")
    else:
        b, h_q, h_kv = spec["heads"]
        dk, dv = spec["dims"]
        if spec["block_size"] is not None:
            q, k, v, table, lens = dec._paged(rng, b, h_q, h_kv, dk, dv, spec["lens"],
                                              spec["block_size"], spec["dtype"])
        else:
            q, k, v = dec._contiguous(rng, b, h_q, h_kv, dk, dv, spec["n_max"], spec["dtype"])
            table = None
            lens = None if spec["lens"] is None else np.asarray(spec["lens"], dtype=np.int32)
        for s in spec["splits"]:
            dec.check("oclgrind", q, k, v, table, lens, s, spec["params"], what="oclgrind",
                      tensor_cores=spec["tensor_cores"])
    print("OCLGRIND-CASE-OK")


def run_under_oclgrind(worker: str, arg: str, what: str, tmp_path, env: dict | None = None) -> None:
    """Run ``worker`` ("tests.module:function", called with ``arg``) in a child process whose only
    OpenCL platform is Oclgrind with its checks on; any Oclgrind report, or a worker that does not
    print OCLGRIND-CASE-OK, fails the calling test."""
    module, func = worker.split(":")
    log = tmp_path / "oclgrind.log"
    env = {**os.environ, **OCLGRIND_ENV, **(env or {}), "OCLGRIND_LOG": str(log),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    code = f"import sys; from {module} import {func}; {func}(sys.argv[1])"
    proc = subprocess.run([sys.executable, "-c", code, arg], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=CASE_TIMEOUT_S)
    report = log.read_text() if log.exists() else ""
    assert not report.strip(), f"Oclgrind reported on {what}:\n{report[:6000]}"
    assert "oclgrind" not in proc.stderr.lower(), f"Oclgrind reported on {what} (stderr):\n{proc.stderr[-6000:]}"
    assert proc.returncode == 0 and "OCLGRIND-CASE-OK" in proc.stdout, (
        f"{what} failed under Oclgrind (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")


def _run_case(spec: dict, tmp_path) -> None:
    run_under_oclgrind("tests.test_oclgrind:_worker", json.dumps(spec), f"{spec['kernel']} {spec}", tmp_path,
                       spec.get("env", {}))


@pytest.mark.slow
@pytest.mark.parametrize("spec", PREFILL_CASES)
def test_prefill_under_oclgrind(spec, tmp_path):
    _run_case(spec, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("spec", DECODE_CASES)
def test_decode_under_oclgrind(spec, tmp_path):
    _run_case(spec, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("spec", HARDENING_CASES)
def test_hardening_under_oclgrind(spec, tmp_path):
    _run_case(spec, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("spec", BFLOAT16_CASES)
def test_bfloat16_under_oclgrind(spec, tmp_path):
    _run_case(spec, tmp_path)


def _run_snippet(tmp_path, src: str, launch: str) -> str:
    """Build ``src`` on Oclgrind in a subprocess, run ``launch`` (Python using ``q``, ``prg``,
    ``np``, ``cla``) and return what Oclgrind reported (log file and stderr); the subprocess
    itself must succeed."""
    code = ("import sys, numpy as np, pyopencl as cl, pyopencl.array as cla\n"
            "import pyopencl.characterize as ch; ch.nv_compute_capability = lambda d: None\n"
            "d = [p for p in cl.get_platforms() if 'oclgrind' in p.name.lower()][0].get_devices()[0]\n"
            "ctx = cl.Context([d]); q = cl.CommandQueue(ctx)\n"
            "prg = cl.Program(ctx, sys.argv[1]).build()\n" + launch)
    log = tmp_path / "oclgrind.log"
    env = dict(os.environ, **OCLGRIND_ENV, OCLGRIND_LOG=str(log))
    proc = subprocess.run([sys.executable, "-c", code, src], env=env, capture_output=True,
                          text=True, timeout=CASE_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr
    return (log.read_text() if log.exists() else "") + proc.stderr


def test_a_race_is_reported(tmp_path):
    """The harness itself: a kernel with a real local-memory race (a missing barrier) is reported
    in the log, so a silent or misconfigured Oclgrind cannot pass the cases above."""
    src = r"""
    __kernel void racy(__global float *out) {
        __local float t[64];
        const int i = get_local_id(0);
        t[i] = i;                                /* no barrier: the read below races */
        out[i] = t[(i + 1) % 64];
    }"""
    log = _run_snippet(tmp_path, src, "out = cla.empty(q, (64,), np.float32)\n"
                                      "prg.racy(q, (64,), (64,), out.data); q.finish()\n")
    assert "data race" in log.lower(), f"no race reported:\n{log}"


def test_fmax_of_float16_upper_half_false_positive(tmp_path):
    """Documents why VEC=16 prefill runs without the uninitialized-value check (see
    NO_UNINIT_CHECK_VEC16). If this starts failing, Oclgrind fixed it: drop the exemption."""
    src = r"""
    __kernel void upper(__global float *out, __global const float *in) {
        const float16 x = vload16(0, in);            /* all 16 lanes initialized */
        const float4 y = fmax(x.s89ab, x.s89ab);
        out[0] = (y.s0 > 0.0f) ? 1.0f : 2.0f;
    }"""
    log = _run_snippet(tmp_path, src, "x = cla.to_device(q, np.ones(16, np.float32)); "
                                      "out = cla.empty(q, (1,), np.float32)\n"
                                      "prg.upper(q, (1,), (1,), out.data, x.data); q.finish()\n")
    assert "uninitialized" in log.lower(), "Oclgrind no longer reports fmax(x.s89ab): drop NO_UNINIT_CHECK_VEC16"


def test_cases_fit_default_oclgrind_limits():
    """Every case is valid for Oclgrind's default device (32 KiB local memory, work-groups up to
    1024) by flashcl's own model: the raised OCLGRIND_LOCAL_MEM_SIZE only absorbs Oclgrind's
    program-wide accounting."""
    from flashcl import tuning
    from flashcl.opencl import decode as cl_decode

    for case in PREFILL_CASES:
        spec = case.values[0]
        *_, dk, dv = spec["shape"]
        assert not tuning.check_params("prefill", spec["params"], dk, dv, local_mem=32768,
                                       max_work_group=1024), case.id
    for case in DECODE_CASES:
        spec = case.values[0]
        b, h_q, h_kv = spec["heads"]
        assert not cl_decode.check_params(spec["params"], h_q // h_kv, *spec["dims"], spec["dtype"],
                                          local_mem=32768, max_work_group=1024), case.id
    from tests.test_hardening_kernels import DECODE_PATHS

    for case in HARDENING_CASES:
        kw = case.values[0]["kwargs"]
        if "params" in kw:
            assert not tuning.check_params("prefill", kw["params"], kw["d"], kw["d"], local_mem=32768,
                                           max_work_group=1024), case.id
        elif DECODE_PATHS[kw["path"]][0] is not None:
            params, _, dtype = DECODE_PATHS[kw["path"]]
            assert not cl_decode.check_params(params, kw["h_q"] // kw["h_kv"], kw["d"], kw["d"], dtype,
                                              local_mem=32768, max_work_group=1024), case.id
