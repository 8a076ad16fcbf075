"""``prefill``: dynamic batches of prompts in one packed pass; returns first tokens and handles."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

from splitserve.engine.build import build_components
from splitserve.engine.prompt_pass import PrefillEngine
from splitserve.engine.request import Request
from splitserve.serving import bls_contract
from splitserve.serving.affinity import allowed_cores
from splitserve.serving.core_lend import CoreLock
from splitserve.serving.decode_lend import PassBorrower, pass_borrower_for
from splitserve.serving.heap import HeapTrimmer
from splitserve.serving.layer_chunks import LayerChunks
from splitserve.serving.stats import InstanceStats, record_kv_pool, record_transport
from splitserve.transport import get_transport
from splitserve.transport.key import load_key
from splitserve.triton.metrics import InstanceMetrics, MetricsRefresher
from splitserve.triton.prefill_push import PassPushes, target_of
from splitserve.triton.prefill_stream import (
    LayerAnnouncer,
    handle_response,
    send,
    token_response,
)
from splitserve.triton.setup import setup_instance
from splitserve.triton.tensors import FINAL, error_response, instance_index

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
        self.engine = PrefillEngine(
            parts.model, pool, parts.eos_ids, parts.max_model_len, cfg.engine.prefix_cache
        )
        self.pool = pool
        self.streams = pb_utils.using_decoupled_model_transaction_policy(
            json.loads(args["model_config"])
        )
        """Decoupled: the KV streams by layer (``prefill_stream``), else one response at the
        end of the pass."""
        self.stream_min_tokens = cfg.kv_stream_min_tokens
        # A GPU pass is enqueued ahead of the device and does not pay for the responses on the
        # host: its layers go one by one (the announcer sends each once the device passed it).
        self.stream_gap_s = cfg.kv_stream_min_gap_s if pool.device.type == "cpu" else 0.0
        if self.streams != cfg.kv_stream_layers:
            raise ValueError("prefill is decoupled exactly when kv_stream_layers is set")
        self.stats = InstanceStats()
        self.metrics = InstanceMetrics(args, self.stats, self._gauges)
        self.refresher = MetricsRefresher(self.metrics, cfg.metrics_interval_s)
        self.heap = HeapTrimmer()
        self.core_lock = CoreLock(cfg.core_lock) if cfg.core_lock else None
        self.borrower: PassBorrower | None = None
        if cfg.core_lock and cfg.lent_cores:
            own = cfg.cores_for(instance_index(args)) or set()
            self.borrower = pass_borrower_for(
                cfg.core_lock, own, cfg.lent_core_set, allowed_cores()
            )

    def _computing(self, reqs: list[Request]) -> ExitStack:
        """The cores to itself for one pass of allocated ``reqs``, if it lends them to decode
        between passes; and decode's too, while decode offers them (priced by the tokens the
        pass computes: not the prefix the cache gave)."""
        stack = ExitStack()
        if self.core_lock is not None:
            stack.enter_context(self.core_lock.lend())
        if self.borrower is not None:
            computed = max(1, sum(len(r.prompt_ids) - r.num_computed for r in reqs))
            stack.enter_context(self.borrower.pass_(computed))
        return stack

    def _gauges(self) -> dict[str, float]:
        if self.borrower is not None:
            withheld = self.borrower.guard.withheld_steps
            self.stats.set_total("prefill_borrowed_passes_total", self.borrower.borrowed_passes)
            self.stats.set_total("prefill_borrow_withheld_passes_total", withheld)
            over = self.borrower.over_budget
            self.stats.set_total("prefill_borrow_over_budget_passes_total", over)
        return {
            **record_kv_pool(self.stats, self.engine.allocator, self.engine.prefix),
            **record_transport(self.stats, self.transport.stats()),
        }

    def execute(self, requests: list[Any]) -> list[Any] | None:
        senders = [r.get_response_sender() for r in requests] if self.streams else []
        responses: list[Any] = [None] * len(requests)
        batch: list[tuple[int, Request]] = []
        targets: dict[int, bytes] = {}
        free = self.engine.allocator.num_free
        for i, request in enumerate(requests):
            try:
                req = _parse(request, self.key)
                self.engine.check(req)
                if (target := target_of(request)) is not None:
                    targets[i] = target
            except ValueError as exc:
                self.stats.error("invalid")
                responses[i] = error_response(str(exc))
                continue
            need = self.engine.free_blocks_for(req)
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
            if self.streams:
                self._stream(batch, [senders[i] for i, _ in batch], responses, targets)
            else:
                self._run(batch, responses, targets)
            self.heap.maybe_trim()
        if not self.streams:
            return responses
        for sender, response in zip(senders, responses, strict=True):
            send(sender, response, FINAL)
        return None

    def _chunked(self, publish: Callable[[range], None]) -> Callable[[int], None]:
        """A pass's per-layer hook that calls ``publish`` with runs of written layers, at most
        once per ``kv_stream_min_gap_s`` (made just before the pass)."""
        return LayerChunks(self.pool.layout.num_layers, self.stream_gap_s, publish).written

    def _timed(self, reqs: list[Request], compute: Callable[[], list[int]]) -> list[int]:
        """One prompt pass of ``reqs`` on this instance's cores, recorded in its stats."""
        with self._computing(reqs):
            start, cpu = time.perf_counter(), time.thread_time()
            first = compute()
            seconds, cpu = time.perf_counter() - start, time.thread_time() - cpu
        self.stats.step(seconds, len(first), cpu)
        return first

    def _failed(
        self, batch: list[tuple[int, Request]], responses: list[Any], exc: Exception
    ) -> None:
        log.exception("prefill failed")
        for i, _ in batch:
            self.stats.error("internal")
            responses[i] = error_response(f"prefill failed: {exc}", pb_utils.TritonError.INTERNAL)

    def _run(
        self, batch: list[tuple[int, Request]], responses: list[Any], targets: dict[int, bytes]
    ) -> None:
        reqs = [r for _, r in batch]
        try:
            self.engine.allocate(reqs)  # frees what it took if it fails
        except Exception as exc:
            self._failed(batch, responses, exc)
            return
        pushes = self._open_pushes(batch, targets, responses)
        batch = [(i, r) for i, r in batch if responses[i] is None]
        reqs = [r for _, r in batch]
        if not reqs:  # every target was refused
            return
        try:
            hook = self._chunked(pushes.written) if pushes else None
            first = self._timed(reqs, lambda: self.engine.run(reqs, hook))
        except Exception as exc:
            pushes.finish()
            self._failed(batch, responses, exc)
            for req in reqs:
                self.engine.free(req)
            return
        self._answer(batch, first, set(), responses, pushes)

    def _open_pushes(
        self, batch: list[tuple[int, Request]], targets: dict[int, bytes], responses: list[Any]
    ) -> PassPushes:
        """The pushes of the batch's requests that came with a target; a request whose target
        cannot be pushed into is answered with the error now (its blocks freed)."""
        pushes = PassPushes(self.transport, self.pool.device)
        for i, req in batch:
            if i not in targets:
                continue
            try:
                pushes.open(i, targets[i], req)
            except ValueError as exc:  # InvalidHandle too
                self.stats.error("invalid")
                responses[i] = error_response(f"{bls_contract.KV_TARGET}: {exc}")
                self.engine.free(req)
        return pushes

    def _answer(
        self,
        batch: list[tuple[int, Request]],
        first: list[int],
        streamed: set[int],
        responses: list[Any],
        pushes: PassPushes,
    ) -> None:
        """Each request's first token: with its handle where its KV is answered whole (leased
        now), alone where it streamed (leased before the pass), with its target where it was
        pushed (once all its WRITEs are done; its blocks freed). Once a lease cannot be made,
        the batch's later whole answers fail too and free their blocks."""
        layers = self.pool.layout.num_layers
        pushed = pushes.finish()
        failure: Exception | None = None
        for k, ((i, req), token) in enumerate(zip(batch, first, strict=True)):
            if i in pushed:
                why = pushed[i]
                if why is None:
                    responses[i] = pushes.response(i, token)
                else:
                    self.stats.error("internal")
                    responses[i] = error_response(why, pb_utils.TritonError.INTERNAL)
                self.engine.free(req)
                continue
            if k in streamed:
                responses[i] = token_response(token, layers)
                continue
            if failure is None:
                try:
                    responses[i] = self._whole_response(req, token)
                    continue
                except Exception as exc:
                    failure = exc
            self._failed([(i, req)], responses, failure)
            self.engine.free(req)

    def _whole_response(self, req: Request, token: int) -> Any:
        """The handle of a prompt's finished KV and its first token, in one response."""
        handle = self.transport.export(req.request_id, req.block_ids, len(req.prompt_ids))
        return pb_utils.InferenceResponse(
            output_tensors=[
                pb_utils.Tensor(bls_contract.FIRST_TOKEN, np.array([[token]], dtype=np.int64)),
                pb_utils.Tensor(bls_contract.KV_HANDLE, np.frombuffer(handle, np.uint8)[None, :]),
            ]
        )

    def _stream(
        self,
        batch: list[tuple[int, Request]],
        senders: list[Any],
        responses: list[Any],
        targets: dict[int, bytes],
    ) -> None:
        """Lease the blocks and answer with their handles before the pass; announce runs of
        layers (``kv_stream_min_gap_s``) as they are written; the first tokens go into
        ``responses`` (sent FINAL by the caller). Prompts shorter than ``kv_stream_min_tokens``
        are answered whole, after the pass; those with a target are pushed."""
        try:
            self.engine.allocate([r for _, r in batch])  # frees what it took if it fails
        except Exception as exc:
            self._failed(batch, responses, exc)
            return
        pushes = self._open_pushes(batch, targets, responses)
        kept = [k for k, (i, _) in enumerate(batch) if responses[i] is None]
        batch, senders = [batch[k] for k in kept], [senders[k] for k in kept]
        reqs = [r for _, r in batch]
        if not reqs:  # every target was refused
            return
        held: list[list[int]] = []
        handles: dict[int, bytes] = {}
        announcer: LayerAnnouncer | None = None
        try:
            for k, (i, r) in enumerate(batch):
                if i in pushes or len(r.prompt_ids) < self.stream_min_tokens:
                    continue
                # The pass keeps its own reference to the streamed blocks (one per request:
                # requests may share cached blocks): a reader may release the lease, and so
                # its reference, before the pass has written them all.
                held.append(list(r.block_ids))
                self.engine.allocator.share(held[-1])
                handles[k] = self.transport.export(
                    r.request_id, r.block_ids, len(r.prompt_ids), streamed=True
                )
            for k, handle in handles.items():
                send(senders[k], handle_response(handle))
            blocks = [b for k in handles for b in reqs[k].block_ids]
            announcer = LayerAnnouncer([senders[k] for k in handles], self.pool.device)
            announce = announcer.written

            def publish(layers: range) -> None:
                if handles:
                    self.transport.publish_layers(blocks, layers)
                    announce(layers.stop)
                if pushes:
                    pushes.written(layers)

            run_hook = self._chunked(publish) if handles or pushes else None
            first = self._timed(reqs, lambda: self.engine.run(reqs, run_hook))
        except Exception as exc:
            pushes.finish()
            self._failed(batch, responses, exc)
            for handle in handles.values():  # the leases own those blocks: releasing frees them
                self.transport.release(handle)
            for k, req in enumerate(reqs):
                if k not in handles:
                    self.engine.free(req)
            return
        finally:
            if announcer is not None:
                announcer.close()
            for ids in held:
                self.engine.allocator.free(ids)
        self._answer(batch, first, set(handles), responses, pushes)

    def finalize(self) -> None:
        self.refresher.stop()
        self.metrics.close()
        self.transport.close()
        if self.core_lock is not None:
            self.core_lock.close()
        if self.borrower is not None:
            self.borrower.cores.close()
