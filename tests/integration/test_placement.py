"""Where the served processes' threads run: tritonserver's own threads on the prefill cores,
each instance's engine thread on its own cores (``splitserve serve``'s default on CPUs)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from splitserve.deploy.launcher import TritonServer
from splitserve.serving.affinity import ALLOWED_CORES_ENV, parse_cores, thread_affinity, thread_ids
from splitserve.testing.procfs import stub_instances

pytestmark = pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2, reason="needs two cores: prefill on one, decode on another"
)


def affinities(pid: int) -> list[set[int]]:
    return [thread_affinity(pid, tid) for tid in sorted(thread_ids(pid))]


def stub_environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
    return dict(item.split("=", 1) for item in raw.split("\0") if "=" in item)


def test_server_threads_run_on_the_prefill_core_and_stubs_keep_theirs(
    splitserve_server: TritonServer,
) -> None:
    pid = splitserve_server.pid
    assert pid is not None
    assert all(cores == {0} for cores in affinities(pid)), affinities(pid)
    stubs = stub_instances(pid)
    engine_cores = {"llm_0_0": {1}, "prefill_0_0": {0}, "llm_colocated_0_0": {0, 1}}
    assert set(stubs) == set(engine_cores)
    for name, cores in engine_cores.items():
        assert cores in affinities(stubs[name]), (name, affinities(stubs[name]))
        allowed = parse_cores(stub_environ(stubs[name])[ALLOWED_CORES_ENV])
        assert allowed == os.sched_getaffinity(0)
