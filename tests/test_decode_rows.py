"""flashcl.decode of several query rows per sequence (q (B, H_q, N_q, DK): speculative decoding's
verification against a paged cache): each row is the decode of its own token alone, at its own
position (the sequence's length less the rows after it), on each backend present; the limits are
errors before launch. The fuzzer (test_fuzz_decode.py) crosses the rows with everything else."""

from __future__ import annotations

import numpy as np
import pytest

import flashcl
from flashcl import reference
from flashcl.variants import DECODE_GROUP_ROWS, DECODE_ROWS

from ._check import check_out_and_lse


def _case(n_q: int, group: int = 4, h_kv: int = 2, d: int = 64, bs: int = 16, seed: int = 0):
    """q rows, a paged cache of permuted blocks (NaN in the blocks no table names), its table and
    lengths: one sequence shorter than the rows (its first rows see no key), one at a block's edge."""
    rng = np.random.default_rng(seed)
    lens = np.array([70, n_q - 1, 2 * bs], np.int32)
    per_seq = -(-int(lens.max()) // bs)
    num_blocks = 3 * per_seq + 2
    table = rng.permutation(num_blocks)[: 3 * per_seq].reshape(3, per_seq).astype(np.int32)
    k, v = (rng.standard_normal((num_blocks, bs, h_kv, d)).astype(np.float32) for _ in range(2))
    unused = np.setdiff1d(np.arange(num_blocks), table)
    k[unused], v[unused] = np.nan, np.nan
    q = rng.standard_normal((3, h_kv * group, n_q, d)).astype(np.float32)
    variants = {"window": (20, 0), "softcap": 8.0, "sinks": rng.standard_normal(h_kv * group).astype(np.float32),
                "alibi_slopes": rng.uniform(0, 0.2, (3, h_kv * group)).astype(np.float32)}
    return q, k, v, table, lens, variants


def _each_row_alone(run, q, k, v, table, lens, variants):
    """Row i of every sequence as a one-token decode at length lens - (N_q - 1 - i) (0 at least)."""
    n_q = q.shape[2]
    outs, lses = zip(*(run(np.ascontiguousarray(q[:, :, i]), k, v, table,
                           np.maximum(lens - (n_q - 1 - i), 0).astype(np.int32), variants)
                       for i in range(n_q)))
    return np.stack(outs, axis=2), np.stack(lses, axis=2)


@pytest.mark.parametrize("n_q", [1, 3, 8, DECODE_ROWS])  # 16 rows of a group of 4: DECODE_GROUP_ROWS
@pytest.mark.parametrize("splits", [None, 1, 3])
def test_rows_are_their_tokens_decoded_alone_opencl(cl_device, n_q, splits):
    q, k, v, table, lens, variants = _case(n_q)

    def run(q, k, v, table, lens, variants):
        return flashcl.decode(q, k, v, block_table=table, context_lens=lens, num_splits=splits, return_lse=True,
                              device=cl_device, **variants)

    out, lse = run(q, k, v, table, lens, variants)
    assert out.shape == (3, 8, n_q, 64) and lse.shape == (3, 8, n_q)
    ref, ref_lse = reference.decode_attention(q, np.nan_to_num(k), np.nan_to_num(v), block_table=table,
                                              context_lens=lens, return_lse=True, **variants)
    check_out_and_lse(out, lse, ref, ref_lse, "float32", f"rows {n_q}", lse_rtol=1e-5)
    alone, alone_lse = _each_row_alone(run, q, k, v, table, lens, variants)
    check_out_and_lse(out, lse, alone, alone_lse, "float32", f"rows {n_q} against one at a time", lse_rtol=1e-5)


@pytest.mark.parametrize("group,n_q,h_kv", [(7, 7, 2), (52, 1, 1)])
@pytest.mark.parametrize("splits", [None, 3])
def test_groups_past_one_work_item_opencl(cl_device, group, n_q, h_kv, splits):
    """decode_cpu.cl (forced on any device) serves a group of more query heads (GQA heads x rows)
    than one work-item keeps, ROWS_GROUP_TILE, in even tiles, the last padded: 49 rows as 25 + 24
    for each of 2 KV heads, an MQA group of 52 heads as 26 + 26; every variant, as the oracle."""
    from flashcl.tuning import ROWS_GROUP_TILE, rows_tiles

    assert group * n_q > ROWS_GROUP_TILE and rows_tiles(group * n_q) == 2
    q, k, v, table, lens, variants = _case(n_q, group=group, h_kv=h_kv)
    rows_layout = {"VARIANT": "rows", "BLOCK_N": 16, "VEC": 8, "MERGE_WG": 64}
    out, lse = flashcl.decode(q if n_q > 1 else q[:, :, 0], k, v, block_table=table, context_lens=lens,
                              num_splits=splits, return_lse=True, device=cl_device, params=rows_layout, **variants)
    ref, ref_lse = reference.decode_attention(q if n_q > 1 else q[:, :, 0], np.nan_to_num(k), np.nan_to_num(v),
                                              block_table=table, context_lens=lens, return_lse=True, **variants)
    check_out_and_lse(out, lse, ref, ref_lse, "float32", f"group {group} x {n_q} rows", lse_rtol=1e-5)


@pytest.mark.parametrize("n_q", [1, 4])
def test_rows_are_their_tokens_decoded_alone_triton(triton_device, n_q):
    torch = pytest.importorskip("torch")
    q, k, v, table, lens, variants = _case(n_q, d=32)
    t = {"q": q, "k": k, "v": v, "table": table, "lens": lens}
    t = {name: torch.from_numpy(x).to(triton_device) for name, x in t.items()}
    tv = {name: x if isinstance(x, (tuple, float)) else torch.from_numpy(x).to(triton_device)
          for name, x in variants.items()}

    def run(q, k, v, table, lens, _variants):  # the variants: tv, on the device
        q, lens = (torch.from_numpy(x).to(triton_device) if isinstance(x, np.ndarray) else x for x in (q, lens))
        out, lse = flashcl.decode(q, k, v, block_table=table, context_lens=lens, return_lse=True, backend="triton",
                                  **tv)
        return out.cpu().numpy(), lse.cpu().numpy()

    out, lse = run(t["q"], t["k"], t["v"], t["table"], t["lens"], None)
    assert out.shape == (3, 8, n_q, 32) and lse.shape == (3, 8, n_q)
    ref, ref_lse = reference.decode_attention(q, np.nan_to_num(k), np.nan_to_num(v), block_table=table,
                                              context_lens=lens, return_lse=True, **variants)
    check_out_and_lse(out, lse, ref, ref_lse, "float32", f"rows {n_q}", lse_rtol=1e-5)
    alone, alone_lse = _each_row_alone(run, q, t["k"], t["v"], t["table"], lens, None)
    check_out_and_lse(out, lse, alone, alone_lse, "float32", f"rows {n_q} against one at a time", lse_rtol=1e-5)


def _rows_with_inf_at_the_last_key(n_q: int):
    """_case's rows (no variants) with V = inf at each sequence's last key, which only its last row
    sees, and the oracle of the finite cache: the other rows must match it, the last row's out is
    not finite, and its lse is the oracle's (lse is the scores', V plays no part)."""
    q, k, v, table, lens, _ = _case(n_q, bs=16)
    k, v = np.nan_to_num(k), np.nan_to_num(v)
    ref, ref_lse = reference.decode_attention(q, k, v, block_table=table, context_lens=lens, return_lse=True)
    for b, n in enumerate(lens):
        if n > 0:
            v[table[b, (n - 1) // 16], (n - 1) % 16] = np.inf
    return q, k, v, table, lens, ref, ref_lse


def _check_inf_at_the_last_key(out, lse, ref, ref_lse, lens, what):
    check_out_and_lse(out[:, :, :-1], lse[:, :, :-1], ref[:, :, :-1], ref_lse[:, :, :-1], "float32", what, 1e-5)
    seen = lens > 0
    assert not np.isfinite(out[seen, :, -1]).any(), what
    assert np.allclose(lse[:, :, -1], ref_lse[:, :, -1], rtol=1e-5), f"{what}: the last row's lse"


@pytest.mark.parametrize("splits", [1, 3])
def test_inf_in_v_seen_by_one_row_keeps_every_lse_opencl(cl_device, splits):
    q, k, v, table, lens, ref, ref_lse = _rows_with_inf_at_the_last_key(4)
    out, lse = flashcl.decode(q, k, v, block_table=table, context_lens=lens, num_splits=splits, return_lse=True,
                              device=cl_device)
    _check_inf_at_the_last_key(out, lse, ref, ref_lse, lens, f"{cl_device} splits {splits}")


@pytest.mark.parametrize("splits", [1, 3])
def test_inf_in_v_seen_by_one_row_keeps_every_lse_triton(triton_device, splits):
    torch = pytest.importorskip("torch")
    q, k, v, table, lens, ref, ref_lse = _rows_with_inf_at_the_last_key(4)
    t = [torch.from_numpy(x).to(triton_device) for x in (q, k, v, table, lens)]
    out, lse = flashcl.decode(t[0], t[1], t[2], block_table=t[3], context_lens=t[4], num_splits=splits,
                              return_lse=True, backend="triton")
    _check_inf_at_the_last_key(out.cpu().numpy(), lse.cpu().numpy(), ref, ref_lse, lens, f"triton splits {splits}")


def test_rows_on_pyopencl_arrays_stay_on_the_device(cl_device):
    import pyopencl.array as cla

    from flashcl.opencl.runtime import get_device

    q, k, v, table, lens, _ = _case(4)
    queue = get_device(cl_device).queue
    qd, kd, vd, td, ld = (cla.to_device(queue, x) for x in (q, np.nan_to_num(k), np.nan_to_num(v), table, lens))
    out, lse = flashcl.decode(qd, kd, vd, block_table=td, context_lens=ld, return_lse=True)
    assert isinstance(out, cla.Array) and out.shape == (3, 8, 4, 64) and lse.shape == (3, 8, 4)
    ref = reference.decode_attention(q, np.nan_to_num(k), np.nan_to_num(v), block_table=table, context_lens=lens)
    assert reference.rel_err(out.get(), ref) < 1e-5


def test_rows_beyond_the_limits_are_errors(cl_device):
    q, k, v, table, lens, _ = _case(4)
    with pytest.raises(ValueError, match=f"1 to {DECODE_ROWS} query rows"):
        flashcl.decode(np.zeros((3, 8, DECODE_ROWS + 1, 64), np.float32), k, v, block_table=table, context_lens=lens,
                       device=cl_device)
    rows = DECODE_GROUP_ROWS // 8 + 1  # a group of 8 query heads (2 KV heads)
    with pytest.raises(ValueError, match=f"rows per KV head; a decode takes at most {DECODE_GROUP_ROWS}"):
        flashcl.decode(np.zeros((3, 16, rows, 64), np.float32), k, v, block_table=table, context_lens=lens,
                       device=cl_device)
    with pytest.raises(ValueError, match=r"expected \(B, H_q, DK\) or \(B, H_q, N_q, DK\)"):
        flashcl.decode(q[..., None], k, v, block_table=table, context_lens=lens, device=cl_device)


# --------------------------------------------------------------------------- the Gluon GQA kernel

def _gluon_rows_case(torch, fmt: str, n_q: int, group: int, kind: str, poison: str, bs: int, seed: int):
    """Rows over a paged (B, 2 KV heads, d = 128) cache of ``fmt`` ("" float16): the launch's
    operands (q's rows as heads, sinks and slopes per row), the oracle, and which sequences' last
    row sees a key. ``poison``: "V" puts inf in V at each sequence's last key (int8: its row
    scale), which only the last row sees."""
    rng = np.random.default_rng(seed)
    h_kv, d = 2, 128
    h_q = h_kv * group
    lens = np.array([n_q - 1, 1, 130, 700], np.int32)  # rows before the first key; a tile's edge
    per_seq = -(-int(lens.max()) // bs)
    table = rng.permutation(4 * per_seq + 1)[: 4 * per_seq].reshape(4, per_seq).astype(np.int32)
    k, v = (torch.from_numpy(rng.standard_normal((4 * per_seq + 1, bs, h_kv, d))).half() for _ in range(2))
    k_cache = flashcl.quantize(k.cuda(), fmt) if fmt else k.cuda()
    v_cache = flashcl.quantize(v.cuda(), fmt) if fmt else v.cuda()
    q = rng.standard_normal((4, h_q, n_q, d)).astype(np.float16)
    var = {"window": (40, 0), "softcap": 8.0, "sinks": rng.standard_normal(h_q).astype(np.float32),
           "alibi_slopes": rng.uniform(0, 0.2, (4, h_q)).astype(np.float32)} if kind == "variants" else {}
    if kind == "key_start":
        var["key_start"] = np.array([0, 1, 67, 650], np.int32)
    ref, ref_lse = reference.decode_attention(q, k_cache if fmt else k.numpy(), v_cache if fmt else v.numpy(),
                                              block_table=table, context_lens=lens, return_lse=True, **var)
    if poison == "V":
        last = [(table[i, (n - 1) // bs], (n - 1) % bs) for i, n in enumerate(lens) if n > 0]
        for page, pos in last:
            if fmt == "int8":
                v_cache.scales[page, pos] = float("inf")
            else:
                v_cache[page, pos] = float("inf")
    run = {"q": torch.from_numpy(q).cuda().reshape(4, h_q * n_q, d), "k": k_cache, "v": v_cache,
           "table": torch.from_numpy(table).cuda(), "lens": torch.from_numpy(lens).cuda(),
           "window_left": var["window"][0] if "window" in var else -1, "softcap": var.get("softcap", 0.0),
           "sinks": None if "sinks" not in var else torch.from_numpy(var["sinks"]).repeat_interleave(n_q).cuda(),
           "alibi_slopes": None if "alibi_slopes" not in var
           else torch.from_numpy(var["alibi_slopes"]).repeat_interleave(n_q, dim=1).cuda(),
           "key_start": None if "key_start" not in var else torch.from_numpy(var["key_start"]).cuda()}
    seen_last = lens > np.maximum(var.get("key_start", 0), 0)  # the sequences whose last row sees a key
    return run, ref, ref_lse, seen_last


def _gluon_rows_launch(torch, run, fmt, n_q, splits, gluon):
    from flashcl.triton import decode as triton_decode

    k, v = run["k"], run["v"]
    out, lse = triton_decode._launch(
        run["q"], k.data if fmt else k, v.data if fmt else v, run["table"], run["lens"], 128 ** -0.5, splits,
        config={"gluon_gqa": gluon}, k_scales=k.scales if fmt else None, v_scales=v.scales if fmt else None,
        k_format=fmt, v_format=fmt, window_left=run["window_left"], softcap=run["softcap"], sinks=run["sinks"],
        alibi_slopes=run["alibi_slopes"], key_start=run["key_start"], query_rows=n_q)
    b, heads, dv = out.shape
    return (out.float().cpu().numpy().reshape(b, heads // n_q, n_q, dv),
            lse.cpu().numpy().reshape(b, heads // n_q, n_q))


@pytest.mark.parametrize("fmt", ["", "q8_0", "q4_0", "int8", "fp8_e4m3"])
@pytest.mark.parametrize("n_q,group,bs", [(2, 4, 16), (4, 4, 1), (3, 1, 64), (2, 8, 16)])  # 8 / 16 / 3 / 16 columns
@pytest.mark.parametrize("kind", ["plain", "variants", "key_start"])
def test_rows_on_the_gluon_gqa_kernel(fmt, n_q, group, bs, kind):
    """The Gluon GQA kernel (forced) with query rows as columns (8, 16 and 3 a KV head, MHA's rows
    too): each row's causal cut, window and ALiBi distance, rows before the first key, 1, 3 and 16
    splits, against the oracle and the dot path; inf in V at the last key (int8: its row scale)
    reaches the last row only."""
    torch = pytest.importorskip("torch")
    from flashcl.triton import decode_gluon

    if not (torch.cuda.is_available() and decode_gluon.available()):
        pytest.skip("needs CUDA and Gluon")
    if fmt == "fp8_e4m3" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 on the Gluon GQA kernel: sm_89+")
    for poison in ("", "V") if fmt in ("", "int8") else ("",):
        run, ref, ref_lse, seen_last = _gluon_rows_case(torch, fmt, n_q, group, kind, poison, bs, seed=n_q * group)
        for splits in (1, 3, 16):
            what = f"{fmt or 'fp16'} rows {n_q} group {group} {kind} poison {poison or 'none'} splits {splits}"
            out, lse = _gluon_rows_launch(torch, run, fmt, n_q, splits, True)
            if poison:  # the last row of a sequence that has keys sees the inf; the others do not
                assert not np.isfinite(out[seen_last, :, -1]).any(), what
                out, lse, want, want_lse = out[:, :, :-1], lse[:, :, :-1], ref[:, :, :-1], ref_lse[:, :, :-1]
            else:
                want, want_lse = ref, ref_lse
            check_out_and_lse(out, lse, want, want_lse, "float16", what, lse_rtol=1e-3)
            if not poison:
                dot, _ = _gluon_rows_launch(torch, run, fmt, n_q, splits, False)
                assert np.allclose(out, dot, rtol=2e-2, atol=2e-3), what


@pytest.mark.parametrize("kernel", ["dot", "gluon"])
def test_rows_window_edges_hide_what_each_row_does_not_see(kernel):
    """Four rows a head under a window of 200 over contexts shorter than the rows, inside the
    window, and long (700: a split runs the window's first tiles, the tiles every row sees, and
    the last rows' tiles), 1, 3 and 16 splits, the Gluon GQA kernel forced or the dot path: inf in
    V at row 0's first window key and at the last key reaches row 0 and row 3 only; the rows
    between match the oracle, and every lse does (V plays no part in it)."""
    torch = pytest.importorskip("torch")
    from flashcl.triton import decode as triton_decode
    from flashcl.triton import decode_gluon

    gpu = torch.cuda.is_available()
    if kernel == "gluon" and not (gpu and decode_gluon.available()):
        pytest.skip("the Gluon GQA kernel needs CUDA and Gluon")
    device, n_q, left, bs = ("cuda" if gpu else "cpu"), 4, 200, 16
    rng = np.random.default_rng(5)
    lens = np.array([3, 150, 700], np.int32)
    per_seq = -(-int(lens.max()) // bs)
    table = rng.permutation(3 * per_seq + 1)[: 3 * per_seq].reshape(3, per_seq).astype(np.int32)
    k, v = (rng.standard_normal((3 * per_seq + 1, bs, 2, 128)).astype(np.float16) for _ in range(2))
    q = rng.standard_normal((3, 8, n_q, 128)).astype(np.float16)
    ref, ref_lse = reference.decode_attention(q, k, v, block_table=table, context_lens=lens, window=(left, 0),
                                              return_lse=True)
    bad = np.zeros((3, n_q), bool)  # the rows that see an inf
    for b, n in enumerate(lens):
        for key, row in ((n - n_q - left, 0), (n - 1, n_q - 1)):  # seen by that row alone
            if key >= 0 and n - n_q + row >= 0:
                v[table[b, key // bs], key % bs] = np.inf
                bad[b, row] = True
    assert bad[2, 0] and bad[:, -1].all() and not bad[:, 1:-1].any()
    t = {n: torch.from_numpy(x).to(device) for n, x in (("k", k), ("v", v), ("table", table), ("lens", lens))}
    qd = torch.from_numpy(q).to(device).reshape(3, 8 * n_q, 128)
    for splits in (1, 3, 16):
        out, lse = triton_decode._launch(qd, t["k"], t["v"], t["table"], t["lens"], 128 ** -0.5, splits,
                                         config={"gluon_gqa": kernel == "gluon"}, window_left=left, query_rows=n_q)
        out = out.float().cpu().numpy().reshape(3, 8, n_q, 128)
        lse = lse.cpu().numpy().reshape(3, 8, n_q)
        what = f"{kernel} splits {splits}"
        assert not np.isfinite(out.transpose(0, 2, 1, 3)[bad]).any(), what
        good = ~bad[:, None, :].repeat(8, axis=1)
        check_out_and_lse(out[good], lse[good], ref[good], ref_lse[good], "float16", what, 1e-3)
        check_out_and_lse(np.zeros(1), lse, np.zeros(1), ref_lse, "float16", what + " lse", 1e-3)
