"""flashcl.prefill with few query rows against a long cache: chunked prefill, speculative
verification (N_q of a few), and a left-padded batch's decode step as a prefill (N_q = 1 with the
padding mask), with flashcl.decode (no mask) and torch's CPU SDPA (with the mask, and the
bottom-right causal mask) beside them.

    python benchmarks/short_queries.py [--device cpu] [--rounds 6] [--window LEFT] [--alibi]

float32 torch CPU tensors, (4, 8/2, N_q, 2048, 64); the padded batch hides 0, 100, 700 and 1500
keys of its four sequences, as a decode step (N_q = 1) and as a causal chunk of 8 rows, and with
holes among the chunk's own keys (a tree of drafts: each row misses two other drafts).
``--window`` / ``--alibi`` put a sliding window (LEFT, 0) / ALiBi slopes on the causal rows
(SDPA gets them in its mask; ALiBi is left off the padded chunk). Prints the median wall-clock milliseconds of a call over the
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


def sdpa_mask(n_q: int, window: int | None, slopes) -> np.ndarray:
    """SDPA's mask for flashcl's bottom-right causal rows with a window (left, 0) and ALiBi: bool
    without ALiBi, else the additive (H_q, N_q, N_kv) bias, -inf where hidden."""
    left = window if window is not None else -1
    seen = flashcl.reference.causal_mask(n_q, N_KV) & flashcl.reference.window_mask(n_q, N_KV, (left, -1))
    if slopes is None:
        return seen
    dist = np.arange(n_q)[:, None] + (N_KV - n_q) - np.arange(N_KV)[None, :]
    return np.where(seen, -slopes[:, None, None] * dist, -np.inf).astype(np.float32)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--window", type=int, default=None, help="a window (LEFT, 0) on the causal rows")
    ap.add_argument("--alibi", action="store_true", help="ALiBi slopes on the causal rows")
    args = ap.parse_args()
    slopes = 2.0 ** (-8.0 * np.arange(1, H_Q + 1, dtype=np.float32) / H_Q) if args.alibi else None
    variants = {**({"window": (args.window, 0)} if args.window is not None else {}),
                **({"alibi_slopes": slopes} if args.alibi else {})}
    rng = np.random.default_rng(0)
    k, v = (torch.from_numpy(rng.standard_normal((B, H_KV, N_KV, D)).astype(np.float32)) for _ in range(2))
    cells = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    for n_q in (1, 4, 8, 16, 48):
        q = torch.from_numpy(rng.standard_normal((B, H_Q, n_q, D)).astype(np.float32))
        ms = median_ms(lambda: flashcl.prefill(q, k, v, causal=True, device=args.device, **variants), args.rounds)
        causal = torch.from_numpy(sdpa_mask(n_q, args.window, slopes))  # bottom-right, as flashcl's
        peer = median_ms(lambda: sdpa(q, k, v, attn_mask=causal, enable_gqa=True), args.rounds)
        cells.append(f"causal N_q={n_q}: {ms:.2f} (SDPA {peer:.2f})")
    mask = torch.ones(B, 1, 1, N_KV, dtype=torch.bool)
    for b, pad in enumerate(PADDING):
        mask[b, :, :, :pad] = False
    q8 = torch.from_numpy(rng.standard_normal((B, H_Q, 8, D)).astype(np.float32))
    chunk_mask = mask & torch.from_numpy(sdpa_mask(8, args.window, None))  # padding and causal
    window = {"window": variants["window"]} if "window" in variants else {}
    ms = median_ms(lambda: flashcl.prefill(q8, k, v, causal=True, mask=mask, device=args.device, **window),
                   args.rounds)
    peer = median_ms(lambda: sdpa(q8, k, v, attn_mask=chunk_mask, enable_gqa=True), args.rounds)
    cells.append(f"padded chunk N_q=8 (causal + mask): {ms:.2f} (SDPA {peer:.2f})")
    # a tree of drafts: each of the 8 rows also misses the keys of two other drafts (not a padding)
    tree = mask.expand(B, 1, 8, N_KV).clone()
    for i in range(8):
        tree[:, :, i, N_KV - 8 + (i + 3) % 8] = False
        tree[:, :, i, N_KV - 8 + (i + 5) % 8] = False
    tree[:, :, :, N_KV - 8:] |= torch.eye(8, dtype=torch.bool)  # each sees itself
    tree_mask = tree & torch.from_numpy(sdpa_mask(8, args.window, None))
    ms = median_ms(lambda: flashcl.prefill(q8, k, v, causal=True, mask=tree, device=args.device, **window),
                   args.rounds)
    peer = median_ms(lambda: sdpa(q8, k, v, attn_mask=tree_mask, enable_gqa=True), args.rounds)
    cells.append(f"tree chunk N_q=8 (causal + padding + holes): {ms:.2f} (SDPA {peer:.2f})")
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
