"""Which kernel variants a device's OpenCL compiler really builds and runs, probed in a subprocess.

Some compilers abort the whole process instead of failing a build: PoCL 3.0 from PyPI (LLVM 14) on
AVX-512 CPUs stops in instruction selection on a 16-wide ``fma`` (prefill.cl with VEC=16), and at
the first launch, not the build. So each device's variants (the widths of prefill's vector
arithmetic, the micro-tiled layout, decode) are built, launched and checked against the oracle in
a child process; a crash there marks that variant, and the child is restarted for the rest.

Results are cached per device, driver, flashcl version and kernel sources: in this process, and on
disk under ``$FLASHCL_CACHE_DIR`` (default: the platform's user cache dir), so a machine pays for
the probe once.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

from .._resources import kernel_dir
from .._version import __version__

PROBE_FORMAT = 2
CHILD_TIMEOUT_S = 600.0  # Adreno compilers take seconds per program; a hung child is a failure

# name -> what the child runs: (kind, dtype, params). "prefill-vec4" is the baseline: a device
# whose compiler fails it builds nothing flashcl has.
VARIANTS = {
    "prefill-vec4": ("prefill", "float32", {"BLOCK_M": 16, "BLOCK_N": 16, "DV_TILE": 32, "VEC": 4}),
    "prefill-vec8": ("prefill", "float32", {"BLOCK_M": 16, "BLOCK_N": 16, "DV_TILE": 32, "VEC": 8}),
    "prefill-vec16": ("prefill", "float32", {"BLOCK_M": 16, "BLOCK_N": 16, "DV_TILE": 32, "VEC": 16}),
    "prefill-half": ("prefill", "float16", {"BLOCK_M": 16, "BLOCK_N": 16, "DV_TILE": 32, "VEC": 4}),
    "prefill-bf16": ("prefill", "bfloat16", {"BLOCK_M": 16, "BLOCK_N": 16, "DV_TILE": 32, "VEC": 4}),
    "prefill-tiles": ("prefill", "float32", {"VARIANT": "tiles", "BLOCK_M": 64, "BLOCK_N": 16,
                                             "DV_TILE": 32, "TILE_M": 8, "TILE_N": 2, "UNROLL_K": 4}),
    "decode": ("decode", "float32", {"ROWS": 2, "UNROLL": 1, "HEAD_TILE": 2, "MERGE_WG": 64}),
    "decode-half": ("decode", "float16", {"ROWS": 2, "UNROLL": 1, "HEAD_TILE": 2, "MERGE_WG": 64}),
    "decode-bf16": ("decode", "bfloat16", {"ROWS": 2, "UNROLL": 1, "HEAD_TILE": 2, "MERGE_WG": 64}),
    # decode_cpu.cl at its widest: 16-wide vectors and a 16-key tile (the 16-wide exp2 and fma)
    "decode-rows": ("decode", "float32", {"VARIANT": "rows", "BLOCK_N": 16, "VEC": 16, "MERGE_WG": 64}),
    "decode-rows-half": ("decode", "float16", {"VARIANT": "rows", "BLOCK_N": 16, "VEC": 16, "MERGE_WG": 64}),
    "decode-rows-bf16": ("decode", "bfloat16", {"VARIANT": "rows", "BLOCK_N": 16, "VEC": 16, "MERGE_WG": 64}),
}
_SUFFIX = {"float16": "-half", "bfloat16": "-bf16"}  # the 2-byte storages' own variants
BASELINE = "prefill-vec4"


def variants_for(kernel: str, dtype: str, params: dict) -> list[str]:
    """The probed variants a launch of ``kernel`` with ``params`` depends on."""
    if kernel == "decode":
        return [("decode-rows" if params.get("VARIANT") == "rows" else "decode") + _SUFFIX.get(dtype, "")]
    if params.get("VARIANT", "rows") == "tiles":
        return ["prefill-tiles"]
    names = [f"prefill-vec{params.get('VEC', 4)}"]
    return names + ["prefill" + _SUFFIX[dtype]] if dtype in _SUFFIX else names


@dataclass(frozen=True)
class Verdict:
    ok: bool
    log: str = ""          # the build log, exception or crash report of a failed variant


@dataclass
class Capabilities:
    """What one device builds: a verdict per variant of VARIANTS."""

    verdicts: dict = field(default_factory=dict)

    @property
    def error(self) -> str | None:
        """None if the device builds flashcl's kernels (the baseline variant), else why not."""
        v = self.verdicts.get(BASELINE)
        return None if v is None or v.ok else v.log

    def works(self, variant: str) -> bool:
        v = self.verdicts.get(variant)
        return v is None or v.ok

    def failure(self, variant: str) -> str:
        v = self.verdicts.get(variant)
        return "" if v is None or v.ok else v.log

    @property
    def max_vec(self) -> int:
        """The widest prefill VEC that works (4 if none does: the baseline's error then applies)."""
        return max([w for w in (4, 8, 16) if self.works(f"prefill-vec{w}")] or [4])

    def summary(self) -> str:
        """One phrase for `flashcl devices`: "yes", "NO", or "yes, not vec16,tiles" (what failed)."""
        if self.error is not None:
            return "NO"
        bad = [n for n in VARIANTS if not self.works(n)]
        return "yes" if not bad else "yes, not " + ",".join(n.replace("prefill-", "") for n in bad)


