"""KV events for routers: vLLM's event format, the event log and the index, one room each.

- ``format``: vLLM's ``KVEventBatch`` and its events (msgspec structs), ``encode_batch`` and
  ``decode_batch``, each tier's medium (``TIER_MEDIA``), block salts, and ``packed_tokens``:
  the one way token ids are packed (little-endian int32), here and in the adapter.
- ``adverts``: a peer's advert checked (``check_advert``) and kept as a chunk; ``chunk_cost``.
- ``log``: ``EventLog``, the bounded ring of ``Record``s readers follow with a cursor.
- ``maps``: what the index has applied (chunks, shares, lookups); no lock of its own.
- ``index``: ``KvIndex``, the queue the pool, the tiers and STOREs feed, and its readers.

The imports go one way: format, adverts, log, maps, index. The design, the bounds and their
figures: docs/design/kv-events.md. A bound is a module constant of the room that applies it
(``index.MAX_QUEUED``, ``maps.MAX_UNRESIDENT``...): change it there, not here.
"""

from lmshm.core.kv_events.adverts import CheckedAdvert, check_advert, chunk_cost
from lmshm.core.kv_events.format import (
    TIER_MEDIA,
    AllBlocksCleared,
    BadBatch,
    BlockRemoved,
    BlockStored,
    KvEvent,
    KvEventBatch,
    block_salt,
    decode_batch,
    encode_batch,
    packed_tokens,
)
from lmshm.core.kv_events.index import KvIndex
from lmshm.core.kv_events.log import BOTH, NODE, OWNER, EventLog, Record, event_bytes

__all__ = [
    "BOTH", "NODE", "OWNER", "TIER_MEDIA", "AllBlocksCleared", "BadBatch", "BlockRemoved", "BlockStored",
    "CheckedAdvert", "EventLog", "KvEvent", "KvEventBatch", "KvIndex", "Record", "block_salt", "check_advert",
    "chunk_cost", "decode_batch", "encode_batch", "event_bytes", "packed_tokens",
]
