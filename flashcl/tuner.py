"""``flashcl tune``: sweep a kernel's tiles on a device and store the winner (DESIGN.md §5).

For every configuration of the kernel's tuning space (``tuning.TUNING_SPACE``) that satisfies the
named constraints:

1. **build** it (a failed build is recorded and the sweep goes on);
2. read the **spill signals**, strongest first: the vendor compiler's report (NVIDIA
   ``-cl-nv-verbose`` ptxas spill stores/loads and registers; Intel's spill size), then
   ``CL_KERNEL_PRIVATE_MEM_SIZE`` (Adreno, NVIDIA), then a kernel ``CL_KERNEL_WORK_GROUP_SIZE``
   below BLOCK_M, then the profile's register model (``tuning.private_floats`` against
   ``regs_hard``);
3. check it against the float64 oracle on a small problem that crosses every tile edge (a wrong
   configuration is marked and never chosen);
4. **time** it on the tuning problem with profiling events (a warm-up, then ``repeats`` >= 5
   runs, the median); the fastest few are re-timed, interleaved, to beat noise.

The result names both the largest non-spilling tile and the fastest configuration (a spilling
one may win; the report says so), and the winner goes into the tuning database with its
provenance. ``flashcl.prefill`` reads it on the next call on that device.

**Model mode.** When the named device is not attached (``--device adreno`` on a laptop or in
CI), the profile stands in for it: every configuration is still built, and checked, with the
OpenCL compiler at hand (the PoCL CPU device), so compile errors surface; the spill verdict,
local memory and work-group limits come from the profile; the largest tile predicted not to
spill wins, and the entry is stored as *modeled* under the profile, where a later measured entry
for a real device of that profile replaces it.

**Robustness.** Each configuration's build and launches run in a worker process with a timeout,
so a driver crash or hang costs one configuration, not the sweep (``isolate=False`` runs them in
this process). Every result is appended to a resume file as it arrives; Ctrl-C keeps them and
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
import signal
import statistics
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from . import tuning
from ._version import __version__
from .profiles import DeviceProfile, find_profile

KERNEL = "prefill"
TOLERANCE = {"float32": 1e-5, "float16": 2e-3}
CHECK_N = 261        # the correctness problem: N not a multiple of any tile, > the largest BLOCK_M
MIN_REPEATS = 5

# Default tuning problems, (B, H_q, H_kv, N, d, causal): the GQA reference shape on GPUs; on CPU
# devices a problem a 2-core machine times in tens of milliseconds per configuration.
GPU_PROBLEM = (1, 32, 8, 2048, 128, True)
CPU_PROBLEM = (1, 8, 2, 512, 128, True)
CPU_QUICK_PROBLEM = (1, 4, 2, 256, 64, True)


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

    @property
    def name(self) -> str:
        return self.key.name or f"{self.profile.name} (profile)"

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
    from .opencl.runtime import get_device, list_devices

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
                             f"({', '.join(_profile_names())}) tunes in model mode") from None
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
    key = tuning.DeviceKey.of(handle.name, handle.device.opencl_c_version, handle.device.vendor,
                              handle.profile.name)
    from .opencl.runtime import list_devices

    spec = next((r["id"] for r in list_devices() if r["device"] == handle.name
                 and r["platform"] == handle.platform), None)
    if spec is None:
        raise TunerError(f"cannot address {handle.describe()} by index")
    return Target(handle.profile, key, "measured", spec, handle.describe(), handle.driver,
                  handle.local_mem, handle.max_work_group, handle.is_nvidia)


def _profile_names():
    from .profiles import PROFILES

    return list(PROFILES)


# --------------------------------------------------------------------------- one configuration

def _problem(shape, dtype: str):
    from .opencl.prefill import PrefillProblem

    b, h_q, h_kv, n, d, causal = shape
    return PrefillProblem(b, h_q, h_kv, n, n, d, d, bool(causal), dtype)


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


class Evaluator:
    """Builds, checks and times configurations on one device; lives in the worker process."""

    def __init__(self, setup: Setup):
        import numpy as np
        import pyopencl.array as cla

        from . import reference
        from .opencl.runtime import get_device

        self.s = setup
        self.h = get_device(setup.device_spec)
        self.prob = _problem(setup.shape, setup.dtype)
        b, h_q, h_kv, n, d, causal = setup.shape
        self.small = _problem((1, 2, 1, CHECK_N, d, causal), setup.dtype)
        rng = np.random.default_rng(setup.seed)
        dt = np.dtype(setup.dtype)

        def rand(*shape):
            return rng.standard_normal(shape).astype(dt)

        q, k, v = rand(1, 2, CHECK_N, d), rand(1, 1, CHECK_N, d), rand(1, 1, CHECK_N, d)
        self.scale = 1.0 / math.sqrt(d)
        self.ref = reference.attention(q, k, v, causal=bool(causal), scale=self.scale)
        queue = self.h.queue
        self.small_io = [cla.to_device(queue, x) for x in (q, k, v)]
        self.small_out = cla.empty(queue, (1, 2, CHECK_N, d), dt)
        self.poison = np.full(self.small_out.shape, np.nan, dt)
        self.big_io = None
        if setup.mode == "measured":
            self.big_io = [cla.to_device(queue, rand(b, h_q, n, d)), cla.to_device(queue, rand(b, h_kv, n, d)),
                           cla.to_device(queue, rand(b, h_kv, n, d))]
            self.big_out = cla.empty(queue, (b, h_q, n, d), dt)
        self.kernels = {}

    def _kernel(self, prob, params):
        from .opencl.prefill import PrefillKernel

        return PrefillKernel(self.h, prob, params, write_lse=False, verbose=self.s.verbose,
                             extra_options=self.s.extra_options)

    def evaluate(self, params: dict) -> dict:
        import numpy as np

        from .errors import FlashCLError

        res = {"params": dict(params), "status": "ok", "error": "", "info": {}, "times_ms": []}
        t0 = time.perf_counter()
        try:
            kern = self._kernel(self.small, params)
        except FlashCLError as exc:
            res.update(status="failed", error=_first_lines(str(exc)))
            return res
        except ValueError as exc:  # the built kernel's work-group limit is below BLOCK_M
            res.update(status="failed", error=str(exc))
            import re

            m = re.search(r"max work-group size (\d+)", str(exc))
            if m:
                res["info"]["kernel_max_work_group"] = int(m.group(1))
            return res
        res["build_s"] = time.perf_counter() - t0
        res["info"] = kern.spills()
        res["info"].update(_intel_spill(kern, self.h))
        # correctness on the small problem, output poisoned so unwritten elements fail
        try:
            # from the host: Array.fill builds a kernel, which takes no half without cl_khr_fp16
            self.small_out.set(self.poison)
            kern(*self.small_io, self.small_out, None, self.scale).wait()
            got = self.small_out.get().astype(np.float64)
        except FlashCLError as exc:
            res.update(status="failed", error=_first_lines(str(exc)))
            return res
        if not np.all(np.isfinite(got)):
            res.update(status="wrong", rel_err=float("inf"), error="non-finite output")
            return res
        err = float(np.linalg.norm(got - self.ref) / np.linalg.norm(self.ref))
        res["rel_err"] = err
        if err > TOLERANCE[self.s.dtype]:
            res.update(status="wrong", error=f"relative error {err:.2e} > {TOLERANCE[self.s.dtype]:g}")
            return res
        if self.s.mode == "measured":
            try:
                big = self._kernel(self.prob, params)
                self.kernels[_key(params)] = big
                res["times_ms"] = self._time(big, self.s.repeats)
            except FlashCLError as exc:
                res.update(status="failed", error=_first_lines(str(exc)))
        return res

    def _time(self, kern, repeats: int) -> list[float]:
        from .opencl.runtime import event_times  # lazily, like every OpenCL import here

        q, k, v = self.big_io
        return event_times(lambda i: kern(q, k, v, self.big_out, None, self.scale), repeats)

    def retime(self, configs: list[dict], repeats: int) -> list[list[float]]:
        """Interleaved re-timing (round robin) so drift in clocks or load hits all alike."""
        kerns = [self.kernels.get(_key(p)) or self._kernel(self.prob, p) for p in configs]
        for kern in kerns:
            self._time(kern, 0)
        times = [[] for _ in kerns]
        for _ in range(repeats):
            for i, kern in enumerate(kerns):
                times[i] += self._time(kern, 1)[-1:]
        return times


def _intel_spill(kern, handle) -> dict:
    """Intel's own spill report: CL_KERNEL_SPILL_MEM_SIZE_INTEL (0x4109), where the driver has it."""
    if "intel" not in handle.platform.lower() or handle.is_cpu:
        return {}
    try:
        return {"intel_spill": int(kern.kernel.get_work_group_info(0x4109, handle.device))}
    except Exception:  # not supported by this driver or this pyopencl
        return {}


