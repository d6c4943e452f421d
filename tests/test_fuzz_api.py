"""Fuzzing the public API with hypothesis (issue 7): ``flashcl.prefill`` and ``flashcl.decode``.

Each example draws a valid call — random batch, heads (MHA/GQA/MQA), lengths, head dims, dtype,
causal, scale, device spelling, tile parameters, non-contiguous and negative-stride numpy views,
contiguous or paged caches with permuted block tables — and then, half of the time, breaks it in
one way: an unsupported dtype or rank, mismatched shapes, an invalid device, invalid parameters,
an out-of-range block id or context length, a bad split count. The contract checked
(docs/design.md §1):

* an unbroken call returns the float64 oracle's answer (relative error <= 1e-5 in float32,
  2e-3 in float16), finite, in the input's dtype and shape;
* a broken call raises ValueError/TypeError (or a flashcl.FlashCLError) — never another exception,
  never a result. Device-side rejections of parameters (a kernel whose register use caps the
  work-group below BLOCK_M) are ValueErrors too.

Runs on the PoCL CPU device; derandomized, so a failure reproduces. Programs are cached per
problem class, so the strategies keep to a few head dims and tile sets to bound the builds.
"""

from __future__ import annotations

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import flashcl  # noqa: E402
from flashcl import reference  # noqa: E402

from ._check import TOL, rel_err  # noqa: E402

ALLOWED = (ValueError, TypeError, flashcl.FlashCLError)
SETTINGS = settings(max_examples=120, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))

HEAD_DIMS = (16, 40)
BAD_HEAD_DIMS = (4, 12, 264)
BAD_DTYPES = ("float64", "int32", "int64", "bool", "complex64")
PREFILL_TILES = (
    {"BLOCK_M": 16, "BLOCK_N": 8, "DV_TILE": 8, "VEC": 8},
    {"BLOCK_M": 64, "BLOCK_N": 16, "DV_TILE": 40},
)
BAD_PREFILL_PARAMS = (
    {"BLOCK_M": 0, "BLOCK_N": 8, "DV_TILE": 8, "VEC": 4},          # not positive
    {"BLOCK_M": 16, "BLOCK_N": 8, "DV_TILE": 12, "VEC": 4},         # DV_TILE does not divide DV
    {"BLOCK_M": 16, "BLOCK_N": 8, "DV_TILE": 8, "VEC": 4, "X": 1},  # unknown key
    {"BLOCK_M": "64", "BLOCK_N": 8, "DV_TILE": 8, "VEC": 4},        # wrong type
    {"BLOCK_M": 1 << 20, "BLOCK_N": 8, "DV_TILE": 8, "VEC": 4},     # above the max work-group
    {"BLOCK_M": 16, "BLOCK_N": 8, "DV_TILE": 8, "VEC": 3},          # no such vector width
    {"BLOCK_M": 16, "BLOCK_N": 1 << 14, "DV_TILE": 8, "VEC": 4},    # local memory overflow
    [("BLOCK_M", 16)],                                              # not a dict
)
DECODE_TILES = ({"ROWS": 2, "UNROLL": 2, "HEAD_TILE": 1, "MERGE_WG": 32},)
BAD_DECODE_PARAMS = (
    {"ROWS": 2, "UNROLL": 2, "HEAD_TILE": 3, "MERGE_WG": 32},       # HEAD_TILE does not divide G
    {"ROWS": 2, "UNROLL": 2, "HEAD_TILE": 1, "MERGE_WG": 48},       # MERGE_WG not a power of two
    {"ROWS": 2, "UNROLL": 2, "HEAD_TILE": 1},                       # missing key
    {"ROWS": 2.0, "UNROLL": 2, "HEAD_TILE": 1, "MERGE_WG": 32},     # wrong type
    {"ROWS": 4096, "UNROLL": 1, "HEAD_TILE": 1, "MERGE_WG": 32},    # work-group too large
    {"ROWS": 64, "UNROLL": 64, "HEAD_TILE": 1, "MERGE_WG": 32},     # local memory overflow
    "fast",                                                         # not a dict
)
BAD_DEVICES = ("no-such-device", "9:9", "1:99", 42, 3.5, object())


