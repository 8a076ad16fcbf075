"""A client run inside a network namespace of the multi-node tests (their servers are reachable
only from there): one command per call, one JSON document on stdout.

    multinode_client.py ready HTTP_URL
    multinode_client.py generate GRPC_URL PROMPT MAX_TOKENS [IGNORE_EOS]
    multinode_client.py load GRPC_URL N MAX_TOKENS TIMEOUT_S [PROMPT_WORDS]
    multinode_client.py cancel GRPC_URL PROMPT
    multinode_client.py gauges METRICS_URL
    multinode_client.py midstream GRPC_URL METRICS_URLS PROMPT MAX_TOKENS [METRIC]  (prints
                          "pulling N" once the request's first layers moved: METRIC grew at
                          the Nth of the comma-separated METRICS_URLS)
    multinode_client.py openai BASE_URL PROMPT MAX_TOKENS
    multinode_client.py timing GRPC_URL PROMPTS_JSON   (one after another: seconds to tokens 1-3)
    multinode_client.py stall GRPC_URL PROMPT PROMPTS_JSON  (a stream's longest token gap while
                                                          each prompt's KV is handed over)
"""

from __future__ import annotations

import itertools
import json
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Any

from llm_client import GAUGE_LINE, LABEL, GrpcStream, generate_inputs

MODEL = "llm"


def ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/v2/health/ready", timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def generate(url: str, prompt: str, max_tokens: int, ignore_eos: bool, timeout_s: float) -> Any:
    sampling = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": ignore_eos}
    with GrpcStream(url) as stream:
        stream.send(MODEL, generate_inputs(prompt, stream=True, sampling=sampling))
        try:
            gen = stream.collect(timeout_s)
        except Exception as exc:  # the test reads the error: any kind
            return {"error": str(exc)}
    return {"text": gen.text, "finish_reason": gen.finish_reason, "tokens": gen.num_output_tokens}


def load(url: str, n: int, max_tokens: int, timeout_s: float, words: int) -> list[Any]:
    results: list[Any] = [None] * n
    padding = " lorem" * words

    def one(i: int) -> None:
        prompt = f"request {i} of the load{padding}"
        results[i] = generate(url, prompt, max_tokens, True, timeout_s)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def midstream(
    url: str,
    metrics_urls: str,
    prompt: str,
    max_tokens: int,
    key: str = "splitserve_kv_streamed_layers_total|llm",
) -> Any:
    """A greedy request; once layers of it moved (``key`` grew at one of ``metrics_urls``:
    decode pulled some, or a prefill pushed some, its pass still running), print ``pulling``
    and which (the caller then acts on that prefill server), then return its result."""
    urls = metrics_urls.split(",")
    before = [gauges(u).get(key, 0.0) for u in urls]
    result: list[Any] = []
    thread = threading.Thread(
        target=lambda: result.append(generate(url, prompt, max_tokens, True, 60.0))
    )
    thread.start()
    grew: int | None = None
    while thread.is_alive() and grew is None:
        now = [gauges(u).get(key, 0.0) for u in urls]
        grew = next((n for n, (a, b) in enumerate(zip(before, now, strict=True)) if b > a), None)
        time.sleep(0.01)
    print(f"pulling {grew}" if thread.is_alive() else "ended", flush=True)
    thread.join()
    return result[0]


def cancel(url: str, prompt: str) -> Any:
    """Start a long stream, read two tokens, cancel it."""
    sampling = {"max_tokens": 2000, "temperature": 0, "ignore_eos": True}
    stream = GrpcStream(url)
    stream.send(MODEL, generate_inputs(prompt, stream=True, sampling=sampling))
    got = [stream.next(30.0) for _ in range(2)]
    stream.close(cancel=True)
    return {"events": len(got), "errors": [str(e) for _, e in got if e is not None]}


