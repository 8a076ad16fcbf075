import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from splitserve.engine.request import Request
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.scheduler import Scheduler, SchedulerLimits
from splitserve.kv.allocator import BlockAllocator, BlocksStillWritten


def _req(rid: str, n: int) -> Request:
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=8))


def _sched(
    blocks: int, budget: int = 64, chunked: bool = False, on_failure: str = "recompute"
) -> Scheduler:
    limits = SchedulerLimits(
        block_size=4,
        max_num_seqs=8,
        max_num_batched_tokens=budget,
        chunked_prefill=chunked,
        on_handoff_failure=on_failure,
    )
    return Scheduler(BlockAllocator(blocks), limits)


def _finish_prefill(s: Scheduler, token: int = 7) -> None:
    plan = s.schedule()
    for req, n in plan.prefills:
        req.num_computed += n
        if req.num_computed == req.num_tokens:
            req.output_ids.append(token)


def test_prefill_allocates_exact_blocks():
    s = _sched(8)
    a, b = _req("a", 5), _req("b", 4)
    s.add(a)
    s.add(b)
    plan = s.schedule()
    assert [(r.request_id, n) for r, n in plan.prefills] == [("a", 5), ("b", 4)]
    assert a.block_ids == [0, 1] and b.block_ids == [2]


def test_decode_grows_a_block_at_the_boundary():
    s = _sched(8)
    a = _req("a", 4)
    s.add(a)
    _finish_prefill(s)
    assert a.block_ids == [0]
    plan = s.schedule()
    assert plan.decodes == [a] and a.block_ids == [0, 1]


def test_token_budget_defers_prompts_without_chunking():
    s = _sched(16, budget=6)
    a, b = _req("a", 5), _req("b", 5)
    s.add(a)
    s.add(b)
    plan = s.schedule()
    assert [r.request_id for r, _ in plan.prefills] == ["a"]
    assert list(s.waiting) == [b]


def test_chunked_prefill_splits_a_long_prompt():
    s = _sched(16, budget=6, chunked=True)
    a = _req("a", 10)
    s.add(a)
    plan = s.schedule()
    assert plan.prefills == [(a, 6)]
    a.num_computed += 6
    plan = s.schedule()
    assert plan.prefills == [(a, 4)]


def test_preempts_newest_when_out_of_blocks():
    s = _sched(2)
    a, b = _req("a", 4), _req("b", 4)
    s.add(a)
    s.add(b)
    _finish_prefill(s)
    plan = s.schedule()
    assert plan.decodes == [a]
    assert b.block_ids == [] and b.num_computed == 0 and s.waiting[0] is b
    assert a.block_ids == [0, 1]


class RecordingSource:
    def __init__(self, log: list[list[int]]) -> None:
        self.log = log

    def load(self, dst: list[int], skip: int = 0) -> None:
        self.log.append(list(dst))

    def discard(self) -> None:
        self.log.append([])


def test_prefilled_requests_wait_for_blocks_then_load():
    s = _sched(3)
    loaded: list[list[int]] = []
    a = _req("a", 8)
    a.num_computed, a.output_ids = 8, [9]
    b = _req("b", 8)
    b.num_computed, b.output_ids = 8, [9]
    s.add_prefilled(a, RecordingSource(loaded))
    s.add_prefilled(b, RecordingSource(loaded))
    plan = s.schedule()
    assert plan.decodes == [a] and a.block_ids == [0, 1, 2] and loaded == [[0, 1]]
    assert len(s.arrived) == 1
    s.remove(a)
    plan = s.schedule()
    assert plan.decodes == [b] and b.block_ids == [0, 1, 2] and loaded[-1] == [0, 1]
    s.remove(b)
    assert s.allocator.num_used == 0


class BrokenSource:
    def load(self, dst: list[int], skip: int = 0) -> None:
        raise RuntimeError("lease expired")

    def discard(self) -> None:
        raise AssertionError("a failed load is not a discard")


class StalledSource:
    """A network read abandoned at its deadline: its destination blocks stay with the transport."""

    def __init__(self) -> None:
        self.held: list[int] = []

    def load(self, dst: list[int], skip: int = 0) -> None:
        self.held = list(dst)
        raise BlocksStillWritten("transfer timed out", dst)

    def discard(self) -> None:
        raise AssertionError("a failed load is not a discard")


def test_abandoned_transfer_keeps_its_blocks_out_of_the_pool():
    s = _sched(8)
    a = _req("a", 8)
    a.num_computed, a.output_ids = 8, [9]
    source = StalledSource()
    s.add_prefilled(a, source)
    plan = s.schedule()
    assert plan.prefills and a.num_computed == 0
    assert not set(source.held) & set(a.block_ids)  # recomputed into other blocks
    assert s.allocator.num_used == len(source.held) + len(a.block_ids)
    s.remove(a)
    assert s.allocator.num_used == len(source.held)  # the transport frees these once settled


