"""Triton prefill (flash-attention forward) against the float64 oracle.

Tiny shapes run everywhere (natively on CUDA, under TRITON_INTERPRET=1 on CPU); the full matrix
(N up to 4096, head dims up to 256, every dtype) runs on CUDA only.

Tolerances: flashcl.reference.TOLERANCE (relative error against float64; tf32x3 dots in float32),
and for float16 and bfloat16 at most twice the error of plain torch attention in that dtype.
bfloat16 keeps 8 significant bits: rounding the exact output alone costs ~1.5e-3, and P is rounded
to bfloat16 for the tensor-core P @ V, as in every flash-attention kernel (~4e-3, like torch's).
"""

from __future__ import annotations

import math
import zlib

import numpy as np
import pytest

from flashcl import reference

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from flashcl.triton import prefill as tp  # noqa: E402  (after the importorskip above)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
REL_TOL = reference.TOLERANCE
NAIVE_FACTOR = 2.0
LSE_TOL = 1e-4  # |lse - ref| <= LSE_TOL * (1 + |ref|): scores are float32 accumulations in every dtype
MAX_REF_ROWS = 96  # long sequences are checked on a sample of query rows (the oracle is O(N^2))


# --------------------------------------------------------------------------- helpers

def _randn(shape, dtype, device, seed, std=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * std).to(dtype).to(device)


def _inputs(b, h_q, h_kv, n_q, n_kv, dk, dv, dtype, device, seed, std=1.0):
    q = _randn((b, h_q, n_q, dk), dtype, device, seed, std)
    k = _randn((b, h_kv, n_kv, dk), dtype, device, seed + 1, std)
    v = _randn((b, h_kv, n_kv, dv), dtype, device, seed + 2)
    return q, k, v


