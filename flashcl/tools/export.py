"""``flashcl export``: the tuned OpenCL kernels as files that a C or C++ app builds with its own
host code (phones ship C++ and OpenCL, not Python).

One folder holds:

* one self-contained ``.cl`` source per problem class and parameter set: a header comment naming
  flashcl's version, the target and where the parameters came from; the tuned defines as
  ``#define`` lines; every ``#include`` inlined. It builds with no options (no ``-D``, no ``-I``).
* ``manifest.json``: every kernel, its arguments in order (OpenCL C type, host type, meaning), its
  work-group and grid formulas with the sizes of each exported shape, the build options and the
  parameters' provenance.
* ``example.c``, ``example_config.h`` and ``run_example.sh``: a C99 host program on the OpenCL 1.2
  API that builds every exported source on the first device that builds them, runs one causal
  GQA prefill and one paged decode (a permuted block table, a partial last block, split-k with the
  merge, and the single pass), checks them against a naive attention in double and exits 0 only
  if every relative error is within the dtype's tolerance (``flashcl.reference.TOLERANCE``).

The defines, grids, arguments and parameter choice are the ones the Python host code uses
(``opencl.prefill.program``/``launch_grid``/``ARGS``, ``opencl.decode.program_defines``/
``launch_grid``/``ARGS``, ``choose_params``); in model mode (a profile name with no such device
attached) the parameters come from the tuning database's modeled entries or the profile default,
as ``flashcl show-config`` shows them, and the manifest says "modeled". The kernels are portable
OpenCL 1.2, so the example runs on whatever device the machine has.

Attention variants and quantized caches (``variants``, ``kv_format``) are compile-time defines of
the same kernels (prefill: HAS_WINDOW, HAS_SOFTCAP, HAS_SINKS, HAS_ALIBI, MASK_KIND; decode.cl:
WINDOW, SOFTCAP, SINKS, ALIBI, KEY_START; both: K_QUANT, V_QUANT): each combination of variants
exported gets sources of its own with those defines fixed (a mask is prefill's alone, key_start
decode's alone: each kernel takes those of the rest), the K/V format holds for all of them, the
manifest lists the arguments those builds take, and example.c runs every combination: the
variants' values, K/V quantized on the host in C, and a reference in double with the same
semantics. With none of them the export is the plain one.

What is not exported: decode_mma.cl (NVIDIA tensor cores, inline PTX), decode_cpu.cl (the CPU
decode layout: a CPU target exports decode.cl's "lanes" layout, tuned entries of it where they
apply) and the contiguous-cache decode; decode.cl serves paged caches on every device.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from .. import tuning
from .._resources import kernel_dir
from .._version import __version__
from ..opencl import decode as dec
from ..opencl import prefill as pre
from ..opencl.arrays import QUANT_CODES
from ..profiles import DeviceProfile, find_profile
from ..reference import TOLERANCE
from ..variants import DECODE_GROUP_ROWS, DECODE_ROWS
from . import shapes as shape_sets
from .tuner import TunerError, resolve_target

FORMAT = 1
MANIFEST = "manifest.json"
EXAMPLE_FILES = ("example.c", "example_config.h", "run_example.sh")

# The reference shapes (docs/design.md §7): prefill (B, H_q, H_kv, N, d, causal), decode
# (B, H_q, H_kv, ctx, d).
DEFAULT_PREFILL = tuple(shape_sets.PREFILL_REFERENCE)
DEFAULT_DECODE = tuple((b, hq, hkv, ctx, shape_sets.DECODE_HEAD_DIM)
                       for b, hq, hkv, ctx in shape_sets.DECODE_REFERENCE)

# What example.c runs: small shapes of the exported classes, quick on a CPU. Prefill: causal
# (bottom-right, N_q < N_kv), GQA 3:1, N not a multiple of any tile. Decode: two sequences over a
# paged cache of blocks of 16, contexts ending inside a block, the table permuted, 3 splits (one
# of them empty for the shorter sequence) and then 1.
EXAMPLE_PREFILL = {"B": 2, "H_KV": 2, "GROUP": 3, "N_Q": 67, "N_KV": 131}
EXAMPLE_DECODE = {"B": 2, "H_KV": 2, "BLOCK_SIZE": 16, "CTX": (45, 30), "SPARE_BLOCKS": 2, "SPLITS": 3}

# The variants an export can fix (flashcl.variants) and the K/V formats (kv_formats.h codes). A
# mask is prefill-only (decode has one query row) and exports as a bool mask (MASK_KIND 1);
# key_start (each sequence's first key: a left-padded batch's decode step) is decode-only.
VARIANTS = ("window", "softcap", "sinks", "alibi", "mask", "key_start")
PREFILL_ONLY, DECODE_ONLY = ("mask",), ("key_start",)
KV_FORMATS = tuple(QUANT_CODES)
# The variants' values example.c runs: a window of 7 keys left (and 3 right on a non-causal
# prefill) and 20 left on decode, so that the 3 decode splits divide the windowed keys; softcap 30
# over queries scaled so that scores reach it; random sinks and per-batch ALiBi slopes; a bool mask
# with a row that sees nothing and a key tile that batch 1 never sees; decode's first keys inside a
# block (13 of 45) and one past a block's edge (17 of 30, so that with the window it still hides some).
EXAMPLE_VARIANTS = {"WINDOW_LEFT": 7, "WINDOW_RIGHT_NONCAUSAL": 3, "DECODE_WINDOW_LEFT": 20,
                    "SOFTCAP": 30.0, "Q_GAIN_SOFTCAP": 8.0, "EMPTY_ROW": 5, "KEY_START": (13, 17)}
# Byte layout of each K/V format (kv_quant.h; ggml's block_q8_0 / block_q4_0)
KV_LAYOUTS = {
    "q8_0": {"row": "D/32 blocks of 34 bytes: fp16 d (little-endian), then 32 int8 q",
             "value": "value j of a block = d * q[j]",
             "quantize": "ggml's quantize_row_q8_0_ref: d = amax / 127, q = roundf(x / d) (0 when d = 0)",
             "reference": "ggml block_q8_0 (ggml/src/ggml-common.h, ggml-quants.c)"},
    "q4_0": {"row": "D/32 blocks of 18 bytes: fp16 d (little-endian), then 16 bytes of nibbles: byte i holds "
                    "value i in its low nibble and value i + 16 in its high nibble",
             "value": "value j of a block = (nibble j - 8) * d",
             "quantize": "ggml's quantize_row_q4_0_ref: max = the value of largest magnitude (with its sign, "
                         "the first on ties), d = max / -8, nibble = min(15, (int8)(x / d + 8.5))",
             "reference": "ggml block_q4_0 (ggml/src/ggml-common.h, ggml-quants.c)"},
    "int8": {"row": "D int8 bytes, and one float32 scale per row in a separate buffer laid out like the rows "
                    "(prefill: k_scales / v_scales; decode: the same, with ks_off / vs_off)",
             "value": "value j = scale * q[j]",
             "quantize": "scale = amax / 127, q = clamp(roundf(x / scale), -127, 127) (scale 0: q = 0)",
             "reference": "flashcl.quant (int8 rows, as in vLLM's per-token int8 KV cache)"},
}


class ExportError(ValueError):
    """The export cannot be written as asked (a folder that holds something else)."""


# --------------------------------------------------------------------------- the target

@dataclass
class Target:
    """What the kernels are exported for: an attached device (measured: its tuning entries, limits
    and compiler) or a profile standing in for an absent one (modeled)."""

    profile: DeviceProfile
    key: tuning.DeviceKey
    mode: str                  # "measured" | "modeled"
    name: str
    handle: object = None      # runtime.DeviceHandle when measured
    local_mem: int = 0
    max_work_group: int = 0

    @property
    def is_cpu(self) -> bool:
        return self.handle.is_cpu if self.handle is not None else self.profile.name == "cpu"

    @property
    def driver(self) -> str | None:
        return self.handle.driver if self.handle is not None else None

    @property
    def cache_bytes(self) -> int | None:
        return int(self.handle.device.global_mem_cache_size) if self.handle is not None else None

    @property
    def compute_units(self) -> int | None:
        return int(self.handle.device.max_compute_units) if self.handle is not None else None

    def describe(self) -> str:
        if self.mode == "modeled":
            return (f"model mode: no {self.profile.name} device is attached; the parameters were not "
                    f"measured: they are the {self.profile.name} profile's modeled tiles (tuning database "
                    f"entries marked modeled, else the profile default)")
        return f"measured: {self.handle.describe()}"


def resolve(device: str | None, *, require_device: bool = False) -> Target:
    """``device`` as ``flashcl tune`` takes it: an attached device, or a profile name that gives
    model mode when no such device is attached. Model mode needs no OpenCL device at all."""
    from ..opencl.runtime import get_device

    try:
        t = resolve_target(device, require_device=require_device)
    except TunerError:
        prof = find_profile(device) if device else None
        if prof is None or require_device:
            raise
        return Target(prof, tuning.DeviceKey.modeled(prof), "modeled", f"{prof.name} (profile)",
                      local_mem=prof.local_mem, max_work_group=prof.max_work_group)
    if t.mode == "modeled":
        return Target(t.profile, t.key, "modeled", t.name, local_mem=t.local_mem, max_work_group=t.max_work_group)
    handle = get_device(t.device_spec)
    return Target(handle.profile, t.key, "measured", handle.name, handle, handle.local_mem, handle.max_work_group)


def choose(target: Target, kernel: str, prob, n: int) -> tuning.Choice:
    """The parameters a call of ``prob`` would use on the target: the library's own choice on an
    attached device; in model mode the database lookup and profile default of show-config."""
    space = tuning.SPACES[kernel]
    group = prob.group if kernel == "decode" else None
    dims = tuning.Dims(prob.dk, prob.dv, group or 1, prob.dtype)
    limits = {"local_mem": target.local_mem, "max_work_group": target.max_work_group}
    if target.handle is not None:
        if kernel == "prefill":
            return pre.choose_params(target.handle, prob)
        choice = dec.choose_params(target.handle, prob, None, n)
        if not tuning.is_rows(choice.params):
            return choice

    def export_errors(p):  # decode: decode.cl's layout only (the module docstring), on an attached CPU too
        rows = kernel == "decode" and tuning.is_rows(p)
        return space.check(p, dims, limits) + (["decode_cpu.cl is not exported"] if rows else [])

    found = tuning.lookup(kernel, target.key, dtype=prob.dtype, dk=prob.dk, dv=prob.dv,
                          causal=kernel == "prefill" and prob.causal, n=n, group=group, validate=export_errors)
    if found is not None:
        return found
    default = space.default(target.profile, dims, local_mem=target.local_mem, max_work_group=target.max_work_group)
    if export_errors(default):  # the cpu profile's decode_cpu.cl
        params = tuning.decode_layout_defaults("lanes", target.profile, dims, limits)
        return tuning.Choice(params, f"decode.cl's default ({target.profile.name} profile)",
                             reason="no tuning entry of decode.cl's layout applies; its default for the profile")
    return tuning.default_choice(target.profile.name, default)


# --------------------------------------------------------------------------- sources

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*(?:/\*.*\*/)?\s*$')


def inline_includes(name: str) -> str:
    """clkernels/``name`` with every quoted ``#include`` replaced by the header's text (each
    header once; a later include of it is a comment)."""
    root, seen = kernel_dir(), set()

    def expand(fname: str) -> str:
        out = []
        for line in (root / fname).read_text().splitlines(keepends=True):
            m = _INCLUDE.match(line)
            if not m:
                out.append(line)
            elif m.group(1) in seen:
                out.append(f'/* #include "{m.group(1)}": inlined above */\n')
            else:
                seen.add(m.group(1))
                body = expand(m.group(1))
                out += [f'/* ---- #include "{m.group(1)}" (inlined) ---- */\n', body,
                        "" if body.endswith("\n") else "\n", f'/* ---- end of "{m.group(1)}" ---- */\n']
        return "".join(out)

    return expand(name)


def _define_value(v) -> str:
    return str(int(v)) if isinstance(v, bool) else str(v)


@dataclass
class Source:
    """One exported source: a problem class and parameter set."""

    kernel: str                      # "prefill" | "decode"
    origin: str                      # the clkernels/ file
    entries: tuple                   # kernel names in it
    problem: dict                    # the class: dtype, dk, dv, causal | group, paged
    params: dict
    defines: dict
    choice: tuning.Choice
    work_group: int
    file: str = ""
    shapes: list = field(default_factory=list)   # [(shape dict, launches dict)]

    @property
    def store_t(self) -> str:  # bfloat16: its bits (STORE_BF16)
        return {"float16": "half", "bfloat16": "ushort"}.get(self.problem["dtype"], "float")

    def text(self, target: Target, command: str, date: str) -> str:
        p = self.problem
        what = (f"{p['dtype']}, DK={p['dk']}, DV={p['dv']}, "
                + (("causal" if p["causal"] else "non-causal") if self.kernel == "prefill"
                   else f"GQA group {p['group']}, {'paged' if p['paged'] else 'contiguous'} cache"
                   + (f", {_rows(p)} query rows a sequence" if _rows(p) > 1 else ""))
                + "".join(f", {x}" for x in p.get("variants", ()))
                + (f", {p['kv_format']} K/V cache" if p.get("kv_format") else ""))
        prov = (self.choice.entry or {}).get("provenance")
        lines = [f"flashcl {__version__}: clkernels/{self.origin} exported for {target.name}"
                 + (" (model mode: parameters not measured)" if target.mode == "modeled" else ""),
                 "",
                 f"Problem class: {self.kernel} {what}.",
                 f"Kernels: {', '.join(self.entries)}.",
                 "Parameters: " + " ".join(f"{k}={v}" for k, v in self.params.items()),
                 f"  from: {self.choice.source}",
                 f"  why:  {self.choice.reason}"]
        if isinstance(prov, dict):
            lines.append("  provenance: " + ", ".join(f"{k} {v}" for k, v in prov.items()
                                                      if k in ("mode", "device", "driver", "flashcl", "date")))
        lines += [f"Exported by `{command}` ({date}).",
                  "",
                  "Self-contained: every #include is inlined and every define is fixed below, so this",
                  "source builds with no options (no -D, no -I). The kernels rely on IEEE inf and NaN:",
                  "do not add -cl-fast-relaxed-math or -cl-finite-math-only. Arguments in order, grid",
                  f"and work-group sizes: {MANIFEST}, the \"kernels\" entries whose \"file\" is this one."]
        head = "\n".join(ln.rstrip() for ln in ("/* " + "\n * ".join(lines) + "\n */").splitlines()) + "\n"
        defines = "".join(f"#define {k} {_define_value(v)}\n" for k, v in self.defines.items())
        return (head + "\n/* ---- the tuned defines (fixed at export) ---- */\n" + defines + "\n"
                + inline_includes(self.origin))


def _rows(problem: dict) -> int:
    """A decode class's query rows a sequence (1 unless exported with decode_rows)."""
    return problem.get("rows", 1)


