"""Bad parameters from a tuning database (issue 7): a hand-edited file, or one tuned on another
device, must never crash a call or change its result. Every invalid entry is skipped with a
warning that names the file and the violated rule; the profile default runs instead, exactly.
(Complements test_tuner.py's DV_TILE case, for both kernels and every kind of bad entry.)

The database itself: each file is parsed once per version; malformed entries are skipped with one
warning per version; a file that cannot be a database is a TuningDatabaseError naming it."""

from __future__ import annotations

import json
import re
import warnings

import numpy as np
import pytest

import flashcl
from flashcl import reference, tuning

from ._check import assert_close

# (params, fragment of the warning); the device limits come from PoCL (max work-group 4096,
# local memory 1 MiB), so "too large" values are far above them.
BAD_PREFILL = [
    ({"BLOCK_M": "64", "BLOCK_N": 16, "DV_TILE": 64, "VEC": 4}, r"BLOCK_M='64' must be a positive int"),
    ({"BLOCK_M": 64.0, "BLOCK_N": 16, "DV_TILE": 64, "VEC": 4}, r"BLOCK_M=64.0 must be a positive int"),
    ({"BLOCK_M": True, "BLOCK_N": 16, "DV_TILE": 64, "VEC": 4}, r"BLOCK_M=True must be a positive int"),
    ({"BLOCK_M": 64, "BLOCK_N": 16, "DV_TILE": 48, "VEC": 4}, r"DV_TILE=48 must divide DV=64"),
    ({"BLOCK_M": 8192, "BLOCK_N": 16, "DV_TILE": 64, "VEC": 4}, r"BLOCK_M=8192 exceeds the device's max work-group"),
    # 512 MB of local memory, more than any device has (PoCL 5 has 4 MB: BLOCK_N=4096 fit it and was
    # refused by the next check instead)
    ({"BLOCK_M": 64, "BLOCK_N": 1 << 20, "DV_TILE": 64, "VEC": 4}, r"need \d+ bytes of local memory"),
    ({"BLOCK_M": 64, "BLOCK_N": 16, "DV_TILE": 64, "VEC": 4, "TURBO": 1}, r"unknown \['TURBO'\]"),
    ({"BLOCK_M": 64, "BLOCK_N": 16, "DV_TILE": 64}, r"missing \['VEC'\]"),
    ({"BLOCK_M": 64, "BLOCK_N": 16, "DV_TILE": 64, "VEC": 4, "Q_IN_REGS": 2}, r"Q_IN_REGS=2 must be 0 or 1"),
]
BAD_DECODE = [
    ({"ROWS": "4", "UNROLL": 1, "HEAD_TILE": 2, "MERGE_WG": 64}, r"ROWS='4' must be a positive int"),
    ({"ROWS": 0, "UNROLL": 1, "HEAD_TILE": 2, "MERGE_WG": 64}, r"ROWS=0 must be a positive int"),
    ({"ROWS": 4, "UNROLL": 1, "HEAD_TILE": 3, "MERGE_WG": 64}, r"HEAD_TILE=3 must divide the GQA group G=4"),
    ({"ROWS": 4, "UNROLL": 1, "HEAD_TILE": 2, "MERGE_WG": 48}, r"MERGE_WG=48 must be a power of two"),
    ({"ROWS": 4096, "UNROLL": 1, "HEAD_TILE": 1, "MERGE_WG": 64}, r"the device allows 4096"),
    ({"ROWS": 4, "UNROLL": 1, "HEAD_TILE": 2, "MERGE_WG": 8192}, r"MERGE_WG=8192 exceeds"),
    ({"ROWS": 64, "UNROLL": 1024, "HEAD_TILE": 1, "MERGE_WG": 64}, r"bytes of local memory"),
    ({"ROWS": 4, "UNROLL": 1, "HEAD_TILE": 2, "MERGE_WG": 64, "BLOCK_N": 8}, r"unknown \['BLOCK_N'\]"),
    ({"BLOCK_M": 64, "BLOCK_N": 16, "DV_TILE": 64, "VEC": 4}, r"missing \['ROWS'"),  # a prefill entry
]