def _sample_rows(n_q: int, seed: int) -> np.ndarray:
    """All rows of short sequences; for long ones the ends, tile edges and a random sample."""
    if n_q <= MAX_REF_ROWS:
        return np.arange(n_q)
    rng = np.random.default_rng(seed)
    edges = [0, 1, 15, 16, 63, 64, 127, 128, n_q // 2, n_q - 129, n_q - 128, n_q - 2, n_q - 1]
    rest = rng.choice(n_q, MAX_REF_ROWS - len(edges), replace=False)
    return np.unique(np.clip(np.concatenate([edges, rest]), 0, n_q - 1))


def _oracle(q, k, v, causal, scale, rows):
    """float64 (out, lse) of the chosen query rows (the mask keeps their absolute positions)."""
    q64 = q.double().cpu().numpy()[:, :, rows]
    k64, v64 = k.double().cpu().numpy(), v.double().cpu().numpy()
    mask = reference.causal_mask(q.shape[2], k.shape[2])[rows] if causal else None
    return reference.finalize(reference.attend_partial(q64, k64, v64, scale=scale, mask=mask))


def _naive(q, k, v, causal, scale):
    """Plain attention computed in the inputs' dtype (the error baseline for 16-bit types)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = (q @ k.transpose(-1, -2)) * scale
    if causal:
        mask = torch.from_numpy(reference.causal_mask(q.shape[2], k.shape[2])).to(q.device)
        s = s.masked_fill(~mask, float("-inf"))
    return torch.softmax(s, dim=-1) @ v


_rel_err = reference.rel_err


def _describe_mismatch(out: np.ndarray, ref: np.ndarray, n: int = 5) -> str:
    diff = np.abs(out - ref)
    worst = np.argsort(diff, axis=None)[::-1][:n]
    lines = [f"  at {np.unravel_index(i, diff.shape)}: got {out.flat[i]:.6g}, want {ref.flat[i]:.6g}"
             for i in worst]
    return f"max abs diff {diff.max():.3g}; worst elements:\n" + "\n".join(lines)


def _poison_allocator(nbytes: int, device: str) -> None:
    """Leave NaNs in the memory the next allocation of this size reuses (CUDA caching allocator),
    so an output element the kernel never writes fails the finiteness check."""
    if device == "cuda":
        torch.full((nbytes // 2,), float("nan"), dtype=torch.float16, device=device)


def _check(q, k, v, *, causal, dtype_name, device, params=None, scale=None, seed=0, naive=True):
    """Run the kernel and check out/lse against the oracle; returns the relative error."""
    b, h_q, n_q, _ = q.shape
    dv = v.shape[3]
    scale = 1.0 / math.sqrt(q.shape[3]) if scale is None else scale
    _poison_allocator(b * h_q * n_q * dv * q.element_size(), device)
    out, lse = tp.prefill(q, k, v, causal=causal, scale=scale, return_lse=True, params=params)
    assert out.shape == (b, h_q, n_q, dv) and out.dtype == q.dtype and out.device == q.device
    assert lse.shape == (b, h_q, n_q) and lse.dtype == torch.float32
    assert not torch.isnan(out).any(), "NaN in the output (unwritten element or 0/0)"
    assert not torch.isnan(lse).any(), "NaN in lse"

    rows = _sample_rows(n_q, seed)
    ref_out, ref_lse = _oracle(q, k, v, causal, scale, rows)
    got = out.double().cpu().numpy()[:, :, rows]
    got_lse = lse.double().cpu().numpy()[:, :, rows]
    err = _rel_err(got, ref_out)
    tol = REL_TOL[dtype_name]
    assert err <= tol, f"{dtype_name} relative error {err:.3g} > {tol:g}; " + _describe_mismatch(got, ref_out)

    seen = np.isfinite(ref_lse)
    assert np.array_equal(np.isneginf(got_lse), ~seen), "lse must be -inf exactly where a row sees no key"
    lse_err = np.abs(got_lse[seen] - ref_lse[seen]) / (1.0 + np.abs(ref_lse[seen]))
    assert lse_err.size == 0 or lse_err.max() <= LSE_TOL, f"lse error {lse_err.max():.3g} > {LSE_TOL}"
    assert not got[~seen].any(), "rows that see no key must be exactly 0"

    if naive and dtype_name != "float32":
        base = _naive(q, k, v, causal, scale).double().cpu().numpy()[:, :, rows]
        base[~seen] = 0.0  # softmax over no key is NaN in plain attention
        naive_err = _rel_err(base, ref_out)
        assert err <= NAIVE_FACTOR * naive_err + 1e-5, (
            f"{dtype_name} error {err:.3g} is worse than {NAIVE_FACTOR}x plain attention's {naive_err:.3g}")
    return err


# --------------------------------------------------------------------------- everywhere (tiny)

# (B, H_q, H_kv, N_q, N_kv, DK, DV, causal)
TINY_CASES = [
    (1, 2, 2, 1, 1, 16, 16, False),      # N = 1
    (1, 2, 2, 1, 1, 16, 16, True),
    (2, 2, 2, 17, 17, 64, 64, True),     # tile boundary + 1 (interpreter tiles are 16)
    (1, 2, 2, 16, 16, 32, 32, False),    # exactly one tile
    (1, 2, 2, 15, 33, 40, 40, False),    # ragged tiles, non-power-of-two head dim
    (1, 8, 2, 20, 20, 80, 80, True),     # GQA 4:1, DK = 80
    (1, 4, 1, 9, 31, 96, 96, True),      # MQA, N_q < N_kv (bottom-right causal)
    (1, 2, 1, 33, 7, 24, 24, True),      # N_q > N_kv: the first 26 rows see no key
    (1, 2, 2, 12, 19, 192, 128, True),   # DK != DV (DeepSeek-style 192/128)
    (1, 1, 1, 5, 18, 8, 256, False),     # smallest DK, largest DV
]


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("case", TINY_CASES, ids=lambda c: "b{}h{}x{}n{}x{}d{}x{}{}".format(*c[:7], "c" if c[7] else ""))
def test_tiny_matches_reference(triton_device, case, dtype_name):
    b, h_q, h_kv, n_q, n_kv, dk, dv, causal = case
    seed = zlib.crc32(repr(case).encode()) % 1000  # hash() of strings varies per process
    q, k, v = _inputs(b, h_q, h_kv, n_q, n_kv, dk, dv, DTYPES[dtype_name], triton_device, seed)
    _check(q, k, v, causal=causal, dtype_name=dtype_name, device=triton_device, seed=seed)


# Long enough for several unmasked tiles per row, so the overlapped loop's carried P and its
# trailing P @ V are exercised (interpreter tiles are 16; on CUDA, 64 x 64 tiles on 4 warps).
OVERLAP_CASES = [
    (1, 2, 2, 1, 1, 16, 16, False),      # N = 1: no unmasked tile at all on the GPU tile
    (1, 4, 1, 70, 150, 40, 40, True),    # MQA, N_q < N_kv, ragged, padded head dim
    (1, 8, 2, 100, 100, 64, 64, False),  # GQA 4:1, ragged last tile
    (2, 2, 2, 130, 130, 32, 48, True),   # DK != DV, causal diagonal mid-tile
    (1, 2, 2, 160, 96, 16, 16, True),    # N_q > N_kv: the first 64 rows see no key
]


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("case", OVERLAP_CASES, ids=lambda c: "b{}h{}x{}n{}x{}d{}x{}{}".format(*c[:7], "c" if c[7] else ""))
def test_softmax_overlap_matches_reference(triton_device, case, dtype_name):
    """The overlapped loop 1 (SOFTMAX_OVERLAP: P @ V of the previous tile under this tile's
    softmax) on its own, forced; it computes what the plain loop does, in another order."""
    b, h_q, h_kv, n_q, n_kv, dk, dv, causal = case
    if triton_device == "cuda":
        params = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3, "SOFTMAX_OVERLAP": True}
        if torch.cuda.get_device_capability()[0] >= 9 and dtype_name != "float32":
            params["USE_TMA"] = True  # the config the autotuner times (see _overlap_pays)
    else:
        params = {**tp._INTERPRETER_PARAMS, "SOFTMAX_OVERLAP": True}
    seed = zlib.crc32(repr(case).encode()) % 1000
    q, k, v = _inputs(b, h_q, h_kv, n_q, n_kv, dk, dv, DTYPES[dtype_name], triton_device, seed)
    _check(q, k, v, causal=causal, dtype_name=dtype_name, device=triton_device, params=params, seed=seed)
    std = math.sqrt(200.0 / 3.0)  # scores around +-200: the carried P and alpha must rescale
    q, k, v = _inputs(b, h_q, h_kv, n_q, n_kv, dk, dv, DTYPES[dtype_name], triton_device, seed, std=std)
    _check(q, k, v, causal=causal, dtype_name=dtype_name, device=triton_device, params=params,
           seed=seed, naive=False)


@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_huge_logits(triton_device, dtype_name):
    """Scores around +-200: the online softmax must rescale, never overflow."""
    std = math.sqrt(200.0 / 3.0)  # score std ~ 67, extremes beyond +-200
    q, k, v = _inputs(1, 2, 1, 24, 40, 32, 32, DTYPES[dtype_name], triton_device, 7, std=std)
    s = (q.double() @ k.double().repeat_interleave(2, 1).transpose(-1, -2)) / math.sqrt(32)
    assert s.abs().max() > 150
    # plain float16 attention rounds such scores by ~0.1: compare with the oracle only
    _check(q, k, v, causal=True, dtype_name=dtype_name, device=triton_device, naive=False)


def test_fully_masked_rows_are_zero(triton_device):
    q, k, v = _inputs(1, 2, 2, 40, 8, 16, 16, torch.float32, triton_device, 11)
    out, lse = tp.prefill(q, k, v, causal=True, return_lse=True)
    assert torch.equal(out[:, :, :32], torch.zeros_like(out[:, :, :32]))
    assert torch.isneginf(lse[:, :, :32]).all() and torch.isfinite(lse[:, :, 32:]).all()


def test_non_contiguous_inputs(triton_device):
    """Any strides: (B, N, H, D) views, strided key rows, a head dim with stride != 1."""
    dtype = torch.float16
    b, h_q, h_kv, n_q, n_kv, d = 2, 4, 2, 19, 21, 32
    q_bnhd = _randn((b, n_q, h_q, d), dtype, triton_device, 1)
    q = q_bnhd.transpose(1, 2)                                           # stride_qm = H * D
    k = _randn((b, h_kv, 2 * n_kv, d), dtype, triton_device, 2)[:, :, ::2]  # stride_kn = 2 * D
    v = _randn((b, h_kv, d, n_kv), dtype, triton_device, 3).transpose(2, 3)  # stride_vd = N_kv
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    out = tp.prefill(q, k, v, causal=True)
    ref = tp.prefill(q.contiguous(), k.contiguous(), v.contiguous(), causal=True)
    assert torch.equal(out, ref), "strided inputs must give the very same bits as contiguous ones"
    _check(q, k, v, causal=True, dtype_name="float16", device=triton_device)


def test_tma_descriptors_follow_strides(triton_device):
    """sm_90+: the host-built 4-D descriptors take any 16-byte aligned strides. (B, N, H, D) views
    through the TMA tile give the very bits of contiguous inputs; ragged N, a padded head dim
    (80 -> 128) and GQA exercise the copy engine's zero fill and clipped stores."""
    if triton_device != "cuda" or torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA needs an sm_90+ GPU")
    params = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3, "USE_TMA": True}
    b, h_q, h_kv, n_q, n_kv, d = 2, 4, 2, 77, 131, 80
    q = _randn((b, n_q, h_q, d), torch.float16, triton_device, 1).transpose(1, 2)
    k = _randn((b, n_kv, h_kv, d), torch.float16, triton_device, 2).transpose(1, 2)
    v = _randn((b, n_kv, h_kv, d), torch.float16, triton_device, 3).transpose(1, 2)
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    for causal in (False, True):
        out = tp.prefill(q, k, v, causal=causal, params=params)
        ref = tp.prefill(q.contiguous(), k.contiguous(), v.contiguous(), causal=causal, params=params)
        assert torch.equal(out, ref), "strided inputs must give the very same bits as contiguous ones"
        _check(q, k, v, causal=causal, dtype_name="float16", device=triton_device, params=params)


