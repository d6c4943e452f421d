"""Benchmark of the Triton paged-KV decode against torch SDPA (docs/design.md §7).

    flashcl bench decode --backend triton [--dtype float16] [--head-dim 128] [--block-size 16]
                                          [--block-order random] [--rounds 3] [--json]

For each decode shape (B, H_q, H_kv, ctx) and head dim d (``--head-dim``, 128 by default): a paged
cache whose blocks are a random permutation (``--block-order random``, the default: a cache after
some serving) or in allocation order (``sequential``: a fresh cache), inputs rotated past 3x L2,
every call timed by CUDA-graph replay in interleaved rounds (``--rounds``: each round times every
variant once; median of the round medians, and their spread). flashcl runs with the automatic split
count and with forced split counts; torch SDPA runs on the same KV as a contiguous (B, H_kv, ctx,
d) tensor (enable_gqa for GQA/MQA), same rotation, and so does flashcl's own kernel ("contig"
column: the same kernel without a block table, which separates what paging costs from what the
kernel costs), and SDPA held to its FlashAttention-2 backend as a second peer ("FA2"; torch 2.11
dispatches these shapes to cuDNN, which is faster and is the target). Reported: TB/s over the bytes
each call must move, % of the device's copy bandwidth and % of its streaming-read bandwidth (a kernel
that only reads: decode's ceiling) measured in the same run, the SDPA ratio, and whether the
automatic split count is within 5% of the best forced one.

``variants`` (``run(variants={"window": (1023, 0), "softcap": 30.0})``, the CLI's --window and
--softcap; "sinks" and "alibi_slopes" True draw values): the same inputs are also timed with the
variants on, in the same interleaved rounds as the plain call, at their own automatic plan.
Reported next to the plain call: their time, TB/s over the bytes they must move (a window reads
only its keys), and the ratio of their time to the plain call's ("var/plain": < 1 where a window
skips keys, the variants' cost where it does not).

``kv_format`` (``run(kv_format="q8_0")``, the CLI's --kv-format: q8_0, q4_0, int8 or fp8_e4m3):
the same paged K/V quantized (flashcl.quantize) are timed next to the float16 call in the same
rounds. Reported: their time, the ratio to the float16 time, TB/s over the bytes as stored
(_stored_bytes) and that bandwidth as a fraction of the float16 call's. With ``variants`` too,
the quantized call with the variants on, and its ratio to the quantized call without them.

What paging costs, measured with this command on an H100 (fp16, d=128, block_size 16, random
blocks): the paged kernel is 1-5% behind the same kernel on contiguous KV (1.0-1.7% on the
one-split shapes, 4-5% on MQA and 32k). Where that goes, and what was tried against it:
docs/notes/decode-h100.md.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import sys

import torch

from .. import __version__
from ..api import _check_head_dim  # noqa: F401 - the CLI checks --head-dim with it
from ..triton import decode as triton_decode
from ..triton import decode_plan
from ..quant import quantize
from ..variants import Variants
from . import cuda_timing, shapes
from .triton_bench_prefill import _sdpa_call

REFERENCE_SHAPES = shapes.DECODE_REFERENCE  # (B, H_q, H_kv, ctx)
HEAD_DIM = shapes.DECODE_HEAD_DIM
AUTO_TOLERANCE = 1.05  # the automatic split count must be within 5% of the best forced one


def _bytes_moved(b, h_q, h_kv, ctx, dk, dv, elt) -> int:
    """Fewest bytes a decode step must move: each K/V row read once for its GQA group, q read,
    out written. (The block table and the split-k partials are overhead, not counted.)"""
    return b * h_kv * ctx * (dk + dv) * elt + b * h_q * (dk + dv) * elt


# bytes one token's head-dim row of d values takes as stored: ggml blocks of 32 values (2 bytes
# of fp16 d each), int8 values and one float32 scale per row, fp8 values (the tensor's one scale
# is not per row)
_ROW_BYTES = {"q8_0": lambda d: d // 32 * 34, "q4_0": lambda d: d // 32 * 18, "int8": lambda d: d + 4,
              "fp8_e4m3": lambda d: d}


def _stored_bytes(b, h_q, h_kv, ctx, d, elt, kv_format) -> int:
    """Fewest bytes a decode step over a quantized cache must move: each K/V row read once as
    stored, q read and out written in q's type."""
    return b * h_kv * ctx * 2 * _ROW_BYTES[kv_format](d) + b * h_q * 2 * d * elt


