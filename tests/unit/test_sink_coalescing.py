"""The sink's send path (pure logic, with a stand-in for the stub-only
``triton_python_backend_utils``): a stream the sender thread has fallen behind on gets one
response with the tokens that piled up, in order, the last one FINAL with the token count."""

from __future__ import annotations

import sys
import threading
import types
from collections.abc import Iterator
from typing import Any

import pytest

from splitserve.engine.output import RequestOutput
from splitserve.engine.sampling_params import SamplingParams
from splitserve.serving.inputs import GenerateRequest
from splitserve.serving.stats import InstanceStats

FINAL_FLAG = 1


@pytest.fixture()
def sink_module(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    pb = types.ModuleType("triton_python_backend_utils")
    pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL = FINAL_FLAG  # type: ignore[attr-defined]
    pb.Tensor = lambda name, value: (name, value)  # type: ignore[attr-defined]
    pb.InferenceResponse = lambda output_tensors=None, error=None: (output_tensors, error)  # type: ignore[attr-defined]
    pb.TritonError = type("TritonError", (), {"INTERNAL": 13, "INVALID_ARG": 3})  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", pb)
    built = ("splitserve.triton.sink", "splitserve.triton.tensors")
    for name in built:
        monkeypatch.delitem(sys.modules, name, raising=False)
    import splitserve.triton.sink as sink

    yield sink
    for name in built:  # built on the stand-in: no later test may import them from here
        sys.modules.pop(name, None)


class Sender:
    """Records responses; the first send blocks until ``go`` is set (a busy sender thread)."""

    def __init__(self) -> None:
        self.go = threading.Event()
        self.entered = threading.Event()
        self.sent: list[tuple[Any, int]] = []
        self.done = threading.Event()

    def send(self, response: Any = None, flags: int = 0) -> None:
        self.entered.set()
        self.go.wait(10)
        self.sent.append((response, flags))
        if flags & FINAL_FLAG:
            self.done.set()


def output(i: int, last: bool) -> RequestOutput:
    return RequestOutput("r", [i], f"t{i} ", last, "length" if last else None, 3, i + 1)


def texts(sent: list[tuple[Any, int]]) -> list[str]:
    out = []
    for response, _ in sent:
        tensors = dict(response[0])
        out.append(tensors["text_output"][0].decode())
    return out


def gen(stream: bool) -> GenerateRequest:
    return GenerateRequest("p", SamplingParams(max_tokens=6), stream, False, True, True, True)


def test_tokens_that_wait_for_the_sender_go_out_together(sink_module: Any) -> None:
    thread, sender = sink_module.SenderThread(), Sender()
    sink = sink_module.TritonSink(sender, gen(True), thread, InstanceStats(), 0.0)
    sink.send(output(0, False))
    assert sender.entered.wait(10)  # the sender thread is busy sending the first token
    for i in range(1, 6):
        sink.send(output(i, i == 5))
    sender.go.set()
    assert sender.done.wait(10)
    thread.stop()
    assert texts(sender.sent) == ["t0 ", "t1 t2 t3 t4 t5 "]
    assert [flags for _, flags in sender.sent] == [0, FINAL_FLAG]
    final = dict(sender.sent[-1][0][0])
    assert int(final["num_output_tokens"][0]) == 6


def test_a_sender_that_keeps_up_sends_a_response_per_token(sink_module: Any) -> None:
    thread, sender = sink_module.SenderThread(), Sender()
    sender.go.set()
    sink = sink_module.TritonSink(sender, gen(True), thread, InstanceStats(), 0.0)
    for i in range(3):
        before = len(sender.sent)
        sink.send(output(i, i == 2))
        for _ in range(1000):
            if len(sender.sent) > before:
                break
            threading.Event().wait(0.005)
    thread.stop()
    assert texts(sender.sent) == ["t0 ", "t1 ", "t2 "]


def test_cancel_after_queued_tokens_ends_with_an_empty_final(sink_module: Any) -> None:
    thread, sender = sink_module.SenderThread(), Sender()
    sink = sink_module.TritonSink(sender, gen(True), thread, InstanceStats(), 0.0)
    sink.send(output(0, False))
    assert sender.entered.wait(10)
    sink.send(output(1, False))
    sink.send(output(2, False))
    sink.cancel()
    sender.go.set()
    assert sender.done.wait(10)
    thread.stop()
    assert texts(sender.sent[:-1]) == ["t0 ", "t1 t2 "]
    assert [flags for _, flags in sender.sent] == [0, 0, FINAL_FLAG]
    assert sender.sent[-1][0] is None
