"""``flashcl export``: the self-contained sources, manifest.json and the C example, built and run
as an app would (the system C compiler against the OpenCL ICD loader), for an attached PoCL CPU
device and for Adreno in model mode. The C tests skip, naming what is missing, only where there
is no C compiler, no OpenCL headers or loader, or no platform the system loader sees; CI installs
them (.ci/run)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import flashcl
from flashcl import __version__, cli, tuning
from flashcl.opencl import decode as dec
from flashcl.opencl import prefill as pre
from flashcl.opencl import runtime
from flashcl.profiles import PROFILES
from flashcl.reference import TOLERANCE
from flashcl.tools import export as ex

PREFILL = "prefill:1,8,2,256,64,1"   # causal GQA 4:1, d = 64
PREFILL_NC = "prefill:2,4,4,100,64,0"
DECODE = "decode:2,8,2,256,64"       # GQA 4:1, d = 64
KERNELS = {"flash_prefill", "flash_decode", "flash_decode_split", "flash_decode_merge"}
LINE = re.compile(r"^(prefill|decode) +(\S+): .*: out rel err (\S+), lse rel err (\S+) "
                  r"\(tolerance (\S+)\) (ok|FAILED)$", re.MULTILINE)


def run(*args):
    return CliRunner().invoke(cli.main, list(args), catch_exceptions=False)


def export(out: Path, *args) -> dict:
    r = run("export", "--out", str(out), *args)
    assert r.exit_code == 0, r.output
    return r, json.loads((out / "manifest.json").read_text())


@pytest.fixture(scope="module")
def toolchain(tmp_path_factory):
    """The C compiler ($CC, else cc), the OpenCL headers and ICD loader, and a platform the system
    loader sees; a skip naming what is missing otherwise."""
    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None:
        pytest.skip(f"no C compiler ({cc}): apt-get install gcc")
    d = tmp_path_factory.mktemp("cl-probe")
    (d / "probe.c").write_text("#define CL_TARGET_OPENCL_VERSION 120\n#include <CL/cl.h>\n#include <stdio.h>\n"
                               "int main(void) { cl_uint n = 0; clGetPlatformIDs(0, NULL, &n); "
                               "printf(\"%u\\n\", n); return 0; }\n")
    build = subprocess.run([cc, "-o", str(d / "probe"), str(d / "probe.c"), "-lOpenCL"], capture_output=True, text=True)
    if build.returncode != 0:
        first = next((ln for ln in build.stderr.splitlines() if "error" in ln), build.stderr.strip()[:200])
        pytest.skip(f"the OpenCL headers or ICD loader are missing (apt-get install ocl-icd-opencl-dev "
                    f"opencl-headers): {first}")
    n = subprocess.run([str(d / "probe")], capture_output=True, text=True)
    if n.returncode != 0 or n.stdout.strip() in ("", "0"):
        pytest.skip("the system OpenCL ICD loader sees no platform (apt-get install pocl-opencl-icd)")
    return cc


def run_example(folder: Path, toolchain: str):
    env = {k: v for k, v in os.environ.items() if k != "FLASHCL_EXAMPLE_DEVICE"}
    env["CC"] = toolchain
    proc = subprocess.run([str(folder / "run_example.sh")], capture_output=True, text=True, env=env, timeout=600)
    return proc, {(m.group(1), m.group(2), i): m.groups()[2:] for i, m in enumerate(LINE.finditer(proc.stdout))}


def assert_example_passes(folder: Path, toolchain: str, manifest: dict):
    proc, checks = run_example(folder, toolchain)
    assert proc.returncode == 0, f"run_example.sh failed:\n{proc.stdout}\n{proc.stderr[-3000:]}"
    ex = manifest["example"]
    runs = ([c["example"] for c in manifest["variants"]["combinations"]] if "variants" in manifest
            else [{"prefill": ex["prefill"]["file"], "decode": ex["decode"]["file"]}])
    # per combination of variants: one prefill, then the paged decode with split-k + merge and with one split
    assert [(k, f) for k, f, _ in checks] == [(k, r[k]) for r in runs for k in ("prefill", "decode", "decode")], \
        proc.stdout
    for (kind, f, _), (out_err, lse_err, tol, verdict) in checks.items():
        tol = float(tol)
        dtype = next(s["problem"]["dtype"] for s in manifest["sources"] if s["file"] == f)
        assert tol == TOLERANCE[dtype]
        assert float(out_err) <= tol and float(lse_err) <= tol and verdict == "ok", proc.stdout
    assert "3 splits + merge" in proc.stdout and "1 split:" in proc.stdout
    assert re.search(r"^max relative error \S+: every check within tolerance$", proc.stdout, re.MULTILINE)
    return proc


# --------------------------------------------------------------------------- the manifest

def _signature(text: str, name: str, problem: dict) -> list[tuple[str, str]]:
    """(type without spaces, name) of each parameter of kernel ``name`` in an exported source, read
    from the text (decode.cl's two decode kernels take the DECODE_PARAMS macro, then VARIANT_PARAMS
    in builds with a variant on and QUANT_PARAMS in int8 builds)."""
    text = re.sub(r"/\*.*?\*/|//[^\n]*", " ", text, flags=re.DOTALL).replace("\\\n", " ")
    if name in ("flash_decode", "flash_decode_split"):
        assert re.search(rf"DECODE_KERNEL\({name},", text)
        body = re.search(r"#define DECODE_PARAMS([^\n]*)", text).group(1)
        for macro, on in (("VARIANT_PARAMS", problem.get("variants")),
                          ("QUANT_PARAMS", problem.get("kv_format") == "int8")):
            if on:  # its first definition, the one with parameters (the #else one is empty)
                body += "," + re.search(rf"#define {macro} ,([^\n]*)", text).group(1)
        key_start = re.search(r"#define KEY_START_PARAM ,([^\n]*)", text).group(1)
        body = body.replace("KEY_START_PARAM", "," + key_start if "key_start" in problem.get("variants", ()) else "")
        body = body.replace("ROW_MASK_PARAM", "")  # prefill's route only: never exported
    else:
        body = re.search(rf"void\s+{name}\s*\((.*?)\)\s*{{", text, re.DOTALL).group(1)
    params = []
    for p in body.split(","):
        m = re.search(r"(\w+)\s*$", p)
        params.append((re.sub(r"\s+", "", p[:m.start()]), m.group(1)))
    return params


def _spec_of(kernel: str, problem: dict | None = None):
    """The argument spec of ``kernel`` for an exported class (None: the plain one)."""
    decode = ex.decode_arg_spec(problem or {})
    return {"flash_prefill": pre.ARGS, "flash_prefill_tiles": pre.ARGS, "flash_decode": decode,
            "flash_decode_split": decode, "flash_decode_merge": dec.MERGE_ARGS}[kernel]


def check_manifest(out: Path, m: dict, *, dtype: str, mode: str):
    assert m["flashcl"] == __version__ and m["format"] == 1 and m["build_options"] == ""
    assert m["target"]["mode"] == mode and m["target"]["modeled"] == (mode == "modeled")
    store, raw = {"float16": ("half", "uint4"), "bfloat16": ("ushort", "uint4")}.get(dtype, ("float", "float4"))
    for s in m["sources"]:
        text = (out / s["file"]).read_text()
        assert hashlib.sha256(text.encode()).hexdigest() == s["sha256"]
        # self-contained: the version and provenance on top, the defines fixed, no include left
        assert text.startswith(f"/* flashcl {__version__}: clkernels/") and "  from: " in text
        assert not re.search(r'^\s*#\s*include', text, re.MULTILINE)
        assert f"#define STORE_HALF {int(dtype == 'float16')}\n" in text
        assert f"#define STORE_BF16 {int(dtype == 'bfloat16')}\n" in text
    assert {k["name"] for k in m["kernels"]} == KERNELS
    for k in m["kernels"]:
        text = (out / k["file"]).read_text()
        for name, value in k["defines"].items():
            assert f"\n#define {name} {value}\n" in text
        # every argument in order, as the kernel declares it and as the Python host passes it
        spec = _spec_of(k["name"], k["problem"])
        assert [a["name"] for a in k["args"]] == [n for n, _, _ in spec]
        assert [a["index"] for a in k["args"]] == list(range(len(spec)))
        declared = _signature(text, k["name"], k["problem"])
        assert [n for _, n in declared] == [a["name"] for a in k["args"]]
        for (ctype, _), (_, spec_type, _), a in zip(declared, spec, k["args"]):
            assert ctype == spec_type.replace(" ", ""), (k["name"], a)
            assert a["type"] == spec_type.replace("store_t", store).replace("raw_t", raw)
            host = ("local memory" if spec_type.startswith("__local") else "cl_mem" if "*" in spec_type
                    else "cl_" + spec_type.split()[-1])
            assert a["host"].startswith(host) and a["meaning"], (k["name"], a)
        assert k["build_options"] == "" and k["global_size"] and k["local_size"][0] >= 1
        src = k["parameters_from"]
        assert src["source"] and src["why"] and src["mode"]


def test_export_measured_on_pocl_builds_and_runs(cpu_device, tmp_path, request):
    out = tmp_path / "export"
    r, m = export(out, "--device", cpu_device, "--shape", PREFILL, "--shape", PREFILL_NC, "--shape", DECODE)
    assert r.stdout.startswith("# measured: ")
    check_manifest(out, m, dtype="float16", mode="measured")
    handle = runtime.get_device(cpu_device)
    assert m["target"]["device"] == handle.name and m["target"]["driver"] == handle.driver
    assert any("decode_cpu.cl" in n and "not exported" in n for n in m["notes"])  # the CPU's own decode

    # the parameters, grids and head sections are the library's own for each shape
    for shape, causal in (((1, 8, 2, 256, 64), True), ((2, 4, 4, 100, 64), False)):
        b, hq, hkv, n, d = shape
        prob = pre.PrefillProblem(b, hq, hkv, n, n, d, d, causal, "float16")
        params = pre.choose_params(handle, prob).params
        [k] = [k for k in m["kernels"] if k["name"] == "flash_prefill" and k["problem"]["causal"] == causal]
        assert k["params"] == params and k["defines"]["UNROLL_LOOPS"] == 0  # a CPU
        assert k["defines"] == {n_: int(v) if isinstance(v, bool) else v
                                for n_, v in pre.program(prob, params, write_lse=True, unroll_loops=False)[2].items()}
        [launch] = k["launches"]
        assert launch["shape"] == {"B": b, "H_q": hq, "H_kv": hkv, "N_q": n, "N_kv": n}
        assert (tuple(launch["global_size"]), tuple(launch["local_size"])) == pre.launch_grid(prob, params)
        assert launch["head_section"] == pre.head_section(prob, handle.device.global_mem_cache_size)
        assert k["global_size"][0] == f"B * H_q * ceil(N_q / {params['BLOCK_M']}) * {d // params['DV_TILE']} * " \
                                      f"{launch['local_size'][0]}"
    prob = dec.DecodeProblem(2, 8, 2, 64, 64, True, "float16")
    params = dec.choose_params(handle, prob, None, 256).params
    if dec.is_rows(params):  # a CPU's decode_cpu.cl is not exported: decode.cl's layout is
        params = dec.layout_params(handle, prob, "lanes")
    kern = {k["name"]: k for k in m["kernels"] if "decode" in k["name"]}
    wg = dec.work_group_size(params, 4, 64, 64, "float16")
    splits = dec.choose_num_splits(int(handle.device.max_compute_units), 4, 256, params=params)
    assert kern["flash_decode"]["params"] == params and kern["flash_decode"]["local_size"] == [wg, 1, 1]
    assert kern["flash_decode"]["defines"]["GROUP"] == 4 and kern["flash_decode"]["defines"]["PAGED"] == 1
    assert kern["flash_decode_split"]["global_size"] == [f"{wg} * num_splits", "H_kv", "B"]
    assert kern["flash_decode_merge"]["local_size"] == [params["MERGE_WG"], 1]
    assert kern["flash_decode"]["launches"][0]["shape"]["auto_splits"] == splits
    if splits > 1:
        [sl] = kern["flash_decode_split"]["launches"]
        assert tuple(sl["global_size"]) == dec.launch_grid(prob, wg, splits)[0]
        [ml] = kern["flash_decode_merge"]["launches"]
        assert tuple(ml["global_size"]) == dec.merge_grid(prob, params["MERGE_WG"])[0]

    proc = assert_example_passes(out, request.getfixturevalue("toolchain"), m)
    assert re.search(r"^device: .*: built 3 exported sources$", proc.stdout, re.MULTILINE), proc.stdout


def test_export_model_mode_for_adreno(tmp_path, tuning_dir, request):
    """No Adreno attached: the tiles are the profile's modeled entry (here one the test stores, as
    `flashcl tune --device adreno` would) or the profile default; the manifest and the CLI say the
    parameters were not measured; the example still runs on this machine's device."""
    prof = PROFILES["adreno"]
    key = tuning.DeviceKey.modeled(prof)
    modeled = {"BLOCK_M": 32, "BLOCK_N": 16, "DV_TILE": 32, "VEC": 4}
    dims = tuning.Dims(64, 64, 1, "float32")
    assert tuning.SPACES["prefill"].check(modeled, dims, {"local_mem": prof.local_mem,
                                                          "max_work_group": prof.max_work_group}) == []
    db = tuning_dir / "model-adreno.json"
    tuning.save_entry(tuning.make_entry("prefill", key, dtype="float32", dk=64, dv=64, causal=True, n=256,
                                        params=modeled, provenance={"mode": "modeled", "flashcl": __version__,
                                                                    "date": "2026-01-01"}), db)
    out = tmp_path / "adreno"
    r, m = export(out, "--device", "adreno", "--dtype", "float32", "--shape", PREFILL, "--shape", DECODE)
    first = r.stdout.splitlines()[0]
    assert first.startswith("# model mode: no adreno device is attached") and "not measured" in first
    check_manifest(out, m, dtype="float32", mode="modeled")
    assert m["target"]["device"] == "adreno (profile)" and m["target"]["driver"] is None
    assert any("model mode" in n for n in m["notes"])
    [pk] = [k for k in m["kernels"] if k["name"] == "flash_prefill"]
    assert pk["params"] == modeled and pk["defines"]["UNROLL_LOOPS"] == 1  # a GPU profile
    assert pk["parameters_from"]["mode"] == "modeled" and db.name in pk["parameters_from"]["source"]
    assert pk["launches"][0]["head_section"] is None  # the cache size of an absent device is unknown
    # decode has no entry: the profile default, as show-config gives it
    dk = next(k for k in m["kernels"] if k["name"] == "flash_decode")
    default = tuning.SPACES["decode"].default(prof, tuning.Dims(64, 64, 4, "float32"), local_mem=prof.local_mem,
                                              max_work_group=prof.max_work_group)
    assert dk["params"] == default and dk["parameters_from"]["mode"] == "profile default (model mode)"
    assert dk["defines"]["ROW_SHUFFLE"] == 0 and dk["launches"][0]["shape"]["auto_splits"] is None
    text = (out / pk["file"]).read_text()
    assert "(model mode: parameters not measured)" in text.splitlines()[0] and "modeled" in text[:2000]
    assert_example_passes(out, request.getfixturevalue("toolchain"), m)


