"""KV events end to end: a real lmshm-server (pool, --disk, a real Valkey as --remote), STOREs
that carry adverts (the engine's block hashes, tokens, LoRA, extra keys) from CPU KV caches
registered in this process, and the events read back with KV_EVENTS, as a connector reads them.

What each test checks is what a router would be told: a ``BlockStored`` when a chunk becomes
servable from a tier (every rank holds it there), a ``BlockRemoved`` when it stops being so, with
vLLM's medium and locality per tier, and nothing for what a peer cannot prove or may not see."""

from __future__ import annotations

import gc
import json
import os
import select
import shutil
import signal
import time
from pathlib import Path
from typing import Any, Optional

import msgspec
import pytest
import torch
from harness import wait_for
from valkey_servers import command, secret_file

from lmshm.core.kv_events import BlockStored, KvIndex, check_advert, packed_tokens
from lmshm.core.kv_events import index as index_module
from lmshm.core.tiers.disk.format import HEADER_BYTES, file_bytes
from lmshm.transport.client import InvalidArgument, MPClient
from lmshm.wire import protocol
from lmshm.wire.protocol import StoreResult

SPACE = b"namespace-S"
BLOCKS = 16                       # blocks of each test registration
LAYERS = 2
BLOCK_SHAPE = (2, 16, 8)          # float32: 1 KiB a block and layer
CHUNK_BYTES = LAYERS * 2 * 16 * 8 * 4
ENGINE_BLOCK = 8                  # the pretend engine's block size, in tokens
NOBODY = 65534


def key(i: int, rank: int = 0) -> bytes:
    return bytes([0xCE, rank, i]) * 6      # 18 bytes


def hashes_of(c: int, n: int = 2) -> list[int]:
    """The engine block hashes of chunk ``c``: ``n`` blocks (signed 64-bit ints, as vLLM's may be)."""
    return [-(c * 1000 + j + 1) for j in range(n)]


def advert(c: int, n: int = 2, **fields: Any) -> protocol.Advert:
    """What chunk ``c`` is to the engine: ``n`` blocks of ``ENGINE_BLOCK`` tokens, its parent the
    last block of chunk ``c - 1``."""
    base = dict(chunk=b"chunk-%d" % c, group=0, block_size=ENGINE_BLOCK, block_hashes=hashes_of(c, n),
                parent_block_hash=hashes_of(c - 1, n)[-1] if c else None,
                token_ids=list(range(c * 100, c * 100 + n * ENGINE_BLOCK)), lora_name=None, extra_keys=None)
    base.update(fields)
    return protocol.Advert(**base)


def summary(events: list) -> list[tuple]:
    """``(type, medium, locality, first block hash)`` of each event (AllBlocksCleared: the type)."""
    return [(type(e).__name__,) if not hasattr(e, "block_hashes") else
            (type(e).__name__, e.medium, e.locality, e.block_hashes[0]) for e in events]


def stored(c: int, medium: str = "CPU", locality: str = "LOCAL") -> tuple:
    return ("BlockStored", medium, locality, hashes_of(c)[0])


def removed(c: int, medium: str = "CPU", locality: str = "LOCAL") -> tuple:
    return ("BlockRemoved", medium, locality, hashes_of(c)[0])


class Engine:
    """A pretend engine in this process: one MPClient, CPU KV caches registered with it (one per
    rank it plays), one block per chunk; ``events`` reads KV_EVENTS with a cursor."""

    def __init__(self, url: str, *, space: bytes = SPACE, pod: str = "pod-a") -> None:
        self.client = MPClient(url, client_name="kv-events-test", timeout_s=10)
        self.space, self.pod = space, pod
        self.iids: list[str] = []
        self.cursor = -1
        self.seen: list = []
        self.epoch = ""

    def register(self, *, world: int = 1, rank: int = 0) -> str:
        kv = {f"layer.{i}": torch.zeros(BLOCKS, *BLOCK_SHAPE) for i in range(LAYERS)}
        iid = self.client.register_kv_caches(kv, model_name="m", world_size=world, rank=rank)
        self.iids.append(iid)
        return iid

    def store(self, iid: str, keys: list[bytes], adverts: Optional[list] = None, blocks: Optional[list[int]] = None):
        blocks = blocks if blocks is not None else [i % BLOCKS for i in range(len(keys))]
        return self.client.store(iid, keys, blocks, 1, adverts=adverts, space=self.space, pod=self.pod)

    def read(self, after: Optional[int] = None, spaces: Optional[list[bytes]] = None) -> protocol.KvEventsReply:
        r = self.client.kv_events(spaces or [self.space], self.cursor if after is None else after)
        if after is None:
            self.cursor = r.cursor
            self.seen += r.events
        self.epoch = r.epoch
        return r

    def until(self, done, what: str, timeout_s: float = 10) -> list:
        """Read until ``done(summary of every event seen)``; the events seen."""
        wait_for(lambda: self.read() is not None and done(summary(self.seen)), timeout_s, 0.02, what)
        return self.seen

    def quiet(self, for_s: float = 0.3) -> list:
        """Read for ``for_s`` more seconds; the summary of every event seen (nothing new is expected)."""
        deadline = time.monotonic() + for_s
        while time.monotonic() < deadline:
            self.read()
            time.sleep(0.02)
        return summary(self.seen)

    def close(self) -> None:
        self.client.close()
        gc.collect()


