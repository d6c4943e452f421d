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
    from flashcl.opencl.decode import ROWS_GROUP_TILE, rows_tiles

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
