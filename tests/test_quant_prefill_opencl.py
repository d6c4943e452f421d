"""Quantized K/V caches (flashcl.quant: q8_0, q4_0, int8) in the OpenCL prefill kernels, both
layouts (prefill.cl "rows", prefill_tiles.cl "tiles"), against the float64 oracle on the values
the caches hold (``reference.attention`` dequantizes QuantizedTensors), on every OpenCL device
present (conftest.py).

Every K/V row has head-dim blocks whose magnitudes differ by 1e4 (the scales of a row's blocks
differ as much) and all-zero blocks; q is scaled per block so that every block moves the scores,
and the output is compared per 32-column block of V, so that a wrong scale on a small block
shows. The kernels run on NaN-poisoned out/lse with K/V as views of longer caches whose extra
rows are NaN (fp16 d = NaN, int8 scale = NaN): a read past N_kv would show. The tiles are small
(BLOCK_M 16, BLOCK_N 8, DV_TILE 32) so that a few dozen keys cross partial tiles, the diagonal and
several DV passes, each of which starts inside a quantized row.
"""

from __future__ import annotations

import importlib.util
import itertools
import zlib

import numpy as np
import pytest

import flashcl
from flashcl import reference
from flashcl.opencl.prefill import PrefillKernel, PrefillProblem, choose_params, program
from flashcl.opencl.runtime import get_device
from flashcl.quant import QK, QuantizedTensor, quantize
from flashcl.variants import Variants

from ._check import assert_close

cla = pytest.importorskip("pyopencl.array")

LAYOUTS = {
    "rows": dict(BLOCK_M=16, BLOCK_N=8, DV_TILE=32, VEC=4),
    "tiles": dict(VARIANT="tiles", BLOCK_M=16, BLOCK_N=8, DV_TILE=32, TILE_M=4, TILE_N=2),
}
FORMATS = ("q8_0", "q4_0", "int8")
PAD = 3  # cache rows past N_kv, poisoned: the kernels get views of the first N_kv


