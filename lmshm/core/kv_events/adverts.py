"""An advert checked (``check_advert``) and kept as one indexed chunk (``Chunk``): what it costs
and the token keys a lookup by token ids finds it by.

An ``Advert`` is a peer's claim and every byte of it is hostile: ``check_advert`` accepts only
whole blocks of int32 token ids and extra keys of one plain entry per block, and packs the
tokens (``format.packed_tokens``). ``chunk_cost`` is what a chunk is charged against its uid's
share and the index's byte bound; the constants behind it were measured with tracemalloc
(docs/design/kv-events.md, "Bounds"). A ``Chunk`` belongs to ``maps.IndexMaps``, which alone
changes it, under ``KvIndex``'s lock.

The one trap: a ``Chunk`` is never tracked by the cyclic GC (``gc=False``), which is safe only
while every field holds atoms, tuples of atoms or dicts of atoms: a list, a set or a reference
to another chunk in a field would make cycles the GC never frees (and, untracked, never sees).
"""

from __future__ import annotations

import hashlib
import sys
from typing import Any, Optional

import msgspec

from lmshm.core.kv_events.format import UNNAMED, block_salt, packed_tokens, unpacked_tokens


class CheckedAdvert:
    """An ``Advert`` whose fields were checked, its extra keys decoded, its token ids packed
    (little-endian int32, ``tokens``)."""

    __slots__ = ("chunk", "group", "block_size", "block_hashes", "parent_block_hash", "tokens", "lora_name",
                 "extra_keys", "extra_size")

    def __init__(self, advert: Any, tokens: bytes, extra: Optional[list]) -> None:
        self.chunk, self.group, self.block_size = advert.chunk, advert.group, advert.block_size
        self.block_hashes, self.parent_block_hash = advert.block_hashes, advert.parent_block_hash
        self.tokens = tokens
        self.lora_name, self.extra_keys = advert.lora_name, extra
        self.extra_size = len(advert.extra_keys or b"")     # encoded: what chunk_cost charges

    @property
    def token_ids(self) -> list[int]:
        return unpacked_tokens(self.tokens)


def _plain(value: Any, depth: int) -> bool:
    if isinstance(value, (str, bytes, int, float)) or value is None:
        return True
    return depth > 0 and isinstance(value, list) and len(value) <= 16 and all(_plain(v, depth - 1) for v in value)


def check_advert(advert: Any) -> CheckedAdvert:
    """``advert`` made safe to keep and republish, or ``ValueError``: its token ids (a list,
    or packed in ``tokens``: one or the other) must be whole blocks (or absent), and its extra
    keys one entry per block of plain values (strings, bytes, numbers, short lists of them), as
    vLLM's are."""
    n = len(advert.block_hashes)
    packed = getattr(advert, "tokens", b"")
    if packed:
        if advert.token_ids:
            raise ValueError("token ids both as a list and packed")
        if len(packed) != 4 * n * advert.block_size:
            raise ValueError(f"{len(packed)} bytes of packed token ids for {n} blocks of {advert.block_size} "
                             "(4 bytes a token)")
        tokens = bytes(packed)
    elif advert.token_ids:
        if len(advert.token_ids) != n * advert.block_size:
            raise ValueError(f"{len(advert.token_ids)} token ids for {n} blocks of {advert.block_size}")
        try:
            tokens = packed_tokens(advert.token_ids)
        except (OverflowError, TypeError):
            raise ValueError("token ids must be 32-bit integers") from None
    else:
        tokens = b""
    extra = None
    if advert.extra_keys:
        try:
            extra = msgspec.msgpack.decode(advert.extra_keys)
        except Exception as exc:
            raise ValueError(f"extra_keys are not msgpack: {type(exc).__name__}") from None
        if not isinstance(extra, list) or len(extra) != n or not all(_plain(e, 2) for e in extra):
            raise ValueError("extra_keys must be one entry per block: null or a list of plain values")
    return CheckedAdvert(advert, tokens, extra)


class Chunk(msgspec.Struct, gc=False):
    """One advertised chunk, as the index keeps it. Never tracked by the cyclic GC (``gc=False``,
    the module's trap): as a class with a list, sets and a dict of sets it was 7 tracked objects
    a chunk, and a full default index made every full collection hold every thread of the
    server for hundreds of milliseconds (test
    ``test_the_index_and_the_log_add_nothing_for_the_cyclic_gc_to_walk``)."""

    ident: tuple
    uid: int
    space: bytes
    model: str
    world: int
    group: int
    hashes: tuple                       # the engine's block hashes
    parent: Any
    tokens: bytes                       # packed int32 (CheckedAdvert)
    block_size: int
    lora: Optional[str]
    extra: Optional[tuple]              # per block, its extra keys (lists made tuples)
    born: float
    cost: int = 0                       # bytes charged to its uid's share (chunk_cost)
    posted: bool = False                # its hashes and token keys are in the lookup maps (resident)
    keys: dict = {}                     # rank -> that rank's key
    where: dict = {}                    # tier -> the ranks holding it there, a bit each
    servable: tuple = ()                # tiers BlockStored was sent for (and not removed)
    tkeys: tuple = ()                   # per block, its token_key (token_keys)
    xheld: int = 0                      # what its decoded extra keys hold (_held_bytes)

    def rank_of(self, key: bytes) -> int:
        for rank, k in self.keys.items():
            if k == key:
                return rank
        return -1