def _flops(b, h_q, ctx, dk, dv) -> int:
    """q.k^T and p.v: 2 * ctx * (DK + DV) per query head (decode is bandwidth bound: ~1 FLOP/B
    for MHA fp16, G FLOP/B for a GQA group of G)."""
    return 2 * b * h_q * ctx * (dk + dv)


# random: a cache after some serving; sequential: a fresh cache (allocation order); ascending: the
# random blocks of each sequence listed in address order (what sorting a random table would give;
# it separates the cost of random addresses from the cost of their order)
BLOCK_ORDERS = ("random", "sequential", "ascending")


def _make_inputs(shape, dtype, block_size, gen, device, block_order: str = "random", head_dim: int = HEAD_DIM):
    """One input set: q, the contiguous KV (for SDPA) and the same KV in pages, the blocks of the
    block table in random order, in allocation order, or random blocks in ascending order within
    each sequence (``block_order``, one of BLOCK_ORDERS)."""
    if block_order not in BLOCK_ORDERS:
        raise ValueError(f"block_order: expected one of {BLOCK_ORDERS}, got {block_order!r}")
    b, h_q, h_kv, ctx = shape
    d = head_dim
    q = torch.randn((b, h_q, d), generator=gen, device=device, dtype=torch.float32).to(dtype)
    k = torch.randn((b, h_kv, ctx, d), generator=gen, device=device, dtype=torch.float32).to(dtype)
    v = torch.randn((b, h_kv, ctx, d), generator=gen, device=device, dtype=torch.float32).to(dtype)
    blocks_per_seq = triton_decode.triton.cdiv(ctx, block_size)
    num_blocks = b * blocks_per_seq
    if block_order == "sequential":
        perm = torch.arange(num_blocks, device=device)
    else:
        perm = torch.randperm(num_blocks, generator=gen, device=device)
    if block_order == "ascending":
        perm = perm.view(b, blocks_per_seq).sort(dim=1).values.flatten()
    block_table = perm.view(b, blocks_per_seq).to(torch.int32)
    pad = blocks_per_seq * block_size - ctx

    def to_pages(x):  # (B, H_kv, ctx, d) -> (num_blocks, block_size, H_kv, d), block j at perm[j]
        x = torch.nn.functional.pad(x, (0, 0, 0, pad))
        x = x.view(b, h_kv, blocks_per_seq, block_size, d).permute(0, 2, 3, 1, 4)
        pages = torch.empty((num_blocks, block_size, h_kv, d), dtype=dtype, device=device)
        pages[perm] = x.reshape(num_blocks, block_size, h_kv, d)
        return pages

    lens = torch.full((b,), ctx, dtype=torch.int32, device=device)
    return {"q": q, "k": k, "v": v, "k_pages": to_pages(k), "v_pages": to_pages(v),
            "block_table": block_table, "context_lens": lens}


def _variants_of(variants: dict, b: int, h_q: int, device) -> Variants:
    """The backend's Variants for the bench's ``variants`` dict: window and softcap as given, sinks
    and ALiBi slopes (True) drawn as models use them (sinks ~ N(0, 1), slopes 2^(-8 (h + 1) / H_q))."""
    unknown = set(variants) - {"window", "softcap", "sinks", "alibi_slopes"}
    if unknown:
        raise ValueError(f"variants: unknown {sorted(unknown)}; decode takes window, softcap, sinks, alibi_slopes")
    sinks, slopes = variants.get("sinks"), variants.get("alibi_slopes")
    if sinks is True:
        sinks = torch.randn(h_q, generator=torch.Generator().manual_seed(1))
    if slopes is True:
        slopes = 2.0 ** (-8.0 * torch.arange(1, h_q + 1, dtype=torch.float64) / h_q)
    def on_device(x, shape):
        return None if x is None else torch.as_tensor(x, dtype=torch.float32).expand(shape).to(device).contiguous()

    window = variants.get("window")
    return Variants(window=None if window is None else tuple(window), softcap=variants.get("softcap"),
                    sinks=on_device(sinks, (h_q,)), alibi_slopes=on_device(slopes, (b, h_q)))


