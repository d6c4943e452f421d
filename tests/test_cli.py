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
    for code in ("0", "1", "2", "3", "4", "5", "130"):
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
    # show-config for the absent device reads the modeled entry
    s = run("show-config", "--device", "adreno", "--dtype", "float32")
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
    assert data["mode"] == "measured" and len(data["results"]) == 2
    assert all(row["status"] == "ok" and row["runs"] >= 5 for row in data["results"])
    win = data["winner"]
    assert win["params"] == data["fastest"]["params"]
    s = run("show-config", "--device", cpu_device, "--n", "128", "--d", "64", "--dtype", "float32", "--json")
    assert s.exit_code == 0, s.output
    cfg = json.loads(s.stdout)
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


def test_bench_decode_head_dim(cpu_device):
    """--head-dim sizes q, K and V: a d = 64 GQA shape on the CPU device, checked against float64."""
    r = run("bench", "decode", "--device", "cpu", "--shape", "1,4,2,64", "--head-dim", "64", "--repeats", "2",
            "--json")
    assert r.exit_code == 0, r.output
    (row,) = json.loads(r.stdout)["rows"]
    assert row["shape"] == "(1,4/2,64,64)" and row["bytes_moved"] == 2 * 64 * 2 * 64 * 2 + 4 * 2 * 64 * 2
    assert row["rel_err"] < 1e-2