def _write(tuning_dir, kernel, h, params, *, dtype, dk, dv, causal, n):
    key = tuning.DeviceKey.of(h.name, h.device.opencl_c_version, h.device.vendor, h.profile.name)
    e = tuning.make_entry(kernel, key, dtype=dtype, dk=dk, dv=dv, causal=causal, n=n,
                          params={}, provenance={"mode": "measured", "device": "another device"})
    e["params"] = params  # as a hand edit would leave it, whatever it is
    tuning_dir.mkdir(parents=True, exist_ok=True)
    (tuning_dir / "hand.json").write_text(json.dumps({"version": 1, "entries": [e]}))


@pytest.mark.parametrize("params,why", BAD_PREFILL, ids=[w.split()[0].strip("\\r") for _, w in BAD_PREFILL])
def test_bad_prefill_entry_falls_back_to_defaults(cpu_device, tuning_dir, params, why):
    from flashcl.opencl.prefill import PrefillProblem, choose_params
    from flashcl.opencl.runtime import get_device

    h = get_device(cpu_device)
    prob = PrefillProblem(1, 4, 2, 100, 100, 64, 64, True, "float32")
    default = choose_params(h, prob)
    _write(tuning_dir, "prefill", h, params, dtype="float32", dk=64, dv=64, causal=True, n=100)
    with pytest.warns(UserWarning, match=r"hand\.json.*" + why):
        got = choose_params(h, prob)
    assert got.params == default.params and got.source.startswith("profile default")
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((4, 100, 64), (2, 100, 64), (2, 100, 64)))
    out = flashcl.prefill(q, k, v, causal=True, device=cpu_device)  # the same choice, warned about once
    assert_close(out, reference.attention(q, k, v, causal=True), "float32", f"prefill with {params}")


@pytest.mark.parametrize("params,why", BAD_DECODE, ids=[w.split()[0].strip("\\r") for _, w in BAD_DECODE])
def test_bad_decode_entry_falls_back_to_defaults(cpu_device, tuning_dir, params, why):
    from flashcl.opencl.decode import DecodeProblem, choose_params
    from flashcl.opencl.runtime import get_device

    h = get_device(cpu_device)
    prob = DecodeProblem(2, 8, 2, 64, 64, True, "float16")
    default = choose_params(h, prob, n_ctx=70)
    _write(tuning_dir, "decode", h, params, dtype="float16", dk=64, dv=64, causal=False, n=70)
    with pytest.warns(UserWarning, match=r"hand\.json.*" + why):
        got = choose_params(h, prob, n_ctx=70)
    assert got.params == default.params and got.source.startswith("profile default")
    rng = np.random.default_rng(4)
    lens = np.array([70, 33], dtype=np.int32)
    q = rng.standard_normal((2, 8, 64)).astype(np.float16)
    k = rng.standard_normal((12, 16, 2, 64)).astype(np.float16)
    v = rng.standard_normal((12, 16, 2, 64)).astype(np.float16)
    table = rng.permutation(12)[:10].reshape(2, 5).astype(np.int32)
    out = flashcl.decode(q, k, v, block_table=table, context_lens=lens, num_splits=3, device=cpu_device)
    ref = reference.decode_attention(q, k, v, block_table=table, context_lens=lens)
    assert_close(out, ref, "float16", f"decode with {params}")


def test_valid_decode_entry_is_used(cpu_device, tuning_dir):
    """The counterpart: a valid decode entry in the same place is picked up (so the tests above
    fail for the right reason) and the call stays exact."""
    from flashcl.opencl.decode import DecodeProblem, choose_params
    from flashcl.opencl.runtime import get_device

    h = get_device(cpu_device)
    prob = DecodeProblem(2, 8, 2, 64, 64, True, "float16")
    params = {"ROWS": 2, "UNROLL": 2, "HEAD_TILE": 2, "MERGE_WG": 32}
    assert params != choose_params(h, prob, n_ctx=70).params
    _write(tuning_dir, "decode", h, params, dtype="float16", dk=64, dv=64, causal=False, n=70)
    got = choose_params(h, prob, n_ctx=70)
    assert got.params == params and "hand.json" in got.source


def test_bfloat16_calls_take_the_float16_entry(cpu_device, tuning_dir):
    """bfloat16 rows are float16's bytes and tiles: a float16 entry is a bfloat16 call's choice."""
    from flashcl.opencl.decode import DecodeProblem, choose_params
    from flashcl.opencl.runtime import get_device

    h = get_device(cpu_device)
    params = {"ROWS": 2, "UNROLL": 2, "HEAD_TILE": 2, "MERGE_WG": 32}
    _write(tuning_dir, "decode", h, params, dtype="float16", dk=64, dv=64, causal=False, n=70)
    got = choose_params(h, DecodeProblem(2, 8, 2, 64, 64, True, "bfloat16"), n_ctx=70)
    assert got.params == params and "hand.json" in got.source


