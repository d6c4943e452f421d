"""Random prefill calls through ``flashcl.prefill`` on each backend present, against the float64
oracle, as test_fuzz_decode does for decode.

Each call draws a dtype; 1-2 sequences; MHA, GQA or MQA; 1-40 query rows (the few-row routes
among them) over 1-80 keys, so N_q > N_kv too; head dims, DK != DV; K and V each plain or in a
quantized format the backend takes; causal or not; a window, softcap, sinks, ALiBi slopes per
head or per sequence; a boolean or additive mask of one of the shapes that broadcast to
(B, H_q, N_q, N_kv), some of its rows wholly hidden. Every key no row of its KV head's group may
see holds NaN (quantized: bytes 0xFF, int8's row scale NaN); out and lse must match the oracle
on the clean inputs within the dtype's tolerance, NaN-free. FLASHCL_FUZZ_EXAMPLES and
FLASHCL_FUZZ_SEED as in test_fuzz_decode.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("hypothesis")
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import flashcl  # noqa: E402
from flashcl import reference  # noqa: E402

from ._check import check_out_and_lse  # noqa: E402
from .test_fuzz_decode import BACKENDS, GGML, _fuzz, _poisoned, opencl_kinds, torch_kinds  # noqa: E402

MASK_SHAPES = ("rows", "batch", "heads", "full")  # (N_q, N_kv), (B, 1, ..), (1, H_q, ..), (B, H_q, ..)


@st.composite
def prefill_calls(draw, backend: str) -> dict:
    dtypes, formats = BACKENDS[backend]
    k_fmt, v_fmt = (draw(st.sampled_from((None,) + formats)) for _ in range(2))
    dk, dv = (draw(st.sampled_from((32, 64, 128) if f in GGML else (16, 40, 64, 128))) for f in (k_fmt, v_fmt))
    return {
        "dtype": draw(st.sampled_from(dtypes)), "k_fmt": k_fmt, "v_fmt": v_fmt, "dk": dk, "dv": dv,
        "b": draw(st.integers(1, 2)), "h_kv": draw(st.sampled_from((1, 2))), "group": draw(st.sampled_from((1, 2, 4))),
        "n_q": draw(st.one_of(st.integers(1, 40), st.sampled_from((1, 2, 16)))),
        "n_kv": draw(st.one_of(st.integers(1, 80), st.sampled_from((16, 64)))),
        "causal": draw(st.booleans()),
        "window": draw(st.one_of(st.none(), st.tuples(st.integers(-1, 30), st.integers(-1, 30)))),
        "softcap": draw(st.one_of(st.none(), st.floats(0.5, 30.0))),
        "sinks": draw(st.booleans()), "alibi": draw(st.sampled_from((None, "head", "batch"))),
        "mask": draw(st.sampled_from((None, "bool", "add"))), "mask_shape": draw(st.sampled_from(MASK_SHAPES)),
        "visible": draw(st.sampled_from((0.2, 0.7, 1.0))),
        "q_scale": draw(st.sampled_from((1.0, 4.0))), "seed": draw(st.integers(0, 2**31 - 1)),
    }


def _host_case(call: dict) -> dict:
    """numpy float64 q, k, v, the variants (mask as its drawn shape) and which (B, H_kv, N_kv) keys
    no row of their group may see."""
    rng = np.random.default_rng(call["seed"])
    b, h_kv, n_q, n_kv = call["b"], call["h_kv"], call["n_q"], call["n_kv"]
    h_q = h_kv * call["group"]
    case = {"q": rng.standard_normal((b, h_q, n_q, call["dk"])) * call["q_scale"],
            "k": rng.standard_normal((b, h_kv, n_kv, call["dk"])),
            "v": rng.standard_normal((b, h_kv, n_kv, call["dv"]))}
    var = {"window": call["window"], "softcap": call["softcap"],
           "sinks": rng.standard_normal(h_q).astype(np.float32) if call["sinks"] else None,
           "alibi_slopes": None, "mask": None}
    if call["alibi"]:
        var["alibi_slopes"] = rng.uniform(0, 0.3, (h_q,) if call["alibi"] == "head" else (b, h_q)).astype(np.float32)
    seen = np.ones((b, h_q, n_q, n_kv), bool)
    if call["causal"]:
        seen &= reference.causal_mask(n_q, n_kv)
    if call["window"] is not None:
        seen &= reference.window_mask(n_q, n_kv, call["window"])
    if call["mask"]:
        shape = {"rows": (n_q, n_kv), "batch": (b, 1, n_q, n_kv), "heads": (1, h_q, n_q, n_kv),
                 "full": (b, h_q, n_q, n_kv)}[call["mask_shape"]]
        shows = rng.random(shape) < call["visible"]
        shows[..., rng.random(n_q) < 0.15, :] = False  # whole rows hidden
        if call["mask"] == "bool":
            var["mask"] = shows
        else:
            var["mask"] = np.where(shows, rng.uniform(-2, 2, shape), -np.inf).astype(np.float32)
        seen &= np.broadcast_to(shows, seen.shape)
    case["variants"] = var
    case["hidden"] = ~seen.reshape(b, h_kv, call["group"], n_q, n_kv).any(axis=(2, 3))  # (B, H_kv, N_kv)
    return case


def _check(call: dict, run, to_kind, to_numpy) -> None:
    case = _host_case(call)
    q = to_kind(case["q"])
    (k_clean, k_dirty), (v_clean, v_dirty) = (_poisoned(case[n], call[f"{n}_fmt"], case["hidden"], to_kind)
                                              for n in ("k", "v"))
    k_ref, v_ref = ((to_numpy(flashcl.dequantize(c)) if call[f"{n}_fmt"] else to_numpy(c))
                    for n, c in (("k", k_clean), ("v", v_clean)))
    var = case["variants"]
    ref_out, ref_lse = reference.attention(to_numpy(q), k_ref, v_ref, causal=call["causal"], return_lse=True, **var)
    out, lse = run(q, k_dirty, v_dirty, var)
    check_out_and_lse(to_numpy(out), to_numpy(lse), ref_out, ref_lse, call["dtype"], f"{call}",
                      lse_rtol=max(1e-4, reference.TOLERANCE[call["dtype"]]))


@_fuzz(3)
@given(call=prefill_calls("opencl"))
def test_opencl_prefill_fuzz(cl_device, call):
    def run(q, k, v, var):
        return flashcl.prefill(q, k, v, causal=call["causal"], device=cl_device, return_lse=True, **var)

    _check(call, run, *opencl_kinds(call["dtype"])[:2])


@_fuzz(12)
@given(call=prefill_calls("triton"))
def test_triton_prefill_fuzz(triton_device, call):
    to_kind, to_numpy, on_device = torch_kinds(triton_device, call["dtype"])

    def run(q, k, v, var):
        return flashcl.prefill(q, k, v, causal=call["causal"], backend="triton", return_lse=True,
                               **{n: on_device(x) for n, x in var.items()})

    _check(call, run, to_kind, to_numpy)
