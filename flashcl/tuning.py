"""Tuning spaces, the register/local-memory model, and the tuning database read at run time.

**Spaces.** Each kernel declares its tuning space as data, a :class:`KernelSpace` in ``SPACES``:
its layouts (the ``.cl`` sources a configuration may select), each with its parameters (candidate
values for a full sweep and for ``--quick``, and what each means) and its named constraints with
the reason for each; the register model (32-bit values a work-item keeps live), local memory and
work-group size of a configuration; the default for a device profile; the order of "largest
tile" that model mode chooses by; the problem it is tuned on and the metric. The tuner, the
parameter choice of every call and ``show-config`` all go through it.

**Database.** A folder of JSON files ``{"version": 1, "entries": [...]}``; each entry is

    {"kernel": "prefill", "dtype": "float32", "dk": 128, "dv": 128, "causal": true,
     "bucket": 2048, "device": "NVIDIA H100 80GB HBM3", "arch": "nvidia-sm90", "vendor": "nvidia",
     "profile": "nvidia", "params": {"BLOCK_M": 64, "BLOCK_N": 32, "DV_TILE": 64, "VEC": 4},
     "provenance": {"device": "...", "driver": "...", "flashcl": "0.1.0", "date": "...",
                    "mode": "measured"}}

Decode entries also carry ``"group"`` (H_q / H_kv): HEAD_TILE must divide it. An entry without
one applies to every group, after those of the exact group.

A *modeled* entry (``flashcl tune`` for a device that is not attached) has no device or arch:
it is keyed by the profile (``"vendor": "adreno", "profile": "adreno"``) and says
``"mode": "modeled"``; a measured entry for a device of that profile, written to the same file,
replaces it.

Lookup: most specific match first -- the exact device, then a measured relative of the same
architecture (:func:`device_arch`: NVIDIA compute capability, Adreno model, Mali GPU, Intel
product line, AMD gfx id), then of the same family (:func:`arch_family`), then the profile
(modeled entries), then vendor -- trying the user's folder (``$FLASHCL_TUNING_DIR`` or the
platform's user cache dir) before the shipped ``tuning/`` at each level; else the profile
default. Within a level the nearest sequence-length bucket wins, measured before modeled. An
entry whose parameters are invalid for the problem or device is skipped with a warning naming its
file. Each file is parsed once per version (its size, mtime and inode): a malformed entry (a
field of the wrong type) is skipped with one warning per version naming the file; a file that is
not valid JSON, lacks the ``entries`` list, is nested too deeply or cannot be read is an error
naming the file (``TuningDatabaseError``).

Writing (``save_entry``) is a locked read-modify-write through a temporary file and
``os.replace``: concurrent tuners never corrupt a file and readers never see half of one.
"""

from __future__ import annotations

import copy
import functools
import json
import math
import os
import re
import stat
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ._resources import shipped_tuning_dir
from .errors import TuningDatabaseError
from .profiles import DeviceProfile, arch_family, device_arch

DB_VERSION = 1


# --------------------------------------------------------------------------- the space interface

@dataclass(frozen=True)
class Dims:
    """The problem class a configuration is checked against: head dims, and for decode the GQA
    group G = H_q / H_kv and the storage dtype (decode reads rows in 16-byte chunks of it)."""

    dk: int
    dv: int
    group: int = 1
    dtype: str = "float32"


@dataclass(frozen=True)
class Constraint:
    """A named rule a configuration must satisfy, with why it exists.

    ``check(p, dims, limits) -> str | None`` returns the violation as a sentence naming the
    parameter and the limit, or None. ``limits`` holds ``local_mem`` and ``max_work_group``.
    ``final``: a violation ends the checks, because the later ones assume this one holds.
    """

    name: str
    reason: str
    check: Callable[[dict, Dims, dict], str | None] = field(compare=False, repr=False, default=None)
    final: bool = False


# Candidate values computed per candidate by the space (prefill's VEC), not listed.
DERIVED = "derived"


@dataclass(frozen=True)
class Param:
    """One tunable. ``values`` (a full sweep) and ``quick`` (``--quick``) are a tuple, a function
    of the Dims, or DERIVED. An optional parameter has a ``default`` that its absence stands for;
    ``omit_default`` leaves it out of a configuration at that value. ``choices`` are the only values
    accepted (else an int >= ``minimum``). ``host``: read by the host code, not a ``-D`` define."""

    name: str
    values: object
    quick: object
    meaning: str
    default: int | None = None
    choices: tuple | None = None
    minimum: int = 1
    host: bool = False
    omit_default: bool = False


@dataclass(frozen=True)
class Layout:
    """One kernel source a configuration may select, with its parameters and constraints."""

    name: str
    source: str
    devices: str
    params: tuple
    constraints: tuple

    @property
    def required(self) -> tuple:
        return tuple(p.name for p in self.params if p.default is None)

    @property
    def optional(self) -> tuple:
        return tuple(p.name for p in self.params if p.default is not None)

    def param(self, name: str) -> Param | None:
        return next((p for p in self.params if p.name == name), None)