@pytest.fixture
def engines():
    made: list[Engine] = []

    def make(url: str, **kw: Any) -> Engine:
        e = Engine(url, **kw)
        made.append(e)
        return e
    yield make
    for e in made:
        e.close()


def tiers(e: Engine) -> dict:
    return {t.name: t for t in e.client.status().pool.tiers}


def written_through(e: Engine, tier: str, n: int) -> None:
    """Wait until ``tier`` has taken ``n`` chunks and the pool holds no write-through pin (a
    pinned chunk is never evicted: the next STORE would evict another)."""
    def done() -> bool:
        p = e.client.status().pool
        t = next(t for t in p.tiers if t.name == tier)
        return t.puts + t.drops >= n and p.pinned == 0
    wait_for(done, 20, what=f"{n} write-through(s) to the {tier} tier")


@pytest.fixture
def disk(tmp) -> Path:
    d = tmp / "disk"
    d.mkdir(mode=0o700)
    yield d
    shutil.rmtree(d, ignore_errors=True)


# ---- the pool ------------------------------------------------------------------------------


def test_a_stored_chunk_is_advertised_cpu_local_with_its_engine_fields_and_removed_when_evicted(
        start_server, engines):
    server = start_server("--capacity", "64MiB", "--max-objects", "2")
    e = engines(server.url)
    iid = e.register()
    extra = msgspec.msgpack.encode([["salt-1", ["mm", 3]], None])
    assert e.store(iid, [key(0)], [advert(0, lora_name="lora-a", extra_keys=extra)]).results == [StoreResult.STORED]
    e.until(lambda s: stored(0) in s, "BlockStored for chunk 0")
    first = next(ev for ev in e.seen if isinstance(ev, BlockStored))
    assert first.block_hashes == hashes_of(0) and first.parent_block_hash is None
    assert first.token_ids == list(range(0, 2 * ENGINE_BLOCK)) and first.block_size == ENGINE_BLOCK
    assert (first.medium, first.locality, first.group_idx) == ("CPU", "LOCAL", 0)
    assert first.lora_name == "lora-a" and first.extra_keys == [["salt-1", ["mm", 3]], None]
    e.store(iid, [key(1)], [advert(1)])
    e.until(lambda s: stored(1) in s, "BlockStored for chunk 1")
    assert next(ev for ev in e.seen if ev.block_hashes == hashes_of(1)).parent_block_hash == hashes_of(0)[-1]
    e.store(iid, [key(2)], [advert(2)])                  # --max-objects 2: chunk 0, the oldest, goes
    got = e.until(lambda s: stored(2) in s, "BlockStored for chunk 2")
    assert summary(got) == [stored(0), stored(1), removed(0), stored(2)]     # evicted to make room for it
    gone = got[2]
    assert gone.block_hashes == hashes_of(0) and gone.group_idx == 0
    assert e.quiet() == [stored(0), stored(1), removed(0), stored(2)]


def test_a_chunk_stored_without_an_advert_is_advertised_by_a_later_store_that_finds_it_present(
        start_server, engines):
    server = start_server("--capacity", "64MiB")
    e = engines(server.url)
    iid = e.register()
    assert e.store(iid, [key(0)]).results == [StoreResult.STORED]
    assert e.quiet() == []
    assert e.store(iid, [key(0)], [advert(0)]).results == [StoreResult.PRESENT]
    e.until(lambda s: stored(0) in s, "BlockStored for the present chunk")
    assert e.store(iid, [key(0)], [advert(0)]).results == [StoreResult.PRESENT]   # once, not per STORE
    assert e.quiet() == [stored(0)]


def test_a_tensor_parallel_chunk_is_stored_once_both_ranks_hold_it_and_removed_when_one_rank_loses_it(
        start_server, engines):
    server = start_server("--capacity", "64MiB", "--max-objects", "2")
    e = engines(server.url)
    rank0, rank1 = e.register(world=2, rank=0), e.register(world=2, rank=1)
    e.store(rank0, [key(0, rank=0)], [advert(0)])
    assert e.quiet(0.5) == []                            # one rank of two: not servable yet
    e.store(rank1, [key(0, rank=1)], [advert(0)])       # its own key, the same chunk id
    e.until(lambda s: stored(0) in s, "BlockStored once both ranks stored")
    e.store(rank0, [key(5, rank=0)])                     # --max-objects 2: rank 0's copy goes
    e.until(lambda s: removed(0) in s, "BlockRemoved when rank 0's copy was evicted")
    assert e.quiet() == [stored(0), removed(0)]
    assert e.client.lookup([[key(0, rank=0)], [key(0, rank=1)]]).hits == 0


# ---- the disk tier -------------------------------------------------------------------------


