"""The launch knobs of the Triton decode (flashcl.triton.decode_plan._KNOBS) run exact, above all
the fused reduce: the last split program of each (sequence, KV head) merges the partial states,
with per-device arrival counters that must be back at zero after every launch. Which knobs the plan
turns on by itself is tested as data in tests/test_decode_plan.py.

Small shapes run under TRITON_INTERPRET=1 on CPU (programs run one after another, which exercises
the counter logic, not its memory ordering); the CUDA-graph tests need a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from flashcl import reference  # noqa: E402
from flashcl.triton import decode as td  # noqa: E402
from flashcl.triton import decode_gluon as tg  # noqa: E402
from flashcl.triton import decode_plan as dp  # noqa: E402

from .test_triton_decode import _case, _check, _np  # noqa: E402

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
FUSED = {"fused_reduce": True}
TWO_KERNEL = {"fused_reduce": False}


@pytest.fixture
def poison(monkeypatch):
    """Every buffer the launch allocates starts as NaN (the workspace counters excepted: zeroed)."""
    monkeypatch.setattr(td, "_empty", lambda shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype, device=device))


def _run(c, num_splits, config, lens=None):
    return td._launch(c["q"], c["k_pages"], c["v_pages"], c["block_table"],
                      c["lens"] if lens is None else lens, c["scale"], num_splits, config=config)


def _counters_zero(device):
    """Every counter workspace of ``device`` (one per stream that ran a fused launch) is zero."""
    dev = torch.device(device)
    return all(int(buf.count_nonzero()) == 0 for key, buf in td._COUNTERS.items()
               if key[:2] == (dev.type, dev.index))


# --------------------------------------------------------------------------- fused reduce


@pytest.mark.parametrize("num_splits", [2, 3, 7, 64])
def test_fused_gqa_split_counts(triton_device, num_splits, poison):
    """GQA 4, contexts 1 / 17 / 40 with block size 16: 3 and 7 (non-powers of two) and 64 splits
    (most splits empty: past the end of every sequence) all merge exactly once."""
    c = _case(triton_device, "float16", b=3, h_q=8, h_kv=2, lens=[1, 17, 40], dk=32, block_size=16)
    out, lse = _run(c, num_splits, FUSED)
    _check(out, c["ref"], "float16", f"fused splits={num_splits}", c["naive"], lse, c["ref_lse"])
    assert _counters_zero(triton_device)


def test_fused_mqa_mha_and_empty_sequences(triton_device, poison):
    """MQA (one KV head, group 8) and MHA (group 1), with context_len 0 sequences: out 0, lse -inf."""
    for h_q, h_kv in ((8, 1), (2, 2)):
        c = _case(triton_device, "float32", b=3, h_q=h_q, h_kv=h_kv, lens=[0, 23, 0], dk=16, block_size=4, seed=3)
        out, lse = _run(c, 5, FUSED)
        o, l = _np(out), _np(lse)
        assert not np.isnan(o).any() and (o[[0, 2]] == 0).all() and np.isneginf(l[[0, 2]]).all()
        _check(out[1:2], c["ref"][1:2], "float32", f"fused h_q={h_q} h_kv={h_kv}", lse=lse[1:2],
               lse_ref=c["ref_lse"][1:2])
        assert _counters_zero(triton_device)


def test_fused_repeated_calls_reuse_zeroed_counters(triton_device, poison):
    """Many calls with changing split counts and batch sizes reuse one zeroed workspace: a counter
    left non-zero would make a later call merge early (wrong output) or never (NaN output)."""
    cases = [_case(triton_device, "float16", b=b, h_q=4, h_kv=2, lens=lens, dk=16, block_size=8, seed=b)
             for b, lens in ((2, [30, 9]), (3, [5, 64, 33]))]
    for _ in range(2):
        for c in cases:
            for ns in (2, 5, 3):
                out, lse = _run(c, ns, FUSED)
                _check(out, c["ref"], "float16", f"repeat splits={ns}", c["naive"], lse, c["ref_lse"])
                assert _counters_zero(triton_device)
    assert len({id(t) for t in td._COUNTERS.values()}) == len(td._COUNTERS)


def test_fused_matches_two_kernel_path(triton_device):
    """Fused and two-kernel merges agree to fp32 rounding (same partial states, merged in another order)."""
    c = _case(triton_device, "float32", b=2, h_q=4, h_kv=1, lens=[50, 13], dk=16, block_size=4, seed=11)
    ref_out, ref_lse = _run(c, 6, TWO_KERNEL)
    out, lse = _run(c, 6, FUSED)
    assert torch.allclose(out, ref_out, rtol=1e-5, atol=1e-6) and torch.allclose(lse, ref_lse, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- the other knobs


_KNOB_CONFIGS = {
    "defaults": None,
    "all-off": {"early_pages": False, "fused_reduce": False, "pdl": False, "whole_pages": False},
    "masked-rows": {"whole_pages": False},  # early pages, K/V rows masked instead of pointed at row 0
    "early_pages": {"early_pages": True, "fused_reduce": False},
    "pdl": {"pdl": True},  # a no-op here (interpreter / no sm_90): still exact
    "fused+early+merge2": {"fused_reduce": True, "early_pages": True, "merge_stages": 2},
    "fused-late_pages": {"fused_reduce": True, "early_pages": False},
    "mha_fma": {"mha_fma": True},  # the MHA case on CUDA cores; GQA ignores it
    "mha_dot": {"mha_fma": False},
    "mha_fma-masked-rows": {"mha_fma": True, "whole_pages": False},  # needs whole pages: the dot path
    "mha_fma-plain-loads": {"mha_fma": True, "kv_evict_first": False},  # the default L1 policy
}


@pytest.mark.parametrize("name", list(_KNOB_CONFIGS))
def test_knobs_exact(triton_device, name, poison):
    """Each knob setting on ragged contexts (full tiles, a partial tail tile, a one-token sequence,
    splits past the end): GQA 4 and MHA, single pass and split."""
    config = _KNOB_CONFIGS[name]
    for h_q, h_kv in ((8, 2), (2, 2)):
        c = _case(triton_device, "float16", b=3, h_q=h_q, h_kv=h_kv, lens=[70, 1, 33], dk=32, block_size=16, seed=5)
        for ns in (1, 3):
            out, lse = _run(c, ns, config)
            _check(out, c["ref"], "float16", f"{name} h_q={h_q} splits={ns}", c["naive"], lse, c["ref_lse"])
    assert _counters_zero(triton_device)


def test_early_pages_shorter_than_bound(triton_device, poison):
    """early_pages partitions by the block-table bound: every sequence much shorter than the bound
    (most splits empty) is still exact."""
    c = _case(triton_device, "float32", b=2, h_q=4, h_kv=2, lens=[200, 7], dk=16, block_size=8, seed=6)
    lens = torch.tensor([20, 3], dtype=torch.int32, device=triton_device)
    ref_out, ref_lse = reference.decode_attention(_np(c["q"]), _np(c["k"]), _np(c["v"]), context_lens=np.array([20, 3]),
                                                  scale=c["scale"], return_lse=True)
    for cfg in ({"early_pages": True}, {"early_pages": True, "fused_reduce": True}):
        out, lse = _run(c, 4, cfg, lens=lens)
        _check(out, ref_out, "float32", f"{cfg}", lse=lse, lse_ref=ref_lse)


# --------------------------------------------------------------------------- MHA on CUDA cores

MHA_FMA = {"mha_fma": True}


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_mha_fma_exact(triton_device, dtype, poison):
    """The CUDA-core MHA loop (forced) against the float64 reference: contexts 0, 1, 15, 16, 17 and
    1000 (an empty sequence, one shorter than a tile, a partial last tile), single pass and 3
    splits (splits past the end), the same result as the tl.dot path to rounding."""
    c = _case(triton_device, dtype, b=6, h_q=2, h_kv=2, lens=[0, 1, 15, 16, 17, 1000], dk=32, block_size=16,
              seed=31)
    for ns in (1, 3):
        out, lse = _run(c, ns, MHA_FMA)
        _check(out, c["ref"], dtype, f"mha_fma {dtype} splits={ns}", c["naive"], lse, c["ref_lse"])
        dot_out, _ = _run(c, ns, {"mha_fma": False})
        assert torch.allclose(out.float(), dot_out.float(), rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("block_size,dk,dv", [(32, 80, 48), (64, 64, 64), (1, 96, 112)])
def test_mha_fma_pages_and_head_dims(triton_device, block_size, dk, dv, poison):
    """Whole pages of 1, 32 and 64 rows in a 64-row tile; non-power-of-two head dims with DK != DV
    (the padded head-dim columns are masked, never read); logits around +-200."""
    c = _case(triton_device, "float16", b=3, h_q=3, h_kv=3, lens=[130, 64, 7], dk=dk, dv=dv, block_size=block_size,
              seed=32)
    for ns in (1, 2):
        out, lse = _run(c, ns, MHA_FMA)
        _check(out, c["ref"], "float16", f"mha_fma bs={block_size} dk={dk} dv={dv} splits={ns}", c["naive"], lse,
               c["ref_lse"])
    c = _case(triton_device, "float16", b=2, h_q=2, h_kv=2, lens=[70, 9], dk=dk, dv=dv, block_size=block_size,
              seed=33, q_scale=75.0)
    assert (np.abs(np.einsum("bhd,bhnd->bhn", _np(c["q"]), _np(c["k"]))) * c["scale"]).max() > 150
    out, lse = _run(c, 1, MHA_FMA)
    _check(out, c["ref"], "float16", f"mha_fma large logits dk={dk}", c["naive"], lse, c["ref_lse"])


# --------------------------------------------------------------------------- the Gluon MHA kernel

gluon_only = pytest.mark.skipif(not (torch.cuda.is_available() and tg.available()), reason="needs CUDA and Gluon")


@pytest.fixture
def gluon_calls(monkeypatch):
    """The Gluon kernel's launches, counted: one (rows, warps) entry per launch."""
    calls = []
    launch = tg.launch
    monkeypatch.setattr(tg, "launch", lambda *args, **kw: (calls.append(args[-2:]), launch(*args, **kw))[1])
    return calls


