"""``flashcl bench prefill --kv-format FMT``: the quantized K/V call timed next to the plain one.

OpenCL through the CLI on the CPU device (PoCL) with tiny shapes; the Triton tool's pure parts
(refusals, byte count, table) without CUDA, the CLI's wiring to it with ``run`` faked, and one shape
timed on Triton's interpreter with CUDA's timing faked.
"""

from __future__ import annotations

import json
import math

import pytest
from click.testing import CliRunner

from flashcl import cli, quant

TINY = ["--shape", "1,2,1,40,32,1", "--shape", "1,2,2,33,64,0", "--repeats", "2"]


def run(*args):
    return CliRunner().invoke(cli.main, list(args), catch_exceptions=False)


def _usage_error(r) -> str:
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output
    lines = [ln for ln in r.stderr.splitlines() if ln.strip() and not ln.startswith("#")]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    return lines[0]


# --------------------------------------------------------------------------- OpenCL (PoCL)

@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "int8"])
def test_opencl_table_has_the_quantized_rows(cpu_device, fmt):
    r = run("bench", "prefill", "--device", cpu_device, *TINY, "--kv-format", fmt)
    assert r.exit_code == 0, r.output
    block = r.stdout.split(f"# K/V quantized to {fmt}", 1)[1].splitlines()[1:3]
    assert [ln.split()[1] for ln in block] == ["(1,2/1,40,32)", "(1,2/2,33,64)"], r.stdout
    for ln in block:
        assert " ms " in ln and "ratio " in ln and "GFLOP/s" in ln and " MB vs " in ln and "rel err" in ln


def test_opencl_json_fields(cpu_device):
    r = run("bench", "prefill", "--device", cpu_device, *TINY, "--kv-format", "q4_0", "--json")
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)["rows"]
    assert len(rows) == 2
    for row, (b, h_kv, n, d) in zip(rows, [(1, 1, 40, 32), (1, 2, 33, 64)]):
        assert row["kv_format"] == "q4_0"
        assert row["kv_bytes"] == 2 * b * h_kv * n * d * 2  # float16 K and V
        assert row["quant_kv_bytes"] == 2 * b * h_kv * n * d // quant.QK * quant.BLOCK_BYTES["q4_0"]
        assert row["quant_min_ms"] <= row["quant_ms"] <= row["quant_max_ms"]
        assert math.isclose(row["quant_ratio"], row["quant_ms"] / row["median_ms"])
        assert math.isclose(row["quant_gflops"] * row["quant_ms"], row["gflops"] * row["median_ms"])
        assert 0 < row["quant_rel_err"] < 2e-3  # against the oracle on the dequantized K/V
        assert row["quant_params"]


def test_opencl_tiles_layout_with_a_quantized_cache(cpu_device):
    """The --params override reaches both calls: the "tiles" layout stages quantized tiles too."""
    tiles = '{"VARIANT":"tiles","BLOCK_M":16,"BLOCK_N":8,"DV_TILE":32,"TILE_M":4,"TILE_N":2}'
    r = run("bench", "prefill", "--device", cpu_device, "--shape", "1,2,1,40,32,1", "--repeats", "1",
            "--kv-format", "q8_0", "--params", tiles, "--json")
    assert r.exit_code == 0, r.output
    (row,) = json.loads(r.stdout)["rows"]
    assert row["quant_params"].startswith("VARIANT=tiles") and 0 < row["quant_rel_err"] < 2e-3


def test_opencl_int8_bytes_count_the_row_scales_and_no_check_skips(cpu_device):
    r = run("bench", "prefill", "--device", cpu_device, "--shape", "1,2,1,40,32,1", "--repeats", "1",
            "--kv-format", "int8", "--no-check", "--json")
    assert r.exit_code == 0, r.output
    (row,) = json.loads(r.stdout)["rows"]
    assert row["quant_kv_bytes"] == 2 * 40 * (32 + 4) and row["quant_rel_err"] is None


def test_opencl_float16_times_nothing_extra(cpu_device):
    r = run("bench", "prefill", "--device", cpu_device, "--shape", "1,2,1,40,32,1", "--repeats", "1",
            "--kv-format", "float16", "--json")
    assert r.exit_code == 0, r.output
    (row,) = json.loads(r.stdout)["rows"]
    assert row["kv_format"] == "" and row["quant_ms"] is None and row["kv_bytes"] == 2 * 40 * 32 * 2


