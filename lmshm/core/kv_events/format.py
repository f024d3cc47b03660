"""vLLM's KV-event format, as lmshm writes and reads it, and token ids packed.

The structs mirror ``vllm/distributed/kv_events.py`` (vLLM 0.32): events are msgpack maps tagged
by ``"type"``, a batch an array ``[ts, events, data_parallel_rank]``; ``decode_batch`` also
reads the positional arrays vLLM sent before (PR #42892). ``TIER_MEDIA`` says which medium and
locality each lmshm tier is in vLLM's terms. ``block_salt`` reads a block's extra keys as
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
import time
from array import array
from typing import Any, Optional, Sequence, Union

import msgspec

#: Each tier's ``(medium, locality)`` in vLLM's events; a tier not listed is ``_OTHER_MEDIA``.
TIER_MEDIA = {"pool": ("CPU", "LOCAL"), "disk": ("STORAGE", "LOCAL"), "remote": ("STORAGE", "REMOTE")}
_OTHER_MEDIA = ("STORAGE", "LOCAL")


def media_of(tier: str) -> tuple[str, str]:
    """``(medium, locality)`` of ``tier`` in vLLM's events (``TIER_MEDIA``)."""
    return TIER_MEDIA.get(tier, _OTHER_MEDIA)


BlockHashValue = Union[int, bytes]


# ---- vLLM's wire format (vllm/distributed/kv_events.py, vLLM 0.32): a map tagged by "type" ----


class KvEvent(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """Base of the three events; the tag is the class name, in the ``"type"`` field."""


class BlockStored(KvEvent):
    block_hashes: list[BlockHashValue]
    parent_block_hash: Optional[BlockHashValue]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str]
    extra_keys: Optional[list[Any]] = None
    group_idx: Optional[int] = None
    kv_cache_spec_kind: Optional[str] = None
    kv_cache_spec_sliding_window: Optional[int] = None
    locality: Optional[str] = None
    ownership: Optional[str] = None
    session_id: Optional[str] = None


class BlockRemoved(KvEvent):
    block_hashes: list[BlockHashValue]
    medium: Optional[str]
    group_idx: Optional[int] = None
    locality: Optional[str] = None
    ownership: Optional[str] = None


class AllBlocksCleared(KvEvent):
    pass


class KvEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]
    data_parallel_rank: Optional[int] = None


_encoder = msgspec.msgpack.Encoder()


def encode_batch(events: Sequence[KvEvent], ts: Optional[float] = None) -> bytes:
    """One ``KVEventBatch`` payload, as vLLM's publisher sends it."""
    return _encoder.encode(KvEventBatch(time.time() if ts is None else ts, list(events)))


_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
                  "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window", "locality",
                  "ownership", "session_id")
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx", "locality", "ownership")
_FIELDS = {"BlockStored": _STORED_FIELDS, "BlockRemoved": _REMOVED_FIELDS, "AllBlocksCleared": ()}


class BadBatch(ValueError):
    """A payload that is not a KV event batch in either encoding."""


def decode_batch(payload: bytes) -> tuple[float, list[dict[str, Any]]]:
    """``(ts, events)`` from a ``KVEventBatch`` payload in either encoding vLLM has used: events
    as maps tagged by ``"type"`` (vLLM >= 0.20, PR #42892) or as positional arrays whose first
    item is the tag (before). Each event comes back as a dict with ``"type"`` and its fields."""
    try:
        raw = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as exc:
        raise BadBatch(f"not msgpack: {exc}") from None
    if not isinstance(raw, list) or len(raw) < 2 or not isinstance(raw[1], list):
        raise BadBatch("a KV event batch is an array [ts, events, (data_parallel_rank)]")
    out = []
    for item in raw[1]:
        if isinstance(item, dict):
            kind = item.get("type")
            if kind not in _FIELDS:
                raise BadBatch(f"unknown event type {str(kind)[:40]!r}")
            out.append(dict(item))
        elif isinstance(item, list) and item and item[0] in _FIELDS:
            names = _FIELDS[item[0]]
            event = {"type": item[0]}
            event.update(zip(names, item[1:1 + len(names)]))
            out.append(event)
        else:
            raise BadBatch("an event is a map with a 'type' or an array starting with its tag")
    return float(raw[0]), out

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