@gluon_only
@pytest.mark.parametrize("dtype,block_size", [("float16", 16), ("bfloat16", 32), ("float16", 64), ("float16", 1)])
def test_gluon_mha(dtype, block_size, poison, gluon_calls):
    """MHA of head dim 128 over whole pages runs the Gluon kernel (its launches counted): contexts
    0, 1, 17, 64, 65 and 1000 over a permuted block table against the float64 reference, the
    Triton MHA loop's result to rounding, and logits around +-200."""
    c = _case("cuda", dtype, b=6, h_q=4, h_kv=4, lens=[0, 1, 17, 64, 65, 1000], dk=128, block_size=block_size,
              seed=41)
    out, lse = _run(c, 1, MHA_FMA)
    assert len(gluon_calls) == 1
    o, l = _np(out), _np(lse)
    assert (o[0] == 0).all() and np.isneginf(l[0]).all()
    _check(out, c["ref"], dtype, f"gluon mha {dtype} bs={block_size}", c["naive"], lse, c["ref_lse"])
    plain_out, plain_lse = _run(c, 1, {**MHA_FMA, "kv_evict_first": False})  # a cache hint: same bits
    assert len(gluon_calls) == 2 and torch.equal(out, plain_out) and torch.equal(lse, plain_lse)
    tri_out, tri_lse = _run(c, 1, {**MHA_FMA, "gluon_mha": False})
    assert len(gluon_calls) == 2
    assert torch.allclose(out.float(), tri_out.float(), rtol=2e-2, atol=2e-3)
    assert torch.allclose(lse[1:], tri_lse[1:], rtol=1e-5, atol=1e-5)
    c = _case("cuda", dtype, b=2, h_q=2, h_kv=2, lens=[70, 9], dk=128, block_size=block_size, seed=42, q_scale=60.0)
    assert (np.abs(np.einsum("bhd,bhnd->bhn", _np(c["q"]), _np(c["k"]))) * c["scale"]).max() > 150
    out, lse = _run(c, 1, MHA_FMA)
    assert len(gluon_calls) == 3
    _check(out, c["ref"], dtype, f"gluon mha large logits {dtype}", c["naive"], lse, c["ref_lse"])


