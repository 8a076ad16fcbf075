"""``splitserve plan link serve`` and ``measure`` between two network namespaces, as a user runs
them between two hosts: the planner learns a tc-limited link's rate from what they measured."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import netns
import pytest

from splitserve_tools.planner.fit import link_fit

pytest.importorskip("nixl._api", reason="NIXL is not installed (pip install nixl-cu12)")

SPLITSERVE = Path(sys.executable).with_name("splitserve")
RATE_GBIT = 0.2
PORT = 5701


@pytest.fixture
def cluster() -> Iterator[netns.Cluster]:
    if (reason := netns.available()) is not None:
        pytest.skip(reason)
    with netns.Cluster(("prefill0", "decode")) as nodes:
        for node in nodes:
            netns.set_rate(node, RATE_GBIT)
        yield nodes


def test_link_measured_between_two_nodes_gives_its_rate(
    cluster: netns.Cluster, tmp_path: Path
) -> None:
    key = tmp_path / "handle.key"
    key.write_text(os.urandom(32).hex() + "\n")
    key.chmod(0o600)
    env = {**os.environ, "UCX_TLS": "tcp"}
    owner_node, reader_node = cluster["prefill0"], cluster["decode"]
    owner = owner_node.popen(
        [str(SPLITSERVE), "plan", "link", "serve", "--host", owner_node.address,
         "--port", str(PORT), "--key-file", str(key)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        assert owner.stdout is not None
        address = next(
            line.split()[3] for line in owner.stdout if line.startswith("link owner at ")
        )
        assert address == f"tcp://{owner_node.address}:{PORT}"
        out = tmp_path / "link.json"
        done = reader_node.run(
            [str(SPLITSERVE), "plan", "link", "measure", address, "--lengths", "128,1024",
             "--repeats", "3", "--host", reader_node.address, "--key-file", str(key),
             "--out", str(out)],
            env=env, timeout=120,
        )  # fmt: skip
    finally:
        owner.terminate()
        owner.wait(30)
    assert owner.returncode == 0
    assert "handoff across the link" in done.stdout and "--link-json" in done.stdout
    rows = json.loads(out.read_text())
    assert [r["tokens"] for r in rows] == [128, 1024]
    fit = link_fit(rows, None)
    gbit = fit.bytes_per_s * 8 / 1e9
    # tbf at rate R carries ~0.956 R of TCP payload (BENCHMARKS.md, "KV over a link").
    assert 0.8 * RATE_GBIT < gbit < 1.05 * RATE_GBIT, gbit
    assert 0 <= fit.fixed_s < 0.05
