"""The ``flashcl`` command through click's CliRunner: tune (model mode and measured), show-config,
--json, the documented exit codes, and the one-line errors."""

from __future__ import annotations

import json
import sys

import pytest
from click.testing import CliRunner

from flashcl import cli, tuning

SMALL = ["--shape", "1,2,1,128,64,1", "--dtype", "float32"]



def run(*args):
    return CliRunner().invoke(cli.main, list(args), catch_exceptions=False)


def test_exit_codes_are_documented():
    doc = cli.__doc__
    for code in ("0", "1", "2", "3", "4", "5", "6", "130"):
        assert f"\n  {code} " in doc


def test_tune_model_mode_for_adreno(cpu_device, tuning_dir):
    r = run("tune", "--device", "adreno", "--param", "BLOCK_M=64", "--param", "BLOCK_N=16,32",
            "--param", "DV_TILE=16,32,64", "--no-isolate")
    assert r.exit_code == 0, r.output
    assert r.stdout.splitlines()[0].startswith("# model mode: no adreno device attached")
    assert "largest non-spilling tile" in r.stdout and "(modeled) to" in r.stdout
    [f] = list(tuning_dir.glob("*.json"))
    [e] = tuning.load_file(f)
    assert (e["vendor"], e["profile"], e["device"], e["provenance"]["mode"]) == ("adreno", "adreno", None, "modeled")
    # at d=128 the q row alone (128 floats) plus the ~48 scalars leave Adreno's 192 registers no
    # room for scores and accumulator, so the model's largest safe tile re-reads q per KV tile
    assert e["params"] == {"BLOCK_M": 64, "BLOCK_N": 32, "DV_TILE": 64, "VEC": 4, "Q_IN_REGS": 0}
    # show-config for the absent device reads the modeled entry (tune and show-config share a dtype)
    s = run("show-config", "--device", "adreno")
    assert s.exit_code == 0, s.output
    assert "BLOCK_M=64 BLOCK_N=32 DV_TILE=64 VEC=4 Q_IN_REGS=0" in s.stdout and f.name in s.stdout and "modeled" in s.stdout


def test_require_device_turns_absence_into_exit_3(cpu_device):
    r = run("tune", "--device", "adreno", "--require-device")
    assert r.exit_code == 3
    assert "no adreno device is attached" in r.stderr and "drop --require-device" in r.stderr


def test_unknown_device_exit_3():
    r = run("tune", "--device", "no-such-gpu-xyz")
    assert r.exit_code == 3 and r.stderr.startswith("error: ")
    assert len(r.stderr.strip().splitlines()) == 1


def test_bad_param_is_usage_error():
    r = run("tune", "--device", "adreno", "--param", "TILE=3")
    assert r.exit_code == 2 and "NAME=v1,v2" in r.output