def _first_lines(text: str, n: int = 4) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return " | ".join(lines[:n])[:400]


def _key(params: dict) -> str:
    return ",".join(f"{k}={params[k]}" for k in sorted(params))


# --------------------------------------------------------------------------- runners

def _worker_main(conn, setup: Setup):
    import warnings

    import pyopencl

    # Ctrl-C is the parent's to handle (it stops the sweep and kills this worker); and PyOpenCL's
    # CompilerWarning for a non-empty build log would land between the parent's table rows.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    warnings.simplefilter("ignore", pyopencl.CompilerWarning)
    try:
        ev = Evaluator(setup)
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

    def __init__(self, setup: Setup, timeout: float):
        self.setup, self.timeout = setup, timeout
        self.ctx = multiprocessing.get_context("spawn")
        self.proc = self.conn = None

    def _start(self):
        parent, child = self.ctx.Pipe()
        self.proc = self.ctx.Process(target=_worker_main, args=(child, self.setup), daemon=True)
        with _sigint_ignored():
            self.proc.start()
        child.close()
        self.conn = parent
        if not parent.poll(max(self.timeout, 60)):
            self.close()
            raise TunerError("the tuning worker did not start within its timeout")
        kind, payload = parent.recv()
        if kind != "ready":
            self.close()
            raise TunerError(f"the tuning worker could not open the device: {payload}")

    def _call(self, msg, timeout):
        if self.proc is None or not self.proc.is_alive():
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


