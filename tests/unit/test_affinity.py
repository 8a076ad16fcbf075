"""Core sets: reading and writing them, the allowed cores, moving a process's threads."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from splitserve.deploy.launcher import TritonInstall, TritonServer
from splitserve.deploy.serve import ServeOptions, build_spec
from splitserve.deploy.spec import (
    DeploymentSpec,
    RoleSpec,
    default_cpu_spec,
    default_gpu_spec,
    server_cores,
)
from splitserve.serving.affinity import (
    ALLOWED_CORES_ENV,
    allowed_cores,
    format_cores,
    parse_cores,
    pin_process_threads,
    thread_affinity,
    thread_ids,
)
from splitserve.serving.serving_config import parse_core_sets

FIRST = min(os.sched_getaffinity(0))

THREADED_CHILD = """
import sys, threading, time
stop = threading.Event()
for _ in range(3):
    threading.Thread(target=stop.wait, daemon=True).start()
print("ready", flush=True)
sys.stdin.readline()
threading.Thread(target=stop.wait, daemon=True).start()
print("more", flush=True)
sys.stdin.readline()
"""


@pytest.mark.parametrize(
    ("spec", "cores"), [("0", {0}), ("0-2,5", {0, 1, 2, 5}), (" 3 , 1-2 ", {1, 2, 3})]
)
def test_parse_cores_reads_lists_and_ranges(spec: str, cores: set[int]) -> None:
    assert parse_cores(spec) == cores
    assert parse_cores(format_cores(cores)) == cores


def test_format_cores_joins_runs() -> None:
    assert format_cores({5, 0, 1, 2, 7, 8}) == "0-2,5,7-8"


@pytest.mark.parametrize("spec", ["", "a", "3-1", "-1", "0-x"])
def test_parse_cores_names_what_it_cannot_read(spec: str) -> None:
    with pytest.raises(ValueError, match="core"):
        parse_cores(spec)


def test_core_sets_name_the_cpu_cores_parameter() -> None:
    assert parse_core_sets("0-1;2") == [{0, 1}, {2}]
    with pytest.raises(ValueError, match="cpu_cores"):
        parse_core_sets("0;x")


def test_allowed_cores_come_from_the_launcher_else_the_affinity() -> None:
    assert allowed_cores({ALLOWED_CORES_ENV: "0-3"}) == {0, 1, 2, 3}
    assert allowed_cores({}) == os.sched_getaffinity(0)


def test_every_thread_of_a_process_moves_and_later_threads_follow() -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", THREADED_CHILD],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdin is not None
        assert child.stdout.readline() == "ready\n"
        assert pin_process_threads(child.pid, {FIRST}) == 4
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.stdout.readline() == "more\n"
        tids = thread_ids(child.pid)
        assert len(tids) == 5
        assert all(thread_affinity(child.pid, tid) == {FIRST} for tid in tids)
    finally:
        child.kill()
        child.wait()


def test_a_gone_process_has_no_threads_to_move() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    time.sleep(0.05)
    assert pin_process_threads(child.pid, {FIRST}) == 0


def test_server_threads_default_to_the_prefill_cores_of_a_cpu_layout() -> None:
    settings = {"model": "tiny"}
    assert server_cores(default_cpu_spec("both", settings, cores=4)) == {0, 1}
    assert server_cores(default_cpu_spec("disagg", settings, cores=2)) == {0}
    assert server_cores(default_cpu_spec("colocated", settings, cores=4)) is None
    assert server_cores(default_gpu_spec("disagg", settings)) is None
    two = DeploymentSpec(layout="disagg", settings=settings, prefill=RoleSpec(2, "0;2"))
    assert server_cores(two) == {0, 2}


def test_server_cores_option_overrides_or_turns_off_the_default() -> None:
    spec = default_cpu_spec("disagg", {"model": "tiny"}, cores=2)
    assert server_cores(spec) == {0}
    assert server_cores(replace(spec, server_cores="all")) is None
    assert server_cores(replace(spec, server_cores="1")) == {1}
    # The same through serve's options.
    placed = {"layout": "disagg", "prefill_cores": "0", "decode_cores": "1"}
    assert server_cores(build_spec(ServeOptions(**placed))) == {0}
    assert server_cores(build_spec(ServeOptions(**placed, server_cores="all"))) is None
    assert server_cores(build_spec(ServeOptions(**placed, server_cores="1"))) == {1}
    with pytest.raises(ValueError, match="cannot read server cores"):
        build_spec(ServeOptions(**placed, server_cores="x"))


def test_server_cores_must_be_cores_the_launcher_may_use() -> None:
    install = TritonInstall(binary=Path("/none"), backend_dir=Path("/none"), stub=None)
    outside = max(os.sched_getaffinity(0)) + 1
    with pytest.raises(ValueError, match="server cores"):
        TritonServer(
            "/none",
            http_port=1,
            grpc_port=2,
            metrics_port=3,
            install=install,
            server_cores={outside},
        )
