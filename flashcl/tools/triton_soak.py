"""Long run of the CUDA (Triton) path: many mixed prefill/decode calls in one process, memory sampled.

    flashcl soak --backend triton [--calls 6000] [--every 300] [--check-every 50] [--json]

The CUDA counterpart of ``flashcl soak`` (issue 7): prefill (causal or not, GQA, d 64/128) and
decode (contiguous and paged caches, block sizes 16/64, automatic and forced split counts, so the
fused-reduce counter workspace is used too), float16 and bfloat16, every call's output checked for
NaN/inf and every ``check_every``-th against the float64 oracle. Samples every ``every`` calls:
torch's allocated and reserved CUDA memory (flashcl keeps nothing per call, so allocated must
stay flat) and the process RSS (which grows while Triton compiles and autotunes new keys, then
stays flat). Exit status 1 if allocated memory grows after the first half or a check fails.
"""

from __future__ import annotations

import json
import math
import random
import sys
import time

import numpy as np
import torch

from .. import reference
from ..api import decode, prefill
from .soak import rss_kib

TOL = reference.TOLERANCE


def _rel_err(got: torch.Tensor, ref: np.ndarray) -> float:
    return reference.rel_err(got.double().cpu().numpy(), ref)


def one_call(rnd: random.Random, gen: torch.Generator, dev: torch.device, check: bool) -> tuple[str, float]:
    """One random call; returns its dtype and relative error against the oracle (0.0 when not
    checked, inf for a non-finite output)."""
    dt = rnd.choice((torch.float16, torch.bfloat16))
    kind = rnd.choice(("prefill", "decode", "decode_paged"))
    if kind == "prefill":
        b, h_kv, grp = rnd.choice((1, 2)), rnd.choice((1, 2, 4)), rnd.choice((1, 4))
        n, d, causal = rnd.choice((17, 128, 300)), rnd.choice((64, 128)), rnd.random() < 0.5
        q = torch.randn(b, h_kv * grp, n, d, device=dev, generator=gen).to(dt)
        k = torch.randn(b, h_kv, n, d, device=dev, generator=gen).to(dt)
        v = torch.randn(b, h_kv, n, d, device=dev, generator=gen).to(dt)
        out = prefill(q, k, v, causal=causal)
        ref = (lambda: reference.attention(*(x.double().cpu().numpy() for x in (q, k, v)), causal=causal))
    else:
        b, h_kv, grp, d = rnd.choice((1, 3)), rnd.choice((1, 8)), rnd.choice((1, 4)), 128
        ctx, splits = rnd.choice((1, 100, 1000, 5000)), rnd.choice((None, 1, 3, 16))
        q = torch.randn(b, h_kv * grp, d, device=dev, generator=gen).to(dt)
        lens = torch.full((b,), ctx, dtype=torch.int32, device=dev)
        if kind == "decode":
            k = torch.randn(b, h_kv, ctx, d, device=dev, generator=gen).to(dt)
            v = torch.randn(b, h_kv, ctx, d, device=dev, generator=gen).to(dt)
            table = None
        else:
            bs = rnd.choice((16, 64))
            nb = math.ceil(ctx / bs)
            k = torch.randn(b * nb, bs, h_kv, d, device=dev, generator=gen).to(dt)
            v = torch.randn(b * nb, bs, h_kv, d, device=dev, generator=gen).to(dt)
            table = torch.randperm(b * nb, device=dev, generator=gen).view(b, nb).to(torch.int32)
        out = decode(q, k, v, block_table=table, context_lens=lens, num_splits=splits)
        ref = (lambda: reference.decode_attention(
            *(x.double().cpu().numpy() for x in (q, k, v)),
            block_table=None if table is None else table.cpu().numpy(), context_lens=lens.cpu().numpy()))
    name = str(dt).removeprefix("torch.")
    if not torch.isfinite(out).all():
        return name, math.inf
    return name, (_rel_err(out, ref()) if check else 0.0)


def run(calls: int, every: int, check_every: int, seed: int = 0, on_sample=None) -> dict:
    dev = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator(device=dev)
    gen.manual_seed(seed)
    rnd = random.Random(seed)
    samples, worst, t0 = [], {}, time.time()
    for i in range(1, calls + 1):
        dtype, err = one_call(rnd, gen, dev, check=i % check_every == 0)
        worst[dtype] = max(worst.get(dtype, 0.0), err)
        if i % every == 0 or i == calls:
            torch.cuda.synchronize()
            s = {"call": i, "seconds": round(time.time() - t0, 1), "rss_mib": round(rss_kib() / 1024, 1),
                 "cuda_allocated_mib": round(torch.cuda.memory_allocated(dev) / 2**20, 3),
                 "cuda_reserved_mib": round(torch.cuda.memory_reserved(dev) / 2**20, 1)}
            samples.append(s)
            if on_sample:
                on_sample(s)
    half = [s["cuda_allocated_mib"] for s in samples[len(samples) // 2:]]
    grew = bool(half) and max(half) > half[0] + 1.0  # more than 1 MiB above the mid-run level
    return {"samples": samples, "worst_rel_err": worst, "allocated_grew": grew,
            "ok": not grew and all(err <= TOL[dt] for dt, err in worst.items())}
