"""What the in-process NIXL tests share: agents on the loopback address over UCX's TCP
transport, and a short poll for what another thread of the agent does."""

import time

import pytest

LOOPBACK = {"advertise_host": "127.0.0.1", "sweep_interval_s": 0.01}
"""Transport options of an agent reachable on the loopback address."""


@pytest.fixture(autouse=True)
def tcp_only(monkeypatch):
    """UCX over TCP only, as between the test's "hosts"."""
    monkeypatch.setenv("UCX_TLS", "tcp")


def wait_for(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)
