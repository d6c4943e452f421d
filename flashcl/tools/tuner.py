"""``flashcl tune``: sweep a kernel's tiles on a device and store the winner.

Both kernels go through their tuning space (``tuning.SPACES``: parameters, constraints, the
register model). For every configuration that satisfies the named constraints:

1. **build** it (a failed build is recorded and the sweep goes on);
2. read the **spill signals**, strongest first: the vendor compiler's report (NVIDIA
   ``-cl-nv-verbose`` ptxas spill stores/loads and registers; Intel's spill size), then
   ``CL_KERNEL_PRIVATE_MEM_SIZE`` (Adreno, NVIDIA), then a kernel ``CL_KERNEL_WORK_GROUP_SIZE``
   below the configuration's work-group, then the profile's register model (the space's
   ``private_floats`` against ``regs_hard``);
3. check it against the float64 oracle on a small problem that crosses every tile edge (a wrong
   configuration is marked and never chosen);
4. **time** it on the tuning problem with profiling events (a warm-up, then ``repeats`` >= 5
   runs, the median); the fastest few are re-timed, interleaved, to beat noise.

The result names both the largest non-spilling tile (by the space's ``rank``) and the fastest
configuration (a spilling one may win; the report says so), and the winner goes into the tuning
database with its provenance (device, driver, flashcl version, date). ``flashcl.prefill`` and
``flashcl.decode`` read it on the next call on that device.

**Decode.** The tuning problem is a paged cache (block size 16, a random block table), every
sequence ``ctx`` keys long; a configuration is timed from the decode kernel's start to the merge
kernel's end at the split count the split rule gives it. The split rule's constants (SPLIT_WAVES,
SPLIT_KEYS) are host parameters: a configuration's tiles are built once and timed at each
distinct split count the candidate constants give on this device and problem, the constants
nearest the defaults standing for each count (one problem cannot tell the others apart). Where
decode_mma.cl runs (NVIDIA sm_80+, fp16 and bf16), ROWS, UNROLL and HEAD_TILE do not apply and stay at the
default; MERGE_WG and the split rule are swept.

**Model mode.** When the named device is not attached (``--device adreno`` on a laptop or in
CI), the profile stands in for it: every configuration is still built, and checked, with the
OpenCL compiler at hand (the PoCL CPU device), so compile errors surface; the spill verdict,
local memory and work-group limits come from the profile; the largest tile predicted not to
spill wins, and the entry is stored as *modeled* under the profile, where a later measured entry
for a real device of that profile replaces it. Nothing is timed, so the split rule keeps its
defaults.

**Robustness.** Each configuration's build and launches run in a worker process with a timeout,
so a driver crash or hang costs one configuration, not the sweep (``isolate=False`` runs them in
this process). Ahead of it, one builder process per host core compiles the configurations (no
timing), so the worker's builds come from the program caches; a builder's crash costs only a prebuild. Every result is appended to a resume file as it arrives; Ctrl-C keeps them and
``resume=True`` continues the sweep.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import json
import math
import multiprocessing
import os
import queue
import re
import signal
import statistics
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .. import tuning
from .._version import __version__
from ..profiles import DeviceProfile, find_profile
from ..reference import TOLERANCE

CHECK_N = 261        # the correctness problem: N not a multiple of any tile, > the largest BLOCK_M
MIN_REPEATS = 5
BLOCK_SIZE = 16      # decode's paged cache, as the reference shapes use


class TunerError(RuntimeError):
    """A tuning run cannot start: no usable device, compiler or worker (the CLI exits 3)."""


# --------------------------------------------------------------------------- target device

@dataclass
class Target:
    """What is tuned for (profile, database key, limits) and which OpenCL device does the work."""

    profile: DeviceProfile
    key: tuning.DeviceKey
    mode: str                # "measured": the device is attached; "modeled": the profile stands in
    device_spec: str         # "P:D" of the OpenCL device that builds (and, measured, runs) the kernels
    device_desc: str
    driver: str
    local_mem: int
    max_work_group: int
    is_nvidia: bool
    compute_units: int = 0   # measured only: the split rule's device size

    @property
    def name(self) -> str:
        return self.key.name or f"{self.profile.name} (profile)"

    @property
    def mma(self) -> bool:
        """NVIDIA sm_80+: decode_mma.cl can run here."""
        m = re.fullmatch(r"nvidia-sm(\d+)\d", self.key.arch or "")
        return bool(m) and int(m.group(1)) >= 8

    def describe(self) -> str:
        if self.mode == "modeled":
            return (f"model mode: no {self.profile.name} device attached; spill verdicts from the "
                    f"{self.profile.name} profile's register model (hard {self.profile.regs_hard}, budget "
                    f"{self.profile.regs_budget} regs/work-item), limits from the profile, kernels built "
                    f"and checked on {self.device_desc}; the entry is stored as modeled")
        return f"measured on {self.device_desc}"


def _family(name: str) -> str:
    return name.split("-")[0]


def resolve_target(spec: str | None, *, require_device: bool = False) -> Target:
    """``spec`` as in ``flashcl.prefill(device=...)``. A profile name with no such device attached
    gives model mode (or, with ``require_device``, an error)."""
    from ..opencl.runtime import get_device, list_devices

    try:
        rows = list_devices(include_oclgrind=False)
    except RuntimeError as exc:
        raise TunerError(f"{exc}") from None
    prof = find_profile(spec) if spec else None
    if prof is None:
        try:
            handle = get_device(spec)
        except (ValueError, RuntimeError) as exc:
            raise TunerError(f"{exc}. Run `flashcl devices` to list devices; a profile name "
                             f"({', '.join(_profile_names())}) without its device runs in model mode") from None
        return _measured(handle)
    want = spec.strip().lower()
    for r in rows:  # an attached device of that profile (a bare family name matches its variants)
        if r["profile"] == prof.name or ("-" not in want and _family(r["profile"]) == _family(prof.name)):
            return _measured(get_device(r["id"]))
    if require_device:
        raise TunerError(f"--device {spec}: no {prof.name} device is attached (have: "
                         f"{', '.join(r['device'] for r in rows) or 'none'}); drop --require-device "
                         f"to tune in model mode")
    if not rows:
        raise TunerError("model mode needs an OpenCL compiler and none is installed; "
                         "pip install 'flashcl[pocl]'")
    compiler = next((r for r in rows if "CPU" in r["type"] and r["compiles"]),
                    next((r for r in rows if r["compiles"]), rows[0]))
    h = get_device(compiler["id"])
    return Target(prof, tuning.DeviceKey.modeled(prof), "modeled", compiler["id"],
                  f"{h.describe()} as the compiler", h.driver, prof.local_mem, prof.max_work_group,
                  h.is_nvidia)


def _measured(handle) -> Target:
    key = tuning.DeviceKey.for_device(handle.device, handle.profile.name)
    from ..opencl.runtime import list_devices

    spec = next((r["id"] for r in list_devices() if r["device"] == handle.name
                 and r["platform"] == handle.platform), None)
    if spec is None:
        raise TunerError(f"cannot address {handle.describe()} by index")
    return Target(handle.profile, key, "measured", spec, handle.describe(), handle.driver,
                  handle.local_mem, handle.max_work_group, handle.is_nvidia,
                  int(handle.device.max_compute_units))


def _profile_names():
    from ..profiles import PROFILES

    return list(PROFILES)


# --------------------------------------------------------------------------- what each kernel is tuned on

class PrefillWorkload:
    """Prefill: shape (B, H_q, H_kv, N, d, causal), N_q = N_kv = N, DK = DV = d."""

    kernel = "prefill"
    fields = "B,H_q,H_kv,N,d,causal"
    # the GQA reference shape on GPUs; on CPU devices a problem a 2-core machine times in tens of
    # milliseconds per configuration
    gpu_problem = (1, 32, 8, 2048, 128, True)
    cpu_problem = (1, 8, 2, 512, 128, True)
    cpu_quick_problem = (1, 4, 2, 256, 64, True)
    rate_unit, rate_key = "GFLOP/s", "gflops"
    plot_axes = ("BLOCK_M", "DV_TILE", "BLOCK_N")   # x, y, one panel per value

    def axes(self, results) -> tuple:
        return self.plot_axes

    def dims(self, shape, dtype: str) -> tuning.Dims:
        return tuning.Dims(shape[4], shape[4], 1, dtype)

    def n(self, shape) -> int:
        return shape[3]

    def causal(self, shape) -> bool:
        return bool(shape[5])

    def group(self, shape):
        return None

    def text(self, shape) -> str:
        b, h_q, h_kv, n, d, causal = shape
        return f"B={b} H_q={h_q} H_kv={h_kv} N={n} d={d} {'causal' if causal else 'non-causal'}"

    def rate(self, shape, dtype: str, ms: float) -> float:
        return _prefill_problem(shape, dtype).flops / (ms * 1e-3) / 1e9

    def header(self) -> str:
        return f"{'BLOCK_M':>7} {'BLOCK_N':>7} {'DV_TILE':>7} {'layout':>12}  "

    def columns(self, r) -> str:
        p = r.params
        return f"{p['BLOCK_M']:7d} {p['BLOCK_N']:7d} {p['DV_TILE']:7d} {_layout(p):>12}  "

    def label(self, p: dict) -> str:
        head = f"BLOCK_M={p['BLOCK_M']} BLOCK_N={p['BLOCK_N']} DV_TILE={p['DV_TILE']}"
        if tuning.variant_of(p) == "tiles":
            return f"tiles {head} TILE_M={p['TILE_M']} TILE_N={p['TILE_N']} UNROLL_K={p.get('UNROLL_K', 0)}"
        return f"{head} VEC={p['VEC']} Q_IN_REGS={p.get('Q_IN_REGS', 1)}"


class DecodeWorkload:
    """Decode: shape (B, H_q, H_kv, ctx, d), DK = DV = d, every sequence ctx keys long."""

    kernel = "decode"
    fields = "B,H_q,H_kv,ctx,d"
    # the (8, 32/8, 2k) reference shape on GPUs; on CPUs contexts long enough to split in two
    gpu_problem = (8, 32, 8, 2048, 128)
    cpu_problem = (2, 8, 2, 1024, 64)
    cpu_quick_problem = (1, 4, 2, 512, 64)
    rate_unit, rate_key = "GB/s", "gbps"
    plot_axes = ("ROWS", "UNROLL", "HEAD_TILE")
    rows_plot_axes = ("BLOCK_N", "VEC", "MERGE_WG")  # decode_cpu.cl's sweeps (CPUs)

    def axes(self, results) -> tuple:
        """The plot axes of a sweep: decode_cpu.cl's where every configuration is of that layout."""
        rows = results and all(tuning.is_rows(r.params) for r in results)
        return self.rows_plot_axes if rows else self.plot_axes

    def dims(self, shape, dtype: str) -> tuning.Dims:
        return tuning.Dims(shape[4], shape[4], shape[1] // shape[2], dtype)

    def n(self, shape) -> int:
        return shape[3]

    def causal(self, shape) -> bool:
        return False

    def group(self, shape) -> int:
        return shape[1] // shape[2]

    def text(self, shape) -> str:
        b, h_q, h_kv, ctx, d = shape
        return f"B={b} H_q={h_q} H_kv={h_kv} ctx={ctx} d={d}"

    def rate(self, shape, dtype: str, ms: float) -> float:
        b, h_q, h_kv, ctx, d = shape
        return _decode_problem(shape, dtype).bytes_moved(b * ctx) / (ms * 1e-3) / 1e9

    def header(self) -> str:
        return f"{'layout':>6} {'tile':>14} {'MERGE_WG':>8} {'waves':>5} {'keys':>5} {'splits':>6}  "

    def columns(self, r) -> str:
        p = r.params
        if tuning.is_rows(p):
            layout, tile = "rows", f"B{p['BLOCK_N']} v{p['VEC']}"
        else:
            layout, tile = "lanes", f"R{p['ROWS']} U{p['UNROLL']} T{p['HEAD_TILE']}"
        return (f"{layout:>6} {tile:>14} {p['MERGE_WG']:8d} "
                f"{_fmt(p.get('SPLIT_WAVES'), '5d'):>5} {_fmt(p.get('SPLIT_KEYS'), '5d'):>5} "
                f"{_fmt(r.info.get('num_splits'), '6d'):>6}  ")

    def label(self, p: dict) -> str:
        split = "".join(f" {k}={p[k]}" for k in ("SPLIT_WAVES", "SPLIT_KEYS") if k in p)
        if tuning.is_rows(p):
            return f"rows BLOCK_N={p['BLOCK_N']} VEC={p['VEC']} MERGE_WG={p['MERGE_WG']}{split}"
        return f"ROWS={p['ROWS']} UNROLL={p['UNROLL']} HEAD_TILE={p['HEAD_TILE']} MERGE_WG={p['MERGE_WG']}{split}"


WORKLOADS = {"prefill": PrefillWorkload(), "decode": DecodeWorkload()}


def default_problem(kernel: str, target: Target, quick: bool = False) -> tuple:
    """The kernel's tuning problem for ``target``: the GPU one, or on an attached CPU device a
    small one (smaller still with ``quick``)."""
    wl = WORKLOADS[kernel]
    if target.mode == "measured" and target.profile.name == "cpu":
        return wl.cpu_quick_problem if quick else wl.cpu_problem
    return wl.gpu_problem


def _prefill_problem(shape, dtype: str):
    from ..opencl.prefill import PrefillProblem

    b, h_q, h_kv, n, d, causal = shape
    return PrefillProblem(b, h_q, h_kv, n, n, d, d, bool(causal), dtype)


def _decode_problem(shape, dtype: str, *, b: int | None = None, h_kv: int | None = None):
    from ..opencl.decode import DecodeProblem

    b0, h_q, h_kv0, ctx, d = shape
    b, h_kv = b or b0, h_kv or h_kv0
    return DecodeProblem(b, h_kv * (h_q // h_kv0), h_kv, d, d, True, dtype)


def decode_splits(compute_units: int, shape, params: dict, tensor_cores: bool) -> int:
    """The split count the split rule gives ``params`` on the tuning problem."""
    from ..opencl import decode as cd

    b, h_q, h_kv, ctx, d = shape
    heads = b * h_kv * cd.head_tiles(h_q // h_kv, tensor_cores, cd.is_rows(params))
    return cd.choose_num_splits(compute_units, heads, ctx, params=params, **cd.split_defaults(params, tensor_cores))


# --------------------------------------------------------------------------- one configuration

@dataclass
class Setup:
    """Everything a worker needs to evaluate configurations (picklable)."""

    device_spec: str
    shape: tuple
    dtype: str
    mode: str
    repeats: int
    verbose: bool
    extra_options: tuple = ()
    seed: int = 0
    kernel: str = "prefill"


class Evaluator:
    """Builds, checks and times configurations on one device; lives in the worker process. A
    kernel's evaluator provides ``_kernel``, ``_check`` (the relative error on the small problem,
    inf when an output is not finite) and ``_run`` (one timed launch on the tuning problem)."""

    def __init__(self, setup: Setup, build_only: bool = False):
        import numpy as np

        from ..opencl.runtime import get_device

        self.s = setup
        self.h = get_device(setup.device_spec)
        self.rng = np.random.default_rng(setup.seed)
        self.kernels = {}
        self.prob, self.small = self._problems()
        if not build_only:  # a pre-build process needs neither inputs nor the oracle
            self._prepare()

    def _rand(self, *shape):
        import numpy as np

        return self.rng.standard_normal(shape).astype(np.dtype(self.s.dtype))

    def _spills(self, kern) -> dict:
        return kern.spills()

    def _cl_kernel(self, kern):
        return kern.kernel

    def _build_small(self, params: dict, res: dict):
        """The check problem's kernel, or None with the failure recorded in ``res``."""
        from ..errors import FlashCLError

        try:
            return self._kernel(self.small, params)
        except FlashCLError as exc:
            res.update(status="failed", error=_first_lines(str(exc)))
        except ValueError as exc:  # the built kernel's work-group limit is below the configuration's
            res.update(status="failed", error=str(exc))
            m = re.search(r"(?:max work-group size|the kernel allows) (\d+)", str(exc))
            if m:
                res["info"]["kernel_max_work_group"] = int(m.group(1))
        return None

    def prebuild(self, params: dict) -> dict:
        """Build (no check, no timing) what ``evaluate`` will build, so that its builds hit the
        program caches; a failed check-problem build is the configuration's final result."""
        from ..errors import FlashCLError

        res = {"params": dict(params), "status": "ok", "error": "", "info": {}, "times_ms": []}
        if self._build_small(params, res) is not None and self.s.mode == "measured":
            with contextlib.suppress(FlashCLError, ValueError):  # evaluate records it after the check
                self._kernel(self.prob, params)
        return res

    def evaluate(self, params: dict) -> dict:
        from ..errors import FlashCLError

        res = {"params": dict(params), "status": "ok", "error": "", "info": {}, "times_ms": []}
        t0 = time.perf_counter()
        kern = self._build_small(params, res)
        if kern is None:
            return res
        res["build_s"] = time.perf_counter() - t0
        res["info"] = self._spills(kern)
        res["info"].update(_intel_spill(self._cl_kernel(kern), self.h))
        try:
            err = self._check(kern)
        except FlashCLError as exc:
            res.update(status="failed", error=_first_lines(str(exc)))
            return res
        if not math.isfinite(err):
            res.update(status="wrong", rel_err=float("inf"), error="non-finite output")
            return res
        res["rel_err"] = err
        if err > TOLERANCE[self.s.dtype]:
            res.update(status="wrong", error=f"relative error {err:.2e} > {TOLERANCE[self.s.dtype]:g}")
            return res
        if self.s.mode == "measured":
            try:
                big = self._kernel(self.prob, params)
                self.kernels[_key(params)] = big
                res["info"].update(self._run_info(big, params))
                res["times_ms"] = self._time(big, params, self.s.repeats)
            except FlashCLError as exc:
                res.update(status="failed", error=_first_lines(str(exc)))
        return res

    def _run_info(self, kern, params) -> dict:
        return {}

    def _time(self, kern, params, repeats: int) -> list[float]:
        from ..opencl.runtime import event_times  # lazily, like every OpenCL import here

        return event_times(lambda i: self._run(kern, params), repeats)

    def retime(self, configs: list[dict], repeats: int) -> list[list[float]]:
        """Interleaved re-timing (round robin) so drift in clocks or load hits all alike."""
        kerns = [self.kernels.get(_key(p)) or self._kernel(self.prob, p) for p in configs]
        for kern, p in zip(kerns, configs):
            self._time(kern, p, 0)
        times = [[] for _ in kerns]
        for _ in range(repeats):
            for i, (kern, p) in enumerate(zip(kerns, configs)):
                times[i] += self._time(kern, p, 1)[-1:]
        return times


class PrefillEvaluator(Evaluator):
    def _problems(self):
        b, h_q, h_kv, n, d, causal = self.s.shape
        return (_prefill_problem(self.s.shape, self.s.dtype),
                _prefill_problem((1, 2, 1, CHECK_N, d, causal), self.s.dtype))

    def _prepare(self):
        import numpy as np
        import pyopencl.array as cla

        from .. import reference

        b, h_q, h_kv, n, d, causal = self.s.shape
        q, k, v = self._rand(1, 2, CHECK_N, d), self._rand(1, 1, CHECK_N, d), self._rand(1, 1, CHECK_N, d)
        self.scale = 1.0 / math.sqrt(d)
        self.ref = reference.attention(q, k, v, causal=bool(causal), scale=self.scale)
        queue = self.h.queue
        self.small_io = [cla.to_device(queue, x) for x in (q, k, v)]
        self.small_out = cla.empty(queue, (1, 2, CHECK_N, d), np.dtype(self.s.dtype))
        self.poison = np.full(self.small_out.shape, np.nan, np.dtype(self.s.dtype))
        if self.s.mode == "measured":
            self.big_io = [cla.to_device(queue, self._rand(b, h_q, n, d)),
                           cla.to_device(queue, self._rand(b, h_kv, n, d)),
                           cla.to_device(queue, self._rand(b, h_kv, n, d))]
            self.big_out = cla.empty(queue, (b, h_q, n, d), np.dtype(self.s.dtype))

    def _kernel(self, prob, params):
        from ..opencl.prefill import PrefillKernel

        return PrefillKernel(self.h, prob, params, write_lse=False, verbose=self.s.verbose,
                             extra_options=self.s.extra_options)

    def _check(self, kern) -> float:
        from .. import reference

        # from the host, output poisoned so unwritten elements fail (Array.fill builds a kernel,
        # which takes no half without cl_khr_fp16)
        self.small_out.set(self.poison)
        kern(*self.small_io, self.small_out, None, self.scale).wait()
        got = self.small_out.get()
        return reference.rel_err(got, self.ref) if _finite(got) else float("inf")

    def _run(self, kern, params):
        q, k, v = self.big_io
        return kern(q, k, v, self.big_out, None, self.scale)


class DecodeEvaluator(Evaluator):
    """The check: B=2, contexts CHECK_N and 100 in a paged cache whose blocks are permuted, with
    spare blocks, the tuning problem's GQA group; single pass and 3 splits (the merge kernel)."""

    def _problems(self):
        return (_decode_problem(self.s.shape, self.s.dtype),
                _decode_problem(self.s.shape, self.s.dtype, b=2, h_kv=1))

    def _prepare(self):
        import numpy as np
        import pyopencl.array as cla

        from .. import reference

        b, h_q, h_kv, ctx, d = self.s.shape
        dt = np.dtype(self.s.dtype)
        queue = self.h.queue
        g = self.small.h_q
        lens = np.array([CHECK_N, 100], np.int32)
        per_seq = -(-CHECK_N // BLOCK_SIZE)
        num_blocks = 2 * per_seq + 3
        table = self.rng.permutation(num_blocks)[: 2 * per_seq].reshape(2, per_seq).astype(np.int32)
        q = self._rand(2, g, d)
        k, v = self._rand(num_blocks, BLOCK_SIZE, 1, d), self._rand(num_blocks, BLOCK_SIZE, 1, d)
        self.scale = 1.0 / math.sqrt(d)
        self.ref = reference.decode_attention(q, k, v, block_table=table, context_lens=lens, scale=self.scale)
        self.small_io = [cla.to_device(queue, x) for x in (q, k, v)]
        self.small_tables = [cla.to_device(queue, x) for x in (table, lens)]
        self.small_out = cla.empty(queue, (2, g, d), dt)
        self.small_lse = cla.empty(queue, (2, g), np.float32)
        self.poison = np.full(self.small_out.shape, np.nan, dt)
        self.compute_units = int(self.h.device.max_compute_units)
        if self.s.mode == "measured":
            blocks = -(-ctx // BLOCK_SIZE)
            big_table = self.rng.permutation(b * blocks).astype(np.int32).reshape(b, blocks)
            self.big_io = [cla.to_device(queue, x) for x in (
                self._rand(b, h_q, d), self._rand(b * blocks, BLOCK_SIZE, h_kv, d),
                self._rand(b * blocks, BLOCK_SIZE, h_kv, d))]
            self.big_tables = [cla.to_device(queue, x) for x in (big_table, np.full(b, ctx, np.int32))]
            self.big_out = cla.empty(queue, (b, h_q, d), dt)
            self.big_lse = cla.empty(queue, (b, h_q), np.float32)

    def _kernel(self, prob, params):
        from ..opencl.decode import DecodeKernel

        return DecodeKernel(self.h, prob, params, verbose=self.s.verbose, extra_options=self.s.extra_options)

    def _cl_kernel(self, kern):
        return kern.kernels["flash_decode_split"]

    def _spills(self, kern) -> dict:
        """The worst of the decode kernels' signals (both share the tiles); the merge kernel's
        spills count too, its work-group limit is checked when the kernel is built."""
        per = kern.spills()
        info = {}
        for name, k in per.items():
            merge = name == "flash_decode_merge"
            for key in ("spill_stores", "spill_loads", "private_mem") + (() if merge else ("registers",)):
                if key in k:
                    info[key] = max(info.get(key, 0), k[key])
            if not merge and "kernel_max_work_group" in k:
                info["kernel_max_work_group"] = min(info.get("kernel_max_work_group", k["kernel_max_work_group"]),
                                                    k["kernel_max_work_group"])
        return info

    def _check(self, kern) -> float:
        from .. import reference

        worst = 0.0
        for splits in (1, 3):
            self.small_out.set(self.poison)
            for ev in kern(*self.small_io, self.small_out, self.small_lse, *self.small_tables, self.scale, splits):
                ev.wait()
            got = self.small_out.get()
            if not _finite(got):
                return float("inf")
            worst = max(worst, reference.rel_err(got, self.ref))
        return worst

    def _splits(self, kern, params) -> int:
        return decode_splits(self.compute_units, self.s.shape, params, bool(kern.tensor_cores))

    def _run_info(self, kern, params) -> dict:
        return {"num_splits": self._splits(kern, params), "path": kern.path}

    def _run(self, kern, params):
        return kern(*self.big_io, self.big_out, self.big_lse, *self.big_tables, self.scale, self._splits(kern, params))


EVALUATORS = {"prefill": PrefillEvaluator, "decode": DecodeEvaluator}


def make_evaluator(setup: Setup, build_only: bool = False) -> Evaluator:
    return EVALUATORS[setup.kernel](setup, build_only)


def _finite(x) -> bool:
    import numpy as np

    return bool(np.all(np.isfinite(x)))


def _intel_spill(kernel, handle) -> dict:
    """Intel's own spill report: CL_KERNEL_SPILL_MEM_SIZE_INTEL (0x4109), where the driver has it."""
    if "intel" not in handle.platform.lower() or handle.is_cpu:
        return {}
    try:
        return {"intel_spill": int(kernel.get_work_group_info(0x4109, handle.device))}
    except Exception:  # not supported by this driver or this pyopencl
        return {}


def _first_lines(text: str, n: int = 4) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return " | ".join(lines[:n])[:400]


def _key(params: dict) -> str:
    return ",".join(f"{k}={params[k]}" for k in sorted(params))


# --------------------------------------------------------------------------- runners

def _worker_main(conn, setup: Setup, build_only: bool = False):
    import warnings

    import pyopencl

    # Ctrl-C is the parent's to handle (it stops the sweep and kills this worker); and PyOpenCL's
    # CompilerWarning for a non-empty build log would land between the parent's table rows.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    warnings.simplefilter("ignore", pyopencl.CompilerWarning)
    try:
        ev = make_evaluator(setup, build_only)
    except Exception as exc:  # pragma: no cover - reported to the parent
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", None))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, KeyboardInterrupt):
            return
        if msg[0] == "stop":
            return
        try:
            if msg[0] == "build":
                out = ev.prebuild(msg[1])
            else:
                out = ev.evaluate(msg[1]) if msg[0] == "eval" else ev.retime(msg[1], msg[2])
            conn.send(("ok", out))
        except Exception as exc:
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


@contextlib.contextmanager
def _sigint_ignored():
    """A process started in here inherits SIGINT ignored (Python leaves an inherited SIG_IGN in
    place), so a Ctrl-C while it starts up, before _worker_main runs, prints no traceback there."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


class IsolatedRunner:
    """One worker process (spawned, so no OpenCL state is forked); a configuration that hangs
    past ``timeout`` or kills the driver costs that configuration, and a fresh worker goes on."""

    def __init__(self, setup: Setup, timeout: float, build_only: bool = False):
        self.setup, self.timeout, self.build_only = setup, timeout, build_only
        self.ctx = multiprocessing.get_context("spawn")
        self.proc = self.conn = None
        self.ready = False

    def _spawn(self):
        parent, child = self.ctx.Pipe()
        self.proc = self.ctx.Process(target=_worker_main, args=(child, self.setup, self.build_only), daemon=True)
        with _sigint_ignored():
            self.proc.start()
        child.close()
        self.conn = parent

    def _start(self):
        if self.proc is None:
            self._spawn()
        parent = self.conn
        if not parent.poll(max(self.timeout, 60)):
            self.close()
            raise TunerError("the tuning worker did not start within its timeout")
        try:
            kind, payload = parent.recv()
        except (EOFError, OSError):
            kind, payload = "error", f"it died (exit code {self.proc.exitcode})"
        if kind != "ready":
            self.close()
            if str(payload).startswith("MemoryError"):  # the problem's inputs, not the device
                raise MemoryError(f"the tuning worker: {payload}")
            raise TunerError(f"the tuning worker could not open the device: {payload}")
        self.ready = True

    def _call(self, msg, timeout):
        if self.proc is not None and not self.proc.is_alive():
            self.close()
        if not self.ready:
            self._start()
        self.conn.send(msg)
        try:
            ready = self.conn.poll(timeout)
        except (EOFError, OSError):
            ready = True
        if not ready:
            self.close()
            return "timeout", f"no answer within {timeout:.0f} s (driver hang?); worker restarted"
        try:
            return self.conn.recv()
        except (EOFError, OSError):
            code = self.proc.exitcode if self.proc else None
            self.close()
            return "crash", f"the worker died (exit code {code}; driver crash?); worker restarted"

    def evaluate(self, params: dict) -> dict:
        kind, payload = self._call(("eval", params), self.timeout)
        if kind == "ok":
            return payload
        return {"params": dict(params), "status": "failed", "error": f"{kind}: {payload}", "info": {},
                "times_ms": []}

    def retime(self, configs, repeats):
        kind, payload = self._call(("retime", configs, repeats), self.timeout * max(1, len(configs)))
        return payload if kind == "ok" else None

    def close(self):
        if self.proc is not None:
            if self.proc.is_alive():
                try:
                    self.conn.send(("stop",))
                    self.proc.join(2)
                except (OSError, BrokenPipeError):
                    pass
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(5)
        self.proc = self.conn = None
        self.ready = False


class Prebuilder:
    """Builds configurations ahead of the timing worker in ``jobs`` spawned processes (compile
    only), so the compiler runs on every core and the timing worker's builds hit the program
    caches (flashcl's on disk; the driver's own, which NVIDIA's verbose builds still go through).
    A configuration that crashes or hangs a builder loses only its prebuild."""

    def __init__(self, setup: Setup, configs: list, jobs: int, timeout: float):
        self.timeout = timeout
        self.todo = queue.Queue()
        for p in configs:
            self.todo.put(p)
        self.done = {_key(p): threading.Event() for p in configs}
        self.results = {}
        self.stopped = False
        self.runners = [IsolatedRunner(setup, timeout, build_only=True) for _ in range(jobs)]
        for r in self.runners:  # from this thread: a child started here inherits SIGINT ignored
            r._spawn()
        self.threads = [threading.Thread(target=self._serve, args=(r,), daemon=True) for r in self.runners]
        for t in self.threads:
            t.start()

    def _serve(self, runner: IsolatedRunner):
        try:
            while not self.stopped:
                try:
                    p = self.todo.get_nowait()
                except queue.Empty:
                    return
                try:
                    kind, payload = runner._call(("build", p), self.timeout)
                except TunerError as exc:
                    kind, payload = "error", str(exc)
                self.results[_key(p)] = payload if kind == "ok" else None
                self.done[_key(p)].set()
        finally:
            runner.close()

    def wait(self, params: dict | None = None) -> dict | None:
        """Wait for one configuration's prebuild (all with None): its result where the build
        failed cleanly (the configuration's final result), else None (evaluate it)."""
        for key, ev in ([(_key(params), self.done[_key(params)])] if params is not None else self.done.items()):
            while not ev.wait(0.2):  # short waits, so that Ctrl-C gets through
                if not any(t.is_alive() for t in self.threads):
                    return None
        res = self.results.get(_key(params)) if params is not None else None
        return res if res is not None and res["status"] != "ok" else None

    def close(self):
        self.stopped = True
        for r in self.runners:  # a builder in the middle of a compile is killed, not waited for
            proc = r.proc
            if proc is not None and proc.is_alive():
                proc.kill()
        for t in self.threads:
            t.join(10)


class InlineRunner:
    """Everything in this process: fastest, but a driver crash ends the sweep."""

    def __init__(self, setup: Setup, timeout: float = 0):
        self.ev = make_evaluator(setup)

    def evaluate(self, params):
        try:
            return self.ev.evaluate(params)
        except Exception as exc:
            return {"params": dict(params), "status": "failed", "error": f"{type(exc).__name__}: {exc}",
                    "info": {}, "times_ms": []}

    def retime(self, configs, repeats):
        return self.ev.retime(configs, repeats)

    def close(self):
        pass


# --------------------------------------------------------------------------- verdicts

def spill_verdict(info: dict, model: dict, params: dict, target: Target, *, work_group: int | None = None,
                  kernel: str = "prefill") -> tuple[bool | None, str]:
    """(spills, which signal said so), strongest signal first. ``work_group``: the configuration's
    work-items (default: the kernel's space computes it from ``params``)."""
    floats, hard = model["floats"], model["regs_hard"]
    model_text = f"model: {floats} floats {'>' if model['spills'] else '<='} {hard} regs"
    if target.mode == "modeled":
        return model["spills"], model_text
    if "spill_stores" in info:
        st, ld = info["spill_stores"], info["spill_loads"]
        return bool(st or ld), f"ptxas: {st}/{ld} B spill st/ld"
    if "intel_spill" in info:
        return info["intel_spill"] > 0, f"intel spill size {info['intel_spill']} B"
    if target.profile.vendor in ("qualcomm", "nvidia") and info.get("private_mem", 0) > 0:
        return True, f"CL_KERNEL_PRIVATE_MEM_SIZE {info['private_mem']} B"
    kwg = info.get("kernel_max_work_group")
    wg = work_group if work_group is not None else tuning.work_group_size(kernel, params)
    if kwg is not None and kwg < wg:
        return True, f"kernel work-group {kwg} < {wg}"
    return model["spills"], model_text


@dataclass
class ConfigResult:
    params: dict
    status: str                      # ok | wrong | failed
    spills: bool | None = None
    signal: str = ""
    registers: int | None = None
    model_floats: int = 0
    median_ms: float = float("nan")
    spread_ms: tuple = (float("nan"), float("nan"))
    runs: int = 0
    rate: float = float("nan")       # GFLOP/s (prefill) or GB/s (decode) at the median
    rel_err: float = float("nan")
    build_s: float = float("nan")
    error: str = ""
    retimed: bool = False
    info: dict = field(default_factory=dict)
    kernel: str = "prefill"

    @property
    def label(self) -> str:
        return WORKLOADS[self.kernel].label(self.params)


def _finish(raw: dict, target: Target, kernel: str, shape, dtype: str) -> ConfigResult:
    params = raw["params"]
    space, dims = tuning.SPACES[kernel], WORKLOADS[kernel].dims(shape, dtype)
    model = space.spill_model(params, dims, target.profile)
    info = raw.get("info") or {}
    spills, signal = spill_verdict(info, model, params, target, work_group=space.work_group_size(params, dims))
    r = ConfigResult(params=params, status=raw["status"], spills=spills, signal=signal,
                     registers=info.get("registers"), model_floats=model["floats"],
                     rel_err=raw.get("rel_err", float("nan")), build_s=raw.get("build_s", float("nan")),
                     error=raw.get("error", ""), info=info, kernel=kernel)
    _set_times(r, raw.get("times_ms") or [], shape, dtype)
    return r


def _set_times(r: ConfigResult, times, shape, dtype: str):
    if times:
        r.median_ms = statistics.median(times)
        r.spread_ms = (min(times), max(times))
        r.runs = len(times)
        r.rate = WORKLOADS[r.kernel].rate(shape, dtype, r.median_ms)
        r.info["times_ms"] = list(times)


# --------------------------------------------------------------------------- the sweep

@dataclass
class Report:
    target: Target
    shape: tuple
    dtype: str
    results: list
    pruned: list                     # (params, [(constraint, sentence)])
    total: int
    largest: ConfigResult | None = None
    fastest: ConfigResult | None = None
    winner: ConfigResult | None = None
    note: str = ""
    interrupted: bool = False
    saved_to: str = ""
    replaced: list = field(default_factory=list)
    date: str = ""
    command: str = ""
    resume_file: str = ""
    kernel: str = "prefill"
    notes: list = field(default_factory=list)   # what the sweep left out, and why

    @property
    def workload(self):
        return WORKLOADS[self.kernel]

    def conditions(self) -> dict:
        t = self.target
        return {"device": t.name, "mode": t.mode, "profile": t.profile.name, "driver": t.driver,
                "worker_device": t.device_desc, "flashcl": __version__, "date": self.date,
                "command": self.command, "kernel": self.kernel, "dtype": self.dtype,
                "problem": self.workload.text(self.shape), "rate_unit": self.workload.rate_unit}

    def as_dict(self) -> dict:
        key = self.workload.rate_key

        def row(r):
            return None if r is None else {k: v for k, v in asdict(r).items() if k not in ("info", "rate")} | {
                key: r.rate, "label": r.label, "private_mem": r.info.get("private_mem"),
                "kernel_max_work_group": r.info.get("kernel_max_work_group"),
                "num_splits": r.info.get("num_splits")}
        return {"conditions": self.conditions(), "mode": self.target.mode,
                "note": self.target.describe(),
                "rows": [row(r) for r in self.results],
                "pruned": [{"params": p, "violations": [f"{n}: {m}" for n, m in v]} for p, v in self.pruned],
                "largest_non_spilling": row(self.largest), "fastest": row(self.fastest),
                "winner": row(self.winner), "summary": self.note, "notes": self.notes,
                "interrupted": self.interrupted, "saved_to": self.saved_to, "replaced": len(self.replaced)}


def _shape_text(shape, kernel: str = "prefill") -> str:
    return WORKLOADS[kernel].text(shape)


def decode_uses_tensor_cores(target: Target, shape, dtype: str) -> bool:
    """Whether decode_mma.cl runs on the attached ``target`` for this problem."""
    if target.mode != "measured" or not target.mma:
        return False
    from ..opencl.decode import tensor_cores_ok
    from ..opencl.runtime import get_device

    return bool(tensor_cores_ok(get_device(target.device_spec), _decode_problem(shape, dtype)))


# decode.cl's tiles, which decode_mma.cl does not read
MMA_INERT = ("ROWS", "UNROLL", "HEAD_TILE")


def _split_settings(space: tuning.KernelSpace, target: Target, shape, dims: tuning.Dims, *, quick: bool,
                    overrides: dict, tensor_cores: bool, layout: str) -> list[dict]:
    """One (SPLIT_WAVES, SPLIT_KEYS) per distinct split count the layout's candidates give on the
    tuning problem, the one nearest the path's defaults (in log2 steps) standing for the others."""
    from ..opencl.decode import split_defaults

    waves, keys = (space.param_values(n, dims, quick=quick, overrides=overrides, layout=layout)
                   for n in ("SPLIT_WAVES", "SPLIT_KEYS"))
    tag = {} if layout == space.layouts[0].name else {"VARIANT": layout}
    path = split_defaults(tag, tensor_cores)
    best = {}
    for w in waves:
        for k in keys:
            p = {"SPLIT_WAVES": w, "SPLIT_KEYS": k}
            n = decode_splits(target.compute_units, shape, {**tag, **p}, tensor_cores)
            dist = (abs(math.log2(w / path["waves"])) + abs(math.log2(k / path["keys_per_split"])), w, k)
            if n not in best or dist < best[n][0]:
                best[n] = (dist, p)
    return [p for _, (_, p) in sorted(best.items())]


def plan(target: Target, shape, *, kernel: str = "prefill", dtype: str = "float16", quick: bool = False,
         overrides: dict | None = None):
    """(configurations to sweep, pruned (params, violations)) for ``target`` and ``shape``."""
    space, wl = tuning.SPACES[kernel], WORKLOADS[kernel]
    dims = wl.dims(shape, dtype)
    layouts = space.layouts_for(target.profile) if space.layouts_for else space.layout_names
    if target.mode == "modeled" and space.modeled_layouts:
        layouts = tuple(v for v in layouts if v in space.modeled_layouts)
    overrides = dict(overrides or {})
    tensor_cores = kernel == "decode" and decode_uses_tensor_cores(target, shape, dtype)
    if tensor_cores:
        default = space.default(target.profile, dims, local_mem=target.local_mem, max_work_group=target.max_work_group)
        for name in MMA_INERT:
            overrides.setdefault(name, [default[name]])
    host = space.host_params()
    lim = {"local_mem": target.local_mem, "max_work_group": target.max_work_group}

    def violations(p):
        v = space.violations(p, dims, lim)
        if target.mode == "modeled" and not v:
            floats = space.private_floats(p, dims)
            kwg = target.profile.kernel_max_work_group(floats)
            wg = space.work_group_size(p, dims)
            if wg > kwg:
                v = [("work_group_fits", f"a work-group of {wg} exceeds the modeled kernel work-group "
                      f"limit {kwg} at {floats} registers per work-item")]
        return v

    def spills(p):
        return space.private_floats(p, dims) > target.profile.regs_hard

    keep, pruned = [], []
    for p in space.candidates(dims, target.profile.simd, quick=quick, overrides=overrides, layouts=layouts,
                              skip=host):
        v = violations(p)
        (pruned.append((p, v)) if v else keep.append(p))
    if quick and all(spills(p) for p in keep):
        # The quick values are typical tiles; where the model predicts every one to spill (at d=128
        # the q row alone takes most of Adreno's 192 registers), the full space's largest tile
        # predicted not to spill joins them, so a quick sweep still has a safe tile to choose.
        safe = [p for p in space.candidates(dims, target.profile.simd, overrides=overrides, layouts=layouts,
                                            skip=host) if not spills(p) and not violations(p)]
        if safe:
            keep.append(max(safe, key=lambda p: space.rank(p, dims, target.profile)))
    if host and target.mode == "measured":
        settings = {lay: _split_settings(space, target, shape, dims, quick=quick, overrides=overrides,
                                         tensor_cores=tensor_cores, layout=lay) for lay in layouts}
        keep = [{**p, **s} for p in keep for s in settings[space.layout_of(p).name]]
    return keep, pruned


def _plan_notes(target: Target, kernel: str, shape, dtype: str) -> list:
    notes = []
    if kernel == "decode" and target.mode == "modeled":
        notes.append("the split rule is not swept in model mode (nothing is timed): its defaults apply")
    if kernel == "decode" and decode_uses_tensor_cores(target, shape, dtype):
        notes.append("decode_mma.cl (tensor cores) runs here: ROWS, UNROLL and HEAD_TILE do not apply and stay "
                     "at the default; MERGE_WG and the split rule are swept")
    return notes


def resume_path(target: Target, shape, dtype: str, configs, repeats: int, kernel: str = "prefill") -> Path:
    ident = json.dumps([target.key.name, target.key.profile, target.mode, list(shape), dtype,
                        [_key(p) for p in configs], repeats, __version__])
    h = hashlib.sha256(ident.encode()).hexdigest()[:16]
    return tuning.user_tuning_dir() / "resume" / f"{kernel}-{h}.json"


def _save_resume(path: Path, raws: list):
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump({"version": 1, "results": raws}, f)
    os.replace(tmp, path)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _resumed(rpath: Path, configs: list, notes: list) -> list:
    """The results of a resume file that belong to this sweep's plan, each with the plan's own
    params; an unreadable file, or results that are malformed or not in the plan, are left out
    with a note (they are measured again)."""
    try:
        loaded = json.loads(rpath.read_text())["results"]
        if not isinstance(loaded, list):
            raise ValueError("'results' is not a list")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        notes.append(f"resume file {rpath} unreadable ({exc}); the sweep starts over")
        return []
    planned = {_key(p): p for p in configs}
    raws, taken = [], set()
    for r in loaded:
        try:
            ok = (isinstance(r["status"], str) and isinstance(r.get("info") or {}, dict)
                  and all(_is_number(t) and math.isfinite(t) and t > 0 for t in r.get("times_ms") or [])
                  and all(_is_number(r[f]) for f in ("rel_err", "build_s") if f in r))
            key = _key(r["params"]) if ok and isinstance(r["params"], dict) else None
        except (AttributeError, KeyError, TypeError):
            key = None
        if key in planned and key not in taken:
            taken.add(key)
            raws.append({**r, "params": dict(planned[key])})
    if len(raws) < len(loaded):
        notes.append(f"{len(loaded) - len(raws)} results of resume file {rpath} left out (malformed, or not "
                     "in this sweep's plan): measured again")
    return raws


def remove_resume_file(report: Report) -> None:
    """Drop a finished sweep's resume file (run_sweep(keep_resume=True) leaves it for the caller
    to remove once the winner is saved)."""
    if report.resume_file:
        Path(report.resume_file).unlink(missing_ok=True)


def run_sweep(target: Target, shape, dtype: str, *, kernel: str = "prefill", quick: bool = False,
              overrides: dict | None = None, repeats: int = 7, retime_top: int = 3, isolate: bool = True,
              timeout: float = 120.0, resume: bool = False, extra_options=(), on_start=None, on_result=None,
              command: str = "", jobs: int | None = None, write_resume: bool = True,
              keep_resume: bool = False) -> Report:
    """Sweep, choose, and return the report (nothing is written to the database here).

    Each result goes to a resume file as it arrives (not with ``write_resume=False``); a sweep
    that finishes removes it, unless ``keep_resume`` (the caller removes it once the winner is
    saved: remove_resume_file), so that a failed save loses nothing.

    With ``isolate``, ``jobs`` processes (default: the host's cores on an attached GPU, else 1)
    build the configurations ahead of the timing worker (``Prebuilder``); 1 builds each in the
    timing worker only.

    ``on_start(n_todo, n_done)`` and ``on_result(ConfigResult)`` drive progress displays. Ctrl-C
    returns the partial report with ``interrupted=True``; the resume file keeps what was measured.
    """
    repeats = max(MIN_REPEATS, repeats)
    shape = tuple(shape)
    configs, pruned = plan(target, shape, kernel=kernel, dtype=dtype, quick=quick, overrides=overrides)
    report = Report(target, shape, dtype, [], pruned, len(configs) + len(pruned),
                    date=_dt.datetime.now().isoformat(timespec="seconds"), command=command, kernel=kernel,
                    notes=_plan_notes(target, kernel, shape, dtype))
    rpath = resume_path(target, shape, dtype, configs, repeats, kernel)
    raws = _resumed(rpath, configs, report.notes) if resume and rpath.exists() else []
    done = {_key(r["params"]) for r in raws}
    todo = [p for p in configs if _key(p) not in done]
    report.results = [_finish(r, target, kernel, shape, dtype) for r in raws]
    if on_start:
        on_start(len(todo), len(raws))
    if not todo and not raws:
        report.note = "no configuration satisfies the constraints"
        return report
    setup = Setup(target.device_spec, shape, dtype, target.mode, repeats, verbose=target.is_nvidia,
                  extra_options=tuple(extra_options), kernel=kernel)
    runner = prebuilder = None
    try:
        # GPU compilers take seconds a configuration; PoCL builds cheaply and compiles at the first
        # launch, so there the builders' start-up cost more than they saved (11.2 -> 12.7 s, --quick)
        default_jobs = (os.cpu_count() or 1) if target.mode == "measured" and target.profile.name != "cpu" else 1
        jobs = min(jobs or default_jobs, len(todo))
        if isolate and jobs > 1:
            prebuilder = Prebuilder(setup, todo, jobs, timeout)
            if target.mode == "measured" and target.profile.name == "cpu":
                prebuilder.wait()  # timing a CPU device while the builders hold its cores would skew it
        for p in todo:
            raw = prebuilder.wait(p) if prebuilder else None
            if raw is None:
                runner = runner or (IsolatedRunner if isolate else InlineRunner)(setup, timeout)
                raw = runner.evaluate(p)
            raws.append(raw)
            if write_resume:
                try:
                    _save_resume(rpath, raws)
                except OSError as exc:  # the sweep goes on; an interruption then loses its results
                    write_resume = False
                    report.notes.append(f"cannot keep a resume file at {rpath} ({exc}): the sweep runs without one")
            res = _finish(raw, target, kernel, shape, dtype)
            report.results.append(res)
            if on_result:
                on_result(res)
        if prebuilder:
            prebuilder.close()
        if target.mode == "measured" and retime_top > 1:
            ok = sorted((r for r in report.results if r.status == "ok" and r.runs),
                        key=lambda r: r.median_ms)[:retime_top]
            if len(ok) > 1:
                runner = runner or (IsolatedRunner if isolate else InlineRunner)(setup, timeout)
                times = runner.retime([r.params for r in ok], repeats)
                for r, extra in zip(ok, times or []):
                    _set_times(r, r.info.get("times_ms", []) + list(extra), shape, dtype)
                    r.retimed = True
    except KeyboardInterrupt:
        report.interrupted = True
    finally:
        if prebuilder is not None:
            prebuilder.close()
        if runner is not None:
            runner.close()
    order = {_key(p): i for i, p in enumerate(configs)}
    report.results.sort(key=lambda r: order.get(_key(r.params), len(order)))
    _choose(report)
    report.resume_file = str(rpath) if write_resume else ""
    if not report.interrupted and not keep_resume:
        remove_resume_file(report)
    return report


def _choose(report: Report):
    t = report.target
    space, dims = tuning.SPACES[report.kernel], report.workload.dims(report.shape, report.dtype)
    ok = [r for r in report.results if r.status == "ok"]
    safe = [r for r in ok if r.spills is False]
    rank = lambda r: space.rank(r.params, dims, t.profile)  # noqa: E731
    report.largest = max(safe, key=rank) if safe else None
    if t.mode == "modeled":
        within = [r for r in safe if r.model_floats <= t.profile.regs_budget]
        report.winner = report.largest
        if report.winner is None and ok:
            report.winner = min(ok, key=lambda r: r.model_floats)
            report.note = ("every configuration is predicted to spill; chose the fewest registers "
                           f"({report.winner.model_floats} floats)")
        elif report.winner is not None:
            report.note = (f"chose the largest tile predicted not to spill: {report.winner.label} "
                           f"({report.winner.model_floats} floats <= {t.profile.regs_hard} regs"
                           + ("" if within else f"; none fits the occupancy budget of {t.profile.regs_budget}")
                           + ")")
        return
    timed = [r for r in ok if r.runs]
    # the re-timed few (the fastest of the first pass, measured again side by side) decide; a
    # config that was not re-timed cannot win on one lucky first pass
    finalists = [r for r in timed if r.retimed] or timed
    report.fastest = min(finalists, key=lambda r: r.median_ms) if finalists else None
    report.winner = report.fastest
    if report.winner is None:
        report.note = "no configuration built and passed the correctness check"
        return
    f, lg = report.fastest, report.largest
    if f.spills:
        vs = (f"; {(lg.median_ms / f.median_ms - 1) * 100:.0f}% faster than the largest non-spilling tile "
              f"({lg.label})" if lg and lg.runs else "")
        report.note = f"the fastest configuration SPILLS ({f.signal}) and still wins{vs}"
    elif lg is not None and lg is not f:
        report.note = (f"the fastest configuration is not the largest non-spilling tile "
                       f"({lg.label}: {lg.median_ms:.3f} ms)")
    else:
        report.note = "the fastest configuration is also the largest non-spilling tile"


def save(report: Report, path: Path | None = None) -> Path:
    """Write the winner into the database (``path`` or the user tuning dir's file for the device).
    Its provenance records the driver it was measured (or, modeled, built) with."""
    w, t, wl = report.winner, report.target, report.workload
    dims = wl.dims(report.shape, report.dtype)
    prov = {"device": t.key.name or f"model of {t.profile.name}", "driver": t.driver, "flashcl": __version__,
            "date": report.date, "mode": t.mode, "problem": wl.text(report.shape),
            "spill": {"spills": w.spills, "signal": w.signal}, "command": report.command}
    if t.mode == "measured":
        prov.update({"median_ms": round(w.median_ms, 4), wl.rate_key: round(w.rate, 2), "runs": w.runs})
        prov.update({k: w.info[k] for k in ("num_splits", "path") if k in w.info})
    else:
        prov.update(compiler=t.device_desc, model_floats=w.model_floats,
                    regs_hard=t.profile.regs_hard, regs_budget=t.profile.regs_budget)
    entry = tuning.make_entry(report.kernel, t.key, dtype=report.dtype, dk=dims.dk, dv=dims.dv,
                              causal=wl.causal(report.shape), n=wl.n(report.shape), params=w.params,
                              provenance=prov, group=wl.group(report.shape))
    path = Path(path) if path else tuning.default_db_file(t.key)
    report.replaced = tuning.save_entry(entry, path)
    report.saved_to = str(path)
    return path


# --------------------------------------------------------------------------- output

def _fmt(x, spec):
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def _layout(p: dict) -> str:
    """The layout column: "rows v4" (+" q0" when q is re-read), or "tiles 8x2 u4"."""
    if tuning.variant_of(p) == "tiles":
        return f"tiles {p['TILE_M']}x{p['TILE_N']} u{p.get('UNROLL_K', 0)}"
    return f"rows v{p['VEC']}" + ("" if p.get("Q_IN_REGS", 1) else " q0")


def format_report(report: Report) -> str:
    t, wl = report.target, report.workload
    c = report.conditions()
    lines = [f"# flashcl tune {report.kernel} {c['problem']} {report.dtype} on {t.name} "
             f"(profile {t.profile.name}, {t.mode}), flashcl {__version__}, {report.date}",
             f"# {t.describe()}",
             f"# command: {report.command}" if report.command else "",
             "# time: median of OpenCL profiling events (warm-up first; * = re-timed); spill: the "
             "strongest signal present; regs: compiler-reported; model: floats live per work-item"]
    lines += [f"# {n}" for n in report.notes]
    lines = [ln for ln in lines if ln]
    lines.append(wl.header() + f"{'status':6} {'spill':5} {'signal':34} {'regs':>4} {'model':>5} {'ms':>9} "
                 f"{wl.rate_unit:>8} {'rel err':>8}  ")
    for r in report.results:
        mark = []
        if r is report.winner:
            mark.append("winner")
        if r is report.largest:
            mark.append("largest non-spilling")
        spill = "-" if r.spills is None else ("yes" if r.spills else "no")
        ms = _fmt(r.median_ms, "9.3f") + ("*" if r.retimed else " ")
        lines.append(
            wl.columns(r) + f"{r.status:6} {spill:5} "
            f"{r.signal[:34]:34} {_fmt(r.registers, '4d'):>4} {r.model_floats:5d} {ms:>10} "
            f"{_fmt(r.rate, '8.1f'):>8} {_fmt(r.rel_err, '8.1e'):>8}  "
            + (" <- " + ", ".join(mark) if mark else "") + (f"  {r.error[:120]}" if r.error else ""))
    if report.pruned:
        counts = {}
        for _, v in report.pruned:
            for name, _msg in v:
                counts[name] = counts.get(name, 0) + 1
        lines.append(f"# pruned {len(report.pruned)} of {report.total} configurations by constraint: "
                     + ", ".join(f"{k} ({n})" for k, n in sorted(counts.items())))
    n_ok = sum(r.status == "ok" for r in report.results)
    n_wrong = sum(r.status == "wrong" for r in report.results)
    n_fail = sum(r.status == "failed" for r in report.results)
    lines.append(f"# {len(report.results)} swept: {n_ok} ok, {n_wrong} wrong, {n_fail} failed")
    if report.largest:
        lines.append(f"# largest non-spilling tile: {report.largest.label}"
                     + (f"  {report.largest.median_ms:.3f} ms, {report.largest.rate:.1f} {wl.rate_unit}"
                        if report.largest.runs else f"  ({report.largest.model_floats} floats)"))
    else:
        lines.append("# largest non-spilling tile: none")
    if t.mode == "measured":
        lines.append(f"# fastest: {report.fastest.label}  {report.fastest.median_ms:.3f} ms, "
                     f"{report.fastest.rate:.1f} {wl.rate_unit}" if report.fastest else "# fastest: none")
    if report.note:
        lines.append(f"# {report.note}")
    if report.interrupted:
        lines.append(f"# INTERRUPTED: {len(report.results)} of {report.total - len(report.pruned)} configurations "
                     f"measured; resume with --resume ({report.resume_file})")
    if report.saved_to:
        lines.append(f"# wrote {report.winner.label} ({t.mode}) to {report.saved_to}"
                     + (f", replacing {len(report.replaced)} entr{'y' if len(report.replaced) == 1 else 'ies'}"
                        if report.replaced else ""))
    return "\n".join(lines)


# --------------------------------------------------------------------------- plot

@dataclass
class Cell:
    """One cell of the plot: the configurations sharing its (panel, x, y), the one that stands for
    them (the winner or the largest non-spilling tile where the cell holds it, else its best), its
    value (ms, or modeled floats in model mode) and verdict ("ok", "S" spills, "X" failed or wrong)."""

    results: list
    shown: ConfigResult
    value: float
    verdict: str
    winner: bool
    largest: bool


def _plot_axes(report: Report) -> tuple:
    return report.workload.axes(report.results)


def plot_cells(report: Report) -> dict:
    """{panel value: {(x value, y value): Cell}} over the kernel's plot axes."""
    space = tuning.SPACES[report.kernel]
    dims = report.workload.dims(report.shape, report.dtype)
    xn, yn, pn = _plot_axes(report)
    modeled = report.target.mode == "modeled"
    groups: dict = {}
    for r in report.results:
        key = (space.value(r.params, pn), space.value(r.params, xn), space.value(r.params, yn))
        groups.setdefault(key, []).append(r)
    panels: dict = {}
    for (panel, x, y), rs in groups.items():
        has_winner = any(r is report.winner for r in rs)
        has_largest = any(r is report.largest for r in rs)
        ok = [r for r in rs if r.status == "ok"]
        if has_winner:
            shown = report.winner
        elif has_largest:
            shown = report.largest
        elif ok and modeled:
            safe = [r for r in ok if not r.spills]
            shown = (max(safe, key=lambda r: space.rank(r.params, dims, report.target.profile)) if safe
                     else min(ok, key=lambda r: r.model_floats))
        elif ok:
            timed = [r for r in ok if r.runs]
            shown = min(timed, key=lambda r: r.median_ms) if timed else ok[0]
        else:
            shown = rs[0]
        if shown.status != "ok":
            value, verdict = float("nan"), "X"
        else:
            value = float(shown.model_floats) if modeled else shown.median_ms
            verdict = "S" if shown.spills else "ok"
        panels.setdefault(panel, {})[(x, y)] = Cell(rs, shown, value, verdict, has_winner, has_largest)
    return panels


def color_limits(values) -> tuple[float, float]:
    """The colour scale: the 5th to 95th percentile of the finite values, so that one outlier (a
    spilling or failing configuration 100x slower) does not flatten the rest."""
    import numpy as np

    v = np.asarray([x for x in values if x == x and math.isfinite(x)], dtype=float)
    if v.size == 0:
        return 0.0, 1.0
    lo, hi = (float(x) for x in np.percentile(v, [5, 95]))
    return (lo, hi) if hi > lo else (lo - 0.5, lo + 0.5)


def plot(report: Report, path: str):
    """One heat map per panel value of the kernel's plot axes (prefill: BLOCK_M x DV_TILE per
    BLOCK_N; decode: ROWS x UNROLL per HEAD_TILE); each cell shows its best configuration's time
    (model mode: modeled floats) and verdict, the winner boxed and marked W, the largest
    non-spilling tile marked L."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.patches as mpatches
    import matplotlib.pyplot as plt
    import numpy as np

    panels = plot_cells(report)
    xn, yn, pn = _plot_axes(report)
    modeled = report.target.mode == "modeled"
    order = lambda v: (v is None, 0 if v is None else v)  # noqa: E731  (a layout without the axis: None)
    keys = sorted(panels, key=order)
    xs = sorted({x for p in panels.values() for x, _ in p}, key=order)
    ys = sorted({y for p in panels.values() for _, y in p}, key=order)
    vmin, vmax = color_limits([c.value for p in panels.values() for c in p.values()])
    all_vals = [c.value for p in panels.values() for c in p.values() if c.value == c.value]
    extend = ("both" if all_vals and min(all_vals) < vmin and max(all_vals) > vmax else
              "min" if all_vals and min(all_vals) < vmin else "max" if all_vals and max(all_vals) > vmax else "neither")
    fig, axes = plt.subplots(1, max(1, len(keys)), figsize=(max(5.5, 3.8 * len(keys)), 3.9), squeeze=False)
    for ax, panel in zip(axes[0], keys):
        grid = np.full((len(ys), len(xs)), np.nan)
        for (x, y), cell in panels[panel].items():
            i, j = ys.index(y), xs.index(x)
            grid[i, j] = cell.value
            text = {"ok": "", "S": "S", "X": "X"}[cell.verdict]
            text = " ".join(t for t in (text, "W" if cell.winner else "", "L" if cell.largest else "") if t)
            ax.text(j, i, text, ha="center", va="center", fontweight="bold",
                    color="red" if cell.verdict != "ok" else "black")
            if cell.winner:
                ax.add_patch(mpatches.Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, lw=2.5, ec="black"))
        im = ax.imshow(grid, origin="lower", cmap="viridis_r", aspect="auto", vmin=vmin, vmax=vmax)
        ax.set_xticks(range(len(xs)), [str(x) for x in xs])
        ax.set_yticks(range(len(ys)), [str(y) for y in ys])
        ax.set_xlabel(xn)
        ax.set_ylabel(yn)
        ax.set_title(f"{pn}={panel}")
        fig.colorbar(im, ax=ax, extend=extend,
                     label=("model floats" if modeled else "ms (median)") + ", 5th-95th pct")
    fig.suptitle(f"flashcl tune {report.kernel} on {report.target.name[:48]} ({report.target.mode})\n"
                 f"W winner (boxed), L largest non-spilling, S spills, X failed/wrong; a cell shows its best",
                 fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
