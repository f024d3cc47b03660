"""vLLM's KV-event format as the core uses it, and token ids packed.

The structs are ``lmshm.wire.vllm_events``'s (the wire carries them; they mirror vLLM 0.32's
``vllm/distributed/kv_events.py``), re-exported here under the names the core has used.
``TIER_MEDIA`` says which medium and locality each lmshm tier is in vLLM's terms. ``block_salt`` reads a block's extra keys as
vLLM's ``to_event_extra_keys`` writes them.

Token ids travel and are kept *packed* (``packed_tokens``): little-endian int32, 4 bytes a
token, one bytes object (``Advert.tokens``, the index's chunks, the log's records). The one
trap: ``array("i")`` is native-endian, so packing and unpacking byte-swap on a big-endian
host; an id outside int32 is ``OverflowError``, never a wrapped value.
"""

from __future__ import annotations

import functools
import struct
import sys
from array import array
from typing import Any, Optional, Sequence

# vLLM's events and their batch are the wire's (both the stream and the KV_EVENTS reply carry
# them); the core builds and reads them through these names.
from lmshm.wire.vllm_events import (  # noqa: F401 (re-exported: the core's names for vLLM's format)
    AllBlocksCleared,
    BadBatch,
    BlockHashValue,
    BlockRemoved,
    BlockStored,
    KvEvent,
    KvEventBatch,
    decode_batch,
    encode_batch,
)

#: Each tier's ``(medium, locality)`` in vLLM's events; a tier not listed is ``_OTHER_MEDIA``.
TIER_MEDIA = {"pool": ("CPU", "LOCAL"), "disk": ("STORAGE", "LOCAL"), "remote": ("STORAGE", "REMOTE")}
_OTHER_MEDIA = ("STORAGE", "LOCAL")


def media_of(tier: str) -> tuple[str, str]:
    """``(medium, locality)`` of ``tier`` in vLLM's events (``TIER_MEDIA``)."""
    return TIER_MEDIA.get(tier, _OTHER_MEDIA)


# ---- token ids, packed ----------------------------------------------------------------------

_BIG_ENDIAN = sys.byteorder == "big"


def packed_tokens(token_ids: Sequence[int]) -> bytes:
    """Token ids packed as an ``Advert`` carries them (its ``tokens``) and the index keeps them:
    little-endian int32, 4 bytes a token. ``OverflowError`` for an id outside int32 (no
    engine's vocabulary is that large), ``TypeError`` for one that is not an int."""
    packed = array("i", token_ids)
    if _BIG_ENDIAN:
        packed.byteswap()
    return packed.tobytes()


def unpacked_tokens(tokens: bytes) -> list[int]:
    """The token ids of ``packed_tokens``'s bytes, as a list."""
    if _BIG_ENDIAN:
        a = array("i", tokens)
        a.byteswap()
        return a.tolist()
    return memoryview(tokens).cast("i").tolist()


@functools.lru_cache(maxsize=64)
def _unpacker(n: int) -> Any:
    return struct.Struct(f"<{n}i").unpack


def token_tuple(tokens: bytes) -> tuple:
    """The token ids of ``packed_tokens``'s bytes as a tuple: what an event carries (one
    unpack, about half the time of ``tuple(unpacked_tokens(tokens))``)."""
    return _unpacker(len(tokens) >> 2)(tokens)


# ---- a block's extra keys -------------------------------------------------------------------

#: ``block_salt``'s answer for a block whose extra keys say more than a lookup by tokens can
#: name (multimodal inputs, prompt embeddings): the block has no token key.
UNNAMED = object()


def block_salt(extra: Any, lora: Optional[str], first: bool) -> Any:
    """The cache salt a block's extra keys carry (None: none), or ``UNNAMED`` when they carry
    more than a lookup by tokens can say. In vLLM's events (``to_event_extra_keys``) a block's
    keys are its LoRA name (every block of a LoRA request), ``[identifier, offset]`` per
    multimodal input, the cache salt (the first block only), a prompt-embeds digest (bytes),
    in that order. So a block is named by its tokens, LoRA and salt when its keys are exactly
    ``[lora]`` (nothing without one), plus, on the first block, one string."""
    keys = list(extra) if isinstance(extra, (list, tuple)) else [] if extra is None else [extra]
    head = [lora] if lora is not None else []
    if keys == head:
        return None
    if first and len(keys) == len(head) + 1 and keys[:-1] == head and isinstance(keys[-1], str):
        return keys[-1]
    return UNNAMED

