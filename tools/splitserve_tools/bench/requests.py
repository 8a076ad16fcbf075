"""The bench's requests: a prompt of exact token length for each (input_len, output_len) pair."""

from __future__ import annotations

from dataclasses import dataclass

from splitserve_tools.bench.prompts import PromptMaker


@dataclass(frozen=True)
class Request:
    prompt_text: str
    input_len: int
    output_len: int


def make_requests(
    lengths: list[tuple[int, int]], make_prompt: PromptMaker, seed: int = 0
) -> list[Request]:
    """One request per length pair; prompt ``i`` is made with seed ``seed * 1_000_003 + i``."""
    return [
        Request(make_prompt(inp, seed * 1_000_003 + i), inp, out)
        for i, (inp, out) in enumerate(lengths)
    ]
