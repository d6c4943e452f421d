"""Comparison helpers shared by the kernel tests: relative error with a per-dtype tolerance and
failure messages that say which elements are off and by how much."""

from __future__ import annotations

import numpy as np

from flashcl.reference import TOLERANCE as TOL, rel_err  # noqa: F401 - the one table and measure


def describe_mismatch(got, ref, n: int = 5) -> str:
    got = np.asarray(got, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    bad_nan = ~np.isfinite(got) & np.isfinite(ref)
    diff = np.where(np.isfinite(got), np.abs(got - ref), np.inf)
    worst = np.argsort(diff, axis=None)[::-1][:n]
    lines = [f"{int(bad_nan.sum())} non-finite where the reference is finite; worst elements:"]
    for flat in worst:
        idx = np.unravel_index(flat, got.shape)
        lines.append(f"  {tuple(int(i) for i in idx)}: got {got[idx]:.6g}, expected {ref[idx]:.6g}")
    return "\n".join(lines)


def naive_attention(q, k, v, causal: bool, scale: float, dtype) -> np.ndarray:
    """Plain softmax(q k^T) v carried out entirely in ``dtype`` (the low-precision yardstick)."""
    q, k, v = (np.asarray(x, dtype=dtype) for x in (q, k, v))
    g = q.shape[-3] // k.shape[-3]
    k = np.repeat(k, g, axis=-3)
    v = np.repeat(v, g, axis=-3)
    s = (q @ np.swapaxes(k, -1, -2)) * np.asarray(scale, dtype=dtype)
    if causal:
        n_q, n_kv = s.shape[-2:]
        mask = np.arange(n_kv)[None, :] <= np.arange(n_q)[:, None] + (n_kv - n_q)
        s = np.where(mask, s, np.asarray(-np.inf, dtype=dtype))
    m = np.max(s, axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, np.asarray(0, dtype=dtype))
    p = np.exp(s - m)
    den = p.sum(axis=-1, keepdims=True)
    return np.where(den > 0, (p @ v) / np.where(den > 0, den, 1), 0).astype(dtype)


def assert_close(got, ref, dtype: str, what: str, *, naive=None):
    """Relative error within the dtype's tolerance, and for half within 2x the naive error."""
    err = rel_err(got, ref)
    tol = TOL[dtype]
    assert np.all(np.isfinite(np.asarray(got, dtype=np.float64))) or not np.all(np.isfinite(ref)), (
        f"{what}: non-finite output\n{describe_mismatch(got, ref)}")
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:g} ({dtype})\n{describe_mismatch(got, ref)}"
    if naive is not None:
        naive_err = rel_err(naive, ref)
        assert err <= 2 * naive_err, (
            f"{what}: error {err:.3e} is more than twice plain {dtype} attention's {naive_err:.3e}")
    return err


def check_out_and_lse(out, lse, ref, ref_lse, dtype: str, what: str, lse_rtol: float) -> None:
    """out within the dtype's TOLERANCE of ref, all finite; lse -inf exactly where ref_lse is, and
    elsewhere within lse_rtol of the largest |ref_lse| (at least 1)."""
    o, got = np.asarray(out, dtype=np.float64), np.asarray(lse, dtype=np.float64)
    bad = ~np.isfinite(o)
    assert not bad.any(), f"{what}: {bad.sum()} non-finite outputs, first at {np.argwhere(bad)[:4].tolist()}"
    err = rel_err(o, ref)
    worst = np.unravel_index(np.argmax(np.abs(o - ref)), o.shape)
    assert err <= TOL[dtype], f"{what}: rel err {err:.2e} > {TOL[dtype]:.0e}; worst {worst}: {o[worst]} vs {ref[worst]}"
    seen = np.isfinite(ref_lse)
    assert (np.isneginf(got) == ~seen).all(), f"{what}: lse -inf at {np.argwhere(np.isneginf(got) != ~seen)[:4]}"
    lerr = np.abs(got[seen] - ref_lse[seen]).max(initial=0.0)
    diff = np.zeros_like(got)
    diff[seen] = got[seen] - ref_lse[seen]
    at = np.unravel_index(np.argmax(np.abs(diff)), got.shape)
    assert lerr <= lse_rtol * max(1.0, np.abs(ref_lse[seen]).max(initial=1.0)), f"{what}: lse err {lerr:.2e} at {at}"
