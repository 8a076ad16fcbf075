"""Custom metrics on Triton's metrics port, labelled by model and instance.

Values are recorded in a ``serving.stats.InstanceStats`` and published by a ``MetricsRefresher``
thread every ``metrics_interval_s``: each ``set``, ``increment`` or ``observe`` is an IPC to the
server, which on an engine thread would stall its steps.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import triton_python_backend_utils as pb_utils

from splitserve.serving.stats import (
    COUNTERS,
    ERROR_KINDS,
    ERRORS,
    GAUGES,
    HISTOGRAMS,
    PREFIX,
    InstanceStats,
    Snapshot,
)


class InstanceMetrics:
    def __init__(
        self,
        args: dict[str, Any],
        stats: InstanceStats,
        gauges: Callable[[], dict[str, float]],
    ) -> None:
        """``gauges`` returns the instance's current gauge values (names of ``GAUGES``)."""
        labels = {"model": args["model_name"], "instance": args["model_instance_name"]}
        kind = pb_utils.MetricFamily
        # The families must outlive their metrics: a collected family makes ``set`` raise.
        self._families: list[Any] = []
        self._gauges = {
            name: self._family(name, text, kind.GAUGE).Metric(labels=labels)
            for name, text in GAUGES.items()
        }
        self._counters = {
            name: self._family(name, text, kind.COUNTER).Metric(labels=labels)
            for name, text in COUNTERS.items()
        }
        errors = self._family(*ERRORS, kind.COUNTER)
        self._errors = {k: errors.Metric(labels={**labels, "kind": k}) for k in ERROR_KINDS}
        self._histograms = {
            key: self._family(name, text, kind.HISTOGRAM).Metric(labels=labels, buckets=buckets)
            for key, (name, text, buckets) in HISTOGRAMS.items()
        }
        self.stats = stats
        self._read_gauges = gauges
        self._values: dict[str, float] = {}

    def _family(self, name: str, text: str, kind: Any) -> Any:
        family = pb_utils.MetricFamily(name=PREFIX + name, description=text, kind=kind)
        self._families.append(family)
        return family

    def update(self) -> None:
        self._publish(self.stats.snapshot(self._read_gauges()))

    def _publish(self, snap: Snapshot) -> None:
        for name, value in snap.gauges.items():
            if self._values.get(name) != value:
                self._gauges[name].set(value)
                self._values[name] = value
        for name, delta in snap.counters.items():
            self._counters[name].increment(delta)
        for error_kind, delta in snap.errors.items():
            self._errors[error_kind].increment(delta)
        for histogram, value in snap.observations:
            self._histograms[histogram].observe(value)

    def close(self) -> None:
        """Drop the metric objects while the stub can still process their destructors: left to
        interpreter teardown, they are collected after the stub's IPC is gone and crash it."""
        self._gauges.clear()
        self._counters.clear()
        self._errors.clear()
        self._histograms.clear()
        self._families.clear()


class MetricsRefresher:
    """Refreshes an instance's metrics on a thread of its own: off the engine thread, and on
    time for ``prefill``, whose leases end off the request path (release message or expiry)."""

    def __init__(self, metrics: InstanceMetrics, interval_s: float) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(metrics, interval_s), name="metrics", daemon=True
        )
        self._thread.start()

    def _run(self, metrics: InstanceMetrics, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            metrics.update()

    def stop(self, timeout_s: float = 2.0) -> None:
        """Call first in ``finalize``: a publish still running once the model unloads waits on
        an IPC that the server no longer answers (it hung the unload of ``llm``)."""
        self._stop.set()
        self._thread.join(timeout_s)
