"""flashcl.decode on CUDA over a contiguous (B, H_kv, N, D) cache (the layout transformers' caches
and the few-row prefill route hand it), next to torch's SDPA of the same query row.

    python benchmarks/cuda_contiguous_decode.py [--rounds 3] [--kv-format FMT]

fp16, d = 128, one query row per head. Device microseconds a call (CUDA-graph replay, inputs
rotated past L2, interleaved rounds: the median, and the least and most round) and the bandwidth
of flashcl's on the K/V bytes. With ``--kv-format``, flashcl also reads the cache quantized in the
same rounds (bytes as stored, time x the fp16 cache's); SDPA reads the fp16 one. Paged caches
are `flashcl bench decode`'s.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import flashcl
from flashcl.tools.cuda_timing import device_and_host, rotation_count
from flashcl.tools.triton_bench_decode import _ROW_BYTES

D = 128
SHAPES = [(1, 32, 8, 4096), (1, 32, 8, 8192), (1, 32, 8, 16384), (1, 32, 8, 32768), (1, 16, 8, 32768),
          (1, 32, 16, 32768), (1, 32, 8, 131072)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kv-format", default=None, choices=("q8_0", "q4_0", "int8", "fp8_e4m3"))
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rand = lambda *s: torch.randn(*s, device="cuda", dtype=torch.float16, generator=gen)  # noqa: E731
    print(torch.cuda.get_device_name(), f"torch {torch.__version__}")
    for b, h_q, h_kv, n in SHAPES:
        kv_bytes = 2 * b * h_kv * n * D * 2
        sets = [{"k": rand(b, h_kv, n, D), "v": rand(b, h_kv, n, D), "q": rand(b, h_q, D)}
                for _ in range(rotation_count(kv_bytes))]
        fmt = args.kv_format
        quant = f"flashcl.decode {fmt}"  # the quantized cache's call, where --kv-format is given
        stored = {"flashcl.decode": kv_bytes, "SDPA": kv_bytes}
        if fmt:
            for x in sets:
                x["kq"], x["vq"] = flashcl.quantize(x["k"], fmt), flashcl.quantize(x["v"], fmt)
            stored[quant] = 2 * b * h_kv * n * _ROW_BYTES[fmt](D)
        calls = {"flashcl.decode": lambda x: flashcl.decode(x["q"], x["k"], x["v"]),
                 "SDPA": lambda x: F.scaled_dot_product_attention(x["q"][:, :, None], x["k"], x["v"],
                                                                  enable_gqa=True)}
        if fmt:
            calls[quant] = lambda x: flashcl.decode(x["q"], x["kq"], x["vq"])
        want = calls["SDPA"](sets[0])[:, :, 0].float()
        for name in calls:
            if name != "SDPA":  # the quantized cache's own error is well inside this bound at these sizes
                assert (calls[name](sets[0]).float() - want).abs().max().item() < 2e-2, (name, b, h_q, h_kv, n)
        timed = device_and_host(calls, sets, args.rounds)
        for name, r in timed.items():
            us = 1e3 * r["median_ms"]
            ratio = f"  {r['median_ms'] / timed['flashcl.decode']['median_ms']:.3f}x fp16" if name == quant else ""
            print(f"({b}, {h_q}/{h_kv}, {n:6d}, {D})  {name:22s} device {us:7.1f} us "
                  f"({1e3 * r['min_ms']:.1f}-{1e3 * r['max_ms']:.1f})  {stored[name] / us / 1e6:5.2f} TB/s{ratio}",
                  flush=True)


if __name__ == "__main__":
    main()
