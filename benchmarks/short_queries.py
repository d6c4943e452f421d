"""flashcl.prefill with few query rows against a long cache: chunked prefill, speculative
verification (N_q of a few), and a left-padded batch's decode step as a prefill (N_q = 1 with the
padding mask), with flashcl.decode (no mask) and torch's CPU SDPA (with the mask, and the
bottom-right causal mask) beside them.

    python benchmarks/short_queries.py [--device cpu] [--rounds 6]

float32 torch CPU tensors, (4, 8/2, N_q, 2048, 64); the padded batch hides 0, 100, 700 and 1500
keys of its four sequences. Prints the median wall-clock milliseconds of a call over the
rounds. Run it from two trees (PYTHONPATH) to compare them; docs/notes/pocl-prefill.md cites it.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

import flashcl

B, H_Q, H_KV, N_KV, D = 4, 8, 2, 2048, 64
PADDING = (0, 100, 700, 1500)


def median_ms(call, rounds: int) -> float:
    call()  # builds, first-touch
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    k, v = (torch.from_numpy(rng.standard_normal((B, H_KV, N_KV, D)).astype(np.float32)) for _ in range(2))
    cells = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    for n_q in (1, 4, 8, 16, 48):
        q = torch.from_numpy(rng.standard_normal((B, H_Q, n_q, D)).astype(np.float32))
        ms = median_ms(lambda: flashcl.prefill(q, k, v, causal=True, device=args.device), args.rounds)
        causal = torch.from_numpy(flashcl.reference.causal_mask(n_q, N_KV))  # bottom-right, as flashcl's
        peer = median_ms(lambda: sdpa(q, k, v, attn_mask=causal, enable_gqa=True), args.rounds)
        cells.append(f"causal N_q={n_q}: {ms:.2f} (SDPA {peer:.2f})")
    mask = torch.ones(B, 1, 1, N_KV, dtype=torch.bool)
    for b, pad in enumerate(PADDING):
        mask[b, :, :, :pad] = False
    q = torch.from_numpy(rng.standard_normal((B, H_Q, 1, D)).astype(np.float32))
    cells += [
        f"padded decode step (prefill, mask): "
        f"{median_ms(lambda: flashcl.prefill(q, k, v, mask=mask, device=args.device), args.rounds):.2f}",
        f"flashcl.decode, no mask: {median_ms(lambda: flashcl.decode(q[:, :, 0], k, v, device=args.device), args.rounds):.2f}",
        f"SDPA with the mask: {median_ms(lambda: sdpa(q, k, v, attn_mask=mask, enable_gqa=True), args.rounds):.2f}",
    ]
    print(" | ".join(cells), "(ms)")


if __name__ == "__main__":
    main()
