"""Open-loop arrival times: requests arrive on schedule whatever the server's latency."""

from __future__ import annotations

import numpy as np

ARRIVALS = ("poisson", "gamma", "fixed")


def arrival_times(kind: str, rate: float, count: int, seed: int = 0, cv: float = 1.0) -> np.ndarray:
    """``count`` arrival times in seconds from 0 (the first request at 0), mean rate ``rate``/s.

    - ``poisson``: exponential gaps (CV 1);
    - ``gamma``: gamma gaps with coefficient of variation ``cv`` (shape 1/cv², scale
      1/(rate·shape)); cv > 1 is burstier than Poisson, cv = 1 is Poisson;
    - ``fixed``: a gap of exactly 1/rate.
    """
    if rate <= 0 or count < 1:
        raise ValueError(f"need rate > 0 and count >= 1, got rate={rate}, count={count}")
    gen = np.random.default_rng(seed)
    n = count - 1
    if kind == "poisson":
        gaps = gen.exponential(1.0 / rate, n)
    elif kind == "gamma":
        if cv <= 0:
            raise ValueError(f"gamma arrivals need cv > 0, got {cv}")
        shape = 1.0 / cv**2
        gaps = gen.gamma(shape, 1.0 / (rate * shape), n)
    elif kind == "fixed":
        gaps = np.full(n, 1.0 / rate)
    else:
        raise ValueError(f"unknown arrival process {kind!r}; expected one of {ARRIVALS}")
    return np.concatenate([[0.0], np.cumsum(gaps)])
