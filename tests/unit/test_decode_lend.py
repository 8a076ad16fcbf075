"""Decode lending its cores to prefill's passes: the three flock locks, the policy that decides
when decode offers, the pass borrower's threads and guard, and the spec that turns it on."""

import dataclasses
import fcntl
import os
import threading
import time

import pytest
from lend_doubles import Always, Recorder
from rendered_config import rendered

from splitserve.deploy.render import render
from splitserve.deploy.spec import LOCK_NAME, default_cpu_spec
from splitserve.serving.decode_lend import (
    DecodeCores,
    Lender,
    LendPolicy,
    PassBorrower,
    pass_borrower_for,
)
from splitserve.serving.guard import PayoffGuard


def cores_free(path: str) -> bool:
    """Whether nobody computes on decode's cores now (a third handle's non-blocking try)."""
    fd = os.open(f"{path}.decode.cores", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return True


@pytest.fixture
def cores(tmp_path):
    """Two handles on decode's locks, as the decode and prefill processes hold them."""
    path = str(tmp_path / "core.lock")
    decode, prefill = DecodeCores(path), DecodeCores(path)
    yield decode, prefill
    decode.close()
    prefill.close()


def test_prefill_sees_the_offer_only_while_decode_stands_by_it(cores):
    decode, prefill = cores
    assert not prefill.offered()
    decode.offer(True)
    assert prefill.offered() and decode.offering
    decode.offer(True)  # idempotent
    decode.offer(False)
    assert not prefill.offered()


def test_a_borrowing_pass_waits_for_the_step_in_flight_and_the_next_step_for_the_pass(cores):
    decode, prefill = cores
    assert not decode.hold()  # nobody borrows: no wait
    started, lent, finish = threading.Event(), threading.Event(), threading.Event()

    def pass_() -> None:
        started.set()
        with prefill.borrow():
            lent.set()
            finish.wait(5)

    thread = threading.Thread(target=pass_)
    thread.start()
    started.wait(5)
    time.sleep(0.1)
    assert not lent.is_set()  # decode's step holds the cores
    decode.release()
    assert lent.wait(5)
    waited: list[bool] = []
    step = threading.Thread(target=lambda: waited.append(decode.hold()))
    step.start()
    time.sleep(0.1)
    assert not waited  # the next step waits for the pass
    finish.set()
    thread.join(5)
    step.join(5)
    assert waited == [True]
    decode.release()


def test_policy_offers_while_idle_and_while_steps_leave_room():
    policy = LendPolicy(tpot_target_s=0.1, headroom=0.8, window_s=1.0)
    assert policy.offers(0.0)  # no steps yet
    for k in range(6):
        policy.stepped(k * 0.05)  # 50 ms per token: room under 80 ms
    assert policy.mean_interval(0.25) == pytest.approx(0.05)
    assert policy.offers(0.25)
    policy.stepped(0.45)  # a 200 ms pass on decode's cores: mean (0.45 - 0) / 6 = 75 ms
    assert policy.offers(0.45)
    policy.stepped(0.65)  # another: 650 / 7 = 93 ms
    assert not policy.offers(0.65)
    # The open gap counts once it is longer than the closed mean: a pass running now.
    policy.idle()
    policy.stepped(10.0)
    policy.stepped(10.05)
    assert policy.offers(10.05)
    assert not policy.offers(10.3)  # 300 ms since the first of two steps: 150 ms a token
    # Steps older than the window are forgotten.
    assert policy.mean_interval(20.0) is None and policy.offers(20.0)


def test_policy_rejects_bad_settings():
    for kwargs in ({"tpot_target_s": 0}, {"tpot_target_s": 0.1, "headroom": 1.5}):
        with pytest.raises(ValueError, match="tpot_target_s"):
            LendPolicy(**kwargs)


def test_lender_offers_while_idle_withdraws_when_steps_run_late(cores):
    decode, prefill = cores
    lender = Lender(decode, LendPolicy(tpot_target_s=0.01, window_s=5.0))
    lender.update(running=0)
    assert prefill.offered()
    for _ in range(3):
        with lender.step():
            time.sleep(0.02)  # 20 ms steps against a 10 ms target
    lender.update(running=1)
    assert not prefill.offered()
    lender.update(running=0)
    assert prefill.offered()
    assert lender.waited_steps == 0


def test_pass_borrower_borrows_only_while_offered_and_makes_the_workers_once(tmp_path, cores):
    decode, prefill = cores
    rec, guard = Recorder(), Always()
    borrower = PassBorrower(prefill, {0}, {1}, rec, guard)
    with borrower.pass_(100):
        pass
    assert rec.calls == [] and borrower.borrowed_passes == 0 and guard.records == []
    decode.offer(True)
    for _ in range(2):
        with borrower.pass_(100):
            assert not cores_free(str(tmp_path / "core.lock"))  # the pass holds them
    assert rec.calls == [("grow", 2, [1], [0]), ("threads", 1), ("threads", 2), ("threads", 1)]
    assert borrower.borrowed_passes == 2 and [r[:2] for r in guard.records] == [(100, True)] * 2
    assert cores_free(str(tmp_path / "core.lock"))


def test_pass_borrower_feeds_the_guard_the_passes_it_withholds(tmp_path, cores):
    decode, prefill = cores

    class Never(Always):
        def use(self, size: int) -> bool:
            return False

    guard = Never()
    borrower = PassBorrower(prefill, {0}, {1}, Recorder(), guard)
    decode.offer(True)
    with borrower.pass_(7):
        assert cores_free(str(tmp_path / "core.lock"))  # not borrowed
    assert borrower.borrowed_passes == 0 and [r[:2] for r in guard.records] == [(7, False)]


def test_pass_borrower_needs_usable_disjoint_cores(tmp_path, cores):
    _, prefill = cores
    for own, lent in (({1}, set()), (set(), {0}), ({0, 1}, {1})):
        with pytest.raises(ValueError, match="disjoint"):
            PassBorrower(prefill, own, lent, Recorder())
    with pytest.raises(ValueError, match="among the cores"):
        pass_borrower_for(str(tmp_path / "lock"), {0}, {5}, allowed={0, 1})


def test_spec_lends_decode_cores_by_default_wherever_the_layout_allows(tmp_path):
    spec = default_cpu_spec("disagg", {"model": "tiny"}, cores=2)
    assert spec.lend_decode_cores is None and spec.lends_decode
    prefill = spec.serving_config("prefill", tmp_path)
    decode = spec.serving_config("llm", tmp_path)
    assert prefill.lent_core_set == {1} and decode.lend_cores and decode.tpot_target_s == 0.1
    assert prefill.core_lock == decode.core_lock == str(tmp_path / LOCK_NAME)
    only = dataclasses.replace(spec, lend_prefill_cores=False)
    decode = only.serving_config("llm", tmp_path)
    assert decode.lend_cores and decode.lent_cores == "" and decode.core_lock
    off = dataclasses.replace(spec, lend_decode_cores=False)
    assert off.serving_config("prefill", tmp_path).lent_cores == ""
    assert not off.serving_config("llm", tmp_path).lend_cores


def test_rendered_repository_carries_the_tpot_target(tmp_path):
    spec = default_cpu_spec("both", {"model": "tiny", "tpot_target_s": 0.05}, cores=2)
    repo = render(spec, tmp_path / "repo")
    decode = rendered(repo, "llm")
    assert decode.lend_cores and decode.tpot_target_s == 0.05
    assert rendered(repo, "prefill").lent_core_set == {1}


def test_budget_is_the_longest_stall_that_keeps_the_mean_under_the_bound():
    policy = LendPolicy(tpot_target_s=0.1, headroom=0.8, window_s=10.0)
    assert policy.budget(0.0) == float("inf")  # nothing measured: anything goes
    for k in range(5):
        policy.stepped(k * 0.04)  # 40 ms steps, ends at 0 .. 0.16
    # A stall D from 0.16, then one more 40 ms step: (0.16 + D + 0.04) / 5 <= 0.08.
    assert policy.budget(0.16) == pytest.approx(0.2)
    assert policy.budget(0.5) == 0.0  # already over: nothing to lend


def test_the_budget_travels_with_the_offer(cores):
    decode, prefill = cores
    assert prefill.budget() == 0.0  # no offer
    decode.offer(True, 0.25)
    assert prefill.budget() == 0.25
    decode.offer(True)
    assert prefill.budget() == float("inf")
    decode.offer(False, 0.5)
    assert prefill.budget() == 0.0


def test_a_pass_expected_to_outlast_the_budget_keeps_to_its_own_cores(tmp_path, cores):
    decode, prefill = cores
    guard = PayoffGuard("test")
    borrower = PassBorrower(prefill, {0}, {1}, Recorder(), guard)
    for _ in range(4):
        guard.record(100, True, 0.001)  # 1 ms a token when borrowed, 2 ms when not
        guard.record(100, False, 0.002)
    decode.offer(True, 0.05)
    with borrower.pass_(100):  # expected 100 ms > 50 ms
        assert cores_free(str(tmp_path / "core.lock"))
    assert borrower.over_budget == 1 and borrower.borrowed_passes == 0
    decode.offer(True, 0.2)
    with borrower.pass_(100):  # expected 100 ms < 200 ms
        assert not cores_free(str(tmp_path / "core.lock"))
    assert borrower.borrowed_passes == 1
