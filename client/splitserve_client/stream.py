"""Timed streaming requests over gRPC with asyncio: one stream per request, no thread each."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import tritonclient.grpc.aio as grpcaio

from splitserve_client.generate import GenerateArgs, build_inputs


@dataclass
class RequestRecord:
    """Client-side timeline of one request (``time.perf_counter`` seconds)."""

    start: float
    token_times: list[float] = field(default_factory=list)
    end: float = 0.0
    text: str = ""
    output_tokens: int = 0
    finish_reason: str = ""
    error: str | None = None

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.start if self.token_times else float("nan")

    @property
    def tpot(self) -> float:
        """Mean gap between tokens after the first (DistServe's TPOT): from the first response
        to the last over the tokens after the first (a response may carry several tokens; the
        final one says how many there were)."""
        if len(self.token_times) < 2:
            return float("nan")  # one response: no gap to measure
        n = max(len(self.token_times), self.output_tokens)
        return (self.token_times[-1] - self.token_times[0]) / (n - 1)

    @property
    def e2e(self) -> float:
        return self.end - self.start


async def _one(payload: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
    yield payload


async def stream_generate(
    client: grpcaio.InferenceServerClient, args: GenerateArgs
) -> RequestRecord:
    """Send one streaming request; every response carries one token or more, the last FINAL
    (with ``num_output_tokens``)."""
    record = RequestRecord(start=time.perf_counter())
    payload = {
        "model_name": args.model,
        "inputs": build_inputs(args),
        "enable_empty_final_response": True,
    }
    async for result, error in client.stream_infer(_one(payload)):
        now = time.perf_counter()
        if error is not None:
            record.error = str(error)
            break
        text = result.as_numpy("text_output")
        if text is not None:
            record.token_times.append(now)
            record.text += b"".join(text.reshape(-1)).decode("utf-8", errors="replace")
        final = result.get_response().parameters.get("triton_final_response")
        if final is not None and final.bool_param:
            count = result.as_numpy("num_output_tokens")
            reason = result.as_numpy("finish_reason")
            record.output_tokens = (
                int(count.reshape(-1)[0]) if count is not None else len(record.token_times)
            )
            record.finish_reason = reason.reshape(-1)[0].decode() if reason is not None else ""
            break
    record.end = time.perf_counter()
    return record
