"""Shutdown drain: the drain file is noticed, and a draining loop ends every request, running or
submitted later, with ``unavailable`` and frees its blocks."""

import time

from test_loop import ListSink, make_loop

from splitserve import SamplingParams
from splitserve.serving.drain import DRAIN_ENV, DrainWatch

LONG = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)


def test_drain_watch_sees_the_file_and_keeps_seeing_it(tmp_path):
    path = tmp_path / "drain"
    watch = DrainWatch({DRAIN_ENV: str(path)}, interval_s=0.0)
    assert not watch.requested()
    path.touch()
    assert watch.requested()
    path.unlink()
    assert watch.requested()
    assert not DrainWatch({}).requested()


def test_draining_loop_fails_running_and_later_requests():
    loop = make_loop()
    loop.start()
    running = ListSink()
    loop.add_request("r", [256, 1, 2], LONG, running)
    deadline = time.monotonic() + 10
    while not running.outputs and time.monotonic() < deadline:
        time.sleep(0.01)
    loop.drain("stopping")
    later = ListSink()
    loop.add_request("l", [256, 3], LONG, later)
    for sink in (running, later):
        assert sink.done.wait(10)
        assert sink.error == "unavailable: stopping"
    loop.stop()
    assert loop.draining and not loop.engine.has_unfinished()
    assert loop.engine.scheduler.allocator.num_used == 0
