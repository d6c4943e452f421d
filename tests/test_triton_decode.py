"""Triton paged-KV decode against the float64 oracle (flashcl.reference.decode_attention).

Every test takes ``triton_device``: native on CUDA, TRITON_INTERPRET=1 on CPU. The CPU run keeps to
few, small cases (the interpreter runs each program in NumPy); the full matrix (dtypes x MHA/GQA/MQA
x block sizes x B in {1, 3, 33} x context {1, 15, 16, 17, 1000} x split counts) runs on CUDA only.

Tolerances, relative error ||out - ref|| / ||ref|| against float64 on the same (rounded) inputs:
fp32 1e-5; fp16 2e-3; bf16 1e-2 -- bf16 keeps 8 mantissa bits, so rounding the output alone costs
~2^-9/sqrt(3) ~ 1.1e-3 rms and rounding p to bf16 for the tensor-core p.v product as much again
(the same as every flash-attention kernel; plain bf16 attention is worse). Low precision must also
be no worse than twice the error of plain attention computed by torch in the same dtype.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import flashcl  # noqa: E402
from flashcl import reference  # noqa: E402

TOL = reference.TOLERANCE
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="large matrix: CUDA only")


# --------------------------------------------------------------------------- helpers


@pytest.fixture
def poison(monkeypatch):
    """Every buffer the launch allocates starts as NaN, so an unwritten element fails."""
    from flashcl.triton import decode as triton_decode

    def nan_empty(shape, dtype, device):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(triton_decode, "_empty", nan_empty)


def _gen(seed):
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def _randn(shape, dtype, device, gen, scale=1.0):
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(getattr(torch, dtype)).to(device)


def _np(x):
    return x.detach().to("cpu", torch.float64).numpy()


def _page_table(b, n_max, block_size, gen, spare_blocks=3):
    """A random block permutation: (block_table (B, per_seq) int32, num_blocks); the spare blocks
    are never referenced and hold random data."""
    per_seq = max(1, -(-n_max // block_size))
    num_blocks = b * per_seq + spare_blocks
    perm = torch.randperm(num_blocks, generator=gen)[: b * per_seq]
    return perm.view(b, per_seq).to(torch.int32), num_blocks


def _to_pages(x, block_table, num_blocks, block_size, gen):
    """Contiguous (B, H_kv, N_max, D) -> vLLM pages (num_blocks, block_size, H_kv, D)."""
    b, h_kv, n_max, d = x.shape
    per_seq = block_table.shape[1]
    pages = torch.randn((num_blocks, block_size, h_kv, d), generator=gen).to(x.dtype)
    padded = torch.nn.functional.pad(x.cpu(), (0, 0, 0, per_seq * block_size - n_max))
    pages[block_table.flatten().long()] = (
        padded.view(b, h_kv, per_seq, block_size, d).permute(0, 2, 3, 1, 4).reshape(-1, block_size, h_kv, d))
    return pages.to(x.device)


def _naive(q, k, v, lens, scale):
    """Plain attention in the input dtype (torch), per sequence: the error floor to compare with."""
    outs = []
    for i in range(q.shape[0]):
        n = int(lens[i])
        g = q.shape[1] // k.shape[1]
        kk = k[i, :, :n].repeat_interleave(g, 0)
        vv = v[i, :, :n].repeat_interleave(g, 0)
        s = (q[i, :, None, :] @ kk.transpose(1, 2)) * scale
        p = torch.softmax(s, dim=-1)
        outs.append((p @ vv)[:, 0] if n else q.new_zeros((q.shape[1], v.shape[3])))
    return torch.stack(outs)


def _rel(out, ref):
    return reference.rel_err(_np(out), ref)


def _check(out, ref, dtype, what="", naive=None, lse=None, lse_ref=None):
    """Relative error against float64 within the dtype's tolerance (and 2x the naive error)."""
    o = _np(out)
    assert np.isfinite(o).all(), f"{what}: {np.count_nonzero(~np.isfinite(o))} non-finite outputs at {np.argwhere(~np.isfinite(o))[:5].tolist()}"
    err = _rel(out, ref)
    worst = np.unravel_index(np.argmax(np.abs(o - ref)), o.shape)
    detail = f"{what}: rel err {err:.2e} (tol {TOL[dtype]:.0e}); worst element {worst}: {o[worst]} vs {ref[worst]}"
    assert err <= TOL[dtype], detail
    if naive is not None and dtype != "float32":
        naive_err = _rel(naive, ref)
        assert err <= 2 * naive_err + 1e-7, f"{detail}; plain {dtype} attention has {naive_err:.2e}"
    if lse is not None:
        got = _np(lse)
        seen = np.isfinite(lse_ref)
        assert (np.isneginf(got) == ~seen).all(), f"{what}: lse -inf pattern differs"
        lerr = np.abs(got[seen] - lse_ref[seen]).max() if seen.any() else 0.0
        assert lerr <= 1e-4 * max(1.0, np.abs(lse_ref[seen]).max() if seen.any() else 1.0), f"{what}: lse err {lerr:.2e}"