class InlineRunner:
    """Everything in this process: fastest, but a driver crash ends the sweep."""

    def __init__(self, setup: Setup, timeout: float = 0):
        self.ev = Evaluator(setup)

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

def spill_verdict(info: dict, model: dict, params: dict, target: Target) -> tuple[bool | None, str]:
    """(spills, which signal said so), strongest signal first (DESIGN.md §5)."""
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
    if kwg is not None and kwg < tuning.work_group_size(KERNEL, params):
        return True, f"kernel work-group {kwg} < {tuning.work_group_size(KERNEL, params)}"
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
    gflops: float = float("nan")
    rel_err: float = float("nan")
    build_s: float = float("nan")
    error: str = ""
    retimed: bool = False
    info: dict = field(default_factory=dict)

    @property
    def label(self) -> str:
        p = self.params
        head = f"BLOCK_M={p['BLOCK_M']} BLOCK_N={p['BLOCK_N']} DV_TILE={p['DV_TILE']}"
        if tuning.variant_of(p) == "tiles":
            return f"tiles {head} TILE_M={p['TILE_M']} TILE_N={p['TILE_N']} UNROLL_K={p.get('UNROLL_K', 0)}"
        return f"{head} VEC={p['VEC']} Q_IN_REGS={p.get('Q_IN_REGS', 1)}"


def _finish(raw: dict, target: Target, prob, d: int) -> ConfigResult:
    params = raw["params"]
    model = tuning.spill_model(KERNEL, params, d, d, target.profile)
    info = raw.get("info") or {}
    spills, signal = spill_verdict(info, model, params, target)
    times = raw.get("times_ms") or []
    r = ConfigResult(params=params, status=raw["status"], spills=spills, signal=signal,
                     registers=info.get("registers"), model_floats=model["floats"],
                     rel_err=raw.get("rel_err", float("nan")), build_s=raw.get("build_s", float("nan")),
                     error=raw.get("error", ""), info=info)
    _set_times(r, times, prob)
    return r


def _set_times(r: ConfigResult, times, prob):
    if times:
        r.median_ms = statistics.median(times)
        r.spread_ms = (min(times), max(times))
        r.runs = len(times)
        r.gflops = prob.flops / (r.median_ms * 1e-3) / 1e9
        r.info["times_ms"] = list(times)


