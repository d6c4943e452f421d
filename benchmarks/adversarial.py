"""Adversarial calls against flashcl's public API and CLI, by class, with their outcomes counted.

    python benchmarks/adversarial.py [--device cpu] [--json]

Each class runs in its own subprocess, so a crash (a signal inside a driver) is counted, not
fatal. Every case ends as one of:
  ok        the right answer, or the documented result (zeros, NaN for a bad device table)
  error     a ValueError/TypeError/flashcl error (or a CLI exit code >= 2 with one line) whose
            message names the argument or file it is about
  unnamed   an error that does not name it, a traceback, or a multi-line CLI failure
  wrong     a result that is silently wrong (differs from the float64 oracle, NaN where it
            should not be, lse -inf for a NaN row, a result not finished when its events are)
  crash     the process died (counted once per class; the cases after it did not run)
Only the public API is used, so the same script measures any version of flashcl.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap

CLASSES = ("threads", "device_tables", "masked_nonfinite", "nan_rows", "byte_order", "device_events",
           "scale", "tuning_database", "device_limits", "merge_states", "cli")


# --------------------------------------------------------------------------- the cases (child)

def _report(case: str, outcome: str, detail: str = "") -> None:
    print("ADV " + json.dumps({"case": case, "outcome": outcome, "detail": detail[:300]}), flush=True)


def _expect_error(case: str, fn, names) -> None:
    """Run fn; an exception whose message contains one of ``names`` is 'error', another 'unnamed',
    none at all 'wrong' (the call should have been refused)."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001
        msg = str(exc)
        ok = any(n.lower() in msg.lower() for n in names)
        _report(case, "error" if ok else "unnamed", f"{type(exc).__name__}: {msg.splitlines()[0] if msg else ''}")
        return
    _report(case, "wrong", "no error")


def _close(got, ref, tol) -> bool:
    import numpy as np

    got = np.asarray(got, np.float64)
    ref = np.asarray(ref, np.float64)
    if not np.all(np.isfinite(got) == np.isfinite(ref)):
        return False
    fin = np.isfinite(ref)
    den = np.linalg.norm(ref[fin]) or 1.0
    return float(np.linalg.norm(got[fin] - ref[fin]) / den) <= tol


def _queue(dev: str):
    """A queue of our own on the first device matching ``dev`` whose compiler builds (Oclgrind left
    out): the calls then take pyopencl Arrays, which carry their queue."""
    import pyopencl as cl

    for p in cl.get_platforms():
        for d in p.get_devices():
            wanted = dev.lower() in (p.name + d.name).lower() or dev == "cpu" and d.type & cl.device_type.CPU
            if wanted and "oclgrind" not in p.name.lower():
                try:
                    cl.Program(cl.Context([d]), "__kernel void k(__global float*x){x[0]=1.0f;}").build()
                except cl.Error:
                    continue
                return cl.CommandQueue(cl.Context([d]))
    raise RuntimeError(f"no OpenCL device matching {dev!r} builds")


def _case_threads(dev):
    import sys as _sys
    import threading

    import numpy as np

    import flashcl
    from flashcl import reference

    rng = np.random.default_rng(0)
    cases = []
    for n_q, n_kv, d, causal in ((33, 47, 32, True), (16, 16, 64, False), (70, 70, 32, True)):
        q = rng.standard_normal((2, n_q, d)).astype(np.float32)
        k, v = (rng.standard_normal((1, n_kv, d)).astype(np.float32) for _ in range(2))
        cases.append(("prefill", (q, k, v), {"causal": causal}, reference.attention(q, k, v, causal=causal)))
    for ctx, splits in ((29, 1), (31, 3), (17, 2)):
        q = rng.standard_normal((2, 4, 32)).astype(np.float32)
        k, v = (rng.standard_normal((9, 8, 2, 32)).astype(np.float32) for _ in range(2))
        table = rng.permutation(9)[:8].reshape(2, 4).astype(np.int32)
        lens = np.array([ctx, ctx - 5], np.int32)
        kw = {"block_table": table, "context_lens": lens, "num_splits": splits}
        cases.append(("decode", (q, k, v), kw, reference.decode_attention(q, k, v, block_table=table,
                                                                          context_lens=lens)))
    for kind, args, kw, _ in cases:
        getattr(flashcl, kind)(*args, device=dev, **kw)
    results = []
    _sys.setswitchinterval(1e-5)

    def worker(seed):
        for i in np.random.default_rng(seed).integers(0, len(cases), 25):
            kind, args, kw, ref = cases[i]
            try:
                results.append(("ok" if _close(getattr(flashcl, kind)(*args, device=dev, **kw), ref, 1e-5)
                                else "wrong", kind))
            except Exception as exc:  # noqa: BLE001
                results.append(("unnamed", f"{kind}: {exc}"))

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, (outcome, detail) in enumerate(results):
        _report(f"threads[{i}]", outcome, detail)


