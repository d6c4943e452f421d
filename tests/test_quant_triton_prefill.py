"""Quantized K/V caches (flashcl.quant: q8_0, q4_0, int8, fp8_e4m3) in the Triton prefill, against
the float64 oracle on the values the caches hold (``reference.attention`` dequantizes
QuantizedTensors), within the plain kernels' tolerance of q's dtype: the quantization error is the
oracle's too, so what is left is the kernel's own. Native on CUDA (one forced tile config),
TRITON_INTERPRET=1 on CPU (the interpreter's 16 x 16 tile), small shapes.

K/V rows have 32-column blocks whose magnitudes differ by 1e4 (so do the scales of a row's blocks)
and all-zero blocks; q is scaled per block so that every block of K moves the scores, and the
output is compared per 32-column block of V, so that a wrong scale on a small block shows. K/V are
views of the first N_kv keys of longer caches whose extra rows are NaN: a read past N_kv shows.
"""

from __future__ import annotations

import dataclasses
import zlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")
triton = pytest.importorskip("triton")

import flashcl  # noqa: E402  (after the importorskip above)
from flashcl import reference  # noqa: E402
from flashcl.quant import QK, QuantizedTensor  # noqa: E402
from flashcl.triton import prefill as tp  # noqa: E402
from tests._triton_tiles import forced_params, forced_tile  # noqa: E402
from flashcl.variants import Variants  # noqa: E402

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
FORMATS = ("q8_0", "q4_0", "int8", "fp8_e4m3")
# |lse - ref| <= LSE_TOL * (1 + |ref|). The oracle attends the dequantized values rounded to q's
# dtype; the kernel keeps int8 / fp8 values exact and applies their scales in float32, so 16-bit
# scores differ by that rounding (float32: the plain kernel's bound)
LSE_TOL = {"float32": 1e-4, "float16": 1e-3, "bfloat16": 1e-2}
PAD = 3  # cache rows past N_kv, poisoned: the kernel gets views of the first N_kv


def _gen(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()) % 2**31)