def tile_rank(params: dict, profile: DeviceProfile, d: int):
    """Order of "largest tile": the register tile first (DV_TILE + BLOCK_N: fewer passes and
    barriers), more output columns at a tie, then the largest BLOCK_M that still lets two
    work-groups share a compute unit (one's barrier wait hidden by the other's math)."""
    kwg = profile.kernel_max_work_group(tuning.private_floats(KERNEL, params, d, d))
    return (params["DV_TILE"] + params["BLOCK_N"], params["DV_TILE"],
            2 * tuning.work_group_size(KERNEL, params) <= kwg, params["BLOCK_M"])


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

    def conditions(self) -> dict:
        t = self.target
        return {"device": t.name, "mode": t.mode, "profile": t.profile.name, "driver": t.driver,
                "worker_device": t.device_desc, "flashcl": __version__, "date": self.date,
                "command": self.command, "kernel": KERNEL, "dtype": self.dtype,
                "problem": _shape_text(self.shape)}

    def as_dict(self) -> dict:
        def row(r):
            return None if r is None else {k: v for k, v in asdict(r).items() if k != "info"} | {
                "label": r.label, "private_mem": r.info.get("private_mem"),
                "kernel_max_work_group": r.info.get("kernel_max_work_group")}
        return {"conditions": self.conditions(), "mode": self.target.mode,
                "note": self.target.describe(),
                "results": [row(r) for r in self.results],
                "pruned": [{"params": p, "violations": [f"{n}: {m}" for n, m in v]} for p, v in self.pruned],
                "largest_non_spilling": row(self.largest), "fastest": row(self.fastest),
                "winner": row(self.winner), "summary": self.note, "interrupted": self.interrupted,
                "saved_to": self.saved_to, "replaced": len(self.replaced)}


def _shape_text(shape) -> str:
    b, h_q, h_kv, n, d, causal = shape
    return f"B={b} H_q={h_q} H_kv={h_kv} N={n} d={d} {'causal' if causal else 'non-causal'}"


# Layouts whose register model has been checked against a real compiler under a small register
# budget (ptxas with -cl-nv-maxrregcount=192, the Adreno profile's: 91% agreement in-sample at
# d=64/128, 93% on d=80/96/256). Model mode chooses only among these; the micro-tiled layout's
# model was only compared with ptxas at 255 registers on two configurations, so it is swept on
# attached devices (where the compiler's own report decides) but not chosen blind.
MODELED_VARIANTS = ("rows",)


def plan(target: Target, shape, *, quick: bool = False, overrides: dict | None = None):
    """(configurations to sweep, pruned (params, violations)) for ``target`` and ``shape``."""
    d = shape[4]
    variants = target.profile.prefill_variants
    if target.mode == "modeled":
        variants = tuple(v for v in variants if v in MODELED_VARIANTS)

    def violations(p):
        v = tuning.violations(KERNEL, p, d, d, local_mem=target.local_mem, max_work_group=target.max_work_group)
        if target.mode == "modeled" and not v:
            kwg = target.profile.kernel_max_work_group(tuning.private_floats(KERNEL, p, d, d))
            wg = tuning.work_group_size(KERNEL, p)
            if wg > kwg:
                v = [("work_group_fits", f"a work-group of {wg} exceeds the modeled kernel work-group "
                      f"limit {kwg} at {tuning.private_floats(KERNEL, p, d, d)} registers per work-item")]
        return v

    def spills(p):
        return tuning.private_floats(KERNEL, p, d, d) > target.profile.regs_hard

    keep, pruned = [], []
    for p in tuning.candidate_configs(KERNEL, d, d, target.profile.simd, quick=quick, overrides=overrides,
                                      variants=variants):
        v = violations(p)
        (pruned.append((p, v)) if v else keep.append(p))
    if quick and all(spills(p) for p in keep):
        # The quick values are typical tiles; where the model predicts every one to spill (at d=128
        # the q row alone takes most of Adreno's 192 registers), the full space's largest tile
        # predicted not to spill joins them, so a quick sweep still has a safe tile to choose.
        safe = [p for p in tuning.candidate_configs(KERNEL, d, d, target.profile.simd, overrides=overrides,
                                                    variants=variants) if not spills(p) and not violations(p)]
        if safe:
            keep.append(max(safe, key=lambda p: tile_rank(p, target.profile, d)))
    return keep, pruned


def resume_path(target: Target, shape, dtype: str, configs, repeats: int) -> Path:
    ident = json.dumps([target.key.name, target.key.profile, target.mode, list(shape), dtype,
                        [_key(p) for p in configs], repeats, __version__])
    h = hashlib.sha256(ident.encode()).hexdigest()[:16]
    return tuning.user_tuning_dir() / "resume" / f"{KERNEL}-{h}.json"