def test_opencl_quantized_error_is_checked(cpu_device, monkeypatch):
    """An oracle that disagrees with the quantized call (K/V scaled) fails the run, naming the format."""
    from flashcl.tools import bench_prefill as bench

    monkeypatch.setattr(bench.quant, "dequantize", lambda qt, real=quant.dequantize: real(qt) * 1.5)
    r = run("bench", "prefill", "--device", cpu_device, "--shape", "1,2,1,40,32,1", "--repeats", "1",
            "--kv-format", "q8_0")
    assert r.exit_code == 1 and "(1,2/1,40,32) q8_0 err" in r.stderr, r.output


def test_opencl_refuses_fp8():
    assert "fp8_e4m3" in _usage_error(run("bench", "prefill", "--shape", "1,2,1,40,32,1",
                                          "--kv-format", "fp8_e4m3"))


def test_ggml_formats_need_whole_blocks():
    assert "head dim 40" in _usage_error(run("bench", "prefill", "--shape", "1,2,1,64,40,1",
                                             "--kv-format", "q8_0"))


def test_kv_format_with_variants_is_refused():
    assert "--kv-format" in _usage_error(run("bench", "prefill", "--shape", "1,2,1,64,32,1",
                                             "--kv-format", "int8", "--window", "15,0"))


def test_unknown_format_is_a_usage_error():
    assert "q5_0" in _usage_error(run("bench", "prefill", "--kv-format", "q5_0"))


# --------------------------------------------------------------------------- Triton, without CUDA

def _triton_tool():
    pytest.importorskip("torch")
    pytest.importorskip("triton")
    from flashcl.tools import triton_bench_prefill

    return triton_bench_prefill


def test_triton_run_refuses_a_format_before_cuda():
    tb = _triton_tool()
    with pytest.raises(ValueError, match="takes q8_0, q4_0, int8, fp8_e4m3; got 'q5_0'"):
        tb.run(shapes=[(1, 2, 2, 64, 64, True)], kv_format="q5_0")
    with pytest.raises(ValueError, match="drop the variants"):
        tb.run(shapes=[(1, 2, 2, 64, 64, True)], kv_format="int8", variants={"window": (15, 0)})


def test_triton_kv_bytes_are_as_stored():
    tb = _triton_tool()
    b, h_kv, n, d = 2, 4, 100, 128
    torch = pytest.importorskip("torch")
    k = torch.randn(b, h_kv, n, d, dtype=torch.float16)
    assert tb.kv_bytes(b, h_kv, n, d, 2) == 2 * k.numel() * 2
    for fmt in ("q8_0", "q4_0", "int8", "fp8_e4m3"):
        qt = quant.quantize(k, fmt)
        stored = qt.data.numel() * qt.data.element_size()
        if fmt == "int8":  # the row scales are stored beside the values; fp8's one scale is not per row
            stored += qt.scales.numel() * qt.scales.element_size()
        assert tb.kv_bytes(b, h_kv, n, d, 2, fmt) == 2 * stored, fmt


_META = dict(flashcl="0", dtype="float16", device="GPU", capability="9.0", driver="12", torch="2", triton="3",
             date="now", command="flashcl bench prefill", rounds=3)


def _rows(fmt="q8_0"):
    shape = dict(B=1, H_q=32, H_kv=8, N=4096, d=128, causal=True, flops=1e12)
    plain = dict(_META, **shape, impl="flashcl", median_ms=2.0, min_ms=1.9, max_ms=2.1, spread_pct=10.0,
                 tflops=500.0, kv_bytes=16777216, config=None)
    quantized = dict(_META, **shape, impl="flashcl-quant", kv_format=fmt, median_ms=2.5, tflops=400.0,
                     kv_bytes=8912896, quant_ratio=1.25, rel_diff_vs_dequantized=1e-4,
                     config=dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=2))
    peer = dict(_META, **shape, impl="sdpa-flash", median_ms=None, tflops=None, error="RuntimeError: no")
    return [plain, quantized, peer]