def _file_stem(src: Source) -> str:
    p = src.problem
    stem = f"{src.kernel}-{p['dtype']}-dk{p['dk']}-dv{p['dv']}"
    if src.kernel == "prefill":
        stem += ("-causal" if p["causal"] else "") + ("-tiles" if src.origin == "prefill_tiles.cl" else "")
    else:
        stem += f"-g{p['group']}" + (f"-rows{_rows(p)}" if _rows(p) > 1 else "") + ("-paged" if p["paged"] else "")
    return stem + "".join(f"-{x}" for x in p.get("variants", ())) + (f"-{p['kv_format']}" if p.get("kv_format") else "")


def decode_arg_spec(problem: dict) -> tuple:
    """flash_decode's arguments for an exported decode class: DECODE_PARAMS, then VARIANT_PARAMS
    in builds with a variant or query rows on (with key_start last in its builds), then
    QUANT_PARAMS in builds that read an int8 cache."""
    variants = problem.get("variants", ())
    return (dec.ARGS + (dec.VARIANT_ARGS if variants or _rows(problem) > 1 else ())
            + (dec.KEY_START_ARGS if "key_start" in variants else ())
            + (dec.QUANT_ARGS if problem.get("kv_format") == "int8" else ()))


# --------------------------------------------------------------------------- the manifest's kernels

def _host_type(ctype: str) -> str:
    if ctype.startswith("__local"):
        return "local memory: clSetKernelArg(kernel, index, bytes, NULL)"
    if "*" in ctype:
        return "cl_mem"
    return {"int": "cl_int", "float": "cl_float", "ulong": "cl_ulong"}[ctype.split()[-1]]


_KV_ADDRESSING = re.compile(r"^[kv]_(off|sb|sh|sn)$")


def _args(spec, src: Source) -> list[dict]:
    raw_t = "float4" if src.store_t == "float" else "uint4"
    quantized = bool(src.problem.get("kv_format"))

    def meaning_of(name: str, meaning: str) -> str:  # a quantized cache is addressed in bytes
        return meaning.replace("in elements", "in bytes (quantized cache)") if quantized and \
            _KV_ADDRESSING.match(name) else meaning

    return [{"index": i, "name": name, "type": ctype.replace("store_t", src.store_t).replace("raw_t", raw_t),
             "host": _host_type(ctype), "meaning": meaning_of(name, meaning)}
            for i, (name, ctype, meaning) in enumerate(spec)]


def _split_rule(params: dict) -> str:
    space = tuning.SPACES["decode"]
    waves, keys = space.value(params, "SPLIT_WAVES"), space.value(params, "SPLIT_KEYS")
    return (f"flashcl's choice (any count from 1 to {dec.MAX_FORCED_SPLITS} gives the same result): "
            f"min(cap, max(fill, work)) with fill = pow2_floor({waves} * CUs / (B * H_kv)) (1 when "
            f"{waves} * CUs < B * H_kv), work = pow2_floor(ctx / {keys}) (1 when ctx < {keys}), cap = "
            f"pow2_floor(max(1, min({dec.MAX_SPLITS}, ctx / {dec.MIN_KEYS_PER_SPLIT}))); CUs = "
            f"CL_DEVICE_MAX_COMPUTE_UNITS, ctx = the batch's longest context")


def _kernel_entries(src: Source, target: Target) -> list[dict]:
    common = {"file": src.file, "source": f"clkernels/{src.origin}", "problem": src.problem,
              "params": src.params, "defines": {k: int(v) if isinstance(v, bool) else v
                                                for k, v in src.defines.items()},
              "build_options": "",
              "parameters_from": {"mode": _mode_of(src.choice, target), "source": src.choice.source,
                                  "why": src.choice.reason,
                                  "provenance": (src.choice.entry or {}).get("provenance")}}
    wg = src.work_group
    if src.kernel == "prefill":
        d = src.defines
        num_dv = d["HEAD_DV"] // d["DV_TILE"]
        wg_formula = ("BLOCK_M: one query row per work-item" if src.origin == "prefill.cl"
                      else "(BLOCK_M / TILE_M) * (BLOCK_N / TILE_N): a TILE_M x TILE_N micro-tile per work-item")
        return [{"name": src.entries[0], **common, "args": _args(pre.ARGS, src),
                 "work_dim": 1, "local_size": [wg, 1, 1], "work_group_formula": wg_formula,
                 "global_size": [f"B * H_q * ceil(N_q / {d['BLOCK_M']}) * {num_dv} * {wg}", "1", "1"],
                 "grid_formula": "B * H_q * (query blocks of BLOCK_M rows) * (HEAD_DV / DV_TILE slices) "
                                 "work-groups in dimension 0; the kernel maps a group to its tile",
                 "launches": [{"shape": s, **launch["prefill"]} for s, launch in src.shapes]}]
    mwg = src.params["MERGE_WG"]
    split_note = _split_rule(src.params)
    decode_common = {**common, "args": _args(decode_arg_spec(src.problem), src), "work_dim": 3,
                     "local_size": [wg, 1, 1],
                     "work_group_formula": "LANES * ROWS * (GROUP / HEAD_TILE), LANES = max(HEAD_DK, HEAD_DV) "
                                           "/ (16 / sizeof(store_t)): the lanes of a row read its 16-byte chunks",
                     "global_size": [f"{wg} * num_splits", "H_kv", "B"],
                     "grid_formula": "one work-group per (split, KV head, sequence); each serves the KV head's "
                                     "whole GQA group of query heads",
                     "num_splits": split_note}
    rows = _rows(src.problem)
    rows_note = {}
    if rows > 1:
        rows_note["query_rows"] = (
            f"{rows} query rows a sequence, causal among themselves: q (B, H_q, {rows}, DK) C-contiguous is "
            f"passed as (B, H_q * {rows}, DK), so every H_q of these arguments and grids is H_q * {rows}: "
            f"kernel head h is row h % {rows} of query head h / {rows}, at position ctx - {rows} + h % {rows} "
            f"(a row before the first key sees none); out, lse and the partials likewise (out (B, H_q, {rows}, "
            f"DV)); sinks (H_q * {rows},) and alibi_slopes (B, H_q * {rows}) hold each query head's value "
            f"{rows} times; the variant arguments are always passed (those of a variant that is off are never read)")
        decode_common.update(rows_note)
    return [
        {"name": "flash_decode", **decode_common, "global_size": [f"{wg}", "H_kv", "B"],
         "runs": "alone when num_splits == 1 (pass num_splits = 1): writes out and lse",
         "launches": [{"shape": s, **launch["flash_decode"]} for s, launch in src.shapes]},
        {"name": "flash_decode_split", **decode_common,
         "runs": "when num_splits > 1, then flash_decode_merge on the same in-order queue",
         "workspace": {"part_m": "float32 (B, H_q, num_splits)", "part_l": "float32 (B, H_q, num_splits)",
                       "part_acc": "float32 (B, H_q, num_splits, DV)"},
         "launches": [{"shape": s, **launch["flash_decode_split"]} for s, launch in src.shapes
                      if launch["flash_decode_split"]]},
        {"name": "flash_decode_merge", **common, **rows_note, "args": _args(dec.MERGE_ARGS, src), "work_dim": 2,
         "local_size": [mwg, 1], "work_group_formula": "MERGE_WG",
         "global_size": [f"{mwg} * H_q", "B"], "grid_formula": "one work-group per (query head, sequence)",
         "runs": "after flash_decode_split when num_splits > 1",
         "launches": [{"shape": s, **launch["flash_decode_merge"]} for s, launch in src.shapes
                      if launch["flash_decode_merge"]]},
    ]


def _mode_of(choice: tuning.Choice, target: Target) -> str:
    """measured / modeled / default: how the parameters were arrived at."""
    if choice.entry is not None:
        return (choice.entry.get("provenance") or {}).get("mode", "measured")
    return "profile default" + (" (model mode)" if target.mode == "modeled" else "")


# --------------------------------------------------------------------------- export

@dataclass
class Result:
    out: Path
    target: Target
    sources: list
    manifest: dict
    files: list


