"""Tuning spaces, the register/local-memory model, and the tuning database read at run time.

A database is a folder of JSON files ``{"version": 1, "entries": [...]}``; each entry is

    {"kernel": "prefill", "dtype": "float32", "dk": 128, "dv": 128, "causal": true,
     "bucket": 2048, "device": "NVIDIA H100 80GB HBM3", "arch": null, "vendor": "nvidia",
     "profile": "nvidia", "params": {"BLOCK_M": 64, "BLOCK_N": 32, "DV_TILE": 64, "VEC": 4},
     "provenance": {"device": "...", "driver": "...", "flashcl": "0.1.0", "date": "...",
                    "mode": "measured"}}

A *modeled* entry (``flashcl tune`` for a device that is not attached) has no device or arch:
it is keyed by the profile (``"vendor": "adreno", "profile": "adreno"``) and says
``"mode": "modeled"``; a measured entry for a device of that profile, written to the same file,
replaces it.

Lookup (DESIGN.md §5): most specific match first — exact device name, then architecture (for
Adreno the model from the OpenCL C version string), then the profile (modeled entries), then
vendor — trying the user's folder (``$FLASHCL_TUNING_DIR`` or the platform's user cache dir)
before the shipped ``tuning/`` at each level; else the profile default. Within a level the
nearest sequence-length bucket wins, measured before modeled. An entry whose parameters are
invalid for the problem or device is skipped with a warning naming its file. Each file is parsed
once per version (its size, mtime and inode): a malformed entry (a field of the wrong type) is
skipped with one warning per version naming the file; a file that is not valid JSON, lacks the
``entries`` list, is nested too deeply or cannot be read is an error naming the file
(``TuningDatabaseError``).

Writing (``save_entry``) is a locked read-modify-write through a temporary file and
``os.replace``: concurrent tuners never corrupt a file and readers never see half of one.
"""

from __future__ import annotations

import copy
import itertools
import json
import math
import os
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ._resources import shipped_tuning_dir
from .errors import TuningDatabaseError
from .profiles import DeviceProfile, adreno_model

DB_VERSION = 1


# --------------------------------------------------------------------------- tuning spaces

@dataclass(frozen=True)
class Constraint:
    """A named rule a configuration must satisfy, with why it exists.

    ``check(p, dk, dv, limits) -> str | None`` returns the violation as a sentence naming the
    parameter and the limit, or None. ``limits`` holds ``local_mem`` and ``max_work_group``.
    """

    name: str
    reason: str
    check: Callable[[dict, int, int, dict], str | None] = field(compare=False, repr=False, default=None)


def dv_tile_candidates(dv: int) -> list[int]:
    """Divisors of DV that are multiples of 4 and at least 16, and DV itself."""
    return sorted({t for t in range(16, dv + 1, 4) if dv % t == 0} | {dv})


def _prefill_local_bytes(p: dict, dk: int) -> int:
    return 4 * p["BLOCK_N"] * (dk + p["DV_TILE"])


_PREFILL_CONSTRAINTS = (
    Constraint("dv_divisible", "the DV_TILE passes must tile the output exactly",
               lambda p, dk, dv, lim: None if dv % p["DV_TILE"] == 0 else
               f"DV_TILE={p['DV_TILE']} must divide DV={dv}"),
    Constraint("vec_width", "the kernel has float4, float8 and float16 code paths only",
               lambda p, dk, dv, lim: None if p["VEC"] in (4, 8, 16) else f"VEC={p['VEC']} must be 4, 8 or 16"),
    Constraint("vec_divides", "scores and the accumulator are VEC-wide vectors, so BLOCK_N and "
               "DV_TILE must be multiples of VEC",
               lambda p, dk, dv, lim: None if p["DV_TILE"] % p["VEC"] == 0 and p["BLOCK_N"] % p["VEC"] == 0
               else f"BLOCK_N={p['BLOCK_N']} and DV_TILE={p['DV_TILE']} must be multiples of VEC={p['VEC']}"),
    Constraint("local_fits", "the K tile and V slice live in local memory: "
               "4 * BLOCK_N * (DK + DV_TILE) bytes must fit the device's local memory",
               lambda p, dk, dv, lim: None if _prefill_local_bytes(p, dk) <= lim["local_mem"] else
               f"BLOCK_N={p['BLOCK_N']}, DV_TILE={p['DV_TILE']} need {_prefill_local_bytes(p, dk)} bytes of "
               f"local memory for DK={dk}; the device has {lim['local_mem']}"),
    Constraint("work_group_fits", "BLOCK_M is the work-group size (one query row per work-item), "
               "bounded by the device's max work-group",
               lambda p, dk, dv, lim: None if p["BLOCK_M"] <= lim["max_work_group"] else
               f"BLOCK_M={p['BLOCK_M']} exceeds the device's max work-group size {lim['max_work_group']}"),
    Constraint("score_row_bounded", "the scores of one KV tile are unrolled in registers; above 256 "
               "every device spills",
               lambda p, dk, dv, lim: None if p["BLOCK_N"] <= 256 else
               f"BLOCK_N={p['BLOCK_N']} is above 256 (the score row is unrolled in registers)"),
)

