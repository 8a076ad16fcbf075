"""``splitserve generate``: one request over tritonclient gRPC, tokens printed as they arrive."""

from __future__ import annotations

import json
import queue
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient


@dataclass(frozen=True)
class GenerateArgs:
    prompt: str
    url: str = "localhost:8001"
    model: str = "llm"
    stream: bool = True
    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False


def build_inputs(args: GenerateArgs) -> list[grpcclient.InferInput]:
    params: dict[str, Any] = {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "ignore_eos": args.ignore_eos,
    }
    if args.seed is not None:
        params["seed"] = args.seed
    values = {
        "text_input": np.array([args.prompt.encode()], dtype=np.object_),
        "stream": np.array([args.stream]),
        "exclude_input_in_output": np.array([True]),
        "sampling_parameters": np.array([json.dumps(params).encode()], dtype=np.object_),
    }
    inputs = []
    for name, value in values.items():
        dtype = "BYTES" if value.dtype == np.object_ else "BOOL"
        tensor = grpcclient.InferInput(name, list(value.shape), dtype)
        tensor.set_data_from_numpy(value)
        inputs.append(tensor)
    return inputs


def generate(args: GenerateArgs, out: Any = sys.stdout) -> str:
    """Send the request, write text to ``out`` as it arrives; returns the finish reason."""
    responses: queue.SimpleQueue[Any] = queue.SimpleQueue()
    client = grpcclient.InferenceServerClient(args.url)
    client.start_stream(callback=lambda result, error: responses.put(error or result))
    try:
        client.async_stream_infer(args.model, build_inputs(args), enable_empty_final_response=True)
        while True:
            item = responses.get()
            if isinstance(item, Exception):
                raise item
            text = item.as_numpy("text_output")
            if text is not None:
                out.write(b"".join(text.reshape(-1)).decode("utf-8", errors="replace"))
                out.flush()
            final = item.get_response().parameters.get("triton_final_response")
            if final is not None and final.bool_param:
                reason = item.as_numpy("finish_reason")
                return "" if reason is None else reason.reshape(-1)[0].decode()
    finally:
        client.stop_stream()
        client.close()
