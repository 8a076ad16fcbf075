"""Continuous batching: which requests run this step, and the KV blocks they need.

Running requests decode one token per step. Waiting requests are prefilled (whole, or in chunks
when ``chunked_prefill`` is on) within a token budget. Requests whose KV was computed elsewhere
wait in ``arrived`` until blocks are free, then their KV is loaded and they join the batch.
When a running request needs a block and none is free, the newest running request is preempted:
its blocks are freed and it is recomputed later from its tokens. A handed-over request whose KV
cannot be loaded (its lease expired, its owner is gone, the transfer missed its deadline) is
recomputed the same way, or ends with an error (``on_handoff_failure="fail"``: a decode server
whose cores are sized for decode, where a prompt pass would stall every running stream).

With a ``puller`` (an executor), loads run on it instead of in ``schedule``: the request waits
in ``pulling`` with its blocks reserved while the batch keeps stepping, and joins it at the first
``schedule`` after its load ended. A pull over a network takes up to a transfer deadline; on the
engine thread it would stall every running stream that long. A request dropped mid-pull keeps
its blocks until the pull ends (its bytes may still be landing).

A streamed source (``StreamedSource``) is handed over while its prompt pass still runs: it pulls
layers as they are written, on the puller, and its request has no first token yet. It joins
the batch once its pull ended and its first token arrived (``Engine.first_token``); removed
mid-pull, the source is cancelled (no further read) and the blocks wait for its last read.
A streamed source whose KV must come into other blocks (a push whose prefill server failed:
that server may write on into the first ones) ends its load with ``LoadAgain``: the request
waits for blocks again, and ``start`` is called once more with new ones.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Executor, Future, wait
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from splitserve.engine.prefix import PrefixCache
from splitserve.engine.request import Request, Status
from splitserve.kv.allocator import BlockAllocator, BlocksStillWritten

log = logging.getLogger(__name__)


class KVSource(Protocol):
    """Where a handed-over request's KV lives until it is copied into this pool."""

    def load(self, dst_block_ids: list[int], skip: int = 0) -> None:
        """Copy the KV, all but its first ``skip`` blocks (cached here), into these local
        blocks, then let the owner free its copy."""

    def discard(self) -> None:
        """The request ended before loading: let the owner free its copy."""


@runtime_checkable
class StreamedSource(Protocol):
    """KV still being written elsewhere, pulled as it is (``serving.layer_stream``)."""

    def start(self, dst_block_ids: list[int], puller: Executor, skip: int = 0) -> Future[None]:
        """Pull all but the first ``skip`` blocks (cached here) into these local blocks on
        ``puller``; the future ends when all are in (then the owner may free its copy) or
        with the error that stopped the pull."""

    def cancel(self) -> None:
        """The request ended mid-pull: post no further read."""

    def discard(self) -> None:
        """The request ended before its pull started: let the owner free its copy."""


class LoadAgain(BlocksStillWritten):
    """A streamed load that starts over in other blocks; ``block_ids`` stay with the
    transport (they may still be written)."""


@dataclass
class SchedulerOutput:
    decodes: list[Request] = field(default_factory=list)
    prefills: list[tuple[Request, int]] = field(default_factory=list)
    """Requests to prefill and how many of their uncached tokens to compute this step."""

    @property
    def empty(self) -> bool:
        return not (self.decodes or self.prefills)


@dataclass(frozen=True)
class SchedulerLimits:
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    chunked_prefill: bool = False
    prefix_cache: bool = False
    """Reuse the KV of cached prompt prefixes (``engine.prefix``)."""
    on_handoff_failure: str = "recompute"
    """``recompute`` the prompt of a handed-over request whose KV cannot be loaded, or
    ``fail`` it (it then appears in ``Scheduler.failed``)."""

    def __post_init__(self) -> None:
        if self.on_handoff_failure not in HANDOFF_FAILURE_POLICIES:
            raise ValueError(
                f"on_handoff_failure must be one of {HANDOFF_FAILURE_POLICIES}, "
                f"got {self.on_handoff_failure!r}"
            )


HANDOFF_FAILURE_POLICIES = ("recompute", "fail")
TOKEN_WAIT_S = 0.001
"""The pause of a step whose only work is streamed requests waiting for their first token."""


