"""The tuner's pieces: profiles and matching, the tuning space as data, the spill verdicts, the
database writer (atomic, locked, measured replaces modeled), resume after Ctrl-C, the worker
timeout, and the pickup of a tuned entry by flashcl.prefill's parameter choice."""

from __future__ import annotations

import json
import multiprocessing
import warnings
from pathlib import Path

import pytest

from flashcl import profiles, tuning
from flashcl.tools import tuner



# --------------------------------------------------------------------------- profiles

@pytest.mark.parametrize("name,version,want", [
    ("QUALCOMM Adreno(TM)", "OpenCL C 2.0 Adreno(TM) 740", "adreno"),
    ("QUALCOMM Adreno(TM)", "OpenCL C 2.0 Adreno(TM) 640", "adreno-6xx"),
    ("QUALCOMM Adreno(TM) 830", "OpenCL C 3.0 Adreno(TM) 830", "adreno-8xx"),
    ("Mali-G715", "OpenCL C 3.0 v1.r38p1", "mali"),
    ("NVIDIA H100 80GB HBM3", "OpenCL C 1.2 ", "nvidia"),
    ("Intel(R) UHD Graphics 770", "OpenCL C 1.2 ", "intel"),
])
def test_profile_matching(name, version, want):
    vendor = name.split()[0]
    assert profiles.profile_for(vendor, name, version).name == want


def test_profiles_have_sources_and_adreno_facts():
    for p in profiles.PROFILES.values():
        assert p.sources, f"profile {p.name} cites no source"
        assert p.regs_budget <= p.regs_hard
    a = profiles.PROFILES["adreno"]
    assert (a.regs_hard, a.local_mem, a.max_work_group, a.subgroup) == (192, 32 * 1024, 1024, 64)
    # Mesa ir3: 96 vec4 per lane; 4 waves64 at 48 vec4 -> a 256-fiber work-group still fits
    assert a.kernel_max_work_group(192) == 256
    assert a.kernel_max_work_group(48) == 1024
    assert profiles.find_profile("a6xx").name == "adreno-6xx"
    assert profiles.find_profile("nope") is None


# --------------------------------------------------------------------------- the tuning space

@pytest.mark.parametrize("kernel", ["prefill", "decode"])
def test_each_space_is_data_with_reasons(kernel):
    """Both kernels declare one KernelSpace: parameters with candidates and meanings, constraints
    with reasons, the models, the problem and the metric."""
    space = tuning.SPACES[kernel]
    assert space.kernel == kernel and space.problem and space.metric and space.correctness and space.register_model
    for lay in space.layouts:
        assert lay.source.endswith(".cl") and lay.devices and lay.params and lay.constraints
        assert all(p.meaning and p.values and p.quick for p in lay.params)
        assert all(c.reason and c.name and c.check for c in lay.constraints)
        assert set(lay.required) | set(lay.optional) == {p.name for p in lay.params}
    dims = tuning.Dims(128, 128, 4, "float16")
    for p in space.candidates(dims):
        for name in ("private_floats", "local_bytes", "work_group_size"):
            assert getattr(space, name)(p, dims) > 0
    assert tuning.tunable_names(kernel) == space.param_names()


def test_prefill_space_candidates():
    space = tuning.SPACES["prefill"]
    assert space.layout_names == ("rows", "tiles") and space.modeled_layouts == ("rows",)
    cands = tuning.candidate_configs("prefill", 128, 128, 4, variants=("rows",))
    assert len(cands) == 5 * 4 * 4 * 2  # BLOCK_M x BLOCK_N x DV_TILE (16, 32, 64, 128) x Q_IN_REGS
    tiles = tuning.candidate_configs("prefill", 128, 128, 4, variants=("tiles",))
    assert len(tiles) == 2 * 2 * 4 * 2 * 2 * 2 and all(p["VARIANT"] == "tiles" for p in tiles)
    assert len(tuning.candidate_configs("prefill", 128, 128, 4)) == len(cands) + len(tiles)
    quick = tuning.candidate_configs("prefill", 64, 64, 16, quick=True, variants=("rows",))
    assert 0 < len(quick) <= 12
    only = tuning.candidate_configs("prefill", 64, 64, 4, overrides={"BLOCK_M": [32], "DV_TILE": [64]})
    assert {p["BLOCK_M"] for p in only} == {32} and {p["DV_TILE"] for p in only} == {64}
    just_tiles = tuning.candidate_configs("prefill", 64, 64, 4, overrides={"VARIANT": ["tiles"]})
    assert just_tiles and {tuning.variant_of(p) for p in just_tiles} == {"tiles"}