def _keys_seen(ctx: int, window) -> int:
    """The keys a query at position ctx - 1 sees under ``window``."""
    return ctx if window is None or window[0] < 0 else min(ctx, window[0] + 1)


def _inner_reps(n_calls: int, est_s: float) -> int:
    """Calls per replay so one replay lasts >= ~1 ms (event resolution, launch gaps amortized)."""
    return max(1, min(50, int(math.ceil(1e-3 / max(n_calls * est_s, 1e-9)))))


def _time(fn, sets, est_s):
    calls = [(lambda s=s: fn(s)) for s in sets]
    return cuda_timing.time_graph(calls, warmup=3, reps=20, inner=_inner_reps(len(calls), est_s))


def _forced_splits(ctx: int, block_n: int, splits) -> list[int]:
    if splits is not None:
        return sorted(set(int(s) for s in splits))
    n_tiles = triton_decode.triton.cdiv(ctx, block_n)
    out, s = [], 1
    while s <= min(n_tiles, 128):
        out.append(s)
        s *= 2
    return out


def run(shapes=None, dtype: str = "float16", block_size: int = 16, splits=None, seed: int = 0,
        on_row=None, block_order: str = "random", rounds: int = 3, head_dim: int = HEAD_DIM,
        variants: dict | None = None, kv_format: str | None = None, knobs: dict | None = None) -> list[dict]:
    """Time every shape; one dict per shape (see the module docstring for what is measured).
    ``on_row(row)`` is called as each shape finishes (progress on long runs); ``rounds``:
    interleaved rounds (cuda_timing.interleaved_rounds); ``variants``: also timed with these on;
    ``kv_format``: also timed on the K/V quantized to it; ``knobs``: decode_plan knobs every
    flashcl call of the run takes (decode_plan.knob_defaults)."""
    with decode_plan.knob_defaults(knobs or {}):
        return _run(shapes, dtype, block_size, splits, seed, on_row, block_order, rounds, head_dim, variants,
                    kv_format, knobs or {})


