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

What is not exported: decode_mma.cl (NVIDIA tensor cores, inline PTX) and the contiguous-cache
decode; decode.cl serves paged caches on every device.
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
from ..profiles import DeviceProfile, find_profile
from ..reference import TOLERANCE
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
    if target.handle is not None:
        if kernel == "prefill":
            return pre.choose_params(target.handle, prob)
        return dec.choose_params(target.handle, prob, None, n)
    space = tuning.SPACES[kernel]
    group = prob.group if kernel == "decode" else None
    dims = tuning.Dims(prob.dk, prob.dv, group or 1, prob.dtype)
    limits = {"local_mem": target.local_mem, "max_work_group": target.max_work_group}
    found = tuning.lookup(kernel, target.key, dtype=prob.dtype, dk=prob.dk, dv=prob.dv,
                          causal=kernel == "prefill" and prob.causal, n=n, group=group,
                          validate=lambda p: space.check(p, dims, limits))
    if found is not None:
        return found
    return tuning.default_choice(target.profile.name, space.default(
        target.profile, dims, local_mem=target.local_mem, max_work_group=target.max_work_group))


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
    def store_t(self) -> str:
        return "half" if self.problem["dtype"] == "float16" else "float"

    def text(self, target: Target, command: str, date: str) -> str:
        p = self.problem
        what = (f"{p['dtype']}, DK={p['dk']}, DV={p['dv']}, "
                + (("causal" if p["causal"] else "non-causal") if self.kernel == "prefill"
                   else f"GQA group {p['group']}, {'paged' if p['paged'] else 'contiguous'} cache"))
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


def _file_stem(src: Source) -> str:
    p = src.problem
    stem = f"{src.kernel}-{p['dtype']}-dk{p['dk']}-dv{p['dv']}"
    if src.kernel == "prefill":
        return stem + ("-causal" if p["causal"] else "") + ("-tiles" if src.origin == "prefill_tiles.cl" else "")
    return stem + f"-g{p['group']}" + ("-paged" if p["paged"] else "")


# --------------------------------------------------------------------------- the manifest's kernels

def _host_type(ctype: str) -> str:
    if ctype.startswith("__local"):
        return "local memory: clSetKernelArg(kernel, index, bytes, NULL)"
    if "*" in ctype:
        return "cl_mem"
    return {"int": "cl_int", "float": "cl_float", "ulong": "cl_ulong"}[ctype.split()[-1]]