@functools.lru_cache(maxsize=None)
def _sources_digest() -> str:
    h = hashlib.sha256()
    for f in sorted(kernel_dir().glob("*")):
        h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()[:16]


def _cache_dir() -> Path:
    env = os.environ.get("FLASHCL_CACHE_DIR")
    if env:
        return Path(env) / "probe"
    import platformdirs

    return Path(platformdirs.user_cache_dir("flashcl")) / "probe"


def _identity(dev) -> dict:
    p = dev.platform
    return {"platform": p.name.strip(), "platform_version": p.version.strip(), "device": dev.name.strip(),
            "driver": dev.driver_version.strip(), "flashcl": __version__, "sources": _sources_digest(),
            "format": PROBE_FORMAT, "variants": sorted(VARIANTS)}


def _cache_file(ident: dict) -> Path:
    key = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:24]
    return _cache_dir() / f"{key}.json"


_memo: dict = {}
_locks: dict = {}
_memo_lock = threading.Lock()


def capabilities(dev) -> Capabilities:
    """The probed capabilities of ``dev`` (a pyopencl Device): memoized, else read from the disk
    cache, else probed in subprocesses and stored."""
    with _memo_lock:  # every call of prefill and decode asks: the device pointer first
        hit = _memo.get(dev.int_ptr)
        if hit is not None:
            return hit
    ident = _identity(dev)
    key = json.dumps(ident, sort_keys=True)
    with _memo_lock:
        if key in _memo:
            _memo[dev.int_ptr] = _memo[key]
            return _memo[key]
        lock = _locks.setdefault(key, threading.Lock())
    with lock:
        with _memo_lock:
            if key in _memo:
                return _memo[key]
        caps = _read_cache(ident) or _probe(dev, ident)
        with _memo_lock:
            _memo[key] = _memo[dev.int_ptr] = caps
        return caps


def _read_cache(ident: dict) -> Capabilities | None:
    try:
        data = json.loads(_cache_file(ident).read_text())
        if data.get("identity") != ident:
            return None
        return Capabilities({n: Verdict(bool(v["ok"]), str(v.get("log", "")))
                             for n, v in data["verdicts"].items()})
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None  # absent or damaged: probe again


def _write_cache(ident: dict, caps: Capabilities) -> None:
    path = _cache_file(ident)
    data = {"identity": ident,
            "verdicts": {n: {"ok": v.ok, "log": v.log} for n, v in caps.verdicts.items()}}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache only costs a probe per process


def _device_spec(dev) -> str:
    import pyopencl as cl

    for pi, p in enumerate(cl.get_platforms()):
        for di, d in enumerate(p.get_devices()):
            if d.int_ptr == dev.int_ptr:
                return f"{pi}:{di}"
    raise ValueError(f"device {dev.name.strip()} is not among the OpenCL platforms' devices")