def _run(shapes, dtype, block_size, splits, seed, on_row, block_order, rounds, head_dim, variants, kv_format,
         knobs) -> list[dict]:
    if kv_format is not None and kv_format not in _ROW_BYTES:
        raise ValueError(f"kv_format: expected one of {sorted(_ROW_BYTES)}, got {kv_format!r}")
    torch_dtype = getattr(torch, dtype)
    device = torch.device("cuda", torch.cuda.current_device())
    facts = decode_plan.facts_of(device)
    shapes = [tuple(s) for s in (shapes or REFERENCE_SHAPES)]
    summary = cuda_timing.device_summary()
    copy_bw = cuda_timing.copy_bandwidth()  # bytes/s, read + write, same run
    read_bw = cuda_timing.read_bandwidth()  # bytes/s, a kernel that only reads: the ceiling
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    elt = torch.empty((), dtype=torch_dtype).element_size()
    rows = []
    for shape in shapes:
        b, h_q, h_kv, ctx = shape
        d = head_dim
        nbytes = _bytes_moved(b, h_q, h_kv, ctx, d, d, elt)
        n_rot = cuda_timing.rotation_count(nbytes, device)
        sets = [_make_inputs(shape, torch_dtype, block_size, gen, device, block_order, d) for _ in range(n_rot)]
        scale = 1.0 / math.sqrt(d)
        est_s = nbytes / 2.5e12

        def flashcl_fn(num_splits):
            return lambda s: triton_decode.decode(
                s["q"], s["k_pages"], s["v_pages"], block_table=s["block_table"],
                context_lens=s["context_lens"], scale=scale, num_splits=num_splits)

        def flashcl_contig(s):  # the same kernel on SDPA's contiguous KV: no block table
            return triton_decode.decode(s["q"], s["k"], s["v"], context_lens=s["context_lens"], scale=scale)

        def sdpa(s):
            return torch.nn.functional.scaled_dot_product_attention(
                s["q"].unsqueeze(2), s["k"], s["v"], scale=scale, enable_gqa=h_q != h_kv)

        def sdpa_fa2(s):  # SDPA held to its FlashAttention-2 backend (default scale = 1/sqrt(d))
            return _sdpa_call("sdpa-flash", s["q"].unsqueeze(2), s["k"], s["v"], False)()

        tb = lambda t: nbytes / (t["median_ms"] * 1e-3) / 1e12  # noqa: E731
        plan = decode_plan.plan(decode_plan.DecodeProblem(b, h_q, h_kv, d, d, ctx, elt, block_size), facts)
        block_n, auto_splits = plan.block_n, plan.num_splits
        calls = {"auto": flashcl_fn(None), "sdpa": sdpa, "contig": flashcl_contig}
        try:  # a peer, not the target: SDPA's default dispatch is the strongest backend here
            sdpa_fa2(sets[0])
            calls["sdpa_fa2"] = sdpa_fa2
        except RuntimeError as e:  # the backend refuses this shape or GPU
            print(f"SDPA FlashAttention-2 backend on {shape}: {str(e).splitlines()[0][:120]}", file=sys.stderr)
        var = _variants_of(variants, b, h_q, device) if variants else None
        if var is not None:
            calls["variants"] = lambda s: triton_decode.decode(
                s["q"], s["k_pages"], s["v_pages"], block_table=s["block_table"], context_lens=s["context_lens"],
                scale=scale, variants=var)
            var_bytes = _bytes_moved(b, h_q, h_kv, _keys_seen(ctx, var.window), d, d, elt)
            # the plain call on the kernels the variants run on (decode_gluon's take none): the
            # variants' own cost, apart from the kernel choice
            no_gluon = dataclasses.replace(facts, gluon=False)
            calls["plain_triton"] = lambda s: triton_decode._launch(
                s["q"], s["k_pages"], s["v_pages"], s["block_table"], s["context_lens"], scale, 0, facts=no_gluon)
        if kv_format is not None:
            for st in sets:
                st["k_quant"], st["v_quant"] = (quantize(st[n], kv_format) for n in ("k_pages", "v_pages"))
                st["k_quant_contig"], st["v_quant_contig"] = (quantize(st[n], kv_format) for n in ("k", "v"))
            calls["quant"] = lambda s: triton_decode.decode(
                s["q"], s["k_quant"], s["v_quant"], block_table=s["block_table"], context_lens=s["context_lens"],
                scale=scale)
            calls["quant_contig"] = lambda s: triton_decode.decode(  # beside "contig": the same cache unpaged
                s["q"], s["k_quant_contig"], s["v_quant_contig"], context_lens=s["context_lens"], scale=scale)
            q_bytes = _stored_bytes(b, h_q, h_kv, ctx, d, elt, kv_format)
            if var is not None:  # what a model with both runs (e.g. softcap on a q8_0 cache)
                calls["quant_variants"] = lambda s: triton_decode.decode(
                    s["q"], s["k_quant"], s["v_quant"], block_table=s["block_table"],
                    context_lens=s["context_lens"], scale=scale, variants=var)
        calls.update({s: flashcl_fn(s) for s in _forced_splits(ctx, block_n, splits)})
        t = cuda_timing.interleaved_rounds(
            {n: (lambda fn=fn, ss=sets: _time(fn, ss, est_s)["median_ms"]) for n, fn in calls.items()}, rounds)
        t_auto, t_sdpa, t_contig = t["auto"], t["sdpa"], t["contig"]
        forced = {s: t[s]["median_ms"] for s in calls if isinstance(s, int)}
        best_s = min(forced, key=forced.get) if forced else None  # --splits with no counts: none forced
        rows.append({
            "shape": f"({b},{h_q},{h_kv},{ctx // 1024}k)" if ctx % 1024 == 0 else str(shape),
            "B": b, "H_q": h_q, "H_kv": h_kv, "ctx": ctx, "d": d, "dtype": dtype,
            "block_size": block_size, "block_order": block_order, "kv_MB": round(b * h_kv * ctx * 2 * d * elt / 1e6, 1),
            "rotation": n_rot, "rounds": rounds,
            "auto_splits": auto_splits, "sm_count_plan": facts.sms, "BLOCK_N": block_n,
            "median_ms": t_auto["median_ms"], "min_ms": t_auto["min_ms"], "max_ms": t_auto["max_ms"],
            "TB_s": tb(t_auto), "pct_copy_bw": 100 * nbytes / (t_auto["median_ms"] * 1e-3) / copy_bw,
            "pct_read_bw": 100 * nbytes / (t_auto["median_ms"] * 1e-3) / read_bw,
            "TFLOP_s": _flops(b, h_q, ctx, d, d) / (t_auto["median_ms"] * 1e-3) / 1e12,
            "sdpa_ms": t_sdpa["median_ms"], "sdpa_TB_s": tb(t_sdpa),
            "vs_sdpa": t_sdpa["median_ms"] / t_auto["median_ms"],
            "contig_ms": t_contig["median_ms"], "contig_TB_s": tb(t_contig),
            "sdpa_fa2_TB_s": tb(t["sdpa_fa2"]) if "sdpa_fa2" in t else None,
            "forced_ms": forced, "best_splits": best_s, "best_forced_ms": forced.get(best_s),
            "auto_within_5pct": None if best_s is None else t_auto["median_ms"] <= AUTO_TOLERANCE * forced[best_s],
            "copy_bw_TB_s": copy_bw / 1e12, "read_bw_TB_s": read_bw / 1e12,
            "device": summary["device"], "sm_count": summary["sm_count"],
            "driver": summary["driver"],
            "torch": summary["torch"], "triton": triton_decode.triton.__version__,
            "flashcl": __version__, "date": date, "knobs": knobs,
        })
        if kv_format is not None:
            t_q = t["quant"]["median_ms"]
            rows[-1].update({
                "kv_format": kv_format, "quant_ms": t_q, "quant_min_ms": t["quant"]["min_ms"],
                "quant_max_ms": t["quant"]["max_ms"], "quant_stored_MB": round(q_bytes / 1e6, 1),
                "quant_TB_s": q_bytes / (t_q * 1e-3) / 1e12, "quant_ratio": t_q / t_auto["median_ms"],
                "quant_bw_vs_fp16": (q_bytes / t_q) / (nbytes / t_auto["median_ms"]),
                "quant_contig_ms": t["quant_contig"]["median_ms"],
                "quant_contig_ratio": t["quant_contig"]["median_ms"] / t_contig["median_ms"],
            })
            if var is not None:
                rows[-1].update({"quant_var_ms": t["quant_variants"]["median_ms"],
                                 "quant_var_ratio": t["quant_variants"]["median_ms"] / t_q})
        if var is not None:
            t_var = t["variants"]["median_ms"]
            rows[-1].update({
                "variants": ", ".join(f"{k}={v}" for k, v in sorted(variants.items())),
                "var_ms": t_var, "var_min_ms": t["variants"]["min_ms"], "var_max_ms": t["variants"]["max_ms"],
                "var_TB_s": var_bytes / (t_var * 1e-3) / 1e12, "var_ratio": t_var / t_auto["median_ms"],
                "plain_triton_ms": t["plain_triton"]["median_ms"],
                "var_vs_plain_triton": t_var / t["plain_triton"]["median_ms"],
                "var_splits": decode_plan.plan(triton_decode.problem_of(
                    sets[0]["q"], sets[0]["k_pages"], sets[0]["v_pages"], sets[0]["block_table"],
                    var.window[0] if var.window else -1, var.softcap or 0.0, var.sinks, var.alibi_slopes),
                    facts).num_splits,
            })
        if on_row is not None:
            on_row(rows[-1])
        del sets
        torch.cuda.empty_cache()
    return rows


