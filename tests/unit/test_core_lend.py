"""Prefill lending its cores to decode: the two flock locks, the borrower's threads and where
they run, its guard, and the deployment spec and config that turn it on."""

import dataclasses
import os
import threading
import time

import pytest
import torch
from lend_doubles import Always, Recorder
from rendered_config import rendered

from splitserve.deploy.render import render
from splitserve.deploy.spec import LOCK_NAME, RoleSpec, default_cpu_spec
from splitserve.serving.affinity import thread_affinity
from splitserve.serving.core_lend import Borrower, CoreLock, borrower_for
from splitserve.serving.guard import GuardSettings, PayoffGuard
from splitserve.serving.omp_team import TorchTeam
from splitserve.serving.serving_config import ServingConfig, parse_core_sets


@pytest.fixture
def locks(tmp_path):
    """Two handles on one lock, as the prefill and decode processes hold them."""
    path = str(tmp_path / "core.lock")
    prefill, decode = CoreLock(path), CoreLock(path)
    yield prefill, decode
    prefill.close()
    decode.close()


def test_decode_borrows_only_while_prefill_neither_computes_nor_waits(locks):
    prefill, decode = locks
    assert decode.try_borrow()
    decode.give_back()
    with prefill.lend():
        assert not decode.try_borrow()
    assert decode.try_borrow()
    decode.give_back()


def test_prefill_waits_for_the_borrowed_step_and_decode_yields_meanwhile(locks):
    prefill, decode = locks
    assert decode.try_borrow()
    started = threading.Event()
    lent = threading.Event()
    finish = threading.Event()

    def pass_() -> None:
        started.set()
        with prefill.lend():
            lent.set()
            finish.wait(5)

    thread = threading.Thread(target=pass_)
    thread.start()
    started.wait(5)
    time.sleep(0.1)
    assert not lent.is_set()
    decode.give_back()
    assert lent.wait(5)
    assert not decode.try_borrow()  # the pass holds the cores
    finish.set()
    thread.join(5)
    assert decode.try_borrow()
    decode.give_back()


def test_borrower_makes_the_lent_workers_on_the_lent_cores_once(locks):
    prefill, decode = locks
    rec = Recorder()
    borrower = Borrower(decode, {1}, {0}, rec, Always())
    for _ in range(2):
        with borrower.step(1):
            pass
    assert rec.calls == [("grow", 2, [0], [1]), ("threads", 1), ("threads", 2), ("threads", 1)]
    rec.calls.clear()
    with prefill.lend(), borrower.step(1):
        pass
    assert rec.calls == [] and borrower.borrowed_steps == 2
    assert decode.try_borrow()  # every borrowed step gave the cores back


def test_borrower_with_several_own_cores_remakes_the_lent_workers_each_borrowed_step(locks):
    prefill, decode = locks
    rec = Recorder()
    borrower = Borrower(decode, {2, 3}, {0, 1}, rec, Always())
    with prefill.lend(), borrower.step(1):
        pass
    assert rec.calls == [("grow", 2, [2, 3], [2, 3])]  # own workers first, on the own cores
    rec.calls.clear()
    for _ in range(2):
        with borrower.step(1):
            pass
    assert rec.calls == [("grow", 4, [0, 1], [2, 3]), ("threads", 2)] * 2


def test_borrower_gives_the_cores_back_when_the_step_fails(locks):
    _, decode = locks
    rec = Recorder()
    guard = Always()
    borrower = Borrower(decode, {1}, {0}, rec, guard)
    with pytest.raises(RuntimeError), borrower.step(1):
        raise RuntimeError("step failed")
    assert rec.calls[-1] == ("threads", 1) and guard.records == []
    assert decode.try_borrow()
    decode.give_back()