def _probe(dev, ident: dict) -> Capabilities:
    """Run the child until every variant has a verdict; a child that dies (a signal, an abort
    inside the compiler) or hangs marks the variant it was running and is restarted."""
    spec = _device_spec(dev)
    verdicts: dict = {}
    while len(verdicts) < len(VARIANTS):
        todo = [n for n in VARIANTS if n not in verdicts]
        # Not under the caller's Oclgrind checks: the probe's launches are not the caller's.
        env = {k: v for k, v in os.environ.items() if not k.startswith("OCLGRIND_")}
        env["FLASHCL_PROBE_CHILD"] = "1"
        cmd = [sys.executable, "-c", _CHILD_MAIN, spec, ident["device"], *todo]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=CHILD_TIMEOUT_S)
            out, err, died = proc.stdout, proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as exc:
            out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            err, died = f"the probe timed out after {CHILD_TIMEOUT_S:.0f} s", "timeout"
        running = None
        for line in out.splitlines():
            if not line.startswith("flashcl-probe "):
                continue
            msg = json.loads(line[len("flashcl-probe "):])
            if "start" in msg:
                running = msg["start"]
            else:
                verdicts[msg["variant"]] = Verdict(msg["ok"], msg.get("log", ""))
                running = None
        if died != 0:  # a child may also die after its last verdict (at exit, or timed out then)
            victim = running or next((n for n in todo if n not in verdicts), None)
            if victim is not None and victim not in verdicts:
                how = f"signal {-died}" if isinstance(died, int) and died < 0 else f"exit {died}"
                tail = "\n".join(err.strip().splitlines()[-20:])
                verdicts[victim] = Verdict(False, f"the OpenCL compiler or runtime killed the process "
                                                  f"({how}) on variant {victim}:\n{tail}")
        elif any(n not in verdicts for n in todo):
            missing = [n for n in todo if n not in verdicts]
            raise RuntimeError(f"the device probe of {ident['device']} gave no verdict on {missing}:\n{err}")
    caps = Capabilities({n: verdicts[n] for n in VARIANTS})
    _write_cache(ident, caps)
    return caps


def in_child() -> bool:
    """True inside the probe's child, which must not probe (or refuse variants) itself."""
    return os.environ.get("FLASHCL_PROBE_CHILD") == "1"


# --------------------------------------------------------------------------- the child

def _run_variant(spec: str, name: str) -> str | None:
    """Build, launch and check one variant on device ``spec``; None if right, else why not."""
    import numpy as np

    from .. import reference
    from . import decode, prefill

    kind, dtype, params = VARIANTS[name]
    rng = np.random.default_rng(0)
    if dtype == "bfloat16":  # torch's (numpy has none); without torch no call can pass bfloat16
        try:
            import torch
        except ImportError:
            return None

    def values(shape):
        x = rng.standard_normal(shape)
        return torch.from_numpy(x).to(torch.bfloat16) if dtype == "bfloat16" else x.astype(dtype)

    if kind == "prefill":
        q = values((1, 2, 37, 32))
        k, v = (values((1, 1, 45, 32)) for _ in range(2))
        out = prefill.prefill(q, k, v, rank=4, shapes=(q.shape, k.shape, v.shape), causal=True,
                              scale=32 ** -0.5, device=spec, params=params, return_lse=False)
        ref = reference.attention(q, k, v, causal=True)
    else:
        q = values((2, 4, 32))
        k, v = (values((6, 16, 2, 32)) for _ in range(2))
        table = np.array([[3, 0, 5], [1, 4, 2]], dtype=np.int32)
        lens = np.array([40, 33], dtype=np.int32)
        geo = {"B": 2, "H_q": 4, "H_kv": 2, "DK": 32, "DV": 32, "paged": True, "block_size": 16,
               "num_blocks": 6, "N_max": 48}
        out = decode.decode(q, k, v, geo=geo, block_table=table, context_lens=lens, scale=32 ** -0.5,
                            num_splits=2, device=spec, params=params, return_lse=False)
        ref = reference.decode_attention(q, k, v, block_table=table, context_lens=lens)
    out = out.float().numpy() if dtype == "bfloat16" else out
    err, tol = reference.rel_err(out, ref), reference.TOLERANCE[dtype]
    return None if err <= tol else f"wrong result: relative error {err:.2e} against the oracle (> {tol:g})"


def _child(argv: list[str]) -> int:
    spec, _device_name, names = argv[0], argv[1], argv[2:]
    import warnings

    warnings.simplefilter("ignore")  # compiler chatter is not a verdict
    for name in names:
        print("flashcl-probe " + json.dumps({"start": name}), flush=True)
        try:
            why = _run_variant(spec, name)
        except Exception as exc:  # a build error, an out-of-resources launch: a clean failure
            why = getattr(exc, "log", None) or f"{type(exc).__name__}: {exc}"
        print("flashcl-probe " + json.dumps({"variant": name, "ok": why is None, "log": why or ""}), flush=True)
    return 0


# The child imports this module by name (not ``-m``), so that it runs the same functions as the parent.
_CHILD_MAIN = "import sys; from flashcl.opencl.probe import _child; sys.exit(_child(sys.argv[1:]))"
