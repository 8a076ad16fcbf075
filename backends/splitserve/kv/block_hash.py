"""Content hashes of full KV blocks, for prefix caching.

A block's KV depends on its tokens and on every token before it, so its hash chains: the first
block's is taken over a key and its token ids, each next one over the previous hash and its
token ids. The key names whatever else changes the KV (the model's layout and dtype today; an
adapter would join it). Two sequences share a block's hash exactly when they share every token
up to the block's end, under the same key. BLAKE2b, 16 bytes: a collision would silently serve
another prompt's KV, so the hash is cryptographic, not Python's ``hash``.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

from splitserve.kv.layout import KVLayout

DIGEST_SIZE = 16


def layout_key(layout: KVLayout) -> bytes:
    """The key of blocks of ``layout``'s pools: what of the model the KV's bytes depend on."""
    fields = (layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.block_size)
    return f"{layout.dtype}:{':'.join(map(str, fields))}".encode()


def extend_hashes(
    hashes: list[bytes], token_ids: Sequence[int], block_size: int, key: bytes, blocks: int
) -> list[bytes]:
    """Append to ``hashes`` (those of the first blocks of ``token_ids``) the hashes of the
    following full blocks, up to ``blocks`` blocks in all; returns ``hashes``."""
    blocks = min(blocks, len(token_ids) // block_size)
    while len(hashes) < blocks:
        i = len(hashes)
        h = hashlib.blake2b(hashes[-1] if hashes else key, digest_size=DIGEST_SIZE)
        h.update(array("q", token_ids[i * block_size : (i + 1) * block_size]).tobytes())
        hashes.append(h.digest())
    return hashes
