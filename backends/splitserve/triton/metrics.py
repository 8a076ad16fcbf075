"""Custom metrics on Triton's metrics port, labelled by model and instance."""

from __future__ import annotations

import threading
import time
from typing import Any

import triton_python_backend_utils as pb_utils

from splitserve.kv.allocator import BlockAllocator
from splitserve.transport.base import KVTransport

GAUGES = {
    "splitserve_kv_blocks_used": "KV cache blocks in use (running requests and leases)",
    "splitserve_kv_blocks_free": "KV cache blocks free",
    "splitserve_leases_outstanding": "KV leases handed out by prefill and not yet released",
    "splitserve_requests_active": "Requests this instance is generating for",
    "splitserve_kv_handoff_recomputes": "Handed-over requests whose KV could not be pulled and "
    "was recomputed here (non-zero means the transport is failing)",
}


class InstanceMetrics:
    def __init__(
        self,
        args: dict[str, Any],
        allocator: BlockAllocator,
        transport: KVTransport | None = None,
        min_interval_s: float = 0.0,
    ) -> None:
        labels = {"model": args["model_name"], "instance": args["model_instance_name"]}
        # The families must outlive their metrics: a collected family makes ``set`` raise.
        self._families = {
            name: pb_utils.MetricFamily(
                name=name, description=text, kind=pb_utils.MetricFamily.GAUGE
            )
            for name, text in GAUGES.items()
        }
        self._gauges = {name: f.Metric(labels=labels) for name, f in self._families.items()}
        self.allocator = allocator
        self.transport = transport
        self.min_interval_s = min_interval_s
        self._last = 0.0
        self._values: dict[str, int] = {}

    def update(self, active: int = 0, handoff_recomputes: int = 0, force: bool = False) -> None:
        """Set the gauges whose values changed; each set is an IPC to the server."""
        now = time.monotonic()
        if not force and now - self._last < self.min_interval_s:
            return
        self._last = now
        values = {
            "splitserve_kv_blocks_used": self.allocator.num_used,
            "splitserve_kv_blocks_free": self.allocator.num_free,
            "splitserve_requests_active": active,
            "splitserve_kv_handoff_recomputes": handoff_recomputes,
        }
        if self.transport is not None:
            values["splitserve_leases_outstanding"] = self.transport.stats().get("outstanding", 0)
        for name, value in values.items():
            if self._values.get(name) != value:
                self._gauges[name].set(value)
                self._values[name] = value

    def close(self) -> None:
        """Drop the metric objects while the stub can still process their destructors: left to
        interpreter teardown, they are collected after the stub's IPC is gone and crash it."""
        self._gauges.clear()
        self._families.clear()


class MetricsRefresher:
    """Refreshes an instance's gauges on a thread of its own, for a model without an engine loop
    (``prefill``): its leases end off the request path, by release message or by expiry."""

    def __init__(self, metrics: InstanceMetrics, interval_s: float) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(metrics, interval_s), name="metrics", daemon=True
        )
        self._thread.start()

    def _run(self, metrics: InstanceMetrics, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            metrics.update(force=True)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
