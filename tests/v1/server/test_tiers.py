"""The disk tier end to end: a real lmshm-server with --disk in a temp directory, workers in
their own processes, real shared memory and real files. Every check compares the bytes the
workers see, or what the server reports in STATUS."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from harness import wait_for

from lmshm.core.pool import cost_of
from lmshm.core.tiers.disk.format import HEADER_BYTES, PAGE, file_bytes
from lmshm.wire.protocol import StoreResult

CHUNK_BYTES = 2 * 2 * 16 * 8 * 4      # two layers of [2, 16, 8] float32, one block per chunk


def key(i: int) -> str:
    return bytes([0xD0, i]).hex() * 8   # 16 bytes


def tier(w) -> dict:
    return w.ok("pool")["pool"]["tiers"][0]


def disk_files(d: Path) -> list[Path]:
    return [p for p in d.rglob("*") if p.is_file() and p.name not in (".lock", ".key")]


@pytest.fixture
def disk(tmp) -> Path:
    d = tmp / "disk"
    d.mkdir(mode=0o700)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def store_each(w, iid: str, keys: list[str], blocks: list[int]) -> None:
    for k, b in zip(keys, blocks):
        assert w.ok("store", instance_id=iid, keys=[k], blocks=[b], chunk_blocks=1)["results"] == [StoreResult.STORED]


def test_a_restarted_server_finds_on_disk_what_it_stored_before(start_server, start_worker, disk):
    args = ("--disk", str(disk), "--disk-capacity", "64MiB")
    first = start_server(*args)
    a = start_worker(first.url)
    ia = a.ok("register_kv")["instance_id"]
    a.ok("fill_blocks", instance_id=ia, blocks=[2, 3, 4], seed=3)
    want = a.ok("digest_blocks", instance_id=ia, blocks=[2, 3, 4])["digests"]
    a.ok("store", instance_id=ia, keys=[key(0), key(1), key(2)], blocks=[2, 3, 4], chunk_blocks=1)
    wait_for(lambda: tier(a)["puts"] == 3, timeout_s=10)
    assert len(disk_files(disk)) == 3
    assert all(p.stat().st_size == HEADER_BYTES + CHUNK_BYTES for p in disk_files(disk))
    a.exit()
    assert first.stop() == 0

    second = start_server(*args)
    b = start_worker(second.url)
    ib = b.ok("register_kv")["instance_id"]
    t = tier(b)
    assert (t["objects"], t["used"]) == (3, 3 * file_bytes(CHUNK_BYTES))
    found = b.ok("lookup", keys=[[key(0), key(1), key(2), key(3)]])
    assert found["hits"] == 3
    p = b.ok("pool")["pool"]
    assert p["objects"] == 3 and p["pinned"] == 3 and p["tiers"][0]["promotions"] == 3
    b.ok("retrieve", instance_id=ib, keys=[key(0), key(1), key(2)], blocks=[9, 10, 11], chunk_blocks=1,
         lease=found["lease"])
    assert b.ok("digest_blocks", instance_id=ib, blocks=[9, 10, 11])["digests"] == want
    status = subprocess.run([sys.executable, "-m", "lmshm.cli", "status", "--url", second.url], capture_output=True,
                            text=True, timeout=30, env={**os.environ})
    assert status.returncode == 0, status.stderr
    assert "disk: " in status.stdout and "3 promoted" in status.stdout


def test_page_sized_chunks_are_written_with_o_direct_from_the_pool_and_others_through_the_cache(
        start_server, start_worker, disk):
    server = start_server("--disk", str(disk), "--disk-capacity", "64MiB")
    a = start_worker(server.url)
    big = a.ok("register_kv", instance_id="pages", shape=[2, 16, 32])["instance_id"]   # 4 KiB a block and layer
    small = a.ok("register_kv", instance_id="small")["instance_id"]                     # 1 KiB: not whole pages
    a.ok("fill_blocks", instance_id=big, blocks=[1, 2], seed=5)
    want = a.ok("digest_blocks", instance_id=big, blocks=[1, 2])["digests"]
    store_each(a, big, [key(0), key(1)], [1, 2])
    store_each(a, small, [key(2)], [3])
    wait_for(lambda: tier(a)["puts"] == 3, timeout_s=10)
    assert tier(a)["direct_writes"] == 2, tier(a)
    for p in disk_files(disk):                           # header, then the chunk at 4096, nothing else
        assert p.stat().st_size in (HEADER_BYTES + 2 * 4 * 16 * 32 * 2, HEADER_BYTES + CHUNK_BYTES)
    a.exit()
    assert server.stop() == 0
    again = start_server("--disk", str(disk), "--disk-capacity", "64MiB")
    b = start_worker(again.url)
    ib = b.ok("register_kv", instance_id="pages", shape=[2, 16, 32])["instance_id"]
    found = b.ok("lookup", keys=[[key(0), key(1)]])
    assert found["hits"] == 2
    b.ok("retrieve", instance_id=ib, keys=[key(0), key(1)], blocks=[7, 8], chunk_blocks=1, lease=found["lease"])
    assert b.ok("digest_blocks", instance_id=ib, blocks=[7, 8])["digests"] == want


@pytest.mark.parametrize("damage", ["payload", "torn"])
def test_a_damaged_file_is_a_miss_is_deleted_and_what_is_served_stays_right(start_server, start_worker, disk,
                                                                           damage):
    args = ("--disk", str(disk), "--disk-capacity", "64MiB")
    first = start_server(*args)
    a = start_worker(first.url)
    ia = a.ok("register_kv")["instance_id"]
    a.ok("fill_blocks", instance_id=ia, blocks=[0, 1], seed=5)
    want = a.ok("digest_blocks", instance_id=ia, blocks=[0])["digests"]
    a.ok("store", instance_id=ia, keys=[key(0), key(1)], blocks=[0, 1], chunk_blocks=1)
    wait_for(lambda: tier(a)["puts"] == 2, timeout_s=10)
    a.exit()
    assert first.stop() == 0
    bad = next(p for p in disk_files(disk) if p.name == bytes.fromhex(key(1)).hex())
    raw = bytearray(bad.read_bytes())
    if damage == "payload":
        raw[HEADER_BYTES + 100] ^= 0xFF                  # a flipped bit on the medium
    else:
        raw = raw[:HEADER_BYTES + CHUNK_BYTES // 2]      # a torn write (what rename prevents)
    bad.write_bytes(raw)

    second = start_server(*args)
    b = start_worker(second.url)
    ib = b.ok("register_kv")["instance_id"]
    found = b.ok("lookup", keys=[[key(0), key(1)]])
    assert found["hits"] == 1 and not bad.exists()
    t = tier(b)
    assert t["corrupt"] == 1 and t["objects"] == 1
    b.ok("retrieve", instance_id=ib, keys=[key(0)], blocks=[5], chunk_blocks=1, lease=found["lease"])
    assert b.ok("digest_blocks", instance_id=ib, blocks=[5])["digests"] == want
    refused = b.call("retrieve", instance_id=ib, keys=[key(0), key(1)], blocks=[6, 7], chunk_blocks=1)
    assert not refused["ok"]                              # never a partial result


def test_lookup_promotes_evicted_chunks_and_pins_them_before_it_answers(start_server, start_worker, disk):
    server = start_server("--disk", str(disk), "--disk-capacity", "64MiB",
                          "--capacity", str(3 * cost_of(CHUNK_BYTES, align=PAGE)), "--max-pinned-fraction-per-uid", "1")
    a = start_worker(server.url)
    ia = a.ok("register_kv")["instance_id"]
    a.ok("fill_blocks", instance_id=ia, blocks=list(range(6)), seed=7)
    want = a.ok("digest_blocks", instance_id=ia, blocks=[0, 1, 2])["digests"]
    for i in range(6):                                    # the pool holds 3: the first 3 are evicted
        store_each(a, ia, [key(i)], [i])
        wait_for(lambda: tier(a)["puts"] == i + 1, timeout_s=10)
    p = a.ok("pool")["pool"]
    assert p["objects"] == 3 and p["evictions"] == 3
    found = a.ok("lookup", keys=[[key(0), key(1), key(2)]])
    assert found["hits"] == 3
    p = a.ok("pool")["pool"]
    assert p["pinned"] == 3 and p["leases"] == 1 and p["tiers"][0]["promotions"] == 3
    # pinned: a STORE cannot evict them, so it finds no room
    assert a.ok("store", instance_id=ia, keys=[key(9)], blocks=[9], chunk_blocks=1)["results"] == [StoreResult.NO_SPACE]
    a.ok("retrieve", instance_id=ia, keys=[key(0), key(1), key(2)], blocks=[12, 13, 14], chunk_blocks=1,
         lease=found["lease"])
    assert a.ok("digest_blocks", instance_id=ia, blocks=[12, 13, 14])["digests"] == want
    assert a.ok("pool")["pool"]["pinned"] == 0


def test_disk_usage_stays_within_its_capacity_under_3x_overfill(start_server, start_worker, disk):
    capacity = 12 * file_bytes(CHUNK_BYTES)
    server = start_server("--disk", str(disk), "--disk-capacity", str(capacity))
    a = start_worker(server.url)
    ia = a.ok("register_kv")["instance_id"]
    n = 3 * 12
    for i in range(n):
        a.ok("store", instance_id=ia, keys=[key(i)], blocks=[i % 16], chunk_blocks=1)
    wait_for(lambda: tier(a)["puts"] + tier(a)["drops"] == n, timeout_s=20)
    t = tier(a)
    assert t["used"] <= capacity and t["evictions"] > 0 and t["errors"] == 0
    assert sum(p.stat().st_size for p in disk_files(disk)) <= capacity
    assert len(disk_files(disk)) == t["objects"]


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="mounts a tiny tmpfs in a private mount namespace: needs root and unshare")
def test_a_full_disk_drops_writes_and_stores_still_succeed(start_server, start_worker, disk):
    mount = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
             'mount -t tmpfs -o size=128k,mode=0700 tmpfs "$0" && exec "$@"', str(disk)]
    server = start_server("--disk", str(disk), "--disk-capacity", "64MiB", prefix=mount)
    a = start_worker(server.url)
    ia = a.ok("register_kv")["instance_id"]
    n = 32                                               # 32 files of 8 KiB: twice what 128 KiB holds
    for i in range(n):
        assert a.ok("store", instance_id=ia, keys=[key(i)], blocks=[i % 16],
                    chunk_blocks=1)["results"] == [StoreResult.STORED]
    wait_for(lambda: tier(a)["puts"] + tier(a)["drops"] == n, timeout_s=20)
    t = tier(a)
    assert t["drops"] > 0 and t["puts"] > 0 and t["errors"] == 0
    assert a.ok("lookup", keys=[[key(i) for i in range(n)]])["hits"] == n    # the pool has them all
    assert server.alive


def test_a_second_server_on_the_same_directory_is_refused_at_start(start_server, disk, tmp):
    start_server("--disk", str(disk), "--disk-capacity", "1MiB")
    with pytest.raises(RuntimeError, match="in use by another lmshm-server"):
        start_server("--disk", str(disk), "--disk-capacity", "1MiB", fd_socket=str(tmp / "second.sock"))


def test_with_disk_admit_second_only_chunks_stored_again_reach_the_disk(start_server, start_worker, disk):
    """--disk-admit second: a first STORE is not written to disk (counted); once the pool lost the
    chunk and it is stored again, it is, and a restarted server finds it there and only it."""
    args = ("--disk", str(disk), "--disk-capacity", "64MiB", "--disk-admit", "second")
    server = start_server(*args, "--capacity", str(2 * cost_of(CHUNK_BYTES, align=PAGE)))
    a = start_worker(server.url)
    ia = a.ok("register_kv")["instance_id"]
    a.ok("fill_blocks", instance_id=ia, blocks=[0, 1, 2, 3], seed=11)
    want = a.ok("digest_blocks", instance_id=ia, blocks=[0, 1])["digests"]
    store_each(a, ia, [key(0), key(1), key(2), key(3)], [0, 1, 2, 3])    # the pool keeps 2: 0 and 1 evicted
    t = tier(a)
    assert (t["not_admitted"], t["puts"], t["drops"]) == (4, 0, 0), t
    assert disk_files(disk) == []
    store_each(a, ia, [key(0), key(1)], [0, 1])                          # computed again: written now
    wait_for(lambda: tier(a)["puts"] == 2, timeout_s=10)
    assert tier(a)["not_admitted"] == 4 and len(disk_files(disk)) == 2
    status = subprocess.run([sys.executable, "-m", "lmshm.cli", "status", "--url", server.url], capture_output=True,
                            text=True, timeout=30, env={**os.environ})
    assert "4 not admitted" in status.stdout, status.stdout
    a.exit()
    assert server.stop() == 0

    again = start_server(*args)
    b = start_worker(again.url)
    ib = b.ok("register_kv")["instance_id"]
    assert b.ok("lookup", keys=[[key(2)]])["hits"] == 0
    found = b.ok("lookup", keys=[[key(0), key(1), key(2)]])
    assert found["hits"] == 2
    b.ok("retrieve", instance_id=ib, keys=[key(0), key(1)], blocks=[5, 6], chunk_blocks=1, lease=found["lease"])
    assert b.ok("digest_blocks", instance_id=ib, blocks=[5, 6])["digests"] == want


def test_an_unknown_disk_admit_is_refused_at_start_naming_the_choices(start_server, disk):
    with pytest.raises(RuntimeError, match="--disk-admit 'sometimes': use one of first, second"):
        start_server("--disk", str(disk), "--disk-capacity", "1MiB", "--disk-admit", "sometimes")
