"""The ``flashcl`` command: ``devices``, ``bench prefill|decode``, ``tune``, ``show-config``, ``export``,
``soak``.

Human tables by default, ``--json`` for scripts (standard JSON: NaN and infinities are null;
progress and notes then go to stderr only). Every error is one line on stderr, ``error: ...``.
Compiler output (PyOpenCL's CompilerWarning) goes to the log, shown with ``flashcl -v``.

Exit codes:
  0    success
  1    a check failed: a benchmark's error above tolerance, no tuning configuration both
       built and passed the correctness check, or ``soak`` saw memory keep growing
  2    bad usage: an option click rejects, a malformed --shape or --params, a problem the API
       rejects (head dims, H_q not a multiple of H_kv), or an option the chosen backend cannot take
  3    no usable device: nothing matches --device, no OpenCL platform, no CUDA GPU for
       --backend triton, or --require-device given and the device is not attached
  4    a tuning database file is corrupt or unreadable (the message names the file)
  5    an optional dependency is missing (e.g. matplotlib for --plot: pip install 'flashcl[plot]')
  6    the device failed: a kernel did not build or launch (the message names kernel and device)
  130  interrupted (Ctrl-C); ``tune`` keeps what it measured, ``tune --resume`` continues
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import sys
import warnings

import click

from .api import _check_head_dim, check_block_size, check_prefill_problem
from .errors import FlashCLError, TuningDatabaseError
from .tools.tuner import TunerError

(EXIT_CHECK_FAILED, EXIT_USAGE, EXIT_NO_DEVICE, EXIT_DATABASE, EXIT_MISSING_DEP, EXIT_DEVICE_FAILED,
 EXIT_INTERRUPTED) = 1, 2, 3, 4, 5, 6, 130

# One dtype for tune, bench and show-config, so show-config finds what tune stored; half is what
# models are deployed in.
DEFAULT_DTYPE = "float16"

_log = logging.getLogger("flashcl")


def _one_line(text: str) -> str:
    """The first line of a message, and the first line after it that names an error (a build log's)."""
    lines = [ln.strip() for ln in str(text).splitlines() if ln.strip()]
    if len(lines) <= 1:
        return lines[0] if lines else ""
    cause = next((ln for ln in lines[1:] if "error" in ln.lower()), lines[1])
    return f"{lines[0]} {cause}"


def _fail(msg: str, code: int):
    _log.debug("%s", msg)
    click.echo(f"error: {_one_line(msg)}", err=True)
    sys.exit(code)


def _handle(device):
    from .opencl.runtime import get_device

    try:
        return get_device(device)
    except (ValueError, RuntimeError) as exc:
        hint = "" if "flashcl devices" in str(exc) else ". Run `flashcl devices` to see what is attached."
        _fail(f"{exc}{hint}", EXIT_NO_DEVICE)


def _finite(x):
    """``x`` with NaN and infinities as None: JSON has neither (json.dumps would write NaN)."""
    if type(x).__module__ == "numpy" and hasattr(x, "item"):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def _echo_json(obj):
    click.echo(json.dumps(_finite(obj), indent=2, allow_nan=False, default=str))


def _echo_report(conditions: dict, rows: list, **extra):
    """Every command's --json: one schema, {"conditions": {...}, "rows": [...], ...extra}."""
    _echo_json({"conditions": conditions, "rows": rows, **extra})


def _run_conditions(command: str | None = None, **extra) -> dict:
    """What every report's conditions say about the run: flashcl, date, host, command."""
    import datetime
    import platform

    from ._version import __version__

    return {"flashcl": __version__, "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "host": platform.node(), "command": command or "flashcl " + " ".join(sys.argv[1:]), **extra}


class _StderrLog(logging.Handler):
    def emit(self, record):
        click.echo(f"log: {self.format(record)}", err=True)


_stderr_log = _StderrLog()


@contextlib.contextmanager
def _compiler_output_to_log():
    """PyOpenCL warns (CompilerWarning) whenever a build log is not empty, PoCL's notes included;
    a failed build raises instead. Printed, they would land between the rows of a table. Other
    warnings are one line on stderr, as errors are (not Python's file, line and source)."""
    with warnings.catch_warnings():
        def showwarning(message, category, filename, lineno, file=None, line=None):
            if category.__name__ == "CompilerWarning":
                _log.info("compiler output: %s", message)
            else:
                _log.debug("%s at %s:%s", category.__name__, filename, lineno)
                click.echo(f"warning: {_one_line(message)}", err=True)

        warnings.showwarning = showwarning
        yield


_NO_ARGS_IS_HELP = getattr(click.exceptions, "NoArgsIsHelpError", ())  # click >= 8.2


class _Main(click.Group):
    """click's group, with every error one line on stderr and the exit code of its kind."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        rv = 0
        with _compiler_output_to_log():
            try:
                rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
            except _NO_ARGS_IS_HELP as exc:  # a bare group: its help, as click prints it
                exc.show()
                sys.exit(exc.exit_code)
            except click.UsageError as exc:
                hint = f"; see '{exc.ctx.command_path} --help'" if exc.ctx else ""
                _fail(exc.format_message().rstrip(".") + hint, EXIT_USAGE)
            except click.ClickException as exc:
                exc.show()
                sys.exit(exc.exit_code)
            except click.Abort:  # Ctrl-C outside a sweep (click turns KeyboardInterrupt into Abort)
                _fail("interrupted", EXIT_INTERRUPTED)
            except TuningDatabaseError as exc:
                _fail(str(exc), EXIT_DATABASE)
            except TunerError as exc:
                _fail(str(exc), EXIT_NO_DEVICE)
            except FlashCLError as exc:
                _fail(str(exc), EXIT_DEVICE_FAILED)
            except ValueError as exc:  # the API's checks of what the options asked for
                _fail(str(exc), EXIT_USAGE)
            except MemoryError as exc:  # a --shape whose inputs the host cannot hold
                _fail(f"out of host memory for the inputs of the shapes asked for ({exc or 'MemoryError'}); "
                      "ask for smaller --shape values", EXIT_USAGE)
            finally:
                _log.removeHandler(_stderr_log)
                _log.setLevel(logging.NOTSET)
        sys.exit(rv if isinstance(rv, int) else 0)


@click.group(cls=_Main, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="flashcl")
@click.option("-v", "--verbose", is_flag=True, help="Log details (compiler output, full error messages) to stderr.")
def main(verbose):
    """Exact flash-attention kernels for OpenCL GPUs and CUDA: devices, benchmarks, tuning."""
    if verbose:
        _log.addHandler(_stderr_log)
        _log.setLevel(logging.DEBUG)


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--all", "include_oclgrind", is_flag=True, help="Also list Oclgrind (a simulator).")
def devices(as_json, include_oclgrind):
    """List OpenCL platforms and devices with the limits the kernels care about."""
    from .opencl.runtime import list_devices

    try:
        rows = list_devices(include_oclgrind=include_oclgrind)
    except RuntimeError as exc:
        _fail(str(exc), EXIT_NO_DEVICE)
    if as_json:
        _echo_report(_run_conditions(), rows)
    if not rows:
        _fail("no OpenCL device found; install one, e.g. pip install 'flashcl[pocl]'", EXIT_NO_DEVICE)
    if as_json:
        return
    click.echo(f"{'id':5} {'platform':28} {'device':44} {'type':5} {'CUs':>4} {'local KiB':>9} "
               f"{'max WG':>6} {'fp16':5} {'profile':10} builds")
    for r in rows:
        kind = next((t for t in ("GPU", "CPU", "ACCELERATOR") if t in r["type"]), r["type"])  # PoCL: "ALL | CPU"
        click.echo(f"{r['id']:5} {r['platform'][:28]:28} {r['device'][:44]:44} {kind[:5]:5} "
                   f"{r['compute_units']:4d} {r['local_mem_kib']:9d} {r['max_work_group']:6d} "
                   f"{str(r['fp16']):5} {r['profile']:10} {r['builds']}")
    if not all(r["compiles"] for r in rows):
        click.echo("builds NO: the device's OpenCL compiler fails on flashcl's kernels (each variant is built "
                   "and run once per device and driver in a subprocess); selection by name or profile skips it "
                   "where another device matches. PoCL 3.0 from PyPI on a CPU its LLVM 14 does not know: "
                   "install a newer PoCL, e.g. apt-get install pocl-opencl-icd")
    if any(r["compiles"] and r["builds"] != "yes" for r in rows):
        click.echo("builds 'yes, not X': variant X failed or crashed the compiler; the defaults avoid it")


@main.group()
def bench():
    """Throughput benchmarks (commands, not tests)."""


_CAUSAL = {"1": True, "t": True, "true": True, "causal": True,
           "0": False, "f": False, "false": False, "non-causal": False, "noncausal": False}


def _ints(text: str, parts, expected: str) -> list[int]:
    try:
        return [int(x) for x in parts]
    except ValueError:
        raise click.BadParameter(f"{text!r}: expected {expected}") from None


def _parse_shape(text: str):
    """B,H_q,H_kv,N,d,causal, checked as flashcl.prefill checks its inputs."""
    expected = "B,H_q,H_kv,N,d,causal: five integers and 1/0 (e.g. 1,32,8,2048,128,1)"
    parts = [x.strip() for x in text.split(",")]
    if len(parts) != 6 or parts[5].lower() not in _CAUSAL:
        raise click.BadParameter(f"{text!r}: expected {expected}")
    b, hq, hkv, n, d = _ints(text, parts[:5], expected)
    try:
        check_prefill_problem(b, hq, hkv, n, n, d, d)
    except ValueError as exc:
        raise click.BadParameter(f"{text!r}: {exc}") from None
    return (b, hq, hkv, n, d, _CAUSAL[parts[5].lower()])


def _shapes_option(ctx, param, value):
    if value is None:
        return None
    return tuple(_parse_shape(v) for v in value) if isinstance(value, tuple) else _parse_shape(value)


def _params_option(ctx, param, value):
    if value is None:
        return None
    try:
        params = json.loads(value)
    except json.JSONDecodeError as exc:
        raise click.BadParameter(f"{value!r} is not JSON ({exc})") from None
    if not isinstance(params, dict):
        raise click.BadParameter(f"{value!r}: expected a JSON object, e.g. "
                                 '\'{"BLOCK_M":64,"BLOCK_N":32,"DV_TILE":64,"VEC":4}\'')
    return params


def _window_option(ctx, param, value):
    if value is None:
        return None
    expected = "LEFT,RIGHT: two ints >= -1 (e.g. 1023,0 for a 1024-token sliding window)"
    parts = value.split(",")
    if len(parts) != 2:
        raise click.BadParameter(f"{value!r}: expected {expected}")
    left, right = _ints(value, parts, expected)
    if min(left, right) < -1:
        raise click.BadParameter(f"{value!r}: expected {expected}")
    return (left, right)


def _variant_kwargs(window, softcap, mask=None, sinks=False, alibi=False) -> dict:
    """The benchmark tools' ``variants`` keyword: each row is timed with these variants on and,
    in the same run, without them (the plain kernel next to the variant). ``sinks`` / ``alibi``:
    drawn by the tool (True)."""
    from .api import _check_softcap, _check_window

    try:  # the API's checks: a window held at 2^30, a softcap finite and within the kernels' range
        window, softcap = _check_window(window), _check_softcap(softcap)
    except ValueError as exc:
        _fail(f"--{str(exc)}", EXIT_USAGE)
    variants = {k: v for k, v in (("window", window), ("softcap", softcap), ("mask", mask),
                                  ("sinks", sinks or None), ("alibi_slopes", alibi or None)) if v is not None}
    return {"variants": variants} if variants else {}


def _check_errors(dtype: str, measured) -> None:
    """Exit 1 where an error against the oracle, ``measured`` = [(what, rel_err)], is past the
    dtype's tolerance or not a number (a NaN output is never within it)."""
    from .reference import TOLERANCE

    tol = TOLERANCE[dtype]
    bad = [(what, err) for what, err in measured if not err <= tol]
    if bad:
        _fail(f"{len(bad)} shape(s) exceed the {dtype} tolerance {tol:g}: " +
              ", ".join(f"{what} err {err:.2e}" for what, err in bad), EXIT_CHECK_FAILED)


def _quantized_kv_format(kv_format, dtype: str):
    """--kv-format as the tools take it: None for the plain cache, which float16 names where
    --dtype is float16 (elsewhere it would be timed as nothing: exit 2)."""
    if kv_format == "float16" and dtype != "float16":
        _fail(f"--kv-format float16 is the plain cache of --dtype float16, not of --dtype {dtype}", EXIT_USAGE)
    return None if kv_format == "float16" else kv_format


def _check_bench_kv_format(kv_format: str, backend: str, kernel: str, head_dims) -> None:
    """Exit 2 where the backend's ``kernel`` does not take ``kv_format`` or a head dim is not whole
    ggml blocks (before any build)."""
    from .api import QUANTIZED_KV_FORMATS
    from .quant import BLOCK_BYTES, QK

    takes = QUANTIZED_KV_FORMATS[(backend, kernel)]
    if kv_format not in takes:
        hint = " (a torch-only format: use --backend triton)" if kv_format == "fp8_e4m3" else ""
        _fail(f"--kv-format {kv_format}: the {backend} {kernel} kernels take {', '.join(takes)}{hint}", EXIT_USAGE)
    odd = sorted(d for d in head_dims if kv_format in BLOCK_BYTES and d % QK)
    if odd:
        _fail(f"--kv-format {kv_format}: head dim {odd[0]} is not a multiple of {QK} (whole ggml blocks)",
              EXIT_USAGE)


def _triton_bench(name: str):
    """The Triton tool module of ``name`` ("prefill", "decode", "soak"), or exit 5 (torch or
    triton missing) or 3 (no CUDA GPU)."""
    try:
        import torch
    except ImportError as exc:
        _fail(f"--backend triton needs torch and triton ({exc}); pip install 'flashcl[cuda]'", EXIT_MISSING_DEP)
    if not torch.cuda.is_available():
        _fail("--backend triton needs a CUDA GPU and torch finds none; use --backend opencl", EXIT_NO_DEVICE)
    try:
        from .tools import triton_bench_decode, triton_bench_prefill, triton_soak
    except ImportError as exc:
        _fail(f"--backend triton needs torch and triton ({exc}); pip install 'flashcl[cuda]'", EXIT_MISSING_DEP)
    return {"prefill": triton_bench_prefill, "decode": triton_bench_decode, "soak": triton_soak}[name]


def _triton_conditions(command: str) -> dict:
    """The run's conditions, with the keys of ``bench.conditions`` (the OpenCL runs')."""
    import torch

    return _run_conditions(command, backend="triton", device=torch.cuda.get_device_name(), platform="CUDA",
                           driver=torch.version.cuda, profile=None, is_cpu=False)


@bench.command("prefill")
@click.option("--device", default=None, help="Device: substring, profile name or P:D (default: first GPU).")
@click.option("--backend", type=click.Choice(["opencl", "triton"]), default="opencl", show_default=True)
@click.option("--preset", type=click.Choice(["auto", "reference", "target", "cpu"]), default="auto",
              show_default=True, help="Shape set; auto = 'cpu' on CPU devices, else 'reference'.")
@click.option("--shape", "shapes", multiple=True, callback=_shapes_option,
              help="B,H_q,H_kv,N,d,causal (repeatable; overrides --preset).")
@click.option("--dtype", type=click.Choice(["float16", "float32", "bfloat16"]), default=DEFAULT_DTYPE,
              show_default=True)
@click.option("--repeats", default=10, show_default=True, type=click.IntRange(1),
              help="Timed runs per shape (median reported).")
@click.option("--params", "params", default=None, callback=_params_option,
              help='Tile override as JSON, a whole tile (flashcl show-config lists its parameters), '
                   'e.g. \'{"BLOCK_M":64,"BLOCK_N":32,"DV_TILE":64}\'; not merged with the tuned one.')
@click.option("--no-check", is_flag=True, help="Skip the error check against the float64 oracle.")
@click.option("--rounds", default=3, show_default=True, type=click.IntRange(1),
              help="Triton: interleaved rounds, each timing every implementation once.")
@click.option("--window", default=None, callback=_window_option,
              help="Sliding window LEFT,RIGHT (e.g. 1023,0), timed next to the same call without it.")
@click.option("--softcap", default=None, type=float, help="Logit softcap, timed next to the call without it.")
@click.option("--kv-format", "kv_format", default=None,
              type=click.Choice(["float16", "q8_0", "q4_0", "int8", "fp8_e4m3"]),
              help="Quantized K/V format, timed next to the plain call (bytes counted as stored).")
@click.option("--mask", default=None, type=click.Choice(["causal", "padding"]),
              help="A bool mask, timed next to the plain call: 'causal' (the causal rule as a mask with "
                   "causal off, against causal=True; causal shapes only) or, Triton only, 'padding' (a "
                   "left-padded batch).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def bench_prefill(device, backend, preset, shapes, dtype, repeats, params, no_check, rounds, window, softcap,
                  kv_format, mask, as_json):
    """Prefill throughput (GFLOP/s; causal counts half) and error vs the float64 oracle."""
    command = "flashcl " + " ".join(sys.argv[1:])
    if mask == "padding" and backend != "triton":
        _fail("--mask padding: the padded-batch benchmark runs with --backend triton", EXIT_USAGE)
    if mask == "causal" and not all(s[5] for s in shapes):
        _fail("--mask causal: it stands in for causal=True, so every --shape must be causal (last field 1)",
              EXIT_USAGE)
    extra = _variant_kwargs(window, softcap, mask)
    kv_format = _quantized_kv_format(kv_format, dtype)
    if kv_format is not None:
        if extra:
            _fail("--kv-format: time it without --window/--softcap/--mask (the quantized call is the plain one)",
                  EXIT_USAGE)
        extra["kv_format"] = kv_format
        _check_bench_kv_format(kv_format, backend, "prefill", {s[4] for s in shapes})
    if backend == "triton":
        tb = _triton_bench("prefill")
        rows = tb.run(shapes=list(shapes) or None, dtype=dtype, rounds=rounds, **extra)
        if as_json:
            _echo_report(_triton_conditions(command), rows)
        else:
            click.echo(tb.format_table(rows))
        return
    from .tools import bench_prefill as b

    handle = _handle(device)
    if shapes:
        shape_list = list(shapes)
    else:
        shape_list = b.PREFILL_PRESETS["cpu" if preset == "auto" and handle.is_cpu else
                                       "reference" if preset == "auto" else preset]
        if mask == "causal":  # the causal rule as a mask stands in for causal=True: the causal shapes
            shape_list = [s for s in shape_list if s[5]]
    cond = b.conditions(handle, command)
    if not as_json:
        click.echo(f"# {len(shape_list)} shapes on {handle.describe()}", err=True)
    rows = b.bench_prefill(handle, shape_list, dtype=dtype, repeats=repeats, params=params,
                           check=not no_check, **extra,
                           progress=None if as_json else lambda r: click.echo(
                               f"#   {r.shape} causal={r.causal}: {r.gflops:.1f} GFLOP/s", err=True))
    if as_json:
        _echo_report(cond, b.rows_as_dicts(rows))
    else:
        click.echo(b.format_prefill(rows, cond))
    if not no_check:
        _check_errors(dtype, [(f"{r.shape} {r.variants}".strip(), r.rel_err) for r in rows] +
                      [(f"{r.shape} {r.kv_format}", r.quant_rel_err) for r in rows if r.kv_format])


# --------------------------------------------------------------------------- bench decode

def _decode_shapes_option(ctx, param, value):
    expected = "B,H_q,H_kv,ctx: four integers (e.g. 8,32,8,2048)"
    out = []
    for text in value:
        parts = text.split(",")
        if len(parts) != 4:
            raise click.BadParameter(f"{text!r}: expected {expected}")
        out.append(tuple(_ints(text, parts, expected)))
    return tuple(out)


def _split_counts(text):
    """--splits: None (the default powers of two), [] for 'none', else the counts."""
    if text is None:
        return None
    if text.strip().lower() == "none":
        return []
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"{text!r}: expected split counts like 1,2,4 or 'none'",
                                 param_hint=["--splits"]) from None
    if any(c < 1 for c in counts):
        raise click.BadParameter(f"{text!r}: split counts are >= 1", param_hint=["--splits"])
    return counts


def _knob_option(ctx, param, values) -> dict:
    """--knob KEY=VALUE ...: the decode plan's knobs by name, each value an integer, true, false or
    none (which knob takes which: decode_plan.check_knobs, called before the run)."""
    words = {"true": True, "false": False, "none": None}
    knobs = {}
    for text in values:
        key, sep, value = text.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{text!r}: expected KEY=VALUE", param_hint=["--knob"])
        if value.lower() in words:
            knobs[key] = words[value.lower()]
        else:
            try:
                knobs[key] = int(value)
            except ValueError:
                raise click.BadParameter(f"{text!r}: the value is an integer, true, false or none",
                                         param_hint=["--knob"]) from None
    return knobs


@bench.command("decode")
@click.option("--device", default=None, help="Device: substring, profile name or P:D (default: first GPU).")
@click.option("--backend", type=click.Choice(["opencl", "triton"]), default="opencl", show_default=True)
@click.option("--preset", default="auto", show_default=True,
              help="Shape set (reference, target, cpu); auto = 'cpu' on CPU devices, else 'reference'.")
@click.option("--shape", "shapes", multiple=True, callback=_decode_shapes_option,
              help="B,H_q,H_kv,ctx (repeatable; overrides --preset).")
@click.option("--dtype", type=click.Choice(["float16", "float32", "bfloat16"]), default=DEFAULT_DTYPE,
              show_default=True)
@click.option("--head-dim", default=128, show_default=True, help="Head dim of q, K and V (a multiple of 8, 8..256).")
@click.option("--block-size", default=16, show_default=True, help="Paged-KV block size (a power of two, 1..256).")
@click.option("--block-order", type=click.Choice(["random", "sequential", "ascending"]), default="random",
              show_default=True,
              help="Block table order: random (a cache after some serving), sequential (allocation order: a "
                   "fresh cache) or ascending (random blocks, each sequence's in address order).")
@click.option("--repeats", default=10, show_default=True, type=click.IntRange(1),
              help="Timed runs per shape (median reported).")
@click.option("--rounds", default=3, show_default=True, type=click.IntRange(1),
              help="Interleaved rounds: Triton, each timing every variant once; OpenCL, the plain and "
                   "the --kv-format cache in turns.")
@click.option("--splits", "splits", default=None,
              help="Triton: forced split counts to compare, comma-separated (default: powers of two; "
                   "'none': no comparison).")
@click.option("--sweep-tiles", is_flag=True, help="Triton: time every tile configuration instead.")
@click.option("--window", default=None, callback=_window_option,
              help="Sliding window LEFT,RIGHT (e.g. 1023,0), timed next to the same call without it.")
@click.option("--softcap", default=None, type=float, help="Logit softcap, timed next to the call without it.")
@click.option("--sinks", is_flag=True, help="Learned sinks (drawn ~ N(0, 1) per query head), timed the same way.")
@click.option("--alibi", is_flag=True,
              help="ALiBi slopes (2^(-8 (h + 1) / H_q) for query head h), timed the same way.")
@click.option("--kv-format", "kv_format", default=None,
              type=click.Choice(["float16", "q8_0", "q4_0", "int8", "fp8_e4m3"]),
              help="Quantized KV cache format, timed next to the plain cache of --dtype (bytes counted as "
                   "stored); with variants, also timed with them on; Triton: contiguous caches too, against "
                   "the contiguous plain call.")
@click.option("--kernel", type=click.Choice(["auto", "decode.cl", "decode_cpu.cl"]), default="auto",
              show_default=True,
              help="OpenCL: auto (decode_mma.cl on NVIDIA sm_80+ with float16 or unquantized bfloat16, "
                   "decode_cpu.cl on CPUs, else decode.cl), decode.cl everywhere (the kernel Adreno and GPU "
                   "float32 calls run) or decode_cpu.cl everywhere.")
@click.option("--knob", "knobs", multiple=True, callback=_knob_option,
              help="Triton: a launch knob every flashcl call of the run takes, the float16 baseline included, "
                   "KEY=VALUE (repeatable; values are integers, true, false or none), e.g. "
                   "gqa_programs_per_sm=3.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def bench_decode(device, backend, preset, shapes, dtype, head_dim, block_size, block_order, repeats, rounds,
                 splits, sweep_tiles, window, softcap, sinks, alibi, kv_format, kernel, knobs, as_json):
    """Decode throughput (TB/s and % of the copy bandwidth measured in the same run)."""
    command = "flashcl " + " ".join(sys.argv[1:])
    try:
        _check_head_dim("--head-dim", head_dim)
    except ValueError as exc:
        _fail(str(exc), EXIT_USAGE)
    try:
        check_block_size("--block-size", block_size)
    except ValueError as exc:
        _fail(str(exc), EXIT_USAGE)
    for b_, h_q, h_kv, ctx in shapes:
        try:  # one query row: decode takes the sizes prefill does
            check_prefill_problem(b_, h_q, h_kv, 1, ctx, head_dim, head_dim)
        except ValueError as exc:
            raise click.BadParameter(f"'{b_},{h_q},{h_kv},{ctx}': {exc}", param_hint=["--shape"]) from None
    shape_list = list(shapes) or None
    extra = _variant_kwargs(window, softcap, sinks=sinks, alibi=alibi)
    kv_format = _quantized_kv_format(kv_format, dtype)
    if kv_format is not None:
        extra["kv_format"] = kv_format
        _check_bench_kv_format(kv_format, backend, "decode", {head_dim})
    if backend == "triton" and kernel != "auto":
        _fail("--kernel picks an OpenCL decode kernel (--backend opencl)", EXIT_USAGE)
    if backend == "triton" and knobs:
        from .triton import decode_plan

        try:
            decode_plan.check_knobs(knobs)
        except (KeyError, ValueError) as exc:
            _fail(f"--knob: {exc.args[0]}", EXIT_USAGE)
        if sweep_tiles:
            _fail("--knob and --sweep-tiles: the sweep sets the tile itself; give one or the other", EXIT_USAGE)
    if backend == "triton":
        tb = _triton_bench("decode")
        if shape_list is None and preset not in ("auto", "reference"):
            _fail(f"--preset {preset}: the Triton benchmark has only the reference shapes; use --shape", EXIT_USAGE)
        if sweep_tiles:
            rows = tb.sweep_tiles(shapes=shape_list, dtype=dtype, block_size=block_size, head_dim=head_dim,
                                  kv_format=extra.get("kv_format"), splits=_split_counts(splits) or None)
            if as_json:
                _echo_report(_triton_conditions(command), rows)
            else:
                for r in rows:
                    click.echo(f"{r['shape']:>22} BLOCK_N={r['BLOCK_N']:<3} warps={r['num_warps']} "
                               f"stages={r['num_stages']} splits={r['splits']:<3} {r['kv_format']} {r['median_ms']:.4f} ms "
                               f"{r['TB_s']:.2f} TB/s")
            return
        forced = _split_counts(splits)
        rows = tb.run(shapes=shape_list, dtype=dtype, block_size=block_size, block_order=block_order,
                      head_dim=head_dim, rounds=rounds, splits=forced, knobs=knobs, **extra,
                      on_row=lambda r: click.echo(f"done {r['shape']}: {r['TB_s']:.2f} TB/s", err=True))
        if as_json:
            _echo_report(_triton_conditions(command), rows)
        else:
            click.echo(tb.format_table(rows, command))
        return
    if splits is not None or sweep_tiles or knobs:
        _fail("--splits, --sweep-tiles and --knob are options of --backend triton", EXIT_USAGE)
    from .tools import bench_prefill as b
    from .tools import bench_decode as bd

    handle = _handle(device)
    if shape_list is None:
        name = ("cpu" if handle.is_cpu else "reference") if preset == "auto" else preset
        if name not in bd.DECODE_PRESETS:
            _fail(f"--preset {preset}: unknown; choose one of {', '.join(sorted(bd.DECODE_PRESETS))} or give "
                  f"--shape", EXIT_USAGE)
        shape_list = bd.DECODE_PRESETS[name]
    cond = b.conditions(handle, command)
    if not as_json:
        click.echo(f"# {len(shape_list)} decode shapes on {handle.describe()}", err=True)
    rows = bd.bench_decode(handle, shape_list, dtype=dtype, block_size=block_size, repeats=repeats,
                           block_order=block_order, head_dim=head_dim,
                           tensor_cores=False if kernel != "auto" else None,
                           layout={"decode.cl": "lanes", "decode_cpu.cl": "rows"}.get(kernel), rounds=rounds,
                           **extra)
    if as_json:
        _echo_report(cond, b.rows_as_dicts(rows))
    else:
        click.echo(bd.format_decode(rows, cond))
    _check_errors(dtype, [(r.shape, r.rel_err) for r in rows] +
                  [(f"{r.shape} {r.variants}", r.var_rel_err) for r in rows if r.variants] +
                  [(f"{r.shape} {r.kv_format}", r.quant_rel_err) for r in rows if r.kv_format] +
                  [(f"{r.shape} {r.kv_format} {r.variants}", r.quant_var_rel_err)
                   for r in rows if r.kv_format and r.variants])


# --------------------------------------------------------------------------- tune

KERNELS = ("prefill", "decode")


def _parse_overrides(items, kernel: str = "prefill") -> dict:
    from . import tuning

    names = sorted(tuning.tunable_names(kernel))
    example = "--param BLOCK_M=32,64 or --param VARIANT=tiles" if kernel == "prefill" else \
        "--param ROWS=4,8 or --param SPLIT_WAVES=2,4"
    out = {}
    for item in items:
        name, _, values = item.partition("=")
        name = name.strip().upper()
        if name not in names or not values:
            raise click.BadParameter(f"{item!r}: expected NAME=v1,v2,... with NAME one of {', '.join(names)} "
                                     f"(e.g. {example})", param_hint="--param")
        vals = [v.strip() for v in values.split(",") if v.strip()]
        if name == "VARIANT":
            out[name] = vals
            continue
        try:
            out[name] = [int(v) for v in vals]
        except ValueError:
            raise click.BadParameter(f"{item!r}: values must be integers", param_hint="--param") from None
        if name.startswith("SPLIT_") and min(out[name]) < 1:  # the split rule's waves and keys a split
            raise click.BadParameter(f"{item!r}: values must be >= 1", param_hint="--param")
    return out


def _parse_tune_shape(text: str, kernel: str):
    """The tuning problem of ``kernel``: prefill B,H_q,H_kv,N,d,causal; decode B,H_q,H_kv,ctx,d;
    checked as the API checks its inputs."""
    if kernel == "prefill":
        return _parse_shape(text)
    expected = "B,H_q,H_kv,ctx,d: five integers (e.g. 8,32,8,2048,128)"
    parts = [x.strip() for x in text.split(",")]
    if len(parts) != 5:
        raise click.BadParameter(f"{text!r}: expected {expected}", param_hint="--shape")
    b, hq, hkv, ctx, d = _ints(text, parts, expected)
    try:
        check_prefill_problem(b, hq, hkv, 1, ctx, d, d)
    except ValueError as exc:
        raise click.BadParameter(f"{text!r}: {exc}", param_hint="--shape") from None
    return (b, hq, hkv, ctx, d)


@main.command()
@click.option("--device", default=None,
              help="Device to tune: substring, P:D, or a profile name (adreno, adreno-6xx, adreno-8xx, mali, "
                   "apple, intel, nvidia, cpu). A profile with no such device attached tunes in model mode.")
@click.option("--kernel", type=click.Choice(KERNELS), default="prefill", show_default=True)
@click.option("--shape", default=None,
              help="Tuning problem. prefill: B,H_q,H_kv,N,d,causal (default 1,32,8,2048,128,1 on GPUs; "
                   "1,8,2,512,128,1 on CPUs; --quick on CPUs: 1,4,2,256,64,1). decode: B,H_q,H_kv,ctx,d "
                   "(default 8,32,8,2048,128 on GPUs; 2,8,2,1024,64 on CPUs; --quick on CPUs: 1,4,2,512,64).")
@click.option("--dtype", type=click.Choice(["float32", "float16"]), default=DEFAULT_DTYPE, show_default=True)
@click.option("--quick", is_flag=True, help="A small candidate list (the tuning space's 'quick' values, and "
                                             "the largest tile predicted not to spill where none of them is).")
@click.option("--param", "params", multiple=True, metavar="NAME=v1,v2",
              help="Restrict a parameter's candidates, e.g. --param BLOCK_M=32,64 (repeatable).")
@click.option("--repeats", default=7, show_default=True, type=click.IntRange(1),
              help="Timed runs per configuration (at least 5 are made).")
@click.option("--retime", default=3, show_default=True, type=click.IntRange(0),
              help="Re-time the fastest N, interleaved with each other (0 or 1: no re-timing).")
@click.option("--timeout", default=120.0, show_default=True, type=click.FloatRange(0, min_open=True),
              help="Seconds one configuration may take (build, check, timing) before it counts as hung.")
@click.option("--no-isolate", is_flag=True, help="Run configurations in this process (faster; a driver "
                                                  "crash then ends the sweep).")
@click.option("--require-device", is_flag=True, help="Fail (exit 3) instead of model mode when the device "
                                                      "is not attached.")
@click.option("--resume", is_flag=True, help="Continue an interrupted sweep of the same problem.")
@click.option("--output", type=click.Path(dir_okay=False), default=None,
              help="Database file to write (default: <user tuning dir>/<device>.json).")
@click.option("--no-save", is_flag=True, help="Sweep and report, write nothing.")
@click.option("--plot", "plot_file", type=click.Path(dir_okay=False), default=None,
              help="Draw the sweep to this PNG (needs matplotlib: pip install 'flashcl[plot]').")
@click.option("--extra-option", "extra_options", multiple=True,
              help="Extra OpenCL build option (repeatable), e.g. -cl-nv-maxrregcount=192.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def tune(device, kernel, shape, dtype, quick, params, repeats, retime, timeout, no_isolate, require_device,
         resume, output, no_save, plot_file, extra_options, as_json):
    """Sweep a kernel's tiles, detect spills, verify, time, and store the winner."""
    from .tools import tuner

    command = "flashcl " + " ".join(sys.argv[1:])
    shape = _parse_tune_shape(shape, kernel) if shape else None
    if plot_file:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            _fail("--plot needs matplotlib; pip install 'flashcl[plot]' (or drop --plot)", EXIT_MISSING_DEP)
        folder = os.path.dirname(os.path.abspath(plot_file))
        if not os.access(folder, os.W_OK):  # found before the sweep, not after it
            _fail(f"--plot {plot_file}: cannot write into {folder}", EXIT_USAGE)
    overrides = _parse_overrides(params, kernel)
    target = tuner.resolve_target(device, require_device=require_device)
    # first line of output: what is measured, or that the profile's model stands in
    click.echo(("# " if not as_json else "") + target.describe(), err=as_json)
    problem = shape or tuner.default_problem(kernel, target, quick)
    configs, pruned = tuner.plan(target, problem, kernel=kernel, dtype=dtype, quick=quick, overrides=overrides)
    if not configs:
        _fail(f"no configuration satisfies the constraints ({len(pruned)} pruned: "
              + "; ".join(m for _, v in pruned[:3] for _, m in v[:1]) + "); widen --param", EXIT_USAGE)
    if not as_json:
        click.echo(f"# {len(configs)} configurations of {kernel} for {tuner._shape_text(problem, kernel)} {dtype}"
                   + (f" ({len(pruned)} pruned by constraints)" if pruned else ""), err=True)

    bar_ctx = {}

    def on_start(n_todo, n_done):
        if n_done:
            click.echo(f"# resuming: {n_done} configurations already measured", err=True)
        bar_ctx["bar"] = click.progressbar(length=n_todo, label="tuning", file=sys.stderr, show_eta=True,
                                           item_show_func=lambda r: r and f"{r.label} {r.status}")
        bar_ctx["bar"].__enter__()

    def on_result(r):
        bar_ctx["bar"].update(1, r)

    try:
        report = tuner.run_sweep(target, problem, dtype, kernel=kernel, quick=quick, overrides=overrides,
                                 repeats=repeats, retime_top=retime, isolate=not no_isolate, timeout=timeout,
                                 resume=resume, extra_options=extra_options, on_start=on_start,
                                 on_result=on_result, command=command, write_resume=not no_save,
                                 keep_resume=True)
    finally:
        if "bar" in bar_ctx:
            bar_ctx["bar"].__exit__(None, None, None)
    if report.interrupted:
        if as_json:
            _echo_json(report.as_dict())
        if no_save or not report.resume_file:
            _fail(f"interrupted after {len(report.results)} configurations (nothing kept: "
                  f"{'--no-save' if no_save else 'no resume file could be written'})", EXIT_INTERRUPTED)
        _fail(f"interrupted; {len(report.results)} configurations kept in {report.resume_file}; "
              f"rerun with --resume to continue", EXIT_INTERRUPTED)
    if report.winner is not None and not no_save:
        kept = ("the measurements are kept: rerun with --resume" if report.resume_file
                else "no resume file could be written either")
        try:
            tuner.save(report, output)
        except TuningDatabaseError as exc:
            if as_json:
                _echo_json(report.as_dict())
            else:
                click.echo(tuner.format_report(report))
            _fail(f"{exc} ({kept})", EXIT_DATABASE)
        except OSError as exc:
            _fail(f"cannot write the tuning database ({exc}); choose another file with --output ({kept})",
                  EXIT_DATABASE)
    tuner.remove_resume_file(report)  # saved, or no winner to save (--no-save: there is none)
    if as_json:
        _echo_json(report.as_dict())
    else:
        click.echo(tuner.format_report(report))
    if plot_file and report.results:
        tuner.plot(report, plot_file)
        if not as_json:
            click.echo(f"# plot: {plot_file}")
    if report.winner is None:
        _fail("no configuration built and passed the correctness check; see the table", EXIT_CHECK_FAILED)


# --------------------------------------------------------------------------- show-config

@main.command("show-config")
@click.option("--device", default=None, help="Device (substring, P:D) or a profile name for an absent device.")
@click.option("--kernel", type=click.Choice(KERNELS), default="prefill", show_default=True)
@click.option("--n", "n", default=2048, show_default=True,
              help="Sequence length: N_q = N_kv (prefill), the context length (decode).")
@click.option("--d", "d", default=128, show_default=True, help="Head dim DK.")
@click.option("--dv", default=None, type=int, help="Value head dim (default: = d).")
@click.option("--causal/--no-causal", default=True, show_default=True, help="Prefill only.")
@click.option("--group", default=4, show_default=True, type=click.IntRange(1),
              help="Decode only: the GQA group H_q / H_kv.")
@click.option("--dtype", type=click.Choice(["float32", "float16"]), default=DEFAULT_DTYPE, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def show_config(device, kernel, n, d, dv, causal, group, dtype, as_json):
    """Which tile parameters a call would use on a device, where they came from, and why they apply."""
    from . import tuning
    from .tools import tuner

    dv = d if dv is None else dv
    try:
        check_prefill_problem(1, group, 1, n, n, d, dv)
    except ValueError as exc:
        raise click.UsageError(f"--n {n} --d {d} --dv {dv}: {exc}") from None
    decode = kernel == "decode"
    causal = causal and not decode
    g = group if decode else None
    target = tuner.resolve_target(device)
    space = tuning.SPACES[kernel]
    dims = tuning.Dims(d, dv, group if decode else 1, dtype)
    driver_warning = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if target.mode == "measured":
            from .opencl.runtime import get_device

            handle = get_device(target.device_spec)
            if decode:
                from .opencl.decode import DecodeProblem, choose_params

                choice = choose_params(handle, DecodeProblem(1, group, 1, d, dv, True, dtype), None, n)
            else:
                from .opencl.prefill import PrefillProblem, choose_params

                choice = choose_params(handle, PrefillProblem(1, 1, 1, n, n, d, dv, causal, dtype))
            driver_warning = tuning.driver_mismatch(choice, handle.driver)
        else:
            limits = {"local_mem": target.local_mem, "max_work_group": target.max_work_group}
            choice = tuning.lookup(kernel, target.key, dtype=dtype, dk=d, dv=dv, causal=causal, n=n, group=g,
                                   validate=lambda p: space.check(p, dims, limits))
            if choice is None:
                choice = tuning.default_choice(target.profile.name, space.default(
                    target.profile, dims, local_mem=target.local_mem, max_work_group=target.max_work_group))
    for w in caught:
        if w.category.__name__ == "CompilerWarning":
            _log.info("compiler output: %s", w.message)
    model = space.spill_model(choice.params, dims, target.profile)
    warned = [str(w.message) for w in caught if w.category.__name__ != "CompilerWarning"]
    if driver_warning:
        warned.append(driver_warning)
    info = {"device": target.name, "mode": "attached" if target.mode == "measured" else "model (not attached)",
            "profile": target.profile.name, "key": {"device": target.key.name, "arch": target.key.arch,
                                                    "family": target.key.family, "profile": target.key.profile,
                                                    "vendor": target.key.vendor},
            "problem": {"kernel": kernel, "dtype": dtype, "dk": d, "dv": dv, "causal": causal, "n": n,
                        "bucket": tuning.seq_bucket(n), **({"group": group} if decode else {})},
            "params": choice.params, "source": choice.source, "why": choice.reason,
            "provenance": (choice.entry or {}).get("provenance"),
            "model": model, "warnings": warned,
            "searched": [str(tuning.user_tuning_dir()), str(tuning.shipped_tuning_dir())]}
    if decode:
        info["split_rule"] = {name: space.value(choice.params, name) for name in ("SPLIT_WAVES", "SPLIT_KEYS")}
        info["split_rule"]["tuned"] = any(name in choice.params for name in ("SPLIT_WAVES", "SPLIT_KEYS"))
    if as_json:
        _echo_report(_run_conditions(), [info])
        return
    for w in info["warnings"]:
        click.echo(f"warning: {w}", err=True)
    click.echo(f"device:  {info['device']} ({info['mode']}, profile {info['profile']}"
               + (f", architecture {tuning.arch_label(target.key.arch)}" if target.key.arch else "") + ")")
    what = (f"G={group}" if decode else ("causal" if causal else "non-causal"))
    click.echo(f"problem: {kernel} {dtype} DK={d} DV={dv} {what} {'ctx' if decode else 'N'}={n} "
               f"(bucket {info['problem']['bucket']})")
    click.echo("params:  " + " ".join(f"{k}={v}" for k, v in choice.params.items()))
    click.echo(f"source:  {choice.source}")
    click.echo(f"why:     {choice.reason}")
    if info["provenance"]:
        pv = info["provenance"]
        click.echo(f"         {pv.get('mode', '?')} on {pv.get('device', '?')}, driver {pv.get('driver', '?')}, "
                   f"flashcl {pv.get('flashcl', '?')}, {pv.get('date', '?')}")
    if decode:
        sr = info["split_rule"]
        click.echo(f"splits:  {sr['SPLIT_WAVES']} work-groups per compute unit, {sr['SPLIT_KEYS']} keys per split "
                   f"({'tuned' if sr['tuned'] else 'defaults of the layout; decode_mma.cl has its own'})")
    click.echo(f"model:   {model['floats']} floats per work-item (hard {model['regs_hard']}, budget "
               f"{model['regs_budget']}): {'spills' if model['spills'] else 'no spill predicted'}"
               f"{', over the occupancy budget' if model['over_budget'] and not model['spills'] else ''}")
    click.echo(f"searched: {info['searched'][0]} (user), then {info['searched'][1]} (shipped)")


# --------------------------------------------------------------------------- export

_EXPORT_SHAPE = ("prefill:B,H_q,H_kv,N,d,causal or decode:B,H_q,H_kv,ctx,d, d the head dim or DK/DV (e.g. "
                 "prefill:1,32,8,2048,128,1 or decode:1,32,8,4096,192/128)")


def _export_shapes_option(ctx, param, value):
    """--shape KERNEL:FIELDS (repeatable) -> {"prefill": [...], "decode": [...]}, checked as the
    API checks its inputs."""
    out = {"prefill": [], "decode": []}
    for text in value:
        kind, sep, rest = text.partition(":")
        kind = kind.strip().lower()
        if not sep or kind not in out:
            raise click.BadParameter(f"{text!r}: expected {_EXPORT_SHAPE}")
        fields = rest.split(",")
        dims = fields[4].split("/") if len(fields) > 4 else []
        dv = None
        if len(dims) == 2:  # DK/DV: parsed with DK, then DV checked as the API checks it
            fields[4] = dims[0]
            dv = _ints(text, [dims[1].strip()], "DV: an integer")[0]
        shape = _parse_shape(",".join(fields)) if kind == "prefill" else _parse_tune_shape(",".join(fields), "decode")
        if dv is not None:
            try:
                check_prefill_problem(shape[0], shape[1], shape[2], 1, 1, shape[4], dv)
            except ValueError as exc:
                raise click.BadParameter(f"{text!r}: {exc}") from None
            shape = shape[:4] + ((shape[4], dv),) + shape[5:]
        out[kind].append(shape)
    return out


# what `flashcl export` compiles in (flashcl.tools.export.VARIANTS and KV_FORMATS: not imported
# here, so that the CLI starts without pyopencl)
_EXPORT_VARIANTS = ("window", "softcap", "sinks", "alibi", "mask", "key_start")
_EXPORT_KV_FORMATS = ("q8_0", "q4_0", "int8")


def _export_variants_option(ctx, param, value):
    """--variants a,b,... (repeatable) -> one tuple of names per combination ("none": the plain
    kernels); an unknown name is a usage error."""
    combos = []
    for text in value:
        names = [x.strip().lower() for x in text.split(",") if x.strip()]
        unknown = [x for x in names if x not in _EXPORT_VARIANTS + ("none",)]
        if unknown:
            raise click.BadParameter(f"unknown {', '.join(map(repr, unknown))}; choose any of "
                                     f"{', '.join(_EXPORT_VARIANTS)} (comma-separated), or none")
        if "none" in names and len(names) > 1:
            raise click.BadParameter(f"{text!r}: none stands alone (the plain kernels)")
        combos.append(tuple(x for x in names if x != "none"))
    return combos


@main.command("export")
@click.option("--device", default=None,
              help="Device: substring, P:D, or a profile name (adreno, adreno-6xx, adreno-8xx, mali, apple, intel, "
                   "nvidia, cpu); a profile with no such device attached exports its modeled tiles (model mode).")
@click.option("--out", "out", required=True, type=click.Path(file_okay=False),
              help="Folder to write: new, empty, or a previous export (whose files are replaced).")
@click.option("--shape", "shapes", multiple=True, callback=_export_shapes_option,
              help=f"{_EXPORT_SHAPE} (repeatable); a kernel given none gets the reference shapes.")
@click.option("--dtype", type=click.Choice(["float32", "float16", "bfloat16"]), default=DEFAULT_DTYPE,
              show_default=True)
@click.option("--variants", multiple=True, callback=_export_variants_option, metavar="NAMES",
              help=f"A combination of attention variants to export, comma-separated: any of "
                   f"{', '.join(_EXPORT_VARIANTS)} (mask: prefill only, a bool mask; key_start: decode "
                   f"only, each sequence's first key), or none (the plain "
                   f"kernels). Repeatable: each combination gets sources of its own. Default: none.")
@click.option("--kv-format", type=click.Choice(_EXPORT_KV_FORMATS), default=None,
              help="K and V caches quantized in this format (default: plain, the dtype's rows).")
@click.option("--decode-rows", type=int, default=1, show_default=True,
              help="Query rows a decode sequence, causal among themselves (speculative verification): "
                   "q (B, H_q, N_q, DK).")
@click.option("--require-device", is_flag=True, help="Fail (exit 3) instead of model mode when the device "
                                                      "is not attached.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def export_kernels(device, out, shapes, dtype, variants, kv_format, decode_rows, require_device, as_json):
    """Kernel sources with the tuned defines fixed, manifest.json and a C example, for C/C++ apps."""
    from .tools import export as ex

    command = "flashcl " + " ".join(sys.argv[1:])
    try:
        res = ex.export(out, device=device, prefill_shapes=shapes["prefill"] or None,
                        decode_shapes=shapes["decode"] or None, dtype=dtype, command=command,
                        require_device=require_device, variants=variants, kv_format=kv_format,
                        decode_rows=decode_rows)
    except OSError as exc:
        _fail(f"cannot write the export ({exc}); choose another --out", EXIT_USAGE)
    t = res.target
    # first line: what the parameters are (model mode: not measured)
    click.echo(("# " if not as_json else "") + t.describe(), err=as_json)
    rows = [{"file": s.file, "kernels": list(s.entries), "problem": s.problem, "params": s.params,
             "source": s.choice.source, "why": s.choice.reason} for s in res.sources]
    if as_json:
        _echo_report(_run_conditions(command, device=t.name, mode=t.mode, profile=t.profile.name, driver=t.driver,
                                     dtype=dtype), rows, out=str(res.out), files=res.files)
        return
    click.echo(f"wrote {res.out}: {len(rows)} kernel sources, " + ", ".join(res.files[len(rows):]))
    width = max(len(r["file"]) for r in rows)
    for r in rows:
        click.echo(f"  {r['file']:{width}}  " + " ".join(f"{k}={v}" for k, v in r["params"].items())
                   + f"  from: {r['source']}")
    each = " per combination of variants" if len(variants) > 1 else ""
    click.echo(f"check: {res.out}/run_example.sh builds example.c with ${{CC:-cc}} against the OpenCL ICD "
               f"loader, runs one prefill and one paged decode{each} and compares them with a naive reference")


@main.command()
@click.option("--device", default=None, help="OpenCL device (name substring, profile or P:D).")
@click.option("--backend", type=click.Choice(["opencl", "triton"]), default="opencl", show_default=True,
              help="triton: mixed calls on the CUDA GPU (torch allocator and RSS curve).")
@click.option("--calls", default=10000, show_default=True, type=click.IntRange(1), help="Calls to make.")
@click.option("--every", default=250, show_default=True, type=click.IntRange(1),
              help="Sample memory and cache sizes every N calls.")
@click.option("--check-every", default=50, show_default=True, type=click.IntRange(1),
              help="Compare every N-th call against the float64 oracle.")
@click.option("--max-growth", default=0.10, show_default=True, type=click.FloatRange(0),
              help="Fail when the last quarter's mean RSS exceeds the second quarter's by more.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def soak(device, backend, calls, every, check_every, max_growth, as_json):
    """Many mixed prefill/decode calls in one process; fails (exit 1) if memory keeps growing."""
    if backend == "triton":
        ts = _triton_bench("soak")
        res = ts.run(calls, every, check_every, on_sample=None if as_json else (lambda s: click.echo(s)))
        if as_json:
            summary = {k: v for k, v in res.items() if k != "samples"}
            _echo_report(_triton_conditions("flashcl " + " ".join(sys.argv[1:])), res["samples"], **summary)
        else:
            errs = ", ".join(f"{dt} {err:.2e} (bound {ts.TOL[dt]:.1e})"
                             for dt, err in sorted(res["worst_rel_err"].items()))
            click.echo(f"worst relative error of the checked calls: {errs}; allocated CUDA memory "
                       f"{'GREW' if res['allocated_grew'] else 'flat'} after mid-run")
        if not res["ok"]:
            sys.exit(EXIT_CHECK_FAILED)
        return
    from .tools import soak as soak_mod

    handle = _handle(device)
    command = "flashcl " + " ".join(sys.argv[1:])
    if not as_json:
        click.echo(f"# {command}\n# device: {handle.describe()}")
        click.echo(f"{'calls':>7} {'RSS MiB':>8} {'handles':>7} {'programs':>8} {'seconds':>8}")

    def show(s):
        if not as_json:
            click.echo(f"{s.call:7d} {s.rss_kib / 1024:8.1f} {s.handles:7d} {s.programs:8d} {s.seconds:8.1f}")

    try:
        res = soak_mod.run(calls, every=every, device=handle.device, check_every=check_every,
                           max_growth=max_growth, progress=show)
    except AssertionError as exc:
        _fail(str(exc), EXIT_CHECK_FAILED)
    if as_json:
        _echo_report(_run_conditions(command, backend="opencl", device=handle.describe()),
                     [vars(x) for x in res.samples], ok=res.ok, verdict=res.verdict, checked=res.checked,
                     max_err=res.max_err)
    else:
        click.echo(f"checked {res.checked} calls against the oracle, max relative error {res.max_err:.2e}")
        click.echo(res.verdict)
    if not res.ok:
        sys.exit(EXIT_CHECK_FAILED)


if __name__ == "__main__":
    main()
