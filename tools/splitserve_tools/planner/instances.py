"""Step models of the two kinds of instance the pipeline runs.

``PrefillPool``: the ``prefill`` model's instances behind Triton's dynamic batcher (one queue;
an idle instance takes up to ``max_batch_size`` requests once that many wait or the oldest has
waited ``queue_delay``). A request's KV stays on its prefill instance until decode pulls it;
its first token goes out from its decode instance, between two of that instance's steps.

``EngineInstance``: one ``Engine`` as the scheduler runs it (``llm`` in disagg, and
``llm_colocated``). Each step decodes every running request, admits handed-over requests (the
KV copy adds to the step), and prefills waiting prompts within ``max_num_batched_tokens`` (whole,
or in chunks); its time is the decode fit plus the prefill fit plus the handoffs plus the
per-token sending cost. When the pool cannot grow, the newest running request is preempted and
recomputed later. KV in blocks is approximated as ``tokens / block_size + 1/2`` per sequence.
Both stretch their steps by what the instances beside them cost (``Machine``).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from splitserve_tools.planner.events import Clock, SimRequest
from splitserve_tools.planner.fit import DecodeFit, HandoffFit, PrefillFit
from splitserve_tools.planner.machine import Machine
from splitserve_tools.planner.placement import Limits


@dataclass(frozen=True)
class StepModel:
    prefill: PrefillFit
    decode: DecodeFit
    handoff: HandoffFit
    kv_bytes_per_token: int
    block_size: int
    token_s: float

    def capacity_blocks(self, kv_cache_bytes: int) -> int:
        return max(1, kv_cache_bytes // (self.kv_bytes_per_token * self.block_size))

    def blocks(self, tokens: float, seqs: int) -> float:
        return tokens / self.block_size + 0.5 * seqs


class PrefillPool:
    def __init__(
        self,
        clock: Clock,
        machine: Machine,
        instances: int,
        units: int,
        model: StepModel,
        limits: Limits,
        on_done: Callable[[SimRequest], None],
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
        self.free = [model.capacity_blocks(limits.kv_cache_bytes)] * instances
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
            inst = max(self.idle, key=lambda i: self.free[i])
            batch: list[SimRequest] = []
            while self.queue and len(batch) < self.max_batch:
                need = self._blocks(self.queue[0][1])
                if need > self.free[inst]:
                    break
                self.free[inst] -= need
                batch.append(self.queue.popleft()[1])
            if not batch:
                return
            self.idle.remove(inst)
            tokens = sum(r.input_len for r in batch)
            sq = sum(r.input_len**2 for r in batch)
            seconds = self.machine.step_seconds(self.units, self.model.prefill(tokens, sq), 0.0)
            self.machine.begin(self.units)
            done_at = self.clock.now + seconds
            self.clock.at(done_at, lambda inst=inst, batch=batch: self._finish(inst, batch))

    def _on_timer(self) -> None:
        self._timer_at = math.inf
        self._dispatch()

    def _finish(self, inst: int, batch: list[SimRequest]) -> None:
        self.machine.end(self.units)
        self.idle.append(inst)
        for req in batch:
            req.computed = req.input_len
            blocks = self._blocks(req)
            req.release = lambda inst=inst, blocks=blocks: self._release(inst, blocks)
            self.on_done(req)
        self._dispatch()

    def _release(self, inst: int, blocks: int) -> None:
        self.free[inst] += blocks
        self._dispatch()


class EngineInstance:
    def __init__(
        self,
        clock: Clock,
        machine: Machine,
        units: int,
        model: StepModel,
        limits: Limits,
    ) -> None:
        self.clock = clock
        self.machine = machine
        self.units = units
        self.model = model
        self.limits = limits
        self.capacity = model.capacity_blocks(limits.kv_cache_bytes)
        self.waiting: deque[SimRequest] = deque()
        """Prompts to compute: new (colocated) or preempted ones."""
        self.arrived: deque[SimRequest] = deque()
        """Prefilled elsewhere, first token sent, KV not yet pulled."""
        self.announcing: list[SimRequest] = []
        """Prefilled elsewhere while a step ran: their first tokens go out when it ends."""
        self.decoding: dict[int, SimRequest] = {}
        """In join order: the last one is the newest."""
        self.prefilling: list[SimRequest] = []
        """Running, with part of the prompt still to compute (chunked prefill)."""
        self.step = 0
        self._ctx_base = 0
        """Sum over decoding requests of (tokens at join - step at join), kept per request in
        ``_contrib``: the batch's context at a step is ``base + batch·step``."""
        self._contrib: dict[int, int] = {}
        self._ends: list[tuple[int, int, int]] = []
        """(step at which the last token is sampled, idx, epoch)."""
        self.busy = False

    @property
    def context(self) -> int:
        return self._ctx_base + len(self.decoding) * self.step

    def _used_blocks(self, extra_tokens: int = 0, extra_seqs: int = 0) -> float:
        tokens = self.context + sum(r.computed for r in self.prefilling) + extra_tokens
        seqs = len(self.decoding) + len(self.prefilling) + extra_seqs
        return self.model.blocks(tokens, seqs)

    def add_prompt(self, req: SimRequest) -> None:
        self.waiting.append(req)
        self._kick()

    def add_prefilled(self, req: SimRequest) -> None:
        if self.busy:
            self.announcing.append(req)
            return
        self._announce(req)
        self._kick()

    def _announce(self, req: SimRequest) -> None:
        req.emit(self.clock.now)
        if not req.done:
            self.arrived.append(req)
        elif req.release is not None:
            req.release()
            req.release = None

    def _kick(self) -> None:
        if not self.busy and (self.waiting or self.arrived or self.decoding or self.prefilling):
            self._run_step()

    def _join(self, req: SimRequest) -> None:
        req.join_step = self.step
        self.decoding[req.idx] = req
        self._contrib[req.idx] = req.num_tokens - self.step
        self._ctx_base += self._contrib[req.idx]
        end = self.step + req.output_len - req.generated - 1
        heapq.heappush(self._ends, (end, req.idx, req.epoch))

    def _leave(self, req: SimRequest) -> None:
        del self.decoding[req.idx]
        self._ctx_base -= self._contrib.pop(req.idx)

    def _preempt_newest(self) -> None:
        victim = self.decoding[next(reversed(self.decoding))]
        self._leave(victim)
        victim.generated += self.step - victim.join_step
        victim.epoch += 1
        victim.computed = 0
        self.waiting.appendleft(victim)

    def _run_step(self) -> None:
        lim, m = self.limits, self.model
        decode_s = 0.0
        while self.decoding and self._used_blocks(len(self.decoding)) > self.capacity:
            self._preempt_newest()
        while self.arrived and len(self.decoding) + len(self.prefilling) < lim.max_num_seqs:
            req = self.arrived[0]
            if self._used_blocks(req.num_tokens + 1, 1) > self.capacity:
                break
            self.arrived.popleft()
            decode_s += m.handoff(req.input_len * m.kv_bytes_per_token)
            if req.release is not None:
                req.release()
                req.release = None
            self._join(req)
        batch = len(self.decoding)
        if batch:
            decode_s += m.decode(batch, self.context)
        chunks = self._schedule_prefills(lim.max_num_batched_tokens - batch)
        prefill_s = 0.0
        if chunks:
            tokens = sum(n for _, n in chunks)
            sq = sum(n * n + 2 * n * r.computed for r, n in chunks)
            prefill_s = m.prefill(tokens, sq)
        finishing = sum(1 for r, n in chunks if r.computed + n == r.num_tokens)
        decode_s += m.token_s * (batch + finishing)
        if not (batch or chunks):
            return
        seconds = self.machine.step_seconds(self.units, prefill_s, decode_s)
        self.machine.begin(self.units)
        self.busy = True
        self.clock.at(self.clock.now + seconds, lambda: self._end_step(chunks))

    def _schedule_prefills(self, budget: int) -> list[tuple[SimRequest, int]]:
        lim = self.limits
        chunks: list[tuple[SimRequest, int]] = []

        def take(req: SimRequest) -> int:
            remaining = req.num_tokens - req.computed
            if remaining > budget and not (lim.chunked_prefill or not chunks):
                return 0
            n = min(remaining, budget) if lim.chunked_prefill else remaining
            if n <= 0 or self._used_blocks(sum(c for _, c in chunks) + n) > self.capacity:
                return 0
            chunks.append((req, n))
            return n

        for req in self.prefilling:
            budget -= take(req)
        while self.waiting and budget > 0:
            if len(self.decoding) + len(self.prefilling) >= lim.max_num_seqs:
                break
            taken = take(self.waiting[0])
            if not taken:
                break
            self.prefilling.append(self.waiting.popleft())
            budget -= taken
        return chunks

    def _end_step(self, chunks: list[tuple[SimRequest, int]]) -> None:
        now = self.clock.now
        # Every decoding request sampled a token; those whose last token it was leave.
        while self._ends and self._ends[0][0] <= self.step:
            _, idx, epoch = heapq.heappop(self._ends)
            req = self.decoding.get(idx)
            if req is None or req.epoch != epoch:
                continue
            self._leave(req)
            req.generated = req.output_len
            req.last = now
        self.step += 1
        for req, n in chunks:
            req.computed += n
            if req.computed < req.num_tokens:
                continue
            self.prefilling.remove(req)
            req.emit(now)
            if not req.done:
                self._join(req)
        self.machine.end(self.units)
        self.busy = False
        for req in self.announcing:
            self._announce(req)
        self.announcing.clear()
        self._kick()
