"""Attention variants (window, softcap, sinks, ALiBi, key_start) in the Triton decode against the float64
oracle (flashcl.reference.decode_attention), on every path: the dot kernel (whole pages, tiles
inside a page, masked rows, contiguous), the MHA CUDA-core loop, one split, the fused merge and the
reduce kernel. Native on CUDA, TRITON_INTERPRET=1 on CPU (small shapes).

The query of sequence b sits at position p = context_lens[b] - 1; window (left, right) shows it
the keys [max(0, p - left), p] (right has no key to reach in decode); key_start[b] hides the keys
before it.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import flashcl  # noqa: E402
from flashcl import reference  # noqa: E402
from tests._check import check_out_and_lse  # noqa: E402
from flashcl.triton import decode as triton_decode  # noqa: E402
from flashcl.triton import decode_plan as dp  # noqa: E402

TOL = reference.TOLERANCE


@pytest.fixture
def poison(monkeypatch):
    """Every buffer the launch allocates starts as NaN, so an unwritten element fails."""
    monkeypatch.setattr(triton_decode, "_empty", lambda shape, dtype, device: torch.full(
        shape, float("nan"), dtype=dtype, device=device))


def _gen(seed):
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def _np(x):
    return x.detach().to("cpu", torch.float64).numpy()


def _case(device, dtype, *, b, h_q, h_kv, lens, d=32, dv=None, block_size=16, seed=0, poison_hidden=None,
          **variants):
    """q, a contiguous (B, H_kv, N_max, D) cache and its paged copy (permuted blocks), the oracle's
    out/lse for ``variants`` (window, softcap, sinks, alibi_slopes, key_start; torch tensors or
    values). ``poison_hidden`` (a float, e.g. nan): written into K and V at every key no query
    sees (before the window or the key start, past the context, the pages no sequence uses) after
    the oracle ran."""
    dv = dv or d
    gen = _gen(seed)
    tdt = getattr(torch, dtype)
    n_max = max(max(lens), 1)
    q = torch.randn((b, h_q, d), generator=gen).to(tdt)
    k = torch.randn((b, h_kv, n_max, d), generator=gen).to(tdt)
    v = torch.randn((b, h_kv, n_max, dv), generator=gen).to(tdt)
    per_seq = -(-n_max // block_size)
    num_blocks = b * per_seq + 2
    bt = torch.randperm(num_blocks, generator=gen)[: b * per_seq].view(b, per_seq).to(torch.int32)
    scale = 1.0 / math.sqrt(d)
    ref_kw = {n: (_np(x) if torch.is_tensor(x) else x) for n, x in variants.items()}
    ref_out, ref_lse = reference.decode_attention(_np(q), _np(k), _np(v), context_lens=np.array(lens), scale=scale,
                                                  return_lse=True, **ref_kw)
    if poison_hidden is not None:
        left = (variants.get("window") or (-1, -1))[0]
        starts = variants.get("key_start")
        for i, n in enumerate(lens):
            lo = max(0, n - 1 - left) if left >= 0 else 0
            lo = lo if starts is None else min(max(lo, int(starts[i])), n_max)
            k[i, :, :lo] = poison_hidden
            v[i, :, :lo] = poison_hidden
            k[i, :, n:] = poison_hidden
            v[i, :, n:] = poison_hidden

    def to_pages(x):
        pages = torch.full((num_blocks, block_size, h_kv, x.shape[3]),
                           poison_hidden if poison_hidden is not None else 0.5, dtype=tdt)
        padded = torch.nn.functional.pad(x, (0, 0, 0, per_seq * block_size - n_max))
        if poison_hidden is not None:
            padded[:, :, n_max:] = poison_hidden
        pages[bt.flatten().long()] = padded.view(b, h_kv, per_seq, block_size, -1).permute(0, 2, 3, 1, 4).reshape(
            -1, block_size, h_kv, x.shape[3])
        return pages.to(device)

    dev = {n: (x.to(device) if torch.is_tensor(x) else x) for n, x in variants.items()}
    return {"q": q.to(device), "k": k.to(device), "v": v.to(device), "k_pages": to_pages(k), "v_pages": to_pages(v),
            "block_table": bt.to(device), "lens": torch.tensor(lens, dtype=torch.int32, device=device),
            "scale": scale, "ref": ref_out, "ref_lse": ref_lse, "variants": dev, "dtype": dtype}


def _check(out, lse, c, what):
    check_out_and_lse(_np(out), _np(lse), c["ref"], c["ref_lse"], c["dtype"], what, lse_rtol=1e-4)


def _run(c, num_splits, paged=True, config=None):
    """flashcl.decode (config None) or the launch with plan overrides (config: _KNOBS / tile)."""
    if config is None:
        k, v = (c["k_pages"], c["v_pages"]) if paged else (c["k"], c["v"])
        return flashcl.decode(c["q"], k, v, block_table=c["block_table"] if paged else None, context_lens=c["lens"],
                              num_splits=num_splits, backend="triton", return_lse=True, **c["variants"])
    var = c["variants"]
    window = var.get("window")
    sl = var.get("alibi_slopes")
    return triton_decode._launch(
        c["q"], c["k_pages"], c["v_pages"], c["block_table"], c["lens"], c["scale"], num_splits, config=config,
        window_left=window[0] if window else -1, softcap=var.get("softcap") or 0.0, sinks=var.get("sinks"),
        alibi_slopes=None if sl is None else sl.to(torch.float32).expand(c["q"].shape[0], c["q"].shape[1]),
        key_start=var.get("key_start"))


def _plan(c, num_splits, config=None):
    var = c["variants"]
    window = var.get("window")
    problem = triton_decode.problem_of(c["q"], c["k_pages"], c["v_pages"], c["block_table"],
                                       window[0] if window else -1, var.get("softcap") or 0.0, var.get("sinks"),
                                       var.get("alibi_slopes"), key_start=var.get("key_start"))
    return dp.plan(problem, dp.facts_of(c["q"].device), config, num_splits)


def _variants(kind, h_q, b, gen):
    sinks = torch.randn((h_q,), generator=gen) * 2
    slopes = torch.rand((b, h_q), generator=gen) * 0.3
    return {"window": {"window": (37, 0)}, "softcap": {"softcap": 4.0}, "sinks": {"sinks": sinks},
            "alibi": {"alibi_slopes": slopes},
            "all": {"window": (50, 3), "softcap": 7.5, "sinks": sinks, "alibi_slopes": slopes},
            # a window that several splits of the Gluon GQA kernel's 64-key tiles share
            "all_wide": {"window": (200, 0), "softcap": 7.5, "sinks": sinks, "alibi_slopes": slopes},
            # (four sequences of 0, 1, 150 and 700 keys) first keys before, inside and past a
            # window of 300, and past a context
            "key_start": {"key_start": torch.tensor([0, 1, 37, 130], dtype=torch.int32)},
            "key_start_all": {"window": (300, 0), "softcap": 7.5, "sinks": sinks, "alibi_slopes": slopes,
                              "key_start": torch.tensor([3, 5, 149, 500], dtype=torch.int32)}}[kind]


# --------------------------------------------------------------------------- each variant, each merge


@pytest.mark.parametrize("kind", ["window", "softcap", "sinks", "alibi", "all"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_each_variant_and_all(triton_device, kind, dtype, poison):
    """Each variant alone and all together, GQA 4, contexts 0 / 1 / partial block / several tiles,
    paged and contiguous; one split, 2 (fused merge), 5 (reduce kernel) and the automatic count."""
    var = _variants(kind, 8, 4, _gen(1))
    c = _case(triton_device, dtype, b=4, h_q=8, h_kv=2, lens=[0, 1, 23, 150], seed=2, **var)
    for paged in (True, False):
        for ns in (None, 1, 2, 5):
            out, lse = _run(c, ns, paged)
            _check(out, lse, c, f"{kind} paged={paged} splits={ns}")
    assert _plan(c, 2).merge == "fused" and _plan(c, 5).merge == "reduce"


@pytest.mark.parametrize("h_q,h_kv", [(4, 4), (8, 1)])
def test_mha_and_mqa_all_variants_bfloat16(triton_device, h_q, h_kv, poison):
    """MHA and MQA 8 with every variant, bfloat16, DK != DV, block size 8."""
    var = _variants("all", h_q, 3, _gen(3))
    c = _case(triton_device, "bfloat16", b=3, h_q=h_q, h_kv=h_kv, lens=[70, 9, 33], d=32, dv=48, block_size=8,
              seed=4, **var)
    for ns in (1, 3):
        out, lse = _run(c, ns)
        _check(out, lse, c, f"splits={ns}")


# --------------------------------------------------------------------------- windows at tile edges


def _block_n(c, config=None):
    return _plan(c, 1, config).block_n


@pytest.mark.parametrize("path", ["whole_pages", "masked_rows", "masked_rows_large_blocks", "late_pages", "page_tiles",
                                  "mha_fma", "contiguous"])
def test_window_edges(triton_device, path, poison):
    """Windows of left 0, 1, tile - 1, tile, tile + 1, 2 tiles + 3 and past the context, right 0
    and > 0, over contexts of one key, a tile, a tile + 1 and several tiles: on each addressing of
    the dot kernel and on the MHA loop, 1 and 3 splits."""
    block_size, h_q, h_kv, config, dtype = {
        "whole_pages": (16, 4, 1, None, "float32"),
        "masked_rows": (16, 4, 1, {"whole_pages": False}, "float32"),
        "masked_rows_large_blocks": (128, 4, 1, {"whole_pages": False}, "float32"),
        "late_pages": (16, 4, 1, {"early_pages": False}, "float32"),
        "page_tiles": (128, 4, 1, {"BLOCK_N": 64}, "float32"),
        "mha_fma": (16, 1, 1, {"mha_fma": True}, "float16"),
        "contiguous": (16, 4, 1, None, "float32"),
    }[path]
    d = 128 if path == "mha_fma" else 32
    lens = [1, 64, 65, 200]
    probe = _case(triton_device, dtype, b=len(lens), h_q=h_q, h_kv=h_kv, lens=lens, d=d, block_size=block_size)
    bn = _block_n(probe, config)
    if path == "page_tiles":
        assert _plan(probe, 1, config).page_tiles
    for i, (left, right) in enumerate([(0, 0), (1, 0), (bn - 1, 0), (bn, 2), (bn + 1, 0), (2 * bn + 3, 5),
                                       (5000, 0)]):
        c = _case(triton_device, dtype, b=len(lens), h_q=h_q, h_kv=h_kv, lens=lens, d=d, block_size=block_size,
                  seed=10 + i, window=(left, right))
        if path == "mha_fma" and left < 200:  # a window that hides keys: the MHA loop, never Gluon
            assert _plan(c, 1, config).kernel == "mha_fma"
        for ns in (1, 3):
            if path == "contiguous":
                out, lse = _run(c, ns, paged=False)
            else:
                out, lse = _run(c, ns, config=config)
            _check(out, lse, c, f"{path} window=({left},{right}) tile {bn} splits={ns}")


def test_window_on_a_contiguous_cache_without_lengths(triton_device, poison):
    """Without context_lens every sequence is N_max long: the window ends at N_max - 1."""
    c = _case(triton_device, "float32", b=2, h_q=4, h_kv=2, lens=[90, 90], seed=15, window=(20, 0), softcap=3.0)
    for ns in (1, 3):
        out, lse = flashcl.decode(c["q"], c["k"], c["v"], num_splits=ns, backend="triton", return_lse=True,
                                  **c["variants"])
        _check(out, lse, c, f"no lengths splits={ns}")


# --------------------------------------------------------------------------- key_start


@pytest.mark.parametrize("path", ["whole_pages", "masked_rows", "late_pages", "page_tiles", "mha_fma", "contiguous"])
def test_key_start_edges(triton_device, path, poison):
    """Per-sequence first keys at 0, 1, tile - 1, tile, tile + 1, the last key, the length, past it
    and below 0, over contexts of one key, a tile, a tile + 1 and several tiles, alone and under a
    window with softcap and ALiBi; NaN in K and V before each first key (and past the context)
    never reaches a row, and a row with no key left is zeros. Each addressing of the dot kernel and
    the MHA loop, 1 and 3 splits."""
    block_size, h_q, config, dtype = {
        "whole_pages": (16, 4, None, "float32"),
        "masked_rows": (16, 4, {"whole_pages": False}, "float32"),
        "late_pages": (16, 4, {"early_pages": False}, "float32"),
        "page_tiles": (128, 4, {"BLOCK_N": 64}, "float32"),
        "mha_fma": (16, 1, {"mha_fma": True}, "float16"),
        "contiguous": (16, 4, None, "float32"),
    }[path]
    d = 128 if path == "mha_fma" else 32
    lens = [1, 64, 65, 200]
    probe = _case(triton_device, dtype, b=len(lens), h_q=h_q, h_kv=1, lens=lens, d=d, block_size=block_size)
    bn = _block_n(probe, config)
    gen = _gen(40)
    slopes = torch.rand((len(lens), h_q), generator=gen) * 0.2
    for i, starts in enumerate([(0, bn - 1, bn, 199), (1, bn + 1, 65, 300), (-3, 63, 64, 2 * bn + 3)]):
        for extra in ({}, {"window": (40, 0), "softcap": 5.0, "alibi_slopes": slopes}):
            c = _case(triton_device, dtype, b=len(lens), h_q=h_q, h_kv=1, lens=lens, d=d, block_size=block_size,
                      seed=41 + i, poison_hidden=float("nan"), key_start=torch.tensor(starts, dtype=torch.int32),
                      **extra)
            if path == "mha_fma":  # a variant on: the MHA loop, never Gluon
                assert _plan(c, 1, config).kernel == "mha_fma"
            for ns in (1, 3):
                out, lse = _run(c, ns, paged=path != "contiguous", config=None if path == "contiguous" else config)
                _check(out, lse, c, f"{path} key_start={starts} {sorted(extra)} tile {bn} splits={ns}")
                if starts[0] >= lens[0]:  # no key left: zeros
                    assert (_np(out)[0] == 0).all()


def test_key_start_of_zeros_and_errors(triton_device, poison):
    """A key_start of zeros gives the plain kernel's bits, a strided one its values; its shape and
    dtype are checked before launch."""
    c = _case(triton_device, "float16", b=2, h_q=4, h_kv=2, lens=[30, 64], seed=45)
    plain = flashcl.decode(c["q"], c["k_pages"], c["v_pages"], block_table=c["block_table"], context_lens=c["lens"],
                           backend="triton")
    zeros = torch.zeros(2, dtype=torch.int32, device=triton_device)
    started = flashcl.decode(c["q"], c["k_pages"], c["v_pages"], block_table=c["block_table"],
                             context_lens=c["lens"], backend="triton", key_start=zeros)
    assert torch.equal(plain, started)
    strided = torch.tensor([[3, 7], [9, 7]], dtype=torch.int32, device=triton_device)[:, 0]  # the op reads it too
    args = (c["q"], c["k_pages"], c["v_pages"], c["block_table"], c["lens"], c["scale"], 1)
    assert torch.equal(torch.ops.flashcl.decode(*args, key_start=strided)[0],
                       torch.ops.flashcl.decode(*args, key_start=strided.contiguous())[0])
    for bad, err in ((torch.zeros(3, dtype=torch.int32), ValueError), (torch.zeros(2, dtype=torch.int64), TypeError)):
        with pytest.raises(err, match="key_start"):
            flashcl.decode(c["q"], c["k_pages"], c["v_pages"], block_table=c["block_table"], context_lens=c["lens"],
                           backend="triton", key_start=bad.to(triton_device))


# --------------------------------------------------------------------------- hidden keys


@pytest.mark.parametrize("path", ["whole_pages", "masked_rows", "mha_fma", "contiguous"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_hidden_keys_never_leak(triton_device, path, value, poison):
    """NaN or inf in K and V at every key outside the window and past the context (including the
    rows a tile past the end reads as stand-ins) leave every output finite and right."""
    config = {"masked_rows": {"whole_pages": False}, "mha_fma": {"mha_fma": True}}.get(path)
    h_q, d, dtype = (2, 128, "float16") if path == "mha_fma" else (8, 32, "float32")
    gen = _gen(7)
    var = {"window": (40, 0), "softcap": 6.0, "sinks": torch.randn((h_q,), generator=gen),
           "alibi_slopes": torch.rand((3, h_q), generator=gen) * 0.2}
    c = _case(triton_device, dtype, b=3, h_q=h_q, h_kv=2, lens=[100, 41, 170], d=d, seed=8, poison_hidden=value,
              **var)
    for ns in (1, 2, 5):
        out, lse = _run(c, ns, paged=path != "contiguous", config=config)
        _check(out, lse, c, f"{path} {value} splits={ns}")


# --------------------------------------------------------------------------- sinks, ALiBi


def test_sinks_rows_without_keys_and_split_k(triton_device, poison):
    """A sink joins each row once whatever the split count (more splits than tiles, empty splits):
    a context of 0 returns zeros with lse = sink; a sink of -inf is no sink."""
    sinks = torch.tensor([0.5, -1.0, 3.0, float("-inf")])
    c = _case(triton_device, "float32", b=3, h_q=4, h_kv=2, lens=[0, 5, 300], seed=9, sinks=sinks)
    for ns in (1, 2, 4, 7, 33):
        out, lse = _run(c, ns)
        _check(out, lse, c, f"splits={ns}")
        assert (_np(out)[0] == 0).all() and np.allclose(_np(lse)[0, :3], sinks[:3].numpy())


def test_alibi_per_batch_slopes(triton_device, poison):
    """ALiBi with different slopes per sequence and head, against each sequence's own slopes
    (a batch of one with the same slopes gives the same row), and large slopes."""
    gen = _gen(11)
    slopes = torch.rand((3, 4), generator=gen) * torch.tensor([[0.01], [0.5], [4.0]])
    c = _case(triton_device, "float32", b=3, h_q=4, h_kv=1, lens=[90, 90, 90], seed=12, alibi_slopes=slopes)
    for ns in (1, 3):
        out, lse = _run(c, ns)
        _check(out, lse, c, f"splits={ns}")
    # (H_q,) slopes broadcast over the batch
    c1 = _case(triton_device, "float32", b=3, h_q=4, h_kv=1, lens=[90, 10, 50], seed=12, alibi_slopes=slopes[1])
    out, lse = _run(c1, 2)
    _check(out, lse, c1, "(H_q,) slopes")


# --------------------------------------------------------------------------- plain path, routing, errors


def test_plain_path_unchanged_and_window_that_hides_nothing(triton_device, poison):
    """Without variants the plan and the kernel are the plain ones; a window reaching the first key
    of the longest context is off (same plan, same bits)."""
    c = _case(triton_device, "float16", b=2, h_q=4, h_kv=2, lens=[30, 64], seed=13)
    plain = _plan(c, 0)
    assert plain.problem.variants == () and plain.problem.window_left == -1
    out, lse = _run(c, None)
    _check(out, lse, c, "plain")
    wide = {**c, "variants": {"window": (63, 0)}}
    assert _plan(wide, 0) == plain
    out_w, lse_w = _run(wide, None)
    assert torch.equal(out_w, out) and torch.equal(lse_w, lse)


def test_plan_routes_variants():
    """On a Hopper with Gluon, the Gluon GQA kernel keeps the launches it takes plain with any
    variant on, at the same split count; the Gluon MHA kernel takes none (they go to the MHA loop);
    a window's span decides the split count and whether the GQA rule takes the launch."""
    facts = dp.DeviceFacts(sms=132, smem_per_block=227 * 1024, capability=(9, 0), gluon=True)
    gqa = dp.DecodeProblem(1, 32, 8, 128, 128, 32768, 2, 16)
    mha = dp.DecodeProblem(8, 32, 32, 128, 128, 8192, 2, 16)
    plain_gqa = dp.plan(gqa, facts)
    assert plain_gqa.kernel == "gluon_gqa" and dp.plan(mha, facts).kernel == "gluon_mha"
    for name in ("alibi", "sinks", "softcap", "key_start"):
        with_variant = dp.plan(replace(gqa, variants=(name,)), facts)
        assert with_variant.kernel == "gluon_gqa" and with_variant.num_splits == plain_gqa.num_splits
        assert dp.plan(replace(mha, variants=(name,)), facts).kernel == "mha_fma"
    assert dp.plan(replace(mha, variants=("window",), window_left=1023), facts).kernel == "mha_fma"
    windowed = dp.plan(replace(gqa, variants=("window",), window_left=127), facts)
    assert windowed.kernel == "dot" and windowed.num_splits <= 2 < plain_gqa.num_splits  # 128 keys: two tiles
    batched = replace(gqa, b=8)  # 64 programs: the GQA rule's 4 splits of 1024 keys cover a 4096-key window
    assert dp.plan(replace(batched, variants=("window",), window_left=4095), facts).kernel == "gluon_gqa"
    assert dp.plan(replace(batched, variants=("window",), window_left=2047), facts).kernel == "dot"
    with pytest.raises(ValueError, match="unknown decode variants"):
        dp.plan(replace(gqa, variants=("mask",)), facts)


