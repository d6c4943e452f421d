"""The Triton kernels on hostile inputs, against the float64 oracle on clean ones.

- A key a row cannot see never influences it, whatever its K or V holds: every such element is
  set to NaN or +inf (prefill: the keys past the causal limit of some rows and past N_kv; decode:
  the cache past context_lens[b], the partial last block's unwritten slots, unused blocks), and
  the rows must match the oracle on the clean inputs.
- lse is NaN wherever out is: a NaN in one q row gives NaN out and lse on that row only (a row
  that sees no key still returns zeros and lse -inf).
- Device-resident tables are never read back: block ids outside the cache and context lengths
  outside [0, capacity] give NaN rows for their sequence only, and no out-of-bounds access.

Every test takes ``triton_device``: native on CUDA, TRITON_INTERPRET=1 on CPU (small shapes there);
the Gluon kernels and the tile configs that need sm_90 run on CUDA only.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from flashcl import reference

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from flashcl.triton import decode as td  # noqa: E402
from flashcl.triton import decode_gluon as tg  # noqa: E402
from flashcl.triton import prefill as tp  # noqa: E402

from .test_triton_decode import _case, _check, _np  # noqa: E402

NAN, INF = float("nan"), float("inf")
REL_TOL = reference.TOLERANCE
LSE_TOL = 1e-4  # |lse - ref| <= LSE_TOL * (1 + |ref|)
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
gluon_only = pytest.mark.skipif(not (torch.cuda.is_available() and tg.available()), reason="needs CUDA and Gluon")


def _compare(got, got_lse, ref, ref_lse, dtype, what):
    """Finite out within the dtype's tolerance of the oracle, lse within LSE_TOL; -inf where the
    oracle's is."""
    bad = ~np.isfinite(got)
    assert not bad.any(), f"{what}: {bad.sum()} non-finite outputs, first at {np.argwhere(bad)[:5].tolist()}"
    err = float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30))
    worst = np.unravel_index(np.argmax(np.abs(got - ref)), got.shape)
    assert err <= REL_TOL[dtype], (f"{what}: rel err {err:.2e} > {REL_TOL[dtype]:.0e}; worst element {worst}: "
                                   f"{got[worst]} vs {ref[worst]}")
    seen = np.isfinite(ref_lse)
    assert np.array_equal(np.isneginf(got_lse), ~seen), f"{what}: lse -inf pattern differs"
    lerr = np.abs(got_lse[seen] - ref_lse[seen]) / (1 + np.abs(ref_lse[seen]))
    assert lerr.size == 0 or lerr.max() <= LSE_TOL, f"{what}: lse err {lerr.max():.2e}"


# --------------------------------------------------------------------------- prefill

# (N_q, N_kv): equal, and N_q < N_kv; neither a multiple of the tile (16 under the interpreter,
# 64 or 128 on a GPU)
PREFILL_SHAPES = {"cpu": [(37, 37), (21, 50)], "cuda": [(300, 300), (130, 333)]}
# GPU tile configs: pointer loads, and TMA with the softmax overlapped (sm_90 only)
PREFILL_PARAMS = {
    "ptr128x64": {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3},
    "tma64x64-overlap": {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3, "USE_TMA": True,
                         "SOFTMAX_OVERLAP": True},
}


def _prefill_params(device, every=False):
    """The tile configs to run: the interpreter's; on a GPU the TMA one where sm_90 has it, and
    with ``every`` the pointer one too."""
    if device != "cuda":
        return {"interpreter": None}
    keep = dict(PREFILL_PARAMS)
    if torch.cuda.get_device_capability()[0] < 9:
        keep.pop("tma64x64-overlap")
    elif not every:
        keep.pop("ptr128x64")
    return keep


def _randn(shape, dtype, device, gen):
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(getattr(torch, dtype)).to(device)


