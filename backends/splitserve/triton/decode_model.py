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
        self.transport = get_transport(self.cfg.transport, key=self.key)
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
            first, handle = await self._prefill(rid, prep, seed)
            if request.is_cancelled():
                self.transport.release(handle)
                sink.cancel()
                return
            source = bls_contract.TransportSource(self.transport, handle)
            self.loop.add_prefilled(
                rid, prep.prompt_ids, prep.gen.params, first, seed, source, sink
            )
        except PrefillError as exc:
            sink.fail(str(exc), exc.kind)
        except Exception as exc:  # every request must end with FINAL, whatever went wrong
            log.exception("request %s failed before decode", rid)
            if handle:
                self.transport.release(handle)
            sink.fail(f"internal error: {exc}", "internal")

    async def _prefill(self, rid: str, prep: Prepared, seed: int) -> tuple[int, bytes]:
        params = bls_contract.params_to_json(prep.gen.params)
        inputs = [
            pb_utils.Tensor(bls_contract.INPUT_IDS, np.array([prep.prompt_ids], dtype=np.int64)),
            pb_utils.Tensor(bls_contract.PARAMS, np.array([[params]], dtype=np.object_)),
            pb_utils.Tensor(bls_contract.SEED, np.array([[seed]], dtype=np.uint64)),
            pb_utils.Tensor(bls_contract.REQUEST_ID, np.array([[rid.encode()]], dtype=np.object_)),
        ]
        auth = bls_contract.auth_tag(self.key, rid)
        deadline = time.monotonic() + self.cfg.prefill_retry_s
        delay = 0.005
        while True:
            response = await pb_utils.InferenceRequest(
                model_name=self.cfg.prefill_model,
                requested_output_names=[bls_contract.FIRST_TOKEN, bls_contract.KV_HANDLE],
                inputs=inputs,
                parameters={bls_contract.AUTH: auth},
            ).async_exec()
            if not response.has_error():
                break
            message = response.error().message()
            if bls_contract.POOL_FULL not in message:
                raise PrefillError(f"prefill failed: {message}", "internal")
            if time.monotonic() > deadline:
                raise PrefillError(f"server busy: {message}", "unavailable")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.2)
        first = pb_utils.get_output_tensor_by_name(response, bls_contract.FIRST_TOKEN).as_numpy()
        handle = pb_utils.get_output_tensor_by_name(response, bls_contract.KV_HANDLE).as_numpy()
        return int(first.reshape(-1)[0]), handle.tobytes()

    def finalize(self) -> None:
        super().finalize()
        self.transport.close()