def _tiles_local_bytes(p: dict, dk: int) -> int:
    """Q^T, the K^T-then-V buffer, P^T and the row partials of prefill_tiles.cl."""
    tn = p["BLOCK_N"] // p["TILE_N"]
    return 4 * (dk * p["BLOCK_M"] + max(dk, p["DV_TILE"]) * p["BLOCK_N"]
                + p["BLOCK_N"] * (p["BLOCK_M"] + max(p["TILE_M"], 4)) + p["BLOCK_M"] * (tn + 1))


def _tiles_dv_split(p: dict, dk: int, dv: int, lim: dict):
    tn = p["BLOCK_N"] // p["TILE_N"]
    if p["DV_TILE"] % tn == 0 and (p["DV_TILE"] // tn) % 4 == 0:
        return None
    return (f"DV_TILE={p['DV_TILE']} must split into BLOCK_N/TILE_N={tn} column blocks of a multiple "
            f"of 4 (each work-item owns DV_TILE/{tn} output columns, stored as float4)")


_TILES_CONSTRAINTS = (
    Constraint("micro_tile", "the kernel has 2-, 4- and 8-wide vector paths for its micro-tiles",
               lambda p, dk, dv, lim: None if p["TILE_M"] in (2, 4, 8) and p["TILE_N"] in (2, 4, 8) else
               f"TILE_M={p['TILE_M']} and TILE_N={p['TILE_N']} must be 2, 4 or 8"),
    Constraint("tiles_divide", "the work-items cover the BLOCK_M x BLOCK_N score tile exactly",
               lambda p, dk, dv, lim: None if p["BLOCK_M"] % p["TILE_M"] == 0 and p["BLOCK_N"] % p["TILE_N"] == 0
               else f"TILE_M={p['TILE_M']} must divide BLOCK_M={p['BLOCK_M']} and TILE_N={p['TILE_N']} "
                    f"BLOCK_N={p['BLOCK_N']}"),
    Constraint("dv_divisible", "the DV_TILE passes must tile the output exactly",
               lambda p, dk, dv, lim: None if dv % p["DV_TILE"] == 0 else
               f"DV_TILE={p['DV_TILE']} must divide DV={dv}"),
    Constraint("dv_split", "the BLOCK_N / TILE_N work-items of a row share the DV slice in float4 columns",
               _tiles_dv_split),
    Constraint("local_fits", "Q^T, the K/V buffer and P^T live in local memory",
               lambda p, dk, dv, lim: None if _tiles_local_bytes(p, dk) <= lim["local_mem"] else
               f"BLOCK_M={p['BLOCK_M']}, BLOCK_N={p['BLOCK_N']}, DV_TILE={p['DV_TILE']} need "
               f"{_tiles_local_bytes(p, dk)} bytes of local memory for DK={dk}; the device has {lim['local_mem']}"),
    Constraint("work_group_fits", "one work-item per TILE_M x TILE_N block: (BLOCK_M/TILE_M)*(BLOCK_N/TILE_N) "
               "work-items, bounded by the device's max work-group",
               lambda p, dk, dv, lim: None if work_group_size("prefill", p) <= lim["max_work_group"] else
               f"a work-group of {work_group_size('prefill', p)} exceeds the device's max {lim['max_work_group']}"),
    Constraint("unroll_k", "UNROLL_K is an unroll factor of the loops over head dims and keys (0: full)",
               lambda p, dk, dv, lim: None if p.get("UNROLL_K", 0) in (0, 2, 4, 8, 16) else
               f"UNROLL_K={p['UNROLL_K']} must be 0, 2, 4, 8 or 16"),
)

# The tuning space of each kernel as data (CLBlast / kernel_tuner style): the parameters with their
# candidate values (``values`` for a full sweep, ``quick`` for ``flashcl tune --quick``), the named
# constraints, the problem the kernel is tuned on, and the metric. A callable value list is
# evaluated per problem (DV_TILE depends on DV); VEC is derived per device unless listed explicitly.
TUNING_SPACE = {
    "prefill": {
        # Two layouts of the same kernel contract. A configuration of "tiles" carries
        # "VARIANT": "tiles"; one without VARIANT is "rows".
        "variants": {
            "rows": {
                "source": "prefill.cl",
                "devices": "every device (the only layout on CPUs)",
                "params": {
                    "BLOCK_M": {"values": (16, 32, 64, 128, 256), "quick": (32, 64, 128),
                                "meaning": "query rows per work-group = work-group size"},
                    "BLOCK_N": {"values": (8, 16, 32, 64), "quick": (16, 32),
                                "meaning": "KV rows per local-memory tile (scores kept in registers)"},
                    "DV_TILE": {"values": dv_tile_candidates,
                                "quick": lambda dv: sorted({dv, dv // 2} & set(dv_tile_candidates(dv))),
                                "meaning": "output columns accumulated per pass (accumulator in registers)"},
                    "VEC": {"values": "derived: the widest of 4, 8, 16 not above the profile's SIMD width "
                                      "that divides BLOCK_N and DV_TILE", "quick": "derived",
                            "meaning": "vector width of the score and accumulator arithmetic"},
                    "Q_IN_REGS": {"values": (1, 0), "quick": (1,),
                                  "meaning": "1: the q row stays in registers; 0: q is re-read from cache per "
                                             "KV tile, freeing DK registers (optional, default 1)"},
                },
                "constraints": _PREFILL_CONSTRAINTS,
            },
            "tiles": {
                "source": "prefill_tiles.cl",
                "devices": "GPUs: on PoCL it measured 20-35x slower than rows (1,8/2,512,128 causal: "
                           "0.8-1.3 against 27 GFLOP/s), so CPU sweeps leave it out",
                "params": {
                    "BLOCK_M": {"values": (64, 128), "quick": (64,), "meaning": "query rows per work-group"},
                    "BLOCK_N": {"values": (16, 32), "quick": (16,), "meaning": "KV rows per local-memory tile"},
                    "DV_TILE": {"values": dv_tile_candidates, "quick": lambda dv: [dv],
                                "meaning": "output columns per work-group"},
                    "TILE_M": {"values": (4, 8), "quick": (8,), "meaning": "query rows per work-item"},
                    "TILE_N": {"values": (2, 8), "quick": (2,), "meaning": "keys per work-item"},
                    "UNROLL_K": {"values": (4, 8), "quick": (4,),
                                 "meaning": "unroll factor of the loops over head dims and keys (0: full)"},
                },
                "constraints": _TILES_CONSTRAINTS,
            },
        },
        "problem": "PrefillProblem(B, H_q, H_kv, N_q = N_kv = N, DK = DV = d, causal, dtype); entries are "
                   "keyed by kernel, dtype, DK, DV, causal and the power-of-two bucket of N",
        "metric": "median kernel time over >= 5 runs (OpenCL profiling events), lower is better; "
                  "GFLOP/s = 2*B*H_q*(DK+DV)*(visible query-key pairs) / t (causal counts about half)",
        "correctness": "relative error against the float64 oracle on a small problem "
                       "(B=1, H_q=2, H_kv=1, N=261: crosses every tile edge) within the dtype's tolerance",
    },
}

# The parameters a configuration of each layout must set, and may set.
_REQUIRED = {"rows": ("BLOCK_M", "BLOCK_N", "DV_TILE", "VEC"),
             "tiles": ("BLOCK_M", "BLOCK_N", "DV_TILE", "TILE_M", "TILE_N")}
_OPTIONAL = {"rows": ("Q_IN_REGS", "VARIANT"), "tiles": ("UNROLL_K", "VARIANT")}


def variant_of(params: dict) -> str:
    return params.get("VARIANT", "rows") if isinstance(params, dict) else "rows"


def tunable_names(kernel: str) -> set[str]:
    """Every parameter name of every layout of ``kernel`` (for --param), plus VARIANT."""
    names = {"VARIANT"}
    for spec in TUNING_SPACE[kernel]["variants"].values():
        names |= set(spec["params"])
    return names


def widest_vec(block_n: int, dv_tile: int, simd: int) -> int:
    """The widest VEC (4, 8, 16) not above ``simd`` that divides BLOCK_N and DV_TILE."""
    return max(w for w in (4, 8, 16) if w <= max(simd, 4) and block_n % w == 0 and dv_tile % w == 0)


def _derived_vec(block_n: int, dv_tile: int, simd: int) -> int:
    """VEC for a candidate; 4 where nothing divides, so that the constraint says why."""
    try:
        return widest_vec(block_n, dv_tile, simd)
    except ValueError:
        return 4


def _values(spec, dv: int):
    return list(spec(dv)) if callable(spec) else list(spec)


def candidate_configs(kernel: str, dk: int, dv: int, simd: int = 4, *, quick: bool = False,
                      overrides: dict | None = None, variants=None) -> list[dict]:
    """Every combination of the space's candidate values, for each layout in ``variants`` (default
    all; ``overrides["VARIANT"]`` narrows them). ``overrides`` replaces a parameter's list, e.g.
    ``{"BLOCK_M": [64]}``, in every layout that has it; VEC is derived from ``simd`` unless
    overridden. Not yet filtered by the constraints: see ``check_params``."""
    spaces = TUNING_SPACE[kernel]["variants"]
    which = "quick" if quick else "values"
    overrides = overrides or {}
    chosen = [v for v in (variants or spaces) if v in spaces]
    if "VARIANT" in overrides:
        chosen = [v for v in chosen if v in overrides["VARIANT"]]
    out = []
    for variant in chosen:
        space = spaces[variant]["params"]
        vals = {p: list(overrides[p]) if p in overrides else _values(space[p][which], dv)
                for p in space if not isinstance(space[p][which], str)}
        if variant == "rows":
            for bm, bn, t in itertools.product(vals["BLOCK_M"], vals["BLOCK_N"], vals["DV_TILE"]):
                vecs = overrides.get("VEC") or [_derived_vec(bn, t, simd)]
                for vec, q_in_regs in itertools.product(vecs, vals["Q_IN_REGS"]):
                    p = {"BLOCK_M": bm, "BLOCK_N": bn, "DV_TILE": t, "VEC": vec}
                    if not q_in_regs:
                        p["Q_IN_REGS"] = 0
                    out.append(p)
        else:
            names = list(vals)
            for combo in itertools.product(*(vals[n] for n in names)):
                out.append({"VARIANT": variant, **dict(zip(names, combo))})
    return out


def private_floats(kernel: str, params: dict, dk: int, dv: int) -> int:
    """Register model: 32-bit values each work-item keeps live in the prefill inner loop.

    Rows layout: the q row (DK, or one float4 chunk when Q_IN_REGS=0), the DV slice of the
    accumulator, the scores of one KV tile, and about 40 scalars (m, l, indices, pointers, loop
    counters). The weights, 1.25 per accumulator column and 0.75 per score, are fitted to ptxas on
    an H100 (2026-11-21; 148 builds at d=64/128, BLOCK_N 8-64, DV_TILE 16-128, Q_IN_REGS 0/1): the
    unrolled P V loop keeps V values in flight in proportion to DV_TILE, while scores and
    probabilities share registers. It agrees with ptxas's spill verdict on 51 of 56 builds capped
    at Adreno's 192 registers (-cl-nv-maxrregcount=192, FIXED_WG=0) and 87 of 92 at 255; the
    earlier q + DV_TILE + BLOCK_N + 48 agreed on 48 and 86. Both figures are in-sample. Half
    storage does not change it: the kernel computes in float32.
    """
    if variant_of(params) == "tiles":
        # scores (reused for P) TILE_M x TILE_N, the accumulator TILE_M x DV_TILE/(BLOCK_N/TILE_N),
        # m and l per row, one q and one k operand vector, and 60 scalars (indices, addresses and
        # in-flight local loads). The 60 is fitted to ptxas on the H100 (2026-11-21, UNROLL_K 4/8):
        # 167-168 registers at 8x2 with 8 columns (model 166), 237-245 at 4x8 with 32 (model 240).
        tm, tn = params["TILE_M"], params["TILE_N"]
        rd = params["DV_TILE"] // max(1, params["BLOCK_N"] // tn)
        return tm * tn + tm * rd + 2 * tm + tm + tn + 60
    q = dk if params.get("Q_IN_REGS", 1) else 4
    return q + (5 * params["DV_TILE"] + 3 * params["BLOCK_N"]) // 4 + 40


def local_bytes(kernel: str, params: dict, dk: int, dv: int) -> int:
    if variant_of(params) == "tiles":
        return _tiles_local_bytes(params, dk)
    return _prefill_local_bytes(params, dk)


def work_group_size(kernel: str, params: dict) -> int:
    """Work-items per work-group: BLOCK_M for the row layout (one query row each); for the
    micro-tiled layout one work-item per TILE_M x TILE_N block of the BLOCK_M x BLOCK_N scores."""
    if params.get("VARIANT", "rows") == "tiles":
        return (params["BLOCK_M"] // params["TILE_M"]) * (params["BLOCK_N"] // params["TILE_N"])
    return params["BLOCK_M"]


def spill_model(kernel: str, params: dict, dk: int, dv: int, profile: DeviceProfile) -> dict:
    """What the profile's register model predicts for one configuration."""
    floats = private_floats(kernel, params, dk, dv)
    return {"floats": floats, "regs_hard": profile.regs_hard, "regs_budget": profile.regs_budget,
            "spills": floats > profile.regs_hard, "over_budget": floats > profile.regs_budget,
            "kernel_max_work_group": profile.kernel_max_work_group(floats)}


def check_params(kernel: str, params: dict, dk: int, dv: int, *, local_mem: int, max_work_group: int) -> list[str]:
    """Every violated constraint as a sentence naming the parameter and the limit; [] when valid."""
    return [msg for _, msg in violations(kernel, params, dk, dv, local_mem=local_mem,
                                         max_work_group=max_work_group)]


def violations(kernel: str, params: dict, dk: int, dv: int, *, local_mem: int,
               max_work_group: int) -> list[tuple[str, str]]:
    """(constraint name, sentence) for every violated constraint of ``kernel``."""
    if not isinstance(params, dict):
        return [("well_formed", f"params must be a dict, got {type(params).__name__}")]
    variant = params.get("VARIANT", "rows")
    spaces = TUNING_SPACE[kernel]["variants"]
    if not isinstance(variant, str) or variant not in spaces:
        return [("well_formed", f"VARIANT={variant!r} must be one of {sorted(spaces)}")]
    need, optional = _REQUIRED[variant], _OPTIONAL[variant]
    missing = [p for p in need if p not in params]
    unknown = [p for p in params if p not in need + optional]
    if missing or unknown:
        return [("well_formed", f"params of the {variant!r} layout must set {need} (optionally {optional}); "
                                f"missing {missing}, unknown {unknown}")]
    if params.get("Q_IN_REGS", 1) not in (0, 1) or isinstance(params.get("Q_IN_REGS"), bool):
        return [("well_formed", f"Q_IN_REGS={params['Q_IN_REGS']!r} must be 0 or 1")]
    ints = need + tuple(p for p in ("UNROLL_K",) if p in params)
    bad = [("well_formed", f"{p}={params[p]!r} must be a positive int") for p in ints
           if isinstance(params[p], bool) or not isinstance(params[p], int)
           or params[p] < (0 if p == "UNROLL_K" else 1)]
    if bad:
        return bad
    limits = {"local_mem": local_mem, "max_work_group": max_work_group}
    out = []
    for c in spaces[variant]["constraints"]:
        msg = c.check(params, dk, dv, limits)
        if msg:
            out.append((c.name, msg))
    return out


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


# Deeper than this, a provenance is not one flashcl wrote (flashcl's go two levels deep), and
# printing it (show-config) would recurse as deep.
_MAX_PROVENANCE_DEPTH = 8


def _json_kind(x) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "a number",
             float: "a number", type(None): "null"}
    return names.get(type(x), type(x).__name__)


def _deeper_than(x, levels: int) -> bool:
    if not isinstance(x, (dict, list)):
        return False
    if levels == 0:
        return True
    return any(_deeper_than(v, levels - 1) for v in (x.values() if isinstance(x, dict) else x))


def _entry_problem(e) -> str | None:
    """Why ``e`` cannot be an entry (a field lookup would fail or match wrongly), or None.
    Whether its params suit a device is checked at lookup, against that device."""
    if not isinstance(e, dict):
        return f"is {_json_kind(e)}, not an object"

    def field_kind(name):
        return _json_kind(e[name]) if name in e else "missing"

    for name in ("kernel", "dtype"):
        if not isinstance(e.get(name), str):
            return f"'{name}' is {field_kind(name)}, expected a string"
    for name in ("dk", "dv", "bucket"):
        v = e.get(name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            return f"'{name}' is {v!r}, expected a positive integer" if name in e else f"'{name}' is missing"
    if not isinstance(e.get("causal"), bool):
        return f"'causal' is {field_kind('causal')}, expected true or false"
    for name in ("device", "arch", "vendor", "profile"):
        if e.get(name) is not None and not isinstance(e[name], str):
            return f"'{name}' is {field_kind(name)}, expected a string or null"
    if not isinstance(e.get("params"), dict):
        return f"'params' is {field_kind('params')}, expected an object"
    prov = e.get("provenance")
    if prov is not None and not isinstance(prov, dict):
        return f"'provenance' is {field_kind('provenance')}, expected an object"
    if _deeper_than(prov, _MAX_PROVENANCE_DEPTH):
        return f"'provenance' is nested more than {_MAX_PROVENANCE_DEPTH} levels deep"
    return None


def _read(path: Path) -> dict:
    """The file's JSON, checked to be ``{"entries": [...], ...}``; TuningDatabaseError otherwise."""
    try:
        data = json.loads(Path(path).read_bytes())
    except json.JSONDecodeError as exc:
        raise TuningDatabaseError(f"tuning database {path} is not valid JSON ({exc}); fix or delete it") from None
    except RecursionError:
        raise TuningDatabaseError(f"tuning database {path} is nested too deeply to be a tuning database; "
                                  f"fix or delete it") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise TuningDatabaseError(f"tuning database {path} cannot be read ({exc}); fix or delete it") from None
    if not isinstance(data, dict) or not isinstance(data.get("entries"), list):
        raise TuningDatabaseError(f"tuning database {path} has no 'entries' list; fix or delete it")
    return data


@dataclass(frozen=True)
class _DbFile:
    """One parsed version of a database file: its well-formed entries (each with ``_file``), in
    file order and indexed by problem; ``candidates`` remembers each level's matches per device,
    so a repeated lookup costs no scan of the file."""

    entries: tuple
    by_problem: dict
    matches: dict = field(default_factory=dict, compare=False)

    def candidates(self, problem: tuple, level: str, match, dev) -> list:
        key = (problem, level, dev)
        found = self.matches.get(key)
        if found is None:
            found = self.matches[key] = [e for e in self.by_problem.get(problem, ()) if match(e, dev)]
        return found


def _problem_key(kernel, dtype, dk, dv, causal) -> tuple:
    return (kernel, dtype, dk, dv, bool(causal))


def _parse(path: Path) -> _DbFile:
    entries, bad, by_problem = [], [], {}
    for i, raw in enumerate(_read(path)["entries"]):
        problem = _entry_problem(raw)
        if problem:
            bad.append(f"entries[{i}] {problem}")
            continue
        e = dict(raw, _file=str(path))
        entries.append(e)
        by_problem.setdefault(_problem_key(e["kernel"], e["dtype"], e["dk"], e["dv"], e["causal"]), []).append(e)
    if bad:
        more = f"; and {len(bad) - 3} more" if len(bad) > 3 else ""
        warnings.warn(f"tuning database {path}: skipped {len(bad)} malformed entr{'y' if len(bad) == 1 else 'ies'} "
                      f"({'; '.join(bad[:3])}{more}); fix or delete them", stacklevel=2)
    return _DbFile(tuple(entries), by_problem)


# path -> (stamp, _DbFile or the TuningDatabaseError it raised): every call of flashcl.prefill
# looks the database up, so a file is parsed (and warned about) once per version.
_parsed: dict[str, tuple] = {}
_parsed_lock = threading.Lock()


def _load(path: Path) -> _DbFile | None:
    """The parsed file, None if it does not exist."""
    path = Path(path)
    # Stat before reading: a write racing the read leaves a stamp newer than the one cached, so
    # the next call parses again. os.replace gives every save a new inode, so two saves of the
    # same size within one clock tick still differ.
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise TuningDatabaseError(f"tuning database {path} cannot be read ({exc}); fix or delete it") from None
    stamp = (st.st_size, st.st_mtime_ns, st.st_ino)
    with _parsed_lock:
        hit = _parsed.get(str(path))
        if hit is None or hit[0] != stamp:
            try:
                hit = (stamp, _parse(path))
            except TuningDatabaseError as exc:
                hit = (stamp, exc)
            _parsed[str(path)] = hit
    if isinstance(hit[1], TuningDatabaseError):
        raise TuningDatabaseError(*hit[1].args)
    return hit[1]


def load_file(path: Path) -> list[dict]:
    """The well-formed entries of one database file, each with ``_file`` (copies: the parsed file
    is shared by every lookup). Malformed entries are skipped with one warning per file version;
    a file that cannot be one raises TuningDatabaseError naming it."""
    db = _load(path)
    if db is None:
        raise TuningDatabaseError(f"tuning database {path} does not exist")
    return [_copy_entry(e) for e in db.entries]


def _files(folder: Path) -> list[_DbFile]:
    if not folder.is_dir():
        return []
    found = (_load(f) for f in sorted(folder.glob("*.json")))
    return [db for db in found if db is not None]  # None: removed since the listing


def _copy_entry(e: dict) -> dict:
    """A copy to hand out: its params and provenance (the parts callers read) are its own. Not a
    deepcopy: a field flashcl does not read may be nested deeper than copying recurses."""
    return dict(e, params=dict(e["params"]), provenance=copy.deepcopy(e.get("provenance")))


def _mode(e) -> str | None:
    prov = e.get("provenance") if isinstance(e, dict) else None
    return prov.get("mode") if isinstance(prov, dict) else None


@dataclass(frozen=True)
class DeviceKey:
    """What the database matches on for one device: its exact name, its architecture (Adreno:
    "adreno-740" from the OpenCL C version string), its profile ("adreno-6xx") and vendor
    ("adreno", the profile family)."""

    name: str
    arch: str | None
    vendor: str
    profile: str

    @staticmethod
    def of(name: str, opencl_c_version: str, vendor: str, profile: str) -> "DeviceKey":
        model = adreno_model(f"{name} {opencl_c_version}")
        arch = f"adreno-{model}" if model else None
        return DeviceKey(name.strip(), arch, profile.split("-")[0] if profile else vendor, profile)

    @staticmethod
    def modeled(profile: DeviceProfile) -> "DeviceKey":
        """The key of a profile standing in for an absent device (model mode)."""
        return DeviceKey("", None, profile.name.split("-")[0], profile.name)


@dataclass(frozen=True)
class Choice:
    params: dict
    source: str          # "tuned <file> (<level>, bucket N, measured|modeled)" or "profile default (<name>)"
    entry: dict | None = None


# Match levels, most specific first (DESIGN.md §5). The profile level holds modeled entries (a
# profile's vendor and name, no device): "adreno-6xx" must not borrow the a7xx model's tiles.
_LEVELS = (
    ("device", lambda e, d: bool(d.name) and e.get("device") == d.name),
    ("arch", lambda e, d: d.arch is not None and e.get("arch") == d.arch and not e.get("device")),
    ("profile", lambda e, d: e.get("profile") == d.profile and not e.get("device") and not e.get("arch")),
    ("vendor", lambda e, d: e.get("vendor") == d.vendor and not e.get("device") and not e.get("arch")
     and not e.get("profile")),
)

_PROBLEM_FIELDS = ("kernel", "dtype", "dk", "dv", "causal", "bucket")


def lookup(kernel: str, dev: DeviceKey, *, dtype: str, dk: int, dv: int, causal: bool, n: int,
           validate=None) -> Choice | None:
    """The best database entry for this call, or None. ``validate(params) -> [errors]``.

    An entry whose parameters fail ``validate`` (a hand-edited file, a database from another
    device) is skipped with a warning naming the file; the next match or the defaults are used.
    """
    problem = _problem_key(kernel, dtype, dk, dv, causal)
    files_by_folder = [_files(folder) for folder in (user_tuning_dir(), shipped_tuning_dir())]
    bucket = seq_bucket(n)
    for level, match in _LEVELS:
        for files in files_by_folder:
            cands = [e for db in files for e in db.candidates(problem, level, match, dev)]
            # nearest bucket; at equal distance a measured entry beats a modeled one
            cands.sort(key=lambda e: (abs(math.log2(e["bucket"]) - math.log2(bucket)), _mode(e) != "measured"))
            for e in cands:
                errs = validate(e["params"]) if validate else []
                if errs:
                    warnings.warn(f"ignoring tuning entry in {e['_file']} for {kernel} on {dev.name or dev.profile}: "
                                  f"{'; '.join(errs)}; using the next match or the defaults", stacklevel=3)
                    continue
                return Choice(dict(e["params"]), f"tuned {e['_file']} ({level}, bucket {e['bucket']}, "
                                                 f"{_mode(e) or 'measured'})", _copy_entry(e))
    return None


# --------------------------------------------------------------------------- writing

def make_entry(kernel: str, dev: DeviceKey, *, dtype: str, dk: int, dv: int, causal: bool, n: int,
               params: dict, provenance: dict) -> dict:
    """A database entry; ``provenance`` holds device, driver, flashcl, date, mode (measured|modeled)
    and whatever else explains the choice (time, metric, command)."""
    return {"kernel": kernel, "dtype": dtype, "dk": dk, "dv": dv, "causal": bool(causal), "bucket": seq_bucket(n),
            "device": dev.name or None, "arch": dev.arch, "vendor": dev.vendor, "profile": dev.profile,
            "params": dict(params), "provenance": dict(provenance)}


def _same_slot(a: dict, b: dict) -> bool:
    return all(a.get(f) == b.get(f) for f in _PROBLEM_FIELDS + ("device", "arch", "vendor", "profile"))


def _superseded(old: dict, new: dict) -> bool:
    """A measured entry replaces the modeled entry of its profile for the same problem."""
    return (_mode(new) == "measured" and _mode(old) == "modeled"
            and all(old.get(f) == new.get(f) for f in _PROBLEM_FIELDS)
            and old.get("profile") == new.get("profile") and not old.get("device"))


def default_db_file(dev: DeviceKey, folder: Path | None = None) -> Path:
    """Where ``flashcl tune`` writes by default: one file per device (or modeled profile) in the
    user tuning dir, so databases can be shared and removed per device."""
    import re

    stem = re.sub(r"[^A-Za-z0-9]+", "-", dev.name).strip("-").lower() if dev.name else f"model-{dev.profile}"
    return Path(folder or user_tuning_dir()) / f"{stem or 'device'}.json"


def save_entry(entry: dict, path: Path) -> list[dict]:
    """Insert ``entry`` into the database file ``path`` (created if missing) and return the
    entries it replaced. Concurrent writers are serialized by an exclusive lock on
    ``path.lock``; the file is rewritten through a temporary file and ``os.replace``, so a reader
    never sees half a file and a crash leaves the old one intact. A corrupt file is an error
    naming it, never silently overwritten; malformed entries are kept as they are."""
    import fcntl
    import tempfile

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            # read here, not through the cache: the lock makes this read the one the write replaces
            old = _read(path)["entries"] if path.exists() else []
            gone = [isinstance(e, dict) and (_same_slot(e, entry) or _superseded(e, entry)) for e in old]
            replaced = [e for e, g in zip(old, gone) if g]
            kept = [e for e, g in zip(old, gone) if not g]
            data = {"version": DB_VERSION, "entries": kept + [entry]}
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump(data, f, indent=2)
                    f.write("\n")
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)
            except BaseException:
                if os.path.exists(tmp):
                    os.unlink(tmp)
                raise
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return replaced


def resolve(kernel: str, handle, params: dict | None, *, errors, default, dtype: str, dk: int,
            dv: int, causal: bool, n: int) -> Choice:
    """The parameters a call runs with: the caller's ``params`` (invalid ones are a ValueError),
    else the best valid database entry for this device, else ``default()`` -- the profile's.
    ``errors(params) -> [sentences]`` validates against the kernel's constraints and the device."""
    if params is not None:
        errs = errors(params)
        if errs:
            raise ValueError("params: " + "; ".join(errs))
        return Choice(dict(params), "params= override")
    key = DeviceKey.of(handle.name, handle.device.opencl_c_version, handle.device.vendor, handle.profile.name)
    found = lookup(kernel, key, dtype=dtype, dk=dk, dv=dv, causal=causal, n=n, validate=errors)
    if found is not None:
        return found
    return Choice(default(), f"profile default ({handle.profile.name})")

