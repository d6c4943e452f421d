"""Attention variants in the OpenCL prefill kernels (flashcl.variants: window, softcap, sinks,
ALiBi, bool and additive masks) against the float64 oracle, in both layouts (prefill.cl "rows",
prefill_tiles.cl "tiles"), on every OpenCL device present (conftest.py).

The kernels run on NaN-poisoned out/lse, with K/V as views of longer buffers (a read past N_kv
would see the rows after them). The tiles are small (BLOCK_M 16, BLOCK_N 8, two DV passes) so that
a few dozen keys cross every kind of tile: skipped by the window or the mask's tile map, crossed
by a window edge, partly hidden by the mask, wholly visible. The Oclgrind cases at the end run
the same checks under its race, uninitialized-value and bounds checkers.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest

import flashcl
from flashcl import reference
from flashcl.opencl import prefill as cl_prefill
from flashcl.opencl.prefill import PrefillKernel, PrefillProblem, choose_params, program
from flashcl.opencl.runtime import get_device
from flashcl.variants import Variants

from ._check import assert_close

cla = pytest.importorskip("pyopencl.array")

BLOCK_M, BLOCK_N = 16, 8
LAYOUTS = {
    "rows": dict(BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, DV_TILE=16, VEC=4),
    "tiles": dict(VARIANT="tiles", BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, DV_TILE=16, TILE_M=4, TILE_N=2),
}
# B, H_q, H_kv, N_q, N_kv, DK, DV: GQA, DK != DV, chunked prefill (N_q < N_kv), no tile multiple
SHAPE = (2, 4, 2, 37, 70, 40, 32)


def _rng(*key):
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def _inputs(rng, b, h_q, h_kv, n_q, n_kv, dk, dv, dtype, pad=3):
    """q, and k/v with ``pad`` extra keys past N_kv (the kernel gets views of the first N_kv)."""
    q = rng.standard_normal((b, h_q, n_q, dk)) * 2.0  # peaked rows: errors in the softmax show
    k = rng.standard_normal((b, h_kv, n_kv + pad, dk))
    v = rng.standard_normal((b, h_kv, n_kv + pad, dv))
    return q.astype(dtype), k.astype(dtype), v.astype(dtype)


def make_variants(rng, spec: dict, b: int, h_q: int, n_q: int, n_kv: int, mask_heads: int = 1) -> Variants:
    """Variants in the API's normalized form from a recipe: window (left, right), softcap float,
    sinks / alibi True, mask "bool" / "add" (random, broadcast over H_q unless mask_heads = H_q)."""
    mask = None
    if spec.get("mask"):
        shape = (b, mask_heads, n_q, n_kv)
        hidden = rng.random(shape) < 0.35
        if spec["mask"] == "bool":
            mask = ~hidden
        else:
            mask = np.where(hidden, -np.inf, rng.standard_normal(shape)).astype(np.float32)
    return Variants(
        window=spec.get("window"),
        softcap=spec.get("softcap"),
        sinks=(rng.standard_normal(h_q) + 2.0).astype(np.float32) if spec.get("sinks") else None,
        alibi_slopes=rng.uniform(0.05, 0.6, (b, h_q)).astype(np.float32) if spec.get("alibi") else None,
        mask=mask)


def oracle(q, k, v, causal, var: Variants | None):
    kw = {} if var is None else dict(window=var.window, softcap=var.softcap, sinks=var.sinks,
                                     alibi_slopes=var.alibi_slopes, mask=var.mask)
    return reference.attention(q, k, v, causal=causal, return_lse=True, **kw)


def visibility(q, k, causal, var: Variants) -> np.ndarray:
    """(B, H_q, N_q, N_kv) bool: which keys each row sees under ``var`` (the oracle's rule)."""
    _, visible = reference.logits(q, k, causal=causal, window=var.window, mask=var.mask)
    return visible


class Runner:
    """One prefill kernel (problem class, params, variant flags) run on NaN-poisoned outputs."""

    def __init__(self, device, q, k, v, n_kv, causal, params, var: Variants | None):
        self.h = get_device(device)
        (b, h_q, n_q, dk), h_kv, dv = q.shape, k.shape[1], v.shape[3]
        self.prob = PrefillProblem(b, h_q, h_kv, n_q, n_kv, dk, dv, causal, q.dtype.name)
        self.params = choose_params(self.h, self.prob, params).params
        self.kern = PrefillKernel(self.h, self.prob, self.params, write_lse=True,
                                  flags=var.flags() if var is not None else None)

    def __call__(self, q, k, v, var: Variants | None):
        p, queue = self.prob, self.h.queue
        qd, kd, vd = (cla.to_device(queue, x) for x in (q, k, v))
        out = cla.to_device(queue, np.full((p.b, p.h_q, p.n_q, p.dv), np.nan, dtype=q.dtype))
        lse = cla.to_device(queue, np.full((p.b, p.h_q, p.n_q), np.nan, dtype=np.float32))
        self.kern(qd, kd[:, :, :p.n_kv], vd[:, :, :p.n_kv], out, lse, p.dk ** -0.5, variants=var).wait()
        return out.get(), lse.get()


def assert_matches(out, lse, ref_out, ref_lse, dtype, what, rows=None):
    """out within the dtype's tolerance, lse within 1e-5 where finite and -inf where the oracle's
    is (a row that sees no key: out 0); only the rows selected by ``rows`` (lse's shape) if given."""
    if rows is not None:
        assert rows.any(), f"{what}: no row to check"
        out, lse, ref_out, ref_lse = out[rows], lse[rows], ref_out[rows], ref_lse[rows]
    assert_close(out, ref_out, dtype, what)
    finite = np.isfinite(ref_lse)
    differ = np.argwhere(np.isfinite(lse) != finite)[:5].tolist()
    assert not differ, f"{what}: lse finiteness differs at {differ}"
    assert np.all(np.isneginf(lse[~finite])), f"{what}: a row that sees no key needs lse = -inf"
    assert np.all(out[~finite] == 0), f"{what}: a row that sees no key needs out = 0"
    np.testing.assert_allclose(lse[finite], ref_lse[finite], rtol=1e-5, atol=1e-5, err_msg=what)


def check_variants(device, layout, spec, causal, dtype, *, shape=SHAPE, mask_heads=1):
    b, h_q, h_kv, n_q, n_kv, dk, dv = shape
    rng = _rng(layout, sorted(spec.items()), causal, dtype, shape)
    q, k, v = _inputs(rng, b, h_q, h_kv, n_q, n_kv, dk, dv, dtype)
    var = make_variants(rng, spec, b, h_q, n_q, n_kv, mask_heads)
    run = Runner(device, q, k, v, n_kv, causal, LAYOUTS[layout], var)
    out, lse = run(q, k, v, var)
    ref_out, ref_lse = oracle(q, k[:, :, :n_kv], v[:, :, :n_kv], causal, var)
    assert_matches(out, lse, ref_out, ref_lse, dtype, f"{layout} {spec} causal={causal} {dtype} {shape}")


# --------------------------------------------------------------------------- each variant

# (recipe, causal): each variant alone, where causal interacts with it, and all together
CASES = [
    ({"window": (9, 0)}, True),
    ({"window": (7, 11)}, False),
    ({"softcap": 0.7}, False),                      # strong capping: scores of order 2
    ({"sinks": True}, True),
    ({"alibi": True}, True),                        # slopes per (batch, head)
    ({"mask": "bool"}, False),
    ({"mask": "add"}, True),
    ({"window": (12, 3), "softcap": 1.5, "sinks": True, "alibi": True, "mask": "bool"}, True),
    ({"window": (20, 5), "softcap": 4.0, "sinks": True, "alibi": True, "mask": "add"}, False),
]
ALL_BOOL, ALL_ADD = CASES[-2], CASES[-1]


def _case_id(case):
    spec, causal = case
    return "+".join(spec) + ("-" + spec["mask"] if "mask" in spec else "") + ("-causal" if causal else "")


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_variant_matches_oracle(cl_device, layout, case):
    check_variants(cl_device, layout, case[0], case[1], "float32")


@pytest.mark.parametrize("params", [LAYOUTS["rows"], dict(LAYOUTS["rows"], BLOCK_N=32, VEC=16), LAYOUTS["tiles"]],
                         ids=["rows", "rows-vec16", "tiles"])
def test_softcap_range_fp32(cl_device, params):
    """The softcap without libm's tanh (softcap.h: a polynomial near 0, the exp2 / reciprocal
    form beyond) keeps fp32's tolerance from a cap far below the logits (every score near +-cap)
    to one far above them (the cap inactive), scores on both sides of its 0.55 switch."""
    b, h_q, h_kv, n_q, n_kv, dk, dv = SHAPE
    rng = _rng("softcap range", sorted(params.items()))
    q, k, v = _inputs(rng, b, h_q, h_kv, n_q, n_kv, dk, dv, np.float32)
    q *= 2.0  # logits of +-30 and more
    for cap in (0.05, 1.0, 30.0, 1e4):
        var = Variants(softcap=cap)
        run = Runner(cl_device, q, k, v, n_kv, True, params, var)
        out, lse = run(q, k, v, var)
        ref_out, ref_lse = oracle(q, k[:, :, :n_kv], v[:, :, :n_kv], True, var)
        assert_matches(out, lse, ref_out, ref_lse, "float32", f"softcap {cap} {params}")


@pytest.mark.parametrize("case", [ALL_BOOL, ALL_ADD], ids=["all-bool-causal", "all-add"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_variants_half_storage(cl_device, layout, case):
    check_variants(cl_device, layout, case[0], case[1], "float16")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_mask_per_head_and_rows_that_see_nothing(cl_device, layout):
    """A (B, H_q, ..) mask (no broadcast) with N_q > N_kv: causal rows before the first key see
    nothing, with sinks (lse = the sink) and without (zeros, lse = -inf)."""
    for spec in ({"mask": "add", "sinks": True}, {"mask": "add"}):
        check_variants(cl_device, layout, spec, True, "float32", shape=(2, 4, 2, 30, 11, 32, 32), mask_heads=4)


# --------------------------------------------------------------------------- windows at tile edges

# left: 0, 1, tile - 1, tile, tile + 1, a query block, beyond N_kv, unbounded; right: 0, 1, tile + 1
WINDOW_LEFTS = [0, 1, BLOCK_N - 1, BLOCK_N, BLOCK_N + 1, BLOCK_M, 200, -1]
WINDOW_RIGHTS = [0, 1, BLOCK_N + 1, -1]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_window_edges(cl_device, layout, causal):
    """Every window around the tile sizes, on a chunked (N_q < N_kv) and an N_q > N_kv problem:
    one build (the window's bounds are arguments), many launches."""
    for n_q, n_kv in ((37, 70), (45, 20)):
        rng = _rng("window", layout, causal, n_q, n_kv)
        q, k, v = _inputs(rng, 1, 2, 1, n_q, n_kv, 32, 32, "float32")
        run = Runner(cl_device, q, k, v, n_kv, causal, LAYOUTS[layout], Variants(window=(0, 0)))
        for left in WINDOW_LEFTS:
            for right in WINDOW_RIGHTS if not causal else [0, 5]:
                var = Variants(window=(left, right))
                out, lse = run(q, k, v, var)
                ref_out, ref_lse = oracle(q, k[:, :, :n_kv], v[:, :, :n_kv], causal, var)
                assert_matches(out, lse, ref_out, ref_lse, "float32",
                               f"{layout} window={var.window} causal={causal} N={n_q}x{n_kv}")


# --------------------------------------------------------------------------- masks and tiles

def _structured_mask(rng, b, n_q, n_kv, kind):
    """A random mask with whole hidden rows, a wholly hidden and a wholly visible (query block,
    key tile), and whole hidden key columns."""
    visible = rng.random((b, 1, n_q, n_kv)) < 0.6
    visible[:, :, BLOCK_M:2 * BLOCK_M, BLOCK_N:3 * BLOCK_N] = False  # hidden tiles: skipped
    visible[:, :, :BLOCK_M, 3 * BLOCK_N:4 * BLOCK_N] = True    # a wholly visible tile
    visible[:, :, :, 5 * BLOCK_N:6 * BLOCK_N] = False          # a key tile no row sees
    visible[:, :, 3 + BLOCK_M] = False                         # a row that sees nothing
    if kind == "bool":
        return visible
    return np.where(visible, rng.standard_normal(visible.shape), -np.inf).astype(np.float32)


@pytest.mark.parametrize("kind", ["bool", "add"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_mask_empties_rows_and_tiles(cl_device, layout, kind):
    b, h_q, h_kv, n_q, n_kv, dk, dv = SHAPE
    rng = _rng("structured", layout, kind)
    q, k, v = _inputs(rng, b, h_q, h_kv, n_q, n_kv, dk, dv, "float32")
    for sinks in (None, (rng.standard_normal(h_q) + 2).astype(np.float32)):
        var = Variants(mask=_structured_mask(rng, b, n_q, n_kv, kind), sinks=sinks)
        tiles = cl_prefill.mask_tile_map(var.mask, BLOCK_M, BLOCK_N)
        assert {0, 1, 2} <= set(np.unique(tiles)), "the mask must make every kind of tile"
        out, lse = Runner(cl_device, q, k, v, n_kv, False, LAYOUTS[layout], var)(q, k, v, var)
        ref_out, ref_lse = oracle(q, k[:, :, :n_kv], v[:, :, :n_kv], False, var)
        assert_matches(out, lse, ref_out, ref_lse, "float32",
                       f"{layout} structured {kind} mask sinks={sinks is not None}")
        if sinks is not None:  # the row that sees nothing: out 0, lse = its head's sink
            np.testing.assert_allclose(lse[:, :, 3 + BLOCK_M], np.broadcast_to(sinks, (b, h_q)), rtol=1e-6)
            assert np.all(out[:, :, 3 + BLOCK_M] == 0)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_additive_mask_of_float32_min(cl_device, layout):
    """transformers pads float32 masks with finfo(float32).min, not -inf: at or below
    reference.MASK_HIDES_AT a value hides its key as -inf does (in the kernels' log2 units it
    overflows), so a row whose keys all carry it sees none (out 0, lse -inf), NaN in V at those
    keys never leaks, and just above it a key stays visible with that bias."""
    b, h_q, h_kv, n_q, n_kv, dk, dv = SHAPE
    rng = _rng("finfo", layout)
    q, k, v = _inputs(rng, b, h_q, h_kv, n_q, n_kv, dk, dv, "float32")
    lowest = np.finfo(np.float32).min
    mask = np.where(rng.random((b, 1, n_q, n_kv)) < 0.5, lowest, 0.0).astype(np.float32)
    mask[:, :, 5] = lowest
    mask[:, :, 6] = np.nextafter(np.float32(reference.MASK_HIDES_AT), np.float32(0))  # the most negative shown
    mask[:, :, 6, 1] = 0.0
    v[:, :, 2] = np.nan  # key 2: hidden from every row
    mask[:, :, :, 2] = lowest
    var = Variants(mask=mask)
    out, lse = Runner(cl_device, q, k, v, n_kv, True, LAYOUTS[layout], var)(q, k, v, var)
    ref_out, ref_lse = oracle(q, k[:, :, :n_kv], v[:, :, :n_kv], True, var)
    assert np.all(out[:, :, 5] == 0) and np.all(np.isneginf(lse[:, :, 5]))
    assert_matches(out, lse, ref_out, ref_lse, "float32", f"{layout} finfo.min mask")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_tile_map_decides_which_tiles_run(cl_device, layout, monkeypatch):
    """The kernels skip the tiles the map marks hidden (what makes a sparse mask cheap): with a
    map that hides every tile, every row sees nothing, though the mask shows every key."""
    b, h_q, h_kv, n_q, n_kv, dk, dv = SHAPE
    rng = _rng("map", layout)
    q, k, v = _inputs(rng, b, h_q, h_kv, n_q, n_kv, dk, dv, "float32")
    var = Variants(mask=np.ones((1, 1, n_q, n_kv), dtype=bool))
    run = Runner(cl_device, q, k, v, n_kv, False, LAYOUTS[layout], var)
    monkeypatch.setattr(cl_prefill, "mask_tile_map", lambda m, bm, bn: np.zeros_like(
        cl_prefill.mask_block_map(m, bm, bn)))
    out, lse = run(q, k, v, var)
    assert np.all(out == 0) and np.all(np.isneginf(lse)), "a tile marked hidden must not run"


def test_mask_tile_map_levels():
    mask = np.ones((1, 1, 5, 12), dtype=bool)
    mask[0, 0, :, 4:8] = False
    mask[0, 0, 1, 9] = False
    # tiles of 4 keys: all visible, all hidden, one hidden key (and the padded rows count as visible)
    assert cl_prefill.mask_tile_map(mask, 4, 4)[0, 0].tolist() == [[2, 0, 1], [2, 0, 2]]
    add = np.where(mask, 0.5, -np.inf).astype(np.float32)
    assert np.array_equal(cl_prefill.mask_tile_map(add, 4, 4), cl_prefill.mask_tile_map(mask, 4, 4))


def _band_mask(n_q, n_kv, kind):
    """Query block j sees keys [8 j + 13, 8 j + 30) (BLOCK_N 8): hidden tiles before (one, then
    three) and after its band, whose edges cut tiles; query block 1 sees nothing at all."""
    rows = np.arange(n_q)[:, None] // BLOCK_M
    keys = np.arange(n_kv)[None, :]
    visible = (keys >= BLOCK_N * rows + 13) & (keys < BLOCK_N * rows + 30) & (rows != 1)
    visible = np.broadcast_to(visible, (1, 1, n_q, n_kv))
    return visible.copy() if kind == "bool" else np.where(visible, 0.25, -np.inf).astype(np.float32)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("kind", ["bool", "add"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_mask_hidden_tiles_at_a_blocks_ends(cl_device, layout, kind, causal):
    """The kernels narrow a block's key range to its first and last tiles the mask does not wholly
    hide (mask_kv_range): hidden tiles at either end, NaN in their K and V, a block that sees
    nothing (its loop empty: out 0, lse -inf), with and without causal."""
    b, h_q, h_kv, n_q, n_kv, dk, dv = SHAPE
    rng = _rng("band", layout, kind, causal)
    q, k, v = _inputs(rng, b, h_q, h_kv, n_q, n_kv, dk, dv, "float32")
    var = Variants(mask=_band_mask(n_q, n_kv, kind))
    tiles = cl_prefill.mask_tile_map(var.mask, BLOCK_M, BLOCK_N)[0, 0]
    assert tiles[0, 0] == 0 and (tiles[0, 4:] == 0).all() and (tiles[2, :3] == 0).all() and (tiles[1] == 0).all()
    visible = visibility(q, k[:, :, :n_kv], causal, var)
    hidden = ~visible.any(axis=(0, 1, 2))
    kp, vp = k.copy(), v.copy()
    kp[:, :, :n_kv][:, :, hidden] = np.nan
    vp[:, :, :n_kv][:, :, hidden] = np.nan
    out, lse = Runner(cl_device, q, kp, vp, n_kv, causal, LAYOUTS[layout], var)(q, kp, vp, var)
    ref_out, ref_lse = oracle(q, k[:, :, :n_kv], v[:, :, :n_kv], causal, var)
    assert_matches(out, lse, ref_out, ref_lse, "float32", f"{layout} band {kind} mask causal={causal}")


@pytest.mark.parametrize("block_m,block_n", [(1, 8), (16, 8), (64, 32), (8, 64), (16, 4)])
def test_mask_tile_map_matches_its_definition(block_m, block_n):
    """The tile map from the mask's bits equals its definition from the boolean block map: 0 where
    no key of the tile is visible to a row of the block, 2 where none is hidden (keys past N_kv and
    rows past N_q count as neither), else 1."""
    rng = np.random.default_rng(block_m * 100 + block_n)
    for shape in [(2, 3, 100, 77), (1, 1, 63, 129), (1, 2, 1, 5), (2, 1, 64, 64)]:
        for p_visible in (0.0, 0.02, 0.5, 0.995, 1.0):
            mask = rng.random(shape) < p_visible
            mask[..., : shape[2] // 2, : shape[3] // 3] = True  # wholly visible tiles too
            some_visible = cl_prefill.mask_block_map(mask, block_m, block_n)
            some_hidden = cl_prefill.mask_block_map(~mask, block_m, block_n)
            want = np.where(some_visible == 1, np.where(some_hidden == 1, 1, 2), 0)
            np.testing.assert_array_equal(cl_prefill.mask_tile_map(mask, block_m, block_n), want)
            add = np.where(mask, 0.0, -np.inf).astype(np.float32)
            np.testing.assert_array_equal(cl_prefill.mask_tile_map(add, block_m, block_n), want)


# --------------------------------------------------------------------------- hidden NaN / inf

@pytest.mark.parametrize("poison", [np.nan, np.inf], ids=["nan", "inf"])
@pytest.mark.parametrize("what", ["window", "mask"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_hidden_keys_never_leak(cl_device, layout, what, poison):
    """K and V poisoned at one key at a time, around window edges and mask-hidden keys: every row
    that cannot see that key equals the oracle on the clean inputs."""
    n_q, n_kv = 37, 70
    rng = _rng("poison", layout, what)
    q, k, v = _inputs(rng, 2, 2, 1, n_q, n_kv, 32, 32, "float32")
    if what == "window":
        var, causal = Variants(window=(BLOCK_N + 3, 2)), False
    else:
        var, causal = Variants(mask=_structured_mask(rng, 2, n_q, n_kv, "bool")), True
    run = Runner(cl_device, q, k, v, n_kv, causal, LAYOUTS[layout], var)
    ref_out, ref_lse = oracle(q, k[:, :, :n_kv], v[:, :, :n_kv], causal, var)
    visible = visibility(q, k[:, :, :n_kv], causal, var)
    for key in (0, BLOCK_N - 1, BLOCK_N, 21, 33, 44, 47, n_kv - 1):
        kp, vp = k.copy(), v.copy()
        kp[:, :, key] = poison
        vp[:, :, key] = poison
        out, lse = run(q, kp, vp, var)
        blind = ~visible[..., key]
        assert_matches(out, lse, ref_out, ref_lse, "float32",
                       f"{layout} {what} poison {poison} at key {key}", rows=blind)


# --------------------------------------------------------------------------- plain path

def test_plain_build_has_no_variant_defines():
    """All variants off: the same defines as the plain kernel, so the same program (zero cost)."""
    prob = PrefillProblem(1, 4, 2, 37, 70, 40, 32, True, "float32")
    for params in LAYOUTS.values():
        plain = program(prob, params)
        assert program(prob, params, flags=Variants().flags()) == plain
        assert not any(d.startswith(("HAS_", "MASK_")) for d in plain[2])
        on = program(prob, params, flags=Variants(window=(1, 0), mask=np.ones((1, 1, 1, 1), bool)).flags())[2]
        assert on["HAS_WINDOW"] == 1 and on["MASK_KIND"] == 1 and "HAS_SINKS" not in on


@pytest.mark.parametrize("layout", LAYOUTS)
def test_plain_path_unchanged(cl_device, layout):
    """variants=None runs the plain kernel and matches the oracle; a kernel built for a variant
    refuses a call without it."""
    b, h_q, h_kv, n_q, n_kv, dk, dv = SHAPE
    rng = _rng("plain", layout)
    q, k, v = _inputs(rng, b, h_q, h_kv, n_q, n_kv, dk, dv, "float32")
    out, lse = Runner(cl_device, q, k, v, n_kv, True, LAYOUTS[layout], None)(q, k, v, None)
    ref_out, ref_lse = oracle(q, k[:, :, :n_kv], v[:, :, :n_kv], True, None)
    assert_matches(out, lse, ref_out, ref_lse, "float32", f"{layout} plain")
    windowed = Runner(cl_device, q, k, v, n_kv, True, LAYOUTS[layout], Variants(window=(3, 0)))
    with pytest.raises(ValueError, match="differ from those this kernel was built for"):
        windowed(q, k, v, None)


# --------------------------------------------------------------------------- public API

def test_api_broadcasts_and_default_params(cl_device):
    """flashcl.prefill with the device's default tiles (wide vectors on this CPU), a 2-D
    additive mask, (H_q,) slopes, 3-D inputs and return_lse."""
    rng = _rng("api")
    h_q, h_kv, n_q, n_kv, d = 4, 1, 90, 150, 64
    q = rng.standard_normal((h_q, n_q, d)).astype(np.float32)
    k, v = (rng.standard_normal((h_kv, n_kv, d)).astype(np.float32) for _ in range(2))
    add = np.where(rng.random((n_q, n_kv)) < 0.3, -np.inf, rng.standard_normal((n_q, n_kv))).astype(np.float32)
    add[:, :70] = -np.inf  # whole default-size tiles hidden
    slopes = rng.uniform(0.01, 0.2, h_q).astype(np.float32)
    sinks = rng.standard_normal(h_q).astype(np.float32)
    for mask in (add, add != -np.inf):
        kw = dict(window=(60, 0), softcap=3.0, sinks=sinks, alibi_slopes=slopes, mask=mask)
        out, lse = flashcl.prefill(q, k, v, causal=True, device=cl_device, return_lse=True, **kw)
        ref_out, ref_lse = reference.attention(q, k, v, causal=True, return_lse=True, **kw)
        assert_matches(out, lse, ref_out, ref_lse, "float32", f"api {mask.dtype} mask")


# --------------------------------------------------------------------------- random combinations

try:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
except ImportError:  # only the random combinations need hypothesis
    st = None

if st is None:
    def test_random_variant_combinations():
        pytest.skip("hypothesis is not installed (pip install hypothesis)")
else:
    @st.composite
    def _problems(draw):
        n_q, n_kv = draw(st.integers(1, 40)), draw(st.integers(1, 50))
        spec = {}
        if draw(st.booleans()):
            spec["window"] = (draw(st.integers(-1, 30)), draw(st.integers(-1, 30)))
        if draw(st.booleans()):
            spec["softcap"] = draw(st.floats(0.3, 20.0))
        spec["sinks"] = draw(st.booleans())
        spec["alibi"] = draw(st.booleans())
        spec["mask"] = draw(st.sampled_from([None, "bool", "add"]))
        return (n_q, n_kv, spec, draw(st.booleans()), draw(st.sampled_from(sorted(LAYOUTS))),
                draw(st.integers(0, 2**31 - 1)))

    @settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(problem=_problems())
    def test_random_variant_combinations(cl_device, problem):
        n_q, n_kv, spec, causal, layout, seed = problem
        rng = np.random.default_rng(seed)
        q, k, v = _inputs(rng, 2, 2, 1, n_q, n_kv, 16, 16, "float32")
        var = make_variants(rng, spec, 2, 2, n_q, n_kv)
        var = var if var.active else None
        out, lse = Runner(cl_device, q, k, v, n_kv, causal, LAYOUTS[layout], var)(q, k, v, var)
        ref_out, ref_lse = oracle(q, k[:, :, :n_kv], v[:, :, :n_kv], causal, var)
        assert_matches(out, lse, ref_out, ref_lse, "float32", f"{layout} {spec} causal={causal} N={n_q}x{n_kv}")


# --------------------------------------------------------------------------- Oclgrind

# Tiny problems on the new code paths: a window whose edges cross tiles and skip others, a mask
# with skipped, partial and visible tiles (bool and additive), sinks, softcap and ALiBi; both
# layouts, work-groups wider than a subgroup in one case each.
OCLGRIND_CASES = {
    "rows-window-softcap-alibi-sinks": ("rows", {"window": (5, 2), "softcap": 1.0, "alibi": True, "sinks": True},
                                        True, (1, 2, 1, 20, 29, 16, 16), dict(BLOCK_M=8, BLOCK_N=4, DV_TILE=8, VEC=4)),
    "rows-mask-bool-m64": ("rows", {"mask": "bool", "sinks": True}, False, (1, 2, 1, 70, 23, 16, 16),
                           dict(BLOCK_M=64, BLOCK_N=8, DV_TILE=16, VEC=8)),
    "tiles-window-mask-add": ("tiles", {"window": (6, 0), "mask": "add", "softcap": 2.0, "alibi": True}, True,
                              (1, 2, 1, 18, 27, 16, 16),
                              dict(VARIANT="tiles", BLOCK_M=8, BLOCK_N=4, DV_TILE=8, TILE_M=2, TILE_N=2)),
    "tiles-mask-bool-sinks-wg64": ("tiles", {"mask": "bool", "sinks": True, "window": (9, 4)}, False,
                                   (1, 2, 1, 70, 40, 16, 32),
                                   dict(VARIANT="tiles", BLOCK_M=64, BLOCK_N=16, DV_TILE=32, TILE_M=8, TILE_N=2)),
}


def _oclgrind_worker(name: str) -> None:
    """Run one case on the Oclgrind device (in a subprocess started by the test)."""
    import pyopencl.characterize

    pyopencl.characterize.nv_compute_capability = lambda dev: None  # see test_oclgrind._worker
    layout, spec, causal, shape, params = OCLGRIND_CASES[name]
    b, h_q, h_kv, n_q, n_kv, dk, dv = shape
    rng = _rng("oclgrind", name)
    q, k, v = _inputs(rng, b, h_q, h_kv, n_q, n_kv, dk, dv, "float32")
    var = make_variants(rng, spec, b, h_q, n_q, n_kv)
    if var.mask is not None:  # whole tiles hidden, so that the tile map skips some (the last too
        # where there are enough: the blocks' key ranges narrow at both ends)
        hidden = False if var.mask.dtype == np.bool_ else -np.inf
        var.mask[:, :, :, : 2 * params["BLOCK_N"]] = hidden
        if n_kv > 3 * params["BLOCK_N"]:
            var.mask[:, :, :, (n_kv - 1) // params["BLOCK_N"] * params["BLOCK_N"]:] = hidden
    out, lse = Runner("oclgrind", q, k, v, n_kv, causal, params, var)(q, k, v, var)
    ref_out, ref_lse = oracle(q, k[:, :, :n_kv], v[:, :, :n_kv], causal, var)
    assert_matches(out, lse, ref_out, ref_lse, "float32", f"oclgrind {name}")
    print("OCLGRIND-CASE-OK")


@pytest.mark.slow
@pytest.mark.parametrize("name", OCLGRIND_CASES)
def test_variants_under_oclgrind(name, tmp_path):
    from tests.test_oclgrind import _oclgrind_present, run_under_oclgrind

    if not _oclgrind_present():
        pytest.skip("Oclgrind is not installed (pip install 'flashcl[oclgrind]')")
    run_under_oclgrind("tests.test_variants_prefill_opencl:_oclgrind_worker", name, name, tmp_path)


# --------------------------------------------------------------------------- benchmark

def test_bench_times_and_checks_the_variants(cl_device):
    """bench_prefill with variants: a plain row, then the variant row timed in the same run, with
    its ratio to the plain time and its error against the oracle."""
    from flashcl.tools import bench_prefill as bench

    rows = bench.bench_prefill(get_device(cl_device), [(1, 2, 1, 100, 32, True)], dtype="float32", repeats=2,
                               peer=False, variants={"window": (20, 0), "softcap": 5.0})
    plain, windowed = rows
    assert not plain.variants and windowed.variants == "window=(20, 0) softcap=5.0"
    assert windowed.plain_ms == plain.median_ms and windowed.vs_plain == plain.median_ms / windowed.median_ms
    assert plain.rel_err <= 1e-5 and windowed.rel_err <= 1e-5
    assert bench.visible_pairs(100, 100, True, (20, 0)) == sum(min(i, 20) + 1 for i in range(100))
    with pytest.raises(ValueError, match="the benchmark takes"):
        bench.bench_prefill(get_device(cl_device), [(1, 2, 1, 100, 32, True)], variants={"sinks": True})


def test_bench_times_the_causal_rule_as_a_mask(cl_device):
    """bench_prefill's "causal" mask: the causal rule as a bool mask with causal off, timed against
    causal=True on the same pairs, checked against the oracle with that mask; causal shapes only."""
    from flashcl.tools import bench_prefill as bench

    h = get_device(cl_device)
    plain, masked = bench.bench_prefill(h, [(1, 2, 1, 100, 32, True)], dtype="float32", repeats=2, peer=False,
                                        variants={"mask": "causal"})
    assert masked.variants == "mask=causal rule (causal off)" and not masked.causal and plain.causal
    assert masked.rel_err <= 1e-5 and masked.vs_plain == plain.median_ms / masked.median_ms
    assert masked.gflops == pytest.approx(plain.gflops * plain.median_ms / masked.median_ms)
    with pytest.raises(ValueError, match="causal shapes only"):
        bench.bench_prefill(h, [(1, 2, 1, 100, 32, False)], variants={"mask": "causal"})
    with pytest.raises(ValueError, match="masks are"):
        bench.bench_prefill(h, [(1, 2, 1, 100, 32, True)], variants={"mask": "padding"})


def test_bench_cli_causal_mask_times_the_presets_causal_shapes(cpu_device, monkeypatch):
    """`flashcl bench prefill --mask causal` without --shape takes the preset's causal shapes only
    (its non-causal ones would stop the run halfway)."""
    from click.testing import CliRunner

    from flashcl import cli
    from flashcl.tools import bench_prefill as bench

    seen = []
    monkeypatch.setattr(bench, "bench_prefill", lambda handle, shapes, **kw: seen.extend(shapes) or [])
    monkeypatch.setattr(bench, "format_prefill", lambda rows, cond: "")
    r = CliRunner().invoke(cli.main, ["bench", "prefill", "--device", cpu_device, "--mask", "causal"])
    assert r.exit_code == 0, r.output
    preset = bench.PREFILL_PRESETS["cpu"]
    assert seen and all(s[5] for s in seen) and len(seen) == sum(1 for s in preset if s[5]) < len(preset)