def test_the_example_catches_a_wrong_define_or_scale(cpu_device, tmp_path, toolchain):
    """The C reference is a real check: the prefill exported non-causal (one define flipped) or
    launched with the scale not multiplied by log2(e) fails, exit 1, while the decode runs stay
    right; another valid tile (BLOCK_N) changes nothing but speed."""
    out = tmp_path / "export"
    _, m = export(out, "--device", cpu_device, "--dtype", "float32", "--shape", PREFILL, "--shape", DECODE)
    src = out / m["example"]["prefill"]["file"]
    good = src.read_text()

    src.write_text(good.replace("\n#define IS_CAUSAL 1\n", "\n#define IS_CAUSAL 0\n", 1))
    proc, checks = run_example(out, toolchain)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    verdicts = [(kind, v[-1]) for (kind, _, _), v in checks.items()]
    assert verdicts == [("prefill", "FAILED"), ("decode", "ok"), ("decode", "ok")], proc.stdout
    assert float(next(iter(checks.values()))[0]) > 1e-2

    [k] = [k for k in m["kernels"] if k["name"] == "flash_prefill"]
    bn, vec = k["defines"]["BLOCK_N"], k["defines"]["VEC"]
    other = bn // 2 if (bn // 2) % vec == 0 and bn // 2 >= vec else bn * 2
    src.write_text(good.replace(f"\n#define BLOCK_N {bn}\n", f"\n#define BLOCK_N {other}\n", 1))
    assert_example_passes(out, toolchain, m)

    src.write_text(good)
    example = out / "example.c"
    c = example.read_text()
    wrong = c.replace("arg_float(&a, (cl_float)(scale * LOG2E));", "arg_float(&a, (cl_float)scale);")
    assert wrong.count("(cl_float)scale)") == 2  # prefill and decode
    example.write_text(wrong)
    proc, checks = run_example(out, toolchain)
    assert proc.returncode == 1 and [v[-1] for v in checks.values()] == ["FAILED"] * 3, proc.stdout


