"""The bench's requests: a prompt of exact token length for each (input_len, output_len) pair,
or the prompts of conversations whose turns share prefixes (``workload.sessions``)."""

from __future__ import annotations

from dataclasses import dataclass

from splitserve_tools.bench.prompts import PromptMaker
from splitserve_tools.workload.sessions import Turn


@dataclass(frozen=True)
class Request:
    prompt_text: str
    input_len: int
    output_len: int
    turn: int = 0
    """Of its session (0: the first, or a request of no session)."""
    follows: int | None = None
    """Position of the request this one is sent after (the session's previous turn), ``think_s``
    after that one ended; None: at its own arrival time."""
    think_s: float = 0.0


def make_requests(
    lengths: list[tuple[int, int]], make_prompt: PromptMaker, seed: int = 0
) -> list[Request]:
    """One request per length pair; prompt ``i`` is made with seed ``seed * 1_000_003 + i``."""
    return [
        Request(make_prompt(inp, seed * 1_000_003 + i), inp, out)
        for i, (inp, out) in enumerate(lengths)
    ]


def make_session_requests(
    turns: list[Turn], make_prompt: PromptMaker, seed: int = 0
) -> list[Request]:
    """One request per turn: its segments' texts joined, the system prompt's shared by every
    session and each earlier message and reply repeated verbatim. Segment texts encode to their
    length each (the first with BOS); joined, BPE may merge a few tokens across a boundary."""
    base = seed * 1_000_003
    system = make_prompt(turns[0].segments[0], base) if turns else ""
    texts: dict[tuple[int, int], str] = {}

    def segment(session: int, position: int, length: int) -> str:
        key = (session, position)
        if key not in texts:  # + 1: the BOS that the segment's own encoding counts
            texts[key] = make_prompt(length + 1, base + 1 + session * 1000 + position)
        return texts[key]

    requests = []
    for t in turns:
        parts = [system, *(segment(t.session, i, n) for i, n in enumerate(t.segments[1:], 1))]
        requests.append(
            Request("".join(parts), t.input_len, t.output_len, t.index, t.follows, t.think_s)
        )
    return requests
