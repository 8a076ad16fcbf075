"""Removal of shm segments and socket files when a process ends without closing its transports.

At interpreter exit every live transport is closed. On SIGTERM the tracked files are unlinked and
the signal is re-raised with its default action; the handler is installed only from the main
thread and only over the default action. (Inside a Triton stub the main thread waits in C++, so
a Python handler never runs there: stubs clean up in ``finalize`` and at exit.) A forked child
forgets what its parent tracks.

SIGKILL leaves files behind. Their names carry the owner's pid namespace and pid
(``owned_name``: ``splitserve-<pid namespace>-<owner pid>-<hex>``, where a KV pool's hex is its
id, see ``pool_name``, and a release socket's ends in ``.sock``), so crash recovery can tell them
apart: ``sweep_dead_owners`` removes this user's files whose owner process is gone. Transports sweep
their directories when they create files, the launcher after its server stopped.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import signal
import threading
import weakref
from pathlib import Path
from typing import Protocol


class _Closable(Protocol):
    def close(self) -> None: ...


OWNED_NAME = re.compile(r"^splitserve-(\d+)-(\d+)-[0-9a-f]+(\.sock)?$")
"""A name from ``owned_name``: ``splitserve-<pid namespace>-<owner pid>-<hex>``, a socket's
with ``.sock``."""

_paths: set[Path] = set()
_live: weakref.WeakSet[_Closable] = weakref.WeakSet()
_installed = False


def track(path: Path) -> None:
    _install()
    _paths.add(path)


def untrack(path: Path) -> None:
    _paths.discard(path)


def close_at_exit(obj: _Closable) -> None:
    _install()
    _live.add(obj)


def _unlink_all() -> None:
    for path in tuple(_paths):
        with contextlib.suppress(OSError):
            path.unlink()
        _paths.discard(path)


def _at_exit() -> None:
    for obj in tuple(_live):
        with contextlib.suppress(Exception):
            obj.close()
    _unlink_all()


def _forget() -> None:
    _paths.clear()
    _live.clear()


def _on_signal(signum: int, frame: object) -> None:
    _unlink_all()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _install() -> None:
    global _installed
    if _installed:
        return
    _installed = True
    atexit.register(_at_exit)
    os.register_at_fork(after_in_child=_forget)
    main = threading.current_thread() is threading.main_thread()
    if main and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _on_signal)


def pid_namespace() -> int:
    """This process's pid namespace (its inode): pids mean something only within it."""
    return os.stat("/proc/self/ns/pid").st_ino


def owned_name(
    token: str, suffix: str = "", pid: int | None = None, namespace: int | None = None
) -> str:
    """``splitserve-<pid namespace>-<pid>-<token><suffix>``: a name that says who owns it."""
    namespace = pid_namespace() if namespace is None else namespace
    return f"splitserve-{namespace}-{os.getpid() if pid is None else pid}-{token}{suffix}"


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` is a running process (a zombie counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2 :].split()[0] != "Z"


def sweep_dead_owners(directory: str | os.PathLike[str]) -> list[Path]:
    """Crash recovery: remove this user's ``splitserve-<ns>-<pid>-*`` files in ``directory``
    whose owner process is gone (killed with SIGKILL, so it could not unlink them). Files made
    in another pid namespace (another container sharing ``/dev/shm``) are left alone: their pids
    cannot be checked from here. Returns what it removed."""
    removed: list[Path] = []
    uid = os.geteuid()
    namespace = pid_namespace()
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return removed
    for entry in entries:
        match = OWNED_NAME.match(entry.name)
        if match is None or int(match.group(1)) != namespace or pid_alive(int(match.group(2))):
            continue
        try:
            if entry.stat(follow_symlinks=False).st_uid != uid:
                continue
            os.unlink(entry.path)
        except OSError:
            continue
        removed.append(Path(entry.path))
    return removed
