"""What ``llm`` and ``llm_colocated`` share: an engine loop, a sender thread, request intake."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import uuid
from concurrent.futures import Executor
from contextlib import ExitStack
from typing import Any

import triton_python_backend_utils as pb_utils

from splitserve.engine.build import Components, build_components, scheduler_limits
from splitserve.engine.engine import Engine
from splitserve.kv.pool import KVPool
from splitserve.serving.affinity import allowed_cores
from splitserve.serving.core_lend import Borrower, borrower_for
from splitserve.serving.decode_lend import DecodeCores, Lender, LendPolicy
from splitserve.serving.drain import MESSAGE as DRAIN_MESSAGE
from splitserve.serving.drain import DrainWatch
from splitserve.serving.frontend import Prepared, prepare
from splitserve.serving.inputs import InputError
from splitserve.serving.loop import EngineLoop
from splitserve.serving.serving_config import ServingConfig
from splitserve.serving.stats import InstanceStats, record_kv_pool, record_transport
from splitserve.serving.threads import on_own_thread
from splitserve.triton.metrics import InstanceMetrics, MetricsRefresher
from splitserve.triton.setup import setup_instance
from splitserve.triton.sink import SenderThread, TritonSink
from splitserve.triton.tensors import FINAL, error_response, instance_index, request_inputs

log = logging.getLogger(__name__)


class GenerateModelBase:
    """A decoupled model that streams generated text from one engine loop per instance."""

    role = ""

    def initialize(self, args: dict[str, Any]) -> None:
        stub_cores = allowed_cores()
        self.cfg: ServingConfig = setup_instance(args, self.role)
        self.instance_name = args["model_instance_name"]
        # CUDA's current device is per thread, and setup_instance set it on this one.
        gpu = self.cfg.engine.device.startswith("cuda")
        engine = self._build_engine() if gpu else on_own_thread(self._build_engine)
        self.stats = InstanceStats(self.cfg.max_queue)
        self.metrics = InstanceMetrics(args, self.stats, self._gauges)
        self.drain_watch = DrainWatch()
        engine_cores = self.cfg.cores_for(instance_index(args)) or set()
        self.borrower: Borrower | None = None
        if self.cfg.core_lock and self.cfg.lent_cores:
            self.borrower = borrower_for(
                self.cfg.core_lock, engine_cores, self.cfg.lent_core_set, stub_cores
            )
        self.lender: Lender | None = None
        if self.cfg.lend_cores:
            policy = LendPolicy(self.cfg.tpot_target_s)
            self.lender = Lender(DecodeCores(self.cfg.core_lock), policy)
        self.loop = EngineLoop(
            engine,
            self.cfg.cancel_poll_s,
            name=f"{self.role}-engine",
            after_step=self._after_step,
            on_step=self.stats.step,
            around_step=self._around_step if self.borrower or self.lender else None,
        )
        self.loop.start()
        # The engine loop (and its OpenMP team) keeps the instance's cores. The threads made from
        # here on (response sender, request intake) mostly move bytes and wake often: they run
        # on the stub's other cores where it has any, since the scheduler wakes a thread beside
        # its waker and would put them on the engine's cores (BENCHMARKS.md, "Helper threads").
        os.sched_setaffinity(0, (stub_cores - engine_cores) or stub_cores)
        self.sender = SenderThread()
        # Publishing is an IPC per value (one per step for the step histogram): off the engine
        # thread, where it stalled a decode step every metrics interval.
        self.refresher = MetricsRefresher(self.metrics, self.cfg.metrics_interval_s)

    def _build_engine(self) -> Engine:
        """Everything that runs torch ops before serving; on a thread of its own, so that the
        engine loop's OpenMP team is the process's only one (``serving.threads``)."""
        self.parts: Components = build_components(self.cfg.engine)
        pool = self.make_pool()
        return Engine(
            self.parts.model,
            pool,
            self.parts.tokenizer,
            dataclasses.replace(
                scheduler_limits(self.cfg.engine),
                on_handoff_failure=self.cfg.kv_load_failure_policy,
            ),
            self.parts.max_model_len,
            puller=self.make_puller(),
        )

    def make_pool(self) -> KVPool:
        return self.parts.new_pool()

    def make_puller(self) -> Executor | None:
        """Where handed-over KV is loaded, if not on the engine thread (``Scheduler``)."""
        return None

    def transport_counts(self) -> dict[str, int]:
        """Cumulative counts of this instance's KV transport, if it has one."""
        return {}

    def _around_step(self, size: int) -> ExitStack:
        """Decode's cores held for the step (when it lends them to prefill's passes), and
        prefill's borrowed for it (when prefill lends them and is idle)."""
        stack = ExitStack()
        if self.lender is not None:
            stack.enter_context(self.lender.step())
        if self.borrower is not None:
            stack.enter_context(self.borrower.step(size))
        return stack

    def _after_step(self, loop: EngineLoop) -> None:
        if not loop.draining and self.drain_watch.requested():
            log.info("%s: draining, the server is stopping", self.instance_name)
            loop.drain(DRAIN_MESSAGE)
        running = len(loop.engine.scheduler.running)
        self.stats.set_running(running)
        if self.lender is not None:
            self.lender.update(running)

    def _gauges(self) -> dict[str, float]:
        """Read on the metrics thread: sizes and counts that the engine thread updates."""
        scheduler = self.loop.engine.scheduler
        gauges = {
            **record_kv_pool(self.stats, scheduler.allocator, scheduler.prefix),
            "requests_active": self.loop.num_active,
            "requests_running": len(scheduler.running),
            "kv_handoff_failures": scheduler.num_handoff_failures,
            **record_transport(self.stats, self.transport_counts()),
        }
        self.stats.set_total("responses_sent_total", self.sender.sent)
        self.stats.set_total("sender_cpu_seconds_total", self.sender.cpu_s)
        if self.borrower is not None:
            guard = self.borrower.guard
            self.stats.set_total("engine_borrowed_steps_total", self.borrower.borrowed_steps)
            self.stats.set_total("engine_borrow_withheld_steps_total", guard.withheld_steps)
            gauges["engine_borrow_off_sizes"] = len(guard.off_buckets)
        if self.lender is not None:
            self.stats.set_total("engine_lent_steps_total", self.lender.waited_steps)
            self.stats.set_total("engine_lent_seconds_total", self.lender.waited_s)
        return gauges

    def _refusal(self) -> str | None:
        """Why a valid request cannot be taken now (counted as ``unavailable``), or None."""
        if self.loop.draining:
            self.stats.error("unavailable")
            return DRAIN_MESSAGE
        if not self.stats.admit():
            return (
                f"server busy: {self.stats.queued} requests queued on "
                f"{self.instance_name} (max_queue {self.cfg.max_queue}); retry later"
            )
        return None

    def intake(self, request: Any) -> tuple[Prepared, TritonSink, str] | None:
        """Parse, validate and admit. On bad input answer INVALID_ARG + FINAL; on a full queue
        or while draining UNAVAILABLE + FINAL; then return None."""
        arrival = time.monotonic()
        sender = request.get_response_sender()
        try:
            prep = prepare(
                request_inputs(request),
                self.parts.tokenizer,
                self.parts.max_model_len,
                self.cfg.default_max_tokens,
                self.cfg.request_timeout_s,
                arrival,
            )
        except InputError as exc:
            self.stats.error("invalid")
            sender.send(error_response(str(exc)), flags=FINAL)
            return None
        refusal = self._refusal()
        if refusal is not None:
            sender.send(error_response(refusal, pb_utils.TritonError.UNAVAILABLE), flags=FINAL)
            return None
        sink = TritonSink(sender, prep.gen, self.sender, self.stats, arrival)
        return prep, sink, uuid.uuid4().hex

    def finalize(self) -> None:
        self.refresher.stop()
        self.loop.stop()
        if self.lender is not None:
            self.lender.cores.close()
        self.sender.stop()
        self.metrics.close()
        log.info("%s finalized", self.role)


__all__ = ["FINAL", "GenerateModelBase", "pb_utils"]