def test_a_chunk_written_through_to_disk_is_advertised_storage_local(start_server, engines, disk):
    server = start_server("--capacity", "64MiB", "--disk", str(disk), "--disk-capacity", "64MiB")
    e = engines(server.url)
    iid = e.register()
    e.store(iid, [key(0), key(1)], [advert(0), advert(1)])
    got = e.until(lambda s: stored(1, "STORAGE") in s and stored(0, "STORAGE") in s, "BlockStored STORAGE")
    assert sorted(summary(got)) == sorted([stored(0), stored(1), stored(0, "STORAGE"), stored(1, "STORAGE")])
    on_disk = [ev for ev in got if ev.medium == "STORAGE"]
    assert all(ev.locality == "LOCAL" and ev.token_ids and ev.block_size == ENGINE_BLOCK for ev in on_disk)


def test_a_store_that_finds_its_chunk_in_the_pool_and_on_disk_advertises_both(start_server, engines, disk):
    server = start_server("--capacity", "64MiB", "--disk", str(disk), "--disk-capacity", "64MiB")
    e = engines(server.url)
    iid = e.register()
    assert e.store(iid, [key(0)]).results == [StoreResult.STORED]        # no advert: nothing to say yet
    written_through(e, "disk", 1)
    assert e.store(iid, [key(0)], [advert(0)]).results == [StoreResult.PRESENT]
    e.until(lambda s: stored(0) in s and stored(0, "STORAGE") in s, "BlockStored CPU and STORAGE")
    assert sorted(e.quiet()) == sorted([stored(0), stored(0, "STORAGE")])


def test_disk_eviction_is_a_storage_removal_and_what_stays_advertised_is_on_disk(start_server, engines, disk):
    capacity = 6 * file_bytes(CHUNK_BYTES)
    server = start_server("--capacity", "64MiB", "--disk", str(disk), "--disk-capacity", str(capacity))
    e = engines(server.url)
    iid = e.register()
    n = 16
    for c in range(n):
        e.store(iid, [key(c)], [advert(c)], blocks=[c])
        written_through(e, "disk", c + 1)
    t = tiers(e)["disk"]
    assert t.evictions > 0
    # the tier's counters move before its events are read out: wait for the last chunk's too
    s = e.until(lambda s: sum(x[0] == "BlockRemoved" for x in s) == t.evictions and stored(n - 1, "STORAGE") in s,
                "a BlockRemoved per eviction and the last chunk's BlockStored on disk")
    s = summary(s)
    assert all(x[1:3] == ("STORAGE", "LOCAL") for x in s if x[0] == "BlockRemoved")   # the pool kept them all
    on_disk = {x[3] for x in s if x[1] == "STORAGE" and x[0] == "BlockStored"} - \
              {x[3] for x in s if x[1] == "STORAGE" and x[0] == "BlockRemoved"}
    files = {p.name for p in disk.rglob("*") if p.is_file() and p.name not in (".lock", ".key")}
    assert on_disk == {hashes_of(c)[0] for c in range(n) if key(c).hex() in files} and len(on_disk) == t.objects


def _evicted_from_the_pool_onto_disk(start_server, engines, disk) -> tuple[Engine, str]:
    """Chunks 0, 1 and 2 stored and on disk; the pool (--max-objects 2) evicted chunk 0."""
    server = start_server("--capacity", "64MiB", "--max-objects", "2", "--disk", str(disk),
                          "--disk-capacity", "64MiB")
    e = engines(server.url)
    iid = e.register()
    for c in range(3):
        e.store(iid, [key(c)], [advert(c)], blocks=[c])
        written_through(e, "disk", c + 1)
    e.until(lambda s: removed(0) in s and stored(2, "STORAGE") in s, "chunk 0 evicted from the pool")
    return e, iid


def test_a_chunk_evicted_from_the_pool_but_on_disk_is_removed_from_cpu_only_and_a_lookup_stores_it_again(
        start_server, engines, disk):
    e, iid = _evicted_from_the_pool_onto_disk(start_server, engines, disk)
    assert [x for x in e.quiet() if x[0] == "BlockRemoved"] == [removed(0)]     # still on disk: STORAGE stays
    found = e.client.lookup([[key(0)]])
    assert found.hits == 1
    e.until(lambda s: s.count(stored(0)) == 2, "BlockStored CPU again after the promotion")
    s = e.quiet()
    assert removed(1) in s                               # the promotion evicted chunk 1 from the pool
    assert not [x for x in s if x[0] == "BlockRemoved" and x[1] == "STORAGE"]
    e.client.retrieve(iid, [key(0)], [9], 1, found.lease)


def test_a_damaged_file_found_on_read_is_a_storage_removal(start_server, engines, disk):
    e, _ = _evicted_from_the_pool_onto_disk(start_server, engines, disk)
    bad = next(p for p in disk.rglob("*") if p.name == key(0).hex())
    raw = bytearray(bad.read_bytes())
    raw[HEADER_BYTES + 100] ^= 0xFF                      # a flipped bit on the medium
    bad.write_bytes(raw)
    assert e.client.lookup([[key(0)]]).hits == 0
    e.until(lambda s: removed(0, "STORAGE") in s, "BlockRemoved STORAGE for the damaged file")
    assert tiers(e)["disk"].corrupt == 1
    assert e.quiet().count(stored(0)) == 1               # never stored again


