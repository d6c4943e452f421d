"""Registers, spills and loop instructions of the Triton decode's Gluon GQA kernel, compiled for
sm_90 on a machine without a GPU (ptxas and cuobjdump come with Triton's NVIDIA backend).

    python benchmarks/gqa_sass.py [--formats fp16,int8,fp8_e4m3,q8_0,q4_0] [--splits 4]
        [--variants softcap+sinks+alibi+window] [--max-registers N] [--group 8] [--q-dtype bfloat16]
        [--out DIR]

Each build is launch_gqa's own (its layouts, tiles ahead and constexprs) for (1, 8 x group / 8,
1024 keys) paged 16, compiled through a stand-in driver that reports an sm_90 target; the launch
itself then fails, which is expected. Prints registers, stack bytes (spills), SASS lines, and the
loop's instruction count with its most frequent opcodes (the longest backward branch's body).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from collections import Counter

import torch
from triton.backends.compiler import GPUTarget
from triton.runtime import driver


class _Sm90:
    """What the JIT asks of the driver before it compiles: an sm_90 target, device 0."""

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")

    def get_device_interface(self):
        return torch.cuda


def _loop(sass: str) -> Counter:
    """Opcode counts of the body of the longest backward branch (the K/V loop)."""
    lines = [ln for ln in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4}\*/", ln)]
    addr = [int(re.match(r"\s+/\*([0-9a-f]{4})\*/", ln).group(1), 16) for ln in lines]
    best = (0, -1)
    for a, ln in zip(addr, lines):
        m = re.search(r"BRA (0x[0-9a-f]+)", ln)
        if m and int(m.group(1), 16) < a and a - int(m.group(1), 16) > best[1] - best[0]:
            best = (int(m.group(1), 16), a)
    ops = Counter()
    for a, ln in zip(addr, lines):
        if best[0] <= a <= best[1]:
            op = re.sub(r"^\s+/\*[0-9a-f]{4}\*/\s+(@!?U?P[0-9T] )?", "", ln).split()[0]
            ops[op.split(".")[0]] += 1
    return ops


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default="fp16,int8,fp8_e4m3,q8_0,q4_0")
    ap.add_argument("--splits", type=int, default=4)
    ap.add_argument("--variants", default="", help="'+'-joined: softcap, sinks, alibi, window")
    ap.add_argument("--max-registers", type=int, default=0, help="the build's register cap (0: none)")
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--q-dtype", default="float16", choices=("float16", "bfloat16"),
                    help="q's dtype (and the plain cache's)")
    ap.add_argument("--out", default=None, help="also write each build's PTX and SASS here")
    args = ap.parse_args()
    driver.set_active(_Sm90())
    import flashcl
    import triton.backends.nvidia as nvidia
    from flashcl.triton import decode_gluon as dg

    tools = os.path.join(os.path.dirname(nvidia.__file__), "bin")
    variants = set(filter(None, args.variants.split("+")))
    b, h_kv, page, blocks, g, ns = 1, 8, 16, 64, args.group, args.splits
    dtype = getattr(torch, args.q_dtype)
    q = torch.randn(b, h_kv * g, 128, dtype=dtype)
    table = torch.arange(blocks, dtype=torch.int32).reshape(1, blocks)
    lens = torch.tensor([blocks * page], dtype=torch.int32)
    out = torch.empty(b, h_kv * g, 128, dtype=dtype)
    lse = torch.empty(b, h_kv * g, dtype=torch.float32)
    part_m = torch.empty(b, h_kv * g, ns, dtype=torch.float32)
    part_acc = torch.empty(b, h_kv * g, ns, 128, dtype=torch.float32)
    x = torch.randn(blocks, page, h_kv, 128, dtype=dtype)
    for fmt in args.formats.split(","):
        data, scales, kf = x, None, ""
        if fmt != "fp16":
            qt = flashcl.quantize(x, fmt)
            data, kf = qt.data, fmt
            if fmt == "int8":
                st = qt.scales.stride()
                scales = (qt.scales, (st[0], st[1], st[2]))
            elif fmt == "fp8_e4m3":
                scales = (qt.scales.reshape(1).float(), (0, 0, 0))
        dg._gqa_decode.device_caches.clear()
        try:
            dg.launch_gqa(q, data, data, table, lens, out, lse, 0.1, num_splits=ns,
                          partials=(part_m, part_m, part_acc) if ns > 1 else None, sort_pages=False,
                          k_format=kf, v_format=kf, k_scales=scales, v_scales=scales,
                          window_left=1023 if "window" in variants else -1,
                          softcap_log2=30.0 if "softcap" in variants else 0.0,
                          sinks=torch.zeros(h_kv * g) if "sinks" in variants else None,
                          alibi_slopes=torch.ones(b, h_kv * g) if "alibi" in variants else None,
                          max_registers=args.max_registers)
        except Exception:  # the stand-in driver cannot launch: the build is what is wanted
            pass
        cache = dg._gqa_decode.device_caches[0][0]
        if not cache:
            print(f"{fmt}: no build", file=sys.stderr)
            return 1
        kernel = list(cache.values())[-1]
        kernel = kernel.result() if hasattr(kernel, "result") else kernel
        name = f"{fmt}_s{ns}_{'+'.join(sorted(variants)) or 'plain'}_r{args.max_registers}_g{g}_{args.q_dtype}"
        folder = args.out or os.path.join(os.environ.get("TMPDIR", "/tmp"), "gqa_sass")
        os.makedirs(folder, exist_ok=True)
        cubin = os.path.join(folder, name + ".cubin")
        with open(cubin, "wb") as f:
            f.write(kernel.asm["cubin"])
        sass = subprocess.run([os.path.join(tools, "cuobjdump"), "-sass", cubin], capture_output=True,
                              text=True, check=True).stdout
        res = subprocess.run([os.path.join(tools, "cuobjdump"), "-res-usage", cubin], capture_output=True,
                             text=True, check=True).stdout
        if args.out:
            for ext, text in ((".ptx", kernel.asm["ptx"]), (".sass", sass)):
                with open(os.path.join(folder, name + ext), "w") as f:
                    f.write(text)
        loop = _loop(sass)
        top = " ".join(f"{op}:{n}" for op, n in loop.most_common(8))
        regs = re.search(r"REG:(\d+)", res).group(1)
        stack = re.search(r"STACK:(\d+)", res).group(1)
        lines = sum(1 for ln in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4}\*/", ln))
        print(f"{name}: registers {regs}, stack {stack}, SASS lines {lines}, loop {sum(loop.values())} ({top})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
