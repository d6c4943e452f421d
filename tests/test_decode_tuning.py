"""Decode through the same tuning interface as prefill: its space (tuning.SPACES["decode"]) and the
host functions that read it, the split rule's tunable constants, model mode, and a measured sweep
on the PoCL CPU device whose winner flashcl.decode picks up."""

from __future__ import annotations

import dataclasses
import json
import types

import numpy as np
import pytest
from click.testing import CliRunner

from flashcl import cli, profiles, reference, tuning
from flashcl.tools import tuner
from flashcl.opencl import decode as cl_decode

from ._check import assert_close

SPACE = tuning.SPACES["decode"]


def run(*args):
    return CliRunner().invoke(cli.main, list(args), catch_exceptions=False)


# --------------------------------------------------------------------------- the space

def test_decode_space_parameters():
    lay = SPACE.layouts[0]
    assert lay.required == cl_decode._PARAM_NAMES == ("ROWS", "UNROLL", "HEAD_TILE", "MERGE_WG")
    assert lay.optional == ("SPLIT_WAVES", "SPLIT_KEYS") and SPACE.host_params() == {"SPLIT_WAVES", "SPLIT_KEYS"}
    assert SPACE.param_values("HEAD_TILE", tuning.Dims(128, 128, 12)) == [1, 2, 3, 4, 6]
    assert SPACE.param_values("HEAD_TILE", tuning.Dims(128, 128, 8), quick=True) == [4]
    dims = tuning.Dims(128, 128, 4, "float16")
    full = SPACE.candidates(dims, layouts=("lanes",))
    assert len(full) == 5 * 3 * 3 * 4 * 4 * 5
    tiles = SPACE.candidates(dims, skip=SPACE.host_params(), layouts=("lanes",))
    assert len(tiles) == 5 * 3 * 3 * 4 and all("SPLIT_WAVES" not in p for p in tiles)
    assert len(SPACE.candidates(dims, quick=True, skip=SPACE.host_params(), layouts=("lanes",))) == 3 * 2 * 1 * 1
    # decode_cpu.cl: BLOCK_N x VEC (8 and 16 for half rows) x MERGE_WG, tagged with its layout
    rows = SPACE.candidates(dims, skip=SPACE.host_params(), layouts=("rows",))
    assert len(rows) == 3 * 2 * 2 and all(p["VARIANT"] == "rows" for p in rows)
    assert SPACE.param_values("VEC", tuning.Dims(40, 40, 4, "float32")) == [4, 8]
    assert profiles.PROFILES["cpu"].decode_variants == ("rows",)
    assert all(p.decode_variants == ("lanes",) for n, p in profiles.PROFILES.items() if n != "cpu")


def test_host_functions_read_the_space():
    """opencl/decode.py's module functions are the space's, with their old signatures."""
    p = {"ROWS": 4, "UNROLL": 2, "HEAD_TILE": 2, "MERGE_WG": 64}
    dims = tuning.Dims(128, 64, 4, "float16")
    assert cl_decode.work_group_size(p, 4, 128, 64, "float16") == SPACE.work_group_size(p, dims) == 16 * 4 * 2
    assert cl_decode.local_bytes(p, 4, 128, 64, "float16") == SPACE.local_bytes(p, dims)
    assert cl_decode.private_floats(p, 128, 64, "float16") == SPACE.private_floats(p, dims) == 32 + 4 + 64 + 24
    assert cl_decode.chunk_elems("float32") == 4 and cl_decode.lanes(128, 64, "float32") == 32
    prof = profiles.PROFILES["nvidia"]
    assert cl_decode.default_params(prof, 4, 128, 64, "float16", local_mem=49152, max_work_group=1024) == \
        tuning.default_params("decode", prof, 128, 64, local_mem=49152, max_work_group=1024, group=4, dtype="float16")
    errs = cl_decode.check_params(dict(p, HEAD_TILE=3), 4, 128, 64, "float16", local_mem=49152, max_work_group=1024)
    assert errs == ["HEAD_TILE=3 must divide the GQA group G=4"]
    assert cl_decode.check_params(dict(p, SPLIT_WAVES=2, SPLIT_KEYS=1024), 4, 128, 64, "float16",
                                  local_mem=49152, max_work_group=1024) == []
    assert "SPLIT_WAVES=0 must be a positive int" in cl_decode.check_params(
        dict(p, SPLIT_WAVES=0), 4, 128, 64, "float16", local_mem=49152, max_work_group=1024)