def test_a_handle_keeps_its_choices_while_the_database_is_unchanged(cpu_device, tuning_dir, monkeypatch):
    """A call looks the database up once per problem class and length bucket while its files are
    the same versions (the lookup and its checks cost more than the rest of a small PoCL call);
    a file written since, in place or by the tuner's save, is seen at the next call."""
    from flashcl.opencl.decode import DecodeProblem, choose_params
    from flashcl.opencl.runtime import get_device

    h = get_device(cpu_device)
    prob = DecodeProblem(2, 8, 2, 64, 64, True, "float16")
    lookups = []
    real = tuning.lookup
    monkeypatch.setattr(tuning, "lookup", lambda *a, **kw: lookups.append(kw["n"]) or real(*a, **kw))
    first = choose_params(h, prob, n_ctx=70)
    assert all(choose_params(h, prob, n_ctx=n) is first for n in (70, 65, 128))  # one bucket
    assert lookups == [70]
    choose_params(h, prob, n_ctx=5000)
    assert lookups == [70, 5000]
    written = {"ROWS": 2, "UNROLL": 2, "HEAD_TILE": 2, "MERGE_WG": 32}
    _write(tuning_dir, "decode", h, written, dtype="float16", dk=64, dv=64, causal=False, n=70)
    assert choose_params(h, prob, n_ctx=70).params == written
    saved = {"ROWS": 4, "UNROLL": 1, "HEAD_TILE": 1, "MERGE_WG": 64}
    key = tuning.DeviceKey.of(h.name, h.device.opencl_c_version, h.device.vendor, h.profile.name)
    tuning.save_entry(tuning.make_entry("decode", key, dtype="float16", dk=64, dv=64, causal=False, n=70,
                                        params=saved, provenance={"mode": "measured"}), tuning_dir / "hand.json")
    assert choose_params(h, prob, n_ctx=70).params == saved
    assert len(lookups) == 4


def test_prefill_keeps_its_choice_per_length_bucket(cpu_device, tuning_dir, monkeypatch):
    """Prefill's choice depends on the dtype, head dims, causality and length bucket only: calls
    that differ in batch, heads or lengths within a bucket look the database up once; another
    bucket or dtype looks it up again, and an entry written since is seen."""
    from flashcl.opencl.prefill import PrefillProblem, choose_params
    from flashcl.opencl.runtime import get_device

    h = get_device(cpu_device)
    lookups = []
    real = tuning.lookup
    monkeypatch.setattr(tuning, "lookup", lambda *a, **kw: lookups.append(kw["n"]) or real(*a, **kw))
    first = choose_params(h, PrefillProblem(1, 8, 2, 300, 300, 64, 64, True, "float16"))
    for prob in (PrefillProblem(4, 32, 8, 511, 511, 64, 64, True, "float16"),
                 PrefillProblem(1, 8, 8, 1, 400, 64, 64, True, "float16")):
        assert choose_params(h, prob) is first
    assert lookups == [300]
    tiles = {"BLOCK_M": 16, "BLOCK_N": 16, "DV_TILE": 32, "VEC": 4}
    _write(tuning_dir, "prefill", h, tiles, dtype="float16", dk=64, dv=64, causal=True, n=4096)
    long_prob = PrefillProblem(1, 8, 2, 4000, 4000, 64, 64, True, "float16")
    assert choose_params(h, long_prob).params == tiles
    assert choose_params(h, PrefillProblem(2, 8, 2, 3000, 3000, 64, 64, True, "float16")).params == tiles
    choose_params(h, PrefillProblem(1, 8, 2, 4000, 4000, 64, 64, True, "float32"))
    assert lookups == [300, 4000, 4000]


# --------------------------------------------------------------------------- the database files

KEY = tuning.DeviceKey("Some GPU", None, "nvidia", "nvidia")
PROBLEM = dict(dtype="float16", dk=64, dv=64, causal=True, n=1024)


