"""The remote tier alone (lmshm/core/tiers/remote/) against real Valkey servers started by the
fixtures (tests/v1/conftest.py): standalone and a 3-master cluster, with real faults (SIGKILL,
SIGSTOP) and values written directly to the server by a hostile writer. A tier signs with
``SECRET`` unless a test is about the unsigned format (``--remote-insecure-unsigned``)."""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import pytest
from valkey_servers import command, flip_byte, free_port

from lmshm.core.tiers.base import ChunkMeta
from lmshm.core.tiers.remote import RemoteTier
from lmshm.core.tiers.remote.breaker import BREAKER_FAILURES
from lmshm.core.tiers.remote.target import SECRET_HOWTO, parse_url, read_ca_file, read_secret_file
from lmshm.core.tiers.remote.value import HEADER_BYTES, MACS, check_value

TIMEOUT_S = 0.3
META = ChunkMeta(nbytes=64 << 10, layout=b"L" * 16, blocks=2)
SECRET = b"lmshm remote tier tests' secret!"     # 32 bytes, one for every process of a test


def signing(signed: bool | str) -> dict:
    """The tier's arguments for a signed tier (``SECRET``; ``signed`` may name its MAC) or an
    unsigned one (the opt-out)."""
    if not signed:
        return {"insecure_unsigned": True}
    return {"secret": SECRET, **({"mac": signed} if isinstance(signed, str) else {})}