def _save_resume(path: Path, raws: list):
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump({"version": 1, "results": raws}, f)
    os.replace(tmp, path)


def run_sweep(target: Target, shape, dtype: str, *, quick: bool = False, overrides: dict | None = None,
              repeats: int = 7, retime_top: int = 3, isolate: bool = True, timeout: float = 120.0,
              resume: bool = False, extra_options=(), on_start=None, on_result=None, command: str = "") -> Report:
    """Sweep, choose, and return the report (nothing is written to the database here).

    ``on_start(n_todo, n_done)`` and ``on_result(ConfigResult)`` drive progress displays. Ctrl-C
    returns the partial report with ``interrupted=True``; the resume file keeps what was measured.
    """
    repeats = max(MIN_REPEATS, repeats)
    d = shape[4]
    prob = _problem(shape, dtype)
    configs, pruned = plan(target, shape, quick=quick, overrides=overrides)
    report = Report(target, tuple(shape), dtype, [], pruned, len(configs) + len(pruned),
                    date=_dt.datetime.now().isoformat(timespec="seconds"), command=command)
    rpath = resume_path(target, shape, dtype, configs, repeats)
    raws = []
    if resume and rpath.exists():
        try:
            raws = json.loads(rpath.read_text())["results"]
        except (OSError, ValueError, KeyError):
            raws = []
    done = {_key(r["params"]) for r in raws}
    todo = [p for p in configs if _key(p) not in done]
    report.results = [_finish(r, target, prob, d) for r in raws]
    if on_start:
        on_start(len(todo), len(raws))
    if not todo and not raws:
        report.note = "no configuration satisfies the constraints"
        return report
    setup = Setup(target.device_spec, tuple(shape), dtype, target.mode, repeats,
                  verbose=target.is_nvidia, extra_options=tuple(extra_options))
    runner = None
    try:
        for p in todo:
            runner = runner or (IsolatedRunner if isolate else InlineRunner)(setup, timeout)
            raw = runner.evaluate(p)
            raws.append(raw)
            _save_resume(rpath, raws)
            res = _finish(raw, target, prob, d)
            report.results.append(res)
            if on_result:
                on_result(res)
        if target.mode == "measured" and retime_top > 1:
            ok = sorted((r for r in report.results if r.status == "ok" and r.runs),
                        key=lambda r: r.median_ms)[:retime_top]
            if len(ok) > 1:
                runner = runner or (IsolatedRunner if isolate else InlineRunner)(setup, timeout)
                times = runner.retime([r.params for r in ok], repeats)
                for r, extra in zip(ok, times or []):
                    _set_times(r, r.info.get("times_ms", []) + list(extra), prob)
                    r.retimed = True
    except KeyboardInterrupt:
        report.interrupted = True
    finally:
        if runner is not None:
            runner.close()
    order = {_key(p): i for i, p in enumerate(configs)}
    report.results.sort(key=lambda r: order.get(_key(r.params), len(order)))
    _choose(report)
    if not report.interrupted:
        try:
            rpath.unlink()
        except FileNotFoundError:
            pass
    report.resume_file = str(rpath)
    return report


