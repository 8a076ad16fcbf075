"""``prefill``: dynamic batches of prompts in one packed pass; returns first tokens and handles."""

from __future__ import annotations

import logging
import time
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

from splitserve.engine.build import build_components
from splitserve.engine.prompt_pass import PrefillEngine
from splitserve.engine.request import Request
from splitserve.serving import bls_contract
from splitserve.serving.core_lend import CoreLock
from splitserve.serving.heap import HeapTrimmer
from splitserve.serving.stats import InstanceStats, record_transport
from splitserve.transport import get_transport
from splitserve.transport.key import load_key
from splitserve.triton.metrics import InstanceMetrics, MetricsRefresher
from splitserve.triton.setup import setup_instance
from splitserve.triton.tensors import error_response

log = logging.getLogger(__name__)


def _request_id(request: Any) -> str | None:
    """The request id input as text; None unless it is one UTF-8 string."""
    tensor = pb_utils.get_input_tensor_by_name(request, bls_contract.REQUEST_ID)
    if tensor is None:
        return None
    ids = tensor.as_numpy().reshape(-1)
    try:
        return bytes(ids[0]).decode() if ids.size == 1 else None
    except (TypeError, UnicodeDecodeError):
        return None


def _parse(request: Any, key: bytes) -> Request:
    # The tag first: a caller without the key learns nothing about its inputs. A request id that
    # cannot be read cannot carry a valid tag, and fails with the very same error.
    rid = _request_id(request)
    bls_contract.check_auth(key, rid or "", request.parameters() if rid is not None else "")
    assert rid is not None  # check_auth refused a call without one

    def get(name: str) -> np.ndarray:
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        if tensor is None:
            raise ValueError(f"input '{name}' is required")
        array = tensor.as_numpy()
        if array.shape[0] != 1:
            raise ValueError(f"input '{name}' must hold one request, got shape {array.shape}")
        return array.reshape(-1)

    ids = [int(t) for t in get(bls_contract.INPUT_IDS)]
    params = bls_contract.params_from_json(bytes(get(bls_contract.PARAMS)[0]))
    req = Request(rid, ids, params)
    req.seed = int(get(bls_contract.SEED)[0])
    return req


class PrefillModel:
    def initialize(self, args: dict[str, Any]) -> None:
        cfg = setup_instance(args, "prefill")
        parts = build_components(cfg.engine)
        self.key = load_key()
        self.transport = get_transport(cfg.transport, key=self.key, **cfg.transport_options())
        pool = self.transport.create_pool(parts.layout, parts.num_blocks, cfg.engine.device)
        self.transport.register(pool)
        self.engine = PrefillEngine(parts.model, pool, parts.eos_ids, parts.max_model_len)
        self.stats = InstanceStats()
        self.metrics = InstanceMetrics(args, self.stats, self._gauges)
        self.refresher = MetricsRefresher(self.metrics, cfg.metrics_interval_s)
        self.heap = HeapTrimmer()
        self.core_lock = CoreLock(cfg.core_lock) if cfg.core_lock else None

    def _computing(self) -> AbstractContextManager[object]:
        """The cores to itself for one pass, if it lends them to decode between passes."""
        return self.core_lock.lend() if self.core_lock else nullcontext()

    def _gauges(self) -> dict[str, float]:
        allocator = self.engine.allocator
        return {
            "kv_blocks_used": allocator.num_used,
            "kv_blocks_free": allocator.num_free,
            **record_transport(self.stats, self.transport.stats()),
        }

    def execute(self, requests: list[Any]) -> list[Any]:
        responses: list[Any] = [None] * len(requests)
        batch: list[tuple[int, Request]] = []
        free = self.engine.allocator.num_free
        for i, request in enumerate(requests):
            try:
                req = _parse(request, self.key)
                self.engine.check(req)
            except ValueError as exc:
                self.stats.error("invalid")
                responses[i] = error_response(str(exc))
                continue
            need = self.engine.blocks_for(req)
            if need > free:
                self.stats.error("unavailable")
                responses[i] = error_response(
                    f"{bls_contract.POOL_FULL}: needs {need} blocks, {free} free",
                    pb_utils.TritonError.UNAVAILABLE,
                )
                continue
            free -= need
            batch.append((i, req))
        if batch:
            self._run(batch, responses)
            self.heap.maybe_trim()
        return responses

    def _run(self, batch: list[tuple[int, Request]], responses: list[Any]) -> None:
        reqs = [r for _, r in batch]
        try:
            with self._computing():
                start, cpu = time.perf_counter(), time.thread_time()
                first = self.engine.prefill(reqs)
                seconds, cpu = time.perf_counter() - start, time.thread_time() - cpu
        except Exception as exc:
            log.exception("prefill failed")
            for i, _ in batch:
                self.stats.error("internal")
                responses[i] = error_response(
                    f"prefill failed: {exc}", pb_utils.TritonError.INTERNAL
                )
            return
        self.stats.step(seconds, len(first), cpu)
        for (i, req), token in zip(batch, first, strict=True):
            handle = self.transport.export(req.request_id, req.block_ids, len(req.prompt_ids))
            responses[i] = pb_utils.InferenceResponse(
                output_tensors=[
                    pb_utils.Tensor(bls_contract.FIRST_TOKEN, np.array([[token]], dtype=np.int64)),
                    pb_utils.Tensor(
                        bls_contract.KV_HANDLE, np.frombuffer(handle, np.uint8)[None, :]
                    ),
                ]
            )

    def finalize(self) -> None:
        self.refresher.stop()
        self.metrics.close()
        self.transport.close()
        if self.core_lock is not None:
            self.core_lock.close()
