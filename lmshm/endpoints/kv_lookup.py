"""KV lookups for routers on the HTTP endpoint: ``POST /v1/kv/lookup``, ``GET /v1/kv/lookup``.

A router sends a prompt's engine block hashes, or its token ids and block size, and learns how
many *leading* blocks each tier (``pool``, ``disk``, ``remote``) and lmshm as a whole can serve:
whole advertised chunks only, from the KV event index (``--kv-events-index 0`` turns it off:
404). "As a whole" counts a block when *any* tier can serve its chunk, since a lower tier's
chunk is served by promotion. ``GET`` answers the node, its tiers and the limits.

The trust boundary: the body is bounded (``--http-max-body-bytes``; ``BYTES_HELD`` over all
lookups), and so are the blocks and tokens (``MAX_BLOCKS``, ``MAX_TOKENS``); every value is
checked before the index is touched, and a refusal is a 400 naming the field. Lookups run off
the endpoint's loop (``LOOKUPS_AT_ONCE``) and take the index's lock per ``WINDOW`` blocks.
The trap: an answer says which prefixes are cached, and anyone who reaches the endpoint may
ask, so anyone can probe for a prompt; bind ``--http-host`` to an address only routers reach.
The reference for routers, hash forms included: docs/kv-lookup.md.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
from collections import OrderedDict
from typing import Any, Optional

import msgspec
from aiohttp import web

from lmshm.core.errors import ErrorCode, ServerError
from lmshm.core.kv_events import TIER_MEDIA
from lmshm.quoting import quote
from lmshm.wire.protocol import MAX_ADVERT_BLOCKS, MAX_TEXT

PATH = "/v1/kv/lookup"
#: The request type the metrics count these routes under (``lmshm_requests{request=...}``).
OPERATIONS = {PATH: "KvLookup"}
#: The most block hashes, or whole blocks of tokens, one request may look up.
MAX_BLOCKS = 65536
#: The most token ids one request may carry.
MAX_TOKENS = 1 << 20
#: The largest engine block size (tokens), as an advert's (``messages.Advert.block_size``).
MAX_BLOCK_SIZE = 1 << 16
#: The longest bytes hash (``messages.BlockHash``).
MAX_HASH_BYTES = 64
#: Blocks looked up per hold of the index's lock; at least an advert's longest chunk.
WINDOW = max(4096, MAX_ADVERT_BLOCKS)
#: Lookups computed at once (on the loop's executor); more wait their turn.
LOOKUPS_AT_ONCE = 2
#: The body of the largest lookup a real engine makes: ``MAX_TOKENS`` token ids below a million
#: (every vocabulary in use: 6 digits and ", ", 8 MiB) and the rest of the object. The docs
#: recommend it as ``--http-max-body-bytes`` for routers that look up by tokens.
LARGEST_BODY = 9 << 20
#: Bytes of lookup bodies held at once, read or waiting their turn: those computed and two of the
#: largest more. A lookup past it is not read: 503 with ``Retry-After: RETRY_AFTER_S``. (One body
#: is always let in when none is held, so a ``--http-max-body-bytes`` above this still works.)
BYTES_HELD = (LOOKUPS_AT_ONCE + 2) * LARGEST_BODY
RETRY_AFTER_S = 1
#: Where ``BYTES_HELD`` is full, a lookup whose body is still arriving gives way to a new one
#: once it has held its bytes this long (seconds), and at once to one whose body is all here: a
#: body that is not sent holds no memory, so a client that declares large bodies and sends them
#: slowly cannot keep every other lookup out (it did, for the whole --http-request-timeout).
#: Of those that may give way, the one arriving slowest (bytes per second so far) does, so such a
#: client cannot pick off an honest body in flight either; bodies that have arrived never give way.
#: The lookup that gives way is answered 503.
GIVE_WAY_S = 1.0
#: The longest LoRA name or cache salt a lookup by tokens may name (an advert's text bound).
MAX_NAME = MAX_TEXT
FIELDS = ("block_hashes", "token_ids", "block_size", "lora_name", "cache_salt")

#: Bytes of a lookup's JSON decoded per call: a call holds the GIL (about 5 ms for this much on
#: the test machine), and a million token ids are 7 MiB.
SLICE_BYTES = 256 << 10
#: The bytes of a JSON array of integers, but its brackets.
_INTEGER_LIST = b"0123456789-, \t\r\n"

_U64 = 1 << 64
_HEX = re.compile(r"(?:[0-9a-fA-F]{2})+")


def node_name(config: Any) -> str:
    """The node's name: the ZMQ publisher's (``--kv-events-node``), else the host name."""
    return getattr(config, "kv_events_node", "") or socket.gethostname()


def tier_names(core: Any) -> list[str]:
    """The tiers that can serve a chunk, top first: the pool, then those below it."""
    stack = getattr(core.dataplane, "tiers", None)
    return ["pool"] + ([t.name for t in stack.tiers] if stack is not None else [])


def _media(tier: str) -> tuple[str, str]:
    return TIER_MEDIA.get(tier, ("STORAGE", "LOCAL"))


# ---- the request: checked completely before the index is touched ------------------------


def _bad(message: str) -> ServerError:
    return ServerError(ErrorCode.INVALID_ARG, message)


def parse_body(raw: bytes) -> dict:
    if not raw:
        raise _bad('the request body is empty; send {"block_hashes": [...]} or {"token_ids": [...], "block_size": N}')
    body = _decode(raw)
    if not isinstance(body, dict):
        raise _bad(f"the request body must be a JSON object, got {_kind(body)}")
    return body


def _decode(raw: bytes) -> Any:
    """``raw`` as JSON. A decoder holds the GIL, so the ZeroMQ endpoint's thread waits while it
    runs: msgspec, 2-3x faster than json, and a long array of token ids in slices
    (``_sliced``). What msgspec refuses (integers past 64 bits, NaN, deep nesting), json reads,
    or says what is wrong with, as before."""
    if len(raw) > SLICE_BYTES:
        try:
            return _sliced(raw)
        except (msgspec.DecodeError, RecursionError, ValueError):
            pass
    try:
        return msgspec.json.decode(raw)
    except (msgspec.DecodeError, RecursionError):
        return _json(raw)


def _sliced(raw: bytes) -> dict:
    """An object whose ``token_ids`` is an array of integers, that array decoded ``SLICE_BYTES``
    at a time (cut at commas); ValueError (or msgspec's) for anything else."""
    top = msgspec.json.decode(raw, type=dict[str, msgspec.Raw])
    body = {k: msgspec.json.decode(v) for k, v in top.items() if k != "token_ids"}
    if "token_ids" in top:
        text = bytes(top["token_ids"]).strip()
        if text[:1] != b"[" or text[-1:] != b"]" or text[1:-1].translate(None, _INTEGER_LIST):
            raise ValueError("not an array of integers")
        ids: list = []
        inner, start = text[1:-1], 0
        while start < len(inner):
            end = inner.find(b",", start + SLICE_BYTES)
            end = len(inner) if end < 0 else end
            ids += msgspec.json.decode(b"[" + inner[start:end] + b"]")
            start = end + 1
        body["token_ids"] = ids
    return body


def _json(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:   # also an integer of more than 4300 digits
        raise _bad(f"the request body is not valid JSON: {str(exc)[:200]}") from None
    except RecursionError:
        raise _bad("the request body nests arrays or objects too deeply; a lookup is one flat JSON object") from None


def _kind(value: Any) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object",
            type(None): "null"}.get(type(value), type(value).__name__)


def _int(value: Any) -> bool:
    return type(value) is int


def _block_size(body: dict, required: bool) -> Optional[int]:
    if "block_size" not in body:
        if required:
            raise _bad("'token_ids' needs 'block_size': the engine's block size in tokens (vLLM's --block-size)")
        return None
    value = body["block_size"]
    if not _int(value):
        raise _bad(f"'block_size' must be an integer, got {_kind(value)} {quote(value, 40)}")
    if not 1 <= value <= MAX_BLOCK_SIZE:
        raise _bad(f"'block_size' must be between 1 and {MAX_BLOCK_SIZE} tokens, got {quote(value, 40)}")
    return value


def _list(body: dict, name: str, limit: int, what: str) -> list:
    value = body[name]
    if not isinstance(value, list):
        raise _bad(f"'{name}' must be an array, got {_kind(value)}")
    if len(value) > limit:
        raise _bad(f"'{name}' has {len(value)} {what}; a lookup takes at most {limit}: send the first {limit}")
    return value


def _name(body: dict, name: str) -> Optional[str]:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, str):
        raise _bad(f"'{name}' must be a string or null, got {_kind(value)} {quote(value, 40)}")
    if len(value) > MAX_NAME:
        raise _bad(f"'{name}' is {len(value)} characters; at most {MAX_NAME}")
    return value


