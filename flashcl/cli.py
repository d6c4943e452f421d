"""The ``flashcl`` command: devices, bench (and, as they land, tune and show-config).

Exit codes: 0 success, 1 a check failed (e.g. a benchmark's error above tolerance), 2 bad usage
(click's own), 3 no usable OpenCL device.
"""

from __future__ import annotations

import json
import sys

import click

EXIT_CHECK_FAILED, EXIT_NO_DEVICE = 1, 3


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
               f"{'max WG':>6} {'fp16':5} profile")
    for r in rows:
        click.echo(f"{r['id']:5} {r['platform'][:28]:28} {r['device'][:44]:44} {r['type'][:5]:5} "
                   f"{r['compute_units']:4d} {r['local_mem_kib']:9d} {r['max_work_group']:6d} "
                   f"{str(r['fp16']):5} {r['profile']}")


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
        _fail("the OpenCL kernels take float32 or float16 (bfloat16 is Triton-only)", 2)
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


if __name__ == "__main__":
    main()
