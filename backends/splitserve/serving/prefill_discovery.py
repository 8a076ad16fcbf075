"""Where the prefill servers of a decode server are: a static list of ``HOST:PORT``, or a DNS
name ``NAME[:PORT]`` re-resolved every few seconds to one server per address record (a
Kubernetes headless Service lists one record per ready pod).

Servers are ``host:port`` strings, IPv6 hosts in brackets (``[::1]:8001``): the form gRPC
targets take, and the router's keys.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import math
import re
import socket
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

log = logging.getLogger(__name__)

DEFAULT_PORT = 8001
"""Triton's gRPC port."""
DEFAULT_INTERVAL_S = 5.0

_HOST_NAME = re.compile(r"^[A-Za-z0-9_]([A-Za-z0-9_.-]*[A-Za-z0-9_.])?$")

Resolver = Callable[..., Sequence[tuple[Any, ...]]]
"""``socket.getaddrinfo``'s signature: ``(host, port, family, type, ...)`` -> 5-tuples."""


def format_server(host: str, port: int) -> str:
    """``host:port``, an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_host_port(text: str, default_port: int | None, what: str) -> tuple[str, int]:
    """``HOST:PORT``, ``[IPV6]:PORT`` (or without ``:PORT`` if ``default_port``) -> (host,
    port). ValueError names ``what`` and the bad value."""
    value = text.strip()
    bad = f"{what} {text!r}"
    if "://" in value or "/" in value:
        raise ValueError(f"{bad}: expected HOST:PORT (no scheme, no path)")
    if value.startswith("["):
        close = value.find("]")
        if close < 0:
            raise ValueError(f"{bad}: '[' without ']'")
        host, rest = value[1:close], value[close + 1 :]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"{bad}: {host!r} in brackets is no IPv6 address") from None
        if rest and not rest.startswith(":"):
            raise ValueError(f"{bad}: expected ':PORT' after ']'")
        port_text = rest[1:] if rest else None
    elif value.count(":") > 1:
        raise ValueError(f"{bad}: an IPv6 address goes in brackets, like [::1]:{DEFAULT_PORT}")
    else:
        host, sep, port_text_or_empty = value.partition(":")
        port_text = port_text_or_empty if sep else None
        if not _HOST_NAME.match(host):
            raise ValueError(f"{bad}: expected HOST:PORT, {host!r} is no host name")
    if port_text is None:
        if default_port is None:
            raise ValueError(f"{bad}: no port (expected HOST:PORT)")
        return host, default_port
    if not (port_text.isascii() and port_text.isdigit()) or not 0 < int(port_text) < 65536:
        raise ValueError(f"{bad}: port {port_text!r} is not in 1-65535")
    return host, int(port_text)


def parse_prefill_url(text: str) -> str:
    """``HOST:PORT`` of one prefill server, normalized (``[::1]:8001`` for IPv6)."""
    return format_server(*parse_host_port(text, None, "prefill server"))


def parse_prefill_urls(text: str) -> list[str]:
    """Comma-separated ``HOST:PORT`` list -> servers in order, duplicates dropped."""
    servers = [parse_prefill_url(part) for part in text.split(",") if part.strip()]
    if not servers:
        raise ValueError(f"prefill servers {text!r}: none given")
    return list(dict.fromkeys(servers))


def parse_prefill_dns(text: str) -> tuple[str, int]:
    """``NAME[:PORT]`` -> (name, port); the port defaults to ``DEFAULT_PORT``."""
    return parse_host_port(text, DEFAULT_PORT, "prefill DNS name")


class Discovery(ABC):
    """A source of the current prefill servers."""

    interval_s: float = math.inf
    """How often ``poll`` resolves again."""

    def __init__(self) -> None:
        self._next = -math.inf

    @abstractmethod
    async def resolve(self) -> set[str]:
        """The servers now; OSError if they cannot be found out now."""

    @abstractmethod
    def describe(self) -> str:
        """For logs and errors."""

    async def poll(self, now: float) -> set[str] | None:
        """The servers if a resolution was due at ``now`` (the first always is) and worked;
        None otherwise. A failed resolution is logged and the caller keeps the servers it has:
        a DNS hiccup must not empty the fleet."""
        if now < self._next:
            return None
        self._next = now + self.interval_s
        try:
            return await self.resolve()
        except OSError as exc:
            log.warning("prefill servers of %s: %s (keeping the known ones)", self.describe(), exc)
            return None


class StaticDiscovery(Discovery):
    def __init__(self, servers: Sequence[str]) -> None:
        super().__init__()
        self.servers = [parse_prefill_url(s) for s in servers]

    async def resolve(self) -> set[str]:
        return set(self.servers)

    def describe(self) -> str:
        return ",".join(self.servers)


class DnsDiscovery(Discovery):
    """One server per address that ``name`` resolves to, every ``interval_s``."""

    def __init__(
        self,
        name: str,
        port: int = DEFAULT_PORT,
        interval_s: float = DEFAULT_INTERVAL_S,
        resolver: Resolver | None = None,
    ) -> None:
        super().__init__()
        if not interval_s > 0:
            raise ValueError(f"DNS interval must be positive, got {interval_s}")
        self.name = name
        self.port = port
        self.interval_s = interval_s
        self._resolver = resolver
        """None: ``socket.getaddrinfo``, looked up at call time (tests patch it)."""

    async def resolve(self) -> set[str]:
        resolver = self._resolver or socket.getaddrinfo
        # getaddrinfo blocks (it may wait on a DNS server for seconds): not on the event loop.
        infos = await asyncio.get_running_loop().run_in_executor(
            None, lambda: resolver(self.name, self.port, 0, socket.SOCK_STREAM)
        )
        servers = {format_server(str(info[4][0]), self.port) for info in infos}
        if not servers:
            raise OSError(f"{self.name} resolved to no address")
        return servers

    def describe(self) -> str:
        return format_server(self.name, self.port)


def discovery_from(
    prefill_urls: str, prefill_dns: str, interval_s: float = DEFAULT_INTERVAL_S
) -> Discovery:
    """The discovery of a decode config: ``prefill_urls`` (comma-separated) or ``prefill_dns``,
    exactly one of them."""
    if bool(prefill_urls) == bool(prefill_dns):
        raise ValueError("remote prefill needs exactly one of prefill_urls and prefill_dns")
    if prefill_urls:
        return StaticDiscovery(parse_prefill_urls(prefill_urls))
    name, port = parse_prefill_dns(prefill_dns)
    return DnsDiscovery(name, port, interval_s)
