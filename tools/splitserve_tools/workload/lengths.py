"""Request length distributions of the workloads: (input_len, output_len) pairs."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MIN_INPUT_LEN = 2
"""BOS and one token: an empty prompt is not a request."""


@dataclass(frozen=True)
class LengthDist:
    """Lognormal input and output lengths (median, sigma of the log), made for a model whose
    context is ``span`` tokens: shorter models get every length scaled by max_model_len / span."""

    input_median: float
    input_sigma: float
    output_median: float
    output_sigma: float
    span: int


WORKLOADS: dict[str, LengthDist] = {
    # ShareGPT-like: prompts median ~250 tokens with a long tail, answers median ~200.
    "chatbot": LengthDist(250.0, 1.0, 200.0, 0.8, span=4096),
    # HumanEval-like: short prompts (~150), short completions (~100).
    "code": LengthDist(150.0, 0.35, 100.0, 0.4, span=2048),
    # LongBench-like: long documents (1-3k tokens), short summaries (~120).
    "summarization": LengthDist(1800.0, 0.3, 120.0, 0.4, span=4096),
}
NAMES = (*WORKLOADS, "fixed")


def sample_lengths(
    dist: LengthDist, count: int, max_model_len: int, seed: int = 0
) -> list[tuple[int, int]]:
    """``count`` (input_len, output_len) pairs with input_len + output_len <= max_model_len."""
    if max_model_len < MIN_INPUT_LEN + 1:
        raise ValueError(f"max_model_len {max_model_len} leaves no room for a request")
    gen = np.random.default_rng(seed)
    scale = min(1.0, max_model_len / dist.span)
    inputs = gen.lognormal(np.log(dist.input_median * scale), dist.input_sigma, count)
    outputs = gen.lognormal(np.log(dist.output_median * scale), dist.output_sigma, count)
    pairs = []
    for i, o in zip(np.rint(inputs).astype(int), np.rint(outputs).astype(int), strict=True):
        out = int(np.clip(o, 1, max_model_len - MIN_INPUT_LEN))
        inp = int(np.clip(i, MIN_INPUT_LEN, max_model_len - out))
        pairs.append((inp, out))
    return pairs


def fixed_lengths(
    count: int, input_len: int, output_len: int, max_model_len: int
) -> list[tuple[int, int]]:
    if input_len < MIN_INPUT_LEN or output_len < 1:
        raise ValueError(f"need input_len >= {MIN_INPUT_LEN} and output_len >= 1")
    if input_len + output_len > max_model_len:
        raise ValueError(
            f"input_len + output_len = {input_len + output_len} > max_model_len {max_model_len}"
        )
    return [(input_len, output_len)] * count


def workload_lengths(
    name: str,
    count: int,
    max_model_len: int,
    seed: int = 0,
    input_len: int | None = None,
    output_len: int | None = None,
) -> list[tuple[int, int]]:
    """Lengths of workload ``name`` (``fixed`` needs ``input_len`` and ``output_len``)."""
    if name == "fixed":
        if input_len is None or output_len is None:
            raise ValueError("the fixed workload needs --input-len and --output-len")
        return fixed_lengths(count, input_len, output_len, max_model_len)
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; expected one of {NAMES}")
    return sample_lengths(WORKLOADS[name], count, max_model_len, seed)