def _case_device_tables(dev):
    import numpy as np
    import pyopencl as cl
    import pyopencl.array as cla

    import flashcl
    from flashcl import reference

    queue = _queue(dev)
    rng = np.random.default_rng(1)
    q = rng.standard_normal((3, 4, 32)).astype(np.float32)
    k, v = (rng.standard_normal((8, 16, 2, 32)).astype(np.float32) for _ in range(2))
    good_table = np.array([[0, 1, 2], [3, 4, 5], [6, 7, 1]], np.int32)
    good_lens = np.array([40, 33, 20], np.int32)
    ref = reference.decode_attention(q, k, v, block_table=good_table, context_lens=good_lens)
    bad = [("block id 1e9", lambda t, l: t.__setitem__((1, 1), 10 ** 9)),
           ("block id -5", lambda t, l: t.__setitem__((1, 0), -5)),
           ("block id num_blocks", lambda t, l: t.__setitem__((1, 2), 8)),
           ("context 1e9", lambda t, l: l.__setitem__(1, 10 ** 9)),
           ("context -7", lambda t, l: l.__setitem__(1, -7)),
           ("context past table", lambda t, l: l.__setitem__(1, 49))]
    for splits in (1, 2):
        for name, spoil in bad:
            t, ln = good_table.copy(), good_lens.copy()
            spoil(t, ln)
            out = flashcl.decode(*(cla.to_device(queue, x) for x in (q, k, v)),
                                 block_table=cla.to_device(queue, t), context_lens=cla.to_device(queue, ln),
                                 num_splits=splits).get()
            good_rows = [0, 2]
            fine = _close(out[good_rows], ref[good_rows], 1e-5)
            flagged = bool(np.isnan(out[1]).all())
            _report(f"device_tables[{name}, splits={splits}]", "ok" if fine and flagged else "wrong",
                    f"other rows right: {fine}, bad row NaN: {flagged}")


def _case_masked_nonfinite(dev):
    import numpy as np

    import flashcl
    from flashcl import reference

    rng = np.random.default_rng(2)
    for poison in (np.nan, np.inf):
        for n_q, n_kv in ((70, 70), (33, 90), (16, 17), (100, 130)):
            for dtype in ("float32", "float16"):
                q = rng.standard_normal((2, n_q, 32)).astype(dtype)
                k, v = (rng.standard_normal((1, n_kv, 32)).astype(dtype) for _ in range(2))
                ref = reference.attention(q, k, v, causal=True)
                kp, vp = k.copy(), v.copy()
                kp[:, n_kv - 1] = poison  # the last key: seen by the last row only
                vp[:, n_kv - 1] = poison
                out = flashcl.prefill(q, kp, vp, causal=True, device=dev)
                tol = 1e-5 if dtype == "float32" else 2e-3
                fine = _close(np.asarray(out)[:, :-1], ref[:, :-1], tol)
                _report(f"masked_nonfinite[prefill {poison} {n_q}/{n_kv} {dtype}]", "ok" if fine else "wrong")
        for splits in (1, 3):
            q = rng.standard_normal((2, 4, 32)).astype(np.float32)
            k, v = (rng.standard_normal((6, 16, 2, 32)).astype(np.float32) for _ in range(2))
            table = np.array([[3, 0, 5], [1, 4, 2]], np.int32)
            lens = np.array([40, 20], np.int32)
            ref = reference.decode_attention(q, k, v, block_table=table, context_lens=lens)
            kp, vp = k.copy(), v.copy()
            kp[5, 8:] = poison  # past sequence 0's end in its partial last block
            vp[5, 8:] = poison
            kp[4, 4:] = poison  # past sequence 1's end
            vp[4, 4:] = poison
            out = flashcl.decode(q, kp, vp, block_table=table, context_lens=lens, num_splits=splits, device=dev)
            _report(f"masked_nonfinite[decode paged {poison} splits={splits}]",
                    "ok" if _close(out, ref, 1e-5) else "wrong")
            kc, vc = (rng.standard_normal((2, 2, 64, 32)).astype(np.float32) for _ in range(2))
            lens = np.array([50, 7], np.int32)
            ref = reference.decode_attention(q, kc, vc, context_lens=lens)
            kc[0, :, 50:], vc[0, :, 50:], kc[1, :, 7:], vc[1, :, 7:] = poison, poison, poison, poison
            out = flashcl.decode(q, kc, vc, context_lens=lens, num_splits=splits, device=dev)
            _report(f"masked_nonfinite[decode contiguous {poison} splits={splits}]",
                    "ok" if _close(out, ref, 1e-5) else "wrong")