def _case(device, dtype, *, b, h_q, h_kv, lens, dk=64, dv=None, block_size=16, seed=0, q_scale=1.0):
    """Random q and contiguous cache (B, H_kv, N_max, D), its paged copy, the float64 reference."""
    dv = dv or dk
    gen = _gen(seed)
    n_max = max(max(lens), 1)
    q = _randn((b, h_q, dk), dtype, device, gen, q_scale)
    k = _randn((b, h_kv, n_max, dk), dtype, device, gen)
    v = _randn((b, h_kv, n_max, dv), dtype, device, gen)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=device)
    bt, num_blocks = _page_table(b, n_max, block_size, gen)
    k_pages = _to_pages(k, bt, num_blocks, block_size, gen)
    v_pages = _to_pages(v, bt, num_blocks, block_size, gen)
    bt = bt.to(device)
    scale = 1.0 / math.sqrt(dk)
    ref_out, ref_lse = reference.decode_attention(_np(q), _np(k), _np(v), context_lens=np.array(lens),
                                                  scale=scale, return_lse=True)
    return {"q": q, "k": k, "v": v, "k_pages": k_pages, "v_pages": v_pages, "block_table": bt,
            "lens": lens_t, "scale": scale, "ref": ref_out, "ref_lse": ref_lse,
            "naive": _naive(q, k, v, lens, scale)}


def _run_paged(c, num_splits):
    return flashcl.decode(c["q"], c["k_pages"], c["v_pages"], block_table=c["block_table"],
                          context_lens=c["lens"], num_splits=num_splits, backend="triton",
                          return_lse=True)


# --------------------------------------------------------------------------- small cases (CPU too)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_paged_gqa(triton_device, dtype, poison):
    """GQA 4, B=3, contexts 1 / 17 (one block + 1) / 40 (partial last block), permuted pages."""
    c = _case(triton_device, dtype, b=3, h_q=8, h_kv=2, lens=[1, 17, 40], block_size=16)
    for ns in (None, 1, 3):
        out, lse = _run_paged(c, ns)
        assert out.dtype == c["q"].dtype and lse.dtype == torch.float32
        _check(out, c["ref"], dtype, f"splits={ns}", c["naive"], lse, c["ref_lse"])


@pytest.mark.parametrize("block_size,dk,dv,h_q,h_kv",
                         [(256, 128, 96, 8, 2), (128, 128, 128, 4, 4), (256, 64, 48, 8, 2), (256, 32, 32, 8, 1)])