# tile configurations swept by --sweep-tiles (those over the shared-memory limit fail to launch
# and are reported as such)
SWEEP_CONFIGS = [{"BLOCK_N": n, "num_warps": w, "num_stages": st}
                 for n, w, st in ((32, 4, 3), (32, 4, 5), (64, 2, 3), (64, 4, 2), (64, 4, 3), (64, 4, 4),
                                  (64, 8, 3), (128, 4, 2), (128, 4, 3), (128, 4, 4), (128, 8, 3))]
SWEEP_SHAPES = [(8, 32, 32, 8192), (1, 32, 8, 131072), (16, 32, 1, 4096)]


def sweep_tiles(shapes=None, configs=None, dtype: str = "float16", block_size: int = 16,
                seed: int = 0, head_dim: int = HEAD_DIM, kv_format: str | None = None, splits=None) -> list[dict]:
    """TB/s of every tile configuration, each at the split count the plan gives its tile, or at each
    of ``splits``. ``kv_format``: K/V quantized to it (TB/s over the bytes as stored)."""
    if kv_format is not None and kv_format not in _ROW_BYTES:
        raise ValueError(f"kv_format: expected one of {sorted(_ROW_BYTES)}, got {kv_format!r}")
    torch_dtype = getattr(torch, dtype)
    device = torch.device("cuda", torch.cuda.current_device())
    facts = decode_plan.facts_of(device)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    elt = torch.empty((), dtype=torch_dtype).element_size()
    formats = (kv_format, kv_format) if kv_format else ("", "")
    rows = []
    for shape in shapes or SWEEP_SHAPES:
        b, h_q, h_kv, ctx = shape
        nbytes = _bytes_moved(b, h_q, h_kv, ctx, head_dim, head_dim, elt)
        if kv_format:
            nbytes = _stored_bytes(b, h_q, h_kv, ctx, head_dim, elt, kv_format)
        sets = [_make_inputs(shape, torch_dtype, block_size, gen, device, head_dim=head_dim)
                for _ in range(cuda_timing.rotation_count(nbytes, device))]
        for st in sets:
            k, v = st["k_pages"], st["v_pages"]
            st["k_scales"] = st["v_scales"] = None
            if kv_format:
                kq, vq = quantize(k, kv_format), quantize(v, kv_format)
                k, v, st["k_scales"], st["v_scales"] = kq.data, vq.data, kq.scales, vq.scales
            st["k_data"], st["v_data"] = k, v
        for cfg in configs or SWEEP_CONFIGS:
            problem = decode_plan.DecodeProblem(b, h_q, h_kv, head_dim, head_dim, ctx, elt, block_size,
                                                kv_formats=formats, q_dtype=dtype)
            for ns in splits or [decode_plan.plan(problem, facts, cfg).num_splits]:
                fn = lambda s, ns=ns, cfg=cfg: triton_decode._launch(  # noqa: E731
                    s["q"], s["k_data"], s["v_data"], s["block_table"], s["context_lens"],
                    1.0 / math.sqrt(head_dim), ns, config=cfg, k_scales=s["k_scales"], v_scales=s["v_scales"],
                    k_format=formats[0], v_format=formats[1])
                try:
                    t = _time(fn, sets, nbytes / 2.5e12)["median_ms"]
                    tbs = nbytes / (t * 1e-3) / 1e12
                except Exception as e:  # out of shared memory and the like: report, go on
                    t, tbs = float("nan"), float("nan")
                    print(f"sweep {shape} {cfg} splits={ns}: {type(e).__name__}: {str(e).splitlines()[0][:120]}",
                          file=sys.stderr)
                    torch.cuda.synchronize()
                rows.append({"shape": str(shape), **cfg, "splits": ns, "kv_format": kv_format or dtype,
                             "median_ms": t, "TB_s": tbs})
        del sets
        torch.cuda.empty_cache()
    return rows


