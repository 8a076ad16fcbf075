"""Results as JSON and PNG plots (attainment vs rate, TTFT/TPOT CDFs, SLO scale)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from splitserve_tools.bench.goodput import Probe
from splitserve_tools.bench.metrics import failed
from splitserve_tools.workload.slo import SLO


@dataclass(frozen=True)
class TargetResult:
    target: str
    probes: list[Probe]
    goodput_rps: float | None = None
    """None when no goodput search ran (a single fixed rate)."""
    slo_scales: dict[float, float] = field(default_factory=dict)
    """Attainment of ``main`` per SLO scale; empty when no sweep was asked for."""

    @property
    def main(self) -> Probe:
        """The probe the CDFs and the SLO-scale sweep describe: the one at the goodput, else the
        lowest rate probed."""
        for p in self.probes:
            if p.rate == self.goodput_rps:
                return p
        return min(self.probes, key=lambda p: p.rate)


def _clean(value: Any) -> Any:
    """NaN/inf -> null, so the file is strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


def _run_entry(result: TargetResult, p: Probe, workload: str, slo: SLO) -> dict[str, Any]:
    return {
        "target": result.target,
        "workload": workload,
        "rate": p.rate,
        "duration_s": p.duration_s,
        **p.summary.flat(),
        "meets_attainment": p.summary.attainment >= slo.attainment,
        "requests": [
            {
                "input_len": req.input_len,
                "output_len": req.output_len,
                "turn": req.turn,
                "output_tokens": rec.output_tokens,
                "ttft": rec.ttft,
                "tpot": rec.tpot,
                "e2e": rec.e2e,
                "error": rec.error,
            }
            for req, rec in zip(p.requests, p.records, strict=True)
        ],
    }


def build_report(
    results: Sequence[TargetResult],
    *,
    workload: str,
    slo: SLO,
    config: dict[str, Any],
) -> dict[str, Any]:
    runs = [_run_entry(r, p, workload, slo) for r in results for p in r.probes]
    summary = [
        {
            "target": r.target,
            "workload": workload,
            "goodput_rps": r.goodput_rps,
            "rate": r.main.rate,
            "attainment": r.main.summary.attainment,
            **{k: v for k, v in r.main.summary.flat().items() if k != "attainment"},
            "probed_rates": [p.rate for p in r.probes],
            "slo_scale": [{"scale": s, "attainment": a} for s, a in r.slo_scales.items()],
        }
        for r in results
    ]
    return _clean(
        {
            "config": config,
            "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s, "attainment": slo.attainment},
            "runs": runs,
            "summary": summary,
        }
    )


def write_json(report: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1, allow_nan=False) + "\n")


def write_plots(results: Sequence[TargetResult], slo: SLO, out_dir: Path) -> list[Path]:
    """attainment_vs_rate.png, ttft_cdf.png, tpot_cdf.png (and slo_scale.png after a sweep)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in results:
        probes = sorted(r.probes, key=lambda p: p.rate)
        ax.plot(
            [p.rate for p in probes], [p.summary.attainment for p in probes], "o-", label=r.target
        )
    ax.axhline(slo.attainment, color="grey", ls="--", lw=1)
    ax.set(
        xlabel="rate (req/s)",
        ylabel="SLO attainment",
        ylim=(-0.02, 1.02),
        title=f"TTFT ≤ {slo.ttft_s * 1e3:g} ms and TPOT ≤ {slo.tpot_s * 1e3:g} ms",
    )
    ax.legend()
    written.append(_save(fig, out_dir / "attainment_vs_rate.png"))

    for metric, limit in (("ttft", slo.ttft_s), ("tpot", slo.tpot_s)):
        fig, ax = plt.subplots(figsize=(6, 4))
        for r in results:
            values = sorted(getattr(rec, metric) * 1e3 for rec in r.main.records if not failed(rec))
            values = [v for v in values if math.isfinite(v)]
            if values:
                ys = [(i + 1) / len(r.main.records) for i in range(len(values))]
                ax.step(values, ys, where="post", label=f"{r.target} @ {r.main.rate:.3g} req/s")
        ax.axvline(limit * 1e3, color="grey", ls="--", lw=1)
        ax.set(xlabel=f"{metric.upper()} (ms)", ylabel="fraction of requests", ylim=(0, 1.02))
        ax.legend()
        written.append(_save(fig, out_dir / f"{metric}_cdf.png"))

    if any(r.slo_scales for r in results):
        fig, ax = plt.subplots(figsize=(6, 4))
        for r in results:
            if r.slo_scales:
                scales = sorted(r.slo_scales)
                ax.plot(
                    scales,
                    [r.slo_scales[s] for s in scales],
                    "o-",
                    label=f"{r.target} @ {r.main.rate:.3g} req/s",
                )
        ax.axhline(slo.attainment, color="grey", ls="--", lw=1)
        ax.set(xlabel="SLO scale", ylabel="SLO attainment", ylim=(-0.02, 1.02))
        ax.legend()
        written.append(_save(fig, out_dir / "slo_scale.png"))
    return written


def _save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
