"""A reference KV-aware router: it reads each host's KV events and sends a request to the host
that holds the longest cached prefix of it. Reference code for lmshm's KV events (used by
``bench/kv_routing.py`` and its test), not part of lmshm and not a production router.

How it works:

- One ZMQ SUB socket per host, on that host's KV-event stream (frames ``[topic, seq, payload]``,
  payload a vLLM ``KVEventBatch`` in either encoding, read with ``lmshm.core.kv_events.decode_batch``).
  A block is credited to the host whose stream carried it, never to a name inside the event.
- A router cannot recompute vLLM's block hashes (sha256 of vLLM's own pickling), so it keys
  blocks by its own token-chain digest: ``digest(block) = H(digest(parent), lora, extra keys,
  tokens)``, the root's parent ``b""``. Per host it maps each engine hash to its digest (to
  follow parents and removals) and each digest to the media holding it (``CPU``, ``STORAGE``, ...).
- ``BlockRemoved`` drops a medium; a block with no medium left is no longer held. Its digest
  stays known (an engine hash always names the same chain), so a block stored later under it
  still chains. A real router would bound that map; this one keeps it until the host is cleared.
- ``BlockStored`` whose parent the host's map does not know (its event was missed) cannot be
  chained: it is skipped and counted in ``orphans``.
- ``AllBlocksCleared``, a sequence gap (a batch was dropped: removals may be among them) or a
  sequence going back (the publisher restarted) forget everything the host held. A real router
  would then ask the publisher's replay socket for the missing batches.
- ``route(tokens)`` computes the same chain over the request's whole blocks and counts, per
  host, the leading blocks it holds; the longest wins, ties go to the host given fewest
  requests, then in turn (round robin).

The easy thing to get wrong: ``block_size`` must be the engines' block size (the token count
per hash in the events). A ``BlockStored`` of another block size is ignored (``skipped``).
"""

from __future__ import annotations

import hashlib
import threading
import time
from typing import Any, Iterable, Optional, Sequence

import msgspec
import zmq

from lmshm.core.kv_events import BadBatch, decode_batch

ROOT = b""


def block_digest(parent: bytes, tokens: Sequence[int], lora: Optional[str] = None, extra: Any = None) -> bytes:
    """The router's key for a block: its tokens, LoRA name and extra keys, chained onto its parent's."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(msgspec.msgpack.encode([lora, extra, list(tokens)]))
    return h.digest()


class HostView:
    """What one host's stream says it holds."""

    def __init__(self) -> None:
        self.digest_of: dict[Any, bytes] = {}        # engine block hash -> router digest (held or not)
        self.media: dict[bytes, set[str]] = {}      # router digest -> media that hold it
        self.last_seq: Optional[int] = None
        self.last_batch_at = 0.0                     # time.monotonic() of the last batch
        self.routed = 0

    def clear(self) -> None:
        self.digest_of.clear()
        self.media.clear()

    def __len__(self) -> int:
        return len(self.media)