def _rng(*key):
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def _block_magnitudes(d: int) -> np.ndarray:
    """log10 magnitude of each 32-column block: from -2 to 2, so blocks differ by 1e4."""
    return np.linspace(-2.0, 2.0, max(1, d // QK))


def _cache(rng, b, h_kv, n, d, dtype):
    """(b, h_kv, n, d) rows whose 32-column blocks have magnitudes 10^(-2 .. 2) (x 10^±0.5 per
    row), about one block in eight all zero, and one row all zero."""
    x = rng.standard_normal((b, h_kv, n, d))
    if d % QK == 0:
        mag = _block_magnitudes(d) + rng.uniform(-0.5, 0.5, (b, h_kv, n, d // QK))
        x = (x.reshape(b, h_kv, n, d // QK, QK) * 10.0 ** mag[..., None]
             * (rng.random((b, h_kv, n, d // QK, 1)) > 0.125)).reshape(b, h_kv, n, d)
    x[:, :, 1] = 0.0
    return x.astype(dtype)


def _queries(rng, b, h_q, n_q, dk, dtype):
    """q scaled against K's block magnitudes, so that every block of K moves the scores."""
    q = rng.standard_normal((b, h_q, n_q, dk)) * 2.0
    if dk % QK == 0:
        q = q * np.repeat(10.0 ** -_block_magnitudes(dk), QK)
    return q.astype(dtype)


def _quantized(x, fmt, n_kv):
    """x quantized to fmt (None: x itself), with the rows past n_kv poisoned."""
    if fmt is None:
        x = x.copy()
        x[:, :, n_kv:] = np.nan
        return x
    qt = quantize(x, fmt)
    if fmt == "int8":
        qt.scales[:, :, n_kv:] = np.nan
        qt.data[:, :, n_kv:] = 127
    else:  # every block's d -> fp16 NaN (0x7eff)
        qt.data[:, :, n_kv:, :, 0] = 0xFF
        qt.data[:, :, n_kv:, :, 1] = 0x7E
    return qt


def _first_keys(x, n: int):
    """The first n keys of a plain or quantized (B, H_kv, N, ..) cache, as a view."""
    if not isinstance(x, QuantizedTensor):
        return x[:, :, :n]
    scales = x.scales[:, :, :n] if x.scales is not None else None
    return QuantizedTensor(x.data[:, :, :n], scales, x.fmt, (*x.shape[:2], n, x.shape[3]), x.dtype)


def _to_device(x, queue):
    if not isinstance(x, QuantizedTensor):
        return cla.to_device(queue, x)
    scales = cla.to_device(queue, np.ascontiguousarray(x.scales)) if x.fmt == "int8" else None
    return QuantizedTensor(cla.to_device(queue, x.data), scales, x.fmt, x.shape, x.dtype)


def _fmt(x):
    return x.fmt if isinstance(x, QuantizedTensor) else None


class Runner:
    """One prefill kernel built for the formats of kq / kv, run on NaN-poisoned outputs with K/V
    as views of the first n_kv keys of their device caches."""

    def __init__(self, device, q, kq, vq, n_kv, causal, params, var: Variants | None = None):
        self.h = get_device(device)
        (b, h_q, n_q, dk), h_kv, dv = q.shape, kq.shape[1], vq.shape[3]
        self.prob = PrefillProblem(b, h_q, h_kv, n_q, n_kv, dk, dv, causal, q.dtype.name, _fmt(kq), _fmt(vq))
        self.params = choose_params(self.h, self.prob, params).params
        self.kern = PrefillKernel(self.h, self.prob, self.params, write_lse=True,
                                  flags=var.flags() if var is not None else None)

    def __call__(self, q, kq, vq, var: Variants | None = None):
        p, queue = self.prob, self.h.queue
        qd = cla.to_device(queue, q)
        kd, vd = (_first_keys(_to_device(x, queue), p.n_kv) for x in (kq, vq))
        out = cla.to_device(queue, np.full((p.b, p.h_q, p.n_q, p.dv), np.nan, dtype=q.dtype))
        lse = cla.to_device(queue, np.full((p.b, p.h_q, p.n_q), np.nan, dtype=np.float32))
        self.kern(qd, kd, vd, out, lse, p.dk ** -0.5, variants=var).wait()
        return out.get(), lse.get()


def oracle(q, kq, vq, n_kv, causal, var: Variants | None = None):
    kw = {} if var is None else dict(window=var.window, softcap=var.softcap, sinks=var.sinks,
                                     alibi_slopes=var.alibi_slopes, mask=var.mask)
    return reference.attention(q, _first_keys(kq, n_kv), _first_keys(vq, n_kv), causal=causal,
                               return_lse=True, **kw)


def assert_matches(out, lse, ref_out, ref_lse, dtype, what, rows=None):
    """out within the dtype's tolerance as a whole and in every 32-column block (the blocks of V
    differ by 1e4 in size), lse within it where finite and -inf where the oracle's is."""
    if rows is not None:
        out, lse, ref_out, ref_lse = out[rows], lse[rows], ref_out[rows], ref_lse[rows]
    assert_close(out, ref_out, dtype, what)
    for c in range(0, out.shape[-1], QK):
        assert_close(out[..., c:c + QK], ref_out[..., c:c + QK], dtype, f"{what}, columns {c}..{c + QK - 1}")
    finite = np.isfinite(ref_lse)
    assert np.array_equal(np.isfinite(lse), finite), f"{what}: lse finiteness differs"
    assert np.all(np.isneginf(lse[~finite])), f"{what}: a row that sees no key needs lse = -inf"
    tol = reference.TOLERANCE[dtype]
    np.testing.assert_allclose(lse[finite], ref_lse[finite], rtol=tol, atol=tol, err_msg=what)


def check(device, layout, k_fmt, v_fmt, *, dtype, causal, dk, dv, shape=(2, 4, 2, 37, 70), var=None,
          params=None):
    b, h_q, h_kv, n_q, n_kv = shape
    rng = _rng(layout, k_fmt, v_fmt, dtype, causal, dk, dv, shape)
    q = _queries(rng, b, h_q, n_q, dk, dtype)
    kq = _quantized(_cache(rng, b, h_kv, n_kv + PAD, dk, dtype), k_fmt, n_kv)
    vq = _quantized(_cache(rng, b, h_kv, n_kv + PAD, dv, dtype), v_fmt, n_kv)
    out, lse = Runner(device, q, kq, vq, n_kv, causal, params or LAYOUTS[layout], var)(q, kq, vq, var)
    ref_out, ref_lse = oracle(q, kq, vq, n_kv, causal, var)
    assert_matches(out, lse, ref_out, ref_lse, dtype,
                   f"{layout} K={k_fmt} V={v_fmt} {dtype} causal={causal} DK={dk} DV={dv} {shape}")


# --------------------------------------------------------------------------- each format

def _format_cases():
    """Each format for K, for V and for both, in both layouts; the head dim (64/128/256), dtype
    and causality rotate so that every format meets each of them. The plain side of a one-sided
    case has another head dim (DK != DV), for K one that is no multiple of 32 (40)."""
    cases = []
    for (fi, fmt), (wi, which), (li, layout) in itertools.product(
            enumerate(FORMATS), enumerate(("k", "v", "kv")), enumerate(LAYOUTS)):
        d = (64, 128, 256)[(fi + wi + li) % 3]
        dtype = ("float32", "float16")[(fi + li) % 2]
        causal = (fi + wi + li) % 2 == 0
        dk, dv = {"k": (d, 32), "v": (40, d), "kv": (d, d)}[which]
        k_fmt, v_fmt = (fmt if "k" in which else None), (fmt if "v" in which else None)
        cases.append(pytest.param(layout, k_fmt, v_fmt, dtype, causal, dk, dv,
                                  id=f"{layout}-{which}-{fmt}-d{d}-{dtype}-{'causal' if causal else 'full'}"))
    return cases


@pytest.mark.parametrize("layout, k_fmt, v_fmt, dtype, causal, dk, dv", _format_cases())
def test_format_matches_oracle(cl_device, layout, k_fmt, v_fmt, dtype, causal, dk, dv):
    check(cl_device, layout, k_fmt, v_fmt, dtype=dtype, causal=causal, dk=dk, dv=dv)


@pytest.mark.parametrize("k_fmt, v_fmt", [("q4_0", "int8"), ("int8", "q8_0")])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_k_and_v_in_different_formats(cl_device, layout, k_fmt, v_fmt):
    """K and V in different formats, MQA, N_q > N_kv (causal rows before the first key see
    nothing: zeros and lse = -inf), a K tile of fewer ggml blocks than work-items."""
    check(cl_device, layout, k_fmt, v_fmt, dtype="float32", causal=True, dk=32, dv=96, shape=(1, 3, 1, 30, 21))


# tiles whose V slice has at least a ggml block per work-item: V is staged a block per step
BLOCK_STEP_LAYOUTS = {
    "rows": dict(BLOCK_M=16, BLOCK_N=16, DV_TILE=32, VEC=4),
    "tiles": dict(VARIANT="tiles", BLOCK_M=16, BLOCK_N=16, DV_TILE=64, TILE_M=4, TILE_N=4),
}


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
@pytest.mark.parametrize("layout", BLOCK_STEP_LAYOUTS)
def test_v_staged_a_block_per_step(cl_device, layout, fmt):
    check(cl_device, layout, fmt, fmt, dtype="float32", causal=True, dk=64, dv=128,
          params=BLOCK_STEP_LAYOUTS[layout])


def test_inputs_have_zero_blocks_and_scales_apart():
    """What the cases above rest on: the caches hold all-zero blocks (d = 0, or -0 in q4_0) and
    blocks whose scales differ by over 1e3 within a row."""
    x = _cache(_rng("inputs"), 1, 2, 40, 128, "float32")
    for fmt in ("q8_0", "q4_0"):
        d = np.abs(quantize(x, fmt).scales.astype(np.float32)).reshape(-1, 4)
        assert (d == 0).any()
        d = d[(d > 0).all(-1)]
        assert (d.max(-1) / d.min(-1) > 1e3).any()


# --------------------------------------------------------------------------- variants

@pytest.mark.parametrize("layout", LAYOUTS)
def test_variants_on_quantized_caches(cl_device, layout):
    """Window, softcap, sinks, ALiBi and a bool mask together on a q4_0 K and q8_0 V."""
    b, h_q, n_q, n_kv = 2, 4, 37, 70
    rng = _rng("variants", layout)
    hidden = rng.random((b, 1, n_q, n_kv)) < 0.3
    hidden[:, :, :, 16:32] = True  # whole key tiles hidden: skipped by the tile map
    var = Variants(window=(12, 3), softcap=1.5, sinks=(rng.standard_normal(h_q) + 2).astype(np.float32),
                   alibi_slopes=rng.uniform(0.05, 0.6, (b, h_q)).astype(np.float32), mask=~hidden)
    check(cl_device, layout, "q4_0", "q8_0", dtype="float32", causal=True, dk=64, dv=64, var=var)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_hidden_quantized_keys_never_leak(cl_device, layout, fmt):
    """One key's K and V scales poisoned (fp16 d = inf / int8 scale = NaN): the rows whose window
    does not reach it equal the oracle on the clean cache."""
    b, h_q, h_kv, n_q, n_kv, d, key = 1, 2, 1, 37, 70, 64, 40
    rng = _rng("poison", layout, fmt)
    q = _queries(rng, b, h_q, n_q, d, "float32")
    kq = _quantized(_cache(rng, b, h_kv, n_kv + PAD, d, "float32"), fmt, n_kv)
    vq = _quantized(_cache(rng, b, h_kv, n_kv + PAD, d, "float32"), fmt, n_kv)
    var = Variants(window=(9, 2))
    ref_out, ref_lse = oracle(q, kq, vq, n_kv, False, var)
    for x in (kq, vq):
        if fmt == "int8":
            x.scales[:, :, key] = np.nan
        else:
            x.data[:, :, key, :, :2] = np.frombuffer(np.float16(np.inf).tobytes(), np.uint8)
    out, lse = Runner(cl_device, q, kq, vq, n_kv, False, LAYOUTS[layout], var)(q, kq, vq, var)
    pos = np.arange(n_q) + n_kv - n_q
    blind = np.broadcast_to((key < pos - 9) | (key > pos + 2), lse.shape)
    assert blind.any() and not blind.all()
    assert_matches(out, lse, ref_out, ref_lse, "float32", f"{layout} {fmt} poisoned key {key}", rows=blind)
    assert not np.isfinite(out[~blind]).all(), "the rows that see the poisoned key should show it"


# --------------------------------------------------------------------------- public API

@pytest.mark.parametrize("kind", ["numpy", "torch", "pyopencl"])
def test_api_takes_each_kind(cl_device, kind):
    """flashcl.prefill with QuantizedTensors of numpy, torch CPU or pyopencl data, 3-D inputs,
    return_lse and the device's default tiles (wide vectors on CPUs)."""
    rng = _rng("api", kind)
    h_q, h_kv, n_q, n_kv, d = 4, 2, 50, 90, 128
    q = _queries(rng, 1, h_q, n_q, d, "float32")[0]
    k, v = (_cache(rng, 1, h_kv, n_kv, d, "float32")[0] for _ in range(2))
    ref_out, ref_lse = reference.attention(q, quantize(k, "q8_0"), quantize(v, "int8"), causal=True,
                                           return_lse=True)
    if kind == "torch":
        torch = pytest.importorskip("torch")
        q, k, v = (torch.from_numpy(x) for x in (q, k, v))
    elif kind == "pyopencl":
        queue = get_device(cl_device).queue
        q, k, v = (cla.to_device(queue, x) for x in (q, k, v))
    kq, vq = quantize(k, "q8_0"), quantize(v, "int8")
    out, lse = flashcl.prefill(q, kq, vq, causal=True, return_lse=True,
                               device=None if kind == "pyopencl" else cl_device)
    if kind == "torch":
        assert isinstance(out, torch.Tensor)
        out, lse = out.numpy(), lse.numpy()
    elif kind == "pyopencl":
        assert isinstance(out, cla.Array)
        out, lse = out.get(), lse.get()
    assert_matches(out, lse, ref_out, ref_lse, "float32", f"api {kind}")


def test_plain_build_has_no_quant_defines():
    """No quantized input: the defines of the plain kernel; a quantized one adds only its code."""
    plain = PrefillProblem(1, 4, 2, 37, 70, 64, 64, True, "float16")
    for params in LAYOUTS.values():
        defines = program(plain, params)[2]
        assert not any(name.endswith("_QUANT") for name in defines)
        quant = program(PrefillProblem(1, 4, 2, 37, 70, 64, 64, True, "float16", "q4_0", "int8"), params)[2]
        assert quant == {**defines, "K_QUANT": 2, "V_QUANT": 3}


def test_refusals(cl_device):
    """What the kernels cannot read is refused before launch: fp8_e4m3 (torch-only), a plain K
    for a kernel built quantized, int8 scales not laid out like the rows."""
    rng = _rng("refuse")
    q = rng.standard_normal((1, 2, 8, 64)).astype(np.float32)
    k = rng.standard_normal((1, 1, 8, 64)).astype(np.float32)
    if importlib.util.find_spec("torch") is not None:
        import torch

        qt, kt = torch.from_numpy(q), torch.from_numpy(k)
        with pytest.raises(TypeError, match="fp8_e4m3"):
            flashcl.prefill(qt, quantize(kt, "fp8_e4m3"), kt, device=cl_device)
    kq = quantize(k, "int8")
    run = Runner(cl_device, q, kq, k, 8, False, LAYOUTS["rows"])
    with pytest.raises(ValueError, match="built for a int8 k"):
        run(q, k, k)
    queue = run.h.queue
    qd, vd = cla.to_device(queue, q), cla.to_device(queue, k)
    out = cla.empty(queue, (1, 2, 8, 64), np.float32)
    longer = cla.to_device(queue, np.concatenate([kq.scales, kq.scales], axis=2))
    shifted = QuantizedTensor(cla.to_device(queue, kq.data), longer[:, :, 8:], "int8", kq.shape, kq.dtype)
    with pytest.raises(ValueError, match="laid out like the rows"):
        run.kern(qd, shifted, vd, out, None, 0.125)


# --------------------------------------------------------------------------- Oclgrind

# One tiny case per format under Oclgrind's bounds, race and uninitialized-value checks: partial
# tiles, DV passes that start inside a quantized row, int8 scale reads, keys past N_kv not read,
# and V staged a ggml block per step.
OCLGRIND_CASES = {
    "q8_0-k-rows": ("rows", "q8_0", None, True, (1, 2, 1, 11, 19, 64, 32),
                    dict(BLOCK_M=8, BLOCK_N=4, DV_TILE=16, VEC=4)),
    "q4_0-v-tiles": ("tiles", None, "q4_0", False, (1, 2, 1, 10, 13, 32, 64),
                     dict(VARIANT="tiles", BLOCK_M=8, BLOCK_N=4, DV_TILE=16, TILE_M=2, TILE_N=2)),
    "int8-kv-rows": ("rows", "int8", "int8", True, (1, 2, 1, 9, 17, 32, 32),
                     dict(BLOCK_M=8, BLOCK_N=4, DV_TILE=16, VEC=4)),
    "q4_0-k-q8_0-v-block-steps": ("rows", "q4_0", "q8_0", True, (1, 2, 1, 9, 13, 32, 64),
                                  dict(BLOCK_M=8, BLOCK_N=8, DV_TILE=32, VEC=4)),
}


def _oclgrind_worker(name: str) -> None:
    """Run one case on the Oclgrind device (in a subprocess started by the test)."""
    import pyopencl.characterize

    pyopencl.characterize.nv_compute_capability = lambda dev: None  # see test_oclgrind._worker
    layout, k_fmt, v_fmt, causal, (b, h_q, h_kv, n_q, n_kv, dk, dv), params = OCLGRIND_CASES[name]
    rng = _rng("oclgrind", name)
    q = _queries(rng, b, h_q, n_q, dk, "float32")
    kq = _quantized(_cache(rng, b, h_kv, n_kv + PAD, dk, "float32"), k_fmt, n_kv)
    vq = _quantized(_cache(rng, b, h_kv, n_kv + PAD, dv, "float32"), v_fmt, n_kv)
    out, lse = Runner("oclgrind", q, kq, vq, n_kv, causal, params)(q, kq, vq)
    ref_out, ref_lse = oracle(q, kq, vq, n_kv, causal)
    assert_matches(out, lse, ref_out, ref_lse, "float32", f"oclgrind {name}")
    print("OCLGRIND-CASE-OK")


@pytest.mark.parametrize("name", OCLGRIND_CASES)
def test_quantized_under_oclgrind(name, tmp_path):
    from tests.test_oclgrind import _oclgrind_present, run_under_oclgrind

    if not _oclgrind_present():
        pytest.skip("Oclgrind is not installed (pip install 'flashcl[oclgrind]')")
    run_under_oclgrind("tests.test_quant_prefill_opencl:_oclgrind_worker", name, name, tmp_path)
