"""An OpenAI-compatible ``/v1/completions`` endpoint (vLLM, ...) as a benchmark target.

Streams over HTTP with aiohttp (already a dependency of ``tritonclient[http]``). Each SSE chunk
is timestamped on arrival. vLLM is asked for ``return_token_ids``: a chunk then lists its tokens,
and each token gets the chunk's arrival time in ``token_times`` (a coalesced chunk adds several
equal times, so ``RequestRecord.tpot`` stays (last - first) / (tokens - 1)); a token whose bytes
do not decode yet comes with empty text, and still counts. Without token ids (other servers), a
chunk with text is one arrival, and so is an empty one that does not finish the request.
``output_tokens`` comes from ``usage.completion_tokens`` (``stream_options.include_usage``) when
the server reports it, else from ``token_times``.
"""

from __future__ import annotations

import json
import time
from typing import Any

import aiohttp

from splitserve_client.stream import RequestRecord

DONE = "[DONE]"
KEEPALIVE_S = 2.0
"""How long an idle connection is kept for reuse: under the servers' own keep-alive timeouts."""


def completions_url(base_url: str) -> str:
    """``http://h:p/v1`` or ``http://h:p`` -> ``http://h:p/v1/completions``."""
    base = base_url.rstrip("/")
    return f"{base}/completions" if base.endswith("/v1") else f"{base}/v1/completions"


class OpenAITarget:
    """Greedy, EOS-ignoring streamed completions from one model of an OpenAI-style server."""

    def __init__(self, base_url: str, model: str, timeout_s: float = 600.0) -> None:
        self.name = model
        self.url = completions_url(base_url)
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=timeout_s)
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        # Made on first use: a session belongs to the running event loop.
        if self._session is None or self._session.closed:
            # Idle connections are dropped here before the server drops them (uvicorn after 5 s):
            # a request sent on one the server is closing fails with "Server disconnected".
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S)
            self._session = aiohttp.ClientSession(connector=connector, timeout=self._timeout)
        return self._session

    def payload(self, prompt: str, max_tokens: int) -> dict[str, Any]:
        return {
            "model": self.name,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,  # vLLM extra field: exact output lengths
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_token_ids": True,  # vLLM extra field: exact tokens per chunk
        }

    async def generate(self, prompt: str, max_tokens: int) -> RequestRecord:
        record = RequestRecord(start=time.perf_counter())
        try:
            async with self._client().post(self.url, json=self.payload(prompt, max_tokens)) as resp:
                if resp.status != 200:
                    body = (await resp.text())[:500]
                    record.error = f"HTTP {resp.status}: {body}"
                else:
                    await _read_stream(resp, record)
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
            record.error = f"{type(exc).__name__}: {exc}"
        record.end = time.perf_counter()
        if not record.output_tokens:
            record.output_tokens = len(record.token_times)
        return record

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


async def _read_stream(resp: aiohttp.ClientResponse, record: RequestRecord) -> None:
    """Consume ``data: {...}`` lines until ``data: [DONE]`` or the end of the body."""
    async for raw in resp.content:
        now = time.perf_counter()
        line = raw.decode("utf-8", errors="replace").strip()
        if not line.startswith("data:"):
            continue  # blank separators, ": keep-alive" comments, event names
        data = line[len("data:") :].strip()
        if data == DONE:
            return
        chunk = json.loads(data)
        if "error" in chunk:
            error = chunk["error"]
            record.error = str(error.get("message", error) if isinstance(error, dict) else error)
            return
        _apply_chunk(chunk, now, record)


def _apply_chunk(chunk: dict[str, Any], now: float, record: RequestRecord) -> None:
    usage = chunk.get("usage")
    if usage and usage.get("completion_tokens") is not None:
        record.output_tokens = int(usage["completion_tokens"])
    for choice in chunk.get("choices") or ():
        text = choice.get("text") or ""
        finish = choice.get("finish_reason")
        token_ids = choice.get("token_ids")
        if token_ids:
            record.token_times.extend([now] * len(token_ids))
        elif text or not finish:  # an empty chunk that only finishes carries no token
            record.token_times.append(now)
        record.text += text
        if finish:
            record.finish_reason = str(finish)