class Router:
    """See the module docstring. ``hosts``: name -> KV-event endpoint to connect to (optional:
    ``apply`` feeds events without sockets)."""

    def __init__(self, block_size: int, hosts: dict[str, str] | Iterable[str]) -> None:
        self.block_size = block_size
        endpoints = hosts if isinstance(hosts, dict) else {name: "" for name in hosts}
        self.names = list(endpoints)
        self.views = {name: HostView() for name in self.names}
        self.stats = {"batches": 0, "events": 0, "gaps": 0, "clears": 0, "orphans": 0, "skipped": 0, "bad": 0}
        self._lock = threading.Lock()
        self._turn = 0
        self._ctx: Optional[zmq.Context] = None
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()
        if any(endpoints.values()):
            self._ctx = zmq.Context()
            self._socks = {}
            for name, endpoint in endpoints.items():
                sock = self._ctx.socket(zmq.SUB)
                sock.setsockopt(zmq.SUBSCRIBE, b"")
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(endpoint)
                self._socks[sock] = name
            self._thread = threading.Thread(target=self._run, name="kv-router", daemon=True)
            self._thread.start()

    # ---- events ------------------------------------------------------------------------
    def _run(self) -> None:
        poller = zmq.Poller()
        for sock in self._socks:
            poller.register(sock, zmq.POLLIN)
        while not self._stop.is_set():
            for sock, _ in poller.poll(50):
                frames = sock.recv_multipart()
                if len(frames) == 3 and len(frames[1]) == 8:
                    self.apply(self._socks[sock], int.from_bytes(frames[1], "big"), frames[2])
                else:
                    self.stats["bad"] += 1

    def apply(self, host: str, seq: int, payload: bytes) -> None:
        """One batch from ``host``'s stream, with its sequence number."""
        try:
            _, events = decode_batch(payload)
        except BadBatch:
            self.stats["bad"] += 1
            return
        with self._lock:
            view = self.views[host]
            if view.last_seq is not None and seq != view.last_seq + 1:
                self.stats["gaps"] += 1       # missed batches (or a restarted publisher): start over
                view.clear()
            view.last_seq = seq
            view.last_batch_at = time.monotonic()
            self.stats["batches"] += 1
            for event in events:
                self.stats["events"] += 1
                self._apply_event(view, event)

    def _apply_event(self, view: HostView, e: dict) -> None:
        kind = e["type"]
        if kind == "AllBlocksCleared":
            self.stats["clears"] += 1
            view.clear()
        elif kind == "BlockRemoved":
            for h in e["block_hashes"]:
                digest = view.digest_of.get(h)
                media = view.media.get(digest) if digest is not None else None
                if media is None:
                    continue
                media.discard(e.get("medium") or "")
                if not media:
                    del view.media[digest]
        elif kind == "BlockStored":
            bs, tokens, hashes = e["block_size"], e["token_ids"], e["block_hashes"]
            if bs != self.block_size or len(tokens) != bs * len(hashes):
                self.stats["skipped"] += 1
                return
            parent = e.get("parent_block_hash")
            prev = ROOT if parent is None else view.digest_of.get(parent)
            if prev is None:
                self.stats["orphans"] += 1
                return
            extra = e.get("extra_keys") or [None] * len(hashes)
            if not isinstance(extra, list) or len(extra) != len(hashes):
                self.stats["skipped"] += 1
                return
            for i, h in enumerate(hashes):
                prev = block_digest(prev, tokens[i * bs:(i + 1) * bs], e.get("lora_name"), extra[i])
                view.digest_of[h] = prev
                view.media.setdefault(prev, set()).add(e.get("medium") or "")

    # ---- requests ----------------------------------------------------------------------
    def match(self, tokens: Sequence[int], lora: Optional[str] = None) -> dict[str, int]:
        """Per host, how many leading whole blocks of ``tokens`` it holds."""
        out = {name: 0 for name in self.names}
        live = set(self.names)
        prev = ROOT
        with self._lock:
            for b in range(len(tokens) // self.block_size):
                prev = block_digest(prev, tokens[b * self.block_size:(b + 1) * self.block_size], lora)
                live = {name for name in live if prev in self.views[name].media}
                if not live:
                    break
                for name in live:
                    out[name] = b + 1
        return out

    def route(self, tokens: Sequence[int], lora: Optional[str] = None) -> tuple[str, int]:
        """``(host, cached blocks there)``: the longest cached prefix; ties to the host given
        fewest requests, then in turn. Counts the request as given to that host."""
        matched = self.match(tokens, lora)
        best = max(matched.values())
        tied = [n for n in self.names if matched[n] == best]
        with self._lock:
            fewest = min(self.views[n].routed for n in tied)
            tied = [n for n in tied if self.views[n].routed == fewest]
            order = self.names[self._turn % len(self.names):] + self.names[:self._turn % len(self.names)]
            host = next(n for n in order if n in tied)
            self._turn = self.names.index(host) + 1
            self.views[host].routed += 1
        return host, best

    def round_robin(self) -> str:
        """The baseline: hosts in turn, whatever they hold (counted like ``route``)."""
        with self._lock:
            host = self.names[self._turn % len(self.names)]
            self._turn += 1
            self.views[host].routed += 1
        return host

    def held(self, host: str) -> int:
        with self._lock:
            return len(self.views[host])

    def close(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(5)
            for sock in self._socks:
                sock.close()
            self._ctx.term()
            self._thread = None