def test_tiles_constraints_and_model():
    good = {"VARIANT": "tiles", "BLOCK_M": 64, "BLOCK_N": 16, "DV_TILE": 64, "TILE_M": 8, "TILE_N": 2,
            "UNROLL_K": 4}
    assert tuning.violations("prefill", good, 64, 64, local_mem=48 * 1024, max_work_group=1024) == []
    assert tuning.work_group_size("prefill", good) == 8 * 8
    # the model was checked against ptxas at this point: 167 registers
    assert abs(tuning.private_floats("prefill", good, 64, 64) - 167) <= 8
    bad = dict(good, DV_TILE=48, TILE_N=3, UNROLL_K=5)
    names = {n for n, _ in tuning.violations("prefill", bad, 64, 96, local_mem=48 * 1024, max_work_group=1024)}
    assert {"micro_tile", "unroll_k"} <= names
    big = dict(good, BLOCK_M=128, BLOCK_N=32)
    assert {n for n, _ in tuning.violations("prefill", big, 256, 256, local_mem=32 * 1024,
                                            max_work_group=1024)} == {"local_fits"}
    assert tuning.violations("prefill", dict(good, VARIANT="nope"), 64, 64, local_mem=1 << 16,
                             max_work_group=1024)[0][0] == "well_formed"
    assert tuning.violations("prefill", dict(good, VEC=4), 64, 64, local_mem=1 << 16,
                             max_work_group=1024)[0][0] == "well_formed"


def test_violations_name_the_constraint():
    v = tuning.violations("prefill", {"BLOCK_M": 2048, "BLOCK_N": 64, "DV_TILE": 128, "VEC": 4}, 128, 128,
                          local_mem=32 * 1024, max_work_group=1024)
    names = {n for n, _ in v}
    assert names == {"local_fits", "work_group_fits"}
    assert any("65536 bytes of local memory" in m for _, m in v)


def _target(profile="adreno", mode="modeled"):
    p = profiles.PROFILES[profile]
    return tuner.Target(p, tuning.DeviceKey.modeled(p), mode, "0:0", "test", "drv", p.local_mem,
                        p.max_work_group, False)


def test_spill_verdict_strongest_signal_first():
    t = _target("nvidia", "measured")
    params = {"BLOCK_M": 64, "BLOCK_N": 32, "DV_TILE": 128, "VEC": 4}
    model = tuning.spill_model("prefill", params, 128, 128, t.profile)
    assert tuner.spill_verdict({"spill_stores": 8, "spill_loads": 8, "private_mem": 0}, model, params, t) == (
        True, "ptxas: 8/8 B spill st/ld")
    assert tuner.spill_verdict({"private_mem": 64}, model, params, t)[1].startswith("CL_KERNEL_PRIVATE_MEM_SIZE")
    assert tuner.spill_verdict({"kernel_max_work_group": 32}, model, params, t)[0] is True
    assert tuner.spill_verdict({}, model, params, t)[1].startswith("model")
    # model mode: only the model speaks, even if the compiler device reports something
    tm = _target("adreno")
    m2 = tuning.spill_model("prefill", params, 128, 128, tm.profile)
    assert tuner.spill_verdict({"spill_stores": 0, "spill_loads": 0}, m2, params, tm) == (
        True, "model: 352 floats > 192 regs")


def test_model_mode_plan_prunes_by_profile_limits():
    configs, pruned = tuner.plan(_target("adreno"), (1, 32, 8, 2048, 128, True))
    assert configs and pruned
    # only layouts whose register model was checked against a compiler are chosen blind
    assert {tuning.variant_of(p) for p in configs} <= set(tuning.SPACES["prefill"].modeled_layouts)
    measured, _ = tuner.plan(_target("adreno", "measured"), (1, 32, 8, 2048, 64, True))
    assert "tiles" in {tuning.variant_of(p) for p in measured}
    for p in configs:
        assert tuning.local_bytes("prefill", p, 128, 128) <= 32 * 1024
    assert all(v for _, v in pruned)