def test_split_rule_reads_the_chosen_entry():
    """SPLIT_WAVES and SPLIT_KEYS in the parameters replace the rule's constants; absent, the
    defaults (and a path's own, passed as arguments) apply."""
    base = cl_decode.choose_num_splits(132, 64, 2048)
    assert cl_decode.choose_num_splits(132, 64, 2048, params={"ROWS": 8}) == base == 8
    assert cl_decode.choose_num_splits(132, 64, 2048, params={"SPLIT_WAVES": 1, "SPLIT_KEYS": 4096}) == 2
    assert cl_decode.choose_num_splits(132, 1024, 8192, params={"SPLIT_KEYS": 1024}) == 8
    assert cl_decode.choose_num_splits(132, 1024, 8192) == 16
    mma = dict(waves=cl_decode.MMA_WAVES, keys_per_split=cl_decode.MMA_KEYS_PER_SPLIT,
               min_keys=cl_decode.MMA_MIN_KEYS_PER_SPLIT)
    assert cl_decode.choose_num_splits(132, 8, 32768, **mma) == 32
    assert cl_decode.choose_num_splits(132, 8, 32768, params={"SPLIT_WAVES": 4}, **mma) == 64


def _target(profile="adreno", mode="modeled", compute_units=0):
    p = profiles.PROFILES[profile]
    return tuner.Target(p, tuning.DeviceKey.modeled(p), mode, "0:0", "test", "drv", p.local_mem,
                        p.max_work_group, False, compute_units)


def test_measured_plan_times_each_split_count_once():
    """The split constants are swept as one setting per distinct split count they give on the
    tuning problem and device; the defaults stand for their own count."""
    t = _target("nvidia", "measured", compute_units=132)
    shape = (8, 32, 8, 2048, 128)
    configs, _ = tuner.plan(t, shape, kernel="decode", dtype="float16",
                            overrides={"ROWS": [8], "UNROLL": [1], "HEAD_TILE": [4], "MERGE_WG": [256]})
    counts = [tuner.decode_splits(132, shape, p, False) for p in configs]
    assert len(configs) > 1 and len(set(counts)) == len(counts) == len(configs)
    assert {"SPLIT_WAVES": 4, "SPLIT_KEYS": 512} in [{k: p[k] for k in ("SPLIT_WAVES", "SPLIT_KEYS")} for p in configs]
    modeled, _ = tuner.plan(_target("adreno"), shape, kernel="decode", dtype="float16")
    assert modeled and not any("SPLIT_WAVES" in p for p in modeled)  # nothing is timed in model mode


def test_decode_spill_signals_take_the_worst_kernel():
    ev = tuner.DecodeEvaluator.__new__(tuner.DecodeEvaluator)
    kern = types.SimpleNamespace(spills=lambda: {
        "flash_decode": {"spill_stores": 0, "spill_loads": 0, "registers": 120, "kernel_max_work_group": 512},
        "flash_decode_split": {"spill_stores": 8, "spill_loads": 4, "registers": 130, "kernel_max_work_group": 256},
        "flash_decode_merge": {"spill_stores": 0, "spill_loads": 0, "registers": 30, "kernel_max_work_group": 1024}})
    info = ev._spills(kern)
    assert info == {"spill_stores": 8, "spill_loads": 4, "registers": 130, "kernel_max_work_group": 256}
    t = _target("nvidia", "measured")
    p = {"ROWS": 8, "UNROLL": 1, "HEAD_TILE": 4, "MERGE_WG": 256}
    model = SPACE.spill_model(p, tuning.Dims(128, 128, 4, "float16"), t.profile)
    assert tuner.spill_verdict(info, model, p, t, work_group=128) == (True, "ptxas: 8/4 B spill st/ld")
    assert tuner.spill_verdict({"kernel_max_work_group": 64}, model, p, t, work_group=128) == (
        True, "kernel work-group 64 < 128")