def test_failed_handoff_falls_back_to_recompute():
    s = _sched(8)
    a = _req("a", 8)
    a.num_computed, a.output_ids = 8, [9]
    s.add_prefilled(a, BrokenSource())
    plan = s.schedule()
    assert plan.decodes == []
    assert plan.prefills == [(a, 9)] and a.num_computed == 0


def test_failed_handoff_ends_the_request_under_the_fail_policy():
    s = _sched(8, on_failure="fail")
    a, b = _req("a", 8), _req("b", 8)
    a.num_computed, a.output_ids = 8, [9]
    b.num_computed, b.output_ids = 8, [9]
    stalled = StalledSource()
    s.add_prefilled(a, BrokenSource())
    s.add_prefilled(b, stalled)
    plan = s.schedule()
    assert plan.empty and not s.waiting and not s.running and not s.arrived
    assert [(r, why.startswith("the prompt's KV could not be pulled")) for r, why in s.failed] == [
        (a, True),
        (b, True),
    ]
    assert a.finished and a.finish_reason == "error" and a.block_ids == [] and b.block_ids == []
    assert s.allocator.num_used == len(stalled.held)  # held by the transport until settled
    assert s.num_handoff_failures == 2


def test_unknown_handoff_failure_policy_is_refused():
    with pytest.raises(ValueError, match="on_handoff_failure"):
        SchedulerLimits(4, 8, 64, on_handoff_failure="retry")


class GatedSource:
    """A load that waits until the test opens the gate, then succeeds or raises ``error``."""

    def __init__(self, error: Exception | None = None) -> None:
        self.gate = threading.Event()
        self.error = error
        self.loaded: list[int] = []

    def load(self, dst: list[int], skip: int = 0) -> None:
        assert self.gate.wait(5)
        if self.error is not None:
            raise self.error
        self.loaded = list(dst)

    def discard(self) -> None:
        raise AssertionError("a pulled source is not discarded")


def _handed_over(rid: str, n: int) -> Request:
    req = _req(rid, n)
    req.num_computed, req.output_ids = n, [9]
    return req


def _settled(s: Scheduler) -> None:
    s.wait_for_pulls(5)


def test_pull_on_the_puller_lets_the_batch_keep_stepping():
    with ThreadPoolExecutor(1) as puller:
        s = Scheduler(BlockAllocator(16), SchedulerLimits(4, 8, 64), puller)
        running = _handed_over("running", 4)
        ready = GatedSource()
        ready.gate.set()
        s.add_prefilled(running, ready)
        s.schedule()
        _settled(s)
        assert s.schedule().decodes == [running]
        source = GatedSource()
        late = _handed_over("late", 8)
        s.add_prefilled(late, source)
        plan = s.schedule()
        assert plan.decodes == [running] and s.pulling and s.num_unfinished == 2
        assert late.block_ids and s.allocator.num_used == len(running.block_ids) + 3
        assert s.pulls_outstanding
        source.gate.set()
        _settled(s)
        running.output_ids.append(1)
        running.num_computed = running.num_tokens - 1
        plan = s.schedule()
        assert late in plan.decodes and late in s.running and not s.pulling
        assert source.loaded == late.block_ids[:2]


def test_request_dropped_mid_pull_keeps_its_blocks_until_the_pull_ends():
    with ThreadPoolExecutor(1) as puller:
        s = Scheduler(BlockAllocator(16), SchedulerLimits(4, 8, 64), puller)
        source = GatedSource(BlocksStillWritten("abandoned", []))
        req = _handed_over("a", 8)
        s.add_prefilled(req, source)
        s.schedule()
        s.remove(req)
        assert s.allocator.num_used == 3 and s.num_unfinished == 0 and s.pulls_outstanding
        source.error = BlocksStillWritten("abandoned", req.block_ids[:1])
        source.gate.set()
        _settled(s)
        s.schedule()
        assert not s.pulls_outstanding and s.allocator.num_used == 1  # the held block


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_failed_pull_follows_the_policy(policy):
    with ThreadPoolExecutor(1) as puller:
        limits = SchedulerLimits(4, 8, 64, on_handoff_failure=policy)
        s = Scheduler(BlockAllocator(16), limits, puller)
        source = GatedSource(RuntimeError("owner gone"))
        req = _handed_over("a", 8)
        s.add_prefilled(req, source)
        s.schedule()
        source.gate.set()
        _settled(s)
        plan = s.schedule()
        assert s.num_handoff_failures == 1
        if policy == "fail":
            assert s.failed[0][0] is req and s.allocator.num_used == 0 and plan.empty
        else:
            assert plan.prefills == [(req, 9)] and not s.failed
