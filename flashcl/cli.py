"""The ``flashcl`` command: ``devices``, ``bench prefill|decode``, ``tune``, ``show-config``, ``soak``.

Human tables by default, ``--json`` for scripts (progress and notes then go to stderr only).

Exit codes:
  0    success
  1    a check failed: a benchmark's error above tolerance, no tuning configuration both
       built and passed the correctness check, or ``soak`` saw memory keep growing
  2    bad usage (click's own), or an option the chosen backend cannot take
  3    no usable device: nothing matches --device, no OpenCL platform, or --require-device given
       and the device is not attached
  4    a tuning database file is corrupt or unreadable (the message names the file)
  5    an optional dependency is missing (e.g. matplotlib for --plot: pip install 'flashcl[plot]')
  130  interrupted (Ctrl-C); ``tune`` keeps what it measured, ``tune --resume`` continues
"""

from __future__ import annotations

import json
import sys

import click

from .api import _check_head_dim

EXIT_CHECK_FAILED, EXIT_USAGE, EXIT_NO_DEVICE, EXIT_DATABASE, EXIT_MISSING_DEP, EXIT_INTERRUPTED = 1, 2, 3, 4, 5, 130


def _fail(msg: str, code: int):
    click.echo(f"error: {msg}", err=True)
    sys.exit(code)


def _handle(device):
    from .opencl.runtime import get_device

    try:
        return get_device(device)
    except (ValueError, RuntimeError) as exc:
        _fail(f"{exc}. Run `flashcl devices` to see what is attached.", EXIT_NO_DEVICE)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="flashcl")
def main():
    """Exact flash-attention kernels for OpenCL GPUs and CUDA: devices, benchmarks, tuning."""


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
        click.echo(json.dumps(rows, indent=2))
        return
    if not rows:
        _fail("no OpenCL device found; install one, e.g. pip install 'flashcl[pocl]'", EXIT_NO_DEVICE)
    click.echo(f"{'id':5} {'platform':28} {'device':44} {'type':5} {'CUs':>4} {'local KiB':>9} "
               f"{'max WG':>6} {'fp16':5} {'builds':6} profile")
    for r in rows:
        click.echo(f"{r['id']:5} {r['platform'][:28]:28} {r['device'][:44]:44} {r['type'][:5]:5} "
                   f"{r['compute_units']:4d} {r['local_mem_kib']:9d} {r['max_work_group']:6d} "
                   f"{str(r['fp16']):5} {'yes' if r['compiles'] else 'NO':6} {r['profile']}")
    if not all(r["compiles"] for r in rows):
        click.echo("builds NO: the device's OpenCL compiler fails on a one-line kernel; selection by name "
                   "or profile skips it where another device matches (a PoCL 3.0 from PyPI on a CPU its "
                   "LLVM 14 does not know: install a newer PoCL, e.g. apt-get install pocl-opencl-icd)")


@main.group()
def bench():
    """Throughput benchmarks (commands, not tests)."""


def _parse_shape(text: str):
    parts = text.split(",")
    if len(parts) != 6:
        raise click.BadParameter(f"{text!r}: expected B,H_q,H_kv,N,d,causal (e.g. 1,32,8,2048,128,1)")
    b, hq, hkv, n, d = (int(x) for x in parts[:5])
    return (b, hq, hkv, n, d, parts[5].strip().lower() in ("1", "t", "true", "causal"))


@bench.command("prefill")
@click.option("--device", default=None, help="Device: substring, profile name or P:D (default: first GPU).")
@click.option("--backend", type=click.Choice(["opencl", "triton"]), default="opencl", show_default=True)
@click.option("--preset", type=click.Choice(["auto", "reference", "target", "cpu"]), default="auto",
              show_default=True, help="Shape set; auto = 'cpu' on CPU devices, else 'reference'.")