def test_borrower_gives_the_cores_back_when_pinning_fails(locks):
    _, decode = locks

    class Refusing(Recorder):
        def grow(self, n: int, cores: set[int], home: set[int]) -> None:
            raise OSError("core not allowed")

    borrower = Borrower(decode, {1}, {0}, Refusing(), Always())
    with pytest.raises(OSError), borrower.step(1):
        pass
    assert decode.try_borrow()
    decode.give_back()


def test_borrower_times_for_the_guard_only_steps_that_found_the_cores_free(locks):
    prefill, decode = locks
    guard = PayoffGuard("test")
    borrower = Borrower(decode, {1}, {0}, Recorder(), guard)
    for _ in range(4):
        with borrower.step(3):
            pass
    with prefill.lend(), borrower.step(3):
        pass
    arms = guard._arms[3]
    assert len(arms.on) == len(arms.off) == 2  # alternated until it can compare
    assert borrower.borrowed_steps == 2 and guard.withheld_steps == 2
    assert decode.try_borrow()
    decode.give_back()


def test_borrower_stops_borrowing_where_it_does_not_pay(locks):
    prefill, decode = locks
    # Medians of three: one own-core step stalled by a loaded machine changes nothing.
    guard = PayoffGuard("test", GuardSettings(window=5, min_samples=3, probe_every=10))
    borrower = Borrower(decode, {1}, {0}, Recorder(), guard)
    for _ in range(30):
        with borrower.step(1):
            if prefill.try_borrow():  # a borrowed step holds the cores: not this one
                prefill.give_back()
            else:
                time.sleep(0.05)  # borrowed steps are slow
    assert guard.off_buckets == (1,)
    assert borrower.borrowed_steps <= 3 + 2  # three to compare, then probes in 10, 20 steps


def test_borrowed_workers_run_on_the_lent_cores_whichever_step_first_needs_them(tmp_path):
    """The defect this guards against: a worker made by a parallel region that first ran in a
    later borrowed step, while the engine thread was back on its own core, shared that core
    with the engine thread (50-200x slower decode steps)."""
    allowed = os.sched_getaffinity(0)
    if len(allowed) < 2:
        pytest.skip("needs two cores")
    own, lent = {min(allowed)}, {max(allowed)}
    found: dict[str, set[int]] = {}

    def engine_thread() -> None:
        os.sched_setaffinity(0, own)
        torch.set_num_threads(1)
        before = set(os.listdir("/proc/self/task"))
        lock = CoreLock(str(tmp_path / "core.lock"))
        borrower = Borrower(lock, own, lent, TorchTeam(), Always())
        with borrower.step(1):
            pass  # a step too small for any parallel region
        with borrower.step(1):
            torch.ones(1 << 18).mul_(2.0)  # every thread of the team
        lock.close()
        for tid in set(os.listdir("/proc/self/task")) - before:
            found[tid] = thread_affinity(os.getpid(), int(tid))

    thread = threading.Thread(target=engine_thread)
    thread.start()
    thread.join(30)
    assert found and all(cores == lent for cores in found.values()), found


def test_lent_cores_must_be_usable_by_the_process(tmp_path):
    with pytest.raises(ValueError, match="may use"):
        borrower_for(str(tmp_path / "lock"), {1}, {7}, allowed={0, 1})
    assert borrower_for(str(tmp_path / "lock"), {1}, {0}, allowed={0, 1}).lent == {0}


def test_borrower_needs_disjoint_core_sets(locks):
    _, decode = locks
    for own, lent in (({1}, set()), (set(), {0}), ({0, 1}, {1})):
        with pytest.raises(ValueError, match="disjoint"):
            Borrower(decode, own, lent, Recorder())


