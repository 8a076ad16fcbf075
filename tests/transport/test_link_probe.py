"""``plan link``'s probe in one process: an owner serving leases, a reader timing handoffs, over
UCX's TCP transport on the loopback address; and the planner's fit of what it measured."""

import threading

import pytest

pytest.importorskip("nixl._api", reason="NIXL is not installed (pip install nixl-cu12)")

import zmq

from splitserve.kv.layout import KVLayout
from splitserve.transport.key import generate_key
from splitserve_tools.planner.fit import link_fit
from splitserve_tools.planner.link_probe import LinkOwner, measure

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32")
KEY = generate_key()


@pytest.fixture(autouse=True)
def _tcp_only(monkeypatch):
    monkeypatch.setenv("UCX_TLS", "tcp")


@pytest.fixture
def owner():
    with LinkOwner(KEY, "127.0.0.1", layout=LAYOUT, max_tokens=64) as link_owner:
        stop = threading.Event()
        thread = threading.Thread(target=link_owner.serve, args=(stop,))
        thread.start()
        yield link_owner
        stop.set()
        thread.join()


def test_measure_times_each_length_and_the_planner_fits_it(owner):
    rows = measure(owner.address, KEY, lengths=(4, 64), repeats=3, host="127.0.0.1")
    assert [(r["tokens"], r["bytes"], r["rate_gbit"]) for r in rows] == [
        (4, LAYOUT.block_bytes, None),
        (64, 16 * LAYOUT.block_bytes, None),
    ]
    assert all(r["seconds"] > 0 for r in rows)
    assert owner.served == 1 + 2 * 3  # the warm-up, then 3 per length
    fit = link_fit(rows, None)
    assert fit.fixed_s >= 0 and fit.bytes_per_s > 0


def test_owner_refuses_what_it_cannot_lease(owner):
    with pytest.raises(RuntimeError, match="cannot lease 65 tokens"):
        measure(owner.address, KEY, lengths=(65,), repeats=1)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.REQ)
    sock.connect(owner.address)
    sock.send(b"many")
    assert sock.recv() == b"error: expected a number of tokens"
    sock.close(0)
    ctx.term()


def test_silent_owner_is_a_clear_timeout(monkeypatch):
    monkeypatch.setattr("splitserve_tools.planner.link_probe.REQUEST_TIMEOUT_MS", 200)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.REP)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    try:
        with pytest.raises(TimeoutError, match="no answer from the link owner"):
            measure(f"tcp://127.0.0.1:{port}", KEY, lengths=(4,), repeats=1)
    finally:
        sock.close(0)
        ctx.term()


def test_fp8_owner_halves_what_crosses_and_reports_its_export():
    with LinkOwner(KEY, "127.0.0.1", layout=LAYOUT, max_tokens=64, transfer_dtype="fp8") as owner:
        stop = threading.Event()
        thread = threading.Thread(target=owner.serve, args=(stop,))
        thread.start()
        try:
            (row,) = measure(owner.address, KEY, lengths=(64,), repeats=2, host="127.0.0.1")
        finally:
            stop.set()
            thread.join()
    assert row["encoding"] == "fp8" and row["bytes"] == 16 * LAYOUT.block_bytes
    # float32 KV: a byte per value plus a float32 scale per 4 x 8 values of a head.
    assert row["wire_bytes"] / row["bytes"] == pytest.approx((1 + 4 / 32) / 4)
    assert 0 < row["export_seconds"] < row["seconds"]
