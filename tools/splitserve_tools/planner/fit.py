"""Latency models of the engine's steps and their least-squares fits.

Prefill (DistServe's form): ``a + b·T + c·S`` seconds for a packed batch of ``T`` prompt tokens
whose squared lengths sum to ``S`` (attention is per prompt, so one prompt has ``S = T²``).
Decode: per range of batch sizes, ``a + b·B + c·C`` seconds per step for ``B`` sequences holding
``C`` context tokens in all. Handoff: ``fixed + bytes / bandwidth``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from itertools import pairwise
from typing import Any

import numpy as np

from splitserve.serving.layer_chunks import run_ends


def _lstsq(rows: Sequence[Sequence[float]], ys: Sequence[float]) -> list[float]:
    """Non-negative least squares weighted by 1/y, so short and long steps count alike
    (relative error). Every coefficient is a cost, so none may be negative: each subset of the
    terms is fitted and the best fit with no negative coefficient wins (3 terms: 7 subsets)."""
    x = np.asarray(rows, dtype=float)
    y = np.asarray(ys, dtype=float)
    w = 1.0 / np.maximum(y, 1e-9)
    xw, yw = x * w[:, None], y * w
    best: tuple[float, list[float]] | None = None
    n = x.shape[1]
    for mask in range(1, 1 << n):
        cols = [j for j in range(n) if mask >> j & 1]
        coef, *_ = np.linalg.lstsq(xw[:, cols], yw, rcond=None)
        if (coef < 0).any():
            continue
        full = np.zeros(n)
        full[cols] = coef
        err = float(np.sum((xw @ full - yw) ** 2))
        if best is None or err < best[0]:
            best = (err, [float(c) for c in full])
    if best is None:
        return [0.0] * n
    return best[1]


@dataclass(frozen=True)
class PrefillSample:
    batch: int
    length: int
    seconds: float

    @property
    def tokens(self) -> int:
        return self.batch * self.length

    @property
    def sq_tokens(self) -> int:
        return self.batch * self.length**2


@dataclass(frozen=True)
class DecodeSample:
    batch: int
    context: float
    """Total context tokens over the batch."""
    seconds: float


@dataclass(frozen=True)
class PrefillFit:
    a: float
    b: float
    c: float

    def __call__(self, tokens: float, sq_tokens: float) -> float:
        return max(0.0, self.a + self.b * tokens + self.c * sq_tokens)

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PrefillFit:
        return cls(float(d["a"]), float(d["b"]), float(d["c"]))


@dataclass(frozen=True)
class DecodeRange:
    lo: int
    """Smallest batch size this range covers; it reaches up to the next range's ``lo``."""
    a: float
    b: float
    c: float