def test_rank3_negative_scale_and_lse_flag(triton_device):
    q, k, v = _inputs(1, 2, 2, 9, 13, 16, 24, torch.float32, triton_device, 5)
    out3 = tp.prefill(q[0], k[0], v[0], causal=False, scale=-0.3)
    assert out3.shape == (2, 9, 24)
    ref = reference.attention(q[0].double().cpu().numpy(), k[0].double().cpu().numpy(),
                              v[0].double().cpu().numpy(), scale=-0.3)
    assert _rel_err(out3.double().cpu().numpy(), ref) <= REL_TOL["float32"]
    out3, lse3 = tp.prefill(q[0], k[0], v[0], return_lse=True)
    assert lse3.shape == (2, 9)


def test_public_api_dispatch(triton_device):
    import flashcl

    q, k, v = _inputs(1, 4, 2, 10, 10, 16, 16, torch.float16, triton_device, 9)
    out, lse = flashcl.prefill(q, k, v, causal=True, backend="triton", return_lse=True)
    direct, direct_lse = tp.prefill(q, k, v, causal=True, scale=0.25, return_lse=True)
    assert torch.equal(out, direct) and torch.equal(lse, direct_lse)


@pytest.mark.parametrize("params, match", [
    ({"BLOCK_M": 64}, "takes the keys"),
    ({"BLOCK_M": 48, "BLOCK_N": 16, "num_warps": 4, "num_stages": 2}, "power of two"),
    ({"BLOCK_M": 64, "BLOCK_N": 16, "num_warps": 0, "num_stages": 2}, "positive int"),
    ({"BLOCK_M": 64, "BLOCK_N": 16, "num_warps": 4, "num_stages": 2, "SOFTMAX_OVERLAP": 1}, "expected a bool"),
    ({"BLOCK_M": 64, "BLOCK_N": 16, "num_warps": 8, "num_stages": 2, "dtype": torch.float32}, "illegal memory"),
])
def test_bad_params(triton_device, params, match):
    params = dict(params)
    dtype = params.pop("dtype", torch.float16)
    q, k, v = _inputs(1, 1, 1, 4, 4, 16, 16, dtype, triton_device, 1)
    with pytest.raises(ValueError, match=match):
        tp.prefill(q, k, v, params=params)


