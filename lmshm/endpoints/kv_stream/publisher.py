"""The server's KV event stream: the core's event log on a ZMQ PUB socket, in vLLM's format.

``KvEventPublisher`` owns one thread, a PUB socket and, with a replay endpoint, a ROUTER. Every
``POLL_S`` it reads the core's ``EventLog`` with its own cursor and sends the new records,
grouped by topic, as ``[topic, seq, KVEventBatch]`` messages, exactly as vLLM's
``ZmqEventPublisher`` does, so a consumer of vLLM's stream reads this one. Topics are per node
(default) or per engine; tokens and extra keys go out only for chains known to be unsalted.
Every queue is bounded (subscribers by HWM, the replay buffer by count and bytes) and the
listeners' peers are guarded by ``peers.PeerGuard``.

One file, over 600 lines: the topics, the scrubbing and the replay all act on the one
thread's sockets. docs/design/kv-stream.md has the rules and bounds. The trap: libzmq sockets
belong to one thread; only this thread touches them between ``start()`` and ``stop()``.
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import socket as _socket
import threading
import time
from typing import Any, Optional

import msgspec
import zmq

from lmshm.core.errors import Unavailable
from lmshm.core.kv_events import NODE, OWNER, event_bytes
from lmshm.core.logs import Throttle
from lmshm.endpoints.kv_stream.peers import PeerGuard
from lmshm.platform.base.files import unlink_if_same
from lmshm.settings import TOPIC_MODES, check_endpoint
from lmshm.transport.fdchannel import FdChannelError, bind_unix
from lmshm.wire.vllm_events import AllBlocksCleared, BlockStored, KvEvent, KvEventBatch

logger = logging.getLogger("lmshm.kv_events")
_replay_log = Throttle(logger)      # requesters cause these lines: at most one every 10 s
_failure_log = Throttle(logger)

POLL_S = 0.02                   # how often the log is read when nothing waits
READ_RECORDS = 4096             # records read from the log at once
READ_BYTES = 4 << 20            # ... and about this many bytes of events
MAX_BATCH_EVENTS = 512          # events of one KVEventBatch at most
MAX_BATCH_BYTES = 512 << 10     # ... and about this many bytes
MAX_REPLAYS = 16                # replay requests served at once; more wait (WAITING_REQUESTS, then the ROUTER)
WAITING_REQUESTS = 64           # requests read ahead of the replay slots (one per requester)
REPLAY_REQUESTS_PER_POLL = 16
REPLAY_MESSAGES_PER_POLL = 256  # replay messages one poll sends, over all requesters
REPLAY_BYTES_PER_POLL = 4 << 20
REPLAY_HWM = 16                 # replay messages queued for one requester; more wait (EAGAIN)
REPLAY_RCVHWM = 256             # requests queued in the ROUTER
REPLAY_STALL_S = 5.0            # a requester whose queue stays full this long is left behind
REPLAY_BUSY_STALL_S = 0.5       # ... or this long while other requests wait for a replay slot
MAX_REQUEST_BYTES = 256         # a bigger frame on the ROUTER closes that connection (libzmq)
MAX_SUBSCRIPTION_BYTES = 1024   # a bigger subscription on the PUB closes that connection (libzmq)
SUBSCRIBER_SENDS = 4 << 10      # bytes a subscriber may send (libzmq keeps its subscriptions); more drops it
SUBSCRIPTION_RCVHWM = 64        # subscription messages libzmq parses ahead of this thread, per subscriber
MAX_SUBSCRIBERS = 64            # connections to a bound PUB at most; more are shut at once
MAX_REQUESTERS = 64             # ... and to the replay ROUTER
MAX_PODS = 64                   # engines remembered for engine topics, per uid (kv_events.MAX_PODS_PER_UID)
MAX_TOPICS = 4096               # node topics remembered (their first batch starts with a clear)
MAX_CHAINS = 1 << 16            # block hashes remembered with whether their chain is salted (8,192-16,384 a namespace)
END_SEQ = (-1).to_bytes(8, "big", signed=True)

__all__ = ["KvEventPublisher", "binds"]

#: Every batch carries ``data_parallel_rank`` 0, as vLLM's publisher fills it in (its rank): the
#: batch is then the 3-element array Go consumers decode into a fixed 3-field array struct
#: (vmihailenco/msgpack refuses an array of another length). ``encode_batch`` leaves it out.
DATA_PARALLEL_RANK = 0
_encoder = msgspec.msgpack.Encoder()


def _encode(events: list[KvEvent], ts: float) -> bytearray:
    out = bytearray()
    _encoder.encode_into(KvEventBatch(ts, events, DATA_PARALLEL_RANK), out)
    return out


def binds(endpoint: str, connect: bool = False) -> bool:
    """Whether the publisher binds ``endpoint``: always, unless ``connect`` (``--kv-events-connect``)
    and it is ``tcp://``. vLLM binds only a wildcard host and connects to any other, so that a
    bound TCP stream listens on every interface; lmshm binds the host it is given (``127.0.0.1``:
    loopback only), and every interface only for a wildcard (``*``, ``::``, ``0.0.0.0``)."""
    return not (connect and endpoint.startswith("tcp://"))


def _carries_salt(keys: Any, lora: Optional[str]) -> bool:
    """Whether a first block's extra keys hold a cache salt: vLLM's are the LoRA name, a list per
    multimodal input, the salt (a string: the first block only), a prompt-embeds digest (bytes)."""
    keys = list(keys) if isinstance(keys, (list, tuple)) else [keys]
    if keys and lora is not None and keys[0] == lora:
        keys = keys[1:]
    return any(isinstance(k, str) for k in keys)


class _Replay:
    """One replay request in progress: batches ``next``..``last`` (seqs), then the end marker."""

    __slots__ = ("identity", "next", "last", "since")

    def __init__(self, identity: bytes, first: int, last: int) -> None:
        self.identity, self.next, self.last = identity, first, last
        self.since = time.monotonic()     # the last time it made progress


class KvEventPublisher:
    """Publishes ``kv_index.log`` on ``endpoint`` (see the module docstring). Sockets are set up
    here (a malformed endpoint raises ``ValueError``, one that cannot be bound or connected
    ``Unavailable``, naming the flag); ``start()`` runs the thread."""

    protocol = "kv-events"

    def __init__(self, kv_index: Any, endpoint: str, *, replay_endpoint: str = "", hwm: int = 10000,
                 replay_batches: int = 10000, replay_bytes: int = 64 << 20, topic: str = "node",
                 node: str = "", metrics: Any = None, subscriber_bytes: int = 64 << 20,
                 connect: bool = False, curve_secret: str = "", curve_clients: str = "") -> None:
        if topic not in TOPIC_MODES:
            raise ValueError(f"KV event topic mode {topic!r}: use node or engine")
        self.kv_index = kv_index
        self.log = kv_index.log
        self.mode = topic
        self.node = node or _socket.gethostname()
        self._node_prefix = f"kv@node:{self.node}@"
        # libzmq's SNDHWM counts batches; a batch is at most MAX_BATCH_BYTES (or one event, which
        # the advert checks keep under it), so this many hold at most subscriber_bytes
        self.hwm = max(1, min(hwm, subscriber_bytes // MAX_BATCH_BYTES))
        self.replay_batches, self.replay_bytes = replay_batches, replay_bytes
        self._cursor = -1
        self._seq = 0
        # (seq, its frames [topic, seq, payload] as sent on the PUB, payload bytes)
        self._buffer: collections.deque[tuple[int, tuple[zmq.Frame, ...], int]] = collections.deque()
        self._buffered_bytes = 0
        self._replays: collections.deque[_Replay] = collections.deque()
        self._waiting: collections.deque[tuple[bytes, list]] = collections.deque()   # (identity, frames)
        self._pods: dict[tuple[int, bytes], list[str]] = {}
        self._pod_count: dict[int, int] = {}      # uid -> engines remembered for it
        # pod name -> [the uid whose topic it is, its (uid, space) attachments]: a pod name is
        # the first uid's to attach it until that uid detaches it everywhere
        self._pod_owner: dict[str, list[int]] = {}
        self._node_topics: set[str] = set()
        # (uid, space) -> [{block hash: whether its chain is salted}, the generation before] (namespaces
        # least recently stored into first); MAX_CHAINS hashes in all at most
        self._chains: dict[tuple, dict] = {}
        self._chain_count = 0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._closed = False
        # counters (read by /metrics from another thread: plain ints)
        self.published = 0        # batches sent on the PUB socket
        self.published_bytes = 0  # ... their payloads' bytes
        self.dropped = 0          # batches some subscriber's full queue did not take (see _send)
        self.lost = 0             # log records trimmed before this publisher read them
        self.replay_requests = 0
        self.replay_malformed = 0  # wrong frame count, delimiter or seq size: answered with the end marker
        self.replay_future = 0    # a start past the newest batch: answered with the end marker
        self.replay_duplicate = 0  # requests from a requester whose replay was under way: dropped
        self.replay_truncated = 0  # a start older than the buffer: answered from its oldest batch
        self.replay_sent = 0      # batches sent on the replay socket
        self.replay_abandoned = 0  # requesters gone, or not reading for REPLAY_STALL_S
        self.pods_unmapped = 0    # engines not remembered: their uid had MAX_PODS
        self.pods_refused = 0     # pod names no topic can carry ('@', spaces, "node:...")
        self.scrubbed = 0         # BlockStored of salted chains sent without tokens and extra keys
        self.pods_taken = 0       # pod names another uid's engine holds (its events go to the node topic)
        # inproc:// only reaches sockets of the same context: the process's shared one, as vLLM
        self._own_ctx = not endpoint.startswith("inproc://") and not replay_endpoint.startswith("inproc://")
        self._ctx = zmq.Context() if self._own_ctx else zmq.Context.instance()
        self._pub: Optional[zmq.Socket] = None
        self._replay: Optional[zmq.Socket] = None
        self._guards: list[PeerGuard] = []
        self._auth: Any = None      # zmq.auth's ZAP thread, with --kv-events-curve-clients
        self._poller = zmq.Poller()
        self._ipc_files: list[tuple[str, tuple[int, int]]] = []     # removed at close, if still ours
        try:
            keys = self._curve(curve_secret, curve_clients)
            self._pub = self._ctx.socket(zmq.PUB)
            self._secure(self._pub, keys)
            self._pub.setsockopt(zmq.LINGER, 0)
            self._pub.setsockopt(zmq.SNDHWM, self.hwm)
            self._pub.setsockopt(zmq.RCVHWM, SUBSCRIPTION_RCVHWM)
            self._pub.setsockopt(zmq.XPUB_NODROP, 1)      # a full queue is EAGAIN: counted, see _send
            self._pub.setsockopt(zmq.MAXMSGSIZE, MAX_SUBSCRIPTION_BYTES)
            self.binds = binds(check_endpoint(endpoint), connect)
            if self.binds:
                self._guard(self._pub, "PUB", MAX_SUBSCRIBERS, SUBSCRIBER_SENDS)
            self.endpoint = self._attach(self._pub, endpoint, self.binds, "--kv-events")
            self.replay_endpoint = ""
            if replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._secure(self._replay, keys)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.setsockopt(zmq.SNDHWM, REPLAY_HWM)
                self._replay.setsockopt(zmq.RCVHWM, REPLAY_RCVHWM)
                self._replay.setsockopt(zmq.ROUTER_MANDATORY, 1)   # a full or gone peer: an error, not silence
                self._replay.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
                self._guard(self._replay, "replay", MAX_REQUESTERS, None)
                self._poller.register(self._replay, zmq.POLLIN)
                self.replay_endpoint = self._attach(self._replay, check_endpoint(replay_endpoint), True,
                                                    "--kv-events-replay")
        except BaseException:
            self._close_sockets()
            raise
        if metrics is not None:
            self._add_gauges(metrics)

    def _curve(self, secret_file: str, clients_dir: str) -> Optional[tuple[bytes, bytes]]:
        """The server's CURVE key pair from ``secret_file`` (None: no CURVE); with ``clients_dir``,
        a ZAP handler that admits only the client public keys of the certificates there."""
        if clients_dir and not secret_file:
            raise ValueError("--kv-events-curve-clients admits client keys to a CURVE stream: set "
                             "--kv-events-curve-secret too")
        if not secret_file:
            return None
        if not zmq.has("curve"):
            raise Unavailable("--kv-events-curve-secret: this libzmq was built without CURVE")
        from zmq.auth import load_certificate

        try:
            public, secret = load_certificate(secret_file)
        except (OSError, ValueError) as exc:
            raise Unavailable(f"cannot read the KV event stream's CURVE key {secret_file} "
                              f"(lmshm-server --kv-events-curve-secret): {exc}") from None
        if not secret:
            raise Unavailable(f"{secret_file} holds no secret-key (lmshm-server --kv-events-curve-secret): give "
                              "the server's .key_secret certificate (zmq.auth.create_certificates makes one)")
        if clients_dir:
            if not os.path.isdir(clients_dir):
                raise Unavailable(f"{clients_dir} is not a directory of client certificates "
                                  "(lmshm-server --kv-events-curve-clients)")
            from zmq.auth.thread import ThreadAuthenticator

            self._auth = ThreadAuthenticator(self._ctx, log=logging.getLogger("lmshm.kv_events.auth"))
            self._auth.start()
            self._auth.configure_curve(domain="*", location=clients_dir)
        return public, secret

    @staticmethod
    def _secure(sock: zmq.Socket, keys: Optional[tuple[bytes, bytes]]) -> None:
        if keys is not None:
            sock.setsockopt(zmq.CURVE_SERVER, 1)
            sock.setsockopt(zmq.CURVE_PUBLICKEY, keys[0])
            sock.setsockopt(zmq.CURVE_SECRETKEY, keys[1])

    def _guard(self, sock: zmq.Socket, what: str, max_peers: int, max_bytes: Optional[int]) -> None:
        guard = PeerGuard(sock, what=what, max_peers=max_peers, max_bytes=max_bytes)
        self._guards.append(guard)
        self._poller.register(guard.monitor, zmq.POLLIN)

    @classmethod
    def from_config(cls, core: Any, config: Any) -> "KvEventPublisher":
        """The publisher a ``ServerConfig`` asks for (``--kv-events`` and the flags after it)."""
        return cls(core.kv_index, config.kv_events, replay_endpoint=config.kv_events_replay,
                   hwm=config.kv_events_hwm, replay_batches=config.kv_events_replay_batches,
                   replay_bytes=config.kv_events_replay_bytes, topic=config.kv_events_topic,
                   node=config.kv_events_node, metrics=core.metrics,
                   subscriber_bytes=config.kv_events_subscriber_bytes, connect=config.kv_events_connect,
                   curve_secret=config.kv_events_curve_secret, curve_clients=config.kv_events_curve_clients)

    def _attach(self, sock: zmq.Socket, endpoint: str, bind: bool, flag: str) -> str:
        if endpoint.startswith("tcp://") and ":" in endpoint[len("tcp://"):].rpartition(":")[0]:
            sock.setsockopt(zmq.IPV6, 1)
        try:
            if not bind:
                sock.connect(endpoint)
                return endpoint
            path = endpoint[len("ipc://"):] if endpoint.startswith("ipc://") else ""
            if path and not path.startswith("@"):
                self._bind_ipc(sock, path, flag)
            else:
                sock.bind(endpoint)
        except zmq.ZMQError as exc:
            raise Unavailable(f"cannot {'bind' if bind else 'connect'} the KV event endpoint {endpoint} "
                              f"(lmshm-server {flag}): {exc.strerror}") from None
        last = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        return last or endpoint

    def _bind_ipc(self, sock: zmq.Socket, path: str, flag: str) -> None:
        """libzmq's own ipc bind first unlinks whatever is at ``path`` (a live endpoint too) and
        leaves its file behind: bind here instead (mode 0600, a live socket refused, only a
        stale one of ours replaced), and hand libzmq the listening fd (ZMQ_USE_FD; it closes it)."""
        try:
            listener, ident = bind_unix(path, _socket.SOCK_STREAM, "KV event endpoint")
        except FdChannelError as exc:
            raise Unavailable(f"{exc} (lmshm-server {flag})") from None
        self._ipc_files.append((path, ident))
        try:
            listener.listen(64)
            sock.setsockopt(zmq.USE_FD, listener.fileno())
            sock.bind(f"ipc://{path}")
        except BaseException:
            listener.close()
            raise
        listener.detach()       # libzmq's now

    @property
    def port(self) -> Optional[int]:
        """The PUB socket's TCP port, if it has one."""
        if not self.endpoint.startswith("tcp://"):
            return None
        port = self.endpoint.rpartition(":")[2]
        return int(port) if port.isdigit() else None

    def _add_gauges(self, m: Any) -> None:
        m.add_gauge("lmshm_kv_events_published", "KV event batches sent on the --kv-events stream",
                    lambda: self.published)
        m.add_gauge("lmshm_kv_events_published_bytes", "Bytes of the KV event batches sent (payloads)",
                    lambda: self.published_bytes)
        m.add_gauge("lmshm_kv_events_dropped", "KV event batches that found a subscriber's queue full "
                    "(--kv-events-hwm): that subscriber misses it, and the batches after it until it catches up "
                    "(those are not counted)", lambda: self.dropped)
        m.add_gauge("lmshm_kv_events_lost", "KV event log records dropped before the publisher read them",
                    lambda: self.lost)
        m.add_gauge("lmshm_kv_events_replay_requests", "Replay requests received (--kv-events-replay)",
                    lambda: self.replay_requests)
        m.add_gauge("lmshm_kv_events_replay_refused", "Replay requests answered with the end marker alone: "
                    "malformed, or for a sequence number not published yet",
                    lambda: self.replay_malformed + self.replay_future)
        m.add_gauge("lmshm_kv_events_replay_malformed", "Replay requests that were not [empty frame, 8-byte "
                    "sequence number]", lambda: self.replay_malformed)
        m.add_gauge("lmshm_kv_events_replay_duplicate", "Replay requests dropped: their requester's earlier "
                    "replay was still under way (one at a time each)", lambda: self.replay_duplicate)
        m.add_gauge("lmshm_kv_events_replay_truncated", "Replay requests for batches older than the replay "
                    "buffer holds (answered from its oldest)", lambda: self.replay_truncated)
        m.add_gauge("lmshm_kv_events_replay_batches", "Batches sent in answer to replay requests",
                    lambda: self.replay_sent)
        m.add_gauge("lmshm_kv_events_replay_abandoned", "Replays given up: the requester left, or did not read "
                    f"for {REPLAY_STALL_S:g} s ({REPLAY_BUSY_STALL_S:g} s while other requests waited)",
                    lambda: self.replay_abandoned)
        m.add_gauge("lmshm_kv_events_replay_buffered", "Batches held for replay", lambda: len(self._buffer))
        m.add_gauge("lmshm_kv_events_connections", "Connections to the bound KV event endpoints (PUB and replay)",
                    lambda: sum(g.connected for g in self._guards))
        m.add_gauge("lmshm_kv_events_connections_refused", f"Connections to the KV event endpoints shut at once: past "
                    f"{MAX_SUBSCRIBERS} per endpoint, or into the fd reserve", lambda: sum(g.refused for g in self._guards))
        m.add_gauge("lmshm_kv_events_connections_evicted", "Connections to the KV event endpoints shut before their "
                    "handshake finished, to make room past the cap for a new one", lambda: sum(g.evicted for g in self._guards))
        m.add_gauge("lmshm_kv_events_subscribers_dropped", f"Subscribers disconnected for sending more than "
                    f"{SUBSCRIBER_SENDS} bytes (subscriptions)", lambda: sum(g.dropped for g in self._guards))

    # ---- lifecycle ----------------------------------------------------------------------
    def start(self) -> "KvEventPublisher":
        if self._thread is None and not self._closed:
            self._thread = threading.Thread(target=self._run, name="lmshm-kv-events", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the thread, close the sockets (linger 0), end the context. Idempotent."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)
            if thread.is_alive():   # never seen: the loop never blocks. Its sockets stay open.
                logger.error("lmshm: the KV event publisher did not stop within %g s", timeout_s)
                return
        self.log.release_node()         # nobody reads the node stream now: nothing to keep for it
        self._close_sockets()

    def _close_sockets(self) -> None:
        if self._closed:
            return
        self._closed = True
        for guard in self._guards:
            guard.close()
        self._guards.clear()
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._replay = None
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        if self._own_ctx:
            self._ctx.term()
        for path, ident in self._ipc_files:
            unlink_if_same(path, ident)

    # ---- the thread ---------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            more = False
            try:
                for guard in self._guards:
                    guard.on_events()
                    guard.check()
                more = self._publish()
                if self._replay is not None:
                    self._take_requests()
                    more = self._serve_replays() or more
            except Exception:
                _failure_log.exception("lmshm: the KV event publisher failed a round; it goes on")
                self._stop.wait(0.1)
            if not more:
                if self._poller.sockets:
                    # a connection or a request wakes it early (a request only while replays may start)
                    if self._replay is not None:
                        self._poller.modify(self._replay, zmq.POLLIN if len(self._waiting) < WAITING_REQUESTS else 0)
                    self._poller.poll(int(POLL_S * 1000))
                else:
                    self._stop.wait(POLL_S)

    def _publish(self) -> bool:
        """Send what the log holds past the cursor; True if it held more than one read."""
        after = self._cursor
        records, self._cursor, lost = self.log.read(after, READ_RECORDS, max_bytes=READ_BYTES, node=True)
        groups: dict[str, list[KvEvent]] = {}
        if lost and records:
            missed = records[0].n - after - 1
            self.lost += missed
            logger.warning("lmshm: the KV event publisher fell %d records behind the event log (--kv-events-buffer) "
                           "and lost them; %s", missed,
                           "its node topics start over with AllBlocksCleared" if self.mode == "node" else
                           "engine topics may advertise blocks that are gone")
            if self.mode == "node":
                for topic in sorted(self._node_topics):
                    groups[topic] = [AllBlocksCleared()]
        for r in records:
            event = r.event
            if event is None:
                if r.pod:
                    (self._detach_pod if r.detach else self._attach_pod)(r.uid, r.space, r.pod)
                continue
            if isinstance(event, BlockStored):
                event = self._scrub(r.uid, r.space, event)
            for topic in self._topics(r.uid, r.space, r.model, event):
                if r.scope == (OWNER if topic.startswith(self._node_prefix) else NODE):
                    continue        # Record.scope: an owner-only record on a node topic, a node-only one on a pod's
                group = groups.get(topic)
                if group is None:
                    group = groups[topic] = []
                    if topic.startswith(self._node_prefix) and topic not in self._node_topics \
                            and len(self._node_topics) < MAX_TOPICS:
                        self._node_topics.add(topic)
                        if not isinstance(event, AllBlocksCleared):
                            group.append(AllBlocksCleared())   # this topic's first batch of the run
                group.append(event)
        now = time.time()
        for topic, events in groups.items():
            topic_b = topic.encode("utf-8", "replace")
            start, size = 0, 0
            for i, event in enumerate(events):
                size += event_bytes(event)
                if i > start and (i - start >= MAX_BATCH_EVENTS or size > MAX_BATCH_BYTES):
                    self._send(topic_b, _encode(events[start:i], now))
                    start, size = i, event_bytes(event)
            self._send(topic_b, _encode(events[start:], now))
        return self._cursor < self.log.last

    def _scrub(self, uid: int, space: bytes, event: BlockStored) -> BlockStored:
        """``event`` as the stream may carry it. Its tokens and extra keys go out only for a chain
        known to be unsalted: a first block (no parent) whose extra keys hold no cache salt, or a
        child of a block remembered as such in the same uid and namespace. Anything else goes out
        as block hashes only: a salted chain (the salt would make the private prompt findable
        again, its tokens would index it under an unsalted key; its hashes need the salt to
        compute), and a child of a parent this run does not remember (stored before a restart, on
        another node, or forgotten: a namespace's last 8,192 to 16,384 hashes are kept, ``MAX_CHAINS``
        in all), which may be one."""
        key, parent = (uid, space), event.parent_block_hash
        gens = self._chains.pop(key, None)
        if gens is None:
            gens = [{}, {}]         # this generation, the one before
        self._chains[key] = gens    # the namespace stored into last goes last
        new, old = gens
        if parent is None:
            salted = bool(event.extra_keys) and _carries_salt(event.extra_keys[0], event.lora_name)
        else:
            salted = new.get(parent)
            if salted is None:
                salted = old.get(parent, True)      # unknown: maybe salted
        before = len(new)
        new.update(dict.fromkeys(event.block_hashes, salted))
        self._chain_count += len(new) - before
        if len(new) > MAX_CHAINS // 8:              # a new generation; the one before is forgotten
            self._chain_count -= len(old)
            gens[:] = [{}, new]
        while self._chain_count > MAX_CHAINS and len(self._chains) > 1:    # forget the namespaces stored
            # into least recently (this one is last; alone, its two generations bound it)
            self._chain_count -= sum(map(len, self._chains.pop(next(iter(self._chains)))))
        if not salted:
            return event
        self.scrubbed += 1
        return msgspec.structs.replace(event, token_ids=[], extra_keys=None)

    def _attach_pod(self, uid: int, space: bytes, pod: str) -> None:
        if "@" in pod or pod.startswith("node:") or any(c.isspace() for c in pod):
            self.pods_refused += 1      # kv@POD@MODEL would not parse, or would pose as a node topic
            return
        owner = self._pod_owner.get(pod)
        if owner is not None and owner[0] != uid:
            # another uid's engine publishes under this name: a STORE's pod is what its sender
            # says, so another tenant naming it would put its claims (and removals) on that
            # engine's topic; its events go to the node topic instead
            self.pods_taken += 1
            _failure_log.warning("lmshm: uid %d names engine %r of another uid in its STOREs; its KV events go "
                                 "to the node topic", uid, pod[:80])
            return
        pods = self._pods.setdefault((uid, space), [])
        if pod in pods:
            return
        if self._pod_count.get(uid, 0) >= MAX_PODS:     # per uid: another uid's engines never count
            self.pods_unmapped += 1
            if not pods:
                del self._pods[(uid, space)]
            return
        pods.append(pod)
        self._pod_count[uid] = self._pod_count.get(uid, 0) + 1
        if owner is None:
            self._pod_owner[pod] = [uid, 1]
        else:
            owner[1] += 1

    def _detach_pod(self, uid: int, space: bytes, pod: str) -> None:
        """The index forgot this engine (``Record.detach``): its topic is no longer sent to."""
        pods = self._pods.get((uid, space))
        if not pods or pod not in pods:
            return
        pods.remove(pod)
        if not pods:
            del self._pods[(uid, space)]
        owner = self._pod_owner.get(pod)
        if owner is not None and owner[0] == uid:
            owner[1] -= 1
            if not owner[1]:
                del self._pod_owner[pod]
        left = self._pod_count[uid] - 1
        if left:
            self._pod_count[uid] = left
        else:
            del self._pod_count[uid]

    def _topics(self, uid: int, space: bytes, model: str, event: KvEvent) -> list[str]:
        if isinstance(event, AllBlocksCleared):
            if model:
                return [self._node_prefix + model]
            first = self._node_prefix
            return [first] + sorted(t for t in self._node_topics if t != first)
        if self.mode == "engine":
            pods = self._pods.get((uid, space))
            if pods:
                return [f"kv@{pod}@{model}" for pod in pods]
        return [self._node_prefix + model]      # node mode, or no engine attached to its namespace

    def _send(self, topic: bytes, payload: bytearray) -> None:
        """One batch on the PUB socket (and into the replay buffer). With XPUB_NODROP a send
        that finds any subscriber's queue full fails (EAGAIN): counted as dropped, then sent
        again without it, so the subscribers with room still get it. libzmq then skips the full
        subscriber until its queue drains, uncounted: the count is of times one fell behind."""
        seq = self._seq
        self._seq += 1
        size = len(payload)
        # one copy into libzmq, shared (by reference) by every subscriber's queue and replay. A
        # Frame keeps a reference to what it was made from: the payload is emptied, so that the
        # buffer does not hold each batch twice
        frames = (zmq.Frame(topic, copy=True), zmq.Frame(seq.to_bytes(8, "big"), copy=True),
                  zmq.Frame(payload, copy=True))
        payload.clear()
        pub = self._pub
        try:
            pub.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            self.dropped += 1
            pub.setsockopt(zmq.XPUB_NODROP, 0)
            try:
                pub.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:  # lossy sends do not fail on a full queue; be safe anyway
                pass
            finally:
                pub.setsockopt(zmq.XPUB_NODROP, 1)
        self.published += 1
        self.published_bytes += size
        if self._replay is not None:
            self._buffer.append((seq, frames, size))
            self._buffered_bytes += len(topic) + size + 8
            while self._buffer and (len(self._buffer) > self.replay_batches
                                    or self._buffered_bytes > self.replay_bytes):
                _, old, n = self._buffer.popleft()
                self._buffered_bytes -= len(old[0].bytes) + n + 8

    # ---- replay -------------------------------------------------------------------------
    def _take_requests(self) -> None:
        """Read requests (at most ``WAITING_REQUESTS`` waiting; one per requester: a request from
        one whose replay is under way or waiting is dropped) and start replays while slots are
        free. Waiting requests shorten how long a stalled replay keeps its slot (``_send_replay``)."""
        sock = self._replay
        for _ in range(REPLAY_REQUESTS_PER_POLL):
            if len(self._waiting) >= WAITING_REQUESTS:
                break           # the rest wait in the ROUTER's queue (REPLAY_RCVHWM)
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            self.replay_requests += 1
            identity = frames[0]
            if any(rp.identity == identity for rp in self._replays) or any(w[0] == identity for w in self._waiting):
                # one replay per requester at a time: a flood of requests from one takes one slot,
                # not all MAX_REPLAYS. Its earlier request's answer (then the end marker) is coming.
                self.replay_duplicate += 1
                continue
            self._waiting.append((identity, frames))
        while self._waiting and len(self._replays) < MAX_REPLAYS:
            self._start_replay(*self._waiting.popleft())

    def _start_replay(self, identity: bytes, frames: list) -> None:
        newest = self._seq - 1
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
            self.replay_malformed += 1
            _replay_log.warning("lmshm: a KV event replay request was not [empty frame, 8-byte sequence "
                                "number] (%d frames); answered with the end marker", len(frames))
            self._replays.append(_Replay(identity, 1, 0))      # nothing, then the end marker
            return
        start = int.from_bytes(frames[2], "big")
        if start > newest:
            self.replay_future += 1
            self._replays.append(_Replay(identity, 1, 0))
            return
        oldest = self._buffer[0][0] if self._buffer else self._seq
        if start < oldest:
            self.replay_truncated += 1
        self._replays.append(_Replay(identity, max(start, oldest), newest))

    def _serve_replays(self) -> bool:
        """Send replay messages, within this poll's budget, requesters in turn (one replay per
        requester: ``_take_requests`` drops the others). True if the budget ran out."""
        budget = [REPLAY_MESSAGES_PER_POLL, REPLAY_BYTES_PER_POLL]
        for rp in list(self._replays):
            if self._advance(rp, budget):
                self._replays.remove(rp)
            if budget[0] <= 0 or budget[1] <= 0:
                return True
        return False

    def _advance(self, rp: _Replay, budget: list[int]) -> bool:
        """Send what ``rp`` has left that fits ``budget``; True when it is finished or given up."""
        while rp.next <= rp.last:
            if budget[0] <= 0 or budget[1] <= 0:
                return False
            first = self._buffer[0][0] if self._buffer else self._seq
            if rp.next < first:
                rp.next = first            # trimmed while this replay waited: a gap, as on the stream
                if rp.next > rp.last:
                    break
            _, frames, size = self._buffer[rp.next - first]
            sent = self._send_replay(rp, (rp.identity, b"", *frames))
            if sent is None:
                return True
            if not sent:
                return False
            rp.next += 1
            self.replay_sent += 1
            budget[0] -= 1
            budget[1] -= size
        sent = self._send_replay(rp, (rp.identity, b"", b"", END_SEQ, b""))
        return sent is None or sent

    def _send_replay(self, rp: _Replay, frames: tuple) -> Optional[bool]:
        """True: sent; False: the requester's queue is full, try later; None: given up."""
        try:
            self._replay.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)     # the frames are shared
        except zmq.Again:
            # a slot held by a requester that does not read: 5 s, or 0.5 s while others wait for one
            if time.monotonic() - rp.since < (REPLAY_BUSY_STALL_S if self._waiting else REPLAY_STALL_S):
                return False
            self.replay_abandoned += 1
            _replay_log.warning("lmshm: a KV event replay requester read nothing for %g s (%g s while other "
                                "requests wait); its replay was given up", REPLAY_STALL_S, REPLAY_BUSY_STALL_S)
            return None
        except zmq.ZMQError as exc:
            if exc.errno != errno.EHOSTUNREACH:
                raise
            self.replay_abandoned += 1      # it disconnected
            return None
        rp.since = time.monotonic()
        return True