def test_blocks_larger_than_the_tile(triton_device, block_size, dk, dv, h_q, h_kv, poison):
    """Blocks of 128 and 256 tokens, larger than the tile (64 rows at d = 128; at d = 64 and 32 the
    small-head tile, 128 rows under the interpreter, up to 256 on a GPU): tiles inside one block,
    one block-table entry per tile. GQA 4, MHA, MQA 8; contexts 0, one partial block, several
    blocks, a block + 1; permuted blocks; 1 to 5 splits."""
    from flashcl.triton.decode_plan import DecodeProblem, facts_of, plan

    block_n = plan(DecodeProblem(4, h_q, h_kv, dk, dv, 3 * block_size, 2, block_size), facts_of(triton_device)).block_n
    assert block_size % block_n == 0 and (block_n < block_size or dk < 128)
    c = _case(triton_device, "float16", b=4, h_q=h_q, h_kv=h_kv, lens=[0, 100, 2 * block_size + 37, block_size + 1],
              dk=dk, dv=dv, block_size=block_size, seed=block_size + dk)
    for ns in (None, 1, 2, 5):
        out, lse = _run_paged(c, ns)
        _check(out, c["ref"], "float16", f"splits={ns}", c["naive"], lse, c["ref_lse"])


def test_batch_33_long_context(triton_device, poison):
    """B=33 with contexts 1 / 15 / 16 / 17 / 1000 mixed (one tile, tile +-1, many tiles)."""
    lens = [[1000, 15, 16, 17, 1][i % 5] for i in range(33)]
    c = _case(triton_device, "float16", b=33, h_q=2, h_kv=1, lens=lens, dk=16, block_size=32, seed=9)
    for ns in (None, 2):
        out, lse = _run_paged(c, ns)
        _check(out, c["ref"], "float16", f"splits={ns}", c["naive"], lse, c["ref_lse"])


def test_mqa_block_size_1_more_splits_than_blocks(triton_device, poison):
    """MQA (8 query heads on 1 KV head), block_size 1, 7 splits over 3 and 5 one-token blocks."""
    c = _case(triton_device, "float32", b=2, h_q=8, h_kv=1, lens=[3, 5], dk=32, block_size=1, seed=1)
    for ns in (1, 7, 64):
        out, lse = _run_paged(c, ns)
        _check(out, c["ref"], "float32", f"splits={ns}", lse=lse, lse_ref=c["ref_lse"])


def test_reduce_kernel_partial_head_group_and_chunks(triton_device, poison):
    """The reduce kernel merges 4 query heads per program, fewer where one step then merges every
    split (_reduce_shape): 6 query heads, so programs of 4 have 2 masked heads; at d = 32, 5 splits
    (4 heads, one chunk of 8, 3 padded), 20 (4 heads, one chunk of 32) and 70 (2 heads, one chunk
    of 128); at d = 128, 10 (4 heads, one chunk of 16), 20 (2 heads, one chunk of 32) and 70 (1
    head, two chunks of 64, the second padded); contexts long and short (splits past the end are
    empty)."""
    from flashcl.triton.decode_plan import _reduce_shape

    assert [_reduce_shape(ns, 32) for ns in (5, 20, 70)] == [(4, 8), (4, 32), (2, 128)]
    assert [_reduce_shape(ns, 128) for ns in (10, 20, 70)] == [(4, 16), (2, 32), (1, 64)]
    for dk, split_counts in ((32, (5, 20, 70)), (128, (10, 20, 70))):
        c = _case(triton_device, "float32", b=2, h_q=6, h_kv=3, lens=[400, 9], dk=dk, block_size=8, seed=13)
        for ns in split_counts:
            out, lse = _run_paged(c, ns)
            _check(out, c["ref"], "float32", f"d={dk} splits={ns}", lse=lse, lse_ref=c["ref_lse"])


