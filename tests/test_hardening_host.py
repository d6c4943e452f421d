"""Regression tests of the host side's edges: concurrent callers, byte order, events of device
results, scales, device limits, merge_states' validation, and a suite that collects without torch."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import flashcl
from flashcl import reference

from ._check import TOL, rel_err

ROOT = Path(__file__).resolve().parent.parent


# --------------------------------------------------------------------------- threads

def _prefill_case(rng, n_q, n_kv, d, causal):
    q = rng.standard_normal((2, n_q, d)).astype(np.float32)
    k, v = (rng.standard_normal((1, n_kv, d)).astype(np.float32) for _ in range(2))
    return ("prefill", (q, k, v), {"causal": causal}, reference.attention(q, k, v, causal=causal))


def _decode_case(rng, ctx, d, splits):
    q = rng.standard_normal((2, 4, d)).astype(np.float32)
    k, v = (rng.standard_normal((9, 8, 2, d)).astype(np.float32) for _ in range(2))
    table = rng.permutation(9)[:8].reshape(2, 4).astype(np.int32)
    lens = np.array([ctx, max(1, ctx - 5)], np.int32)
    ref = reference.decode_attention(q, k, v, block_table=table, context_lens=lens)
    return ("decode", (q, k, v), {"block_table": table, "context_lens": lens, "num_splits": splits}, ref)


def _variant_cases(rng):
    """Calls whose kernels carry per-call variant buffers (sinks, slopes, a mask and its tile map)
    and quantized caches: their arguments are set and launched under the same per-device lock."""
    q = rng.standard_normal((1, 4, 37, 32)).astype(np.float32)
    k, v = (rng.standard_normal((1, 2, 45, 32)).astype(np.float32) for _ in range(2))
    sinks = rng.standard_normal(4).astype(np.float32)
    mask = rng.random((37, 45)) > 0.3
    var = {"causal": True, "window": (9, 0), "softcap": 5.0, "sinks": sinks}
    qd = rng.standard_normal((2, 4, 32)).astype(np.float32)
    kc, vc = (rng.standard_normal((2, 2, 40, 32)).astype(np.float32) for _ in range(2))
    lens = np.array([40, 23], np.int32)
    slopes = rng.uniform(0, 0.5, (2, 4)).astype(np.float32)
    dvar = {"context_lens": lens, "window": (11, 0), "alibi_slopes": slopes, "sinks": sinks}
    kq = flashcl.quantize(kc, "q8_0")
    return [
        ("prefill", (q, k, v), var, reference.attention(q, k, v, **var)),
        ("prefill", (q, k, v), {"mask": mask}, reference.attention(q, k, v, mask=mask)),
        ("decode", (qd, kc, vc), {**dvar, "num_splits": 3}, reference.decode_attention(qd, kc, vc, **dvar)),
        ("decode", (qd, kq, vc), {"context_lens": lens}, reference.decode_attention(qd, kq, vc, context_lens=lens)),
    ]


def test_concurrent_calls_on_one_device_are_all_right(cpu_device):
    """Four threads calling prefill and decode (mixed shapes, variants and cache formats, so mixed
    programs) on one device with a tiny switch interval: every result matches the oracle."""
    rng = np.random.default_rng(7)
    cases = [_prefill_case(rng, 33, 47, 32, True), _prefill_case(rng, 16, 16, 64, False),
             _decode_case(rng, 29, 32, 1), _decode_case(rng, 31, 32, 3), _decode_case(rng, 17, 64, 2),
             *_variant_cases(rng)]
    for kind, args, kw, _ in cases:  # build every program once, so the threads race on launches
        getattr(flashcl, kind)(*args, device=cpu_device, **kw)
    from flashcl.opencl.runtime import get_device

    get_device(cpu_device).scratch_buffers.clear()  # and on growing the shared split-k scratch
    wrong, errors = [], []
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)

    def worker(seed):
        order = np.random.default_rng(seed).integers(0, len(cases), 30)
        for i in order:
            kind, args, kw, ref = cases[i]
            try:
                out = getattr(flashcl, kind)(*args, device=cpu_device, **kw)
            except Exception as exc:  # noqa: BLE001 - any failure is a finding
                errors.append(f"{kind}: {exc!r}")
                continue
            if not rel_err(out, ref) <= TOL["float32"]:
                wrong.append((kind, kw.get("num_splits"), rel_err(out, ref)))

    try:
        threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(old)
    assert not errors, errors[:5]
    assert not wrong, f"{len(wrong)} of 120 results wrong: {wrong[:5]}"


# --------------------------------------------------------------------------- repeated calls

def test_repeated_calls_reuse_their_kernels_and_workspaces(cpu_device, monkeypatch):
    """A call of a problem class seen before builds nothing (its wrapper is kept on the device),
    and the device's scratch serves decodes of other lengths, split counts and classes exactly."""
    from flashcl.opencl import decode as cl_decode
    from flashcl.opencl import prefill as cl_prefill

    rng = np.random.default_rng(11)
    q = rng.standard_normal((2, 4, 32)).astype(np.float32)
    k, v = (rng.standard_normal((9, 8, 2, 32)).astype(np.float32) for _ in range(2))
    table = rng.permutation(9)[:8].reshape(2, 4).astype(np.int32)
    pq = rng.standard_normal((2, 21, 32)).astype(np.float32)
    calls = [(3, {"context_lens": np.array([29, 7], np.int32)}),
             (2, {"context_lens": np.array([32, 30], np.int32)}),
             (3, {"context_lens": np.array([5, 31], np.int32)}),
             (None, {"context_lens": np.array([17, 1], np.int32), "sinks": rng.standard_normal(4).astype(np.float32)})]
    for splits, kw in calls:  # the first round builds
        flashcl.decode(q, k, v, block_table=table, num_splits=splits, device=cpu_device, **kw)
    flashcl.prefill(pq, pq, pq, causal=True, device=cpu_device)
    builds = []
    for mod in (cl_decode, cl_prefill):
        real = mod.build
        monkeypatch.setattr(mod, "build", lambda *a, _real=real, **kw: builds.append(a[1]) or _real(*a, **kw))
    for splits, kw in calls * 2:
        out = flashcl.decode(q, k, v, block_table=table, num_splits=splits, device=cpu_device, **kw)
        ref = reference.decode_attention(q, k, v, block_table=table, **kw)
        assert rel_err(out, ref) <= TOL["float32"], kw
    out = flashcl.prefill(pq, pq, pq, causal=True, device=cpu_device)
    assert rel_err(out, reference.attention(pq, pq, pq, causal=True)) <= TOL["float32"]
    assert builds == []


