"""The OpenAI-compatible frontend on a real tritonserver, driven by the official ``openai`` SDK:
completions and chat, streamed and not, equal to what gRPC to Triton gives; usage counts; the
sampling fields; error objects and status codes; a client that disconnects frees its KV blocks;
``splitserve bench`` measures it."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from llm_client import (
    MAX_MODEL_LEN,
    Generation,
    GrpcStream,
    gauges,
    generate_inputs,
    stub_pid,
    wait_for,
)

from splitserve.deploy.launcher import TritonServer, free_ports
from splitserve.deploy.spec import DeploymentSpec
from splitserve.openai.options import OpenAIOptions
from splitserve.openai.server import BackgroundFrontend
from splitserve.tokenizer import load_tokenizer
from splitserve_tools.bench.main import BenchOptions, bench

pytestmark = pytest.mark.triton

NAME = "splitserve-test"
PROMPT = "The old lighthouse keeper climbed the spiral stairs"
MAX_TOKENS = 24
GREEDY: dict[str, Any] = {"temperature": 0.0, "max_tokens": MAX_TOKENS}
IGNORE_EOS = {"ignore_eos": True}
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}"
    "{% endif %}"
    "{{ message['role'] }}: {{ message['content'] }}<|eot_id|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
MESSAGES = [
    {"role": "system", "content": "You keep lighthouses."},
    {"role": "user", "content": [{"type": "text", "text": "Tell me about the spiral stairs."}]},
]
CHAT_PROMPT = (
    "system: You keep lighthouses.<|eot_id|>"
    "user: Tell me about the spiral stairs.<|eot_id|>assistant:"
)
"""``MESSAGES`` rendered, without the BOS text (the server's tokenizer adds BOS)."""
POOLS = ("llm", "prefill")
CANCEL_STOP_S = 2.0
IDLE_S = 10.0


@pytest.fixture(scope="module")
def frontend_dir(serve_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The served checkpoint's tokenizer files, and a chat template (the random checkpoints
    have none)."""
    out = tmp_path_factory.mktemp("frontend_ckpt")
    for name in ("tokenizer.json", "config.json", "generation_config.json"):
        shutil.copy(serve_ckpt / name, out / name)
    config = json.loads((serve_ckpt / "tokenizer_config.json").read_text())
    assert "chat_template" not in config
    config["chat_template"] = CHAT_TEMPLATE
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def start_frontend(
    triton_url: str, triton_model: str, model_dir: Path | None, **options: Any
) -> BackgroundFrontend:
    (port,) = free_ports(1)
    opts = OpenAIOptions(
        triton_url=triton_url,
        host="127.0.0.1",
        port=port,
        triton_model=triton_model,
        served_model_name=NAME,
        model_dir=model_dir,
        **options,
    )
    return BackgroundFrontend(opts).start()


@pytest.fixture(scope="module", params=["llm", "llm_colocated"])
def frontend(
    request: pytest.FixtureRequest, splitserve_server: TritonServer, frontend_dir: Path
) -> Iterator[BackgroundFrontend]:
    """A frontend in front of the session's server: ``llm`` (disaggregated) or ``llm_colocated``;
    the context length comes from the Triton model's config."""
    running = start_frontend(splitserve_server.grpc_url, request.param, frontend_dir)
    yield running
    running.stop()


def base_url(frontend: BackgroundFrontend) -> str:
    return f"http://127.0.0.1:{frontend.options.port}/v1"


@pytest.fixture(scope="module")
def client(frontend: BackgroundFrontend) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url(frontend), api_key="unused", max_retries=0)


def grpc_generate(server: TritonServer, model: str, prompt: str, **sampling: Any) -> Generation:
    with GrpcStream(server.grpc_url) as stream:
        return stream.generate(model, generate_inputs(prompt, stream=True, sampling=sampling))