def _case_nan_rows(dev):
    import numpy as np

    import flashcl

    rng = np.random.default_rng(3)
    for n in (1, 16, 70):
        q = rng.standard_normal((2, n, 32)).astype(np.float32)
        k, v = (rng.standard_normal((2, 50, 32)).astype(np.float32) for _ in range(2))
        q[1, n - 1] = np.nan
        out, lse = flashcl.prefill(q, k, v, causal=False, return_lse=True, device=dev)
        bad = np.isnan(out).any(-1) & ~np.isnan(lse)
        _report(f"nan_rows[prefill N={n}]", "wrong" if bad.any() else "ok", f"{int(bad.sum())} rows")
    q = rng.standard_normal((2, 4, 32)).astype(np.float32)
    kc, vc = (rng.standard_normal((2, 2, 40, 32)).astype(np.float32) for _ in range(2))
    q[1, 2] = np.nan
    for splits in (1, 2):
        out, lse = flashcl.decode(q, kc, vc, num_splits=splits, return_lse=True, device=dev)
        bad = np.isnan(out).any(-1) & ~np.isnan(lse)
        _report(f"nan_rows[decode splits={splits}]", "wrong" if bad.any() else "ok", f"{int(bad.sum())} rows")


def _case_byte_order(dev):
    import numpy as np

    import flashcl
    from flashcl import reference

    rng = np.random.default_rng(4)
    for dt in (">f4", ">f2"):
        for causal in (False, True):
            q, k, v = (rng.standard_normal((2, 40, 32)).astype(dt) for _ in range(3))
            try:
                out = flashcl.prefill(q, k, v, causal=causal, device=dev)
                tol = 1e-5 if dt == ">f4" else 2e-3
                ok = _close(out, reference.attention(q, k, v, causal=causal), tol)
                _report(f"byte_order[prefill {dt} causal={causal}]", "ok" if ok else "wrong")
            except Exception as exc:  # noqa: BLE001
                _report(f"byte_order[prefill {dt} causal={causal}]", "error" if "byte" in str(exc) else "unnamed",
                        str(exc))
        q = rng.standard_normal((2, 4, 32)).astype(dt)
        kc, vc = (rng.standard_normal((2, 2, 24, 32)).astype(dt) for _ in range(2))
        lens = np.array([24, 13], ">i4")
        try:
            out = flashcl.decode(q, kc, vc, context_lens=lens, device=dev)
            ok = _close(out, reference.decode_attention(q, kc, vc, context_lens=lens), 2e-3)
            _report(f"byte_order[decode {dt}]", "ok" if ok else "wrong")
        except Exception as exc:  # noqa: BLE001
            _report(f"byte_order[decode {dt}]", "error" if "byte" in str(exc) else "unnamed", str(exc))


def _case_device_events(dev):
    import numpy as np
    import pyopencl as cl
    import pyopencl.array as cla

    import flashcl

    queue = _queue(dev)
    rng = np.random.default_rng(5)
    for n in (64, 512, 1024):
        x = cla.to_device(queue, rng.standard_normal((4, n, 64)).astype(np.float32))
        out = flashcl.prefill(x, x, x, causal=True)
        events = list(out.events)  # finish() waits for them and empties the list
        out.finish()
        done = bool(events) and all(e.command_execution_status == cl.command_execution_status.COMPLETE
                                    for e in events)
        _report(f"device_events[prefill N={n}]", "ok" if done else "wrong", f"{len(events)} events")
    kc = cla.to_device(queue, rng.standard_normal((1, 2, 4096, 64)).astype(np.float32))
    q = cla.to_device(queue, rng.standard_normal((1, 4, 64)).astype(np.float32))
    for splits in (1, 4):
        out = flashcl.decode(q, kc, kc, num_splits=splits)
        events = list(out.events)
        out.finish()
        done = bool(events) and all(e.command_execution_status == cl.command_execution_status.COMPLETE
                                    for e in events)
        _report(f"device_events[decode splits={splits}]", "ok" if done else "wrong", f"{len(events)} events")