def test_contiguous_cache_non_pow2_dims(triton_device, poison):
    """MHA on a contiguous cache, DK=40 != DV=24 (padded to 64/32 with masks), with and without
    context_lens, single pass and 2 splits."""
    c = _case(triton_device, "float16", b=2, h_q=2, h_kv=2, lens=[33, 20], dk=40, dv=24, seed=2)
    for lens in (c["lens"], None):
        ref_out, ref_lse = (c["ref"], c["ref_lse"]) if lens is not None else reference.decode_attention(
            _np(c["q"]), _np(c["k"]), _np(c["v"]), scale=c["scale"], return_lse=True)
        naive = c["naive"] if lens is not None else _naive(c["q"], c["k"], c["v"], [33, 33], c["scale"])
        for ns in (1, 2):
            out, lse = flashcl.decode(c["q"], c["k"], c["v"], context_lens=lens, num_splits=ns,
                                      backend="triton", return_lse=True)
            _check(out, ref_out, "float16", f"lens={lens is not None} splits={ns}", naive, lse, ref_lse)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_large_logits(triton_device, dtype, poison):
    """q scaled up so the logits reach about +-200: the online softmax must not overflow."""
    c = _case(triton_device, dtype, b=2, h_q=4, h_kv=2, lens=[70, 9], dk=32, seed=3, q_scale=75.0)
    s = np.einsum("bhd,bhnd->bhn", _np(c["q"])[:, ::2], _np(c["k"])) * c["scale"]
    assert np.abs(s).max() > 150
    for ns in (1, 3):
        out, lse = _run_paged(c, ns)
        _check(out, c["ref"], dtype, f"splits={ns}", c["naive"], lse, c["ref_lse"])


def test_context_len_zero(triton_device, poison):
    """A sequence with no key gives out 0 and lse -inf, never NaN, single pass and split."""
    c = _case(triton_device, "float16", b=3, h_q=4, h_kv=1, lens=[0, 5, 0], dk=16, block_size=4, seed=4)
    for ns in (1, 3):
        out, lse = _run_paged(c, ns)
        o, l = _np(out), _np(lse)
        assert not np.isnan(o).any() and not np.isnan(l).any()
        assert (o[[0, 2]] == 0).all() and np.isneginf(l[[0, 2]]).all()
        assert np.abs(o[1] - c["ref"][1]).max() < 2e-3 and np.abs(l[1] - c["ref_lse"][1]).max() < 1e-3


