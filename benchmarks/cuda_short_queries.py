"""flashcl.prefill on CUDA with few query rows against a long cache (speculative verification,
small chunks), next to flashcl.decode of one row and torch's SDPA with the bottom-right causal
mask; CPU devices have their own run of this in short_queries.py.

    python benchmarks/cuda_short_queries.py [--rounds 5] [--window LEFT] [--kv-format FMT] [--padding P [--additive]]
        [--paged]

fp16, contiguous (1, 32/8, N_q, N_kv, 128), N_kv 4k and 32k, N_q 1, 2, 4, 8 and 16, causal
(with ``--window``, a window (LEFT, 0) on flashcl's rows and in SDPA's mask; with
``--kv-format``, flashcl reads the cache quantized, SDPA the fp16 one; with ``--padding``, a
bool mask hides the first P keys, a left-padded sequence's, from flashcl and SDPA; with
``--additive`` flashcl takes it as a float32 mask of 0 and -inf; with ``--paged``, also
flashcl.decode of the N_q rows, q (B, H_q, N_q, D), on the same cache in pages of 16 tokens in
random order, which prefill does not take). Device
microseconds a call (CUDA-graph replay, inputs rotated past L2, interleaved rounds: the median,
and the least and most round), then the host's microseconds a call (eager, no synchronize: the
least of 5 rounds of 100 calls).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import flashcl
from flashcl import reference
from flashcl.tools.cuda_timing import device_and_host, rotation_count

B, H_Q, H_KV, D = 1, 32, 8, 128


def bottom_right_mask(n_q: int, n_kv: int, window: int | None) -> torch.Tensor:
    """flashcl's causal rows (row i at position n_kv - n_q + i) and window as SDPA's bool mask."""
    left = window if window is not None else -1
    seen = reference.causal_mask(n_q, n_kv) & reference.window_mask(n_q, n_kv, (left, -1))
    return torch.from_numpy(seen).to("cuda")


def padding_mask(n_q: int, n_kv: int, padding: int) -> torch.Tensor:
    """(1, 1, n_q, n_kv) bool: the first ``padding`` keys hidden from every row."""
    return (torch.arange(n_kv, device="cuda") >= padding).expand(1, 1, n_q, n_kv).contiguous()


def paged(x: torch.Tensor, gen: torch.Generator, page: int = 16) -> tuple:
    """A contiguous (1, H_kv, N, D) cache as pages of ``page`` tokens in random order: (pages, table)."""
    _, h_kv, n, d = x.shape
    order = torch.randperm(n // page, generator=gen, device="cuda")
    pages = torch.empty((n // page, page, h_kv, d), dtype=x.dtype, device="cuda")
    pages[order] = x[0].reshape(h_kv, n // page, page, d).permute(1, 2, 0, 3)
    return pages, order[None].to(torch.int32)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--window", type=int, default=None, help="a window (LEFT, 0) on the causal rows")
    ap.add_argument("--kv-format", default=None, choices=("q8_0", "q4_0", "int8", "fp8_e4m3"),
                    help="flashcl's K/V quantized to this format")
    ap.add_argument("--padding", type=int, default=None, help="a bool mask hides the first P keys")
    ap.add_argument("--additive", action="store_true", help="the padding as an additive mask (0 / -inf)")
    ap.add_argument("--paged", action="store_true", help="also flashcl.decode of the rows on a paged cache")
    args = ap.parse_args()
    window = None if args.window is None else (args.window, 0)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rand = lambda *s: torch.randn(*s, device="cuda", dtype=torch.float16, generator=gen)  # noqa: E731
    fmt = args.kv_format
    print(torch.cuda.get_device_name(), f"torch {torch.__version__}", f"window {window}", f"K/V {fmt or 'fp16'}")
    for n_kv in (4096, 32768):
        sets = [{"k": rand(B, H_KV, n_kv, D), "v": rand(B, H_KV, n_kv, D)}
                for _ in range(rotation_count(2 * B * H_KV * n_kv * D * 2))]
        for x in sets:  # flashcl's K/V ("fk", "fv"): as stored; SDPA's: their values in fp16
            x["fk"], x["fv"] = x["k"], x["v"]
            if args.paged:  # the same keys in pages: flashcl.decode's ("pk", "pv"), as stored
                (x["pk"], x["table"]), (x["pv"], _) = (paged(x[n], torch.Generator(device="cuda").manual_seed(1))
                                                        for n in ("k", "v"))
                x["lens"] = torch.tensor([n_kv], dtype=torch.int32, device="cuda")
            if fmt:
                x["fk"], x["fv"] = (flashcl.quantize(x[n], fmt) for n in ("k", "v"))
                x["k"], x["v"] = (flashcl.dequantize(x[n]).to(torch.float16) for n in ("fk", "fv"))
                if args.paged:
                    x["pk"], x["pv"] = (flashcl.quantize(x[n], fmt) for n in ("pk", "pv"))
        for n_q in (1, 2, 4, 8, 16):
            for x in sets:
                x["q"] = rand(B, H_Q, n_q, D)
            mask = bottom_right_mask(n_q, n_kv, args.window)
            pad = None if args.padding is None else padding_mask(n_q, n_kv, args.padding)
            if pad is not None:
                mask = mask & pad
                if args.additive:
                    pad = torch.zeros(pad.shape, device="cuda").masked_fill(~pad, float("-inf"))
            calls = {
                "flashcl.prefill": lambda x: flashcl.prefill(x["q"], x["fk"], x["fv"], causal=True, window=window,
                                                             mask=pad),
                "SDPA, mask": lambda x: F.scaled_dot_product_attention(x["q"], x["k"], x["v"], attn_mask=mask,
                                                                       enable_gqa=True),
            }
            if n_q == 1:
                starts = None if pad is None else torch.tensor([args.padding], dtype=torch.int32, device="cuda")
                calls["flashcl.decode"] = lambda x: flashcl.decode(x["q"][:, :, 0], x["fk"], x["fv"], window=window,
                                                                   key_start=starts)
            if args.paged and pad is None:
                calls["flashcl.decode, paged"] = lambda x: flashcl.decode(x["q"], x["pk"], x["pv"], window=window,
                                                                          block_table=x["table"],
                                                                          context_lens=x["lens"])
            want = calls["SDPA, mask"](sets[0]).float()
            for name in ("flashcl.prefill", "flashcl.decode, paged"):
                if name in calls:
                    assert (calls[name](sets[0]).float() - want).abs().max().item() < 2e-2, (name, n_kv, n_q)
            for name, r in device_and_host(calls, sets, args.rounds).items():
                print(f"N_kv {n_kv:6d} N_q {n_q:2d}  {name:21s} device {1e3 * r['median_ms']:7.1f} us "
                      f"({1e3 * r['min_ms']:.1f}-{1e3 * r['max_ms']:.1f})   host {r['host_us']:6.1f} us")


if __name__ == "__main__":
    main()