@dataclass(frozen=True)
class KernelSpace:
    """A kernel's tuning space as data. A configuration of a layout other than the first names
    it with ``"VARIANT"``.

    The callables take a configuration and the Dims: ``private_floats`` (the register model),
    ``local_bytes``, ``work_group_size``; ``defaults(profile, dims, limits)`` is the configuration
    of an untuned device; ``rank(params, dims, profile)`` orders configurations by "largest tile"
    (model mode picks the highest that the model predicts not to spill); ``derive(name, partial,
    dims, simd)`` computes a DERIVED parameter. ``modeled_layouts`` are the layouts whose register
    model was checked against a compiler, the only ones model mode may choose; ``layouts_for``
    narrows the layouts swept on a profile.
    """

    kernel: str
    layouts: tuple
    problem: str
    metric: str
    correctness: str
    register_model: str
    private_floats: Callable[[dict, Dims], int]
    local_bytes: Callable[[dict, Dims], int]
    work_group_size: Callable[[dict, Dims], int]
    defaults: Callable[[DeviceProfile, Dims, dict], dict]
    rank: Callable[[dict, Dims, DeviceProfile], tuple]
    derive: Callable | None = None
    modeled_layouts: tuple | None = None
    layouts_for: Callable[[DeviceProfile], tuple] | None = None

    @property
    def layout_names(self) -> tuple:
        return tuple(lay.name for lay in self.layouts)

    def layout(self, name: str) -> Layout:
        return next(lay for lay in self.layouts if lay.name == name)

    def layout_of(self, params: dict) -> Layout:
        name = params.get("VARIANT", self.layouts[0].name) if isinstance(params, dict) else None
        return self.layout(name) if name in self.layout_names else self.layouts[0]

    def param_names(self) -> set:
        """Every parameter of every layout (``--param`` names), plus VARIANT where there are several."""
        names = {p.name for lay in self.layouts for p in lay.params}
        return names | {"VARIANT"} if len(self.layouts) > 1 else names

    def host_params(self) -> set:
        return {p.name for lay in self.layouts for p in lay.params if p.host}

    def value(self, params: dict, name: str):
        """A parameter's value in ``params``, its default where an optional one is absent."""
        prm = self.layout_of(params).param(name)
        return params.get(name, prm.default if prm else None)

    def candidates(self, dims: Dims, simd: int = 4, *, quick: bool = False, overrides: dict | None = None,
                   layouts=None, skip=()) -> list:
        """Every combination of the candidate values, for each layout in ``layouts`` (default all;
        ``overrides["VARIANT"]`` narrows them), parameters in declared order. ``overrides``
        replaces a parameter's list in every layout that has it; ``skip`` leaves parameters out
        (their defaults apply). Not yet filtered by the constraints: see ``violations``."""
        overrides = overrides or {}
        chosen = [n for n in (self.layout_names if layouts is None else layouts) if n in self.layout_names]
        if "VARIANT" in overrides:
            chosen = [n for n in chosen if n in overrides["VARIANT"]]
        out = []
        for name in chosen:
            lay = self.layout(name)
            partial = [{} if lay is self.layouts[0] else {"VARIANT": name}]
            for prm in lay.params:
                if prm.name in skip:
                    continue
                grown = []
                for p in partial:
                    for v in self._values(prm, p, dims, simd, quick, overrides):
                        grown.append(p if prm.omit_default and v == prm.default else {**p, prm.name: v})
                partial = grown
            out += partial
        return out

    def param_values(self, name: str, dims: Dims, *, quick: bool = False, overrides: dict | None = None,
                     layout: str | None = None) -> list:
        """The candidate values of a listed (not DERIVED) parameter of ``layout``, or of the first
        layout that has it."""
        lay = self.layout(layout) if layout else next(lay for lay in self.layouts if lay.param(name))
        return self._values(lay.param(name), {}, dims, 4, quick, overrides or {})

    def _values(self, prm: Param, partial: dict, dims: Dims, simd: int, quick: bool, overrides: dict) -> list:
        if prm.name in overrides:
            return list(overrides[prm.name])
        spec = prm.quick if quick else prm.values
        if spec == DERIVED:
            return [self.derive(prm.name, partial, dims, simd)]
        return list(spec(dims)) if callable(spec) else list(spec)

    def violations(self, params, dims: Dims, limits: dict) -> list:
        """(constraint name, sentence) for every violated constraint; "well_formed" when the
        configuration is not one of this space (a name missing or unknown, a value of the wrong
        type)."""
        if not isinstance(params, dict):
            return [("well_formed", f"params must be a dict, got {type(params).__name__}")]
        several = len(self.layouts) > 1
        if several:
            variant = params.get("VARIANT", self.layouts[0].name)
            if not isinstance(variant, str) or variant not in self.layout_names:
                return [("well_formed", f"VARIANT={variant!r} must be one of {sorted(self.layout_names)}")]
        lay = self.layout_of(params)
        need, optional = lay.required, lay.optional + (("VARIANT",) if several else ())
        missing = [p for p in need if p not in params]
        unknown = [p for p in params if p not in need + optional]
        if missing or unknown:
            return [("well_formed", f"params of the {lay.name!r} layout must set {need} (optionally {optional}); "
                                    f"missing {missing}, unknown {unknown}")]
        given = [prm for prm in lay.params if prm.name in params]
        for prm in given:
            v = params[prm.name]
            if prm.choices and (isinstance(v, bool) or v not in prm.choices):
                return [("well_formed", f"{prm.name}={v!r} must be {' or '.join(map(str, prm.choices))}")]
        bad = [("well_formed", f"{prm.name}={params[prm.name]!r} must be a positive int") for prm in given
               if not prm.choices and (isinstance(params[prm.name], bool) or not isinstance(params[prm.name], int)
                                       or params[prm.name] < prm.minimum)]
        if bad:
            return bad
        out = []
        for c in lay.constraints:
            msg = c.check(params, dims, limits)
            if msg:
                out.append((c.name, msg))
                if c.final:
                    break
        return out

    def check(self, params, dims: Dims, limits: dict) -> list:
        """Every violated constraint as a sentence naming the parameter and the limit; [] when valid."""
        return [msg for _, msg in self.violations(params, dims, limits)]

    def spill_model(self, params: dict, dims: Dims, profile: DeviceProfile) -> dict:
        """What the profile's register model predicts for one configuration."""
        floats = self.private_floats(params, dims)
        return {"floats": floats, "regs_hard": profile.regs_hard, "regs_budget": profile.regs_budget,
                "spills": floats > profile.regs_hard, "over_budget": floats > profile.regs_budget,
                "kernel_max_work_group": profile.kernel_max_work_group(floats)}

    def default(self, profile: DeviceProfile, dims: Dims, *, local_mem: int, max_work_group: int) -> dict:
        return self.defaults(profile, dims, {"local_mem": local_mem, "max_work_group": max_work_group})


def register_room(profile: DeviceProfile) -> int:
    """Registers a default may use by the model: the hard limit less the profile's model margin."""
    return profile.regs_hard - profile.model_margin


# --------------------------------------------------------------------------- prefill

def dv_tile_candidates(dv: int) -> list[int]:
    """Divisors of DV that are multiples of 4 and at least 16, and DV itself."""
    return sorted({t for t in range(16, dv + 1, 4) if dv % t == 0} | {dv})


def widest_vec(block_n: int, dv_tile: int, simd: int) -> int:
    """The widest VEC (4, 8, 16) not above ``simd`` that divides BLOCK_N and DV_TILE."""
    return max(w for w in (4, 8, 16) if w <= max(simd, 4) and block_n % w == 0 and dv_tile % w == 0)


def _derived_vec(name: str, p: dict, dims: Dims, simd: int) -> int:
    """VEC for a candidate; 4 where nothing divides, so that the constraint says why."""
    try:
        return widest_vec(p["BLOCK_N"], p["DV_TILE"], simd)
    except ValueError:
        return 4


def variant_of(params: dict) -> str:
    return params.get("VARIANT", "rows") if isinstance(params, dict) else "rows"


def _rows_local_bytes(p: dict, dk: int) -> int:
    return 4 * p["BLOCK_N"] * (dk + p["DV_TILE"])


def _tiles_local_bytes(p: dict, dk: int) -> int:
    """Q^T, the K^T-then-V buffer, P^T and the row partials of prefill_tiles.cl."""
    tn = p["BLOCK_N"] // p["TILE_N"]
    return 4 * (dk * p["BLOCK_M"] + max(dk, p["DV_TILE"]) * p["BLOCK_N"]
                + p["BLOCK_N"] * (p["BLOCK_M"] + max(p["TILE_M"], 4)) + p["BLOCK_M"] * (tn + 1))


def _prefill_local_bytes(p: dict, dims: Dims) -> int:
    return _tiles_local_bytes(p, dims.dk) if variant_of(p) == "tiles" else _rows_local_bytes(p, dims.dk)