@pytest.mark.parametrize("block_size,h_q,h_kv", [(16, 4, 2), (64, 4, 2), (16, 2, 2), (256, 4, 2), (256, 2, 2)])
def test_rows_past_the_end_are_never_read(triton_device, block_size, h_q, h_kv, poison):
    """Block-table entries past each sequence's end point far outside the cache, and every cache row
    that holds no token of a sequence is NaN: the kernel may read neither (rows past the end of a
    tile point at a real row instead of being masked when tiles hold whole pages, or lie inside one
    page: 256-token blocks, two 128-row tiles each at d = 32). GQA, and MHA (which takes the
    CUDA-core loop here for whole pages: more programs than the 4 "SMs" of the CPU plan)."""
    lens = [1, 17, 80]
    c = _case(triton_device, "float16", b=3, h_q=h_q, h_kv=h_kv, lens=lens, dk=32, block_size=block_size, seed=21)
    bt = c["block_table"].cpu()
    wide = torch.full((3, bt.shape[1] + 2), 2**30, dtype=torch.int32)  # a bound past the longest
    k_pages, v_pages = torch.full_like(c["k_pages"], float("nan")), torch.full_like(c["v_pages"], float("nan"))
    for i, n in enumerate(lens):
        used = -(-n // block_size)
        wide[i, :used] = bt[i, :used]
        for t in range(n):
            blk, row = int(bt[i, t // block_size]), t % block_size
            k_pages[blk, row] = c["k_pages"][blk, row]
            v_pages[blk, row] = c["v_pages"][blk, row]
    for ns in (1, 2, 3):
        out, lse = flashcl.decode(c["q"], k_pages, v_pages, block_table=wide.to(triton_device),
                                  context_lens=c["lens"], num_splits=ns, backend="triton", return_lse=True)
        _check(out, c["ref"], "float16", f"splits={ns}", c["naive"], lse, c["ref_lse"])


@pytest.mark.parametrize("h_q,h_kv", [(4, 2), (2, 2)])
def test_64_bit_row_offsets(triton_device, h_q, h_kv, poison):
    """The 64-bit row offsets that caches of 2^31 elements or more take (forced on a small cache by
    the plan of a problem whose caches are that large); GQA and MHA, on the default path and, for
    MHA, on the CUDA-core loop."""
    from dataclasses import replace

    from flashcl.triton import decode as triton_decode
    from flashcl.triton.decode_plan import facts_of, plan

    c = _case(triton_device, "float16", b=3, h_q=h_q, h_kv=h_kv, lens=[1, 17, 80], dk=32, seed=22)
    problem = replace(triton_decode.problem_of(c["q"], c["k_pages"], c["v_pages"], c["block_table"]),
                      max_offset=2**31)
    for config in [None] + ([{"mha_fma": True}] if h_q == h_kv else []):
        for ns in (1, 3):
            p = plan(problem, facts_of(triton_device), config, ns)
            assert not p.offs32 and p.whole_pages and p.mha_loop == (config is not None)
            out, lse = triton_decode._launch(c["q"], c["k_pages"], c["v_pages"], c["block_table"], c["lens"],
                                             c["scale"], ns, plan=p)
            _check(out, c["ref"], "float16", f"{config} splits={ns}", c["naive"], lse, c["ref_lse"])


def test_non_contiguous_inputs(triton_device, poison):
    """q a strided slice, K/V halves of one packed (num_blocks, block_size, 2, H_kv, D) cache."""
    c = _case(triton_device, "float32", b=2, h_q=4, h_kv=2, lens=[20, 7], dk=32, block_size=8, seed=5)
    packed = torch.stack([c["k_pages"], c["v_pages"]], dim=2)
    wide_q = torch.zeros((2, 4, 64), dtype=c["q"].dtype, device=triton_device)
    wide_q[:, :, ::2] = c["q"]
    q = wide_q[:, :, ::2]
    assert not q.is_contiguous() and not packed[:, :, 0].is_contiguous()
    out, lse = flashcl.decode(q, packed[:, :, 0], packed[:, :, 1], block_table=c["block_table"],
                              context_lens=c["lens"], num_splits=2, backend="triton", return_lse=True)
    _check(out, c["ref"], "float32", "strided", lse=lse, lse_ref=c["ref_lse"])


def test_custom_op_opcheck(triton_device):
    """The registered op passes torch.library.opcheck (schema, fake kernel, dispatch)."""
    c = _case(triton_device, "float32", b=2, h_q=2, h_kv=1, lens=[5, 3], dk=16, block_size=4, seed=6)
    args = (c["q"], c["k_pages"], c["v_pages"], c["block_table"], c["lens"], c["scale"], 2)
    torch.library.opcheck(torch.ops.flashcl.decode.default, args,
                          test_utils=("test_schema", "test_faketensor"))


def test_torch_compile_fullgraph(triton_device):
    """A compiled function calling decode has no graph break (inductor on CUDA; on CPU the
    aot_eager backend, which still traces the whole graph and runs the fake kernel), also after
    numpy calls in the process (dtype_name's cache of numpy dtypes broke torch 2.11's trace)."""
    c = _case(triton_device, "float16", b=2, h_q=4, h_kv=2, lens=[9, 30], dk=32, seed=7)
    flashcl.quant.dtype_name(np.zeros(1, np.int32))
    torch._dynamo.reset()

    def step(q, k, v, bt, lens):
        out = flashcl.decode(q * 1.0, k, v, block_table=bt, context_lens=lens, backend="triton")
        return out.float() + 1.0

    backend = "inductor" if triton_device == "cuda" else "aot_eager"
    compiled = torch.compile(step, fullgraph=True, backend=backend)
    got = compiled(c["q"], c["k_pages"], c["v_pages"], c["block_table"], c["lens"])
    _check(got - 1.0, c["ref"], "float16", "compiled")


@cuda_only
def test_cuda_graph_capture(triton_device):
    """Captured once, replayed with new context_lens written in place: nothing was read on the host."""
    c = _case(triton_device, "float16", b=3, h_q=8, h_kv=2, lens=[300, 17, 1000], dk=128, seed=8)
    lens = c["lens"].clone()
    for ns in (None, 1, 4):
        _run_paged(c, ns)  # compile outside the capture
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out, lse = flashcl.decode(c["q"], c["k_pages"], c["v_pages"], block_table=c["block_table"],
                                      context_lens=lens, num_splits=ns, backend="triton", return_lse=True)
        for new in ([300, 17, 1000], [1, 999, 16]):
            lens.copy_(torch.tensor(new, dtype=torch.int32))
            g.replay()
            ref_out, ref_lse = reference.decode_attention(_np(c["q"]), _np(c["k"]), _np(c["v"]),
                                                          context_lens=np.array(new), scale=c["scale"],
                                                          return_lse=True)
            _check(out, ref_out, "float16", f"graph splits={ns} lens={new}", lse=lse, lse_ref=ref_lse)


# --------------------------------------------------------------------------- the large matrix (CUDA)

_HEADS = {"MHA": (4, 4), "GQA4": (16, 4), "GQA8": (16, 2), "MQA": (8, 1)}
_MATRIX = ([(dt, h, 16) for dt in ("float32", "float16", "bfloat16") for h in _HEADS]
           + [("float16", "GQA4", bs) for bs in (1, 32, 64)] + [("bfloat16", "MQA", 1)])


@cuda_only
@pytest.mark.parametrize("dtype,heads,block_size", _MATRIX)
def test_matrix(triton_device, dtype, heads, block_size, poison):
    """B in {1, 3, 33}, contexts {1, 15, 16, 17, 1000} mixed within a batch, permuted pages,
    splits auto / 1 / 2 / 3 / 7 / more than blocks (all at B=3), d = 128."""
    h_q, h_kv = _HEADS[heads]
    ctx_cycle = [1000, 15, 16, 17, 1]
    for b, split_counts in ((1, (None, 7)), (3, (None, 1, 2, 3, 7, 200)), (33, (None, 3))):
        lens = [ctx_cycle[(i + b) % len(ctx_cycle)] for i in range(b)]
        c = _case(triton_device, dtype, b=b, h_q=h_q, h_kv=h_kv, lens=lens, dk=128,
                  block_size=block_size, seed=b)
        for ns in split_counts:
            out, lse = _run_paged(c, ns)
            _check(out, c["ref"], dtype, f"B={b} splits={ns}", c["naive"], lse, c["ref_lse"])


@cuda_only
@pytest.mark.parametrize("dk,dv,dtype", [(96, 96, "float32"), (192, 128, "float16"),
                                          (256, 256, "float16"), (8, 8, "bfloat16")])
def test_head_dims_cuda(triton_device, dk, dv, dtype, poison):
    """Non-power-of-two and DK != DV head dims, paged and contiguous, GQA 4."""
    c = _case(triton_device, dtype, b=3, h_q=8, h_kv=2, lens=[1000, 17, 64], dk=dk, dv=dv, seed=dk)
    for ns in (1, 5):
        out, lse = _run_paged(c, ns)
        _check(out, c["ref"], dtype, f"paged {dtype} splits={ns}", c["naive"], lse, c["ref_lse"])
        out, lse = flashcl.decode(c["q"], c["k"], c["v"], context_lens=c["lens"], num_splits=ns,
                                  backend="triton", return_lse=True)
        _check(out, c["ref"], dtype, f"contig {dtype} splits={ns}", c["naive"], lse, c["ref_lse"])


@pytest.mark.parametrize("block_order,head_dim", [("random", 128), ("sequential", 128), ("ascending", 128),
                                                  ("random", 40)])
def test_bench_inputs_hold_the_same_kv(block_order, head_dim):
    """The benchmark's paged cache holds exactly the contiguous KV SDPA reads, for every block
    order (what the bench compares must be the same data) and head dim; sequential means
    allocation order, ascending a random set of blocks per sequence listed in address order."""
    from flashcl.tools import triton_bench_decode as bd

    shape = (3, 4, 2, 72)  # ctx not a multiple of the block size: a partial last block
    s = bd._make_inputs(shape, torch.float16, 16, _gen(3), torch.device("cpu"), block_order, head_dim)
    assert s["q"].shape[-1] == s["k"].shape[-1] == s["v_pages"].shape[-1] == head_dim
    b, _, h_kv, ctx = shape
    table = s["block_table"].long()
    for name in ("k", "v"):
        pages = s[f"{name}_pages"][table]                      # (B, blocks, 16, H_kv, d)
        flat = pages.permute(0, 3, 1, 2, 4).reshape(b, h_kv, -1, head_dim)[:, :, :ctx]
        assert torch.equal(flat, s[name])
    ordered = torch.arange(table.numel()).view_as(table)
    assert torch.equal(table.flatten().sort().values, ordered.flatten())  # every block used once
    assert torch.equal(table, ordered) == (block_order == "sequential")
    assert bool((table[:, 1:] > table[:, :-1]).all()) == (block_order != "random")
    with pytest.raises(ValueError, match="block_order"):
        bd._make_inputs(shape, torch.float16, 16, _gen(3), torch.device("cpu"), "reversed")


@pytest.mark.parametrize("forced", [{}, {1: 0.0933, 2: 0.0975}])
def test_bench_table_with_and_without_forced_splits(forced):
    """The bench table prints with forced split counts (best one, auto within 5%) and without
    (``--splits`` given no counts), and states the command that made it."""
    from flashcl.tools import triton_bench_decode as bd

    best = min(forced, key=forced.get) if forced else None
    row = {"shape": "(8,32,32,2k)", "kv_MB": 268.4, "auto_splits": 1, "median_ms": 0.0931, "min_ms": 0.093,
           "max_ms": 0.0934, "TB_s": 2.89, "pct_copy_bw": 99.6, "sdpa_TB_s": 2.92, "vs_sdpa": 0.99,
           "contig_TB_s": 2.93, "sdpa_fa2_TB_s": None, "forced_ms": forced, "best_splits": best,
           "best_forced_ms": forced.get(best), "auto_within_5pct": (0.0931 <= 1.05 * forced[best]) if forced else None,
           "flashcl": "0.1.0", "dtype": "float16", "d": 128, "block_size": 16, "block_order": "ascending",
           "rounds": 3, "device": "GPU", "sm_count": 132, "driver": "580", "torch": "2.11", "triton": "3.6",
           "date": "the run's date", "copy_bw_TB_s": 2.9, "read_bw_TB_s": 3.07, "pct_read_bw": 94.1}
    text = bd.format_table([row], "flashcl bench decode --backend triton --splits 1,2")
    assert "command: flashcl bench decode --backend triton --splits 1,2" in text
    assert "streaming-read bandwidth 3.07 TB/s" in text and " 94.1 " in text and " 0.990 " in text
    # rows saved before the read ceiling was measured still print
    old = {k: v for k, v in row.items() if k not in ("read_bw_TB_s", "pct_read_bw")}
    assert "streaming-read bandwidth n/a" in bd.format_table([old])
    assert "(ascending block order)" in text
    last = [ln for ln in text.splitlines() if ln.strip().startswith("(8,32,32,2k)")][0]  # the shape's row
    if forced:
        assert "1: 0.0933" in last and last.rstrip().endswith("yes") and "forced split counts" in text
    else:
        assert last.rstrip().endswith("-") and "forced split counts" not in text
    # a quantized cache: paged beside the paged call, contiguous beside the contiguous one
    quant = {**row, "kv_format": "q4_0", "quant_ms": 0.05, "quant_min_ms": 0.049, "quant_max_ms": 0.051,
             "quant_stored_MB": 75.5, "quant_TB_s": 1.5, "quant_ratio": 0.537, "quant_bw_vs_fp16": 0.52,
             "quant_contig_ms": 0.048, "quant_contig_ratio": 0.512}
    text = bd.format_table([quant])
    assert "K/V quantized to q4_0" in text and "time x0.537" in text
    assert "contiguous (B, H_kv, N, D): 0.0480 ms, time x0.512 of the contiguous float16 call" in text