@pytest.mark.parametrize("profile,d", [("adreno", 128), ("adreno-6xx", 128), ("apple", 256), ("intel", 256)])
def test_quick_plan_has_a_non_spilling_tile_where_the_space_has_one(profile, d):
    """The quick list keeps q in registers; where that spills every quick tile, the full space's
    largest tile predicted not to spill is added (and so chosen in model mode)."""
    t = _target(profile)
    hard = t.profile.regs_hard
    quick, _ = tuner.plan(t, (1, 32, 8, 2048, d, True), quick=True)
    full, _ = tuner.plan(t, (1, 32, 8, 2048, d, True))
    safe = [p for p in full if tuning.private_floats("prefill", p, d, d) <= hard]
    assert safe and any(tuning.private_floats("prefill", p, d, d) <= hard for p in quick)
    assert len(quick) < len(full) // 4  # still quick
    best = max(safe, key=lambda p: tuning.SPACES["prefill"].rank(p, tuning.Dims(d, d), t.profile))
    assert best in quick


def test_quick_plan_adds_nothing_where_nothing_fits():
    t = _target("mali")  # 64 registers: every tile of the space spills
    quick, _ = tuner.plan(t, (1, 32, 8, 2048, 128, True), quick=True)
    only, _ = tuner.plan(t, (1, 32, 8, 2048, 128, True), quick=True, overrides={"Q_IN_REGS": [1]})
    assert quick == only and all(tuning.private_floats("prefill", p, 128, 128) > 64 for p in quick)


# --------------------------------------------------------------------------- profile defaults

def _all_candidates(space, dims, prof):
    """Every configuration of the space's full candidate lists in the layouts the profile sweeps,
    plus the default ladder's smaller prefill tiles (BLOCK_N 4, DV_TILE down to 4)."""
    cands = space.candidates(dims, 4, layouts=space.layouts_for(prof))
    if space.kernel == "prefill":
        cands += [{"BLOCK_M": 64, "BLOCK_N": bn, "DV_TILE": t, "VEC": 4, "Q_IN_REGS": q}
                  for bn in (4, 8) for t in range(4, dims.dv + 1, 4) if dims.dv % t == 0 for q in (0, 1)]
    return cands


@pytest.mark.parametrize("profile", sorted(profiles.PROFILES))
@pytest.mark.parametrize("kernel,dtype,group", [("prefill", "float16", 1), ("decode", "float16", 1),
                                               ("decode", "float16", 4), ("decode", "float16", 8),
                                               ("decode", "float32", 4), ("decode", "float32", 8)])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_profile_defaults_do_not_spill(profile, kernel, dtype, group, d):
    """A profile's default is valid on the profile's limits and fits its register room (regs_hard
    less the profile's model margin) by the model, with a work-group the modeled kernel allows;
    where no configuration of the space fits at all (decode with an fp16 cache on Mali's 64
    registers), it is the one with the fewest registers."""
    prof = profiles.PROFILES[profile]
    space, dims = tuning.SPACES[kernel], tuning.Dims(d, d, group, dtype)
    p = space.default(prof, dims, local_mem=prof.local_mem, max_work_group=prof.max_work_group)
    assert space.check(p, dims, {"local_mem": prof.local_mem, "max_work_group": prof.max_work_group}) == []
    floats, room = space.private_floats(p, dims), tuning.register_room(prof)
    fewest = min(space.private_floats(c, dims) for c in _all_candidates(space, dims, prof))
    assert floats <= room or floats == fewest > room, f"{profile} {kernel} d={d}: {p} models {floats} > {room}"
    assert space.work_group_size(p, dims) <= prof.kernel_max_work_group(floats)


