"""Request deadlines without Triton: ``timeout``/``deadline_ms`` parsing, the server default, and
the engine loop ending requests past their deadline wherever they are; and the seed range."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
from test_loop import ListSink

from splitserve import SamplingParams
from splitserve.engine.build import build_components, scheduler_limits
from splitserve.engine.engine import Engine
from splitserve.engine.sampling_params import SEED_MAX
from splitserve.engine_config import EngineConfig
from splitserve.serving.frontend import prepare
from splitserve.serving.inputs import InputError, parse_generate
from splitserve.serving.loop import TIMED_OUT, EngineLoop
from splitserve.serving.serving_config import ServingConfig

LONG = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
STEP_S = 0.005
"""Each engine step takes at least this long, so that a long request outlives short deadlines."""


def sampling(**values: Any) -> dict[str, np.ndarray]:
    return {
        "text_input": np.array([b"hi"], dtype=object),
        "sampling_parameters": np.array([json.dumps(values).encode()], dtype=object),
    }


@pytest.mark.parametrize(
    ("values", "seconds"),
    [({}, None), ({"timeout": 2.5}, 2.5), ({"timeout": 3}, 3.0), ({"deadline_ms": 1500}, 1.5)],
)
def test_timeout_and_deadline_ms_give_the_request_seconds(
    values: dict[str, Any], seconds: float | None
) -> None:
    assert parse_generate(sampling(**values)).timeout_s == seconds


def test_timeout_given_as_a_string_is_read_like_other_numbers() -> None:
    assert parse_generate(sampling(timeout="0.25")).timeout_s == 0.25
    assert parse_generate(sampling(deadline_ms="40")).timeout_s == 0.04


@pytest.mark.parametrize(
    ("values", "field"),
    [
        ({"timeout": 0}, "timeout"),
        ({"timeout": -1.0}, "timeout"),
        ({"timeout": float("inf")}, "timeout"),
        ({"timeout": float("nan")}, "timeout"),
        ({"timeout": 10**400}, "timeout"),
        ({"timeout": True}, "timeout"),
        ({"timeout": "soon"}, "timeout"),
        ({"timeout": [1]}, "timeout"),
        ({"deadline_ms": 0}, "deadline_ms"),
        ({"deadline_ms": 2.5}, "deadline_ms"),
        ({"deadline_ms": -100}, "deadline_ms"),
        ({"deadline_ms": 10**400}, "deadline_ms"),
        ({"timeout": 1, "deadline_ms": 1000}, "not both"),
    ],
)
def test_bad_deadlines_name_the_field(values: dict[str, Any], field: str) -> None:
    with pytest.raises(InputError, match=field):
        parse_generate(sampling(**values))


class Bytes:
    """A tokenizer stand-in: one token per byte."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode())


def test_deadline_counts_from_arrival_and_the_server_default_fills_in() -> None:
    def deadline(inputs: dict[str, np.ndarray], default_s: float | None) -> float | None:
        return prepare(inputs, Bytes(), 64, 4, default_s, 100.0).deadline  # type: ignore[arg-type]

    assert deadline(sampling(), None) is None
    assert deadline(sampling(), 30.0) == 130.0
    assert deadline(sampling(timeout=2.0), None) == 102.0
    assert deadline(sampling(deadline_ms=500), 30.0) == 100.5


@pytest.mark.parametrize("value", [0.0, -1.0, float("inf"), float("nan")])
def test_server_request_timeout_must_be_positive_and_finite(value: float) -> None:
    with pytest.raises(ValueError, match="request_timeout_s"):
        ServingConfig(role="colocated", request_timeout_s=value)
    assert ServingConfig(role="colocated", request_timeout_s=0.5).request_timeout_s == 0.5


@pytest.mark.parametrize(
    "inputs",
    [
        sampling(seed=2**64),
        sampling(seed=-1),
        {"text_input": np.array([b"hi"], dtype=object), "seed": np.array([-1], np.int64)},
    ],
    ids=["json-2**64", "json-negative", "tensor-negative"],
)
def test_seeds_outside_the_uint64_range_are_refused_naming_seed(
    inputs: dict[str, np.ndarray],
) -> None:
    with pytest.raises(InputError, match="seed"):
        parse_generate(inputs)


