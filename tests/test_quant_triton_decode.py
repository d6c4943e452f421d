"""Quantized KV caches (flashcl.quant: q8_0, q4_0, int8, fp8_e4m3) in the Triton decode, against
the float64 oracle given the same QuantizedTensor (flashcl.reference.decode_attention dequantizes
it), within the plain kernels' tolerance: the quantization error is the oracle's too, so what is
left is the kernel's own. Native on CUDA, TRITON_INTERPRET=1 on CPU (small shapes).
"""

from __future__ import annotations

import dataclasses
import math

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
FORMATS = ("q8_0", "q4_0", "int8", "fp8_e4m3")


@pytest.fixture
def poison(monkeypatch):
    """Every buffer the launch allocates starts as NaN, so an unwritten element fails."""
    monkeypatch.setattr(triton_decode, "_empty", lambda shape, dtype, device: torch.full(
        shape, float("nan"), dtype=dtype, device=device))


def _np(x):
    return x.detach().to("cpu", torch.float64).numpy()


def _case(device, dtype, *, b, h_q, h_kv, lens, d=64, dv=None, block_size=16, paged=True, k_fmt="q8_0",
          v_fmt="q8_0", seed=0, **variants):
    """q and K/V caches (paged with permuted blocks, or contiguous), each quantized in its format
    (None: plain), and the oracle's out/lse on exactly those caches."""
    dv = dv or d
    gen = torch.Generator()
    gen.manual_seed(seed)
    tdt = getattr(torch, dtype)
    n_max = max(max(lens), 1)
    q = torch.randn((b, h_q, d), generator=gen).to(tdt)
    k = torch.randn((b, h_kv, n_max, d), generator=gen).to(tdt)
    v = torch.randn((b, h_kv, n_max, dv), generator=gen).to(tdt)
    bt = None
    if paged:
        per_seq = -(-n_max // block_size)
        num_blocks = b * per_seq + 2
        bt = torch.randperm(num_blocks, generator=gen)[: b * per_seq].view(b, per_seq).to(torch.int32)

        def to_pages(x):
            pages = torch.randn((num_blocks, block_size, h_kv, x.shape[3]), generator=gen).to(tdt)
            padded = torch.nn.functional.pad(x, (0, 0, 0, per_seq * block_size - n_max))
            pages[bt.flatten().long()] = padded.view(b, h_kv, per_seq, block_size, -1).permute(
                0, 2, 3, 1, 4).reshape(-1, block_size, h_kv, x.shape[3])
            return pages

        k, v = to_pages(k), to_pages(v)
    k_cache = flashcl.quantize(k.to(device), k_fmt) if k_fmt else k.to(device)
    v_cache = flashcl.quantize(v.to(device), v_fmt) if v_fmt else v.to(device)
    scale = 1.0 / math.sqrt(d)
    ref_kw = {n: (_np(x) if torch.is_tensor(x) else x) for n, x in variants.items()}
    ref_out, ref_lse = reference.decode_attention(
        _np(q), k_cache if k_fmt else _np(k), v_cache if v_fmt else _np(v),
        block_table=None if bt is None else bt.numpy(), context_lens=np.array(lens), scale=scale, return_lse=True,
        **ref_kw)
    return {"q": q.to(device), "k": k_cache, "v": v_cache, "block_table": None if bt is None else bt.to(device),
            "lens": torch.tensor(lens, dtype=torch.int32, device=device), "ref": ref_out, "ref_lse": ref_lse,
            "dtype": dtype, "variants": {n: (x.to(device) if torch.is_tensor(x) else x) for n, x in variants.items()}}


def _run(c, num_splits):
    return flashcl.decode(c["q"], c["k"], c["v"], block_table=c["block_table"], context_lens=c["lens"],
                          num_splits=num_splits, backend="triton", return_lse=True, **c["variants"])


def _check(out, lse, c, what):
    check_out_and_lse(_np(out), _np(lse), c["ref"], c["ref_lse"], c["dtype"], what, lse_rtol=1e-3)


# (format, paged, block size, h_q, h_kv): every format paged and contiguous, block sizes 1 / 16 /
# 64 / 256 (tiles inside a page), GQA 4, MQA 8 and MHA spread over them
MATRIX = [
    ("q8_0", True, 16, 8, 2), ("q8_0", False, 16, 8, 1), ("q8_0", True, 1, 4, 4),
    ("q4_0", True, 64, 8, 1), ("q4_0", False, 16, 4, 4), ("q4_0", True, 16, 8, 2),
    ("int8", True, 16, 4, 4), ("int8", False, 16, 8, 2), ("int8", True, 64, 8, 2), ("int8", True, 256, 8, 2),
    ("fp8_e4m3", True, 16, 8, 2), ("fp8_e4m3", False, 16, 8, 1), ("fp8_e4m3", True, 1, 8, 1),
]


@pytest.mark.parametrize("fmt,paged,block_size,h_q,h_kv", MATRIX)
def test_formats_layouts_splits(triton_device, fmt, paged, block_size, h_q, h_kv, poison):
    """Each format on paged (permuted blocks) and contiguous caches, GQA / MQA / MHA, contexts 0 /
    1 / a block + 1 / several tiles; one split, 2 (fused merge) and 5 (reduce kernel)."""
    c = _case(triton_device, "float16", b=4, h_q=h_q, h_kv=h_kv, lens=[0, 1, block_size + 1, 150], paged=paged,
              block_size=block_size, k_fmt=fmt, v_fmt=fmt, seed=len(fmt) + block_size)
    for ns in (1, 2, 5):
        out, lse = _run(c, ns)
        _check(out, lse, c, f"{fmt} paged={paged} bs={block_size} splits={ns}")


@pytest.mark.parametrize("k_fmt,v_fmt", [("q8_0", None), (None, "q4_0"), ("int8", "fp8_e4m3"), ("q4_0", "int8")])
def test_mixed_formats_and_head_dims(triton_device, k_fmt, v_fmt, poison):
    """K and V in different formats (or one plain), DK != DV (both multiples of 32)."""
    c = _case(triton_device, "float16", b=2, h_q=4, h_kv=2, lens=[77, 20], d=64, dv=96, k_fmt=k_fmt, v_fmt=v_fmt,
              seed=3)
    for ns in (1, 3):
        out, lse = _run(c, ns)
        _check(out, lse, c, f"K {k_fmt} V {v_fmt} splits={ns}")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_logical_dtypes(triton_device, dtype, poison):
    """A cache quantized from float32 or bfloat16 (q's dtype), d = 128 (q4_0 in stored order)."""
    for fmt in ("q8_0", "q4_0", "int8"):
        c = _case(triton_device, dtype, b=2, h_q=4, h_kv=2, lens=[50, 9], d=128, k_fmt=fmt, v_fmt=fmt, seed=5)
        out, lse = _run(c, 2)
        _check(out, lse, c, f"{dtype} {fmt}")


def test_quantized_with_variants(triton_device, poison):
    """A quantized cache with a window, softcap, sinks and ALiBi."""
    gen = torch.Generator()
    gen.manual_seed(8)
    var = {"window": (33, 0), "softcap": 5.0, "sinks": torch.randn((8,), generator=gen),
           "alibi_slopes": torch.rand((3, 8), generator=gen) * 0.2}
    c = _case(triton_device, "float16", b=3, h_q=8, h_kv=2, lens=[100, 5, 64], k_fmt="q4_0", v_fmt="int8", seed=9,
              **var)
    for ns in (1, 3):
        out, lse = _run(c, ns)
        _check(out, lse, c, f"variants splits={ns}")


@pytest.mark.parametrize("d,block_size,paged", [(128, 16, True), (256, 1, True), (128, 16, False), (64, 32, True),
                                                 (64, 256, True)])
@pytest.mark.parametrize("fmt", ("q4_0", "int8", "fp8_e4m3"))
def test_words(triton_device, fmt, d, block_size, paged, poison, dot_launches):
    """Caches read as 32-bit words (head dims 64 / 128 / 256; int8 and fp8 where q is fp16, q4_0
    in stored order): every column back in its place, in out and in the split partials; whole
    pages, tiles inside a page (256-token blocks) and contiguous rows; rows past the end; a window
    (row-masked loads). On a GPU the words become fp16 through byte permutes, under the
    interpreter through casts."""
    c = _case(triton_device, "float16", b=3, h_q=4, h_kv=2, lens=[0, 37, 2 * block_size + 70], d=d, paged=paged,
              block_size=block_size, k_fmt=fmt, v_fmt=fmt, seed=d + block_size)
    cvt_asm = triton_decode._cvt_asm(c["q"], (fmt, fmt))
    words = (lambda data, fmt, d: triton_decode.ggml_stored.row_words_aligned(data) >= 1) if fmt == "q4_0" else (
        lambda data, fmt, d: triton_decode._reads_words(data, fmt, d, cvt_asm))
    assert all(words(c[x].data, fmt, d) for x in ("k", "v"))
    for ns in (1, 2, 5):
        out, lse = _run(c, ns)
        _check(out, lse, c, f"{fmt} words d={d} paged={paged} splits={ns}")
    # where the dot path runs it (not the Gluon GQA kernel), q4_0 is read in stored order
    assert all(launch["STORED"] == (fmt == "q4_0") for launch in dot_launches), dot_launches
    w = _case(triton_device, "float16", b=2, h_q=4, h_kv=2, lens=[90, 17], d=d, paged=paged, block_size=block_size,
              k_fmt=fmt, v_fmt=fmt, seed=d + 1, window=(block_size + 3, 0))
    out, lse = _run(w, 3)
    _check(out, lse, w, f"{fmt} words d={d} window")


def _gluon_gqa_runs(device, formats) -> bool:
    """The Gluon GQA kernel can read these formats here: CUDA with Gluon, sm_89+ for fp8."""
    from flashcl.triton import decode_gluon

    if device != "cuda" or not decode_gluon.available():
        return False
    return "fp8_e4m3" not in formats or torch.cuda.get_device_capability() >= (8, 9)


def _forced_gqa(c, formats, splits):
    """(out, lse) of case ``c`` (d = 128) with the Gluon GQA kernel forced where it runs;
    ``formats``: K's and V's ("" plain); the case's variants as the op passes them."""
    (k, k_fmt), (v, v_fmt) = zip((c["k"], c["v"]), formats)
    var = c["variants"]
    slopes = var.get("alibi_slopes")
    return triton_decode._launch(
        c["q"], k.data if k_fmt else k, v.data if v_fmt else v, c["block_table"], c["lens"], 1.0 / math.sqrt(128),
        splits, config={"gluon_gqa": True}, k_scales=k.scales if k_fmt else None,
        v_scales=v.scales if v_fmt else None, k_format=k_fmt, v_format=v_fmt,
        window_left=var["window"][0] if "window" in var else -1, softcap=var.get("softcap", 0.0),
        sinks=var.get("sinks"), alibi_slopes=None if slopes is None else slopes.to(torch.float32))


@pytest.fixture
def gqa_calls(monkeypatch):
    """The formats of every launch of the Gluon GQA kernel."""
    from flashcl.triton import decode_gluon

    calls = []
    launch = decode_gluon.launch_gqa
    monkeypatch.setattr(decode_gluon, "launch_gqa", lambda *a, **kw: (
        calls.append((kw.get("k_format", ""), kw.get("v_format", ""))), launch(*a, **kw))[1])
    return calls


@pytest.mark.parametrize("k_fmt,v_fmt", [("int8", "int8"), ("fp8_e4m3", "fp8_e4m3"), ("int8", None),
                                         (None, "fp8_e4m3"), ("fp8_e4m3", "int8"), ("q8_0", "q8_0"),
                                         ("q8_0", None), (None, "q8_0"), ("q8_0", "int8"), ("fp8_e4m3", "q8_0"),
                                         ("q4_0", "q4_0"), ("q4_0", None), (None, "q4_0"), ("q8_0", "q4_0"),
                                         ("q4_0", "fp8_e4m3")])
@pytest.mark.parametrize("h_q,h_kv,lens,splits", [(32, 8, [3000], 1), (16, 4, [0, 1, 700, 2049], 3),
                                                  (64, 8, [3001, 17], 2), (32, 8, [5000], 1)])
def test_gluon_gqa_reads_quantized_caches(triton_device, k_fmt, v_fmt, h_q, h_kv, lens, splits, poison, gqa_calls):
    """The Gluon GQA kernel (forced) on int8 / fp8 / q8_0 / q4_0 caches, each side quantized or
    plain, formats mixed: groups 4 and 8, contexts 0, 1, a page boundary and several tiles, one
    split and more (reduce kernel), 313 pages in a split (the page sort); the words it reads
    become the same values the dot path's do (ggml: every block's offset in its 8-byte units,
    q4_0's V columns in nibble order)."""
    formats = (k_fmt or "", v_fmt or "")
    if not _gluon_gqa_runs(triton_device, formats):
        pytest.skip("the Gluon GQA kernel runs on CUDA with Gluon (fp8: sm_89+)")
    c = _case(triton_device, "float16", b=len(lens), h_q=h_q, h_kv=h_kv, lens=lens, d=128, k_fmt=k_fmt,
              v_fmt=v_fmt, seed=sum(lens) + h_q)
    out, lse = _forced_gqa(c, formats, splits)
    assert gqa_calls == [formats]
    _check(out, lse, c, f"gluon gqa {formats} lens={lens} splits={splits}")


@pytest.mark.parametrize("h_q,h_kv", [(24, 2), (32, 2)])
@pytest.mark.parametrize("k_fmt,v_fmt", [("q8_0", "q4_0"), ("q4_0", "q8_0"), ("int8", "q4_0")])
def test_gluon_gqa_quantized_large_groups(triton_device, k_fmt, v_fmt, h_q, h_kv, poison, gqa_calls):
    """The Gluon GQA kernel (forced) on quantized caches at groups 12 and 16: every accumulator
    row a query head (groups up to 8 rescale only rows 0..7)."""
    formats = (k_fmt, v_fmt)
    if not _gluon_gqa_runs(triton_device, formats):
        pytest.skip("the Gluon GQA kernel runs on CUDA with Gluon (fp8: sm_89+)")
    c = _case(triton_device, "float16", b=2, h_q=h_q, h_kv=h_kv, lens=[1500, 90], d=128, k_fmt=k_fmt,
              v_fmt=v_fmt, seed=h_q)
    out, lse = _forced_gqa(c, formats, 2)
    assert gqa_calls == [formats]
    _check(out, lse, c, f"gluon gqa {formats} group {h_q // h_kv}")


@pytest.mark.parametrize("block_size", [1, 64])
@pytest.mark.parametrize("k_fmt,v_fmt", [("q8_0", "q4_0"), ("int8", "fp8_e4m3")])
def test_gluon_gqa_quantized_block_sizes(triton_device, k_fmt, v_fmt, block_size, poison, gqa_calls):
    """The Gluon GQA kernel (forced) on quantized pages of 1 token (a split of 550 pages: the page
    sort) and of 64 (a tile's 64 keys on one page), contexts of a partial last page."""
    formats = (k_fmt, v_fmt)
    if not _gluon_gqa_runs(triton_device, formats):
        pytest.skip("the Gluon GQA kernel runs on CUDA with Gluon (fp8: sm_89+)")
    c = _case(triton_device, "float16", b=2, h_q=32, h_kv=8, lens=[1100, 37], d=128, block_size=block_size,
              k_fmt=k_fmt, v_fmt=v_fmt, seed=block_size)
    out, lse = _forced_gqa(c, formats, 2)
    assert gqa_calls == [formats]
    _check(out, lse, c, f"gluon gqa {formats} block_size={block_size}")


@pytest.mark.parametrize("k_fmt,v_fmt", [("q4_0", "q4_0"), ("int8", "int8"), ("q8_0", "fp8_e4m3"),
                                         ("fp8_e4m3", "fp8_e4m3")])
def test_gluon_gqa_quantized_with_variants(triton_device, k_fmt, v_fmt, poison, gqa_calls):
    """The Gluon GQA kernel (forced) on quantized caches with every variant on (q4_0's two tiles in
    flight, int8's row scales, ggml and fp8 mixed, builds capped at 168 registers where the grid
    needs three programs per SM): a window that starts mid-tile, 1 and 3 splits, and for int8, fp8
    and q4_0 K and V as many as make the grid more than two programs per SM."""
    formats = (k_fmt, v_fmt)
    if not _gluon_gqa_runs(triton_device, formats):
        pytest.skip("the Gluon GQA kernel runs on CUDA with Gluon (fp8: sm_89+)")
    gen = torch.Generator()
    gen.manual_seed(5)
    var = {"window": (300, 0), "softcap": 7.5, "sinks": torch.randn((16,), generator=gen),
           "alibi_slopes": torch.rand((4, 16), generator=gen) * 0.1}
    c = _case(triton_device, "float16", b=4, h_q=16, h_kv=4, lens=[0, 1, 700, 2049], d=128, k_fmt=k_fmt,
              v_fmt=v_fmt, seed=6, **var)
    splits = [1, 3]
    if k_fmt == v_fmt and dp.gqa_programs_per_sm(formats) > 2:
        splits.append(2 * torch.cuda.get_device_properties(0).multi_processor_count // 16 + 1)  # 16 programs a split
    for ns in splits:
        out, lse = _forced_gqa(c, formats, ns)
        _check(out, lse, c, f"gluon gqa {formats} all variants splits={ns}")
    assert gqa_calls == [formats] * len(splits)


@pytest.mark.parametrize("k_fmt,v_fmt", [("int8", "int8"), ("fp8_e4m3", "fp8_e4m3"), ("q8_0", "q8_0"),
                                         ("q4_0", "q4_0"), ("q8_0", None), (None, "int8")])
@pytest.mark.parametrize("splits", [1, 3])
def test_gluon_gqa_bf16_q(triton_device, k_fmt, v_fmt, splits, poison, gqa_calls):
    """bf16 q on quantized caches (quantized from bf16; one side plain bf16): the Gluon GQA kernel
    takes q in fp16 at a power of two per row. Rows of magnitudes 2^-100 to 2^100 within one
    group (huge and tiny logits), a row of zeros and rows with values 2^-20 of their largest,
    against the oracle on the values as stored (dequantized to float32: in bf16, the dequantized
    values' rounding alone moves a 2^100 logit's lse by up to 2e-3 of it)."""
    formats = (k_fmt or "", v_fmt or "")
    if not _gluon_gqa_runs(triton_device, formats):
        pytest.skip("the Gluon GQA kernel runs on CUDA with Gluon (fp8: sm_89+)")
    c = _case(triton_device, "bfloat16", b=2, h_q=32, h_kv=8, lens=[1500, 77], d=128, k_fmt=k_fmt,
              v_fmt=v_fmt, seed=splits)
    q = c["q"].float()
    q[0, 0] *= 2.0 ** -100
    q[0, 1] *= 2.0 ** 100 / q[0, 1].abs().max()  # logits past 2^100: the softmax of one key
    q[0, 2] = 0.0
    q[1, 4, ::2] *= 2.0 ** -20  # half its values far below the row's largest
    q[1, 5] *= 2.0 ** 60
    c["q"] = q.to(torch.bfloat16)
    ref_kw = {"block_table": c["block_table"].cpu().numpy(), "context_lens": np.array([1500, 77]),
              "scale": 1.0 / math.sqrt(128), "return_lse": True}
    k, v = (dataclasses.replace(x, dtype=torch.float32) if f else _np(x) for x, f in ((c["k"], k_fmt), (c["v"], v_fmt)))
    c["ref"], c["ref_lse"] = reference.decode_attention(_np(c["q"]), k, v, **ref_kw)
    out, lse = _forced_gqa(c, formats, splits)
    assert gqa_calls == [formats] and out.dtype == torch.bfloat16
    _check(out, lse, c, f"gluon gqa bf16 q {formats} splits={splits}")


@pytest.mark.parametrize("k_fmt,v_fmt,dk,dv", [("q8_0", "q4_0", 128, 128), ("q4_0", "q8_0", 64, 128),
                                               ("q8_0", "q4_0", 128, 256)])
def test_float32_q_on_mixed_ggml_caches(triton_device, k_fmt, v_fmt, dk, dv, poison, dot_launches):
    """float32 q on q8_0 K with q4_0 V and the reverse, head dims apart, with a window, softcap,
    sinks and ALiBi: both sides in stored order, each with its own block size and tail."""
    gen = torch.Generator().manual_seed(dk + dv)
    var = {"window": (70, 0), "softcap": 5.0, "sinks": torch.randn((8,), generator=gen),
           "alibi_slopes": torch.rand((2, 8), generator=gen) * 0.2}
    c = _case(triton_device, "float32", b=2, h_q=8, h_kv=2, lens=[150, 33], d=dk, dv=dv, k_fmt=k_fmt, v_fmt=v_fmt,
              seed=dk, **var)
    for ns in (1, 3):
        out, lse = _run(c, ns)
        _check(out, lse, c, f"float32 q K {k_fmt} V {v_fmt} d={dk}/{dv} splits={ns}")
    assert dot_launches and all(launch["STORED"] for launch in dot_launches), dot_launches


@pytest.fixture
def dot_launches(monkeypatch):
    """The quantized-cache flags of every launch of the dot path's kernel."""
    kernel = triton_decode._decode_kernel
    launches = []

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **meta):
                launches.append({n: meta.get(n, False) for n in ("STORED", "K_PARTS", "V_PARTS")})
                return kernel[grid](*args, **meta)
            return launch

    monkeypatch.setattr(triton_decode, "_decode_kernel", Spy())
    return launches


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3", "q4_0", "q8_0"])
@pytest.mark.parametrize("splits", [1, 3])
def test_float32_q_in_bf16_parts(triton_device, fmt, splits, poison, dot_launches):
    """float32 q against int8, fp8, q4_0 and q8_0 (stored order: d = 128, paged) K and V: bf16 tiles,
    q and p as three bf16 parts (quant_words.dot), exact over float32's range short of its top:
    rows of magnitudes 2^-100 to 2^100 in one group, a row of zeros, a row with values 2^-20 of
    its largest."""
    c = _case(triton_device, "float32", b=2, h_q=8, h_kv=2, lens=[300, 41], d=128, k_fmt=fmt, v_fmt=fmt,
              seed=splits)
    q = c["q"]
    q[0, 0] *= 2.0 ** -100
    q[0, 1] *= 2.0 ** 100 / q[0, 1].abs().max()
    q[0, 2] = 0.0
    q[1, 4, ::2] *= 2.0 ** -20
    q[1, 5] *= 2.0 ** 60
    ref_kw = {"block_table": c["block_table"].cpu().numpy(), "context_lens": np.array([300, 41]),
              "scale": 1.0 / math.sqrt(128), "return_lse": True}
    c["ref"], c["ref_lse"] = reference.decode_attention(_np(q), c["k"], c["v"], **ref_kw)
    out, lse = _run(c, splits)
    _check(out, lse, c, f"float32 q {fmt} splits={splits}")
    stored = fmt in ("q4_0", "q8_0")
    assert dot_launches == [{"STORED": stored, "K_PARTS": True, "V_PARTS": True}]


_DOTS_PROBE = """
import sys, torch, flashcl
from flashcl.triton import decode as d
launches = []
kernel = d._decode_kernel
class Spy:
    def __getitem__(self, grid):
        def launch(*args, **meta):
            launches.append({n: meta[n] for n in ("DOT_PRECISION", "K_PARTS", "V_PARTS")})
            return kernel[grid](*args, **meta)
        return launch
d._decode_kernel = Spy()
q, k = torch.randn(1, 4, 64, device=sys.argv[1]), torch.randn(1, 2, 20, 64, device=sys.argv[1])
flashcl.decode(q, flashcl.quantize(k, "int8"), flashcl.quantize(k, "int8"), backend="triton")
print(flashcl.triton.FLOAT32_DOTS, launches)
"""


@pytest.mark.parametrize("dots, want", [
    (None, "tf32x3 [{'DOT_PRECISION': 'tf32x3', 'K_PARTS': True, 'V_PARTS': True}]"),
    ("ieee", "ieee [{'DOT_PRECISION': 'ieee', 'K_PARTS': False, 'V_PARTS': False}]"),
    ("tf32", "expected 'tf32x3' or 'ieee', got 'tf32'"),
])
def test_float32_dots_switch(triton_device, dots, want):
    """FLASHCL_TRITON_FLOAT32_DOTS=ieee: float32 dots as IEEE FMAs and float32 tiles against
    quantized caches (the bf16 parts off); another value is an error naming the two."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "FLASHCL_TRITON_FLOAT32_DOTS"}
    if dots:
        env["FLASHCL_TRITON_FLOAT32_DOTS"] = dots
    run = subprocess.run([sys.executable, "-c", _DOTS_PROBE, triton_device], env=env, capture_output=True, text=True,
                         timeout=300)
    assert want in run.stdout + run.stderr, run.stdout + run.stderr


@pytest.mark.parametrize("fmt", ["q4_0", "q8_0"])
@pytest.mark.parametrize("splits", [1, 2])
def test_gluon_gqa_two_tiles_unused_entries(triton_device, fmt, splits, poison, gqa_calls):
    """q4_0 and q8_0 K and V keep two tiles in flight: the table entries the prologue and the loop
    read ahead past a sequence's end are never used, so -1 there changes nothing (contexts of one
    key, a tile, a tile + 1 and two tiles + 2); a used entry of -1 makes only its sequence NaN."""
    formats = (fmt, fmt)
    if not _gluon_gqa_runs(triton_device, formats):
        pytest.skip("the Gluon GQA kernel runs on CUDA with Gluon")
    lens = [1, 64, 65, 130, 300]
    c = _case(triton_device, "float16", b=len(lens), h_q=32, h_kv=8, lens=lens, d=128, k_fmt=fmt, v_fmt=fmt,
              seed=9)
    table = c["block_table"]
    for i, n in enumerate(lens):
        table[i, -(-n // 16):] = -1
    out, lse = _forced_gqa(c, formats, splits)
    _check(out, lse, c, f"gluon gqa {fmt} entries -1 past the end splits={splits}")
    table[4, 5] = -1  # a block sequence 4 uses
    out, lse = _forced_gqa(c, formats, splits)
    o, l = _np(out), _np(lse)
    assert np.isnan(o[4]).all() and np.isnan(l[4]).all()
    check_out_and_lse(o[:4], l[:4], c["ref"][:4], c["ref_lse"][:4], "float16", "the other sequences", lse_rtol=1e-3)
    assert gqa_calls == [formats] * 2


def test_words_need_an_int32_view():
    """A quantized cache whose rows are not on 4-byte boundaries, or that cannot be viewed as int32,
    does not fit the Gluon kernel: the launch falls back to the dot path instead of raising."""
    from flashcl.triton import decode_gluon

    q = torch.zeros((1, 8, 128), dtype=torch.float16)
    table, lens = torch.zeros((1, 4), dtype=torch.int32), torch.ones((1,), dtype=torch.int32)
    data = torch.zeros((4 * 16 * 2 * 128 + 4,), dtype=torch.int8)
    aligned = data[:-4].view(4, 16, 2, 128)
    shifted = data[1:-3].view(4, 16, 2, 128)  # storage offset 1
    assert decode_gluon.operands_fit(q, aligned, aligned, table, lens, ("int8", "int8"))
    assert not decode_gluon.operands_fit(q, shifted, aligned, table, lens, ("int8", "int8"))
    assert decode_gluon.operands_fit(q, shifted, aligned, table, lens, ("", "int8"))  # a plain K reads elements
    # q8_0 / q4_0 rows are read as 8-byte units: a 4-byte offset does not fit, nor blocks split apart
    for fmt, size in (("q8_0", 34), ("q4_0", 18)):
        blocks = torch.zeros((4 * 16 * 2 * 4 * size + 8,), dtype=torch.uint8)
        rows = blocks[:-8].view(4, 16, 2, 4, size)
        assert decode_gluon.operands_fit(q, rows, rows, table, lens, (fmt, fmt))
        shifted = blocks[4:-4].view(4, 16, 2, 4, size)  # storage offset 4
        assert not decode_gluon.operands_fit(q, shifted, rows, table, lens, (fmt, fmt))
        apart = torch.zeros((4, 16, 2, 4, size + 6), dtype=torch.uint8)[..., :size]
        assert not decode_gluon.operands_fit(q, rows, apart, table, lens, (fmt, fmt))
        # 3 blocks a row (aligned rows, 102 / 54 bytes): not a whole number of units
        odd = torch.zeros((4, 16, 2, 3 * size + 2), dtype=torch.uint8)[..., :3 * size].unflatten(-1, (3, size))
        assert not decode_gluon.operands_fit(q, odd, odd, table, lens, (fmt, fmt))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_default_plan_takes_gluon_for_quantized_caches(triton_device, fmt, dtype, poison, gqa_calls):
    """At (1, 32/8, 32k) the default plan runs every quantized format on the Gluon GQA kernel, for
    fp16 and bf16 q."""
    if not _gluon_gqa_runs(triton_device, (fmt,)):
        pytest.skip("the Gluon GQA kernel runs on CUDA with Gluon (fp8: sm_89+)")
    c = _case(triton_device, dtype, b=1, h_q=32, h_kv=8, lens=[32768], d=128, k_fmt=fmt, v_fmt=fmt, seed=5)
    out, lse = _run(c, None)
    assert gqa_calls == [(fmt, fmt)]
    _check(out, lse, c, f"default plan {fmt}")


@pytest.mark.parametrize("fmt", (None,) + FORMATS)
@pytest.mark.parametrize("b,lens", [(1, None), (2, [32768, 20001])])
def test_default_plan_takes_gluon_for_contiguous_caches(triton_device, fmt, b, lens, poison, gqa_calls):
    """A contiguous cache at (B, 32/8, 32k) runs on the Gluon GQA kernel too, as pages of itself:
    the same attention, with and without context lengths."""
    formats = (fmt or "", fmt or "")
    if not _gluon_gqa_runs(triton_device, formats):
        pytest.skip("the Gluon GQA kernel runs on CUDA with Gluon (fp8: sm_89+)")
    c = _case(triton_device, "float16", b=b, h_q=32, h_kv=8, lens=lens or [32768], d=128, paged=False,
              k_fmt=fmt, v_fmt=fmt, seed=6 + b)
    out, lse = flashcl.decode(c["q"], c["k"], c["v"], context_lens=c["lens"] if lens else None,
                              backend="triton", return_lse=True)
    assert gqa_calls == [formats]
    _check(out, lse, c, f"contiguous {fmt} b={b} lens={lens}")


@pytest.mark.parametrize("fmt", ("int8", "q8_0", "q4_0", None))
@pytest.mark.parametrize("b,h_kv,n_max,n_cache,expand", [(1, 2, 1008, 1008, False), (3, 2, 384, 384, False),
                                                         (2, 1, 96, 320, False), (3, 2, 128, 128, True)])
def test_contiguous_cache_as_pages(triton_device, fmt, b, h_kv, n_max, n_cache, expand):
    """_as_pages: a contiguous cache (dense, the first N_max of a longer one, or one sequence
    expanded over the batch) and its int8 row scales as paged views whose table (_page_table)
    addresses the same rows: the paged kernel on them gives the contiguous call's result."""
    gen = torch.Generator().manual_seed(n_max + b)
    x = torch.randn((1 if expand else b, h_kv, n_cache, 64), generator=gen)
    caches = [flashcl.quantize(t, fmt) if fmt else t.to(torch.float16) for t in (x, x.flip(-1))]
    data = [c.data if fmt else c for c in caches]
    scales = [c.scales if fmt == "int8" else None for c in caches]
    if expand:
        data = [t.expand(b, *t.shape[1:]) for t in data]
        scales = [s if s is None else s.expand(b, *s.shape[1:]) for s in scales]
    data = [t[:, :, :n_max].to(triton_device) for t in data]
    scales = [s if s is None else s[:, :, :n_max].to(triton_device) for s in scales]
    pages = triton_decode._as_pages((*data, *(s for s in scales if s is not None)), n_max)
    assert pages is not None
    views, seq_blocks = pages
    pages = n_max // triton_decode._VIEW_PAGE
    table, full = triton_decode._page_table(torch.device(triton_device), b, seq_blocks, pages)
    assert table.shape == (b, pages) and full.tolist() == [n_max] * b
    q = torch.randn((b, 4 * h_kv, 64), generator=gen).to(torch.float16).to(triton_device)
    lens = torch.tensor([n_max - 7 * i for i in range(b)], dtype=torch.int32, device=triton_device)
    formats = {"k_format": fmt or "", "v_format": fmt or ""}
    want = triton_decode._launch(q, *data, None, lens, 0.125, 2, config={}, k_scales=scales[0],
                                 v_scales=scales[1], **formats)
    row_scales = iter(views[2:])
    got = triton_decode._launch(q, views[0], views[1], table, lens, 0.125, 2, config={},
                                k_scales=next(row_scales, None), v_scales=next(row_scales, None), **formats)
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, rtol=2e-3, atol=2e-3)