@pytest.mark.parametrize("kernel", ["prefill", "decode"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_nvidia_defaults_fit_with_margin(kernel, d):
    """ptxas spilled 52 B for the former d=128 prefill default, modeled at 254 of 255 registers."""
    prof = profiles.PROFILES["nvidia"]
    assert prof.model_margin >= 28
    for group, dtype in ((1, "float16"), (4, "float16"), (8, "float16"), (8, "float32")):
        dims = tuning.Dims(d, d, group if kernel == "decode" else 1, dtype)
        p = tuning.SPACES[kernel].default(prof, dims, local_mem=prof.local_mem, max_work_group=prof.max_work_group)
        assert tuning.SPACES[kernel].private_floats(p, dims) <= prof.regs_hard - prof.model_margin


def test_defaults_that_fit_are_unchanged():
    """Only defaults the model says spill moved (and NVIDIA's, for its margin): the others are the
    largest tiles with q in registers, as before."""
    adreno = profiles.PROFILES["adreno"]
    assert tuning.default_params("prefill", adreno, 128, 128, local_mem=32768, max_work_group=1024) == {
        "BLOCK_M": 64, "BLOCK_N": 4, "DV_TILE": 16, "VEC": 4}
    assert tuning.default_params("prefill", adreno, 64, 64, local_mem=32768, max_work_group=1024) == {
        "BLOCK_M": 64, "BLOCK_N": 8, "DV_TILE": 64, "VEC": 4}
    cpu = profiles.PROFILES["cpu"]
    assert tuning.default_params("prefill", cpu, 64, 64, local_mem=1 << 20, max_work_group=4096) == {
        "BLOCK_M": 64, "BLOCK_N": 64, "DV_TILE": 64, "VEC": 16}
    # d=256: q alone exceeds Adreno's 192 registers, so q is re-read per KV tile
    d256 = tuning.default_params("prefill", adreno, 256, 256, local_mem=32768, max_work_group=1024)
    assert d256["Q_IN_REGS"] == 0 and tuning.private_floats("prefill", d256, 256, 256) <= 192


@pytest.mark.parametrize("dk, dv, block_n", [(64, 64, 64), (96, 96, 64), (128, 128, 32), (192, 192, 32),
                                              (256, 256, 16), (192, 128, 32), (64, 128, 64)])
def test_cpu_prefill_tiles_stay_in_l1(dk, dv, block_n):
    """CPU defaults keep the K/V tiles every work-item re-reads within the core's L1: the largest
    BLOCK_N that fits, with the whole DV in one pass."""
    cpu = profiles.PROFILES["cpu"]
    p = tuning.default_params("prefill", cpu, dk, dv, local_mem=1 << 20, max_work_group=4096)
    assert (p["BLOCK_N"], p["DV_TILE"]) == (block_n, dv)
    tile = 4 * p["BLOCK_N"] * (dk + p["DV_TILE"])
    assert tile <= cpu.tile_cache and (p["BLOCK_N"] == 64 or 2 * tile > cpu.tile_cache)


# --------------------------------------------------------------------------- plot

def _result(params, status="ok", spills=False, ms=1.0, floats=100, kernel="prefill"):
    return tuner.ConfigResult(params=params, status=status, spills=spills, model_floats=floats, median_ms=ms,
                              runs=5 if ms == ms else 0, kernel=kernel)


def test_plot_cells_show_each_cells_own_verdict_and_the_marks():
    """Two configurations share a cell (Q_IN_REGS 1 spills, 0 does not): the cell shows the one
    that stands for it, not a spill mark from the other; winner and largest are marked."""
    t = _target("adreno")
    spill = _result({"BLOCK_M": 64, "BLOCK_N": 16, "DV_TILE": 64, "VEC": 4}, spills=True, floats=260)
    fits = _result({"BLOCK_M": 64, "BLOCK_N": 16, "DV_TILE": 64, "VEC": 4, "Q_IN_REGS": 0}, floats=136)
    small = _result({"BLOCK_M": 32, "BLOCK_N": 16, "DV_TILE": 64, "VEC": 4, "Q_IN_REGS": 0}, floats=136)
    bad = _result({"BLOCK_M": 64, "BLOCK_N": 16, "DV_TILE": 32, "VEC": 4}, status="failed", ms=float("nan"))
    rep = tuner.Report(t, (1, 32, 8, 2048, 64, True), "float16", [spill, fits, small, bad], [], 4,
                       winner=fits, largest=fits)
    cells = tuner.plot_cells(rep)[16]
    assert cells[(64, 64)].shown is fits and cells[(64, 64)].verdict == "ok"
    assert cells[(64, 64)].winner and cells[(64, 64)].largest and len(cells[(64, 64)].results) == 2
    assert cells[(32, 64)].verdict == "ok" and not cells[(32, 64)].winner
    assert cells[(64, 32)].verdict == "X"
    assert cells[(64, 64)].value == 136  # model mode plots the modeled floats


def test_plot_colour_scale_ignores_outliers():
    vals = [1.0 + 0.01 * i for i in range(40)] + [250.0, float("nan")]
    lo, hi = tuner.color_limits(vals)
    assert 1.0 <= lo < hi < 2.0
    assert tuner.color_limits([3.0, 3.0]) == (2.5, 3.5) and tuner.color_limits([]) == (0.0, 1.0)


# --------------------------------------------------------------------------- database

def _entry(mode, bucket_n=2048, device="", params=None, profile="adreno"):
    prof = profiles.PROFILES[profile]
    key = tuning.DeviceKey(device, "adreno-740" if device else None, "adreno", prof.name) if device else \
        tuning.DeviceKey.modeled(prof)
    return tuning.make_entry("prefill", key, dtype="float16", dk=128, dv=128, causal=True, n=bucket_n,
                             params=params or {"BLOCK_M": 64, "BLOCK_N": 16, "DV_TILE": 32, "VEC": 4},
                             provenance={"mode": mode, "device": device or "model", "driver": "x",
                                         "flashcl": "0", "date": "today"})


def test_measured_entry_replaces_modeled(tmp_path):
    f = tmp_path / "db.json"
    tuning.save_entry(_entry("modeled"), f)
    tuning.save_entry(_entry("modeled"), f)             # same slot: replaced, not duplicated
    assert len(tuning.load_file(f)) == 1
    replaced = tuning.save_entry(_entry("measured", device="QUALCOMM Adreno(TM)"), f)
    assert len(replaced) == 1 and replaced[0]["provenance"]["mode"] == "modeled"
    entries = tuning.load_file(f)
    assert [e["provenance"]["mode"] for e in entries] == ["measured"]


def test_modeled_entry_is_found_for_its_profile_only(tuning_dir):
    tuning.save_entry(_entry("modeled"), tuning_dir / "m.json")
    key740 = tuning.DeviceKey.of("QUALCOMM Adreno(TM)", "OpenCL C 2.0 Adreno(TM) 740", "QUALCOMM", "adreno")
    key640 = tuning.DeviceKey.of("QUALCOMM Adreno(TM)", "OpenCL C 2.0 Adreno(TM) 640", "QUALCOMM", "adreno-6xx")
    kw = dict(dtype="float16", dk=128, dv=128, causal=True, n=2048)
    found = tuning.lookup("prefill", key740, **kw)
    assert found is not None and "(profile, bucket 2048, modeled)" in found.source
    assert tuning.lookup("prefill", key640, **kw) is None


def _writer(path, i):
    tuning.save_entry(_entry("measured", bucket_n=16 << i, device=f"dev{i}"), path)


def test_concurrent_writers_do_not_corrupt(tmp_path):
    f = tmp_path / "db.json"
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_writer, args=(f, i)) for i in range(8)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
    assert all(p.exitcode == 0 for p in procs)
    entries = tuning.load_file(f)
    assert sorted(e["device"] for e in entries) == sorted(f"dev{i}" for i in range(8))


def test_corrupt_database_names_the_file(tuning_dir):
    tuning_dir.mkdir(parents=True)
    bad = tuning_dir / "broken.json"
    bad.write_text("{ not json")
    key = tuning.DeviceKey("x", None, "cpu", "cpu")
    with pytest.raises(tuning.TuningDatabaseError, match="broken.json"):
        tuning.lookup("prefill", key, dtype="float32", dk=64, dv=64, causal=True, n=256)
    with pytest.raises(tuning.TuningDatabaseError, match="broken.json"):
        tuning.save_entry(_entry("modeled"), bad)
    assert bad.read_text() == "{ not json"          # never overwritten


# --------------------------------------------------------------------------- on a device

def _prob():
    from flashcl.opencl.prefill import PrefillProblem

    return PrefillProblem(1, 4, 2, 256, 256, 64, 64, True, "float32")


def test_hand_edited_bad_entry_is_rejected_with_warning(cpu_device, tuning_dir):
    from flashcl.opencl.prefill import choose_params
    from flashcl.opencl.runtime import get_device

    h = get_device(cpu_device)
    default = choose_params(h, _prob())
    key = tuning.DeviceKey.of(h.name, h.device.opencl_c_version, h.device.vendor, h.profile.name)
    tuning_dir.mkdir(parents=True)
    e = tuning.make_entry("prefill", key, dtype="float32", dk=64, dv=64, causal=True, n=256,
                          params={"BLOCK_M": 64, "BLOCK_N": 16, "DV_TILE": 48, "VEC": 4},
                          provenance={"mode": "measured"})
    (tuning_dir / "hand.json").write_text(json.dumps({"version": 1, "entries": [e]}))
    with pytest.warns(UserWarning, match=r"hand\.json.*DV_TILE=48 must divide DV=64"):
        got = choose_params(h, _prob())
    assert got.params == default.params and got.source.startswith("profile default")


def test_tuned_entry_is_picked_up_by_prefill(cpu_device, tuning_dir):
    """Tune with a candidate list that excludes the default: the next call's parameters change
    and name the database file; flashcl.prefill runs with them and stays exact."""
    import numpy as np

    import flashcl
    from flashcl import reference
    from flashcl.opencl.prefill import choose_params
    from flashcl.opencl.runtime import get_device

    h = get_device(cpu_device)
    before = choose_params(h, _prob())
    target = tuner.resolve_target(cpu_device)
    assert target.mode == "measured"
    over = {"BLOCK_M": [32], "BLOCK_N": [16], "DV_TILE": [32, 64]}
    over = {k: [x for x in v if x != before.params[k]] or v for k, v in over.items()}
    report = tuner.run_sweep(target, (1, 4, 2, 256, 64, True), "float32", overrides=over, repeats=5,
                             isolate=False)
    assert report.winner is not None and report.winner.status == "ok" and report.winner.runs >= 5
    path = tuner.save(report)
    after = choose_params(h, _prob())
    assert after.params == report.winner.params != before.params
    assert str(path) in after.source and "measured" in after.source
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((4, 256, 64), (2, 256, 64), (2, 256, 64)))
    out = flashcl.prefill(q, k, v, causal=True, device=cpu_device)
    ref = reference.attention(q, k, v, causal=True)
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-5