def check_request(body: dict) -> tuple[str, list, Optional[int], Optional[str], Optional[str]]:
    """``("hashes", [int | bytes], block_size or None, None, None)`` or ``("tokens", [int],
    block_size, lora_name, cache_salt)``, or a ``ServerError`` (400) that says what is wrong."""
    unknown = sorted(k for k in body if k not in FIELDS)
    if "model" in unknown:
        raise _bad("'model' is not supported: block hashes (and token chains) are matched whatever model stored "
                   "them; leave 'model' out")
    if unknown:
        raise _bad(f"unknown field {quote(unknown[0], 60)}; a lookup has 'block_hashes', or 'token_ids' and "
                   "'block_size' (and 'lora_name', 'cache_salt')")
    if ("block_hashes" in body) == ("token_ids" in body):
        raise _bad("send either 'block_hashes' or 'token_ids' (with 'block_size'), not "
                   + ("both" if "token_ids" in body else "neither"))
    if "block_hashes" in body:
        named = [k for k in ("lora_name", "cache_salt") if k in body]
        if named:
            raise _bad(f"'{named[0]}' goes with 'token_ids' only: block hashes already include the LoRA and "
                       "the cache salt")
        size = _block_size(body, required=False)
        values = _list(body, "block_hashes", MAX_BLOCKS, "hashes")
        return "hashes", [_hash(i, v) for i, v in enumerate(values)], size, None, None
    lora, salt = _name(body, "lora_name"), _name(body, "cache_salt")
    size = _block_size(body, required=True)
    tokens = _list(body, "token_ids", MAX_TOKENS, "tokens")
    for i, t in enumerate(tokens):
        if not _int(t) or not -(1 << 31) <= t < 1 << 31:
            what = f"{_kind(t)} {quote(t, 40)}" if not _int(t) else f"{quote(t, 40)}, out of range"
            raise _bad(f"token_ids[{i}] must be a 32-bit integer token id, got {what}")
    blocks = len(tokens) // size
    if blocks > MAX_BLOCKS:
        raise _bad(f"{len(tokens)} tokens are {blocks} blocks of {size}; a lookup takes at most {MAX_BLOCKS} "
                   f"blocks: send the first {MAX_BLOCKS * size} tokens")
    return "tokens", tokens, size, lora, salt


