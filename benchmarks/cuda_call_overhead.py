"""What a flashcl.decode / flashcl.prefill call on CUDA tensors costs the host, next to torch's
SDPA on the same tensors: what an eager caller (a model's forward, layer after layer) pays per call.

    python benchmarks/cuda_call_overhead.py [--profile]

For each case: the host's time per call (the call alone, no synchronize; 9 rounds of 200 calls,
the least round and the median, the device drained between rounds) and the device time per call of the same calls
replayed in a CUDA graph (what the kernels themselves take). Where the host's time is the larger,
an eager caller waits on Python, not on the GPU. ``--profile``: cProfile over 200 calls of each
flashcl case, the 25 functions of most own time. Run it from two trees (PYTHONPATH) to compare
them. docs/notes/triton-host.md cites it.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import torch

import flashcl


def host_us(call, n: int = 200, rounds: int = 9) -> str:
    """Host microseconds a call over ``rounds`` of ``n`` calls: the least round (the code's cost on a
    shared host) and the median."""
    for _ in range(10):
        call()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(n):
            call()
        times.append(1e6 * (time.perf_counter() - t) / n)
        torch.cuda.synchronize()
    return f"{min(times):6.1f} (median {statistics.median(times):6.1f}) us"


def graph_us(call, n: int = 20) -> float:
    """Device microseconds a call: ``n`` calls captured in one CUDA graph, replayed, median of 5."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()  # compiles and warms outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(n):
            call()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(1e3 * start.elapsed_time(end) / n)
    return statistics.median(times)


def cases():
    """(name, flashcl call, SDPA call on the same problem or None)."""
    dev, f16 = "cuda", torch.float16
    g = torch.Generator(device=dev).manual_seed(0)
    rand = lambda *s: torch.randn(*s, device=dev, dtype=f16, generator=g)  # noqa: E731
    sdpa = torch.nn.functional.scaled_dot_product_attention
    out = []
    for b, h_q, h_kv, ctx, d in ((1, 32, 8, 4096, 128), (4, 8, 2, 512, 64)):
        q = rand(b, h_q, d)
        k, v = rand(b, h_kv, ctx, d), rand(b, h_kv, ctx, d)
        out.append((f"decode ({b},{h_q}/{h_kv},{ctx},{d}) contiguous",
                    lambda q=q, k=k, v=v: flashcl.decode(q, k, v),
                    lambda q=q, k=k, v=v: sdpa(q[:, :, None], k, v, enable_gqa=True)))
    b, h_q, h_kv, ctx, d, page = 1, 32, 8, 4096, 128, 16
    q = rand(b, h_q, d)
    blocks = ctx // page
    kp, vp = rand(blocks, page, h_kv, d), rand(blocks, page, h_kv, d)
    table = torch.randperm(blocks, device=dev, dtype=torch.int32, generator=g)[None]
    lens = torch.full((b,), ctx, device=dev, dtype=torch.int32)
    out.append((f"decode ({b},{h_q}/{h_kv},{ctx},{d}) paged {page}",
                lambda: flashcl.decode(q, kp, vp, block_table=table, context_lens=lens), None))
    kq, vq = flashcl.quantize(kp, "q8_0"), flashcl.quantize(vp, "q8_0")
    out.append((f"decode ({b},{h_q}/{h_kv},{ctx},{d}) paged {page} q8_0",
                lambda: flashcl.decode(q, kq, vq, block_table=table, context_lens=lens), None))
    for b, h_q, h_kv, n, d in ((1, 8, 2, 256, 64), (1, 32, 8, 512, 128)):
        qp, kc, vc = rand(b, h_q, n, d), rand(b, h_kv, n, d), rand(b, h_kv, n, d)
        out.append((f"prefill ({b},{h_q}/{h_kv},{n},{d}) causal",
                    lambda qp=qp, kc=kc, vc=vc: flashcl.prefill(qp, kc, vc, causal=True),
                    lambda qp=qp, kc=kc, vc=vc: sdpa(qp, kc, vc, is_causal=True, enable_gqa=True)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", action="store_true", help="cProfile each flashcl case")
    opt = ap.parse_args()
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}")
    for name, call, peer in cases():
        line = f"{name:44s} flashcl host {host_us(call)}, device {graph_us(call):5.1f} us"
        if peer is not None:
            line += f"; SDPA host {host_us(peer)}, device {graph_us(peer):5.1f} us"
        print(line, flush=True)
        if opt.profile:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(200):
                call()
            prof.disable()
            torch.cuda.synchronize()
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
