"""The Python backend stubs of a running tritonserver, found through ``/proc``."""

from __future__ import annotations

from pathlib import Path

from splitserve.deploy.process_group import live_group_members

STUB_NAME = "triton_python_backend_stub"
STUB_INSTANCE_ARG = 8


def stub_instances(pgid: int) -> dict[str, int]:
    """Instance name (``llm_0_0``) -> pid of each live Python backend stub in group ``pgid``.

    The stub's command line is: binary, model.py, shm region, shm sizes (2), server pid,
    backend directory, IPC control handle, instance name, runtime.
    """
    stubs = {}
    for pid in live_group_members(pgid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if len(argv) > STUB_INSTANCE_ARG and argv[0].endswith(STUB_NAME):
            stubs[argv[STUB_INSTANCE_ARG]] = pid
    return stubs