def _choose(report: Report):
    t, d = report.target, report.shape[4]
    ok = [r for r in report.results if r.status == "ok"]
    safe = [r for r in ok if r.spills is False]
    rank = lambda r: tile_rank(r.params, t.profile, d)  # noqa: E731
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
    """Write the winner into the database (``path`` or the user tuning dir's file for the device)."""
    w, t = report.winner, report.target
    b, h_q, h_kv, n, d, causal = report.shape
    prov = {"device": t.key.name or f"model of {t.profile.name}", "driver": t.driver, "flashcl": __version__,
            "date": report.date, "mode": t.mode, "problem": _shape_text(report.shape),
            "spill": {"spills": w.spills, "signal": w.signal}, "command": report.command}
    if t.mode == "measured":
        prov.update(median_ms=round(w.median_ms, 4), gflops=round(w.gflops, 2), runs=w.runs)
    else:
        prov.update(compiler=t.device_desc, model_floats=w.model_floats,
                    regs_hard=t.profile.regs_hard, regs_budget=t.profile.regs_budget)
    entry = tuning.make_entry(KERNEL, t.key, dtype=report.dtype, dk=d, dv=d, causal=bool(causal), n=n,
                              params=w.params, provenance=prov)
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
    t = report.target
    c = report.conditions()
    lines = [f"# flashcl tune {KERNEL} {c['problem']} {report.dtype} on {t.name} "
             f"(profile {t.profile.name}, {t.mode}), flashcl {__version__}, {report.date}",
             f"# {t.describe()}",
             f"# command: {report.command}" if report.command else "",
             "# time: median of OpenCL profiling events (warm-up first; * = re-timed); spill: the "
             "strongest signal present; regs: compiler-reported; model: floats live per work-item"]
    lines = [ln for ln in lines if ln]
    hdr = (f"{'BLOCK_M':>7} {'BLOCK_N':>7} {'DV_TILE':>7} {'layout':>12}  {'status':6} {'spill':5} "
           f"{'signal':34} {'regs':>4} {'model':>5} {'ms':>9} {'GFLOP/s':>8} {'rel err':>8}  ")
    lines.append(hdr)
    for r in report.results:
        p = r.params
        mark = []
        if r is report.winner:
            mark.append("winner")
        if r is report.largest:
            mark.append("largest non-spilling")
        spill = "-" if r.spills is None else ("yes" if r.spills else "no")
        ms = _fmt(r.median_ms, "9.3f") + ("*" if r.retimed else " ")
        lines.append(
            f"{p['BLOCK_M']:7d} {p['BLOCK_N']:7d} {p['DV_TILE']:7d} {_layout(p):>12}  "
            f"{r.status:6} {spill:5} "
            f"{r.signal[:34]:34} {_fmt(r.registers, '4d'):>4} {r.model_floats:5d} {ms:>10} "
            f"{_fmt(r.gflops, '8.1f'):>8} {_fmt(r.rel_err, '8.1e'):>8}  "
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
                     + (f"  {report.largest.median_ms:.3f} ms, {report.largest.gflops:.1f} GFLOP/s"
                        if report.largest.runs else f"  ({report.largest.model_floats} floats)"))
    else:
        lines.append("# largest non-spilling tile: none")
    if t.mode == "measured":
        lines.append(f"# fastest: {report.fastest.label}  {report.fastest.median_ms:.3f} ms, "
                     f"{report.fastest.gflops:.1f} GFLOP/s" if report.fastest else "# fastest: none")
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


def plot(report: Report, path: str):
    """Time per BLOCK_M x DV_TILE, one panel per BLOCK_N; spilling configurations hatched with
    an S, failed/wrong ones X. Model mode plots the modeled registers instead of time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    res = report.results
    bns = sorted({r.params["BLOCK_N"] for r in res})
    bms = sorted({r.params["BLOCK_M"] for r in res})
    dvs = sorted({r.params["DV_TILE"] for r in res})
    modeled = report.target.mode == "modeled"
    vals = [(r.model_floats if modeled else r.median_ms) for r in res if r.status == "ok"]
    vals = [v for v in vals if v == v] or [0.0, 1.0]
    fig, axes = plt.subplots(1, max(1, len(bns)), figsize=(3.6 * max(1, len(bns)), 3.4), squeeze=False)
    for ax, bn in zip(axes[0], bns):
        grid = np.full((len(dvs), len(bms)), np.nan)
        for r in res:
            if r.params["BLOCK_N"] != bn:
                continue
            i, j = dvs.index(r.params["DV_TILE"]), bms.index(r.params["BLOCK_M"])
            if r.status == "ok":
                grid[i, j] = r.model_floats if modeled else r.median_ms
            ax.text(j, i, "X" if r.status != "ok" else ("S" if r.spills else ""), ha="center", va="center",
                    color="red", fontweight="bold")
        im = ax.imshow(grid, origin="lower", cmap="viridis_r", aspect="auto", vmin=min(vals), vmax=max(vals))
        ax.set_xticks(range(len(bms)), [str(b) for b in bms])
        ax.set_yticks(range(len(dvs)), [str(v) for v in dvs])
        ax.set_xlabel("BLOCK_M")
        ax.set_ylabel("DV_TILE")
        ax.set_title(f"BLOCK_N={bn}")
        fig.colorbar(im, ax=ax, label="model floats" if modeled else "ms (median)")
    fig.suptitle(f"flashcl tune {KERNEL} on {report.target.name} ({report.target.mode}); "
                 f"S = spills, X = failed/wrong", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