class Scheduler:
    def __init__(
        self,
        allocator: BlockAllocator,
        limits: SchedulerLimits,
        puller: Executor | None = None,
        prefix: PrefixCache | None = None,
    ) -> None:
        self.allocator = allocator
        self.limits = limits
        self.puller = puller
        self.prefix = prefix
        """Prefix caching: requests that compute their prompt here start from its longest
        cached prefix; None: off."""
        self.waiting: deque[Request] = deque()
        self.arrived: deque[tuple[Request, KVSource | StreamedSource]] = deque()
        self.pulling: list[tuple[Request, Future[None], KVSource | StreamedSource]] = []
        """Handed-over requests whose KV the puller is loading into their reserved blocks."""
        self._dropped: list[tuple[Request, Future[None], KVSource | StreamedSource]] = []
        """Requests removed mid-pull: their blocks are freed once the pull ends."""
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.num_handoff_failures = 0
        self.failed: list[tuple[Request, str]] = []
        """Handed-over requests ended by a failed load (policy ``fail``) and why; taken by the
        engine after each ``schedule``."""

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.arrived) + len(self.pulling) + len(self.running)

    @property
    def pulls_outstanding(self) -> bool:
        """Loads still running on the puller (of live or dropped requests)."""
        return bool(self.pulling or self._dropped)

    def wait_for_pulls(self, timeout_s: float) -> None:
        """Block until a load ends or ``timeout_s`` passed (a step with nothing else to do);
        with every load ended (streamed requests waiting for their first token), a short
        pause."""
        futures = [f for _, f, _ in self.pulling + self._dropped if not f.done()]
        if futures:
            wait(futures, timeout=timeout_s, return_when=FIRST_COMPLETED)
        else:
            time.sleep(min(timeout_s, TOKEN_WAIT_S))

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def add_prefilled(self, req: Request, source: KVSource | StreamedSource) -> None:
        """``req`` has ``num_computed`` prompt tokens cached elsewhere and one sampled token
        (a streamed source: none yet)."""
        if isinstance(source, StreamedSource) and self.puller is None:
            raise ValueError("a streamed KV source needs a scheduler with a puller")
        self.arrived.append((req, source))

    def is_handed_over(self, req: Request) -> bool:
        """``req`` waits for its KV from elsewhere (queued for, or in, its pull)."""
        return any(r is req for r, _ in self.arrived) or any(p[0] is req for p in self.pulling)

    def _blocks_needed(self, req: Request, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.limits.block_size) - len(req.block_ids))

    def _grow(self, req: Request, num_tokens: int) -> bool:
        need = self._blocks_needed(req, num_tokens)
        if not self.allocator.can_allocate(need):
            return False
        req.block_ids += self.allocator.allocate(need)
        return True

    def remove(self, req: Request) -> None:
        """Take ``req`` out of whichever queue holds it and free its blocks (mid-pull: once
        the pull ends)."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        elif (pull := next((p for p in self.pulling if p[0] is req), None)) is not None:
            self.pulling.remove(pull)
            self._dropped.append(pull)
            if isinstance(pull[2], StreamedSource):
                pull[2].cancel()
            return
        else:
            for item in self.arrived:
                if item[0] is req:
                    self.arrived.remove(item)
                    item[1].discard()
                    break
        self.free(req)

    def free(self, req: Request) -> None:
        if req.block_ids:
            self.allocator.free(req.block_ids)
            req.block_ids = []
        req.num_cached_blocks = 0

    def _preempt(self, victim: Request) -> None:
        self.num_preemptions += 1
        self.running.remove(victim)
        self.free(victim)
        victim.num_computed = 0
        victim.status = Status.WAITING
        self.waiting.appendleft(victim)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self._schedule_decodes(out)
        self._settle_pulls(out)
        self._admit_arrived(out)
        self._schedule_prefills(out)
        return out

    def _schedule_decodes(self, out: SchedulerOutput) -> None:
        for req in list(self.running):
            if req not in self.running or not req.is_decoding:
                continue
            while not self._grow(req, req.num_tokens):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is req:
                    break
            else:
                out.decodes.append(req)

    def _admit_arrived(self, out: SchedulerOutput) -> None:
        while self.arrived and len(self.running) + len(self.pulling) < self.limits.max_num_seqs:
            req, source = self.arrived[0]
            # Blocks of the prompt that this pool has cached are not pulled.
            skip = self.prefix.attach_arrived(req) if self.prefix is not None else 0
            # A streamed request's first token comes later: its slot is reserved now.
            if not self._grow(req, req.num_tokens + (not req.output_ids)):
                self.free(req)  # the cached blocks it took, if any
                break
            self.arrived.popleft()
            if self.prefix is not None:
                self.prefix.count_arrived(req, skip)
            dst = req.block_ids[skip : -(-req.num_computed // self.limits.block_size)]
            if isinstance(source, StreamedSource):
                assert self.puller is not None  # add_prefilled checked it
                self.pulling.append((req, source.start(dst, self.puller, skip), source))
                continue
            if self.puller is not None:
                self.pulling.append((req, self.puller.submit(source.load, dst, skip), source))
                continue
            try:
                source.load(dst, skip)
            except Exception as exc:
                self._load_failed(req, exc)
                continue
            self._join(req, out)

    def _settle_pulls(self, out: SchedulerOutput) -> None:
        for item in [p for p in self.pulling if p[1].done()]:
            req, done, _ = item
            exc = done.exception()
            if exc is None and not req.output_ids:
                continue  # streamed: its first token has not arrived yet
            self.pulling.remove(item)
            if isinstance(exc, LoadAgain):
                self._drop_held(req, exc)
                self.free(req)
                self.arrived.appendleft((req, item[2]))
            elif exc is not None:
                self._load_failed(req, exc)
            else:
                self._join(req, out)
        for item in [p for p in self._dropped if p[1].done()]:
            self._dropped.remove(item)
            self._drop_held(item[0], item[1].exception())
            self.free(item[0])

    def _join(self, req: Request, out: SchedulerOutput) -> None:
        if self.prefix is not None:
            self.prefix.commit(req)  # its handed-over prompt KV is in
        req.status = Status.RUNNING
        self.running.append(req)
        out.decodes.append(req)

    @staticmethod
    def _drop_held(req: Request, exc: BaseException | None) -> None:
        """Leave out the blocks a transport still holds (an abandoned network read)."""
        if isinstance(exc, BlocksStillWritten):
            held = set(exc.block_ids)
            req.block_ids = [b for b in req.block_ids if b not in held]

    def _load_failed(self, req: Request, exc: BaseException) -> None:
        self.num_handoff_failures += 1
        fail = self.limits.on_handoff_failure == "fail"
        log.warning(
            "KV handoff of %s failed; %s",
            req.request_id,
            "ending it" if fail else "recomputing its prompt",
            exc_info=exc,
        )
        self._drop_held(req, exc)
        self.free(req)
        if fail:
            req.status = Status.FINISHED
            req.finish_reason = "error"
            self.failed.append((req, f"the prompt's KV could not be pulled: {exc}"))
        else:
            req.num_computed = 0
            self.waiting.appendleft(req)

    def _schedule_prefills(self, out: SchedulerOutput) -> None:
        budget = self.limits.max_num_batched_tokens - len(out.decodes)
        for req in self.running:
            if not req.is_decoding and req.num_computed < req.num_tokens:
                budget -= self._add_prefill(out, req, budget)
        while self.waiting and budget > 0 and len(self.running) < self.limits.max_num_seqs:
            req = self.waiting[0]
            taken = self._add_prefill(out, req, budget)
            if not taken:
                break
            self.waiting.popleft()
            req.status = Status.RUNNING
            self.running.append(req)
            budget -= taken

    def _add_prefill(self, out: SchedulerOutput, req: Request, budget: int) -> int:
        # A request starting its prompt takes the cached part first.
        prefix = self.prefix if not req.block_ids and req.num_computed == 0 else None
        if prefix is not None:
            prefix.attach(req)
        chunk = self._prefill_chunk(out, req, budget)
        if prefix is not None:
            if chunk:
                prefix.count(req)
            else:
                self.free(req)  # what attach gave it
                req.num_computed = 0
        if chunk:
            out.prefills.append((req, chunk))
        return chunk

    def _prefill_chunk(self, out: SchedulerOutput, req: Request, budget: int) -> int:
        """How many of ``req``'s uncached tokens fit this step (its blocks grown for them)."""
        remaining = req.num_tokens - req.num_computed
        if remaining > budget and not (self.limits.chunked_prefill or not out.prefills):
            return 0
        chunk = min(remaining, budget) if self.limits.chunked_prefill else remaining
        if chunk <= 0 or not self._grow(req, req.num_computed + chunk):
            return 0
        return chunk
