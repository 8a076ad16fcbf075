"""How ``llm`` reaches prefill: one interface, over BLS (the local ``prefill`` model) or gRPC
(remote prefill servers, ``serving.remote_prefill``). Pure data and an ABC: no I/O here."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class PrefillCall:
    """One prompt that ``llm`` sends to prefill (``bls_contract`` names the tensors)."""

    prompt_ids: list[int]
    params_json: bytes
    """``bls_contract.params_to_json`` of the request's sampling parameters."""
    seed: int
    request_id: str
    auth: str
    """``bls_contract.auth_tag`` of ``request_id``: prefill refuses calls without it."""
    kv_target: bytes | None = None
    """Where prefill pushes the KV (``serving.layer_push``): blocks reserved by the caller;
    the reply's handle is then this target, and the KV is in once the reply came."""
    failover: bool = False
    """A push tried again, into other blocks, after its first server failed."""


@dataclass(frozen=True)
class PrefillReply:
    first_token: int
    kv_handle: bytes
    """The lease on the prompt's KV blocks; whoever gets it must release it."""
    server: str
    """Who prefilled: ``"local"`` over BLS, else the server's ``host:port``."""
    streamed: bool = False
    """The handle went to the call's ``StreamListener`` before the pass ended (the listener's
    owner pulls and releases it)."""


class StreamListener(Protocol):
    """Hears a prefill that streams its KV by layer (``bls_contract.LAYERS_READY``); called on
    the client's event loop."""

    def handle(self, kv_handle: bytes) -> None:
        """The lease on the prompt's KV, before the pass wrote any of it: from here on the
        listener owns it, and the call is no longer retried elsewhere."""

    def layers(self, ready: int) -> None:
        """The first ``ready`` layers of the KV are written."""


class PrefillFailed(RuntimeError):
    """A prefill call that produced no reply."""

    def __init__(
        self,
        message: str,
        *,
        pool_full: bool = False,
        retryable: bool = False,
        streamed: bool = False,
        target_spent: bool = False,
    ) -> None:
        super().__init__(message)
        self.streamed = streamed
        """The handle had gone to the listener, or the call pushed into the caller's blocks:
        the pass failed midway (never retried)."""
        self.pool_full = pool_full
        """Prefill said its KV pool is full now: the caller backs off and calls again."""
        self.retryable = retryable
        """The server failed (connection, unavailable, died), not the request: another server
        (or the same one later) may succeed."""
        self.target_spent = target_spent
        """The failed call carried a push target (``kv_target``): its server may still write
        into those blocks, so another call needs a target naming other blocks."""


class PrefillClient(ABC):
    """Calls prefill for ``llm``. Used from one event loop (the model's)."""

    @abstractmethod
    async def prefill(
        self, call: PrefillCall, listener: StreamListener | None = None
    ) -> PrefillReply:
        """The first token and KV handle of ``call``; PrefillFailed if there is none.

        A prefill that streams its KV by layer gives ``listener`` the handle early and each
        layer count (the reply then says ``streamed``); others ignore it. Cancelling the
        awaiting task cancels the call where the transport allows it (gRPC does, BLS does
        not); a reply that arrives anyway is the caller's to release."""

    @abstractmethod
    async def close(self) -> None:
        """Stop background work and drop connections; no call may follow."""

    @abstractmethod
    def stats(self) -> dict[str, int]:
        """Counters for the metrics endpoint (``calls``, ``failures``, ...); read on the
        metrics thread, so safe to call from a thread other than the loop's."""
