"""Prefill benchmark: flashcl's Triton kernel against torch SDPA's backends, same inputs, same run.

    flashcl bench prefill --backend triton [--dtype float16] [--rounds 3] [--json]
    flashcl bench prefill --backend triton --window 4095,0 [--softcap 50] --shape 1,32,32,16384,128,1
    flashcl bench prefill --backend triton --mask causal --shape 1,32,32,4096,128,1
    flashcl bench prefill --backend triton --kv-format q8_0 --shape 1,32,8,4096,128,1

Throughput is TFLOP/s of exact attention (FLOPs below, next to the timing); each implementation
is timed by CUDA-graph replay over input sets rotated past 3x L2 (flashcl.cuda_timing). The
implementations take turns: ``--rounds`` rounds, each timing every implementation once (median of
20 replays), the first to run rotating from round to round, so clock and temperature drift over a
run fall on all of them alike (an H100 runs the first ~0.1 s after a pause up to 10% faster, then
settles: a single pass favours whoever runs first). Reported: the median over the rounds, and the
spread of the round medians. Peers are torch SDPA restricted to one backend each (FLASH_ATTENTION
= FlashAttention-2, CUDNN_ATTENTION, EFFICIENT_ATTENTION); a backend that refuses a shape is
reported as n/a with its reason.

With variants (``run(variants={"window": (left, right), "softcap": c, ...})``) each shape is timed
three ways on the same inputs: flashcl with the variants, flashcl without them, and torch's
FlexAttention (compiled, a causal + sliding-window block mask, a softcap / ALiBi score_mod). Their
TFLOP/s count only the (row, key) pairs each call sees (visible_pairs), so a window's skipped keys
count for nothing; the speed-up over the plain call is a ratio of times. ``{"mask": kind}`` times a
bool mask (mask_tensor): "causal", the causal rule as a mask, called with causal=False next to the
plain causal call; "padding", a left-padded batch, with the shape's causal flag. FlexAttention
gets the same mask in its mask_mod.

With ``kv_format`` (``run(kv_format="q8_0")``, the CLI's --kv-format: q8_0, q4_0, int8 or
fp8_e4m3) K and V of every input set are also quantized to it (flashcl.quantize, outside the timed
graph) and flashcl on them ("flashcl-quant") takes its turn in the same interleaved rounds as the
plain call, autotuned for its own key. Reported per shape: both times, their ratio (quantized /
plain: < 1 faster), TFLOP/s of both over the same FLOPs, K/V bytes as stored, and the quantized
call's difference from flashcl on the dequantized K/V (the same values, unquantized kernel).
"""

from __future__ import annotations

import datetime
import functools
import sys

import torch

from ..api import QUANTIZED_KV_FORMATS
from . import shapes

