"""The engine's state of one request."""

from __future__ import annotations

import enum
import os
import time
from dataclasses import dataclass, field

from splitserve.engine.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


def random_seed() -> int:
    return int.from_bytes(os.urandom(7), "little")


@dataclass(eq=False)
class Request:
    """Token state of a request. ``num_computed`` tokens have their KV in ``block_ids``.

    Compared by identity: the scheduler's queue lookups would otherwise compare every field
    (token lists included) of every queued request, O(batch^2) field compares per step."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int = field(default_factory=random_seed)
    output_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    block_hashes: list[bytes] = field(default_factory=list)
    """Content hashes of the first full blocks of ``all_ids`` (``kv.block_hash``), grown as
    needed; they depend on the tokens only, so they outlive the blocks."""
    num_cached_blocks: int = 0
    """How many of ``block_ids``, from the first, the pool's prefix cache knows."""
    status: Status = Status.WAITING
    finish_reason: str | None = None
    arrival: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        if self.params.seed is not None:
            self.seed = self.params.seed

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    @property
    def is_decoding(self) -> bool:
        """All but the newest token are cached: the next step feeds one token."""
        return bool(self.output_ids) and self.num_computed == self.num_tokens - 1

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
