"""The contract between ``llm`` (decode) and ``prefill``: tensor names, params, KV sources."""

from __future__ import annotations

import dataclasses
import hmac
import json

from splitserve.engine.sampling_params import SamplingParams
from splitserve.kv.handle import mac
from splitserve.transport.base import KVTransport

# prefill inputs
INPUT_IDS = "input_ids"
PARAMS = "sampling_parameters"
SEED = "seed"
REQUEST_ID = "request_id"
KV_TARGET = "kv_target"
"""Optional: a push target (``transport.nixl_push``) naming the caller's blocks that prefill
WRITEs the KV into, layer by layer; the answer then carries the target as its handle."""
# prefill outputs
FIRST_TOKEN = "first_token"
KV_HANDLE = "kv_handle"
LAYERS_READY = "layers_ready"
"""Of a prefill that streams its KV by layer (a decoupled model): how many layers of the
prompt's KV are written. The first response carries the handle and 0; the last (FINAL) the
first token and every layer."""

# request parameter of every call to prefill
AUTH = "splitserve_auth"

_PARAM_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}
_AUTH_DOMAIN = b"splitserve prefill request\0"

POOL_FULL = "prefill KV pool is full"
"""Prefix of the error prefill returns when a prompt does not fit now; ``llm`` retries."""


def params_to_json(params: SamplingParams) -> bytes:
    return json.dumps(dataclasses.asdict(params)).encode()


def params_from_json(data: bytes) -> SamplingParams:
    """Raises ValueError naming the problem: ``prefill`` is reachable by any client."""
    try:
        obj = json.loads(data)
    except ValueError as exc:
        raise ValueError(f"{PARAMS} is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{PARAMS} must be a JSON object")
    unknown = sorted(set(obj) - _PARAM_FIELDS)
    if unknown:
        raise ValueError(f"{PARAMS} has unknown keys {unknown}")
    return SamplingParams(**obj)


def auth_tag(key: bytes, request_id: str) -> str:
    """What ``llm`` sends in the ``AUTH`` parameter: proof that the caller holds the handle key
    of this server start, bound to the request id."""
    return mac(key, _AUTH_DOMAIN + request_id.encode()).hex()


def check_auth(key: bytes, request_id: str, parameters: str) -> None:
    """Raise ValueError unless the request's parameters (JSON) carry ``auth_tag``: ``prefill``
    is internal, and a client calling it directly must get nothing, not even a lease."""
    try:
        tag = json.loads(parameters or "{}").get(AUTH)
    except (ValueError, AttributeError):
        tag = None
    if not isinstance(tag, str) or not hmac.compare_digest(tag, auth_tag(key, request_id)):
        raise ValueError(
            "prefill is internal to the server: call 'llm' (requests to 'prefill' must come "
            "from it)"
        )


class TransportSource:
    """A handed-over request's KV behind a handle: fetch it, then release the owner's lease."""

    def __init__(self, transport: KVTransport, handle: bytes) -> None:
        self.transport = transport
        self.handle = handle

    def load(self, dst_block_ids: list[int], skip: int = 0) -> None:
        try:
            self.transport.fetch(self.handle, dst_block_ids, skip)
        finally:
            self.transport.release(self.handle)

    def discard(self) -> None:
        self.transport.release(self.handle)