def _pocl_device() -> tuple[str | None, str | None]:
    """("P:D" of the first PoCL CPU device whose compiler works, the first word of its name:
    "pthread" in PoCL 3 and 6, "cpu" in PoCL 5), or (None, None) without one."""
    try:
        import pyopencl as cl

        from flashcl.opencl.runtime import compiler_error

        for pi, p in enumerate(cl.get_platforms()):
            for di, d in enumerate(p.get_devices()):
                if "portable" in p.name.lower() and d.type & cl.device_type.CPU and compiler_error(d) is None:
                    return f"{pi}:{di}", d.name.strip().split("-")[0].lower()
    except Exception:
        return None, None
    return None, None


POCL, POCL_NAME = _pocl_device()
pytestmark = pytest.mark.skipif(POCL is None, reason="needs the PoCL CPU device (pip install 'flashcl[pocl]')")


# --------------------------------------------------------------------------- strategies

def _view(draw, rng, shape, dtype):
    """An array of ``shape`` that is one of: contiguous, a strided slice of a larger array,
    a transposed copy viewed back, or reversed along an axis (negative stride)."""
    how = draw(st.sampled_from(["contiguous", "strided", "transposed", "reversed"]))
    if how == "strided":
        big = rng.standard_normal((*shape[:-1], shape[-1] * 2)).astype(dtype)
        return big[..., ::2]
    x = rng.standard_normal(shape).astype(dtype)
    if how == "transposed" and len(shape) >= 2:
        return np.ascontiguousarray(np.swapaxes(x, -1, -2)).swapaxes(-1, -2)
    if how == "reversed":
        return x[::-1] if shape[0] > 1 else x[..., ::-1]
    return x


def _device(draw):
    # spellings of the PoCL device (its "P:D", platform and device names, profile), and None for the
    # default device; the device name's word is taken from the device, which PoCL versions name differently
    return draw(st.sampled_from([None, POCL, "portable", POCL_NAME, "cpu"]))


def _break(draw, call, options):
    """Apply one of ``options`` (name -> mutation) to ``call``; returns its name."""
    name = draw(st.sampled_from(sorted(options)))
    options[name](call)
    return name


@st.composite
def prefill_calls(draw):
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    dtype = draw(st.sampled_from(["float32", "float16"]))
    rank = draw(st.sampled_from([3, 4]))
    b = 1 if rank == 3 else draw(st.integers(1, 2))
    h_kv = draw(st.integers(1, 2))
    h_q = h_kv * draw(st.sampled_from([1, 2, 3]))
    n_q, n_kv = draw(st.integers(1, 40)), draw(st.integers(1, 40))
    dk, dv = draw(st.sampled_from(HEAD_DIMS)), draw(st.sampled_from(HEAD_DIMS))
    lead = (b,) if rank == 4 else ()
    call = {
        "q": _view(draw, rng, (*lead, h_q, n_q, dk), dtype),
        "k": _view(draw, rng, (*lead, h_kv, n_kv, dk), dtype),
        "v": _view(draw, rng, (*lead, h_kv, n_kv, dv), dtype),
        "kw": {"causal": draw(st.booleans()), "device": _device(draw),
               "scale": draw(st.sampled_from([None, 0.05, 0.3])),
               "return_lse": draw(st.booleans())},
    }
    if draw(st.booleans()):
        tiles = [t for t in PREFILL_TILES if dv % t["DV_TILE"] == 0]
        if tiles:
            call["kw"]["params"] = dict(draw(st.sampled_from(tiles)))
    broken = None
    if draw(st.booleans()):
        def retype(c):
            bad = draw(st.sampled_from(BAD_DTYPES))
            c["q"], c["k"], c["v"] = (x.astype(bad) for x in (c["q"], c["k"], c["v"]))

        def mixed(c):
            c["k"] = c["k"].astype("float32" if dtype == "float16" else "float16")

        def rank5(c):
            c["q"] = c["q"][None]

        def heads(c):  # v has one more head than k
            c["v"] = np.concatenate([c["v"], c["v"][..., :1, :, :]], axis=-3)

        def head_dim(c):
            d = draw(st.sampled_from(BAD_HEAD_DIMS))
            c["q"] = rng.standard_normal((*c["q"].shape[:-1], d)).astype(c["q"].dtype)
            c["k"] = rng.standard_normal((*c["k"].shape[:-1], d)).astype(c["k"].dtype)

        def kv_len(c):  # v has one more key than k
            c["v"] = np.concatenate([c["v"], c["v"][..., :1, :]], axis=-2)

        def empty(c):
            c["q"] = c["q"][..., :0, :]

        def device(c):
            c["kw"]["device"] = draw(st.sampled_from(BAD_DEVICES))

        def params(c):
            c["kw"]["params"] = draw(st.sampled_from(BAD_PREFILL_PARAMS))

        def scale(c):
            c["kw"]["scale"] = draw(st.sampled_from([float("nan"), float("inf"), "0.1", True]))

        def causal(c):
            c["kw"]["causal"] = draw(st.sampled_from(["yes", 1, None]))

        def kind(c):
            c["k"] = c["k"].tolist()

        broken = _break(draw, call, dict(retype=retype, mixed=mixed, rank5=rank5, heads=heads,
                                         head_dim=head_dim, kv_len=kv_len, empty=empty,
                                         device=device, params=params, scale=scale,
                                         causal=causal, kind=kind))
    return call, broken


