"""Open-loop arrival processes: mean rate, burstiness (CV of the gaps), determinism."""

from __future__ import annotations

import numpy as np
import pytest

from splitserve_tools.workload.arrivals import arrival_times

N = 200_000


def gaps(kind: str, rate: float, cv: float = 1.0, seed: int = 0) -> np.ndarray:
    times = arrival_times(kind, rate, N, seed=seed, cv=cv)
    assert times[0] == 0.0
    assert np.all(np.diff(times) >= 0)
    return np.diff(times)


@pytest.mark.parametrize("rate", [0.5, 4.0, 100.0])
def test_poisson_mean_rate_and_cv_one(rate: float) -> None:
    g = gaps("poisson", rate)
    assert 1 / g.mean() == pytest.approx(rate, rel=0.01)
    assert g.std() / g.mean() == pytest.approx(1.0, rel=0.02)


@pytest.mark.parametrize("cv", [0.5, 1.0, 2.0, 4.0])
def test_gamma_mean_rate_and_cv(cv: float) -> None:
    g = gaps("gamma", 8.0, cv=cv)
    assert 1 / g.mean() == pytest.approx(8.0, rel=0.03)
    assert g.std() / g.mean() == pytest.approx(cv, rel=0.05)


def test_fixed_rate_is_exact() -> None:
    times = arrival_times("fixed", 4.0, 9)
    np.testing.assert_allclose(times, np.arange(9) / 4.0)


def test_seeded() -> None:
    a = arrival_times("gamma", 3.0, 100, seed=7, cv=2.0)
    np.testing.assert_array_equal(a, arrival_times("gamma", 3.0, 100, seed=7, cv=2.0))
    assert not np.array_equal(a, arrival_times("gamma", 3.0, 100, seed=8, cv=2.0))


@pytest.mark.parametrize(
    ("kind", "rate", "count", "cv"),
    [
        ("poisson", 0.0, 10, 1.0),
        ("fixed", 1.0, 0, 1.0),
        ("gamma", 1.0, 10, 0.0),
        ("burst", 1, 10, 1),
    ],
)
def test_rejects_bad_arguments(kind: str, rate: float, count: int, cv: float) -> None:
    with pytest.raises(ValueError):
        arrival_times(kind, rate, count, cv=cv)