@gluon_only
@pytest.mark.parametrize("dk,rows,warps,block_size,dtype", [
    (72, 64, 4, 16, "float16"), (96, 64, 4, 16, "float16"), (112, 64, 4, 16, "float16"),  # padded to 128
    (64, 128, 8, 16, "float16"), (64, 128, 8, 32, "bfloat16"), (64, 64, 4, 64, "float16"),  # padded to 64
    (48, 128, 8, 128, "float16"), (40, 64, 4, 16, "float16"),
    (32, 128, 8, 16, "float16"), (32, 128, 4, 32, "bfloat16"), (24, 128, 8, 1, "float16")])  # padded to 32
def test_gluon_mha_head_dims_and_tiles(dk, rows, warps, block_size, dtype, poison, gluon_calls):
    """Head dims below 128 run the Gluon kernel padded to 32, 64 or 128 (the padding columns
    masked), on each tile it takes (decode_gluon.tile): ragged contexts over a permuted table
    against the float64 reference and the Triton MHA loop on the same tile, and logits around
    +-200."""
    config = {**MHA_FMA, "BLOCK_N": rows, "num_warps": warps}
    c = _case("cuda", dtype, b=5, h_q=3, h_kv=3, lens=[0, 1, rows + 1, 700, 1000], dk=dk, block_size=block_size,
              seed=dk + rows)
    out, lse = _run(c, 1, config)
    assert gluon_calls == [(rows, warps)]
    _check(out, c["ref"], dtype, f"gluon mha {dtype} dk={dk} tile {rows}x{warps}", c["naive"], lse, c["ref_lse"])
    tri_out, tri_lse = _run(c, 1, {**config, "gluon_mha": False})
    assert len(gluon_calls) == 1
    assert torch.allclose(out.float(), tri_out.float(), rtol=2e-2, atol=2e-3)
    assert torch.allclose(lse[1:], tri_lse[1:], rtol=1e-5, atol=1e-5)
    c = _case("cuda", dtype, b=2, h_q=2, h_kv=2, lens=[rows + 6, 9], dk=dk, block_size=block_size, seed=dk,
              q_scale=90.0)
    assert (np.abs(np.einsum("bhd,bhnd->bhn", _np(c["q"]), _np(c["k"]))) * c["scale"]).max() > 150
    out, lse = _run(c, 1, config)
    assert len(gluon_calls) == 2
    _check(out, c["ref"], dtype, f"gluon mha large logits {dtype} dk={dk}", c["naive"], lse, c["ref_lse"])


@gluon_only
@pytest.mark.parametrize("d", [32, 64])
def test_gluon_mha_small_heads_automatic(d, poison, gluon_calls):
    """With more programs than SMs, MHA at d = 32 and 64 runs the Gluon kernel on its own tile
    (decode_plan.gluon_tile), unforced; with two splits, the dot path."""
    sms = dp.facts_of("cuda").sms
    c = _case("cuda", "float16", b=1, h_q=sms + 4, h_kv=sms + 4, lens=[300], dk=d, block_size=16, seed=d)
    out, lse = _run(c, 0, None)
    assert gluon_calls == [dp.gluon_tile(d, sms + 4, sms)]
    _check(out, c["ref"], "float16", f"gluon mha automatic d={d}", c["naive"], lse, c["ref_lse"])
    out, lse = _run(c, 2, None)
    assert len(gluon_calls) == 1
    _check(out, c["ref"], "float16", f"dot path d={d} 2 splits", c["naive"], lse, c["ref_lse"])



GQA = {"gluon_gqa": True}


@pytest.fixture
def gqa_calls(monkeypatch):
    """The Gluon GQA kernel's launches, counted."""
    calls = []
    launch = tg.launch_gqa
    monkeypatch.setattr(tg, "launch_gqa", lambda *args, **kw: (calls.append(args[0].shape), launch(*args, **kw))[1])
    return calls