# --------------------------------------------------------------------------- model mode

def test_model_mode_decode_tune_and_show_config(cpu_device, tuning_dir, tmp_path):
    """--device adreno with no Adreno: every configuration built and checked on the CPU, the
    model's verdicts, the largest non-spilling tile stored as modeled (with its GQA group), and
    show-config --kernel decode reads it."""
    pytest.importorskip("matplotlib")
    png = tmp_path / "decode.png"
    r = run("tune", "--kernel", "decode", "--device", "adreno", "--quick", "--no-isolate",
            "--shape", "1,8,2,256,128", "--plot", str(png))
    assert r.exit_code == 0, r.output
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert "model mode: no adreno device attached" in r.stdout and "split rule is not swept" in r.stdout
    [f] = list(tuning_dir.glob("*.json"))
    [e] = tuning.load_file(f)
    assert (e["kernel"], e["group"], e["dk"], e["causal"]) == ("decode", 4, 128, False)
    assert e["provenance"]["mode"] == "modeled"
    dims = tuning.Dims(128, 128, 4, "float16")
    assert SPACE.private_floats(e["params"], dims) <= profiles.PROFILES["adreno"].regs_hard
    assert "SPLIT_WAVES" not in e["params"]
    s = run("show-config", "--kernel", "decode", "--device", "adreno", "--n", "256", "--group", "4", "--json")
    assert s.exit_code == 0, s.output
    (cfg,) = json.loads(s.stdout)["rows"]
    assert cfg["params"] == e["params"] and f.name in cfg["source"] and "modeled entry" in cfg["why"]
    assert cfg["split_rule"] == {"SPLIT_WAVES": tuning.SPLIT_WAVES, "SPLIT_KEYS": tuning.SPLIT_KEYS, "tuned": False}
    other = run("show-config", "--kernel", "decode", "--device", "adreno", "--n", "256", "--group", "2", "--json")
    assert "profile default" in json.loads(other.stdout)["rows"][0]["source"]  # another group: not this entry


def test_decode_shape_errors_are_usage_errors():
    for shape, why in (("1,4,2,512", "B,H_q,H_kv,ctx,d"), ("1,3,2,512,64", "H_q=3 must be a multiple"),
                       ("1,4,2,512,12", "head dim 12")):
        r = run("tune", "--kernel", "decode", "--shape", shape)
        assert r.exit_code == 2 and why in r.stderr, r.output
    r = run("tune", "--kernel", "decode", "--device", "adreno", "--param", "BLOCK_M=64")
    assert r.exit_code == 2 and "ROWS" in r.stderr


# --------------------------------------------------------------------------- measured, on PoCL