# --------------------------------------------------------------------------- variants and quantized caches

ALL = ",".join(ex.VARIANTS)


def check_variant_export(out: Path, m: dict, combos: list, kv_format):
    """Each combination has sources of its own (decode: without the mask) that fix it and say so
    in their name, problem and defines; the manifest documents the values and the format's bytes;
    the example config runs every combination."""
    combos = [c.split(",") if c else [] for c in combos] or [[]]
    for k in m["kernels"]:
        on = k["problem"].get("variants", [])
        prefill = k["name"].startswith("flash_prefill")
        only = "key_start" if prefill else "mask"  # what the other kernel alone takes
        assert on in [[x for x in c if x != only] for c in combos], k["problem"]
        assert k["problem"].get("kv_format") == kv_format, k["problem"]
        assert k["file"].endswith("".join(f"-{x}" for x in on) + (f"-{kv_format}" if kv_format else "") + ".cl")
        d = k["defines"]
        if prefill:
            want = {f"HAS_{x.upper()}": 1 for x in on if x != "mask"} | ({"MASK_KIND": 1} if "mask" in on else {})
            assert {n: v for n, v in d.items() if n.startswith("HAS_") or n == "MASK_KIND"} == want
        else:
            assert {n: d.get(n, 0) for n in ("WINDOW", "SOFTCAP", "SINKS", "ALIBI", "KEY_START")} == \
                {x.upper(): int(x in on) for x in ("window", "softcap", "sinks", "alibi", "key_start")}
        code = {"q8_0": 1, "q4_0": 2, "int8": 3}.get(kv_format)
        assert (d.get("K_QUANT"), d.get("V_QUANT")) == (code, code)
    config = (out / "example_config.h").read_text()
    if any(combos):
        assert [c["on"] for c in m["variants"]["combinations"]] == combos
        assert f"\n#define EX_NUM_COMBOS {len(combos)}\n" in config
        assert "exp(sink - m)" in m["variants"]["semantics"]["sinks"]
    else:
        assert "variants" not in m and "EX_NUM_COMBOS" not in config
    if kv_format:
        assert m["kv_format"]["name"] == kv_format and m["kv_format"]["defines"] == {"K_QUANT": code, "V_QUANT": code}
        assert f'#define EX_KV_FORMAT {code}\n' in config
        layout = m["kv_format"]["row"] + m["kv_format"]["value"]
        assert {"q8_0": "fp16 d", "q4_0": "low nibble", "int8": "float32 scale"}[kv_format] in layout
    else:
        assert "kv_format" not in m and "EX_KV_FORMAT" not in config