def _hash(i: int, value: Any) -> Any:
    if _int(value):
        if not -(1 << 63) <= value < _U64:
            raise _bad(f"block_hashes[{i}] = {quote(value, 40)} is not a 64-bit integer (signed or unsigned)")
        return value
    if isinstance(value, str):
        if len(value) > 2 * MAX_HASH_BYTES or not _HEX.fullmatch(value):
            raise _bad(f"block_hashes[{i}] = {quote(value, 40)} is not a hex string of 1 to {MAX_HASH_BYTES} "
                       "bytes (an even number of 0-9a-f digits, no 0x)")
        return bytes.fromhex(value)
    raise _bad(f"block_hashes[{i}] must be an integer or a hex string, got {_kind(value)} {quote(value, 40)}")


def hash_forms(hashes: list) -> list[list]:
    """The forms the index may keep ``hashes`` in (see the module docstring): as given, then
    with integers unsigned and bytes as vLLM's integers, then signed; no form twice."""
    forms = [hashes]
    if any(isinstance(h, bytes) or not 0 <= h < 1 << 63 for h in hashes):
        unsigned = [_unsigned(h) for h in hashes]
        for form in (unsigned, [_signed(h) for h in unsigned]):
            if all(form != f for f in forms):
                forms.append(form)
    return forms


