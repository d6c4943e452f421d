"""The benchmarks' interleaved rounds (flashcl.tools.cuda_timing.interleaved_rounds): pure Python, no GPU."""

import pytest

cuda_timing = pytest.importorskip("flashcl.tools.cuda_timing", reason="the CUDA timing tools need torch")


def test_interleaved_rounds_take_turns_and_rotate():
    order = []

    def timer(name, values):
        it = iter(values)
        return lambda: (order.append(name), next(it))[1]

    timers = {"a": timer("a", [3.0, 1.0, 2.0]), "b": timer("b", [5.0, 4.0, 6.0]), "c": timer("c", [7.0, 7.0, 9.0])}
    out = cuda_timing.interleaved_rounds(timers, 3)
    # every timer once per round, the first one rotating
    assert order == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert out["a"] == {"median_ms": 2.0, "min_ms": 1.0, "max_ms": 3.0, "round_ms": [3.0, 1.0, 2.0]}
    assert out["c"]["median_ms"] == 7.0 and out["c"]["max_ms"] == 9.0
    assert list(out) == ["a", "b", "c"]


def test_interleaved_rounds_edge_cases():
    assert cuda_timing.interleaved_rounds({}, 2) == {}
    assert cuda_timing.interleaved_rounds({"x": lambda: 1.5}, 1)["x"]["median_ms"] == 1.5
    with pytest.raises(ValueError, match="rounds"):
        cuda_timing.interleaved_rounds({"x": lambda: 1.0}, 0)