def _candidates(**facts):
    """The tiles _tile_fits keeps on an H100-like device (pure: runs on CPU)."""
    base = dict(elt=2, dk=128, dv=128, bdk=128, bdv=128, q_bucket=4096, kv_bucket=4096,
                smem=232448, wgmma=True, tma_ok=True)
    base.update(facts)
    return [t for t in tp._TILE_SPACE if tp._tile_fits(*t, **base)]


def test_softmax_overlap_tile_rule():
    """The overlapped TMA tile replaces the plain one exactly where it was measured ahead: 16-bit,
    head dims exactly 128 with N_q and N_kv buckets from 4096, or exactly 64 from 1024; never
    without TMA."""
    overlap = (64, 64, 4, 3, True, None, True)
    plain = (64, 64, 4, 3, True, None, False)
    d64 = dict(dk=64, dv=64, bdk=64, bdv=64)
    for facts in (dict(), dict(q_bucket=16384, kv_bucket=8192), dict(d64, q_bucket=1024, kv_bucket=1024)):
        kept = _candidates(**facts)
        assert overlap in kept and plain not in kept, facts
    for facts in (dict(q_bucket=2048), dict(kv_bucket=2048), dict(dk=96, dv=96),
                  dict(dk=128, dv=64, bdv=64), dict(elt=4), dict(d64, q_bucket=512)):
        assert overlap not in _candidates(**facts), facts
    assert plain in _candidates(q_bucket=2048) and plain in _candidates(dk=96, dv=96)
    assert not any(t[6] for t in _candidates(tma_ok=False, wgmma=False, smem=101376))