def _unsigned(h: Any) -> int:
    if isinstance(h, bytes):
        return int.from_bytes(h, "big") & (_U64 - 1)     # vLLM's maybe_convert_block_hash
    return h + _U64 if h < 0 else h


def _signed(h: int) -> int:
    return h - _U64 if h >= 1 << 63 else h


# ---- the answer -----------------------------------------------------------------------------


def _run(index: Any, hashes: list, p: int, tiers: list[str], size: int = WINDOW) -> dict[str, int]:
    """``index.leading`` of ``hashes[p:p + size]``: one hold of its lock, for ``size`` blocks at most."""
    return index.leading(hashes[p:p + size], tiers)


def _walk(index: Any, hashes: list, tiers: list[str]) -> tuple[dict[str, int], int]:
    """``({tier: leading blocks it serves}, leading blocks some tier serves)``, whole chunks.

    A window is at least a chunk long, so it ends a tier's run only where a chunk would cross
    its end: the run goes on from there until a window adds nothing. The whole: from a chunk
    boundary, the tier that goes furthest takes it there, and the next chunk boundary is where
    any tier goes on from (its windows grow from a chunk's length, so that tiers taking turns
    chunk by chunk do not copy a full window per chunk)."""
    per_tier = {}
    for tier in tiers:
        p = 0
        while p < len(hashes):
            n = _run(index, hashes, p, [tier])[tier]
            if n == 0:
                break
            p += n
        per_tier[tier] = p
    whole = max(per_tier.values(), default=0)
    size = MAX_ADVERT_BLOCKS
    while whole < len(hashes):
        n = max(_run(index, hashes, whole, tiers, size).values(), default=0)
        if n == 0:
            break
        whole += n
        size = min(WINDOW, max(MAX_ADVERT_BLOCKS, 2 * n))
    return per_tier, whole


def lookup(index: Any, tiers: list[str], kind: str, values: list, block_size: Optional[int],
           lora: Optional[str] = None, salt: Optional[str] = None) -> dict[str, Any]:
    """The ``POST`` answer's counts for a checked request (``check_request``)."""
    if kind == "tokens":
        blocks = len(values) // block_size
        # the index's own hashes, as far as each uid's adverts know them (KvIndex.chains_of_tokens)
        forms = index.chains_of_tokens(values, block_size, lora, salt) or [[]]
    else:
        blocks = len(values)
        forms = hash_forms(values)
    best: tuple[dict[str, int], int] = ({t: 0 for t in tiers}, 0)
    for form in forms:
        got = _walk(index, form, tiers)
        if got[1] > best[1]:
            best = got
    per_tier, whole = best
    out: dict[str, Any] = {
        "blocks": blocks,
        "leading_blocks": whole,
        "tiers": {t: {"medium": _media(t)[0], "locality": _media(t)[1], "leading_blocks": per_tier[t]}
                  for t in tiers},
    }
    if block_size is not None:
        out["block_size"] = block_size
        out["leading_tokens"] = whole * block_size
    return out


class Ticket:
    """A lookup's bytes of ``BYTES_HELD``: ``size``, taken at ``since`` (the loop's clock);
    ``evicted`` is done when its body, still arriving (``content``), gave way to another lookup's."""

    __slots__ = ("size", "since", "evicted", "content", "released")

    def __init__(self, size: int, since: float, evicted: "asyncio.Future[None]", content: Any) -> None:
        self.size, self.since, self.evicted, self.content, self.released = size, since, evicted, content, False