def export(out, *, device: str | None = None, prefill_shapes=None, decode_shapes=None,
           dtype: str = "float16", command: str = "flashcl export", require_device: bool = False,
           check_build: bool = True, variants=(), kv_format: str | None = None, decode_rows: int = 1) -> Result:
    """Write the export of ``prefill_shapes`` (B, H_q, H_kv, N, d, causal) and ``decode_shapes``
    (B, H_q, H_kv, ctx, d) into the folder ``out``, d the head dim of q, K and V or a pair (DK, DV);
    None means the reference shapes. On an
    attached device each source is also built as written (``check_build``). ``variants``: one
    combination of VARIANTS' names, or a list of combinations (an empty one is the plain
    kernels), each exported in sources of its own; ``kv_format`` (one of KV_FORMATS) stores K and
    V in every source; ``decode_rows`` > 1: each decode sequence's last query rows, causal among
    themselves (speculative verification; decode.cl's QUERY_ROWS). None of them gives the plain
    export."""
    if dtype not in _STORE_KINDS:
        raise ValueError(f"dtype: flashcl export writes float32, float16 and bfloat16 kernels, got {dtype!r}")
    prefill_shapes = DEFAULT_PREFILL if prefill_shapes is None else tuple(prefill_shapes)
    decode_shapes = DEFAULT_DECODE if decode_shapes is None else tuple(decode_shapes)
    if not prefill_shapes or not decode_shapes:
        raise ValueError("export needs at least one prefill and one decode shape (the example runs both)")
    combos = check_combinations(variants)
    check_decode_rows(decode_rows, [hq // hkv for _, hq, hkv, *_ in decode_shapes])
    check_kv_format(kv_format, dtype, [x for s in prefill_shapes + decode_shapes for x in _head_dims(s[4])])
    # combinations that differ only in a variant one kernel lacks share that kernel's sources
    prefill_combos = list(dict.fromkeys(_prefill_variants(c) for c in combos))
    decode_combos = list(dict.fromkeys(_decode_variants(c) for c in combos))
    out = Path(out)
    previous = _previous_export(out)
    target = resolve(device, require_device=require_device)
    sources: dict = {}

    for combo, (b, hq, hkv, n, d, causal) in ((c, s) for c in prefill_combos for s in prefill_shapes):
        dk, dv = _head_dims(d)
        prob = pre.PrefillProblem(b, hq, hkv, n, n, dk, dv, bool(causal), dtype, kv_format, kv_format)
        choice = choose(target, "prefill", prob, n)
        origin, entry, defines = pre.program(prob, choice.params, write_lse=True, unroll_loops=not target.is_cpu,
                                             flags=_prefill_flags(combo))
        src = _source(sources, "prefill", origin, (entry,),
                      {"dtype": dtype, "dk": dk, "dv": dv, "causal": bool(causal), **_class_extras(combo, kv_format)},
                      choice, defines, tuning.work_group_size("prefill", choice.params))
        gsize, lsize = pre.launch_grid(prob, choice.params)
        section = pre.head_section(prob, target.cache_bytes) if target.cache_bytes else None
        src.shapes.append(({"B": b, "H_q": hq, "H_kv": hkv, "N_q": n, "N_kv": n},
                           {"prefill": {"global_size": list(gsize), "local_size": list(lsize),
                                        "head_section": section}}))

    for combo, (b, hq, hkv, ctx, d) in ((c, s) for c in decode_combos for s in decode_shapes):
        dk, dv = _head_dims(d)
        # the rows run as heads of their KV head's group (QUERY_ROWS), as flashcl.decode runs them
        prob = dec.DecodeProblem(b, hq * decode_rows, hkv, dk, dv, True, dtype, kv_format, kv_format)
        choice = choose(target, "decode", prob, ctx)
        shuffle = (target.handle is not None  # NVIDIA inline PTX: only where the device is known
                   and dec.row_shuffle_ok(target.handle, choice.params, prob.group, dk, dv, dtype))
        flags = {x.upper(): 1 for x in combo} | ({"QUERY_ROWS": decode_rows} if decode_rows > 1 else {})
        defines = dec.program_defines(prob, choice.params, row_shuffle=shuffle, unroll_merge=not target.is_cpu,
                                      variant_flags=flags)
        wg = dec.work_group_size(choice.params, prob.group, dk, dv, dtype)
        rows = {"rows": decode_rows} if decode_rows > 1 else {}
        src = _source(sources, "decode", "decode.cl", ("flash_decode", "flash_decode_split", "flash_decode_merge"),
                      {"dtype": dtype, "dk": dk, "dv": dv, "group": hq // hkv, **rows, "paged": True,
                       **_class_extras(combo, kv_format)}, choice, defines, wg)
        cus = target.compute_units
        splits = dec.choose_num_splits(cus, b * hkv, ctx, params=choice.params) if cus else None
        one = dec.launch_grid(prob, wg, 1)
        launch = {"flash_decode": {"num_splits": 1, "global_size": list(one[0]), "local_size": list(one[1])},
                  "flash_decode_split": None, "flash_decode_merge": None}
        if splits and splits > 1:
            g, l_ = dec.launch_grid(prob, wg, splits)
            mg, ml = dec.merge_grid(prob, choice.params["MERGE_WG"])
            launch["flash_decode_split"] = {"num_splits": splits, "global_size": list(g), "local_size": list(l_)}
            launch["flash_decode_merge"] = {"num_splits": splits, "global_size": list(mg), "local_size": list(ml)}
        # auto_splits: flashcl's split count for the shape (None in model mode: it depends on the
        # device's compute units)
        src.shapes.append(({"B": b, "H_q": hq, "H_kv": hkv, "ctx": ctx, **({"N_q": decode_rows} if rows else {}),
                            "auto_splits": splits}, launch))

    srcs = list(sources.values())
    _name_files(srcs)
    date = datetime.datetime.now().isoformat(timespec="seconds")
    texts = {s.file: s.text(target, command, date) for s in srcs}
    if check_build and target.handle is not None:
        for s in srcs:
            _check_builds(target, s, texts[s.file])

    out.mkdir(parents=True, exist_ok=True)
    for name in previous:
        if (out / name).is_file():
            (out / name).unlink()
    for name, text in texts.items():
        (out / name).write_text(text)
    picks = _example_choice(srcs, combos)
    manifest = _manifest(target, srcs, texts, command, date, *picks[0])
    manifest.update(_variant_sections(combos, kv_format, picks))
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    (out / "example.c").write_text(EXAMPLE_C)
    (out / "example_config.h").write_text(_example_config(srcs, picks, combos))
    sh = out / "run_example.sh"
    sh.write_text(RUN_EXAMPLE_SH)
    sh.chmod(0o755)
    return Result(out, target, srcs, manifest, list(texts) + [MANIFEST, *EXAMPLE_FILES])


def check_variants(names) -> tuple:
    """One combination: the variant names in VARIANTS' order, each once; an unknown name raises
    ValueError."""
    names = tuple(names or ())
    unknown = [x for x in names if x not in VARIANTS]
    if unknown:
        raise ValueError(f"variants: unknown {', '.join(map(repr, unknown))}; choose from {', '.join(VARIANTS)}")
    return tuple(x for x in VARIANTS if x in names)


def check_combinations(variants) -> list[tuple]:
    """The combinations to export, each once in the order given: ``variants`` is one combination
    (names) or a list of them; none at all is the plain kernels alone."""
    variants = list(variants or ())
    combos = [variants] if all(isinstance(x, str) for x in variants) else variants
    return list(dict.fromkeys(check_variants(c) for c in combos))


def check_decode_rows(rows, groups) -> None:
    """Query rows a decode sequence: 1 to DECODE_ROWS, at most DECODE_GROUP_ROWS a KV head with its
    group's heads (``groups``: each decode shape's H_q / H_kv), as flashcl.decode takes them."""
    if isinstance(rows, bool) or not isinstance(rows, int) or not 1 <= rows <= DECODE_ROWS:
        raise ValueError(f"decode rows: 1 to {DECODE_ROWS} query rows a sequence, got {rows!r}")
    if rows * max(groups, default=1) > DECODE_GROUP_ROWS:
        raise ValueError(f"decode rows: {rows} rows x a group of {max(groups)} query heads is "
                         f"{rows * max(groups)} rows per KV head; a decode takes at most {DECODE_GROUP_ROWS}")


def _prefill_variants(combo: tuple) -> tuple:
    return tuple(x for x in combo if x not in DECODE_ONLY)


def _decode_variants(combo: tuple) -> tuple:
    return tuple(x for x in combo if x not in PREFILL_ONLY)


def _class_extras(combo: tuple, kv_format: str | None) -> dict:
    """A problem class's entries for its variants and K/V format (none in a plain export)."""
    return {**({"variants": list(combo)} if combo else {}), **({"kv_format": kv_format} if kv_format else {})}


def _prefill_flags(variants: tuple) -> dict | None:
    """The prefill kernels' flags of a combination (as Variants.flags() gives them; None: plain)."""
    variants = _prefill_variants(variants)
    if not variants:
        return None
    return {**{x: x in variants for x in VARIANTS if x not in PREFILL_ONLY + DECODE_ONLY},
            "mask": "bool" if "mask" in variants else None}


def _head_dims(d) -> tuple:
    """(DK, DV) of a shape's head-dim field: one int for both, or the pair."""
    return (d, d) if isinstance(d, int) else tuple(d)


def check_kv_format(fmt: str | None, dtype: str, head_dims) -> None:
    """A K/V format the kernels read, for head dims they can address in it (ValueError otherwise):
    ggml blocks of 32 values; int8 rows whose decode pieces stay aligned (decode.cl reads 8 bytes
    (float16 q) or 4 (float32 q) of a row at a time)."""
    if fmt is None:
        return
    if fmt not in KV_FORMATS:
        raise ValueError(f"kv_format: unknown {fmt!r}; choose from {', '.join(KV_FORMATS)}")
    step = 32 if fmt in ("q8_0", "q4_0") else dec.chunk_elems(dtype)
    bad = sorted({d for d in head_dims if d % step})
    if bad:
        raise ValueError(f"kv_format {fmt}: head dims must be multiples of {step}"
                         f"{' (ggml blocks)' if step == 32 else f' for {dtype} queries'}; got d = "
                         f"{', '.join(map(str, bad))}")


def _source(sources: dict, kernel: str, origin: str, entries: tuple, problem: dict, choice: tuning.Choice,
            defines: dict, work_group: int) -> Source:
    key = (kernel, origin, tuple(sorted((k, _define_value(v)) for k, v in defines.items())))
    if key not in sources:
        sources[key] = Source(kernel, origin, entries, problem, dict(choice.params), defines, choice, work_group)
    return sources[key]


def _name_files(srcs: list) -> None:
    """Readable names; a class exported with several parameter sets (tuning entries of different
    sequence-length buckets) numbers them."""
    stems: dict = {}
    for s in srcs:
        stems.setdefault(_file_stem(s), []).append(s)
    for stem, group in stems.items():
        for i, s in enumerate(group):
            s.file = f"{stem}.cl" if len(group) == 1 else f"{stem}-{i + 1}.cl"


def _previous_export(out: Path) -> list[str]:
    """The files of a previous export in ``out`` (replaced by this one); [] for a new or empty
    folder. A folder holding anything else is an error: nothing in it is touched."""
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out}: exists and is not a folder")
    if not out.exists() or not any(out.iterdir()):
        return []
    try:
        old = json.loads((out / MANIFEST).read_text())
        files = [Path(s["file"]).name for s in old["sources"]]
    except (OSError, ValueError, KeyError, TypeError):
        raise ExportError(f"--out {out}: the folder is not empty and holds no flashcl export; choose a new "
                          f"or empty folder") from None
    return files + [MANIFEST, *EXAMPLE_FILES, "example"]


def _check_builds(target: Target, src: Source, text: str) -> None:
    """Build the exported text as an app would (no options) on the attached device, and check that
    each kernel takes its work-group."""
    import pyopencl as cl

    from ..errors import KernelBuildError

    h = target.handle
    prog = cl.Program(h.context, text)
    try:
        prog.build(options=[], devices=[h.device])
    except cl.RuntimeError as exc:
        try:
            log = prog.get_build_info(h.device, cl.program_build_info.LOG) or str(exc)
        except cl.Error:
            log = str(exc)
        raise KernelBuildError(f"exported {src.file}", src.params, h.describe(), log) from None
    needs = {e: src.work_group for e in src.entries}
    if src.kernel == "decode":
        needs["flash_decode_merge"] = src.params["MERGE_WG"]
    for name, need in needs.items():
        kwg = int(cl.Kernel(prog, name).get_work_group_info(cl.kernel_work_group_info.WORK_GROUP_SIZE, h.device))
        if kwg < need:
            raise KernelBuildError(f"exported {src.file}", src.params, h.describe(),
                                   f"error: {name} needs a work-group of {need}, the device allows {kwg}")


def _example_choice(srcs: list, combos: list) -> list[tuple[Source, Source]]:
    """The sources example.c runs, (prefill, decode) per combination: a causal prefill where one
    is exported, the smallest head dims; a decode with a GQA group > 1 where one is exported, the
    smallest group and head dims; the same class and parameters for every combination."""
    p = min((s for s in srcs if s.kernel == "prefill"),
            key=lambda s: (not s.problem["causal"], s.problem["dk"] + s.problem["dv"]))
    d = min((s for s in srcs if s.kernel == "decode"),
            key=lambda s: (s.problem["group"] == 1, s.problem["group"], s.problem["dk"] + s.problem["dv"]))

    def of(pick: Source, variants: tuple) -> Source:  # pick's class and parameters with these variants
        cls = {k: v for k, v in pick.problem.items() if k != "variants"}
        return next(s for s in srcs if s.kernel == pick.kernel and s.origin == pick.origin and s.params == pick.params
                    and {k: v for k, v in s.problem.items() if k != "variants"} == cls
                    and tuple(s.problem.get("variants", ())) == variants)

    return [(of(p, _prefill_variants(c)), of(d, _decode_variants(c))) for c in combos]


def _manifest(target: Target, srcs: list, texts: dict, command: str, date: str, pick_p: Source,
              pick_d: Source) -> dict:
    kernels = [k for s in srcs for k in _kernel_entries(s, target)]
    notes = []
    if target.mode == "modeled":
        notes.append(f"model mode: no {target.profile.name} device was attached; every parameter comes from the "
                     f"{target.profile.name} profile's model (modeled tuning entries or the profile default), "
                     f"not from a measurement. Tune on the device (flashcl tune --device {target.profile.name}) "
                     f"and export again for measured tiles")
    if target.handle is not None and target.handle.is_nvidia:
        notes.append("decode_mma.cl (NVIDIA tensor cores) is not exported: flashcl runs it on sm_80+ "
                     "where this export's decode.cl is the portable path")
    if target.is_cpu:
        notes.append("decode_cpu.cl (flashcl's decode on CPU devices) is not exported: this export's decode.cl "
                     "is the GPU layout, several times slower on a CPU (compare with flashcl bench decode "
                     "--kernel decode.cl and --kernel decode_cpu.cl)")
    return {
        "format": FORMAT, "flashcl": __version__, "date": date, "command": command,
        "target": {"device": target.name, "mode": target.mode, "profile": target.profile.name,
                   "driver": target.driver, "modeled": target.mode == "modeled", "describe": target.describe()},
        "build_options": "",
        "build_note": "every source builds with no options: the defines are fixed at its top and every "
                      "#include is inlined; do not add -cl-fast-relaxed-math or -cl-finite-math-only "
                      "(the kernels rely on IEEE inf and NaN)",
        "notes": notes,
        "sources": [{"file": s.file, "kernels": list(s.entries), "problem": s.problem,
                     "sha256": hashlib.sha256(texts[s.file].encode()).hexdigest()} for s in srcs],
        "kernels": kernels,
        "semantics": {
            "layout": "SDPA order: q (B, H_q, N_q, DK), k (B, H_kv, N_kv, DK), v (B, H_kv, N_kv, DV); "
                      "decode: q (B, H_q, DK) (or (B, H_q, N_q, DK): a class's \"rows\", see a decode "
                      "kernel's \"query_rows\"), paged caches (num_blocks, block_size, H_kv, D) as vLLM's",
            "causal": "bottom-right aligned: query i sees key j iff j <= i + N_kv - N_q",
            "empty_row": "a row that sees no key returns zeros and lse = -inf",
            "accumulation": "float32; float16 data is read with vload_half (no cl_khr_fp16 needed), bfloat16 "
                            "data as its 16 bits (ushort), widened by a shift",
            "tolerance": {k: TOLERANCE[k] for k in _STORE_KINDS},
        },
        "example": {"files": list(EXAMPLE_FILES), "run": "./run_example.sh",
                    "prefill": {"file": pick_p.file, **EXAMPLE_PREFILL},
                    "decode": {"file": pick_d.file, **{k: list(v) if isinstance(v, tuple) else v
                                                      for k, v in EXAMPLE_DECODE.items()}},
                    "device": "the first device of the first platform that builds every source; "
                              "FLASHCL_EXAMPLE_DEVICE=P:D picks one, numbered in the order this program's ICD "
                              "loader lists them (not flashcl devices')"},
    }


def _variant_sections(combos: list, kv_format: str | None, picks: list) -> dict:
    """The manifest's "variants" and "kv_format" sections: what the sources fix and how an app
    passes the values, and the combinations example.c runs (nothing in a plain export)."""
    out = {}
    if any(combos):
        ex = EXAMPLE_VARIANTS
        right = 0 if picks[0][0].problem["causal"] else ex["WINDOW_RIGHT_NONCAUSAL"]
        out["variants"] = {
            "combinations": [{"on": list(c), "prefill_defines": pre.variant_defines(_prefill_flags(c)),
                              "decode_defines": {x.upper(): 1 for x in _decode_variants(c)},
                              "example": {"prefill": p.file, "decode": d.file}}
                             for c, (p, d) in zip(combos, picks)],
            "decode_note": "decode takes no mask; its variant arguments (window_left, softcap_log2, "
                           "sinks, alibi_slopes) follow o_sh only in builds with a variant (or query rows) "
                           "on, and all four are passed then; key_start follows them in KEY_START builds",
            "prefill_note": "the prefill kernels take every variant argument in every build; those of a "
                            "variant that is off are never read (pass any buffer / any value); key_start "
                            "is decode's alone (prefill takes a mask)",
            "semantics": {
                "position": "query row i sits at p = i + N_kv - N_q (decode: p = ctx - 1)",
                "score": "s = scale * q.k; softcap: s = c * tanh(s / c); ALiBi: s -= slope[b, h] * |p - j|; "
                         "in that order; the kernels take scale and softcap times log2(e)",
                "visible": "key j is visible iff causal allows it (j <= p), the window does (p - win_left <= j "
                           "<= p + win_right), the mask does (bool: nonzero) and, in decode, j >= "
                           "key_start[b]; a hidden key never influences the row, even if its K or V is "
                           "NaN or inf",
                "key_start": "KEY_START: int32 (B,) per sequence, the first key its query sees (a left-padded "
                             "batch's decode step); 0 or less hides nothing, ctx[b] or more hides every key "
                             "(zeros, lse = -inf or the sink); the split ranges start there, so the keys "
                             "before it are never read",
                "sinks": "sinks[h] (natural log) joins each row's normalizer as exp(sink - m), m including the "
                         "sink; nothing is added to out; lse = log(sum over visible keys of exp(s) + exp(sink))",
                "empty_row": "a row that sees no key returns zeros, lse = -inf, or = sinks[h] with sinks on",
                "mask": "MASK_KIND 1: uchar (Bm, Hm, N_q, N_kv), Bm in {1, B}, Hm in {1, H_q}, a stride of 0 "
                        "broadcasts; tile_map (Bm, Hm, ceil(N_q / BLOCK_M), ceil(N_kv / BLOCK_N)) uchar per "
                        "(query block, key tile) of the mask alone: 0 every key hidden (the tile is skipped), "
                        "1 some hidden, 2 none; an additive float mask (-inf or <= MASK_HIDES_AT hides) is "
                        "MASK_KIND 2 with the same arguments (flashcl.opencl.prefill.mask_tile_map computes "
                        "the map)",
            },
            "example_values": {"prefill_window": [ex["WINDOW_LEFT"], right],
                               "decode_window_left": ex["DECODE_WINDOW_LEFT"], "softcap": ex["SOFTCAP"],
                               "sinks": "q_gain * (1 + normal(0, 1)) per query head (q_gain: the factor "
                                        "on q, 8 with a softcap so that scores reach it, else 1)",
                               "alibi_slopes": "uniform in (0.05, 0.5) per (sequence, query head)",
                               "mask": f"(B, 1, N_q, N_kv) bool, 80% visible; row {ex['EMPTY_ROW']} of batch 0 "
                                       "sees nothing; batch 1 sees no key of the first key tile",
                               "decode_key_start": list(ex["KEY_START"])},
        }
    if kv_format:
        out["kv_format"] = {"name": kv_format, "defines": {"K_QUANT": QUANT_CODES[kv_format],
                                                           "V_QUANT": QUANT_CODES[kv_format]},
                            **KV_LAYOUTS[kv_format],
                            "addressing": "k and v are read as bytes: their offsets and strides are in bytes "
                                          "(prefill: k_off, k_sb, k_sh, k_sn; decode: k_off, k_s0, k_sh, k_s1), "
                                          "rows contiguous, ggml rows 2-byte aligned, int8 rows 8-byte "
                                          "(float16) or 4-byte (float32) aligned",
                            "example": "example.c quantizes its K/V on the host in C (quantize_row) and the "
                                       "reference attends the dequantized values"}
    return out


_STORE_KINDS = {"float32": 0, "float16": 1, "bfloat16": 2}  # example.c's F32, F16, BF16


def _example_config(srcs: list, picks: list, combos: list) -> str:
    files = [s.file for s in srcs]
    p, d = picks[0]
    ep, ed = EXAMPLE_PREFILL, EXAMPLE_DECODE
    pd, dd = p.defines, d.defines
    used = sum(-(-c // ed["BLOCK_SIZE"]) for c in ed["CTX"])
    lines = [
        f"/* example_config.h: written by flashcl {__version__} export; what example.c builds and runs.",
        " * The shapes may be changed to any of the class (DK, DV, causal, dtype; decode: GROUP, its query",
        " * heads times ROWS). */",
        f'#define EX_FLASHCL_VERSION "{__version__}"',
        f"#define EX_NUM_SOURCES {len(files)}",
        "static const char *const EX_SOURCES[EX_NUM_SOURCES] = {" + ", ".join(f'"{f}"' for f in files) + "};",
        "",
        f"/* prefill: {p.file}, kernel {p.entries[0]} (manifest.json) */",
        f"#define EX_PREFILL_SOURCE {files.index(p.file)}",
        f'#define EX_PREFILL_KERNEL "{p.entries[0]}"',
        f"#define EX_PREFILL_STORE {_STORE_KINDS[p.problem['dtype']]}",
        f"#define EX_PREFILL_DK {pd['HEAD_DK']}",
        f"#define EX_PREFILL_DV {pd['HEAD_DV']}",
        f"#define EX_PREFILL_CAUSAL {int(pd['IS_CAUSAL'])}",
        f"#define EX_PREFILL_WRITE_LSE {int(pd['WRITE_LSE'])}",
        f"#define EX_PREFILL_BLOCK_M {pd['BLOCK_M']}",
        f"#define EX_PREFILL_DV_TILE {pd['DV_TILE']}",
        f"#define EX_PREFILL_WG {p.work_group}",
        f"#define EX_PREFILL_TOLERANCE {TOLERANCE[p.problem['dtype']]:g}",
        f"#define EX_PREFILL_B {ep['B']}",
        f"#define EX_PREFILL_H_KV {ep['H_KV']}",
        f"#define EX_PREFILL_H_Q {ep['H_KV'] * ep['GROUP']}",
        f"#define EX_PREFILL_N_Q {ep['N_Q']}",
        f"#define EX_PREFILL_N_KV {ep['N_KV']}",
        "",
        f"/* paged decode: {d.file}, kernels flash_decode, flash_decode_split, flash_decode_merge */",
        f"#define EX_DECODE_SOURCE {files.index(d.file)}",
        f"#define EX_DECODE_STORE {_STORE_KINDS[d.problem['dtype']]}",
        f"#define EX_DECODE_DK {dd['HEAD_DK']}",
        f"#define EX_DECODE_DV {dd['HEAD_DV']}",
        f"#define EX_DECODE_GROUP {dd['GROUP']}",
        f"#define EX_DECODE_ROWS {d.problem.get('rows', 1)}",
        f"#define EX_DECODE_WG {d.work_group}",
        f"#define EX_DECODE_MERGE_WG {d.params['MERGE_WG']}",
        f"#define EX_DECODE_TOLERANCE {TOLERANCE[d.problem['dtype']]:g}",
        f"#define EX_DECODE_B {len(ed['CTX'])}",
        f"#define EX_DECODE_H_KV {ed['H_KV']}",
        f"#define EX_DECODE_BLOCK_SIZE {ed['BLOCK_SIZE']}",
        "#define EX_DECODE_CTX {" + ", ".join(str(c) for c in ed["CTX"]) + "}",
        f"#define EX_DECODE_NUM_BLOCKS {used + ed['SPARE_BLOCKS']}",
        f"#define EX_DECODE_SPLITS {ed['SPLITS']}",
    ]
    on, fmt = {x for c in combos for x in c}, p.problem.get("kv_format")
    if on:
        ex = EXAMPLE_VARIANTS
        lines += ["", "/* the combinations of variants exported: sources (EX_SOURCES indices) and the variants on */",
                  f"#define EX_NUM_COMBOS {len(combos)}",
                  "#define EX_COMBOS {" + ", ".join(
                      "{" + ", ".join([str(files.index(cp.file)), str(files.index(cd.file))]
                                      + [str(int(x in c)) for x in VARIANTS]) + "}"
                      for c, (cp, cd) in zip(combos, picks)) + "}",
                  "/* the variants' values example.c runs */"]
        if "window" in on:
            lines += [f"#define EX_WINDOW_LEFT {ex['WINDOW_LEFT']}",
                      f"#define EX_WINDOW_RIGHT {0 if p.problem['causal'] else ex['WINDOW_RIGHT_NONCAUSAL']}",
                      f"#define EX_DECODE_WINDOW_LEFT {ex['DECODE_WINDOW_LEFT']}"]
        if "softcap" in on:
            lines += [f"#define EX_SOFTCAP_VALUE {ex['SOFTCAP']!r}", f"#define EX_Q_GAIN {ex['Q_GAIN_SOFTCAP']!r}"]
        if "mask" in on:
            lines += [f"#define EX_PREFILL_BLOCK_N {p.defines['BLOCK_N']}", f"#define EX_EMPTY_ROW {ex['EMPTY_ROW']}"]
        if "key_start" in on:
            lines += ["#define EX_DECODE_KEY_START {" + ", ".join(map(str, ex["KEY_START"])) + "}"]
    if fmt:
        lines += ["", f"/* K and V caches in {fmt} (kv_formats.h code), quantized by example.c */",
                  f"#define EX_KV_FORMAT {QUANT_CODES[fmt]}", f'#define EX_KV_FORMAT_NAME "{fmt}"']
    return "\n".join(lines) + "\n"


RUN_EXAMPLE_SH = """#!/bin/sh
# Builds example.c with the system C compiler against the OpenCL ICD loader and runs it: exit 0
# only if the exported prefill and paged decode match a naive attention in double.
# CC, CFLAGS and LDFLAGS are honoured (e.g. CFLAGS="-O2 -I/path/to/OpenCL-Headers").
set -e
cd "$(dirname "$0")"
${CC:-cc} ${CFLAGS:--O2} -o example example.c ${LDFLAGS:-} -lOpenCL -lm
exec ./example "$@"
"""

EXAMPLE_C = r"""/* example.c: flashcl's exported OpenCL kernels driven from C (written by `flashcl export`).
 *
 * Builds every exported source on the first OpenCL device whose compiler builds them all
 * (FLASHCL_EXAMPLE_DEVICE=P:D picks platform P, device D), then runs, on random inputs:
 *   - one causal GQA prefill (bottom-right aligned, N_q < N_kv),
 *   - one paged decode: a permuted block table, contexts ending inside a block (the unwritten
 *     slots hold NaN, which must not reach the output), split-k with the merge, then one split,
 * once per combination of attention variants exported (window, softcap, sinks, ALiBi, a bool
 * mask, decode's key_start: example_config.h's EX_COMBOS; keys no row sees hold NaN), with K/V
 * quantized on the host where a format was exported (EX_KV_FORMAT: q8_0, q4_0 as ggml's reference
 * quantizers, int8 rows),
 * checks each against a naive attention in double, prints the relative errors
 * ||out - ref|| / ||ref|| and exits 0 only if every one is within the dtype's tolerance.
 * C99 and the OpenCL 1.2 API; example_config.h says which exported classes run, on what shapes.
 *
 *     cc -O2 -o example example.c -lOpenCL -lm && ./example [folder of the .cl files]
 *
 * Every kernel argument, the grid formulas and the provenance of the parameters: manifest.json.
 * Exit codes: 0 every check passed, 1 a result outside the tolerance, 2 an OpenCL error (no
 * device builds the sources, an allocation or a launch failed).
 */
#define CL_TARGET_OPENCL_VERSION 120
#ifdef __APPLE__
#include <OpenCL/opencl.h>
#else
#include <CL/cl.h>
#endif
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "example_config.h"

#define LOG2E 1.4426950408889634

/* The combinations of variants exported, each with its prefill and decode source: a plain
 * export's example_config.h has one, with none on, and leaves out the variants' values */
typedef struct {
    int prefill_source, decode_source;
    int window, softcap, sinks, alibi, mask, key_start;
} combo_t;
#ifndef EX_NUM_COMBOS
#define EX_NUM_COMBOS 1
#define EX_COMBOS {{EX_PREFILL_SOURCE, EX_DECODE_SOURCE, 0, 0, 0, 0, 0, 0}}
#endif
#ifndef EX_WINDOW_LEFT
#define EX_WINDOW_LEFT 0
#define EX_WINDOW_RIGHT 0
#define EX_DECODE_WINDOW_LEFT 0
#endif
#ifndef EX_SOFTCAP_VALUE
#define EX_SOFTCAP_VALUE 0.0
#define EX_Q_GAIN 1.0
#endif
#ifndef EX_PREFILL_BLOCK_N
#define EX_PREFILL_BLOCK_N 1
#define EX_EMPTY_ROW 0
#endif
#ifndef EX_DECODE_KEY_START
#define EX_DECODE_KEY_START {0}
#endif
#ifndef EX_KV_FORMAT
#define EX_KV_FORMAT 0
#define EX_KV_FORMAT_NAME "plain"
#endif

/* decode.cl takes its variant arguments only in builds with a variant or query rows on (it has no mask) */
static int decode_variants(const combo_t *c)
{
    return c->window || c->softcap || c->sinks || c->alibi || c->key_start || EX_DECODE_ROWS > 1;
}

/* the factor on q: with a softcap, scores large enough for it to matter */
static double q_gain(const combo_t *c) { return c->softcap ? EX_Q_GAIN : 1.0; }

/* ---- errors: a failed OpenCL call ends the program with exit code 2 ------------------------ */
static void cl_fail(const char *call, cl_int err, int line)
{
    fprintf(stderr, "error: %s failed with OpenCL error %d (example.c:%d)\n", call, (int)err, line);
    exit(2);
}
#define CHECK(call)                                                                          \
    do {                                                                                     \
        const cl_int err_ = (call);                                                          \
        if (err_ != CL_SUCCESS)                                                              \
            cl_fail(#call, err_, __LINE__);                                                  \
    } while (0)

static void *xmalloc(size_t n)
{
    void *p = malloc(n ? n : 1);
    if (!p) {
        fprintf(stderr, "error: out of host memory\n");
        exit(2);
    }
    return p;
}

/* ---- random inputs: xorshift64*, normals by Box-Muller ---------------------------------------- */
static uint64_t rng = 88172645463325252ull;

static double uniform(void) /* in (0, 1) */
{
    rng ^= rng >> 12;
    rng ^= rng << 25;
    rng ^= rng >> 27;
    return (double)((rng * 2685821657736338717ull) >> 11) * (1.0 / 9007199254740992.0) + 0x1p-54;
}

static double normal(void)
{
    return sqrt(-2.0 * log(uniform())) * cos(6.283185307179586 * uniform());
}

/* ---- IEEE binary16 <-> float (round to nearest even), for float16 storage -------------------- */
static uint16_t half_from_float(float f)
{
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    const uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    const uint32_t mag = x & 0x7fffffffu;
    if (mag > 0x7f800000u)
        return sign | 0x7e00u;                          /* NaN */
    if (mag >= 0x477ff000u)
        return sign | 0x7c00u;                          /* inf, or rounds past 65504 */
    if (mag < 0x38800000u)                              /* below 2^-14: subnormal, units of 2^-24 */
        return sign | (uint16_t)nearbyint(fabs((double)f) * 16777216.0);
    uint32_t h = (mag >> 13) - ((127u - 15u) << 10);    /* rebias the exponent */
    const uint32_t rest = mag & 0x1fffu;                /* the 13 dropped bits: round to even */
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u)))
        h += 1;
    return sign | (uint16_t)h;
}

static float float_from_half(uint16_t h)
{
    const int e = (h >> 10) & 0x1f, m = h & 0x3ff;
    const double v = e == 0 ? ldexp(m, -24) : e == 31 ? (m ? NAN : INFINITY) : ldexp(m | 0x400, e - 25);
    return (float)((h & 0x8000u) ? -v : v);
}

/* ---- bfloat16 <-> float (round to nearest even; the top 16 bits of a float32) ---------------- */
static uint16_t bf16_from_float(float f)
{
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    if ((x & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((x >> 16) | 0x40u); /* NaN stays NaN */
    return (uint16_t)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

static float float_from_bf16(uint16_t h)
{
    const uint32_t x = (uint32_t)h << 16;
    float f;
    memcpy(&f, &x, sizeof f);
    return f;
}

/* ---- a tensor as the device stores it and its values in double ------------------------------
 * fmt 0: float32 or binary16 elements; a K/V cache may be quantized instead (kv_formats.h codes):
 * rows of `dim` values as q8_0 / q4_0 ggml blocks (fp16 d, then the quants) or int8 with one
 * float32 scale per row (`scales`). val holds the values the device reads, exactly. */
enum { PLAIN = 0, Q8_0 = 1, Q4_0 = 2, INT8 = 3 };
enum { F32 = 0, F16 = 1, BF16 = 2 }; /* a tensor's storage: EX_*_STORE */

static const char *store_name(int store) { return store == F16 ? "float16" : store == BF16 ? "bfloat16" : "float32"; }

typedef struct {
    size_t n;
    int store, fmt, dim;
    double *val;   /* the stored values, exactly (dequantized for a quantized cache) */
    void *raw;     /* the bytes copied to and from the device */
    float *scales; /* int8: one per row */
} tensor_t;

static size_t row_bytes(int fmt, int dim, int store)
{
    return fmt == PLAIN ? (size_t)dim * (store ? 2 : 4) : fmt == INT8 ? (size_t)dim
                                                                      : (size_t)dim / 32 * (fmt == Q8_0 ? 34 : 18);
}

static size_t bytes_of(const tensor_t *t) { return t->n / t->dim * row_bytes(t->fmt, t->dim, t->store); }

static tensor_t kv_tensor(size_t n, int dim, int store, int fmt)
{
    tensor_t t;
    t.n = n;
    t.store = store;
    t.fmt = fmt;
    t.dim = dim;
    t.val = xmalloc(n * sizeof(double));
    t.raw = xmalloc(n / dim * row_bytes(fmt, dim, store));
    t.scales = fmt == INT8 ? xmalloc(n / dim * sizeof(float)) : NULL;
    return t;
}

static tensor_t tensor(size_t n, int store) { return kv_tensor(n, 1, store, PLAIN); }

static void tensor_set(tensor_t *t, size_t i, double x) /* fmt 0 */
{
    if (t->store != F32) {
        const uint16_t h = t->store == F16 ? half_from_float((float)x) : bf16_from_float((float)x);
        ((uint16_t *)t->raw)[i] = h;
        t->val[i] = t->store == F16 ? float_from_half(h) : float_from_bf16(h);
    } else {
        const float f = (float)x;
        ((float *)t->raw)[i] = f;
        t->val[i] = f;
    }
}

/* One row of `dim` values x into `out` (and *scale for int8), as ggml's quantize_row_q8_0_ref /
 * quantize_row_q4_0_ref do it in float32; x becomes the dequantized values the kernels read. */
static void quantize_row(int fmt, int dim, double *x, uint8_t *out, float *scale)
{
    if (fmt == INT8) { /* scale = amax / 127, q = round(x / scale) */
        float amax = 0.0f;
        for (int c = 0; c < dim; ++c)
            amax = fmaxf(amax, fabsf((float)x[c]));
        const float s = amax / 127.0f, safe = s == 0.0f ? 1.0f : s;
        for (int c = 0; c < dim; ++c) {
            const float r = roundf((float)x[c] / safe);
            const int qi = r > 127.0f ? 127 : r < -127.0f ? -127 : (int)r;
            out[c] = (uint8_t)(int8_t)qi;
            x[c] = (double)qi * s;
        }
        *scale = s;
        return;
    }
    for (int b = 0; b < dim / 32; ++b) {
        double *xb = x + 32 * b;
        uint8_t *blk = out + (size_t)b * (fmt == Q8_0 ? 34 : 18);
        float amax = 0.0f, max = 0.0f, d;
        for (int j = 0; j < 32; ++j)
            if (amax < fabsf((float)xb[j])) { /* q4_0 keeps the sign of the first largest */
                amax = fabsf((float)xb[j]);
                max = (float)xb[j];
            }
        d = fmt == Q8_0 ? amax / 127.0f : max / -8.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        const uint16_t dh = half_from_float(d);
        blk[0] = (uint8_t)(dh & 0xff); /* little-endian fp16 d */
        blk[1] = (uint8_t)(dh >> 8);
        const double dd = float_from_half(dh);
        if (fmt == Q8_0) {
            for (int j = 0; j < 32; ++j) {
                const int8_t qi = (int8_t)roundf((float)xb[j] * id);
                blk[2 + j] = (uint8_t)qi;
                xb[j] = dd * qi;
            }
            continue;
        }
        for (int j = 0; j < 16; ++j) { /* byte j: value j in the low nibble, value j + 16 in the high */
            const int lo = (int8_t)((float)xb[j] * id + 8.5f), hi = (int8_t)((float)xb[j + 16] * id + 8.5f);
            const uint8_t q0 = (uint8_t)(lo < 15 ? lo : 15), q1 = (uint8_t)(hi < 15 ? hi : 15);
            blk[2 + j] = (uint8_t)(q0 | (q1 << 4));
            xb[j] = dd * (q0 - 8);
            xb[j + 16] = dd * (q1 - 8);
        }
    }
}

/* val -> raw: each value rounded to the storage, or each row quantized; val then holds what the
 * device reads */
static void tensor_store(tensor_t *t)
{
    if (t->fmt == PLAIN) {
        for (size_t i = 0; i < t->n; ++i)
            tensor_set(t, i, t->val[i]);
        return;
    }
    const size_t rb = row_bytes(t->fmt, t->dim, 0);
    for (size_t r = 0; r < t->n / t->dim; ++r)
        quantize_row(t->fmt, t->dim, t->val + r * t->dim, (uint8_t *)t->raw + r * rb,
                     t->scales ? t->scales + r : NULL);
}

static void tensor_random(tensor_t *t, double gain)
{
    for (size_t i = 0; i < t->n; ++i)
        t->val[i] = gain * normal();
    tensor_store(t);
}

static void tensor_fill(tensor_t *t, double x) /* fmt 0 */
{
    for (size_t i = 0; i < t->n; ++i)
        tensor_set(t, i, x);
}

/* Row r (dim values) becomes NaN as the device reads it: NaN elements, every ggml block's d, or
 * the int8 row's scale. Only keys the checked rows must not see are poisoned. */
static void poison_row(tensor_t *t, size_t r)
{
    for (int c = 0; c < t->dim; ++c)
        t->val[r * t->dim + c] = NAN;
    if (t->fmt == PLAIN) {
        for (int c = 0; c < t->dim; ++c)
            tensor_set(t, r * t->dim + c, NAN);
    } else if (t->fmt == INT8) {
        t->scales[r] = NAN;
    } else {
        const size_t bb = t->fmt == Q8_0 ? 34 : 18;
        uint8_t *row = (uint8_t *)t->raw + r * row_bytes(t->fmt, t->dim, 0);
        for (int b = 0; b < t->dim / 32; ++b)
            row[b * bb] = 0x00, row[b * bb + 1] = 0x7e; /* fp16 NaN */
    }
}

static void tensor_unpack(tensor_t *t) /* after a read-back (fmt 0) */
{
    for (size_t i = 0; i < t->n; ++i) {
        const uint16_t h = t->store != F32 ? ((uint16_t *)t->raw)[i] : 0;
        t->val[i] = t->store == F16 ? float_from_half(h) : t->store == BF16 ? float_from_bf16(h)
                                                                              : ((float *)t->raw)[i];
    }
}

static void tensor_free(tensor_t *t)
{
    free(t->val);
    free(t->raw);
    free(t->scales);
}

/* ---- the device: the first that builds every exported source ----------------------------------- */
typedef struct {
    cl_device_id dev;
    cl_context ctx;
    cl_command_queue queue;
    cl_program prog[EX_NUM_SOURCES];
    char name[256], platform[256];
} env_t;

static char *read_text(const char *dir, const char *file)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, file);
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "error: cannot open %s\n", path);
        exit(2);
    }
    fseek(f, 0, SEEK_END);
    const long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *text = xmalloc((size_t)n + 1);
    if (fread(text, 1, (size_t)n, f) != (size_t)n) {
        fprintf(stderr, "error: cannot read %s\n", path);
        exit(2);
    }
    text[n] = '\0';
    fclose(f);
    return text;
}

/* Build every source on `dev` with no options (the defines are in the sources); 1 on success. */
static int try_device(cl_platform_id platform, cl_device_id dev, char **texts, env_t *e)
{
    cl_int err;
    const cl_context_properties props[] = {CL_CONTEXT_PLATFORM, (cl_context_properties)platform, 0};
    memset(e, 0, sizeof *e);
    e->dev = dev;
    clGetDeviceInfo(dev, CL_DEVICE_NAME, sizeof e->name, e->name, NULL);
    clGetPlatformInfo(platform, CL_PLATFORM_NAME, sizeof e->platform, e->platform, NULL);
    e->ctx = clCreateContext(props, 1, &dev, NULL, NULL, &err);
    if (err != CL_SUCCESS) {
        fprintf(stderr, "note: %s: no context (OpenCL error %d)\n", e->name, (int)err);
        return 0;
    }
    for (int i = 0; i < EX_NUM_SOURCES; ++i) {
        const char *text = texts[i];
        e->prog[i] = clCreateProgramWithSource(e->ctx, 1, &text, NULL, &err);
        if (err == CL_SUCCESS)
            err = clBuildProgram(e->prog[i], 1, &dev, "", NULL, NULL);
        if (err != CL_SUCCESS) {
            char log[4096] = "";
            if (e->prog[i])
                clGetProgramBuildInfo(e->prog[i], dev, CL_PROGRAM_BUILD_LOG, sizeof log - 1, log, NULL);
            fprintf(stderr, "note: %s (%s) does not build %s (OpenCL error %d):\n%.2000s\n", e->name,
                    e->platform, EX_SOURCES[i], (int)err, log);
            for (int j = 0; j <= i; ++j)
                if (e->prog[j])
                    clReleaseProgram(e->prog[j]);
            clReleaseContext(e->ctx);
            return 0;
        }
    }
    e->queue = clCreateCommandQueue(e->ctx, dev, 0, &err); /* in order: the merge follows its split */
    if (err != CL_SUCCESS)
        cl_fail("clCreateCommandQueue", err, __LINE__);
    return 1;
}

static int pick_device(char **texts, env_t *e)
{
    cl_platform_id platforms[16];
    cl_uint np = 0;
    if (clGetPlatformIDs(16, platforms, &np) != CL_SUCCESS || np == 0) {
        fprintf(stderr, "error: no OpenCL platform (is an ICD installed? e.g. apt-get install pocl-opencl-icd)\n");
        return 0;
    }
    const char *want = getenv("FLASHCL_EXAMPLE_DEVICE");
    int wp = -1, wd = -1;
    if (want && *want && sscanf(want, "%d:%d", &wp, &wd) != 2) {
        fprintf(stderr, "error: FLASHCL_EXAMPLE_DEVICE=%s: expected P:D (platform and device indices)\n", want);
        return 0;
    }
    for (cl_uint p = 0; p < np && p < 16; ++p) {
        char pname[256] = "";
        clGetPlatformInfo(platforms[p], CL_PLATFORM_NAME, sizeof pname, pname, NULL);
        if (wp < 0 && strstr(pname, "Oclgrind"))
            continue; /* a simulator: only when asked for */
        cl_device_id devs[16];
        cl_uint nd = 0;
        if (clGetDeviceIDs(platforms[p], CL_DEVICE_TYPE_ALL, 16, devs, &nd) != CL_SUCCESS)
            continue;
        for (cl_uint d = 0; d < nd && d < 16; ++d) {
            if (wp >= 0 && ((int)p != wp || (int)d != wd))
                continue;
            if (try_device(platforms[p], devs[d], texts, e))
                return 1;
        }
    }
    if (wp >= 0) {
        cl_uint nd = 0;
        int exists = wp < (int)np && wp < 16
                     && clGetDeviceIDs(platforms[wp], CL_DEVICE_TYPE_ALL, 0, NULL, &nd) == CL_SUCCESS && wd < (int)nd;
        if (exists)
            fprintf(stderr, "error: FLASHCL_EXAMPLE_DEVICE=%s does not build the sources\n", want);
        else
            fprintf(stderr, "error: FLASHCL_EXAMPLE_DEVICE=%s names no device: this program's ICD loader sees %u "
                            "platform(s), numbered from 0 in its own order (not flashcl devices')\n", want, np);
        return 0;
    }
    fprintf(stderr, "error: no OpenCL device builds the exported sources\n");
    return 0;
}

static cl_kernel make_kernel(const env_t *e, int source, const char *name, size_t wg)
{
    cl_int err;
    cl_kernel k = clCreateKernel(e->prog[source], name, &err);
    if (err != CL_SUCCESS)
        cl_fail("clCreateKernel", err, __LINE__);
    size_t max = 0;
    CHECK(clGetKernelWorkGroupInfo(k, e->dev, CL_KERNEL_WORK_GROUP_SIZE, sizeof max, &max, NULL));
    if (max < wg) {
        fprintf(stderr, "error: %s needs a work-group of %zu work-items; %s allows %zu for it\n", name, wg,
                e->name, max);
        exit(2);
    }
    return k;
}

/* ---- kernel arguments, in the order manifest.json lists them --------------------------------- */
typedef struct {
    cl_kernel k;
    cl_uint next;
} args_t;

static void arg(args_t *a, size_t size, const void *value)
{
    const cl_int err = clSetKernelArg(a->k, a->next, size, value);
    if (err != CL_SUCCESS) {
        fprintf(stderr, "error: clSetKernelArg(%u) failed with OpenCL error %d\n", a->next, (int)err);
        exit(2);
    }
    a->next++;
}
static void arg_mem(args_t *a, cl_mem x) { arg(a, sizeof x, &x); }
static void arg_int(args_t *a, cl_int x) { arg(a, sizeof x, &x); }
static void arg_float(args_t *a, cl_float x) { arg(a, sizeof x, &x); }
static void arg_ulong(args_t *a, cl_ulong x) { arg(a, sizeof x, &x); }

static void args_done(const args_t *a) /* every argument was set */
{
    cl_uint n = 0;
    CHECK(clGetKernelInfo(a->k, CL_KERNEL_NUM_ARGS, sizeof n, &n, NULL));
    if (n != a->next) {
        fprintf(stderr, "error: %u arguments set, the kernel takes %u\n", a->next, n);
        exit(2);
    }
}

static cl_mem buffer(const env_t *e, size_t bytes, void *host) /* host NULL: uninitialized */
{
    cl_int err;
    cl_mem m = clCreateBuffer(e->ctx, CL_MEM_READ_WRITE | (host ? CL_MEM_COPY_HOST_PTR : 0), bytes, host, &err);
    if (err != CL_SUCCESS)
        cl_fail("clCreateBuffer", err, __LINE__);
    return m;
}

static void release_own(cl_mem m, cl_mem stand_in) /* a buffer of its own, not the stand-in of an unused one */
{
    if (m != stand_in)
        clReleaseMemObject(m);
}

static void read_back(const env_t *e, cl_mem m, size_t bytes, void *host)
{
    CHECK(clEnqueueReadBuffer(e->queue, m, CL_TRUE, 0, bytes, host, 0, NULL, NULL));
}

/* ---- the check: ||got - ref|| / ||ref||, and the worst over the run --------------------------- */
static double rel_err(const double *got, const double *ref, size_t n)
{
    double num = 0.0, den = 0.0;
    for (size_t i = 0; i < n; ++i) {
        const double d = got[i] - ref[i];
        num += d * d;
        den += ref[i] * ref[i];
    }
    return sqrt(num) / (den > 0.0 ? sqrt(den) : 1.0);
}

static double lse_err(const float *got, const double *ref, size_t n) /* a -inf row must be -inf */
{
    double num = 0.0, den = 0.0;
    for (size_t i = 0; i < n; ++i) {
        if (isinf(ref[i])) {
            if (!(isinf(got[i]) && got[i] < 0))
                return INFINITY;
            continue;
        }
        const double d = got[i] - ref[i];
        num += d * d;
        den += ref[i] * ref[i];
    }
    return sqrt(num) / (den > 0.0 ? sqrt(den) : 1.0);
}

static double worst = 0.0; /* NaN once any error is NaN */

static void note_worst(double err)
{
    if (!isnan(worst) && (isnan(err) || err > worst))
        worst = err;
}

static int verdict(double out_err, double lse_error, double tol) /* 1 if a check failed */
{
    note_worst(out_err);
    note_worst(lse_error);
    const int ok = out_err <= tol && lse_error <= tol; /* false for NaN */
    printf(": out rel err %.2e, lse rel err %.2e (tolerance %.0e) %s\n", out_err, lse_error, tol,
           ok ? "ok" : "FAILED");
    return !ok;
}

/* One attention row in double (flashcl/variants.py's semantics) over the keys j < n_keys, key j's
 * rows at krow[j] and vrow[j]: s = scale q.k, softcapped (softcap > 0: c tanh(s / c)), plus
 * bias[j] (-ALiBi); bias[j] = -inf hides key j, which is never read (its rows may be NaN). The
 * sink logit (-inf: none) joins the normalizer and adds nothing to o. Returns the lse; a row
 * that sees no key gets zeros and lse = the sink (-inf without sinks). */
static double attend(const double *q, int dk, int dv, int n_keys, const double *const *krow,
                     const double *const *vrow, const double *bias, double scale, double softcap, double sink,
                     double *s, double *o)
{
    double m = sink, l = 0.0;
    int seen = 0;
    for (int j = 0; j < n_keys; ++j) {
        if (bias[j] == -INFINITY)
            continue;
        double dot = 0.0;
        for (int c = 0; c < dk; ++c)
            dot += q[c] * krow[j][c];
        s[j] = dot * scale;
        if (softcap > 0.0)
            s[j] = softcap * tanh(s[j] / softcap);
        s[j] += bias[j];
        m = s[j] > m ? s[j] : m;
        ++seen;
    }
    for (int c = 0; c < dv; ++c)
        o[c] = 0.0;
    if (!seen)
        return sink;
    l = exp(sink - m);
    for (int j = 0; j < n_keys; ++j) {
        if (bias[j] == -INFINITY)
            continue;
        const double p = exp(s[j] - m);
        l += p;
        for (int c = 0; c < dv; ++c)
            o[c] += p * vrow[j][c];
    }
    for (int c = 0; c < dv; ++c)
        o[c] /= l;
    return m + log(l);
}

/* the variants' values: one sink logit per query head, about as large as the scores (scaled as
 * q is) so that it weighs in the normalizer; ALiBi slopes per (sequence, query head) */
static float *sink_logits(int hq, double gain)
{
    float *x = xmalloc((size_t)hq * sizeof(float));
    for (int h = 0; h < hq; ++h)
        x[h] = (float)(gain * (1.0 + normal()));
    return x;
}

static float *alibi_slopes(int b, int hq)
{
    float *x = xmalloc((size_t)b * hq * sizeof(float));
    for (int i = 0; i < b * hq; ++i)
        x[i] = (float)(0.05 + 0.45 * uniform());
    return x;
}

/* each of the n values of x `rows` times over (decode rows: a query head's rows share its sink and slope) */
static float *per_row(float *x, int n, int rows)
{
    float *y = xmalloc((size_t)n * rows * sizeof(float));
    for (int i = 0; i < n * rows; ++i)
        y[i] = x[i / rows];
    free(x);
    return y;
}

/* ---- prefill ----------------------------------------------------------------------------------- */
enum { P_NQ = EX_PREFILL_N_Q, P_NKV = EX_PREFILL_N_KV };

/* whether query row i of sequence b sees key j (causal, window, the mask (B, 1, N_q, N_kv)) */
static int prefill_sees(const combo_t *c, const uint8_t *mask, int b, int i, int j)
{
    const int p = i + P_NKV - P_NQ; /* bottom-right aligned */
    if (EX_PREFILL_CAUSAL && j > p)
        return 0;
    if (c->window && (j < p - EX_WINDOW_LEFT || j > p + EX_WINDOW_RIGHT))
        return 0;
    return !mask || mask[((size_t)b * P_NQ + i) * P_NKV + j];
}

static int run_prefill(const env_t *e, const combo_t *c)
{
    enum { B = EX_PREFILL_B, HQ = EX_PREFILL_H_Q, HKV = EX_PREFILL_H_KV, NQ = EX_PREFILL_N_Q,
           NKV = EX_PREFILL_N_KV, DK = EX_PREFILL_DK, DV = EX_PREFILL_DV, G = HQ / HKV };
    const int store = EX_PREFILL_STORE, fmt = EX_KV_FORMAT;
    const double scale = 1.0 / sqrt((double)DK);
    tensor_t q = tensor((size_t)B * HQ * NQ * DK, store), out = tensor((size_t)B * HQ * NQ * DV, store);
    tensor_t k = kv_tensor((size_t)B * HKV * NKV * DK, DK, store, fmt);
    tensor_t v = kv_tensor((size_t)B * HKV * NKV * DV, DV, store, fmt);
    const size_t n_rows = (size_t)B * HQ * NQ;
    float *lse = xmalloc(n_rows * sizeof(float));
    tensor_random(&q, q_gain(c));
    tensor_random(&k, 1.0);
    tensor_random(&v, 1.0);
    tensor_fill(&out, NAN); /* poisoned: an element the kernel does not write fails the check */
    for (size_t i = 0; i < n_rows; ++i)
        lse[i] = NAN;

    /* the variants' arrays: sinks (H_q,), slopes (B, H_q), a bool mask (B, 1, N_q, N_kv), 80% of
     * it visible, with a row that sees nothing and a key tile that batch 1 never sees, and its
     * tile map: per (sequence, query block, key tile) 0 all hidden, 1 some, 2 none */
    float *sinks = c->sinks ? sink_logits(HQ, q_gain(c)) : NULL;
    float *slopes = c->alibi ? alibi_slopes(B, HQ) : NULL;
    uint8_t *mask = NULL, *tile_map = NULL;
    const int num_m = (NQ + EX_PREFILL_BLOCK_M - 1) / EX_PREFILL_BLOCK_M;
    const int num_n = (NKV + EX_PREFILL_BLOCK_N - 1) / EX_PREFILL_BLOCK_N;
    if (c->mask) {
        mask = xmalloc((size_t)B * NQ * NKV);
        tile_map = xmalloc((size_t)B * num_m * num_n);
        for (int b = 0; b < B; ++b)
            for (int i = 0; i < NQ; ++i)
                for (int j = 0; j < NKV; ++j)
                    mask[((size_t)b * NQ + i) * NKV + j] = !(b == 0 && i == EX_EMPTY_ROW)
                                                           && !(b == 1 && j < EX_PREFILL_BLOCK_N) && uniform() < 0.8;
        for (int b = 0; b < B; ++b)
            for (int mb = 0; mb < num_m; ++mb)
                for (int nb = 0; nb < num_n; ++nb) {
                    int visible = 0, hidden = 0;
                    for (int i = mb * EX_PREFILL_BLOCK_M; i < NQ && i < (mb + 1) * EX_PREFILL_BLOCK_M; ++i)
                        for (int j = nb * EX_PREFILL_BLOCK_N; j < NKV && j < (nb + 1) * EX_PREFILL_BLOCK_N; ++j)
                            if (mask[((size_t)b * NQ + i) * NKV + j])
                                ++visible;
                            else
                                ++hidden;
                    tile_map[((size_t)b * num_m + mb) * num_n + nb] = !visible ? 0 : hidden ? 1 : 2;
                }
    }
    /* keys no row of a sequence sees (left of every window, hidden by the mask) hold NaN: a
     * kernel that reads them fails */
    for (int b = 0; b < B; ++b)
        for (int j = 0; j < NKV; ++j) {
            int seen = 0;
            for (int i = 0; i < NQ && !seen; ++i)
                seen = prefill_sees(c, mask, b, i, j);
            for (int h = 0; !seen && h < HKV; ++h) {
                poison_row(&k, ((size_t)b * HKV + h) * NKV + j);
                poison_row(&v, ((size_t)b * HKV + h) * NKV + j);
            }
        }

    cl_mem bq = buffer(e, bytes_of(&q), q.raw), bk = buffer(e, bytes_of(&k), k.raw);
    cl_mem bv = buffer(e, bytes_of(&v), v.raw), bo = buffer(e, bytes_of(&out), out.raw);
    cl_mem bl = buffer(e, n_rows * sizeof(float), lse);
    /* the variants' buffers; one that is off gets any buffer (never read) */
    cl_mem b_sinks = sinks ? buffer(e, HQ * sizeof(float), sinks) : bl;
    cl_mem b_slopes = slopes ? buffer(e, (size_t)B * HQ * sizeof(float), slopes) : bl;
    cl_mem b_mask = mask ? buffer(e, (size_t)B * NQ * NKV, mask) : bl;
    cl_mem b_map = mask ? buffer(e, (size_t)B * num_m * num_n, tile_map) : bl;
    cl_mem b_ks = fmt == INT8 ? buffer(e, (size_t)B * HKV * NKV * sizeof(float), k.scales) : bl;
    cl_mem b_vs = fmt == INT8 ? buffer(e, (size_t)B * HKV * NKV * sizeof(float), v.scales) : bl;

    /* head_section: any value >= 1 gives the same result; flashcl sizes a section so that its K/V
     * stay in the device's global-memory cache (manifest.json) */
    cl_ulong cache = 0;
    clGetDeviceInfo(e->dev, CL_DEVICE_GLOBAL_MEM_CACHE_SIZE, sizeof cache, &cache, NULL);
    cl_ulong kv_heads = cache / ((cl_ulong)NKV * (row_bytes(fmt, DK, store) + row_bytes(fmt, DV, store)));
    cl_ulong section = (kv_heads < 1 ? 1 : kv_heads) * G;
    if (section > (cl_ulong)B * HQ)
        section = (cl_ulong)B * HQ;

    cl_kernel kern = make_kernel(e, c->prefill_source, EX_PREFILL_KERNEL, EX_PREFILL_WG);
    args_t a = {kern, 0};
    arg_mem(&a, bq);
    arg_mem(&a, bk);
    arg_mem(&a, bv);
    arg_mem(&a, bo);
    arg_mem(&a, bl);
    arg_int(&a, NQ);
    arg_int(&a, NKV);
    arg_int(&a, HQ);
    arg_int(&a, G);
    arg_int(&a, (cl_int)section);
    arg_float(&a, (cl_float)(scale * LOG2E));
    /* offset, batch, head and row strides: q, k, v, out (contiguous here); in elements, and in
     * bytes for a quantized K/V (a row of row_bytes) */
    const cl_ulong k_row = fmt ? row_bytes(fmt, DK, store) : DK, v_row = fmt ? row_bytes(fmt, DV, store) : DV;
    const cl_ulong strides[4][3] = {{(cl_ulong)HQ * NQ * DK, (cl_ulong)NQ * DK, DK},
                                    {HKV * NKV * k_row, NKV * k_row, k_row},
                                    {HKV * NKV * v_row, NKV * v_row, v_row},
                                    {(cl_ulong)HQ * NQ * DV, (cl_ulong)NQ * DV, DV}};
    for (int t = 0; t < 4; ++t) {
        arg_ulong(&a, 0);
        for (int s = 0; s < 3; ++s)
            arg_ulong(&a, strides[t][s]);
    }
    /* the variants' values (manifest.json), read only where the source's define is on */
    arg_int(&a, c->window ? EX_WINDOW_LEFT : NQ + NKV);  /* win_left, win_right; N_q + N_kv: unbounded */
    arg_int(&a, c->window ? EX_WINDOW_RIGHT : NQ + NKV);
    arg_float(&a, (cl_float)(c->softcap ? EX_SOFTCAP_VALUE * LOG2E : 1.0)); /* softcap_log2 */
    arg_mem(&a, b_sinks);
    arg_mem(&a, b_slopes);
    arg_mem(&a, b_mask);                 /* mask (B, 1, N_q, N_kv): batch, head (broadcast), row strides */
    arg_ulong(&a, c->mask ? (cl_ulong)NQ * NKV : 0);
    arg_ulong(&a, 0);
    arg_ulong(&a, c->mask ? NKV : 0);
    arg_mem(&a, b_map);                  /* tile_map (B, 1, num_m, num_n): batch, head strides */
    arg_ulong(&a, c->mask ? (cl_ulong)num_m * num_n : 0);
    arg_ulong(&a, 0);
    arg_mem(&a, b_ks);                   /* k_scales, v_scales: int8 caches only, laid out like the rows */
    arg_mem(&a, b_vs);
    args_done(&a);
    const size_t local = EX_PREFILL_WG;
    const size_t global = (size_t)B * HQ * num_m * (DV / EX_PREFILL_DV_TILE) * local;
    CHECK(clEnqueueNDRangeKernel(e->queue, kern, 1, NULL, &global, &local, 0, NULL, NULL));
    read_back(e, bo, bytes_of(&out), out.raw);
    read_back(e, bl, n_rows * sizeof(float), lse);
    tensor_unpack(&out);

    double *ref = xmalloc(out.n * sizeof(double)), *ref_lse = xmalloc(n_rows * sizeof(double));
    double *s = xmalloc(NKV * sizeof(double)), *bias = xmalloc(NKV * sizeof(double));
    const double **krow = xmalloc(NKV * sizeof(double *)), **vrow = xmalloc(NKV * sizeof(double *));
    for (int b = 0; b < B; ++b)
        for (int h = 0; h < HQ; ++h)
            for (int i = 0; i < NQ; ++i) {
                const int kvh = h / G, p = i + NKV - NQ;
                for (int j = 0; j < NKV; ++j) {
                    krow[j] = k.val + (((size_t)b * HKV + kvh) * NKV + j) * DK;
                    vrow[j] = v.val + (((size_t)b * HKV + kvh) * NKV + j) * DV;
                    bias[j] = !prefill_sees(c, mask, b, i, j) ? -INFINITY
                              : slopes ? -(double)slopes[b * HQ + h] * fabs((double)(p - j)) : 0.0;
                }
                const size_t r = ((size_t)b * HQ + h) * NQ + i;
                ref_lse[r] = attend(q.val + r * DK, DK, DV, NKV, krow, vrow, bias, scale,
                                    c->softcap ? EX_SOFTCAP_VALUE : 0.0, sinks ? sinks[h] : -INFINITY, s, ref + r * DV);
            }
    printf("prefill %s: %s B=%d H_q=%d H_kv=%d N_q=%d N_kv=%d %s", EX_SOURCES[c->prefill_source],
           store_name(store), B, HQ, HKV, NQ, NKV, EX_PREFILL_CAUSAL ? "causal" : "non-causal");
    if (c->window)
        printf(" window (%d,%d)", EX_WINDOW_LEFT, EX_WINDOW_RIGHT);
    if (c->softcap)
        printf(" softcap %g", (double)EX_SOFTCAP_VALUE);
    printf("%s%s%s", c->sinks ? " sinks" : "", c->alibi ? " alibi" : "", c->mask ? " mask" : "");
    if (fmt)
        printf(" %s K/V", EX_KV_FORMAT_NAME);
    const int failed = verdict(rel_err(out.val, ref, out.n),
                               EX_PREFILL_WRITE_LSE ? lse_err(lse, ref_lse, n_rows) : 0.0, EX_PREFILL_TOLERANCE);

    free(ref), free(ref_lse), free(s), free(bias), free(krow), free(vrow), free(lse);
    free(sinks), free(slopes), free(mask), free(tile_map);
    tensor_free(&q), tensor_free(&k), tensor_free(&v), tensor_free(&out);
    clReleaseMemObject(bq), clReleaseMemObject(bk), clReleaseMemObject(bv), clReleaseMemObject(bo);
    release_own(b_sinks, bl), release_own(b_slopes, bl), release_own(b_mask, bl), release_own(b_map, bl);
    release_own(b_ks, bl), release_own(b_vs, bl);
    clReleaseMemObject(bl), clReleaseKernel(kern);
    return failed;
}

/* ---- paged decode ------------------------------------------------------------------------------ */
/* whether the query at position p of a sequence of n keys whose first key is `start` sees key j
 * (p = n - 1; with query rows, row r of R sits at n - R + r) */
static int decode_sees(const combo_t *c, int n, int start, int p, int j)
{
    return j < n && j <= p && (!c->window || j >= p - EX_DECODE_WINDOW_LEFT) && (!c->key_start || j >= start);
}

static int run_decode(const env_t *e, const combo_t *c, int splits)
{
    /* G: the kernel's heads per KV head, its query heads times their R rows (each row runs as a head) */
    enum { B = EX_DECODE_B, HKV = EX_DECODE_H_KV, G = EX_DECODE_GROUP, HQ = G * HKV, R = EX_DECODE_ROWS,
           DK = EX_DECODE_DK, DV = EX_DECODE_DV, BS = EX_DECODE_BLOCK_SIZE, NB = EX_DECODE_NUM_BLOCKS };
    const int store = EX_DECODE_STORE, fmt = EX_KV_FORMAT, vw = store ? 8 : 4; /* vw: elements per 16-byte chunk */
    const int ctx[B] = EX_DECODE_CTX, starts[B] = EX_DECODE_KEY_START;
    const double scale = 1.0 / sqrt((double)DK);
    int max_blocks = 0, shift = 0;
    for (int b = 0; b < B; ++b)
        max_blocks = (ctx[b] + BS - 1) / BS > max_blocks ? (ctx[b] + BS - 1) / BS : max_blocks;
    while ((1 << shift) < BS)
        ++shift;

    /* the block table: a random permutation of the cache's blocks; entries past a sequence's
     * last block are -1 (never read: a read would make the output NaN) */
    int perm[NB], *table = xmalloc((size_t)B * max_blocks * sizeof(int)), used = 0;
    for (int i = 0; i < NB; ++i)
        perm[i] = i;
    for (int i = NB - 1; i > 0; --i) {
        const int j = (int)(uniform() * (i + 1)), t = perm[i];
        perm[i] = perm[j], perm[j] = t;
    }
    for (int b = 0; b < B; ++b)
        for (int i = 0; i < max_blocks; ++i)
            table[b * max_blocks + i] = i < (ctx[b] + BS - 1) / BS ? perm[used++] : -1;

    tensor_t q = tensor((size_t)B * HQ * DK, store), out = tensor((size_t)B * HQ * DV, store);
    tensor_t kc = kv_tensor((size_t)NB * BS * HKV * DK, DK, store, fmt);
    tensor_t vc = kv_tensor((size_t)NB * BS * HKV * DV, DV, store, fmt);
    tensor_random(&q, q_gain(c));
    tensor_random(&kc, 1.0);
    tensor_random(&vc, 1.0);
    /* slots no sequence uses, and keys left of a query's window, hold NaN: they must never reach
     * an output */
    uint8_t seen[NB * BS] = {0};
    for (int b = 0; b < B; ++b)
        for (int j = 0; j < ctx[b]; ++j)
            for (int r = 0; r < R; ++r)
                if (decode_sees(c, ctx[b], starts[b], ctx[b] - R + r, j))
                    seen[table[b * max_blocks + j / BS] * BS + j % BS] = 1;
    for (int slot = 0; slot < NB * BS; ++slot)
        for (int h = 0; !seen[slot] && h < HKV; ++h) {
            poison_row(&kc, (size_t)slot * HKV + h);
            poison_row(&vc, (size_t)slot * HKV + h);
        }
    tensor_fill(&out, NAN);
    float *lse = xmalloc((size_t)B * HQ * sizeof(float));
    for (int i = 0; i < B * HQ; ++i)
        lse[i] = NAN;
    float *sinks = c->sinks ? per_row(sink_logits(HQ / R, q_gain(c)), HQ / R, R) : NULL;
    float *slopes = c->alibi ? per_row(alibi_slopes(B, HQ / R), B * HQ / R, R) : NULL;

    cl_mem bq = buffer(e, bytes_of(&q), q.raw), bk = buffer(e, bytes_of(&kc), kc.raw);
    cl_mem bv = buffer(e, bytes_of(&vc), vc.raw), bo = buffer(e, bytes_of(&out), out.raw);
    cl_mem bl = buffer(e, (size_t)B * HQ * sizeof(float), lse);
    cl_mem bt = buffer(e, (size_t)B * max_blocks * sizeof(int), table), bc = buffer(e, sizeof ctx, (void *)ctx);
    cl_mem b_sinks = sinks ? buffer(e, HQ * sizeof(float), sinks) : bl;
    cl_mem b_slopes = slopes ? buffer(e, (size_t)B * HQ * sizeof(float), slopes) : bl;
    cl_mem b_starts = c->key_start ? buffer(e, sizeof starts, (void *)starts) : bl;
    cl_mem b_ks = fmt == INT8 ? buffer(e, (size_t)NB * BS * HKV * sizeof(float), kc.scales) : bl;
    cl_mem b_vs = fmt == INT8 ? buffer(e, (size_t)NB * BS * HKV * sizeof(float), vc.scales) : bl;
    /* split-k partial states (float32): m and l (B, H_q, splits), acc (B, H_q, splits, DV); one split
     * writes out and lse itself and does not use them (flashcl passes lse) */
    cl_mem pm = bl, pl = bl, pacc = bl;
    if (splits > 1) {
        pm = buffer(e, (size_t)B * HQ * splits * sizeof(float), NULL);
        pl = buffer(e, (size_t)B * HQ * splits * sizeof(float), NULL);
        pacc = buffer(e, (size_t)B * HQ * splits * DV * sizeof(float), NULL);
    }

    cl_kernel kern = make_kernel(e, c->decode_source, splits > 1 ? "flash_decode_split" : "flash_decode",
                                 EX_DECODE_WG);
    args_t a = {kern, 0};
    arg_mem(&a, bq);
    arg_mem(&a, bk);
    arg_mem(&a, bv);
    arg_mem(&a, bo);
    arg_mem(&a, bl);
    arg_mem(&a, pm);
    arg_mem(&a, pl);
    arg_mem(&a, pacc);
    arg_mem(&a, bt);
    arg_mem(&a, bc);
    arg_int(&a, HQ);
    arg_int(&a, splits);
    arg_int(&a, max_blocks);                /* bt_stride */
    arg_int(&a, shift);                     /* log2(block_size) */
    arg_int(&a, NB);                        /* num_blocks */
    arg_int(&a, max_blocks * BS);           /* capacity */
    arg_float(&a, (cl_float)(scale * LOG2E));
    arg_ulong(&a, 0);                       /* q: offset, batch and head strides in elements */
    arg_ulong(&a, (cl_ulong)HQ * DK);
    arg_ulong(&a, DK);
    /* K, V caches (num_blocks, block_size, H_kv, D): offset, block, head and slot strides in
     * 16-byte chunks, or in bytes for a quantized cache (rows of row_bytes) */
    const cl_ulong k_row = fmt ? row_bytes(fmt, DK, store) : (cl_ulong)DK / vw;
    const cl_ulong v_row = fmt ? row_bytes(fmt, DV, store) : (cl_ulong)DV / vw;
    arg_ulong(&a, 0);
    arg_ulong(&a, BS * HKV * k_row);
    arg_ulong(&a, k_row);
    arg_ulong(&a, HKV * k_row);
    arg_ulong(&a, 0);
    arg_ulong(&a, BS * HKV * v_row);
    arg_ulong(&a, v_row);
    arg_ulong(&a, HKV * v_row);
    arg_ulong(&a, 0);                       /* out: offset, batch and head strides in elements */
    arg_ulong(&a, (cl_ulong)HQ * DV);
    arg_ulong(&a, DV);
    if (decode_variants(c)) { /* window_left, softcap_log2, sinks, alibi_slopes */
        arg_int(&a, c->window ? EX_DECODE_WINDOW_LEFT : 0x7fffffff);
        arg_float(&a, (cl_float)(c->softcap ? EX_SOFTCAP_VALUE * LOG2E : 0.0));
        arg_mem(&a, b_sinks);
        arg_mem(&a, b_slopes);
        if (c->key_start)
            arg_mem(&a, b_starts);          /* key_start (B,) int32 */
    }
    if (fmt == INT8) { /* k_scales, v_scales (one per row, in the rows' order) and their offsets */
        arg_mem(&a, b_ks);
        arg_mem(&a, b_vs);
        arg_ulong(&a, 0);
        arg_ulong(&a, 0);
    }
    args_done(&a);
    const size_t local[3] = {EX_DECODE_WG, 1, 1}, global[3] = {(size_t)EX_DECODE_WG * splits, HKV, B};
    CHECK(clEnqueueNDRangeKernel(e->queue, kern, 3, NULL, global, local, 0, NULL, NULL));

    cl_kernel merge = NULL;
    if (splits > 1) { /* the in-order queue runs it after the splits */
        merge = make_kernel(e, c->decode_source, "flash_decode_merge", EX_DECODE_MERGE_WG);
        args_t m = {merge, 0};
        arg_mem(&m, pm);
        arg_mem(&m, pl);
        arg_mem(&m, pacc);
        arg_mem(&m, bo);
        arg_mem(&m, bl);
        arg_int(&m, HQ);
        arg_int(&m, splits);
        arg_ulong(&m, 0);
        arg_ulong(&m, (cl_ulong)HQ * DV);
        arg_ulong(&m, DV);
        arg(&m, sizeof(float) * splits, NULL); /* local memory: one weight per split */
        args_done(&m);
        const size_t mlocal[2] = {EX_DECODE_MERGE_WG, 1}, mglobal[2] = {(size_t)EX_DECODE_MERGE_WG * HQ, B};
        CHECK(clEnqueueNDRangeKernel(e->queue, merge, 2, NULL, mglobal, mlocal, 0, NULL, NULL));
    }
    read_back(e, bo, bytes_of(&out), out.raw);
    read_back(e, bl, (size_t)B * HQ * sizeof(float), lse);
    tensor_unpack(&out);

    int max_ctx = 0;
    for (int b = 0; b < B; ++b)
        max_ctx = ctx[b] > max_ctx ? ctx[b] : max_ctx;
    double *ref = xmalloc(out.n * sizeof(double)), ref_lse[B * HQ];
    double *s = xmalloc((size_t)(max_ctx + 1) * sizeof(double));
    double *bias = xmalloc((size_t)(max_ctx + 1) * sizeof(double));
    const double **krow = xmalloc((size_t)(max_ctx + 1) * sizeof(double *));
    const double **vrow = xmalloc((size_t)(max_ctx + 1) * sizeof(double *));
    for (int b = 0; b < B; ++b)
        for (int h = 0; h < HQ; ++h) {
            const int p = ctx[b] - R + h % R; /* the row's position */
            for (int j = 0; j < ctx[b]; ++j) {
                const size_t row = (size_t)table[b * max_blocks + j / BS] * BS + j % BS;
                krow[j] = kc.val + (row * HKV + h / G) * DK;
                vrow[j] = vc.val + (row * HKV + h / G) * DV;
                bias[j] = !decode_sees(c, ctx[b], starts[b], p, j) ? -INFINITY
                          : slopes ? -(double)slopes[b * HQ + h] * (p - j) : 0.0;
            }
            const size_t r = (size_t)b * HQ + h;
            ref_lse[r] = attend(q.val + r * DK, DK, DV, ctx[b], krow, vrow, bias, scale,
                                c->softcap ? EX_SOFTCAP_VALUE : 0.0, sinks ? sinks[h] : -INFINITY, s, ref + r * DV);
        }
    printf("decode  %s: %s paged B=%d H_q=%d H_kv=%d ctx=", EX_SOURCES[c->decode_source],
           store_name(store), B, HQ / R, HKV);
    for (int b = 0; b < B; ++b)
        printf(b ? ",%d" : "%d", ctx[b]);
    if (c->window)
        printf(" window (%d,0)", EX_DECODE_WINDOW_LEFT);
    if (c->softcap)
        printf(" softcap %g", (double)EX_SOFTCAP_VALUE);
    printf("%s%s", c->sinks ? " sinks" : "", c->alibi ? " alibi" : "");
    if (c->key_start) {
        printf(" key_start ");
        for (int b = 0; b < B; ++b)
            printf(b ? ",%d" : "%d", starts[b]);
    }
    if (R > 1)
        printf(" rows %d", R);
    if (fmt)
        printf(" %s K/V", EX_KV_FORMAT_NAME);
    printf(" block_size=%d, %d split%s", BS, splits, splits > 1 ? "s + merge" : "");
    const int failed = verdict(rel_err(out.val, ref, out.n), lse_err(lse, ref_lse, (size_t)B * HQ),
                               EX_DECODE_TOLERANCE);

    free(ref), free(s), free(bias), free(krow), free(vrow), free(lse), free(table), free(sinks), free(slopes);
    tensor_free(&q), tensor_free(&kc), tensor_free(&vc), tensor_free(&out);
    if (splits > 1)
        clReleaseMemObject(pm), clReleaseMemObject(pl), clReleaseMemObject(pacc), clReleaseKernel(merge);
    release_own(b_sinks, bl), release_own(b_slopes, bl), release_own(b_ks, bl), release_own(b_vs, bl);
    release_own(b_starts, bl);
    clReleaseMemObject(bq), clReleaseMemObject(bk), clReleaseMemObject(bv), clReleaseMemObject(bo);
    clReleaseMemObject(bl), clReleaseMemObject(bt), clReleaseMemObject(bc), clReleaseKernel(kern);
    return failed;
}

int main(int argc, char **argv)
{
    const char *dir = argc > 1 ? argv[1] : ".";
    const char *seed = getenv("FLASHCL_SEED"); /* fresh inputs each run; the seed reproduces one */
    rng = seed && *seed ? strtoull(seed, NULL, 10) : (uint64_t)time(NULL);
    printf("flashcl %s export, seed %llu (FLASHCL_SEED)\n", EX_FLASHCL_VERSION, (unsigned long long)rng);
    rng = rng * 0x9E3779B97F4A7C15ull + 1; /* never 0 */

    char *texts[EX_NUM_SOURCES];
    for (int i = 0; i < EX_NUM_SOURCES; ++i)
        texts[i] = read_text(dir, EX_SOURCES[i]);
    env_t e;
    if (!pick_device(texts, &e))
        return 2;
    printf("device: %s (%s): built %d exported source%s\n", e.name, e.platform, EX_NUM_SOURCES,
           EX_NUM_SOURCES > 1 ? "s" : "");

    static const combo_t combos[EX_NUM_COMBOS] = EX_COMBOS;
    int failed = 0;
    for (int i = 0; i < EX_NUM_COMBOS; ++i) {
        failed |= run_prefill(&e, &combos[i]);
        failed |= run_decode(&e, &combos[i], EX_DECODE_SPLITS);
        failed |= run_decode(&e, &combos[i], 1);
    }
    printf("max relative error %.2e: %s\n", worst, failed ? "FAILED" : "every check within tolerance");

    for (int i = 0; i < EX_NUM_SOURCES; ++i)
        clReleaseProgram(e.prog[i]), free(texts[i]);
    clReleaseCommandQueue(e.queue);
    clReleaseContext(e.ctx);
    return failed ? 1 : 0;
}
"""