def key(i: int) -> bytes:
    return bytes([0xA5, i % 256, i // 256]) * 8


def payload(i: int, n: int = META.nbytes) -> bytes:
    return (bytes([i % 251]) + os.urandom(15)) * (n // 16)


def tier_for(url: str, **kw) -> RemoteTier:
    """A tier on ``url``, signed with ``SECRET`` unless ``kw`` names another secret or the opt-out."""
    kw.setdefault("timeout_s", TIMEOUT_S)
    if not kw.get("insecure_unsigned"):
        kw.setdefault("secret", SECRET)
    return RemoteTier(url, prefix="t:", **kw)


def read(tier: RemoteTier, uid: int, k: bytes, framed: bool = False) -> bytes | None:
    """The chunk as a promotion reads it: into a slot alone, or (``framed``) into a slot with the
    pool's head room before it, as the server's pool keeps it with a remote tier."""
    meta = tier.head(uid, k)
    if meta is None:
        return None
    frame = memoryview(bytearray(b"\xee" * (HEADER_BYTES + meta.nbytes)))
    dest = frame[HEADER_BYTES:]
    if not tier.get_into(uid, k, meta, dest, frame if framed else None):
        if not framed:                  # read into the thread's buffer: nothing was copied
            assert bytes(frame) == b"\xee" * len(frame), "a refused value reached the slot or its room"
        return None
    return bytes(dest)


def test_a_stored_chunk_reads_back_equal_and_only_for_its_uid(valkey):
    tier = tier_for(valkey.url)
    try:
        data = payload(1)
        assert tier.put(7, key(1), META, memoryview(data))
        assert tier.head(7, key(1)) == META
        assert read(tier, 7, key(1)) == data
        assert tier.head(8, key(1)) is None, "another uid saw the chunk"
        assert tier.contains(7, [key(1), key(2), key(1)]) == 1
        stored = command(valkey.port, "STRLEN", tier.remote_key(7, key(1)))
        assert stored == b":%d\r\n" % (HEADER_BYTES + META.nbytes)
        assert tier.remote_key(7, key(1)).startswith(b"t:00000007:")
        s = tier.stats.snapshot()
        assert s["puts"] == 1 and s["reads"] == 1 and s["read_bytes"] == META.nbytes
    finally:
        tier.close()


def test_the_ttl_is_set_on_every_value(valkey):
    tier = tier_for(valkey.url, ttl_s=30)
    try:
        assert tier.put(1, key(1), META, memoryview(payload(1)))
        ttl = int(command(valkey.port, "PTTL", tier.remote_key(1, key(1)))[1:])
        assert 25_000 < ttl <= 30_000
    finally:
        tier.close()


@pytest.mark.parametrize("signed", [False, "aes-gmac", "blake3"], ids=["checksum", "aes-gmac", "blake3"])
@pytest.mark.parametrize("framed", [False, True], ids=["slot", "framed"])
@pytest.mark.parametrize("damage", ["truncated", "extended", "flipped payload", "flipped header", "garbage"])
def test_a_damaged_value_is_a_miss_never_served(valkey, damage, framed, signed):
    tier = tier_for(valkey.url, **signing(signed))
    try:
        data = payload(2)
        assert tier.put(1, key(2), META, memoryview(data))
        rkey = tier.remote_key(1, key(2))
        good = bytes(tier._get_client().get(rkey))
        bad = {"truncated": good[:-1], "extended": good + b"x" * (1 << 20),
               "flipped payload": good[:-5] + bytes([good[-5] ^ 1]) + good[-4:],
               "flipped header": good[:20] + bytes([good[20] ^ 1]) + good[21:],
               "garbage": os.urandom(len(good))}[damage]
        assert command(valkey.port, "SET", rkey, bad).startswith(b"+OK")
        for _ in range(BREAKER_FAILURES + 1):
            assert read(tier, 1, key(2), framed) is None
        s = tier.stats.snapshot()
        assert s["corrupt"] == BREAKER_FAILURES + 1 and s["errors"] == 0 and s["timeouts"] == 0, s
        assert command(valkey.port, "EXISTS", rkey) == b":1\r\n", "the tier deleted a value it did not own"
        # a refused value is no failure of the remote: the breaker stays shut, the next value is read
        assert tier.put(1, key(2), META, memoryview(data)) and read(tier, 1, key(2), framed) == data
    finally:
        tier.close()


def test_with_a_secret_unsigned_forged_and_moved_values_are_misses(valkey, tmp_path):
    secret_file = tmp_path / "secret"
    secret_file.write_bytes(os.urandom(32))
    secret_file.chmod(0o600)
    secret = read_secret_file(str(secret_file), "--remote-secret-file", 16)
    signed = tier_for(valkey.url, secret=secret)
    unsigned = tier_for(valkey.url, insecure_unsigned=True)  # a writer without the secret
    forger = tier_for(valkey.url, secret=os.urandom(32))     # a writer with another secret
    try:
        good = payload(3)
        assert signed.put(1, key(3), META, memoryview(good))
        assert read(signed, 1, key(3)) == good
        assert read(unsigned, 1, key(3)) is None, "a signed value was served without a secret to check it"
        # poisoning: the same key, overwritten by a writer without the secret, and by a forger
        for writer in (unsigned, forger):
            assert writer.put(1, key(3), META, memoryview(payload(99)))
            assert read(signed, 1, key(3)) is None, "a value without a valid MAC was served"
            # read into the slot and its room (an invisible reserved object): still not served
            assert read(signed, 1, key(3), framed=True) is None
        # a valid value moved to another key (or uid) is refused: the MAC covers uid and key
        assert signed.put(1, key(4), META, memoryview(good))
        value = bytes(signed._get_client().get(signed.remote_key(1, key(4))))
        command(valkey.port, "SET", signed.remote_key(1, key(5)), value)
        command(valkey.port, "SET", signed.remote_key(2, key(4)), value)
        assert read(signed, 1, key(5)) is None and read(signed, 2, key(4)) is None
        # a forged header with the right MAC length and a payload the forger chose
        forged = bytearray(value)
        forged[HEADER_BYTES:HEADER_BYTES + 8] = b"EVILEVIL"
        command(valkey.port, "SET", signed.remote_key(1, key(4)), bytes(forged))
        assert read(signed, 1, key(4)) is None
        assert signed.stats.snapshot()["corrupt"] >= 5
    finally:
        for t in (signed, unsigned, forger):
            t.close()


@pytest.mark.parametrize("mac", ["aes-gmac", "blake3"])
def test_values_signed_with_either_mac_are_read_and_every_tampered_byte_is_refused(valkey, mac):
    writer = tier_for(valkey.url, mac=mac)
    reader = tier_for(valkey.url, mac="blake3" if mac == "aes-gmac" else "aes-gmac")   # reads either
    forger = tier_for(valkey.url, secret=os.urandom(32), mac=mac)
    try:
        data = payload(7)
        assert writer.put(1, key(7), META, memoryview(data))
        rkey = writer.remote_key(1, key(7))
        good = bytes(writer._get_client().get(rkey))
        assert good[11] == MACS[mac], "the value is not signed with the MAC asked for"
        assert read(reader, 1, key(7)) == data and read(writer, 1, key(7)) == data
        # a second write of the same chunk: with AES-GMAC another nonce, so no key signs two payloads
        assert writer.put(1, key(7), META, memoryview(data))
        again = bytes(writer._get_client().get(rkey))
        assert (again[160:192] != good[160:192]) if mac == "aes-gmac" else again == good
        # one bit flipped in: the MAC algorithm, uid, length, key, layout, nonce, tag, the tag's zero
        # pad, the payload's first and last byte; and the algorithm byte set to the other MAC, to none
        flips = [11, 12, 20, 40, 100, 170, HEADER_BYTES - 32, HEADER_BYTES - 1, HEADER_BYTES, len(good) - 1]
        bad = [good[:i] + bytes([good[i] ^ 1]) + good[i + 1:] for i in flips]
        bad += [good[:11] + bytes([b]) + good[12:] for b in set(MACS.values()) - {MACS[mac]} | {0}]
        # the header (and nonce) of this value with another payload, its tag kept or re-made by a forger
        bad.append(good[:HEADER_BYTES] + payload(8))
        assert forger.put(1, key(7), META, memoryview(payload(8)))
        bad.append(bytes(forger._get_client().get(rkey)))
        for value in bad:
            assert command(valkey.port, "SET", rkey, value).startswith(b"+OK")
            assert read(reader, 1, key(7)) is None and read(reader, 1, key(7), framed=True) is None
        assert reader.stats.snapshot()["corrupt"] == 2 * len(bad)
    finally:
        for t in (writer, reader, forger):
            t.close()


def test_an_unknown_mac_is_refused_naming_the_choices(valkey):
    with pytest.raises(ValueError, match="aes-gmac, blake3"):
        tier_for(valkey.url, mac="hmac")


def test_a_framed_read_lands_in_the_slot_itself_signed_or_not(valkey):
    plain, signed = tier_for(valkey.url, insecure_unsigned=True), tier_for(valkey.url, secret=os.urandom(32))
    try:
        data = payload(6)
        for tier in (plain, signed):
            assert tier.put(1, key(6), META, memoryview(data))
            meta = tier.head(1, key(6))
            frame = memoryview(bytearray(HEADER_BYTES + META.nbytes))
            def no_buffer(nbytes):
                raise AssertionError("the value went through a read buffer, not into the slot")
            tier._read_buffer = no_buffer
            assert tier.get_into(1, key(6), meta, frame[HEADER_BYTES:], frame)
            assert bytes(frame[HEADER_BYTES:]) == data
            stored = bytes(tier._get_client().get(tier.remote_key(1, key(6))))
            assert bytes(frame[:HEADER_BYTES]) == stored[:HEADER_BYTES], "the header did not land in the room"
            # a forged payload read the same way is refused there, and never served
            forged = stored[:HEADER_BYTES] + bytes(b ^ 1 for b in stored[HEADER_BYTES:HEADER_BYTES + 64]) \
                + stored[HEADER_BYTES + 64:]
            command(valkey.port, "SET", tier.remote_key(1, key(6)), forged)
            assert not tier.get_into(1, key(6), meta, frame[HEADER_BYTES:], frame)
            assert tier.stats.snapshot()["corrupt"] == 1
        # a missing key is a plain miss, not counted as corrupt
        assert plain.get_into(1, key(60), META, frame[HEADER_BYTES:], frame) is False
        assert plain.stats.snapshot()["corrupt"] == 1
    finally:
        plain.close()
        signed.close()


def test_a_secret_file_others_can_read_is_refused(tmp_path):
    f = tmp_path / "secret"
    f.write_bytes(os.urandom(32))
    f.chmod(0o644)
    with pytest.raises(ValueError, match="chmod 600"):
        read_secret_file(str(f), "--remote-secret-file", 16)
    f.chmod(0o600)
    f.write_bytes(b"short")
    with pytest.raises(ValueError, match="at least 16"):
        read_secret_file(str(f), "--remote-secret-file", 16)


def test_a_tier_without_a_secret_is_refused_saying_how_to_make_one_and_naming_the_opt_out(tmp_path):
    with pytest.raises(ValueError) as err:
        RemoteTier("redis://127.0.0.1:1")
    said = str(err.value)
    assert "--remote-secret-file" in said and SECRET_HOWTO in said and "--remote-insecure-unsigned" in said
    assert "LMSHM_REMOTE_INSECURE_UNSIGNED=1" in said
    # the recipe, followed as written (in a scratch directory), makes a file read_secret_file takes
    import subprocess
    subprocess.run(["sh", "-c", SECRET_HOWTO.replace("/etc/lmshm", str(tmp_path / "etc"))], check=True)
    assert len(read_secret_file(str(tmp_path / "etc" / "remote.key"), "--remote-secret-file", 16)) >= 16


def test_a_secret_and_the_insecure_opt_out_together_are_refused():
    with pytest.raises(ValueError, match="contradict each other"):
        RemoteTier("redis://127.0.0.1:1", secret=SECRET, insecure_unsigned=True)


def test_the_insecure_opt_out_logs_one_warning_at_start_and_then_serves_a_forged_value(valkey, caplog):
    with caplog.at_level("WARNING", logger="lmshm.tiers.remote"):
        tier = tier_for(valkey.url, insecure_unsigned=True)
    try:
        said = [r for r in caplog.records if "insecure" in r.getMessage()]
        assert len(said) == 1 and said[0].levelname == "WARNING"
        assert "anyone who can write to that Valkey/Redis can feed engines wrong KV" in said[0].getMessage()
        assert tier.put(1, key(8), META, memoryview(payload(8)))
        # a writer of the Valkey, no secret: a valid header and checksum over its own payload
        forged = payload(66)
        forger = tier_for(valkey.url, insecure_unsigned=True)
        assert forger.put(1, key(8), META, memoryview(forged))
        forger.close()
        assert read(tier, 1, key(8)) == forged, "the opt-out's risk: a forged value is a hit"
        assert tier.stats.snapshot()["corrupt"] == 0
        # the same forgery, read with a secret: a counted miss
        signed = tier_for(valkey.url)
        assert read(signed, 1, key(8)) is None and signed.stats.snapshot()["corrupt"] == 1
        signed.close()
    finally:
        tier.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another uid needs root")
def test_a_secret_file_of_another_uid_is_refused(tmp_path):
    f = tmp_path / "secret"
    f.write_bytes(os.urandom(32))
    f.chmod(0o600)
    os.chown(f, 12345, -1)
    with pytest.raises(ValueError, match="belongs to uid 12345.*chown it"):
        read_secret_file(str(f), "--remote-secret-file", 16)


@pytest.mark.parametrize("url, message", [
    ("http://127.0.0.1:6379", "is not a URL lmshm accepts"),
    ("127.0.0.1:6379", "is not a URL lmshm accepts"),
    ("redis://:hunter2@127.0.0.1:6379", "LMSHM_REMOTE_PASSWORD"),
    ("redis://u:hunter2@127.0.0.1", "--remote-password-file"),
    ("redis://127.0.0.1:1,127.0.0.1:2", "redis\\+cluster://"),
    ("redis+cluster://127.0.0.1:1/3", "database number"),
    ("redis://127.0.0.1:99999", "HOST:PORT"),
    ("redis://127.0.0.1:6379?ssl=true", "query strings"),
])
def test_unaccepted_urls_are_refused_naming_what_is_accepted(url, message):
    with pytest.raises(ValueError, match=message) as err:
        parse_url(url)
    assert "hunter2" not in str(err.value)


def test_accepted_url_forms():
    assert parse_url("redis://h").nodes == (("h", 6379),)
    t = parse_url("rediss://user@h:7000/2")
    assert t.tls and not t.cluster and t.db == 2 and t.username == "user"
    c = parse_url("redis+cluster://a:1,b:2,[::1]:3")
    assert c.cluster and c.nodes == (("a", 1), ("b", 2), ("::1", 3))


def test_a_dead_remote_at_start_costs_misses_then_is_found_when_it_comes_up(valkey):
    port = valkey.port
    valkey.kill()
    tier = tier_for(f"redis://127.0.0.1:{port}")
    try:
        t0 = time.monotonic()
        assert tier.head(1, key(1)) is None
        assert not tier.put(1, key(1), META, memoryview(payload(1)))
        assert time.monotonic() - t0 < 2 * TIMEOUT_S + 0.5
        valkey.start()
        data = payload(1)
        wait_until(lambda: tier.put(1, key(1), META, memoryview(data)), 40)
        assert read(tier, 1, key(1)) == data
    finally:
        tier.close()


def wait_until(predicate, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "not true in time"
        time.sleep(0.1)


@pytest.mark.parametrize("fault", ["SIGSTOP", "SIGKILL"])
def test_a_silent_or_dead_remote_answers_misses_within_the_timeout_opens_the_breaker_and_recovers(valkey, fault):
    tier = tier_for(valkey.url)
    try:
        data = payload(5)
        assert tier.put(1, key(5), META, memoryview(data))
        if fault == "SIGSTOP":
            valkey.pause()
        else:
            valkey.kill()
        took = []
        for _ in range(BREAKER_FAILURES + 3):
            t0 = time.monotonic()
            assert tier.head(1, key(5)) is None
            took.append(time.monotonic() - t0)
        assert max(took) < TIMEOUT_S + 0.4, f"a call waited past its timeout: {took}"
        assert max(took[BREAKER_FAILURES:]) < 0.01, f"the breaker did not open: {took}"
        s = tier.stats.snapshot()
        assert s["timeouts"] + s["errors"] >= 1
        if fault == "SIGSTOP":
            valkey.resume()
        else:
            valkey.start()              # the value died with the server: stored again below
        wait_until(lambda: fault == "SIGSTOP" or tier.put(1, key(5), META, memoryview(data)), 40)
        wait_until(lambda: read(tier, 1, key(5)) == data, 40)
    finally:
        tier.close()


def test_a_cluster_stores_and_finds_and_a_node_down_costs_only_its_slots(valkey_cluster):
    tier = tier_for(valkey_cluster.url)
    try:
        keys = [key(i) for i in range(24)]
        for i, k in enumerate(keys):
            assert tier.put(1, k, META, memoryview(payload(i, 4096) * 16))
        by_node = {id(n): [] for n in valkey_cluster.nodes}
        for k in keys:
            by_node[id(valkey_cluster.node_for(tier.remote_key(1, k)))].append(k)
        assert all(by_node.values()), "the keys did not spread over the three masters"
        for k in keys:
            assert read(tier, 1, k) is not None
        tier._usage_at = 0                    # read the usage now, not after USAGE_REFRESH_S
        tier._refresh_usage()
        capacity, used, objects = tier.usage()    # summed over the three primaries
        assert objects == 24 and used > 24 * 64 * 1024 and capacity == 0
        down = valkey_cluster.nodes[1]
        down.kill()
        t0 = time.monotonic()
        for _ in range(2):                    # twice: the breaker must not spill over other slots
            for k in keys:
                got = read(tier, 1, k)
                if k in by_node[id(down)]:
                    assert got is None
                else:
                    assert got is not None, "a key on a live node was a miss"
        assert time.monotonic() - t0 < 2 * len(by_node[id(down)]) * (TIMEOUT_S + 0.2) + 5
    finally:
        tier.close()


def _hammer(url: str, fill: int, until: float) -> None:
    tier = RemoteTier(url, prefix="t:", timeout_s=2, secret=SECRET)
    data = memoryview(bytes([fill]) * META.nbytes)
    while time.time() < until:
        tier.put(1, key(9), META, data)
    tier.close()


def test_two_writers_of_one_key_never_give_a_reader_a_torn_value(valkey):
    ctx = mp.get_context("spawn")
    until = time.time() + 3
    writers = [ctx.Process(target=_hammer, args=(valkey.url, fill, until)) for fill in (0x11, 0x22)]
    for w in writers:
        w.start()
    tier = tier_for(valkey.url, timeout_s=2)
    seen = set()
    try:
        while time.time() < until + 0.2:
            got = read(tier, 1, key(9))
            if got is not None:
                assert got in (b"\x11" * META.nbytes, b"\x22" * META.nbytes), "a torn value was served"
                seen.add(got[0])
    finally:
        tier.close()
        for w in writers:
            w.join(30)
            assert w.exitcode == 0
    assert seen, "no read succeeded"
    assert tier.stats.snapshot()["corrupt"] == 0


def test_check_value_refuses_a_value_for_another_key_without_a_secret():
    tier_meta = ChunkMeta(16, b"x", 1)
    from lmshm.core.tiers.remote.value import BadValue, encode_header
    body = b"p" * 16
    value = encode_header(1, b"k1", tier_meta, 3, None, memoryview(body)) + body
    assert bytes(check_value(value, 1, b"k1", None)[1]) == body
    with pytest.raises(BadValue):
        check_value(value, 1, b"k2", None)


def test_a_port_nobody_listens_on_is_a_quick_miss():
    tier = tier_for(f"redis://127.0.0.1:{free_port()}")
    try:
        t0 = time.monotonic()
        assert tier.head(1, key(1)) is None
        assert time.monotonic() - t0 < TIMEOUT_S + 0.5
    finally:
        tier.close()


def test_concurrent_calls_to_a_remote_silent_since_before_the_first_connection_each_stay_within_the_bound(valkey):
    import threading
    valkey.pause()                               # TCP connects (the kernel's backlog); nothing answers
    tier = tier_for(valkey.url)
    took: list[float] = []

    def call() -> None:
        for i in range(4):
            t0 = time.monotonic()
            assert tier.head(1, key(i)) is None
            took.append(time.monotonic() - t0)
    threads = [threading.Thread(target=call) for _ in range(4)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert len(took) == 16
        assert max(took) < TIMEOUT_S + 0.4, f"a call waited past its bound: {sorted(took)}"
    finally:
        valkey.resume()
        tier.close()


def test_the_servers_maxmemory_evicts_and_an_unbounded_remote_is_warned_about(valkey_dir, valkey, caplog):
    from valkey_servers import ValkeyServer
    with caplog.at_level("WARNING", logger="lmshm.tiers.remote"):
        unbounded = tier_for(valkey.url)
        try:
            assert unbounded.put(1, key(1), META, memoryview(payload(1)))
        finally:
            unbounded.close()
    assert any("grow without bound" in r.getMessage() for r in caplog.records)
    small = ValkeyServer(valkey_dir / "small", maxmemory="4mb")
    tier = tier_for(small.url)
    try:
        # 80 x 64 KiB: more than the server keeps (each value is one SET of its exact size; the
        # MULTI/APPEND writes of format 1 held about twice that, and 40 were enough then)
        stored = [payload(i) for i in range(80)]
        for i, data in enumerate(stored):
            assert tier.put(1, key(i), META, memoryview(data))
        capacity, used, objects = tier.usage()
        assert capacity == 4 << 20 and 0 < objects < 80
        got = [read(tier, 1, key(i)) for i in range(80)]
        # Which ones went is Valkey's choice: its LRU clock ticks once a second and it samples a
        # few keys, so chunks written within a second are evicted in no particular order.
        assert any(g is None for g in got), "the server evicted nothing"
        assert got[-1] == stored[-1]
        assert all(g is None or g == s for g, s in zip(got, stored))
        s = tier.stats.snapshot()
        assert s["errors"] == s["corrupt"] == s["drops"] == 0
    finally:
        tier.close()
        small.close()


def old_format_value(uid: int, k: bytes, data: bytes, secret: bytes | None) -> bytes:
    """A value as format version 1 wrote it: a checksum (xxh3-128 or CRC-32) without a secret,
    HMAC-SHA256 with one."""
    import hashlib
    import hmac
    import struct

    from lmshm.core.tiers.integrity import CHECKSUMS, checksum_algorithm
    head = struct.Struct("<8sHBBIIQBBxx64s64s32s")
    algo = checksum_algorithm("auto")
    if secret is None:
        h = head.pack(b"LMSHMRV\0", 1, algo, 0, uid, META.blocks, len(data), len(k), len(META.layout), k,
                      META.layout, CHECKSUMS[algo][1](memoryview(data)))
        return h + bytes(32) + data
    h = head.pack(b"LMSHMRV\0", 1, 0, 1, uid, META.blocks, len(data), len(k), len(META.layout), k,
                  META.layout, bytes(32))
    return h + hmac.new(secret, h + data, hashlib.sha256).digest() + data


@pytest.mark.parametrize("signed", [False, True])
def test_a_value_of_the_old_format_is_a_plain_miss_and_the_next_write_replaces_it(valkey, signed):
    secret = SECRET if signed else None
    tier = tier_for(valkey.url, **signing(signed))
    try:
        data = payload(6)
        rkey = tier.remote_key(1, key(6))
        assert len(old_format_value(1, key(6), data, secret)) == HEADER_BYTES + META.nbytes
        command(valkey.port, "SET", rkey, old_format_value(1, key(6), data, secret))
        assert tier.head(1, key(6)) is None
        assert tier.get_into(1, key(6), META, memoryview(bytearray(META.nbytes))) is False
        s = tier.stats.snapshot()
        assert s["corrupt"] == s["errors"] == s["timeouts"] == 0, "an old value was counted as a fault"
        assert tier.put(1, key(6), META, memoryview(data))
        assert read(tier, 1, key(6)) == data
    finally:
        tier.close()


def _read_planted(url: str, k: bytes, signed: bool, out) -> None:
    import resource
    tier = tier_for(url, **signing(signed))
    try:
        meta = tier.head(1, k)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        served = tier.get_into(1, k, meta, memoryview(bytearray(meta.nbytes)))
        grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
        out.put((meta == META, served, grew << 10, tier.stats.snapshot()["corrupt"]))
    finally:
        tier.close()


@pytest.mark.parametrize("signed", [False, True], ids=["checksum", "mac"])
def test_a_planted_huge_value_is_a_miss_and_the_reader_never_allocates_its_size(valkey, signed):
    tier = tier_for(valkey.url, **signing(signed))
    try:
        assert tier.put(1, key(7), META, memoryview(payload(7)))
        # a hostile writer keeps the valid header and grows the value to 256 MiB (one SETRANGE)
        huge = 256 << 20
        command(valkey.port, "SETRANGE", tier.remote_key(1, key(7)), str(huge - 1), b"x", timeout_s=20)
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        reader = ctx.Process(target=_read_planted, args=(valkey.url, key(7), signed, out))
        reader.start()
        header_ok, served, grew, corrupt = out.get(timeout=60)
        reader.join(10)
        assert header_ok and not served and corrupt == 1
        assert grew < 32 << 20, f"the reader grew by {grew >> 20} MiB reading a {huge >> 20} MiB value"
    finally:
        tier.close()


@pytest.mark.parametrize("signed", [False, True], ids=["checksum", "mac"])
def test_write_through_sends_header_and_chunk_from_the_pools_head_room_without_a_copy(valkey, signed, tmp_path):
    from lmshm.core.pool import OFFSET, Pool, Reservation
    from lmshm.core.tiers.stack import TierStack
    tier = tier_for(valkey.url, **signing(signed))
    pool = Pool(8 << 20, head_room=tier.head_room)
    assert pool.head_room >= HEADER_BYTES

    def no_staging(nbytes):
        raise AssertionError("the chunk was copied into a staging buffer")
    tier._staging = no_staging
    stack = TierStack(pool, [tier], queue_limit=16, timeout_s=2.0)
    reader = tier_for(valkey.url, **signing(signed))
    try:
        objs, datas = [], [payload(i) for i in range(4)]
        for i in range(4):                              # neighbours: each one's room ends at the next
            outcome, obj = pool.reserve(3, key(i), META.nbytes, META.layout, META.blocks)
            assert outcome == Reservation.STORED
            pool.bytes.view[obj[OFFSET]:obj[OFFSET] + META.nbytes] = datas[i]
            pool.commit([obj])
            objs.append(obj)
        stack.write_through(objs)
        end = time.monotonic() + 5
        while tier.stats.snapshot()["puts"] < 4:
            assert time.monotonic() < end and not tier.stats.snapshot()["drops"], tier.stats.snapshot()
            time.sleep(0.01)
        for i, obj in enumerate(objs):
            assert bytes(pool.bytes.view[obj[OFFSET]:obj[OFFSET] + META.nbytes]) == datas[i], "a header overwrote a chunk"
            assert read(reader, 3, key(i)) == datas[i]
        # and back: another server's promotion reads each value into its pool, the room included
        # (straight into the reserved object, signed or not, never through a read buffer)
        reader._read_buffer = no_staging
        pool2 = Pool(8 << 20, head_room=reader.head_room)
        stack2 = TierStack(pool2, [reader], queue_limit=16, timeout_s=2.0)
        try:
            done = stack2.promote(3, [[key(i) for i in range(4)]], time.monotonic() + 5)
            assert [bytes(pool2.bytes.view[o[OFFSET]:o[OFFSET] + META.nbytes]) for o in done.held] == datas
            assert reader.stats.snapshot()["promotions"] == 4
            done.release()
        finally:
            stack2.close()
            pool2.release()
    finally:
        stack.close()
        reader.close()
        pool.release()


def test_a_tls_remote_is_reached_with_its_ca_file_and_a_certificate_nobody_vouches_for_is_a_miss(valkey_tls):
    ca = read_ca_file(str(valkey_tls.ca))
    tier = tier_for(valkey_tls.url, ca_pem=ca, timeout_s=2)
    try:
        data = payload(3)
        assert tier.put(2, key(3), META, memoryview(data))
        assert read(tier, 2, key(3)) == data
        big = os.urandom(BIG.nbytes)            # received in pieces (resp.PIECE), checked as they come
        assert tier.put(2, key(5), BIG, memoryview(big))
        assert read(tier, 2, key(5)) == big and read(tier, 2, key(5), framed=True) == big
    finally:
        tier.close()
    # the system's trust store does not know the test CA: refused, a miss, never a hang
    untrusted = tier_for(valkey_tls.url, timeout_s=TIMEOUT_S)
    try:
        t0 = time.monotonic()
        assert read(untrusted, 2, key(3)) is None
        assert not untrusted.put(2, key(4), META, memoryview(data))
        assert time.monotonic() - t0 < 4 * (TIMEOUT_S + 0.5)
        s = untrusted.stats.snapshot()
        assert s["errors"] + s["timeouts"] >= 1 and s["reads"] == 0
    finally:
        untrusted.close()
    # plain text to the TLS port: no reply a client could take for a chunk
    plain = tier_for(valkey_tls.url.replace("rediss://", "redis://"), timeout_s=TIMEOUT_S)
    try:
        assert read(plain, 2, key(3)) is None
    finally:
        plain.close()


def test_a_ca_file_is_refused_without_tls_or_without_certificates(tmp_path):
    pem = tmp_path / "ca.pem"
    pem.write_bytes(b"-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n")
    with pytest.raises(ValueError, match="rediss://"):
        RemoteTier("redis://127.0.0.1:1", ca_pem=read_ca_file(str(pem)), secret=SECRET)
    junk = tmp_path / "junk.pem"
    junk.write_bytes(b"not a certificate")
    with pytest.raises(ValueError, match="not a PEM file of certificates"):
        read_ca_file(str(junk))
    with pytest.raises(ValueError, match="cannot read --remote-ca-file"):
        read_ca_file(str(tmp_path / "missing.pem"))


def test_headers_are_read_ahead_in_one_batch_and_a_damaged_one_is_a_counted_miss(valkey):
    from lmshm.core.pool import Pool
    from lmshm.core.tiers.stack import TierStack
    tier = tier_for(valkey.url)
    try:
        datas = [payload(i) for i in range(5)]
        for i, data in enumerate(datas):
            assert tier.put(4, key(i), META, memoryview(data))
        command(valkey.port, "SETRANGE", tier.remote_key(4, key(2)), "0", "garbage!")   # no longer a header
        metas = tier.heads(4, [key(i) for i in range(7)])
        assert metas[:2] == [META, META] and metas[2] is None and metas[3:5] == [META, META]
        assert metas[5:] == [None, None] and tier.stats.snapshot()["corrupt"] == 1
        assert tier.contains(4, [key(0), key(1), key(2), key(3)]) == 2
        calls = []
        real = tier.heads
        tier.heads = lambda uid, keys: calls.append(list(keys)) or real(uid, keys)
        pool = Pool(4 << 20)
        stack = TierStack(pool, [tier], queue_limit=4, timeout_s=2.0)
        try:
            held = stack.promote(4, [[key(0), key(1), key(3)]], time.monotonic() + 2)
            assert len(held.held) == 3 and calls == [[key(0), key(1), key(3)]]   # one batch for the LOOKUP
            held.release()
        finally:
            stack.close()
            pool.release()
    finally:
        tier.close()


BIG = ChunkMeta(nbytes=(9 << 20) + 4096, layout=b"L" * 16, blocks=2)


@pytest.mark.parametrize("signed", [False, True], ids=["checksum", "mac"])
def test_a_large_value_reads_back_equal_and_damage_anywhere_or_another_length_is_a_miss(valkey, signed):
    tier = tier_for(valkey.url, timeout_s=5, **signing(signed))
    try:
        data = os.urandom(BIG.nbytes)
        assert tier.put(1, key(40), BIG, memoryview(data))
        for framed in (False, True):
            assert read(tier, 1, key(40), framed) == data
        rkey = tier.remote_key(1, key(40))
        good = bytes(tier._get_client().get(rkey))
        size = HEADER_BYTES + BIG.nbytes
        for at in (100, HEADER_BYTES + 10, size // 2 + 7, size - 3):      # a flipped byte anywhere
            command(valkey.port, "SET", rkey, good[:at] + bytes([good[at] ^ 1]) + good[at + 1:], timeout_s=20)
            assert read(tier, 1, key(40)) is None and read(tier, 1, key(40), framed=True) is None
        for bad in (good[:-1], good + b"x"):
            command(valkey.port, "SET", rkey, bad, timeout_s=20)
            assert read(tier, 1, key(40)) is None and read(tier, 1, key(40), framed=True) is None
        s = tier.stats.snapshot()
        assert s["corrupt"] == 12 and s["errors"] == 0 and s["timeouts"] == 0, s
        command(valkey.port, "SET", rkey, good, timeout_s=20)
        assert read(tier, 1, key(40), framed=True) == data      # the connection closed on a refusal is replaced
    finally:
        tier.close()


@pytest.mark.parametrize("how", ["xxh3", "blake2b", "crc32", "aes-gmac", "blake3"])
def test_a_mac_or_checksum_taken_piece_by_piece_is_the_one_taken_whole_and_damage_still_fails(how):
    from lmshm.core.tiers.integrity import checksum_algorithm
    from lmshm.core.tiers.remote.value import MACS, BadValue, Streamed, encode_header
    secret = SECRET if how in MACS else None
    data = memoryview(os.urandom((3 << 20) + 17))
    meta = ChunkMeta(len(data), b"L" * 16, 1)
    head = encode_header(1, key(1), meta, 2 if secret else checksum_algorithm(how), secret, data,
                         mac=MACS.get(how, MACS["aes-gmac"]))
    value = memoryview(bytearray(head + bytes(data)))
    for step in (1000, 400 << 10, len(value)):              # pieces of any size, the header's included
        stream = Streamed(value, secret)
        for filled in [*range(0, len(value), step), len(value)]:
            stream(filled)
        assert stream.taken is not None, "the header named a MAC or checksum that was not taken"
        assert bytes(check_value(value, 1, key(1), secret, stream.taken)[1]) == bytes(data)
    half = Streamed(value, secret)
    half(len(value) // 2)
    assert half.taken is None                               # cut short: nothing to compare
    value[len(value) // 2] ^= 1
    stream = Streamed(value, secret)
    stream(len(value))
    with pytest.raises(BadValue):
        check_value(value, 1, key(1), secret, stream.taken)


@pytest.mark.parametrize("signed", [False, True], ids=["checksum", "mac"])
def test_a_run_of_large_values_is_checked_a_piece_at_a_time_as_it_arrives(valkey, signed):
    """Values longer than ``resp.PIECE`` are received in pieces, and their MAC or checksum is
    taken on each piece right after it arrived (still in the CPU's cache), not over the whole
    value afterwards; damage in any piece is still refused."""
    from lmshm.core.tiers.remote import resp, value
    tier = tier_for(valkey.url, timeout_s=5, **signing(signed))
    meta = ChunkMeta(nbytes=3 * resp.PIECE + 100, layout=b"L" * 16, blocks=2)
    updates: list[int] = []
    real = value.Streamed._start

    def counting(self):
        real(self)
        inner = self.update
        self.update = lambda piece: updates.append(len(piece)) or inner(piece)
    try:
        datas = [os.urandom(meta.nbytes) for _ in range(3)]
        for i, data in enumerate(datas):
            assert tier.put(1, key(70 + i), meta, memoryview(data))
        frames = [memoryview(bytearray(HEADER_BYTES + meta.nbytes)) for _ in range(3)]
        jobs = [(key(70 + i), meta, f[HEADER_BYTES:], f) for i, f in enumerate(frames)]
        value.Streamed._start = counting
        assert tier.get_run_into(1, jobs) == 3
        assert [bytes(f[HEADER_BYTES:]) for f in frames] == datas
        assert len(updates) >= 3 * 4 and max(updates) <= resp.PIECE, updates
        assert sum(updates) == 3 * meta.nbytes
        flip_byte(valkey.port, tier.remote_key(1, key(71)), HEADER_BYTES + 2 * resp.PIECE + 9)
        assert tier.get_run_into(1, jobs) == 1              # stops at the damage in its third piece
        assert tier.stats.snapshot()["corrupt"] == 1
    finally:
        value.Streamed._start = real
        tier.close()


def test_a_cluster_slot_map_gone_stale_is_followed_by_moved_and_reread(valkey_cluster):
    tier = tier_for(valkey_cluster.url)
    try:
        keys = [key(i) for i in range(12)]
        for i, k in enumerate(keys):
            assert tier.put(1, k, META, memoryview(payload(i)))
        assert all(read(tier, 1, k) is not None for k in keys)
        moved = []
        real_moved = tier._moved
        tier._moved = lambda m, asked: moved.append(m) or real_moved(m, asked)
        wrong = valkey_cluster.nodes[0]
        tier.slots.by_slot = {s: ("127.0.0.1", wrong.port) for s in range(16384)}    # every slot on one node
        tier.slots.read_at = 0
        assert tier.heads(1, keys) == [META] * len(keys)        # each MOVED key asked again at its node
        tier.slots.by_slot = {s: ("127.0.0.1", wrong.port) for s in range(16384)}
        tier.slots.read_at = 0
        assert all(read(tier, 1, k) is not None for k in keys)
        s = tier.stats.snapshot()
        assert s["errors"] == 0 and s["corrupt"] == 0, s
        assert len(set(tier.slots.by_slot.values())) == 3, "the slot map was not read again"
        assert moved, "no MOVED was seen: the test did not exercise a stale map"
    finally:
        tier.close()


class HostileServer:
    """A TCP server on loopback that answers every request on every connection with ``reply``
    (bytes, sent as they are, then nothing more; ``close`` after it closes the connection)."""

    def __init__(self, reply: bytes, close: bool = False) -> None:
        import socket
        import threading
        self.reply, self.close_after = reply, close
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.conns: list = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        import threading
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn) -> None:
        try:
            while conn.recv(65536):
                conn.sendall(self.reply)
                if self.close_after:
                    conn.close()
                    return
        except OSError:
            return

    def stop(self) -> None:
        self.sock.close()
        for c in self.conns:
            c.close()


HOSTILE = {
    "a huge length": (b"$99999999999\r\n", False, "corrupt"),
    "another length": (b"$%d\r\n" % (HEADER_BYTES + META.nbytes + 1), False, "corrupt"),
    "a huge array": (b"*99999999999\r\n", False, "errors"),
    "an endless line": (b"$" + b"9" * (1 << 20), False, "errors"),
    "half a value, then silence": (b"$%d\r\n" % (HEADER_BYTES + META.nbytes) + b"x" * 1000, False, "timeouts"),
    "half a value, then a close": (b"$%d\r\n" % (HEADER_BYTES + META.nbytes) + b"x" * 1000, True, "errors"),
    "a status for a value": (b"+OK\r\n", False, "errors"),
    # given time to parse it all (3 s), its 200,000 ints would take 8 MB: refused at its bound
    "a wide, deep array": (b"*65536\r\n" * 3 + b":100000000001\r\n" * 200_000, False, "errors", 3.0),
    "garbage": (b"\x00\xff" * 64 + b"\r\n", False, "errors"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_hostile_server_cannot_make_a_read_hang_allocate_or_pass(case):
    """A server that answers anything at all: every read is a miss within the timeout, counted,
    with nothing of the bogus reply allocated, and the next read opens a new connection."""
    import tracemalloc
    reply, close, counter, timeout_s = (HOSTILE[case] + (TIMEOUT_S,))[:4]
    server = HostileServer(reply, close)
    tier = tier_for(f"redis://127.0.0.1:{server.port}", insecure_unsigned=True, timeout_s=timeout_s)
    try:
        frame = memoryview(bytearray(HEADER_BYTES + META.nbytes))
        tracemalloc.start()
        t0 = time.monotonic()
        assert tier.heads(1, [key(1), key(2)]) == [None, None]
        assert tier.get_into(1, key(1), META, frame[HEADER_BYTES:], frame) is False
        took = time.monotonic() - t0
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert took < 2 * timeout_s + 0.5, f"{case}: the reads took {took:.2f} s"
        assert peak < 4 << 20, f"{case}: {peak >> 20} MiB allocated for a bogus reply"
        s = tier.stats.snapshot()
        assert s[counter] >= 1, (case, s)
        assert all(c.closed for c in tier._conns), "a connection left in an unknown state stayed open"
    finally:
        tier.close()
        server.stop()


@pytest.mark.parametrize("close", [False, True], ids=["silence", "close"])
def test_a_large_value_cut_short_is_a_miss_within_the_timeout(close):
    """A value of WAITALL_FROM or more is received by one call that waits for all of it: a
    server that sends part of one and then stops, or closes, still ends the read within the
    timeout (SO_RCVTIMEO bounds the wait), counted, the connection closed."""
    import tracemalloc

    from lmshm.core.tiers.remote import resp
    meta = ChunkMeta(nbytes=4 * resp.WAITALL_FROM, layout=b"L" * 16, blocks=8)
    size = HEADER_BYTES + meta.nbytes
    server = HostileServer(b"$%d\r\n" % size + b"x" * (resp.WAITALL_FROM + 12345), close)
    tier = tier_for(f"redis://127.0.0.1:{server.port}", insecure_unsigned=True)
    try:
        frame = memoryview(bytearray(size))
        tracemalloc.start()
        t0 = time.monotonic()
        assert tier.get_into(1, key(1), meta, frame[HEADER_BYTES:], frame) is False
        took = time.monotonic() - t0
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert took < 2 * TIMEOUT_S + 0.5, f"the read took {took:.2f} s"
        assert peak < 1 << 20, f"{peak} bytes allocated for a cut value"
        assert tier.stats.snapshot()["errors" if close else "timeouts"] == 1, tier.stats.snapshot()
        assert all(c.closed for c in tier._conns)
    finally:
        tier.close()
        server.stop()


@pytest.mark.parametrize("signed", [False, True], ids=["checksum", "mac"])
@pytest.mark.parametrize("framed", [False, True], ids=["slot", "framed"])
def test_a_run_of_chunks_is_asked_for_at_once_and_read_up_to_the_first_unsound_one(valkey, signed, framed):
    from lmshm.core.tiers.remote import resp
    tier = tier_for(valkey.url, **signing(signed))
    try:
        datas = [payload(i) for i in range(6)]
        for i, data in enumerate(datas):
            assert tier.put(1, key(i), META, memoryview(data))
        frames = [memoryview(bytearray(HEADER_BYTES + META.nbytes)) for _ in range(6)]

        def jobs(keys):
            return [(k, META, f[HEADER_BYTES:], f if framed else None) for k, f in zip(keys, frames)]
        sent = []
        real = resp.Connection.request_gets
        resp.Connection.request_gets = lambda conn, keys: sent.append(len(keys)) or real(conn, keys)
        try:
            assert tier.get_run_into(1, jobs([key(i) for i in range(6)])) == 6
            assert sent == [6], "the run was not asked for in one round trip"
            assert [bytes(f[HEADER_BYTES:]) for f in frames] == datas
            flip_byte(valkey.port, tier.remote_key(1, key(3)), HEADER_BYTES + 5)
            assert tier.get_run_into(1, jobs([key(i) for i in range(6)])) == 3      # stops at the damage
            assert tier.stats.snapshot()["corrupt"] == 1
            assert tier.get_run_into(1, jobs([key(0), key(1), key(60), key(2)])) == 2   # stops at a missing key
            assert tier.get_run_into(1, jobs([key(4), key(5)])) == 2        # a new connection after each stop
            assert [bytes(f[HEADER_BYTES:]) for f in frames[:2]] == datas[4:6]
        finally:
            resp.Connection.request_gets = real
        s = tier.stats.snapshot()
        assert s["corrupt"] == 1 and s["errors"] == 0 and s["timeouts"] == 0, s
    finally:
        tier.close()


def test_a_run_a_cluster_spreads_over_nodes_is_read_chunk_by_chunk(valkey_cluster):
    tier = tier_for(valkey_cluster.url)
    try:
        datas = [payload(i) for i in range(8)]
        for i, data in enumerate(datas):
            assert tier.put(1, key(i), META, memoryview(data))
        frames = [memoryview(bytearray(META.nbytes)) for _ in range(8)]
        assert len({tier._node(tier.remote_key(1, key(i))) for i in range(8)}) > 1
        assert tier.get_run_into(1, [(key(i), META, frames[i], None) for i in range(8)]) == 8
        assert [bytes(f) for f in frames] == datas
    finally:
        tier.close()


def test_the_slot_map_routes_by_hash_tag_notes_a_moved_slot_at_once_and_rereads_at_most_each_second():
    """``SlotMap`` alone, with a fake ``CLUSTER SLOTS``: a key goes to its slot's node (a hash
    tag decides the slot), a seed until the map is read; a MOVED is noted before the map is
    read again, and the map is read at most once per ``SLOTS_REFRESH_S``."""
    from lmshm.core.tiers.remote.slots import SlotMap, key_slot

    seeds = (("10.0.0.1", 7000), ("10.0.0.2", 7000))
    asked = []

    def ask(node):
        asked.append(node)
        if node == seeds[0]:
            return None                                 # the first seed is down
        return {s: ("" if s < 8192 else "10.0.0.3", 7000) for s in range(16384)}
    slots = SlotMap(seeds, ask)
    assert key_slot(b"{user1}:a") == key_slot(b"{user1}:b") == key_slot(b"user1")
    low = next(k for k in (b"k%d" % i for i in range(100)) if key_slot(k) < 8192)
    high = next(k for k in (b"k%d" % i for i in range(100)) if key_slot(k) >= 8192)
    assert slots.node(low) == seeds[1]                  # "" is the node that answered
    assert slots.node(high) == ("10.0.0.3", 7000) and asked == list(seeds)
    assert slots.moved((key_slot(low), "10.0.0.9", 7001), seeds[1]) == ("10.0.0.9", 7001)
    assert slots.node(low) == ("10.0.0.9", 7001) and len(asked) == 2, "read again within a second"
