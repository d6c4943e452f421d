"""OpenCL runtime: device selection, context/queue reuse, the program cache, kernel launches.

Contexts and queues are created once per device and reused; programs are cached per
(context, source + includes, build options, device, driver, flashcl version), so a second call
with the same parameters never rebuilds, and their binaries on disk (``program_cache_dir``), so a
second process loads them instead of compiling.
"""

from __future__ import annotations

import hashlib
import os
import re
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path

import numpy as np
import pyopencl as cl

from .._resources import kernel_dir
from .._version import __version__
from ..errors import KernelBuildError, KernelLaunchError
from ..profiles import DeviceProfile, profile_for
from . import probe


@dataclass
class DeviceHandle:
    """One OpenCL device with its reused context and profiling queue."""

    device: cl.Device
    context: cl.Context
    queue: cl.CommandQueue
    # built programs by cache key, least recently used first; bounded by MAX_PROGRAMS (build())
    programs: OrderedDict = field(default_factory=OrderedDict)
    # Kernel objects are shared by every caller of a program, and an OpenCL kernel's arguments
    # are state: setting them and enqueueing is one step per device (launch_sequence).
    launch_lock: threading.Lock = field(default_factory=threading.Lock)
    # One build at a time per device: some compilers (PoCL) are not safe to enter concurrently.
    build_lock: threading.Lock = field(default_factory=threading.Lock)
    # Kernel wrappers (DecodeKernel, PrefillKernel) by kind, then by problem class, parameters and
    # variant flags, least recently used first, MAX_PROGRAMS of each kind: a flashcl.decode or
    # prefill call of a class seen before builds nothing (reuse()).
    wrappers: dict = field(default_factory=dict)
    # Scratch buffers by name, each grown to the largest request up to SCRATCH_KEPT (scratch()):
    # the split-k partial states of every decode on this queue, and flash_decode_fused's arrival
    # counts (zeroed; each launch leaves them at zero).
    scratch_buffers: dict = field(default_factory=dict)
    # Tile choices by (kernel, problem class, sequence bucket), with the tuning database files
    # they were chosen from (chosen()): the lookup and its validation cost ~70 us a call on PoCL.
    choices: OrderedDict = field(default_factory=OrderedDict)

    def reuse(self, kind: str, key, make):
        """The ``kind`` wrapper kept under ``key``, else ``make()``'s, kept; a kept one whose kernel
        sources changed since its build is made again. Wrappers are shared by the calls on this
        queue: in order, each call's kernels enqueued together (launch_sequence)."""
        with _lock:
            lru = self.wrappers.setdefault(kind, OrderedDict())
            kept = lru.get(key)
            if kept is not None:
                lru.move_to_end(key)
        if kept is not None and all(b.current() for b in kept.built_programs):
            return kept
        made = make()
        with _lock:
            lru = self.wrappers.setdefault(kind, OrderedDict())
            lru[key] = made
            lru.move_to_end(key)
            while len(lru) > MAX_PROGRAMS:
                lru.popitem(last=False)
        return made

    def chosen(self, key, choose):
        """``choose()``'s tuning.Choice for ``key``, kept while the tuning database's files are the
        ones it was chosen from (a file the tuner rewrites is a new version, seen at the next call)."""
        from .. import tuning

        files = tuning.database_files()
        with _lock:
            held = self.choices.get(key)
            if held is not None and _same_objects(held[0], files):
                self.choices.move_to_end(key)
                return held[1]
        choice = choose()
        with _lock:
            self.choices[key] = (files, choice)
            self.choices.move_to_end(key)
            while len(self.choices) > MAX_CHOICES:
                self.choices.popitem(last=False)
        return choice

    def scratch(self, name: str, nbytes: int, *, zeroed: bool = False) -> cl.Buffer:
        """A buffer of at least ``nbytes`` for a call's intermediate values, shared by every call
        on this queue: in order, each call's kernels enqueued together (launch_sequence), so a
        call's kernels are done with it before the next call's write it. A larger request
        replaces it (OpenCL frees the old one once the commands using it have finished); one
        over SCRATCH_KEPT gets a buffer of its own, released with the call. ``zeroed``: created
        from host zeros (a fill command is not initialization to Oclgrind), for kernels that
        leave it as they found it."""
        def new_buffer(size):
            if zeroed:
                return cl.Buffer(self.context, cl.mem_flags.READ_WRITE | cl.mem_flags.COPY_HOST_PTR,
                                 hostbuf=np.zeros(size, np.uint8))
            return cl.Buffer(self.context, cl.mem_flags.READ_WRITE, size)

        if nbytes > SCRATCH_KEPT:
            return new_buffer(nbytes)
        with _lock:
            buf = self.scratch_buffers.get(name)
            if buf is None or buf.size < nbytes:
                buf = self.scratch_buffers[name] = new_buffer(max(nbytes, 4))
            return buf

    def forget(self) -> None:
        """Drop what the handle keeps (its wrappers refer back to it): called when it leaves the
        handle cache, so that it is freed as soon as nothing else holds it."""
        with _lock:
            self.wrappers.clear()
            self.scratch_buffers.clear()
            self.choices.clear()

    @property
    def name(self) -> str:
        return self.device.name.strip()

    @property
    def platform(self) -> str:
        return self.device.platform.name.strip()

    @property
    def driver(self) -> str:
        return self.device.driver_version.strip()

    @property
    def is_cpu(self) -> bool:
        return bool(self.device.type & cl.device_type.CPU)

    @cached_property
    def profile(self) -> DeviceProfile:
        """The device's profile, its SIMD width cut to the widest VEC its compiler builds."""
        prof = profile_for(self.device.vendor, self.name, self.device.opencl_c_version,
                           "cpu" if self.is_cpu else "gpu")
        max_vec = capabilities(self.device).max_vec
        return replace(prof, simd=max_vec) if prof.simd > max_vec else prof

    @property
    def local_mem(self) -> int:
        return int(self.device.local_mem_size)

    @property
    def max_work_group(self) -> int:
        return int(self.device.max_work_group_size)

    @property
    def fp16(self) -> bool:
        return "cl_khr_fp16" in self.device.extensions

    @property
    def is_nvidia(self) -> bool:
        return "nvidia" in self.platform.lower()

    def describe(self) -> str:
        return f"{self.name} ({self.platform}, driver {self.driver})"


