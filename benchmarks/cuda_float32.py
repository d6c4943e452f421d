"""float32 on the Triton kernels: default calls of flashcl.prefill (autotuned) and flashcl.decode
(planned), next to torch's SDPA (its own dispatch) for the prefills.

    python benchmarks/cuda_float32.py [--no-sdpa]

Prefill (B, H_q/H_kv, N, d), causal but for the last shape; decode (B, H_q/H_kv, N) paged 16 in
random order, d = 128. Device time a call in CUDA-graph replay (prefill: 2 input sets; decode:
sets rotated past 3x L2), the better of two replays of 20. Run once per tree to compare trees.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import flashcl
from flashcl.tools.cuda_timing import rotation_count, time_graph
from flashcl.tools.triton_bench_decode import _make_inputs

PREFILLS = [(1, 32, 32, 4096, 64, True), (1, 32, 32, 4096, 128, True), (1, 32, 8, 2048, 128, True),
            (1, 32, 32, 4096, 256, True), (2, 16, 16, 1024, 128, False)]
DECODES = [(8, 32, 32, 8192), (1, 32, 8, 32768), (4, 32, 8, 8192), (1, 32, 32, 32768)]


def _ms(call, sets) -> float:
    return min(time_graph([lambda s=s: call(s) for s in sets])["median_ms"] for _ in range(2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-sdpa", action="store_true", help="time flashcl only")
    args = ap.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    for b, h_q, h_kv, n, d, causal in PREFILLS:
        sets = [tuple(torch.randn(b, h, n, d, device=dev, generator=gen) for h in (h_q, h_kv, h_kv))
                for _ in range(2)]
        flops = 4 * b * h_q * n * n * d / (2 if causal else 1)
        calls = {"flashcl": lambda x: flashcl.prefill(*x, causal=causal)}
        if not args.no_sdpa:
            calls["sdpa"] = lambda x: F.scaled_dot_product_attention(*x, is_causal=causal, enable_gqa=h_q != h_kv)
        for name, call in calls.items():
            ms = _ms(call, sets)
            print(f"prefill ({b},{h_q}/{h_kv},{n},{d}) causal={causal} {name:8s} {ms:8.3f} ms "
                  f"{flops / ms / 1e9:6.1f} TFLOP/s", flush=True)
    for shape in DECODES:
        nbytes = 2 * shape[0] * shape[2] * shape[3] * 128 * 4
        sets = [_make_inputs(shape, torch.float32, 16, gen, dev, "random", 128)
                for _ in range(rotation_count(nbytes, dev))]
        ms = _ms(lambda x: flashcl.decode(x["q"], x["k_pages"], x["v_pages"], block_table=x["block_table"],
                                          context_lens=x["context_lens"]), sets)
        print(f"decode {shape} d=128 {ms * 1e3:8.1f} us {nbytes / ms / 1e9:5.2f} TB/s", flush=True)
        del sets


if __name__ == "__main__":
    main()
