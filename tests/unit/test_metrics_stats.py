"""InstanceStats: admission against the queue bound, ends, latencies and counter deltas."""

import threading

import pytest

from splitserve.serving.stats import InstanceStats, record_transport


def test_queue_bound_counts_only_requests_beyond_the_running_batch():
    stats = InstanceStats(max_queue=2)
    assert stats.admit() and stats.admit()
    assert not stats.admit()
    stats.set_running(2)
    assert stats.admit() and stats.admit()
    assert stats.queued == 2 and not stats.admit()
    stats.end()
    assert stats.admit()
    assert stats.snapshot({}).errors == {"unavailable": 2}


def test_unbounded_queue_and_bad_bound():
    stats = InstanceStats()
    assert all(stats.admit() for _ in range(10_000))
    with pytest.raises(ValueError, match="max_queue"):
        InstanceStats(max_queue=-1)


def test_snapshot_reports_deltas_once():
    stats = InstanceStats()
    stats.admit()
    stats.end("internal")
    stats.error("invalid")
    stats.first_token(arrival=1.0, now=1.25)
    stats.finished(first_token_at=1.25, now=2.25, num_output_tokens=5)
    stats.finished(first_token_at=1.25, now=2.25, num_output_tokens=1)
    gauges = record_transport(stats, {"outstanding": 3, "released": 4, "fetch_ns": 2_000_000_000})
    first = stats.snapshot(gauges)
    assert first.gauges == {"queue_depth": 0, "leases_outstanding": 3.0}
    assert first.errors == {"internal": 1, "invalid": 1}
    assert first.observations == [("ttft", 0.25), ("tpot", 0.25)]
    assert first.counters == {"leases_released_total": 4.0, "kv_handoff_seconds_total": 2.0}
    record_transport(stats, {"released": 6, "fetch_ns": 2_000_000_000})
    second = stats.snapshot({})
    assert second.counters == {"leases_released_total": 2.0}
    assert second.errors == {} and second.observations == []


def test_steps_add_up_between_snapshots():
    stats = InstanceStats()
    stats.step(0.5, 8, 0.5)
    stats.step(0.25, 2, 0.125)
    first = stats.snapshot({})
    assert first.observations == [("step", 0.5), ("step", 0.25)]
    assert first.counters == {
        "engine_steps_total": 2.0,
        "engine_busy_seconds_total": 0.75,
        "engine_cpu_seconds_total": 0.625,
        "engine_sampled_tokens_total": 10.0,
    }
    stats.step(0.125, 1, 0.0625)
    assert stats.snapshot({}).counters == {
        "engine_steps_total": 1.0,
        "engine_busy_seconds_total": 0.125,
        "engine_cpu_seconds_total": 0.0625,
        "engine_sampled_tokens_total": 1.0,
    }


def test_concurrent_admit_and_end_balance():
    stats = InstanceStats(max_queue=1_000_000)

    def work() -> None:
        for _ in range(2000):
            assert stats.admit()
            stats.end("cancelled")

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert stats.in_flight == 0
    assert stats.snapshot({}).errors == {"cancelled": 8000}