# (B, H_q, H_kv, N, d, causal): the reference shapes, then long sequences
REFERENCE_SHAPES = shapes.PREFILL_REFERENCE + shapes.PREFILL_LONG
IMPLS = ("flashcl", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient")
QUANT_IMPL = "flashcl-quant"  # flashcl on the quantized K/V (run's kv_format)


def prefill_flops(b: int, h_q: int, n_q: int, n_kv: int, dk: int, dv: int, causal: bool) -> float:
    """FLOPs of exact attention: S = Q K^T is 2 N_q N_kv DK, O = P V is 2 N_q N_kv DV per head
    (4 B H N_q N_kv d when DK = DV = d); causal attention computes half of them (the usual
    convention, exact up to the diagonal)."""
    flops = 2.0 * b * h_q * n_q * n_kv * (dk + dv)
    return flops / 2 if causal else flops


def visible_pairs(n_q: int, n_kv: int, causal: bool, window=None) -> int:
    """(row, key) pairs that see each other under causal (bottom-right) and a window
    (flashcl.variants.key_range per row)."""
    import numpy as np

    from ..variants import window_bounds

    p = np.arange(n_q, dtype=np.int64) + (n_kv - n_q)  # row positions
    left, right = window_bounds(window)
    lo = np.maximum(p - left, 0)
    hi = np.minimum(p + 1, n_kv) if causal else np.full_like(p, n_kv)
    hi = np.minimum(hi, np.maximum(p + right + 1, 0))
    return int(np.maximum(hi - lo, 0).sum())


def kv_bytes(b: int, h_kv: int, n: int, d: int, elt: int, kv_format: str | None = None) -> int:
    """K and V as stored: B·H_kv·N rows of d values each, plain (``elt`` bytes a value) or in
    ``kv_format``'s row size (the decode benchmark's table of them)."""
    from .triton_bench_decode import _ROW_BYTES

    row = d * elt if kv_format is None else _ROW_BYTES[kv_format](d)
    return 2 * b * h_kv * n * row


def _sdpa_call(backend_name: str, q, k, v, causal: bool):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    backend = {"sdpa-flash": SDPBackend.FLASH_ATTENTION, "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION,
               "sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION}[backend_name]
    gqa = q.shape[1] != k.shape[1]

    def call():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)

    return call


def _flashcl_call(q, k, v, causal: bool):
    from ..triton import prefill as tp

    return lambda: tp.prefill(q, k, v, causal=causal)


MASK_KINDS = ("causal", "padding")


def mask_tensor(kind: str, b: int, n: int, device="cuda") -> torch.Tensor:
    """A bool mask for the benchmark: "causal" (1, 1, N, N), key j visible to row i where
    j <= i; "padding" (B, 1, N, N), a left-padded batch: sequence s hides its first
    s * N // (2 B) keys from every row."""
    if kind == "causal":
        return torch.ones(n, n, dtype=torch.bool, device=device).tril()[None, None]
    if kind == "padding":
        pad = torch.arange(b, device=device) * n // (2 * b)
        keys = torch.arange(n, device=device)
        return (keys[None, :] >= pad[:, None])[:, None, None, :].expand(b, 1, n, n).contiguous()
    raise ValueError(f"mask: expected one of {MASK_KINDS}, got {kind!r}")


def mask_pairs(mask: torch.Tensor, causal: bool) -> float:
    """The (row, key) pairs a (Bm, 1, N, N) mask leaves visible to one (batch, head), with causal
    on top if set, averaged over the batch (one sequence at a time: N x N each)."""
    n = mask.shape[-1]
    rule = torch.ones(n, n, dtype=torch.bool, device=mask.device)
    rule = rule.tril() if causal else rule
    return sum(float((m[0] & rule).sum()) for m in mask) / mask.shape[0]


def _torch_variants(variants: dict, b: int, h_q: int, n: int):
    """A flashcl.variants.Variants of torch CUDA tensors from the benchmark's ``variants`` dict
    (window, softcap, sinks (H_q,), alibi_slopes (H_q,) or (B, H_q), mask: a MASK_KINDS name);
    made once, outside the timed graph."""
    from ..variants import Variants

    unknown = set(variants) - {"window", "softcap", "sinks", "alibi_slopes", "mask"}
    if unknown:
        raise ValueError(f"variants: the prefill benchmark takes window, softcap, sinks, alibi_slopes and "
                         f"mask; got {sorted(unknown)}")
    window = variants.get("window")
    window = None if window is None or tuple(window) == (-1, -1) else tuple(int(w) for w in window)
    softcap = variants.get("softcap")

    def tensor(name, shape):
        x = variants.get(name)
        return None if x is None else torch.as_tensor(x, dtype=torch.float32).expand(shape).contiguous().cuda()

    mask = None if variants.get("mask") is None else mask_tensor(variants["mask"], b, n)
    return Variants(window, None if softcap is None else float(softcap), tensor("sinks", (h_q,)),
                    tensor("alibi_slopes", (b, h_q)), mask)


def _flex_call(q, k, v, causal: bool, var):
    """torch's FlexAttention on the same problem: a block mask for causal + window, a score_mod
    for softcap and ALiBi (no sinks: it has none)."""
    from torch.nn.attention.flex_attention import create_block_mask

    from ..variants import window_bounds

    if var.sinks is not None:
        raise NotImplementedError("FlexAttention has no sinks")
    n_q, n_kv = q.shape[2], k.shape[2]
    shift = n_kv - n_q
    left, right = window_bounds(var.window)

    mask = var.mask

    def mask_mod(b, h, q_idx, kv_idx):
        pos = q_idx + shift
        seen = (kv_idx >= pos - left) & (kv_idx <= pos + right)
        if mask is not None:
            seen = seen & mask[b if mask.shape[0] > 1 else 0, 0, q_idx, kv_idx]
        return seen & (kv_idx <= pos) if causal else seen

    batch = None if mask is None or mask.shape[0] == 1 else mask.shape[0]
    block_mask = create_block_mask(mask_mod, batch, None, n_q, n_kv, device=q.device)
    cap, slopes = var.softcap, var.alibi_slopes

    def score_mod(score, b, h, q_idx, kv_idx):
        if cap is not None:
            score = cap * torch.tanh(score / cap)
        if slopes is not None:
            score = score - slopes[b, h] * (q_idx + shift - kv_idx).abs()
        return score

    flex = _compiled_flex()
    gqa = q.shape[1] != k.shape[1]
    mod = score_mod if (cap is not None or slopes is not None) else None
    return lambda: flex(q, k, v, score_mod=mod, block_mask=block_mask, enable_gqa=gqa)


@functools.lru_cache(maxsize=None)
def _compiled_flex():
    """flex_attention through torch.compile (its fused kernel; eager runs a reference loop)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


VARIANT_IMPLS = ("flashcl", "flashcl-plain", "flex")


def _bench_variant_shape(shape, dtype, meta, rounds: int, variants: dict) -> list[dict]:
    """One shape with variants: flashcl with them, flashcl without, FlexAttention (module docstring)."""
    from . import cuda_timing
    from ..triton import prefill as tp

    b, h_q, h_kv, n, d, causal = shape
    var = _torch_variants(variants, b, h_q, n)
    # the causal mask replaces causal=True; any other mask comes on top of the shape's flag
    masked_causal = causal and variants.get("mask") != "causal"
    sets = _input_sets(shape, dtype)
    seen = visible_pairs(n, n, causal, var.window) if var.mask is None else mask_pairs(var.mask, causal)
    pairs = {"flashcl": seen, "flex": seen, "flashcl-plain": visible_pairs(n, n, causal)}
    makers = {
        "flashcl": lambda q, k, v: (lambda: tp.prefill(q, k, v, causal=masked_causal, variants=var)),
        "flashcl-plain": lambda q, k, v: _flashcl_call(q, k, v, causal),
        "flex": lambda q, k, v: _flex_call(q, k, v, causal, var),
    }
    described = {n_: (list(x) if isinstance(x, tuple) else x) for n_, x in variants.items()}
    rows, outputs, runnable = [], {}, {}
    for impl in VARIANT_IMPLS:
        flops = 2.0 * b * h_q * pairs[impl] * 2 * d  # QK^T and PV over the visible pairs
        row = {**meta, "impl": impl, "B": b, "H_q": h_q, "H_kv": h_kv, "N": n, "d": d, "causal": causal,
               "variants": described if impl != "flashcl-plain" else {}, "visible_pairs": pairs[impl],
               "rotated_sets": len(sets), "flops": flops, "rounds": rounds}
        rows.append(row)
        try:
            calls = [makers[impl](q, k, v) for q, k, v in sets]
            outputs[impl] = calls[0]()  # compiles / autotunes outside the graph
            torch.cuda.synchronize()
            if impl.startswith("flashcl"):
                row["config"] = tp.best_config(n, n, d, d, masked_causal if impl == "flashcl" else causal,
                                               dtype, batch_heads=b * h_q,
                                               variants=var if impl == "flashcl" else None)
            else:  # a compiled peer must also replay inside a CUDA graph
                cuda_timing.time_graph(calls[:1], warmup=1, reps=1)
            runnable[impl] = calls
        except Exception as e:  # FlexAttention missing, or a variant it does not express
            row.update(median_ms=None, tflops=None, error=f"{type(e).__name__}: {str(e).splitlines()[0][:120]}")

    timed = cuda_timing.interleaved_rounds(
        {impl: (lambda c=calls: cuda_timing.time_graph(c, warmup=3, reps=20)["median_ms"])
         for impl, calls in runnable.items()}, rounds)
    by = {r["impl"]: r for r in rows}
    for impl, t in timed.items():
        r = by[impl]
        r.update(t, spread_pct=100.0 * (t["max_ms"] - t["min_ms"]) / t["median_ms"],
                 tflops=r["flops"] / (t["median_ms"] * 1e-3) / 1e12)
    mine = by["flashcl"]
    if mine.get("median_ms"):
        for peer, key in (("flashcl-plain", "speedup_vs_plain"), ("flex", "speedup_vs_flex")):
            if by[peer].get("median_ms"):
                mine[key] = by[peer]["median_ms"] / mine["median_ms"]
    if "flashcl" in outputs and "flex" in outputs:  # same inputs, same answer
        ref = outputs["flex"].float()
        mine["rel_diff_vs_flex"] = float((outputs["flashcl"].float() - ref).norm() / ref.norm())
    del sets, outputs
    torch.cuda.empty_cache()
    return rows


def _input_sets(shape, dtype):
    """Fresh (q, k, v) sets, enough of them to rotate past 3x L2."""
    from . import cuda_timing

    b, h_q, h_kv, n, d, _ = shape
    elt = torch.empty((), dtype=dtype).element_size()
    set_bytes = (2 * b * h_q * n * d + 2 * b * h_kv * n * d) * elt  # q, out, k, v
    n_sets = cuda_timing.rotation_count(set_bytes)
    g = torch.Generator(device="cuda").manual_seed(0)
    return [tuple(torch.randn(s, device="cuda", dtype=dtype, generator=g)
                  for s in ((b, h_q, n, d), (b, h_kv, n, d), (b, h_kv, n, d)))
            for _ in range(n_sets)]


def _config_name(c) -> str:
    return _tile_name({**c.kwargs, "num_warps": c.num_warps, "num_stages": c.num_stages,
                       "maxnreg": c.maxnreg})


def _tile_name(cfg: dict) -> str:
    return "{}x{} w{} s{}{}{}{}".format(cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["num_warps"], cfg["num_stages"],
                                        " tma" if cfg.get("USE_TMA") else "",
                                        f" r{cfg['maxnreg']}" if cfg.get("maxnreg") else "",
                                        " overlap" if cfg.get("SOFTMAX_OVERLAP") else "")


def _first(ms):
    return float(ms[0] if isinstance(ms, (list, tuple)) else ms)


def _bench_shape(shape, dtype, meta, rounds: int = 3, kv_format: str | None = None) -> list[dict]:
    from . import cuda_timing
    from ..quant import dequantize, quantize
    from ..triton import prefill as tp

    b, h_q, h_kv, n, d, causal = shape
    sets = _input_sets(shape, dtype)
    n_sets = len(sets)
    flops = prefill_flops(b, h_q, n, n, d, d, causal)
    elt = torch.empty((), dtype=dtype).element_size()
    makers = {"flashcl": lambda q, k, v, causal, *_: _flashcl_call(q, k, v, causal)}
    if kv_format is not None:  # quantized outside the timed graph; same values as the plain sets
        sets = [(q, k, v, quantize(k, kv_format), quantize(v, kv_format)) for q, k, v in sets]
        makers[QUANT_IMPL] = lambda q, k, v, causal, qk, qv: _flashcl_call(q, qk, qv, causal)

    rows, outputs, runnable = [], {}, {}
    for impl in (*makers, *IMPLS[1:]):  # flashcl's calls first: rows[0] is the plain one
        row = {**meta, "impl": impl, "B": b, "H_q": h_q, "H_kv": h_kv, "N": n, "d": d,
               "causal": causal, "rotated_sets": n_sets, "flops": flops, "rounds": rounds,
               "kv_bytes": kv_bytes(b, h_kv, n, d, elt, kv_format if impl == QUANT_IMPL else None)}
        if impl == QUANT_IMPL:
            row["kv_format"] = kv_format
        rows.append(row)
        try:
            make = makers.get(impl) or (lambda q, k, v, causal, *_, _i=impl: _sdpa_call(_i, q, k, v, causal))
            calls = [make(q, k, v, causal, *quantized) for q, k, v, *quantized in sets]
            outputs[impl] = calls[0]()  # flashcl: autotunes this key here, outside the graph
            torch.cuda.synchronize()
            if impl in makers:
                timings = getattr(tp._prefill_autotuned, "configs_timings", None) or {}
                row["autotune_ms"] = {_config_name(c): _first(ms) for c, ms in timings.items()}
                formats = (kv_format, kv_format) if impl == QUANT_IMPL else ("", "")
                row["config"] = tp.best_config(n, n, d, d, causal, dtype, batch_heads=b * h_q, kv_formats=formats)
            runnable[impl] = calls
        except Exception as e:  # a backend that does not take this shape, dtype or GPU
            row.update(median_ms=None, tflops=None, error=f"{type(e).__name__}: {str(e).splitlines()[0][:120]}")

    # the implementations take turns (see the module docstring)
    timed = cuda_timing.interleaved_rounds(
        {impl: (lambda c=calls: cuda_timing.time_graph(c, warmup=3, reps=20)["median_ms"])
         for impl, calls in runnable.items()}, rounds)
    for row in rows:
        t = timed.get(row["impl"])
        if t is None:
            continue
        # throughput: FLOPs of the call over the median of its round medians
        row.update(t, spread_pct=100.0 * (t["max_ms"] - t["min_ms"]) / t["median_ms"],
                   tflops=flops / (t["median_ms"] * 1e-3) / 1e12)

    # same inputs, same answer: flashcl against the first peer that ran
    peer = next((outputs[i] for i in IMPLS[1:] if i in outputs), None)
    if "flashcl" in outputs and peer is not None:
        diff = (outputs["flashcl"].float() - peer.float())
        rows[0]["rel_diff_vs_sdpa"] = float(diff.norm() / peer.float().norm())
    flash = next((r for r in rows if r["impl"] == "sdpa-flash"), None)
    for r in rows:
        if r.get("tflops") and flash and flash.get("tflops"):
            r["vs_sdpa_flash"] = r["tflops"] / flash["tflops"]
    if QUANT_IMPL in outputs:  # the same values through the unquantized kernel: the same answer
        _, _, _, qk, qv = sets[0]
        ref = _flashcl_call(sets[0][0], dequantize(qk), dequantize(qv), causal)().float()
        qrow = next(r for r in rows if r["impl"] == QUANT_IMPL)
        qrow["rel_diff_vs_dequantized"] = float((outputs[QUANT_IMPL].float() - ref).norm() / ref.norm())
        if qrow.get("median_ms") and rows[0].get("median_ms"):
            qrow["quant_ratio"] = qrow["median_ms"] / rows[0]["median_ms"]
    del sets, outputs
    torch.cuda.empty_cache()
    return rows


def run(shapes=None, dtype: str = "float16", rounds: int = 3, variants: dict | None = None,
        kv_format: str | None = None) -> list[dict]:
    """Time every implementation on every shape; one row per (shape, implementation).

    ``shapes``: (B, H_q, H_kv, N, d, causal) tuples, or (B, H, N, d, causal) for H_q = H_kv;
    default REFERENCE_SHAPES. ``rounds``: turns each implementation gets (module docstring).
    ``variants``: {"window": (left, right), "softcap": c, "sinks": (H_q,), "alibi_slopes": ...}:
    each shape timed with them, without them and by FlexAttention (VARIANT_IMPLS).
    ``kv_format``: flashcl also timed on K/V quantized to it (QUANT_IMPL; not with ``variants``).
    """
    from .. import __version__
    from . import cuda_timing

    shapes = [tuple(s) if len(s) == 6 else (s[0], s[1], *s[1:]) for s in (shapes or REFERENCE_SHAPES)]
    takes = QUANTIZED_KV_FORMATS[("triton", "prefill")]
    if kv_format is not None and kv_format not in takes:
        raise ValueError(f"kv_format: the Triton prefill kernel takes {', '.join(takes)}; got {kv_format!r}")
    if kv_format is not None and variants:
        raise ValueError("kv_format: timed on the plain call only; drop the variants")
    if (variants or {}).get("mask") == "causal" and not all(s[5] for s in shapes):
        raise ValueError("mask 'causal' stands in for causal=True: every shape must be causal")
    if not torch.cuda.is_available():
        raise RuntimeError("bench_prefill needs a CUDA GPU (torch.cuda.is_available() is False)")
    torch_dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    summary = cuda_timing.device_summary()
    meta = {
        "device": summary["device"], "capability": summary["capability"], "driver": summary["driver"],
        "torch": summary["torch"], "triton": __import__("triton").__version__, "dtype": dtype,
        "flashcl": __version__, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        # the CLI's own words when it called us, else what a script passed
        "command": ("flashcl " + " ".join(sys.argv[1:]) if sys.argv[1:3] == ["bench", "prefill"]
                    else " ".join(["flashcl bench prefill --backend triton", *sys.argv[1:]])),
    }
    rows = []
    for shape in shapes:
        if variants:
            rows += _bench_variant_shape(shape, torch_dtype, meta, rounds, variants)
        else:
            rows += _bench_shape(shape, torch_dtype, meta, rounds, kv_format)
    return rows


def format_table(rows: list[dict]) -> str:
    """A human table: one line per shape, TFLOP/s per implementation, flashcl's ratios."""
    if not rows:
        return "(no rows)"
    if "variants" in rows[0]:
        return _format_variant_table(rows)
    m = rows[0]
    head = (f"flashcl {m['flashcl']} prefill, {m['dtype']}, {m['device']} (sm_{m['capability'].replace('.', '')}), "
            f"driver {m['driver']}, torch {m['torch']}, triton {m['triton']}, {m['date']}\n"
            f"command: {m['command']}\n"
            "TFLOP/s = FLOPs / median time; FLOPs = 2*B*H_q*N*N*(DK+DV), halved when causal; "
            f"CUDA-graph replay, inputs rotated past 3x L2; {m.get('rounds', 1)} interleaved rounds, "
            "median; spread = (max-min)/median of the round medians\n")
    shapes = []
    for r in rows:
        key = (r["B"], r["H_q"], r["H_kv"], r["N"], r["d"], r["causal"])
        if key not in shapes:
            shapes.append(key)
    cols = ["B", "H_q/H_kv", "N", "d", "causal"] + [f"{i}" for i in IMPLS] + ["x FA2", "x cuDNN", "spread%", "flashcl config", "rel diff"]
    lines = []
    for key in shapes:
        by = {r["impl"]: r for r in rows if (r["B"], r["H_q"], r["H_kv"], r["N"], r["d"], r["causal"]) == key}
        f = by.get("flashcl", {})

        def tf(i):
            t = by.get(i, {}).get("tflops")
            return f"{t:.1f}" if t else "n/a"

        def ratio(i):
            a, b_ = f.get("tflops"), by.get(i, {}).get("tflops")
            return f"{a / b_:.2f}" if a and b_ else "n/a"

        cfg = f.get("config") or {}
        cfg_s = _tile_name(cfg) if cfg else "-"
        spread = f"{f['spread_pct']:.1f}" if f.get("spread_pct") is not None else "-"
        diff = f"{f['rel_diff_vs_sdpa']:.1e}" if f.get("rel_diff_vs_sdpa") is not None else "-"
        lines.append([str(key[0]), f"{key[1]}/{key[2]}", str(key[3]), str(key[4]), "T" if key[5] else "F",
                      *[tf(i) for i in IMPLS], ratio("sdpa-flash"), ratio("sdpa-cudnn"), spread, cfg_s, diff])
    widths = [max(len(c), *(len(l[j]) for l in lines)) for j, c in enumerate(cols)]
    fmt = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    errors = [f"  {r['impl']} {(r['B'], r['H_q'], r['H_kv'], r['N'], r['d'], r['causal'])}: {r['error']}"
              for r in rows if r.get("error")]
    out = head + fmt(cols) + "\n" + "\n".join(fmt(l) for l in lines) + format_quant_block(rows)
    if errors:
        out += "\nn/a:\n" + "\n".join(errors)
    return out


def format_quant_block(rows: list[dict]) -> str:
    """The quantized K/V lines (QUANT_IMPL rows next to their shape's flashcl row), "" if none."""
    keyf = lambda r: (r["B"], r["H_q"], r["H_kv"], r["N"], r["d"], r["causal"])  # noqa: E731
    plain = {keyf(r): r for r in rows if r["impl"] == "flashcl"}
    q_rows = [r for r in rows if r["impl"] == QUANT_IMPL]
    if not q_rows:
        return ""
    out = [f"\nK/V quantized to {q_rows[0]['kv_format']} (same inputs, same interleaved rounds; bytes as stored; "
           "ratio = quantized ms / plain ms; TFLOP/s over the same FLOPs; diff: against flashcl on the "
           "dequantized K/V):"]
    num = lambda r, k, fmt: fmt.format(r[k]) if r.get(k) is not None else "n/a"  # noqa: E731
    for r in q_rows:
        p = plain.get(keyf(r), {})
        cfg = r.get("config")
        out.append(f"  {keyf(r)}: {num(r, 'median_ms', '{:.3f}')} ms vs {num(p, 'median_ms', '{:.3f}')} ms "
                   f"{r['dtype']}, ratio {num(r, 'quant_ratio', '{:.3f}')}, {num(r, 'tflops', '{:.1f}')} vs "
                   f"{num(p, 'tflops', '{:.1f}')} TFLOP/s, K/V {r['kv_bytes'] / 1e6:.3g} MB vs "
                   f"{p.get('kv_bytes', 0) / 1e6:.3g} MB, diff {num(r, 'rel_diff_vs_dequantized', '{:.1e}')}, "
                   f"config {_tile_name(cfg) if cfg else '-'}")
    return "\n".join(out)


def _format_variant_table(rows: list[dict]) -> str:
    """The variant rows: per shape, TFLOP/s over the visible pairs of each implementation and
    flashcl's speed-up over its plain call and over FlexAttention (ratios of times)."""
    m = rows[0]
    head = (f"flashcl {m['flashcl']} prefill with variants {m['variants']}, {m['dtype']}, {m['device']} "
            f"(sm_{m['capability'].replace('.', '')}), driver {m['driver']}, torch {m['torch']}, "
            f"triton {m['triton']}, {m['date']}\ncommand: {m['command']}\n"
            "TFLOP/s = 4*B*H_q*d*(visible pairs) / median time (flashcl-plain: the causal pairs); "
            f"CUDA-graph replay, inputs rotated past 3x L2; {m.get('rounds', 1)} interleaved rounds, median\n")
    cols = ["B", "H_q/H_kv", "N", "d", "causal", *VARIANT_IMPLS, "ms", "plain ms", "flex ms",
            "x plain", "x flex", "spread%", "flashcl config", "diff vs flex"]
    keyf = lambda r: (r["B"], r["H_q"], r["H_kv"], r["N"], r["d"], r["causal"])  # noqa: E731
    keys = list(dict.fromkeys(keyf(r) for r in rows))
    lines = []
    for key in keys:
        by = {r["impl"]: r for r in rows if keyf(r) == key}
        f = by.get("flashcl", {})
        num = lambda r, k, fmt: fmt.format(r[k]) if r.get(k) is not None else "n/a"  # noqa: E731
        cfg = f.get("config")
        lines.append([str(key[0]), f"{key[1]}/{key[2]}", str(key[3]), str(key[4]), "T" if key[5] else "F",
                      *[num(by.get(i, {}), "tflops", "{:.1f}") for i in VARIANT_IMPLS],
                      *[num(by.get(i, {}), "median_ms", "{:.3f}") for i in VARIANT_IMPLS],
                      num(f, "speedup_vs_plain", "{:.2f}"), num(f, "speedup_vs_flex", "{:.2f}"),
                      num(f, "spread_pct", "{:.1f}"), _tile_name(cfg) if cfg else "-",
                      num(f, "rel_diff_vs_flex", "{:.1e}")])
    widths = [max(len(c), *(len(l[j]) for l in lines)) for j, c in enumerate(cols)]
    fmt = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    out = head + fmt(cols) + "\n" + "\n".join(fmt(l) for l in lines)
    errors = [f"  {r['impl']} {keyf(r)}: {r['error']}" for r in rows if r.get("error")]
    return out + ("\nn/a:\n" + "\n".join(errors) if errors else "")
