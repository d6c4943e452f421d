"""Attention variants (flashcl.variants) in the Triton prefill, against the float64 oracle.

Runs natively on CUDA with one forced tile config (T = BLOCK_N = 64), and under TRITON_INTERPRET=1
on CPU with the interpreter's 16 x 16 tile (T = 16): window edges are placed relative to T.
Tolerances: flashcl.reference.TOLERANCE, and for float16 and bfloat16 at most twice the error of
the same variants computed naively in that dtype (_naive).
"""

from __future__ import annotations

import math
import zlib

import numpy as np
import pytest

from flashcl import reference

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import flashcl  # noqa: E402  (after the importorskip above)
from flashcl.triton import mask_tiles, prefill as tp  # noqa: E402
from tests._triton_tiles import forced_params, forced_tile  # noqa: E402
from flashcl.variants import Variants, mask_block_map  # noqa: E402

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
LSE_TOL = 1e-4  # |lse - ref| <= LSE_TOL * (1 + |ref|): scores accumulate in float32 in every dtype
NAIVE_FACTOR = 2.0


def _randn(shape, dtype, device, seed, std=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * std).to(dtype).to(device)


def _inputs(b, h_q, h_kv, n_q, n_kv, dk, dv, dtype, device, seed):
    return (_randn((b, h_q, n_q, dk), dtype, device, seed), _randn((b, h_kv, n_kv, dk), dtype, device, seed + 1),
            _randn((b, h_kv, n_kv, dv), dtype, device, seed + 2))


def _seed(*key) -> int:
    return zlib.crc32(repr(key).encode()) % 10000


def _np(x):
    """float64 numpy of a tensor (a bool mask stays bool)."""
    if not isinstance(x, torch.Tensor):
        return x
    return (x if x.dtype == torch.bool else x.double()).cpu().numpy()


def _oracle(q, k, v, causal, scale, **variants):
    """float64 (out, lse); finite stand-ins replace non-finite K/V the caller planted at keys no row
    sees (``clean_k``/``clean_v``), the oracle otherwise propagating them."""
    clean_k, clean_v = variants.pop("clean_k", k), variants.pop("clean_v", v)
    return reference.attention(_np(q), _np(clean_k), _np(clean_v), causal=causal, scale=scale, return_lse=True,
                               **{n: _np(x) for n, x in variants.items()})


def _naive(q, k, v, causal, scale, window=None, softcap=None, sinks=None, alibi_slopes=None, mask=None):
    """The variants computed plainly in the inputs' dtype (the error baseline for 16-bit types)."""
    b, h_q, n_q, _ = q.shape
    n_kv = k.shape[2]
    group = h_q // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = (q @ k.transpose(-1, -2)) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    dist = (torch.arange(n_q)[:, None] + n_kv - n_q - torch.arange(n_kv)[None, :]).to(q.device)
    if alibi_slopes is not None:
        s = s - alibi_slopes.reshape(-1, h_q, 1, 1).to(s.dtype) * dist.abs().to(s.dtype)
    visible = torch.ones(n_q, n_kv, dtype=torch.bool, device=q.device)
    if causal:
        visible &= dist >= 0
    if window is not None:
        left, right = (1 << 30 if w < 0 else w for w in window)
        visible &= (dist <= left) & (-dist <= right)
    if mask is not None:
        visible = visible & (mask if mask.dtype == torch.bool else mask != float("-inf"))
        if mask.dtype != torch.bool:
            s = s + mask.to(s.dtype)
    s = s.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.to(s.dtype).reshape(1, h_q, 1, 1).expand(b, h_q, n_q, 1)], dim=-1)
        v = torch.cat([v, torch.zeros_like(v[:, :, :1])], dim=2)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # a row that sees nothing: 0, as the kernel
    return p @ v


def _describe(got: np.ndarray, ref: np.ndarray, n: int = 5) -> str:
    diff = np.abs(np.nan_to_num(got, nan=np.inf) - ref)
    worst = np.argsort(diff, axis=None)[::-1][:n]
    return f"max abs diff {diff.max():.3g}; worst:\n" + "\n".join(
        f"  at {np.unravel_index(i, diff.shape)}: got {got.flat[i]:.6g}, want {ref.flat[i]:.6g}" for i in worst)


