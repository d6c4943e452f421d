"""The four GPU boards of two flashcl trees, one right after the other on one machine.

    python benchmarks/boards.py BEFORE_TREE AFTER_TREE OUT_DIR [--boards ...] [--rounds 3]

Each tree is a directory holding a ``flashcl`` package (a checkout or ``git archive`` of a
commit); the boards run in a fresh process per tree, the trees alternating (ABBA across boards)
so that the GPU's clock drift falls on both. The board modules are found where each version keeps
them (``flashcl.tools`` now, ``flashcl.triton`` / ``flashcl`` before the layout move). Writes
``OUT_DIR/<board>-<tree name>.json`` and prints one line per row: the median against the same
row of the other tree.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

BOARDS = ("opencl-prefill", "opencl-decode", "triton-prefill", "triton-decode")

# Each board as code run inside the tree's process: prints the rows as JSON on the last line.
_CHILD = r'''
import importlib, json, os, sys
board, rounds = sys.argv[1], int(sys.argv[2])
device, preset = os.environ.get("BOARD_DEVICE", "nvidia"), os.environ.get("BOARD_PRESET")
def first(*names):
    for n in names:
        try:
            return importlib.import_module(n)
        except ImportError:
            continue
    raise ImportError(names)
if board.startswith("opencl"):
    from flashcl.opencl.runtime import get_device
    h = get_device(device)
    if board == "opencl-prefill":
        # the shipped H100 tiles in both trees (like for like), then what each tree chooses itself
        import pathlib
        b = first("flashcl.tools.bench_prefill", "flashcl.bench")
        entries = json.loads(pathlib.Path("tuning/nvidia-h100.json").read_text())["entries"]
        rows = []
        for shape in b.PREFILL_PRESETS[preset or "target"]:
            tiles = next((e["params"] for e in entries if e["dk"] == shape[4]), None)
            rows += b.bench_prefill(h, [shape], dtype="float32", repeats=10, check=False, params=tiles)
            rows += b.bench_prefill(h, [shape], dtype="float32", repeats=10, check=False)
    else:
        b = first("flashcl.tools.bench_prefill", "flashcl.bench")
        bd = first("flashcl.tools.bench_decode", "flashcl.bench_decode")
        rows = bd.bench_decode(h, bd.DECODE_PRESETS[preset or "reference"], dtype="float16", block_size=16, repeats=10,
                               splits=(1,))
    rows = b.rows_as_dicts(rows)
elif board == "triton-prefill":
    tb = first("flashcl.tools.triton_bench_prefill", "flashcl.triton.bench_prefill")
    rows = [r for r in tb.run(shapes=tb.REFERENCE_SHAPES[:7], dtype="float16", rounds=rounds)
            if r["impl"] in ("flashcl", "sdpa-cudnn")]
else:
    tb = first("flashcl.tools.triton_bench_decode", "flashcl.triton.bench_decode")
    rows = tb.run(dtype="float16", block_size=16, splits=[], rounds=rounds)
print(json.dumps(rows, default=str))
'''

# The time each board compares, per row (the peer's rows ride along as a control).
_TIME_KEY = {"opencl-prefill": "median_ms", "opencl-decode": "auto_ms", "triton-prefill": "median_ms",
             "triton-decode": "median_ms"}


def _label(row: dict) -> str:
    if "impl" in row:
        return f"({row['B']}, {row['H_q']}/{row['H_kv']}, {row['N']}, {row['d']}, {row.get('causal')}) {row['impl']}"
    return f"{row.get('shape')} {row.get('params_source', '')}"[:60]


def _run(tree: Path, board: str, rounds: int) -> list[dict]:
    # the tree first, so that its flashcl is the one imported; the rest (site dirs) stays
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-c", _CHILD, board, str(rounds)], capture_output=True, text=True,
                          env=env, cwd=tree, timeout=1200)
    if proc.returncode != 0:
        raise RuntimeError(f"{board} in {tree} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("before", type=Path)
    ap.add_argument("after", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--boards", nargs="*", choices=BOARDS, default=list(BOARDS))
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    for i, board in enumerate(args.boards):
        order = ("before", "after") if i % 2 == 0 else ("after", "before")
        rows = {}
        for name in order:
            rows[name] = _run(trees[name], board, args.rounds)
            (args.out / f"{board}-{name}.json").write_text(json.dumps(rows[name], indent=1, default=str))
        print(f"# {board} (order {'/'.join(order)})")
        for a, b in zip(rows["before"], rows["after"]):
            ta, tb = a.get(_TIME_KEY[board]), b.get(_TIME_KEY[board])
            ratio = f"{tb / ta:.3f}" if ta and tb else "n/a"
            print(f"{_label(a):44} before {ta} after {tb} after/before {ratio}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