def test_seed_range_ends_are_accepted() -> None:
    assert parse_generate(sampling(seed=0)).params.seed == 0
    assert parse_generate(sampling(seed=SEED_MAX)).params.seed == SEED_MAX
    random_seed = {"random_seed": np.array([SEED_MAX], np.uint64)}
    assert parse_generate(sampling() | random_seed).params.seed == SEED_MAX


@contextmanager
def slow_step(_size: int) -> Iterator[None]:
    yield
    time.sleep(STEP_S)


def running_loop(max_num_seqs: int = 8) -> EngineLoop:
    cfg = EngineConfig(model="tiny", num_kv_blocks=64, max_model_len=128, max_num_seqs=max_num_seqs)
    parts = build_components(cfg)
    engine = Engine(
        parts.model, parts.new_pool(), parts.tokenizer, scheduler_limits(cfg), parts.max_model_len
    )
    loop = EngineLoop(engine, cancel_poll_s=0.0, around_step=slow_step)
    loop.start()
    return loop


def timed_out(sink: ListSink) -> bool:
    return sink.error == f"unavailable: {TIMED_OUT}"


def test_decoding_request_ends_at_its_deadline_and_frees_its_blocks() -> None:
    loop = running_loop()
    timed, free = ListSink(), ListSink()
    started = time.monotonic()
    loop.add_request("timed", [256, 1, 2], LONG, timed, deadline=started + 0.2)
    loop.add_request("free", [256, 3, 4], LONG, free)
    assert timed.done.wait(10) and free.done.wait(10)
    loop.stop()
    assert timed_out(timed) and 0 < len(timed.tokens) < LONG.max_tokens
    assert time.monotonic() - started >= 0.2
    assert free.error is None and len(free.tokens) == LONG.max_tokens
    assert loop.engine.scheduler.allocator.num_used == 0 and not loop.engine.has_unfinished()
    assert loop.num_active == 0


def test_queued_request_ends_at_its_deadline_before_it_runs() -> None:
    loop = running_loop(max_num_seqs=1)
    first, queued = ListSink(), ListSink()
    loop.add_request("first", [256, 1], LONG, first)
    loop.add_request("queued", [256, 2], LONG, queued, deadline=time.monotonic() + 0.1)
    assert queued.done.wait(10)
    assert timed_out(queued) and queued.tokens == []
    assert first.done.wait(10)
    loop.stop()
    assert loop.engine.scheduler.allocator.num_used == 0


class Source:
    """A handed-over request's KV; records whether it was loaded or discarded."""

    def __init__(self) -> None:
        self.loaded = False
        self.discarded = False

    def load(self, dst_block_ids: list[int], skip: int = 0) -> None:
        self.loaded = True

    def discard(self) -> None:
        self.discarded = True


def test_handed_over_request_waiting_for_blocks_ends_at_its_deadline_and_discards_its_kv() -> None:
    loop = running_loop(max_num_seqs=1)
    first, waiting, source = ListSink(), ListSink(), Source()
    loop.add_request("first", [256, 1], LONG, first)
    while not first.outputs:  # running: the one batch slot is taken
        time.sleep(STEP_S)
    deadline = time.monotonic() + 0.1
    loop.add_prefilled("waiting", [256, 2], LONG, 7, 1, source, waiting, deadline)
    assert waiting.done.wait(10)
    assert timed_out(waiting) and waiting.tokens == [7]
    assert source.discarded and not source.loaded
    assert first.done.wait(10)
    loop.stop()
    assert loop.engine.scheduler.allocator.num_used == 0


def test_finished_request_leaves_no_deadline_behind() -> None:
    loop = running_loop()
    sink = ListSink()
    short = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    loop.add_request("short", [256, 1], short, sink, deadline=time.monotonic() + 60)
    assert sink.done.wait(10)
    loop.stop()
    assert sink.error is None and loop._deadlines == {}
