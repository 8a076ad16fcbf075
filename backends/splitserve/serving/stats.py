"""Counts of one model instance, kept without Triton: admission, ends, latencies, errors.

Any thread records (request intake, the engine loop, the sender path); the metrics adapter
takes a ``Snapshot`` now and then and publishes it, so recording never costs an IPC.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from splitserve.engine.prefix import PrefixCache
from splitserve.kv.allocator import BlockAllocator

ERROR_KINDS = ("invalid", "unavailable", "internal", "cancelled")
"""How a request can end other than normally (``cancelled`` is the client's choice)."""

PREFIX = "splitserve_"
"""Of every metric name below, as it appears on the metrics port."""
GAUGES = {
    "kv_blocks_used": "KV cache blocks in use (running requests and leases)",
    "kv_blocks_free": "KV cache blocks free (cached ones included)",
    "kv_blocks_cached": "Of kv_blocks_free, blocks that keep a cached prefix's KV for later "
    "requests until the pool needs them",
    "leases_outstanding": "KV leases handed out by prefill and not yet released or expired",
    "requests_active": "Requests this instance's engine is generating for",
    "requests_running": "Requests in this instance's running batch",
    "queue_depth": "Requests accepted and not yet running (waiting for prefill, blocks, a slot)",
    "kv_handoff_failures": "Handed-over requests whose KV could not be pulled: recomputed here "
    "or ended with UNAVAILABLE, per kv_load_failure_policy (non-zero means the transport is "
    "failing)",
    "kv_blocks_quarantined": "KV blocks of failed pushes (kv_push) held out of the pool until "
    "no WRITE of prefill can still land in them",
    "engine_borrow_off_sizes": "Batch sizes (1-8, then power-of-two buckets) at which decode "
    "does not borrow prefill's idle cores, because its borrowed steps there were not faster "
    "than its own-core steps",
}
COUNTERS = {
    "leases_granted_total": "KV leases granted by prefill",
    "leases_released_total": "KV leases released by their reader",
    "leases_expired_total": "KV leases freed because nobody released them in time",
    "kv_handoffs_total": "KV handoffs pulled by this instance",
    "kv_handoff_bytes_total": "Bytes of KV pulled by this instance, as they crossed the "
    "transport (encoded, where kv_transfer_dtype is fp8)",
    "kv_handoff_fp8_bytes_total": "Of kv_handoff_bytes_total, the bytes that came fp8-encoded",
    "kv_handoff_seconds_total": "Seconds spent pulling KV",
    "kv_streamed_requests_total": "Handed-over requests whose KV this instance pulled layer by "
    "layer while their prompt pass ran (prefill servers with kv_stream_layers)",
    "kv_streamed_layers_total": "Layers of KV pulled as their prompt pass announced them",
    "kv_stream_wait_seconds_total": "Seconds streamed pulls waited for prefill to write the "
    "next layer (the pull had caught up with the pass; no decode step waits for it)",
    "kv_pushed_requests_total": "Handed-over requests whose KV prefill pushed into blocks "
    "this instance reserved (kv_push)",
    "kv_push_failures_total": "Pushed requests whose push failed or whose request ended "
    "before it was in",
    "kv_pushed_bytes_total": "Bytes of KV this prefill instance WRITEs into decode's blocks, "
    "as they cross the network",
    "kv_pushed_layers_total": "Layers of KV this prefill instance posted WRITEs for",
    "kv_push_post_seconds_total": "Seconds the prompt pass spent posting its pushes' WRITEs",
    "kv_pushes_sent_total": "Pushes this prefill instance finished (answered or failed)",
    "kv_push_wait_seconds_total": "Seconds this prefill's answers waited after their pass for "
    "their pushes' last WRITEs: what the transfer added to the request's wait",
    "kv_transfer_timeouts_total": "KV transfers over the network abandoned at their deadline "
    "(then kv_load_failure_policy applies)",
    "prefill_calls_total": "Calls of this decode instance to prefill (local or remote)",
    "prefill_routed_by_prefix_total": "Remote prefill calls sent to the server that was sent "
    "the longest run of their leading blocks (where their prefix is probably cached) rather "
    "than to the least loaded one",
    "prefill_failovers_total": "Remote prefill calls retried on another prefill server after "
    "the first one failed",
    "engine_steps_total": "Forward passes of this instance's engine (a decode step of its "
    "running batch, or a batch of prompts)",
    "engine_busy_seconds_total": "Seconds this instance's engine spent in forward passes; its "
    "rate is the fraction of time the engine is busy",
    "engine_cpu_seconds_total": "CPU seconds the engine's own thread used in those passes; "
    "busy seconds minus these is time it was runnable but not running (other threads on its "
    "cores) or waiting for its OpenMP workers",
    "engine_sampled_tokens_total": "Tokens sampled by this instance's forward passes; over "
    "engine_steps_total, the mean batch",
    "prefix_cache_queries_total": "Prompt tokens looked up in the prefix cache",
    "prefix_cache_hits_total": "Of those, tokens whose KV came from the cache (not computed)",
    "prefix_cache_evictions_total": "Cached blocks evicted to make room",
    "kv_handoff_blocks_pulled_total": "Blocks of handed-over prompts pulled from prefill",
    "kv_handoff_blocks_skipped_total": "Blocks of handed-over prompts not pulled: this "
    "instance had them in its prefix cache",
    "responses_sent_total": "Streamed responses sent; fewer than the tokens sampled where "
    "the sender thread fell behind a stream and sent its waiting tokens in one response",
    "sender_cpu_seconds_total": "CPU seconds of the thread that builds and sends responses",
    "engine_borrowed_steps_total": "Decode steps run with extra threads on cores lent by an "
    "idle prefill instance (core_lock)",
    "engine_borrow_withheld_steps_total": "Decode steps run on decode's own cores although "
    "prefill's were free: where borrowing did not pay, and probes that keep timing both",
    "prefill_borrowed_passes_total": "Prompt passes run with extra threads on cores lent by "
    "decode while its steps left room under its tpot_target_s (core_lock)",
    "prefill_borrow_withheld_passes_total": "Prompt passes run on prefill's own cores although "
    "decode offered its: where borrowing did not pay, and probes that keep timing both",
    "prefill_borrow_over_budget_passes_total": "Prompt passes kept on prefill's own cores "
    "although decode offered its: expected to outlast decode's budget",
    "engine_lent_steps_total": "Decode steps that waited for a prompt pass on decode's cores",
    "engine_lent_seconds_total": "Seconds decode's steps waited for prompt passes on its cores",
}
ERRORS = ("errors_total", "Requests ended with an error or cancelled, by kind")
HISTOGRAMS = {
    "ttft": (
        "ttft_seconds",
        "Time from request arrival to its first token",
        [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0],
    ),
    "tpot": (
        "tpot_seconds",
        "Mean time per output token after the first, per request",
        [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0],
    ),
    "step": (
        "engine_step_seconds",
        "Time of one forward pass of this instance's engine",
        [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5],
    ),
}


@dataclass
class Snapshot:
    gauges: dict[str, float] = field(default_factory=dict)
    counters: dict[str, float] = field(default_factory=dict)
    """Increments since the previous snapshot, by counter name."""
    errors: dict[str, int] = field(default_factory=dict)
    """Increments since the previous snapshot, by error kind."""
    observations: list[tuple[str, float]] = field(default_factory=list)
    """``(histogram name, value)`` recorded since the previous snapshot."""


class InstanceStats:
    """Thread-safe request accounting of one instance, with an optional queue bound.

    A request is *in flight* from ``admit`` until ``end``; the engine reports how many of them
    are ``running`` (scheduled in its batch); the rest are queued: waiting for prefill, for KV
    blocks or for a batch slot. ``max_queue`` > 0 bounds that queue.
    """

    def __init__(self, max_queue: int = 0) -> None:
        if max_queue < 0:
            raise ValueError("max_queue must be >= 0 (0: unbounded)")
        self.max_queue = max_queue
        self._lock = threading.Lock()
        self._in_flight = 0
        self._running = 0
        self._errors = dict.fromkeys(ERROR_KINDS, 0)
        self._observations: list[tuple[str, float]] = []
        self._totals: dict[str, float] = {}
        self._published: dict[str, float] = {}
        self._published_errors = dict.fromkeys(ERROR_KINDS, 0)

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def queued(self) -> int:
        return max(0, self._in_flight - self._running)

    def admit(self) -> bool:
        """Take a new request unless the queue is at its bound (then count it unavailable)."""
        with self._lock:
            if self.max_queue and self._in_flight - self._running >= self.max_queue:
                self._errors["unavailable"] += 1
                return False
            self._in_flight += 1
            return True

    def end(self, error_kind: str | None = None) -> None:
        """An admitted request sent its FINAL response; ``error_kind`` if it failed."""
        with self._lock:
            self._in_flight -= 1
            if error_kind is not None:
                self._errors[error_kind] += 1

    def error(self, kind: str) -> None:
        """A request rejected before admission (bad input)."""
        with self._lock:
            self._errors[kind] += 1

    def set_running(self, running: int) -> None:
        self._running = running

    def observe(self, histogram: str, value: float) -> None:
        with self._lock:
            self._observations.append((histogram, value))

    def first_token(self, arrival: float, now: float) -> None:
        self.observe("ttft", now - arrival)

    def finished(self, first_token_at: float, now: float, num_output_tokens: int) -> None:
        if num_output_tokens > 1:
            self.observe("tpot", (now - first_token_at) / (num_output_tokens - 1))

    def step(self, seconds: float, sampled_tokens: int, cpu_seconds: float) -> None:
        """The engine ran one forward pass of ``seconds``, ``cpu_seconds`` of them on its
        thread's CPU time, which sampled ``sampled_tokens`` tokens."""
        with self._lock:
            self._observations.append(("step", seconds))
            for name, value in (
                ("engine_steps_total", 1.0),
                ("engine_busy_seconds_total", seconds),
                ("engine_cpu_seconds_total", cpu_seconds),
                ("engine_sampled_tokens_total", float(sampled_tokens)),
            ):
                self._totals[name] = self._totals.get(name, 0.0) + value

    def set_total(self, name: str, value: float) -> None:
        """A cumulative count kept elsewhere (a transport's); published as a counter."""
        with self._lock:
            self._totals[name] = value

    def snapshot(self, gauges: dict[str, float]) -> Snapshot:
        """``gauges`` plus everything recorded since the last snapshot."""
        with self._lock:
            counters = {
                name: value - self._published.get(name, 0.0)
                for name, value in self._totals.items()
                if value != self._published.get(name, 0.0)
            }
            self._published.update(self._totals)
            errors = {
                kind: n - self._published_errors[kind]
                for kind, n in self._errors.items()
                if n != self._published_errors[kind]
            }
            self._published_errors.update(self._errors)
            observations, self._observations = self._observations, []
            queue = {"queue_depth": max(0, self._in_flight - self._running)}
        return Snapshot({**queue, **gauges}, counters, errors, observations)


TRANSPORT_COUNTERS = {
    "granted": ("leases_granted_total", 1.0),
    "released": ("leases_released_total", 1.0),
    "expired": ("leases_expired_total", 1.0),
    "fetches": ("kv_handoffs_total", 1.0),
    "fetched_bytes": ("kv_handoff_bytes_total", 1.0),
    "fetched_fp8_bytes": ("kv_handoff_fp8_bytes_total", 1.0),
    "fetch_ns": ("kv_handoff_seconds_total", 1e-9),
    "transfer_timeouts": ("kv_transfer_timeouts_total", 1.0),
    "streamed_requests": ("kv_streamed_requests_total", 1.0),
    "streamed_layers": ("kv_streamed_layers_total", 1.0),
    "stream_wait_ns": ("kv_stream_wait_seconds_total", 1e-9),
    "pushes": ("kv_pushed_requests_total", 1.0),
    "push_failures": ("kv_push_failures_total", 1.0),
    "pushed_bytes": ("kv_pushed_bytes_total", 1.0),
    "pushed_layers": ("kv_pushed_layers_total", 1.0),
    "push_ns": ("kv_push_post_seconds_total", 1e-9),
    "pushes_sent": ("kv_pushes_sent_total", 1.0),
    "push_wait_ns": ("kv_push_wait_seconds_total", 1e-9),
    "prefill_calls": ("prefill_calls_total", 1.0),
    "prefill_failovers": ("prefill_failovers_total", 1.0),
    "prefill_routed_by_prefix": ("prefill_routed_by_prefix_total", 1.0),
}
"""``KVTransport.stats()`` key -> (counter name, scale)."""


def record_kv_pool(
    stats: InstanceStats, allocator: BlockAllocator, prefix: PrefixCache | None
) -> dict[str, float]:
    """Hand the pool's cumulative prefix-cache counts to ``stats``; returns its block gauges."""
    if prefix is not None:
        stats.set_total("prefix_cache_queries_total", prefix.stats.queries)
        stats.set_total("prefix_cache_hits_total", prefix.stats.hits)
        stats.set_total("kv_handoff_blocks_pulled_total", prefix.stats.blocks_pulled)
        stats.set_total("kv_handoff_blocks_skipped_total", prefix.stats.blocks_skipped)
    stats.set_total("prefix_cache_evictions_total", allocator.num_evictions)
    return {
        "kv_blocks_used": allocator.num_used,
        "kv_blocks_free": allocator.num_free,
        "kv_blocks_cached": allocator.num_cached_free,
    }


def record_transport(stats: InstanceStats, counts: dict[str, int]) -> dict[str, float]:
    """Hand a transport's cumulative counts to ``stats``; returns its lease gauges."""
    for key, (name, scale) in TRANSPORT_COUNTERS.items():
        if key in counts:
            stats.set_total(name, counts[key] * scale)
    gauges = {"leases_outstanding": float(counts.get("outstanding", 0))}
    if "quarantined_blocks" in counts:
        gauges["kv_blocks_quarantined"] = float(counts["quarantined_blocks"])
    return gauges
