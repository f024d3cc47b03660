"""``lmshm-server --kv-events``: the server's own KV event stream, in vLLM's wire format.

Real ``lmshm-server`` processes, a CPU KV cache registered by an ``MPClient`` in this process,
and real ZMQ SUB / DEALER sockets reading the stream and its replay ROUTER. Payloads are
decoded with lmshm's ``decode_batch``, with plain msgpack, and (``.venv-vllm``) with vLLM's own
``KVEventBatch`` decoder.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Optional

import msgspec
import pytest
import torch
import zmq
from harness import wait_for
from zmq.utils.monitor import recv_monitor_message

from lmshm.core.errors import Unavailable
from lmshm.core.kv_events import BlockStored, KvIndex, decode_batch
from lmshm.endpoints.kv_stream.publisher import KvEventPublisher
from lmshm.server import Server
from lmshm.settings import ConfigError, ServerConfig, build_arg_parser, resolve_config
from lmshm.transport.client import MPClient
from lmshm.wire import protocol

ROOT = Path(__file__).resolve().parents[3]
VLLM_PYTHON = Path(os.environ.get("LMSHM_VLLM_VENV", ROOT / ".venv-vllm")) / "bin" / "python"
END = (-1).to_bytes(8, "big", signed=True)
NODE = "testnode"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _seq(frame: bytes) -> int:
    return int.from_bytes(frame, "big")


class Sub:
    """A ZMQ SUB on the stream that collects ``[topic, seq, payload]`` on a thread of its own.

    A PUB drops what it sends before a subscription reached it, so the constructor waits for
    the ZMTP handshake (a socket monitor) and a little longer (the subscription follows it);
    ``wait_connected()`` does the same again, after the publisher restarted."""

    def __init__(self, endpoint: str, *, bind: bool = False, topic: bytes = b"", wait: bool = True) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, topic)
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        (self.sock.bind if bind else self.sock.connect)(endpoint)
        self.frames: list[list[bytes]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        if wait:
            self.wait_connected()

    def wait_connected(self, timeout_s: float = 20.0) -> None:
        if not self.monitor.poll(int(timeout_s * 1000)):
            raise AssertionError(f"the subscriber did not connect within {timeout_s} s")
        recv_monitor_message(self.monitor)
        time.sleep(0.2)                       # the subscription travels after the handshake

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.sock.poll(20):
                self.frames.append(self.sock.recv_multipart())

    def events(self, topic: Optional[bytes] = None) -> list[dict]:
        return [e for t, _, p in list(self.frames) if topic is None or t == topic for e in decode_batch(p)[1]]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.disable_monitor()
        self.monitor.close()
        self.sock.close()
        self.ctx.term()


def _replay(endpoint: str, frames: list[bytes], timeout_s: float = 5.0) -> list[list[bytes]]:
    """Send one request on a DEALER (the ROUTER sees ``[identity, *frames]``) and read the answer:
    messages ``[b"", topic, seq, payload]`` up to the end marker ``[b"", b"", -1, b""]``. Returns
    the ``[topic, seq, payload]`` before the end marker."""
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart(frames)
        out = []
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if dealer.poll(100):
                msg = dealer.recv_multipart()
                assert len(msg) == 4 and msg[0] == b"", msg[:3]
                if msg[1:] == [b"", END, b""]:
                    return out
                out.append(msg[1:])
        raise AssertionError(f"no end marker within {timeout_s} s; got {len(out)} messages")
    finally:
        dealer.close()
        ctx.term()


def _metrics(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
            if line.startswith("lmshm_kv_events")}


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


class Engine:
    """An MPClient with one registered CPU KV cache of ``blocks`` blocks (1 KiB each)."""

    def __init__(self, url: str, blocks: int = 16, model: str = "m") -> None:
        self.client = MPClient(url)
        self.kv = torch.zeros(blocks, 4, 64)
        self.iid = self.client.register_kv_caches({"l0": self.kv}, f"w{id(self)}", model_name=model)

    def store(self, adverts: list, pod: str = "pod0", space: bytes = b"S") -> None:
        reply = self.client.store(self.iid, [a.chunk for a in adverts], list(range(len(adverts))), 1,
                                  adverts=adverts, space=space, pod=pod)
        assert list(reply.results) == [0] * len(adverts), reply

    def close(self) -> None:
        self.client.close()
        self.kv = None          # its pages are a memfd mapping: unmapped when the tensor goes


def _advert(i: int, parent: Optional[int] = None) -> protocol.Advert:
    """Chunk ``i``: one engine block, hash 1000+i, tokens [2i, 2i+1]."""
    return protocol.Advert(i.to_bytes(4, "big") * 8, 0, 2, [1000 + i], parent, [2 * i, 2 * i + 1])


@pytest.fixture
def engines():
    made: list[Engine] = []

    def make(url: str, **kw) -> Engine:
        made.append(Engine(url, **kw))
        return made[-1]

    yield make
    for e in made:
        e.close()


def _events_server(start_server, *args: str, port: Optional[int] = None, replay: bool = True):
    # A free port can be taken by a test running beside this one before the server binds it:
    # then the server refuses to start ("Address already in use"), and we try other ports.
    for attempt in range(5):
        pub_port = port or _free_port()
        extra = ["--kv-events", f"tcp://*:{pub_port}", "--kv-events-node", NODE]
        replay_port = _free_port() if replay else None
        if replay:
            extra += ["--kv-events-replay", f"tcp://127.0.0.1:{replay_port}"]
        try:
            server = start_server("--capacity", "64MiB", *extra, *args)
        except RuntimeError as exc:
            if "Address already in use" not in str(exc) or attempt == 4:
                raise
            continue
        return server, f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{replay_port}" if replay else None


def _stored(events: list[dict]) -> list[tuple]:
    return [(e["type"], e.get("block_hashes")) for e in events]


# ---- the stream -------------------------------------------------------------------------

def test_a_store_is_block_stored_cpu_local_and_an_eviction_block_removed(start_server, engines):
    server, pub, _ = _events_server(start_server, "--max-objects", "4", replay=False)
    sub = Sub(pub)
    try:
        engine = engines(server.url)
        engine.store([_advert(i, None if i == 0 else 999 + i) for i in range(6)])
        topic = f"kv@node:{NODE}@m".encode()
        wait_for(lambda: len(sub.events(topic)) >= 9, 10, what="9 events on the node topic")
        events = sub.events(topic)
    finally:
        sub.close()
    # the topic's first batch of this run starts with AllBlocksCleared; then 4 stores, 2 evictions, 2 stores
    assert _stored(events) == [("AllBlocksCleared", None)] + [("BlockStored", [1000 + i]) for i in range(4)] + [
        ("BlockRemoved", [1000]), ("BlockRemoved", [1001])] + [("BlockStored", [1000 + i]) for i in (4, 5)]
    first = events[1]
    assert (first["medium"], first["locality"], first["token_ids"], first["block_size"], first["group_idx"],
            first["parent_block_hash"], first["lora_id"]) == ("CPU", "LOCAL", [0, 1], 2, 0, None, None)
    assert events[2]["parent_block_hash"] == 1000 and events[2]["token_ids"] == [2, 3]
    assert (events[5]["medium"], events[5]["locality"]) == ("CPU", "LOCAL")
    # frames: [topic, 8-byte big-endian seq, payload]; one counter over every topic, from 0
    seqs = [_seq(f[1]) for f in sub.frames]
    assert all(len(f) == 3 and len(f[1]) == 8 for f in sub.frames)
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    # plain msgpack: an array [ts, events, data_parallel_rank] (three items, as vLLM's publisher sends:
    # Go consumers decode it into a 3-field array struct), each event a map tagged by "type"
    raw = msgspec.msgpack.decode(next(p for t, _, p in sub.frames if t == topic))
    assert isinstance(raw, list) and len(raw) == 3 and isinstance(raw[0], float) and raw[2] == 0
    assert raw[1][0] == {"type": "AllBlocksCleared"}
    assert raw[1][1] == {"type": "BlockStored", "block_hashes": [1000], "parent_block_hash": None, "token_ids": [0, 1],
                         "block_size": 2, "lora_id": None, "medium": "CPU", "lora_name": None, "group_idx": 0,
                         "locality": "LOCAL"}


_DECODE_WITH_VLLM = r"""
import json, sys, msgspec
from vllm.distributed.kv_events import KVEventBatch, BlockStored, BlockRemoved, AllBlocksCleared
frames = msgspec.msgpack.decode(open(sys.argv[1], "rb").read())
dec = msgspec.msgpack.Decoder(KVEventBatch)
out = []
for topic, seq, payload in frames:
    batch = dec.decode(payload)
    events = []
    for e in batch.events:
        d = {"type": type(e).__name__}
        if isinstance(e, (BlockStored, BlockRemoved)):
            d.update(hashes=[h.hex() if isinstance(h, bytes) else h for h in e.block_hashes], medium=e.medium,
                     locality=e.locality, group=e.group_idx)
        if isinstance(e, BlockStored):
            d.update(parent=e.parent_block_hash, tokens=e.token_ids, block_size=e.block_size, lora=e.lora_name)
        events.append(d)
    out.append({"topic": topic.decode(), "seq": int.from_bytes(seq, "big"), "ts": batch.ts,
                "rank": batch.data_parallel_rank, "events": events})