def test_an_edited_kernel_source_is_rebuilt_for_a_kept_wrapper(cpu_device, monkeypatch, tmp_path):
    import shutil

    from flashcl.opencl import runtime

    kernels = tmp_path / "clkernels"
    shutil.copytree(runtime.kernel_dir(), kernels)
    monkeypatch.setattr(runtime, "kernel_dir", lambda: kernels)
    # 40 query rows: the prefill kernels (a CPU runs up to 16 as a decode)
    q = np.random.default_rng(12).standard_normal((2, 40, 32)).astype(np.float32)
    flashcl.prefill(q, q, q, causal=True, device=cpu_device)
    source = kernels / "prefill_common.h"   # an include: the wrapper's program must notice it too
    source.write_text(source.read_text() + "\n#error edited\n")
    with pytest.raises(flashcl.KernelBuildError, match="edited"):
        flashcl.prefill(q, q, q, causal=True, device=cpu_device)


def test_an_edited_include_changes_the_build_options(cpu_device, monkeypatch, tmp_path):
    """Drivers cache binaries by the source text and options they are given (PoCL 5 served a
    kernel built from an older header): the options carry a digest of the kernel and its includes,
    so that an edited include, as a flashcl upgrade brings, is never answered from such a cache."""
    import shutil

    from flashcl.opencl import runtime

    kernels = tmp_path / "clkernels"
    shutil.copytree(runtime.kernel_dir(), kernels)
    monkeypatch.setattr(runtime, "kernel_dir", lambda: kernels)
    h = runtime.get_device(cpu_device)
    q = np.random.default_rng(15).standard_normal((2, 40, 32)).astype(np.float32)  # the prefill kernels

    def digests():
        return {o for b in h.programs.values() for o in b.options if o.startswith("-DFLASHCL_SOURCES=")}

    flashcl.prefill(q, q, q, causal=True, device=cpu_device)
    before = digests()
    header = kernels / "softcap.h"   # an include of the prefill kernels
    header.write_text(header.read_text() + "\n/* edited */\n")
    out = flashcl.prefill(q, q, q, causal=True, device=cpu_device)
    assert rel_err(out, reference.attention(q, q, q, causal=True)) <= TOL["float32"]
    assert before and digests() - before


