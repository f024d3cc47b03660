"""The disk tier against another local user, against one tenant flushing another, and while its
index is rebuilt (issue 25 items 4, 5, 7). The attacker is real: a forked child that drops to
uid/gid 65534 (nobody) before it acts. Needs root (as the tests run), like the server it tests."""

from __future__ import annotations

import os
import pickle
import re
import shutil
import stat
import struct
import tempfile
import threading
import time
import zlib
from pathlib import Path

import pytest
from test_disk_tier import META, disk_dir, payload, wait_for  # noqa: F401  (disk_dir: a fixture)

import lmshm.core.tiers.disk.tier as disk
from lmshm.core.pool import NBYTES, OFFSET, Pool
from lmshm.core.tiers.base import ChunkMeta
from lmshm.core.tiers.disk import DiskTier
from lmshm.core.tiers.disk.format import HEADER_BYTES, encode_header, file_bytes
from lmshm.core.tiers.disk.tier import LOW_WATERMARK
from lmshm.core.tiers.stack import TierStack

NOBODY = 65534

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="acts as a second uid: needs root")


def as_nobody(fn, *args) -> tuple:
    """``fn(*args)`` in a forked child as uid and gid 65534: ``("ok", result)`` or ``("raised", text)``."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:                                  # the child: never returns into pytest
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            try:
                out = ("ok", fn(*args))
            except BaseException as exc:
                out = ("raised", f"{type(exc).__name__}: {exc}")
            os.write(w, pickle.dumps(out))
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    os.waitpid(pid, 0)
    return pickle.loads(data)


@pytest.fixture
def shared() -> Path:
    """A directory under /tmp that nobody may enter (not write): the attacker's view of a host."""
    path = Path(tempfile.mkdtemp(prefix="lmshm-dt-", dir="/tmp"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def mode(p: Path) -> int:
    return stat.S_IMODE(os.lstat(p).st_mode)


def chunk_files(d: Path) -> list[Path]:
    return [p for p in d.rglob("*") if p.is_file() and p.name not in (".lock", ".key")]


def charged(d: Path) -> int:
    """What the chunk files in ``d`` count against the capacity (each file_bytes of its payload)."""
    total = 0
    for p in chunk_files(d):
        try:
            total += file_bytes(p.stat().st_size - HEADER_BYTES)
        except FileNotFoundError:               # evicted meanwhile
            pass
    return total


# ---- 4a: the path above and below DIR --------------------------------------------------------

def test_a_disk_dir_under_a_directory_another_user_may_write_is_refused_naming_it(shared):
    parent = shared / "open"
    parent.mkdir()
    parent.chmod(0o777)
    d = parent / "disk"
    d.mkdir(mode=0o700)
    # the attack: nobody moves the server's directory away (and could put a forged one there)
    assert as_nobody(os.rename, str(d), str(parent / "moved")) == ("ok", None)
    os.rename(parent / "moved", d)
    with pytest.raises(PermissionError, match=rf"ancestor {re.escape(str(parent))} is writable by others "
                                              r"\(mode 777, not sticky\).*chmod go-w"):
        DiskTier(str(d), 1 << 20)
    parent.chmod(0o1777)                          # sticky, as /tmp: nobody cannot move what is not theirs
    assert as_nobody(os.rename, str(d), str(parent / "moved"))[0] == "raised"
    DiskTier(str(d), 1 << 20).close()
    parent.chmod(0o755)
    os.chown(parent, NOBODY, NOBODY)              # an ancestor of another uid: it may do what it likes
    with pytest.raises(PermissionError, match=rf"ancestor {re.escape(str(parent))} belongs to uid {NOBODY}"):
        DiskTier(str(d), 1 << 20)


def test_a_directory_swapped_after_start_is_never_read_nor_written(shared):
    d = shared / "disk"
    d.mkdir(mode=0o700)
    tier = DiskTier(str(d), 1 << 20)
    try:
        assert tier.put(0, b"k1", META, memoryview(payload(1)))
        os.rename(d, shared / "moved")            # (only root or the server's uid can: the parents are checked)
        d.mkdir(mode=0o700)
        if (shared / "moved" / ".key").exists():   # the strongest forger: it even has the key
            shutil.copy2(shared / "moved" / ".key", d / ".key")
        forged = DiskTier(str(d), 1 << 20)
        assert forged.put(0, b"k1", META, memoryview(payload(99)))
        assert forged.put(0, b"k2", META, memoryview(payload(98)))
        forged.close()
        dest = bytearray(META.nbytes)
        assert tier.get_into(0, b"k1", META, memoryview(dest)) and bytes(dest) == payload(1)
        assert tier.put(0, b"k3", META, memoryview(payload(3)))
        assert {p.name for p in chunk_files(shared / "moved")} == {b"k1".hex(), b"k3".hex()}
        assert {p.name for p in chunk_files(d)} == {b"k1".hex(), b"k2".hex()}
        assert tier.contains(0, [b"k2"]) == 0
    finally:
        tier.close()


@pytest.mark.parametrize("where", ["uid", "xx"])
def test_a_planted_symlink_below_the_directory_is_never_followed(shared, where):
    d = shared / "disk"
    d.mkdir(mode=0o700)
    outside = shared / "outside"
    outside.mkdir()
    key = bytes.fromhex("abcd") * 8
    tier = DiskTier(str(d), 1 << 20)
    assert tier.put(0, key, META, memoryview(payload(1)))
    tier.close()
    real = d / "0" if where == "uid" else d / "0" / "ab"
    shutil.move(real, outside / "tree")           # a valid file of ours, behind a link
    real.symlink_to(outside / "tree")
    before = sorted((p, p.stat().st_mtime_ns) for p in outside.rglob("*"))
    tier = DiskTier(str(d), 1 << 20)
    try:
        assert tier.wait_scan(10)
        assert tier.contains(0, [key]) == 0 and not tier.get_into(0, key, META, memoryview(bytearray(META.nbytes)))
        assert not tier.put(0, key, META, memoryview(payload(2)))       # dropped, never written there
        assert not tier.put(0, bytes.fromhex("abef") * 8, META, memoryview(payload(3)))
        assert sorted((p, p.stat().st_mtime_ns) for p in outside.rglob("*")) == before
        s = tier.stats.snapshot()
        assert s["drops"] == 2 and s["errors"] == 2
    finally:
        tier.close()
    assert real.is_symlink()                      # left alone (logged), not removed through


@pytest.mark.parametrize("openat2", ["openat2", "step by step"])
@pytest.mark.parametrize("swap", ["leaf link", "file link", "leaf not ours"])
def test_a_leaf_swapped_after_a_chunk_was_indexed_is_never_read_through(shared, openat2, swap):
    """A chunk's directory ``DIR/<uid>/<xx>/<yy>`` (or its file) replaced, while the tier runs,
    by a link to the valid file moved elsewhere, or by a directory of another uid holding it
    (a file of that uid, its header and MAC still good): the chunk is a miss, counted, and
    nothing there is read into the pool, written or unlinked. Reads open the file by one
    ``openat2`` that follows no link; without it, step by step."""
    d = shared / "disk"
    d.mkdir(mode=0o700)
    outside = shared / "outside"
    outside.mkdir()
    key = bytes.fromhex("abcd") * 8
    tier = DiskTier(str(d), 1 << 20)
    if openat2 == "step by step":
        tier._open_below = tier._open_below_direct = None
    else:
        assert tier._open_below is not None, "openat2 is refused on this machine"
    try:
        assert tier.put(0, key, META, memoryview(payload(1)))
        assert tier.wait_scan(10) and tier.contains(0, [key]) == 1
        leaf = d / "0" / "ab" / "cd"
        name = key.hex()
        if swap == "leaf link":
            shutil.move(leaf, outside / "tree")
            leaf.symlink_to(outside / "tree")
        elif swap == "file link":
            shutil.move(leaf / name, outside / name)
            (leaf / name).symlink_to(outside / name)
        else:
            shutil.move(leaf, outside / "tree")
            leaf.mkdir(mode=0o700)
            shutil.copy2(outside / "tree" / name, leaf / name)
            os.chown(leaf / name, NOBODY, NOBODY)
            os.chown(leaf, NOBODY, NOBODY)
        before = sorted((p, p.stat().st_mtime_ns) for p in outside.rglob("*"))
        dest = bytearray(META.nbytes)
        assert not tier.get_into(0, key, META, memoryview(dest)) and bytes(dest) == bytes(META.nbytes)
        s = tier.stats.snapshot()
        assert s["errors"] + s["corrupt"] == 1 and tier.contains(0, [key]) == 0
        assert sorted((p, p.stat().st_mtime_ns) for p in outside.rglob("*")) == before
    finally:
        tier.close()
    if swap == "leaf link":
        assert leaf.is_symlink()                  # left alone (logged), not removed through
    if swap == "file link":                      # the link itself removed (as a damaged file), not its target
        assert not os.path.lexists(leaf / name) and (outside / name).exists()


# ---- 4b: the modes of what the tier makes ----------------------------------------------------

@pytest.mark.parametrize("umask", [0, 0o022])
def test_every_directory_the_tier_makes_is_0700_whatever_the_umask(shared, umask):
    d = shared / "made" / "disk"                  # neither exists yet
    keys = [bytes([i * 60, i]) * 8 for i in range(4)]
    old = os.umask(umask)
    try:
        tier = DiskTier(str(d), 1 << 20)
        try:
            for uid in (0, 1000):
                for k in keys:
                    assert tier.put(uid, k, META, memoryview(payload(uid + k[0])))
        finally:
            tier.close()
    finally:
        os.umask(old)
    made = [shared / "made", d] + [p for p in d.rglob("*") if p.is_dir()]
    assert len(made) == 2 + 2 * (1 + 4 + 4)
    assert {f"{mode(p):o}" for p in made} == {"700"}, {str(p): f"{mode(p):o}" for p in made}
    assert {f"{mode(p):o}" for p in d.rglob("*") if p.is_file()} == {"600"}
    for p in made:                                # nobody lists nothing and plants nothing
        assert as_nobody(os.listdir, str(p))[0] == "raised"
        assert as_nobody(lambda q: open(q, "x").close(), str(p / "planted"))[0] == "raised"


def test_an_existing_subdirectory_of_another_mode_is_set_to_0700_and_one_not_ours_is_never_used(shared):
    d = shared / "disk"
    d.mkdir(mode=0o700)
    (d / "0").mkdir()
    (d / "0").chmod(0o777)
    (d / "5").mkdir(mode=0o700)
    os.chown(d / "5", NOBODY, NOBODY)
    tier = DiskTier(str(d), 1 << 20)
    try:
        assert tier.put(0, b"k", META, memoryview(payload(1)))
        assert mode(d / "0") == 0o700
        assert not tier.put(5, b"k", META, memoryview(payload(1)))
        assert list((d / "5").iterdir()) == []
    finally:
        tier.close()


def v1_file(uid: int, key: bytes, meta: ChunkMeta, data: bytes) -> bytes:
    """A chunk file of format 1: every header field is public, and the CRC-32 is no secret."""
    head = struct.pack("<8sHBxIIQBBxx64s64s32s", b"LMSHMKV\0", 1, 3, uid, meta.blocks, meta.nbytes, len(key),
                       len(meta.layout), key, meta.layout, struct.pack("<I", zlib.crc32(data)))
    return (head + struct.pack("<I", zlib.crc32(head))).ljust(4096, b"\0") + data


def test_a_planted_file_with_a_correct_old_style_header_and_crc_is_a_miss(disk_dir):
    tier = DiskTier(str(disk_dir), 1 << 20)
    planted = Path(tier.path_of(0, b"planted"))
    try:
        assert tier.put(0, b"real", META, memoryview(payload(1)))
        Path(tier.path_of(0, b"real")).write_bytes(v1_file(0, b"real", META, payload(66)))  # over an indexed one
        dest = bytearray(META.nbytes)
        assert not tier.get_into(0, b"real", META, memoryview(dest))
        planted.parent.mkdir(parents=True, exist_ok=True)
        planted.write_bytes(v1_file(0, b"planted", META, payload(67)))
        forged = Path(tier.path_of(0, b"guess"))   # format 2, but a MAC under a key the forger guessed
        forged.parent.mkdir(parents=True, exist_ok=True)
        forged.write_bytes(encode_header(0, b"guess", META, 3, memoryview(payload(68)), mac_key=os.urandom(32))
                           + payload(68))
    finally:
        tier.close()
    again = DiskTier(str(disk_dir), 1 << 20)
    try:
        assert again.wait_scan(10)
        assert again.contains(0, [b"planted"]) == 0 and again.contains(0, [b"guess"]) == 0
        assert not planted.exists() and not forged.exists() and again.stats.snapshot()["corrupt"] == 2
    finally:
        again.close()


@pytest.mark.parametrize("bad", ["mode", "link", "owner", "short"])
def test_a_key_file_that_is_not_a_0600_file_of_ours_is_refused(disk_dir, bad):
    DiskTier(str(disk_dir), 1 << 20).close()
    key = disk_dir / ".key"
    assert mode(key) == 0o600 and key.stat().st_size == 32
    if bad == "mode":
        key.chmod(0o644)
    elif bad == "link":
        key.rename(disk_dir / "elsewhere")
        key.symlink_to(disk_dir / "elsewhere")
    elif bad == "owner":
        os.chown(key, NOBODY, NOBODY)
    else:
        key.write_bytes(b"x" * 16)
    with pytest.raises(PermissionError, match=r"\.key.*remove it"):
        DiskTier(str(disk_dir), 1 << 20)


# ---- 5: one tenant cannot flush another ------------------------------------------------------

def test_a_uid_storing_a_lot_evicts_its_own_files_not_another_uids(disk_dir):
    meta = ChunkMeta(32 << 10, b"L" * 16, 1)
    size, capacity = file_bytes(meta.nbytes), 8 << 20          # 36 KiB a file
    data = memoryview(payload(5, meta.nbytes))
    tier = DiskTier(str(disk_dir), capacity)
    try:
        a_keys = [b"A%05d" % i for i in range(128)]             # 4.5 MiB: more than half the tier
        for k in a_keys:
            assert tier.put(1, k, meta, data)
        b_keys = [b"B%05d" % i for i in range((20 << 20) // meta.nbytes)]
        for k in b_keys:
            tier.put(2, k, meta, data)
        a_kept = [k for k in a_keys if tier.contains(1, [k])]
        b_kept = [k for k in b_keys if tier.contains(2, [k])]
        assert len(a_kept) * size >= LOW_WATERMARK * capacity / 2 - 2 * size, (len(a_kept), len(b_kept))
        assert a_kept == a_keys[-len(a_kept):] and b_kept == b_keys[-len(b_kept):]   # each LRU within its own
        assert tier.usage()[1] <= capacity
    finally:
        tier.close()


# ---- 7: serving while the index is rebuilt -----------------------------------------------------

def fill(d: Path, n: int) -> list[bytes]:
    tier = DiskTier(str(d), 1 << 30)
    keys = [b"key-%04d" % i for i in range(n)]
    try:
        for i, k in enumerate(keys):
            assert tier.put(0, k, META, memoryview(payload(i)))
    finally:
        tier.close()
    return keys


def test_the_tier_answers_while_its_index_is_rebuilt_and_counts_every_file_once(disk_dir, monkeypatch):
    keys = fill(disk_dir, 300)
    real = disk.decode_header
    permits = threading.Semaphore(0)
    constructing = [True]

    def gated(*a, **kw):                          # the scan reads a header only when the test lets it
        if threading.current_thread().name == "lmshm-disk-scan":
            permits.acquire(timeout=20)
        elif constructing[0]:
            time.sleep(0.005)                     # a scan in the constructor: 300 x 5 ms
        return real(*a, **kw)

    monkeypatch.setattr(disk, "decode_header", gated)
    t0 = time.monotonic()
    tier = DiskTier(str(disk_dir), 1 << 30)
    opened_s = time.monotonic() - t0
    constructing[0] = False
    try:
        assert opened_s < 1.0
        for _ in range(100):
            permits.release()
        wait_for(lambda: tier.usage()[2] == 100)
        info = tier.info()
        assert info.scanned == 100 and not info.scan_done
        from lmshm.core.metrics import Metrics
        from lmshm.core.registry import Registry
        from lmshm.wire.protocol import PoolInfo
        text = Metrics(Registry(), lambda: PoolInfo(1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, tiers=[info])).text()
        assert b'lmshm_tier_scan_done{tier="disk"} 0.0' in text and b'lmshm_tier_scanned{tier="disk"} 100.0' in text
        indexed = set(tier.held_by(0)[1])
        missing = [k for k in keys if k not in indexed]
        assert len(missing) == 200
        dest = bytearray(META.nbytes)
        assert not tier.get_into(0, missing[0], META, memoryview(dest))      # not reached yet: not indexed
        assert tier.put(0, missing[0], META, memoryview(payload(999)))       # over a file not counted yet
        assert tier.head(0, missing[1]) == META and tier.contains(0, missing[2:50]) == 48   # probed, indexed
        assert tier.probed == 49 and tier.usage()[2] == 100 + 1 + 49
        text = Metrics(Registry(), lambda: PoolInfo(1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                                    tiers=[tier.info()])).text()
        assert b'lmshm_tier_probed_total{tier="disk"} 49.0' in text
        assert tier.put(0, b"new", META, memoryview(payload(998)))
        for _ in range(1000):
            permits.release()
        assert tier.wait_scan(20)
        files = chunk_files(disk_dir)
        assert len(files) == 301 and tier.usage()[2] == 301
        assert tier.usage()[1] == charged(disk_dir) == 301 * file_bytes(META.nbytes)
        assert tier.get_into(0, missing[0], META, memoryview(dest)) and bytes(dest) == payload(999)
        assert tier.get_into(0, missing[1], META, memoryview(dest)) and bytes(dest) == payload(keys.index(missing[1]))
        assert tier.info().scan_done and tier.info().scanned >= 300
    finally:
        for _ in range(1000):
            permits.release()
        tier.close()


def test_a_lookup_right_after_a_restart_finds_files_the_rebuild_has_not_reached(disk_dir, monkeypatch):
    """Issue 28: a LOOKUP after a restart missed every chunk the index rebuild had not reached
    yet (bench/disk_tier.py found 1 of 1,024 chunks of 256 KiB). Now each key asked for is
    probed on disk, checked, and indexed once; a bad file probed is a miss and is deleted."""
    keys = fill(disk_dir, 40)
    h = keys[5].hex()
    bad = disk_dir / "0" / h[0:2] / h[2:4] / h
    raw = bytearray(bad.read_bytes())
    raw[40] ^= 1                                  # in the header: its MAC no longer matches
    bad.write_bytes(bytes(raw))
    real = disk.decode_header
    gate = threading.Event()

    def gated(*a, **kw):                          # the scan reads no header until the test is done
        if threading.current_thread().name == "lmshm-disk-scan":
            gate.wait(20)
        return real(*a, **kw)

    monkeypatch.setattr(disk, "decode_header", gated)
    pool = Pool(64 * (META.nbytes + 4096), max_pinned_fraction_per_uid=1.0)
    tier = DiskTier(str(disk_dir), 1 << 30, scan_wait_s=0)
    stack = TierStack(pool, [tier], queue_limit=16, timeout_s=5.0)
    try:
        assert not tier.info().scan_done and tier.usage()[2] == 0
        held = stack.promote(0, [keys[:5]], time.monotonic() + 5)
        assert len(held.held) == 5 and tier.probed == 5
        for i, obj in enumerate(held.held):
            assert bytes(pool.bytes.view[obj[OFFSET]:obj[OFFSET] + obj[NBYTES]]) == payload(i)
        held.release()
        assert tier.contains(0, keys) == 5         # keys[5] is bad: a miss, deleted, counted
        assert not bad.exists() and tier.stats.snapshot()["corrupt"] == 1
        assert tier.contains(0, [b"never-stored"]) == 0 and tier.contains(1, keys[:1]) == 0
        assert tier.contains(0, keys[6:]) == 34 and tier.probed == 39
        gate.set()
        assert tier.wait_scan(20)
        assert tier.usage()[2] == 39 and tier.usage()[1] == 39 * file_bytes(META.nbytes)   # each counted once
        assert tier.info().promotions == 5
    finally:
        gate.set()
        stack.close()
        pool.release()


def test_the_capacity_holds_while_the_index_is_rebuilt(disk_dir, monkeypatch):
    keys = fill(disk_dir, 200)
    size = file_bytes(META.nbytes)
    capacity = 50 * size
    real = disk.decode_header
    monkeypatch.setattr(disk, "decode_header", lambda *a, **kw: time.sleep(0.002) or real(*a, **kw))
    tier = DiskTier(str(disk_dir), capacity, scan_wait_s=0)
    try:
        i = 0
        while not tier.wait_scan(0.01):
            on_disk = charged(disk_dir)
            unscanned = (len(keys) - tier.scanned + 1) * size
            assert tier.usage()[1] <= capacity and on_disk <= capacity + unscanned
            tier.put(0, b"during-%d" % i, META, memoryview(payload(i)))
            i += 1
        files = chunk_files(disk_dir)
        assert i > 0 and tier.usage()[1] <= capacity
        assert tier.usage()[1] == charged(disk_dir) and tier.usage()[2] == len(files)
    finally:
        tier.close()


def test_close_stops_the_rebuild_promptly_and_releases_the_directory(disk_dir, monkeypatch):
    keys = fill(disk_dir, 300)
    real = disk.decode_header
    monkeypatch.setattr(disk, "decode_header", lambda *a, **kw: time.sleep(0.02) or real(*a, **kw))
    t0 = time.monotonic()
    tier = DiskTier(str(disk_dir), 1 << 30)
    opened_s = time.monotonic() - t0
    time.sleep(0.2)
    t1 = time.monotonic()
    tier.close()
    closed_s = time.monotonic() - t1
    assert opened_s < 1.0 and closed_s < 1.0 and tier.info().scanned < 300
    monkeypatch.setattr(disk, "decode_header", real)
    again = DiskTier(str(disk_dir), 1 << 30)      # the lock was released: a new tier opens
    try:
        assert again.wait_scan(10) and again.contains(0, keys) == 300
    finally:
        again.close()
