"""``on_own_thread``: the engine build runs on a thread that is gone when it returns."""

from __future__ import annotations

import threading

import pytest

from splitserve.serving.threads import on_own_thread


def test_runs_on_another_thread_that_has_exited() -> None:
    seen: list[threading.Thread] = []

    def build() -> int:
        seen.append(threading.current_thread())
        return 7

    assert on_own_thread(build) == 7
    assert seen[0] is not threading.current_thread()
    assert not seen[0].is_alive()


def test_the_build_error_is_raised_to_the_caller() -> None:
    def build() -> None:
        raise ValueError("no such checkpoint")

    with pytest.raises(ValueError, match="no such checkpoint"):
        on_own_thread(build)