def test_a_handle_dropped_from_the_cache_is_freed(cpu_device, monkeypatch):
    """Its kept wrappers refer back to it: leaving the handle cache drops them, so that the handle
    (its context, programs and scratch) goes with its last reference, not at a later collection."""
    import gc
    import weakref

    import pyopencl as cl

    from flashcl.opencl import runtime

    monkeypatch.setattr(runtime, "MAX_HANDLES", 2)
    dev = runtime.get_device(cpu_device).device
    q = np.random.default_rng(13).standard_normal((1, 4, 32)).astype(np.float32)
    k = np.random.default_rng(14).standard_normal((1, 2, 40, 32)).astype(np.float32)
    refs = []
    gc.disable()
    try:
        for _ in range(4):
            ctx = cl.Context([dev])
            flashcl.decode(q, k, k, device=ctx, num_splits=2)
            refs.append(weakref.ref(runtime.get_device(ctx)))
            del ctx
        alive = sum(r() is not None for r in refs)
    finally:
        gc.enable()
    assert alive <= 2


def test_split_states_over_the_kept_scratch_are_their_own(cpu_device, monkeypatch):
    import pyopencl as cl

    from flashcl.opencl import runtime

    monkeypatch.setattr(runtime, "SCRATCH_KEPT", 256)  # part_m and part_l fit, part_acc does not
    ctx = cl.Context([runtime.get_device(cpu_device).device])
    rng = np.random.default_rng(15)
    q = rng.standard_normal((2, 4, 32)).astype(np.float32)
    k, v = (rng.standard_normal((2, 2, 40, 32)).astype(np.float32) for _ in range(2))
    lens = np.array([40, 23], np.int32)
    for splits in (3, 2, 3):
        out = flashcl.decode(q, k, v, context_lens=lens, num_splits=splits, device=ctx)
        assert rel_err(out, reference.decode_attention(q, k, v, context_lens=lens)) <= TOL["float32"]
    kept = runtime.get_device(ctx).scratch_buffers
    assert set(kept) == {"part_m", "part_l"} and all(b.size <= 256 for b in kept.values())


def test_arrays_on_a_handles_queue_use_that_handle(cpu_device):
    """Arrays made on get_device(...).queue run on that handle (its programs and wrappers), not on
    a second handle of the same queue; another queue of the device gets its own."""
    import pyopencl as cl
    import pyopencl.array as cla

    from flashcl.opencl.arrays import handle_for_inputs
    from flashcl.opencl.runtime import get_device

    h = get_device(cpu_device)
    x = cla.to_device(h.queue, np.zeros((1, 2, 8, 32), np.float32))
    assert handle_for_inputs({"q": x}, None) is h
    assert get_device(cl.CommandQueue(h.context, h.device)) is not h


def test_an_out_of_order_queue_is_refused(cpu_device):
    import pyopencl as cl
    import pyopencl.array as cla

    from flashcl.opencl.runtime import get_device

    h = get_device(cpu_device)
    props = cl.command_queue_properties.OUT_OF_ORDER_EXEC_MODE_ENABLE
    if not h.device.queue_properties & props:
        pytest.skip("the device has no out-of-order queues")
    queue = cl.CommandQueue(h.context, h.device, properties=props)
    x = cla.to_device(queue, np.zeros((1, 4, 8, 32), np.float32))
    with pytest.raises(ValueError, match="in-order command queue"):
        flashcl.prefill(x, x, x)


