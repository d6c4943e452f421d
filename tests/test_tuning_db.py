"""Bad parameters from a tuning database (issue 7): a hand-edited file, or one tuned on another
device, must never crash a call or change its result. Every invalid entry is skipped with a
warning that names the file and the violated rule; the profile default runs instead, exactly.
(Complements test_tuner.py's DV_TILE case, for both kernels and every kind of bad entry.)"""

from __future__ import annotations

import json

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
    ([64, 16, 64, 4], r"params is not a dict"),
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
    ("fast", r"params is not a dict"),
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
    with pytest.warns(UserWarning, match=r"hand\.json"):
        out = flashcl.prefill(q, k, v, causal=True, device=cpu_device)
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
    with pytest.warns(UserWarning, match=r"hand\.json"):
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