@pytest.mark.parametrize("dtype, shape, combos, kv_format, model_mode", [
    ("float16", PREFILL, [ALL], None, False),            # every variant on a causal GQA prefill
    ("float32", PREFILL, [], "q8_0", False),
    ("float16", PREFILL_NC, [ALL], "q4_0", True),        # non-causal: window (7, 3); adreno's tiles
    ("float32", PREFILL, ["window,sinks"], "int8", False),
    ("float16", PREFILL, ["none", "mask", "softcap,alibi"], None, False),  # several combinations
    ("float32", PREFILL, ["key_start", "window,key_start", "mask"], "int8", False),  # decode's own variant
], ids=["variants", "q8_0", "q4_0-variants-adreno", "int8-window-sinks", "combinations", "key_start"])
def test_export_variants_and_quantized_caches_run(dtype, shape, combos, kv_format, model_mode, tmp_path,
                                                  tuning_dir, request):
    """The exported combinations build as written and example.c runs each: the variants' values,
    K/V quantized in C, checked against its reference in double within the dtype's tolerance."""
    device = "adreno" if model_mode else request.getfixturevalue("cpu_device")
    out = tmp_path / "export"
    args = ["--device", device, "--dtype", dtype, "--shape", shape, "--shape", DECODE]
    _, m = export(out, *args, *(a for c in combos for a in ("--variants", c)),
                  *(["--kv-format", kv_format] if kv_format else []))
    check_manifest(out, m, dtype=dtype, mode="modeled" if model_mode else "measured")
    combos = ["" if c == "none" else c for c in combos]
    check_variant_export(out, m, combos, kv_format)
    prefill_combos = {tuple(x for x in c.split(",") if x and x != "key_start") for c in combos or [""]}
    decode_combos = {tuple(x for x in c.split(",") if x and x != "mask") for c in combos or [""]}
    assert len(m["sources"]) == len(prefill_combos) + len(decode_combos)  # each kernel's own variants
    proc = assert_example_passes(out, request.getfixturevalue("toolchain"), m)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(("prefill", "decode"))]
    for c, (prefill, *decodes) in zip(combos or [""], (lines[i:i + 3] for i in range(0, len(lines), 3))):
        if "window" in c:
            assert ("window (7,3)" if shape == PREFILL_NC else "window (7,0)") in prefill
            assert all("window (20,0)" in ln for ln in decodes)
        assert ("mask" in prefill) == ("mask" in c) and not any("mask" in ln for ln in decodes)
        assert "key_start" not in prefill and all(("key_start 13,17" in ln) == ("key_start" in c) for ln in decodes)
    if kv_format:
        assert all(f" {kv_format} K/V" in ln for ln in lines), proc.stdout


