"""Chunk keys: what names a chunk of KV, and what must match for stored bytes to be reused.

A chunk is ``chunk_tokens`` consecutive prompt tokens (whole KV blocks). Its key is chained,
``k_i = H(k_{i-1}, namespace, chunk i)`` (BLAKE2b-256), so a key names the whole prefix up to
its chunk. The namespace digest covers the model, dtype, KV layout fingerprint, world size, rank,
KV cache group, chunk size and an optional salt: bytes stored under one layout are never found
under another (the server checks the layout again, on RETRIEVE).

Pure functions of their arguments; nothing here talks to the server. The trap: a key must be the
same in every engine process, so it may hash only what every process computes alike (the
tokens, or the engine's own block hashes where they are cross-process, never Python's ``hash``).
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from typing import Sequence

KEY_BYTES = 32


@dataclass(frozen=True)
class Namespace:
    """What must match for stored KV bytes to be valid for another engine."""

    model: str
    dtype: str
    layout: str               # a fingerprint of the KV layout: shapes, strides, block size, backend
    world_size: int = 1
    rank: int = 0
    chunk_tokens: int = 0
    salt: str = ""
    group: int = 0            # the engine's KV cache group (hybrid models have several)

    def for_rank(self, rank: int, group: int = 0) -> "Namespace":
        return dataclasses.replace(self, rank=rank, group=group)

    @property
    def digest(self) -> bytes:
        text = "\x1f".join(["lmshm-ns-2", self.model, self.dtype, self.layout, str(self.world_size),
                            str(self.rank), str(self.chunk_tokens), self.salt, str(self.group)])
        return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=KEY_BYTES).digest()


def _salt_root(salt: bytes) -> bytes:
    """Where a chain starts: nothing, or a digest of the request's salt (a tenant, an adapter)."""
    if not salt:
        return b""
    return hashlib.blake2b(b"lmshm-salt\x1f" + salt, digest_size=KEY_BYTES).digest()


def chunk_keys(namespace: bytes, tokens: Sequence[int], chunk_tokens: int, salt: bytes = b"") -> list[bytes]:
    """Keys of every *whole* chunk of ``tokens``, chained from the first.

    ``salt`` is the request's own identity (a tenant, a LoRA adapter, ...): two requests with
    the same tokens and different salts share no key. Engines without block hashes of their
    own (TRT-LLM) use this."""
    keys: list[bytes] = []
    prev = _salt_root(salt)
    for c in range(len(tokens) // chunk_tokens):
        h = hashlib.blake2b(digest_size=KEY_BYTES)
        h.update(prev)
        h.update(namespace)
        chunk = tokens[c * chunk_tokens:(c + 1) * chunk_tokens]
        h.update(b"".join(int(t).to_bytes(4, "little", signed=True) for t in chunk))
        prev = h.digest()
        keys.append(prev)
    return keys


def chunk_keys_from_hashes(namespace: bytes, block_hashes: Sequence[bytes], hashes_per_chunk: int) -> list[bytes]:
    """Keys of every whole chunk from the engine's own chained block hashes (vLLM's
    ``request.block_hashes``, which already cover the cache salt, LoRA, multimodal inputs and
    prompt embeddings): ``k_i = H(k_{i-1}, namespace, hash of chunk i's last block)``."""
    keys: list[bytes] = []
    prev = b""
    for c in range(len(block_hashes) // hashes_per_chunk):
        h = hashlib.blake2b(digest_size=KEY_BYTES)
        h.update(prev)
        h.update(namespace)
        h.update(b"engine-block-hash")
        h.update(bytes(block_hashes[(c + 1) * hashes_per_chunk - 1]))
        prev = h.digest()
        keys.append(prev)
    return keys


def chunk_block_ids(block_ids: Sequence[int], first_chunk: int, chunks: int, chunk_blocks: int) -> list[int]:
    """The block ids of chunks ``[first_chunk, first_chunk + chunks)`` of a request."""
    return list(block_ids[first_chunk * chunk_blocks:(first_chunk + chunks) * chunk_blocks])
