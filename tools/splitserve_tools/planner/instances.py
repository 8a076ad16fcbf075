"""One engine instance (``llm`` in disagg, ``llm_colocated``) in simulated time.

It runs the engine's own ``Scheduler`` over a real ``BlockAllocator`` of the KV pool's blocks
(``simulate.pool_blocks``), and steps as ``Engine.step`` does: the scheduler picks the step's
decodes, handed-over requests whose KV it loads, and prompt chunks within the token budget
(preempting the newest request when the pool cannot grow); the cost runner (``StepModel``)
prices the step in place of the forward pass, stretched by what the instances beside it cost
(``Machine``); when the step ends, every scheduled request advances as the model runner would
have advanced it, samples a token where the engine would, and leaves once it has all its tokens.

A request prefilled elsewhere sends its first token between two steps, as ``llm`` applies a
handover in its engine loop, then waits in the scheduler until its KV can be pulled.
"""

from __future__ import annotations

from collections.abc import Callable

from splitserve.engine.prefix import PrefixCache, PrefixStats
from splitserve.engine.request import Request, Status
from splitserve.engine.scheduler import Scheduler, SchedulerLimits, SchedulerOutput
from splitserve.kv.allocator import BlockAllocator
from splitserve_tools.planner.events import SIM_KEY, TOKEN, Clock, SimRequest, engine_request
from splitserve_tools.planner.lending import Lending
from splitserve_tools.planner.machine import Machine
from splitserve_tools.planner.placement import Limits
from splitserve_tools.planner.prefill_pool import Release
from splitserve_tools.planner.step_model import StepModel


class HandedOverKV:
    """A prompt's KV on its prefill instance (the scheduler's ``KVSource``): loading it costs
    the loading step a handoff of the blocks pulled (those decode had cached are skipped), and
    either way the prefill instance gets its blocks back."""

    def __init__(
        self, on_load: Callable[[tuple[int, int]], None], prompt_blocks: int, release: Release
    ) -> None:
        self.on_load = on_load
        self.prompt_blocks = prompt_blocks
        self.release = release

    def load(self, dst_block_ids: list[int], skip: int = 0) -> None:
        self.on_load((len(dst_block_ids), self.prompt_blocks))
        self.release()

    def discard(self) -> None:
        self.release()


class EngineInstance:
    def __init__(
        self,
        clock: Clock,
        machine: Machine,
        units: int,
        model: StepModel,
        limits: Limits,
        kv_blocks: int,
        prefix_cache: bool = False,
    ) -> None:
        self.clock = clock
        self.machine = machine
        self.lending: Lending | None = None
        self.units = units
        self.model = model
        allocator = BlockAllocator(kv_blocks)
        self.prefix = PrefixCache(allocator, model.block_size, SIM_KEY) if prefix_cache else None
        self.scheduler = Scheduler(
            allocator,
            SchedulerLimits(
                block_size=model.block_size,
                max_num_seqs=limits.max_num_seqs,
                max_num_batched_tokens=limits.max_num_batched_tokens,
                chunked_prefill=limits.chunked_prefill,
                prefix_cache=prefix_cache,
            ),
            prefix=self.prefix,
        )
        self.sims: dict[Request, SimRequest] = {}
        """Every request in this engine, and the run's record of it."""
        self.handovers: list[tuple[SimRequest, Release]] = []
        """Prefilled elsewhere while a step ran: their first tokens go out when it ends."""
        self.loaded: list[tuple[int, int]] = []
        """(blocks pulled, blocks of the prompt) of each handed-over KV the step being
        scheduled loads."""
        self.busy = False

    def attach(self, lending: Lending) -> None:
        """A decode instance: the cores it shares with one prefill instance."""
        self.lending = lending
        lending.kick_decode = self._kick

    def add_prompt(self, sim: SimRequest) -> None:
        self.scheduler.add(self._request(sim))
        self._kick()

    def add_prefilled(self, sim: SimRequest, release: Release) -> None:
        if self.busy:  # applied between steps (also while a pass holds the cores: at its end)
            self.handovers.append((sim, release))
            return
        self._hand_over(sim, release)
        self._kick()

    @property
    def prefix_stats(self) -> PrefixStats:
        return PrefixStats() if self.prefix is None else self.prefix.stats

    def _request(self, sim: SimRequest) -> Request:
        req = engine_request(sim)
        self.sims[req] = sim
        return req

    def _hand_over(self, sim: SimRequest, release: Release) -> None:
        """``Engine.add_prefilled``: the prompt is cached elsewhere, its first token goes out."""
        req = self._request(sim)
        req.num_computed = sim.input_len
        if self._sample(req):
            release()
        else:
            blocks = -(-sim.input_len // self.model.block_size)
            self.scheduler.add_prefilled(req, HandedOverKV(self.loaded.append, blocks, release))

    def _sample(self, req: Request) -> bool:
        """One token of ``req`` goes out now; True if it was the last (``req`` is done)."""
        req.output_ids.append(TOKEN)
        finished = len(req.output_ids) >= req.params.max_tokens
        if finished:
            req.status = Status.FINISHED
            self.sims.pop(req).sent(self.clock.now, True)
        elif len(req.output_ids) == 1:
            self.sims[req].sent(self.clock.now, False)
        return finished

    def _kick(self) -> None:
        if self.busy or not self.scheduler.num_unfinished:
            return
        if self.lending is not None and not self.lending.may_step():
            return  # a prompt pass holds (or waits for) the cores: kicked when it ends
        self.loaded.clear()
        out = self.scheduler.schedule()
        if out.empty:
            return
        units = self.units
        prefill_s, decode_s = self.model.engine_step(out, self.loaded)
        if self.lending is not None:
            wide = self.lending.decode_wide
            faster = False
            if self.lending.prefill_lends():
                wide_prefill_s, wide_decode_s = wide.model.engine_step(out, self.loaded)
                faster = wide_prefill_s + wide_decode_s < prefill_s + decode_s
                if faster:
                    units, prefill_s, decode_s = wide.units, wide_prefill_s, wide_decode_s
            self.lending.step_started(faster)
        seconds = self.machine.step_seconds(units, prefill_s, decode_s)
        self.machine.begin(units)
        self.busy = True
        self.clock.at(self.clock.now + seconds, lambda: self._end_step(out, units))

    def _end_step(self, out: SchedulerOutput, units: int) -> None:
        """What ``Engine.step`` does once the forward pass is back: the KV is written (and its
        full blocks cached), then tokens are sampled."""
        for req in out.decodes:
            req.num_computed = req.num_tokens
        for req, n in out.prefills:
            req.num_computed += n
        if self.prefix is not None:
            for req in [*out.decodes, *(r for r, _ in out.prefills)]:
                self.prefix.commit(req)
        for req in out.decodes:
            if self._sample(req):
                self.scheduler.remove(req)
        for req, _ in out.prefills:
            if req.num_computed == req.num_tokens and self._sample(req):
                self.scheduler.remove(req)
        self.machine.end(units)
        self.busy = False
        for sim, release in self.handovers:
            self._hand_over(sim, release)
        self.handovers.clear()
        if self.lending is not None:  # a pass waiting for these cores starts first
            self.lending.step_ended(self.clock.now, len(self.scheduler.running))
        self._kick()