@click.option("--shape", "shapes", multiple=True, help="B,H_q,H_kv,N,d,causal (repeatable; overrides --preset).")
@click.option("--dtype", type=click.Choice(["float16", "float32", "bfloat16"]), default="float16", show_default=True)
@click.option("--repeats", default=10, show_default=True, help="Timed runs per shape (median reported).")
@click.option("--params", "params_json", default=None, help='Tile override as JSON, e.g. \'{"BLOCK_M":64,...}\'.')
@click.option("--no-check", is_flag=True, help="Skip the error check against the float64 oracle.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def bench_prefill(device, backend, preset, shapes, dtype, repeats, params_json, no_check, as_json):
    """Prefill throughput (GFLOP/s; causal counts half) and error vs the float64 oracle."""
    command = "flashcl " + " ".join(sys.argv[1:])
    if backend == "triton":
        from .triton import bench_prefill as tb

        rows = tb.run(shapes=[_parse_shape(s) for s in shapes] or None, dtype=dtype)
        click.echo(json.dumps(rows, indent=2, default=str) if as_json else tb.format_table(rows))
        return
    if dtype == "bfloat16":
        _fail("the OpenCL kernels take float32 or float16 (bfloat16 is Triton-only)", EXIT_USAGE)
    from . import bench as b

    handle = _handle(device)
    params = json.loads(params_json) if params_json else None
    if shapes:
        shape_list = [_parse_shape(s) for s in shapes]
    else:
        shape_list = b.PREFILL_PRESETS["cpu" if preset == "auto" and handle.is_cpu else
                                       "reference" if preset == "auto" else preset]
    cond = b.conditions(handle, command)
    if not as_json:
        click.echo(f"# {len(shape_list)} shapes on {handle.describe()}", err=True)
    rows = b.bench_prefill(handle, shape_list, dtype=dtype, repeats=repeats, params=params,
                           check=not no_check,
                           progress=None if as_json else lambda r: click.echo(
                               f"#   {r.shape} causal={r.causal}: {r.gflops:.1f} GFLOP/s", err=True))
    if as_json:
        click.echo(json.dumps({"conditions": cond, "rows": b.rows_as_dicts(rows)}, indent=2))
    else:
        click.echo(b.format_prefill(rows, cond))
    tol = 2e-3 if dtype == "float16" else 1e-5
    bad = [r for r in rows if r.rel_err == r.rel_err and r.rel_err > tol]
    if bad:
        _fail(f"{len(bad)} shape(s) exceed the {dtype} tolerance {tol:g}: " +
              ", ".join(f"{r.shape} err {r.rel_err:.2e}" for r in bad), EXIT_CHECK_FAILED)


# --------------------------------------------------------------------------- bench decode

# (B, H_q, H_kv, ctx), DESIGN.md §6; used when flashcl.bench_decode has no presets of its own
_DECODE_PRESETS = {
    "reference": [(8, 32, 32, 2048), (8, 32, 32, 8192), (8, 32, 8, 2048), (32, 32, 8, 2048), (4, 64, 8, 2048),
                  (8, 64, 8, 2048), (16, 32, 1, 4096), (1, 32, 8, 32768), (1, 32, 8, 131072)],
    "cpu": [(1, 8, 8, 1024), (2, 8, 2, 2048), (1, 8, 1, 4096)],
}


def _parse_decode_shape(text: str):
    parts = text.split(",")
    if len(parts) != 4:
        raise click.BadParameter(f"{text!r}: expected B,H_q,H_kv,ctx (e.g. 8,32,8,2048)")
    return tuple(int(x) for x in parts)


@bench.command("decode")
@click.option("--device", default=None, help="Device: substring, profile name or P:D (default: first GPU).")
@click.option("--backend", type=click.Choice(["opencl", "triton"]), default="opencl", show_default=True)
@click.option("--preset", default="auto", show_default=True,
              help="Shape set (reference, cpu, ...); auto = 'cpu' on CPU devices, else 'reference'.")
@click.option("--shape", "shapes", multiple=True, help="B,H_q,H_kv,ctx (repeatable; overrides --preset).")
@click.option("--dtype", type=click.Choice(["float16", "float32", "bfloat16"]), default="float16", show_default=True)
@click.option("--head-dim", default=128, show_default=True, help="Head dim of q, K and V (a multiple of 8, 8..256).")
@click.option("--block-size", default=16, show_default=True, help="Paged-KV block size (a power of two, 1..256).")
@click.option("--block-order", type=click.Choice(["random", "sequential", "ascending"]), default="random",
              show_default=True,
              help="Block table order: random (a cache after some serving), sequential (allocation order: a "
                   "fresh cache) or ascending (random blocks, each sequence's in address order).")
@click.option("--repeats", default=10, show_default=True, help="Timed runs per shape (median reported).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def bench_decode(device, backend, preset, shapes, dtype, head_dim, block_size, block_order, repeats, as_json):
    """Decode throughput (TB/s and % of the copy bandwidth measured in the same run)."""
    command = "flashcl " + " ".join(sys.argv[1:])
    try:
        _check_head_dim("--head-dim", head_dim)
    except ValueError as exc:
        _fail(str(exc), EXIT_USAGE)
    if block_size < 1 or block_size > 256 or block_size & (block_size - 1):
        _fail(f"--block-size {block_size}: expected a power of two from 1 to 256", EXIT_USAGE)
    shape_list = [_parse_decode_shape(s) for s in shapes] or None
    if backend == "triton":
        try:
            from .triton import bench_decode as tb
        except ImportError as exc:
            _fail(f"the Triton backend needs torch and triton ({exc}); pip install 'flashcl[cuda]'",
                  EXIT_MISSING_DEP)
        if shape_list is None and preset not in ("auto", "reference"):
            _fail(f"--preset {preset}: the Triton benchmark has only the reference shapes; use --shape", EXIT_USAGE)
        rows = tb.run(shapes=shape_list, dtype=dtype, block_size=block_size, block_order=block_order,
                      head_dim=head_dim)
        click.echo(json.dumps(rows, indent=2, default=str) if as_json else tb.format_table(rows, command))
        return
    if dtype == "bfloat16":
        _fail("the OpenCL kernels take float32 or float16 (bfloat16 is Triton-only)", EXIT_USAGE)
    try:
        from . import bench_decode as bd
    except ImportError as exc:
        _fail(f"the OpenCL decode benchmark is not available in this build ({exc})", EXIT_MISSING_DEP)
    from . import bench as b

    handle = _handle(device)
    if shape_list is None:
        presets = dict(_DECODE_PRESETS, **getattr(bd, "DECODE_PRESETS", {}))
        name = ("cpu" if handle.is_cpu else "reference") if preset == "auto" else preset
        if name not in presets:
            _fail(f"--preset {preset}: unknown; choose one of {', '.join(sorted(presets))} or give --shape",
                  EXIT_USAGE)
        shape_list = presets[name]
    cond = b.conditions(handle, command)
    if not as_json:
        click.echo(f"# {len(shape_list)} decode shapes on {handle.describe()}", err=True)
    rows = bd.bench_decode(handle, shape_list, dtype=dtype, block_size=block_size, repeats=repeats,
                           block_order=block_order, head_dim=head_dim)
    if as_json:
        from dataclasses import asdict, is_dataclass

        click.echo(json.dumps({"conditions": cond, "rows": [asdict(r) if is_dataclass(r) else r for r in rows]},
                              indent=2, default=str))
    else:
        click.echo(bd.format_decode(rows, cond))


# --------------------------------------------------------------------------- tune

def _parse_overrides(items) -> dict:
    from . import tuning

    names = sorted(tuning.tunable_names("prefill"))
    out = {}
    for item in items:
        name, _, values = item.partition("=")
        name = name.strip().upper()
        if name not in names or not values:
            raise click.BadParameter(f"{item!r}: expected NAME=v1,v2,... with NAME one of {', '.join(names)} "
                                     f"(e.g. --param BLOCK_M=32,64 or --param VARIANT=tiles)", param_hint="--param")
        vals = [v.strip() for v in values.split(",") if v.strip()]
        if name == "VARIANT":
            out[name] = vals
            continue
        try:
            out[name] = [int(v) for v in vals]
        except ValueError:
            raise click.BadParameter(f"{item!r}: values must be integers", param_hint="--param") from None
    return out


@main.command()
@click.option("--device", default=None,
              help="Device to tune: substring, P:D, or a profile name (adreno, adreno-6xx, adreno-8xx, mali, "
                   "apple, intel, nvidia, cpu). A profile with no such device attached tunes in model mode.")
@click.option("--kernel", type=click.Choice(["prefill"]), default="prefill", show_default=True)
@click.option("--shape", default=None,
              help="Tuning problem B,H_q,H_kv,N,d,causal (default: 1,32,8,2048,128,1 on GPUs; "
                   "1,8,2,512,128,1 on CPUs; --quick on CPUs: 1,4,2,256,64,1).")
@click.option("--dtype", type=click.Choice(["float32", "float16"]), default="float32", show_default=True)
@click.option("--quick", is_flag=True, help="A small candidate list (the tuning space's 'quick' values).")
@click.option("--param", "params", multiple=True, metavar="NAME=v1,v2",
              help="Restrict a parameter's candidates, e.g. --param BLOCK_M=32,64 (repeatable).")
@click.option("--repeats", default=7, show_default=True, help="Timed runs per configuration (at least 5).")
@click.option("--retime", default=3, show_default=True, help="Re-time the fastest N, interleaved.")
@click.option("--timeout", default=120.0, show_default=True,
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
    """Sweep the kernel's tiles, detect spills, verify, time, and store the winner."""
    from . import tuner, tuning

    command = "flashcl " + " ".join(sys.argv[1:])
    if plot_file:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            _fail("--plot needs matplotlib; pip install 'flashcl[plot]' (or drop --plot)", EXIT_MISSING_DEP)
    overrides = _parse_overrides(params)
    try:
        target = tuner.resolve_target(device, require_device=require_device)
    except tuner.TunerError as exc:
        _fail(str(exc), exc.code)
    # first line of output: what is measured, or that the profile's model stands in
    click.echo(("# " if not as_json else "") + target.describe(), err=as_json)
    if shape:
        problem = _parse_shape(shape)
    elif target.mode == "measured" and target.profile.name == "cpu":
        problem = tuner.CPU_QUICK_PROBLEM if quick else tuner.CPU_PROBLEM
    else:
        problem = tuner.GPU_PROBLEM
    configs, pruned = tuner.plan(target, problem, quick=quick, overrides=overrides)
    if not configs:
        _fail(f"no configuration satisfies the constraints ({len(pruned)} pruned: "
              + "; ".join(m for _, v in pruned[:3] for _, m in v[:1]) + "); widen --param", EXIT_USAGE)
    if not as_json:
        click.echo(f"# {len(configs)} configurations of {kernel} for {tuner._shape_text(problem)} {dtype}"
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
        report = tuner.run_sweep(target, problem, dtype, quick=quick, overrides=overrides, repeats=repeats,
                                 retime_top=retime, isolate=not no_isolate, timeout=timeout, resume=resume,
                                 extra_options=extra_options, on_start=on_start, on_result=on_result,
                                 command=command)
    except tuner.TunerError as exc:
        _fail(str(exc), exc.code)
    finally:
        if "bar" in bar_ctx:
            bar_ctx["bar"].__exit__(None, None, None)
    if report.winner is not None and not no_save and not report.interrupted:
        try:
            tuner.save(report, output)
        except tuning.TuningDatabaseError as exc:
            click.echo(tuner.format_report(report) if not as_json else json.dumps(report.as_dict(), indent=2,
                                                                                   default=str))
            _fail(f"{exc}", EXIT_DATABASE)
        except OSError as exc:
            _fail(f"cannot write the tuning database ({exc}); choose another file with --output", EXIT_DATABASE)
    if as_json:
        click.echo(json.dumps(report.as_dict(), indent=2, default=str))
    else:
        click.echo(tuner.format_report(report))
    if plot_file and report.results:
        tuner.plot(report, plot_file)
        if not as_json:
            click.echo(f"# plot: {plot_file}")
    if report.interrupted:
        _fail(f"interrupted; {len(report.results)} configurations kept in {report.resume_file}; "
              f"rerun with --resume to continue", EXIT_INTERRUPTED)
    if report.winner is None:
        _fail("no configuration built and passed the correctness check; see the table", EXIT_CHECK_FAILED)


# --------------------------------------------------------------------------- show-config

@main.command("show-config")
@click.option("--device", default=None, help="Device (substring, P:D) or a profile name for an absent device.")
@click.option("--kernel", type=click.Choice(["prefill"]), default="prefill", show_default=True)
@click.option("--n", "n", default=2048, show_default=True, help="Sequence length (N_q = N_kv).")
@click.option("--d", "d", default=128, show_default=True, help="Head dim DK.")
@click.option("--dv", default=None, type=int, help="Value head dim (default: = d).")
@click.option("--causal/--no-causal", default=True, show_default=True)
@click.option("--dtype", type=click.Choice(["float32", "float16"]), default="float16", show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def show_config(device, kernel, n, d, dv, causal, dtype, as_json):
    """Which tile parameters a call would use on a device, and where they came from."""
    import warnings

    from . import tuner, tuning

    dv = dv or d
    try:
        target = tuner.resolve_target(device)
    except tuner.TunerError as exc:
        _fail(str(exc), exc.code)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            if target.mode == "measured":
                from .opencl.prefill import PrefillProblem, choose_params
                from .opencl.runtime import get_device

                handle = get_device(target.device_spec)
                choice = choose_params(handle, PrefillProblem(1, 1, 1, n, n, d, dv, causal, dtype))
            else:
                def errors(p):
                    return tuning.check_params(kernel, p, d, dv, local_mem=target.local_mem,
                                               max_work_group=target.max_work_group)

                choice = tuning.lookup(kernel, target.key, dtype=dtype, dk=d, dv=dv, causal=causal, n=n,
                                       validate=errors)
                if choice is None:
                    p = tuning.default_params(kernel, target.profile, d, dv, local_mem=target.local_mem,
                                              max_work_group=target.max_work_group)
                    choice = tuning.Choice(p, f"profile default ({target.profile.name})")
        except tuning.TuningDatabaseError as exc:
            _fail(str(exc), EXIT_DATABASE)
        except ValueError as exc:
            _fail(str(exc), EXIT_USAGE)
    model = tuning.spill_model(kernel, choice.params, d, dv, target.profile)
    info = {"device": target.name, "mode": "attached" if target.mode == "measured" else "model (not attached)",
            "profile": target.profile.name, "key": {"device": target.key.name, "arch": target.key.arch,
                                                    "profile": target.key.profile, "vendor": target.key.vendor},
            "problem": {"kernel": kernel, "dtype": dtype, "dk": d, "dv": dv, "causal": causal, "n": n,
                        "bucket": tuning.seq_bucket(n)},
            "params": choice.params, "source": choice.source,
            "provenance": (choice.entry or {}).get("provenance"),
            "model": model, "warnings": [str(w.message) for w in caught],
            "searched": [str(tuning.user_tuning_dir()), str(tuning.shipped_tuning_dir())]}
    if as_json:
        click.echo(json.dumps(info, indent=2, default=str))
        return
    for w in info["warnings"]:
        click.echo(f"warning: {w}", err=True)
    click.echo(f"device:  {info['device']} ({info['mode']}, profile {info['profile']})")
    click.echo(f"problem: {kernel} {dtype} DK={d} DV={dv} {'causal' if causal else 'non-causal'} N={n} "
               f"(bucket {info['problem']['bucket']})")
    click.echo("params:  " + " ".join(f"{k}={v}" for k, v in choice.params.items()))
    click.echo(f"source:  {choice.source}")
    if info["provenance"]:
        pv = info["provenance"]
        click.echo(f"         {pv.get('mode', '?')} on {pv.get('device', '?')}, driver {pv.get('driver', '?')}, "
                   f"flashcl {pv.get('flashcl', '?')}, {pv.get('date', '?')}")
    click.echo(f"model:   {model['floats']} floats per work-item (hard {model['regs_hard']}, budget "
               f"{model['regs_budget']}): {'spills' if model['spills'] else 'no spill predicted'}"
               f"{', over the occupancy budget' if model['over_budget'] and not model['spills'] else ''}")
    click.echo(f"searched: {info['searched'][0]} (user), then {info['searched'][1]} (shipped)")


@main.command()
@click.option("--device", default=None, help="OpenCL device (name substring, profile or P:D).")
@click.option("--calls", default=10000, show_default=True, type=click.IntRange(1), help="Calls to make.")
@click.option("--every", default=250, show_default=True, type=click.IntRange(1),
              help="Sample memory and cache sizes every N calls.")
@click.option("--check-every", default=50, show_default=True, type=click.IntRange(1),
              help="Compare every N-th call against the float64 oracle.")
@click.option("--max-growth", default=0.10, show_default=True, type=float,
              help="Fail when the last quarter's mean RSS exceeds the second quarter's by more.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def soak(device, calls, every, check_every, max_growth, as_json):
    """Many mixed prefill/decode calls in one process; fails (exit 1) if memory keeps growing."""
    from . import soak as soak_mod

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
        click.echo(json.dumps({"command": command, "device": handle.describe(), "ok": res.ok,
                               "verdict": res.verdict, "checked": res.checked, "max_err": res.max_err,
                               "samples": [vars(s) for s in res.samples]}, indent=2))
    else:
        click.echo(f"checked {res.checked} calls against the oracle, max relative error {res.max_err:.2e}")
        click.echo(res.verdict)
    if not res.ok:
        sys.exit(EXIT_CHECK_FAILED)


if __name__ == "__main__":
    main()