def test_spec_lends_the_prefill_cores_to_decode(tmp_path):
    spec = default_cpu_spec(
        "both", {"model": "tiny"}, cores=2, lend_prefill_cores=True, lend_decode_cores=False
    )
    assert spec.lends and not spec.lends_decode
    lock = str(tmp_path / "core.lock")
    prefill = spec.serving_config("prefill", tmp_path)
    assert prefill.core_lock == lock and prefill.lent_cores == ""
    decode = spec.serving_config("llm", tmp_path)
    assert decode.core_lock == lock and parse_core_sets(decode.lent_cores) == [{0}]
    assert not decode.lend_cores
    assert parse_core_sets(decode.cpu_cores) == [{1}]
    colocated = spec.serving_config("llm_colocated", tmp_path)
    assert colocated.core_lock == "" and colocated.lent_cores == ""
    cfg = ServingConfig(role="decode", core_lock="/x/lock", lent_cores="0", cpu_cores="1")
    assert cfg.lent_core_set == {0} and cfg.cores_for(0) == {1}


def test_rendered_repository_holds_the_lock_both_roles_name(tmp_path):
    spec = default_cpu_spec("both", {"model": "tiny"}, cores=2, lend_prefill_cores=True)
    repo = render(spec, tmp_path / "repo")
    lock = str((tmp_path / "repo").resolve() / LOCK_NAME)
    assert rendered(repo, "prefill").core_lock == lock
    decode = rendered(repo, "llm")
    assert decode.core_lock == lock and decode.lent_core_set == {0}
    assert rendered(repo, "llm_colocated").core_lock == ""


def test_spec_lends_by_default_wherever_the_layout_allows(tmp_path):
    base = default_cpu_spec("disagg", {"model": "tiny"}, cores=2)
    assert base.lend_prefill_cores is None and base.lends
    assert base.serving_config("llm", tmp_path).lent_core_set == {0}
    off = dataclasses.replace(base, lend_prefill_cores=False, lend_decode_cores=False)
    assert not off.lends and not off.lends_decode
    for model in ("prefill", "llm"):
        cfg = off.serving_config(model, tmp_path)
        assert cfg.core_lock == "" and cfg.lent_cores == ""
    cannot = dataclasses.replace(base, decode=RoleSpec(instances=2, cpu_cores="1"))
    assert not cannot.lends  # None: no lending, and no error
    assert cannot.serving_config("prefill", tmp_path).core_lock == ""


@pytest.mark.parametrize(
    "change, message",
    [
        ({"decode": RoleSpec(instances=2, cpu_cores="1")}, "one prefill and one decode"),
        ({"decode": RoleSpec(cpu_cores="0-1")}, "no core in both"),
        ({"layout": "colocated"}, "with prefill and decode"),
    ],
)
def test_spec_refuses_what_one_lock_cannot_share(change, message):
    base = default_cpu_spec("both", {"model": "tiny"}, cores=2)
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(base, lend_prefill_cores=True, **change)


def test_config_pairs_core_lock_with_what_each_role_lends_or_borrows():
    with pytest.raises(ValueError, match="needs lent_cores or lend_cores"):
        ServingConfig(role="decode", core_lock="/x/lock")
    with pytest.raises(ValueError, match="lent_cores applies to the prefill and decode roles"):
        ServingConfig(role="prefill", lent_cores="0")
    with pytest.raises(ValueError, match="core_lock applies to the prefill and decode"):
        ServingConfig(role="colocated", core_lock="/x/lock")
    with pytest.raises(ValueError, match="lend_cores applies to the decode role"):
        ServingConfig(role="prefill", core_lock="/x/lock", lend_cores=True)
    with pytest.raises(ValueError, match="one core set"):
        ServingConfig(role="decode", core_lock="/x/lock", lent_cores="0;1")
    with pytest.raises(ValueError, match="tpot_target_s must be positive"):
        ServingConfig(role="decode", tpot_target_s=0)
    assert ServingConfig(role="prefill", core_lock="/x/lock").core_lock == "/x/lock"
    assert ServingConfig(role="prefill", core_lock="/x/lock", lent_cores="1").lent_core_set == {1}
    assert ServingConfig(role="decode", core_lock="/x/lock", lend_cores=True).lend_cores