def test_interrupt_keeps_results_and_resume_continues(cpu_device):
    target = tuner.resolve_target(cpu_device)
    over = {"BLOCK_M": [32, 64], "BLOCK_N": [16], "DV_TILE": [64], "Q_IN_REGS": [1]}
    seen = []

    def stop_after_first(r):
        seen.append(r)
        raise KeyboardInterrupt

    shape = (1, 2, 1, 128, 64, True)
    rep = tuner.run_sweep(target, shape, "float32", overrides=over, repeats=5, isolate=False,
                          on_result=stop_after_first)
    assert rep.interrupted and len(rep.results) == 1
    starts = []
    rep2 = tuner.run_sweep(target, shape, "float32", overrides=over, repeats=5, isolate=False, resume=True,
                           on_start=lambda todo, done: starts.append((todo, done)))
    assert starts == [(1, 1)] and not rep2.interrupted and len(rep2.results) == 2
    assert not list((tuning.user_tuning_dir() / "resume").glob("*.json"))  # finished: removed


def _interrupted_sweep(cpu_device, **kw):
    target = tuner.resolve_target(cpu_device)
    over = {"BLOCK_M": [32, 64], "BLOCK_N": [16], "DV_TILE": [64], "Q_IN_REGS": [1]}

    def stop_after_first(r):
        raise KeyboardInterrupt

    shape = (1, 2, 1, 128, 64, True)
    rep = tuner.run_sweep(target, shape, "float32", overrides=over, repeats=5, isolate=False,
                          on_result=stop_after_first, **kw)
    assert rep.interrupted and len(rep.results) == 1
    return target, shape, over, rep