def _block_magnitudes(d: int) -> torch.Tensor:
    """log10 magnitude of each 32-column block: from -2 to 2, so blocks differ by 1e4."""
    return torch.linspace(-2.0, 2.0, max(1, d // QK), dtype=torch.float64)


def _cache(gen, b, h_kv, n, d) -> torch.Tensor:
    """float64 (b, h_kv, n, d) rows whose 32-column blocks have magnitudes 10^(-2 .. 2) (x 10^±0.5
    per row), about one block in eight all zero, and one row all zero."""
    x = torch.randn((b, h_kv, n, d), generator=gen, dtype=torch.float64)
    nb = d // QK
    mag = _block_magnitudes(d) + torch.rand((b, h_kv, n, nb), generator=gen, dtype=torch.float64) - 0.5
    keep = torch.rand((b, h_kv, n, nb, 1), generator=gen) > 0.125
    x = (x.view(b, h_kv, n, nb, QK) * 10.0 ** mag[..., None] * keep).view(b, h_kv, n, d)
    x[:, :, 1] = 0.0
    return x


def _queries(gen, b, h_q, n_q, dk) -> torch.Tensor:
    """q scaled against K's block magnitudes, so that every block of K moves the scores."""
    q = torch.randn((b, h_q, n_q, dk), generator=gen, dtype=torch.float64) * 2.0
    return q * torch.repeat_interleave(10.0 ** -_block_magnitudes(dk), QK)


def _quantized(x: torch.Tensor, fmt, n_kv: int, dtype, device):
    """x (float64, with PAD rows past n_kv) in ``dtype`` on ``device``, quantized to ``fmt`` (None:
    plain), the rows past n_kv poisoned, then the view of the first n_kv keys."""
    x = x.to(dtype).to(device)
    if fmt is None:
        x[:, :, n_kv:] = float("nan")
        return x[:, :, :n_kv]
    qt = flashcl.quantize(x, fmt)
    if fmt in ("q8_0", "q4_0"):  # every block's d -> fp16 NaN (0x7eff)
        qt.data[:, :, n_kv:, :, 0] = 0xFF
        qt.data[:, :, n_kv:, :, 1] = 0x7E
    elif fmt == "int8":
        qt.data[:, :, n_kv:] = 127
        qt.scales[:, :, n_kv:] = float("nan")
    else:  # fp8: the values themselves (one scale for the tensor)
        qt.data[:, :, n_kv:] = float("nan")
    scales = qt.scales[:, :, :n_kv] if fmt != "fp8_e4m3" else qt.scales
    return QuantizedTensor(qt.data[:, :, :n_kv], scales, fmt, (*qt.shape[:2], n_kv, qt.shape[3]), qt.dtype)


def _np(x):
    """float64 numpy of a tensor (a bool mask stays bool); a QuantizedTensor stays as it is."""
    if not isinstance(x, torch.Tensor):
        return x
    return (x if x.dtype == torch.bool else x.double()).cpu().numpy()


def _check(q, k, v, *, causal, device, params=None, **variants):
    """flashcl.prefill (backend triton, return_lse) against the oracle on the same caches: out per
    32-column block of V within TOLERANCE of q's dtype, lse within LSE_TOL. Returns (out, lse).
    ``params`` "flashcl": flashcl's own choice (its routes too), None: the forced test tile."""
    dtype_name = str(q.dtype).split(".")[-1]
    out, lse = flashcl.prefill(q, k, v, causal=causal, backend="triton", return_lse=True,
                               params=None if params == "flashcl" else params or forced_params(device), **variants)
    ref, ref_lse = reference.attention(_np(q), _np(k), _np(v), causal=causal, return_lse=True,
                                       **{n: _np(x) for n, x in variants.items()})
    got, got_lse = out.double().cpu().numpy(), lse.double().cpu().numpy()
    assert np.isfinite(got).all(), f"non-finite outputs at {np.argwhere(~np.isfinite(got))[:4].tolist()}"
    tol = reference.TOLERANCE[dtype_name]
    for c in range(0, got.shape[-1], QK):
        err = reference.rel_err(got[..., c:c + QK], ref[..., c:c + QK])
        worst = np.unravel_index(np.argmax(np.abs(got[..., c:c + QK] - ref[..., c:c + QK])), got[..., c:c + QK].shape)
        assert err <= tol, (f"{dtype_name} columns {c}..{c + QK - 1}: relative error {err:.3g} > {tol:g}; "
                            f"worst at {worst}: got {got[..., c:c + QK][worst]:.6g}, "
                            f"want {ref[..., c:c + QK][worst]:.6g}")
    seen = np.isfinite(ref_lse)
    assert np.array_equal(np.isneginf(got_lse), ~seen), "lse must be -inf exactly where a row sees no key"
    lse_err = np.abs(got_lse[seen] - ref_lse[seen]) / (1.0 + np.abs(ref_lse[seen]))
    assert lse_err.size == 0 or lse_err.max() <= LSE_TOL[dtype_name], (
        f"{dtype_name} lse error {lse_err.max():.3g} > {LSE_TOL[dtype_name]}")
    return out, lse


def _case(device, dtype, k_fmt, v_fmt, *, b=2, h_q=4, h_kv=2, n_q=21, n_kv=37, dk=64, dv=96, seed=0):
    """q and K/V caches in their formats (views of the first n_kv keys of poisoned caches)."""
    gen = _gen(k_fmt, v_fmt, dtype, seed)
    q = _queries(gen, b, h_q, n_q, dk).to(dtype).to(device)
    k = _quantized(_cache(gen, b, h_kv, n_kv + PAD, dk), k_fmt, n_kv, dtype, device)
    v = _quantized(_cache(gen, b, h_kv, n_kv + PAD, dv), v_fmt, n_kv, dtype, device)
    return q, k, v


# --------------------------------------------------------------------------- formats

@pytest.mark.parametrize("k_fmt, v_fmt", [("q8_0", "q8_0"), ("q4_0", "q4_0"), ("int8", "int8"),
                                          ("fp8_e4m3", "fp8_e4m3"), ("q4_0", None), (None, "int8")],
                         ids=lambda f: str(f))
def test_few_query_rows_run_as_decode(triton_device, monkeypatch, k_fmt, v_fmt):
    """A prefill of few query rows over quantized caches runs as the decode of its rows as heads
    (prefill._rows_as_decode, QUERY_ROWS; q4_0 read by the byte gather, stored order being one
    row's): causal with N_q < N_kv, with a window and ALiBi, and with a mask of holes, the
    poisoned rows past N_kv unread; against the oracle on the caches' values."""
    routed = []
    real = tp._rows_as_decode
    monkeypatch.setattr(tp, "_rows_as_decode", lambda q, *a, **kw: routed.append(q.shape) or real(q, *a, **kw))
    q, k, v = _case(triton_device, torch.float16, k_fmt, v_fmt, n_q=5, dv=64)
    gen = _gen("variants", k_fmt, v_fmt)
    slopes = torch.rand(2, 4, generator=gen).to(triton_device) * 0.4 + 0.05
    holes = (torch.rand(2, 1, 5, 37, generator=gen) > 0.3).to(triton_device)
    for kw in (dict(), dict(window=(7, 0), alibi_slopes=slopes), dict(mask=holes)):
        routed.clear()
        _check(q, k, v, causal=True, device=triton_device, params="flashcl", **kw)
        assert routed == [q.shape], (sorted(kw), routed)


def test_few_query_rows_hide_nonfinite_row_scales(triton_device):
    """On the few-row route an int8 V row scale of inf or NaN reaches only the rows that see its
    key: the last key's (only the last causal row sees it), and a key a mask hides from row 0."""
    q, k, v = _case(triton_device, torch.float16, "int8", "int8", b=1, n_q=4, n_kv=40, dk=32, dv=32)
    for bad_key, bad, mask, rows in ((39, float("inf"), None, slice(0, 3)), (5, float("nan"), True, slice(0, 1))):
        scales = v.scales.clone()
        scales[:, :, bad_key] = bad
        v_bad = dataclasses.replace(v, scales=scales)
        kw = {}
        if mask:
            holes = torch.ones(1, 1, 4, 40, dtype=torch.bool)
            holes[:, :, 0, bad_key] = False
            kw["mask"] = holes.to(triton_device)
        out = flashcl.prefill(q, k, v_bad, causal=True, backend="triton", **kw)
        ref = reference.attention(_np(q), _np(k), _np(v), causal=True, **{n: _np(x) for n, x in kw.items()})
        got = out.double().cpu().numpy()[:, :, rows]
        assert np.isfinite(got).all(), (bad_key, bad)
        assert reference.rel_err(got, ref[:, :, rows]) <= reference.TOLERANCE["float16"], (bad_key, bad)


PAIRS = [(f, f) for f in FORMATS] + [("q8_0", "int8"), (None, "q4_0"), ("int8", None), ("fp8_e4m3", "q8_0"),
                                     ("q4_0", "fp8_e4m3")]


@pytest.mark.parametrize("k_fmt, v_fmt", PAIRS, ids=[f"{k}-{v}" for k, v in PAIRS])
def test_formats_match_reference(triton_device, k_fmt, v_fmt):
    """K and V each in its format or plain: GQA 2:1, DK 64 != DV 96 (a padded ggml block), causal
    bottom-right with N_q < N_kv, ragged last tiles, then non-causal."""
    q, k, v = _case(triton_device, torch.float16, k_fmt, v_fmt)
    _check(q, k, v, causal=True, device=triton_device)
    _check(q, k, v, causal=False, device=triton_device)


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_other_dtypes(triton_device, fmt, dtype_name):
    """q float32 / bfloat16 (the cache's logical dtype), MQA, DK 32 (one ggml block) != DV 64."""
    q, k, v = _case(triton_device, DTYPES[dtype_name], fmt, fmt, b=1, h_q=3, h_kv=1, n_q=19, n_kv=19, dk=32, dv=64)
    _check(q, k, v, causal=True, device=triton_device)


def test_inputs_have_zero_blocks_and_scales_apart():
    """The cases above hold all-zero blocks and per-block scales 1e4 apart, so a wrong block
    scale or a zero d mishandled shows."""
    x = _cache(_gen("inputs"), 1, 2, 40, 128)
    qt = flashcl.quantize(x.float(), "q8_0")
    d = qt.scales.float()
    assert (d == 0).any() and (x.view(1, 2, 40, 4, QK).abs().amax(-1) == 0).any()
    nonzero = d[d > 0]
    assert nonzero.max() / nonzero.min() > 1e3


def test_three_d_inputs_and_softmax_overlap(triton_device):
    """(H, N, D) inputs, and loop 1 with each softmax under the P @ V dot (its P waits one trip
    with the previous tile's int8 V scales)."""
    t = forced_tile(triton_device)
    q, k, v = _case(triton_device, torch.float16, "q8_0", "int8", b=1, h_q=2, h_kv=2, n_q=3 * t + 1, n_kv=3 * t + 1,
                    dk=64, dv=64)
    out = flashcl.prefill(q[0], _batch0(k), _batch0(v), causal=True, backend="triton", params=forced_params(triton_device))
    ref = reference.attention(_np(q), _np(k), _np(v), causal=True)[0]
    assert reference.rel_err(out.double().cpu().numpy(), ref) <= reference.TOLERANCE["float16"]
    _check(q, k, v, causal=False, device=triton_device, params=forced_params(triton_device, SOFTMAX_OVERLAP=True))


def _batch0(x):
    """Batch 0 of a (B, ..) cache, plain or quantized, as (H, N, D)."""
    if not isinstance(x, QuantizedTensor):
        return x[0]
    scales = x.scales if x.fmt == "fp8_e4m3" else x.scales[0]
    return QuantizedTensor(x.data[0], scales, x.fmt, x.shape[1:], x.dtype)


# --------------------------------------------------------------------------- variants

def test_window_softcap_sinks_alibi(triton_device):
    """Every score variant on a q8_0 K / int8 V cache: a window narrower than a tile, softcap,
    sinks, ALiBi with per-batch slopes; then on an fp8 K / q4_0 V cache."""
    t = forced_tile(triton_device)
    q, k, v = _case(triton_device, torch.float16, "q8_0", "int8", n_q=t + 5, n_kv=3 * t + 2, dk=64, dv=64)
    gen = _gen("variants")
    _check(q, k, v, causal=True, device=triton_device, window=(t - 3, 0), softcap=2.5,
           sinks=(torch.randn(4, generator=gen) * 2).to(triton_device),
           alibi_slopes=(torch.rand(2, 4, generator=gen) * 0.3).to(triton_device))
    _check(q, k, v, causal=False, device=triton_device, window=(t + 1, 2), softcap=4.0)
    # fp8 K: its one scale is folded into the scores' scales, softcap's included
    q, k, v = _case(triton_device, torch.float16, "fp8_e4m3", "q4_0", n_q=t + 5, n_kv=3 * t + 2, dk=64, dv=64)
    _check(q, k, v, causal=True, device=triton_device, window=(t + 2, 0), softcap=2.5,
           alibi_slopes=(torch.rand(2, 4, generator=gen) * 0.3).to(triton_device))


@pytest.mark.parametrize("k_fmt, v_fmt, dk, dv", [("q4_0", "fp8_e4m3", 64, 32), ("q8_0", "int8", 64, 64),
                                                  ("int8", "q4_0", 32, 96)])
def test_mask_with_quantized_cache(triton_device, k_fmt, v_fmt, dk, dv):
    """A bool mask that hides whole rows and whole tiles, with quantized caches; V of head dim 32
    (on sm_90 its 64-byte rows once made the masked P @ V read past its shared-memory operand)."""
    t = forced_tile(triton_device)
    n_q, n_kv = t + 5, 2 * t + 3
    q, k, v = _case(triton_device, torch.float16, k_fmt, v_fmt, n_q=n_q, n_kv=n_kv, dk=dk, dv=dv)
    mask = torch.rand(2, 1, n_q, n_kv, generator=_gen("mask", k_fmt, dv)) < 0.6
    mask[:, :, 3] = False       # a row that sees nothing
    mask[:, :, :, t:2 * t] = False  # a key tile no row sees
    _check(q, k, v, causal=False, device=triton_device, mask=mask.to(triton_device))


@pytest.mark.parametrize("fmt", ["q8_0", "int8", "fp8_e4m3"])
def test_hidden_keys_never_leak(triton_device, fmt):
    """inf in K and NaN in V at keys no row sees (left of every row's window, in a tile that rows
    see in part): quantized, such rows hold non-finite scales or values, and still never reach
    the output. fp8's scale is one per tensor, so there only the values are poisoned."""
    t = forced_tile(triton_device)
    n_q, n_kv = 5, 3 * t + 4
    q, k, v = _case(triton_device, torch.float16, fmt, fmt, b=1, h_q=2, h_kv=1, n_q=n_q, n_kv=n_kv, dk=64, dv=64)
    first_seen = n_kv - n_q - (t - 2)  # the window's left edge for the first row, inside a tile
    hidden = [first_seen - 1, first_seen - 3, 2]
    bad_k, bad_v = _poison(k, hidden, float("inf")), _poison(v, hidden, float("nan"))
    out, _ = flashcl.prefill(q, bad_k, bad_v, causal=True, window=(t - 2, 0), backend="triton", return_lse=True,
                             params=forced_params(triton_device))
    ref = reference.attention(_np(q), k, v, causal=True, window=(t - 2, 0))
    got = out.double().cpu().numpy()
    assert np.isfinite(got).all(), f"a hidden key leaked: non-finite at {np.argwhere(~np.isfinite(got))[:4].tolist()}"
    assert reference.rel_err(got, ref) <= reference.TOLERANCE["float16"]


def _poison(x: QuantizedTensor, keys, value) -> QuantizedTensor:
    """A copy of x whose rows ``keys`` hold ``value`` as a quantizer turns it into bytes: a
    non-finite d (ggml), a non-finite row scale (int8), or the values themselves (fp8)."""
    data, scales = x.data.clone(), x.scales.clone() if x.fmt != "fp8_e4m3" else x.scales
    if x.fmt in ("q8_0", "q4_0"):
        d = torch.tensor([value], dtype=torch.float16).view(torch.uint8)
        data[:, :, keys, :, 0], data[:, :, keys, :, 1] = int(d[0]), int(d[1])
    elif x.fmt == "int8":
        scales[:, :, keys] = value
    else:
        data[:, :, keys] = float("nan")  # e4m3fn has no inf
    return QuantizedTensor(data, scales, x.fmt, x.shape, x.dtype)


# --------------------------------------------------------------------------- API, errors, compile

def test_bad_head_dim_is_refused_before_launch(triton_device):
    """ggml formats pack the head dim in blocks of 32: a hand-built q8_0 cache of head dim 48
    is a ValueError from flashcl.prefill."""
    q = torch.randn(1, 2, 4, 48, dtype=torch.float16, device=triton_device)
    v = torch.randn(1, 2, 4, 48, dtype=torch.float16, device=triton_device)
    data = torch.zeros(1, 2, 4, 1, 34, dtype=torch.uint8, device=triton_device)
    k = QuantizedTensor(data, data[..., :2].view(torch.float16)[..., 0], "q8_0", (1, 2, 4, 48), torch.float16)
    with pytest.raises(ValueError, match=r"^k: q8_0 packs the head dim in blocks of 32; got DK=48$"):
        flashcl.prefill(q, k, v, backend="triton")


def test_backend_refusals(triton_device):
    """What the kernel relies on, checked in flashcl.triton.prefill before the op runs: rows of
    contiguous bytes, int8 scales of the data's shape, no tensor descriptors for quantized K/V."""
    q, k, v = _case(triton_device, torch.float16, "q8_0", "int8", b=1, h_q=2, h_kv=2, n_q=4, n_kv=6, dk=64, dv=64)
    every_other = QuantizedTensor(k.data[..., ::2, :], k.scales[..., ::2], "q8_0", (1, 2, 6, 32), k.dtype)
    with pytest.raises(ValueError, match=r"^k: the kernel reads each row of the q8_0 data as contiguous bytes"):
        tp.prefill(q[..., :32], every_other, v)
    bad_scales = QuantizedTensor(v.data, v.scales[..., 0], "int8", v.shape, v.dtype)
    with pytest.raises(ValueError, match=r"^v: int8 data of shape \(1, 2, 6, 64\) needs float32 scales of "
                                         r"shape \(1, 2, 6, 1\)"):
        tp.prefill(q, k, bad_scales)
    with pytest.raises(ValueError, match=r"^params\['USE_TMA'\]: tensor descriptors need .* plain \(not quantized\)"):
        tp.prefill(q, k, v, params=forced_params(triton_device, USE_TMA=True))


def test_compiled_with_quantized_cache_and_variants(triton_device):
    """torch.compile (fullgraph) of a step that attends over a q4_0 K / int8 V cache with a window
    and sinks: no graph break, the op's fake kernel gives the logical head dim (inductor on CUDA,
    aot_eager on CPU); the op passes opcheck with a quantized cache."""
    q, k, v = _case(triton_device, torch.float16, "q4_0", "int8", b=1, h_q=4, h_kv=2, n_q=9, n_kv=20, dk=64, dv=32)
    sinks = torch.randn(4, generator=_gen("compile")).to(triton_device)
    torch._dynamo.reset()

    def step(q, k, v, sinks):
        out = flashcl.prefill(q * 1.0, k, v, causal=True, backend="triton", window=(6, 0), sinks=sinks)
        return out.float() + 1.0

    backend = "inductor" if triton_device == "cuda" else "aot_eager"
    got = torch.compile(step, fullgraph=True, backend=backend)(q, k, v, sinks)
    assert got.shape == (1, 4, 9, 32)
    ref = reference.attention(_np(q), k, v, causal=True, window=(6, 0), sinks=_np(sinks))
    assert reference.rel_err((got - 1.0).double().cpu().numpy(), ref) <= reference.TOLERANCE["float16"]
    args = (q, k.data, v.data, True, 0.125, True)
    kwargs = dict(v_scales=v.scales, k_format="q4_0", v_format="int8")
    torch.library.opcheck(torch.ops.flashcl.prefill.default, args, kwargs,
                          test_utils=("test_schema", "test_faketensor"))


class _Capture:
    """Stands in for tp._prefill_kernel: records the launch's arguments, runs nothing."""

    def __init__(self):
        self.arg_names = tp._prefill_kernel.arg_names
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **kw: self.calls.append({**dict(zip(self.arg_names, args)), **kw})


QUANT_ARGS = ("KScales", "VScales", "stride_ksb", "stride_ksh", "stride_ksn", "stride_vsb", "stride_vsh",
              "stride_vsn")


def test_plain_call_compiles_the_quant_args_out(triton_device, monkeypatch):
    """Plain K/V: K_FMT = V_FMT = "" and every quantized-only argument None, which Triton makes a
    constexpr: the plain kernel is compiled as before (its sm_90 PTX byte for byte). int8 K and
    fp8 V: their scales and int8's strides reach the kernel."""
    capture = _Capture()
    monkeypatch.setattr(tp, "_prefill_kernel", capture)
    q, k, v = _case(triton_device, torch.float16, None, None, b=1, h_q=2, h_kv=2, n_q=4, n_kv=6, dk=64, dv=64)
    tp.prefill(q, k, v, causal=True, params=forced_params(triton_device))
    plain, = capture.calls
    assert (plain["K_FMT"], plain["V_FMT"]) == ("", "") and all(plain[n] is None for n in QUANT_ARGS)
    q, k, v = _case(triton_device, torch.float16, "int8", "fp8_e4m3", b=1, h_q=2, h_kv=2, n_q=4, n_kv=6,
                    dk=64, dv=64)
    tp.prefill(q, k, v, causal=True, params=forced_params(triton_device))
    quant = capture.calls[1]
    assert (quant["K_FMT"], quant["V_FMT"]) == ("int8", "fp8_e4m3")
    assert quant["KScales"] is k.scales and quant["VScales"] is v.scales
    assert (quant["stride_ksb"], quant["stride_ksh"], quant["stride_ksn"]) == k.scales.stride()[:3]
    assert quant["stride_vsn"] is None and quant["K"] is k.data and quant["USE_TMA"] is False


@pytest.mark.parametrize("k_fmt, v_fmt", [(None, None), ("q8_0", "int8"), ("fp8_e4m3", None)])
def test_best_config_builds_the_autotuners_key(triton_device, monkeypatch, k_fmt, v_fmt):
    """best_config looks up the key the autotuner files a call under (its key arguments, then
    the dtype of every tensor argument in order), formats and scales included."""
    capture = _Capture()
    monkeypatch.setattr(tp, "_prefill_kernel", capture)
    q, k, v = _case(triton_device, torch.float16, k_fmt, v_fmt, b=1, h_q=2, h_kv=2, n_q=4, n_kv=6, dk=64, dv=64)
    sinks = torch.zeros(2, device=triton_device)
    tp.prefill(q, k, v, causal=True, params=forced_params(triton_device), variants=Variants(sinks=sinks))
    args, = capture.calls
    in_order = [args[n] for n in capture.arg_names if n in args]
    key = (tuple(args[n] for n in tp._prefill_autotuned.keys)
           + tuple(str(a.dtype) for a in in_order if hasattr(a, "dtype")))
    config = triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=4, num_stages=2)
    monkeypatch.setattr(tp._prefill_autotuned, "cache", {key: config})
    formats = (k_fmt or "", v_fmt or "")
    got = tp.best_config(4, 6, 64, 64, True, torch.float16, 2, tma_ok=bool(args["TMA_OK"]),
                         variants=Variants(sinks=sinks), kv_formats=formats)
    assert got is not None and got["BLOCK_M"] == 64


def test_best_config_keys_on_formats(triton_device):
    """The autotuner's cache is keyed by the formats: a quantized call tunes its own entry."""
    if triton_device != "cuda":
        pytest.skip("autotuning runs on CUDA only")
    q, k, v = _case(triton_device, torch.float16, "q8_0", "int8", b=1, h_q=8, h_kv=8, n_q=1024, n_kv=1024,
                    dk=64, dv=64)
    flashcl.prefill(q, k, v, causal=True, backend="triton")
    assert tp.best_config(1024, 1024, 64, 64, True, torch.float16, 8, kv_formats=("q8_0", "int8")) is not None