def test_quick_tune_on_cpu_json_and_pickup(cpu_device, tuning_dir):
    r = run("tune", "--device", cpu_device, *SMALL, "--param", "BLOCK_M=32,64", "--param", "BLOCK_N=16",
            "--param", "DV_TILE=64", "--param", "Q_IN_REGS=1", "--repeats", "5", "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["mode"] == "measured" and len(data["rows"]) == 2
    assert all(row["status"] == "ok" and row["runs"] >= 5 for row in data["rows"])
    win = data["winner"]
    assert win["params"] == data["fastest"]["params"]
    s = run("show-config", "--device", cpu_device, "--n", "128", "--d", "64", "--dtype", "float32", "--json")
    assert s.exit_code == 0, s.output
    (cfg,) = json.loads(s.stdout)["rows"]
    assert cfg["params"] == win["params"] and data["saved_to"] in cfg["source"]


def test_isolated_quick_tune_table(cpu_device, tuning_dir):
    r = run("tune", "--device", cpu_device, *SMALL, "--param", "BLOCK_M=32", "--param", "BLOCK_N=16",
            "--param", "DV_TILE=32,64", "--repeats", "5", "--retime", "2")
    assert r.exit_code == 0, r.output
    out = r.stdout
    assert out.startswith("# measured on")
    assert "BLOCK_M BLOCK_N DV_TILE       layout" in out and "# fastest:" in out and "<- winner" in out
    assert "*" in out  # the top two were re-timed


def test_corrupt_database_exit_4_names_file(cpu_device, tuning_dir):
    tuning_dir.mkdir(parents=True)
    (tuning_dir / "broken.json").write_text("[1, 2")
    r = run("show-config", "--device", cpu_device)
    assert r.exit_code == 4 and "broken.json" in r.stderr and "fix or delete it" in r.stderr
    r = run("tune", "--device", "adreno", "--param", "BLOCK_M=64", "--param", "BLOCK_N=16", "--param",
            "DV_TILE=32", "--no-isolate", "--output", str(tuning_dir / "broken.json"))
    assert r.exit_code == 4 and "broken.json" in r.stderr


def test_show_config_default_and_bad_entry_warning(cpu_device, tuning_dir):
    r = run("show-config", "--device", cpu_device, "--d", "64", "--n", "256", "--dtype", "float32")
    assert r.exit_code == 0 and "source:  profile default (cpu)" in r.stdout
    from flashcl.opencl.runtime import get_device

    h = get_device(cpu_device)
    key = tuning.DeviceKey.of(h.name, h.device.opencl_c_version, h.device.vendor, h.profile.name)
    e = tuning.make_entry("prefill", key, dtype="float32", dk=64, dv=64, causal=True, n=256,
                          params={"BLOCK_M": 64, "BLOCK_N": 12, "DV_TILE": 64, "VEC": 8},
                          provenance={"mode": "measured"})
    tuning_dir.mkdir(parents=True)
    (tuning_dir / "edited.json").write_text(json.dumps({"version": 1, "entries": [e]}))
    r = run("show-config", "--device", cpu_device, "--d", "64", "--n", "256", "--dtype", "float32")
    assert r.exit_code == 0 and "profile default (cpu)" in r.stdout
    assert "warning: ignoring tuning entry in" in r.stderr and "edited.json" in r.stderr


def test_plot_without_matplotlib_exit_5(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    r = run("tune", "--device", "adreno", "--plot", "x.png")
    assert r.exit_code == 5 and "pip install 'flashcl[plot]'" in r.stderr


def test_plot_draws_the_sweep(cpu_device, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "sweep.png"
    r = run("tune", "--device", "adreno", "--param", "BLOCK_M=64", "--param", "BLOCK_N=16,32", "--param",
            "DV_TILE=32,64", "--no-isolate", "--no-save", "--plot", str(png))
    assert r.exit_code == 0, r.output
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_bench_decode_wiring():
    r = run("bench", "decode", "--help")
    assert r.exit_code == 0 and "--block-size" in r.stdout and "--backend" in r.stdout
    assert "--block-order" in r.stdout
    r = run("bench", "decode", "--block-order", "reversed")
    assert r.exit_code == 2 and "reversed" in r.stderr
    r = run("bench", "decode", "--block-size", "12")
    assert r.exit_code == 2 and "power of two" in r.stderr
    r = run("bench", "decode", "--head-dim", "12")
    assert r.exit_code == 2 and "head dim 12" in r.stderr
    r = run("bench", "decode", "--backend", "triton", "--kernel", "decode.cl")
    assert r.exit_code == 2 and "--kernel" in r.stderr
    # --knob: KEY=VALUE, a known knob, Triton only, not with --sweep-tiles
    for bad, said in (("gqa_programs_per_sm", "KEY=VALUE"), ("gqa_programs_per_sm=three", "an integer"),
                      ("=3", "KEY=VALUE")):
        r = run("bench", "decode", "--backend", "triton", "--knob", bad)
        assert r.exit_code == 2 and said in r.stderr, r.output
    r = run("bench", "decode", "--backend", "triton", "--knob", "programs=3")
    assert r.exit_code == 2 and "unknown decode knobs ['programs']" in r.stderr and "gqa_programs_per_sm" in r.stderr
    for bad, said in (("gluon_gqa=1", "none, true or false"), ("sort_pages=none", "true or false"),
                      ("merge_stages=none", "an integer >= 1"), ("gqa_programs_per_sm=5", "none or 1 .. 4")):
        r = run("bench", "decode", "--backend", "triton", "--knob", bad)
        assert r.exit_code == 2 and said in r.stderr, r.output
    r = run("bench", "decode", "--backend", "triton", "--knob", "sort_pages=false", "--sweep-tiles")
    assert r.exit_code == 2 and "--sweep-tiles" in r.stderr
    r = run("bench", "decode", "--knob", "sort_pages=false")
    assert r.exit_code == 2 and "--backend triton" in r.stderr


def test_bench_decode_head_dim(cpu_device):
    """--head-dim sizes q, K and V: a d = 64 GQA shape on the CPU device, checked against float64."""
    r = run("bench", "decode", "--device", "cpu", "--shape", "1,4,2,64", "--head-dim", "64", "--repeats", "2",
            "--json")
    assert r.exit_code == 0, r.output
    (row,) = json.loads(r.stdout)["rows"]
    assert row["shape"] == "(1,4/2,64,64)" and row["bytes_moved"] == 2 * 64 * 2 * 64 * 2 + 4 * 2 * 64 * 2
    assert row["rel_err"] < 1e-2


@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_bench_bfloat16_on_opencl(cpu_device, kind):
    """bfloat16 on the OpenCL backend: values stored as their bits, read back for the error (a
    quantized cache beside the decode); torch's SDPA, the peer, in bfloat16 too."""
    pytest.importorskip("torch")
    shape = ["--shape", "1,4,2,64", "--head-dim", "64", "--kv-format", "q8_0"] if kind == "decode" else \
        ["--shape", "1,4,2,40,64,1"]
    r = run("bench", kind, "--device", "cpu", "--dtype", "bfloat16", "--repeats", "1", *shape, "--json")
    assert r.exit_code == 0, r.output
    (row,) = json.loads(r.stdout)["rows"]
    assert row["dtype"] == "bfloat16" and 1e-4 < row["rel_err"] < 1e-2  # bfloat16's rounding, not exact
    assert "bfloat16" in row["peer"]
    if kind == "decode":
        assert row["quant_rel_err"] < 1e-2


def test_bench_decode_kernel_option(cpu_device):
    """--kernel decode.cl reaches the kernel (the row names it) with a quantized cache timed beside."""
    r = run("bench", "decode", "--device", "cpu", "--shape", "1,4,2,64", "--head-dim", "64", "--repeats", "1",
            "--kernel", "decode.cl", "--kv-format", "q4_0", "--rounds", "2", "--json")
    assert r.exit_code == 0, r.output
    (row,) = json.loads(r.stdout)["rows"]
    assert row["kernel"].startswith("decode.cl") and row["quant_kernel"].startswith("decode.cl")
    assert row["quant_rel_err"] < 1e-2
    # the ratio is against the plain call timed in turns with the quantized one
    assert row["quant_plain_ms"] > 0 and row["quant_ratio"] == pytest.approx(row["quant_ms"] / row["quant_plain_ms"])



def test_bench_decode_quantized_with_variants(cpu_device):
    """--kv-format with variants also times the quantized cache with them on, checked against the
    oracle on the dequantized cache with the same variants."""
    r = run("bench", "decode", "--device", "cpu", "--shape", "1,4,2,96", "--head-dim", "64", "--repeats", "1",
            "--kv-format", "q8_0", "--window", "40,0", "--softcap", "5", "--sinks", "--alibi", "--json")
    assert r.exit_code == 0, r.output
    (row,) = json.loads(r.stdout)["rows"]
    assert row["variants"] == "window=(40, 0) softcap=5.0 sinks=True alibi_slopes=True" and row["quant_var_ms"] > 0
    assert row["quant_var_ratio"] == pytest.approx(row["quant_var_ms"] / row["quant_ms"])
    assert row["quant_var_rel_err"] < 1e-2

# --------------------------------------------------------------------------- one-line errors

def _one_error_line(r, code):
    """The one line of stderr that is neither a progress note ("# ...") nor the progress bar."""
    assert r.exit_code == code, r.output
    assert "Traceback" not in r.output
    lines = [ln for ln in r.stderr.splitlines() if ln.strip() and not ln.startswith(("#", "tuning"))]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    return lines[0]


@pytest.mark.parametrize("args,why", [
    (["tune", "--shape", "1,x,2,128,64,1"], "five integers"),
    (["tune", "--shape", "1,4,2,128,64"], "B,H_q,H_kv,N,d,causal"),
    (["tune", "--shape", "1,4,2,128,64,maybe"], "B,H_q,H_kv,N,d,causal"),
    # H_q not a multiple of H_kv: the sweep read past the K/V buffers
    (["tune", "--device", "adreno", "--shape", "1,3,2,128,64,1"], "H_q=3 must be a multiple of H_kv=2"),
    (["tune", "--device", "adreno", "--shape", "1,4,2,128,12,1"], "head dim 12 is not supported"),
    (["tune", "--device", "adreno", "--shape", "1,4,2,0,64,1"], "empty input"),
    (["tune", "--timeout", "0"], "--timeout"),
    (["tune", "--repeats", "0"], "--repeats"),
    (["bench", "prefill", "--shape", "1,3,2,128,64,1"], "H_q=3 must be a multiple of H_kv=2"),
    (["bench", "prefill", "--params", "{BLOCK_M: 64}"], "is not JSON"),
    (["bench", "prefill", "--params", "[64, 32]"], "expected a JSON object"),
    (["bench", "decode", "--shape", "1,3,2,64"], "H_q=3 must be a multiple of H_kv=2"),
    (["bench", "decode", "--shape", "1,x,2,64"], "four integers"),
    (["bench", "decode", "--head-dim", "40", "--kv-format", "q8_0"], "head dim 40 is not a multiple of 32"),
    (["bench", "decode", "--kv-format", "fp8_e4m3"], "use --backend triton"),
    (["export", "--shape", "decode:1,4,2,64,96/12"], "head dim 12 is not supported"),
    (["export", "--variants", "none,window"], "none stands alone"),
    (["export", "--shape", "prefill:1,4,2,64,96/x,1"], "DV: an integer"),
    (["show-config", "--device", "adreno", "--d", "12"], "head dim 12 is not supported"),
    (["show-config", "--device", "adreno", "--dv", "0"], "head dim 0 is not supported"),
    (["show-config", "--device", "adreno", "--d", "264"], "head dim 264 is not supported"),
    (["show-config", "--dtype", "float64"], "float64"),
    (["no-such-command"], "no-such-command"),
    (["bench", "prefill", "--softcap", "1e39"], "--softcap: 1e+39 is past the kernels' range"),
    (["bench", "decode", "--softcap", "inf"], "--softcap: expected a finite float > 0"),
    (["tune", "--kernel", "decode", "--param", "SPLIT_WAVES=0"], "values must be >= 1"),
    (["tune", "--plot", "/no/such/folder/sweep.png"], "cannot write into /no/such/folder"),
    (["bench", "decode", "--dtype", "float32", "--kv-format", "float16"], "not of --dtype float32"),
])
def test_usage_errors_are_one_line_exit_2(args, why):
    """Checked before any device is touched: none of these needs one."""
    assert why in _one_error_line(run(*args), 2)


def test_bare_group_prints_its_help():
    r = run("bench")
    assert r.exit_code in (0, 2) and "Usage:" in r.output and "prefill" in r.output  # 2 from click 8.2
    assert "error:" not in r.output


def test_flashcl_errors_are_one_line_with_their_exit_code(monkeypatch, tuning_dir):
    from flashcl.tools import tuner
    from flashcl.errors import KernelBuildError

    def build_fails(*a, **k):
        raise KernelBuildError("prefill", {"BLOCK_M": 64}, "some GPU", "note: first\nerror: no such builtin\nmore")

    monkeypatch.setattr(tuner, "run_sweep", build_fails)
    line = _one_error_line(run("tune", "--device", "adreno", "--no-isolate"), 6)
    assert "building kernel 'prefill'" in line and "error: no such builtin" in line

    def rejected(*a, **k):
        raise ValueError("params: BLOCK_M=3 is not a power of two")

    monkeypatch.setattr(tuner, "run_sweep", rejected)
    assert "BLOCK_M=3" in _one_error_line(run("tune", "--device", "adreno", "--no-isolate"), 2)


def test_deeply_nested_database_is_exit_4_naming_the_file(tuning_dir):
    tuning_dir.mkdir(parents=True)
    (tuning_dir / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    line = _one_error_line(run("show-config", "--device", "adreno"), 4)
    assert "deep.json" in line and "nested too deeply" in line


def test_string_provenance_is_skipped_with_a_warning(tuning_dir):
    e = tuning.make_entry("prefill", tuning.DeviceKey("", None, "adreno", "adreno"), dtype="float16", dk=128,
                          dv=128, causal=True, n=2048, params={"BLOCK_M": 64, "BLOCK_N": 16, "DV_TILE": 32,
                                                              "VEC": 4, "Q_IN_REGS": 0}, provenance={})
    e["provenance"] = "tuned by hand"
    tuning_dir.mkdir(parents=True)
    (tuning_dir / "hand.json").write_text(json.dumps({"version": 1, "entries": [e]}))
    r = run("show-config", "--device", "adreno")
    assert r.exit_code == 0, r.output
    assert "profile default (adreno)" in r.stdout
    assert "hand.json" in r.stderr and "'provenance' is a string" in r.stderr


def test_triton_backend_without_cuda_is_exit_3(monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for cmd in ("prefill", "decode"):
        assert "CUDA" in _one_error_line(run("bench", cmd, "--backend", "triton"), 3)


def test_ctrl_c_in_tune_is_one_line_exit_130(cpu_device, monkeypatch):
    from flashcl.tools import tuner

    calls = []
    evaluate = tuner.InlineRunner.evaluate

    def interrupted_on_second(self, params):
        calls.append(params)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return evaluate(self, params)

    monkeypatch.setattr(tuner.InlineRunner, "evaluate", interrupted_on_second)
    r = run("tune", "--device", "adreno", "--param", "BLOCK_M=64", "--param", "BLOCK_N=16,32", "--param",
            "DV_TILE=32", "--no-isolate")
    line = _one_error_line(r, 130)
    assert "interrupted; 1 configurations kept in" in line and "--resume" in line
    assert "BLOCK_M BLOCK_N" not in r.stdout


def test_a_tuning_folder_that_is_a_file_is_one_line(cpu_device, tmp_path, monkeypatch):
    """The tuning folder cannot be made (a file holds its path): the sweep runs without a resume
    file, then the save fails as one error line that says nothing was kept."""
    blocker = tmp_path / "not_a_folder"
    blocker.write_text("")
    monkeypatch.setenv("FLASHCL_TUNING_DIR", str(blocker))
    r = run("tune", "--device", "adreno", "--param", "BLOCK_M=64", "--param", "BLOCK_N=16", "--param",
            "DV_TILE=32", "--no-isolate")
    line = _one_error_line(r, 4)
    assert "cannot write the tuning database" in line and "no resume file could be written either" in line


# --------------------------------------------------------------------------- output

def _strict_json(text):
    def no_constant(name):
        raise AssertionError(f"{name} is not JSON")

    return json.loads(text, parse_constant=no_constant)


def test_tune_json_is_standard_json(cpu_device, tuning_dir):
    r = run("tune", "--device", "adreno", "--param", "BLOCK_M=64", "--param", "BLOCK_N=16", "--param",
            "DV_TILE=32", "--no-isolate", "--json")
    assert r.exit_code == 0, r.output
    data = _strict_json(r.stdout)  # model mode has no times: NaN before, null now
    assert data["winner"]["median_ms"] is None and data["winner"]["spread_ms"] == [None, None]


def test_bench_json_is_standard_json_with_conditions_and_rows(cpu_device):
    r = run("bench", "prefill", "--device", cpu_device, "--shape", "1,2,1,32,16,1", "--repeats", "1",
            "--no-check", "--json")
    assert r.exit_code == 0, r.output
    data = _strict_json(r.stdout)
    assert set(data) == {"conditions", "rows"} and data["conditions"]["backend"] == "opencl"
    assert data["rows"][0]["rel_err"] is None


def test_triton_json_conditions_have_the_opencl_keys(monkeypatch):
    import types

    torch = pytest.importorskip("torch")
    from flashcl.tools import bench_prefill as bench

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "GPU")
    handle = types.SimpleNamespace(name="dev", platform="p", driver="d", profile=types.SimpleNamespace(name="cpu"),
                                   is_cpu=True)
    assert set(cli._triton_conditions("flashcl bench")) == set(bench.conditions(handle, "flashcl bench"))


def test_compiler_warnings_go_to_the_log(cpu_device, monkeypatch, tuning_dir):
    import warnings

    import pyopencl

    from flashcl.tools import tuner

    sweep = tuner.run_sweep

    def noisy(*a, **k):
        warnings.warn("Non-empty compiler output encountered", pyopencl.CompilerWarning)
        return sweep(*a, **k)

    monkeypatch.setattr(tuner, "run_sweep", noisy)
    args = ["tune", "--device", "adreno", "--param", "BLOCK_M=64", "--param", "BLOCK_N=16", "--param",
            "DV_TILE=32", "--no-isolate", "--no-save"]
    r = run(*args)
    assert r.exit_code == 0, r.output
    assert "compiler output" not in r.output
    r = run("-v", *args)
    assert r.exit_code == 0, r.output
    assert "log: compiler output: Non-empty compiler output encountered" in r.stderr
    assert "compiler output" not in r.stdout


def test_other_warnings_are_one_line(cpu_device, monkeypatch, tuning_dir):
    """A library's warning during a command: "warning: ..." on stderr, not Python's file, line
    and source line between a table's rows."""
    import warnings

    from flashcl.tools import tuner

    sweep = tuner.run_sweep

    def warns(*a, **k):
        warnings.warn("an entry was skipped\nsecond line", UserWarning)
        return sweep(*a, **k)

    monkeypatch.setattr(tuner, "run_sweep", warns)
    r = run("tune", "--device", "adreno", "--param", "BLOCK_M=64", "--param", "BLOCK_N=16", "--param",
            "DV_TILE=32", "--no-isolate", "--no-save")
    assert r.exit_code == 0, r.output
    assert "warning: an entry was skipped second line" in r.stderr and "UserWarning" not in r.stderr


def test_commands_share_one_default_dtype():
    commands = [cli.tune, cli.show_config, cli.bench_prefill, cli.bench_decode]
    assert {next(p.default for p in c.params if p.name == "dtype") for c in commands} == {cli.DEFAULT_DTYPE}


def test_quick_model_tune_stores_a_non_spilling_tile(cpu_device, tuning_dir):
    """At d=128 every quick tile keeps q in registers and spills Adreno's 192; the stored tile
    must still be one the model predicts not to spill, and show-config must find it."""
    r = run("tune", "--device", "adreno", "--quick", "--no-isolate")
    assert r.exit_code == 0, r.output
    [f] = list(tuning_dir.glob("*.json"))
    [e] = tuning.load_file(f)
    from flashcl import profiles

    assert tuning.private_floats("prefill", e["params"], 128, 128) <= profiles.PROFILES["adreno"].regs_hard
    assert e["dtype"] == cli.DEFAULT_DTYPE
    s = run("show-config", "--device", "adreno", "--json")
    assert s.exit_code == 0, s.output
    (cfg,) = _strict_json(s.stdout)["rows"]
    assert cfg["params"] == e["params"] and f.name in cfg["source"] and not cfg["model"]["spills"]


def test_show_config_names_the_relative_it_uses(monkeypatch, tuning_dir):
    """An H200 with no entry of its own: the shipped H100 entry of the same architecture, and
    show-config says so."""
    from flashcl import profiles
    from flashcl.tools import tuner

    prof = profiles.PROFILES["nvidia"]
    key = tuning.DeviceKey.of("NVIDIA H200", "OpenCL C 3.0 ", "NVIDIA Corporation", "nvidia", compute_capability=(9, 0))
    target = tuner.Target(prof, key, "modeled", "0:0", "test", "drv", prof.local_mem, prof.max_work_group, True)
    monkeypatch.setattr(tuner, "resolve_target", lambda spec, **kw: target)
    r = run("show-config", "--device", "nvidia", "--dtype", "float32")
    assert r.exit_code == 0, r.output
    assert ("why:     no entry for NVIDIA H200; using NVIDIA H100 80GB HBM3's (same architecture sm_90)"
            in r.stdout.splitlines())
    assert "nvidia-h100.json (arch, bucket 2048, measured)" in r.stdout and "architecture sm_90" in r.stdout
    assert "VARIANT=tiles" in r.stdout


def test_show_config_warns_once_when_the_driver_differs(cpu_device, tuning_dir):
    from flashcl.opencl.runtime import get_device

    h = get_device(cpu_device)
    key = tuning.DeviceKey.for_device(h.device, h.profile.name)
    tuning_dir.mkdir(parents=True)
    args = ("show-config", "--device", cpu_device, "--d", "64", "--n", "256", "--dtype", "float32")
    for driver, warned in (("0.0-other", True), (h.driver, False)):
        e = tuning.make_entry("prefill", key, dtype="float32", dk=64, dv=64, causal=True, n=256,
                              params={"BLOCK_M": 32, "BLOCK_N": 16, "DV_TILE": 64, "VEC": 4},
                              provenance={"mode": "measured", "driver": driver})
        (tuning_dir / "db.json").write_text(json.dumps({"version": 1, "entries": [e]}))
        r = run(*args)
        assert r.exit_code == 0 and "db.json" in r.stdout, r.output
        lines = [ln for ln in r.stderr.splitlines() if ln.startswith("warning:")]
        if warned:
            assert len(lines) == 1 and "0.0-other" in lines[0] and h.driver in lines[0]
        else:
            assert lines == []


def test_every_json_has_one_schema(cpu_device, tuning_dir):
    """devices, bench, tune, show-config and soak: {"conditions": {...}, "rows": [...]}, strict JSON."""
    commands = [
        ("devices", "--json"),
        ("bench", "prefill", "--device", cpu_device, "--shape", "1,2,1,40,32,1", "--dtype", "float32",
         "--repeats", "1", "--json"),
        ("bench", "decode", "--device", cpu_device, "--shape", "1,4,2,100", "--head-dim", "32",
         "--repeats", "1", "--json"),
        ("tune", "--device", "adreno", "--quick", "--no-save", "--json"),
        ("show-config", "--device", "adreno", "--json"),
        ("soak", "--device", cpu_device, "--calls", "4", "--every", "2", "--check-every", "2", "--json"),
    ]
    for args in commands:
        r = run(*args)
        assert r.exit_code == 0, (args, r.output)
        data = _strict_json(r.stdout)
        assert isinstance(data["conditions"], dict) and isinstance(data["rows"], list), args
        assert data["conditions"]["flashcl"] and data["conditions"]["command"], args


def test_shapes_past_host_memory_are_one_line_exit_2(cpu_device, tuning_dir):
    """numpy's MemoryError for inputs no host holds, in the benchmark and the tuning worker."""
    assert "out of host memory" in _one_error_line(
        run("bench", "prefill", "--device", "cpu", "--repeats", "1", "--shape", "1000000,64,64,1000000,256,1"), 2)
    assert "out of host memory" in _one_error_line(
        run("tune", "--device", "cpu", "--quick", "--kernel", "decode", "--shape", "100000,64,64,10000000,128",
            "--no-save"), 2)
