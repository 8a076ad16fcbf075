"""Removal of shm segments and socket files when a process ends without closing its transports.

At interpreter exit every live transport is closed. On SIGTERM (Triton stopping a stub, a
launcher's kill) the tracked files are unlinked and the signal is re-raised with its default
action; the handler is installed only from the main thread and only over the default action.
A forked child forgets what its parent tracks. SIGKILL leaves files behind: their names start
with ``splitserve-``.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import threading
import weakref
from pathlib import Path
from typing import Protocol


class _Closable(Protocol):
    def close(self) -> None: ...


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
