"""Quantized paged decode on CUDA: the default plan next to the Gluon GQA kernel forced at each
split count, and the plain cache, in the same rounds (the sweep behind decode_plan's
gqa_takes_quantized rule; docs/notes/quantized-decode.md, "Short contexts and small groups").

    python benchmarks/cuda_quantized_splits.py [--formats int8,fp8_e4m3,q8_0,q4_0]
        [--shape B,H_q,H_kv,N ...] [--splits 1,2,4,8,16,32,64] [--rounds 3] [--dtype bfloat16]

fp16 (or --dtype) q and plain cache, the quantized caches quantized from it, d = 128, paged cache
of block size 16 in random block order. Device microseconds a call (CUDA-graph replay, inputs
rotated past L2, interleaved rounds, median) and x the plain cache's time. ``--splits ''`` times
the default plans only.
"""

from __future__ import annotations

import argparse
import math

import torch

import flashcl
from flashcl.triton import decode as triton_decode
from flashcl.tools.cuda_timing import interleaved_rounds, rotation_count, time_graph
from flashcl.tools.triton_bench_decode import _make_inputs

D, PAGE = 128, 16


def _sets(b: int, h_q: int, h_kv: int, n: int, formats, gen, dtype=torch.float16, device: str = "cuda") -> list:
    """Input sets past L2 (at most 8): the bench's (q, pages in random order, table, lengths) with
    each format's paged caches."""
    sets = []
    for _ in range(min(rotation_count(2 * b * n * h_kv * D * 2), 8)):
        x = _make_inputs((b, h_q, h_kv, n), dtype, PAGE, gen, torch.device(device), "random", D)
        x.update({fmt: tuple(flashcl.quantize(x[n], fmt) for n in ("k_pages", "v_pages")) for fmt in formats})
        sets.append(x)
    return sets


def _forced(x, fmt: str, splits: int):
    """The Gluon GQA kernel forced at ``splits`` on the set's ``fmt`` caches."""
    kq, vq = x[fmt]
    scaled = fmt in ("int8", "fp8_e4m3")
    return triton_decode._launch(x["q"], kq.data, vq.data, x["block_table"], x["context_lens"], 1 / math.sqrt(D),
                                 splits, config={"gluon_gqa": True}, k_scales=kq.scales if scaled else None,
                                 v_scales=vq.scales if scaled else None, k_format=fmt, v_format=fmt)[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default="int8,fp8_e4m3,q8_0,q4_0")
    ap.add_argument("--shape", action="append", default=None, help="B,H_q,H_kv,N (repeatable)")
    ap.add_argument("--splits", default="1,2,4,8,16,32,64")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"), help="q's and the plain cache's")
    args = ap.parse_args()
    formats = args.formats.split(",")
    shapes = [tuple(map(int, s.split(","))) for s in (args.shape or ["1,32,8,4096"])]
    counts = [int(s) for s in args.splits.split(",") if s]
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(torch.cuda.get_device_name(), f"torch {torch.__version__}")
    for b, h_q, h_kv, n in shapes:
        sets = _sets(b, h_q, h_kv, n, formats, gen, getattr(torch, args.dtype))
        plain = args.dtype
        calls = {plain: lambda x: flashcl.decode(x["q"], x["k_pages"], x["v_pages"], block_table=x["block_table"],
                                                 context_lens=x["context_lens"])}
        for fmt in formats:
            calls[f"{fmt} default"] = lambda x, fmt=fmt: flashcl.decode(
                x["q"], *x[fmt], block_table=x["block_table"], context_lens=x["context_lens"])
            for s in (s for s in counts if n // s >= 64):  # a split of one 64-key tile at least
                calls[f"{fmt} gluon s={s}"] = lambda x, fmt=fmt, s=s: _forced(x, fmt, s)
        want = calls[plain](sets[0]).float()
        for name, call in calls.items():  # well inside every format's error at these sizes
            assert (call(sets[0]).float() - want).abs().max().item() < 5e-2, name
        timers = {name: (lambda call=call: time_graph([lambda x=x: call(x) for x in sets])["median_ms"])
                  for name, call in calls.items()}
        r = interleaved_rounds(timers, args.rounds)
        base = r[plain]["median_ms"]
        print(f"({b}, {h_q}/{h_kv}, {n}, {D})  {plain} {1e3 * base:.1f} us", flush=True)
        for name in list(calls)[1:]:
            print(f"    {name:22s} {1e3 * r[name]['median_ms']:7.1f} us  {r[name]['median_ms'] / base:.3f}x {plain}",
                  flush=True)


if __name__ == "__main__":
    main()