def test_float32_tile_rule():
    """float32 runs tf32x3 tensor-core dots: tiles of 32 rows and 32 keys stay in, and the K/V ring
    plus Q must fit 3/4 of shared memory (the rest goes to the dots' operand splits; on an H200
    160 KiB by _tile_fits' formula launched, 192 KiB did not)."""
    d64 = dict(dk=64, dv=64, bdk=64, bdv=64)
    d256 = dict(dk=256, dv=256, bdk=256, bdv=256)
    assert (128, 32, 8, 2, False, None, False) in _candidates(elt=4)  # the fastest timed at d = 128
    assert (128, 64, 8, 3, False, None, False) in _candidates(elt=4, **d64)  # and at d = 64
    kept = _candidates(elt=4, **d256)
    assert (32, 32, 8, 2, False, None, False) in kept and all(t[0] == 32 for t in kept)
    assert (64, 32, 4, 2, False, None, False) in tp._TILE_SPACE  # 192 KiB at d = 256: not kept


def test_op_schema_is_stable():
    schema = str(torch.ops.flashcl.prefill.default._schema)
    assert schema == "flashcl::prefill" + tp._SCHEMA


def test_opcheck(triton_device):
    """Fake (meta) implementation, schema and dispatcher registration agree with the kernel."""
    q, k, v = _inputs(1, 4, 2, 5, 7, 16, 16, torch.float16, triton_device, 3)
    for return_lse in (True, False):
        torch.library.opcheck(torch.ops.flashcl.prefill.default, (q, k, v, True, 0.25, return_lse),
                              test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


class _LlamaAttention(torch.nn.Module):
    """q/k/v projections, reshape to heads, flashcl::prefill, output projection (GQA)."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, dim // n_heads
        self.wq = torch.nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = torch.nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = torch.nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = torch.nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x):
        b, n, _ = x.shape
        q = self.wq(x).view(b, n, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, n, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, n, self.n_kv_heads, self.head_dim).transpose(1, 2)
        o = tp.prefill(q, k, v, causal=True)
        return self.wo(o.transpose(1, 2).reshape(b, n, -1))


def test_torch_compile_llama_block(triton_device):
    """fullgraph compile of a LLaMA attention block: no graph break, same bits as eager."""
    import torch._dynamo

    torch.manual_seed(0)
    dim, n = (512, 256) if triton_device == "cuda" else (64, 16)
    dtype = torch.float16 if triton_device == "cuda" else torch.float32
    model = _LlamaAttention(dim, n_heads=8, n_kv_heads=2).to(triton_device, dtype).eval()
    x = _randn((2, n, dim), dtype, triton_device, 4)
    with torch.no_grad():
        eager = model(x)
        explained = torch._dynamo.explain(model)(x)
        assert explained.graph_break_count == 0, explained.break_reasons
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True)(x)
    assert torch.equal(compiled, eager), f"max diff {(compiled - eager).abs().max().item()}"


# --------------------------------------------------------------------------- CUDA: full matrix

HEAD_DIMS = [(64, 64), (80, 80), (96, 96), (128, 128), (256, 256), (192, 128)]
# (B, H_q, H_kv, N_q, N_kv): N in {1, 17, 128, 1000, 4096}, GQA 4:1, MQA, N_q < N_kv, N_q > N_kv
CUDA_SHAPES = [
    (1, 2, 2, 1, 1),
    (2, 3, 3, 17, 17),
    (1, 8, 2, 128, 128),
    (1, 4, 1, 1000, 1000),
    (1, 2, 2, 4096, 4096),
    (1, 4, 4, 1, 4096),
    (1, 4, 2, 100, 1000),
    (1, 2, 2, 1000, 128),
]
CUDA_MATRIX = [(dt, hd, c) for dt in DTYPES for hd in HEAD_DIMS for c in (False, True)]


@pytest.mark.parametrize("index", range(len(CUDA_MATRIX)),
                         ids=["{}-d{}x{}-{}".format(dt, *hd, "causal" if c else "full")
                              for dt, hd, c in CUDA_MATRIX])
def test_cuda_matrix(triton_device, index):
    if triton_device != "cuda":
        pytest.skip("the full matrix runs natively on CUDA only")
    dtype_name, (dk, dv), causal = CUDA_MATRIX[index]
    dtype = DTYPES[dtype_name]
    # every config the autotuner may pick gets exercised somewhere in the matrix
    cands = tp.candidate_params(dtype, dk, dv, 4096)
    params = cands[index % len(cands)]
    for i, (b, h_q, h_kv, n_q, n_kv) in enumerate(CUDA_SHAPES):
        seed = 100 * index + i
        q, k, v = _inputs(b, h_q, h_kv, n_q, n_kv, dk, dv, dtype, triton_device, seed)
        try:
            _check(q, k, v, causal=causal, dtype_name=dtype_name, device=triton_device,
                   params=params, seed=seed)
        except AssertionError as e:
            raise AssertionError(f"shape {(b, h_q, h_kv, n_q, n_kv)} params {params}: {e}") from None


@pytest.mark.parametrize("causal", [False, True])
def test_cuda_autotuned_default(triton_device, causal):
    """The autotuned path (no params) on a reference benchmark shape, GQA 4:1."""
    if triton_device != "cuda":
        pytest.skip("autotuning runs on CUDA only")
    q, k, v = _inputs(1, 16, 4, 2048, 2048, 128, 128, torch.float16, triton_device, 21)
    _check(q, k, v, causal=causal, dtype_name="float16", device=triton_device)
    assert tp.best_config(2048, 2048, 128, 128, causal, torch.float16, batch_heads=16) is not None