# ---- the remote tier -----------------------------------------------------------------------


def test_a_remote_chunk_is_storage_remote_and_a_value_gone_from_valkey_is_removed_when_looked_up(
        start_server, engines, valkey, tmp):
    server = start_server("--capacity", "64MiB", "--max-objects", "2", "--remote", valkey.url,
                          "--remote-secret-file", str(secret_file(tmp)), "--remote-timeout", "0.5",
                          "--remote-prefix", "kv:")
    e = engines(server.url)
    iid = e.register()
    for c in range(3):
        e.store(iid, [key(c)], [advert(c)], blocks=[c])
        written_through(e, "remote", c + 1)
    s = summary(e.until(lambda s: removed(0) in s and stored(2, "STORAGE", "REMOTE") in s,
                        "chunk 0 evicted from the pool"))
    assert [x for x in s if x[1] == "STORAGE"] == [stored(c, "STORAGE", "REMOTE") for c in range(3)]
    rkey = b"kv:%08x:" % os.geteuid() + key(0).hex().encode()
    assert command(valkey.port, "DEL", rkey).startswith(b":1")    # gone behind the server's back
    assert e.client.lookup([[key(0)]]).hits == 0
    e.until(lambda s: removed(0, "STORAGE", "REMOTE") in s, "BlockRemoved REMOTE for the missing value")
    assert summary(e.seen).count(removed(0, "STORAGE", "REMOTE")) == 1


def test_a_full_index_forgets_its_oldest_chunk_so_that_silent_remote_evictions_never_stop_new_adverts(
        start_server, engines, valkey, tmp):
    """Valkey evicts without telling anyone: chunks that left the pool stay indexed as remote
    ones until a LOOKUP finds them gone. A full index makes room by forgetting its least
    recently stored chunk, with a removal, rather than leave every new chunk unadvertised."""
    server = start_server("--capacity", "64MiB", "--max-objects", "1", "--kv-events-index", "2", "--remote",
                          valkey.url, "--remote-secret-file", str(secret_file(tmp)), "--remote-timeout", "0.5")
    e = engines(server.url)
    iid = e.register()
    for c in range(2):
        e.store(iid, [key(c)], [advert(c)], blocks=[c])
        written_through(e, "remote", c + 1)
    e.until(lambda s: removed(0) in s and stored(1, "STORAGE", "REMOTE") in s, "chunks 0 and 1 advertised")
    e.store(iid, [key(2)], [advert(2)], blocks=[2])     # the index holds 0 (remote only) and 1
    e.until(lambda s: stored(2) in s, "BlockStored for chunk 2")
    s = e.quiet()
    assert removed(0, "STORAGE", "REMOTE") in s and s.index(removed(0, "STORAGE", "REMOTE")) < s.index(stored(2))
    assert removed(1, "STORAGE", "REMOTE") not in s


# ---- isolation -----------------------------------------------------------------------------