def test_export_int8_float16_head_dim_not_a_multiple_of_16(cpu_device, tmp_path, toolchain):
    """float16 int8 rows need 8-byte alignment (decode.cl reads 8 values a lane): d = 40 exports
    and its example passes, as the library runs it."""
    out = tmp_path / "export"
    _, m = export(out, "--device", cpu_device, "--dtype", "float16", "--kv-format", "int8",
                  "--shape", "prefill:1,4,2,64,40,1", "--shape", "decode:1,4,2,64,40")
    assert "int8 rows 8-byte" in m["kv_format"]["addressing"]
    assert_example_passes(out, toolchain, m)


@pytest.mark.parametrize("kv_format", [None, "q8_0"])
def test_export_dk_ne_dv(cpu_device, tmp_path, toolchain, kv_format):
    """Head dims DK/DV (e.g. 192/128 in real models): the sources, the manifest's classes and the
    example all take them."""
    out = tmp_path / "export"
    _, m = export(out, "--device", cpu_device, "--dtype", "float16", "--shape", "prefill:1,4,2,64,64/32,1",
                  "--shape", "decode:1,4,2,64,96/64", *(["--kv-format", kv_format] if kv_format else []))
    dims = {k["name"]: (k["problem"]["dk"], k["problem"]["dv"]) for k in m["kernels"]}
    assert dims["flash_prefill"] == (64, 32) and dims["flash_decode"] == (96, 64), dims
    assert_example_passes(out, toolchain, m)