def _prefill_work_group(p: dict, dims: Dims | None = None) -> int:
    """Work-items per work-group: BLOCK_M for the row layout (one query row each); for the
    micro-tiled layout one work-item per TILE_M x TILE_N block of the BLOCK_M x BLOCK_N scores."""
    if variant_of(p) == "tiles":
        return (p["BLOCK_M"] // p["TILE_M"]) * (p["BLOCK_N"] // p["TILE_N"])
    return p["BLOCK_M"]


def _prefill_private_floats(p: dict, dims: Dims) -> int:
    """Register model: 32-bit values each work-item keeps live in the prefill inner loop.

    Rows layout: the q row (DK, or one float4 chunk when Q_IN_REGS=0), the DV slice of the
    accumulator, the scores of one KV tile, and about 40 scalars (m, l, indices, pointers, loop
    counters). The weights, 1.25 per accumulator column and 0.75 per score, are fitted to ptxas on
    an H100 (148 builds at d=64/128, BLOCK_N 8-64, DV_TILE 16-128, Q_IN_REGS 0/1): the unrolled
    P V loop keeps V values in flight in proportion to DV_TILE, while scores and probabilities
    share registers. It agrees with ptxas's spill verdict on 51 of 56 builds capped at Adreno's 192
    registers (-cl-nv-maxrregcount=192, FIXED_WG=0) and 87 of 92 at 255; the earlier q + DV_TILE +
    BLOCK_N + 48 agreed on 48 and 86. Both figures are in-sample. Half storage does not change
    it: the kernel computes in float32.
    """
    if variant_of(p) == "tiles":
        # scores (reused for P) TILE_M x TILE_N, the accumulator TILE_M x DV_TILE/(BLOCK_N/TILE_N),
        # m and l per row, one q and one k operand vector, and 60 scalars (indices, addresses and
        # in-flight local loads). The 60 is fitted to ptxas on the H100 (UNROLL_K 4/8): 167-168
        # registers at 8x2 with 8 columns (model 166), 237-245 at 4x8 with 32 (model 240).
        tm, tn = p["TILE_M"], p["TILE_N"]
        rd = p["DV_TILE"] // max(1, p["BLOCK_N"] // tn)
        return tm * tn + tm * rd + 2 * tm + tm + tn + 60
    q = dims.dk if p.get("Q_IN_REGS", 1) else 4
    return q + (5 * p["DV_TILE"] + 3 * p["BLOCK_N"]) // 4 + 40


def _prefill_defaults(profile: DeviceProfile, dims: Dims, lim: dict) -> dict:
    """The largest tiles the profile's register room (``register_room``) and the device's local
    memory allow, q in registers and the fewest DV passes first; VEC is the profile's SIMD width
    for scores and accumulators (4 on GPUs: one float4 per work-item). Where q in registers leaves
    no room (d=256 on every GPU profile), q is re-read per KV tile, and below that the output
    passes narrow to 4 columns; where nothing fits, the fewest registers. On CPUs (a profile with
    ``tile_cache``) the K/V tiles also stay within the core's L1."""
    block_m = min(64, lim["max_work_group"])
    room = register_room(profile)

    def in_cache(p):
        # CPUs: each work-item re-reads the K/V tiles, best from L1 (BLOCK_N 32 against 64 at d=128
        # 1.07-1.14x faster on one thread, 16 at d=256 1.2x: docs/notes/pocl-prefill.md)
        return not profile.tile_cache or _rows_local_bytes(p, dims.dk) <= profile.tile_cache

    def fits(p):
        return (_prefill_private_floats(p, dims) <= room
                and _rows_local_bytes(p, dims.dk) <= lim["local_mem"] and in_cache(p))

    for t in sorted(dv_tile_candidates(dims.dv), reverse=True):
        for block_n in (64, 32, 16, 8, 4):
            p = {"BLOCK_M": block_m, "BLOCK_N": block_n, "DV_TILE": t, "VEC": widest_vec(block_n, t, profile.simd)}
            if fits(p):
                return p
    for t in sorted((t for t in range(4, dims.dv + 1, 4) if dims.dv % t == 0), reverse=True):
        for block_n in (64, 32, 16, 8, 4):
            p = {"BLOCK_M": block_m, "BLOCK_N": block_n, "DV_TILE": t, "VEC": widest_vec(block_n, t, profile.simd),
                 "Q_IN_REGS": 0}
            if fits(p):
                return p
    return {"BLOCK_M": block_m, "BLOCK_N": 4, "DV_TILE": 4, "VEC": 4, "Q_IN_REGS": 0}


def _prefill_rank(p: dict, dims: Dims, profile: DeviceProfile) -> tuple:
    """"Largest tile": the register tile first (DV_TILE + BLOCK_N: fewer passes and barriers),
    more output columns at a tie, then the largest BLOCK_M that still lets two work-groups share a
    compute unit (one's barrier wait hidden by the other's math)."""
    kwg = profile.kernel_max_work_group(_prefill_private_floats(p, dims))
    return (p["DV_TILE"] + p["BLOCK_N"], p["DV_TILE"], 2 * _prefill_work_group(p) <= kwg, p["BLOCK_M"])


def _tiles_dv_split(p: dict, dims: Dims, lim: dict):
    tn = p["BLOCK_N"] // p["TILE_N"]
    if p["DV_TILE"] % tn == 0 and (p["DV_TILE"] // tn) % 4 == 0:
        return None
    return (f"DV_TILE={p['DV_TILE']} must split into BLOCK_N/TILE_N={tn} column blocks of a multiple "
            f"of 4 (each work-item owns DV_TILE/{tn} output columns, stored as float4)")


_ROWS_CONSTRAINTS = (
    Constraint("dv_divisible", "the DV_TILE passes must tile the output exactly",
               lambda p, d, lim: None if d.dv % p["DV_TILE"] == 0 else
               f"DV_TILE={p['DV_TILE']} must divide DV={d.dv}"),
    Constraint("vec_width", "the kernel has float4, float8 and float16 code paths only",
               lambda p, d, lim: None if p["VEC"] in (4, 8, 16) else f"VEC={p['VEC']} must be 4, 8 or 16"),
    Constraint("vec_divides", "scores and the accumulator are VEC-wide vectors, so BLOCK_N and "
               "DV_TILE must be multiples of VEC",
               lambda p, d, lim: None if p["DV_TILE"] % p["VEC"] == 0 and p["BLOCK_N"] % p["VEC"] == 0
               else f"BLOCK_N={p['BLOCK_N']} and DV_TILE={p['DV_TILE']} must be multiples of VEC={p['VEC']}"),
    Constraint("local_fits", "the K tile and V slice live in local memory: "
               "4 * BLOCK_N * (DK + DV_TILE) bytes must fit the device's local memory",
               lambda p, d, lim: None if _rows_local_bytes(p, d.dk) <= lim["local_mem"] else
               f"BLOCK_N={p['BLOCK_N']}, DV_TILE={p['DV_TILE']} need {_rows_local_bytes(p, d.dk)} bytes of "
               f"local memory for DK={d.dk}; the device has {lim['local_mem']}"),
    Constraint("work_group_fits", "BLOCK_M is the work-group size (one query row per work-item), "
               "bounded by the device's max work-group",
               lambda p, d, lim: None if p["BLOCK_M"] <= lim["max_work_group"] else
               f"BLOCK_M={p['BLOCK_M']} exceeds the device's max work-group size {lim['max_work_group']}"),
    Constraint("score_row_bounded", "the scores of one KV tile are unrolled in registers; above 256 "
               "every device spills",
               lambda p, d, lim: None if p["BLOCK_N"] <= 256 else
               f"BLOCK_N={p['BLOCK_N']} is above 256 (the score row is unrolled in registers)"),
)

_TILES_CONSTRAINTS = (
    Constraint("micro_tile", "the kernel has 2-, 4- and 8-wide vector paths for its micro-tiles",
               lambda p, d, lim: None if p["TILE_M"] in (2, 4, 8) and p["TILE_N"] in (2, 4, 8) else
               f"TILE_M={p['TILE_M']} and TILE_N={p['TILE_N']} must be 2, 4 or 8"),
    Constraint("tiles_divide", "the work-items cover the BLOCK_M x BLOCK_N score tile exactly",
               lambda p, d, lim: None if p["BLOCK_M"] % p["TILE_M"] == 0 and p["BLOCK_N"] % p["TILE_N"] == 0
               else f"TILE_M={p['TILE_M']} must divide BLOCK_M={p['BLOCK_M']} and TILE_N={p['TILE_N']} "
                    f"BLOCK_N={p['BLOCK_N']}"),
    Constraint("dv_divisible", "the DV_TILE passes must tile the output exactly",
               lambda p, d, lim: None if d.dv % p["DV_TILE"] == 0 else
               f"DV_TILE={p['DV_TILE']} must divide DV={d.dv}"),
    Constraint("dv_split", "the BLOCK_N / TILE_N work-items of a row share the DV slice in float4 columns",
               _tiles_dv_split),
    Constraint("local_fits", "Q^T, the K/V buffer and P^T live in local memory",
               lambda p, d, lim: None if _tiles_local_bytes(p, d.dk) <= lim["local_mem"] else
               f"BLOCK_M={p['BLOCK_M']}, BLOCK_N={p['BLOCK_N']}, DV_TILE={p['DV_TILE']} need "
               f"{_tiles_local_bytes(p, d.dk)} bytes of local memory for DK={d.dk}; the device has {lim['local_mem']}"),
    Constraint("work_group_fits", "one work-item per TILE_M x TILE_N block: (BLOCK_M/TILE_M)*(BLOCK_N/TILE_N) "
               "work-items, bounded by the device's max work-group",
               lambda p, d, lim: None if _prefill_work_group(p) <= lim["max_work_group"] else
               f"a work-group of {_prefill_work_group(p)} exceeds the device's max {lim['max_work_group']}"),
    Constraint("unroll_k", "UNROLL_K is an unroll factor of the loops over head dims and keys (0: full)",
               lambda p, d, lim: None if p.get("UNROLL_K", 0) in (0, 2, 4, 8, 16) else
               f"UNROLL_K={p['UNROLL_K']} must be 0, 2, 4, 8 or 16"),
)

PREFILL_SPACE = KernelSpace(
    kernel="prefill",
    layouts=(
        Layout("rows", "prefill.cl", "every device (the only layout on CPUs)", (
            Param("BLOCK_M", (16, 32, 64, 128, 256), (32, 64, 128), "query rows per work-group = work-group size"),
            Param("BLOCK_N", (8, 16, 32, 64), (16, 32), "KV rows per local-memory tile (scores kept in registers)"),
            Param("DV_TILE", lambda d: dv_tile_candidates(d.dv),
                  lambda d: sorted({d.dv, d.dv // 2} & set(dv_tile_candidates(d.dv))),
                  "output columns accumulated per pass (accumulator in registers)"),
            Param("VEC", DERIVED, DERIVED, "vector width of the score and accumulator arithmetic: the widest of "
                  "4, 8, 16 not above the profile's SIMD width that divides BLOCK_N and DV_TILE"),
            Param("Q_IN_REGS", (1, 0), (1,), "1: the q row stays in registers; 0: q is re-read from cache per KV "
                  "tile, freeing DK registers", default=1, choices=(0, 1), omit_default=True),
        ), _ROWS_CONSTRAINTS),
        Layout("tiles", "prefill_tiles.cl",
               "GPUs: on PoCL it measured 20-35x slower than rows (1,8/2,512,128 causal: 0.8-1.3 against "
               "27 GFLOP/s), so CPU sweeps leave it out", (
                   Param("BLOCK_M", (64, 128), (64,), "query rows per work-group"),
                   Param("BLOCK_N", (16, 32), (16,), "KV rows per local-memory tile"),
                   Param("DV_TILE", lambda d: dv_tile_candidates(d.dv), lambda d: [d.dv],
                         "output columns per work-group"),
                   Param("TILE_M", (4, 8), (8,), "query rows per work-item"),
                   Param("TILE_N", (2, 8), (2,), "keys per work-item"),
                   Param("UNROLL_K", (4, 8), (4,), "unroll factor of the loops over head dims and keys (0: full)",
                         default=0, minimum=0),
               ), _TILES_CONSTRAINTS),
    ),
    problem="PrefillProblem(B, H_q, H_kv, N_q = N_kv = N, DK = DV = d, causal, dtype); entries are keyed by "
            "kernel, dtype, DK, DV, causal and the power-of-two bucket of N",
    metric="median kernel time over >= 5 runs (OpenCL profiling events), lower is better; "
           "GFLOP/s = 2*B*H_q*(DK+DV)*(visible query-key pairs) / t (causal counts about half)",
    correctness="relative error against the float64 oracle on a small problem (B=1, H_q=2, H_kv=1, "
                "N=261: crosses every tile edge) within the dtype's tolerance",
    register_model="rows: q row + 1.25 per accumulator column + 0.75 per score + 40 scalars; tiles: the "
                   "micro-tiles' scores and accumulator + 60 scalars (fitted to ptxas)",
    private_floats=_prefill_private_floats,
    local_bytes=_prefill_local_bytes,
    work_group_size=_prefill_work_group,
    defaults=_prefill_defaults,
    rank=_prefill_rank,
    derive=_derived_vec,
    # The micro-tiled layout's model was compared with ptxas at 255 registers on two
    # configurations only: swept on attached devices, where the compiler's report decides, never
    # chosen blind.
    modeled_layouts=("rows",),
    layouts_for=lambda profile: profile.prefill_variants,
)


# --------------------------------------------------------------------------- decode

CHUNK_BYTES = 16  # decode reads K/V rows in 16-byte chunks: 8 halves or 4 floats per work-item
DECODE_DEFINES = ("ROWS", "UNROLL", "HEAD_TILE", "MERGE_WG")  # decode.cl's -D tunables

# The split rule's constants for decode.cl (opencl.decode.choose_num_splits says how they were
# measured): work-groups per compute unit the split count aims for, and keys one split aims to
# cover on long contexts. Tunable per device as SPLIT_WAVES and SPLIT_KEYS.
SPLIT_WAVES = 4
SPLIT_KEYS = 512
DECODE_MERGE_WG = 256  # the merge kernel's work-group (see _decode_defaults)
# decode_cpu.cl's split rule defaults: one work-group per compute unit, a split every 16384 keys
# (a CPU core streams a long context as well as several splits do: _decode_rows_defaults)
ROWS_SPLIT_WAVES = 1
ROWS_SPLIT_KEYS = 16384

# decode_cpu.cl: the most query heads of a group (GQA heads x query rows) one work-item serves, a
# larger group in even tiles of at most this many (PoCL: 64 in one work-item took 3x 32's time;
# docs/notes/pocl-decode.md, "Query rows as a decode")
ROWS_GROUP_TILE = 48


def rows_tiles(group: int) -> int:
    """Work-groups of decode_cpu.cl per KV head."""
    return -(-group // ROWS_GROUP_TILE)


def rows_group_tile(group: int) -> int:
    """Query heads of the group one decode_cpu.cl work-item serves: even tiles, the last padded."""
    return -(-group // rows_tiles(group))


def storage_bytes(dtype: str) -> int:
    """Bytes of an element as the kernels store it: 2 for float16 and bfloat16, 4 for float32."""
    return 2 if dtype in ("float16", "bfloat16") else 4


def chunk_elems(dtype: str) -> int:
    return CHUNK_BYTES // storage_bytes(dtype)


def lanes(dk: int, dv: int, dtype: str) -> int:
    """Work-items across one K/V row: one 16-byte chunk each."""
    return max(dk, dv) // chunk_elems(dtype)


def is_rows(p: dict) -> bool:
    """Whether a decode configuration is decode_cpu.cl's ("rows") rather than decode.cl's ("lanes")."""
    return p.get("VARIANT") == "rows"


def _decode_work_group(p: dict, dims: Dims) -> int:
    """lanes: LANES x ROWS x the G / HEAD_TILE head tiles; rows: one work-item."""
    if is_rows(p):
        return 1
    return lanes(dims.dk, dims.dv, dims.dtype) * p["ROWS"] * (dims.group // p["HEAD_TILE"])


def _decode_local_bytes(p: dict, dims: Dims) -> int:
    """Local memory of decode.cl's __local arrays: partial dots and scores of a tile per head, the
    row-slot merge buffer (ROWS > 1), and the staged K/V tile when several head tiles share it;
    rows: decode_cpu.cl has no local arrays; the merge kernel's (decode.cl's, MERGE_WG-wide)."""
    if is_rows(p):
        cols = min(dims.dv // 4, p["MERGE_WG"])
        return 4 * (p["MERGE_WG"] + p["MERGE_WG"] // cols * dims.dv)
    ln, rows, nht = lanes(dims.dk, dims.dv, dims.dtype), p["ROWS"], dims.group // p["HEAD_TILE"]
    block_n = rows * p["UNROLL"]
    floats = dims.group * block_n * (ln + 1) + dims.group * block_n + 2 * rows * dims.group
    floats += rows * nht * dims.dv if rows > 1 else 4
    tile = block_n * (dims.dk + dims.dv) * storage_bytes(dims.dtype) if nht > 1 else CHUNK_BYTES
    return 4 * floats + tile


def _decode_private_floats(p: dict, dims: Dims) -> int:
    """Register model per work-item: q and acc chunks of HEAD_TILE heads, m/l per head, per
    unrolled key the current and prefetched K/V chunks (raw, 4 registers each) and their float
    conversions, ~24 scalars. It does not depend on the head dim: a work-item holds one chunk.
    rows (decode_cpu.cl, CPUs): what stays in vector registers, a tile's scores and a dot product
    per head, m and l per head, one K/V vector, ~24 scalars; q and acc of the group are arrays a
    CPU keeps in L1 (PoCL: on the stack)."""
    if is_rows(p):
        return rows_group_tile(dims.group) * (p["BLOCK_N"] + p["VEC"] + 2) + p["VEC"] + 24
    w, ht, u = chunk_elems(dims.dtype), p["HEAD_TILE"], p["UNROLL"]
    return 2 * ht * w + 2 * ht + u * (4 * 4 + 2 * w) + 24


def _no_register_cliff(profile: DeviceProfile) -> bool:
    """CPUs: private arrays live in memory, there is no register file to fit."""
    return profile.regs_hard >= 1024


def _decode_wg_target(profile: DeviceProfile) -> int:
    """~128 work-items (4 warps) on GPUs; 64 on CPUs, where PoCL runs a work-group as loops and
    barriers are costly."""
    return 64 if _no_register_cliff(profile) else 128


def _pow2_floor(x: int) -> int:
    return 1 << (max(1, int(x)).bit_length() - 1)


def _decode_defaults(profile: DeviceProfile, dims: Dims, lim: dict) -> dict:
    """Working parameters for an untuned device: the profile's first decode layout's."""
    return decode_layout_defaults(profile.decode_variants[0], profile, dims, lim)


def decode_layout_defaults(layout: str, profile: DeviceProfile, dims: Dims, lim: dict) -> dict:
    """Working parameters of one decode layout ("lanes" or "rows") for an untuned device.

    rows: see _decode_rows_defaults. lanes:

    HEAD_TILE: the largest divisor of G up to 4 (8 where the profile has no register cliff, i.e.
    CPUs): q + acc chunks of 4 heads are 64 registers for half, within NVIDIA's 128-register
    occupancy budget; smaller where the model leaves no room for one unrolled key; larger, within
    the model, where G's head tiles would make a GPU work-group of more than 256. ROWS: enough
    row slots for the target work-group (``_decode_wg_target``). UNROLL: at least 8 keys per
    iteration, so that barriers and the score reduction are amortized over a tile, fewer where
    the registers do not allow. MERGE_WG: 256, i.e. 8 groups of splits by 32 float4 columns at
    DV=128 (H100, (1, 32, 8, 32k) at 64 splits: the whole decode 0.0943 ms with a 64-work-item
    merge, 0.0907 with 256).
    """
    if layout == "rows":
        return _decode_rows_defaults(profile, dims, lim)
    g, room = dims.group, register_room(profile)
    divisors = [d for d in range(1, g + 1) if g % d == 0]

    def floats(p):
        return _decode_private_floats(p, dims)

    ht_max = 8 if _no_register_cliff(profile) else 4
    ht = max(d for d in divisors if d <= ht_max)
    while ht > 1 and floats({"HEAD_TILE": ht, "UNROLL": 1}) > room:
        ht = max(d for d in divisors if d < ht)
    ln, nht = lanes(dims.dk, dims.dv, dims.dtype), g // ht
    target = _decode_wg_target(profile)
    rows = 1
    while rows < 16 and ln * nht * rows * 2 <= min(target, lim["max_work_group"]):
        rows *= 2
    unroll = max(1, min(4, 8 // rows))
    while unroll > 1 and floats({"HEAD_TILE": ht, "UNROLL": unroll}) > room:
        unroll //= 2
    p = {"ROWS": rows, "UNROLL": unroll, "HEAD_TILE": ht, "MERGE_WG": 64}
    # a large group's head tiles alone can pass what a GPU runs of a kernel this size (NVIDIA:
    # 256 work-items of 128-255 registers; G = 64 fp32 built to 512): more heads a tile instead
    wg_cap = lim["max_work_group"] if _no_register_cliff(profile) else 2 * target
    while _decode_work_group(p, dims) > wg_cap and p["HEAD_TILE"] < g:
        bigger = min(d for d in divisors if d > p["HEAD_TILE"])
        if floats({"HEAD_TILE": bigger, "UNROLL": 1}) > room:  # within the register model
            break
        p["HEAD_TILE"] = bigger
        while p["UNROLL"] > 1 and floats(p) > room:
            p["UNROLL"] //= 2
    while DECODE_SPACE.check(p, dims, lim):
        if p["UNROLL"] > 1:
            p["UNROLL"] //= 2
        elif p["ROWS"] > 1:
            p["ROWS"] //= 2
        elif p["HEAD_TILE"] < g:  # fewer head tiles: a smaller work-group
            p["HEAD_TILE"] = min(d for d in divisors if d > p["HEAD_TILE"])
        else:
            break
    p["MERGE_WG"] = _pow2_floor(min(DECODE_MERGE_WG, lim["max_work_group"]))
    return p


def _rows_vecs(d: Dims) -> list:
    """decode_cpu.cl's vector widths for the head dims: 4, 8, 16 dividing both (8 at least for half)."""
    return [w for w in (4, 8, 16) if d.dk % w == 0 and d.dv % w == 0 and not (storage_bytes(d.dtype) == 2 and w < 8)]


def _decode_rows_defaults(profile: DeviceProfile, dims: Dims, lim: dict) -> dict:
    """decode_cpu.cl on an untuned CPU: 16 keys a softmax step, the widest vectors up to the
    profile's SIMD width that divide the head dims, and a 64-work-item merge; its split rule
    (the layout's SPLIT_WAVES / SPLIT_KEYS defaults) aims for one work-group per compute unit and
    a split every 16384 keys (a CPU core streams a long context as well as several splits do,
    and the merge is a second launch). `flashcl tune --device cpu --kernel decode` on a 2-core AMD EPYC
    (PoCL 3.1, AVX-512), (1, 32/8, 1k, 128) float32: VEC 16 0.34 ms, 8 0.44-0.48, 4 0.73-0.81;
    one split 0.34 ms, two 0.38-0.45 (docs/notes/pocl-decode.md)."""
    vecs = [w for w in _rows_vecs(dims) if w <= max(4, profile.simd)] or _rows_vecs(dims)[:1]
    return {"VARIANT": "rows", "BLOCK_N": 16, "VEC": max(vecs), "MERGE_WG": _pow2_floor(min(64, lim["max_work_group"]))}


def _decode_rank(p: dict, dims: Dims, profile: DeviceProfile) -> tuple:
    """"Largest tile" for decode, which reads every K/V row once whatever the tile: within the
    occupancy budget (more work-groups in flight hide the latency of the loads), at least 8 keys
    per iteration (amortizes the barriers and the score reduction), more heads per work-item (K/V
    staged once for fewer head tiles), the work-group nearest its target, then the widest merge;
    among equal tiles the split rule nearest its defaults."""
    floats = _decode_private_floats(p, dims)
    wg = _decode_work_group(p, dims)
    lay = DECODE_SPACE.layout_of(p)  # the split rule nearest the layout's own defaults
    split = sum(abs(math.log2(DECODE_SPACE.value(p, n) / lay.param(n).default)) for n in ("SPLIT_WAVES", "SPLIT_KEYS"))
    if is_rows(p):  # no registers to fit: 8 keys a step, then the widest vectors
        return (True, min(p["BLOCK_N"], 8), p["VEC"], 0, p["MERGE_WG"], -floats, -split)
    return (floats <= profile.regs_budget, min(p["ROWS"] * p["UNROLL"], 8), p["HEAD_TILE"],
            -abs(math.log2(wg / _decode_wg_target(profile))), p["MERGE_WG"], -floats, -split)


def _head_tiles(d: Dims) -> list:
    return [t for t in range(1, min(d.group, 8) + 1) if d.group % t == 0]


_DECODE_CONSTRAINTS = (
    Constraint("head_tile_divides", "each work-item keeps the q and accumulator chunks of HEAD_TILE heads; "
               "the head tiles cover G exactly",
               lambda p, d, lim: None if d.group % p["HEAD_TILE"] == 0 else
               f"HEAD_TILE={p['HEAD_TILE']} must divide the GQA group G={d.group}", final=True),
    Constraint("merge_pow2", "the merge reduces by halving", lambda p, d, lim: None
               if not p["MERGE_WG"] & (p["MERGE_WG"] - 1) else f"MERGE_WG={p['MERGE_WG']} must be a power of two"),
    Constraint("work_group_fits", "LANES * ROWS * G / HEAD_TILE work-items (LANES = max(DK, DV) / chunk "
               "elements) must not exceed the device's max work-group",
               lambda p, d, lim: None if _decode_work_group(p, d) <= lim["max_work_group"] else
               f"ROWS={p['ROWS']}, HEAD_TILE={p['HEAD_TILE']} give a work-group of {_decode_work_group(p, d)} "
               f"for G={d.group}, D={max(d.dk, d.dv)}; the device allows {lim['max_work_group']}"),
    Constraint("merge_fits", "MERGE_WG is the merge kernel's work-group", lambda p, d, lim: None
               if p["MERGE_WG"] <= lim["max_work_group"] else
               f"MERGE_WG={p['MERGE_WG']} exceeds the device's max work-group {lim['max_work_group']}"),
    Constraint("local_fits", "partial dots, scores, the staged K/V tile (G > HEAD_TILE) and the row-slot "
               "merge buffer must fit in local memory",
               lambda p, d, lim: None if _decode_local_bytes(p, d) <= lim["local_mem"] else
               f"ROWS={p['ROWS']}, UNROLL={p['UNROLL']}, HEAD_TILE={p['HEAD_TILE']} need "
               f"{_decode_local_bytes(p, d)} bytes of local memory for G={d.group}; the device has {lim['local_mem']}"),
)

_SPLIT_PARAMS = (
    Param("SPLIT_WAVES", (1, 2, 4, 8), (2, 4), "split rule: work-groups per compute unit the split "
          "count aims for", default=SPLIT_WAVES, host=True),
    Param("SPLIT_KEYS", (256, 512, 1024, 2048, 4096), (512, 4096), "split rule: keys one split aims "
          "to cover on long contexts", default=SPLIT_KEYS, host=True),
)

_MERGE_CONSTRAINTS = tuple(c for c in _DECODE_CONSTRAINTS if c.name in ("merge_pow2", "merge_fits"))

_DECODE_ROWS_CONSTRAINTS = (
    Constraint("block_n_range", "decode_cpu.cl keeps a tile's scores in a private array of 1..64 keys per head",
               lambda p, d, lim: None if 1 <= p["BLOCK_N"] <= 64 else f"BLOCK_N={p['BLOCK_N']} must be in 1..64"),
    Constraint("vec_divides", "decode_cpu.cl reads rows VEC floats at a time: VEC divides DK and DV, and "
               "half rows are read 8 values at a time at least",
               lambda p, d, lim: None if p["VEC"] in _rows_vecs(d) else
               f"VEC={p['VEC']} must divide DK={d.dk} and DV={d.dv}"
               + (f" and be at least 8 for {d.dtype}" if storage_bytes(d.dtype) == 2 else "")),
    *_MERGE_CONSTRAINTS,
)

DECODE_SPACE = KernelSpace(
    kernel="decode",
    layouts=(
        Layout("lanes", "decode.cl", "every device (decode_mma.cl replaces its decode kernels on NVIDIA sm_80+ "
               "with an fp16 cache; there only MERGE_WG and the split rule apply)", (
                   Param("ROWS", (1, 2, 4, 8, 16), (2, 4, 8),
                         "key rows read side by side: work-items along the key axis"),
                   Param("UNROLL", (1, 2, 4), (1, 2),
                         "keys per work-item per iteration: loads in flight per work-item"),
                   Param("HEAD_TILE", _head_tiles, lambda d: [max(t for t in _head_tiles(d) if t <= 4)],
                         "query heads whose q/acc chunks one work-item keeps in registers (divisors of G up to 8)"),
                   Param("MERGE_WG", (32, 64, 128, 256), (256,), "work-items of the merge kernel (power of two)"),
                   *_SPLIT_PARAMS,
               ), _DECODE_CONSTRAINTS),
        Layout("rows", "decode_cpu.cl", "CPUs (the only layout swept there): one work-item per (sequence, KV "
               "head, split) reads whole rows in vector types; no local memory, no barriers", (
                   Param("BLOCK_N", (4, 8, 16), (8, 16), "keys per online-softmax step (4, 8, 16: one vector exp2 "
                         "a tile)"),
                   Param("VEC", _rows_vecs, lambda d: [w for w in _rows_vecs(d) if w >= 8] or _rows_vecs(d),
                         "floats per vector operation (divides DK and DV)"),
                   Param("MERGE_WG", (64, 256), (64,), "work-items of decode.cl's merge kernel (power of two)"),
                   Param("SPLIT_WAVES", (1, 2, 4), (1, 2), "split rule: work-groups per compute unit the split "
                         "count aims for", default=ROWS_SPLIT_WAVES, host=True),
                   Param("SPLIT_KEYS", (1024, 4096, ROWS_SPLIT_KEYS), (4096, ROWS_SPLIT_KEYS), "split rule: keys "
                         "one split aims to cover on long contexts", default=ROWS_SPLIT_KEYS, host=True),
               ), _DECODE_ROWS_CONSTRAINTS),
    ),
    problem="DecodeProblem(B, H_q, H_kv, DK = DV = d, paged, dtype), every sequence ctx keys long in a paged "
            "cache (block size 16, a random block table); entries are keyed by kernel, dtype, DK, DV, the GQA "
            "group and the power-of-two bucket of ctx",
    metric="median time from the decode kernel's start to the merge kernel's end over >= 5 runs (OpenCL "
           "profiling events), lower is better; GB/s = (K and V read once per GQA group + q + out) / t",
    correctness="relative error against the float64 oracle on a small paged problem (B=2, contexts 261 and "
                 "100, a permuted block table), single pass and 3 splits, within the dtype's tolerance",
    register_model="lanes: q and acc chunks of HEAD_TILE heads + m, l per head + UNROLL x (raw and converted "
                   "K/V chunks) + 24 scalars; rows: a tile's scores and dot products of the group + 24 "
                   "scalars (q and acc in L1)",
    private_floats=_decode_private_floats,
    local_bytes=_decode_local_bytes,
    work_group_size=_decode_work_group,
    defaults=_decode_defaults,
    rank=_decode_rank,
    # rows runs on CPUs, where nothing spills: its model has no cliff to miss
    modeled_layouts=("lanes", "rows"),
    layouts_for=lambda profile: profile.decode_variants,
)

SPACES = {"prefill": PREFILL_SPACE, "decode": DECODE_SPACE}


# --------------------------------------------------------------------------- by kernel name
# What callers holding a kernel name and sizes use; each goes through SPACES[kernel].

def _dims(dk: int, dv: int, group: int, dtype: str) -> Dims:
    return Dims(dk, dv, group, dtype)


def tunable_names(kernel: str) -> set[str]:
    """Every parameter name of every layout of ``kernel`` (for --param), plus VARIANT."""
    return SPACES[kernel].param_names()


def candidate_configs(kernel: str, dk: int, dv: int, simd: int = 4, *, quick: bool = False,
                      overrides: dict | None = None, variants=None, group: int = 1,
                      dtype: str = "float32") -> list[dict]:
    """KernelSpace.candidates for ``kernel``; ``variants`` are the layouts."""
    return SPACES[kernel].candidates(_dims(dk, dv, group, dtype), simd, quick=quick, overrides=overrides,
                                     layouts=variants)


def private_floats(kernel: str, params: dict, dk: int, dv: int, *, group: int = 1, dtype: str = "float32") -> int:
    return SPACES[kernel].private_floats(params, _dims(dk, dv, group, dtype))


def local_bytes(kernel: str, params: dict, dk: int, dv: int, *, group: int = 1, dtype: str = "float32") -> int:
    return SPACES[kernel].local_bytes(params, _dims(dk, dv, group, dtype))


def work_group_size(kernel: str, params: dict, dk: int = 0, dv: int = 0, *, group: int = 1,
                    dtype: str = "float32") -> int:
    """Work-items per work-group (prefill's does not depend on the head dims)."""
    return SPACES[kernel].work_group_size(params, _dims(dk, dv, group, dtype))


def spill_model(kernel: str, params: dict, dk: int, dv: int, profile: DeviceProfile, *, group: int = 1,
                dtype: str = "float32") -> dict:
    return SPACES[kernel].spill_model(params, _dims(dk, dv, group, dtype), profile)


def violations(kernel: str, params: dict, dk: int, dv: int, *, local_mem: int, max_work_group: int,
               group: int = 1, dtype: str = "float32") -> list[tuple[str, str]]:
    """(constraint name, sentence) for every violated constraint of ``kernel``."""
    return SPACES[kernel].violations(params, _dims(dk, dv, group, dtype),
                                     {"local_mem": local_mem, "max_work_group": max_work_group})


def check_params(kernel: str, params: dict, dk: int, dv: int, *, local_mem: int, max_work_group: int,
                 group: int = 1, dtype: str = "float32") -> list[str]:
    """Every violated constraint as a sentence naming the parameter and the limit; [] when valid."""
    return [msg for _, msg in violations(kernel, params, dk, dv, local_mem=local_mem,
                                         max_work_group=max_work_group, group=group, dtype=dtype)]


def default_params(kernel: str, profile: DeviceProfile, dk: int, dv: int, *, local_mem: int,
                   max_work_group: int, group: int = 1, dtype: str = "float32") -> dict:
    """The configuration of an untuned device (KernelSpace.defaults)."""
    return SPACES[kernel].default(profile, _dims(dk, dv, group, dtype), local_mem=local_mem,
                                  max_work_group=max_work_group)


# --------------------------------------------------------------------------- database

def seq_bucket(n: int) -> int:
    """Sequence-length bucket: the next power of two, clamped to [16, 131072]."""
    return int(min(max(16, 1 << max(0, math.ceil(math.log2(max(n, 1))))), 131072))


def user_tuning_dir() -> Path:
    env = os.environ.get("FLASHCL_TUNING_DIR")
    if env:
        return Path(env)
    return _platform_tuning_dir()


@functools.lru_cache(maxsize=None)
def _platform_tuning_dir() -> Path:
    """The platform's user cache folder for the database (it does not move while a process runs;
    asking platformdirs took ~8 us of every call's lookup)."""
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


_DB_DTYPES = ("float32", "float16")   # what the OpenCL kernels are tuned for
# bfloat16 calls take float16's entries: the same 2-byte rows, loads and tiles, only the widening differs
_DB_DTYPE_OF = {"bfloat16": "float16"}
_MAX_DB_BYTES = 64 << 20             # far past any real database (an entry is ~1 KB)


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
    if e["kernel"] not in SPACES:
        return f"'kernel' is {e['kernel']!r}, expected one of {', '.join(map(repr, SPACES))}"
    if e["dtype"] not in _DB_DTYPES:
        return f"'dtype' is {e['dtype']!r}, expected one of {', '.join(map(repr, _DB_DTYPES))}"
    for name in ("dk", "dv", "bucket"):
        v = e.get(name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            return f"'{name}' is {v!r}, expected a positive integer" if name in e else f"'{name}' is missing"
    if not isinstance(e.get("causal"), bool):
        return f"'causal' is {field_kind('causal')}, expected true or false"
    for name in ("device", "arch", "vendor", "profile"):
        if e.get(name) is not None and not isinstance(e[name], str):
            return f"'{name}' is {field_kind(name)}, expected a string or null"
    g = e.get("group")
    if g is not None and (isinstance(g, bool) or not isinstance(g, int) or g < 1):
        return f"'group' is {g!r}, expected a positive integer or null"
    if not isinstance(e.get("params"), dict):
        return f"'params' is {field_kind('params')}, expected an object"
    prov = e.get("provenance")
    if prov is not None and not isinstance(prov, dict):
        return f"'provenance' is {field_kind('provenance')}, expected an object"
    if _deeper_than(prov, _MAX_PROVENANCE_DEPTH):
        return f"'provenance' is nested more than {_MAX_PROVENANCE_DEPTH} levels deep"
    return None


def _read(path: Path) -> dict:
    """The file's JSON, checked to be ``{"version": 1, "entries": [...], ...}`` in a regular file of
    at most _MAX_DB_BYTES; TuningDatabaseError otherwise."""
    try:
        st = Path(path).stat()
        if not stat.S_ISREG(st.st_mode):
            raise TuningDatabaseError(f"tuning database {path} is not a regular file; fix or delete it")
        if st.st_size > _MAX_DB_BYTES:
            raise TuningDatabaseError(f"tuning database {path} is {st.st_size} bytes, past the "
                                      f"{_MAX_DB_BYTES} a database can be; fix or delete it")
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
    if data.get("version", DB_VERSION) != DB_VERSION:
        raise TuningDatabaseError(f"tuning database {path} is version {data['version']!r}; this flashcl reads "
                                  f"version {DB_VERSION} (a newer flashcl wrote it?); fix or delete it")
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


def _load(path: "str | Path") -> _DbFile | None:
    """The parsed file, None if it does not exist."""
    # Stat before reading: a write racing the read leaves a stamp newer than the one cached, so
    # the next call parses again. os.replace gives every save a new inode, so two saves of the
    # same size within one clock tick still differ.
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise TuningDatabaseError(f"tuning database {path} cannot be read ({exc}); fix or delete it") from None
    stamp = (st.st_size, st.st_mtime_ns, st.st_ino)
    with _parsed_lock:
        hit = _parsed.get(str(path))
        if hit is None or hit[0] != stamp:
            try:
                hit = (stamp, _parse(Path(path)))
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
    """The folder's database files (every ``*.json`` name, in order; one that is not a regular
    file is _load's error); none where the folder does not exist or cannot be listed."""
    try:
        with os.scandir(folder) as listing:
            paths = sorted(e.path for e in listing if e.name.endswith(".json"))
    except OSError:
        return []
    found = (_load(p) for p in paths)
    return [db for db in found if db is not None]  # None: removed since the listing


def database_files() -> tuple:
    """The parsed files a lookup reads now: the user folder's, then the shipped folder's. Each
    version of a file is parsed once and kept (``_load``), so the same objects mean the same
    database, and a result computed from them still holds (DeviceHandle.chosen)."""
    return tuple(tuple(_files(folder)) for folder in (user_tuning_dir(), shipped_tuning_dir()))


def _copy_entry(e: dict) -> dict:
    """A copy to hand out: its params and provenance (the parts callers read) are its own. Not a
    deepcopy: a field flashcl does not read may be nested deeper than copying recurses."""
    return dict(e, params=dict(e["params"]), provenance=copy.deepcopy(e.get("provenance")))


def _mode(e) -> str | None:
    prov = e.get("provenance") if isinstance(e, dict) else None
    return prov.get("mode") if isinstance(prov, dict) else None


@dataclass(frozen=True)
class DeviceKey:
    """What the database matches on for one device: its exact name, its architecture and the
    family of that (``device_arch``, ``arch_family``: "nvidia-sm90" / "nvidia-sm9x", "adreno-740"
    / "adreno-7xx"), its profile ("adreno-6xx") and vendor ("adreno", the profile family)."""

    name: str
    arch: str | None
    vendor: str
    profile: str
    family: str | None = None

    @staticmethod
    def of(name: str, opencl_c_version: str, vendor: str, profile: str, *,
           compute_capability: tuple | None = None) -> "DeviceKey":
        arch = device_arch(name, opencl_c_version, vendor, compute_capability)
        return DeviceKey(name.strip(), arch, profile.split("-")[0] if profile else vendor, profile, arch_family(arch))

    @staticmethod
    def for_device(dev, profile: str) -> "DeviceKey":
        """The key of a pyopencl Device; NVIDIA's compute capability comes from
        cl_nv_device_attribute_query where the driver has it."""
        cc = None
        if "nvidia" in f"{dev.vendor} {dev.platform.name}".lower():
            try:
                cc = (int(dev.compute_capability_major_nv), int(dev.compute_capability_minor_nv))
            except Exception:  # no such extension (pyopencl raises LogicError), or an old pyopencl
                cc = None
        return DeviceKey.of(dev.name, dev.opencl_c_version, dev.vendor, profile, compute_capability=cc)

    @staticmethod
    def modeled(profile: DeviceProfile) -> "DeviceKey":
        """The key of a profile standing in for an absent device (model mode)."""
        return DeviceKey("", None, profile.name.split("-")[0], profile.name)


@dataclass(frozen=True)
class Choice:
    params: dict
    source: str          # "tuned <file> (<level>, bucket N, measured|modeled)" or "profile default (<name>)"
    entry: dict | None = None
    reason: str = ""     # why this entry applies to the device, in words (show-config)


def arch_label(arch: str | None) -> str:
    """"sm_90" for "nvidia-sm90"; other architectures as they are."""
    m = re.fullmatch(r"nvidia-sm(\d+)(\d)", arch or "")
    return f"sm_{m.group(1)}{m.group(2)}" if m else str(arch)


def _arch_compatible(e: dict, d: DeviceKey) -> bool:
    """A device name alone does not tell Adreno models apart ("QUALCOMM Adreno(TM)" names them all)."""
    return not e.get("arch") or not d.arch or e.get("arch") == d.arch


# Match levels, most specific first: the device, a measured relative of the same architecture,
# then of the same family, then the profile, then the vendor. The profile level holds modeled
# entries (a profile's vendor and name, no device): "adreno-6xx" must not borrow the a7xx model's
# tiles.
_LEVELS = (
    ("device", lambda e, d: bool(d.name) and e.get("device") == d.name and _arch_compatible(e, d)),
    ("arch", lambda e, d: d.arch is not None and e.get("arch") == d.arch
     and not (d.name and e.get("device") == d.name)),
    ("family", lambda e, d: d.family is not None and e.get("arch") != d.arch
     and arch_family(e.get("arch")) == d.family),
    ("profile", lambda e, d: e.get("profile") == d.profile and not e.get("device") and not e.get("arch")),
    ("vendor", lambda e, d: e.get("vendor") == d.vendor and not e.get("device") and not e.get("arch")
     and not e.get("profile")),
)

_PROBLEM_FIELDS = ("kernel", "dtype", "dk", "dv", "causal", "bucket", "group")


def _why(level: str, e: dict, d: DeviceKey) -> str:
    """Why entry ``e``, found at ``level``, applies to device ``d``."""
    whose = f"{e['device']}'s" if e.get("device") else f"the {e.get('arch')} entry"
    if level == "device":
        return f"tuned for {d.name}"
    if level == "arch":
        return f"no entry for {d.name}; using {whose} (same architecture {arch_label(d.arch)})"
    if level == "family":
        return (f"no entry for {d.name}; using {whose} ({arch_label(e.get('arch'))}, same family "
                f"{d.family} as {arch_label(d.arch)})")
    if level == "profile":
        return f"no measured entry for {d.name or 'this device'}; using the modeled entry of profile {d.profile}"
    return f"no entry for {d.name or d.profile}'s device, architecture or profile; using the {d.vendor} vendor entry"


def lookup(kernel: str, dev: DeviceKey, *, dtype: str, dk: int, dv: int, causal: bool, n: int,
           validate=None, group: int | None = None) -> Choice | None:
    """The best database entry for this call, or None. ``validate(params) -> [errors]``.
    ``group``: decode's GQA group; entries of that group come before those that name none, and
    entries of another group never apply.

    An entry whose parameters fail ``validate`` (a hand-edited file, a database from another
    device) is skipped with a warning naming the file; the next match or the defaults are used.
    """
    problem = _problem_key(kernel, _DB_DTYPE_OF.get(dtype, dtype), dk, dv, causal)
    files_by_folder = database_files()
    bucket = seq_bucket(n)
    for level, match in _LEVELS:
        for files in files_by_folder:
            cands = [e for db in files for e in db.candidates(problem, level, match, dev)
                     if e.get("group") in (None, group)]
            # the exact group first, then the nearest bucket; at equal distance measured beats modeled
            cands.sort(key=lambda e: (e.get("group") != group, abs(math.log2(e["bucket"]) - math.log2(bucket)),
                                      _mode(e) != "measured"))
            for e in cands:
                errs = validate(e["params"]) if validate else []
                if errs:
                    warnings.warn(f"ignoring tuning entry in {e['_file']} for {kernel} on {dev.name or dev.profile}: "
                                  f"{'; '.join(errs)}; using the next match or the defaults", stacklevel=3)
                    continue
                return Choice(dict(e["params"]), f"tuned {e['_file']} ({level}, bucket {e['bucket']}, "
                                                 f"{_mode(e) or 'measured'})", _copy_entry(e), _why(level, e, dev))
    return None


def driver_mismatch(choice: Choice, driver: str) -> str | None:
    """A one-line warning when ``choice`` comes from an entry measured with another driver than
    ``driver`` (the attached device's); None when they agree or nothing was measured."""
    prov = (choice.entry or {}).get("provenance")
    if not isinstance(prov, dict) or _mode(choice.entry) != "measured" or not prov.get("driver"):
        return None
    if str(prov["driver"]).strip() == driver.strip():
        return None
    return (f"the tuning entry was measured with driver {prov['driver']}, this device runs {driver}; "
            f"retune with `flashcl tune` if its times matter")


# --------------------------------------------------------------------------- writing

def make_entry(kernel: str, dev: DeviceKey, *, dtype: str, dk: int, dv: int, causal: bool, n: int,
               params: dict, provenance: dict, group: int | None = None) -> dict:
    """A database entry; ``provenance`` holds device, driver, flashcl, date, mode (measured|modeled)
    and whatever else explains the choice (time, metric, command). ``group``: decode's GQA group."""
    e = {"kernel": kernel, "dtype": dtype, "dk": dk, "dv": dv, "causal": bool(causal), "bucket": seq_bucket(n),
         "device": dev.name or None, "arch": dev.arch, "vendor": dev.vendor, "profile": dev.profile,
         "params": dict(params), "provenance": dict(provenance)}
    if group is not None:
        e["group"] = int(group)
    return e


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
            dv: int, causal: bool, n: int, group: int | None = None) -> Choice:
    """The parameters a call runs with: the caller's ``params`` (invalid ones are a ValueError),
    else the best valid database entry for this device, else ``default()`` -- the profile's.
    ``errors(params) -> [sentences]`` validates against the kernel's constraints and the device."""
    if params is not None:
        errs = errors(params)
        if errs:
            raise ValueError("params: " + "; ".join(errs))
        return Choice(dict(params), "params= override", reason="given by the caller")
    key = DeviceKey.for_device(handle.device, handle.profile.name)
    found = lookup(kernel, key, dtype=dtype, dk=dk, dv=dv, causal=causal, n=n, validate=errors, group=group)
    if found is not None:
        return found
    return default_choice(handle.profile.name, default())


def default_choice(profile: str, params: dict) -> Choice:
    return Choice(params, f"profile default ({profile})",
                  reason=f"no tuning entry applies; the {profile} profile's default")