def test_mask_refused_and_custom_op_schema(triton_device):
    """A mask (prefill only) is refused before launch; the op carries the variant arguments and
    its fake kernel agrees (opcheck)."""
    c = _case(triton_device, "float32", b=2, h_q=2, h_kv=1, lens=[5, 3], d=16, block_size=4, seed=14)
    from flashcl.variants import Variants

    with pytest.raises(ValueError, match="mask"):
        triton_decode.decode(c["q"], c["k_pages"], c["v_pages"], block_table=c["block_table"], context_lens=c["lens"],
                             scale=c["scale"], variants=Variants(mask=torch.ones((1, 1, 1, 5), dtype=torch.bool)))
    sinks = torch.tensor([0.1, -0.2], device=triton_device)
    slopes = torch.tensor([[0.1, 0.2], [0.3, 0.4]], device=triton_device)
    args = (c["q"], c["k_pages"], c["v_pages"], c["block_table"], c["lens"], c["scale"], 2, 2, 3.0, sinks, slopes)
    torch.library.opcheck(torch.ops.flashcl.decode.default, args, test_utils=("test_schema", "test_faketensor"))
    starts = torch.tensor([1, 0], dtype=torch.int32, device=triton_device)
    torch.library.opcheck(torch.ops.flashcl.decode.default, args, {"key_start": starts},
                          test_utils=("test_schema", "test_faketensor"))