def gauges(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    values: dict[str, float] = {}
    for name, labels, value in GAUGE_LINE.findall(text):
        key = f"{name}|{dict(LABEL.findall(labels))['model']}"
        values[key] = values.get(key, 0.0) + float(value)
    return values


def openai_completion(base: str, prompt: str, max_tokens: int) -> Any:
    """``/v1/models``, then a greedy ``/v1/completions`` of its first model."""
    with urllib.request.urlopen(f"{base}/v1/models", timeout=10) as response:
        model = json.loads(response.read())["data"][0]["id"]
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    request = urllib.request.Request(
        f"{base}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def timing(url: str, prompts: list[str], tokens: int) -> list[list[float]]:
    """Per prompt, sent one at a time: seconds to each of its ``tokens`` tokens."""
    sampling = {"max_tokens": tokens, "temperature": 0, "ignore_eos": True}
    out = []
    with GrpcStream(url) as stream:
        for prompt in prompts:
            sent = time.perf_counter()
            stream.send(MODEL, generate_inputs(prompt, stream=True, sampling=sampling))
            stamps = []
            for _ in range(tokens):
                _, error = stream.next(120.0)
                if error is not None:
                    raise error
                stamps.append(time.perf_counter() - sent)
            out.append(stamps)
    return out


def stall(url: str, background: str, prompts: list[str]) -> dict[str, Any]:
    """A greedy stream of ``background`` runs while ``prompts`` are sent one at a time; per
    prompt, the stream's longest gap between tokens from that prompt's first token to its
    second (when its KV crosses), and the stream's median gap overall."""
    arrivals: list[float] = []
    started = threading.Event()

    def stream_background() -> None:
        sampling = {"max_tokens": 4000, "temperature": 0, "ignore_eos": True}
        with GrpcStream(url) as stream:
            stream.send(MODEL, generate_inputs(background, stream=True, sampling=sampling))
            while not done.is_set():
                _, error = stream.next(120.0)
                if error is not None:
                    raise error
                arrivals.append(time.perf_counter())
                if len(arrivals) == 16:
                    started.set()
            stream.client.stop_stream(cancel_requests=True)

    done = threading.Event()
    thread = threading.Thread(target=stream_background)
    thread.start()
    assert started.wait(300), "the background stream did not start"
    windows = []
    with GrpcStream(url) as stream:
        sampling = {"max_tokens": 2, "temperature": 0, "ignore_eos": True}
        for prompt in prompts:
            stream.send(MODEL, generate_inputs(prompt, stream=True, sampling=sampling))
            stamps = []
            for _ in range(2):
                _, error = stream.next(300.0)
                if error is not None:
                    raise error
                stamps.append(time.perf_counter())
            windows.append(stamps)
            time.sleep(0.5)
    done.set()
    thread.join(300)
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]

    def longest(lo: float, hi: float) -> float:
        inside = [b - a for a, b in itertools.pairwise(arrivals) if b > lo and a < hi]
        return max(inside, default=0.0)

    return {
        "median_gap": sorted(gaps)[len(gaps) // 2],
        "stall": [longest(first, second) for first, second in windows],
        "handoff_window": [second - first for first, second in windows],
    }


def main(argv: list[str]) -> Any:
    cmd, *args = argv
    if cmd == "ready":
        return ready(args[0])
    if cmd == "generate":
        ignore_eos = len(args) > 3 and args[3] == "1"
        return generate(args[0], args[1], int(args[2]), ignore_eos, 60.0)
    if cmd == "load":
        words = int(args[4]) if len(args) > 4 else 0
        return load(args[0], int(args[1]), int(args[2]), float(args[3]), words)
    if cmd == "cancel":
        return cancel(args[0], args[1])
    if cmd == "midstream":
        return midstream(args[0], args[1], args[2], int(args[3]), *args[4:5])
    if cmd == "gauges":
        return gauges(args[0])
    if cmd == "timing":
        with open(args[1]) as f:
            return timing(args[0], json.load(f), int(args[2]))
    if cmd == "stall":
        with open(args[2]) as f:
            return stall(args[0], args[1], json.load(f))
    if cmd == "openai":
        return openai_completion(args[0], args[1], int(args[2]))
    raise SystemExit(f"unknown command {cmd!r}")


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])))
