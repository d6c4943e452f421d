"""Random decode calls through ``flashcl.decode`` on each backend present, against the float64
oracle: hypothesis crosses what the targeted tests take one at a time or on hand-picked grids.

Each call draws a dtype; 1-3 sequences of 0-70 keys (the edges of the drawn block size and 700
among them); MHA, GQA or MQA; head dims, DK != DV; a contiguous or a paged cache (block size 1-32, a
permuted table whose unused entries are out of range); K and V each plain or in a quantized
format the backend takes; a window, softcap, sinks, ALiBi slopes per head or per sequence,
key_start; a split count; one query token per sequence or its last 1-4 (q 4-D). Every key a
row may not see (past its length, before its key_start, left of its window, in a block no table
entry names) holds NaN: plain caches NaN values,
quantized ones bytes 0xFF (a NaN ggml d, a NaN fp8 value, an int8 value of -1 with a NaN row
scale). The oracle attends the clean caches; out and lse must match it within the dtype's
tolerance, NaN-free.

Derandomized (a failure reproduces). FLASHCL_FUZZ_EXAMPLES sets the examples per backend (default
3 on OpenCL, which builds programs for each new combination: ~50 s an example on a cold 2-core
PoCL; 12 on Triton), FLASHCL_FUZZ_SEED another sequence of them (processes side by side).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import flashcl  # noqa: E402
from flashcl import quant, reference  # noqa: E402

from ._check import check_out_and_lse  # noqa: E402

SEED = os.environ.get("FLASHCL_FUZZ_SEED")


def _fuzz(examples: int):
    """The tests' settings: ``examples`` unless FLASHCL_FUZZ_EXAMPLES says otherwise."""
    examples = int(os.environ.get("FLASHCL_FUZZ_EXAMPLES", examples))
    chosen = settings(max_examples=examples, deadline=None, derandomize=SEED is None, database=None,
                      suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    return lambda test: chosen(test) if SEED is None else hypothesis.seed(int(SEED))(chosen(test))


GGML = ("q8_0", "q4_0")
BACKENDS = {  # dtypes, quantized formats
    "opencl": (("float32", "float16", "bfloat16"), ("q8_0", "q4_0", "int8")),
    "triton": (("float32", "float16", "bfloat16"), ("q8_0", "q4_0", "int8", "fp8_e4m3")),
}


@st.composite
def decode_calls(draw, backend: str) -> dict:
    dtypes, formats = BACKENDS[backend]
    k_fmt, v_fmt = (draw(st.sampled_from((None,) + formats)) for _ in range(2))
    dk, dv = (draw(st.sampled_from((32, 64, 128) if f in GGML else (16, 40, 64, 128))) for f in (k_fmt, v_fmt))
    block_size = draw(st.sampled_from((None, 1, 4, 16, 32)))  # None: a contiguous cache
    b = draw(st.integers(1, 3))
    edge = block_size or 16
    lens = draw(st.lists(st.one_of(st.integers(0, 70), st.sampled_from((edge - 1, edge, edge + 1, 2 * edge, 700))),
                         min_size=b, max_size=b))
    return {
        "dtype": draw(st.sampled_from(dtypes)), "k_fmt": k_fmt, "v_fmt": v_fmt, "dk": dk, "dv": dv,
        "h_kv": draw(st.sampled_from((1, 2))), "group": draw(st.sampled_from((1, 2, 4, 7, 8))),
        "block_size": block_size, "lens": lens,
        "window": draw(st.one_of(st.none(), st.tuples(st.integers(0, 40), st.sampled_from((0, -1))))),
        "softcap": draw(st.one_of(st.none(), st.floats(0.5, 30.0))),
        "sinks": draw(st.booleans()), "alibi": draw(st.sampled_from((None, "head", "batch"))),
        "key_start": draw(st.booleans()), "num_splits": draw(st.sampled_from((None, 1, 2, 3, 5))),
        # None: q (B, H_q, DK); else its last n_q rows (7 x 7 and 8 x 7: decode_cpu.cl's group tiles)
        "n_q": draw(st.sampled_from((None, 1, 3, 4, 7))),
        "q_scale": draw(st.sampled_from((1.0, 4.0))), "seed": draw(st.integers(0, 2**31 - 1)),
    }


def _first_seen(call: dict, key_start) -> list:
    """Each sequence's first key its queries may see (window and key_start; its first query row
    sits at the length less the rows)."""
    firsts = []
    for i, n in enumerate(call["lens"]):
        first = 0 if call["window"] is None else max(0, n - (call["n_q"] or 1) - call["window"][0])
        firsts.append(max(first, 0 if key_start is None else int(key_start[i])))
    return firsts


def _host_case(call: dict) -> dict:
    """numpy float64 q, K, V (contiguous (B, H_kv, N, D) or pages), table, lengths, variants,
    and where each sequence's keys live: [(page or None, slot or position)] per sequence."""
    rng = np.random.default_rng(call["seed"])
    b, h_kv, lens, bs = len(call["lens"]), call["h_kv"], call["lens"], call["block_size"]
    h_q = h_kv * call["group"]
    n_max = max(max(lens), 1)
    rows = () if call["n_q"] is None else (call["n_q"],)
    case = {"q": rng.standard_normal((b, h_q, *rows, call["dk"])) * call["q_scale"]}
    if bs is None:
        case["k"], case["v"] = (rng.standard_normal((b, h_kv, n_max, d)) for d in (call["dk"], call["dv"]))
        case["table"] = None
        case["where"] = [[(None, j) for j in range(n)] for n in lens]
    else:
        per_seq = -(-n_max // bs)
        num_blocks = b * per_seq + 2
        ids = rng.permutation(num_blocks)[: b * per_seq].reshape(b, per_seq)
        table = np.empty((b, per_seq + 1), np.int32)
        for i, n in enumerate(lens):  # entries past a sequence's blocks name no block of the cache
            used = -(-n // bs)
            table[i, :used] = ids[i, :used]
            table[i, used:] = np.where(np.arange(per_seq + 1 - used) % 2, -5, num_blocks + 3)
        case["table"] = table
        case["k"], case["v"] = (rng.standard_normal((num_blocks, bs, h_kv, d)) for d in (call["dk"], call["dv"]))
        case["where"] = [[(int(table[i, j // bs]), j % bs) for j in range(n)] for i, n in enumerate(lens)]
    case["lens"] = np.asarray(lens, np.int32)
    case["key_start"] = rng.integers(0, np.maximum(case["lens"], 1) + 1).astype(np.int32) if call["key_start"] else None
    case["variants"] = {
        "window": call["window"], "softcap": call["softcap"],
        "sinks": rng.standard_normal(h_q).astype(np.float32) if call["sinks"] else None,
        "alibi_slopes": (rng.uniform(0, 0.3, (h_q,) if call["alibi"] == "head" else (b, h_q)).astype(np.float32)
                         if call["alibi"] else None)}
    return case


def _poison_mask(call: dict, case: dict, rows_shape: tuple) -> np.ndarray:
    """True at every cache row (contiguous (B, H_kv, N) or paged (blocks, block_size, H_kv)) that
    no query may see."""
    hidden = np.ones(rows_shape, bool)
    for i, first in enumerate(_first_seen(call, case["key_start"])):
        for j, (page, slot) in enumerate(case["where"][i]):
            if j >= first:
                if page is None:
                    hidden[i, :, slot] = False
                else:
                    hidden[page, slot, :] = False
    return hidden


def _poisoned(x, fmt, hidden, to_kind):
    """(the clean cache, the poisoned one) in the backend's kind: plain (``to_kind`` of x) or a
    QuantizedTensor; hidden rows NaN (plain) or bytes 0xFF (quantized; int8's row scale NaN)."""
    if not fmt:
        bad = x.copy()
        bad[hidden] = np.nan
        return to_kind(x), to_kind(bad)
    clean, dirty = (flashcl.quantize(to_kind(x), fmt) for _ in range(2))
    data, scales = dirty.data, dirty.scales
    if quant.kind_of(data) == "torch":
        import torch

        m = torch.from_numpy(hidden).to(data.device)
        data.view(torch.uint8)[m] = 255
        if fmt == "int8":
            scales[m] = float("nan")
    else:
        data.view(np.uint8)[hidden] = 255
        if fmt == "int8":
            scales[hidden] = np.nan
    return clean, dirty


def _check(call: dict, run, to_kind, to_numpy) -> None:
    case = _host_case(call)
    dtype = call["dtype"]
    q = to_kind(case["q"])
    q64 = to_numpy(q)  # q as rounded to its dtype
    rows = case["k"].shape[:3]
    hidden = _poison_mask(call, case, rows)
    (k_clean, k_dirty), (v_clean, v_dirty) = (_poisoned(case[n], call[f"{n}_fmt"], hidden, to_kind) for n in ("k", "v"))
    k_ref, v_ref = ((c if call[f"{n}_fmt"] else to_numpy(c)) for n, c in (("k", k_clean), ("v", v_clean)))
    var = case["variants"]
    ref_out, ref_lse = reference.decode_attention(
        q64, k_ref, v_ref, block_table=case["table"], context_lens=case["lens"], return_lse=True,
        key_start=case["key_start"], **var)
    out, lse = run(q, k_dirty, v_dirty, case, var)
    # lse: the scores' error, which a 16-bit dequantized K tile carries at its dtype's precision
    check_out_and_lse(to_numpy(out), to_numpy(lse), ref_out, ref_lse, dtype, f"{call}",
                      lse_rtol=max(1e-4, reference.TOLERANCE[dtype]))


@_fuzz(3)
@given(call=decode_calls("opencl"))
def test_opencl_decode_fuzz(cl_device, call):
    to_kind, to_numpy, on_host = opencl_kinds(call["dtype"])

    def run(q, k, v, case, var):
        table, lens, key_start = (on_host(case[n]) for n in ("table", "lens", "key_start"))
        return flashcl.decode(q, k, v, block_table=table, context_lens=lens, key_start=key_start,
                              num_splits=call["num_splits"], device=cl_device, return_lse=True, **var)

    _check(call, run, to_kind, to_numpy)


@_fuzz(12)
@given(call=decode_calls("triton"))
def test_triton_decode_fuzz(triton_device, call):
    to_kind, to_numpy, on_device = torch_kinds(triton_device, call["dtype"])

    def run(q, k, v, case, var):
        tables = [None if case[n] is None else on_device(case[n]) for n in ("table", "lens", "key_start")]
        return flashcl.decode(q, k, v, block_table=tables[0], context_lens=tables[1], key_start=tables[2],
                              num_splits=call["num_splits"], backend="triton", return_lse=True,
                              **{n: on_device(x) for n, x in var.items()})

    _check(call, run, to_kind, to_numpy)


def opencl_kinds(dtype_name: str) -> tuple:
    """The OpenCL half's (to_kind, to_numpy, on_host: a table as q's kind of array): numpy
    arrays, or torch CPU tensors for bfloat16 (numpy has none)."""
    if dtype_name == "bfloat16":
        return torch_kinds("cpu", dtype_name)
    dtype = np.dtype(dtype_name)
    return lambda x: x.astype(dtype), lambda x: np.asarray(x, np.float64), lambda x: x


def torch_kinds(device: str, dtype_name: str) -> tuple:
    """The Triton half's conversions: (to_kind: a float array as a tensor of the call's dtype on
    ``device``; to_numpy: a tensor back as float64; on_device: an array as it is on ``device``,
    None, tuples and floats unchanged)."""
    torch = pytest.importorskip("torch")
    dtype = getattr(torch, dtype_name)

    def on_device(x):
        return x if x is None or isinstance(x, (tuple, float)) else torch.from_numpy(np.ascontiguousarray(x)).to(device)

    return (lambda x: on_device(x).to(dtype), lambda x: x.detach().to("cpu", torch.float64).numpy(), on_device)