def _case_scale(dev):
    import numpy as np

    import flashcl

    rng = np.random.default_rng(6)
    q = rng.standard_normal((2, 20, 32)).astype(np.float32)
    for scale in (1e38, 3e38, 1e39, -1e39, float("inf"), float("nan")):
        try:
            out, lse = flashcl.prefill(q, q, q, scale=scale, device=dev, return_lse=True)
        except (ValueError, TypeError) as exc:
            _report(f"scale[{scale}]", "error" if "scale" in str(exc) else "unnamed", str(exc))
            continue
        # logits past float32's range: a NaN row is acceptable only where its lse says so too
        rows_nan = np.isnan(out).any(-1)
        ok = np.isfinite(out).all() or bool(np.isnan(lse[rows_nan]).all())
        _report(f"scale[{scale}]", "ok" if ok else "wrong", f"{int(rows_nan.sum())} NaN rows, lse NaN there: {ok}")


def _case_tuning_database(dev):
    import warnings

    import numpy as np

    import flashcl

    q = np.random.default_rng(7).standard_normal((2, 20, 32)).astype(np.float32)
    base = {"kernel": "prefill", "dtype": "float32", "dk": 32, "dv": 32, "causal": False, "bucket": 32,
            "vendor": "cpu", "profile": "cpu", "params": {"BLOCK_M": 16, "BLOCK_N": 16, "DV_TILE": 32, "VEC": 4}}
    files = {
        "not json": "{ this is not json",
        "no entries": json.dumps({"version": 1}),
        "entries not a list": json.dumps({"entries": {"a": 1}}),
        "deeply nested": "[" * 100000 + "]" * 100000,
        "provenance a string": json.dumps({"entries": [dict(base, provenance="measured")]}),
        "params a list": json.dumps({"entries": [dict(base, params=[1, 2])]}),
        "dk a string": json.dumps({"entries": [dict(base, dk="32")]}),
        "entry a number": json.dumps({"entries": [7]}),
    }
    for name, text in files.items():
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "db.json")
            with open(path, "w") as f:
                f.write(text)
            os.environ["FLASHCL_TUNING_DIR"] = d
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    out = flashcl.prefill(q, q, q, device=dev)
                named = any(path in str(w.message) or "db.json" in str(w.message) for w in caught)
                fine = np.isfinite(out).all()
                _report(f"tuning_database[{name}]", "ok" if fine and (named or name == "provenance a string"
                                                                        and not caught) else "unnamed",
                        f"{len(caught)} warnings, named: {named}")
            except Exception as exc:  # noqa: BLE001
                _report(f"tuning_database[{name}]", "error" if "db.json" in str(exc) else "unnamed",
                        f"{type(exc).__name__}: {str(exc)[:200]}")
    os.environ.pop("FLASHCL_TUNING_DIR", None)


def _case_device_limits(dev):
    import time

    import numpy as np

    import flashcl

    for shape in ((64, 64, 65536, 64), (8, 32, 262144, 128), (1, 1, 2 ** 31, 8)):
        big = np.broadcast_to(np.zeros((1, 1, 1, shape[-1]), np.float32), shape)
        t0 = time.perf_counter()
        try:
            flashcl.prefill(big, big, big, device=dev)
            _report(f"device_limits[{shape}]", "wrong", "accepted")
        except MemoryError as exc:
            _report(f"device_limits[{shape}]", "unnamed", f"MemoryError {exc}")
        except Exception as exc:  # noqa: BLE001
            named = "CL_DEVICE" in str(exc) or "limit" in str(exc).lower()
            slow = time.perf_counter() - t0 > 5
            _report(f"device_limits[{shape}]", "error" if named and not slow else "unnamed",
                    f"{type(exc).__name__} after {time.perf_counter() - t0:.1f} s: {str(exc)[:150]}")