def new_chunk(ident: tuple, uid: int, space: bytes, model: str, world: int, advert: Any, born: float) -> Chunk:
    extra = advert.extra_keys
    chunk = Chunk(ident, uid, space, model, world, advert.group, tuple(advert.block_hashes),
                   advert.parent_block_hash, advert.tokens, advert.block_size, advert.lora_name,
                   None if extra is None else _frozen(extra, {}), born)
    chunk.tkeys = token_keys(chunk)
    chunk.xheld = 0 if chunk.extra is None else _held_bytes(chunk.extra, set())
    chunk.cost = chunk_cost(len(chunk.hashes), len(chunk.tokens), getattr(advert, "extra_size", 0),
                            text_bytes(chunk.lora), chunk.xheld)
    return chunk


def _held_bytes(value: Any, seen: set) -> int:
    """What decoded extra keys hold: every distinct object (``_frozen`` made equal values one)
    once. Small values of many kinds decode to more than twice their encoded size: a one-item
    list of a 16-bit int is 4 bytes encoded, 84 bytes decoded."""
    if id(value) in seen:
        return 0
    seen.add(id(value))
    n = sys.getsizeof(value)
    if type(value) is tuple:
        for v in value:
            n += _held_bytes(v, seen)
    return n


def text_bytes(text: Optional[str]) -> int:
    """What a LoRA name costs where it is kept (a chunk, a record): its own string, up to
    16 KiB for 4,096 characters (``MAX_TEXT``) of 4 bytes each."""
    return 0 if text is None else sys.getsizeof(text)


#: What an indexed chunk costs the server's memory, as ``chunk_cost`` estimates it: the chunk
#: and its entries in the index's maps and its share, each block's hash, token key (a tuple and
#: a 16-byte digest) and map entries, its packed tokens, and its extra keys decoded (equal
#: values shared). Measured with tracemalloc and rounded up (docs/design/kv-events.md, "Bounds").
CHUNK_BYTES = 1280
BLOCK_BYTES = 256
EXTRA_FACTOR = 2


def chunk_cost(blocks: int, token_bytes: int, extra_bytes: int, text_bytes: int = 0, extra_held: int = 0) -> int:
    """Bytes an indexed chunk of ``blocks`` blocks, ``token_bytes`` of packed token ids,
    ``extra_bytes`` of encoded extra keys (``extra_held`` decoded, ``_held_bytes``: the more of
    it and twice the encoded size) and a LoRA name of ``text_bytes`` (as the function of that
    name counts it) is charged (its uid's share, the index's bound)."""
    return CHUNK_BYTES + BLOCK_BYTES * blocks + token_bytes + max(EXTRA_FACTOR * extra_bytes, extra_held) \
        + text_bytes


def _frozen(value: Any, seen: dict) -> Any:
    """``value`` with every list made a tuple (extra keys: plain values, ``check_advert``), equal
    values one object (``seen``: a LoRA's name on each of 1,024 blocks is one string and one
    tuple, not 1,024 of each)."""
    if isinstance(value, (list, tuple)):
        value = tuple([_frozen(v, seen) for v in value])
    try:
        return seen.setdefault((type(value), value), value)
    except TypeError:           # not hashable (never, for checked extra keys): kept as it is
        return value


def token_keys(chunk: Chunk) -> tuple:
    """Per block of ``chunk``, its ``token_key`` (``KvIndex.hashes_of_tokens`` walks them from
    the first block), or None for a block a lookup by tokens cannot name (``block_salt``)."""
    tokens = chunk.tokens
    if not tokens:
        return ()
    step = 4 * chunk.block_size
    hashes, uid = chunk.hashes, chunk.uid
    if chunk.extra is None and chunk.lora is None:      # no salt, nothing unnamed: the common case
        if len(hashes) == 1:
            return ((uid, chunk.parent, block_digest(tokens), None, None),)
        # a list first: tuple() of a generator allocates the outer tuple before its items, and
        # the GC untracks a tuple only once its items are (a collection later, or never)
        return tuple([(uid, hashes[i - 1] if i else chunk.parent, block_digest(tokens[i * step:(i + 1) * step]), None, None)
                      for i in range(len(hashes))])
    extra = chunk.extra or (None,) * len(hashes)
    out: list[Optional[TokenKey]] = []
    for i in range(len(hashes)):
        parent = hashes[i - 1] if i else chunk.parent
        salt = block_salt(extra[i], chunk.lora, parent is None)
        out.append(None if salt is UNNAMED else
                   token_key(uid, parent, block_digest(tokens[i * step:(i + 1) * step]), chunk.lora, salt))
    return tuple(out)


#: ``(uid, parent block hash, the digest of the block's packed tokens, LoRA name, cache salt)``:
#: what a lookup by token ids can name a block by, in one uid's chains (a uid's adverts never
#: name a block in another's). The salt is the first block's only (None elsewhere). The digest
#: (``block_digest``: BLAKE2b, 16 bytes) keeps the key small: a block of 64 tokens is 256 bytes packed.
TokenKey = tuple[int, Any, bytes, Optional[str], Optional[str]]


def token_key(uid: int, parent: Any, digest: bytes, lora: Optional[str], salt: Optional[str]) -> TokenKey:
    return (uid, parent, digest, lora, salt)


def block_digest(tokens: bytes) -> bytes:
    """A block's packed tokens as a token key holds them (collision-resistant: within one uid's
    keys, a tenant could only confuse its own lookups)."""
    return hashlib.blake2b(tokens, digest_size=16).digest()