# --------------------------------------------------------------------------- the Gluon GQA kernel

GQA = {"gluon_gqa": True}  # the Gluon GQA kernel forced wherever it can run


@pytest.fixture
def gqa_calls(monkeypatch):
    """The Gluon GQA kernel's launches, with the variants each one took."""
    from flashcl.triton import decode_gluon

    calls = []
    launch = decode_gluon.launch_gqa
    monkeypatch.setattr(decode_gluon, "launch_gqa", lambda *a, **kw: (calls.append(
        {n for n in ("sinks", "alibi_slopes", "key_start") if kw.get(n) is not None}
        | {n for n in ("window_left",) if kw.get(n, -1) >= 0} | {n for n in ("softcap_log2",) if kw.get(n, 0) > 0}),
        launch(*a, **kw))[1])
    return calls


def _gluon_runs():
    from flashcl.triton import decode_gluon

    return torch.cuda.is_available() and decode_gluon.available()


gluon_only = pytest.mark.skipif(not _gluon_runs(), reason="needs CUDA and Gluon")
_TAKEN = {"window": {"window_left"}, "softcap": {"softcap_log2"}, "sinks": {"sinks"}, "alibi": {"alibi_slopes"},
          "all": {"window_left", "softcap_log2", "sinks", "alibi_slopes"},
          "all_wide": {"window_left", "softcap_log2", "sinks", "alibi_slopes"},
          "key_start": {"key_start"}, "key_start_all": {"key_start", "window_left", "softcap_log2", "sinks",
                                                         "alibi_slopes"}}