def test_resume_keeps_only_well_formed_results_of_this_plan(cpu_device):
    """A hand-edited resume file: a result with params outside the plan (it could win with a
    made-up time) and one with times that are not numbers are left out, with a note, and measured
    again; nothing raises."""
    target, shape, over, rep = _interrupted_sweep(cpu_device)
    path = Path(rep.resume_file)
    data = json.loads(path.read_text())
    alien = dict(data["results"][0], params=dict(data["results"][0]["params"], BLOCK_M=512), times_ms=[1e-3] * 5)
    good = data["results"][0]
    bools = dict(good, times_ms=[True] * 5)
    text = dict(good, times_ms="fast")
    path.write_text(json.dumps({"version": 1, "results": [text, alien, bools, good, good]}))  # good twice
    starts = []
    rep2 = tuner.run_sweep(target, shape, "float32", overrides=over, repeats=5, isolate=False, resume=True,
                           on_start=lambda todo, done: starts.append((todo, done)))
    assert starts == [(1, 1)] and len(rep2.results) == 2 and rep2.winner.params["BLOCK_M"] in (32, 64)
    assert any("4 results of resume file" in n and "left out" in n for n in rep2.notes), rep2.notes
    path.write_text("{garbage")
    _, _, _, rep3 = _interrupted_sweep(cpu_device, resume=True)
    assert any("unreadable" in n for n in rep3.notes), rep3.notes


