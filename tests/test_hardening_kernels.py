"""The kernels' contract on hostile inputs, on every OpenCL device present (conftest.py).

* A key that a row cannot see never influences that row, even if its K or V holds NaN or inf:
  keys above the causal diagonal, keys past N_kv in the last tile, keys past a sequence's context
  length (the tail of a contiguous cache, the unwritten slots of a paged cache's last block, blocks
  no sequence uses). Those K/V are poisoned with NaN or +inf and the rows that cannot see them
  must equal the oracle on the clean inputs.
* lse is NaN wherever out is: NaN in one q row makes exactly that row's out and lse NaN; a row
  that sees no key still gives zeros and lse -inf.
* Device-resident tables (pyopencl Arrays, never read back on the host) with an out-of-range
  context length or block id: no out-of-bounds access, NaN out and lse for exactly the bad
  sequences, the others exact. Run in a subprocess, so that a segfault fails the test instead of
  killing pytest; tests/test_oclgrind.py runs the same checks under Oclgrind's bounds checker.

The checks are functions of the device spec so that test_oclgrind.py can call them with smaller
shapes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest

from flashcl import reference
from flashcl.opencl.decode import DecodeProblem, tensor_cores_ok
from flashcl.opencl.prefill import PrefillKernel, PrefillProblem, choose_params as prefill_params
from flashcl.opencl.runtime import get_device

from . import test_decode_opencl as dec
from . import test_prefill_opencl as pre
from ._check import assert_close

cla = pytest.importorskip("pyopencl.array")

REPO = Path(__file__).resolve().parent.parent
POISONS = {"nan": np.nan, "inf": np.inf}
INT_MIN, INT_MAX = -2**31, 2**31 - 1


def _rng(*key):
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def _assert_rows_match(out, lse, ref_out, ref_lse, rows, dtype, what):
    """out/lse equal the oracle on the rows selected by the boolean mask ``rows`` (lse's shape)."""
    assert rows.any(), f"{what}: no row to check"
    assert_close(out[rows], ref_out[rows], dtype, what)
    got, ref = lse[rows], ref_lse[rows]
    finite = np.isfinite(ref)
    assert np.array_equal(np.isfinite(got), finite), f"{what}: lse finiteness differs"
    assert np.all(np.isneginf(got[~finite])), f"{what}: a row that sees no key needs lse = -inf"
    assert np.all(out[rows][~finite] == 0), f"{what}: a row that sees no key needs out = 0"
    np.testing.assert_allclose(got[finite], ref[finite], rtol=1e-5, atol=1e-5, err_msg=what)


# --------------------------------------------------------------------------- prefill

# Both layouts with BLOCK_M = 2 * BLOCK_N (a query block's diagonal crosses two or three KV tiles)
# and two DV passes at DV = 32.
PREFILL_LAYOUTS = {
    "rows": dict(BLOCK_M=16, BLOCK_N=8, DV_TILE=16, VEC=4),
    "tiles": dict(VARIANT="tiles", BLOCK_M=16, BLOCK_N=8, DV_TILE=16, TILE_M=4, TILE_N=2),
}
# (N_q, N_kv): square, chunked (N_q < N_kv), N_q > N_kv (rows that see no key); none a tile multiple
PREFILL_SHAPES = [(37, 37), (21, 45), (30, 11)]


def _run_prefill(device, q, k, v, n_kv, causal, params):
    """The prefill kernel on NaN-poisoned out/lse, K/V being views of their first n_kv rows (the
    rows after them stay in the buffer: a read past N_kv would see them)."""
    h = get_device(device)
    (b, h_q, n_q, dk), h_kv, dv = q.shape, k.shape[1], v.shape[3]
    prob = PrefillProblem(b, h_q, h_kv, n_q, n_kv, dk, dv, causal, q.dtype.name)
    kern = PrefillKernel(h, prob, prefill_params(h, prob, params).params, write_lse=True)
    qd, kd, vd = (cla.to_device(h.queue, x) for x in (q, k, v))
    out = cla.to_device(h.queue, np.full((b, h_q, n_q, dv), np.nan, dtype=q.dtype))
    lse = cla.to_device(h.queue, np.full((b, h_q, n_q), np.nan, dtype=np.float32))
    kern(qd, kd[:, :, :n_kv], vd[:, :, :n_kv], out, lse, dk ** -0.5).wait()
    return out.get(), lse.get()


def check_prefill_poisoned(device, params, n_q, n_kv, causal, dtype, poison, *, d=32, h_q=2, pad=5):
    """Batch entry i poisons K and V at keys cuts[i].. (and the pad past N_kv); the rows that see
    none of them (all rows for the cut N_kv) must equal the oracle on the clean inputs. The cuts
    run over every key, so every key above the diagonal is poisoned for some rows."""
    off = n_kv - n_q
    cuts = list(range(max(1, off + 1), n_kv + 1)) if causal else [n_kv]
    b = len(cuts)
    q, k, v = pre._inputs(_rng(n_q, n_kv, causal, dtype, d), b, h_q, 1, n_q, n_kv + pad, d, d, dtype)
    ref_out, ref_lse = reference.attention(q, k[:, :, :n_kv], v[:, :, :n_kv], causal=causal,
                                           return_lse=True)
    kp, vp = k.copy(), v.copy()
    for i, c in enumerate(cuts):
        kp[i, :, c:] = poison
        vp[i, :, c:] = poison
    out, lse = _run_prefill(device, q, kp, vp, n_kv, causal, params)
    sees_clean = np.arange(n_q)[None, :] + off < np.array(cuts)[:, None]  # (B, N_q)
    rows = np.broadcast_to(sees_clean[:, None, :], lse.shape)
    _assert_rows_match(out, lse, ref_out, ref_lse, rows, dtype,
                       f"prefill {params} N={n_q}x{n_kv} causal={causal} {dtype} poison={poison}")


def check_prefill_nan_q(device, params, n_q, n_kv, causal, dtype, *, d=32, h_q=2):
    """NaN in a few q rows (first, middle, last, and a causal row that sees no key): exactly those
    rows' out and lse are NaN (the no-key row: zeros and -inf); every other row is exact."""
    q, k, v = pre._inputs(_rng("q", n_q, n_kv, causal, dtype), 2, h_q, 1, n_q, n_kv, d, d, dtype)
    ref_out, ref_lse = reference.attention(q, k, v, causal=causal, return_lse=True)
    off = n_kv - n_q
    blind = [i for i in range(n_q) if causal and i + off < 0]
    nan_rows = sorted({0, n_q // 2, n_q - 1} - set(blind))
    qp = q.copy()
    qp[1, 0, nan_rows, 3] = np.nan
    qp[1, 0, blind[:1], :] = np.nan
    out, lse = _run_prefill(device, qp, k, v, n_kv, causal, params)
    what = f"prefill {params} N={n_q}x{n_kv} causal={causal} {dtype} NaN q rows {nan_rows}"
    bad = np.zeros(lse.shape, bool)
    bad[1, 0, nan_rows] = True
    assert np.isnan(out[bad]).all() and np.isnan(lse[bad]).all(), f"{what}: out and lse must be NaN"
    _assert_rows_match(out, lse, ref_out, ref_lse, ~bad, dtype, what)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("layout", PREFILL_LAYOUTS)
def test_prefill_invisible_keys_never_leak(cl_device, layout, causal, dtype):
    for n_q, n_kv in PREFILL_SHAPES:
        for poison in POISONS.values():
            check_prefill_poisoned(cl_device, PREFILL_LAYOUTS[layout], n_q, n_kv, causal, dtype, poison)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("layout", PREFILL_LAYOUTS)
def test_prefill_nan_q_row(cl_device, layout, causal):
    for n_q, n_kv in PREFILL_SHAPES:
        check_prefill_nan_q(cl_device, PREFILL_LAYOUTS[layout], n_q, n_kv, causal, "float32")


# --------------------------------------------------------------------------- decode

# name -> (params, tensor_cores, dtype): decode.cl loading K/V rows directly (HEAD_TILE = G; warp
# shuffles on NVIDIA) and through the staged local tile (HEAD_TILE < G), and decode_mma.cl ("mma":
# its real PTX where tensor_cores_ok, else emulated), and decode_cpu.cl's whole rows ("rows").
DECODE_PATHS = {
    "direct-f32": (dict(ROWS=4, UNROLL=2, HEAD_TILE=4, MERGE_WG=32), None, "float32"),
    "staged-f16": (dict(ROWS=2, UNROLL=2, HEAD_TILE=1, MERGE_WG=16), False, "float16"),
    "rows-f32": (dict(VARIANT="rows", BLOCK_N=8, VEC=8, MERGE_WG=32), False, "float32"),
    "rows-f16": (dict(VARIANT="rows", BLOCK_N=5, VEC=16, MERGE_WG=64), False, "float16"),
    "mma-f16": (None, "mma", "float16"),
}
DECODE_SPLITS = (1, 3, 16)


def _decode_problem(rng, layout, lens, dtype, *, h_q=8, h_kv=2, d=64, block_size=16, n_max=None):
    """q and a paged (dec._paged: permuted blocks, spare blocks, garbage ids past each sequence's
    blocks) or contiguous cache; also a mask of the cache rows no sequence may read."""
    if layout == "paged":
        q, k, v, table, lens = dec._paged(rng, len(lens), h_q, h_kv, d, d, lens, block_size, dtype)
        unread = np.ones(k.shape[:2], bool)  # (num_blocks, block_size)
        for i, n in enumerate(lens):
            for t in range(n):
                unread[table[i, t // block_size], t % block_size] = False
        return q, k, v, table, lens, unread[:, :, None]
    n_max = n_max or max(lens) + 3
    q, k, v = dec._contiguous(rng, len(lens), h_q, h_kv, d, d, n_max, dtype)
    lens = np.asarray(lens, np.int32)
    unread = np.arange(n_max)[None, :] >= lens[:, None]  # (B, N_max)
    return q, k, v, None, lens, unread[:, None, :]


def _decode_ref(q, k, v, table, lens):
    return reference.decode_attention(q, k, v, block_table=table, context_lens=lens, return_lse=True)


def _run_decode(device, path, q, k, v, table, lens, num_splits):
    """dec.run_poisoned on one of DECODE_PATHS: (out, lse, params used)."""
    params, tensor_cores, dtype = DECODE_PATHS[path]
    if tensor_cores == "mma":
        h_kv, dk, dv = (k.shape[2] if table is not None else k.shape[1]), q.shape[2], v.shape[3]
        prob = DecodeProblem(q.shape[0], q.shape[1], h_kv, dk, dv, table is not None, dtype)
        tensor_cores = True if tensor_cores_ok(get_device(device), prob) else "emulate"
    return dec.run_poisoned(device, q, k, v, table, lens, num_splits, params, tensor_cores=tensor_cores)


def check_decode_poisoned(device, path, layout, poison, *, lens, splits=DECODE_SPLITS, **dims):
    dtype = DECODE_PATHS[path][2]
    q, k, v, table, lens, unread = _decode_problem(_rng(path, layout, lens), layout, lens, dtype, **dims)
    ref_out, ref_lse = _decode_ref(q, k, v, table, lens)
    kp, vp = (np.where(unread[..., None], np.asarray(poison, dtype), x) for x in (k, v))
    for s in splits:
        out, lse, used = _run_decode(device, path, q, kp, vp, table, lens, s)
        what = f"decode {path} {layout} lens={lens.tolist()} splits={s} poison={poison} params={used}"
        _assert_rows_match(out, lse, ref_out, ref_lse, np.ones(lse.shape, bool), dtype, what)


def check_decode_nan_q(device, path, layout, *, lens, splits=(1, 3), **dims):
    """NaN in one query head of a sequence (its GQA group's other heads stay exact) and in a
    sequence of context 0 (zeros and -inf: it sees no key)."""
    dtype = DECODE_PATHS[path][2]
    q, k, v, table, lens, _ = _decode_problem(_rng("q", path, layout), layout, lens, dtype, **dims)
    assert lens[-1] == 0 and lens[1] > 0
    ref_out, ref_lse = _decode_ref(q, k, v, table, lens)
    q = q.copy()
    q[1, 2, 5] = np.nan
    q[-1, 0, :] = np.nan
    bad = np.zeros(ref_lse.shape, bool)
    bad[1, 2] = True
    for s in splits:
        out, lse, _ = _run_decode(device, path, q, k, v, table, lens, s)
        what = f"decode {path} {layout} splits={s}: NaN in q[1, 2]"
        assert np.isnan(out[bad]).all() and np.isnan(lse[bad]).all(), f"{what}: out and lse must be NaN"
        _assert_rows_match(out, lse, ref_out, ref_lse, ~bad, dtype, what)


# context lengths around block (16) and tile ends, a long one, an empty sequence
PAGED_LENS = [1, 15, 16, 17, 130, 0]
CONTIGUOUS_LENS = [0, 1, 9, 64, 65, 139]


@pytest.mark.parametrize("poison", POISONS)
@pytest.mark.parametrize("layout", ["paged", "contiguous"])
@pytest.mark.parametrize("path", DECODE_PATHS)
def test_decode_unread_cache_never_leaks(cl_device, path, layout, poison):
    lens = PAGED_LENS if layout == "paged" else CONTIGUOUS_LENS
    check_decode_poisoned(cl_device, path, layout, POISONS[poison], lens=lens)


@pytest.mark.parametrize("layout", ["paged", "contiguous"])
@pytest.mark.parametrize("path", DECODE_PATHS)
def test_decode_nan_q_head(cl_device, path, layout):
    check_decode_nan_q(cl_device, path, layout, lens=[40, 17, 0])


# --------------------------------------------------------------------------- bad device tables

def _bad_tables(table, lens, layout, block_size, num_blocks, n_max):
    """One sequence per class of bad value (context length < 0, just past the cache, INT_MAX,
    INT_MIN; a used block id < 0, == num_blocks, INT_MAX, INT_MIN at the first, a middle and the
    partial last block), good sequences around them. Returns the tables and the bad rows."""
    lens = lens.copy()
    cap = table.shape[1] * block_size if layout == "paged" else n_max
    bad = {1: ("ctx", -1), 2: ("ctx", cap + 1), 3: ("ctx", INT_MAX), 4: ("ctx", INT_MIN)}
    if layout == "paged":
        table = table.copy()
        last = -(-int(lens[5]) // block_size) - 1
        bad.update({5: ("block", (0, -1)), 6: ("block", (last, num_blocks)), 7: ("block", (1, INT_MAX)),
                    8: ("block", (last, INT_MIN))})
    for i, (kind, val) in bad.items():
        if kind == "ctx":
            lens[i] = val
        else:
            table[i, val[0]] = val[1]
    is_bad = np.zeros(len(lens), bool)
    is_bad[list(bad)] = True
    return table, lens, is_bad


def check_bad_device_tables(device, path, layout, *, splits=(1, 3, 7), public_api=True, h_q=8, h_kv=2,
                            d=64, block_size=16, n=40):
    """Runs the bad-table cases of one path and layout; every sequence but 0 and the last is bad."""
    params, dtype = DECODE_PATHS[path][0], DECODE_PATHS[path][2]
    b = 10 if layout == "paged" else 6
    q, k, v, table, lens, _ = _decode_problem(_rng("tables", path, layout), layout, [n] * b, dtype,
                                              h_q=h_q, h_kv=h_kv, d=d, block_size=block_size, n_max=n + 5)
    lens[-1] = n // 2
    ref_out, ref_lse = _decode_ref(q, k, v, table, lens)
    n_max = k.shape[2]
    bad_table, bad_lens, is_bad = _bad_tables(table if table is not None else np.zeros((b, 1), np.int32),
                                              lens, layout, block_size, k.shape[0], n_max)
    if layout != "paged":
        bad_table = None
    good = np.broadcast_to(~is_bad[:, None], ref_lse.shape)
    runs = [(s, _run_decode(device, path, q, k, v, bad_table, bad_lens, s)[:2]) for s in splits]
    if public_api and path == "direct-f32":  # the device's own choice of kernel for fp32: decode.cl
        import flashcl

        h = get_device(device)
        args = [cla.to_device(h.queue, x) for x in (q, k, v, bad_lens)]
        kw = dict(context_lens=args[3], params=params, return_lse=True)
        if bad_table is not None:
            kw["block_table"] = cla.to_device(h.queue, bad_table)
        out_d, lse_d = flashcl.decode(*args[:3], **kw)
        runs.append(("flashcl.decode", (out_d.get(), lse_d.get())))
    for s, (out, lse) in runs:
        what = f"decode {path} {layout} splits={s} lens={bad_lens.tolist()}"
        assert np.isnan(out[is_bad]).all(), f"{what}: bad sequences need out NaN, got\n{out[is_bad][..., :4]}"
        assert np.isnan(lse[is_bad]).all(), f"{what}: bad sequences need lse NaN, got\n{lse[is_bad]}"
        _assert_rows_match(out, lse, ref_out, ref_lse, good, dtype, what)


def _bad_tables_worker(args_json: str) -> None:
    device, path, layout = json.loads(args_json)
    check_bad_device_tables(device, path, layout)
    print("BAD-TABLES-OK")


@pytest.mark.parametrize("layout", ["paged", "contiguous"])
@pytest.mark.parametrize("path", DECODE_PATHS)
def test_bad_device_tables(cl_device, path, layout):
    """In a subprocess: a segfault there fails this test (rc < 0) instead of killing pytest."""
    path_env = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=path_env)
    code = ("import sys; from tests.test_hardening_kernels import _bad_tables_worker; "
            "_bad_tables_worker(sys.argv[1])")
    proc = subprocess.run([sys.executable, "-c", code, json.dumps([cl_device, path, layout])], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "BAD-TABLES-OK" in proc.stdout, (
        f"bad device tables, {path} {layout}: rc {proc.returncode} (negative: killed by that signal)\n"
        f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
