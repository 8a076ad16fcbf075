"""The ``prefill`` model's instances behind Triton's dynamic batcher, in simulated time.

One queue: an idle instance takes up to ``max_batch_size`` requests once that many wait or the
oldest has waited ``queue_delay``. Each instance's KV pool is a real ``BlockAllocator``; a
prompt's blocks stay allocated after its pass (leased to its decode
instance) until decode pulls or discards them, so a full pool stalls prefill.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from functools import partial

from splitserve.kv.allocator import BlockAllocator
from splitserve_tools.planner.events import Clock, SimRequest
from splitserve_tools.planner.machine import Machine
from splitserve_tools.planner.placement import Limits
from splitserve_tools.planner.step_model import StepModel

Release = Callable[[], None]
"""Frees a prefilled prompt's blocks on its prefill instance."""


class PrefillPool:
    def __init__(
        self,
        clock: Clock,
        machine: Machine,
        instances: int,
        units: int,
        model: StepModel,
        limits: Limits,
        kv_blocks: int,
        on_done: Callable[[SimRequest, Release], None],
    ) -> None:
        self.clock = clock
        self.machine = machine
        self.units = units
        self.model = model
        self.max_batch = limits.prefill_max_batch_size
        self.delay = limits.prefill_queue_delay_s
        self.on_done = on_done
        self.queue: deque[tuple[float, SimRequest]] = deque()
        self.idle = list(range(instances))
        self.pools = [BlockAllocator(kv_blocks) for _ in range(instances)]
        self._timer_at = math.inf

    def submit(self, req: SimRequest) -> None:
        self.queue.append((self.clock.now, req))
        self._dispatch()

    def _blocks(self, req: SimRequest) -> int:
        return -(-req.input_len // self.model.block_size)

    def _dispatch(self) -> None:
        while self.queue and self.idle:
            oldest = self.queue[0][0]
            if len(self.queue) < self.max_batch and self.clock.now < oldest + self.delay:
                if oldest + self.delay < self._timer_at:
                    self._timer_at = oldest + self.delay
                    self.clock.at(self._timer_at, self._on_timer)
                return
            # The instance with the most free blocks takes the batch.
            inst = max(self.idle, key=lambda i: self.pools[i].num_free)
            pool = self.pools[inst]
            batch: list[tuple[SimRequest, list[int]]] = []
            while self.queue and len(batch) < self.max_batch:
                need = self._blocks(self.queue[0][1])
                if not pool.can_allocate(need):
                    break
                batch.append((self.queue.popleft()[1], pool.allocate(need)))
            if not batch:
                return
            self.idle.remove(inst)
            seconds = self.model.prompt_pass([req.input_len for req, _ in batch])
            seconds = self.machine.step_seconds(self.units, seconds, 0.0)
            self.machine.begin(self.units)
            done_at = self.clock.now + seconds
            self.clock.at(done_at, partial(self._finish, inst, batch))

    def _on_timer(self) -> None:
        self._timer_at = math.inf
        self._dispatch()

    def _finish(self, inst: int, batch: list[tuple[SimRequest, list[int]]]) -> None:
        self.machine.end(self.units)
        self.idle.append(inst)
        for req, blocks in batch:
            self.on_done(req, partial(self._release, inst, blocks))
        self._dispatch()

    def _release(self, inst: int, blocks: list[int]) -> None:
        self.pools[inst].free(blocks)
        self._dispatch()
