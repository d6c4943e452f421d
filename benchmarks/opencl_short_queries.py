"""flashcl.prefill of few query rows against a long cache on an OpenCL GPU (speculative
verification, a chunk through a cache), next to flashcl.decode of one row, inputs in device memory.

    python benchmarks/opencl_short_queries.py --device 0:0 [--n-kv 32768] [--window LEFT] [--padding P] [--rounds 5]
        [--paged]

(1, 32/8, N_q, N_kv, 128) (``--head-dim 256``: Gemma's), fp16 (``--dtype float32`` for
decode.cl's path on NVIDIA), causal; with ``--padding``, a bool mask (1, 1, N_q, N_kv) hides the
first P keys (a left-padded sequence's) from the rows, and the decode takes ``key_start`` P.
``--paged``: also flashcl.decode of the same rows (q (1, 32, N_q, D)) on the cache as pages of 16
in random order, the speculative verification a paged cache takes.
Two times a call, medians over the rounds (the cases interleaved in each): "wall", ``--calls``
calls back to back then the queue's finish, host and device overlapping as an application's loop
overlaps them; "device", from the first kernel's start to the last one's end (OpenCL profiling
events of the launches the call makes, recorded around flashcl's launch function), each call
waited for alone. Run it from two trees (PYTHONPATH) to compare them;
docs/notes/opencl-decode-nvidia.md cites it.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import pyopencl.array as cla

import flashcl
from flashcl.opencl.runtime import get_device

H_Q, H_KV = 32, 8
ROWS = (1, 2, 4, 8, 16)


def record_launches() -> list:
    """The events of every kernel flashcl enqueues from now on (appended to the list returned)."""
    from flashcl.opencl import decode as cl_decode
    from flashcl.opencl import runtime

    events, real = [], runtime.launch_sequence

    def recording(*args, **kw):
        evs = real(*args, **kw)
        events.extend(evs)
        return evs

    runtime.launch_sequence = cl_decode.launch_sequence = recording
    return events


def device_ms(call, events: list, calls: int) -> float:
    spans = []
    for _ in range(calls):
        events.clear()
        call()
        events[-1].wait()
        spans.append((events[-1].profile.end - events[0].profile.start) * 1e-6)
    return statistics.median(spans)


def per_call_ms(call, queue, calls: int) -> float:
    queue.finish()
    t0 = time.perf_counter()
    for _ in range(calls):
        call()
    queue.finish()
    return 1e3 * (time.perf_counter() - t0) / calls


def paged(queue, x: np.ndarray, rng, page: int = 16) -> tuple:
    """A contiguous (1, H_kv, N, D) cache as pages of ``page`` tokens in random order, on the
    device: (pages, table)."""
    _, h_kv, n, d = x.shape
    order = rng.permutation(n // page)
    pages = np.empty((n // page, page, h_kv, d), x.dtype)
    pages[order] = x[0].reshape(h_kv, n // page, page, d).transpose(1, 2, 0, 3)
    return cla.to_device(queue, pages), cla.to_device(queue, order[None].astype(np.int32))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="0:0")
    ap.add_argument("--n-kv", type=int, default=32768)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", default="float16", choices=("float16", "float32"))
    ap.add_argument("--window", type=int, default=None, help="a window (LEFT, 0) on the causal rows")
    ap.add_argument("--padding", type=int, default=None, help="a bool mask hides the first P keys")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--paged", action="store_true", help="also flashcl.decode of the rows on a paged cache")
    args = ap.parse_args()
    if args.paged and (args.padding is not None or args.n_kv % 16):
        ap.error("--paged: N_kv a multiple of the 16-token page, and no --padding (decode takes key_start)")
    queue = get_device(args.device).queue
    rng = np.random.default_rng(0)
    n_kv, dt, D = args.n_kv, np.dtype(args.dtype), args.head_dim
    k_host, v_host = (rng.standard_normal((1, H_KV, n_kv, D)).astype(dt) for _ in range(2))
    k, v = cla.to_device(queue, k_host), cla.to_device(queue, v_host)
    if args.paged:
        (pk, table), (pv, _) = (paged(queue, x, np.random.default_rng(1)) for x in (k_host, v_host))
    kw = {"window": (args.window, 0)} if args.window is not None else {}
    lens = cla.to_device(queue, np.array([n_kv], np.int32))
    cases = {}
    for n_q in ROWS:
        q = cla.to_device(queue, rng.standard_normal((1, H_Q, n_q, D)).astype(dt))
        mask = {}
        if args.padding is not None:
            mask["mask"] = cla.to_device(queue, np.broadcast_to(np.arange(n_kv) >= args.padding,
                                                                (1, 1, n_q, n_kv)).copy())
        cases[f"prefill N_q={n_q}"] = lambda q=q, mask=mask: flashcl.prefill(q, k, v, causal=True, **kw, **mask)
        if args.paged:
            cases[f"paged decode N_q={n_q}"] = lambda q=q: flashcl.decode(
                q, pk, pv, block_table=table, context_lens=lens, **kw)
    # decode of the last row: the same cache as a contiguous (B, H_kv, N_max, D) one
    q1 = cla.to_device(queue, rng.standard_normal((1, H_Q, D)).astype(dt))
    start = {}
    if args.padding is not None:
        start["key_start"] = cla.to_device(queue, np.array([args.padding], np.int32))
    cases["decode, one row"] = lambda: flashcl.decode(q1, k, v, context_lens=lens, **kw, **start)
    events = record_launches()
    for call in cases.values():  # builds, first launches
        call()
    wall, device = ({name: [] for name in cases} for _ in range(2))
    for _ in range(args.rounds):
        for name, call in cases.items():
            wall[name].append(per_call_ms(call, queue, args.calls))
            device[name].append(device_ms(call, events, args.calls))
    print(f"# {queue.device.name}; (1, {H_Q}/{H_KV}, N_q, {n_kv}, {D}) {args.dtype} causal"
          f"{' window ' + str(kw['window']) if kw else ''}"
          f"{'' if args.padding is None else f', the first {args.padding} keys masked'}; ms a call, median of {args.rounds} rounds [min-max]")
    for name in cases:
        w, d = wall[name], device[name]
        print(f"{name:>22}: wall {statistics.median(w):.4f} [{min(w):.4f}-{max(w):.4f}]  "
              f"device {statistics.median(d):.4f} [{min(d):.4f}-{max(d):.4f}]")


if __name__ == "__main__":
    main()