@pytest.mark.parametrize("value", [NAN, INF], ids=["nan", "inf"])
@pytest.mark.parametrize("shape", [0, 1], ids=["nq=nkv", "nq<nkv"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_prefill_hidden_keys_poisoned(triton_device, dtype, shape, value):
    """Causal, GQA 2: batch element i has every key from cuts[i] on set to ``value`` in K and V,
    and so do the keys past N_kv (k and v are views of longer buffers). Rows that see no poisoned
    key match the oracle on clean inputs; the others are NaN in out and lse."""
    n_q, n_kv = PREFILL_SHAPES[triton_device][shape]
    shift = n_kv - n_q
    cuts = [shift + 1, shift + 7, shift + 16, shift + 17, shift + n_q // 2 + 3, n_kv - 1]
    b, h_q, h_kv, d = len(cuts), 4, 2, 32 if triton_device == "cpu" else 64
    gen = torch.Generator().manual_seed(n_q + n_kv)
    q = _randn((b, h_q, n_q, d), dtype, triton_device, gen)
    k = _randn((b, h_kv, n_kv + 9, d), dtype, triton_device, gen)
    v = _randn((b, h_kv, n_kv + 9, d), dtype, triton_device, gen)
    ref, ref_lse = reference.attention(_np(q), _np(k[:, :, :n_kv]), _np(v[:, :, :n_kv]), causal=True,
                                       return_lse=True)
    for i, cut in enumerate(cuts):
        k[i, :, cut:] = value
        v[i, :, cut:] = value
    clean = np.arange(n_q)[None, :] + shift < np.array(cuts)[:, None]  # (B, N_q)
    for name, params in _prefill_params(triton_device, every=dtype == "float16").items():
        out, lse = tp.prefill(q, k[:, :, :n_kv], v[:, :, :n_kv], causal=True, return_lse=True, params=params)
        o, l = _np(out), _np(lse)
        rows = np.broadcast_to(clean[:, None, :], l.shape)
        _compare(o[rows], l[rows], ref[rows], ref_lse[rows], dtype, f"{name} clean rows")
        assert np.isnan(o[~rows]).all() and np.isnan(l[~rows]).all(), f"{name}: rows that see a poisoned key"


@pytest.mark.parametrize("value", [NAN, INF], ids=["nan", "inf"])
def test_prefill_past_n_kv_poisoned(triton_device, value):
    """Non-causal, N_kv not a multiple of the tile: the keys past N_kv (k and v are views of
    longer buffers) are poisoned and must not be read."""
    n_q, n_kv = (21, 37) if triton_device == "cpu" else (130, 333)
    gen = torch.Generator().manual_seed(5)
    q = _randn((2, 2, n_q, 32), "float16", triton_device, gen)
    k = _randn((2, 2, n_kv + 40, 32), "float16", triton_device, gen)
    v = _randn((2, 2, n_kv + 40, 32), "float16", triton_device, gen)
    ref, ref_lse = reference.attention(_np(q), _np(k[:, :, :n_kv]), _np(v[:, :, :n_kv]), return_lse=True)
    k[:, :, n_kv:] = value
    v[:, :, n_kv:] = value
    for name, params in _prefill_params(triton_device).items():
        out, lse = tp.prefill(q, k[:, :, :n_kv], v[:, :, :n_kv], return_lse=True, params=params)
        _compare(_np(out), _np(lse), ref, ref_lse, "float16", name)


@pytest.mark.parametrize("causal", [False, True])
def test_prefill_nan_q_row(triton_device, causal):
    """NaN in one q row gives NaN out and lse on that row only; with N_q > N_kv (causal), a NaN q
    row that sees no key still returns zeros and lse -inf."""
    n_q, n_kv = (30, 20) if triton_device == "cpu" else (200, 150)
    gen = torch.Generator().manual_seed(7)
    q = _randn((2, 4, n_q, 32), "float16", triton_device, gen)
    k = _randn((2, 2, n_kv, 32), "float16", triton_device, gen)
    v = _randn((2, 2, n_kv, 32), "float16", triton_device, gen)
    ref, ref_lse = reference.attention(_np(q), _np(k), _np(v), causal=causal, return_lse=True)
    blind = n_q - n_kv - 1  # causal: the last row that sees no key
    nan_rows = [(0, 1, n_q - 1), (1, 3, blind + 3), (1, 0, blind)]
    for b, h, i in nan_rows:
        q[b, h, i, 5] = NAN
    for name, params in _prefill_params(triton_device).items():
        out, lse = tp.prefill(q, k, v, causal=causal, return_lse=True, params=params)
        o, l = _np(out), _np(lse)
        rows = np.ones(l.shape, dtype=bool)
        for b, h, i in nan_rows:
            rows[b, h, i] = False
            if causal and i == blind:
                assert (o[b, h, i] == 0).all() and np.isneginf(l[b, h, i]), f"{name}: a row that sees no key"
            else:
                assert np.isnan(o[b, h, i]).all() and np.isnan(l[b, h, i]), f"{name}: NaN q row {b, h, i}"
        _compare(o[rows], l[rows], ref[rows], ref_lse[rows], "float16", f"{name} other rows")


# --------------------------------------------------------------------------- decode

@pytest.fixture
def poison(monkeypatch):
    """Every buffer the launch allocates starts as NaN, so an unwritten element fails."""
    monkeypatch.setattr(td, "_empty", lambda shape, dtype, device: torch.full(shape, NAN, dtype=dtype, device=device))


@pytest.fixture
def sentinel(monkeypatch):
    """Every buffer the launch allocates starts as 7.0: an unwritten element is neither NaN nor
    the oracle's value (for the tests whose expected outputs hold NaN)."""
    monkeypatch.setattr(td, "_empty", lambda shape, dtype, device: torch.full(shape, 7.0, dtype=dtype, device=device))


@pytest.fixture
def gluon_calls(monkeypatch):
    """The Gluon kernels' launches, counted by name."""
    calls = []
    for name in ("launch", "launch_gqa"):
        fn = getattr(tg, name)
        monkeypatch.setattr(tg, name, lambda *a, _f=fn, _n=name, **kw: (calls.append(_n), _f(*a, **kw))[1])
    return calls


MHA, GQA = (4, 4), (8, 2)
BLOCK = 16
LENS = [0, 1, 23, 57, 48]  # empty, one token, partial last blocks, whole blocks (table entries past the end)


def _decode_configs(device, heads, layout):
    """(name, config, split counts): every decode path the shape can take on this device."""
    if layout == "contiguous":
        return [("contiguous", {}, (1, 3, 5))]
    runs = [("default", {}, (1, 3, 5)), ("masked-rows", {"whole_pages": False}, (1, 3)),
            ("late-pages", {"early_pages": False}, (1, 3))]
    if heads == MHA:
        runs.append(("mha_fma", {"mha_fma": True, "gluon_mha": False}, (1, 3)))
    if device == "cuda" and tg.available():
        if heads == MHA:
            runs.append(("gluon_mha", {"mha_fma": True}, (1,)))
        else:
            runs.append(("gluon_gqa", {"gluon_gqa": True}, (1, 3)))
    return runs


def _decode_case(device, heads, lens=LENS, block_size=BLOCK, seed=0):
    d = 32 if device == "cpu" else 128  # the Gluon kernels take head dim 128
    return _case(device, "float16", b=len(lens), h_q=heads[0], h_kv=heads[1], lens=lens, dk=d,
                 block_size=block_size, seed=seed)


def _poison_decode(c, value, block_size):
    """A copy of the caches with every element no query may see set to ``value``: the contiguous
    cache past each context length; in the pages every slot past the length (the partial last
    block's unwritten slots, whole blocks past the end) and every block no sequence uses."""
    k, v = c["k"].clone(), c["v"].clone()
    bt = c["block_table"].cpu()
    used = torch.zeros(c["k_pages"].shape[:2], dtype=torch.bool)
    for b, n in enumerate(c["lens"].tolist()):
        k[b, :, n:] = value
        v[b, :, n:] = value
        for t in range(n):
            used[bt[b, t // block_size], t % block_size] = True
    hidden = ~used.to(c["k_pages"].device)
    k_pages, v_pages = c["k_pages"].clone(), c["v_pages"].clone()
    k_pages[hidden] = value
    v_pages[hidden] = value
    return k, v, k_pages, v_pages


def _decode(c, layout, k, v, k_pages, v_pages, num_splits, config, lens=None, block_table=None):
    lens = c["lens"] if lens is None else lens
    if layout == "contiguous":
        return td._launch(c["q"], k, v, None, lens, c["scale"], num_splits, config=config)
    bt = c["block_table"] if block_table is None else block_table
    return td._launch(c["q"], k_pages, v_pages, bt, lens, c["scale"], num_splits, config=config)


@pytest.mark.parametrize("value", [NAN, INF], ids=["nan", "inf"])
@pytest.mark.parametrize("heads", [MHA, GQA], ids=["mha", "gqa"])
@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_decode_hidden_keys_poisoned(triton_device, layout, heads, value, poison, gluon_calls):
    """Every K/V element past each context length set to ``value``, in every decode path (plain,
    split with the fused merge (3) and the reduce kernel (5), the masked-row and late-page
    variants, the MHA loop, the Gluon kernels on CUDA): the oracle's result on clean caches."""
    c = _decode_case(triton_device, heads)
    caches = _poison_decode(c, value, BLOCK)
    for name, config, splits in _decode_configs(triton_device, heads, layout):
        for ns in splits:
            out, lse = _decode(c, layout, *caches, ns, config)
            _check(out, c["ref"], "float16", f"{name} splits={ns}", None, lse, c["ref_lse"])
    if triton_device == "cuda" and tg.available() and layout == "paged":
        assert gluon_calls, "the Gluon kernel did not run"


@pytest.mark.parametrize("value", [NAN, INF], ids=["nan", "inf"])
def test_decode_large_blocks_partial_last_block_poisoned(triton_device, value, poison):
    """Blocks larger than the tile (one table entry per tile): the partial last block's unwritten
    slots and the unused blocks poisoned; GQA 4, 1 to 3 splits."""
    block_size = 128
    c = _decode_case(triton_device, GQA, lens=[0, 70, 150], block_size=block_size, seed=3)
    caches = _poison_decode(c, value, block_size)
    for ns in (1, 3):
        out, lse = _decode(c, "paged", *caches, ns, {})
        _check(out, c["ref"], "float16", f"splits={ns}", None, lse, c["ref_lse"])


@pytest.mark.parametrize("heads", [MHA, GQA], ids=["mha", "gqa"])
@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_decode_nan_q_row(triton_device, layout, heads, sentinel):
    """NaN in one query head's q gives NaN out and lse there only (its GQA group mates, the other
    sequences exact); a NaN q of an empty sequence still returns zeros and lse -inf."""
    c = _decode_case(triton_device, heads, seed=11)
    nan_heads = [(2, 1), (3, heads[0] - 1), (0, 0)]  # (sequence, query head); sequence 0 is empty
    for b, h in nan_heads:
        c["q"][b, h, 3] = NAN
    caches = (c["k"], c["v"], c["k_pages"], c["v_pages"])
    for name, config, splits in _decode_configs(triton_device, heads, layout):
        for ns in splits:
            out, lse = _decode(c, layout, *caches, ns, config)
            o, l = _np(out), _np(lse)
            rows = np.ones(l.shape, dtype=bool)
            for b, h in nan_heads:
                rows[b, h] = False
                if c["lens"][b] == 0:
                    assert (o[b, h] == 0).all() and np.isneginf(l[b, h]), f"{name} splits={ns}: empty sequence"
                else:
                    assert np.isnan(o[b, h]).all() and np.isnan(l[b, h]), f"{name} splits={ns}: NaN q {b, h}"
            _compare(o[rows], l[rows], c["ref"][rows], c["ref_lse"][rows], "float16", f"{name} splits={ns}")


def _expect_nan_sequences(out, lse, c, bad, what):
    o, l = _np(out), _np(lse)
    good = np.ones(len(o), dtype=bool)
    good[bad] = False
    assert np.isnan(o[bad]).all() and np.isnan(l[bad]).all(), (
        f"{what}: the bad sequences' rows must be NaN; finite at {np.argwhere(~np.isnan(o[bad]))[:5].tolist()}")
    _compare(o[good], l[good], c["ref"][good], c["ref_lse"][good], "float16", f"{what}: the good sequences")


@pytest.mark.parametrize("heads", [MHA, GQA], ids=["mha", "gqa"])
def test_decode_bad_paged_tables(triton_device, heads, sentinel):
    """Device-resident block table and context_lens with out-of-range values: a used entry -1,
    num_blocks, 2^31 - 1; a length past the capacity, a negative one. Those sequences give NaN
    rows; the others are exact, also one whose entries past its end hold -7 (never used)."""
    lens = [40, 23, 57, 23, 9, 40]
    c = _decode_case(triton_device, heads, lens=lens, seed=13)
    bt = c["block_table"].clone()
    num_blocks, capacity = c["k_pages"].shape[0], bt.shape[1] * BLOCK
    bt[1, 1] = -1
    bt[2, 0] = num_blocks
    bt[2, 3] = 2**31 - 1
    bad_lens = c["lens"].clone()
    bad_lens[3] = capacity + 1
    bad_lens[4] = -5
    bt[5, 3] = -7  # tokens 48.. of a 40-token sequence
    for name, config, splits in _decode_configs(triton_device, heads, "paged"):
        for ns in splits:
            out, lse = _decode(c, "paged", None, None, c["k_pages"], c["v_pages"], ns, config, lens=bad_lens,
                               block_table=bt)
            if triton_device == "cuda":
                torch.cuda.synchronize()  # an illegal address would surface here
            _expect_nan_sequences(out, lse, c, [1, 2, 3, 4], f"{name} splits={ns}")


def test_decode_bad_contiguous_lens(triton_device, sentinel):
    """A contiguous cache: context lengths past N_max or negative give NaN rows for their sequence."""
    c = _decode_case(triton_device, GQA, lens=[40, 57, 23, 57], seed=17)
    lens = c["lens"].clone()
    lens[1] = c["k"].shape[2] + 1
    lens[2] = -1
    for ns in (1, 3, 5):
        out, lse = _decode(c, "contiguous", c["k"], c["v"], None, None, ns, {}, lens=lens)
        _expect_nan_sequences(out, lse, c, [1, 2], f"splits={ns}")


@gluon_only
@pytest.mark.parametrize("heads", [MHA, GQA], ids=["mha", "gqa"])
def test_decode_bad_tables_sorted_pages(heads, sentinel, gluon_calls):
    """The Gluon kernels' page sort (splits of 256 to 1024 pages) with a bad entry in the middle of
    a sequence and a length past the capacity."""
    c = _decode_case("cuda", heads, lens=[4200, 4200, 4100, 4150], seed=19)
    bt = c["block_table"].clone()
    bt[1, 100] = -3
    lens = c["lens"].clone()
    lens[2] = bt.shape[1] * BLOCK + 1
    # MHA: the Gluon kernel's own tile (a grid this small would take the long tile otherwise)
    config = {"mha_fma": True, "BLOCK_N": 64, "num_warps": 4} if heads == MHA else {"gluon_gqa": True}
    assert tg.sort_size(bt.shape[1], BLOCK, 1) >= 256
    out, lse = _decode(c, "paged", None, None, c["k_pages"], c["v_pages"], 1, config, lens=lens, block_table=bt)
    torch.cuda.synchronize()
    assert gluon_calls
    _expect_nan_sequences(out, lse, c, [1, 2], "sorted pages")


def test_decode_empty_cache_refused(triton_device):
    """A paged cache of no block: refused on the host (the kernels clamp block ids into the cache)."""
    q = torch.zeros((1, 2, 16), dtype=torch.float16, device=triton_device)
    kv = torch.zeros((0, 16, 2, 16), dtype=torch.float16, device=triton_device)
    bt = torch.zeros((1, 1), dtype=torch.int32, device=triton_device)
    lens = torch.zeros((1,), dtype=torch.int32, device=triton_device)
    with pytest.raises(ValueError, match="no block"):
        td._launch(q, kv, kv, bt, lens, 0.25, 1)


def test_decode_visible_inf_key_gives_nan_lse(triton_device, sentinel):
    """A visible K row of +inf (its score NaN or inf) gives NaN out and lse for the query heads of
    that KV head, not lse -inf; the other heads and sequences are exact."""
    c = _decode_case(triton_device, GQA, lens=[20, 30], seed=23)
    c["k"][1, 0, 4] = INF
    for ns in (1, 3):
        out, lse = td._launch(c["q"], c["k"], c["v"], None, c["lens"], c["scale"], ns)
        l = _np(lse)
        group = c["q"].shape[1] // c["k"].shape[1]
        assert np.isnan(l[1, :group]).all() and np.isnan(_np(out)[1, :group]).all()
        _compare(_np(out)[0], l[0], c["ref"][0], c["ref_lse"][0], "float16", f"splits={ns}")
        assert math.isfinite(float(lse[1, group]))