def test_triton_table_has_the_quantized_block():
    tb = _triton_tool()
    text = tb.format_table(_rows())
    block = text.split("K/V quantized to q8_0", 1)[1].splitlines()[1]
    for part in ("2.500 ms vs 2.000 ms float16", "ratio 1.250", "400.0 vs 500.0 TFLOP/s",
                 "K/V 8.91 MB vs 16.8 MB", "diff 1.0e-04", "config 128x64 w8 s2"):
        assert part in block, block
    assert "K/V quantized" not in tb.format_table(_rows()[:1] + _rows()[2:])


def test_triton_table_survives_a_failed_quantized_call():
    tb = _triton_tool()
    rows = _rows()
    rows[1].update(median_ms=None, tflops=None, quant_ratio=None, rel_diff_vs_dequantized=None,
                   error="RuntimeError: out of memory", config=None)
    text = tb.format_table(rows)
    assert "n/a ms vs 2.000 ms" in text and "flashcl-quant" in text.split("n/a:", 1)[1]


def test_triton_cli_passes_the_format(monkeypatch):
    tb = _triton_tool()
    seen = {}

    def fake_run(**kw):
        seen.update(kw)
        return _rows(kw.get("kv_format", "q8_0"))

    monkeypatch.setattr(tb, "run", fake_run)
    monkeypatch.setattr(cli, "_triton_bench", lambda name: tb)
    r = run("bench", "prefill", "--backend", "triton", "--shape", "1,32,8,4096,128,1", "--kv-format", "fp8_e4m3")
    assert r.exit_code == 0, r.output
    assert seen["kv_format"] == "fp8_e4m3" and "K/V quantized to fp8_e4m3" in r.stdout
    seen.clear()
    r = run("bench", "prefill", "--backend", "triton", "--shape", "1,32,8,4096,128,1", "--kv-format", "float16")
    assert r.exit_code == 0 and "kv_format" not in seen, r.output
    assert "head dim 80" in _usage_error(run("bench", "prefill", "--backend", "triton", "--shape",
                                             "1,32,8,4096,80,1", "--kv-format", "q8_0"))


@pytest.mark.parametrize("fmt", ["q4_0", "int8"])
def test_triton_shape_times_the_quantized_call_beside_the_plain_one(monkeypatch, fmt):
    """_bench_shape on Triton's interpreter, CUDA's parts faked: the quantized call takes its turn in
    the same rounds, on the same values, and gives the same answer as the plain kernel."""
    tb = _triton_tool()
    torch = pytest.importorskip("torch")
    from flashcl.tools import cuda_timing

    shape = (1, 2, 1, 40, 32, True)
    gen = torch.Generator().manual_seed(0)
    sets = [tuple(torch.randn(s, generator=gen, dtype=torch.float32) for s in ((1, 2, 40, 32), (1, 1, 40, 32),
                                                                              (1, 1, 40, 32)))]
    fake_ms = iter(range(1, 1000))
    turns = []

    def time_graph(calls, **kw):
        turns.append(calls)
        calls[0]()
        return {"median_ms": float(next(fake_ms))}

    monkeypatch.setattr(tb, "_input_sets", lambda shape, dtype: list(sets))
    monkeypatch.setattr(cuda_timing, "time_graph", time_graph)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    rows = tb._bench_shape(shape, torch.float32, {"dtype": "float32"}, rounds=2, kv_format=fmt)
    by = {r["impl"]: r for r in rows}
    plain, quantized = by["flashcl"], by[tb.QUANT_IMPL]
    assert rows[0] is plain and quantized["kv_format"] == fmt
    assert plain["kv_bytes"] == 2 * 40 * 32 * 4
    assert quantized["kv_bytes"] == tb.kv_bytes(1, 1, 40, 32, 4, fmt) < plain["kv_bytes"]
    assert quantized["rounds"] == 2 and len(quantized["round_ms"]) == 2  # timed in the same rounds
    assert quantized["quant_ratio"] == quantized["median_ms"] / plain["median_ms"]
    assert quantized["tflops"] == quantized["flops"] / (quantized["median_ms"] * 1e-3) / 1e12
    assert quantized["rel_diff_vs_dequantized"] < 1e-5, quantized
    assert "K/V quantized to " + fmt in tb.format_table([dict(r, flashcl="0", device="cpu", capability="0.0",
                                                             driver="-", torch="-", triton="-", date="-",
                                                             command="-") for r in rows])