# --------------------------------------------------------------------------- byte order

@pytest.mark.parametrize("dtype", [">f4", ">f2"])
def test_non_native_byte_order_is_converted(cpu_device, dtype):
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((2, 40, 32)).astype(dtype) for _ in range(3))
    out = flashcl.prefill(q, k, v, causal=True, device=cpu_device)
    name = np.dtype(dtype).newbyteorder("=").name
    assert out.dtype == np.dtype(name)
    assert rel_err(out, reference.attention(q, k, v, causal=True)) <= TOL[name]

    qd = rng.standard_normal((2, 4, 32)).astype(dtype)
    kc, vc = (rng.standard_normal((2, 2, 24, 32)).astype(dtype) for _ in range(2))
    lens = np.array([24, 13], dtype=">i4")
    out = flashcl.decode(qd, kc, vc, context_lens=lens, device=cpu_device)
    assert rel_err(out, reference.decode_attention(qd, kc, vc, context_lens=lens)) <= TOL[name]


# --------------------------------------------------------------------------- device results

def test_device_results_carry_the_events_that_write_them(cpu_device):
    import pyopencl as cl
    import pyopencl.array as cla

    from flashcl.opencl.runtime import get_device

    queue = get_device(cpu_device).queue
    rng = np.random.default_rng(4)
    q = cla.to_device(queue, rng.standard_normal((2, 300, 64)).astype(np.float32))
    out, lse = flashcl.prefill(q, q, q, causal=True, return_lse=True)
    events = list(out.events)  # finish() waits for them and empties the list
    assert events and lse.events
    out.finish()
    assert all(e.command_execution_status == cl.command_execution_status.COMPLETE for e in events)

    kc = cla.to_device(queue, rng.standard_normal((1, 2, 64, 64)).astype(np.float32))
    qd = cla.to_device(queue, rng.standard_normal((1, 4, 64)).astype(np.float32))
    out = flashcl.decode(qd, kc, kc, num_splits=2)
    events = list(out.events)
    assert events
    out.finish()
    assert all(e.command_execution_status == cl.command_execution_status.COMPLETE for e in events)


# --------------------------------------------------------------------------- scale

@pytest.mark.parametrize("scale", [1e39, -3e38, float("inf"), float("nan")])
def test_a_scale_not_finite_in_float32_is_an_error(scale):
    q = np.ones((1, 4, 32), np.float32)
    with pytest.raises(ValueError, match="scale"):
        flashcl.prefill(q, q, q, scale=scale)
    with pytest.raises(ValueError, match="scale"):
        flashcl.decode(q, q[None], q[None], scale=scale)


# --------------------------------------------------------------------------- device limits

def test_inputs_beyond_the_device_fail_before_any_copy(cpu_device):
    """A 64 GiB (broadcast) input: a ValueError naming the limit, at once, not after host copies."""
    big = np.broadcast_to(np.zeros((1, 1, 1, 64), np.float32), (64, 64, 65536, 64))
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match="CL_DEVICE_MAX_MEM_ALLOC_SIZE"):
        flashcl.prefill(big, big, big, device=cpu_device)
    cache = np.broadcast_to(np.zeros((1, 1, 1, 64), np.float32), (64, 8, 1 << 20, 64))
    with pytest.raises(ValueError, match="k_cache.*CL_DEVICE_MAX_MEM_ALLOC_SIZE"):
        flashcl.decode(np.zeros((64, 8, 64), np.float32), cache, cache, device=cpu_device)
    assert time.perf_counter() - t0 < 5.0


# --------------------------------------------------------------------------- merge_states

