"""Prefill lending its cores to decode: the two flock locks, the borrower's thread switching,
and the layout and config that turn it on."""

import threading
import time

import pytest

from splitserve.deploy.render import RoleSpec, default_cpu_layout, lend_prefill_cores
from splitserve.serving.config import ServingConfig, parse_core_sets
from splitserve.serving.core_lend import Borrower, CoreLock, borrower_for


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


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []

    def threads(self, n: int) -> None:
        self.calls.append(("threads", n))

    def affinity(self, cores: set[int]) -> None:
        self.calls.append(("affinity", sorted(cores)))


def test_borrower_adds_a_thread_per_lent_core_made_on_the_lent_cores(locks):
    prefill, decode = locks
    rec = Recorder()
    borrower = Borrower(decode, {1}, {0}, rec.threads, rec.affinity)
    for _ in range(2):
        with borrower.step():
            pass
    assert rec.calls == [
        ("affinity", [0]),
        ("threads", 2),
        ("threads", 1),
        ("affinity", [1]),
        ("threads", 2),
        ("threads", 1),
    ]
    rec.calls.clear()
    with prefill.lend(), borrower.step():
        pass
    assert rec.calls == [] and borrower.borrowed_steps == 2
    assert decode.try_borrow()  # every borrowed step gave the cores back


def test_borrower_gives_the_cores_back_when_the_step_fails(locks):
    _, decode = locks
    rec = Recorder()
    borrower = Borrower(decode, {1}, {0}, rec.threads, rec.affinity)
    with pytest.raises(RuntimeError), borrower.step():
        raise RuntimeError("step failed")
    assert rec.calls[-2:] == [("threads", 1), ("affinity", [1])]
    assert decode.try_borrow()
    decode.give_back()


def test_borrower_with_several_own_cores_first_steps_on_them(locks):
    _, decode = locks
    rec = Recorder()
    borrower = Borrower(decode, {2, 3}, {0, 1}, rec.threads, rec.affinity)
    with borrower.step():
        pass
    assert rec.calls == [] and borrower.borrowed_steps == 0
    with borrower.step():
        pass
    assert rec.calls == [
        ("affinity", [0, 1]),
        ("threads", 4),
        ("threads", 2),
        ("affinity", [2, 3]),
    ]


def test_borrower_gives_the_cores_back_when_pinning_fails(locks):
    _, decode = locks

    def refuse(cores: set[int]) -> None:
        raise OSError("core not allowed")

    borrower = Borrower(decode, {1}, {0}, lambda n: None, refuse)
    with pytest.raises(OSError), borrower.step():
        pass
    assert decode.try_borrow()
    decode.give_back()


def test_lent_cores_must_be_usable_by_the_process(tmp_path):
    with pytest.raises(ValueError, match="may use"):
        borrower_for(str(tmp_path / "lock"), {1}, {7}, allowed={0, 1})
    assert borrower_for(str(tmp_path / "lock"), {1}, {0}, allowed={0, 1}).lent == {0}


def test_borrower_needs_disjoint_core_sets(locks):
    _, decode = locks
    for own, lent in (({1}, set()), (set(), {0}), ({0, 1}, {1})):
        with pytest.raises(ValueError, match="disjoint"):
            Borrower(decode, own, lent, print, print)


def test_layout_lends_the_prefill_cores_to_decode():
    layout = lend_prefill_cores(default_cpu_layout("both", {"model": "tiny"}, cores=2), "/x/lock")
    assert layout.prefill.params == {"core_lock": "/x/lock"}
    params = layout.decode.params
    assert params["core_lock"] == "/x/lock" and parse_core_sets(params["lent_cores"]) == [{0}]
    assert parse_core_sets(layout.decode.cpu_cores) == [{1}]
    assert layout.colocated.params == {}
    cfg = ServingConfig(role="decode", core_lock="/x/lock", lent_cores="0", cpu_cores="1")
    assert cfg.lent_core_set == {0} and cfg.cores_for(0) == {1}


@pytest.mark.parametrize(
    "change, message",
    [
        ({"decode": RoleSpec(instances=2, cpu_cores="1")}, "one prefill and one decode"),
        ({"decode": RoleSpec(cpu_cores="0-1")}, "no core in both"),
        ({"layout": "colocated"}, "with prefill and decode"),
    ],
)
def test_layout_refuses_what_one_lock_cannot_share(change, message):
    import dataclasses

    base = default_cpu_layout("both", {"model": "tiny"}, cores=2)
    with pytest.raises(ValueError, match=message):
        lend_prefill_cores(dataclasses.replace(base, **change), "/x/lock")


def test_config_pairs_core_lock_and_lent_cores_on_decode_only():
    with pytest.raises(ValueError, match="needs lent_cores"):
        ServingConfig(role="decode", core_lock="/x/lock")
    with pytest.raises(ValueError, match="applies to the decode role"):
        ServingConfig(role="prefill", core_lock="/x/lock", lent_cores="0")
    with pytest.raises(ValueError, match="one core set"):
        ServingConfig(role="decode", core_lock="/x/lock", lent_cores="0;1")
    assert ServingConfig(role="prefill", core_lock="/x/lock").core_lock == "/x/lock"
