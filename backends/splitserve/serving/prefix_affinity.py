"""Which prefill server probably holds a prompt's prefix in its cache: pure state for the router.

Decode learns nothing of the prefill servers' caches; it knows what it sent where. Per server
this keeps the block hashes (``kv.block_hash``) of the prompts routed to it lately, at most
``capacity`` of them, least recently routed out first: an estimate of the server's prefix
cache, which evicts least recently used blocks too. A prompt's match on a server is how many of
its leading block hashes that server was sent. A server that failed or left is forgotten (a
restarted server's cache is empty).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from splitserve.kv.block_hash import extend_hashes

ROUTE_KEY = b"splitserve-route"
"""The hashes' key: they are compared with each other only, never with a pool's."""


class PrefixAffinity:
    def __init__(self, block_size: int = 16, capacity: int = 65536) -> None:
        if block_size <= 0 or capacity <= 0:
            raise ValueError("block_size and capacity must be positive")
        self.block_size = block_size
        self.capacity = capacity
        self._sent: dict[str, OrderedDict[bytes, None]] = {}

    def hashes(self, prompt_ids: Sequence[int]) -> list[bytes]:
        """The hashes of the prompt's full blocks (a prefix cache never shares a partial one)."""
        return extend_hashes([], prompt_ids, self.block_size, ROUTE_KEY, len(prompt_ids))

    def matched(self, server: str, hashes: Sequence[bytes]) -> int:
        """Leading blocks of ``hashes`` that ``server`` was sent lately."""
        sent = self._sent.get(server)
        n = 0
        if sent is not None:
            for h in hashes:
                if h not in sent:
                    break
                n += 1
        return n

    def routed(self, server: str, hashes: Sequence[bytes]) -> None:
        """``server`` computes (and caches) a prompt of these blocks."""
        sent = self._sent.setdefault(server, OrderedDict())
        for h in hashes:
            sent[h] = None
            sent.move_to_end(h)
        while len(sent) > self.capacity:
            sent.popitem(last=False)

    def forget(self, server: str) -> None:
        self._sent.pop(server, None)