@st.composite
def decode_calls(draw):
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    dtype = draw(st.sampled_from(["float32", "float16"]))
    b = draw(st.integers(1, 3))
    h_kv = draw(st.integers(1, 2))
    h_q = h_kv * draw(st.sampled_from([1, 2, 4]))
    dk, dv = draw(st.sampled_from(HEAD_DIMS)), draw(st.sampled_from(HEAD_DIMS))
    paged = draw(st.booleans())
    lens = np.array([draw(st.integers(0, 40)) for _ in range(b)], dtype=np.int32)
    q = _view(draw, rng, (b, h_q, dk), dtype)
    if paged:
        bs = draw(st.sampled_from([1, 4, 16]))
        max_blocks = max(1, int(max(-(-n // bs) for n in lens)))
        num_blocks = b * max_blocks + draw(st.integers(0, 3))
        k = rng.standard_normal((num_blocks, bs, h_kv, dk)).astype(dtype)
        v = rng.standard_normal((num_blocks, bs, h_kv, dv)).astype(dtype)
        table = rng.permutation(num_blocks)[: b * max_blocks].reshape(b, max_blocks).astype(np.int32)
        for i, n in enumerate(lens):  # entries past a sequence's end are never read
            table[i, -(-n // bs):] = draw(st.sampled_from([-1, num_blocks, 2**31 - 1]))
        kw = {"block_table": table, "context_lens": lens}
    else:
        n_max = max(1, int(lens.max()) + draw(st.integers(0, 5)))
        k = _view(draw, rng, (b, h_kv, n_max, dk), dtype)
        v = _view(draw, rng, (b, h_kv, n_max, dv), dtype)
        kw = {"context_lens": lens} if draw(st.booleans()) else {}
    kw.update(device=_device(draw), num_splits=draw(st.sampled_from([None, 1, 2, 3, 64])),
              scale=draw(st.sampled_from([None, 0.2])), return_lse=draw(st.booleans()))
    if draw(st.booleans()):
        kw["params"] = dict(DECODE_TILES[0])
    if draw(st.booleans()):  # first keys anywhere: below 0, inside, at and past the end
        kw["key_start"] = np.array([draw(st.integers(-3, 45)) for _ in range(b)], dtype=np.int32)
    call = {"q": q, "k": k, "v": v, "kw": kw}
    broken = None
    if draw(st.booleans()):
        def retype(c):
            bad = draw(st.sampled_from(BAD_DTYPES))
            c["q"], c["k"], c["v"] = (x.astype(bad) for x in (c["q"], c["k"], c["v"]))

        def q_rank(c):  # 4-D is a decode of rows; 2-D and 5-D are neither
            c["q"] = c["q"][:, :, None, None, :] if draw(st.booleans()) else c["q"][0]

        def cache_rank(c):
            c["k"] = c["k"][0]

        def head_dim(c):
            c["q"] = rng.standard_normal((*c["q"].shape[:-1], dk + 8)).astype(c["q"].dtype)

        def lens_dtype(c):
            if "context_lens" in c["kw"]:
                c["kw"]["context_lens"] = c["kw"]["context_lens"].astype(np.int64)
            else:
                c["kw"]["context_lens"] = np.zeros(b + 1, np.int32)  # wrong shape

        def lens_range(c):
            cap = (c["kw"]["block_table"].shape[1] * c["k"].shape[1]) if "block_table" in c["kw"] \
                else c["k"].shape[2]
            bad = np.array(c["kw"].get("context_lens", np.full(b, cap, np.int32)), dtype=np.int32)
            bad[draw(st.integers(0, b - 1))] = draw(st.sampled_from([-1, cap + 1]))
            c["kw"]["context_lens"] = bad

        def table(c):
            if "block_table" in c["kw"]:
                t = c["kw"]["block_table"].copy()
                used = [i for i, n in enumerate(lens) if n > 0]
                if used:
                    t[used[0], 0] = draw(st.sampled_from([-1, c["k"].shape[0], 2**31 - 1]))
                else:
                    t = t.astype(np.int64)
                c["kw"]["block_table"] = t
            else:   # a block table for a contiguous cache: wrong shape for a paged one
                c["kw"]["block_table"] = np.zeros((b + 1, 2), np.int32)

        def no_lens(c):
            if "block_table" in c["kw"]:
                c["kw"].pop("context_lens")
            else:
                c["kw"]["num_splits"] = 0

        def splits(c):
            c["kw"]["num_splits"] = draw(st.sampled_from([0, -1, 1.5, True, 10**6]))

        def device(c):
            c["kw"]["device"] = draw(st.sampled_from(BAD_DEVICES))

        def params(c):
            c["kw"]["params"] = draw(st.sampled_from(BAD_DECODE_PARAMS))

        broken = _break(draw, call, dict(retype=retype, q_rank=q_rank, cache_rank=cache_rank,
                                         head_dim=head_dim, lens_dtype=lens_dtype,
                                         lens_range=lens_range, table=table, no_lens=no_lens,
                                         splits=splits, device=device, params=params))
    return call, broken


# --------------------------------------------------------------------------- the contract

def _check_result(got, ref_out, ref_lse, dtype, return_lse, what):
    out, lse = got if return_lse else (got, None)
    assert isinstance(out, np.ndarray) and out.dtype == np.dtype(dtype), f"{what}: got {type(out)} {getattr(out, 'dtype', None)}"
    assert out.shape == ref_out.shape, f"{what}: shape {out.shape}, expected {ref_out.shape}"
    assert np.all(np.isfinite(out)), f"{what}: non-finite output on valid input"
    err = rel_err(out, ref_out)
    assert err <= TOL[dtype], f"{what}: relative error {err:.3e} > {TOL[dtype]}"
    if return_lse:
        finite = np.isfinite(ref_lse)
        assert lse.shape == ref_lse.shape and np.array_equal(np.isfinite(lse), finite), f"{what}: lse"
        np.testing.assert_allclose(lse[finite], ref_lse[finite], rtol=1e-5, atol=1e-5, err_msg=what)


def _describe(call, broken):
    arrays = {n: (getattr(call[n], "shape", None), getattr(call[n], "dtype", type(call[n]).__name__),
                  getattr(call[n], "strides", None)) for n in ("q", "k", "v")}
    kw = {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in call["kw"].items()}
    return f"broken={broken} arrays={arrays} kw={kw}"


def _call_or_documented_error(fn, call, broken, what):
    """The call's result, or None when it raised one of the documented exceptions -- which it
    must do exactly when the call was broken."""
    try:
        got = fn(call["q"], call["k"], call["v"], **call["kw"])
    except ALLOWED as exc:
        assert broken is not None, f"{what}: a valid call raised {type(exc).__name__}: {exc}"
        assert str(exc), f"{what}: {type(exc).__name__} without a message"
        return None
    assert broken is None, f"{what}: an invalid call returned a result"
    return got


@SETTINGS
@given(prefill_calls())
def test_prefill_fuzz(case):
    call, broken = case
    what = f"prefill {_describe(call, broken)}"
    got = _call_or_documented_error(flashcl.prefill, call, broken, what)
    if got is None:
        return
    kw = call["kw"]
    ref_out, ref_lse = reference.attention(call["q"], call["k"], call["v"], causal=kw["causal"],
                                           scale=kw["scale"], return_lse=True)
    _check_result(got, ref_out, ref_lse, call["q"].dtype.name, kw["return_lse"], what)


@SETTINGS
@given(decode_calls())
def test_decode_fuzz(case):
    call, broken = case
    what = f"decode {_describe(call, broken)}"
    got = _call_or_documented_error(flashcl.decode, call, broken, what)
    if got is None:
        return
    kw = call["kw"]
    ref_out, ref_lse = reference.decode_attention(call["q"], call["k"], call["v"],
                                                  block_table=kw.get("block_table"),
                                                  context_lens=kw.get("context_lens"),
                                                  key_start=kw.get("key_start"), scale=kw["scale"],
                                                  return_lse=True)
    _check_result(got, ref_out, ref_lse, call["q"].dtype.name, kw["return_lse"], what)
