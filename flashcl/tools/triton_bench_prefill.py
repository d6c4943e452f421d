"""Prefill benchmark: flashcl's Triton kernel against torch SDPA's backends, same inputs, same run.

    flashcl bench prefill --backend triton [--dtype float16] [--rounds 3] [--json]

Throughput is TFLOP/s of exact attention (FLOPs below, next to the timing); each implementation
is timed by CUDA-graph replay over input sets rotated past 3x L2 (flashcl.cuda_timing). The
implementations take turns: ``--rounds`` rounds, each timing every implementation once (median of
20 replays), the first to run rotating from round to round, so clock and temperature drift over a
run fall on all of them alike (an H100 runs the first ~0.1 s after a pause up to 10% faster, then
settles: a single pass favours whoever runs first). Reported: the median over the rounds, and the
spread of the round medians. Peers are torch SDPA restricted to one backend each (FLASH_ATTENTION
= FlashAttention-2, CUDNN_ATTENTION, EFFICIENT_ATTENTION); a backend that refuses a shape is
reported as n/a with its reason.
"""

from __future__ import annotations

import datetime
import json
import sys

import torch

from . import shapes

# (B, H_q, H_kv, N, d, causal): the reference shapes, then long sequences
REFERENCE_SHAPES = shapes.PREFILL_REFERENCE + shapes.PREFILL_LONG
IMPLS = ("flashcl", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient")


def prefill_flops(b: int, h_q: int, n_q: int, n_kv: int, dk: int, dv: int, causal: bool) -> float:
    """FLOPs of exact attention: S = Q K^T is 2 N_q N_kv DK, O = P V is 2 N_q N_kv DV per head
    (4 B H N_q N_kv d when DK = DV = d); causal attention computes half of them (the usual
    convention, exact up to the diagonal)."""
    flops = 2.0 * b * h_q * n_q * n_kv * (dk + dv)
    return flops / 2 if causal else flops


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


def _bench_shape(shape, dtype, meta, rounds: int = 3) -> list[dict]:
    from . import cuda_timing
    from ..triton import prefill as tp

    b, h_q, h_kv, n, d, causal = shape
    elt = torch.empty((), dtype=dtype).element_size()
    set_bytes = (2 * b * h_q * n * d + 2 * b * h_kv * n * d) * elt  # q, out, k, v
    n_sets = cuda_timing.rotation_count(set_bytes)
    g = torch.Generator(device="cuda").manual_seed(0)
    sets = [tuple(torch.randn(s, device="cuda", dtype=dtype, generator=g)
                  for s in ((b, h_q, n, d), (b, h_kv, n, d), (b, h_kv, n, d)))
            for _ in range(n_sets)]
    flops = prefill_flops(b, h_q, n, n, d, d, causal)

    rows, outputs, runnable = [], {}, {}
    for impl in IMPLS:
        row = {**meta, "impl": impl, "B": b, "H_q": h_q, "H_kv": h_kv, "N": n, "d": d,
               "causal": causal, "rotated_sets": n_sets, "flops": flops, "rounds": rounds}
        rows.append(row)
        try:
            make = _flashcl_call if impl == "flashcl" else (lambda *a, _i=impl: _sdpa_call(_i, *a))
            calls = [make(q, k, v, causal) for q, k, v in sets]
            outputs[impl] = calls[0]()  # flashcl: autotunes this key here, outside the graph
            torch.cuda.synchronize()
            if impl == "flashcl":
                timings = getattr(tp._prefill_autotuned, "configs_timings", None) or {}
                row["autotune_ms"] = {_config_name(c): _first(ms) for c, ms in timings.items()}
                row["config"] = tp.best_config(n, n, d, d, causal, dtype, batch_heads=b * h_q)
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
    del sets, outputs
    torch.cuda.empty_cache()
    return rows


def run(shapes=None, dtype: str = "float16", rounds: int = 3) -> list[dict]:
    """Time every implementation on every shape; one row per (shape, implementation).

    ``shapes``: (B, H_q, H_kv, N, d, causal) tuples, or (B, H, N, d, causal) for H_q = H_kv;
    default REFERENCE_SHAPES. ``rounds``: turns each implementation gets (module docstring).
    """
    from .. import __version__
    from . import cuda_timing

    if not torch.cuda.is_available():
        raise RuntimeError("bench_prefill needs a CUDA GPU (torch.cuda.is_available() is False)")
    torch_dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    summary = cuda_timing.device_summary()
    meta = {
        "device": summary["device"], "capability": summary["capability"], "driver": summary["driver"],
        "torch": summary["torch"], "triton": __import__("triton").__version__, "dtype": dtype,
        "flashcl": __version__, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["flashcl bench prefill --backend triton", *sys.argv[1:]]),
    }
    rows = []
    for shape in shapes or REFERENCE_SHAPES:
        if len(shape) == 5:
            b, h, n, d, causal = shape
            shape = (b, h, h, n, d, causal)
        rows += _bench_shape(tuple(shape), torch_dtype, meta, rounds)
    return rows


def format_table(rows: list[dict]) -> str:
    """A human table: one line per shape, TFLOP/s per implementation, flashcl's ratios."""
    if not rows:
        return "(no rows)"
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
    out = head + fmt(cols) + "\n" + "\n".join(fmt(l) for l in lines)
    if errors:
        out += "\nn/a:\n" + "\n".join(errors)
    return out
