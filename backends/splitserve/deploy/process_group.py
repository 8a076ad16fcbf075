"""What a tritonserver's process group holds, read from ``/proc``: its live members and the
``/dev/shm`` files they own (removed after a stop, when a killed stub could not)."""

from __future__ import annotations

from pathlib import Path

SHM_REGION_PREFIX = "triton_python_backend_shm_region_"
OPENMP_SHM = "__KMP_REGISTERED_LIB_{pid}_*"


def stub_shm_regions(pids: list[int]) -> list[Path]:
    """The /dev/shm regions named on the command lines of Python backend stubs among `pids`."""
    regions = []
    for pid in pids:
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        regions += [Path("/dev/shm") / arg for arg in argv if arg.startswith(SHM_REGION_PREFIX)]
    return regions


def openmp_registrations(pids: list[int]) -> list[Path]:
    """The ``/dev/shm`` files the OpenMP runtime of torch registers per process among ``pids``;
    a process killed with SIGKILL leaves its own behind."""
    return [path for pid in pids for path in Path("/dev/shm").glob(OPENMP_SHM.format(pid=pid))]


def live_group_members(pgid: int) -> list[int]:
    """Pids of the non-zombie processes in process group `pgid` (Linux /proc)."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(entry.name))
    return members
