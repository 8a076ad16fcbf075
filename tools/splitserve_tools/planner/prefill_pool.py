"""The ``prefill`` model's instances behind Triton's dynamic batcher, in simulated time.

One queue: an idle instance takes up to ``max_batch_size`` requests once that many wait or the
oldest has waited ``queue_delay``. Each instance's KV pool is a real ``BlockAllocator``; a
prompt's blocks stay allocated after its pass (leased to its decode
instance) until decode pulls or discards them, so a full pool stalls prefill. With prefix
caching, each instance runs the engine's ``PrefixCache`` as ``PrefillEngine`` does: a prompt
starts from its longest cached prefix, whose tokens its pass does not compute.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from functools import partial

from splitserve.engine.prefix import PrefixCache, PrefixStats
from splitserve.engine.request import Request
from splitserve.kv.allocator import BlockAllocator
from splitserve_tools.planner.events import SIM_KEY, Clock, SimRequest, engine_request
from splitserve_tools.planner.lending import Lending
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
        prefix_cache: bool = False,
        lending: Lending | None = None,
    ) -> None:
        """``lending``: with one instance, the cores it shares with one decode instance."""
        self.clock = clock
        self.lending = lending
        self.machine = machine
        self.units = units
        self.model = model
        self.max_batch = limits.prefill_max_batch_size
        self.delay = limits.prefill_queue_delay_s
        self.on_done = on_done
        self.queue: deque[tuple[float, SimRequest]] = deque()
        self.idle = list(range(instances))
        self.pools = [BlockAllocator(kv_blocks) for _ in range(instances)]
        self.caches = [
            PrefixCache(pool, model.block_size, SIM_KEY) if prefix_cache else None
            for pool in self.pools
        ]
        self._timer_at = math.inf

    @property
    def prefix_stats(self) -> PrefixStats:
        return PrefixStats.total(c.stats for c in self.caches if c is not None)

    def submit(self, req: SimRequest) -> None:
        self.queue.append((self.clock.now, req))
        self._dispatch()

    def _take(self, inst: int, sim: SimRequest) -> Request | None:
        """``sim``'s prompt blocks on instance ``inst`` (``PrefillEngine.allocate``): its cached
        prefix's, then new ones; None, holding nothing, if they do not fit."""
        pool, cache = self.pools[inst], self.caches[inst]
        req = engine_request(sim)
        if cache is not None:
            cache.attach(req)
        need = -(-sim.input_len // self.model.block_size) - len(req.block_ids)
        if not pool.can_allocate(need):
            pool.free(req.block_ids)
            return None
        if cache is not None:
            cache.count(req)
        req.block_ids += pool.allocate(need)
        return req

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
            batch: list[tuple[SimRequest, Request]] = []
            while self.queue and len(batch) < self.max_batch:
                req = self._take(inst, self.queue[0][1])
                if req is None:
                    break
                batch.append((self.queue.popleft()[1], req))
            if not batch:
                return
            self.idle.remove(inst)
            start = partial(self._start, inst, batch)
            if self.lending is None:
                start(False)
            else:
                wide_s = self._pass_s(self.lending.prefill_wide.model, batch)
                self.lending.start_pass(self.clock.now, wide_s, start)

    @staticmethod
    def _pass_s(model: StepModel, batch: list[tuple[SimRequest, Request]]) -> float:
        lengths = [sim.input_len for sim, _ in batch]
        return model.prompt_pass(lengths, [req.num_computed for _, req in batch])

    def _start(self, inst: int, batch: list[tuple[SimRequest, Request]], wide: bool) -> None:
        """The pass of ``batch`` starts now, on the decode instance's cores too if ``wide``."""
        model, units = self.model, self.units
        if wide:
            assert self.lending is not None
            model, units = self.lending.prefill_wide.model, self.lending.prefill_wide.units
        seconds = self.machine.step_seconds(units, self._pass_s(model, batch), 0.0)
        self.machine.begin(units)
        self.clock.at(self.clock.now + seconds, partial(self._finish, inst, batch, units))

    def _on_timer(self) -> None:
        self._timer_at = math.inf
        self._dispatch()

    def _finish(self, inst: int, batch: list[tuple[SimRequest, Request]], units: int) -> None:
        self.machine.end(units)
        self.idle.append(inst)
        cache = self.caches[inst]
        for sim, req in batch:
            if cache is not None:
                cache.commit(req, sim.input_len)
            self.on_done(sim, partial(self._release, inst, req.block_ids))
        if self.lending is not None:  # after the handovers: decode applies them, then steps
            self.lending.pass_ended()
        self._dispatch()

    def _release(self, inst: int, blocks: list[int]) -> None:
        self.pools[inst].free(blocks)
        self._dispatch()