class KvLookup:
    """The routes; ``add_routes`` puts them on the HTTP endpoint's router."""

    def __init__(self, server: Any) -> None:
        self.server = server
        self._turns = asyncio.Semaphore(LOOKUPS_AT_ONCE)
        self.held = 0     # bytes of bodies let in and not answered yet (the endpoint's loop only)
        self._arriving: "OrderedDict[Ticket, None]" = OrderedDict()   # tickets whose bodies are arriving

    def admit(self, request: web.Request, max_body: int, arrived: bool, now: float) -> Optional["Ticket"]:
        """A ticket for the bytes ``request``'s body may hold (its Content-Length, else
        ``max_body``), taken from ``BYTES_HELD`` before the endpoint reads it; None when there is
        no room: the endpoint answers 503 without reading it. ``arrived``: the whole body is here
        already. Where there is no room, bodies still arriving give way, the slowest first (see
        ``GIVE_WAY_S``). ``arrived`` once the body is read, ``release`` once answered."""
        size = min(request.content_length if request.content_length is not None else max_body, max_body)
        while self.held and self.held + size > BYTES_HELD:
            victims = [t for t in self._arriving if arrived or t.since + GIVE_WAY_S <= now]
            if not victims:
                return None
            victim = min(victims, key=lambda t: t.content.total_bytes / max(now - t.since, 0.05))   # the slowest
            self.release(victim)
            victim.evicted.set_result(None)
        ticket = Ticket(size, now, asyncio.get_running_loop().create_future(), request.content)
        self.held += size
        self._arriving[ticket] = None
        return ticket

    def arrived(self, ticket: "Ticket") -> None:
        """``ticket``'s body is all here: it holds its bytes until answered, and no longer gives way."""
        self._arriving.pop(ticket, None)

    def release(self, ticket: "Ticket") -> None:
        if not ticket.released:
            ticket.released = True
            self.held -= ticket.size
            self._arriving.pop(ticket, None)

    def add_routes(self, router: web.UrlDispatcher) -> None:
        router.add_post(PATH, self.post)
        router.add_get(PATH, self.get)

    def _index(self) -> Any:
        index = self.server.core.kv_index
        if not index.enabled:
            raise ServerError(ErrorCode.NOT_FOUND,
                              "KV lookups answer from the KV event index, which this server runs without "
                              "(--kv-events-index 0): start lmshm-server with --kv-events-index N (default 262144 "
                              "chunks), and connectors that send adverts with their STOREs")
        return index

    def _identity(self) -> dict[str, Any]:
        return {"server_id": self.server.server_id, "node": node_name(self.server.config)}

    async def get(self, request: web.Request) -> web.Response:
        index = self._index()
        tiers = tier_names(self.server.core)
        body = {**self._identity(),
                "tiers": {t: {"medium": _media(t)[0], "locality": _media(t)[1]} for t in tiers},
                "chunks": len(index), "block_sizes": sorted(index.block_sizes()),     # counters: O(1)
                "limits": {"max_blocks": MAX_BLOCKS, "max_tokens": MAX_TOKENS, "max_block_size": MAX_BLOCK_SIZE,
                           "max_body_bytes": self.server.config.http_max_body_bytes}}
        return web.json_response(body, headers={"Cache-Control": "no-store"})

    async def post(self, request: web.Request) -> web.Response:
        index = self._index()
        tiers = tier_names(self.server.core)
        raw = await request.read()          # already read by the endpoint, within its size limit

        def answer() -> dict[str, Any]:
            return lookup(index, tiers, *check_request(parse_body(raw)))

        async with self._turns:
            counts = await asyncio.get_running_loop().run_in_executor(None, answer)
        return web.json_response({**self._identity(), **counts}, headers={"Cache-Control": "no-store"})