def _parts(rng, n=3, shape=(2, 5)):
    outs = [rng.standard_normal((*shape, 8)).astype(np.float32) for _ in range(n)]
    lses = [rng.standard_normal(shape).astype(np.float32) for _ in range(n)]
    return outs, lses


@pytest.mark.parametrize("bad, match", [
    (lambda o, l: (o, l[:2]), "equally many"),
    (lambda o, l: ([], []), "equally many"),
    (lambda o, l: (o[:2] + [o[2][:, :4]], l), r"outs\[2\]: shape"),
    (lambda o, l: (o, l[:2] + [l[2][:, :4]]), r"lses\[2\]: expected shape"),
    (lambda o, l: (o[:2] + [o[2].astype(np.float16)], l), r"outs\[2\]: dtype"),
    (lambda o, l: (o, l[:2] + [l[2].astype(np.int32)]), r"lses\[2\]"),
    (lambda o, l: (o[0], l), "list or tuple"),
    (lambda o, l: (o[:2] + ["x"], l), r"outs\[2\]"),
])
def test_merge_states_validates_its_inputs(bad, match):
    outs, lses = bad(*_parts(np.random.default_rng(0)))
    with pytest.raises((ValueError, TypeError), match=match):
        flashcl.merge_states(outs, lses)


def test_merge_states_refuses_mixed_numpy_and_torch():
    torch = pytest.importorskip("torch")
    outs, lses = _parts(np.random.default_rng(0))
    with pytest.raises(TypeError, match="all be numpy arrays or all torch tensors"):
        flashcl.merge_states([torch.from_numpy(outs[0]), *outs[1:]], lses)


def test_merge_states_keeps_nan_rows_nan():
    """NaN lse in a part (its scores were NaN): that row is NaN in both results. NaN in a part's
    out: those columns are NaN, the lse (of the scores) stays finite."""
    outs, lses = _parts(np.random.default_rng(0))
    outs[1][0, 2, 3] = np.nan
    lses[2][1, 4] = np.nan
    out, lse = flashcl.merge_states(outs, lses)
    assert np.isnan(out[0, 2, 3]) and np.isfinite(np.delete(out[0, 2], 3)).all() and np.isfinite(lse[0, 2])
    assert np.isnan(out[1, 4]).all() and np.isnan(lse[1, 4])
    good = np.ones(lse.shape, bool)
    good[0, 2] = good[1, 4] = False
    assert np.isfinite(out[good]).all() and np.isfinite(lse[good]).all()


# --------------------------------------------------------------------------- collection

