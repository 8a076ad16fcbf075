"""The guard that keeps an adaptive mechanism on only where it makes steps faster."""

import logging

import pytest

from splitserve.serving.guard import GuardSettings, PayoffGuard, size_bucket


def run(guard: PayoffGuard, size: int, steps: int, on_s: float, off_s: float) -> list[bool]:
    """``steps`` decisions at ``size``, each fed back the time its arm takes."""
    choices = []
    for _ in range(steps):
        used = guard.use(size)
        guard.record(size, used, on_s if used else off_s)
        choices.append(used)
    return choices


def test_sizes_compare_exactly_up_to_eight_then_by_power_of_two():
    assert [size_bucket(n) for n in (0, 1, 8, 9, 16, 17, 100)] == [1, 1, 8, 16, 16, 32, 128]


def test_alternates_until_both_arms_are_measured():
    guard = PayoffGuard("m", GuardSettings(min_samples=3))
    assert run(guard, 1, 6, on_s=1.0, off_s=1.0) == [True, False] * 3


def test_keeps_a_mechanism_that_pays_and_probes_the_other_arm():
    guard = PayoffGuard("m", GuardSettings(min_samples=2, probe_every=8, max_probe_every=8))
    choices = run(guard, 4, 4 + 64, on_s=0.001, off_s=0.002)[4:]
    assert choices.count(False) == 64 // 8
    assert guard.off_buckets == ()


def test_holds_off_where_it_does_not_pay_and_logs_why_once(caplog):
    guard = PayoffGuard("borrowing", GuardSettings(min_samples=2, probe_every=8, max_probe_every=8))
    with caplog.at_level(logging.INFO, logger="splitserve.serving.guard"):
        choices = run(guard, 2, 4 + 64, on_s=0.1, off_s=0.002)[4:]
    assert choices.count(True) == 64 // 8
    assert guard.off_buckets == (2,)
    assert guard.withheld_steps == 2 + 64 - 8
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "borrowing does not pay at 2 requests" in lines[0]
    assert "100.00 ms with it, 2.00 ms without" in lines[0]


def test_decides_each_size_on_its_own_and_follows_a_change():
    guard = PayoffGuard(
        "m", GuardSettings(window=4, min_samples=2, probe_every=4, max_probe_every=4)
    )
    run(guard, 1, 20, on_s=0.1, off_s=0.002)
    run(guard, 32, 20, on_s=0.001, off_s=0.002)
    assert guard.off_buckets == (1,)
    run(guard, 1, 40, on_s=0.001, off_s=0.002)  # the probes see it pay again
    assert guard.off_buckets == ()


def test_probes_back_off_while_they_confirm_and_reset_when_it_flips():
    guard = PayoffGuard("m", GuardSettings(min_samples=2, probe_every=4, max_probe_every=16))
    choices = run(guard, 1, 4 + 4 + 8 + 16 + 16 + 16, on_s=0.1, off_s=0.002)[4:]
    probes = [i + 1 for i, used in enumerate(choices) if used]
    assert probes == [4, 12, 28, 44, 60]  # every 4, 8, then 16 (the most)
    assert guard._arms[1].probe_every == 16
    run(guard, 1, 16 + 4 * 8, on_s=0.001, off_s=0.002)  # it pays now: probes come back
    assert guard.off_buckets == () and guard._arms[1].probe_every <= 8


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(window=4, min_samples=5), "min_samples"),
        (dict(min_samples=0), "min_samples"),
        (dict(probe_every=1), "probe_every"),
        (dict(probe_every=64, max_probe_every=32), "probe_every"),
    ],
)
def test_settings_check_themselves(settings, message):
    with pytest.raises(ValueError, match=message):
        GuardSettings(**settings)
