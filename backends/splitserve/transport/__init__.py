"""KV transports by name; a transport's module (and its GPU libraries) loads on first use."""

from __future__ import annotations

import importlib
from typing import Any

from splitserve.transport.base import KVTransport

_TRANSPORTS = {
    "cuda_ipc": ("splitserve.transport.cuda_ipc", "CudaIpcTransport"),
    "nixl": ("splitserve.transport.nixl", "NixlTransport"),
    "shm": ("splitserve.transport.shm", "ShmTransport"),
}


def available_transports() -> list[str]:
    return sorted(_TRANSPORTS)


def get_transport(name: str, **kwargs: Any) -> KVTransport:
    """A new transport instance; ``kwargs`` go to its constructor (``key`` at least)."""
    try:
        module_name, class_name = _TRANSPORTS[name]
    except KeyError:
        known = available_transports()
        raise ValueError(f"unknown KV transport {name!r}; known: {known}") from None
    cls = getattr(importlib.import_module(module_name), class_name)
    return cls(**kwargs)


__all__ = ["KVTransport", "available_transports", "get_transport"]