def test_the_suite_collects_without_torch(tmp_path):
    """torch and triton made invisible (the path finder does not find them): collection succeeds."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(textwrap.dedent("""
        import importlib.machinery
        _find = importlib.machinery.PathFinder.find_spec
        def _hidden(cls, name, path=None, target=None):
            return None if name.split(".")[0] in ("torch", "triton") else _find(name, path, target)
        importlib.machinery.PathFinder.find_spec = classmethod(_hidden)
    """))
    env = dict(os.environ, PYTHONPATH=str(site))
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           str(ROOT / "tests")], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert "tests collected" in last and "error" not in last, proc.stdout[-2000:]


def test_host_transfers_round_trip(cl_device):
    """Host inputs reach the device and results come back (opencl/arrays.py; on a CPU device
    through buffers filled at creation and one wait): every dtype the kernels read, empty arrays,
    and a result that is a view at an offset of its buffer come back bit for bit."""
    import pyopencl.array as cla

    from flashcl.opencl.arrays import device_to_host, host_buffer, host_to_device
    from flashcl.opencl.runtime import get_device

    h = get_device(cl_device)
    rng = np.random.default_rng(4)
    hosts = [rng.standard_normal((3, 5, 7)).astype(np.float32), rng.standard_normal(17).astype(np.float16),
             rng.integers(-9, 9, (4, 6), dtype=np.int32), rng.integers(0, 255, 33, dtype=np.uint8),
             np.zeros((0, 4), np.float32)]
    for borrow in (False, True):  # filled at creation, or (a waiting call's inputs) the host memory itself
        devs = [host_to_device(h.queue, x, borrow=borrow) for x in hosts]
        for x, d, back in zip(hosts, devs, device_to_host(*devs)):
            assert back.dtype == x.dtype and back.shape == x.shape and np.array_equal(back, x)
            assert np.array_equal(d.get(), x)
        # HostBuffers, what calls on host arrays make and read back on every device
        for x, back in zip(hosts, device_to_host(*(host_buffer(h.queue, x, borrow=borrow) for x in hosts))):
            assert back.dtype == x.dtype and back.shape == x.shape and np.array_equal(back, x)
    whole = cla.to_device(h.queue, np.arange(24, dtype=np.float32))
    (tail,) = device_to_host(whole[8:].reshape(4, 4))
    assert np.array_equal(tail, np.arange(8, 24, dtype=np.float32).reshape(4, 4))


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_host_inputs_at_any_address_are_read_right(cpu_device, dtype):
    """A call on host arrays reads them in place on a CPU device (USE_HOST_PTR): arrays that start
    at any element of a larger allocation, so at every alignment, give the oracle's result."""
    rng = np.random.default_rng(21)

    def at(offset, shape):
        whole = rng.standard_normal(int(np.prod(shape)) + 8).astype(dtype)
        return whole[offset:offset + int(np.prod(shape))].reshape(shape)

    for offset in (0, 1, 3, 5):
        q, k, v = at(offset, (1, 4, 37, 32)), at(offset + 1, (1, 2, 37, 32)), at(offset + 2, (1, 2, 37, 32))
        out = flashcl.prefill(q, k, v, causal=True, device=cpu_device)
        assert rel_err(out, reference.attention(q, k, v, causal=True)) <= TOL[dtype], offset
        qd = at(offset, (2, 4, 32))
        kc, vc = at(offset + 3, (5, 8, 2, 32)), at(offset, (5, 8, 2, 32))
        table = rng.permutation(5)[:4].reshape(2, 2).astype(np.int32)
        lens = np.array([16, 9], np.int32)
        out = flashcl.decode(qd, kc, vc, block_table=table, context_lens=lens, device=cpu_device)
        ref = reference.decode_attention(qd, kc, vc, block_table=table, context_lens=lens)
        assert rel_err(out, ref) <= TOL[dtype], offset


_FAILING_MERGE = """
import sys, numpy as np, pyopencl as cl, flashcl
from flashcl.opencl import runtime
rng = np.random.default_rng(0)
q = rng.standard_normal((1, 8, 128), dtype=np.float32)
kv = rng.standard_normal((1, 8, 8192, 256), dtype=np.float32)
k, v = kv[..., :128], kv[..., 128:]   # strided views: the call borrows contiguous temporaries
flashcl.decode(q, k, v, device=sys.argv[1], num_splits=4)
real, calls = cl.enqueue_nd_range_kernel, []
def enqueue(queue, kernel, *args, **kw):
    calls.append(1)
    if len(calls) == 2:
        raise RuntimeError("the merge could not be enqueued")
    return real(queue, kernel, *args, **kw)
runtime.cl.enqueue_nd_range_kernel = enqueue
try:
    flashcl.decode(q, k, v, device=sys.argv[1], num_splits=4)
except Exception as exc:
    print("raised", type(exc).__name__)
runtime.cl.enqueue_nd_range_kernel = real
print("alive")
"""


def test_an_error_after_a_launch_drains_the_queue_before_unwinding(cpu_device):
    """A call on host arrays reads them in place; an error once its kernels are enqueued (here the
    merge's enqueue, after the split kernel's) waits for those kernels before the frames holding
    the borrowed 33 MB temporaries unwind. Without it the split kernel read freed memory (a
    segfault). In a child process, so that a crash fails this test only."""
    proc = subprocess.run([sys.executable, "-c", _FAILING_MERGE, cpu_device], capture_output=True,
                          text=True, timeout=600, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))})
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert "raised RuntimeError" in proc.stdout and "alive" in proc.stdout, proc.stdout
