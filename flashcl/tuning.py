"""Tuning spaces, the register/local-memory model, and the tuning database read at run time.

A database is a folder of JSON files ``{"version": 1, "entries": [...]}``; each entry is

    {"kernel": "prefill", "dtype": "float32", "dk": 128, "dv": 128, "causal": true,
     "bucket": 2048, "device": "NVIDIA H100 80GB HBM3", "arch": null, "vendor": "nvidia",
     "params": {"BLOCK_M": 64, "BLOCK_N": 32, "DV_TILE": 64},
     "provenance": {"driver": "...", "flashcl": "0.1.0", "date": "...", "mode": "measured"}}

Lookup (DESIGN.md §5): most specific match first — exact device name, then architecture (for
Adreno the model from the OpenCL C version string), then vendor — trying the user's folder
(``$FLASHCL_TUNING_DIR`` or the platform's user cache dir) before the shipped ``tuning/`` at each
level; else the profile default. Within a level the nearest sequence-length bucket wins. An entry
whose parameters are invalid for the problem or device is skipped with a warning.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

from ._resources import shipped_tuning_dir
from .profiles import DeviceProfile, adreno_model

DB_VERSION = 1


# --------------------------------------------------------------------------- tuning spaces

@dataclass(frozen=True)
class Constraint:
    name: str
    reason: str


# The parameters each kernel takes, their candidate values, and the constraints with reasons.
TUNING_SPACE = {
    "prefill": {
        "params": {
            "BLOCK_M": (16, 32, 64, 128, 256),
            "BLOCK_N": (8, 16, 32, 64),
            "DV_TILE": "divisors of DV that are multiples of 4, at least 16 (or DV itself)",
            "VEC": (4, 8, 16),
        },
        "constraints": (
            Constraint("dv_divisible", "DV must be a multiple of DV_TILE: the passes tile the output exactly"),
            Constraint("vec_divides", "BLOCK_N and DV_TILE must be multiples of VEC: scores and the "
                       "accumulator are VEC-wide vectors"),
            Constraint("local_fits", "K tile + V slice (4 * BLOCK_N * (DK + DV_TILE) bytes) must fit in local memory"),
            Constraint("work_group_fits", "BLOCK_M work-items must not exceed the device's or kernel's max work-group"),
        ),
        "metric": "median kernel time (profiling events); GFLOP/s = 4*B*H*Nq*Nkv*d' / t, causal halves",
    },
}


def dv_tile_candidates(dv: int) -> list[int]:
    return sorted({t for t in range(16, dv + 1, 4) if dv % t == 0} | {dv})


def widest_vec(block_n: int, dv_tile: int, simd: int) -> int:
    """The widest VEC (4, 8, 16) not above ``simd`` that divides BLOCK_N and DV_TILE."""
    return max(w for w in (4, 8, 16) if w <= max(simd, 4) and block_n % w == 0 and dv_tile % w == 0)


def candidate_configs(kernel: str, dk: int, dv: int, simd: int = 4) -> list[dict]:
    space = TUNING_SPACE[kernel]["params"]
    return [{"BLOCK_M": bm, "BLOCK_N": bn, "DV_TILE": t, "VEC": widest_vec(bn, t, simd)}
            for bm in space["BLOCK_M"] for bn in space["BLOCK_N"] for t in dv_tile_candidates(dv)]


def private_floats(kernel: str, params: dict, dk: int, dv: int) -> int:
    """Register model: 32-bit values each work-item keeps live in the prefill inner loop.

    q row (DK) + the DV slice of the accumulator (DV_TILE) + the scores of one KV tile (BLOCK_N)
    + about 16 scalars (m, l, indices, pointers, loop counters).
    """
    return dk + params["DV_TILE"] + params["BLOCK_N"] + 16


def local_bytes(kernel: str, params: dict, dk: int, dv: int) -> int:
    return 4 * params["BLOCK_N"] * (dk + params["DV_TILE"])


def check_params(kernel: str, params: dict, dk: int, dv: int, *, local_mem: int, max_work_group: int) -> list[str]:
    """Every violated constraint as a sentence naming the parameter and the limit; [] when valid."""
    errors = []
    need = ("BLOCK_M", "BLOCK_N", "DV_TILE", "VEC")
    missing = [p for p in need if p not in params]
    unknown = [p for p in params if p not in need]
    if missing or unknown:
        return [f"params must set exactly {need}; missing {missing}, unknown {unknown}"]
    for p in need:
        if isinstance(params[p], bool) or not isinstance(params[p], int) or params[p] < 1:
            errors.append(f"{p}={params[p]!r} must be a positive int")
    if errors:
        return errors
    t, vec = params["DV_TILE"], params["VEC"]
    if vec not in (4, 8, 16):
        errors.append(f"VEC={vec} must be 4, 8 or 16")
    if dv % t:
        errors.append(f"DV_TILE={t} must divide DV={dv}")
    if t % vec or params["BLOCK_N"] % vec:
        errors.append(f"BLOCK_N={params['BLOCK_N']} and DV_TILE={t} must be multiples of VEC={vec}")
    lb = local_bytes(kernel, params, dk, dv)
    if lb > local_mem:
        errors.append(f"BLOCK_N={params['BLOCK_N']}, DV_TILE={t} need {lb} bytes of local memory "
                      f"for DK={dk}; the device has {local_mem}")
    if params["BLOCK_M"] > max_work_group:
        errors.append(f"BLOCK_M={params['BLOCK_M']} exceeds the device's max work-group size {max_work_group}")
    if params["BLOCK_N"] > 256:
        errors.append(f"BLOCK_N={params['BLOCK_N']} is above 256 (the score row is unrolled in registers)")
    return errors


def default_params(kernel: str, profile: DeviceProfile, dk: int, dv: int, *, local_mem: int,
                   max_work_group: int) -> dict:
    """Working parameters for an untuned device: the largest tiles the profile's register budget
    and the device's local memory allow (the same model the tuner uses in model mode); VEC is the
    profile's SIMD width for scores and accumulators (4 on GPUs: one float4 per work-item)."""
    block_m = min(64, max_work_group)
    simd = profile.simd
    for t in sorted(dv_tile_candidates(dv), reverse=True):   # fewest passes first
        for block_n in (64, 32, 16, 8, 4):
            p = {"BLOCK_M": block_m, "BLOCK_N": block_n, "DV_TILE": t, "VEC": widest_vec(block_n, t, simd)}
            if (private_floats(kernel, p, dk, dv) <= profile.regs_hard
                    and local_bytes(kernel, p, dk, dv) <= local_mem):
                return p
    t = min(dv_tile_candidates(dv))
    return {"BLOCK_M": block_m, "BLOCK_N": 4, "DV_TILE": t, "VEC": 4}


