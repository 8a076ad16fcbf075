"""``llm``: the public entry and the decode stage of disaggregated serving.

Per request: validate and tokenize, call ``prefill`` once through BLS, stream the first token,
hand the request (with its KV handle) to the engine loop, which pulls the blocks when it has
room and streams every further token straight to the client.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

from splitserve.engine.request import random_seed
from splitserve.kv.pool import KVPool
from splitserve.serving import bls_contract
from splitserve.serving.frontend import Prepared
from splitserve.serving.loop import TIMED_OUT
from splitserve.transport import get_transport
from splitserve.transport.key import load_key
from splitserve.triton.streaming_model import GenerateModelBase

log = logging.getLogger(__name__)


class PrefillError(RuntimeError):
    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind
        """A ``Sink.fail`` kind: ``internal`` or ``unavailable``."""


class DecodeModel(GenerateModelBase):
    role = "decode"

    def make_pool(self) -> KVPool:
        self.key = load_key()
        self.transport = get_transport(
            self.cfg.transport, key=self.key, **self.cfg.transport_options()
        )
        pool = self.parts.new_pool()
        self.transport.register(pool)
        return pool

    def transport_counts(self) -> dict[str, int]:
        return self.transport.stats()

    async def execute(self, requests: list[Any]) -> None:
        await asyncio.gather(*(self._handle(r) for r in requests))

    async def _handle(self, request: Any) -> None:
        taken = self.intake(request)
        if taken is None:
            return
        prep, sink, rid = taken
        handle = b""
        try:
            seed = prep.gen.params.seed if prep.gen.params.seed is not None else random_seed()
            prefilled = await self._prefill(request, rid, prep, seed)
            if prefilled is None:
                sink.cancel()
                return
            first, handle = prefilled
            source = bls_contract.TransportSource(self.transport, handle)
            self.loop.add_prefilled(
                rid, prep.prompt_ids, prep.gen.params, first, seed, source, sink, prep.deadline
            )
        except PrefillError as exc:
            sink.fail(str(exc), exc.kind)
        except Exception as exc:  # every request must end with FINAL, whatever went wrong
            log.exception("request %s failed before decode", rid)
            if handle:
                self.transport.release(handle)
            sink.fail(f"internal error: {exc}", "internal")

    async def _prefill(
        self, request: Any, rid: str, prep: Prepared, seed: int
    ) -> tuple[int, bytes] | None:
        """The first token and KV handle from ``prefill``, retried while its pool is full; None
        (and no lease held) if the client cancelled meanwhile. PrefillError once the request's
        deadline passed, too."""
        params = bls_contract.params_to_json(prep.gen.params)
        inputs = [
            pb_utils.Tensor(bls_contract.INPUT_IDS, np.array([prep.prompt_ids], dtype=np.int64)),
            pb_utils.Tensor(bls_contract.PARAMS, np.array([[params]], dtype=np.object_)),
            pb_utils.Tensor(bls_contract.SEED, np.array([[seed]], dtype=np.uint64)),
            pb_utils.Tensor(bls_contract.REQUEST_ID, np.array([[rid.encode()]], dtype=np.object_)),
        ]
        auth = bls_contract.auth_tag(self.key, rid)
        retry_until = time.monotonic() + self.cfg.prefill_retry_s
        delay = 0.005
        while True:
            response = await self._call_prefill(inputs, auth, prep.deadline)
            if not response.has_error():
                break
            message = response.error().message()
            if bls_contract.POOL_FULL not in message:
                raise PrefillError(f"prefill failed: {message}", "internal")
            if time.monotonic() > retry_until:
                raise PrefillError(f"server busy: {message}", "unavailable")
            await asyncio.sleep(delay)
            # Asked between tries: a request nobody waits for must not retry on.
            if request.is_cancelled():
                return None
            delay = min(delay * 2, 0.2)
        first = pb_utils.get_output_tensor_by_name(response, bls_contract.FIRST_TOKEN).as_numpy()
        handle = _handle_of(response)
        if request.is_cancelled():
            self.transport.release(handle)
            return None
        return int(first.reshape(-1)[0]), handle

    async def _call_prefill(self, inputs: list[Any], auth: str, deadline: float | None) -> Any:
        """One BLS call to ``prefill``, waited for until ``deadline``. The call itself cannot be
        stopped: a response that comes after the request timed out has its lease released here,
        rather than held until it expires."""
        if deadline is not None and time.monotonic() >= deadline:
            raise PrefillError(TIMED_OUT, "unavailable")
        call = asyncio.ensure_future(
            pb_utils.InferenceRequest(
                model_name=self.cfg.prefill_model,
                requested_output_names=[bls_contract.FIRST_TOKEN, bls_contract.KV_HANDLE],
                inputs=inputs,
                parameters={bls_contract.AUTH: auth},
            ).async_exec()
        )
        if deadline is None:
            return await call
        try:
            return await asyncio.wait_for(asyncio.shield(call), deadline - time.monotonic())
        except TimeoutError:
            call.add_done_callback(self._release_late)
            raise PrefillError(TIMED_OUT, "unavailable") from None

    def _release_late(self, call: asyncio.Future[Any]) -> None:
        """Done-callback of a call the request stopped waiting for: free the lease it got."""
        if call.cancelled() or call.exception() is not None:
            return
        response = call.result()
        if not response.has_error():
            self.transport.release(_handle_of(response))

    def finalize(self) -> None:
        super().finalize()
        self.transport.close()


def _handle_of(response: Any) -> bytes:
    """The KV handle in a successful response of ``prefill``."""
    return pb_utils.get_output_tensor_by_name(response, bls_contract.KV_HANDLE).as_numpy().tobytes()