# Handles by (device, user's context, user's queue). Handles of devices named by string or
# Device are one per device; a caller passing a new Context or CommandQueue per call would add
# one handle (and its program cache) per call, so at most MAX_HANDLES are kept, least recently
# used dropped first (a later call with that queue simply builds a new handle).
_handles: OrderedDict = OrderedDict()
MAX_HANDLES = 16
# Tile choices a handle keeps (DeviceHandle.chosen): problem classes times sequence buckets.
MAX_CHOICES = 256
_lock = threading.RLock()


def _same_objects(a, b) -> bool:
    """Whether two database_files() results hold the very same parsed files (each version of a
    file is its own object)."""
    a, b = [db for folder in a for db in folder], [db for folder in b for db in folder]
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


def _all_devices():
    try:
        platforms = cl.get_platforms()
    except cl.Error as exc:
        raise RuntimeError(f"no OpenCL platform found ({exc}); install one, e.g. pip install 'flashcl[pocl]'") from exc
    return [(pi, di, p, d) for pi, p in enumerate(platforms) for di, d in enumerate(p.get_devices())]


def _is_oclgrind(p) -> bool:
    return "oclgrind" in p.name.lower()


# PoCL from PyPI (3.0, LLVM 14) builds nothing on a CPU newer than its LLVM knows ("unknown target
# CPU 'generic'" on AMD Zen 5) and aborts the process on some variants elsewhere. Each device's
# compiler is therefore probed in a subprocess (probe.py); where a device spec or the default
# matches several devices, selection takes the first whose compiler builds.
_UNKNOWN_CPU_HINT = (
    "\nThis OpenCL compiler does not know the host CPU (PoCL 3.0 from PyPI ships LLVM 14, which calls "
    "CPUs newer than it 'generic', AMD Zen 5 for one). A newer PoCL can: on Debian or Ubuntu "
    "`apt-get install pocl-opencl-icd`; flashcl then picks the PoCL device whose compiler works.")


def capabilities(dev: cl.Device) -> probe.Capabilities:
    """What ``dev``'s compiler builds and runs (probe.py); everything inside the probe's child."""
    if probe.in_child():
        return probe.Capabilities()
    return probe.capabilities(dev)


