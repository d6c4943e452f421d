"""``flashcl soak``: many mixed prefill/decode calls in one process, watching memory (issue 7).

A server calls the kernels millions of times with shapes it does not choose; anything flashcl
keeps per call (programs, kernels, split-k workspaces, device handles) must be bounded. The soak
runs ``calls`` calls of varied shapes — prefill and decode, float32 and float16, causal and not,
contiguous and paged caches, forced split counts — checking a sample of them against the oracle,
and samples every ``every`` calls the resident set size (VmRSS from /proc/self/status, else the
peak from getrusage) and the sizes of flashcl's caches. It fails when memory keeps growing after
the warm-up: the mean RSS of the last quarter more than ``max_growth`` (10%) above that of the
second quarter (the first quarter is warm-up: every problem class builds its program once).
"""

from __future__ import annotations

import resource
import time
from dataclasses import dataclass, field

import numpy as np

from .. import reference
from ..api import decode, prefill

# Problem classes the soak cycles through (small, so 10,000 calls take minutes on a CPU driver).
# More classes than MAX_PROGRAMS would measure the eviction path rather than steady state; these
# are 16 prefill + 12 decode programs.
HEAD_DIMS = ((32, 32), (64, 64))


def rss_kib() -> int:
    """Current resident set size in KiB (peak RSS where /proc is missing)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


def cache_sizes() -> dict:
    """Device handles and the programs they cache (all handles together)."""
    from ..opencl import runtime

    with runtime._lock:
        handles = list(runtime._handles.values())
    return {"handles": len(handles), "programs": sum(len(h.programs) for h in handles)}


@dataclass
class Sample:
    call: int
    rss_kib: int
    handles: int
    programs: int
    seconds: float


@dataclass
class SoakResult:
    samples: list = field(default_factory=list)
    checked: int = 0
    max_err: float = 0.0
    verdict: str = ""
    ok: bool = True


def _one_call(rng, i: int, device, check: bool):
    """Call number ``i``: alternate prefill and decode over the problem classes."""
    dtype = ("float32", "float16")[(i // 2) % 2]
    dk, dv = HEAD_DIMS[(i // 4) % len(HEAD_DIMS)]
    if i % 2 == 0:
        causal = bool((i // 8) % 2)
        h_kv = 1 + (i // 16) % 2
        h_q = 2 * h_kv
        n_q, n_kv = int(rng.integers(1, 65)), int(rng.integers(1, 97))
        if causal and i % 3 == 0:
            n_q = n_kv  # square causal as well as chunked
        q = rng.standard_normal((1, h_q, n_q, dk)).astype(dtype)
        k = rng.standard_normal((1, h_kv, n_kv, dk)).astype(dtype)
        v = rng.standard_normal((1, h_kv, n_kv, dv)).astype(dtype)
        out = prefill(q, k, v, causal=causal, device=device)
        ref = reference.attention(q, k, v, causal=causal) if check else None
    else:
        b, h_kv = int(rng.integers(1, 4)), 2
        h_q = h_kv * (1, 2, 4)[(i // 8) % 3]
        lens = rng.integers(0, 80, size=b).astype(np.int32)
        q = rng.standard_normal((b, h_q, dk)).astype(dtype)
        splits = (None, 1, 3, 8)[(i // 24) % 4]
        if (i // 4) % 2:   # paged, block_size 16, permuted table
            bs = 16
            max_blocks = max(1, int(-(-lens.max() // bs)))
            nb = b * max_blocks
            k = rng.standard_normal((nb, bs, h_kv, dk)).astype(dtype)
            v = rng.standard_normal((nb, bs, h_kv, dv)).astype(dtype)
            table = rng.permutation(nb).reshape(b, max_blocks).astype(np.int32)
            kw = {"block_table": table, "context_lens": lens}
        else:
            n_max = max(1, int(lens.max()))
            k = rng.standard_normal((b, h_kv, n_max, dk)).astype(dtype)
            v = rng.standard_normal((b, h_kv, n_max, dv)).astype(dtype)
            kw = {"context_lens": lens}
        out = decode(q, k, v, num_splits=splits, device=device, **kw)
        ref = reference.decode_attention(q, k, v, **kw) if check else None
    if not check:
        return None
    err = reference.rel_err(out, ref)
    if not np.all(np.isfinite(out)) or err > reference.TOLERANCE[dtype]:
        raise AssertionError(f"soak call {i}: relative error {err:.3e} ({dtype}) or non-finite output")
    return err


def run(calls: int = 10000, *, every: int = 250, device=None, check_every: int = 50,
        max_growth: float = 0.10, seed: int = 0, progress=None) -> SoakResult:
    """Run the soak; ``progress(sample)`` is called after each sample."""
    rng = np.random.default_rng(seed)
    res = SoakResult()
    t0 = time.perf_counter()
    every = max(1, min(every, calls))
    for i in range(calls):
        # every check_every-th pair of calls (one prefill, one decode) is checked
        err = _one_call(rng, i, device, check=(i % max(2, check_every) < 2))
        if err is not None:
            res.checked += 1
            res.max_err = max(res.max_err, err)
        if (i + 1) % every == 0 or i + 1 == calls:
            s = Sample(i + 1, rss_kib(), **cache_sizes(), seconds=time.perf_counter() - t0)
            res.samples.append(s)
            if progress:
                progress(s)
    res.ok, res.verdict = judge(res.samples, max_growth)
    return res


def judge(samples: list, max_growth: float = 0.10) -> tuple[bool, str]:
    """Memory keeps growing when the last quarter's mean RSS exceeds the second quarter's by more
    than ``max_growth``; with fewer than 4 samples there is no verdict (passes)."""
    if len(samples) < 4:
        return True, f"only {len(samples)} samples: no growth verdict"
    n = len(samples)
    q2 = [s.rss_kib for s in samples[n // 4: n // 2]]
    q4 = [s.rss_kib for s in samples[3 * n // 4:]]
    a, b = sum(q2) / len(q2), sum(q4) / len(q4)
    growth = b / a - 1.0
    ok = growth <= max_growth
    word = "stable" if ok else "GROWING"
    return ok, (f"{word}: mean RSS {a / 1024:.1f} MiB in the second quarter, {b / 1024:.1f} MiB in the "
                f"last ({growth * 100:+.1f}%, limit {max_growth * 100:+.0f}%)")