@pytest.mark.parametrize("dtype, combos, kv_format, rows", [
    ("float32", [ALL, "none"], None, 3),      # every decode variant with the rows, and the rows alone
    ("float16", [], "q8_0", 2),
    ("float32", ["window,key_start"], "int8", 16),  # a group of 4 x 16 rows: DECODE_GROUP_ROWS
], ids=["variants", "q8_0", "int8-16-rows"])
def test_export_decode_rows_run(dtype, combos, kv_format, rows, cpu_device, tmp_path, toolchain):
    """--decode-rows N exports decode.cl with QUERY_ROWS = N (q (B, H_q, N, DK) run as heads): the
    classes, file names and the manifest's kernels say so, and example.c checks every row at its
    own position (causal cut, window, ALiBi distance) against its reference; a build with the
    rows left out fails it."""
    out = tmp_path / "export"
    _, m = export(out, "--device", cpu_device, "--dtype", dtype, "--shape", PREFILL, "--shape", DECODE,
                  "--decode-rows", str(rows), *(a for c in combos for a in ("--variants", c)),
                  *(["--kv-format", kv_format] if kv_format else []))
    decodes = [s for s in m["sources"] if "flash_decode" in s["kernels"]]
    assert decodes and all(s["problem"]["rows"] == rows and s["problem"]["group"] == 4 and f"-rows{rows}-"
                           in s["file"] for s in decodes)
    assert all("prefill" not in s["file"] or "rows" not in s["problem"] for s in m["sources"])
    for k in (k for k in m["kernels"] if k["name"].startswith("flash_decode")):
        assert f"passed as (B, H_q * {rows}, DK)" in k["query_rows"]  # the merge's H_q too
        if k["name"] != "flash_decode_merge":
            assert k["defines"]["QUERY_ROWS"] == rows and k["defines"]["GROUP"] == 4 * rows
            assert {"window_left", "softcap_log2", "sinks", "alibi_slopes"} <= {a["name"] for a in k["args"]}
            assert all(s["N_q"] == rows for s in (ln["shape"] for ln in k["launches"]))
    proc = assert_example_passes(out, toolchain, m)
    assert all(f" rows {rows} " in ln for ln in proc.stdout.splitlines() if ln.startswith("decode")), proc.stdout
    first = out / decodes[0]["file"]
    text = first.read_text()
    first.write_text(text.replace(f"\n#define QUERY_ROWS {rows}\n", "\n#define QUERY_ROWS 1\n", 1))
    proc, checks = run_example(out, toolchain)
    assert proc.returncode != 0 and "every check within tolerance" not in proc.stdout, proc.stdout


@pytest.mark.parametrize("combos, kv_format", [([ALL, "none"], None), (["window,sinks"], "q8_0"), ([], "int8")],
                         ids=["variants", "q8_0", "int8"])
def test_export_bfloat16_runs(combos, kv_format, cpu_device, tmp_path, toolchain):
    """--dtype bfloat16 exports the STORE_BF16 builds (q, K, V and out as their 16 bits, ushort in
    the manifest): the example stores its inputs in bfloat16 (round to nearest even) and checks
    them within bfloat16's tolerance; a source read as float16 instead fails it."""
    out = tmp_path / "export"
    _, m = export(out, "--device", cpu_device, "--dtype", "bfloat16", "--shape", PREFILL, "--shape", DECODE,
                  *(a for c in combos for a in ("--variants", c)), *(["--kv-format", kv_format] if kv_format else []))
    check_manifest(out, m, dtype="bfloat16", mode="measured")
    assert m["semantics"]["tolerance"]["bfloat16"] == TOLERANCE["bfloat16"]
    proc = assert_example_passes(out, toolchain, m)
    assert all(": bfloat16 " in ln for ln in proc.stdout.splitlines() if ln.startswith(("prefill", "decode")))
    decode = out / next(s["file"] for s in m["sources"] if "flash_decode" in s["kernels"])
    text = decode.read_text()
    decode.write_text(text.replace("\n#define STORE_HALF 0\n#define STORE_BF16 1\n",
                                   "\n#define STORE_HALF 1\n#define STORE_BF16 0\n", 1))
    proc, _ = run_example(out, toolchain)
    assert proc.returncode == 1 and "FAILED" in proc.stdout, proc.stdout


def test_export_refuses_decode_rows_past_the_limits(tmp_path):
    """Rows a sequence outside 1..DECODE_ROWS, or more than DECODE_GROUP_ROWS rows a KV head with
    the group's heads, are usage errors (exit 2) before anything is written."""
    out = tmp_path / "x"
    for rows, named in ((0, "1 to 16 query rows"), (17, "1 to 16 query rows"), (9, "72 rows per KV head")):
        r = run("export", "--device", "adreno", "--out", str(out), "--shape", PREFILL,
                "--shape", "decode:1,16,2,256,64", "--decode-rows", str(rows))
        assert r.exit_code == 2 and named in r.stderr, (rows, r.stderr)
    assert not out.exists()


