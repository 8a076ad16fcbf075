"""Toy decoupled model: one BLS prefill per request, then tokens streamed from one thread.

`execute` validates, awaits the `toy_prefill` BLS call and enqueues; a single streaming thread
sends one word per step to every running stream, FINAL riding on the last word's response.
"""

import asyncio
import json
import queue
import threading
import time
from dataclasses import dataclass

import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class InvalidRequestError(ValueError):
    pass


@dataclass
class Stream:
    sender: object
    words: list[str]
    max_tokens: int
    first_outputs: list
    sent: int = 0


def _error_response(message: str, code: object) -> object:
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code))


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        self.token_delay_s = float(params.get("token_delay_ms", "0")) / 1000
        pb_utils.Logger.log_info(
            f"echo_stream instance name={args['model_instance_name']} "
            f"kind={args['model_instance_kind']} device_id={args['model_instance_device_id']}"
        )
        if params.get("import_torch") == "true":
            start = time.perf_counter()
            import torch

            elapsed = time.perf_counter() - start
            pb_utils.Logger.log_info(f"echo_stream torch {torch.__version__} in {elapsed:.2f} s")
        self.metric_family = pb_utils.MetricFamily(
            name="splitserve_toy_active",
            description="Streams running in the toy echo model",
            kind=pb_utils.MetricFamily.GAUGE,
        )
        self.active = self.metric_family.Metric(labels={"model": args["model_name"]})
        self.pending: queue.Queue[Stream | None] = queue.Queue()
        self.thread = threading.Thread(target=self._stream_loop, name="echo-stream", daemon=True)
        self.thread.start()

    async def execute(self, requests: list) -> None:
        await asyncio.gather(*(self._admit(request) for request in requests))

    async def _admit(self, request: object) -> None:
        sender = request.get_response_sender()
        try:
            text, max_tokens = self._parse(request)
            prefill_outputs = await self._prefill(text)
        except InvalidRequestError as exc:
            sender.send(_error_response(str(exc), pb_utils.TritonError.INVALID_ARG), flags=FINAL)
            return
        except Exception as exc:
            sender.send(_error_response(repr(exc), pb_utils.TritonError.INTERNAL), flags=FINAL)
            return
        self.pending.put(Stream(sender, text.split(), max_tokens, prefill_outputs))

    @staticmethod
    def _parse(request: object) -> tuple[str, int]:
        text = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy().item()
        text = text.decode() if isinstance(text, bytes) else str(text)
        if not text.split():
            raise InvalidRequestError("text_input must contain at least one word")
        max_tokens_tensor = pb_utils.get_input_tensor_by_name(request, "max_tokens")
        if max_tokens_tensor is None:
            return text, len(text.split())
        max_tokens = int(max_tokens_tensor.as_numpy().item())
        if max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be >= 1, got {max_tokens}")
        return text, max_tokens

    @staticmethod
    async def _prefill(text: str) -> list:
        input_ids = np.frombuffer(text.encode(), dtype=np.uint8).astype(np.int64)[None, :]
        request = pb_utils.InferenceRequest(
            model_name="toy_prefill",
            requested_output_names=["sum", "batch_size"],
            inputs=[pb_utils.Tensor("input_ids", input_ids)],
        )
        response = await request.async_exec()
        if response.has_error():
            raise RuntimeError(f"toy_prefill failed: {response.error().message()}")
        total = pb_utils.get_output_tensor_by_name(response, "sum").as_numpy().reshape(1)
        batch = pb_utils.get_output_tensor_by_name(response, "batch_size").as_numpy().reshape(1)
        return [pb_utils.Tensor("prefill_sum", total), pb_utils.Tensor("prefill_batch_size", batch)]

    def _stream_loop(self) -> None:
        streams: list[Stream] = []
        while True:
            try:
                while True:
                    item = self.pending.get(block=not streams)
                    if item is None:
                        self._abort(streams)
                        return
                    streams.append(item)
            except queue.Empty:
                pass
            streams = [stream for stream in streams if self._step_or_fail(stream)]
            self.active.set(len(streams))
            time.sleep(self.token_delay_s)

    def _step_or_fail(self, stream: Stream) -> bool:
        try:
            return self._step(stream)
        except Exception as exc:
            error = _error_response(repr(exc), pb_utils.TritonError.INTERNAL)
            stream.sender.send(error, flags=FINAL)
            return False

    @staticmethod
    def _step(stream: Stream) -> bool:
        """Send the next word; False once the stream is finished or cancelled."""
        if stream.sender.is_cancelled():
            stream.sender.send(flags=FINAL)
            return False
        word = stream.words[stream.sent % len(stream.words)]
        outputs = [pb_utils.Tensor("text_output", np.array([word.encode()], dtype=np.object_))]
        if stream.sent == 0:
            outputs += stream.first_outputs
        stream.sent += 1
        done = stream.sent >= stream.max_tokens
        response = pb_utils.InferenceResponse(output_tensors=outputs)
        stream.sender.send(response, flags=FINAL if done else 0)
        return not done

    @staticmethod
    def _abort(streams: list[Stream]) -> None:
        for stream in streams:
            error = _error_response("server shutting down", pb_utils.TritonError.UNAVAILABLE)
            stream.sender.send(error, flags=FINAL)

    def finalize(self) -> None:
        self.pending.put(None)
        self.thread.join(timeout=5)