def _check(q, k, v, *, causal, device, params=None, scale=None, naive=True, rows=None, **variants):
    """Run flashcl.prefill (backend triton) with ``variants``; check out and lse against the oracle
    (on the query ``rows`` only, if given). Returns (out, lse) of the kernel."""
    dtype_name = str(q.dtype).split(".")[-1]
    scale = 1.0 / math.sqrt(q.shape[3]) if scale is None else scale
    kernel_variants = {n: x for n, x in variants.items() if n not in ("clean_k", "clean_v")}
    if device == "cuda":  # NaN in the memory the output reuses: an unwritten element fails
        torch.full((q.numel() * v.shape[3] // q.shape[3],), float("nan"), dtype=q.dtype, device=device)
    out, lse = flashcl.prefill(q, k, v, causal=causal, scale=scale, backend="triton", return_lse=True,
                               params=params if params is not None else forced_params(device), **kernel_variants)
    ref_out, ref_lse = _oracle(q, k, v, causal, scale, **variants)
    got, got_lse = out.double().cpu().numpy(), lse.double().cpu().numpy()
    if rows is not None:
        got, got_lse, ref_out, ref_lse = (x[:, :, rows] for x in (got, got_lse, ref_out, ref_lse))
    assert np.isfinite(got).all(), "non-finite output: " + _describe(got, ref_out)
    err = reference.rel_err(got, ref_out)
    tol = reference.TOLERANCE[dtype_name]
    assert err <= tol, f"{dtype_name} relative error {err:.3g} > {tol:g}; " + _describe(got, ref_out)
    seen = np.isfinite(ref_lse)
    assert np.array_equal(np.isneginf(got_lse), ~seen), "lse must be -inf exactly where a row sees no key"
    lse_err = np.abs(got_lse[seen] - ref_lse[seen]) / (1.0 + np.abs(ref_lse[seen]))
    assert lse_err.size == 0 or lse_err.max() <= LSE_TOL, f"lse error {lse_err.max():.3g} > {LSE_TOL}"
    if naive and dtype_name != "float32" and rows is None:
        base = _naive(q, k, v, causal, scale, **kernel_variants).double().cpu().numpy()
        naive_err = reference.rel_err(base, ref_out)
        assert err <= NAIVE_FACTOR * naive_err + 1e-5, (
            f"{dtype_name} error {err:.3g} is worse than {NAIVE_FACTOR}x plain attention's {naive_err:.3g}")
    return out, lse


def _variant_kwargs(name, b, h_q, n_q, n_kv, device, seed) -> dict:
    """Keyword arguments of one variant (random, on ``device``) for flashcl.prefill."""
    g = torch.Generator().manual_seed(seed)
    if name == "window":
        return {"window": (5, 2)}
    if name == "softcap":
        return {"softcap": 2.5}  # scores beyond +-2.5 get bent: the cap matters
    if name == "sinks":
        return {"sinks": (torch.randn(h_q, generator=g) * 2).to(device)}
    if name == "alibi":
        return {"alibi_slopes": (torch.rand(b, h_q, generator=g) * 0.5).to(device)}
    if name == "mask_bool":
        return {"mask": (torch.rand(b, 1, n_q, n_kv, generator=g) < 0.6).to(device)}
    if name == "mask_add":
        add = torch.randn(1, h_q, n_q, n_kv, generator=g)
        add[torch.rand(1, h_q, n_q, n_kv, generator=g) < 0.3] = float("-inf")
        return {"mask": add.to(device)}
    raise KeyError(name)


# --------------------------------------------------------------------------- each variant, combined

VARIANTS = ["window", "softcap", "sinks", "alibi", "mask_bool", "mask_add"]
COMBOS = [[v] for v in VARIANTS] + [["window", "softcap", "sinks", "alibi"],
                                    ["window", "softcap", "sinks", "alibi", "mask_add"],
                                    ["window", "mask_bool", "sinks"]]


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("combo", COMBOS, ids="+".join)
def test_variants_match_reference(triton_device, combo, dtype_name):
    """Each variant alone and combined: batch 2, GQA 2:1, DK != DV, ragged tiles, causal, N_q < N_kv."""
    t = forced_tile(triton_device)
    b, h_q, h_kv, n_q, n_kv, dk, dv = 2, 2, 1, 2 * t + 3, 3 * t + 1, 32, 48
    seed = _seed(combo, dtype_name)
    q, k, v = _inputs(b, h_q, h_kv, n_q, n_kv, dk, dv, DTYPES[dtype_name], triton_device, seed)
    kw = {}
    for name in combo:
        kw.update(_variant_kwargs(name, b, h_q, n_q, n_kv, triton_device, seed))
    _check(q, k, v, causal=True, device=triton_device, **kw)
    if dtype_name == "float32":  # and non-causal, with the scale's sign flipped (q negated inside)
        _check(q, k, v, causal=False, device=triton_device, scale=-0.2, **kw)


# --------------------------------------------------------------------------- windows at tile edges

def _windows(t: int, n_kv: int):
    """(left, right) at and around the tile edges, unbounded, and beyond N_kv."""
    return [(0, 0), (1, 0), (t - 1, 0), (t, 0), (t + 1, 0), (2 * t + 3, 0), (n_kv + 5, 0), (-1, 0),
            (0, 1), (3, t - 1), (t, t), (1, t + 1), (t + 1, -1), (-1, 3)]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("index", range(14))
def test_window_edges(triton_device, index, causal):
    t = forced_tile(triton_device)
    n = 3 * t + 5
    window = _windows(t, n)[index]
    if causal and window[1] != 0 and index % 3:
        pytest.skip("right > 0 under causal is the same as right = 0; a third of them run")
    q, k, v = _inputs(1, 2, 1, n, n, 32, 32, torch.float32, triton_device, _seed(window, causal))
    _check(q, k, v, causal=causal, device=triton_device, window=window)


# (N_q, N_kv, window, causal) for tile width t
CHUNKED = {
    "chunk": lambda t: (t + 3, 4 * t + 1, (5, 0), True),       # bottom-right aligned positions
    "one-row": lambda t: (1, 4 * t + 1, (t, 0), True),         # a single query row
    "full": lambda t: (t - 1, 3 * t, (t + 1, 2), False),
    "nq>nkv": lambda t: (3 * t, t + 2, (3, 0), True),          # the first rows see no key
}


@pytest.mark.parametrize("case", list(CHUNKED))
def test_window_chunked_prefill(triton_device, case):
    n_q, n_kv, window, causal = CHUNKED[case](forced_tile(triton_device))
    q, k, v = _inputs(1, 4, 1, n_q, n_kv, 16, 24, torch.float16, triton_device, _seed(case))
    _check(q, k, v, causal=causal, device=triton_device, window=window,
           alibi_slopes=torch.tensor([0.3, 0.1, 0.05, 0.0], device=triton_device))


def test_window_with_softmax_overlap(triton_device):
    """The overlapped loop 1 starting at the window's first full tile (its first trip reloads that
    tile's V with P = 0), with a softcap applied in it."""
    t = forced_tile(triton_device)
    extra = {"SOFTMAX_OVERLAP": True}
    if triton_device == "cuda" and torch.cuda.get_device_capability()[0] >= 9:
        extra["USE_TMA"] = True
    q, k, v = _inputs(1, 2, 2, 6 * t + 7, 6 * t + 7, 64, 64, torch.float16, triton_device, 3)
    for window in ((2 * t + 5, 0), (3 * t, t + 2)):
        _check(q, k, v, causal=window[1] == 0, device=triton_device, params=forced_params(triton_device, **extra),
               window=window, softcap=4.0)


# --------------------------------------------------------------------------- masks

def test_mask_empties_rows_and_tiles(triton_device):
    """Whole rows and whole (query block, key tile) tiles hidden: rows that see nothing give 0
    and lse -inf, or lse = the sink with sinks."""
    t = forced_tile(triton_device)
    n_q, n_kv = 2 * t + 5, 3 * t + 2
    q, k, v = _inputs(1, 2, 2, n_q, n_kv, 32, 32, torch.float32, triton_device, 21)
    mask = torch.rand(1, 2, n_q, n_kv, generator=torch.Generator().manual_seed(5)) < 0.7
    mask[:, :, 3] = False            # an empty row
    mask[:, 1, t:2 * t] = False      # a whole query block of head 1
    mask[:, :, :t, t:2 * t] = False  # a whole tile
    mask[:, 0, :, 2 * t:] = False    # the last tiles of head 0
    mask = mask.to(triton_device)
    out, lse = _check(q, k, v, causal=False, device=triton_device, mask=mask)
    assert not out[0, :, 3].any() and torch.isneginf(lse[0, :, 3]).all()
    sinks = torch.tensor([0.7, -2.0], device=triton_device)
    out, lse = _check(q, k, v, causal=False, device=triton_device, mask=mask, sinks=sinks)
    assert not out[0, :, 3].any() and torch.allclose(lse[0, :, 3], sinks)
    # additive: -inf over the same keys, a finite bias elsewhere
    bias = torch.where(mask, torch.randn(mask.shape, device=triton_device), torch.tensor(float("-inf"), device=triton_device))
    _check(q, k, v, causal=True, device=triton_device, mask=bias)


@pytest.mark.parametrize("n_q", [1, 4, 37])
def test_mask_of_float32_min_hides(triton_device, n_q):
    """An additive value at or below reference.MASK_HIDES_AT (float32's finfo.min, which
    transformers pads with) hides its key as -inf does, on the prefill kernel (37 rows) and the
    few-row route (1: one mask row for the group; 4: a mask per row): a row whose keys all carry
    it sees none, NaN in V at such a key never leaks, and just above it a key stays visible."""
    b, h_q, h_kv, n_kv, d = 1, 4, 2, 70, 32
    q, k, v = _inputs(b, h_q, h_kv, n_q, n_kv, d, d, torch.float32, triton_device, 91 + n_q)
    lowest = torch.finfo(torch.float32).min
    gen = torch.Generator().manual_seed(n_q)
    mask = torch.where(torch.rand(b, 1, n_q, n_kv, generator=gen) < 0.5, lowest, 0.0)
    mask[..., 2] = lowest  # hidden from every row, its V NaN
    v[:, :, 2] = float("nan")
    shown = float(np.nextafter(np.float32(reference.MASK_HIDES_AT), np.float32(0)))
    mask[..., -1, :] = shown  # the last row: every key at the most negative value that shows it,
    mask[..., -1, 1] = 0.0    # but key 1
    mask[..., -1, 2] = lowest
    if n_q > 1:
        mask[..., 0, :] = lowest  # a row that sees nothing
    out, lse = _check(q, k, v, causal=False, device=triton_device, mask=mask.to(triton_device))
    if n_q > 1:
        assert not out[0, :, 0].any() and torch.isneginf(lse[0, :, 0]).all()


def test_mask_broadcast_and_strided_batch(triton_device):
    """A (N_q, N_kv) mask broadcast over batch and heads, and a (B, 1, ..) one per batch."""
    t = forced_tile(triton_device)
    q, k, v = _inputs(2, 4, 2, t + 7, 2 * t + 1, 16, 16, torch.float16, triton_device, 8)
    g = torch.Generator().manual_seed(9)
    _check(q, k, v, causal=True, device=triton_device,
           mask=(torch.rand(t + 7, 2 * t + 1, generator=g) < 0.5).to(triton_device))
    _check(q, k, v, causal=False, device=triton_device,
           mask=(torch.rand(2, 1, t + 7, 2 * t + 1, generator=g) < 0.5).to(triton_device))


def test_block_map_matches_numpy(triton_device):
    """The device block map: MAP_SEEN is flashcl.variants.mask_block_map at MAP_GRAIN, MAP_PLAIN
    marks blocks where every key is visible with nothing to add; padding is MAP_PLAIN alone."""
    g = torch.Generator().manual_seed(2)
    grain, pad = mask_tiles.MAP_GRAIN.value, mask_tiles.MAP_PAD.value
    seen_bit, plain_bit = mask_tiles.MAP_SEEN.value, mask_tiles.MAP_PLAIN.value
    bool_mask = torch.rand(2, 3, 37, 70, generator=g) < 0.05
    bool_mask[:, :, :16, :32] = True
    bias = torch.where(torch.rand(1, 1, 130, 17, generator=g) < 0.1, 0.5, float("-inf"))
    bias[..., 16:32, :16] = 0.0
    for mask in (bool_mask, bias):
        got = mask_tiles.block_map(mask.to(triton_device)).cpu().numpy()
        want = mask_block_map(mask.numpy(), grain, grain)
        rows, cols = want.shape[2:]
        assert got.shape[2] % (pad // grain) == 0 and got.shape[3] % (pad // grain) == 0
        assert np.array_equal((got[:, :, :rows, :cols] & seen_bit) != 0, want != 0)
        assert (got[:, :, rows:] == plain_bit).all() and (got[:, :, :, cols:] == plain_bit).all()
        plain = mask.numpy() if mask.dtype == torch.bool else mask.numpy() == 0
        n_q, n_kv = plain.shape[2:]
        padded = np.ones((*plain.shape[:2], rows * grain, cols * grain), dtype=bool)
        padded[:, :, :n_q, :n_kv] = plain
        want_plain = padded.reshape(*plain.shape[:2], rows, grain, cols, grain).all(axis=(3, 5))
        assert np.array_equal((got[:, :, :rows, :cols] & plain_bit) != 0, want_plain)
        assert want_plain.any() and not want_plain.all()


def _tile_lists(mask, window, causal: bool, bm: int, bn: int) -> np.ndarray:
    """The tile lists of a (BLOCK_M, BLOCK_N) = (bm, bn) config, as the prefill's pre-hook builds them."""
    var = tp._VariantArgs.of(Variants(window=window, mask=mask), torch.float32, block_map=True)
    nargs = dict(MaskMap=var.tensors[3], MaskTiles=var.tensors[4], BLOCK_M=bm, BLOCK_N=bn, N_Q=mask.shape[2],
                 N_KV=mask.shape[3], IS_CAUSAL=causal, WINDOW=window is not None, window_left=var.scalars[0],
                 window_right=var.scalars[1])
    tp._list_mask_tiles(nargs)
    return nargs["MaskTiles"].cpu().numpy()


def _longest_run(flags) -> int:
    best = run = 0
    for f in flags:
        run = run + 1 if f else 0
        best = max(best, run)
    return best


@pytest.mark.parametrize("causal, window", [(False, None), (True, None), (True, (40, 0)), (False, (17, 9))])
def test_mask_tile_lists(triton_device, causal, window):
    """The per-config tile lists: the longest run of full tiles (every row sees every key with
    nothing to add), then the other tiles some row may see in increasing order; together every
    tile where some row sees a key, none the mask hides wholly or causal / the window puts out of
    reach."""
    g = torch.Generator().manual_seed(3)
    n_q, n_kv, bm, bn = 150, 230, 64, 32
    mask = torch.rand(3, 1, n_q, n_kv, generator=g) < 0.02
    mask[0, :, :, :96] = True        # full tiles where causal and the window allow
    mask[1, :, :, 100:180] = False   # hidden tiles
    mask[2, :, :, :32] = True        # two runs of full tiles: 1 and 3 long
    mask[2, :, :, 64:160] = True
    tiles = _tile_lists(mask.to(triton_device), window, causal, bm, bn)
    head = mask_tiles.LIST_HEADER.value
    _, visible = reference.logits(np.zeros((3, 1, n_q, 1)), np.zeros((3, 1, n_kv, 1)), causal=causal,
                                  window=window, mask=mask.numpy())
    _, reach = reference.logits(np.zeros((1, 1, n_q, 1)), np.zeros((1, 1, n_kv, 1)), causal=causal,
                                window=window)
    n_full_total = 0
    key_tiles = [slice(t * bn, (t + 1) * bn) for t in range(-(-n_kv // bn))]
    for b in range(3):
        for qb in range(-(-n_q // bm)):
            first, end, n_part = tiles[b, 0, qb, :head]
            run, part = list(range(first, end)), list(tiles[b, 0, qb, head:head + n_part])
            rows = slice(qb * bm, (qb + 1) * bm)
            needed = [t for t, keys in enumerate(key_tiles) if visible[b, 0, rows, keys].any()]
            hidden = [t for t, keys in enumerate(key_tiles)
                      if not mask[b, 0, :, keys].any() or not reach[0, 0, rows, keys].any()]
            listed = set(run) | set(part)
            assert part == sorted(part) and not set(run) & set(part)
            assert set(needed) <= listed and not listed & set(hidden), (b, qb, run, part, needed, hidden)
            full = [(t + 1) * bn <= n_kv and visible[b, 0, rows, keys].all() for t, keys in enumerate(key_tiles)]
            assert all(full[t] for t in run), (b, qb, run)  # every real row sees all of every run tile
            assert len(run) == _longest_run(full), (b, qb, run, full)  # the longest run
            n_full_total += len(run)
    assert n_full_total > 0 or window is not None  # windows narrower than a block have none


@pytest.mark.parametrize("window", [None, (2**31 - 1, 0), (300, 2**31 - 1)])
def test_mask_tile_lists_many_tiles(triton_device, window):
    """More key tiles than one step of the list kernel (its longest run carried across steps),
    N_q > N_kv, Hm > 1, and windows wider than int32 positions allow (taken as unbounded)."""
    g = torch.Generator().manual_seed(5)
    n_q, n_kv, bm, bn = 1200, 1100, 32, 16
    mask = torch.rand(1, 2, n_q, n_kv, generator=g) < 0.02
    mask[:, 0, :, 992:1090] = True    # full tiles 62 and 64-67 (tile 63 hides a key): the longer
    mask[:, 0, :, 1008:1009] = False  # run in the list kernel's second step
    mask[:, 1, :, 16:1040] = True     # one run, tiles 1-64: across the first step's end
    tiles = _tile_lists(mask.to(triton_device), window, False, bm, bn)
    head = mask_tiles.LIST_HEADER.value
    key_tiles = [slice(t * bn, (t + 1) * bn) for t in range(-(-n_kv // bn))]
    _, m = reference.logits(np.zeros((1, 2, n_q, 1)), np.zeros((1, 1, n_kv, 1)), causal=False, window=window,
                            mask=mask.numpy())
    for h in range(2):
        for qb in range(0, -(-n_q // bm), 7):
            first, end, n_part = tiles[0, h, qb, :head]
            rows = slice(qb * bm, (qb + 1) * bm)
            full = [(t + 1) * bn <= n_kv and m[0, h, rows, keys].all() for t, keys in enumerate(key_tiles)]
            assert end - first == _longest_run(full) and all(full[first:end]), (h, qb, first, end)
            listed = set(tiles[0, h, qb, head:head + n_part]) | set(range(first, end))
            assert {t for t, keys in enumerate(key_tiles) if m[0, h, rows, keys].any()} <= listed


def test_window_wider_than_int32_positions(triton_device):
    """A window bound of 2^31 - 1 (any int the API takes) is unbounded, not an int32 overflow:
    N_q > N_kv, with and without a mask."""
    t = forced_tile(triton_device)
    q, k, v = _inputs(1, 2, 1, 2 * t + 5, t + 3, 16, 16, torch.float32, triton_device, 61)
    mask = (torch.rand(1, 1, 2 * t + 5, t + 3, generator=torch.Generator().manual_seed(6)) < 0.7)
    for window in ((2**31 - 1, 0), (0, 2**31 - 1)):
        _check(q, k, v, causal=False, device=triton_device, window=window)
        _check(q, k, v, causal=True, device=triton_device, window=window, mask=mask.to(triton_device))


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_mask_full_and_partial_tiles(triton_device, dtype_name):
    """Structured masks whose tiles are mostly full (causal as a bool mask, key padding, an
    additive mask of zeros and -inf with a bias on some keys), with causal and a window on top:
    the unmasked path on full tiles, the masked one on the rest."""
    t = forced_tile(triton_device)
    n_q, n_kv = 3 * t + 3, 4 * t + 5
    q, k, v = _inputs(2, 2, 1, n_q, n_kv, 32, 32, DTYPES[dtype_name], triton_device, 71)
    pos = torch.arange(n_q)[:, None] + n_kv - n_q
    key = torch.arange(n_kv)[None, :]
    causal_mask = (key <= pos)[None, None].expand(2, 1, n_q, n_kv).clone()
    causal_mask[1, :, :, n_kv - t - 2:] = False  # the second sequence padded on the right
    causal_mask = causal_mask.to(triton_device)
    _check(q, k, v, causal=False, device=triton_device, mask=causal_mask)
    _check(q, k, v, causal=True, device=triton_device, mask=causal_mask, window=(2 * t + 1, 0),
           sinks=torch.tensor([0.3, -0.3], device=triton_device))
    bias = torch.where(causal_mask.cpu(), 0.0, float("-inf"))
    bias[:, :, :, t:t + 5] += 0.75 * (bias[:, :, :, t:t + 5] == 0)
    _check(q, k, v, causal=False, device=triton_device, mask=bias.to(triton_device), softcap=5.0)


@pytest.mark.parametrize("mask_batch", [1, 2])
def test_mask_tiles_through_tma(triton_device, mask_batch):
    """sm_90+: with the TMA tile the mask's partial tiles come in by the copy engine (MASK_TMA),
    for a mask broadcast over batch and heads or one per batch; bool and additive, causal, a
    window and softcap on top, rows and keys past the last whole tile (read as 0 there)."""
    if triton_device != "cuda" or torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("tensor descriptors need an sm_90+ GPU")
    t = forced_tile(triton_device)
    n_q, n_kv = 3 * t + 16, 5 * t + 32  # 16-byte aligned rows for the descriptor
    q, k, v = _inputs(2, 4, 2, n_q, n_kv, 64, 64, torch.float16, triton_device, 83 + mask_batch)
    g = torch.Generator().manual_seed(mask_batch)
    mask = torch.rand(mask_batch, 1, n_q, n_kv, generator=g) < 0.9
    mask[..., t:2 * t] = True  # whole visible tiles: the unmasked run
    mask[..., 3 * t:4 * t] = False  # a whole hidden tile
    params = forced_params(triton_device, USE_TMA=True)
    assert tp._tma_ok(mask.view(torch.uint8).to(triton_device))
    _check(q, k, v, causal=False, device=triton_device, params=params, mask=mask.to(triton_device))
    _check(q, k, v, causal=True, device=triton_device, params=params, mask=mask.to(triton_device),
           window=(2 * t + 5, 0))
    bias = torch.where(mask, 0.25 * torch.randn(mask.shape, generator=g), torch.tensor(float("-inf")))
    _check(q, k, v, causal=True, device=triton_device, params=params, mask=bias.to(triton_device),
           softcap=20.0)


# --------------------------------------------------------------------------- non-finite K/V at hidden keys

# where the bad keys go, for tile width t and n = 4t + 3 keys: (keys, window, causal, rows compared)
HIDDEN = {
    # keys < 2t + 1 left of every row's window: tiles 0-1 skipped, tile 2 masked
    "window_left": lambda t, n: (slice(t, 2 * t + 1), (t + 1, 0), True, slice(3 * t + 2, None)),
    # right of the window of rows < 2t - 1; the later rows see them and are not compared
    "window_right": lambda t, n: (slice(2 * t + 1, n), (-1, 2), False, slice(0, 2 * t - 1)),
    "mask_in_tile": lambda t, n: (slice(t + 3, t + 9), None, True, slice(None)),
    "mask_whole_tile": lambda t, n: (slice(t, 2 * t), None, True, slice(None)),
}


@pytest.mark.parametrize("where", list(HIDDEN))
def test_nonfinite_kv_at_hidden_keys(triton_device, where):
    """NaN and inf in K and V at keys no compared row sees (left of the window, right of it
    without causal, hidden by the mask inside a kept tile or in a skipped one) never reach it."""
    t = forced_tile(triton_device)
    n = 4 * t + 3
    bad, window, causal, rows = HIDDEN[where](t, n)
    q, k, v = _inputs(1, 2, 1, n, n, 32, 32, torch.float16, triton_device, _seed(where))
    kw = {"window": window} if window is not None else {}
    if where.startswith("mask"):
        mask = torch.ones(1, 1, n, n, dtype=torch.bool)
        mask[..., bad] = False
        kw["mask"] = mask.to(triton_device)
    k_bad, v_bad = k.clone(), v.clone()
    k_bad[:, :, bad, ::2] = float("nan")
    k_bad[:, :, bad, 1::2] = float("inf")
    v_bad[:, :, bad] = float("inf")
    v_bad[:, :, bad, 0] = float("nan")
    _check(q, k_bad, v_bad, causal=causal, device=triton_device, rows=rows, clean_k=k, clean_v=v, **kw)


# --------------------------------------------------------------------------- few query rows as a decode

ROW_CASES = [  # (b, h_q, h_kv, n_q, n_kv, d): GQA and MHA, N_kv below, at and above N_q, 64 group rows
    (2, 4, 2, 3, 21, 32), (1, 8, 2, 5, 5, 64), (1, 4, 4, 6, 4, 32), (1, 8, 2, 16, 70, 64), (2, 4, 1, 1, 33, 32),
]


def _rows_variants(name, b, h_q, n_q, n_kv, device, seed):
    g = torch.Generator().manual_seed(seed)
    slopes = (torch.rand(b, h_q, generator=g) * 0.45 + 0.05).to(device)
    sinks = torch.randn(h_q, generator=g).to(device)
    # a bool mask of holes, per sequence, with one row hidden from every key; an additive one per
    # head: biases, and -inf at about a quarter of the keys
    holes = torch.rand(b, 1, n_q, n_kv, generator=g) > 0.3
    if n_q > 1:  # the first row sees nothing
        holes[:, :, 0] = False
    bias = torch.randn(b, h_q, n_q, n_kv, generator=g)
    bias = torch.where(torch.rand(b, h_q, n_q, n_kv, generator=g) > 0.25, bias, float("-inf"))
    return {"causal": dict(causal=True), "full": dict(causal=False),
            "mask": dict(causal=True, mask=holes.to(device), sinks=sinks),
            "mask additive window": dict(causal=True, mask=bias.to(device), window=(3, 0), alibi_slopes=slopes),
            "full, one row masked": dict(causal=False, mask=holes[:, :, :1].to(device)) if n_q == 1 else
            dict(causal=True, mask=holes.to(device)),
            "window 0": dict(causal=True, window=(0, 0), sinks=sinks),
            "window 2": dict(causal=True, window=(2, 0)),
            "window alibi softcap": dict(causal=True, window=(n_q + 1, 4), alibi_slopes=slopes, softcap=5.0),
            "full sinks softcap": dict(causal=False, sinks=sinks, softcap=3.0)}[name]


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("name", ["causal", "full", "window 0", "window 2", "window alibi softcap",
                                  "full sinks softcap", "mask", "mask additive window", "full, one row masked"])
def test_few_query_rows_run_as_decode(triton_device, monkeypatch, name, dtype_name):
    """1 to 16 query rows (at most 64 rows per KV head) with flashcl's tiles run as the decode of
    the rows as heads (prefill._rows_as_decode; causal rows through QUERY_ROWS): each row's causal
    cut, window and ALiBi distances from its own position, bottom-right, rows that see nothing
    when N_kv < N_q or by the mask, sinks once per row, bool and additive masks read per row
    (one row of a full prefill too); against the oracle and plain attention in the dtype."""
    routed = []
    real = tp._rows_as_decode
    monkeypatch.setattr(tp, "_rows_as_decode", lambda q, *a, **kw: routed.append(q.shape) or real(q, *a, **kw))
    dtype = DTYPES[dtype_name]
    for i, (b, h_q, h_kv, n_q, n_kv, d) in enumerate(ROW_CASES):
        q, k, v = _inputs(b, h_q, h_kv, n_q, n_kv, d, d, dtype, triton_device, _seed(name, i))
        kw = _rows_variants(name, b, h_q, n_q, n_kv, triton_device, _seed(name, i, "v"))
        routed.clear()
        out, lse = flashcl.prefill(q, k, v, backend="triton", return_lse=True, **kw)
        assert routed == [q.shape], (name, routed)
        causal = kw.pop("causal")
        scale = 1.0 / math.sqrt(d)
        ref_out, ref_lse = _oracle(q, k, v, causal, scale, **kw)
        got, got_lse = out.double().cpu().numpy(), lse.double().cpu().numpy()
        err = reference.rel_err(got, ref_out)
        tol = reference.TOLERANCE[dtype_name]
        assert err <= tol, f"{name} {ROW_CASES[i]}: error {err:.3g} > {tol:g}; " + _describe(got, ref_out)
        if dtype_name != "float32":
            naive_err = reference.rel_err(_naive(q, k, v, causal, scale, **kw).double().cpu().numpy(), ref_out)
            assert err <= NAIVE_FACTOR * naive_err + 1e-5, (name, ROW_CASES[i], err, naive_err)
        seen = np.isfinite(ref_lse)
        assert np.array_equal(np.isneginf(got_lse), ~seen) and not got[~seen].any(), (name, ROW_CASES[i])
        lse_err = np.abs(got_lse[seen] - ref_lse[seen]) / (1.0 + np.abs(ref_lse[seen]))
        assert lse_err.size == 0 or lse_err.max() <= LSE_TOL, (name, ROW_CASES[i], lse_err.max())


def test_few_query_rows_hide_nonfinite_kv(triton_device):
    """As a decode, keys a row does not see never reach it whatever their K/V hold: the keys left
    of the first row's window, the one key only the first row's window reaches (for the other
    rows) and the later rows' own keys (for the earlier rows), with 1 and 3 splits."""
    from flashcl.triton import decode as td

    b, h_q, h_kv, n_q, n_kv, d, left = 1, 8, 2, 4, 45, 32, 6
    q, k, v = _inputs(b, h_q, h_kv, n_q, n_kv, d, d, torch.float32, triton_device, 77)
    first = n_kv - n_q - left  # the first row's first key, which no other row sees
    for bad, rows in ((slice(0, first), slice(None)), (slice(first, first + 1), slice(1, None)),
                      (slice(n_kv - 2, n_kv), slice(0, n_q - 2))):
        k_bad, v_bad = k.clone(), v.clone()
        k_bad[:, :, bad, ::2], k_bad[:, :, bad, 1::2] = float("nan"), float("inf")
        v_bad[:, :, bad], v_bad[:, :, bad, 0] = float("inf"), float("nan")
        ref_out, _ = _oracle(q, k, v, True, d ** -0.5, window=(left, 0))
        for splits in (1, 3):
            out, _ = td._launch(q.reshape(b, h_q * n_q, d), k_bad, v_bad, None, None, d ** -0.5, splits,
                                window_left=left, query_rows=n_q)
            got = out.view(b, h_q, n_q, d).double().cpu().numpy()[:, :, rows]
            assert np.isfinite(got).all(), (bad, splits)
            assert reference.rel_err(got, ref_out[:, :, rows]) <= reference.TOLERANCE["float32"], (bad, splits)


def test_few_query_rows_with_a_mask_hide_nonfinite_kv(triton_device):
    """Keys a row's mask hides never reach it whatever their K/V hold: a left padding (every row
    of the sequence) and a key hidden from every row of one sequence, with 1 and 3 splits."""
    from flashcl.triton import decode as td

    b, h_q, h_kv, n_q, n_kv, d = 2, 8, 2, 4, 45, 32
    q, k, v = _inputs(b, h_q, h_kv, n_q, n_kv, d, d, torch.float32, triton_device, 81)
    mask = torch.ones(b, 1, n_q, n_kv, dtype=torch.bool)
    mask[1, :, :, :9] = False  # sequence 1 padded by 9 keys
    mask[0, :, :, 20] = False
    k_bad, v_bad = k.clone(), v.clone()
    for i, keys in ((1, slice(0, 9)), (0, slice(20, 21))):
        k_bad[i, :, keys, ::2], k_bad[i, :, keys, 1::2] = float("nan"), float("inf")
        v_bad[i, :, keys], v_bad[i, :, keys, 0] = float("inf"), float("nan")
    ref_out, _ = _oracle(q, k, v, True, d ** -0.5, mask=mask)
    for splits in (1, 3):
        out, _ = td._launch(q.reshape(b, h_q * n_q, d), k_bad, v_bad, None, None, d ** -0.5, splits,
                            query_rows=n_q, row_mask=mask.to(triton_device))
        got = out.view(b, h_q, n_q, d).double().cpu().numpy()
        assert np.isfinite(got).all(), splits
        assert reference.rel_err(got, ref_out) <= reference.TOLERANCE["float32"], splits


@pytest.mark.parametrize("heads, n_q, h_kv", [(1, 3, 2), (1, 16, 2), (8, 3, 2), (8, 8, 1), (8, 1, 1)],
                         ids=["shared-3", "shared-16", "per-head-12", "per-head-64", "per-head-one-row"])
def test_row_mask_words_hold_each_rows_bit(triton_device, heads, n_q, h_kv):
    """row_mask_words: bit g of key j's word is row g of the KV head's group (row g % N_q of prefill's
    head (h * group + g) // N_q), int32 words up to 32 rows and int64 past them (bit 63 included)."""
    from flashcl.triton import decode as td

    b, h_q, n_kv = 2, 8, 300
    group = h_q // h_kv * n_q
    mask = torch.rand(b, heads, n_q, n_kv, generator=torch.Generator().manual_seed(87)) > 0.5
    words, word_rows = td.row_mask_words(mask.to(triton_device), h_kv, group, n_q)
    words = words.cpu()
    word_heads = 1 if heads == 1 else h_kv
    assert word_rows == (n_q if heads == 1 else group)
    assert words.shape == (b, word_heads, n_kv) and words.dtype == (torch.int32 if word_rows <= 32 else torch.int64)
    for h in range(word_heads):
        for g in range(word_rows):
            row = mask[:, 0, g] if heads == 1 else mask[:, (h * group + g) // n_q, g % n_q]
            assert torch.equal((words[:, h] >> g) & 1 == 1, row), (h, g)


def _record_decode_flag(monkeypatch, td, flag: str) -> list:
    """The values of build flag ``flag`` of every _decode_kernel launch from now on."""
    launched, kernel = [], td._decode_kernel

    class Spy:
        def __getitem__(self, grid):
            return lambda *a, **kw: launched.append(kw[flag]) or kernel[grid](*a, **kw)

    monkeypatch.setattr(td, "_decode_kernel", Spy())
    return launched


def _to_pages(x, order, page):
    """(B, H_kv, N, D) as a paged cache (blocks, page, H_kv, D) whose blocks lie in ``order``."""
    b, h_kv, n, d = x.shape
    per_seq = -(-n // page)
    x = torch.nn.functional.pad(x, (0, 0, 0, per_seq * page - n))
    x = x.view(b, h_kv, per_seq, page, d).permute(0, 2, 3, 1, 4).reshape(b * per_seq, page, h_kv, d)
    out = torch.empty_like(x)
    out[order.to(x.device)] = x
    return out


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("heads, n_q", [("broadcast", 3), ("per-head", 3), ("per-head", 1)])
@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_few_query_rows_with_row_masks_hide_keys(triton_device, monkeypatch, kind, heads, n_q, paged):
    """Causal rows, each with its own mask row (broadcast over heads or one per head; one row per
    head of a GQA group too): a left padding past a whole tile (its K/V NaN and inf: no row sees
    it), random holes, and a key every row but the first sees, holding NaN and inf: the first row
    stays finite and right, the others see it (NaN), and without the poison every row matches the
    oracle; 1 and 3 splits."""
    from flashcl.triton import decode as td

    launched = _record_decode_flag(monkeypatch, td, "ROW_MASK")
    b, h_q, h_kv, n_kv, d, page = 2, 8, 2, 150, 32, 16
    q, k, v = _inputs(b, h_q, h_kv, n_q, n_kv, d, d, torch.float32, triton_device, 85)
    g = torch.Generator().manual_seed(86)
    seen = torch.rand(b, 1 if heads == "broadcast" else h_q, n_q, n_kv, generator=g) > 0.3
    seen[0, :, :, :70] = False  # sequence 0 left-padded by 70 keys
    seen[:, :, :, 100] = True
    seen[:, :, 0, 100] = False  # key 100: hidden from the first row only
    mask = seen if kind == "bool" else torch.where(seen, torch.randn(seen.shape, generator=g), float("-inf"))
    k_bad, v_bad = k.clone(), v.clone()
    for keys in (slice(0, 70), slice(100, 101)):
        seq = slice(0, 1) if keys.start == 0 else slice(None)
        k_bad[seq, :, keys, ::2], k_bad[seq, :, keys, 1::2] = float("nan"), float("inf")
        v_bad[seq, :, keys], v_bad[seq, :, keys, 0] = float("inf"), float("nan")
    ref_out, _ = _oracle(q, k, v, True, d ** -0.5, mask=mask)
    table = lens = None
    if paged:
        order = torch.randperm(b * -(-n_kv // page), generator=g)
        table = order.view(b, -1).to(torch.int32).to(triton_device)
        lens = torch.full((b,), n_kv, dtype=torch.int32, device=triton_device)
        k, v, k_bad, v_bad = (_to_pages(x, order, page) for x in (k, v, k_bad, v_bad))
    for splits in (1, 3):
        for kc, vc, rows in ((k, v, slice(None)), (k_bad, v_bad, slice(0, 1))):
            out, _ = td._launch(q.reshape(b, h_q * n_q, d), kc, vc, table, lens, d ** -0.5, splits,
                                query_rows=n_q, row_mask=mask.to(triton_device))
            got = out.view(b, h_q, n_q, d).double().cpu().numpy()
            assert np.isfinite(got[:, :, rows]).all(), (splits, rows)
            assert reference.rel_err(got[:, :, rows], ref_out[:, :, rows]) <= reference.TOLERANCE["float32"], splits
            if rows.stop == 1:
                assert np.isnan(got[:, :, 1:]).any(axis=-1).all(), splits
    assert set(launched) == {1 if kind == "bool" else 2}


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("h_kv", [2, 8])
@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_one_query_row_with_a_mask_hides_keys(triton_device, monkeypatch, kind, h_kv, paged):
    """One query row whose group reads one row of the mask (broadcast over heads, or MHA with a
    mask per head) runs MASK_PER_KEY: a padding past a whole tile, holes, and a sequence that sees
    nothing (out 0, lse -inf); whatever the K/V a head's mask hides hold; 1 and 3 splits."""
    from flashcl.triton import decode as td

    launched = _record_decode_flag(monkeypatch, td, "MASK_PER_KEY")
    b, h_q, n_kv, d, page = 3, 8, 150, 32, 16
    q, k, v = _inputs(b, h_q, h_kv, 1, n_kv, d, d, torch.float32, triton_device, 83)
    g = torch.Generator().manual_seed(84)
    heads = 1 if h_kv < h_q else h_q
    seen = torch.rand(b, heads, 1, n_kv, generator=g) > 0.3
    seen[0, :, :, :100] = False  # sequence 0 padded by 100 keys (past any tile of the plan)
    seen[2] = False  # sequence 2 sees nothing
    mask = seen if kind == "bool" else torch.where(seen, torch.randn(seen.shape, generator=g), float("-inf"))
    # the keys each KV head's rows do not see hold NaN and inf
    hidden = ~seen[:, :, 0].reshape(b, -1, heads // min(heads, h_kv), n_kv).any(dim=2).expand(b, h_kv, n_kv)
    hidden = hidden.to(triton_device)
    k_bad, v_bad = k.clone(), v.clone()
    k_bad[..., ::2] = torch.where(hidden[..., None], float("nan"), k[..., ::2])
    k_bad[..., 1::2] = torch.where(hidden[..., None], float("inf"), k[..., 1::2])
    v_bad = torch.where(hidden[..., None], float("inf"), v)
    v_bad[..., 0] = torch.where(hidden, float("nan"), v[..., 0])
    table = lens = None
    if paged:  # (blocks, page, H_kv, D) in a permuted order
        order = torch.randperm(b * -(-n_kv // page), generator=g)
        table = order.view(b, -1).to(torch.int32).to(triton_device)
        lens = torch.full((b,), n_kv, dtype=torch.int32, device=triton_device)
        k_bad, v_bad = _to_pages(k_bad, order, page), _to_pages(v_bad, order, page)
    ref_out, ref_lse = _oracle(q, k, v, False, d ** -0.5, mask=mask)
    for splits in (1, 3):
        out, lse = td._launch(q.reshape(b, h_q, d), k_bad, v_bad, table, lens, d ** -0.5, splits,
                              row_mask=mask.to(triton_device))
        got, got_lse = out.view(b, h_q, 1, d).double().cpu().numpy(), lse.view(b, h_q, 1).double().cpu().numpy()
        assert np.isfinite(got).all(), splits
        assert reference.rel_err(got, ref_out) <= reference.TOLERANCE["float32"], splits
        assert np.array_equal(np.isneginf(got_lse), np.isneginf(ref_lse)) and not got[2].any(), splits
    assert launched == [True, True]


def test_few_query_rows_that_keep_the_prefill_kernel(triton_device, monkeypatch):
    """A mask, a window or ALiBi on several rows that are not causal, explicit tiles, 17 rows or
    more than 64 rows per KV head run the prefill kernel."""
    routed = []
    monkeypatch.setattr(tp, "_rows_as_decode", lambda *a, **kw: routed.append(a) or None)
    q, k, v = _inputs(1, 8, 2, 4, 40, 32, 32, torch.float32, triton_device, 78)
    mask = torch.ones(1, 1, 4, 40, dtype=torch.bool, device=triton_device)
    mask[..., :5] = False
    slopes = torch.full((1, 8), 0.1, device=triton_device)
    calls = [dict(mask=mask), dict(window=(7, 3)), dict(alibi_slopes=slopes),
             dict(causal=True, params=forced_params(triton_device))]
    for kw in calls:
        flashcl.prefill(q, k, v, backend="triton", **kw)
    for n_q, h_q in ((17, 2), (9, 16)):  # 17 rows; 8 x 9 = 72 rows per KV head
        q2, k2, v2 = _inputs(1, h_q, 2, n_q, 40, 32, 32, torch.float32, triton_device, 79)
        flashcl.prefill(q2, k2, v2, causal=True, backend="triton")
    assert routed == []


# --------------------------------------------------------------------------- ALiBi, sinks, lse

def test_alibi_per_batch_slopes(triton_device):
    """(B, H_q) slopes: each batch its own; distances in both directions without causal."""
    t = forced_tile(triton_device)
    q, k, v = _inputs(3, 2, 2, t + 5, 2 * t + 3, 32, 32, torch.float32, triton_device, 31)
    slopes = torch.tensor([[0.5, 0.25], [0.0, 1.0], [0.125, 0.0625]], device=triton_device)
    _check(q, k, v, causal=False, device=triton_device, alibi_slopes=slopes)
    out_b0 = flashcl.prefill(q[:1], k[:1], v[:1], backend="triton", alibi_slopes=slopes[0],
                             params=forced_params(triton_device))
    out = flashcl.prefill(q, k, v, backend="triton", alibi_slopes=slopes, params=forced_params(triton_device))
    assert torch.equal(out[:1], out_b0)


def test_sinks_lse_and_empty_rows(triton_device):
    """lse includes the sink; a row that sees no key (N_q > N_kv, causal) returns 0 and lse = sink."""
    t = forced_tile(triton_device)
    q, k, v = _inputs(1, 3, 1, 2 * t, t - 3, 16, 16, torch.bfloat16, triton_device, 41)
    sinks = torch.tensor([3.0, -1.5, 0.0], device=triton_device)
    out, lse = _check(q, k, v, causal=True, device=triton_device, sinks=sinks)
    empty = 2 * t - (t - 3)  # rows 0 .. empty - 1 see no key
    assert not out[:, :, :empty].any()
    assert torch.allclose(lse[:, :, :empty], sinks[None, :, None].expand(1, 3, empty))
    big = torch.full((3,), 40.0, device=triton_device)  # a sink far above every score
    _check(q, k, v, causal=True, device=triton_device, sinks=big, window=(2, 0))


def test_huge_logits_with_softcap_and_alibi(triton_device):
    """Raw scores near +-200 capped to +-30, ALiBi over long distances: the rescaling holds."""
    t = forced_tile(triton_device)
    std = math.sqrt(200.0 / 3.0)
    q = _randn((1, 2, 2 * t + 1, 32), torch.float32, triton_device, 1, std)
    k = _randn((1, 2, 3 * t, 32), torch.float32, triton_device, 2, std)
    v = _randn((1, 2, 3 * t, 32), torch.float32, triton_device, 3)
    _check(q, k, v, causal=True, device=triton_device, softcap=30.0,
           alibi_slopes=torch.tensor([2.0, 0.01], device=triton_device))


# --------------------------------------------------------------------------- plain path, op, errors

def test_plain_path_unchanged(triton_device):
    """variants=None compiles no variant code (every flag off, no variant tensor passed); a
    window wider than the sequence gives the very bits of the plain call."""
    off = tp._VariantArgs.of(None, torch.float16)
    assert not any(off.flags.values()) and all(x is None for x in off.tensors)
    t = forced_tile(triton_device)
    q, k, v = _inputs(1, 2, 1, 2 * t + 3, 3 * t + 1, 32, 32, torch.float16, triton_device, 51)
    for causal in (True, False):
        plain = tp.prefill(q, k, v, causal=causal, params=forced_params(triton_device))
        wide = tp.prefill(q, k, v, causal=causal, params=forced_params(triton_device),
                          variants=Variants(window=(4 * t, 4 * t)))
        assert torch.equal(plain, wide)


def test_op_carries_variants(triton_device):
    """flashcl::prefill takes the variants in its schema; the fake and real implementations agree
    (opcheck) with every variant on."""
    q, k, v = _inputs(1, 4, 2, 5, 7, 16, 16, torch.float16, triton_device, 3)
    mask = (torch.rand(1, 4, 5, 7, generator=torch.Generator().manual_seed(1)) < 0.7).to(triton_device)
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(2)).to(triton_device)
    slopes = torch.rand(1, 4, generator=torch.Generator().manual_seed(3)).to(triton_device)
    for return_lse in (True, False):
        torch.library.opcheck(
            torch.ops.flashcl.prefill.default, (q, k, v, True, 0.25, return_lse),
            {"window": [3, 0], "softcap": 5.0, "sinks": sinks, "alibi_slopes": slopes, "mask": mask},
            test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


def test_torch_compile_with_variants(triton_device):
    """fullgraph compile through flashcl::prefill with a mask and sinks: no graph break, same bits."""
    import torch._dynamo

    q, k, v = _inputs(1, 2, 1, 20, 20, 16, 16, torch.float32, triton_device, 4)
    mask = (torch.rand(1, 1, 20, 20, generator=torch.Generator().manual_seed(1)) < 0.8).to(triton_device)
    var = Variants(window=(7, 0), softcap=3.0, sinks=torch.tensor([0.5, -0.5], device=triton_device), mask=mask)

    def f(q, k, v):
        return tp.prefill(q, k, v, causal=True, variants=var, params=forced_params(triton_device)) * 2

    eager = f(q, k, v)
    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True)(q, k, v)
    assert torch.equal(compiled, eager)


@pytest.mark.parametrize("bad, match", [
    (dict(mask=torch.ones(1, 1, 4, 5, dtype=torch.bool)), "variants.mask"),
    (dict(mask=torch.ones(1, 1, 3, 6, dtype=torch.int32)), "variants.mask"),
    (dict(sinks=torch.zeros(3)), "variants.sinks"),
    (dict(alibi_slopes=torch.zeros(2)), "variants.alibi_slopes"),
])
def test_bad_variants_raise_before_launch(triton_device, bad, match):
    """tp.prefill checks what it is handed (flashcl.prefill validates users' input first)."""
    q, k, v = _inputs(1, 2, 2, 3, 6, 16, 16, torch.float32, triton_device, 1)
    bad = {n: x.to(triton_device) for n, x in bad.items()}
    with pytest.raises(ValueError, match=match):
        tp.prefill(q, k, v, variants=Variants(**bad))


def test_best_config_keys_on_flags(triton_device):
    """The autotuner's cache is keyed by the variant flags: a windowed call tunes its own entry."""
    if triton_device != "cuda":
        pytest.skip("autotuning runs on CUDA only")
    q, k, v = _inputs(1, 8, 8, 1024, 1024, 64, 64, torch.float16, triton_device, 61)
    var = Variants(window=(255, 0))
    out = tp.prefill(q, k, v, causal=True, variants=var)
    assert tp.best_config(1024, 1024, 64, 64, True, torch.float16, 8, variants=var) is not None
    ref = reference.attention(_np(q), _np(k), _np(v), causal=True, window=(255, 0))
    assert reference.rel_err(out.double().cpu().numpy(), ref) <= reference.TOLERANCE["float16"]


def test_best_config_keys_on_mask_reads(triton_device):
    """A mask read by TMA (16-byte aligned rows) and one read by pointer loads (odd N_kv) tune
    entries of their own: their tiles load differently, so one's best config is not the other's."""
    if triton_device != "cuda" or torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA mask reads need sm_90")
    for n_kv, by_tma in ((1024, True), (1023, False)):
        q, k, v = _inputs(1, 8, 8, 1024, n_kv, 64, 64, torch.float16, triton_device, 62)
        mask = torch.rand(1, 1, 1024, n_kv, device=triton_device) < 0.9
        var = Variants(mask=mask)
        assert tp._tma_ok(mask.view(torch.uint8)) == by_tma
        out = tp.prefill(q, k, v, causal=False, variants=var)
        assert tp.best_config(1024, n_kv, 64, 64, False, torch.float16, 8, variants=var) is not None
        ref = reference.attention(_np(q), _np(k), _np(v), causal=False, mask=_np(mask))
        assert reference.rel_err(out.double().cpu().numpy(), ref) <= reference.TOLERANCE["float16"]


@pytest.mark.parametrize("n_q, n_kv, causal, window", [
    (7, 7, True, None), (5, 9, True, (2, 0)), (9, 5, True, (1, 0)), (6, 6, False, (1, 2)), (4, 8, False, (-1, 1)),
])
def test_bench_counts_visible_pairs(n_q, n_kv, causal, window):
    """The variant benchmark's FLOPs count the (row, key) pairs the oracle's rules make visible."""
    from flashcl.tools import triton_bench_prefill as bench

    _, visible = reference.logits(np.zeros((1, 1, n_q, 1)), np.zeros((1, 1, n_kv, 1)), causal=causal, window=window)
    assert bench.visible_pairs(n_q, n_kv, causal, window) == int(visible.sum())