def compiler_error(dev: cl.Device) -> str | None:
    """None if ``dev``'s OpenCL compiler builds flashcl's kernels, else why not (its log)."""
    return capabilities(dev).error


def probe_failure(handle: "DeviceHandle", kernel: str, dtype: str, params: dict) -> str:
    """Why the probe found that ``kernel`` with ``params`` fails on this device ("" if it works)."""
    caps = capabilities(handle.device)
    failures = (caps.failure(v) for v in probe.variants_for(kernel, dtype, params))
    return caps.error or next((why for why in failures if why), "")


def probe_errors(handle: "DeviceHandle", kernel: str, dtype: str, params: dict) -> list[str]:
    """probe_failure as a constraint violation (tuning entries that fail here are skipped)."""
    why = probe_failure(handle, kernel, dtype, params)
    return [f"the device's compiler fails on this variant ({why.strip().splitlines()[0]})"] if why else []


def check_variant(handle: "DeviceHandle", kernel: str, dtype: str, params: dict) -> None:
    """Raise KernelBuildError, with the probe's log, where the probe found that ``kernel`` with
    ``params`` fails to build or kills the process on this device."""
    log = probe_failure(handle, kernel, dtype, params)
    if not log:
        return
    first = next((ln.strip() for ln in log.splitlines() if "error" in ln.lower()), log.strip().splitlines()[0])
    what = ("this device's OpenCL compiler builds none of flashcl's kernels" if capabilities(handle.device).error
            else "this variant fails on this device")
    if "unknown target CPU" in log:
        first += "; a newer PoCL builds here (Debian/Ubuntu: apt-get install pocl-opencl-icd)"
    log = f"error: {what} (probed in a subprocess; see `flashcl devices`): {first}\n{log}"
    if "unknown target CPU" in log and _UNKNOWN_CPU_HINT not in log:
        log += _UNKNOWN_CPU_HINT
    raise KernelBuildError(kernel, params, handle.describe(), log)


def _first_usable(devices: list):
    """The first of ``devices`` whose compiler works; the first one if none does (its builds then
    raise KernelBuildError with the compiler's log). A single candidate is not probed."""
    if len(devices) > 1:
        for d in devices:
            if compiler_error(d) is None:
                return d
    return devices[0]


def _match(spec: str):
    devices = _all_devices()
    m = re.fullmatch(r"(\d+):(\d+)", spec.strip())
    if m:
        pi, di = int(m.group(1)), int(m.group(2))
        for P, D, _, d in devices:
            if (P, D) == (pi, di):
                return d
        raise ValueError(f"device={spec!r}: no OpenCL device {pi}:{di}; run `flashcl devices` to list them")
    want = spec.strip().lower()
    # A name or profile ("cpu") never selects the Oclgrind simulator, which calls itself a CPU
    # and is listed first once installed; it must be named ("oclgrind") or given as "P:D".
    if "oclgrind" not in want:
        devices = [x for x in devices if not _is_oclgrind(x[2])]
    hits = []
    for _, _, p, d in devices:
        prof = profile_for(d.vendor, d.name, d.opencl_c_version,
                           "cpu" if d.type & cl.device_type.CPU else "gpu")
        if want in p.name.lower() or want in d.name.lower() or want == prof.name or prof.name.startswith(want):
            hits.append(d)
    if hits:
        return _first_usable(hits)
    names = ", ".join(f"{P}:{D} {d.name.strip()}" for P, D, _, d in devices)
    raise ValueError(f"device={spec!r} matches no OpenCL device (have: {names})")


def _default_device():
    devices = [d for _, _, p, d in _all_devices() if not _is_oclgrind(p)]
    if not devices:
        raise RuntimeError("no OpenCL device found; install one, e.g. pip install 'flashcl[pocl]'")
    gpus = [d for d in devices if d.type & cl.device_type.GPU]
    return _first_usable(gpus + [d for d in devices if d not in gpus])


# Devices by the string that named them (None: the default): the platforms a process sees do not
# change, and matching a name lists them all and probes the candidates (~15 us a call).
_named: dict = {}


def _named_device(spec: str | None) -> cl.Device:
    with _lock:
        dev = _named.get(spec)
    if dev is None:
        dev = _match(spec) if spec is not None else _default_device()
        with _lock:
            _named[spec] = dev
    return dev


