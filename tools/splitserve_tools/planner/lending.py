"""Cores lent between one prefill and one decode instance, in simulated time.

What ``splitserve serve`` does on a CPU split of one prefill and one decode instance
(``serving.core_lend``, ``serving.decode_lend``): a decode step that starts while prefill is
idle runs on both roles' cores (where that is faster), and a prompt pass waits for it; a prompt
pass that starts while decode offers its cores (decode idle, or its mean step interval under
``LendPolicy``'s share of ``tpot_target_s``) and fits decode's budget waits for decode's step in
flight and runs on both, and decode steps again once it ends. The engine's own ``LendPolicy``
decides the offer and the budget, fed the simulated step ends.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from splitserve.serving.decode_lend import LendPolicy
from splitserve_tools.planner.step_model import StepModel


@dataclass(frozen=True)
class Wider:
    """A role's step model on both roles' cores, and how many cores that is."""

    model: StepModel
    units: int


class Lending:
    """Which cores the next pass or step runs on; driven by ``PrefillPool`` and the decode
    ``EngineInstance``, which ask before they start and report when they end."""

    def __init__(self, prefill_wide: Wider, decode_wide: Wider, tpot_target_s: float) -> None:
        """``prefill_wide``: prompt passes on both roles' cores; ``decode_wide``: decode
        steps on both."""
        self.prefill_wide = prefill_wide
        self.decode_wide = decode_wide
        self.policy = LendPolicy(tpot_target_s)
        self.prefill_busy = False
        self.decode_busy = False
        self.decode_running = 0
        self.pass_on_decode = False
        """A prompt pass holds decode's cores: decode steps once it ends."""
        self.step_on_prefill = False
        """A decode step holds prefill's cores: a pass starts once it ends."""
        self.waiting_pass: tuple[Callable[[bool], None], bool, float] | None = None
        """A pass that waits for the step in flight, whether it borrows already, and its
        seconds on both roles' cores."""
        self.kick_decode: Callable[[], None] = lambda: None
        self.borrowed_passes = 0
        self.borrowed_steps = 0

    def decode_offers(self, now: float, wide_s: float) -> bool:
        """Whether a pass of ``wide_s`` seconds on both roles' cores may borrow decode's."""
        if self.decode_running == 0:
            return True
        return self.policy.offers(now) and wide_s <= self.policy.budget(now)

    def start_pass(self, now: float, wide_s: float, start: Callable[[bool], None]) -> None:
        """A prompt pass (``wide_s`` seconds on both roles' cores) is ready: ``start(borrowed)``
        now, or once the step holding the cores it needs ends."""
        borrow = self.decode_offers(now, wide_s)
        self.prefill_busy = True
        if (borrow and self.decode_busy) or self.step_on_prefill:
            self.waiting_pass = (start, borrow, wide_s)
            return
        self._start_pass(start, borrow)

    def _start_pass(self, start: Callable[[bool], None], borrow: bool) -> None:
        self.pass_on_decode = borrow
        self.borrowed_passes += borrow
        start(borrow)

    def pass_ended(self) -> None:
        self.prefill_busy = False
        if self.pass_on_decode:
            self.pass_on_decode = False
            self.kick_decode()

    def may_step(self) -> bool:
        """Whether decode may start a step now (no pass holds or waits for its cores)."""
        return not self.pass_on_decode and self.waiting_pass is None

    def prefill_lends(self) -> bool:
        """Whether a decode step starting now may run on prefill's cores too (prefill idle)."""
        return not self.prefill_busy

    def step_started(self, wide: bool) -> None:
        """A decode step starts, on prefill's cores too if ``wide`` (where ``prefill_lends``
        and the step is faster there, as the guard finds)."""
        self.decode_busy = True
        self.step_on_prefill = wide
        self.borrowed_steps += wide

    def step_ended(self, now: float, running: int) -> None:
        self.decode_busy = False
        self.step_on_prefill = False
        self.policy.stepped(now)
        self.set_running(running)
        waiting, self.waiting_pass = self.waiting_pass, None
        if waiting is not None:
            start, borrow, wide_s = waiting
            # One that waited for prefill's cores asks for decode's now, as the server does.
            self._start_pass(start, borrow or self.decode_offers(now, wide_s))

    def set_running(self, running: int) -> None:
        self.decode_running = running
        if running == 0:
            self.policy.idle()
