"""A short run of ``scripts/soak.py`` against the session's server: every request ends, and no
block, lease or queued request is left on any instance. (RSS is not judged: too short a run to
warm up.)"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from splitserve.deploy.launcher import TritonServer

pytestmark = pytest.mark.triton

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "soak.py"


def load_soak() -> ModuleType:
    spec = importlib.util.spec_from_file_location("soak", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_short_soak(splitserve_server: TritonServer) -> None:
    report = load_soak().soak(
        splitserve_server, requests=300, concurrency=32, timeout_s=60.0, peak_warmup=False
    )
    print(report.table())
    assert not report.tally.unexpected, report.table()
    assert sum(report.tally.ended.values()) == 300
    kinds = {kind for _, kind, _ in report.tally.ended}
    assert kinds == {"normal", "cancel", "malformed"}
    held = [v for values in report.held.values() for v in values.values()]
    assert held and not any(held), report.table()
    assert set(report.held) == set(report.rss_before), report.table()