def _handle_for_device(dev: cl.Device, context=None, queue=None) -> DeviceHandle:
    if queue is not None and queue.properties & cl.command_queue_properties.OUT_OF_ORDER_EXEC_MODE_ENABLE:
        raise ValueError("flashcl needs an in-order command queue: a call's kernels (split-k, then its "
                         "merge) and the workspaces its calls share run in queue order")
    key = (dev.int_ptr, None if context is None else context.int_ptr, None if queue is None else queue.int_ptr)
    with _lock:
        if key not in _handles and queue is not None:
            # arrays made on get_device(...).queue: that handle, not a second one (programs,
            # wrappers) on the same queue
            for other, h in _handles.items():
                if h.queue.int_ptr == queue.int_ptr:
                    key = other
                    break
        h = _handles.get(key)
        if h is None:
            ctx = context or (queue.context if queue is not None else cl.Context([dev]))
            if queue is None:
                queue = cl.CommandQueue(ctx, dev, properties=cl.command_queue_properties.PROFILING_ENABLE)
            h = _handles[key] = DeviceHandle(dev, ctx, queue)
            while len(_handles) > MAX_HANDLES:
                _handles.popitem(last=False)[1].forget()
        else:
            _handles.move_to_end(key)
        return h


def get_device(spec=None) -> DeviceHandle:
    """Resolve ``device=`` (docs/design.md §1) to a cached DeviceHandle.

    None: $FLASHCL_DEVICE, else the first GPU, else the first device. A string: "P:D" indices or a
    substring of the platform/device name or a profile name ("adreno", "nvidia", "cpu"). Or a
    pyopencl Device, Context or CommandQueue.
    """
    if isinstance(spec, DeviceHandle):
        return spec
    if isinstance(spec, cl.CommandQueue):
        return _handle_for_device(spec.device, queue=spec)
    if isinstance(spec, cl.Context):
        return _handle_for_device(spec.devices[0], context=spec)
    if isinstance(spec, cl.Device):
        return _handle_for_device(spec)
    if spec is None:
        spec = os.environ.get("FLASHCL_DEVICE") or None
    if spec is None or isinstance(spec, str):
        return _handle_for_device(_named_device(spec))
    raise TypeError(f"device: expected None, a string, or a pyopencl Device/Context/CommandQueue; "
                    f"got {type(spec).__name__}")


def list_devices(include_oclgrind: bool = True) -> list[dict]:
    rows = []
    for pi, di, p, d in _all_devices():
        if _is_oclgrind(p) and not include_oclgrind:
            continue
        rows.append({
            "id": f"{pi}:{di}", "platform": p.name.strip(), "device": d.name.strip(),
            "type": cl.device_type.to_string(d.type), "driver": d.driver_version.strip(),
            "opencl_c": d.opencl_c_version.strip(), "compute_units": int(d.max_compute_units),
            "local_mem_kib": int(d.local_mem_size) // 1024, "max_work_group": int(d.max_work_group_size),
            "fp16": "cl_khr_fp16" in d.extensions,
            "profile": profile_for(d.vendor, d.name, d.opencl_c_version,
                                   "cpu" if d.type & cl.device_type.CPU else "gpu").name,
            "compiles": compiler_error(d) is None,
            "builds": capabilities(d).summary(),
        })
    return rows


# --------------------------------------------------------------------------- programs

_INCLUDE_RE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


# _source_with_includes' results by (folder, name): (text, digest, the stat of every file read).
# Every kernel construction asks for them; reading, scanning and hashing the files took ~0.4 ms a
# call, a stat of each ~2 us, and an edited file still gives a new digest.
_sources: dict = {}


def _stamp(path: "str | Path") -> tuple:
    st = os.stat(path)
    return st.st_mtime_ns, st.st_size, st.st_ino