def test_no_resume_file_without_write_resume_and_kept_until_saved(cpu_device):
    _, _, _, rep = _interrupted_sweep(cpu_device, write_resume=False)
    assert rep.resume_file == "" and not list((tuning.user_tuning_dir() / "resume").glob("*.json"))
    target = tuner.resolve_target(cpu_device)
    over = {"BLOCK_M": [32], "BLOCK_N": [16], "DV_TILE": [64], "Q_IN_REGS": [1]}
    rep = tuner.run_sweep(target, (1, 2, 1, 128, 64, True), "float32", overrides=over, repeats=5,
                          isolate=False, keep_resume=True)
    assert not rep.interrupted and Path(rep.resume_file).exists()  # a failed save would lose nothing
    tuner.remove_resume_file(rep)
    assert not Path(rep.resume_file).exists()


def test_hung_configuration_costs_only_itself(cpu_device):
    """A worker that does not answer within the timeout is killed and the config marked failed."""
    setup = tuner.Setup(cpu_device, (1, 2, 1, 128, 64, True), "float32", "modeled", 5, False)
    runner = tuner.IsolatedRunner(setup, timeout=1e-3)
    try:
        res = runner.evaluate({"BLOCK_M": 32, "BLOCK_N": 16, "DV_TILE": 64, "VEC": 16})
    finally:
        runner.close()
    assert res["status"] == "failed" and res["error"].startswith("timeout")


def test_worker_ignores_ctrl_c(cpu_device, capfd):
    """Ctrl-C reaches the whole process group; the parent stops the sweep and kills the worker,
    so the worker must neither die of it nor print a KeyboardInterrupt traceback."""
    import os
    import signal

    setup = tuner.Setup(cpu_device, (1, 2, 1, 128, 64, True), "float32", "modeled", 5, False)
    runner = tuner.IsolatedRunner(setup, timeout=120)
    try:
        runner._start()
        os.kill(runner.proc.pid, signal.SIGINT)
        res = runner.evaluate({"BLOCK_M": 32, "BLOCK_N": 16, "DV_TILE": 64, "VEC": 16})
    finally:
        runner.close()
    assert res["status"] == "ok", res["error"]
    assert "KeyboardInterrupt" not in capfd.readouterr().err


def test_model_mode_sweep_builds_and_chooses_largest_non_spilling(cpu_device):
    target = tuner.resolve_target("adreno")
    assert target.mode == "modeled" and target.key.vendor == "adreno"
    over = {"BLOCK_M": [64], "BLOCK_N": [16, 32], "DV_TILE": [16, 32, 64]}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rep = tuner.run_sweep(target, (1, 32, 8, 2048, 128, True), "float32", overrides=over, isolate=False)
    assert all(r.status == "ok" and r.signal.startswith("model") for r in rep.results)
    safe = [r for r in rep.results if not r.spills]
    assert rep.winner is rep.largest and rep.winner in safe
    assert rep.winner.model_floats == max(r.model_floats for r in safe)
    assert any(r.spills for r in rep.results)  # d=128: the wider tiles exceed 192 registers


def test_ptxas_report_per_kernel():
    """A program with several kernels: each kernel's registers and spills come from its own
    section of the ptxas report (decode.cl builds three kernels; the first section is not the
    decode kernel's). Log lines as NVIDIA's OpenCL compiler writes them with -cl-nv-verbose."""
    from flashcl.opencl.runtime import ptxas_section

    log = (
        "ptxas info    : 0 bytes gmem\n"
        "ptxas info    : Compiling entry function 'flash_decode_merge' for 'sm_90a'\n"
        "ptxas info    : Function properties for flash_decode_merge\n"
        "ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
        "ptxas info    : Used 32 registers, used 1 barriers, 260 bytes smem\n"
        "ptxas info    : Compiling entry function 'flash_decode_split' for 'sm_90a'\n"
        "ptxas info    : Function properties for flash_decode_split\n"
        "ptxas         .     8 bytes stack frame, 12 bytes spill stores, 16 bytes spill loads\n"
        "ptxas info    : Used 185 registers, used 1 barriers, 11584 bytes smem\n"
    )
    split = ptxas_section(log, "flash_decode_split")
    assert "Used 185 registers" in split and "12 bytes spill stores" in split
    assert "Used 32 registers" in ptxas_section(log, "flash_decode_merge")
    assert "Used 185" not in ptxas_section(log, "flash_decode_merge")
    assert ptxas_section(log, "flash_decode") == ""  # a prefix of another name is not a match
    assert ptxas_section("Used 40 registers", "anything") == "Used 40 registers"  # no sections