# --------------------------------------------------------------------------- database

def seq_bucket(n: int) -> int:
    """Sequence-length bucket: the next power of two, clamped to [16, 131072]."""
    return int(min(max(16, 1 << max(0, math.ceil(math.log2(max(n, 1))))), 131072))


def user_tuning_dir() -> Path:
    env = os.environ.get("FLASHCL_TUNING_DIR")
    if env:
        return Path(env)
    import platformdirs

    return Path(platformdirs.user_cache_dir("flashcl")) / "tuning"


class TuningDatabaseError(ValueError):
    pass


def load_file(path: Path) -> list[dict]:
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as exc:
        raise TuningDatabaseError(f"tuning database {path} is not valid JSON ({exc}); fix or delete it") from None
    if not isinstance(data, dict) or not isinstance(data.get("entries"), list):
        raise TuningDatabaseError(f"tuning database {path} has no 'entries' list; fix or delete it")
    return [dict(e, _file=str(path)) for e in data["entries"] if isinstance(e, dict)]


def _entries(folder: Path) -> list[dict]:
    if not folder.is_dir():
        return []
    out = []
    for f in sorted(folder.glob("*.json")):
        out.extend(load_file(f))
    return out


@dataclass(frozen=True)
class DeviceKey:
    """What the database matches on for one device."""

    name: str
    arch: str | None
    vendor: str
    profile: str

    @staticmethod
    def of(name: str, opencl_c_version: str, vendor: str, profile: str) -> "DeviceKey":
        model = adreno_model(f"{name} {opencl_c_version}")
        arch = f"adreno-{model}" if model else None
        return DeviceKey(name.strip(), arch, profile.split("-")[0] if profile else vendor, profile)


@dataclass(frozen=True)
class Choice:
    params: dict
    source: str          # "tuned <file> (<level>, bucket N, measured|modeled)" or "profile default (<name>)"
    entry: dict | None = None


def lookup(kernel: str, dev: DeviceKey, *, dtype: str, dk: int, dv: int, causal: bool, n: int,
           validate=None) -> Choice | None:
    """The best database entry for this call, or None. ``validate(params) -> [errors]``."""
    folders = [user_tuning_dir(), shipped_tuning_dir()]
    entries_by_folder = [_entries(f) for f in folders]
    bucket = seq_bucket(n)
    levels = (("device", lambda e: e.get("device") == dev.name),
              ("arch", lambda e: dev.arch is not None and e.get("arch") == dev.arch),
              ("vendor", lambda e: e.get("vendor") == dev.vendor and not e.get("device") and not e.get("arch")))
    for level, match in levels:
        for entries in entries_by_folder:
            cands = [e for e in entries if e.get("kernel") == kernel and e.get("dtype") == dtype
                     and e.get("dk") == dk and e.get("dv") == dv and bool(e.get("causal")) == causal
                     and match(e)]
            # nearest bucket; at equal distance a measured entry beats a modeled one
            cands.sort(key=lambda e: (abs(math.log2(max(e.get("bucket", bucket), 1)) - math.log2(bucket)),
                                      e.get("provenance", {}).get("mode") != "measured"))
            for e in cands:
                params = e.get("params")
                errs = validate(params) if validate and isinstance(params, dict) else (
                    [] if isinstance(params, dict) else ["params is not a dict"])
                if errs:
                    warnings.warn(f"ignoring tuning entry in {e['_file']} for {kernel} on {dev.name}: "
                                  f"{'; '.join(errs)}; using the next match or the defaults", stacklevel=3)
                    continue
                mode = e.get("provenance", {}).get("mode", "measured")
                return Choice(dict(params), f"tuned {e['_file']} ({level}, bucket {e.get('bucket')}, {mode})", e)
    return None