def _source_with_includes(name: str) -> tuple[str, str]:
    """The kernel source and a digest covering it and (recursively) its quoted includes."""
    root = kernel_dir()
    hit = _sources.get((root, name))
    try:
        if hit is not None and all(_stamp(f) == st for f, st in hit[2]):
            return hit[0], hit[1]
    except OSError:
        pass
    stamps = [(str(root / name), _stamp(root / name))]
    text = (root / name).read_text()
    digest = hashlib.sha256(text.encode())
    seen, todo = set(), _INCLUDE_RE.findall(text)
    while todo:
        inc = todo.pop()
        if inc in seen:
            continue
        seen.add(inc)
        stamps.append((str(root / inc), _stamp(root / inc)))
        inc_text = (root / inc).read_text()
        digest.update(inc.encode() + inc_text.encode())
        todo.extend(_INCLUDE_RE.findall(inc_text))
    _sources[(root, name)] = (text, digest.hexdigest(), stamps)
    return text, digest.hexdigest()


@dataclass
class BuiltProgram:
    program: cl.Program
    log: str
    options: list
    kernels: dict = field(default_factory=dict)
    # "compiled" or "disk cache": where the binary came from (tests and timings read it)
    origin: str = "compiled"
    # the clkernels/ file it was built from and the digest of it and its includes then
    source: str = ""
    digest: str = ""

    def current(self) -> bool:
        """Whether its source and includes are as they were when it was built."""
        return not self.source or _source_with_includes(self.source)[1] == self.digest

    def kernel(self, name: str) -> cl.Kernel:
        """One Kernel object per name, reused (launches set all arguments every time, under the
        device's launch lock)."""
        with _lock:
            if name not in self.kernels:
                self.kernels[name] = cl.Kernel(self.program, name)
            return self.kernels[name]


def build_options(defines: dict, handle: DeviceHandle, verbose: bool = False, extra=()) -> list[str]:
    opts = [f"-I{kernel_dir()}"]
    opts += [f"-D{k}={int(v) if isinstance(v, bool) else v}" for k, v in sorted(defines.items())]
    if handle.is_nvidia and verbose:
        opts.append("-cl-nv-verbose")  # ptxas register/spill report in the build log
    opts += list(extra)
    return opts


# Programs kept per device. Every distinct problem class (head dims, dtype, causal, GQA group,
# tile parameters) is its own program, so a long-running server that sees many shapes, or a
# tuner sweep, would otherwise hold every program it ever built (and its kernels' device code).
# 64 covers the working set of a model (a few problem classes per layer type) many times over;
# the least recently used program is dropped beyond it, and PyOpenCL releases it once no
# PrefillKernel/DecodeKernel still holds it (the wrappers a handle keeps, up to 64 of each kind,
# hold theirs). Rebuilding an evicted one loads its binary from disk.
MAX_PROGRAMS = 64
# The largest scratch buffer a handle keeps between calls (64 MiB): a larger call's split-k
# states are its own, released with it, so one huge decode does not pin its memory.
SCRATCH_KEPT = 64 << 20


def build(handle: DeviceHandle, source: str, defines: dict, *, kernel: str,
          verbose: bool = False, extra_options=()) -> BuiltProgram:
    """Build (or fetch from the cache) ``source`` from clkernels/ with ``-D`` defines."""
    text, digest = _source_with_includes(source)
    # Drivers cache binaries by the source text and options they are given, blind to the files it
    # includes (PoCL 5 served a kernel built from an older header): the digest makes them differ.
    options = build_options(defines, handle, verbose, extra_options) + [f"-DFLASHCL_SOURCES={digest[:16]}"]
    key = (digest, tuple(options), handle.name, handle.driver, __version__)
    with _lock:
        cached = handle.programs.get(key)
        if cached is not None:
            handle.programs.move_to_end(key)  # most recently used
    if cached is not None:
        return cached
    with handle.build_lock:
        with _lock:
            cached = handle.programs.get(key)  # built by another thread while this one waited
        if cached is not None:
            return cached
        built = _build_locked(handle, key, text, options, defines, kernel, verbose)
        built.source, built.digest = source, digest
        return built


def _build_locked(handle: DeviceHandle, key, text: str, options: list, defines: dict, kernel: str,
                  verbose: bool) -> BuiltProgram:
    # A verbose build is one whose compiler report we read (ptxas registers and spills); a cached
    # binary comes without it (flashcl tune on the H100 then fell back to the register model).
    path = None if verbose or not caches_binaries(handle) else _binary_path(handle, key)
    loaded = _load_binary(handle, path, options) if path is not None else None
    if loaded is not None:
        built = BuiltProgram(loaded[0], loaded[1], options, origin="disk cache")
    else:
        built = _compile(handle, text, options, defines, kernel)
        if path is not None:
            _store_binary(handle, path, built)
    with _lock:
        handle.programs[key] = built
        while len(handle.programs) > MAX_PROGRAMS:
            handle.programs.popitem(last=False)  # least recently used
    return built