TILES = {"BLOCK_M": 64, "BLOCK_N": 16, "DV_TILE": 64, "VEC": 4}


def _good(params=TILES, **fields):
    e = tuning.make_entry("prefill", KEY, **PROBLEM, params=params,
                          provenance={"mode": "measured", "device": "Some GPU"})
    e.update(fields)
    return e


def _db(tuning_dir, entries, name="db.json"):
    tuning_dir.mkdir(parents=True, exist_ok=True)
    f = tuning_dir / name
    f.write_text(json.dumps({"version": 1, "entries": entries}))
    return f


def _count_reads(monkeypatch):
    reads = []
    read = tuning._read
    monkeypatch.setattr(tuning, "_read", lambda path: reads.append(path) or read(path))
    return reads


def test_a_file_is_parsed_once_per_version(tuning_dir, monkeypatch):
    reads = _count_reads(monkeypatch)
    f = _db(tuning_dir, [_good()])
    for _ in range(3):
        assert tuning.lookup("prefill", KEY, **PROBLEM).params["BLOCK_N"] == 16
    assert reads.count(f) == 1
    tuning.save_entry(_good({"BLOCK_M": 32, "BLOCK_N": 32, "DV_TILE": 64, "VEC": 4}), f)  # a new version
    reads.clear()
    assert tuning.lookup("prefill", KEY, **PROBLEM).params["BLOCK_N"] == 32
    assert tuning.lookup("prefill", KEY, **PROBLEM).params["BLOCK_N"] == 32
    assert reads.count(f) == 1
    # the entry a lookup returns is a copy: changing it changes no later lookup
    tuning.lookup("prefill", KEY, **PROBLEM).entry["params"]["BLOCK_N"] = 8
    assert tuning.lookup("prefill", KEY, **PROBLEM).params["BLOCK_N"] == 32


def test_concurrent_first_lookups_parse_once(tuning_dir, monkeypatch):
    from concurrent.futures import ThreadPoolExecutor

    reads = _count_reads(monkeypatch)
    f = _db(tuning_dir, [_good(device=f"GPU {i}") for i in range(2000)] + [_good()])
    with ThreadPoolExecutor(8) as pool:
        found = list(pool.map(lambda _: tuning.lookup("prefill", KEY, **PROBLEM), range(8)))
    assert all(c is not None and c.entry["device"] == "Some GPU" for c in found)
    assert reads.count(f) == 1


MALFORMED = [
    (lambda e: dict(e, provenance="tuned by hand"), "'provenance' is a string, expected an object"),
    (lambda e: [e], "is an array, not an object"),
    (lambda e: dict(e, dk="64"), "'dk' is '64', expected a positive integer"),
    (lambda e: dict(e, causal="false"), "'causal' is a string, expected true or false"),
    (lambda e: {k: v for k, v in e.items() if k != "kernel"}, "'kernel' is missing"),
    (lambda e: dict(e, bucket=0), "'bucket' is 0"),
    (lambda e: dict(e, device=["Some GPU"]), "'device' is an array"),
    (lambda e: dict(e, params=[64, 16, 64, 4]), "'params' is an array, expected an object"),
    (lambda e: dict(e, provenance=json.loads('{"a":' * 20 + "1" + "}" * 20)), "nested more than 8 levels"),
    (lambda e: dict(e, kernel="prefil"), "'kernel' is 'prefil', expected one of 'prefill', 'decode'"),
    (lambda e: dict(e, dtype="fp16"), "'dtype' is 'fp16', expected one of 'float32', 'float16'"),
]


@pytest.mark.parametrize("mangle,why", MALFORMED, ids=[w.split(",")[0] for _, w in MALFORMED])
def test_malformed_entry_is_skipped_with_one_warning(tuning_dir, mangle, why):
    """The well-formed entry of the same file is still found; the warning names the file and the
    fault once per file version, not once per call."""
    good = _good({"BLOCK_M": 32, "BLOCK_N": 16, "DV_TILE": 64, "VEC": 4}, bucket=4096)
    f = _db(tuning_dir, [mangle(_good()), good])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            found = tuning.lookup("prefill", KEY, **PROBLEM)
            assert found is not None and found.params == good["params"]
    [w] = caught
    assert str(f) in str(w.message) and "entries[0]" in str(w.message) and why in str(w.message)
    f.write_text(f.read_text() + "\n")  # a new version warns again
    with pytest.warns(UserWarning, match=re.escape(why)):
        tuning.lookup("prefill", KEY, **PROBLEM)