def test_measured_decode_tune_on_cpu_is_picked_up(cpu_device, tuning_dir):
    """A quick sweep of a tiny problem: every configuration checked and timed, the winner stored
    under kernel "decode" with its group, the driver and the split count it was timed at;
    choose_params finds it and flashcl.decode stays exact with it."""
    import flashcl
    from flashcl.opencl.decode import DecodeProblem, choose_params
    from flashcl.opencl.runtime import get_device

    r = run("tune", "--kernel", "decode", "--device", cpu_device, "--quick", "--shape", "1,4,2,512,64",
            "--dtype", "float32", "--repeats", "5", "--retime", "2", "--no-isolate", "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["mode"] == "measured" and data["conditions"]["rate_unit"] == "GB/s"
    assert data["rows"] and all(row["status"] == "ok" and row["runs"] >= 5 for row in data["rows"])
    assert all(row["rel_err"] < reference.TOLERANCE["float32"] and row["gbps"] > 0 for row in data["rows"])
    win = data["winner"]
    assert {"SPLIT_WAVES", "SPLIT_KEYS"} <= win["params"].keys() and win["num_splits"] >= 1
    [e] = tuning.load_file(data["saved_to"])
    h = get_device(cpu_device)
    assert (e["kernel"], e["group"], e["dtype"], e["device"]) == ("decode", 2, "float32", h.name)
    assert e["provenance"]["driver"] == h.driver and e["provenance"]["num_splits"] == win["num_splits"]

    choice = choose_params(h, DecodeProblem(3, 6, 3, 64, 64, True, "float32"), None, 500)
    assert choice.params == win["params"] and data["saved_to"] in choice.source and choice.reason.startswith("tuned")
    rng = np.random.default_rng(7)
    lens = np.array([500, 37, 260], dtype=np.int32)
    q = rng.standard_normal((3, 6, 64)).astype(np.float32)
    k, v = (rng.standard_normal((100, 16, 3, 64)).astype(np.float32) for _ in range(2))
    table = rng.permutation(100)[:96].reshape(3, 32).astype(np.int32)
    out = flashcl.decode(q, k, v, block_table=table, context_lens=lens, device=cpu_device)
    assert_close(out, reference.decode_attention(q, k, v, block_table=table, context_lens=lens), "float32",
                 "decode with the tuned entry")
    s = run("show-config", "--kernel", "decode", "--device", cpu_device, "--n", "512", "--d", "64",
            "--group", "2", "--dtype", "float32")
    assert s.exit_code == 0 and "tuned for" in s.stdout and "(tuned)" in s.stdout, s.output
    assert "warning" not in s.stderr  # measured with this device's driver


def test_rows_layout_space_checks():
    """decode_cpu.cl's space: BLOCK_N within the kernel's 1..64, VEC dividing the head dims; an
    untuned CPU whose SIMD width the probe narrowed takes the narrowest vectors a half row allows;
    model mode for the cpu profile plans decode_cpu.cl only (its layout), ranked by its own split
    defaults."""
    dims = tuning.Dims(128, 128, 4, "float16")
    lim = {"local_mem": 1 << 20, "max_work_group": 4096}
    rows = {"VARIANT": "rows", "BLOCK_N": 16, "VEC": 16, "MERGE_WG": 64}
    assert SPACE.check(rows, dims, lim) == []
    assert SPACE.check(dict(rows, BLOCK_N=100), dims, lim) == ["BLOCK_N=100 must be in 1..64"]
    narrow = dataclasses.replace(profiles.PROFILES["cpu"], simd=4)
    assert tuning.decode_layout_defaults("rows", narrow, dims, lim)["VEC"] == 8
    configs, _ = tuner.plan(_target("cpu"), (1, 8, 2, 512, 64), kernel="decode", dtype="float32")
    assert configs and all(p["VARIANT"] == "rows" for p in configs)
    one, two = dict(rows, SPLIT_WAVES=1), dict(rows, SPLIT_WAVES=2)
    assert SPACE.rank(one, dims, profiles.PROFILES["cpu"]) > SPACE.rank(two, dims, profiles.PROFILES["cpu"])


def test_a_failed_rows_probe_defaults_to_decode_cl(cpu_device, monkeypatch):
    """Where the probe found that the device's compiler fails decode_cpu.cl, the untuned choice is
    decode.cl's layout (a forced rows configuration raises the probe's error); where decode.cl's
    fails, the rows default still runs."""
    from flashcl.errors import KernelBuildError
    from flashcl.opencl import probe, runtime
    from flashcl.opencl.decode import DecodeProblem, choose_params

    h = runtime.get_device(cpu_device)
    real = probe.capabilities(h.device)
    prob = DecodeProblem(1, 8, 2, 64, 64, True, "float32")
    # choices are kept per handle, and a real device's probe verdicts never change in a process:
    # the simulated ones get choices of their own, dropped with the test
    monkeypatch.setattr(h, "choices", type(h.choices)())
    for failing in ("decode-rows", "decode"):
        caps = probe.Capabilities({**real.verdicts, failing: probe.Verdict(False, "error: simulated " + failing)})
        monkeypatch.setattr(runtime, "capabilities", lambda dev, caps=caps: caps)
        h.choices.clear()
        params = choose_params(h, prob, None, 256).params
        assert cl_decode.is_rows(params) == (failing == "decode"), (failing, params)
    with pytest.raises(KernelBuildError, match="simulated decode"):
        choose_params(h, prob, {"ROWS": 2, "UNROLL": 1, "HEAD_TILE": 4, "MERGE_WG": 64}, 256)