@gluon_only
@pytest.mark.parametrize("kind", ["window", "softcap", "sinks", "alibi", "all", "all_wide", "key_start",
                                  "key_start_all"])
@pytest.mark.parametrize("dtype,h_q,h_kv,block_size", [("float16", 8, 2, 16), ("bfloat16", 16, 2, 1),
                                                       ("float16", 32, 2, 64)])  # groups 4, 8, 16
def test_gluon_gqa_variants(kind, dtype, h_q, h_kv, block_size, poison, gqa_calls):
    """The Gluon GQA kernel (forced) with each variant alone and all together (a window inside a
    split, and one of 201 keys over several), groups 4, 8 and 16, pages of 1, 16 and 64 tokens,
    contexts 0, 1, 150 and 700: one split, 3 and 16 (the reduce kernel; empty splits), against
    the oracle and against the dot path."""
    var = _variants(kind, h_q, 4, _gen(21))
    c = _case("cuda", dtype, b=4, h_q=h_q, h_kv=h_kv, lens=[0, 1, 150, 700], d=128, block_size=block_size,
              seed=22, **var)
    for ns in (1, 3, 16):
        out, lse = _run(c, ns, config=GQA)
        assert gqa_calls[-1] == _TAKEN[kind]
        _check(out, lse, c, f"gluon gqa {kind} {dtype} {h_q}/{h_kv} bs={block_size} splits={ns}")
        dot_out, dot_lse = _run(c, ns, config={"gluon_gqa": False})
        assert torch.allclose(out.float(), dot_out.float(), rtol=2e-2, atol=2e-3)
    assert len(gqa_calls) == 3


