"""Which cores a process may use, and moving another process's threads onto a core set (Linux).

The launcher can pin tritonserver's own threads (HTTP/gRPC front ends, the Python backend's
threads) to a few cores after start-up, so that they stop waking beside a decode engine thread
(docs/bench/HISTORY.md, "tritonserver's threads on the prefill cores"). A stub Triton starts
after that (a restart) inherits the narrowed affinity, so the launcher also names, in
``SPLITSERVE_ALLOWED_CORES``, the cores the instances may use; ``allowed_cores`` reads it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path

ALLOWED_CORES_ENV = "SPLITSERVE_ALLOWED_CORES"
PIN_ROUNDS = 5
"""Passes over a process's threads: one made during a pass is caught by the next."""


def format_cores(cores: Iterable[int]) -> str:
    """``{0, 1, 2, 5}`` -> ``"0-2,5"``."""
    ranges: list[list[int]] = []
    for core in sorted(set(cores)):
        if ranges and core == ranges[-1][1] + 1:
            ranges[-1][1] = core
        else:
            ranges.append([core, core])
    return ",".join(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in ranges)


def parse_ranges(spec: str, noun: str) -> set[int]:
    """``"0-2,5"`` -> ``{0, 1, 2, 5}`` (core or GPU ids); ValueError naming ``spec``."""
    ids: set[int] = set()
    for item in filter(None, (part.strip() for part in spec.split(","))):
        lo, _, hi = item.partition("-")
        try:
            first, last = int(lo), int(hi or lo)
        except ValueError:
            raise ValueError(f"cannot read {noun} {spec!r} (e.g. '0', '0,2' or '0-3')") from None
        if first < 0 or last < first:
            raise ValueError(f"bad range {item!r} of {noun} in {spec!r}")
        ids.update(range(first, last + 1))
    if not ids:
        raise ValueError(f"no {noun} in {spec!r}")
    return ids


def parse_cores(spec: str) -> set[int]:
    return parse_ranges(spec, "cores")


def allowed_cores(environ: Mapping[str, str] | None = None) -> set[int]:
    """The cores this process's instances may use: the launcher's ``SPLITSERVE_ALLOWED_CORES``
    where set, else this thread's affinity."""
    env = os.environ if environ is None else environ
    spec = env.get(ALLOWED_CORES_ENV)
    return parse_cores(spec) if spec else os.sched_getaffinity(0)


def thread_ids(pid: int) -> set[int]:
    """The ids of the threads of process ``pid`` alive a moment ago."""
    try:
        return {int(name) for name in os.listdir(f"/proc/{pid}/task")}
    except FileNotFoundError:
        return set()


def thread_affinity(pid: int, tid: int) -> set[int]:
    """The cores thread ``tid`` of process ``pid`` may run on."""
    status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
    line = next(row for row in status.splitlines() if row.startswith("Cpus_allowed_list:"))
    return parse_cores(line.split(":", 1)[1])


def pin_process_threads(pid: int, cores: set[int]) -> int:
    """Restrict every thread of process ``pid`` (not its child processes) to ``cores``; threads
    it makes later inherit the set from their maker. Returns how many threads were moved."""
    done: set[int] = set()
    for _ in range(PIN_ROUNDS):
        todo = thread_ids(pid) - done
        if not todo:
            break
        for tid in todo:
            try:
                os.sched_setaffinity(tid, cores)
            except ProcessLookupError:
                continue
            done.add(tid)
    return len(done)
