"""Keeps an adaptive mechanism on only where it measurably pays.

A mechanism that changes how an engine step runs (decode borrowing prefill's cores, and any
later one) is a bet that steps get faster. The guard checks the bet as the server runs: per step
size (the batch), it keeps the recent step times with the mechanism and without it, and holds
the mechanism off at a size where its median is not below the median without it. Both arms stay
measured: until each has ``min_samples`` at a size the guard alternates them, and afterwards
one step in ``probe_every`` takes the arm it would not (fewer while the probes keep confirming
the decision), so a decision follows a change in either direction. The first time it holds the
mechanism off at a size it logs why, once.
"""

from __future__ import annotations

import logging
import statistics
from collections import deque
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

EXACT_SIZES = 8
"""Step sizes up to this are compared on their own; larger ones by power-of-two bucket."""


def size_bucket(size: int) -> int:
    """The key a step of ``size`` requests is compared under: 1..8, then 16, 32, 64, ..."""
    if size <= EXACT_SIZES:
        return max(size, 1)
    return 1 << (size - 1).bit_length()


@dataclass(frozen=True)
class GuardSettings:
    window: int = 16
    """Step times kept per arm and bucket; decisions compare their medians."""
    min_samples: int = 4
    """Samples each arm needs at a bucket before the guard decides there."""
    probe_every: int = 32
    """Once decided, one step in this many (per bucket) takes the other arm ..."""
    max_probe_every: int = 4096
    """... and, each time a probe leaves the decision as it was, twice as few, down to one in
    this many: a mechanism that does not pay by far costs its probes almost nothing."""

    def __post_init__(self) -> None:
        if not 1 <= self.min_samples <= self.window:
            raise ValueError("min_samples must be in [1, window]")
        if not 2 <= self.probe_every <= self.max_probe_every:
            raise ValueError("probe_every must be in [2, max_probe_every]")


@dataclass
class _Arms:
    on: deque[float]
    off: deque[float]
    probe_every: int
    until_probe: int
    pays: bool | None = None
    """Whether the mechanism made steps faster here; None until both arms have samples. Kept
    by ``record`` (the only place the samples change), read on every step."""
    logged: bool = False

    def add(self, used: bool, seconds: float, min_samples: int) -> None:
        (self.on if used else self.off).append(seconds)
        if len(self.on) >= min_samples and len(self.off) >= min_samples:
            self.pays = statistics.median(self.on) < statistics.median(self.off)


@dataclass
class PayoffGuard:
    """Decides, step by step, whether ``name`` is used; fed back the time of every step it
    decided. Used by one thread (the engine loop's)."""

    name: str
    settings: GuardSettings = field(default_factory=GuardSettings)
    withheld_steps: int = 0
    """Steps run without the mechanism by the guard's choice (probes included)."""
    off_buckets: tuple[int, ...] = ()
    """Step-size buckets at which the mechanism is held off now (replaced, never changed in
    place: other threads read it)."""
    _arms: dict[int, _Arms] = field(default_factory=dict)

    def use(self, size: int) -> bool:
        """Whether the next step, of ``size`` requests, should use the mechanism."""
        arms = self._at(size)
        decided = arms.pays
        if decided is None:
            choice = len(arms.on) <= len(arms.off)
        else:
            arms.until_probe -= 1
            probe = arms.until_probe <= 0
            if probe:
                arms.until_probe = arms.probe_every
            choice = decided != probe
        if not choice:
            self.withheld_steps += 1
        return choice

    def record(self, size: int, used: bool, seconds: float) -> None:
        """The step the guard decided on took ``seconds``."""
        arms = self._at(size)
        before = arms.pays
        if before is not None and used != before:  # a probe: did it bear the decision out?
            chosen = statistics.median(arms.off if used else arms.on)
            confirmed = seconds >= chosen if used else seconds > chosen
            limit = self.settings.max_probe_every
            arms.probe_every = min(2 * arms.probe_every, limit) if confirmed else self._base
            arms.until_probe = arms.probe_every
        arms.add(used, seconds, self.settings.min_samples)
        pays = arms.pays
        key = size_bucket(size)
        if (pays is False) != (key in self.off_buckets):
            self.off_buckets = tuple(sorted(set(self.off_buckets) ^ {key}))
        if pays is False and not arms.logged:
            arms.logged = True
            log.info(
                "%s does not pay at %d requests per step (median %.2f ms with it, %.2f ms "
                "without, over the last %d and %d steps): holding it off there while that lasts",
                self.name,
                key,
                statistics.median(arms.on) * 1e3,
                statistics.median(arms.off) * 1e3,
                len(arms.on),
                len(arms.off),
            )

    def median(self, size: int, used: bool) -> float | None:
        """The median recent time of steps of ``size``'s bucket with the mechanism (``used``)
        or without it; None before any."""
        arms = self._arms.get(size_bucket(size))
        samples = None if arms is None else (arms.on if used else arms.off)
        return statistics.median(samples) if samples else None

    @property
    def _base(self) -> int:
        return self.settings.probe_every

    def _at(self, size: int) -> _Arms:
        key = size_bucket(size)
        arms = self._arms.get(key)
        if arms is None:
            window, every = self.settings.window, self._base
            arms = _Arms(deque(maxlen=window), deque(maxlen=window), every, every)
            self._arms[key] = arms
        return arms
