"""``Link``: one connection to lmshm-server that never stalls or crashes the engine.

It connects in the background. While the server is down or unreachable every call returns at
once: lookups miss, stores are dropped, retrieves fail, each kind with a warning at most every
``warn_every_s`` (``Link.warn``); after a failure, calls return at once for ``retry_s``. After a
server restart ``MPClient`` re-registers the KV caches by itself, and ``register_with`` runs a
registration that was asked for before the server answered.

Thread-safe; the scheduler, the workers and ``EventFeed`` share one. The trap: never keep an
exception in a log record (``str(exc)`` only): its traceback's frames hold the KV tensors.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

from lmshm.core.kv_events import packed_tokens  # the one packer: Advert.tokens as the index keeps them
from lmshm.core.logs import Throttle
from lmshm.transport.client import MPClient, Pending, ServerError, ServerTimeout
from lmshm.wire import protocol

logger = logging.getLogger("lmshm.connector")


@dataclass
class LinkConfig:
    url: Optional[str] = None         # None: $LMSHM_URL or tcp://127.0.0.1:5555
    client_name: str = ""
    timeout_s: float = 5.0            # STORE and RETRIEVE
    lookup_timeout_s: float = 1.0
    retry_s: float = 5.0              # after a failure, calls return at once for this long
    warn_every_s: float = 30.0


class Link:
    """See the module docstring. Thread-safe."""

    def __init__(self, config: LinkConfig, *, connect_now: bool = True) -> None:
        self.config = config
        self._lock = threading.Lock()
        self._client: Optional[MPClient] = None
        self._down_until = 0.0
        self._connecting = False
        self._closed = False
        self._registration: Optional[Callable[[MPClient], Any]] = None
        self.instance_ids: list[str] = []     # one per KV cache group
        self._warnings: dict[str, Throttle] = {}     # one per kind of warning (``warn``)
        if connect_now:
            self._connect_in_background()

    # ---- connection ---------------------------------------------------------------------
    def _connect_in_background(self) -> None:
        with self._lock:
            if self._connecting or self._client is not None or self._closed:
                return
            self._connecting = True
        threading.Thread(target=self._connect, name="lmshm-connect", daemon=True).start()

    def _connect(self) -> None:
        try:
            client = MPClient(self.config.url, timeout_s=self.config.timeout_s,
                              client_name=self.config.client_name)
        except Exception as exc:
            self.warn("connect", "cannot reach lmshm-server at %s: %s; lookups miss and stores are dropped "
                      "until it answers", self.config.url or "the default URL", str(exc))
            with self._lock:
                self._connecting = False
                self._down_until = time.monotonic() + self.config.retry_s
            return
        registration = None
        with self._lock:
            if self._closed:
                self._connecting = False
                client.close()
                return
            self._client = client         # before _connecting is cleared: wait_connected reads both unlocked
            self._connecting = False
            registration = self._registration
        logger.info("lmshm: connected to lmshm-server at %s", client.url)
        if registration is not None:
            self._register_now(registration)

    def client(self) -> Optional[MPClient]:
        """The connected ``MPClient``, or None (then a connection attempt starts, at most every
        ``retry_s``)."""
        client = self._client
        if client is not None:
            return client if time.monotonic() >= self._down_until else None
        if time.monotonic() >= self._down_until:
            self._connect_in_background()
        return None

    def wait_connected(self, timeout_s: float) -> bool:
        """Wait, at most ``timeout_s``, until the link is connected (and registered, if a
        registration was asked for); False at once when the connection attempt failed."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._client is not None and (self.instance_ids or self._registration is None):
                return True
            if self._client is None and not self._connecting:
                return False
            time.sleep(0.02)
        return False

    def warn(self, what: str, message: str, *args: object) -> None:
        """Log ``"lmshm: " + message`` at most once per ``warn_every_s`` for each kind ``what``
        (a fixed name per call site); the next line written says how many were left out."""
        throttle = self._warnings.get(what)
        if throttle is None:
            throttle = self._warnings.setdefault(what, Throttle(logger, self.config.warn_every_s))
        throttle.warning("lmshm: " + message, *args)

    def _failed(self, what: str, exc: BaseException) -> None:
        self._down_until = time.monotonic() + self.config.retry_s
        # str(exc), never exc: a log record keeping the exception would keep its traceback's
        # frames, and the KV tensors in them, alive
        self.warn(what, "%s failed: %s (the engine goes on without lmshm for %g s)", what.upper(), str(exc),
                  self.config.retry_s)

    # ---- registration -------------------------------------------------------------------
    def register(self, kv_caches: Mapping[str, Any], *, model_name: str = "", world_size: int = 1,
                 rank: int = 0, instance_id: Optional[str] = None, block_dim: int = 0) -> None:
        """Register the engine's KV caches now if the server is up, else as soon as it is."""
        self.register_groups([kv_caches], model_name=model_name, world_size=world_size, rank=rank,
                             instance_id=instance_id, block_dim=block_dim)

    def register_groups(self, groups: Sequence[Mapping[str, Any]], *, model_name: str = "", world_size: int = 1,
                        rank: int = 0, instance_id: Optional[str] = None, block_dim: int = 0) -> None:
        """One registration per KV cache group (a hybrid model's groups have block tables of
        their own); ``group=g`` in ``store``/``retrieve`` picks one."""
        base = instance_id or f"{self.config.client_name or 'lmshm'}-{uuid.uuid4().hex[:12]}"
        ids = [base if len(groups) == 1 else f"{base}-g{g}" for g in range(len(groups))]

        def registrar(client: MPClient) -> list[str]:
            done: list[str] = []
            try:
                for iid, kv in zip(ids, groups):
                    done.append(client.register_kv_caches(kv, iid, model_name=model_name, world_size=world_size,
                                                          rank=rank, block_dim=block_dim))
            except Exception:
                for iid in done:  # all groups or none
                    try:
                        client.unregister_kv_caches(iid)
                    except Exception:
                        logger.debug("lmshm: unregistering %s after a failed registration failed", iid)
                raise
            return done

        self.register_with(registrar)

    def register_with(self, registrar: Callable[[MPClient], Any]) -> None:
        """``register`` with the caller's own call: ``registrar(client)`` registers and returns
        the instance id (or one per group). It runs now if the server is up, else once it is."""
        with self._lock:
            self._registration = registrar
            client = self._client
        if client is not None:
            self._register_now(registrar)
        else:
            self._connect_in_background()

    def _register_now(self, registrar: Callable[[MPClient], Any]) -> None:
        try:
            ids = registrar(self._client)
            self.instance_ids = [ids] if isinstance(ids, str) else list(ids)
        except Exception as exc:
            self._failed("register", exc)

    @property
    def instance_id(self) -> Optional[str]:
        return self.instance_ids[0] if self.instance_ids else None

    # ---- requests -----------------------------------------------------------------------
    def lookup(self, keys: list[list[bytes]], ttl_s: float = 0.0) -> tuple[int, bytes]:
        """``(leading chunks every rank has, lease)``; ``(0, b"")`` whenever anything fails."""
        client = self.client()
        if client is None or not keys or not keys[0]:
            return 0, b""
        try:
            reply = client.submit(protocol.Lookup(keys, ttl_s), self.config.lookup_timeout_s).result()
            return reply.hits, reply.lease
        except Exception as exc:
            self._failed("lookup", exc)
            return 0, b""

    def release(self, lease: bytes) -> None:
        client = self.client()
        if client is None or not lease:
            return
        try:
            # Not awaited: cancel() makes the client drop the reply when it comes.
            client.submit(protocol.Release(lease), self.config.lookup_timeout_s).cancel()
        except Exception as exc:
            self._failed("release", exc)

    def _instance(self, group: int) -> Optional[str]:
        ids = self.instance_ids
        return ids[group] if group < len(ids) else None

    def store(self, keys: list[bytes], block_ids: list[int], chunk_blocks: int, event: bytes = b"",
              group: int = 0, adverts: Sequence[tuple] = (), space: bytes = b"", pod: str = "") -> Optional[Pending]:
        """A ``Pending`` STORE, or None if it was dropped (no server, nothing registered).
        ``adverts``: one ``Advert``'s fields per key (KV events), or none."""
        client = self.client()
        iid = self._instance(group)
        if client is None or iid is None or not keys:
            return None
        try:
            ads = None
            if adverts:
                ads = [_advert(a) for a in adverts]
            return client.store(iid, keys, block_ids, chunk_blocks, wait=False,
                                timeout_s=self.config.timeout_s, event=event, adverts=ads, space=space, pod=pod)
        except Exception as exc:
            self._failed("store", exc)
            return None

    def retrieve(self, keys: list[bytes], block_ids: list[int], chunk_blocks: int, lease: bytes = b"",
                 event: bytes = b"", group: int = 0) -> Optional[Pending]:
        """A ``Pending`` RETRIEVE, or None if it cannot be sent (treat as a failure)."""
        client = self.client()
        iid = self._instance(group)
        if client is None or iid is None:
            return None
        try:
            return client.retrieve(iid, keys, block_ids, chunk_blocks, lease, wait=False,
                                   timeout_s=self.config.timeout_s, event=event)
        except Exception as exc:
            self._failed("retrieve", exc)
            return None

    def outcome(self, what: str, pending: Pending) -> Optional[Any]:
        """``pending.result()``, or None (logged, rate-limited) if it failed."""
        try:
            return pending.result()
        except ServerTimeout as exc:
            self._failed(what, exc)
        except ServerError as exc:  # the server answered: it is up, this request failed
            self.warn(what, "%s failed: %s", what.upper(), str(exc))
        except Exception as exc:
            self._failed(what, exc)
        return None

    def close(self) -> None:
        with self._lock:
            self._closed = True
            client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception:
                logger.debug("lmshm: closing the client failed", exc_info=True)


def _advert(fields: tuple) -> protocol.Advert:
    """An ``Advert`` from its fields, the token ids packed (``packed_tokens``): the server
    decodes one bytes object, not a list of ints. ``fields[5]``, the token ids, may come packed
    already (the vLLM describer packs them, so the scheduler's metadata carries bytes) or as a list."""
    tokens = fields[5]
    if not isinstance(tokens, (bytes, bytearray)):
        tokens = packed_tokens(tokens)
    return protocol.Advert(*fields[:5], [], *fields[6:8], tokens=bytes(tokens))