def _case_merge_states(dev):
    import numpy as np

    import flashcl

    rng = np.random.default_rng(8)
    o = [rng.standard_normal((2, 5, 8)).astype(np.float32) for _ in range(3)]
    l = [rng.standard_normal((2, 5)).astype(np.float32) for _ in range(3)]
    cases = {
        "lses shorter": (lambda: flashcl.merge_states(o, l[:2]), ["lses", "equally"]),
        "out shape differs": (lambda: flashcl.merge_states(o[:2] + [o[2][:, :3]], l), ["outs[2]"]),
        "lse shape differs": (lambda: flashcl.merge_states(o, l[:2] + [l[2][:, :3]]), ["lses[2]"]),
        "dtype differs": (lambda: flashcl.merge_states(o[:2] + [o[2].astype(np.float16)], l), ["outs[2]"]),
        "not a list": (lambda: flashcl.merge_states(o[0], l), ["outs"]),
        "a string inside": (lambda: flashcl.merge_states(o[:2] + ["x"], l), ["outs[2]"]),
    }
    try:
        import torch

        cases["numpy and torch"] = (lambda: flashcl.merge_states([torch.from_numpy(o[0]), *o[1:]], l),
                                    ["torch", "numpy"])
    except ImportError:
        pass
    for name, (fn, names) in cases.items():
        _expect_error(f"merge_states[{name}]", fn, names)
    l2 = [x.copy() for x in l]
    l2[1][0, 2] = np.nan
    out, lse = flashcl.merge_states(o, l2)
    _report("merge_states[a NaN lse keeps the row NaN]",
            "ok" if np.isnan(lse[0, 2]) and np.isnan(out[0, 2]).all() else "wrong")


def _case_cli(dev):
    cases = {
        "malformed --shape": ["bench", "prefill", "--device", dev, "--shape", "1,2,x"],
        "H_q not multiple": ["tune", "--device", "adreno", "--shape", "1,3,2,64,64,1", "--no-save"],
        "head dim 12 (tune)": ["tune", "--device", "adreno", "--shape", "1,2,2,64,12,1", "--no-save"],
        "head dim 300 (show-config)": ["show-config", "--device", "adreno", "--d", "300"],
        "--timeout 0": ["tune", "--device", "adreno", "--timeout", "0", "--no-save"],
        "bad --params": ["bench", "prefill", "--device", dev, "--params", "{not json"],
        "unknown device": ["bench", "prefill", "--device", "no-such-device-xyz"],
    }
    try:
        import torch

        if not torch.cuda.is_available():
            cases["triton without CUDA"] = ["bench", "prefill", "--backend", "triton"]
    except ImportError:
        pass
    for name, args in cases.items():
        proc = subprocess.run([sys.executable, "-c", "from flashcl.cli import main; main()", *args],
                              capture_output=True, text=True, timeout=300)
        err_lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
        if proc.returncode >= 2 and len(err_lines) == 1 and "Traceback" not in proc.stderr:
            outcome = "error"
        elif proc.returncode == 0:
            outcome = "wrong"
        else:
            outcome = "unnamed"
        _report(f"cli[{name}]", outcome, f"exit {proc.returncode}, {len(err_lines)} stderr lines")
    proc = subprocess.run([sys.executable, "-c", "from flashcl.cli import main; main()", "tune", "--device",
                           "adreno", "--quick", "--no-save", "--json"], capture_output=True, text=True, timeout=600)
    try:
        json.loads(proc.stdout, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))
        _report("cli[tune --json is standard JSON]", "ok")
    except ValueError as exc:
        _report("cli[tune --json is standard JSON]", "wrong", str(exc)[:100])


# --------------------------------------------------------------------------- the parent

def _run_class(name: str, device: str) -> dict:
    code = textwrap.dedent(f"""
        import sys, warnings
        warnings.simplefilter("ignore")
        sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
        import adversarial
        adversarial._case_{name}({device!r})
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1800)
    counts = {k: 0 for k in ("ok", "error", "unnamed", "wrong", "crash")}
    findings = []
    for line in proc.stdout.splitlines():
        if line.startswith("ADV "):
            r = json.loads(line[4:])
            counts[r["outcome"]] += 1
            if r["outcome"] in ("unnamed", "wrong"):
                findings.append(f"{r['case']}: {r['outcome']} {r['detail']}")
    if proc.returncode != 0:
        counts["crash"] += 1
        findings.append(f"process died (exit {proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}")
    return {"class": name, **counts, "findings": findings}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", help="OpenCL device for the calls (default: cpu)")
    ap.add_argument("--only", nargs="*", choices=CLASSES, help="run these classes only")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = [_run_class(c, args.device) for c in (args.only or CLASSES)]
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"{'class':18} {'calls':>5} {'ok':>4} {'error':>5} {'unnamed':>7} {'wrong':>5} {'crash':>5}")
    for r in rows:
        n = sum(r[k] for k in ("ok", "error", "unnamed", "wrong"))
        print(f"{r['class']:18} {n:5d} {r['ok']:4d} {r['error']:5d} {r['unnamed']:7d} {r['wrong']:5d} {r['crash']:5d}")
    for r in rows:
        for f in r["findings"][:5]:
            print(f"  {r['class']}: {f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
