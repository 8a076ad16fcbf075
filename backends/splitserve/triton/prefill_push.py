"""``prefill`` pushing prompts' KV into decode's blocks: the requests of a pass that came with a
``kv_target`` (``serving.layer_push``). Each run of layers (``serving.layer_chunks``) is WRITten
as soon as the pass wrote it; the request is answered once all its WRITEs are done, with the
target as its handle, and its blocks here are freed then (nothing is leased)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import triton_python_backend_utils as pb_utils

from splitserve.engine.request import Request
from splitserve.serving import bls_contract
from splitserve.transport.base import KVTransport

if TYPE_CHECKING:
    from splitserve.transport.nixl import NixlTransport

log = logging.getLogger(__name__)


def target_of(request: Any) -> bytes | None:
    """The request's ``kv_target`` bytes, None without one."""
    tensor = pb_utils.get_input_tensor_by_name(request, bls_contract.KV_TARGET)
    if tensor is None:
        return None
    return bytes(tensor.as_numpy().astype(np.uint8, copy=False).reshape(-1).tobytes())


class PassPushes:
    """The pushes of one pass, by the index of their request in ``execute``'s list."""

    def __init__(self, transport: KVTransport, device: torch.device) -> None:
        self._transport = transport
        self._cuda = device.type == "cuda"
        self._nixl: NixlTransport | None = None
        """The transport once a push opened (pushes need nixl)."""
        self._keys: dict[int, bytes] = {}
        self._targets: dict[int, bytes] = {}

    def __bool__(self) -> bool:
        return bool(self._keys)

    def __contains__(self, i: int) -> bool:
        return i in self._keys

    def open(self, i: int, target: bytes, req: Request) -> None:
        """Check ``target`` against ``req``'s allocated blocks; raises ValueError (an
        ``InvalidHandle`` too) naming the problem."""
        from splitserve.transport.nixl import NixlTransport

        if not isinstance(self._transport, NixlTransport):
            raise ValueError(f"{bls_contract.KV_TARGET} needs a prefill on transport nixl")
        self._nixl = self._transport
        self._keys[i] = self._nixl.open_push(target, req.block_ids)
        self._targets[i] = target

    def written(self, layers: range) -> None:
        """``layers`` of the pass are written: WRITE them for every push."""
        assert self._nixl is not None  # a push was opened
        if self._cuda:
            torch.cuda.current_stream().synchronize()  # the layers' writes are only enqueued
        for key in self._keys.values():
            self._nixl.push_layers(key, layers)

    def finish(self) -> dict[int, str | None]:
        """Wait for every push's WRITEs; per request, why its push failed (None: it is in)."""
        failures: dict[int, str | None] = {}
        for i, key in self._keys.items():
            assert self._nixl is not None  # a push was opened
            try:
                self._nixl.finish_push(key)
                failures[i] = None
            except Exception as exc:  # each push fails alone; the transport says why
                log.warning("KV push failed: %s", exc)
                failures[i] = f"KV push to decode failed: {exc}"
        self._keys.clear()
        return failures

    def response(self, i: int, token: int) -> Any:
        """The answer of a pushed request: its first token, its target as the handle."""
        return pb_utils.InferenceResponse(
            output_tensors=[
                pb_utils.Tensor(bls_contract.FIRST_TOKEN, np.array([[token]], dtype=np.int64)),
                pb_utils.Tensor(
                    bls_contract.KV_HANDLE, np.frombuffer(self._targets[i], np.uint8)[None, :]
                ),
            ]
        )