@gluon_only
@pytest.mark.parametrize("value", [None, float("nan"), float("inf")])
def test_gluon_gqa_window_edges(value, poison, gqa_calls):
    """Windows of left 0, 1, tile - 1, tile, tile + 1, 2 tiles + 3 and past the context (tiles of
    64 keys), over contexts of one key, a tile, a tile + 1, 200 and 1000; NaN or inf in K and V at
    every key outside the window and past the context never reach a row. 1, 3 and 16 splits."""
    lens = [1, 64, 65, 200, 1000]
    for i, left in enumerate([0, 1, 63, 64, 65, 131, 5000]):
        c = _case("cuda", "float16", b=len(lens), h_q=8, h_kv=2, lens=lens, d=128, seed=30 + i, window=(left, 0),
                  softcap=20.0, poison_hidden=value)
        for ns in (1, 3, 16):
            out, lse = _run(c, ns, config=GQA)
            _check(out, lse, c, f"gluon gqa window=({left},0) hidden={value} splits={ns}")
    assert len(gqa_calls) == 7 * 3


@gluon_only
def test_gluon_gqa_key_start_edges(poison, gqa_calls):
    """First keys at 0, 1, tile - 1, tile, tile + 1, the last key, the length, past it and below 0
    (tiles of 64 keys), over contexts of one key, a tile, a tile + 1, 200 and 1000, alone and under
    a window; NaN in K and V before each first key never reaches a row. 1, 3 and 16 splits."""
    lens = [1, 64, 65, 200, 1000]
    for i, starts in enumerate([(0, 63, 64, 199, 999), (1, 65, 65, 200, 1001), (-3, 1, 0, 65, 130)]):
        for window in (None, (500, 0)):
            c = _case("cuda", "float16", b=len(lens), h_q=8, h_kv=2, lens=lens, d=128, seed=50 + i, window=window,
                      key_start=torch.tensor(starts, dtype=torch.int32), poison_hidden=float("nan"))
            for ns in (1, 3, 16):
                out, lse = _run(c, ns, config=GQA)
                _check(out, lse, c, f"gluon gqa key_start={starts} window={window} splits={ns}")
    assert len(gqa_calls) == 3 * 2 * 3


@gluon_only
def test_gluon_gqa_sinks_rows_without_keys(poison, gqa_calls):
    """In the GQA kernel a sink joins each row once (one split: in the kernel; more: in the reduce
    kernel): a context of 0 returns zeros with lse = sink; a sink of -inf is no sink."""
    sinks = torch.tensor([0.5, -1.0, 3.0, float("-inf"), 0.0, 2.0, -3.0, 1.0])
    c = _case("cuda", "float16", b=3, h_q=8, h_kv=2, lens=[0, 5, 300], d=128, seed=31, sinks=sinks)
    for ns in (1, 2, 7):
        out, lse = _run(c, ns, config=GQA)
        _check(out, lse, c, f"gluon gqa sinks splits={ns}")
        finite = torch.isfinite(sinks)
        assert (_np(out)[0] == 0).all() and np.allclose(_np(lse)[0][finite.numpy()], sinks[finite].numpy())
    assert len(gqa_calls) == 3