def _args(spec, src: Source) -> list[dict]:
    raw_t = "uint4" if src.store_t == "half" else "float4"
    return [{"index": i, "name": name, "type": ctype.replace("store_t", src.store_t).replace("raw_t", raw_t),
             "host": _host_type(ctype), "meaning": meaning} for i, (name, ctype, meaning) in enumerate(spec)]


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
    decode_common = {**common, "args": _args(dec.ARGS, src), "work_dim": 3, "local_size": [wg, 1, 1],
                     "work_group_formula": "LANES * ROWS * (GROUP / HEAD_TILE), LANES = max(HEAD_DK, HEAD_DV) "
                                           "/ (16 / sizeof(store_t)): the lanes of a row read its 16-byte chunks",
                     "global_size": [f"{wg} * num_splits", "H_kv", "B"],
                     "grid_formula": "one work-group per (split, KV head, sequence); each serves the KV head's "
                                     "whole GQA group of query heads",
                     "num_splits": split_note}
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
        {"name": "flash_decode_merge", **common, "args": _args(dec.MERGE_ARGS, src), "work_dim": 2,
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
           check_build: bool = True) -> Result:
    """Write the export of ``prefill_shapes`` (B, H_q, H_kv, N, d, causal) and ``decode_shapes``
    (B, H_q, H_kv, ctx, d) into the folder ``out``; None means the reference shapes. On an
    attached device each source is also built as written (``check_build``)."""
    if dtype not in ("float32", "float16"):
        raise ValueError(f"dtype: the OpenCL kernels take float32 or float16, got {dtype!r}")
    prefill_shapes = DEFAULT_PREFILL if prefill_shapes is None else tuple(prefill_shapes)
    decode_shapes = DEFAULT_DECODE if decode_shapes is None else tuple(decode_shapes)
    if not prefill_shapes or not decode_shapes:
        raise ValueError("export needs at least one prefill and one decode shape (the example runs both)")
    out = Path(out)
    previous = _previous_export(out)
    target = resolve(device, require_device=require_device)
    sources: dict = {}

    for b, hq, hkv, n, d, causal in prefill_shapes:
        prob = pre.PrefillProblem(b, hq, hkv, n, n, d, d, bool(causal), dtype)
        choice = choose(target, "prefill", prob, n)
        origin, entry, defines = pre.program(prob, choice.params, write_lse=True, unroll_loops=not target.is_cpu)
        src = _source(sources, "prefill", origin, (entry,),
                      {"dtype": dtype, "dk": d, "dv": d, "causal": bool(causal)}, choice, defines,
                      tuning.work_group_size("prefill", choice.params))
        gsize, lsize = pre.launch_grid(prob, choice.params)
        section = pre.head_section(prob, target.cache_bytes) if target.cache_bytes else None
        src.shapes.append(({"B": b, "H_q": hq, "H_kv": hkv, "N_q": n, "N_kv": n},
                           {"prefill": {"global_size": list(gsize), "local_size": list(lsize),
                                        "head_section": section}}))

    for b, hq, hkv, ctx, d in decode_shapes:
        prob = dec.DecodeProblem(b, hq, hkv, d, d, True, dtype)
        choice = choose(target, "decode", prob, ctx)
        shuffle = (target.handle is not None  # NVIDIA inline PTX: only where the device is known
                   and dec.row_shuffle_ok(target.handle, choice.params, prob.group, d, d, dtype))
        defines = dec.program_defines(prob, choice.params, row_shuffle=shuffle, unroll_merge=not target.is_cpu)
        wg = dec.work_group_size(choice.params, prob.group, d, d, dtype)
        src = _source(sources, "decode", "decode.cl", ("flash_decode", "flash_decode_split", "flash_decode_merge"),
                      {"dtype": dtype, "dk": d, "dv": d, "group": prob.group, "paged": True}, choice, defines, wg)
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
        src.shapes.append(({"B": b, "H_q": hq, "H_kv": hkv, "ctx": ctx, "auto_splits": splits}, launch))

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
    pick_p, pick_d = _example_choice(srcs)
    manifest = _manifest(target, srcs, texts, command, date, pick_p, pick_d)
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    (out / "example.c").write_text(EXAMPLE_C)
    (out / "example_config.h").write_text(_example_config(srcs, pick_p, pick_d))
    sh = out / "run_example.sh"
    sh.write_text(RUN_EXAMPLE_SH)
    sh.chmod(0o755)
    return Result(out, target, srcs, manifest, list(texts) + [MANIFEST, *EXAMPLE_FILES])


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


def _example_choice(srcs: list) -> tuple[Source, Source]:
    """The classes example.c runs: a causal prefill where one is exported, the smallest head dims;
    a decode with a GQA group > 1 where one is exported, the smallest group and head dims."""
    p = min((s for s in srcs if s.kernel == "prefill"),
            key=lambda s: (not s.problem["causal"], s.problem["dk"] + s.problem["dv"]))
    d = min((s for s in srcs if s.kernel == "decode"),
            key=lambda s: (s.problem["group"] == 1, s.problem["group"], s.problem["dk"] + s.problem["dv"]))
    return p, d


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
        notes.append("decode_mma.cl (NVIDIA tensor cores, fp16) is not exported: flashcl runs it on sm_80+ "
                     "where this export's decode.cl is the portable path")
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
                      "decode: q (B, H_q, DK), paged caches (num_blocks, block_size, H_kv, D) as vLLM's",
            "causal": "bottom-right aligned: query i sees key j iff j <= i + N_kv - N_q",
            "empty_row": "a row that sees no key returns zeros and lse = -inf",
            "accumulation": "float32; float16 data is read with vload_half (no cl_khr_fp16 needed)",
            "tolerance": {k: TOLERANCE[k] for k in ("float32", "float16")},
        },
        "example": {"files": list(EXAMPLE_FILES), "run": "./run_example.sh",
                    "prefill": {"file": pick_p.file, **EXAMPLE_PREFILL},
                    "decode": {"file": pick_d.file, **{k: list(v) if isinstance(v, tuple) else v
                                                      for k, v in EXAMPLE_DECODE.items()}},
                    "device": "the first device of the first platform that builds every source; "
                              "FLASHCL_EXAMPLE_DEVICE=P:D picks one"},
    }