def test_contiguous_cache_with_odd_strides_keeps_its_layout():
    """Sequence strides that are not whole rows or blocks, or that differ between K and V, and
    lengths that are not whole blocks take no page view."""
    k = torch.zeros((2, 2, 64, 66))[..., :64]  # rows of 66: 128 rows a sequence, as a dense V's
    assert triton_decode._as_pages((k, torch.zeros((2, 2, 64, 64))), 64) is not None
    assert triton_decode._as_pages((k, torch.zeros((2, 2, 128, 64))[:, :, :64]), 64) is None
    odd = torch.zeros(16400).as_strided((2, 2, 64, 64), (8195, 4096, 64, 1))
    assert triton_decode._as_pages((odd, odd), 64) is None
    assert triton_decode._as_pages((k[:1], k[:1]), 64) is not None  # one sequence: its stride is unused
    assert triton_decode._as_pages((k[:1, :, :56], k[:1, :, :56]), 56) is None  # 56 rows: not whole blocks
    short = torch.zeros((2, 1, 40, 64))[:, :, :32]  # 40 rows a sequence: not whole blocks
    assert triton_decode._as_pages((short, short), 32) is None


def _blocks_apart(gen, shape, lo: float, hi: float) -> torch.Tensor:
    """float64 rows whose 32-column blocks have magnitudes 10^lo .. 10^hi, one block in eight all zero."""
    *lead, d = shape
    nb = d // 32
    x = torch.randn((*lead, nb, 32), generator=gen, dtype=torch.float64)
    keep = torch.rand((*lead, nb, 1), generator=gen) > 0.125
    return (x * 10.0 ** torch.linspace(lo, hi, nb, dtype=torch.float64)[:, None] * keep).reshape(shape)