def test_the_example_catches_a_variant_or_format_left_out(cpu_device, tmp_path, toolchain):
    """Each variant and the format are checked for real: a source built with one of them off (its
    define flipped), or K/V packed with the q4_0 nibbles swapped, fails; the others stay right."""
    out = tmp_path / "export"
    _, m = export(out, "--device", cpu_device, "--dtype", "float32", "--shape", PREFILL, "--shape", DECODE,
                  "--variants", ALL, "--kv-format", "q4_0")
    [run] = [c["example"] for c in m["variants"]["combinations"]]
    prefill_src, decode_src = out / run["prefill"], out / run["decode"]
    cases = [(prefill_src, f"#define {d} 1", f"#define {d} 0", ["FAILED", "ok", "ok"])
             for d in ("HAS_WINDOW", "HAS_SOFTCAP", "HAS_SINKS", "HAS_ALIBI", "MASK_KIND")]
    cases += [(decode_src, f"#define {d} 1", f"#define {d} 0", ["ok", "FAILED", "FAILED"])
              for d in ("WINDOW", "SOFTCAP", "SINKS", "ALIBI")]
    cases += [(decode_src, "min(key_start[batch], (n))", "min(0, (n))", ["ok", "FAILED", "FAILED"])]
    cases += [(prefill_src, "#define K_QUANT 2", "#define K_QUANT 1", ["FAILED", "ok", "ok"]),
              (out / "example.c", "(uint8_t)(q0 | (q1 << 4))", "(uint8_t)(q1 | (q0 << 4))", ["FAILED"] * 3)]
    for path, good, bad, verdicts in cases:
        text = path.read_text()
        assert text.count(f"\n{good}\n" if good.startswith("#") else good) == 1, good
        path.write_text(text.replace(good, bad))
        proc, checks = run_example(out, toolchain)
        assert proc.returncode == 1 and [v[-1] for v in checks.values()] == verdicts, (bad, proc.stdout)
        path.write_text(text)


def test_a_plain_export_has_no_variant_trace(tmp_path):
    """Without --variants and --kv-format the export is the plain one: no variant or format in a
    file name, problem, define, the manifest or the example's config."""
    _, m = export(tmp_path / "a", "--device", "adreno", "--shape", PREFILL, "--shape", DECODE)
    _, m2 = export(tmp_path / "b", "--device", "adreno", "--shape", PREFILL, "--shape", DECODE, "--variants", "none")
    assert [s["file"] for s in m["sources"]] == ["prefill-float16-dk64-dv64-causal.cl",
                                                 "decode-float16-dk64-dv64-g4-paged.cl"]
    check_variant_export(tmp_path / "a", m, [], None)
    assert m["example"]["prefill"]["file"] == m["sources"][0]["file"]
    flags = {"HAS_WINDOW", "HAS_SOFTCAP", "HAS_SINKS", "HAS_ALIBI", "MASK_KIND", "WINDOW", "SOFTCAP", "SINKS",
             "ALIBI", "K_QUANT", "V_QUANT"}
    assert all(not flags & k["defines"].keys() for k in m["kernels"])
    assert [a["name"] for a in next(k for k in m["kernels"] if k["name"] == "flash_decode")["args"]] == \
        [n for n, _, _ in dec.ARGS]
    for s in m["sources"]:  # the same text but for the command in the header
        a, b = ((tmp_path / x / s["file"]).read_text().split("\n") for x in "ab")
        assert [ln for ln in a if "Exported by" not in ln] == [ln for ln in b if "Exported by" not in ln]
    assert m2["kernels"] == m["kernels"]


def test_export_refuses_unknown_variants_and_formats(tmp_path):
    """An unknown variant or format is a usage error (exit 2) naming the choices; so is a format
    the head dim cannot be stored in. Nothing is written."""
    assert cli._EXPORT_VARIANTS == ex.VARIANTS and cli._EXPORT_KV_FORMATS == ex.KV_FORMATS
    out = tmp_path / "x"
    for args, named, choices in ((("--variants", "window,rope"), "'rope'", ex.VARIANTS),
                                 (("--kv-format", "q5_1"), "'q5_1'", ex.KV_FORMATS),
                                 (("--kv-format", "q8_0", "--shape", "prefill:1,8,2,64,48,1"), "d = 48", ("32",))):
        r = run("export", "--device", "adreno", "--out", str(out), *args)
        assert r.exit_code == 2 and r.stderr.startswith("error: ") and named in r.stderr, (args, r.stderr)
        assert all(c in r.stderr for c in choices), (args, r.stderr)
    assert not out.exists()
    with pytest.raises(ValueError, match="choose from window, softcap, sinks, alibi, mask"):
        ex.export(out, device="adreno", variants=("window", "rope"))


# --------------------------------------------------------------------------- the CLI and the host spec

