"""Custom metrics on the metrics port: every family per model and instance, counts that move
with a workload, and KV blocks, leases and queues back at zero once it is done."""

from __future__ import annotations

import time
from collections import defaultdict

import pytest
from llm_client import GrpcStream, generate_inputs, samples, wait_for

from splitserve.deploy.launcher import TritonServer

pytestmark = pytest.mark.triton

MODELS = ("llm", "llm_colocated")
COMMON = (
    "splitserve_kv_blocks_used",
    "splitserve_kv_blocks_free",
    "splitserve_leases_outstanding",
    "splitserve_queue_depth",
    "splitserve_requests_running",
    "splitserve_leases_expired_total",
    "splitserve_kv_handoff_bytes_total",
    "splitserve_kv_handoff_seconds_total",
    "splitserve_ttft_seconds_count",
    "splitserve_tpot_seconds_bucket",
    "splitserve_engine_steps_total",
    "splitserve_engine_step_seconds_bucket",
)
ERROR_KINDS = {"invalid", "unavailable", "internal", "cancelled"}
IDLE = ("splitserve_kv_blocks_used", "splitserve_leases_outstanding", "splitserve_queue_depth")
N = 3

Totals = dict[tuple[str, str], float]


def totals(server: TritonServer, kind: str | None = None) -> Totals:
    """Samples summed per (name, model); only errors of ``kind`` when given."""
    out: Totals = defaultdict(float)
    for name, labels, value in samples(server):
        if kind is None or labels.get("kind", kind) == kind:
            out[(name, labels["model"])] += value
    return out


def steady(server: TritonServer, interval_s: float = 0.3) -> bool:
    """Whether no count moved over ``interval_s`` (several publishing intervals)."""
    first = totals(server)
    time.sleep(interval_s)
    return totals(server) == first


def test_families_per_model_and_instance(splitserve_server: TritonServer) -> None:
    seen: dict[str, set[tuple[str, str]]] = defaultdict(set)
    kinds: dict[str, set[str]] = defaultdict(set)
    for name, labels, _ in samples(splitserve_server):
        seen[name].add((labels["model"], labels["instance"]))
        if name == "splitserve_errors_total":
            kinds[labels["model"]].add(labels["kind"])
    for name in COMMON:
        assert {model for model, _ in seen[name]} == {*MODELS, "prefill"}, name
        assert all(instance.startswith(f"{model}_") for model, instance in seen[name]), name
    assert all(kinds[model] == ERROR_KINDS for model in (*MODELS, "prefill")), kinds


def test_a_workload_moves_the_counts_and_leaves_nothing_held(
    splitserve_server: TritonServer,
) -> None:
    # Earlier tests' counts reach the port within a publishing interval (0.1 s): let them land.
    assert wait_for(lambda: steady(splitserve_server), 5.0)
    before, invalid_before = totals(splitserve_server), totals(splitserve_server, "invalid")
    with GrpcStream(splitserve_server.grpc_url) as stream:
        for model in MODELS:
            for _ in range(N):
                inputs = generate_inputs("Metrics", stream=True, sampling={"max_tokens": 4})
                assert stream.generate(model, inputs).finals[-1]
            assert "max_tokens" in stream.error_of(
                model, generate_inputs("hi", sampling={"max_tokens": 0})
            )

    def settled() -> bool:
        now = totals(splitserve_server)
        idle = all(now[(name, m)] == 0 for name in IDLE for m in (*MODELS, "prefill"))
        counts = ("splitserve_ttft_seconds_count", "splitserve_tpot_seconds_count")
        # Each instance publishes on its own schedule (prefill's too), and TPOT is observed when
        # a request ends, after its TTFT: wait for both counts of every model, and the leases.
        leases = ("splitserve_leases_granted_total", "splitserve_leases_released_total")
        return (
            idle
            and all(now[(c, m)] >= before[(c, m)] + N for c in counts for m in MODELS)
            and all(now[(c, "prefill")] >= before[(c, "prefill")] + N for c in leases)
        )

    assert wait_for(settled, 5.0), totals(splitserve_server)
    after, invalid_after = totals(splitserve_server), totals(splitserve_server, "invalid")

    def grew(name: str, model: str) -> float:
        return after[(name, model)] - before[(name, model)]

    for model in MODELS:
        assert grew("splitserve_ttft_seconds_count", model) >= N
        assert grew("splitserve_tpot_seconds_count", model) >= N
        assert grew("splitserve_tpot_seconds_sum", model) > 0
        assert grew("splitserve_engine_sampled_tokens_total", model) >= 3 * N
        assert grew("splitserve_responses_sent_total", model) >= N
        assert grew("splitserve_sender_cpu_seconds_total", model) > 0
        key = ("splitserve_errors_total", model)
        assert invalid_after[key] - invalid_before[key] == 1
    assert grew("splitserve_kv_handoffs_total", "llm") >= N
    assert grew("splitserve_kv_handoff_bytes_total", "llm") > 0
    assert grew("splitserve_kv_handoff_seconds_total", "llm") > 0
    # The session server lends the prefill core to decode: steps between passes find it free
    # and borrow it, or run on decode's own core where the guard found borrowing not to pay.
    lent = (
        "splitserve_engine_borrowed_steps_total",
        "splitserve_engine_borrow_withheld_steps_total",
    )
    assert sum(grew(name, "llm") for name in lent) >= 1
    # And decode offers its core to prefill's passes while it is idle or its steps leave room
    # under tpot_target_s: a pass borrows it, or the guard or decode's budget keeps it on its
    # own core.
    borrowed = (
        "splitserve_prefill_borrowed_passes_total",
        "splitserve_prefill_borrow_withheld_passes_total",
        "splitserve_prefill_borrow_over_budget_passes_total",
    )
    assert sum(grew(name, "prefill") for name in borrowed) >= 1
    assert grew("splitserve_engine_lent_seconds_total", "llm") >= 0
    for model in (*MODELS, "prefill"):
        assert grew("splitserve_engine_steps_total", model) >= 1, model
        assert grew("splitserve_engine_busy_seconds_total", model) > 0, model
        assert grew("splitserve_engine_cpu_seconds_total", model) > 0, model
        assert grew("splitserve_engine_step_seconds_count", model) >= 1, model
    assert grew("splitserve_leases_granted_total", "prefill") >= N
    assert grew("splitserve_leases_released_total", "prefill") >= N