def _as_other_uid(url: str, uid: int, timeout_s: float = 30) -> dict:
    """Fork; the child switches to ``uid`` (root only), stores chunk 7 advertised in ``SPACE``,
    and reads ``SPACE``'s events until its own BlockStored arrives; what it saw, as JSON.

    A fork, not a new interpreter: this one lives where only root may read it. What the child
    needs (torch, zmq, lmshm) is imported already."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:                                         # the child: never returns
        code = 1
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            other = Engine(url)
            iid = other.register()
            other.store(iid, [key(7)], [advert(7)])
            other.until(lambda s: stored(7) in s, "the other uid's own event")
            other.quiet(0.3)
            out = {"summary": summary(other.seen)}
            other.close()
            code = 0
        except BaseException as exc:
            out = {"error": repr(exc)}
        os.write(w, json.dumps(out).encode())
        os._exit(code)
    os.close(w)
    try:
        ready, _, _ = select.select([r], [], [], timeout_s)
        data = os.read(r, 1 << 20) if ready else b""
    finally:
        os.close(r)
        if not data:
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    assert data, "the other uid's process said nothing"
    return json.loads(data)


@pytest.mark.skipif(os.geteuid() != 0, reason="runs a second client as uid nobody: needs root")
def test_a_second_uid_never_reads_the_first_uids_events_in_the_same_namespace(start_server, engines):
    server = start_server("--capacity", "64MiB", "--allow-uid", str(NOBODY))
    os.chmod(os.path.dirname(server.fd_socket), 0o711)
    os.chmod(server.fd_socket, 0o666)
    e = engines(server.url)
    iid = e.register()
    e.store(iid, [key(0)], [advert(0)])
    e.until(lambda s: stored(0) in s, "the first uid's event")
    seen = _as_other_uid(server.url, NOBODY)
    assert "error" not in seen, seen
    assert [tuple(x) for x in seen["summary"]] == [stored(7)]          # its own, never chunk 0
    assert e.quiet() == [stored(0)]                                     # and the first never sees chunk 7


def test_a_reader_of_other_namespaces_gets_nothing(start_server, engines):
    server = start_server("--capacity", "64MiB")
    e = engines(server.url)
    iid = e.register()
    e.store(iid, [key(0)], [advert(0)])
    e.until(lambda s: stored(0) in s, "the event in its own namespace")
    other = engines(server.url, space=b"another")
    assert other.quiet() == []
    r = e.read(after=-1, spaces=[b"another", b"a third"])
    assert r.events == [] and not r.lost


# ---- hostile adverts -----------------------------------------------------------------------


def _nested(depth: int) -> bytes:
    """msgpack of two blocks' extra keys, the first nested ``depth`` lists deep
    (``[[[...[1]...]], None]``)."""
    return b"\x92" + b"\x91" * depth + b"\x01" + b"\xc0"


HOSTILE = {
    "tokens not whole blocks": dict(token_ids=list(range(2 * ENGINE_BLOCK - 1))),
    "extra keys not msgpack": dict(extra_keys=b"\xc1\xc1\xc1"),
    "extra keys a map": dict(extra_keys=msgspec.msgpack.encode([{"a": 1}, None])),
    "extra keys nested 3 deep": dict(extra_keys=msgspec.msgpack.encode([[[[1]]], None])),
    "extra keys nested 5000 deep": dict(extra_keys=_nested(5000)),
    "extra keys not one per block": dict(extra_keys=msgspec.msgpack.encode([None])),
    "extra keys a long list": dict(extra_keys=msgspec.msgpack.encode([list(range(17)), None])),
    "packed tokens not whole blocks": dict(token_ids=[], tokens=packed_tokens(range(2 * ENGINE_BLOCK - 1))),
    "packed tokens not 4 bytes a token": dict(token_ids=[], tokens=packed_tokens(range(2 * ENGINE_BLOCK))[:-2]),
    "tokens both packed and a list": dict(tokens=packed_tokens(range(2 * ENGINE_BLOCK))),
}


def test_hostile_adverts_are_stored_but_never_advertised_and_the_server_keeps_serving(start_server, engines):
    server = start_server("--capacity", "64MiB")
    e = engines(server.url)
    iid = e.register()
    for i, (what, fields) in enumerate(HOSTILE.items()):
        assert e.store(iid, [key(i)], [advert(i, **fields)]).results == [StoreResult.STORED], what
    assert e.quiet() == []
    assert e.client.lookup([[key(i) for i in range(len(HOSTILE))]]).hits == len(HOSTILE)   # stored, all of them
    with pytest.raises(InvalidArgument, match="2 adverts for 1 keys"):
        e.store(iid, [key(20)], [advert(20), advert(21)])
    with pytest.raises(InvalidArgument, match="adverts must be an array"):
        e.client.submit(protocol.Store(iid, [key(20)], [0], 1, adverts=msgspec.Raw(msgspec.msgpack.encode({"a": 1})),
                                       space=e.space, pod=e.pod)).result()
    # past the wire's limits (1024 blocks an advert), or not adverts at all: the adverts are
    # decoded off the request's path, so the chunk is stored and they are refused (not advertised)
    assert e.store(iid, [key(21)], [advert(21, n=1025, token_ids=[])]).results == [StoreResult.STORED]
    garbage = protocol.Store(iid, [key(23)], [1], 1, adverts=msgspec.Raw(msgspec.msgpack.encode([[b"x", "y"]])),
                             space=e.space, pod=e.pod)
    assert e.client.submit(garbage).result().results == [StoreResult.STORED]
    at_limits = advert(22, n=1024, block_size=64, token_ids=[1] * 65536)
    assert e.store(iid, [key(22)], [at_limits]).results == [StoreResult.STORED]
    e.until(lambda s: s == [("BlockStored", "CPU", "LOCAL", hashes_of(22, 1)[0])], "the honest advert at the limits")
    assert len(e.seen[0].block_hashes) == 1024 and len(e.seen[0].token_ids) == 65536
    assert e.client.ping() > 0 and server.alive


def test_check_advert_refuses_each_hostile_advert_in_process():
    """The same cases, through ``check_advert`` alone: each is a ValueError, never anything else."""
    for fields in HOSTILE.values():
        with pytest.raises(ValueError):
            check_advert(advert(0, **fields))
    ok = check_advert(advert(0, extra_keys=msgspec.msgpack.encode([["salt", ["mm", 1]], None])))
    assert list(ok.token_ids) == list(range(16)) and ok.extra_keys == [["salt", ["mm", 1]], None]
    packed = check_advert(advert(0, token_ids=[], tokens=packed_tokens([-(1 << 31), (1 << 31) - 1] * 8)))
    assert packed.token_ids == [-(1 << 31), (1 << 31) - 1] * 8


def test_packed_token_ids_and_a_3_7_clients_list_give_the_same_events(start_server, engines):
    server = start_server("--capacity", "64MiB")
    e = engines(server.url)
    iid = e.register()
    tokens = [5, 150_000, 0, 7] * 4
    e.store(iid, [key(0)], [advert(0, token_ids=[], tokens=packed_tokens(tokens))])
    e.store(iid, [key(1)], [advert(1, token_ids=tokens)])
    e.until(lambda s: len(s) == 2, "both chunks advertised")
    assert [ev.token_ids for ev in e.seen] == [tokens, tokens]


def test_encoded_adverts_are_counted_from_their_header_and_decoded_only_when_applied(monkeypatch):
    """A STORE's adverts arrive and are queued as the request's msgpack bytes: the request's
    path reads their count alone; the index decodes them when it applies its queue, and what
    does not decode, or is not one advert per key, is refused there (never an exception)."""
    two = protocol.pack_adverts([advert(0), advert(1)])
    assert bytes(two) == msgspec.msgpack.encode([advert(0), advert(1)])     # the list's own bytes
    assert [protocol.advert_count(protocol.pack_adverts([advert(0)] * n)) for n in (0, 1, 15, 16, 70_000 // 2)] == \
        [0, 1, 15, 16, 35_000]
    assert protocol.advert_count(protocol.Store("i", [], [], 1).adverts) == 0
    for bad in (msgspec.msgpack.encode({"a": 1}), b"\xdc\x00", b"\xdd\x00\x01\x00\x01", b"\xc0"):
        with pytest.raises(ValueError):
            protocol.advert_count(msgspec.Raw(bad))
    kv = KvIndex(records=64)
    kv.describe(1, SPACE, "m", "", 0, 1, [key(0), key(1)], two, "engine", 2)
    assert kv.queued == 1
    kv.batch_recorder("pool")([(1, key(0)), (1, key(1))])       # a commit of both: one entry
    assert kv.queued == 2 and len(kv) == 2 and kv.leading(hashes_of(0) + hashes_of(1), ["pool"]) == {"pool": 4}
    garbage = msgspec.Raw(msgspec.msgpack.encode([[b"x", "y"]]))
    kv.describe(1, SPACE, "m", "", 0, 1, [key(2)], garbage, "engine", 1)
    kv.describe(1, SPACE, "m", "", 0, 1, [key(3)], protocol.pack_adverts([advert(3), advert(4)]), "engine", 1)
    assert len(kv) == 2 and kv.refused == 2
    # their bytes bound the queue too: past MAX_QUEUED_ADVERT_BYTES, whoever queues applies some
    monkeypatch.setattr(index_module, "MAX_QUEUED_ADVERT_BYTES", 64 << 10)
    big = protocol.pack_adverts([advert(9, token_ids=list(range(2 * ENGINE_BLOCK)), extra_keys=bytes(60_000))])
    for i in range(100):
        kv.describe(1, SPACE, "m", "", 0, 1, [key(10 + i)], big, "engine", 1)
        assert kv._queued_bytes <= (64 << 10) + len(big)
    assert kv.queued < 100 and len(kv) == 2 and kv._queued_bytes == 0 and kv.refused == 102   # not msgpack extra keys


def test_a_pool_commit_reports_its_chunks_in_one_call_and_evictions_one_each():
    from lmshm.core.pool import Pool, Reservation

    pool = Pool(1 << 20)
    seen: list = []
    pool.on_resident = lambda uid, k, present: seen.append(("one", k, present))
    pool.on_committed = lambda pairs: seen.append(("batch", list(pairs)))
    try:
        objs = [pool.reserve(1, key(i), 256 << 10, b"d", 1) for i in range(3)]
        assert [outcome for outcome, _ in objs] == [Reservation.STORED] * 3
        pool.commit([obj for _, obj in objs])
        assert seen == [("batch", [(1, key(0)), (1, key(1)), (1, key(2))])]
        outcome, obj = pool.reserve(1, key(3), 512 << 10, b"d", 1)      # room only once the oldest go
        assert outcome == Reservation.STORED and seen[1:] == [("one", key(0), False), ("one", key(1), False)]
        pool.abort([obj])
    finally:
        pool.release()


def test_the_index_applies_what_it_queued_in_order_when_read_and_bounds_its_queue(monkeypatch):
    kv = KvIndex(records=64)
    kv.describe(1, SPACE, "m", "", 0, 1, [key(0)], [advert(0)])     # a request's adverts: checked when applied
    kv.note(1, key(0), "pool", True)
    kv.note(1, key(0), "pool", False)
    kv.note(1, key(0), "pool", True)                                 # dropped with the chunk: nothing
    assert kv.queued == 4
    records, _, _ = kv.log.read(-1, 100, uid=1)                      # a reader applies the queue first
    assert kv.queued == 0
    assert [type(r.event).__name__ for r in records] == ["BlockStored", "BlockRemoved"] and len(kv) == 0
    kv.describe(1, SPACE, "m", "", 0, 1, [key(1)], [advert(1, extra_keys=b"\xc1")])
    assert kv.refused == 0 and len(kv) == 0 and kv.refused == 1     # refused once applied (len drains)
    monkeypatch.setattr(index_module, "MAX_QUEUED", 100)
    kv.describe(1, SPACE, "m", "", 0, 1, [key(2)], [advert(2)])
    for _ in range(1000):                                            # past the bound, the caller applies some
        kv.note(1, key(2), "pool", True)
    assert kv.queued <= 101 and kv.leading(hashes_of(2), ["pool"]) == {"pool": 2}


def test_a_bounded_read_applies_that_many_entries_and_the_next_read_the_rest():
    kv = KvIndex(records=4096)
    for c in range(100):
        kv.describe(1, SPACE, "m", "", 0, 1, [key(c)], [advert(c)])
        kv.note(1, key(c), "pool", True)
    records, cursor, _ = kv.log.read(-1, 4096, apply=50)            # KV_EVENTS: server.KV_EVENTS_APPLY
    assert kv.queued == 150 and len(records) == 25
    records, _, _ = kv.log.read(cursor, 4096)
    assert kv.queued == 0 and [list(r.event.block_hashes) for r in records] == [hashes_of(c) for c in range(25, 100)]


def test_a_kv_events_read_applies_nothing_while_requests_keep_the_loop_busy_unless_the_backlog_is_long():
    """The rule a KV_EVENTS read follows on the loop (``ZmqEndpoint._kv_events_apply``): a read
    that came between two STOREs of a burst applied 256 entries and the next STORE waited for
    them; now it applies none while a request came within IDLE_QUIET_S or a copy or promotion
    runs, unless IDLE_BACKLOG entries are queued (then the backlog is worked off as before)."""
    import types

    from lmshm.endpoints.zmq import endpoint as server
    apply = server.ZmqEndpoint._kv_events_apply
    busy = {"now": False}
    loop = types.SimpleNamespace(_active_at=0.0, dataplane=types.SimpleNamespace(busy=lambda: busy["now"]))
    assert apply(loop, 10) == server.KV_EVENTS_APPLY                 # idle: apply, as every reader does
    loop._active_at = time.monotonic()
    assert apply(loop, 10) == 0                                       # a STORE just came
    assert apply(loop, server.IDLE_BACKLOG) == server.KV_EVENTS_APPLY
    loop._active_at = time.monotonic() - 2 * server.IDLE_QUIET_S
    busy["now"] = True
    assert apply(loop, 10) == 0                                       # a copy runs: its reply waits for the loop
    busy["now"] = False
    assert apply(loop, 10) == server.KV_EVENTS_APPLY


def test_the_index_and_the_log_add_nothing_for_the_cyclic_gc_to_walk():
    """Every object the cyclic GC tracks is walked by each full collection, with every thread
    of the server held: the index's chunks were 7 tracked objects each (a full default index:
    466 ms a collection) and the log's events 1 each. Chunks, tuples of atoms and dicts of
    atoms are not tracked, nor are events of tuples."""
    kv = KvIndex(max_chunks=1 << 16, records=1 << 14)
    n = 8000
    extra = msgspec.msgpack.encode([["adapter"], ["adapter"]])
    gc.collect()
    before = len(gc.get_objects())
    for c in range(n):
        k0, k1 = b"gc-%d-0" % c, b"gc-%d-1" % c
        kv.describe(1, SPACE, "m", "pod", 0, 2, [k0], [advert(c) if c % 100 else advert(c, lora_name="adapter", extra_keys=extra)])
        kv.describe(1, SPACE, "m", "pod", 1, 2, [k1], [advert(c)])        # a TP world of 2
        for k in (k0, k1):
            kv.note(1, k, "pool", True)
        kv.note(1, k0, "disk", True)
        if c % 3 == 0:
            kv.note(1, k1, "pool", False)                                  # servable from the pool no more
    kv.drain()
    # twice: a tuple the GC caught half built (its items not set yet) stays tracked one
    # collection longer, and so does the tuple holding it (a chunk's token keys)
    gc.collect()
    gc.collect()
    grown = len(gc.get_objects()) - before
    assert len(kv) == n and kv.log.last >= n
    assert grown < n // 20, f"{grown} more objects tracked by the GC for {n} chunks indexed"
    assert kv.leading(hashes_of(1), ["pool", "disk"]) == {"pool": 2, "disk": 0}
    assert kv.leading(hashes_of(3), ["pool"]) == {"pool": 0}


def test_a_lookup_by_tokens_follows_chunks_described_in_any_order():
    kv = KvIndex()
    for c in (2, 0, 1):                                              # the child first, its parent last
        kv.describe(1, SPACE, "m", "", 0, 1, [key(c)], [advert(c)])
        kv.note(1, key(c), "pool", True)
    tokens = [t for c in range(3) for t in range(c * 100, c * 100 + 2 * ENGINE_BLOCK)]
    assert kv.hashes_of_tokens(tokens, ENGINE_BLOCK) == hashes_of(0) + hashes_of(1) + hashes_of(2)
    assert kv.hashes_of_tokens(tokens[:ENGINE_BLOCK] + [1 << 40] * ENGINE_BLOCK, ENGINE_BLOCK) == hashes_of(0)[:1]
    kv.note(1, key(1), "pool", False)                                # chunk 1 gone: the walk stops before it
    assert kv.hashes_of_tokens(tokens, ENGINE_BLOCK) == hashes_of(0)


def test_the_index_keeps_at_most_kv_events_index_chunks_and_zero_turns_events_off(start_server, engines):
    capped = start_server("--capacity", "64MiB", "--kv-events-index", "2")
    e = engines(capped.url)
    iid = e.register()
    e.store(iid, [key(c) for c in range(4)], [advert(c) for c in range(4)])
    e.until(lambda s: len(s) == 2, "two BlockStored")
    assert e.quiet() == [stored(2), stored(3)]           # 0 and 1 made room before they were stored
    e.store(iid, [key(4)], [advert(4)])
    e.until(lambda s: stored(4) in s, "BlockStored for chunk 4")
    assert e.quiet() == [stored(2), stored(3), removed(2), stored(4)]   # the oldest, forgotten: removed
    off = start_server("--capacity", "64MiB", "--kv-events-index", "0", fd_socket=str(capped.tmp / "off.sock"))
    f = engines(off.url)
    iid = f.register()
    assert f.store(iid, [key(0)], [advert(0)]).results == [StoreResult.STORED]
    assert f.quiet() == []


# ---- the log -------------------------------------------------------------------------------


def test_a_cursor_reads_only_newer_events_and_a_future_cursor_reads_nothing(start_server, engines):
    server = start_server("--capacity", "64MiB")
    e = engines(server.url)
    iid = e.register()
    e.store(iid, [key(0)], [advert(0)])
    e.until(lambda s: s == [stored(0)], "the first event")
    cursor = e.cursor
    e.store(iid, [key(1)], [advert(1)])
    wait_for(lambda: e.read(after=cursor).events, 10, what="the second event")
    assert summary(e.read(after=cursor).events) == [stored(1)]
    assert summary(e.read(after=-1).events) == [stored(0), stored(1)]
    future = e.read(after=1 << 40)
    assert future.events == [] and not future.lost and future.cursor <= e.read(after=-1).cursor


def test_a_reader_behind_the_ring_is_told_it_lost_events(start_server, engines):
    server = start_server("--capacity", "64MiB", "--kv-events-buffer", "16")
    e = engines(server.url)
    iid = e.register()
    e.store(iid, [key(0)], [advert(0)])
    e.until(lambda s: s == [stored(0)], "the first event")
    behind = e.cursor
    e.store(iid, [key(c) for c in range(1, 21)], [advert(c) for c in range(1, 21)])
    wait_for(lambda: stored(20) in summary(e.read(after=-1).events), 10, what="the last event")
    late = e.read(after=behind)
    assert late.lost and late.events and summary(late.events)[-1] == stored(20)
    assert len(e.read(after=-1).events) <= 16 and not e.read(after=-1).lost
    assert not e.read(after=late.cursor).lost


def test_a_restarted_server_has_a_new_epoch_and_none_of_the_old_events(start_server, engines):
    first = start_server("--capacity", "64MiB")
    e = engines(first.url)
    iid = e.register()
    e.store(iid, [key(0)], [advert(0)])
    e.until(lambda s: s == [stored(0)], "the first event")
    old_epoch = e.epoch
    assert old_epoch
    assert first.stop() == 0
    start_server("--capacity", "64MiB", url=first.url)
    r = e.read(after=-1)                                 # the client says HELLO again, on its own
    assert r.epoch and r.epoch != old_epoch and r.events == []
    assert e.store(iid, [key(0)], [advert(0)]).results == [StoreResult.STORED]   # re-registered, stored anew
    wait_for(lambda: summary(e.read(after=-1).events) == [stored(0)], 10, what="the event after the restart")


# ---- the index in process: what the server's flags cannot reach ----------------------------


def test_the_index_forgets_a_chunk_held_nowhere_and_a_full_one_its_least_recently_stored():
    kv = KvIndex(max_chunks=2, records=64)
    checked = [check_advert(advert(c)) for c in range(4)]
    kv.describe(1, SPACE, "m", "pod", 0, 1, [key(c) for c in range(2)], checked[:2])
    kv.note(1, key(0), "pool", True)
    kv.note(1, key(0), "disk", True)
    kv.note(1, key(0), "pool", False)                    # still on disk: indexed, still servable there
    assert len(kv) == 2 and kv.leading(hashes_of(0), ["pool", "disk"]) == {"pool": 0, "disk": 2}
    kv.note(1, key(1), "pool", True)                     # chunk 1 is now the more recently stored
    kv.note(1, key(0), "disk", False)                    # held nowhere: forgotten, room for another
    assert len(kv) == 1
    kv.note(1, key(0), "disk", True)                     # no longer indexed: nothing happens
    kv.describe(1, SPACE, "m", "pod", 0, 1, [key(2), key(3)], checked[2:])   # full: chunk 1 goes
    assert len(kv) == 2 and kv.unindexed == 1 and kv.leading(hashes_of(1), ["pool"]) == {"pool": 0}
    records, _, _ = kv.log.read(-1, 100, uid=1)
    assert [(type(r.event).__name__, r.event.medium, r.event.block_hashes[0]) if r.event else "attach"
            for r in records] == ["attach", ("BlockStored", "CPU", hashes_of(0)[0]),
                                  ("BlockStored", "STORAGE", hashes_of(0)[0]), ("BlockRemoved", "CPU", hashes_of(0)[0]),
                                  ("BlockStored", "CPU", hashes_of(1)[0]), ("BlockRemoved", "STORAGE", hashes_of(0)[0]),
                                  ("BlockRemoved", "CPU", hashes_of(1)[0])]
