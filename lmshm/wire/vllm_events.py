"""vLLM's KV-event format: the three events, their batch, and a decoder for both encodings.

These are the bytes a KV-aware router already reads from vLLM (vllm/distributed/kv_events.py):
a ``KVEventBatch`` ``[ts, events, data_parallel_rank]`` whose events are maps tagged by
``"type"`` (the class name). lmshm sends them on two wires: its KV event stream for routers
(``lmshm.endpoints.kv_stream``) and the ``KV_EVENTS`` reply (``protocol.KvEventsReply``); the
core's event log and index (``lmshm.core.kv_events``) build them.

The trap: the field order and names are vLLM's, not ours; a field vLLM adds goes at the end
with a default, or a router that decodes positionally reads the wrong value.
"""

from __future__ import annotations

import time
from typing import Any, Optional, Sequence, Union

import msgspec

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
