"""Workloads whose prompts share prefixes: conversations of several turns, and single prompts
behind one system prompt.

A prompt is a sequence of segments (token counts): the system prompt, then per earlier turn the
user's message and the assistant's reply, then this turn's message. Turn ``k + 1`` of a
session repeats turn ``k``'s prompt and reply and adds a message, so a prefix cache can serve
all of it but the new tokens. The replies in later prompts are the recorded ones of the
workload (as a replayed ShareGPT conversation carries), not what the served model wrote: the
shared prefix ends where the served reply began. Every session of a run shares the system
prompt. A session sends its next turn ``think_s`` after the previous one ended.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from splitserve_tools.workload.arrivals import arrival_times
from splitserve_tools.workload.lengths import MIN_INPUT_LEN

SESSION_SECONDS = 60.0
"""A probe of a session workload at ``rate`` sends at least ``rate * SESSION_SECONDS`` turns:
later turns wait for earlier ones, so a short run of few sessions is a closed loop of that many
users whatever its nominal rate, not the open-loop load the rate names."""


def probe_turns(num_requests: int, rate: float) -> int:
    """How many turns a probe at ``rate`` requests/s sends."""
    return max(num_requests, math.ceil(rate * SESSION_SECONDS))


@dataclass(frozen=True)
class SessionDist:
    """Token lengths (lognormal: median, sigma of the log) for a model whose context is ``span``
    tokens (shorter models get every length scaled by max_model_len / span)."""

    system: int
    min_turns: int
    max_turns: int
    """Turns per session, uniform over [min_turns, max_turns] (a session ends early once its
    next turn would not fit the context)."""
    message_median: float
    message_sigma: float
    reply_median: float
    reply_sigma: float
    think_s: float
    span: int = 4096


SESSION_WORKLOADS: dict[str, SessionDist] = {
    # Chat: a 200-token system prompt, 2-6 turns of ~60-token messages and ~150-token replies.
    "multi-turn": SessionDist(200, 2, 6, 60.0, 0.6, 150.0, 0.6, think_s=1.0),
    # One question each behind a shared 400-token system prompt (instructions, tools).
    "shared-prefix": SessionDist(400, 1, 1, 100.0, 0.8, 150.0, 0.6, think_s=0.0),
}


@dataclass(frozen=True)
class Turn:
    session: int
    index: int
    """0 for a session's first turn."""
    segments: tuple[int, ...]
    """Token counts of the prompt's parts: system, (message, reply) per earlier turn, message."""
    output_len: int
    follows: int | None
    """Position (in the run's list of turns) of the turn this one waits for; None: the first."""
    think_s: float

    @property
    def input_len(self) -> int:
        return sum(self.segments)


def session_turns(name: str, count: int, max_model_len: int, seed: int = 0) -> list[Turn]:
    """``count`` turns of workload ``name``, session after session (a session's turns in
    order), each fitting ``max_model_len`` with its reply."""
    dist = SESSION_WORKLOADS[name]
    gen = np.random.default_rng(seed)
    scale = min(1.0, max_model_len / dist.span)
    system = max(MIN_INPUT_LEN, round(dist.system * scale))

    def draw(median: float, sigma: float) -> int:
        return max(1, round(float(gen.lognormal(np.log(median * scale), sigma))))

    turns: list[Turn] = []
    session = 0
    while len(turns) < count:
        history: list[int] = [system]
        planned = int(gen.integers(dist.min_turns, dist.max_turns + 1))
        for index in range(planned):
            message = draw(dist.message_median, dist.message_sigma)
            reply = draw(dist.reply_median, dist.reply_sigma)
            segments = (*history, message)
            if sum(segments) + reply > max_model_len:
                if index == 0:
                    raise ValueError(f"max_model_len {max_model_len} fits no turn of {name!r}")
                break
            follows = len(turns) - 1 if index else None
            turns.append(Turn(session, index, segments, reply, follows, dist.think_s))
            if len(turns) == count:
                break
            history += [message, reply]
        session += 1
    return turns


def first_turn_arrivals(
    follows: Sequence[int | None], rate: float, arrival: str, seed: int, cv: float
) -> dict[int, float]:
    """When each session's first turn arrives (by its position in ``follows``, the turns'
    ``follows`` in order): sessions arrive as the arrival process says, at the rate that sends
    ``rate`` turns/s in all."""
    firsts = [i for i, f in enumerate(follows) if f is None]
    times = arrival_times(arrival, rate * len(firsts) / len(follows), len(firsts), seed, cv)
    return dict(zip(firsts, times.tolist(), strict=True))
