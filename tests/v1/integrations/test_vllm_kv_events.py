"""KV events on a real vLLM engine's own stream (``--kv-events-config``), from LmshmConnector.

Two engines share one lmshm-server whose pool holds 24 objects. Engine A stores a 700-token
prompt (21 chunks) and a 250-token one (7 chunks): the pool evicts A's 4 oldest chunks. We
subscribe to both engines' vLLM event streams (ZMQ SUB) and decode every payload twice: with
vLLM's own ``KVEventBatch`` decoder (in .venv-vllm) and with lmshm's ``decode_batch``.
"""

from __future__ import annotations

import json
import socket
import subprocess
import threading

import msgspec
import pytest
import zmq
from harness import ServerProcess
from vllm_harness import CHUNK, VLLM_PYTHON, Engine, prompts

from lmshm.core.kv_events import decode_batch

pytestmark = pytest.mark.vllm

_DECODE_WITH_VLLM = r"""
import json, sys, msgspec
from vllm.distributed.kv_events import KVEventBatch, BlockStored, BlockRemoved, AllBlocksCleared
frames = msgspec.msgpack.decode(open(sys.argv[1], "rb").read())
dec = msgspec.msgpack.Decoder(KVEventBatch)
out = []
for topic, seq, payload in frames:
    batch = dec.decode(payload)
    for e in batch.events:
        d = {"type": type(e).__name__}
        if isinstance(e, (BlockStored, BlockRemoved)):
            d.update(hashes=[h.hex() if isinstance(h, bytes) else h for h in e.block_hashes], medium=e.medium,
                     locality=e.locality, group=e.group_idx)
        if isinstance(e, BlockStored):
            d.update(parent=e.parent_block_hash.hex() if isinstance(e.parent_block_hash, bytes) else e.parent_block_hash,
                     tokens=e.token_ids, block_size=e.block_size)
        out.append(d)
print(json.dumps(out))
"""