def _or_na(x, spec: str = ".2f") -> str:
    """A measurement that a row may lack (older JSON rows, a peer that did not run)."""
    return "n/a" if x is None else format(x, spec)


def format_table(rows, command: str | None = None) -> str:
    """The rows as a text table under a header with their conditions; ``command``: the command
    line that produced them (default: the module's, with the rows' block order)."""
    if not rows:
        return "(no rows)"
    r0 = rows[0]
    head = (f"flashcl {r0['flashcl']} decode, {r0['dtype']}, d={r0['d']}, block_size={r0['block_size']} "
            f"({r0['block_order']} block order), inputs rotated past 3x L2, CUDA-graph replay, "
            f"{r0.get('rounds', 1)} interleaved rounds, median (spread: min-max of the round medians)\n"
            f"device: {r0['device']} ({r0['sm_count']} SMs), {r0['driver']}, torch {r0['torch']}, "
            f"triton {r0['triton']}, {r0['date']}; copy bandwidth {r0['copy_bw_TB_s']:.2f} TB/s (read + "
            f"write), streaming-read bandwidth {_or_na(r0.get('read_bw_TB_s'))} TB/s (%read: the ceiling)\n"
            f"command: {command or 'flashcl bench decode --backend triton --block-order ' + r0['block_order']}\n"
            f"contig = the same kernel on SDPA's contiguous KV (no block table); SDPA = torch's own "
            f"dispatch (the target), FA2 = SDPA held to its FlashAttention-2 backend (a weaker peer)\n")
    cols = ("shape", "KV MB", "splits", "ms", "spread", "TB/s", "%copy", "%read", "SDPA TB/s", "xSDPA",
            "contig TB/s", "FA2 TB/s", "best forced", "auto<=5%")
    lines = [cols]
    for r in rows:
        lines.append((
            r["shape"], f"{r['kv_MB']:.0f}", str(r["auto_splits"]), f"{r['median_ms']:.4f}",
            f"{r['min_ms']:.4f}-{r['max_ms']:.4f}", f"{r['TB_s']:.2f}", f"{r['pct_copy_bw']:.0f}",
            _or_na(r.get("pct_read_bw"), ".1f"),
            f"{r['sdpa_TB_s']:.2f}", f"{r['vs_sdpa']:.3f}", f"{r['contig_TB_s']:.2f}",
            _or_na(r.get("sdpa_fa2_TB_s")),
            "-" if r["best_splits"] is None else f"{r['best_splits']}: {r['best_forced_ms']:.4f}",
            {None: "-", True: "yes", False: "NO"}[r["auto_within_5pct"]],
        ))
    widths = [max(len(line[i]) for line in lines) for i in range(len(cols))]
    out = [head]
    for i, line in enumerate(lines):
        out.append("  ".join(c.rjust(w) for c, w in zip(line, widths)))
        if i == 0:
            out.append("  ".join("-" * w for w in widths))
    q_rows = [r for r in rows if r.get("kv_format")]
    if q_rows:
        out.append(f"\nK/V quantized to {q_rows[0]['kv_format']} (same run, same rounds; TB/s over the bytes as "
                   f"stored; time and bandwidth relative to the {q_rows[0]['dtype']} call above):")
        for r in q_rows:
            out.append(f"  {r['shape']}: {r['quant_ms']:.4f} ms ({r['quant_min_ms']:.4f}-{r['quant_max_ms']:.4f}), "
                       f"{r['quant_stored_MB']:.0f} MB stored, {r['quant_TB_s']:.2f} TB/s; time x{r['quant_ratio']:.3f}"
                       f", bandwidth x{r['quant_bw_vs_fp16']:.3f} of {r['dtype']}")
            if r.get("quant_contig_ms") is not None:
                out.append(f"    contiguous (B, H_kv, N, D): {r['quant_contig_ms']:.4f} ms, time "
                           f"x{r['quant_contig_ratio']:.3f} of the contiguous {r['dtype']} call")
            if r.get("quant_var_ms") is not None:
                out.append(f"    with variants {r['variants']}: {r['quant_var_ms']:.4f} ms, "
                           f"x{r['quant_var_ratio']:.3f} of the {r['kv_format']} call without them")
    var_rows = [r for r in rows if r.get("variants")]
    if var_rows:
        out.append(f"\nwith variants {var_rows[0]['variants']} (same run, same rounds; TB/s over the keys "
                   f"they see; var/plain = their time / the plain call's):")
        for r in var_rows:
            out.append(f"  {r['shape']}: plain {r['median_ms']:.4f} ms, variants {r['var_ms']:.4f} ms "
                       f"({r['var_min_ms']:.4f}-{r['var_max_ms']:.4f}, {r['var_splits']} splits, "
                       f"{r['var_TB_s']:.2f} TB/s), var/plain {r['var_ratio']:.3f} "
                       f"(plain/var {1 / r['var_ratio']:.1f}x); plain on the Triton kernels "
                       f"{r['plain_triton_ms']:.4f} ms, var/that {r['var_vs_plain_triton']:.3f}")
    if any(r["forced_ms"] for r in rows):
        out.append("\nforced split counts (ms):")
    for r in rows:
        if r["forced_ms"]:
            out.append(f"  {r['shape']}: " + ", ".join(f"{s}={t:.4f}" for s, t in r["forced_ms"].items()))
    return "\n".join(out)
