"""Prefill server discovery: address parsing, and DNS names re-resolved on their interval."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest

from splitserve.serving.prefill_discovery import (
    DEFAULT_PORT,
    DnsDiscovery,
    StaticDiscovery,
    discovery_from,
    parse_prefill_dns,
    parse_prefill_url,
    parse_prefill_urls,
)


@pytest.mark.parametrize(
    ("text", "server"),
    [
        ("host:8001", "host:8001"),
        (" 10.0.0.2:9000 ", "10.0.0.2:9000"),
        (
            "prefill-0.prefill.ns.svc.cluster.local:8001",
            "prefill-0.prefill.ns.svc.cluster.local:8001",
        ),
        ("[::1]:8001", "[::1]:8001"),
        ("[fd00::2]:1", "[fd00::2]:1"),
    ],
)
def test_parse_prefill_url(text: str, server: str) -> None:
    assert parse_prefill_url(text) == server


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("host", "no port"),
        ("host:", "port ''"),
        ("host:0", "port '0'"),
        ("host:65536", "port '65536'"),
        ("host:80x", "port '80x'"),
        (":8001", "no host name"),
        ("grpc://host:8001", "no scheme"),
        ("host:8001/v2", "no scheme"),
        ("::1:8001", "brackets"),
        ("[::1:8001", "without ']'"),
        ("[nothost]:8001", "no IPv6 address"),
        ("[::1]8001", "':PORT' after ']'"),
        ("[::1]", "no port"),
        ("ho st:1", "no host name"),
    ],
)
def test_bad_prefill_url_names_the_value(text: str, problem: str) -> None:
    with pytest.raises(ValueError) as err:
        parse_prefill_url(text)
    assert repr(text) in str(err.value) and problem in str(err.value)


def test_parse_prefill_urls() -> None:
    assert parse_prefill_urls("a:1, b:2,,a:1,[::1]:3") == ["a:1", "b:2", "[::1]:3"]
    with pytest.raises(ValueError, match="none given"):
        parse_prefill_urls(" , ")
    with pytest.raises(ValueError, match="'b'"):
        parse_prefill_urls("a:1,b")


def test_parse_prefill_dns() -> None:
    assert parse_prefill_dns("prefill.ns.svc") == ("prefill.ns.svc", DEFAULT_PORT)
    assert parse_prefill_dns("prefill:9001") == ("prefill", 9001)
    with pytest.raises(ValueError, match="prefill DNS name 'prefill:x'"):
        parse_prefill_dns("prefill:x")


def test_discovery_from_config_values() -> None:
    static = discovery_from("a:1,b:2", "")
    assert isinstance(static, StaticDiscovery)
    assert asyncio.run(static.resolve()) == {"a:1", "b:2"}
    dns = discovery_from("", "prefill-headless")
    assert isinstance(dns, DnsDiscovery)
    assert (dns.name, dns.port, dns.interval_s) == ("prefill-headless", DEFAULT_PORT, 5.0)
    with pytest.raises(ValueError, match="exactly one"):
        discovery_from("a:1", "prefill")
    with pytest.raises(ValueError, match="exactly one"):
        discovery_from("", "")


class FakeDns:
    """``socket.getaddrinfo`` answering from ``records`` (an OSError: resolution fails)."""

    def __init__(self) -> None:
        self.records: list[str] | OSError = []
        self.asked: list[tuple[Any, ...]] = []

    def __call__(self, host: str, port: int, family: int = 0, type: int = 0) -> list[Any]:
        self.asked.append((host, port, family, type))
        if isinstance(self.records, OSError):
            raise self.records
        infos = []
        for address in self.records:
            if ":" in address:
                sockaddr: tuple[Any, ...] = (address, port, 0, 0)
                infos.append((socket.AF_INET6, socket.SOCK_STREAM, 6, "", sockaddr))
            else:
                infos.append((socket.AF_INET, socket.SOCK_STREAM, 6, "", (address, port)))
        return infos


def test_dns_re_resolves_on_its_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    dns = FakeDns()
    monkeypatch.setattr(socket, "getaddrinfo", dns)
    discovery = DnsDiscovery("prefill.ns.svc", 9001, interval_s=5.0)

    async def run() -> None:
        dns.records = ["10.0.0.1", "10.0.0.2", "10.0.0.2", "fd00::3"]
        # The first poll always resolves; one server per distinct address.
        assert await discovery.poll(0.0) == {"10.0.0.1:9001", "10.0.0.2:9001", "[fd00::3]:9001"}
        dns.records = ["10.0.0.2", "10.0.0.4"]
        assert await discovery.poll(4.9) is None  # not due yet
        assert await discovery.poll(5.0) == {"10.0.0.2:9001", "10.0.0.4:9001"}
        # A failure keeps the caller's servers (None) and is tried again an interval later.
        dns.records = socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        assert await discovery.poll(10.0) is None
        dns.records = []
        assert await discovery.poll(15.0) is None  # no address: a failure too
        dns.records = ["10.0.0.5"]
        assert await discovery.poll(19.0) is None
        assert await discovery.poll(20.0) == {"10.0.0.5:9001"}

    asyncio.run(run())
    assert len(dns.asked) == 5
    assert {asked[:2] for asked in dns.asked} == {("prefill.ns.svc", 9001)}
    assert {asked[3] for asked in dns.asked} == {socket.SOCK_STREAM}


def test_dns_resolver_argument_and_bad_interval() -> None:
    dns = FakeDns()
    dns.records = ["10.1.0.1"]
    discovery = DnsDiscovery("p", resolver=dns)
    assert asyncio.run(discovery.resolve()) == {f"10.1.0.1:{DEFAULT_PORT}"}
    with pytest.raises(ValueError, match="positive"):
        DnsDiscovery("p", interval_s=0)


def test_static_discovery_never_re_resolves() -> None:
    discovery = StaticDiscovery(["a:1"])

    async def run() -> None:
        assert await discovery.poll(0.0) == {"a:1"}
        assert await discovery.poll(1e9) is None

    asyncio.run(run())