_SWEEP_OVER = {"BLOCK_M": [32, 64], "BLOCK_N": [16], "DV_TILE": [64], "Q_IN_REGS": [1]}
_SWEEP_SHAPE = (1, 2, 1, 128, 64, True)


def _statuses(rep):
    return {r.label: r.status for r in rep.results}


def test_parallel_prebuild_sweep_matches_one_process(cpu_device):
    """Two builder processes ahead of the timing worker change nothing a sweep decides but the
    timings: the same configurations, statuses and largest non-spilling tile as in-process."""
    target = tuner.resolve_target(cpu_device)
    inline = tuner.run_sweep(target, _SWEEP_SHAPE, "float32", overrides=_SWEEP_OVER, repeats=5, isolate=False)
    pooled = tuner.run_sweep(target, _SWEEP_SHAPE, "float32", overrides=_SWEEP_OVER, repeats=5, jobs=2)
    assert _statuses(pooled) == _statuses(inline) and set(_statuses(inline).values()) == {"ok"}
    assert pooled.largest.params == inline.largest.params
    assert pooled.winner is not None and pooled.winner.runs >= 5


def test_prebuild_in_another_process_is_a_disk_cache_hit(cpu_device, tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHCL_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("FLASHCL_PROGRAM_CACHE", "on")  # off by default on CPU devices
    setup = tuner.Setup(cpu_device, _SWEEP_SHAPE, "float32", "measured", 5, False)
    params = {"BLOCK_M": 32, "BLOCK_N": 16, "DV_TILE": 64, "VEC": 16, "Q_IN_REGS": 1}
    pre = tuner.Prebuilder(setup, [params], 1, timeout=120)
    try:
        assert pre.wait(params) is None  # built: the timing worker evaluates it
    finally:
        pre.close()
    ev = tuner.make_evaluator(setup, build_only=True)
    ev.h.programs.clear()  # this process may hold them from an earlier test's in-process sweep
    assert ev._kernel(ev.small, params).built.origin == "disk cache"
    assert ev._kernel(ev.prob, params).built.origin == "disk cache"


def test_crashed_prebuild_costs_only_its_prebuild(cpu_device, monkeypatch):
    """A builder that dies on one configuration (the worker exits without answering, as on a
    compiler crash): the timing worker builds that configuration itself and the sweep goes on."""
    target = tuner.resolve_target(cpu_device)
    crashed = []
    call = tuner.IsolatedRunner._call

    def crash_on_block_m_64(self, msg, timeout):
        if msg[0] == "build" and msg[1]["BLOCK_M"] == 64:
            kind, payload = call(self, ("stop",), timeout)
            crashed.append(kind)
            return kind, payload
        return call(self, msg, timeout)

    monkeypatch.setattr(tuner.IsolatedRunner, "_call", crash_on_block_m_64)
    rep = tuner.run_sweep(target, _SWEEP_SHAPE, "float32", overrides=_SWEEP_OVER, repeats=5, jobs=2)
    assert crashed == ["crash"]
    assert len(rep.results) == 2 and all(r.status == "ok" for r in rep.results), _statuses(rep)


def test_failed_prebuild_is_the_configurations_result(cpu_device):
    """A clean build failure in a builder is recorded as evaluate records it, not built again."""
    setup = tuner.Setup(cpu_device, _SWEEP_SHAPE, "float32", "measured", 5, False)
    params = {"BLOCK_M": 32, "BLOCK_N": 16, "DV_TILE": 64, "VEC": 5, "Q_IN_REGS": 1}  # prefill.cl's #error
    pre = tuner.Prebuilder(setup, [params], 1, timeout=120)
    try:
        res = pre.wait(params)
    finally:
        pre.close()
    assert res is not None and res["status"] == "failed" and res["error"]