def test_models(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [NAME]
    assert client.models.retrieve(NAME).owned_by == "splitserve"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


@pytest.mark.parametrize("stream", [False, True])
def test_completion_equals_grpc(
    client: openai.OpenAI,
    frontend: BackgroundFrontend,
    splitserve_server: TritonServer,
    serve_ckpt: Path,
    stream: bool,
) -> None:
    expected = grpc_generate(
        splitserve_server, frontend.options.triton_model, PROMPT, **GREEDY, **IGNORE_EOS
    )
    kwargs: dict[str, Any] = {"model": NAME, "prompt": PROMPT, **GREEDY, "extra_body": IGNORE_EOS}
    if stream:
        chunks = list(
            client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
        )
        *texts, last = chunks
        assert last.choices == [] and last.usage is not None
        assert all(c.usage is None for c in texts)
        text = "".join(c.choices[0].text for c in texts)
        reason = texts[-1].choices[0].finish_reason
        usage = last.usage
    else:
        answer = client.completions.create(**kwargs)
        assert answer.object == "text_completion" and answer.model == NAME
        text, reason, usage = answer.choices[0].text, answer.choices[0].finish_reason, answer.usage
        assert usage is not None
    assert text == expected.text
    assert reason == "length" == expected.finish_reason
    prompt_tokens = len(load_tokenizer(serve_ckpt).encode(PROMPT))
    assert (usage.prompt_tokens, usage.completion_tokens) == (prompt_tokens, MAX_TOKENS)
    assert usage.total_tokens == prompt_tokens + MAX_TOKENS
    assert expected.num_input_tokens == prompt_tokens


def test_completion_echo(client: openai.OpenAI) -> None:
    plain = client.completions.create(model=NAME, prompt=PROMPT, **GREEDY)
    echoed = client.completions.create(model=NAME, prompt=[PROMPT], echo=True, **GREEDY)
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text


@pytest.mark.parametrize("stream", [False, True])
def test_chat_equals_grpc(
    client: openai.OpenAI,
    frontend: BackgroundFrontend,
    splitserve_server: TritonServer,
    stream: bool,
) -> None:
    expected = grpc_generate(
        splitserve_server, frontend.options.triton_model, CHAT_PROMPT, **GREEDY, **IGNORE_EOS
    )
    kwargs: dict[str, Any] = {
        "model": NAME,
        "messages": MESSAGES,
        **GREEDY,
        "extra_body": IGNORE_EOS,
    }
    if stream:
        chunks = list(client.chat.completions.create(**kwargs, stream=True))
        assert chunks[0].choices[0].delta.role == "assistant"
        assert all(c.object == "chat.completion.chunk" and c.usage is None for c in chunks)
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        reason = chunks[-1].choices[0].finish_reason
    else:
        answer = client.chat.completions.create(**kwargs)
        assert answer.choices[0].message.role == "assistant"
        text, reason = answer.choices[0].message.content, answer.choices[0].finish_reason
        assert answer.usage is not None
        assert answer.usage.prompt_tokens == expected.num_input_tokens
        assert answer.usage.completion_tokens == MAX_TOKENS
    assert text == expected.text
    assert reason == "length"


def test_chat_max_completion_tokens_and_stop(client: openai.OpenAI) -> None:
    full = client.chat.completions.create(
        model=NAME, messages=MESSAGES, max_completion_tokens=MAX_TOKENS, temperature=0.0
    )
    text = full.choices[0].message.content or ""
    assert full.usage is not None and 0 < full.usage.completion_tokens <= MAX_TOKENS
    stop = text[len(text) // 2 :][:3]
    assert stop.strip(), text
    cut = client.chat.completions.create(
        model=NAME, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0.0, stop=[stop]
    )
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == text[: text.index(stop)]


def test_seed_and_vllm_sampling_fields(client: openai.OpenAI) -> None:
    sampled = [
        client.completions.create(
            model=NAME,
            prompt=PROMPT,
            max_tokens=MAX_TOKENS,
            temperature=1.0,
            top_p=0.9,
            seed=7,
            extra_body={"top_k": 50, "ignore_eos": True},
        )
        .choices[0]
        .text
        for _ in range(2)
    ]
    assert sampled[0] == sampled[1]
    answer = client.completions.create(
        model=NAME,
        prompt=PROMPT,
        max_tokens=8,
        temperature=0.0,
        extra_body={"min_tokens": 8, "repetition_penalty": 1.2, "ignore_eos": False},
    )
    assert answer.usage is not None and answer.usage.completion_tokens == 8


def status_and_error(exc: openai.APIStatusError) -> tuple[int, dict[str, Any]]:
    body = exc.response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return exc.status_code, body["error"]


@pytest.mark.parametrize(
    ("kwargs", "status", "param"),
    [
        ({"n": 2}, 400, "n"),
        ({"model": "gpt-4"}, 404, "model"),
        ({"temperature": -1.0}, 400, "temperature"),
        ({"top_p": 0.0}, 400, "top_p"),
        ({"logprobs": 2}, 400, "logprobs"),
        ({"stream_options": {"include_usage": True}}, 400, "stream_options"),
        ({"prompt": [[1, 2, 3]]}, 400, "prompt"),
        ({"max_tokens": MAX_MODEL_LEN}, 400, None),
        ({"max_tokens": MAX_MODEL_LEN, "stream": True}, 400, None),
    ],
)
def test_completion_errors(
    client: openai.OpenAI, kwargs: dict[str, Any], status: int, param: str | None
) -> None:
    request = {"model": NAME, "prompt": PROMPT, "max_tokens": 4, **kwargs}
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(**request)
    code, error = status_and_error(info.value)
    assert (code, error["param"]) == (status, param), error
    if code == 400:
        assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
        ({"messages": []}, "messages"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"logprobs": True}, "logprobs"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages[0].content",
        ),
    ],
)
def test_chat_errors(client: openai.OpenAI, kwargs: dict[str, Any], param: str) -> None:
    request = {"model": NAME, "messages": MESSAGES, "max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**request)
    assert status_and_error(info.value)[1]["param"] == param


def http(url: str, data: bytes | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_malformed_body_and_unknown_route(frontend: BackgroundFrontend) -> None:
    url = base_url(frontend)
    status, body = http(f"{url}/completions", b"{not json")
    assert status == 400 and json.loads(body)["error"]["type"] == "invalid_request_error"
    status, body = http(f"{url}/nothing-here")
    assert status == 404 and "error" in json.loads(body)
    assert http(url.removesuffix("/v1") + "/health")[0] == 200


def test_unreachable_triton_is_503() -> None:
    (dead_port,) = free_ports(1)
    running = start_frontend(f"127.0.0.1:{dead_port}", "llm", None)
    try:
        client = openai.OpenAI(base_url=base_url(running), api_key="unused", max_retries=0)
        for stream in (False, True):
            with pytest.raises(openai.APIStatusError) as info:
                client.completions.create(model=NAME, prompt=PROMPT, max_tokens=4, stream=stream)
            assert info.value.status_code == 503
        with pytest.raises(openai.APIStatusError) as info:
            client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=4)
        assert info.value.status_code == 503
        assert http(base_url(running).removesuffix("/v1") + "/health")[0] == 503
    finally:
        running.stop()


def blocks_used(server: TritonServer) -> float:
    values = gauges(server)
    return sum(values.get(("splitserve_kv_blocks_used", pool), 0.0) for pool in POOLS)


def is_running(server: TritonServer, model: str) -> bool:
    values = gauges(server)
    return (
        values[("splitserve_requests_active", model)] == 1
        and values[("splitserve_kv_blocks_used", model)] > 0
    )


LONG = {"max_tokens": MAX_MODEL_LEN - 64, "temperature": 0.0, "extra_body": IGNORE_EOS}
"""A request that would run for many seconds."""


def test_disconnect_mid_stream_frees_blocks(
    client: openai.OpenAI, frontend: BackgroundFrontend, splitserve_server: TritonServer
) -> None:
    model = frontend.options.triton_model
    assert wait_for(lambda: blocks_used(splitserve_server) == 0, IDLE_S), gauges(splitserve_server)
    stream = client.completions.create(model=NAME, prompt=PROMPT, stream=True, **LONG)
    chunks = iter(stream)
    received = [next(chunks) for _ in range(3)]
    assert all(chunk.choices for chunk in received)
    assert wait_for(lambda: is_running(splitserve_server, model), CANCEL_STOP_S)
    stream.close()
    assert wait_for(lambda: blocks_used(splitserve_server) == 0, CANCEL_STOP_S), gauges(
        splitserve_server
    )


def test_disconnect_while_waiting_frees_blocks(
    frontend: BackgroundFrontend, splitserve_server: TritonServer
) -> None:
    """A non-streaming request whose client gives up after a second (it would run for many)."""
    assert wait_for(lambda: blocks_used(splitserve_server) == 0, IDLE_S), gauges(splitserve_server)
    impatient = openai.OpenAI(
        base_url=base_url(frontend), api_key="unused", max_retries=0, timeout=1.0
    )
    with pytest.raises(openai.APITimeoutError):
        impatient.chat.completions.create(model=NAME, messages=MESSAGES, **LONG)
    assert wait_for(lambda: blocks_used(splitserve_server) == 0, CANCEL_STOP_S), gauges(
        splitserve_server
    )


SILENT_S = 2.0


def test_the_stream_of_a_killed_stub_ends_with_an_error(
    start_splitserve: Callable[[DeploymentSpec], TritonServer],
) -> None:
    """Triton 2.51 leaves the streams of a dead stub open; ``--stream-idle-timeout`` ends them."""
    settings = {"model": "tiny", "max_model_len": 2048}
    server = start_splitserve(DeploymentSpec(layout="disagg", settings=settings))
    running = start_frontend(server.grpc_url, "llm", None, stream_idle_timeout=SILENT_S)
    try:
        client = openai.OpenAI(base_url=base_url(running), api_key="unused", max_retries=0)
        long = {"max_tokens": 1500, "temperature": 0.0, "extra_body": IGNORE_EOS}
        chunks = iter(client.completions.create(model=NAME, prompt=PROMPT, stream=True, **long))
        assert all(next(chunks).choices for _ in range(3))
        os.kill(stub_pid(server, "llm_0_0"), signal.SIGKILL)
        killed = time.monotonic()
        with pytest.raises(openai.APIError) as info:
            for _ in chunks:
                pass
        waited = time.monotonic() - killed
        if not server.is_alive():
            pytest.skip("tritonserver aborted on the killed stub (see test_faults.TRITON_ABORT)")
        assert isinstance(info.value.body, dict) and info.value.body["code"] == "triton_timeout"
        assert waited < SILENT_S + 5.0
    finally:
        running.stop()


def test_splitserve_bench_targets_it(
    frontend: BackgroundFrontend, serve_ckpt: Path, tmp_path: Path
) -> None:
    input_len, output_len, num_requests = 16, 8, 6
    opts = BenchOptions(
        targets=[f"openai:{base_url(frontend)}@{NAME}"],
        workload="fixed",
        input_len=input_len,
        output_len=output_len,
        tokenizer=str(serve_ckpt),
        max_model_len=MAX_MODEL_LEN,
        arrival="fixed",
        rate=8.0,
        num_requests=num_requests,
        ttft_slo=10.0,
        tpot_slo=2.0,
        json_path=tmp_path / "bench.json",
        progress=False,
    )
    bench(opts)
    (run,) = json.loads(opts.json_path.read_text())["runs"]
    assert run["errors"] == 0, [r["error"] for r in run["requests"]]
    assert [r["output_tokens"] for r in run["requests"]] == [output_len] * num_requests
