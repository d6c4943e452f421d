"""A left-padded batch's decode step on CUDA, the way the transformers integration can run it:
as a one-row prefill with the padding mask, or as flashcl.decode with each sequence's first key
(``key_start``), next to a decode that reads every key and torch's SDPA with the mask.

    python benchmarks/cuda_padded_step.py [--rounds 5]

fp16, contiguous (4, 32/8, N_kv, 128) caches, N_kv 1k / 4k / 16k, the four sequences padded by
0, 1/8, 1/4 and 1/2 of N_kv. Device microseconds a call (CUDA-graph replay, inputs rotated past
L2, interleaved rounds: the median, and the least and most round), then the host's microseconds
a call (eager, no synchronize: the least of 5 rounds of 100 calls). docs/notes/triton-host.md
cites it.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import flashcl
from flashcl.tools.cuda_timing import device_and_host, rotation_count

B, H_Q, H_KV, D = 4, 32, 8, 128


def inputs(n_kv: int, gen: torch.Generator) -> dict:
    rand = lambda *s: torch.randn(*s, device="cuda", dtype=torch.float16, generator=gen)  # noqa: E731
    pads = [0, n_kv // 8, n_kv // 4, n_kv // 2]
    mask = torch.ones(B, 1, 1, n_kv, dtype=torch.bool, device="cuda")
    for b, pad in enumerate(pads):
        mask[b, :, :, :pad] = False
    return {"q": rand(B, H_Q, 1, D), "k": rand(B, H_KV, n_kv, D), "v": rand(B, H_KV, n_kv, D), "mask": mask,
            "key_start": torch.tensor(pads, dtype=torch.int32, device="cuda")}


CALLS = {
    "prefill, N_q = 1, mask": lambda x: flashcl.prefill(x["q"], x["k"], x["v"], mask=x["mask"]),
    "decode, key_start": lambda x: flashcl.decode(x["q"][:, :, 0], x["k"], x["v"], key_start=x["key_start"]),
    "decode, every key": lambda x: flashcl.decode(x["q"][:, :, 0], x["k"], x["v"]),
    "SDPA, mask": lambda x: F.scaled_dot_product_attention(x["q"], x["k"], x["v"], attn_mask=x["mask"],
                                                           enable_gqa=True),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(torch.cuda.get_device_name(), f"torch {torch.__version__}")
    for n_kv in (1024, 4096, 16384):
        sets = [inputs(n_kv, gen) for _ in range(rotation_count(2 * B * H_KV * n_kv * D * 2))]
        want = CALLS["SDPA, mask"](sets[0]).float()
        for name in ("prefill, N_q = 1, mask", "decode, key_start"):  # the two routes of one step
            got = CALLS[name](sets[0]).float().reshape(want.shape)
            assert (got - want).abs().max().item() < 2e-2, name
        for name, r in device_and_host(CALLS, sets, args.rounds).items():
            print(f"N_kv {n_kv:6d}  {name:24s} device {1e3 * r['median_ms']:7.1f} us "
                  f"({1e3 * r['min_ms']:.1f}-{1e3 * r['max_ms']:.1f})   host {r['host_us']:6.1f} us")


if __name__ == "__main__":
    main()