def test_malformed_params_skipped_and_the_call_stays_exact(cpu_device, tuning_dir):
    """Params that are not an object at all, on a device: one warning, then the profile default."""
    from flashcl.opencl.prefill import PrefillProblem, choose_params
    from flashcl.opencl.runtime import get_device

    h = get_device(cpu_device)
    prob = PrefillProblem(1, 4, 2, 100, 100, 64, 64, True, "float32")
    default = choose_params(h, prob)
    _write(tuning_dir, "prefill", h, [64, 16, 64, 4], dtype="float32", dk=64, dv=64, causal=True, n=100)
    with pytest.warns(UserWarning, match=r"hand\.json.*'params' is an array"):
        got = choose_params(h, prob)
    assert got.params == default.params and got.source.startswith("profile default")
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((4, 100, 64), (2, 100, 64), (2, 100, 64)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # parsed and warned about already
        out = flashcl.prefill(q, k, v, causal=True, device=cpu_device)
    assert_close(out, reference.attention(q, k, v, causal=True), "float32", "prefill after a malformed entry")


BAD_FILES = [
    (b"{ not json", "is not valid JSON"),
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    (b'{"entries": {"a": 1}}', "has no 'entries' list"),
    (b"[]", "has no 'entries' list"),
    (b'{"version": 1, "entries": []}\xff\xfe', "cannot be read"),
]


@pytest.mark.parametrize("content,why", BAD_FILES, ids=["not-json", "deep", "entries-object", "array", "bytes"])
def test_bad_file_raises_naming_it(tuning_dir, content, why):
    tuning_dir.mkdir(parents=True)
    (tuning_dir / "bad.json").write_bytes(content)
    for _ in range(2):  # the verdict is kept for the file's version, and raised on every call
        with pytest.raises(flashcl.TuningDatabaseError, match=rf"bad\.json.*{why}"):
            tuning.lookup("prefill", KEY, **PROBLEM)


def test_unreadable_file_raises_naming_it(tuning_dir):
    (tuning_dir / "folder.json").mkdir(parents=True)  # globbed like a file, read like none
    with pytest.raises(tuning.TuningDatabaseError, match=r"folder\.json is not a regular file"):
        tuning.lookup("prefill", KEY, **PROBLEM)
    assert tuning.TuningDatabaseError is flashcl.TuningDatabaseError


def test_a_link_to_a_device_is_refused_unread(tuning_dir):
    """A link to /dev/zero would be read until memory runs out."""
    tuning_dir.mkdir(parents=True)
    (tuning_dir / "dev.json").symlink_to("/dev/zero")
    with pytest.raises(tuning.TuningDatabaseError, match=r"dev\.json is not a regular file"):
        tuning.lookup("prefill", KEY, **PROBLEM)


def test_an_oversized_file_is_refused_unread(tuning_dir, monkeypatch):
    f = _db(tuning_dir, [_good()])
    monkeypatch.setattr(tuning, "_MAX_DB_BYTES", 100)
    with pytest.raises(tuning.TuningDatabaseError, match=r"db\.json is \d+ bytes, past the 100 a database"):
        tuning.load_file(f)


def test_a_database_of_another_version_is_refused(tuning_dir):
    f = _db(tuning_dir, [_good()])
    f.write_text(json.dumps({"version": 99, "entries": [_good()]}))
    with pytest.raises(tuning.TuningDatabaseError, match="is version 99; this flashcl reads version 1"):
        tuning.load_file(f)


def test_save_keeps_malformed_entries(tuning_dir):
    """A save never drops what a lookup skips: the hand edit stays for its author to fix."""
    odd = dict(_good(), device="Other GPU", provenance="tuned by hand")
    f = _db(tuning_dir, [odd, "note"])
    tuning.save_entry(_good(), f)
    entries = json.loads(f.read_text())["entries"]
    assert entries[:2] == [odd, "note"] and entries[2]["provenance"]["mode"] == "measured"


# --------------------------------------------------------------------------- nearest measured relative

def _key(name, version="OpenCL C 3.0", vendor="", profile="nvidia", cc=None):
    return tuning.DeviceKey.of(name, version, vendor, profile, compute_capability=cc)


H100 = "NVIDIA H100 80GB HBM3"
FP32_128 = dict(dtype="float32", dk=128, dv=128, causal=True, n=2048)


def test_shipped_h100_entries_carry_their_architecture():
    entries = tuning.load_file(tuning.shipped_tuning_dir() / "nvidia-h100.json")
    assert {e["arch"] for e in entries} == {"nvidia-sm90"} and {e["device"] for e in entries} == {H100}
    assert [e["params"] for e in entries] == [
        {"VARIANT": "tiles", "BLOCK_M": 64, "BLOCK_N": 16, "DV_TILE": 128, "TILE_M": 8, "TILE_N": 2, "UNROLL_K": 8},
        {"VARIANT": "tiles", "BLOCK_M": 64, "BLOCK_N": 16, "DV_TILE": 64, "TILE_M": 8, "TILE_N": 2, "UNROLL_K": 8}]


def test_an_h200_uses_the_h100_entry_of_its_architecture():
    h200 = _key("NVIDIA H200", vendor="NVIDIA Corporation", cc=(9, 0))
    assert (h200.arch, h200.family) == ("nvidia-sm90", "nvidia-sm9x")
    found = tuning.lookup("prefill", h200, **FP32_128)
    assert found is not None and found.entry["device"] == H100 and "(arch, bucket 2048" in found.source
    assert found.reason == f"no entry for NVIDIA H200; using {H100}'s (same architecture sm_90)"
    own = tuning.lookup("prefill", _key(H100, cc=(9, 0)), **FP32_128)
    assert own.reason == f"tuned for {H100}" and "(device," in own.source
    # without the compute capability (no cl_nv_device_attribute_query) nothing but the name matches
    assert tuning.lookup("prefill", _key("NVIDIA H200"), **FP32_128) is None
    assert tuning.lookup("prefill", _key("NVIDIA A100-SXM4-80GB", cc=(8, 0)), **FP32_128) is None


def _measured(device, arch, params=TILES, **problem):
    key = tuning.DeviceKey(device, arch, "x", "x")
    return tuning.make_entry("prefill", key, **{**PROBLEM, **problem}, params=params,
                             provenance={"mode": "measured", "device": device, "driver": "1"})


@pytest.mark.parametrize("entry_dev,entry_arch,dev,level,why", [
    ("NVIDIA A100-SXM4-80GB", "nvidia-sm80", _key("NVIDIA RTX A6000", cc=(8, 6)), "family",
     "same family nvidia-sm8x as sm_86"),
    # every Adreno is named "QUALCOMM Adreno(TM)": the name alone must not match another model
    ("QUALCOMM Adreno(TM)", "adreno-740", _key("QUALCOMM Adreno(TM)", "OpenCL C 3.0 Adreno(TM) 750", "QUALCOMM",
                                               "adreno"), "family", "same family adreno-7xx as adreno-750"),
    ("QUALCOMM Adreno(TM)", "adreno-740", _key("QUALCOMM Adreno(TM)", "OpenCL C 2.0 Adreno(TM) 740", "QUALCOMM",
                                               "adreno"), "device", "tuned for QUALCOMM Adreno(TM)"),
    ("Mali-G715", "mali-g715", _key("Mali-G710", "OpenCL C 3.0 v1.r38p1", "ARM", "mali"), "family",
     "same family mali-valhall"),
    ("Intel(R) UHD Graphics 770", "intel-xe-lp", _key("Intel(R) Iris(R) Xe Graphics", "OpenCL C 3.0", "Intel",
                                                      "intel"), "arch", "same architecture intel-xe-lp"),
    ("gfx90a:sramecc+:xnack-", "amd-gfx90a", _key("gfx942:sramecc+:xnack-", "OpenCL C 2.0", "AMD", "intel"),
     "family", "same family amd-gfx9"),
])
def test_nearest_relative_by_architecture(tuning_dir, entry_dev, entry_arch, dev, level, why):
    _db(tuning_dir, [_measured(entry_dev, entry_arch)])
    found = tuning.lookup("prefill", dev, **PROBLEM)
    assert found is not None and f"({level}, bucket" in found.source and why in found.reason, found


@pytest.mark.parametrize("entry_dev,entry_arch,dev", [
    ("QUALCOMM Adreno(TM)", "adreno-740", _key("QUALCOMM Adreno(TM)", "OpenCL C 2.0 Adreno(TM) 640", "QUALCOMM",
                                               "adreno-6xx")),
    ("Mali-G715", "mali-g715", _key("Mali-G52 r1", "OpenCL C 2.0", "ARM", "mali")),
    ("Intel(R) UHD Graphics 770", "intel-xe-lp", _key("Intel(R) Arc(TM) A770 Graphics", "OpenCL C 3.0", "Intel",
                                                      "intel")),
])
def test_no_relative_across_architectures(tuning_dir, entry_dev, entry_arch, dev):
    _db(tuning_dir, [_measured(entry_dev, entry_arch)])
    assert tuning.lookup("prefill", dev, **PROBLEM) is None


def test_levels_most_specific_first(tuning_dir):
    """The device's own entry, then its architecture's, then its family's, then the modeled
    entry of its profile."""
    dev = _key("NVIDIA H200", cc=(9, 0))
    params = [dict(TILES, BLOCK_M=m) for m in (16, 32, 64, 128)]
    modeled = tuning.make_entry("prefill", tuning.DeviceKey("", None, "nvidia", "nvidia"), **PROBLEM,
                                params=params[3], provenance={"mode": "modeled"})
    entries = [modeled, _measured("NVIDIA GH200", "nvidia-sm91", params[2]),
               _measured("NVIDIA H100 PCIe", "nvidia-sm90", params[1]),
               _measured("NVIDIA H200", "nvidia-sm90", params[0])]
    for expect in (16, 32, 64, 128):
        _db(tuning_dir, entries)
        assert tuning.lookup("prefill", dev, **PROBLEM).params["BLOCK_M"] == expect
        entries = entries[:-1]


def test_decode_entries_are_keyed_by_group(tuning_dir):
    key = tuning.DeviceKey("Some GPU", None, "nvidia", "nvidia")
    p4, p1, anyg = ({"ROWS": r, "UNROLL": 1, "HEAD_TILE": 1, "MERGE_WG": 64} for r in (4, 1, 2))
    kw = dict(dtype="float16", dk=128, dv=128, causal=False, n=2048)
    _db(tuning_dir, [tuning.make_entry("decode", key, **kw, params=p4, provenance={}, group=4),
                     tuning.make_entry("decode", key, **kw, params=anyg, provenance={}),
                     tuning.make_entry("decode", key, **kw, params=p1, provenance={}, group=1)])
    assert tuning.lookup("decode", key, **kw, group=4).params == p4
    assert tuning.lookup("decode", key, **kw, group=1).params == p1
    assert tuning.lookup("decode", key, **kw, group=8).params == anyg  # no group: any group


def test_device_key_of_a_pyopencl_device():
    import types

    class Device:
        name, vendor, opencl_c_version = "NVIDIA H200", "NVIDIA Corporation", "OpenCL C 3.0"
        platform = types.SimpleNamespace(name="NVIDIA CUDA")

        def __init__(self, cc):
            self.cc = cc

        @property
        def compute_capability_major_nv(self):
            if self.cc is None:  # a driver without cl_nv_device_attribute_query
                raise RuntimeError("clGetDeviceInfo failed: INVALID_VALUE")
            return self.cc[0]

        @property
        def compute_capability_minor_nv(self):
            return self.cc[1]

    k = tuning.DeviceKey.for_device(Device((9, 0)), "nvidia")
    assert (k.name, k.arch, k.family, k.vendor) == ("NVIDIA H200", "nvidia-sm90", "nvidia-sm9x", "nvidia")
    assert tuning.DeviceKey.for_device(Device(None), "nvidia").arch is None


# --------------------------------------------------------------------------- the driver an entry was measured with

def test_driver_mismatch_is_one_line():
    measured = _good(provenance={"mode": "measured", "driver": "580.159.04"})
    choice = tuning.Choice(measured["params"], "tuned x", measured)
    assert tuning.driver_mismatch(choice, "580.159.04") is None
    msg = tuning.driver_mismatch(choice, "590.10")
    assert "580.159.04" in msg and "590.10" in msg and "\n" not in msg
    modeled = _good(provenance={"mode": "modeled", "driver": "3.1"})
    assert tuning.driver_mismatch(tuning.Choice({}, "tuned x", modeled), "590.10") is None
    assert tuning.driver_mismatch(tuning.default_choice("cpu", {}), "590.10") is None
