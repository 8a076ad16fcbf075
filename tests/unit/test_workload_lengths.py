"""Workload length distributions: their shape, their fit to the model, their seeds."""

from __future__ import annotations

import statistics

import pytest

from splitserve_tools.workload.lengths import MIN_INPUT_LEN, WORKLOADS, workload_lengths

# (input median range, output median range) at a 4096-token context.
MEDIANS = {
    "chatbot": ((200, 300), (150, 250)),
    "code": ((100, 200), (50, 150)),
    "summarization": ((1000, 3000), (50, 200)),
}


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_medians_match_the_dataset_shape(name: str) -> None:
    pairs = workload_lengths(name, 2000, 4096, seed=1)
    (in_lo, in_hi), (out_lo, out_hi) = MEDIANS[name]
    assert in_lo <= statistics.median(i for i, _ in pairs) <= in_hi
    assert out_lo <= statistics.median(o for _, o in pairs) <= out_hi


@pytest.mark.parametrize("name", list(WORKLOADS))
@pytest.mark.parametrize("max_model_len", [64, 512, 4096])
def test_lengths_fit_the_model(name: str, max_model_len: int) -> None:
    pairs = workload_lengths(name, 500, max_model_len, seed=3)
    assert len(pairs) == 500
    for inp, out in pairs:
        assert inp >= MIN_INPUT_LEN and out >= 1
        assert inp + out <= max_model_len


def test_short_models_get_scaled_lengths() -> None:
    long = workload_lengths("summarization", 500, 4096, seed=0)
    short = workload_lengths("summarization", 500, 1024, seed=0)
    ratio = statistics.median(i for i, _ in short) / statistics.median(i for i, _ in long)
    assert ratio == pytest.approx(0.25, rel=0.05)


def test_deterministic_per_seed() -> None:
    assert workload_lengths("chatbot", 50, 2048, seed=5) == workload_lengths(
        "chatbot", 50, 2048, seed=5
    )
    assert workload_lengths("chatbot", 50, 2048, seed=5) != workload_lengths(
        "chatbot", 50, 2048, seed=6
    )


def test_fixed_workload() -> None:
    assert workload_lengths("fixed", 3, 128, input_len=16, output_len=8) == [(16, 8)] * 3
    with pytest.raises(ValueError, match="max_model_len"):
        workload_lengths("fixed", 3, 20, input_len=16, output_len=8)
    with pytest.raises(ValueError, match="--input-len"):
        workload_lengths("fixed", 3, 128)