class Subscriber:
    """A ZMQ SUB on an engine's KV-event stream, collecting ``[topic, seq, payload]`` frames."""

    def __init__(self, port: int) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(f"tcp://127.0.0.1:{port}")
        self.frames: list[list[bytes]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.sock.poll(50):
                self.frames.append(self.sock.recv_multipart())

    def close(self) -> list[list[bytes]]:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()
        self.ctx.term()
        return self.frames


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _decode_with_vllm(frames: list[list[bytes]], tmp) -> list[dict]:
    path = tmp / f"frames-{len(frames)}-{id(frames)}.msgpack"
    path.write_bytes(msgspec.msgpack.encode(frames))
    out = subprocess.run([str(VLLM_PYTHON), "-c", _DECODE_WITH_VLLM, str(path)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def _decode_with_lmshm(frames: list[list[bytes]]) -> list[dict]:
    events = []
    for _topic, seq, payload in frames:
        assert len(seq) == 8
        events.extend(decode_batch(payload)[1])
    return events


def _mine(events: list[dict]) -> list[dict]:
    """lmshm's events: medium CPU or STORAGE (vLLM's own GPU events are off: no prefix caching)."""
    return [e for e in events if e.get("medium") in ("CPU", "STORAGE")]


def test_lmshm_blocks_appear_on_each_engines_stream_are_removed_on_eviction_and_credit_the_other_engine(model, tmp,
                                                                                                        sockets):
    server = ServerProcess(sockets, "--capacity", "256MiB", "--max-objects", "24", "--reap-timeout", "5")
    try:
        p = prompts()
        port_a, port_b = _free_port(), _free_port()
        sub_a, sub_b = Subscriber(port_a), Subscriber(port_b)
        a = Engine(model, server.url, tmp, [p["long"], p["other"]], name="A",
                   extra=("--kv-events", f"tcp://*:{port_a}", "--kv-events-topic", "kv@pod-a@tiny"))
        a.results()
        b = Engine(model, server.url, tmp, [p["other"]], name="B",
                   extra=("--kv-events", f"tcp://*:{port_b}", "--kv-events-topic", "kv@pod-b@tiny"))
        b.results()
        frames_a, frames_b = sub_a.close(), sub_b.close()
    finally:
        assert server.stop() == 0, server.log()

    assert frames_a and frames_b, "no KV events reached the subscribers"
    assert {f[0] for f in frames_a} == {b"kv@pod-a@tiny"}
    for frames in (frames_a, frames_b):
        seqs = [int.from_bytes(f[1], "big") for f in frames]
        assert seqs == sorted(seqs)
    ev_a = _mine(_decode_with_vllm(frames_a, tmp))
    assert ev_a == _normalise(_mine(_decode_with_lmshm(frames_a))), "vLLM's decoder and lmshm's disagree"

    stored = [e for e in ev_a if e["type"] == "BlockStored"]
    removed = [e for e in ev_a if e["type"] == "BlockRemoved"]
    long_chunks, other_chunks = len(p["long"]) // CHUNK, len(p["other"]) // CHUNK
    # every chunk A stored is advertised once, from the pool: medium CPU, locality LOCAL, with its tokens
    assert len(stored) == long_chunks + other_chunks, [e["tokens"][:3] for e in stored]
    assert all(e["medium"] == "CPU" and e["locality"] == "LOCAL" and e["group"] == 0 for e in stored)
    assert all(len(e["hashes"]) == 1 and e["block_size"] == CHUNK for e in stored)
    tokens = [t for e in stored[:long_chunks] for t in e["tokens"]]
    assert tokens == p["long"][:long_chunks * CHUNK]
    # the engine's own chained hashes: each chunk's parent is the one before it
    assert stored[0]["parent"] is None
    assert all(stored[i]["parent"] == stored[i - 1]["hashes"][-1] for i in range(1, long_chunks))
    # the 4 oldest chunks were evicted when the second prompt's 7 arrived (24 objects)
    assert [h for e in removed for h in e["hashes"]] == [h for e in stored[:4] for h in e["hashes"]]
    assert all(e["medium"] == "CPU" and e["locality"] == "LOCAL" for e in removed)

    # engine B stored nothing new (A had stored its prompt): it is credited with what A stored
    ev_b = _mine(_decode_with_vllm(frames_b, tmp))
    held_b: set[str] = set()
    for e in ev_b:
        (held_b.update if e["type"] == "BlockStored" else held_b.difference_update)(e["hashes"])
    held_a: set[str] = set()
    for e in ev_a:
        (held_a.update if e["type"] == "BlockStored" else held_a.difference_update)(e["hashes"])
    assert held_b == held_a and len(held_a) == long_chunks + other_chunks - 4


def _normalise(events: list[dict]) -> list[dict]:
    """lmshm's decode in the shape of the vLLM-decoded summary."""
    out = []
    for e in events:
        d = {"type": e["type"], "hashes": [h.hex() if isinstance(h, bytes) else h for h in e["block_hashes"]],
             "medium": e.get("medium"), "locality": e.get("locality"), "group": e.get("group_idx")}
        if e["type"] == "BlockStored":
            parent = e.get("parent_block_hash")
            d.update(parent=parent.hex() if isinstance(parent, bytes) else parent, tokens=e["token_ids"],
                     block_size=e["block_size"])
        out.append(d)
    return out


def _lookup(port: int, **body) -> int:
    import urllib.request
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/kv/lookup", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())["leading_blocks"]


def test_a_lookup_by_tokens_finds_a_salted_prompt_only_under_its_cache_salt(model, tmp, sockets):
    """A real engine stores one prompt under ``cache_salt`` "alice" and one without: the
    connector's adverts carry vLLM's own extra keys, and the server's lookup by tokens counts
    each prompt's chunks under its own salt and none under another or none."""
    http = _free_port()
    server = ServerProcess(sockets, "--capacity", "256MiB", "--http-port", str(http))
    try:
        p = prompts()
        events = _free_port()
        Engine(model, server.url, tmp, [{"tokens": p["long"], "cache_salt": "alice"}, {"tokens": p["other"]}],
               name="A", extra=("--kv-events", f"tcp://*:{events}")).results()
        long_chunks, other_chunks = len(p["long"]) // CHUNK, len(p["other"]) // CHUNK
        salted = dict(token_ids=p["long"], block_size=CHUNK)
        plain = dict(token_ids=p["other"], block_size=CHUNK)
        assert _lookup(http, **salted, cache_salt="alice") == long_chunks
        assert _lookup(http, **salted) == 0
        assert _lookup(http, **salted, cache_salt="bob") == 0
        assert _lookup(http, **salted, cache_salt="alice", lora_name="x") == 0
        assert _lookup(http, **plain) == other_chunks
        assert _lookup(http, **plain, cache_salt="alice") == 0
    finally:
        assert server.stop() == 0, server.log()