@gluon_only
@pytest.mark.parametrize("dtype,block_size,h_q,h_kv", [
    ("float16", 16, 8, 2), ("bfloat16", 32, 16, 2), ("float16", 1, 12, 4),  # groups 4, 8, 3
    ("float16", 256, 16, 1), ("float16", 64, 32, 2),  # groups of 16: every row of the mma tile
])
def test_gluon_gqa(dtype, block_size, h_q, h_kv, poison, gqa_calls):
    """GQA of head dim 128 runs the Gluon GQA kernel when forced (its launches counted): contexts 0,
    1, 17, 64, 65 and 1000 over a permuted block table against the float64 reference and the dot
    path, logits around +-200; the L1 hint changes no bit."""
    c = _case("cuda", dtype, b=6, h_q=h_q, h_kv=h_kv, lens=[0, 1, 17, 64, 65, 1000], dk=128,
              block_size=block_size, seed=43)
    out, lse = _run(c, 1, GQA)
    assert len(gqa_calls) == 1
    o, l = _np(out), _np(lse)
    assert (o[0] == 0).all() and np.isneginf(l[0]).all()
    _check(out, c["ref"], dtype, f"gluon gqa {dtype} bs={block_size} {h_q}/{h_kv}", c["naive"], lse, c["ref_lse"])
    plain_out, plain_lse = _run(c, 1, {**GQA, "kv_evict_first": False})
    assert len(gqa_calls) == 2 and torch.equal(out, plain_out) and torch.equal(lse, plain_lse)
    dot_out, dot_lse = _run(c, 1, {"gluon_gqa": False})
    assert len(gqa_calls) == 2
    assert torch.allclose(out.float(), dot_out.float(), rtol=2e-2, atol=2e-3)
    assert torch.allclose(lse[1:], dot_lse[1:], rtol=1e-5, atol=1e-5)
    c = _case("cuda", dtype, b=2, h_q=h_q, h_kv=h_kv, lens=[70, 9], dk=128, block_size=block_size, seed=44,
              q_scale=60.0)
    assert (np.abs(np.einsum("bhd,bhnd->bhn", _np(c["q"]), np.repeat(_np(c["k"]), h_q // h_kv, axis=1)))
            * c["scale"]).max() > 150
    out, lse = _run(c, 1, GQA)
    assert len(gqa_calls) == 3
    _check(out, c["ref"], dtype, f"gluon gqa large logits {dtype} {h_q}/{h_kv}", c["naive"], lse, c["ref_lse"])


@gluon_only
@pytest.mark.parametrize("h_q,h_kv", [(8, 2), (32, 2)])
def test_gluon_gqa_splits(h_q, h_kv, poison, gqa_calls):
    """The GQA kernel's split launches (forced): 2, 3 and 16 splits of ragged contexts 0, 1, 17, 200
    and 1000 (splits past a sequence's end are empty), merged by the reduce kernel."""
    c = _case("cuda", "float16", b=5, h_q=h_q, h_kv=h_kv, lens=[0, 1, 17, 200, 1000], dk=128, seed=47)
    for ns in (2, 3, 16):
        out, lse = _run(c, ns, GQA)
        _check(out, c["ref"], "float16", f"gluon gqa {h_q}/{h_kv} splits={ns}", c["naive"], lse, c["ref_lse"])
    assert len(gqa_calls) == 3


@gluon_only
def test_gluon_gqa_automatic(poison, gqa_calls):
    """Unforced, launches of the rule's shapes (decode_gluon.gqa_takes) run the kernel, one split or
    its own split count; 512-token splits, MHA and a head dim below 128 do not."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    b = -(-3 * sms // (2 * 2))  # 2 KV heads: at least 1.5 programs per SM
    c = _case("cuda", "float16", b=b, h_q=8, h_kv=2, lens=[1024] * b, dk=128, seed=45)
    out, lse = _run(c, 0, None)
    assert len(gqa_calls) == 1
    _check(out, c["ref"], "float16", "gluon gqa automatic", c["naive"], lse, c["ref_lse"])
    _run(c, 2, None)  # 512-token splits
    assert len(gqa_calls) == 1
    for h_q, h_kv, dk in ((2, 2, 128), (8, 2, 64)):
        c = _case("cuda", "float16", b=b, h_q=h_q, h_kv=h_kv, lens=[1024] * b, dk=dk, seed=46)
        _run(c, 0, GQA)
    assert len(gqa_calls) == 1
    b = -(-3 * sms // (4 * 2))  # at most one program per SM unsplit: two splits of 1024 tokens
    c = _case("cuda", "float16", b=b, h_q=8, h_kv=2, lens=[2048] * b, dk=128, seed=48)
    out, lse = _run(c, 0, None)
    assert len(gqa_calls) == 2 and dp.plan(dp.DecodeProblem(b, 8, 2, 128, 128, 2048, 2),
                                           dp.facts_of(c["q"].device)).num_splits == 2
    _check(out, c["ref"], "float16", "gluon gqa automatic, split", c["naive"], lse, c["ref_lse"])


def _run_ptx_warp(ptx: str, regs: list[list[int]]) -> list[list[int]]:
    """Execute ``ptx`` (inline-asm text over 32-bit registers, the subset bitonic_ptx emits) on the
    32 lanes of a warp in lockstep; regs[lane] are the inputs $R.. $2R-1, the outputs come back."""
    n_in = len(regs[0])
    lanes = [{"%laneid": lane, **{f"${n_in + r}": v for r, v in enumerate(regs[lane])}} for lane in range(32)]

    def val(env, x):
        return env[x] if x in env else int(x, 0)

    for line in ptx.splitlines():
        line = line.strip().rstrip(";")
        if line in ("{", "}") or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        a = [x.strip() for x in args.split(",")]
        if op.startswith("shfl.sync.bfly"):
            src = [env[a[1]] for env in lanes]
            for lane, env in enumerate(lanes):
                env[a[0]] = src[lane ^ int(a[2], 0)]
            continue
        for env in lanes:
            if op in ("mov.u32", "mov.b32"):
                env[a[0]] = val(env, a[1])
            elif op == "and.b32":
                env[a[0]] = val(env, a[1]) & val(env, a[2])
            elif op in ("setp.eq.u32", "setp.ne.u32"):
                env[a[0]] = (val(env, a[1]) == val(env, a[2])) == (op == "setp.eq.u32")
            elif op == "xor.pred":
                env[a[0]] = env[a[1]] != env[a[2]]
            elif op in ("min.s32", "max.s32"):
                env[a[0]] = (min if op == "min.s32" else max)(val(env, a[1]), val(env, a[2]))
            elif op == "selp.b32":
                env[a[0]] = env[a[1]] if env[a[3]] else env[a[2]]
            else:
                raise AssertionError(f"unexpected instruction {line!r}")
    return [[env[f"${r}"] for r in range(n_in)] for env in lanes]


@pytest.mark.parametrize("keys", [32, 64, 128, 256, 512])
def test_bitonic_ptx_sorts(keys):
    """The PTX of the page sort's per-warp network (decode_gluon.bitonic_ptx), executed instruction by
    instruction for a warp: random keys, ties, the int32 maximum that pads a split's unsorted
    positions, and keys already in either order come out ascending in lane-major order."""
    ptx = tg.bitonic_ptx(keys)
    constraints = tg.asm_constraints(keys // 32)
    per_lane = keys // 32
    assert constraints.count("=r") == per_lane and constraints.count(",r") == per_lane
    rng = np.random.default_rng(keys)
    for data in (rng.integers(0, 1 << 20, keys), rng.integers(0, 4, keys),
                 np.where(np.arange(keys) < keys // 3, rng.integers(0, 1 << 31, keys), 2**31 - 1),
                 np.arange(keys), np.arange(keys)[::-1]):
        data = [int(x) for x in data]
        out = _run_ptx_warp(ptx, [data[lane * per_lane:(lane + 1) * per_lane] for lane in range(32)])
        assert sum(out, []) == sorted(data)


def _sort_keys_model(keys: list[int], warps: int) -> list[int]:
    """decode_gluon._sort_keys on lists, with its PTX executed by _run_ptx_warp: row w of warps
    rows in warp w; level 0 sorts each row, each level after it merges pairs of runs: the rows
    each thread holds by rows_merge_ptx (one lane a column), then each row by bitonic_ptx
    (merge_only); the runs a level leaves descending are negated around it."""
    n = len(keys)
    cols = n // warps
    per_lane = cols // 32
    rows = [keys[w * cols:(w + 1) * cols] for w in range(warps)]
    level = 0
    while 1 << level <= warps:
        rows = [[-v if (w >> level) & 1 else v for v in row] for w, row in enumerate(rows)]
        if level > 0:
            ptx = tg.rows_merge_ptx(warps, 1 << (level - 1))
            for c0 in range(0, cols, 32):
                merged = _run_ptx_warp(ptx, [[row[c] for row in rows] for c in range(c0, c0 + 32)])
                for c in range(32):
                    for w in range(warps):
                        rows[w][c0 + c] = merged[c][w]
        ptx = tg.bitonic_ptx(cols, level > 0)
        rows = [sum(_run_ptx_warp(ptx, [row[lane * per_lane:(lane + 1) * per_lane] for lane in range(32)]), [])
                for row in rows]
        rows = [[-v if (w >> level) & 1 else v for v in row] for w, row in enumerate(rows)]
        level += 1
    return sum(rows, [])


@pytest.mark.parametrize("keys,warps", [(256, 4), (512, 4), (1024, 4), (256, 8), (512, 8), (1024, 8), (64, 2)])
def test_sort_keys_network(keys, warps):
    """The warps' sort of the page sort (decode_gluon._sort_keys: a sort per warp, then bitonic
    merges across warps), its PTX executed for every warp: random keys, ties, the int32 maximum
    that pads the positions past a split and keys in either order come out ascending."""
    rng = np.random.default_rng(keys + warps)
    for data in (rng.integers(0, 1 << 20, keys), rng.integers(0, 4, keys),
                 np.where(np.arange(keys) < keys // 3, rng.integers(0, 1 << 31, keys), 2**31 - 1),
                 np.arange(keys), np.arange(keys)[::-1]):
        data = [int(x) for x in data]
        assert _sort_keys_model(data, warps) == sorted(data)


if tg.gluon is not None:
    gl = tg.gl

    @tg.gluon.jit
    def _sort_keys_kernel(Keys, Out, N: gl.constexpr):
        i = tg._sort_index(N)
        gl.store(Out + i, tg._sort_keys(gl.load(Keys + i), N))


@gluon_only
@pytest.mark.parametrize("keys,warps", [(256, 4), (512, 4), (1024, 4), (256, 8), (512, 8), (1024, 8)])
def test_sort_keys_kernel(keys, warps):
    """decode_gluon._sort_keys compiled and run (its layout conversions between the warps' rows
    and the threads' columns included) against torch.sort."""
    gen = torch.Generator().manual_seed(keys + warps)
    for data in (torch.randint(0, 1 << 20, (keys,), generator=gen), torch.randint(0, 4, (keys,), generator=gen),
                 torch.where(torch.arange(keys) < keys // 3, torch.randint(-(1 << 30), 1 << 30, (keys,), generator=gen),
                             2**31 - 1),
                 torch.arange(keys).flip(0)):
        x = data.to(torch.int32).cuda()
        out = torch.empty_like(x)
        _sort_keys_kernel[(1,)](x, out, N=keys, num_warps=warps)
        assert torch.equal(out, torch.sort(x).values)


def test_sort_size_rule():
    """decode_gluon.sort_size: the power of two that holds a split's pages, where a split has 256 to
    1024 pages of a size dividing the 64-token tile; 0 otherwise."""
    assert tg.sort_size(8192, 16, 32) == 256  # (1, 32/8, 128k) at 32 splits
    assert tg.sort_size(512, 16, 1) == 512 and tg.sort_size(513, 16, 1) == 1024  # 8k, one split
    assert tg.sort_size(1024, 16, 1) == 1024 and tg.sort_size(1025, 16, 1) == 0  # 16k
    assert tg.sort_size(2048, 16, 16) == 0 and tg.sort_size(2048, 16, 8) == 256  # 128 and 256 pages
    assert tg.sort_size(300, 16, 1) == 512  # rounded up to a power of two
    assert tg.sort_size(4096, 32, 8) == 512 and tg.sort_size(8192, 128, 4) == 0  # pages > the tile
    assert tg.sort_size(1023, 16, 4) == 256  # 256 pages a split, the last one short


def _page_tables(c, lens):
    """(name, case, out, lse) for the page sort's tables: the case's random one, one whose pages
    repeat (ties in the sort) and one already sorted; out/lse the float64 oracle over the pages
    each names ((B, H_kv, N, D) gathered from the pages)."""
    bt = c["block_table"]
    b, width = bt.shape
    repeated = bt.view(b, -1, 4)[:, :, :1].expand(b, width // 4, 4).reshape(b, width).contiguous()
    tables = {"random": bt, "repeated": repeated, "sorted": torch.sort(bt, dim=1).values.contiguous()}
    for name, table in tables.items():
        k = c["k_pages"][table.long()].flatten(1, 2).transpose(1, 2)
        v = c["v_pages"][table.long()].flatten(1, 2).transpose(1, 2)
        ref, ref_lse = reference.decode_attention(_np(c["q"]), _np(k), _np(v), context_lens=np.array(lens),
                                                  scale=c["scale"], return_lse=True)
        yield name, {**c, "block_table": table}, ref, ref_lse


@gluon_only
@pytest.mark.parametrize("h_q,h_kv,block_size,splits", [(8, 2, 16, (1, 2)), (16, 2, 32, (1,))])
def test_gluon_gqa_sorted_pages(h_q, h_kv, block_size, splits, poison, gqa_calls):
    """The GQA kernel visits the pages of splits of 256 to 1024 pages in address order (the
    in-kernel sort): ragged contexts (a partial last page, a sequence shorter than two tiles, an
    empty one), a table whose pages repeat (ties in the sort) and one already sorted, against
    float64 over the gathered pages; the same bits on every call and in a CUDA graph, and close to
    the kernel without the sort."""
    lens = [8192, 8150, 100, 0, 4200]
    c = _case("cuda", "float16", b=5, h_q=h_q, h_kv=h_kv, lens=lens, dk=128, block_size=block_size, seed=61)
    width = c["block_table"].shape[1]
    assert all(tg.sort_size(width, block_size, ns) >= 256 for ns in splits)
    for name, case, ref, ref_lse in _page_tables(c, lens):
        for ns in splits:
            out, lse = _run(case, ns, GQA)
            _check(out, ref, "float16", f"sorted pages, {name} table, splits={ns}", lse=lse, lse_ref=ref_lse)
            again, again_lse = _run(case, ns, GQA)
            assert torch.equal(out, again) and torch.equal(lse, again_lse)
            plain, plain_lse = _run(case, ns, {**GQA, "sort_pages": False})
            assert torch.allclose(out.float(), plain.float(), rtol=0, atol=2e-3)
            assert torch.allclose(lse, plain_lse, rtol=1e-5, atol=1e-5, equal_nan=True)
    assert len(gqa_calls) == 3 * 3 * len(splits)
    g = torch.cuda.CUDAGraph()  # the scratch is allocated in the capture, from the graph's pool
    with torch.cuda.graph(g):
        graph_out, graph_lse = _run(c, splits[-1], GQA)
    g.replay()
    torch.cuda.synchronize()
    out, lse = _run(c, splits[-1], GQA)
    assert torch.equal(graph_out, out) and torch.equal(graph_lse, lse)


@gluon_only
@pytest.mark.parametrize("dk,rows,warps,block_size", [(128, 64, 4, 16), (128, 64, 4, 32), (128, 64, 4, 8),
                                                      (64, 128, 8, 16)])
def test_gluon_mha_sorted_pages(dk, rows, warps, block_size, poison, gluon_calls):
    """The MHA kernel visits the pages of sequences of 256 to 1024 pages in address order (the
    in-kernel sort, on the kernel's 4- and 8-warp tiles): ragged contexts, a table whose pages
    repeat and one already sorted, against float64 over the gathered pages; the same bits on
    every call and in a CUDA graph, and close to the kernel without the sort."""
    lens = [8192, 8150, 100, 0, 4200]
    c = _case("cuda", "float16", b=5, h_q=2, h_kv=2, lens=lens, dk=dk, block_size=block_size, seed=63)
    width = c["block_table"].shape[1]
    config = {**MHA_FMA, "BLOCK_N": rows, "num_warps": warps}
    assert tg.sort_size(width, block_size, 1, rows) >= 256
    for name, case, ref, ref_lse in _page_tables(c, lens):
        out, lse = _run(case, 1, config)
        _check(out, ref, "float16", f"mha sorted pages, {name} table", lse=lse, lse_ref=ref_lse)
        again, again_lse = _run(case, 1, config)
        assert torch.equal(out, again) and torch.equal(lse, again_lse)
        plain, plain_lse = _run(case, 1, {**config, "sort_pages": False})
        assert torch.allclose(out.float(), plain.float(), rtol=0, atol=2e-3)
        assert torch.allclose(lse, plain_lse, rtol=1e-5, atol=1e-5, equal_nan=True)
    assert len(gluon_calls) == 3 * 3
    g = torch.cuda.CUDAGraph()  # the scratch is allocated in the capture, from the graph's pool
    with torch.cuda.graph(g):
        graph_out, graph_lse = _run(c, 1, config)
    g.replay()
    torch.cuda.synchronize()
    out, lse = _run(c, 1, config)
    assert torch.equal(graph_out, out) and torch.equal(graph_lse, lse)


@pytest.mark.parametrize("config", [MHA_FMA, {"mha_fma": False}])
def test_strided_block_table_and_context_lens(triton_device, config):
    """Views: a block table with a column stride of 2 (the Triton kernel follows its strides; the
    Gluon kernel takes unit-stride tables only) and context_lens taken every other element (read
    from a contiguous copy: until now the kernel read context_lens[b] at offset b of the view)."""
    c = _case(triton_device, "float16", b=3, h_q=2, h_kv=2, lens=[40, 1, 33], dk=128, block_size=16, seed=44)
    bt = c["block_table"]
    wide = torch.full((bt.shape[0], 2 * bt.shape[1]), -1, dtype=torch.int32, device=bt.device)
    wide[:, ::2] = bt
    lens = torch.stack([c["lens"], torch.full_like(c["lens"], -5)], 1).reshape(-1)[::2]
    assert wide[:, ::2].stride(1) == 2 and lens.stride(0) == 2
    out, lse = td._launch(c["q"], c["k_pages"], c["v_pages"], wide[:, ::2], lens, c["scale"], 1, config=config)
    _check(out, c["ref"], "float16", f"strided table and lens {config}", c["naive"], lse, c["ref_lse"])


@gluon_only
def test_gluon_mha_takes_only_what_fits(monkeypatch):
    """Splits, a tile the kernel does not run (64 rows at d = 32), DK != DV, fp32 and 128-row pages
    (not whole pages of a 64-row tile) stay on the Triton kernel."""
    calls = []
    monkeypatch.setattr(tg, "launch", lambda *args: calls.append(1))
    for dtype, dk, dv, block_size, ns in (("float16", 128, 128, 16, 2), ("float16", 32, 32, 16, 1),
                                          ("float16", 128, 96, 16, 1), ("float32", 128, 128, 16, 1),
                                          ("float16", 128, 128, 128, 1)):
        c = _case("cuda", dtype, b=2, h_q=2, h_kv=2, lens=[300, 5], dk=dk, dv=dv, block_size=block_size, seed=43)
        out, lse = _run(c, ns, MHA_FMA)
        _check(out, c["ref"], dtype, f"not gluon {dtype} dk={dk} dv={dv} bs={block_size} splits={ns}", c["naive"],
               lse, c["ref_lse"])
    assert not calls


@pytest.mark.parametrize("h_q,h_kv,block_n", [(4, 4, 256), (8, 2, 128), (8, 2, 256)])
def test_small_head_rows_exact(triton_device, h_q, h_kv, block_n, poison):
    """The tiles small heads get on a GPU (128 and 256 rows at d = 32), forced here: MHA and GQA,
    contexts of one token, one partial tile and several, pages of 16 and 64, one split and three."""
    for block_size in (16, 64):
        c = _case(triton_device, "float16", b=3, h_q=h_q, h_kv=h_kv, lens=[1, 100, 600], dk=32, block_size=block_size,
                  seed=block_n + block_size)
        for ns in (1, 3):
            out, lse = _run(c, ns, {"mha_fma": False, "BLOCK_N": block_n, "num_warps": 4, "num_stages": 3})
            _check(out, c["ref"], "float16", f"rows {block_n} bs={block_size} splits={ns}", c["naive"], lse,
                   c["ref_lse"])


@pytest.mark.parametrize("paged", [True, False])
def test_long_tile_exact(triton_device, paged, poison):
    """The long tile (128 rows, 8 warps) forced on short contexts: a partial last tile, a context
    shorter than one tile, splits past the end; paged and contiguous."""
    c = _case(triton_device, "float16", b=3, h_q=8, h_kv=2, lens=[300, 17, 129], dk=64, block_size=16, seed=14)
    for ns in (1, 3):
        if paged:
            out, lse = _run(c, ns, {"BLOCK_N": 128, "num_warps": 8})
        else:
            out, lse = td._launch(c["q"], c["k"], c["v"], None, c["lens"], c["scale"], ns,
                                  config={"BLOCK_N": 128, "num_warps": 8})
        _check(out, c["ref"], "float16", f"long tile paged={paged} splits={ns}", c["naive"], lse, c["ref_lse"])


@cuda_only
def test_long_tile_chosen_and_exact(triton_device, poison):
    """On a GPU with the shared memory for it, 2 splits of >= 4096 tokens take the long tile by
    themselves; exact with a partial last block and a short sequence."""
    c = _case(triton_device, "float16", b=2, h_q=8, h_kv=2, lens=[9000, 4100], dk=128, block_size=16, seed=15)
    facts = dp.facts_of(c["q"].device)
    plan = dp.plan(td.problem_of(c["q"], c["k_pages"], c["v_pages"], c["block_table"]), facts, None, 2)
    if not dp._long_tile_fits(facts.smem_per_block, 2, 128, 128):
        pytest.skip("this GPU's shared memory does not hold the long tile")
    assert plan.block_n == 128 and plan.num_warps == 8
    out, lse = _run(c, 2, None)
    _check(out, c["ref"], "float16", "long tile, 2 splits", c["naive"], lse, c["ref_lse"])


class _LaunchSpy:
    """Stands in for a Triton kernel: records the grid of each launch, then launches."""

    def __init__(self, kernel):
        self.kernel, self.grids = kernel, []

    def __getitem__(self, grid):
        self.grids.append(grid)
        return self.kernel[grid]


def test_default_launch_uses_fused_for_few_splits(triton_device, monkeypatch, poison):
    """The op with no config: a 2..4-split launch merges in the decode kernel (the counter workspace
    is made and left at zero, no reduce kernel runs); with many splits the reduce kernel merges.
    (The workspace is emptied and the reduce kernel watched: the launch's doings, not the plan's.)"""
    monkeypatch.setattr(td, "_COUNTERS", {})
    reduce_spy = _LaunchSpy(td._reduce_kernel)
    monkeypatch.setattr(td, "_reduce_kernel", reduce_spy)
    # one KV head, 10 tiles of 64: 2 splits on CPU (4 "SMs") and on any GPU (>= 4 tiles a split)
    c = _case(triton_device, "float16", b=1, h_q=4, h_kv=1, lens=[600], dk=32, block_size=16, seed=12)
    plan = dp.plan(td.problem_of(c["q"], c["k_pages"], c["v_pages"], c["block_table"]), dp.facts_of(c["q"].device))
    assert plan.num_splits == 2 and plan.config["fused_reduce"] and plan.merge == "fused"
    out, lse = _run(c, 0, None)
    _check(out, c["ref"], "float16", "default fused", c["naive"], lse, c["ref_lse"])
    assert reduce_spy.grids == [] and td._COUNTERS and _counters_zero(triton_device)
    out, lse = _run(c, 8, None)
    _check(out, c["ref"], "float16", "8 splits", c["naive"], lse, c["ref_lse"])
    assert len(reduce_spy.grids) == 1


# --------------------------------------------------------------------------- CUDA graphs


@cuda_only
@pytest.mark.parametrize("config", [None, FUSED, {**FUSED, "pdl": True}, {"pdl": True},
                                    {**FUSED, "early_pages": False}, {"gluon_gqa": True, "pdl": True}])
def test_cuda_graph_replay(triton_device, config):
    """Captured once, replayed many times with new context_lens: exact every time, counters at zero."""
    c = _case(triton_device, "float16", b=3, h_q=8, h_kv=2, lens=[300, 17, 1000], dk=128, seed=8)
    lens = c["lens"].clone()
    for ns in (4, 7):
        _run(c, ns, config, lens=lens)  # compile (and make the workspace) outside the capture
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out, lse = _run(c, ns, config, lens=lens)
        for new in ([300, 17, 1000], [1, 999, 16], [0, 5, 1000]) * 2:
            lens.copy_(torch.tensor(new, dtype=torch.int32))
            g.replay()
            torch.cuda.synchronize()
            ref_out, ref_lse = reference.decode_attention(_np(c["q"]), _np(c["k"]), _np(c["v"]),
                                                          context_lens=np.array(new), scale=c["scale"],
                                                          return_lse=True)
            _check(out, ref_out, "float16", f"graph {config} splits={ns} lens={new}", lse=lse, lse_ref=ref_lse)
            assert _counters_zero(triton_device)


@cuda_only
def test_capture_makes_its_own_workspace(triton_device, monkeypatch):
    """A first fused call inside a capture zeroes a new workspace (a memset in the graph) and
    stays fused and exact on every replay."""
    monkeypatch.setattr(td, "_COUNTERS", {})
    c = _case(triton_device, "float16", b=2, h_q=8, h_kv=2, lens=[500, 40], dk=128, seed=9)
    _run(c, 3, TWO_KERNEL)  # compile outside the capture
    _run(c, 3, FUSED)
    torch.cuda.synchronize()
    monkeypatch.setattr(td, "_COUNTERS", {})
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out, lse = _run(c, 3, FUSED)
    assert len(td._COUNTERS) == 1
    for _ in range(3):
        g.replay()
        torch.cuda.synchronize()
        _check(out, c["ref"], "float16", "fused in capture", lse=lse, lse_ref=c["ref_lse"])
        assert _counters_zero(triton_device)


@cuda_only
def test_two_streams_do_not_share_counters(triton_device):
    """Fused launches on two streams at once: each stream has its own counters, both exact."""
    cases = [_case(triton_device, "float16", b=4, h_q=8, h_kv=2, lens=[2000, 1500, 999, 3000], dk=128,
                   seed=s) for s in (10, 11)]
    for c in cases:
        _run(c, 3, FUSED)  # compile
    torch.cuda.synchronize()
    streams = [torch.cuda.Stream() for _ in cases]
    results = []
    for _ in range(20):
        for c, st in zip(cases, streams):
            st.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(st):
                results.append((c, _run(c, 3, FUSED)))
        torch.cuda.synchronize()
    for c, (out, lse) in results:
        _check(out, c["ref"], "float16", "two streams", lse=lse, lse_ref=c["ref_lse"])
    assert _counters_zero(triton_device)