@dataclass(frozen=True)
class DecodeFit:
    ranges: tuple[DecodeRange, ...]

    def __post_init__(self) -> None:
        if not self.ranges or self.ranges[0].lo != 1:
            raise ValueError("decode ranges must start at batch size 1")
        if any(x.lo >= y.lo for x, y in pairwise(self.ranges)):
            raise ValueError("decode ranges must be sorted by batch size")

    def __call__(self, batch: int, context: float) -> float:
        r = next(r for r in reversed(self.ranges) if r.lo <= batch)
        return max(0.0, r.a + r.b * batch + r.c * context)

    def to_dict(self) -> dict[str, Any]:
        return {"ranges": [asdict(r) for r in self.ranges]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DecodeFit:
        return cls(tuple(DecodeRange(int(r["lo"]), r["a"], r["b"], r["c"]) for r in d["ranges"]))


@dataclass(frozen=True)
class HandoffFit:
    fixed_s: float
    bytes_per_s: float
    stream_layers: int = 0
    """0: the KV moves after the prompt pass; else it streams during the pass, one transfer per
    layer of this many (prefill servers with ``kv_stream_layers``)."""
    stream_min_tokens: int = 0
    """With ``stream_layers``: prompts shorter than this move after the pass all the same
    (the prefill server's ``kv_stream_min_tokens``)."""
    stream_min_gap_s: float = 0.0
    """With ``stream_layers``: the least pass time between two runs of layers handed on (the
    prefill server's ``kv_stream_min_gap_s``, ``serving.layer_chunks``); 0: layer by layer."""

    def streams(self, tokens: int) -> bool:
        """Whether a prompt of ``tokens`` tokens streams its KV during the pass."""
        return bool(self.stream_layers) and tokens >= self.stream_min_tokens

    def __call__(self, nbytes: float) -> float:
        return self.fixed_s + nbytes / self.bytes_per_s

    def added_after_pass(self, nbytes: float, pass_s: float) -> float:
        """What moving ``nbytes`` of a prompt's KV adds after its pass of ``pass_s`` ends: the
        whole transfer; streamed, the last run of layers', or, where the link is slower than
        the pass writes KV, the part of all the runs' transfers the pass did not cover (each
        run leaves once the pass wrote it and the link is free)."""
        n = self.stream_layers
        if not n:
            return self(nbytes)
        finish, start = 0.0, 0
        for end in run_ends(n, pass_s, self.stream_min_gap_s):
            finish = max(finish, pass_s * end / n) + self(nbytes * (end - start) / n)
            start = end
        return finish - pass_s

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> HandoffFit:
        return cls(
            float(d["fixed_s"]),
            float(d["bytes_per_s"]),
            int(d.get("stream_layers", 0)),
            int(d.get("stream_min_tokens", 0)),
            float(d.get("stream_min_gap_s", 0.0)),
        )


def over_link(local: HandoffFit, gbit_s: float, latency_s: float) -> HandoffFit:
    """The handoff of prefill and decode on different nodes: the local fit's costs, the link's
    latency, and bytes at the slower of the local rate and the link's (``scripts/bench_link.py``
    measured NIXL at 0.96-1.00 of TCP's goodput at 1 Gbit/s, where the link binds)."""
    if gbit_s <= 0 or latency_s < 0:
        raise ValueError("a link needs a positive rate and a latency >= 0")
    return HandoffFit(local.fixed_s + latency_s, min(local.bytes_per_s, gbit_s * 1e9 / 8))


def link_fit(
    rows: Sequence[dict[str, Any]], rate_gbit: float | None, encoding: str = "raw"
) -> HandoffFit:
    """The handoff across nodes fitted to ``splitserve plan link measure`` (or
    ``scripts/bench_link.py --json``) rows of one tc rate (None: an unshaped link) and one
    encoding (``raw`` or ``fp8``; rows without one are raw): their KV ``bytes`` and median
    ``seconds`` (for fp8, encoding included: the fit prices the KV's own bytes)."""
    points = [
        (int(r["bytes"]), float(r["seconds"]))
        for r in rows
        if r["rate_gbit"] == rate_gbit and r.get("encoding", "raw") == encoding
    ]
    if not points:
        have = sorted({f"{r['rate_gbit']} {r.get('encoding', 'raw')}" for r in rows})
        raise ValueError(f"no {encoding} link rows at rate {rate_gbit}; the file has {have}")
    return fit_handoff(points)


def fit_prefill(samples: Sequence[PrefillSample]) -> PrefillFit:
    """Needs samples at three or more (T, S) points, not all on one line (vary the prompt length,
    and the batch at one length, to separate the linear from the quadratic term)."""
    if len(samples) < 3:
        raise ValueError("a prefill fit needs at least 3 samples")
    a, b, c = _lstsq([(1.0, s.tokens, s.sq_tokens) for s in samples], [s.seconds for s in samples])
    return PrefillFit(a, b, c)


def _enough(group: Sequence[DecodeSample]) -> bool:
    return len(group) >= 3 and len({s.batch for s in group}) >= 2


def fit_decode(samples: Sequence[DecodeSample], bounds: Sequence[int] = ()) -> DecodeFit:
    """One linear fit per batch-size range; ``bounds`` are the first batch sizes of the ranges
    after the first (default: one range per measured batch size pair). A range with too few
    samples to fit three terms is merged into a neighbour."""
    batches = sorted({s.batch for s in samples})
    if len(samples) < 3 or len(batches) < 2:
        raise ValueError("a decode fit needs at least 3 samples over 2 batch sizes")
    starts = sorted({1, *bounds}) if bounds else [1, *batches[2::2]]
    groups: list[tuple[int, list[DecodeSample]]] = []
    for i, lo in enumerate(starts):
        hi = starts[i + 1] if i + 1 < len(starts) else None
        groups.append((lo, [s for s in samples if s.batch >= lo and (hi is None or s.batch < hi)]))
    short = [k for k, (_, g) in enumerate(groups) if not _enough(g)]
    while len(groups) > 1 and short:
        j = max(short[0], 1)
        groups[j - 1 : j + 1] = [(groups[j - 1][0], groups[j - 1][1] + groups[j][1])]
        short = [k for k, (_, g) in enumerate(groups) if not _enough(g)]
    ranges = []
    for lo, group in groups:
        if not _enough(group):
            raise ValueError(f"decode range from batch {lo} has too few distinct samples")
        a, b, c = _lstsq([(1.0, s.batch, s.context) for s in group], [s.seconds for s in group])
        ranges.append(DecodeRange(lo, a, b, c))
    return DecodeFit(tuple(ranges))


def fit_handoff(points: Sequence[tuple[int, float]]) -> HandoffFit:
    """``(bytes, seconds)`` pairs at two or more sizes."""
    if len({n for n, _ in points}) < 2:
        raise ValueError("a handoff fit needs at least 2 sizes")
    fixed, per_byte = _lstsq([(1.0, float(n)) for n, _ in points], [s for _, s in points])
    return HandoffFit(max(fixed, 0.0), 1.0 / max(per_byte, 1e-15))