@pytest.mark.parametrize("fmt,dtype,h_q,h_kv,dk,dv", [
    ("q4_0", "float16", 16, 2, 64, 128), ("q4_0", "float16", 4, 4, 128, 64), ("q4_0", "float16", 8, 2, 256, 256),
    ("q8_0", "float32", 16, 2, 128, 128), ("q8_0", "float32", 4, 4, 128, 128)])
def test_ggml_stored_order_scales(triton_device, fmt, dtype, h_q, h_kv, dk, dv, poison, dot_launches):
    """q4_0 (fp16 q) and q8_0 (float32 q, d = 128) read in stored order (ggml_stored): K blocks
    whose magnitudes differ by 1e4 with q scaled against them, V blocks of 1e-4 to 1e-3 (p * d
    below fp16's normal range: the stacked p's exponent shift), all-zero blocks; GQA 8 and MHA
    (group rows padded per block), DK != DV; each head dim's tail (the last block's values past it)."""
    gen = torch.Generator().manual_seed(dk + dv + h_q)
    lens = [150, 1, 97]
    n = max(lens)
    k = _blocks_apart(gen, (3, h_kv, n, dk), -2.0, 2.0)
    v = _blocks_apart(gen, (3, h_kv, n, dv), -4.0, -3.0)
    q = torch.randn((3, h_q, dk), generator=gen, dtype=torch.float64)
    q = q * torch.repeat_interleave(10.0 ** -torch.linspace(-2.0, 2.0, dk // 32, dtype=torch.float64), 32)
    tdt = getattr(torch, dtype)
    kq, vq = (flashcl.quantize(x.to(tdt).to(triton_device), fmt) for x in (k, v))
    shapes = dp.DecodeProblem(3, h_q, h_kv, dk, dv, n, tdt.itemsize, 0, kv_formats=(fmt, fmt), q_dtype=dtype)
    assert dp.stored_order(shapes) and all(triton_decode.ggml_stored.row_words_aligned(x.data) for x in (kq, vq))
    qd = q.to(tdt)
    ref_out, ref_lse = reference.decode_attention(_np(qd), kq, vq, context_lens=np.array(lens), scale=dk ** -0.5,
                                                  return_lse=True)
    c = {"ref": ref_out, "ref_lse": ref_lse, "dtype": dtype}
    for ns in (1, 3):
        out, lse = flashcl.decode(qd.to(triton_device), kq, vq, context_lens=torch.tensor(lens, dtype=torch.int32,
                                  device=triton_device), num_splits=ns, backend="triton", return_lse=True)
        _check(out, lse, c, f"{fmt} stored h={h_q}/{h_kv} d={dk}/{dv} splits={ns}")
    assert all(launch["STORED"] for launch in dot_launches), dot_launches  # where the dot path runs


def test_q4_0_large_groups_take_the_byte_path(triton_device, poison):
    """A GQA group too large to stack per block (16 query heads per KV head at d = 128: 64 stacked
    rows) is read by the byte gather, with the same result; 8 at d = 64 (16 rows) is stacked."""
    group = dp.DecodeProblem(2, 16, 1, 128, 128, 70, 2, 16, kv_formats=("q4_0", "q4_0"))
    assert not dp.stored_order(group) and dp.stored_order(dataclasses.replace(group, h_q=8, dk=64, dv=64))
    c = _case(triton_device, "float16", b=2, h_q=16, h_kv=1, lens=[70, 9], d=128, k_fmt="q4_0", v_fmt="q4_0",
              seed=31)
    for ns in (1, 3):
        out, lse = _run(c, ns)
        _check(out, lse, c, f"q4_0 group 16 splits={ns}")


@pytest.mark.parametrize("fmt,dtype,d", [("q4_0", "float16", 64), ("q8_0", "float32", 128)])
def test_ggml_unaligned_rows_take_the_byte_path(triton_device, fmt, dtype, d, poison, dot_launches):
    """A q4_0 or q8_0 cache whose rows are not on 4-byte boundaries (data at a 2-byte offset) is
    planned and read by the byte gather instead of in stored order, with the same result."""
    c = _case(triton_device, dtype, b=2, h_q=4, h_kv=2, lens=[45, 20], d=d, k_fmt=fmt, v_fmt=fmt, seed=21)
    shifted = []
    for qt in (c["k"], c["v"]):
        buf = torch.empty(qt.data.numel() + 2, dtype=torch.uint8, device=qt.data.device)
        data = buf[2:].view(qt.data.shape)
        data.copy_(qt.data)
        shifted.append(dataclasses.replace(qt, data=data, scales=data[..., :2].view(torch.float16)[..., 0]))
    assert not triton_decode.ggml_stored.row_words_aligned(shifted[0].data)
    c["k"], c["v"] = shifted
    out, lse = _run(c, 2)
    _check(out, lse, c, f"{fmt} at a 2-byte offset")
    assert all(not launch["STORED"] for launch in dot_launches), dot_launches


def test_plan_routes_quantized_caches():
    """On a Hopper with Gluon, quantized K/V of every format with fp16 or bf16 q take the Gluon GQA
    kernel where its rule takes the launch (at its own split count), and the dot path elsewhere: MHA,
    float32 q, fp8 before sm_89, the kernel turned off. The dot path reads whole pages at
    four programs per SM; int8 and fp8 alone take the word tile, q8_0 and q4_0 their own tiles, a
    mix with a ggml format the ggml tile; an unknown format is refused. No quantized cache takes
    the MHA loop."""
    from dataclasses import replace

    facts = dp.DeviceFacts(sms=132, smem_per_block=227 * 1024, capability=(9, 0), gluon=True)
    gqa, mha = dp.DecodeProblem(1, 32, 8, 128, 128, 32768, 2, 16), dp.DecodeProblem(8, 32, 32, 128, 128, 8192, 2, 16)
    for fmt in FORMATS:
        p = dp.plan(replace(mha, kv_formats=(fmt, fmt)), facts)
        assert p.kernel == "dot" and p.whole_pages and not p.page_tiles, (fmt, p.kernel)
        p = dp.plan(replace(gqa, kv_formats=(fmt, fmt)), facts)
        want = "gluon_gqa" if fmt in dp.GQA_QUANTIZED else "dot"
        assert p.kernel == want, (fmt, p.kernel)
        if want == "gluon_gqa":  # int8, fp8, q4_0 K and V: three programs per SM (168 registers), q8_0 two
            per_sm = 2 if fmt == "q8_0" else 3
            assert dp.gqa_programs_per_sm((fmt, fmt)) == per_sm
            assert p.num_splits == dp.gqa_splits(8, facts.sms, per_sm) and p.merge == "reduce"
            assert p.gqa_registers == dp.gqa_registers(per_sm)
    fp8 = replace(gqa, kv_formats=("fp8_e4m3", "fp8_e4m3"))
    assert dp.plan(replace(gqa, kv_formats=("fp8_e4m3", "int8")), facts).num_splits == 32  # mixed: two per SM
    for splits, capped in ((8, False), (33, False), (34, True), (49, True)):  # forced: capped past 2 per SM
        p = dp.plan(fp8, facts, {"gluon_gqa": True}, num_splits=splits)
        assert p.kernel == "gluon_gqa" and p.num_splits == splits and (p.gqa_registers > 0) == capped, splits
    for per_sm, splits, cap in ((2, 32, 0), (3, 49, 168), (4, 66, 128)):  # the knob: split count and cap
        p = dp.plan(fp8, facts, {"gqa_programs_per_sm": per_sm})
        assert (p.num_splits, p.gqa_registers) == (splits, cap), per_sm
    wide = dp.plan(replace(fp8, b=32), facts)  # 256 programs: within two per SM already, no cap
    assert wide.kernel == "gluon_gqa" and wide.num_splits == 1 and wide.gqa_registers == 0
    for formats in (("int8", ""), ("", "fp8_e4m3"), ("fp8_e4m3", "int8"), ("q8_0", "int8"), ("", "q8_0"),
                    ("int8", "q4_0")):
        assert dp.plan(replace(gqa, kv_formats=formats), facts).kernel == "gluon_gqa", formats
    for fmt in FORMATS:
        assert dp.plan(replace(gqa, kv_formats=(fmt, ""), q_dtype="bfloat16"), facts).kernel == "gluon_gqa", fmt
    for problem, f in ((replace(gqa, kv_formats=("int8", "int8"), q_dtype="float32", elt_bytes=4), facts),
                       (replace(gqa, kv_formats=("fp8_e4m3", "fp8_e4m3")), replace(facts, capability=(8, 0)))):
        assert dp.plan(problem, f).kernel == "dot", problem
    assert dp.plan(replace(gqa, kv_formats=("int8", "int8")), replace(facts, capability=(8, 0))).kernel == "gluon_gqa"
    off = {"gluon_gqa": False}
    for ctx in (32768, 131072):
        base = replace(gqa, n_ctx_bound=ctx)
        tiles = {"int8": (64, 2), "fp8_e4m3": (64, 2), "q8_0": (64, 2), "q4_0": (32, 2)}
        for fmt, tile in tiles.items():
            p = dp.plan(replace(base, kv_formats=(fmt, fmt)), facts, off)
            assert p.kernel == "dot" and 4 * facts.sms <= 8 * p.num_splits < 4 * facts.sms + 8 * 2, (fmt, ctx)
            assert (p.block_n, p.num_warps) == tile, (fmt, ctx)
        mixed = dp.plan(replace(base, kv_formats=("int8", "q4_0")), facts)
        assert (mixed.block_n, mixed.num_warps) == tiles["q4_0"]
        mixed = dp.plan(replace(base, kv_formats=("q8_0", "q4_0")), facts)
        assert (mixed.block_n, mixed.num_warps) == tiles["q8_0"]
    with pytest.raises(ValueError, match="quantized"):
        dp.plan(replace(gqa, kv_formats=("q5_1", "")), facts)


def test_plan_q8_0_under_float32_q():
    """float32 q on a q8_0 cache (both sides q8_0 or q4_0, head dim 128, a group that stacks) reads
    it in stored order: 128 rows on 4 warps, 2 stages, two programs per SM. A group too large
    to stack, query rows, a plain side, head dims 64 (slower that way) or 256 (not measured), fp16
    q or the knob off keep the gather's tile."""
    from dataclasses import replace

    facts = dp.DeviceFacts(sms=132, smem_per_block=227 * 1024, capability=(9, 0), gluon=True)
    f32 = dp.DecodeProblem(1, 32, 8, 128, 128, 32768, 4, 16, kv_formats=("q8_0", "q8_0"), q_dtype="float32")
    for problem in (f32, replace(f32, kv_formats=("q8_0", "q4_0")), replace(f32, kv_formats=("q4_0", "q8_0"))):
        p = dp.plan(problem, facts)
        assert p.stored_order and (p.kernel, p.block_n, p.num_warps, p.num_stages, p.num_splits) == (
            "dot", 128, 4, 2, 33), problem
    for problem, config in ((replace(f32, h_q=128), {}), (replace(f32, query_rows=2), {}),
                            (replace(f32, kv_formats=("q8_0", "")), {}), (replace(f32, dk=64, dv=64), {}),
                            (replace(f32, dk=256, dv=256), {}), (f32, {"ggml_stored": False}),
                            (replace(f32, q_dtype="float16", elt_bytes=2), {"gluon_gqa": False})):
        p = dp.plan(problem, facts, config)
        assert not p.stored_order and (p.block_n, p.num_warps) == (64, 2), (problem, config)


def test_plan_takes_gluon_for_quantized_short_contexts():
    """Quantized caches take the Gluon GQA kernel at any context on grids of at most half an SM
    count of (sequence, KV head) programs, groups 2 to 8, splits of 128 tokens or more up to its
    own count; larger groups keep the dot path below gqa_takes' contexts (wider grids: its rule)."""
    from dataclasses import replace

    facts = dp.DeviceFacts(sms=132, smem_per_block=227 * 1024, capability=(9, 0), gluon=True)
    for fmt in FORMATS:
        formats = (fmt, fmt)
        own = dp.gqa_splits(8, facts.sms, dp.gqa_programs_per_sm(formats))
        for ctx, splits in ((100, 1), (1024, 8), (2048, 16), (4096, 32), (16384, own)):
            p = dp.plan(dp.DecodeProblem(1, 32, 8, 128, 128, ctx, 2, 16, kv_formats=formats), facts)
            assert (p.kernel, p.num_splits) == ("gluon_gqa", splits), (fmt, ctx, p.kernel, p.num_splits)
        for b, h_q, h_kv in ((1, 16, 8), (4, 32, 8), (1, 32, 16), (8, 64, 8)):  # groups 2, 4, 8; 16 to 64 programs
            p = dp.plan(dp.DecodeProblem(b, h_q, h_kv, 128, 128, 4096, 2, 16, kv_formats=formats), facts)
            assert p.kernel == "gluon_gqa" and 4096 // p.num_splits >= dp.GQA_QUANTIZED_MIN_SPLIT, (fmt, b, h_q)
        for b, h_q, h_kv in ((1, 32, 2), (2, 64, 1)):  # groups 16 and 64
            p = dp.plan(dp.DecodeProblem(b, h_q, h_kv, 128, 128, 4096, 2, 16, kv_formats=formats), facts)
            assert p.kernel == "dot", (fmt, b, h_q, h_kv)
        p = dp.plan(dp.DecodeProblem(1, 32, 8, 128, 128, 4096, 2, 16, kv_formats=formats), facts, num_splits=3)
        assert (p.kernel, p.num_splits) == ("gluon_gqa", 3)
    plain = dp.plan(dp.DecodeProblem(1, 32, 8, 128, 128, 4096, 2, 16), facts)
    assert plain.kernel != "gluon_gqa"  # fp16 keeps its measured rule
    bf16 = dp.DecodeProblem(1, 32, 8, 128, 128, 4096, 2, 16, kv_formats=("int8", "int8"), q_dtype="bfloat16")
    assert dp.plan(bf16, facts) == replace(dp.plan(replace(bf16, q_dtype="float16"), facts), problem=bf16)
    assert dp.plan(replace(bf16, q_dtype="float32", elt_bytes=4), facts).kernel == "dot"
    assert dp.plan(bf16, replace(facts, gluon=False)).kernel == "dot"


def test_compiled_with_quantized_cache_and_variants(triton_device):
    """torch.compile (fullgraph) of a step that decodes over a q4_0 K / int8 V cache with a window
    and sinks: no graph break, the op's fake kernel gives the logical head dim (inductor on CUDA,
    aot_eager on CPU); the op passes opcheck with a quantized cache."""
    gen = torch.Generator()
    gen.manual_seed(12)
    sinks = torch.randn((4,), generator=gen)
    c = _case(triton_device, "float16", b=2, h_q=4, h_kv=2, lens=[40, 9], d=64, dv=32, k_fmt="q4_0", v_fmt="int8",
              seed=13, window=(20, 0), sinks=sinks)
    torch._dynamo.reset()

    def step(q, k, v, bt, lens, sk):
        out = flashcl.decode(q * 1.0, k, v, block_table=bt, context_lens=lens, backend="triton", window=(20, 0),
                             sinks=sk)
        return out.float() + 1.0

    backend = "inductor" if triton_device == "cuda" else "aot_eager"
    got = torch.compile(step, fullgraph=True, backend=backend)(c["q"], c["k"], c["v"], c["block_table"], c["lens"],
                                                               c["variants"]["sinks"])
    assert got.shape == (2, 4, 32)
    assert reference.rel_err(_np(got - 1.0), c["ref"]) <= TOL["float16"]
    args = (c["q"], c["k"].data, c["v"].data, c["block_table"], c["lens"], 0.125, 2, 20, 0.0, c["variants"]["sinks"],
            None, None, c["v"].scales, "q4_0", "int8")
    torch.library.opcheck(torch.ops.flashcl.decode.default, args, test_utils=("test_schema", "test_faketensor"))