print(json.dumps(out))
"""


@pytest.mark.vllm
def test_vllms_own_decoder_reads_the_stream_and_its_replay(start_server, engines, tmp_path):
    if not VLLM_PYTHON.exists():
        pytest.skip(f"{VLLM_PYTHON} is missing (scripts/bootstrap-vllm builds it)")
    server, pub, replay = _events_server(start_server, "--max-objects", "4")
    sub = Sub(pub)
    try:
        engine = engines(server.url)
        engine.store([protocol.Advert(bytes([i]) * 32, 0, 2, [bytes([i]) * 32], None, [i, i]) for i in range(6)])
        wait_for(lambda: len(sub.events()) >= 9, 10, what="the store's events")
    finally:
        sub.close()
    answer = _replay(replay, [b"", (0).to_bytes(8, "big")])
    frames = sub.frames + answer
    path = tmp_path / "frames.msgpack"
    path.write_bytes(msgspec.msgpack.encode(frames))
    env = {**os.environ, "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "TMPDIR": str(tmp_path)}
    env.pop("PYTHONPATH", None)
    done = subprocess.run([str(VLLM_PYTHON), "-c", _DECODE_WITH_VLLM, str(path)], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    batches = json.loads(done.stdout.strip().splitlines()[-1])
    live, replayed = batches[:len(sub.frames)], batches[len(sub.frames):]
    assert replayed[0]["seq"] == 0 and replayed[0]["topic"] == f"kv@node:{NODE}@"
    assert replayed[0]["events"] == [{"type": "AllBlocksCleared"}]
    # the replay holds every batch the subscriber got, the same as vLLM decodes them
    by_seq = {b["seq"]: b for b in replayed}
    assert all(by_seq[b["seq"]] == b for b in live)
    # ... and what vLLM decodes is what lmshm's decoder reads
    assert [e["type"] for b in live for e in b["events"]] == [e["type"] for e in sub.events()]
    events = [e for b in live if b["topic"] == f"kv@node:{NODE}@m" for e in b["events"]]
    assert [e["type"] for e in events] == ["AllBlocksCleared"] + ["BlockStored"] * 4 + ["BlockRemoved"] * 2 + [
        "BlockStored"] * 2
    assert events[1] == {"type": "BlockStored", "hashes": [(b"\x00" * 32).hex()], "medium": "CPU",
                         "locality": "LOCAL", "group": 0, "parent": None, "tokens": [0, 0], "block_size": 2,
                         "lora": None}
    assert events[5] == {"type": "BlockRemoved", "hashes": [(b"\x00" * 32).hex()], "medium": "CPU",
                         "locality": "LOCAL", "group": 0}
    assert all(b["rank"] == 0 and b["ts"] > 0 for b in batches)


def test_engine_topics_carry_a_namespaces_events_to_every_engine_attached_to_it(start_server, engines):
    server, pub, replay = _events_server(start_server, "--kv-events-topic", "engine")
    sub = Sub(pub)
    try:
        engine = engines(server.url)
        engine.store([_advert(0), _advert(1, 1000)], pod="pod0")
        wait_for(lambda: len(sub.events()) >= 2, 10, what="pod0's events")
        engine.store([_advert(2, 1001)], pod="pod1")          # pod1 attaches to the same namespace
        engine.store([_advert(3)], pod="pod2", space=b"other")  # another namespace: pod2 alone
        wait_for(lambda: len(sub.events()) >= 5, 10, what="every event")
        time.sleep(0.2)
    finally:
        sub.close()
    assert _stored(sub.events(b"kv@pod0@m")) == [("BlockStored", [1000]), ("BlockStored", [1001]),
                                                  ("BlockStored", [1002])]
    assert _stored(sub.events(b"kv@pod1@m")) == [("BlockStored", [1002])]
    assert _stored(sub.events(b"kv@pod2@m")) == [("BlockStored", [1003])]
    assert {t for t, _, _ in sub.frames} - {f"kv@node:{NODE}@".encode()} == {b"kv@pod0@m", b"kv@pod1@m",
                                                                                 b"kv@pod2@m"}
    # AllBlocksCleared never goes on an engine's topic (it would clear its GPU blocks): only on the node's
    answer = _replay(replay, [b"", (0).to_bytes(8, "big")])
    assert (answer[0][0], decode_batch(answer[0][2])[1]) == (f"kv@node:{NODE}@".encode(),
                                                             [{"type": "AllBlocksCleared"}])
    assert not any(e["type"] == "AllBlocksCleared" for m in answer[1:] for e in decode_batch(m[2])[1])


def test_a_publisher_connects_to_a_subscriber_that_binds(start_server, engines):
    port = _free_port()
    sub = Sub(f"tcp://127.0.0.1:{port}", bind=True, wait=False)
    try:
        server = start_server("--capacity", "64MiB", "--kv-events", f"tcp://127.0.0.1:{port}",
                              "--kv-events-connect", "--kv-events-node", NODE)
        sub.wait_connected()
        engines(server.url).store([_advert(0)])
        wait_for(lambda: len(sub.events(f"kv@node:{NODE}@m".encode())) >= 2, 10, what="the store's events")
    finally:
        sub.close()
    assert _stored(sub.events(f"kv@node:{NODE}@m".encode())) == [("AllBlocksCleared", None),
                                                                  ("BlockStored", [1000])]


# ---- replay -------------------------------------------------------------------------------

def test_replay_from_zero_returns_every_buffered_batch_then_the_end_marker(start_server, engines):
    server, pub, replay = _events_server(start_server, "--max-objects", "4")
    sub = Sub(pub)
    try:
        engine = engines(server.url)
        for i in range(5):                            # five STOREs, a batch or two each
            engine.store([_advert(i)])
            wait_for(lambda: sum(e["type"] == "BlockStored" for e in sub.events()) >= i + 1, 10, what=f"store {i}")
        time.sleep(0.2)
    finally:
        sub.close()
    answer = _replay(replay, [b"", (0).to_bytes(8, "big")])
    seqs = [_seq(m[1]) for m in answer]
    assert seqs == list(range(len(seqs))) and len(seqs) >= 6
    assert answer[0][0] == f"kv@node:{NODE}@".encode()
    assert decode_batch(answer[0][2])[1] == [{"type": "AllBlocksCleared"}]
    live = [f for f in sub.frames if _seq(f[1]) > 0]
    assert answer[1:] == live           # the same topics, seqs and payloads
    # from a later seq: only the batches from there on
    later = _replay(replay, [b"", (3).to_bytes(8, "big")])
    assert [_seq(m[1]) for m in later] == list(range(3, len(seqs)))


def test_a_future_or_malformed_replay_request_gets_the_end_marker_alone_and_the_server_goes_on(
        start_server, engines):
    http = _free_port()
    server, pub, replay = _events_server(start_server, "--http-port", str(http))
    engine = engines(server.url)
    engine.store([_advert(0)])
    wait_for(lambda: _metrics(http)["lmshm_kv_events_published"] >= 2, 10, what="two batches")
    # each answered with the end marker alone
    assert _replay(replay, [b"", (1 << 40).to_bytes(8, "big")]) == []     # future
    assert _replay(replay, [b"", END]) == []                              # -1 read as unsigned: future too
    assert _replay(replay, [(0).to_bytes(8, "big")]) == []                # no delimiter frame
    assert _replay(replay, [b"", b"\x00" * 9]) == []                     # not 8 bytes
    assert _replay(replay, [b"", b"", b"", b""]) == []                    # too many frames
    # a frame past the ROUTER's size limit: libzmq closes that connection; nothing comes back
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(replay)
    dealer.send_multipart([b"", b"x" * 4096])
    assert not dealer.poll(500)
    dealer.close()
    ctx.term()
    # the server goes on: the stream, the replay and the data plane answer
    sub = Sub(pub)
    try:
        engine.store([_advert(1)])
        wait_for(lambda: sub.events(), 10, what="a batch after the bad requests")
    finally:
        sub.close()
    answer = _replay(replay, [b"", (0).to_bytes(8, "big")])
    assert [_seq(m[1]) for m in answer] == [0, 1, 2]
    m = _metrics(http)
    assert m["lmshm_kv_events_replay_requests"] == 6 and m["lmshm_kv_events_replay_malformed"] == 3
    assert m["lmshm_kv_events_replay_refused"] == 5 and m["lmshm_kv_events_replay_batches"] == 3
    assert m["lmshm_kv_events_published"] == 3 and m["lmshm_kv_events_index_chunks"] == 2
    assert server.alive


def test_the_loop_applies_the_index_queue_when_idle_with_no_reader(start_server, engines):
    http = _free_port()
    server = start_server("--capacity", "64MiB", "--http-port", str(http))
    engine = engines(server.url)
    engine.store([_advert(i, 1000 + i - 1 if i else None) for i in range(8)])
    time.sleep(0.5)                                  # no KV_EVENTS, no publisher: only the idle loop applies it
    m = _metrics(http)                               # (read before the gauges that apply the queue themselves)
    assert m["lmshm_kv_events_queued"] == 0 and m["lmshm_kv_events_index_chunks"] == 8


def test_replay_keeps_at_most_replay_batches_and_answers_an_older_start_from_its_oldest(start_server, engines):
    http = _free_port()
    server, pub, replay = _events_server(start_server, "--kv-events-replay-batches", "3", "--http-port", str(http))
    sub = Sub(pub)
    try:
        engine = engines(server.url)
        for i in range(5):
            engine.store([_advert(i)])
            wait_for(lambda: len(sub.events()) >= i + 2, 10, what=f"store {i}")
        time.sleep(0.2)
    finally:
        sub.close()
    newest = max(_seq(f[1]) for f in sub.frames)
    answer = _replay(replay, [b"", (0).to_bytes(8, "big")])
    assert [_seq(m[1]) for m in answer] == [newest - 2, newest - 1, newest]
    assert _metrics(http)["lmshm_kv_events_replay_truncated"] == 1


# ---- a slow subscriber, a restart, shutdown ---------------------------------------------

def _settled(http: int, timeout_s: float = 30.0) -> dict[str, float]:
    """The metrics once the index has applied every queued advert and the publisher has sent
    what that made: the index applies a STORE's adverts in bounded steps, so a flood's events go
    out for some time after its last reply. Settled means nothing queued and the bytes sent
    unchanged over three reads 0.1 s apart."""
    deadline, seen = time.monotonic() + timeout_s, []
    while True:
        m = _metrics(http)
        seen = (seen + [(m.get("lmshm_kv_events_queued", 0), m["lmshm_kv_events_published_bytes"])])[-3:]
        if len(seen) == 3 and seen[0][0] == 0 and len(set(seen)) == 1:
            return m
        if time.monotonic() > deadline:
            raise AssertionError(f"the KV event stream did not settle in {timeout_s:.0f} s: {seen}")
        time.sleep(0.1)


def test_a_subscriber_that_never_reads_costs_bounded_memory_and_is_counted_as_drops(start_server, engines):
    http = _free_port()
    server, pub, _ = _events_server(start_server, "--max-objects", "4", "--kv-events-hwm", "4",
                                    "--kv-events-buffer", "1024", "--http-port", str(http), replay=False)
    ctx = zmq.Context()
    stuck = ctx.socket(zmq.SUB)            # subscribes, then never reads: a queue of 1, a 4 KiB socket buffer
    stuck.setsockopt(zmq.LINGER, 0)
    stuck.setsockopt(zmq.RCVHWM, 1)
    stuck.setsockopt(zmq.RCVBUF, 4096)
    stuck.setsockopt(zmq.SUBSCRIBE, b"")
    stuck.connect(pub)
    reader = Sub(pub)
    try:
        engine = engines(server.url, blocks=64)

        def store(k: int) -> None:      # 64 chunks of 1024 engine blocks (9-byte hashes): ~9 KiB per event
            first = [(1 << 40) + ((k * 64 + i) << 10) for i in range(64)]
            engine.store([protocol.Advert(k.to_bytes(4, "big") + bytes([i]) * 28, 0, 16,
                                          list(range(first[i], first[i] + 1024))) for i in range(64)])

        for k in range(20):             # warm up: the pool, the log's ring, the allocator
            store(k)
        _settled(http)                  # the index applies adverts in bounded steps: all of the warm-up's first
        before, sent_before = _rss(server.proc.pid), _metrics(http)["lmshm_kv_events_published_bytes"]
        sent, k = 0.0, 20
        while sent < 64 << 20 and k < 600:      # at least 64 MiB more through the stream
            store(k)
            k += 1
            if k % 10 == 0:
                sent = _metrics(http)["lmshm_kv_events_published_bytes"] - sent_before
        time.sleep(0.5)
        grown = _rss(server.proc.pid) - before
        m = _metrics(http)
        sent = m["lmshm_kv_events_published_bytes"] - sent_before
        # the last batch reaches the subscriber that reads: the stuck one holds nobody up
        engine.store([_advert(999)])
        wait_for(lambda: any(e.get("block_hashes") == [1999] for e in reader.events()), 10,
                 what="the last batch at the reading subscriber")
    finally:
        reader.close()
        stuck.close()
        ctx.term()
    assert sent >= 64 << 20, f"only {sent / 2**20:.1f} MiB published"
    # with --kv-events-hwm 100000 the stuck subscriber's queue holds about all of it; here the
    # log's records the publisher has not read yet (up to twice its bounds while it lags) and
    # the allocator's slack are what grow
    # (CI, beside the other pytest group, saw 18.8 and 27.4 MiB for 72-76 MiB sent); a stuck queue
    # that held it all would grow by what went out
    assert grown < min(40 << 20, sent / 2), \
        f"the server grew {grown / 2**20:.1f} MiB while {sent / 2**20:.1f} MiB went out"
    assert m["lmshm_kv_events_dropped"] >= 1


def test_a_restarted_server_starts_its_stream_with_all_blocks_cleared(start_server, engines):
    port = _free_port()
    server, pub, replay = _events_server(start_server, port=port)
    sub = Sub(pub)
    try:
        engine = engines(server.url)
        engine.store([_advert(0)])
        wait_for(lambda: len(sub.frames) >= 1, 10, what="the first run's batch")
        engine.close()
        assert server.stop() == 0
        first_run = len(sub.frames)
        server, _, replay = _events_server(start_server, port=port)     # the same stream endpoint
        sub.wait_connected()                                     # the SUB reconnects on its own
        engines(server.url).store([_advert(1)])
        topic = f"kv@node:{NODE}@m".encode()
        # the restart's own clear (on kv@node:NODE@) may come first: wait for the model's batch
        wait_for(lambda: any(f[0] == topic for f in sub.frames[first_run:]), 10, what="the second run's batch")
    finally:
        sub.close()
    [(_, seq, payload)] = [f for f in sub.frames[first_run:] if f[0] == topic]
    assert topic == f"kv@node:{NODE}@m".encode() and _seq(seq) == 1      # seq starts over
    assert _stored(decode_batch(payload)[1]) == [("AllBlocksCleared", None), ("BlockStored", [1001])]
    answer = _replay(replay, [b"", (0).to_bytes(8, "big")])
    assert [(m[0], _seq(m[1])) for m in answer] == [(f"kv@node:{NODE}@".encode(), 0), (topic, 1)]


def test_stop_joins_the_publisher_and_closes_its_sockets(tmp):
    def fds() -> set[str]:
        return set(os.listdir("/proc/self/fd"))

    def run() -> None:
        config = ServerConfig(url=f"ipc://{tmp}/s.ipc", fd_socket=str(tmp / "s.fds"), capacity=0,
                              kv_events=f"ipc://{tmp}/events.ipc", kv_events_replay=f"ipc://{tmp}/replay.ipc",
                              kv_events_node=NODE)
        with Server(config) as server:
            assert server.kv_events.endpoint == f"ipc://{tmp}/events.ipc"
            answer = _replay(f"ipc://{tmp}/replay.ipc", [b"", (0).to_bytes(8, "big")])
            assert [(m[0], _seq(m[1])) for m in answer] == [(f"kv@node:{NODE}@".encode(), 0)]
            assert (tmp / "events.ipc").exists() and (tmp / "replay.ipc").exists()

    run()                                   # the first run opens what a process opens once
    before = fds()
    run()
    assert not [t.name for t in threading.enumerate() if t.name == "lmshm-kv-events"]
    assert fds() == before
    assert not (tmp / "events.ipc").exists() and not (tmp / "replay.ipc").exists()


def test_an_ipc_endpoint_in_use_is_refused_and_left_alone(tmp):
    live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    live.bind(str(tmp / "taken.sock"))
    live.listen(1)
    try:
        config = ServerConfig(url=f"ipc://{tmp}/s.ipc", fd_socket=str(tmp / "s.fds"), capacity=0,
                              kv_events=f"ipc://{tmp}/taken.sock")
        server = Server(config)
        with pytest.raises(Unavailable, match=r"KV event endpoint .*taken.sock is in use .*--kv-events\)"):
            server.start()
        assert not server.ready()
        # the live socket is still there, and still accepts
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.connect(str(tmp / "taken.sock"))
        probe.close()
    finally:
        live.close()
        os.unlink(tmp / "taken.sock")


def test_a_busy_kv_event_port_stops_the_server_with_a_message_naming_the_flag(tmp):
    taken = socket.socket()
    taken.bind(("0.0.0.0", 0))
    taken.listen(1)
    try:
        done = subprocess.run([sys.executable, "-m", "lmshm.server", "--url", f"ipc://{tmp}/s.ipc", "--fd-socket",
                               str(tmp / "s.fds"), "--capacity", "0", "--kv-events",
                               f"tcp://*:{taken.getsockname()[1]}"], capture_output=True, text=True, timeout=60)
    finally:
        taken.close()
    assert done.returncode == 1, done.stderr[-2000:]
    assert "cannot bind the KV event endpoint tcp://*:" in done.stderr and "(lmshm-server --kv-events)" in done.stderr


# ---- the publisher on a log of its own (no server) ----------------------------------------

def _stored_event(h: int) -> BlockStored:
    return BlockStored(block_hashes=[h], parent_block_hash=None, token_ids=[], block_size=16, lora_id=None,
                       medium="CPU", lora_name=None, locality="LOCAL")


def test_records_the_log_dropped_unread_are_counted_and_node_topics_start_over(tmp):
    index = KvIndex(records=16)
    index.cleared()
    publisher = KvEventPublisher(index, f"ipc://{tmp}/ev.ipc", node=NODE).start()
    sub = Sub(f"ipc://{tmp}/ev.ipc")
    topic = f"kv@node:{NODE}@m".encode()
    try:
        index.log.append(1, b"S", "m", _stored_event(1))
        wait_for(lambda: sub.events(topic), 10, what="the first batch")
        for h in range(2, 200):          # far more than the ring holds, faster than a poll
            index.log.append(1, b"S", "m", _stored_event(h))
        wait_for(lambda: publisher.lost > 0 and len([f for f in sub.frames if f[0] == topic]) >= 2, 10,
                 what="a batch after the loss")
        time.sleep(0.1)
    finally:
        publisher.stop()
        sub.close()
    batches = [decode_batch(p)[1] for t, _, p in sub.frames if t == topic]
    assert _stored(batches[0]) == [("AllBlocksCleared", None), ("BlockStored", [1])]
    assert {"type": "AllBlocksCleared"} in [e for b in batches[1:] for e in b]      # after the loss
    received = sum(e["type"] == "BlockStored" for b in batches[1:] for e in b)
    assert publisher.lost > 0 and publisher.lost + received == 198
    assert not (tmp / "ev.ipc").exists()


def test_pod_names_no_topic_can_carry_are_not_attached(tmp):
    index = KvIndex()
    publisher = KvEventPublisher(index, f"ipc://{tmp}/ev.ipc", topic="engine", node=NODE).start()
    sub = Sub(f"ipc://{tmp}/ev.ipc")
    try:
        for pod in ("a@b", "node:x", "with space", "pod0"):
            index.log.append(1, b"S", "m", None, pod=pod)
        index.log.append(1, b"S", "m", _stored_event(1))
        index.log.append(1, b"T", "m", None, pod="bad@pod")
        index.log.append(1, b"T", "m", _stored_event(2))     # no engine it can name: the node topic
        wait_for(lambda: len(sub.events()) >= 3, 10, what="the events")
    finally:
        publisher.stop()
        sub.close()
    assert _stored(sub.events(b"kv@pod0@m")) == [("BlockStored", [1])]
    assert _stored(sub.events(f"kv@node:{NODE}@m".encode())) == [("AllBlocksCleared", None), ("BlockStored", [2])]
    assert publisher.pods_refused == 4


# ---- settings -----------------------------------------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["--kv-events", "udp://x:1"], r"--kv-events \(LMSHM_KV_EVENTS.*expected tcp://HOST:PORT"),
    (["--kv-events", "tcp://*"], r"--kv-events .*with a port"),
    (["--kv-events-replay", "tcp://*:5558"], r"--kv-events-replay .*set --kv-events too"),
    (["--kv-events", "tcp://*:5557", "--kv-events-index", "0"], r"--kv-events-index 0 turns the index off"),
    (["--kv-events", "tcp://*:5557", "--kv-events-topic", "pod"], r"--kv-events-topic .*use node or engine"),
    (["--kv-events", "tcp://*:5557", "--kv-events-node", "a@b"], r"--kv-events-node .*no '@'"),
    (["--kv-events-hwm", "0"], r"--kv-events-hwm"),
])
def test_bad_kv_event_settings_are_refused_naming_the_flag(argv, message):
    with pytest.raises(ConfigError, match=message):
        resolve_config(build_arg_parser().parse_args(argv), environ={})


def test_kv_event_settings_read_the_flag_the_environment_and_the_file(tmp):
    (tmp / "c.toml").write_text('kv_events = "tcp://*:6000"\nkv_events_replay_bytes = "1MiB"\n')
    args = build_arg_parser().parse_args(["--config", str(tmp / "c.toml"), "--kv-events-topic", "engine"])
    config = resolve_config(args, environ={"LMSHM_KV_EVENTS_HWM": "7", "LMSHM_KV_EVENTS_BUFFER": "32"})
    assert (config.kv_events, config.kv_events_replay_bytes, config.kv_events_topic, config.kv_events_hwm,
            config.kv_events_buffer) == ("tcp://*:6000", 1 << 20, "engine", 7, 32)
