"""The Grafana dashboard asks only for metrics that the models publish."""

import json
import re
from pathlib import Path

from splitserve.serving.stats import COUNTERS, ERRORS, GAUGES, HISTOGRAMS, PREFIX

DASHBOARD = Path(__file__).resolve().parents[2] / "scripts" / "grafana" / "splitserve.json"


def published() -> set[str]:
    names = {*GAUGES, *COUNTERS, ERRORS[0]}
    for name, _, _ in HISTOGRAMS.values():
        names |= {f"{name}_bucket", f"{name}_count", f"{name}_sum"}
    return {PREFIX + name for name in names}


def test_dashboard_queries_published_metrics():
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {name for expr in exprs for name in re.findall(r"splitserve_\w+", expr)}
    assert used and used <= published(), used - published()
    assert {f"{PREFIX}{h[0]}_bucket" for h in HISTOGRAMS.values()} <= used
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