def test_export_refuses_a_folder_that_is_not_an_export(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    r = run("export", "--device", "adreno", "--out", str(tmp_path), "--shape", PREFILL, "--shape", DECODE)
    assert r.exit_code == 2 and "holds no flashcl export" in r.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def test_export_replaces_a_previous_export(tmp_path):
    out = tmp_path / "x"
    _, m1 = export(out, "--device", "adreno", "--shape", PREFILL, "--shape", PREFILL_NC, "--shape", DECODE)
    _, m2 = export(out, "--device", "adreno", "--dtype", "float32", "--shape", PREFILL, "--shape", DECODE)
    assert len(m1["sources"]) == 3 and len(m2["sources"]) == 2
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted([s["file"] for s in m2["sources"]] + ["manifest.json", "example.c", "example_config.h",
                                                                  "run_example.sh"])
    assert os.access(out / "run_example.sh", os.X_OK)


def test_export_json_and_bad_shapes(tmp_path):
    r = run("export", "--device", "adreno", "--out", str(tmp_path / "j"), "--shape", DECODE, "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["conditions"]["mode"] == "modeled" and doc["files"][-4:] == ["manifest.json", "example.c",
                                                                             "example_config.h", "run_example.sh"]
    # no prefill --shape: the reference shapes (d = 128 and 64, causal and not)
    assert {(row["problem"]["dk"], row["problem"].get("causal")) for row in doc["rows"]
            if row["kernels"] == ["flash_prefill"]} == {(128, True), (128, False), (64, True), (64, False)}
    for bad in ("prefill:1,8,3,256,64,1", "decode:1,8,2,256", "attention:1,2"):
        r = run("export", "--device", "adreno", "--out", str(tmp_path / "b"), "--shape", bad)
        assert r.exit_code == 2 and r.stderr.startswith("error: ") and "--shape" in r.stderr, (bad, r.stderr)


def _spy_launches(monkeypatch) -> list:
    """(kernel name, arguments) of every launch the library makes from here on."""
    seen = []
    real = runtime.launch_sequence

    def spy(handle, launches, *, params):
        seen.extend((kernel.function_name, args) for _, kernel, _, _, args in launches)
        return real(handle, launches, params=params)

    monkeypatch.setattr(runtime, "launch_sequence", spy)
    monkeypatch.setattr(dec, "launch_sequence", spy)
    return seen


def _assert_args_follow_the_spec(seen: list, problem: dict):
    """Each launch set exactly the arguments the manifest lists for ``problem``'s class, with their types."""
    import pyopencl as cl

    kinds = {np.int32: "int", np.float32: "float", np.uint64: "ulong"}
    assert {name for name, _ in seen} == KERNELS
    for name, args in seen:
        spec = _spec_of(name, problem)
        assert len(args) == len(spec), name
        for a, (arg_name, ctype, _) in zip(args, spec):
            if ctype.startswith("__local"):
                assert isinstance(a, cl.LocalMemory), (name, arg_name)
            elif "*" in ctype:
                assert isinstance(a, cl.MemoryObjectHolder), (name, arg_name)
            else:
                assert kinds[type(a)] == ctype.split()[-1], (name, arg_name)


def test_the_host_code_passes_the_arguments_the_spec_lists(cpu_device, monkeypatch):
    """PrefillKernel and DecodeKernel set exactly the arguments ARGS / MERGE_ARGS list, with their
    types: the manifest describes what the library itself launches."""
    seen = _spy_launches(monkeypatch)
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 4, 40, 64)).astype(np.float32) for _ in range(3))
    flashcl.prefill(q, k[:, :2], v[:, :2], causal=True, device=cpu_device)
    kc = rng.standard_normal((6, 16, 2, 64)).astype(np.float32)
    table = np.array([[3, 1, 5], [0, 4, 2]], dtype=np.int32)
    lens = np.array([40, 20], dtype=np.int32)
    for splits in (1, 3):
        flashcl.decode(rng.standard_normal((2, 4, 64)).astype(np.float32), kc, kc, block_table=table,
                       context_lens=lens, num_splits=splits, device=cpu_device)
    _assert_args_follow_the_spec(seen, {})


def test_the_host_code_passes_the_variant_and_int8_arguments_the_spec_lists(cpu_device, monkeypatch):
    """With every variant on and int8 caches the library passes what the manifest of such an
    export lists: the prefill's variant and scale arguments, decode's VARIANT_ARGS and QUANT_ARGS."""
    seen = _spy_launches(monkeypatch)
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, 4, 40, 64)).astype(np.float32) for _ in range(3))
    sinks, slopes = rng.standard_normal(4).astype(np.float32), np.full((1, 4), 0.1, np.float32)
    kq, vq = (flashcl.quantize(x[:, :2], "int8") for x in (k, v))
    flashcl.prefill(q, kq, vq, causal=True, window=(7, 0), softcap=30.0, sinks=sinks, alibi_slopes=slopes,
                    mask=rng.random((1, 1, 40, 40)) < 0.8, device=cpu_device)
    kc = flashcl.quantize(rng.standard_normal((6, 16, 2, 64)).astype(np.float32), "int8")
    table = np.array([[3, 1, 5], [0, 4, 2]], dtype=np.int32)
    lens = np.array([40, 20], dtype=np.int32)
    for splits in (1, 3):
        flashcl.decode(rng.standard_normal((2, 4, 64)).astype(np.float32), kc, kc, block_table=table,
                       context_lens=lens, num_splits=splits, window=(20, 0), softcap=30.0, sinks=sinks,
                       alibi_slopes=np.full((2, 4), 0.1, np.float32), device=cpu_device)
    _assert_args_follow_the_spec(seen, {"variants": ["window", "softcap", "sinks", "alibi"], "kv_format": "int8"})
