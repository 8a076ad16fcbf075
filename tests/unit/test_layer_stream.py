"""Layer-wise KV streaming: a decode engine pulls each layer as a concurrent prompt pass
announces it, never before, and joins the request once all layers and the first token are in."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from streamed_engine import decode_engine

from splitserve import SamplingParams
from splitserve.engine.build import build_components, scheduler_limits
from splitserve.engine.engine import Engine
from splitserve.engine.prompt_pass import PrefillEngine
from splitserve.engine.request import Request
from splitserve.engine_config import EngineConfig
from splitserve.serving.layer_stream import LayerStream, StreamCounts, StreamStopped

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPT = [256, *range(1, 48)]
"""Whole blocks (3 of 16 tokens): the first token's slot is a block the pull does not fill."""


class PoolCopy:
    """A transport between two in-process pools: ``fetch_layers`` copies the layers asked for
    and records which layers the source had announced by then."""

    def __init__(self, src: torch.Tensor, src_ids: list[int], dst: torch.Tensor) -> None:
        self.src, self.src_ids, self.dst = src, src_ids, dst
        self.announced = 0
        self.reads: list[range] = []
        self.released = 0
        self.fail_at: int | None = None

    def fetch_layers(self, handle: bytes, dst_ids: list[int], layers: range, skip: int = 0) -> None:
        assert layers.stop <= self.announced, f"read {layers} with {self.announced} announced"
        if self.fail_at is not None and self.fail_at in layers:
            raise RuntimeError("link cut")
        self.reads.append(layers)
        span = slice(layers.start, layers.stop)
        self.dst[span, dst_ids] = self.src[span, self.src_ids[skip:]]

    def release(self, handle: bytes) -> None:
        self.released += 1


@pytest.fixture(scope="module")
def parts():
    return build_components(EngineConfig(model="tiny", num_kv_blocks=64, max_model_len=128))


@pytest.fixture
def puller():
    with ThreadPoolExecutor(1) as pool:
        yield pool


def test_layers_are_read_only_once_announced(puller):
    src, dst = torch.randn(4, 3, 2), torch.zeros(4, 3, 2)
    transport = PoolCopy(src, [0, 1], dst)
    counts = StreamCounts()
    stream = LayerStream(transport, b"h", 4, counts)  # type: ignore[arg-type]
    done = stream.start([2, 0], puller)
    for ready in (1, 1, 3, 4):
        transport.announced = ready
        stream.announce(ready)
        time.sleep(0.02)
    done.result(timeout=5)
    assert torch.equal(dst[:, [2, 0]], src[:, [0, 1]])
    assert sum(len(r) for r in transport.reads) == 4 and transport.released == 1
    assert counts.as_dict()["streamed_layers"] == 4 and counts.as_dict()["streamed_requests"] == 1
    assert counts.as_dict()["stream_wait_ns"] > 0
    with pytest.raises(ValueError, match="layers_ready"):
        stream.announce(5)


def test_a_stopped_stream_reads_no_further_and_releases(puller):
    transport = PoolCopy(torch.randn(4, 2), [0], torch.zeros(4, 2))
    stream = LayerStream(transport, b"h", 4)  # type: ignore[arg-type]
    done = stream.start([1], puller)
    transport.announced = 2
    stream.announce(2)
    time.sleep(0.05)
    stream.stop("prefill server died")
    with pytest.raises(StreamStopped, match="died"):
        done.result(timeout=5)
    assert max(r.stop for r in transport.reads) == 2 and transport.released == 1
    never = LayerStream(transport, b"h", 4)  # type: ignore[arg-type]
    never.discard()
    never.discard()
    assert transport.released == 2


def test_a_failed_read_ends_the_pull_with_its_error(puller):
    transport = PoolCopy(torch.randn(4, 2), [0], torch.zeros(4, 2))
    transport.fail_at = 1
    stream = LayerStream(transport, b"h", 4)  # type: ignore[arg-type]
    done = stream.start([1], puller)
    transport.announced = 4
    stream.announce(4)
    with pytest.raises(RuntimeError, match="link cut"):
        done.result(timeout=5)
    assert transport.released == 1


def solo(parts, ids: list[int], params: SamplingParams) -> list[int]:
    cfg = EngineConfig(model="tiny", num_kv_blocks=64)
    engine = Engine(
        parts.model, parts.new_pool(), parts.tokenizer, scheduler_limits(cfg), parts.max_model_len
    )
    engine.add_request("x", ids, params)
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
    return tokens


def streamed(parts, puller, params: SamplingParams, **hold) -> tuple[Engine, list, PoolCopy]:
    """Prefill ``PROMPT`` on a thread while ``decode`` pulls its layers as they are written;
    returns the decode engine (request admitted, first token delivered), its outputs and the
    transport."""
    prefill = PrefillEngine(parts.model, parts.new_pool(), parts.eos_ids, parts.max_model_len)
    decode = decode_engine(parts, puller)
    req = Request("s", PROMPT, params)
    prefill.allocate([req])
    transport = PoolCopy(prefill.runner.pool.tensor, req.block_ids, decode.runner.pool.tensor)
    layers = parts.model.cfg.num_layers
    stream = LayerStream(transport, b"h", layers)  # type: ignore[arg-type]
    decode.add_streaming("s", PROMPT, params, req.seed, stream)
    outputs = decode.step()  # admits it: the pull starts, nothing announced yet
    assert decode.scheduler.pulling and not outputs

    def written(layer: int) -> None:
        transport.announced = layer + 1
        stream.announce(layer + 1)
        time.sleep(hold.get("per_layer_s", 0.0))

    first: list[int] = []
    pass_thread = threading.Thread(target=lambda: first.extend(prefill.run([req], written)))
    pass_thread.start()
    while pass_thread.is_alive():
        outputs += decode.step()
    pass_thread.join()
    out = decode.first_token("s", first[0])
    assert out is not None and out.new_token_ids == first
    assert decode.first_token("s", first[0]) is None or out.finished
    return decode, [out, *outputs], transport


def test_a_streamed_request_decodes_as_if_computed_here(parts, puller):
    decode, outputs, transport = streamed(parts, puller, GREEDY, per_layer_s=0.01)
    assert len(transport.reads) > 1, "layers arrived in more than one read"
    while decode.has_unfinished():
        outputs += decode.step()
    tokens = [t for o in outputs for t in o.new_token_ids]
    assert tokens == solo(parts, PROMPT, GREEDY)
    assert transport.released == 1 and decode.scheduler.allocator.num_used == 0


def test_a_first_token_that_ends_the_request_frees_its_blocks_after_the_pull(parts, puller):
    one = SamplingParams(max_tokens=1, temperature=0.0)
    decode, outputs, transport = streamed(parts, puller, one)
    assert outputs[0].finished and outputs[0].finish_reason == "length"
    while decode.has_unfinished():
        decode.step()
    assert transport.released == 1 and decode.scheduler.allocator.num_used == 0


def test_an_engine_without_a_puller_refuses_a_stream(parts):
    transport = PoolCopy(torch.zeros(1), [], torch.zeros(1))
    stream = LayerStream(transport, b"h", 2)  # type: ignore[arg-type]
    cfg = EngineConfig(model="tiny", num_kv_blocks=64)
    engine = Engine(
        parts.model, parts.new_pool(), parts.tokenizer, scheduler_limits(cfg), parts.max_model_len
    )
    with pytest.raises(ValueError, match="puller"):
        engine.add_streaming("s", PROMPT, GREEDY, 0, stream)
    assert transport.released == 1
