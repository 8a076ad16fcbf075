"""``PrefillClient`` over BLS: ``llm`` calls the ``prefill`` model of its own tritonserver."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

from splitserve.serving import bls_contract
from splitserve.serving.prefill_client import (
    PrefillCall,
    PrefillClient,
    PrefillFailed,
    PrefillReply,
    StreamListener,
)


class BlsPrefillClient(PrefillClient):
    """One BLS call per prompt. BLS calls cannot be stopped: a cancelled one runs to its end
    inside Triton, and the lease it returns then goes to ``release`` at once."""

    def __init__(self, model_name: str, release: Callable[[bytes], None]) -> None:
        self.model_name = model_name
        self._release = release
        self._counts = dict.fromkeys(("calls", "failures"), 0)

    async def prefill(
        self, call: PrefillCall, listener: StreamListener | None = None
    ) -> PrefillReply:
        """The local ``prefill`` model never streams (``kv_stream_layers`` is for prefill
        servers): ``listener`` hears nothing. Nor does it push (``kv_push`` needs prefill
        servers)."""
        if call.kv_target is not None:
            raise PrefillFailed("KV pushes (kv_push) need remote prefill servers")
        inputs = [
            pb_utils.Tensor(bls_contract.INPUT_IDS, np.array([call.prompt_ids], dtype=np.int64)),
            pb_utils.Tensor(bls_contract.PARAMS, np.array([[call.params_json]], dtype=np.object_)),
            pb_utils.Tensor(bls_contract.SEED, np.array([[call.seed]], dtype=np.uint64)),
            pb_utils.Tensor(
                bls_contract.REQUEST_ID, np.array([[call.request_id.encode()]], dtype=np.object_)
            ),
        ]
        self._counts["calls"] += 1
        running = asyncio.ensure_future(
            pb_utils.InferenceRequest(
                model_name=self.model_name,
                requested_output_names=[bls_contract.FIRST_TOKEN, bls_contract.KV_HANDLE],
                inputs=inputs,
                parameters={bls_contract.AUTH: call.auth},
            ).async_exec()
        )
        try:
            response = await asyncio.shield(running)
        except asyncio.CancelledError:
            running.add_done_callback(self._release_orphan)
            raise
        if response.has_error():
            self._counts["failures"] += 1
            message = response.error().message()
            raise PrefillFailed(message, pool_full=bls_contract.POOL_FULL in message)
        return PrefillReply(
            first_token=int(_output(response, bls_contract.FIRST_TOKEN).reshape(-1)[0]),
            kv_handle=_output(response, bls_contract.KV_HANDLE).tobytes(),
            server="local",
        )

    def _release_orphan(self, running: asyncio.Future[Any]) -> None:
        """Done-callback of a call nobody waits for any more: free the lease it got."""
        if running.cancelled() or running.exception() is not None:
            return
        response = running.result()
        if not response.has_error():
            self._release(_output(response, bls_contract.KV_HANDLE).tobytes())

    async def close(self) -> None:
        return None

    def stats(self) -> dict[str, int]:
        return dict(self._counts)


def _output(response: Any, name: str) -> np.ndarray:
    array = pb_utils.get_output_tensor_by_name(response, name).as_numpy()
    assert isinstance(array, np.ndarray)
    return array