def _compile(handle: DeviceHandle, text: str, options: list, defines: dict, kernel: str) -> BuiltProgram:
    program = cl.Program(handle.context, text)
    try:
        # PyOpenCL's own cache is off: it skips PoCL and NVIDIA (trusting their caches, which
        # miss an edited header) and keys on neither flashcl's version nor the includes.
        program.build(options=options, devices=[handle.device], cache_dir=False)
    except cl.RuntimeError as exc:
        try:
            log = program.get_build_info(handle.device, cl.program_build_info.LOG)
        except cl.Error:
            log = str(exc)
        log = log or str(exc)
        if "unknown target CPU" in log:
            log += _UNKNOWN_CPU_HINT
        raise KernelBuildError(kernel, defines, handle.describe(), log) from None
    log = program.get_build_info(handle.device, cl.program_build_info.LOG) or ""
    return BuiltProgram(program, log, options)


# --------------------------------------------------------------------------- the binary cache

# Bump when the file layout changes: <8-byte little-endian log length><sha256 of the binary><log,
# UTF-8><binary>. The digest is checked first: PoCL crashes the process on a damaged binary.
BINARY_CACHE_FORMAT = 1


def caches_binaries(handle: DeviceHandle) -> bool:
    """Whether built programs go to the disk cache: $FLASHCL_PROGRAM_CACHE "on", "off", or "auto"
    (default): not on CPU devices, where PoCL compiles lazily and fetching a binary compiles every
    kernel (1.7 s against 0.1 s for decode), and its own kernel cache serves a second process."""
    mode = os.environ.get("FLASHCL_PROGRAM_CACHE", "auto").lower()
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"FLASHCL_PROGRAM_CACHE={mode!r}: expected auto, on or off")
    return mode == "on" or (mode == "auto" and not handle.is_cpu)


def program_cache_dir() -> Path:
    """Where built program binaries are kept: ``$FLASHCL_CACHE_DIR/programs``, else the user cache dir."""
    env = os.environ.get("FLASHCL_CACHE_DIR")
    if env:
        return Path(env) / "programs"
    import platformdirs

    return Path(platformdirs.user_cache_dir("flashcl")) / "programs"


def _binary_path(handle: DeviceHandle, key) -> Path:
    # key already holds the source-and-includes digest, the options, device, driver and version
    ident = repr((BINARY_CACHE_FORMAT, handle.platform, handle.device.platform.version.strip(),
                  handle.device.vendor.strip(), key))
    return program_cache_dir() / f"{hashlib.sha256(ident.encode()).hexdigest()[:32]}.bin"


def _load_binary(handle: DeviceHandle, path: Path, options: list):
    """(program, log) from the cache, or None on a miss, a damaged file or a binary the driver refuses."""
    try:
        data = path.read_bytes()
        (n,) = struct.unpack_from("<Q", data)
        digest, log, binary = data[8:40], data[40:40 + n].decode(), data[40 + n:]
        if not binary or hashlib.sha256(binary).digest() != digest:
            return None
        program = cl.Program(handle.context, [handle.device], [binary])
        program.build(options=options, devices=[handle.device])
    except (OSError, struct.error, UnicodeDecodeError, cl.Error):
        return None  # built from source and stored again
    return program, log


def _store_binary(handle: DeviceHandle, path: Path, built: BuiltProgram) -> None:
    try:
        devices = built.program.get_info(cl.program_info.DEVICES)
        binary = built.program.get_info(cl.program_info.BINARIES)[devices.index(handle.device)]
    except (cl.Error, ValueError):
        return
    if not binary:
        return
    log = built.log.encode()
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        binary = bytes(binary)
        tmp.write_bytes(struct.pack("<Q", len(log)) + hashlib.sha256(binary).digest() + log + binary)
        os.replace(tmp, path)  # readers in other processes see a whole file or none
    except OSError:
        tmp.unlink(missing_ok=True)  # a read-only cache only costs a compile per process


_PTXAS_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_REGS = re.compile(r"Used (\d+) registers")
_PTXAS_ENTRY = re.compile(r"Compiling entry function '([^']+)'")