def _example_config(srcs: list, p: Source, d: Source) -> str:
    files = [s.file for s in srcs]
    ep, ed = EXAMPLE_PREFILL, EXAMPLE_DECODE
    pd, dd = p.defines, d.defines
    used = sum(-(-c // ed["BLOCK_SIZE"]) for c in ed["CTX"])
    lines = [
        f"/* example_config.h: written by flashcl {__version__} export; what example.c builds and runs.",
        " * The shapes may be changed to any of the class (DK, DV, causal, dtype; decode: GROUP). */",
        f'#define EX_FLASHCL_VERSION "{__version__}"',
        f"#define EX_NUM_SOURCES {len(files)}",
        "static const char *const EX_SOURCES[EX_NUM_SOURCES] = {" + ", ".join(f'"{f}"' for f in files) + "};",
        "",
        f"/* prefill: {p.file}, kernel {p.entries[0]} (manifest.json) */",
        f"#define EX_PREFILL_SOURCE {files.index(p.file)}",
        f'#define EX_PREFILL_KERNEL "{p.entries[0]}"',
        f"#define EX_PREFILL_HALF {int(pd['STORE_HALF'])}",
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
        f"#define EX_DECODE_HALF {int(dd['STORE_HALF'])}",
        f"#define EX_DECODE_DK {dd['HEAD_DK']}",
        f"#define EX_DECODE_DV {dd['HEAD_DV']}",
        f"#define EX_DECODE_GROUP {dd['GROUP']}",
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

/* ---- a tensor as the device stores it (float32 or binary16) and its values in double --------- */
typedef struct {
    size_t n;
    int half;
    double *val; /* the stored values, exactly */
    void *raw;   /* the bytes copied to and from the device */
} tensor_t;

static tensor_t tensor(size_t n, int half)
{
    tensor_t t;
    t.n = n;
    t.half = half;
    t.val = xmalloc(n * sizeof(double));
    t.raw = xmalloc(n * (half ? 2 : 4));
    return t;
}

static size_t bytes_of(const tensor_t *t) { return t->n * (t->half ? 2 : 4); }

static void tensor_set(tensor_t *t, size_t i, double x)
{
    if (t->half) {
        const uint16_t h = half_from_float((float)x);
        ((uint16_t *)t->raw)[i] = h;
        t->val[i] = float_from_half(h);
    } else {
        const float f = (float)x;
        ((float *)t->raw)[i] = f;
        t->val[i] = f;
    }
}

static void tensor_random(tensor_t *t)
{
    for (size_t i = 0; i < t->n; ++i)
        tensor_set(t, i, normal());
}

static void tensor_fill(tensor_t *t, double x)
{
    for (size_t i = 0; i < t->n; ++i)
        tensor_set(t, i, x);
}

static void tensor_unpack(tensor_t *t) /* after a read-back */
{
    for (size_t i = 0; i < t->n; ++i)
        t->val[i] = t->half ? float_from_half(((uint16_t *)t->raw)[i]) : ((float *)t->raw)[i];
}

static void tensor_free(tensor_t *t)
{
    free(t->val);
    free(t->raw);
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
    fprintf(stderr, "error: %s\n", wp >= 0 ? "FLASHCL_EXAMPLE_DEVICE names no device that builds the sources"
                                           : "no OpenCL device builds the exported sources");
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

/* one attention row in double: keys j < n_keys, key j's rows at k_row(j) and v_row(j) */
static double attend(const double *q, int dk, int dv, int n_keys, const double *const *krow,
                     const double *const *vrow, double scale, double *s, double *o)
{
    double m = -INFINITY, l = 0.0;
    for (int j = 0; j < n_keys; ++j) {
        double dot = 0.0;
        for (int c = 0; c < dk; ++c)
            dot += q[c] * krow[j][c];
        s[j] = dot * scale;
        m = s[j] > m ? s[j] : m;
    }
    for (int c = 0; c < dv; ++c)
        o[c] = 0.0;
    if (n_keys == 0)
        return -INFINITY; /* a row that sees no key: zeros, lse = -inf */
    for (int j = 0; j < n_keys; ++j) {
        const double p = exp(s[j] - m);
        l += p;
        for (int c = 0; c < dv; ++c)
            o[c] += p * vrow[j][c];
    }
    for (int c = 0; c < dv; ++c)
        o[c] /= l;
    return m + log(l);
}

/* ---- prefill ----------------------------------------------------------------------------------- */
static int run_prefill(const env_t *e)
{
    enum { B = EX_PREFILL_B, HQ = EX_PREFILL_H_Q, HKV = EX_PREFILL_H_KV, NQ = EX_PREFILL_N_Q,
           NKV = EX_PREFILL_N_KV, DK = EX_PREFILL_DK, DV = EX_PREFILL_DV, G = HQ / HKV };
    const int half = EX_PREFILL_HALF;
    const double scale = 1.0 / sqrt((double)DK);
    tensor_t q = tensor((size_t)B * HQ * NQ * DK, half), k = tensor((size_t)B * HKV * NKV * DK, half);
    tensor_t v = tensor((size_t)B * HKV * NKV * DV, half), out = tensor((size_t)B * HQ * NQ * DV, half);
    const size_t n_rows = (size_t)B * HQ * NQ;
    float *lse = xmalloc(n_rows * sizeof(float));
    tensor_random(&q);
    tensor_random(&k);
    tensor_random(&v);
    tensor_fill(&out, NAN); /* poisoned: an element the kernel does not write fails the check */
    for (size_t i = 0; i < n_rows; ++i)
        lse[i] = NAN;
    cl_mem bq = buffer(e, bytes_of(&q), q.raw), bk = buffer(e, bytes_of(&k), k.raw);
    cl_mem bv = buffer(e, bytes_of(&v), v.raw), bo = buffer(e, bytes_of(&out), out.raw);
    cl_mem bl = buffer(e, n_rows * sizeof(float), lse);

    /* head_section: any value >= 1 gives the same result; flashcl sizes a section so that its K/V
     * stay in the device's global-memory cache (manifest.json) */
    cl_ulong cache = 0;
    clGetDeviceInfo(e->dev, CL_DEVICE_GLOBAL_MEM_CACHE_SIZE, sizeof cache, &cache, NULL);
    cl_ulong kv_heads = cache / ((cl_ulong)NKV * (DK + DV) * (half ? 2 : 4));
    cl_ulong section = (kv_heads < 1 ? 1 : kv_heads) * G;
    if (section > (cl_ulong)B * HQ)
        section = (cl_ulong)B * HQ;

    cl_kernel kern = make_kernel(e, EX_PREFILL_SOURCE, EX_PREFILL_KERNEL, EX_PREFILL_WG);
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
    /* offset, batch, head and row strides in elements: q, k, v, out (contiguous here) */
    const cl_ulong strides[4][3] = {{(cl_ulong)HQ * NQ * DK, (cl_ulong)NQ * DK, DK},
                                    {(cl_ulong)HKV * NKV * DK, (cl_ulong)NKV * DK, DK},
                                    {(cl_ulong)HKV * NKV * DV, (cl_ulong)NKV * DV, DV},
                                    {(cl_ulong)HQ * NQ * DV, (cl_ulong)NQ * DV, DV}};
    for (int t = 0; t < 4; ++t) {
        arg_ulong(&a, 0);
        for (int s = 0; s < 3; ++s)
            arg_ulong(&a, strides[t][s]);
    }
    /* the variants' values (manifest.json): all off in this build, so never read; any buffer
     * stands for their arrays */
    arg_int(&a, NQ + NKV);  /* win_left, win_right: unbounded */
    arg_int(&a, NQ + NKV);
    arg_float(&a, 1.0f);    /* softcap_log2 */
    arg_mem(&a, bl);        /* sinks */
    arg_mem(&a, bl);        /* alibi */
    arg_mem(&a, bl);        /* mask and its batch, head and row strides */
    for (int s = 0; s < 3; ++s)
        arg_ulong(&a, 0);
    arg_mem(&a, bl);        /* tile_map and its batch and head strides */
    arg_ulong(&a, 0);
    arg_ulong(&a, 0);
    arg_mem(&a, bl);        /* k_scales, v_scales: int8 caches only, never read here */
    arg_mem(&a, bl);
    args_done(&a);
    const size_t num_m = (NQ + EX_PREFILL_BLOCK_M - 1) / EX_PREFILL_BLOCK_M;
    const size_t local = EX_PREFILL_WG;
    const size_t global = (size_t)B * HQ * num_m * (DV / EX_PREFILL_DV_TILE) * local;
    CHECK(clEnqueueNDRangeKernel(e->queue, kern, 1, NULL, &global, &local, 0, NULL, NULL));
    read_back(e, bo, bytes_of(&out), out.raw);
    read_back(e, bl, n_rows * sizeof(float), lse);
    tensor_unpack(&out);

    double *ref = xmalloc(out.n * sizeof(double)), *ref_lse = xmalloc(n_rows * sizeof(double));
    double *s = xmalloc(NKV * sizeof(double));
    const double **krow = xmalloc(NKV * sizeof(double *)), **vrow = xmalloc(NKV * sizeof(double *));
    for (int b = 0; b < B; ++b)
        for (int h = 0; h < HQ; ++h)
            for (int i = 0; i < NQ; ++i) {
                const int kvh = h / G;
                int n_keys = EX_PREFILL_CAUSAL ? i + NKV - NQ + 1 : NKV; /* bottom-right aligned */
                n_keys = n_keys < 0 ? 0 : n_keys > NKV ? NKV : n_keys;
                for (int j = 0; j < n_keys; ++j) {
                    krow[j] = k.val + (((size_t)b * HKV + kvh) * NKV + j) * DK;
                    vrow[j] = v.val + (((size_t)b * HKV + kvh) * NKV + j) * DV;
                }
                const size_t r = ((size_t)b * HQ + h) * NQ + i;
                ref_lse[r] = attend(q.val + r * DK, DK, DV, n_keys, krow, vrow, scale, s, ref + r * DV);
            }
    printf("prefill %s: %s B=%d H_q=%d H_kv=%d N_q=%d N_kv=%d %s", EX_SOURCES[EX_PREFILL_SOURCE],
           half ? "float16" : "float32", B, HQ, HKV, NQ, NKV, EX_PREFILL_CAUSAL ? "causal" : "non-causal");
    const int failed = verdict(rel_err(out.val, ref, out.n),
                               EX_PREFILL_WRITE_LSE ? lse_err(lse, ref_lse, n_rows) : 0.0, EX_PREFILL_TOLERANCE);

    free(ref), free(ref_lse), free(s), free(krow), free(vrow), free(lse);
    tensor_free(&q), tensor_free(&k), tensor_free(&v), tensor_free(&out);
    clReleaseMemObject(bq), clReleaseMemObject(bk), clReleaseMemObject(bv), clReleaseMemObject(bo);
    clReleaseMemObject(bl), clReleaseKernel(kern);
    return failed;
}

/* ---- paged decode ------------------------------------------------------------------------------ */
static int run_decode(const env_t *e, int splits)
{
    enum { B = EX_DECODE_B, HKV = EX_DECODE_H_KV, G = EX_DECODE_GROUP, HQ = G * HKV, DK = EX_DECODE_DK,
           DV = EX_DECODE_DV, BS = EX_DECODE_BLOCK_SIZE, NB = EX_DECODE_NUM_BLOCKS };
    const int half = EX_DECODE_HALF, vw = half ? 8 : 4; /* elements per 16-byte chunk */
    const int ctx[B] = EX_DECODE_CTX;
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

    tensor_t q = tensor((size_t)B * HQ * DK, half), out = tensor((size_t)B * HQ * DV, half);
    tensor_t kc = tensor((size_t)NB * BS * HKV * DK, half), vc = tensor((size_t)NB * BS * HKV * DV, half);
    tensor_random(&q);
    tensor_fill(&kc, NAN); /* slots no sequence uses hold NaN: they must never reach an output */
    tensor_fill(&vc, NAN);
    for (int b = 0; b < B; ++b)
        for (int j = 0; j < ctx[b]; ++j) {
            const size_t row = (size_t)table[b * max_blocks + j / BS] * BS + j % BS;
            for (int h = 0; h < HKV; ++h) {
                for (int c = 0; c < DK; ++c)
                    tensor_set(&kc, (row * HKV + h) * DK + c, normal());
                for (int c = 0; c < DV; ++c)
                    tensor_set(&vc, (row * HKV + h) * DV + c, normal());
            }
        }
    tensor_fill(&out, NAN);
    float *lse = xmalloc((size_t)B * HQ * sizeof(float));
    for (int i = 0; i < B * HQ; ++i)
        lse[i] = NAN;

    cl_mem bq = buffer(e, bytes_of(&q), q.raw), bk = buffer(e, bytes_of(&kc), kc.raw);
    cl_mem bv = buffer(e, bytes_of(&vc), vc.raw), bo = buffer(e, bytes_of(&out), out.raw);
    cl_mem bl = buffer(e, (size_t)B * HQ * sizeof(float), lse);
    cl_mem bt = buffer(e, (size_t)B * max_blocks * sizeof(int), table), bc = buffer(e, sizeof ctx, (void *)ctx);
    /* split-k partial states (float32): m and l (B, H_q, splits), acc (B, H_q, splits, DV); one split
     * writes out and lse itself and does not use them (flashcl passes lse) */
    cl_mem pm = bl, pl = bl, pacc = bl;
    if (splits > 1) {
        pm = buffer(e, (size_t)B * HQ * splits * sizeof(float), NULL);
        pl = buffer(e, (size_t)B * HQ * splits * sizeof(float), NULL);
        pacc = buffer(e, (size_t)B * HQ * splits * DV * sizeof(float), NULL);
    }

    cl_kernel kern = make_kernel(e, EX_DECODE_SOURCE, splits > 1 ? "flash_decode_split" : "flash_decode",
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
    /* K, V caches (num_blocks, block_size, H_kv, D): offset, block, head and slot strides in chunks */
    arg_ulong(&a, 0);
    arg_ulong(&a, (cl_ulong)BS * HKV * DK / vw);
    arg_ulong(&a, (cl_ulong)DK / vw);
    arg_ulong(&a, (cl_ulong)HKV * DK / vw);
    arg_ulong(&a, 0);
    arg_ulong(&a, (cl_ulong)BS * HKV * DV / vw);
    arg_ulong(&a, (cl_ulong)DV / vw);
    arg_ulong(&a, (cl_ulong)HKV * DV / vw);
    arg_ulong(&a, 0);                       /* out: offset, batch and head strides in elements */
    arg_ulong(&a, (cl_ulong)HQ * DV);
    arg_ulong(&a, DV);
    args_done(&a);
    const size_t local[3] = {EX_DECODE_WG, 1, 1}, global[3] = {(size_t)EX_DECODE_WG * splits, HKV, B};
    CHECK(clEnqueueNDRangeKernel(e->queue, kern, 3, NULL, global, local, 0, NULL, NULL));

    cl_kernel merge = NULL;
    if (splits > 1) { /* the in-order queue runs it after the splits */
        merge = make_kernel(e, EX_DECODE_SOURCE, "flash_decode_merge", EX_DECODE_MERGE_WG);
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
    const double **krow = xmalloc((size_t)(max_ctx + 1) * sizeof(double *));
    const double **vrow = xmalloc((size_t)(max_ctx + 1) * sizeof(double *));
    for (int b = 0; b < B; ++b)
        for (int h = 0; h < HQ; ++h) {
            for (int j = 0; j < ctx[b]; ++j) {
                const size_t row = (size_t)table[b * max_blocks + j / BS] * BS + j % BS;
                krow[j] = kc.val + (row * HKV + h / G) * DK;
                vrow[j] = vc.val + (row * HKV + h / G) * DV;
            }
            const size_t r = (size_t)b * HQ + h;
            ref_lse[r] = attend(q.val + r * DK, DK, DV, ctx[b], krow, vrow, scale, s, ref + r * DV);
        }
    printf("decode  %s: %s paged B=%d H_q=%d H_kv=%d ctx=", EX_SOURCES[EX_DECODE_SOURCE],
           half ? "float16" : "float32", B, HQ, HKV);
    for (int b = 0; b < B; ++b)
        printf(b ? ",%d" : "%d", ctx[b]);
    printf(" block_size=%d, %d split%s", BS, splits, splits > 1 ? "s + merge" : "");
    const int failed = verdict(rel_err(out.val, ref, out.n), lse_err(lse, ref_lse, (size_t)B * HQ),
                               EX_DECODE_TOLERANCE);

    free(ref), free(s), free(krow), free(vrow), free(lse), free(table);
    tensor_free(&q), tensor_free(&kc), tensor_free(&vc), tensor_free(&out);
    if (splits > 1)
        clReleaseMemObject(pm), clReleaseMemObject(pl), clReleaseMemObject(pacc), clReleaseKernel(merge);
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

    int failed = run_prefill(&e);
    failed |= run_decode(&e, EX_DECODE_SPLITS);
    failed |= run_decode(&e, 1);
    printf("max relative error %.2e: %s\n", worst, failed ? "FAILED" : "every check within tolerance");

    for (int i = 0; i < EX_NUM_SOURCES; ++i)
        clReleaseProgram(e.prog[i]), free(texts[i]);
    clReleaseCommandQueue(e.queue);
    clReleaseContext(e.ctx);
    return failed ? 1 : 0;
}
"""
