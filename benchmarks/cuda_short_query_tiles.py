"""The tiles of the few-row prefill route on CUDA (flashcl.prefill of N_q causal rows run as the
Triton decode of its rows, prefill._rows_as_decode): the plan's tile beside forced ones, per K/V
format, at one shape.

    python benchmarks/cuda_short_query_tiles.py [--formats q8_0,q4_0,int8,fp16] [--n-q 8,16]
        [--n-kv 32768] [--padding P] [--rounds 2]

(1, 32/8, N_q, N_kv, 128), fp16 q, contiguous K/V (quantized by flashcl.quantize where a format is
given), causal rows (N_q 1: one row); ``--padding``: a bool mask hiding the first P keys, read by
the kernel (ROW_MASK). Each tile is (BLOCK_N, num_warps) forced through ``decode._launch``'s
config at the plan's split count for that tile; "plan" is the launch as flashcl.prefill makes it.
Device microseconds a call (CUDA-graph replay, inputs rotated past L2, interleaved rounds: median).
"""

from __future__ import annotations

import argparse

import torch

import flashcl
from flashcl.tools.cuda_timing import device_and_host, rotation_count
from flashcl.triton import decode as triton_decode

B, H_Q, H_KV, D = 1, 32, 8, 128
TILES = [(64, 2), (64, 4), (64, 8), (32, 2), (32, 4), (128, 8)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default="q8_0,q4_0,int8,fp16")
    ap.add_argument("--n-q", default="8,16")
    ap.add_argument("--n-kv", type=int, default=32768)
    ap.add_argument("--padding", type=int, default=None, help="a bool mask hides the first P keys")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    n_kv = args.n_kv
    gen = torch.Generator(device="cuda").manual_seed(0)
    rand = lambda *s: torch.randn(*s, device="cuda", dtype=torch.float16, generator=gen)  # noqa: E731
    print(torch.cuda.get_device_name(), f"torch {torch.__version__}", f"(1, 32/8, N_q, {n_kv}, 128)",
          f"padding {args.padding}")
    for fmt in args.formats.split(","):
        fmt = "" if fmt == "fp16" else fmt
        sets = [{"k": rand(B, H_KV, n_kv, D), "v": rand(B, H_KV, n_kv, D)}
                for _ in range(rotation_count(2 * B * H_KV * n_kv * D * 2))]
        for x in sets:
            if fmt:
                x["k"], x["v"] = (flashcl.quantize(x[n], fmt) for n in ("k", "v"))
        for n_q in (int(n) for n in args.n_q.split(",")):
            for x in sets:
                x["q"] = rand(B, H_Q, n_q, D)
            mask = None
            if args.padding is not None:
                mask = (torch.arange(n_kv, device="cuda") >= args.padding).expand(1, 1, n_q, n_kv).contiguous()

            def rows(x, config, n_q=n_q, mask=mask):
                k, v, quant = x["k"], x["v"], {}
                if fmt:
                    quant = dict(k_format=fmt, v_format=fmt, k_scales=k.scales, v_scales=v.scales)
                    k, v = k.data, v.data
                return triton_decode._launch(x["q"].reshape(B, H_Q * n_q, D), k, v, None, None, D ** -0.5, 0,
                                             config=config, query_rows=n_q if n_q > 1 else 1, row_mask=mask,
                                             **quant)

            calls = {"plan": lambda x, mask=mask: flashcl.prefill(x["q"], x["k"], x["v"], causal=True, mask=mask)}
            calls.update({f"{n} keys, {w} warps": (lambda x, n=n, w=w: rows(x, {"BLOCK_N": n, "num_warps": w}))
                          for n, w in TILES})
            res = device_and_host(calls, sets, args.rounds)
            print(f"{fmt or 'fp16'} N_q {n_q}: " + " | ".join(f"{k} {1e3 * r['median_ms']:.1f}"
                                                           for k, r in res.items()), flush=True)


if __name__ == "__main__":
    main()