def ptxas_section(log: str, name: str) -> str:
    """The part of a ptxas report about kernel ``name``: a program with several kernels reports
    each after its "Compiling entry function 'name'" line. The whole log if it names no entry."""
    starts = [(m.start(), m.group(1)) for m in _PTXAS_ENTRY.finditer(log)]
    if not starts:
        return log
    for i, (pos, entry) in enumerate(starts):
        if entry == name:
            end = starts[i + 1][0] if i + 1 < len(starts) else len(log)
            return log[pos:end]
    return ""


def spill_report(built: BuiltProgram, kernel: cl.Kernel, handle: DeviceHandle) -> dict:
    """Spill signals for one built kernel, strongest first (docs/design.md §6)."""
    info = {}
    section = ptxas_section(built.log, kernel.function_name)
    m = _PTXAS_SPILL.search(section)
    if m:
        info["spill_stores"], info["spill_loads"] = int(m.group(1)), int(m.group(2))
    m = _PTXAS_REGS.search(section)
    if m:
        info["registers"] = int(m.group(1))
    wgi = cl.kernel_work_group_info
    try:
        info["private_mem"] = int(kernel.get_work_group_info(wgi.PRIVATE_MEM_SIZE, handle.device))
    except cl.Error:
        pass
    info["kernel_max_work_group"] = int(kernel.get_work_group_info(wgi.WORK_GROUP_SIZE, handle.device))
    info["local_mem"] = int(kernel.get_work_group_info(wgi.LOCAL_MEM_SIZE, handle.device))
    return info


def launch(handle: DeviceHandle, kernel: cl.Kernel, global_size, local_size, args, *,
           name: str, params: dict) -> cl.Event:
    """Set the arguments of one kernel and enqueue it; errors name the kernel and its params."""
    return launch_sequence(handle, [(name, kernel, global_size, local_size, args)], params=params)[0]


def launch_sequence(handle: DeviceHandle, launches, *, params: dict) -> list[cl.Event]:
    """Enqueue kernels that run one after the other, ``launches`` = [(name, kernel, global_size,
    local_size, args)]: every kernel's arguments are set before the first is enqueued, so that
    the GPU starts the next one without waiting for Python to set its arguments (tens of
    microseconds for PyOpenCL's set_args of ~30 arguments, longer than a short decode kernel)."""
    events = []
    with handle.launch_lock:
        for name, kernel, _, _, args in launches:
            try:
                _set_args(kernel, args)
            except (cl.Error, TypeError, RuntimeError) as exc:  # RuntimeError: a bad value in a typed slot
                raise KernelLaunchError(name, params, handle.describe(), str(exc)) from None
        for name, kernel, global_size, local_size, _ in launches:
            try:
                events.append(cl.enqueue_nd_range_kernel(handle.queue, kernel, global_size, local_size))
            except cl.Error as exc:
                raise KernelLaunchError(name, params, handle.describe(), str(exc)) from None
    return events


def _set_args(kernel: cl.Kernel, args) -> None:
    """kernel.set_args(*args), the scalars' types told to PyOpenCL at the Kernel object's first
    launch (numpy scalars there; buffers, local memory and None untyped): its set_args is then
    generated code, ~2 us for 30 arguments on PoCL instead of ~100 us through the generic
    per-argument conversion (docs/notes/opencl-host.md)."""
    if not getattr(kernel, "_flashcl_typed", False):
        kernel.set_scalar_arg_dtypes([a.dtype if isinstance(a, np.generic) else None for a in args])
        kernel._flashcl_typed = True
    kernel.set_args(*args)


def event_times(run, repeats: int, *, warmup: int = 1) -> list[float]:
    """Milliseconds of ``repeats`` calls of ``run(i)``, from OpenCL profiling events, after
    ``warmup`` untimed calls (the driver's first-launch cost). ``run`` returns the event of one
    kernel or the events of a sequence (timed from the first start to the last end)."""
    def span(evs):
        evs = evs if isinstance(evs, (list, tuple)) else [evs]
        evs[-1].wait()
        return (evs[-1].profile.end - evs[0].profile.start) * 1e-6

    for i in range(warmup):
        span(run(i))
    return [span(run(i)) for i in range(repeats)]

