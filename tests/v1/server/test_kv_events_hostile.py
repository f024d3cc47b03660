"""Hostile peers of ``lmshm-server --kv-events``: subscribers and replay requesters that send
too much, never read, or only hold connections. Real servers, real ZMQ and TCP peers; what is
measured is the server process's RSS and fd count (``/proc``)."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Optional

import msgspec
import pytest
import zmq
from attacks import need_fds
from harness import PrefixedServerProcess, assert_an_honest_worker_registers, proc_fd_count, wait_for
from test_kv_events_stream import NODE, Sub, _advert, _events_server, _free_port, _metrics, _rss, _settled, engines  # noqa: F401 (engines: a fixture)

from lmshm.wire import protocol


def _subscribe_flood(endpoint: str, count: int, size: int = 3990) -> zmq.Socket:
    """A SUB that sends ``count`` distinct subscriptions of ``size`` bytes (libzmq keeps them all)."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.connect(endpoint)
    for i in range(count):
        sock.setsockopt(zmq.SUBSCRIBE, i.to_bytes(4, "big") * (size // 4))
    return sock


def test_a_subscriber_that_sends_thousands_of_subscriptions_is_dropped_and_the_server_stays_small(
        start_server, engines):
    http = _free_port()
    server, pub, _ = _events_server(start_server, "--http-port", str(http), replay=False)
    reader = Sub(pub)
    floods = []
    try:
        time.sleep(0.3)
        before = _rss(server.proc.pid)
        # 3 peers x 8,000 subscriptions of 1,000 bytes: 24 MB sent; libzmq's trie keeps ~170x that
        engine = engines(server.url)
        for _ in range(3):
            floods.append(_subscribe_flood(pub, 8000, 1000))
        for i in range(30):             # the PUB takes subscriptions in when it sends
            engine.store([_advert(100 + i)])
            time.sleep(0.1)
        grown = _rss(server.proc.pid) - before
        m = _metrics(http)
        engine.store([_advert(7)])
        wait_for(lambda: any(e.get("block_hashes") == [1007] for e in reader.events()), 10,
                 what="the stream at an honest subscriber after the flood")
    finally:
        for s in floods:
            s.close()
        reader.close()
    assert grown < 48 << 20, f"the server grew {grown / 2**20:.0f} MiB under 24 MB of subscriptions"
    assert m["lmshm_kv_events_subscribers_dropped"] >= 3, m
    text = urllib.request.urlopen(f"http://127.0.0.1:{http}/metrics", timeout=10).read().decode()
    names = [line.split()[0] for line in text.splitlines() if line.startswith("lmshm_kv_events")]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)


def _hold(port: int, n: int) -> list[socket.socket]:
    """``n`` idle TCP connections to ``port`` (whatever the server does with them)."""
    held = []
    for _ in range(n):
        s = socket.socket()
        s.setblocking(False)
        try:
            s.connect(("127.0.0.1", port))
        except BlockingIOError:
            pass
        held.append(s)
    return held


@pytest.mark.parametrize("target", ["pub", "replay"])
def test_idle_connections_to_an_event_endpoint_cannot_take_the_servers_fds(tmp, target):
    need_fds(2600)
    pub_port, replay_port = _free_port(), _free_port()
    server = PrefixedServerProcess(tmp, "--capacity", "64MiB", "--kv-events", f"tcp://*:{pub_port}",
                                   "--kv-events-replay", f"tcp://127.0.0.1:{replay_port}",
                                   prefix=["prlimit", "--nofile=1024:1024"])
    held: list[socket.socket] = []
    try:
        reader = Sub(f"tcp://127.0.0.1:{pub_port}")
        base = proc_fd_count(server.proc.pid)
        for _ in range(11):                 # 1,100 connections, 100 at a time
            held += _hold(pub_port if target == "pub" else replay_port, 100)
            time.sleep(0.05)
        time.sleep(1)
        fds = proc_fd_count(server.proc.pid)
        assert_an_honest_worker_registers(server.url, server_pid=server.proc.pid)
        reader.close()
    finally:
        for s in held:
            s.close()
        rc = server.stop()
    assert rc == 0, server.log()
    assert fds < base + 64 + 32, f"{fds} fds open (from {base}) under 1,100 idle connections"


def _stuck_requester(endpoint: str) -> zmq.Socket:
    """A DEALER that asks for a replay from seq 0 and never reads the answer."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 1)
    sock.setsockopt(zmq.RCVBUF, 4096)
    sock.connect(endpoint)
    sock.send_multipart([b"", (0).to_bytes(8, "big")])
    return sock


def test_replay_requesters_that_never_read_hold_no_copies_of_the_buffer(start_server, engines):
    http = _free_port()
    server, pub, replay = _events_server(start_server, "--max-objects", "4096", "--kv-events-buffer", "65536",
                                         "--http-port", str(http))
    engine = engines(server.url, blocks=64)
    for k in range(48):     # 48 STOREs of 64 chunks of 1,024 engine blocks: ~28 MiB of batches
        first = [(1 << 40) + ((k * 64 + i) << 10) for i in range(64)]
        engine.store([protocol.Advert(k.to_bytes(4, "big") + bytes([i]) * 28, 0, 16,
                                      list(range(first[i], first[i] + 1024))) for i in range(64)])
    wait_for(lambda: _metrics(http)["lmshm_kv_events_replay_buffered"] >= 48, 20, what="the replay buffer")
    buffered = _settled(http)["lmshm_kv_events_published_bytes"]   # the index applies adverts in steps
    time.sleep(0.5)
    before = _rss(server.proc.pid)
    stuck = [_stuck_requester(replay) for _ in range(16)]
    try:
        wait_for(lambda: _metrics(http)["lmshm_kv_events_replay_batches"] >= 16 * 8, 20,
                 what="replays under way")
        time.sleep(2)
        grown = _rss(server.proc.pid) - before
    finally:
        for s in stuck:
            s.close()
    assert buffered > 16 << 20, f"only {buffered / 2**20:.1f} MiB to replay: 16 copies would not show"
    assert grown < 48 << 20, f"16 requesters that never read grew the server by {grown / 2**20:.0f} MiB"


def test_a_subscriber_that_never_reads_holds_at_most_its_byte_budget_at_the_default_hwm(start_server, engines):
    http = _free_port()
    server, pub, _ = _events_server(start_server, "--max-objects", "4", "--kv-events-subscriber-bytes", "4MiB",
                                    "--kv-events-buffer", "1024", "--http-port", str(http), replay=False)
    ctx = zmq.Context()
    stuck = ctx.socket(zmq.SUB)            # subscribes, then never reads
    stuck.setsockopt(zmq.LINGER, 0)
    stuck.setsockopt(zmq.RCVHWM, 1)
    stuck.setsockopt(zmq.RCVBUF, 4096)
    stuck.setsockopt(zmq.SUBSCRIBE, b"")
    stuck.connect(pub)
    try:
        engine = engines(server.url, blocks=64)

        def store(k: int) -> None:      # 64 chunks of 1024 engine blocks: ~600 KiB of events
            first = [(1 << 40) + ((k * 64 + i) << 10) for i in range(64)]
            engine.store([protocol.Advert(k.to_bytes(4, "big") + bytes([i]) * 28, 0, 16,
                                          list(range(first[i], first[i] + 1024))) for i in range(64)])

        for k in range(20):
            store(k)
            if k % 4 == 3:
                _settled(http)
        sent_before = _settled(http)["lmshm_kv_events_published_bytes"]
        before = _rss(server.proc.pid)
        for k in range(20, 200):        # ~55 MiB more, at --kv-events-hwm's default (10,000 batches)
            store(k)
            if k % 4 == 3:              # paced: the log (--kv-events-buffer 1024 records) keeps what the publisher has not read yet
                _settled(http)
        m = _settled(http)
        grown = _rss(server.proc.pid) - before
    finally:
        stuck.close()
        ctx.term()
    sent = m["lmshm_kv_events_published_bytes"] - sent_before
    assert sent >= 40 << 20, f"only {sent / 2**20:.1f} MiB published"
    assert grown < 16 << 20, f"the server grew {grown / 2**20:.1f} MiB while {sent / 2**20:.1f} MiB went out"
    assert m["lmshm_kv_events_dropped"] >= 1


def _listening_hosts(pid: int, port: int) -> set[str]:
    """Local addresses the process ``pid`` listens on at TCP ``port`` (from /proc/net/tcp{,6})."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    hosts = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in list(f)[1:]:
                cols = line.split()
                addr, lport = cols[1].split(":")
                if cols[3] == "0A" and int(lport, 16) == port and cols[9] in inodes:
                    hosts.add(addr)
    return hosts


def test_a_tcp_event_endpoint_binds_the_host_it_names_and_no_other(start_server):
    port = _free_port()
    server = start_server("--capacity", "64MiB", "--kv-events", f"tcp://127.0.0.1:{port}")
    wait_for(lambda: _listening_hosts(server.proc.pid, port), 10, what="the PUB's listener")
    assert _listening_hosts(server.proc.pid, port) == {"0100007F"}     # 127.0.0.1, nothing else


def test_the_stream_carries_no_cache_salt_and_no_tokens_of_a_salted_chain(start_server, engines):
    server, pub, _ = _events_server(start_server, replay=False)
    sub = Sub(pub)
    try:
        engine = engines(server.url)
        salted = protocol.Advert(b"s" * 32, 0, 2, [5000], None, [11, 12],
                                 extra_keys=msgspec.msgpack.encode([["secret-salt-42"]]))
        child = protocol.Advert(b"c" * 32, 0, 2, [5001], 5000, [13, 14])
        plain = protocol.Advert(b"p" * 32, 0, 2, [6000], None, [21, 22])
        engine.store([salted, child, plain])
        wait_for(lambda: len([e for e in sub.events() if e["type"] == "BlockStored"]) >= 3, 10,
                 what="three BlockStored")
        stored = {tuple(e["block_hashes"]): e for e in sub.events() if e["type"] == "BlockStored"}
        raw = b"".join(p for _, _, p in sub.frames)
    finally:
        sub.close()
    assert b"secret-salt-42" not in raw
    assert not stored[(5000,)]["token_ids"] and not stored[(5000,)].get("extra_keys")
    assert not stored[(5001,)]["token_ids"]                   # the salted chain's next block too
    assert stored[(6000,)]["token_ids"] == [21, 22]           # an unsalted chain keeps its tokens


def _curve_sub(endpoint: str, server_public: bytes, keys: Optional[tuple[bytes, bytes]]) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = server_public, *keys
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(endpoint)
    return sock


@pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CURVE")
def test_with_curve_only_an_admitted_client_key_receives_the_stream(start_server, engines):
    scratch = Path(tempfile.mkdtemp(prefix="lmshm-curve-"))
    try:
        _curve_stream(start_server, engines, scratch)
    finally:
        shutil.rmtree(scratch)


def _curve_stream(start_server, engines, scratch: Path) -> None:
    from zmq.auth import create_certificates, load_certificate

    keys, clients = scratch / "keys", scratch / "clients"
    keys.mkdir()
    clients.mkdir()
    create_certificates(keys, "server")
    create_certificates(clients, "router")
    create_certificates(keys, "stranger")
    server_public, _ = load_certificate(keys / "server.key")
    router = load_certificate(clients / "router.key_secret")
    stranger = load_certificate(keys / "stranger.key_secret")
    server, pub, _ = _events_server(start_server, "--kv-events-curve-secret", str(keys / "server.key_secret"),
                                    "--kv-events-curve-clients", str(clients), replay=False)
    subs = {name: _curve_sub(pub, server_public, k) for name, k in
            (("router", router), ("stranger", stranger), ("plain", None))}
    try:
        time.sleep(1)
        engine = engines(server.url)
        got = {name: [] for name in subs}
        for i in range(20):
            engine.store([_advert(100 + i)])
            for name, s in subs.items():
                while s.poll(50):
                    got[name].append(s.recv_multipart())
            if got["router"]:
                break
    finally:
        for s in subs.values():
            s.close()
    assert got["router"], "the admitted client got nothing"
    assert not got["stranger"] and not got["plain"], {k: len(v) for k, v in got.items()}


def test_garbage_huge_frames_and_a_request_flood_leave_the_stream_and_replay_serving(start_server, engines):
    http = _free_port()
    server, pub, replay = _events_server(start_server, "--http-port", str(http))
    pub_port, replay_port = int(pub.rpartition(":")[2]), int(replay.rpartition(":")[2])
    engine = engines(server.url, blocks=64)
    engine.store([_advert(1)])
    for k in range(8):      # ~2.5 MiB more to replay: a requester that never reads fills its socket
        first = [(1 << 40) + ((k * 64 + i) << 10) for i in range(64)]
        engine.store([protocol.Advert(k.to_bytes(4, "big") + bytes([i]) * 28, 0, 16,
                                      list(range(first[i], first[i] + 1024))) for i in range(64)])
    reader = Sub(pub)
    junk: list = []
    try:
        before_fds, before_rss = proc_fd_count(server.proc.pid), _rss(server.proc.pid)
        for port in (pub_port, replay_port):
            for _ in range(10):                     # garbage instead of a greeting
                s = socket.create_connection(("127.0.0.1", port))
                s.sendall(os.urandom(64 << 10))
                junk.append(s)
            s = socket.create_connection(("127.0.0.1", port))   # a greeting, then a 2**62-byte frame header
            s.sendall(b"\xff" + b"\x00" * 8 + b"\x7f" + bytes([3, 0]) + b"NULL".ljust(20, b"\x00") + b"\x00" * 32)
            s.sendall(b"\x02" + (1 << 62).to_bytes(8, "big") + b"x" * 4096)
            junk.append(s)
        flood = zmq.Context.instance().socket(zmq.DEALER)      # 2,000 requests, never reads an answer
        flood.setsockopt(zmq.LINGER, 0)
        flood.setsockopt(zmq.RCVHWM, 1)
        flood.setsockopt(zmq.RCVBUF, 4096)
        flood.setsockopt(zmq.SNDHWM, 0)
        flood.connect(replay)
        for _ in range(2000):
            flood.send_multipart([b"", (0).to_bytes(8, "big")])
        junk.append(flood)
        time.sleep(1)
        engine.store([_advert(2)])
        wait_for(lambda: any(e.get("block_hashes") == [1002] for e in reader.events()), 10,
                 what="the stream at an honest subscriber")
        from test_kv_events_stream import _replay
        t0 = time.monotonic()
        got = _replay(replay, [b"", (0).to_bytes(8, "big")], timeout_s=30)
        waited = time.monotonic() - t0
        fds, grown = proc_fd_count(server.proc.pid), _rss(server.proc.pid) - before_rss
    finally:
        for s in junk:
            s.close()
        reader.close()
    assert server.alive
    assert any(decode_seq_payload_has(p, 1001) for _, _, p in got)
    assert waited < 3, f"an honest replay waited {waited:.1f} s behind one requester's flood"
    assert fds < before_fds + 40 and grown < 32 << 20, (fds, before_fds, grown)


def decode_seq_payload_has(payload: bytes, block_hash: int) -> bool:
    from lmshm.core.kv_events import decode_batch
    return any(e.get("block_hashes") == [block_hash] for e in decode_batch(payload)[1])


def test_a_salted_chain_whose_root_this_run_never_saw_goes_out_without_tokens(start_server, engines):
    """The scrub failed open: a block whose parent the publisher did not remember as salted went
    out with its tokens. That is every continuation of a salted chain whose first blocks were
    stored before a restart, on another node, or more than 65,536 salted blocks ago; and another
    namespace could advertise the salted parent's hash as an unsalted root of its own."""
    server, pub, _ = _events_server(start_server, replay=False)
    sub = Sub(pub)
    try:
        victim, other = engines(server.url), engines(server.url)
        # the victim's salted root 5000 was stored before this run; only its continuation is new
        victim.store([protocol.Advert(b"a" * 32, 0, 2, [5001], 5000, [31, 32])])
        # another namespace advertises the victim's salted hash 7000 as an unsalted root of its own
        other.store([protocol.Advert(b"o" * 32, 0, 2, [7000], None, [41, 42])], space=b"T")
        victim.store([protocol.Advert(b"s" * 32, 0, 2, [7000], None, [51, 52],
                                      extra_keys=msgspec.msgpack.encode([["salt-7"]])),
                      protocol.Advert(b"b" * 32, 0, 2, [7001], 7000, [53, 54])])
        plain = [_advert(1), _advert(2, 1001)]          # an unsalted chain seen from its root
        victim.store(plain)
        wait_for(lambda: len([e for e in sub.events() if e["type"] == "BlockStored"]) >= 6, 10,
                 what="six BlockStored")
        stored = {}
        for e in sub.events():
            if e["type"] == "BlockStored":
                stored.setdefault(tuple(e["block_hashes"]), []).append(e)
    finally:
        sub.close()
    assert not stored[(5001,)][0]["token_ids"], stored[(5001,)]     # its parent unknown: no tokens
    assert not stored[(7001,)][0]["token_ids"], stored[(7001,)]     # salted in its own namespace
    assert [e["token_ids"] for e in stored[(7000,)]] == [[41, 42], []]
    assert stored[(1002,)][0]["token_ids"] == [4, 5]                # an unsalted chain keeps them


_FOREIGN_SUB = r"""
import socket, sys, time
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect("\0" + sys.argv[1])
ready = b"\x05READY\x0bSocket-Type\x00\x00\x00\x03SUB"
try:        # the server may shut a foreign uid's connection before its greeting is all sent
    s.sendall(b"\xff" + b"\0" * 8 + b"\x7f\x03\x01" + b"NULL".ljust(20, b"\0") + b"\0" * 32 + bytes((4, len(ready))) + ready)
except OSError:
    print("closed", 0); sys.exit()
s.setblocking(False)
sent, i, out, end = 0, 0, b"", time.monotonic() + 3
quiet = len(sys.argv) > 2      # only wait to be refused
while time.monotonic() < end:       # distinct 1,000-byte subscriptions, as fast as they are taken
    try:
        if s.recv(65536) == b"":
            break
    except BlockingIOError:
        pass
    except OSError:
        break
    if quiet:
        time.sleep(0.01); continue
    if not out:
        out, i = b"\x02" + (1001).to_bytes(8, "big") + b"\x01" + i.to_bytes(4, "big") * 250, i + 1
    try:
        n = s.send(out)
        sent, out = sent + n, out[n:]
    except BlockingIOError:
        time.sleep(0.01)
    except OSError:
        break
else:
    print("open", sent); sys.exit()
print("closed", sent)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs another uid for the subscriber (root)")
def test_an_abstract_ipc_endpoint_admits_no_peer_of_another_uid(start_server, engines):
    """``ipc://@NAME`` has no file and no mode: any uid on the host can connect, and ipc peers
    were never counted in bytes (``ipc://PATH`` is 0600: only the server's uid). A SUB of
    another uid could send subscriptions without end, libzmq keeping ~170 bytes each."""
    import subprocess
    name = f"lmshm-test-{os.getpid()}-{time.monotonic_ns()}"
    server = start_server("--capacity", "64MiB", "--kv-events", f"ipc://@{name}", "--kv-events-node", NODE)
    honest = Sub(f"ipc://@{name}")
    try:
        # a python nobody may run (the venv's may be under a home it cannot enter)
        python = next((p for p in ("/usr/bin/python3", "/usr/local/bin/python3") if os.path.exists(p)), None)
        if python is None:
            pytest.skip("no system python3 for another uid")
        out = subprocess.run([python, "-c", _FOREIGN_SUB, name, "quiet"], user=65534, group=65534, cwd="/",
                             capture_output=True, text=True, timeout=30)
        engines(server.url).store([_advert(3)])
        wait_for(lambda: any(e.get("block_hashes") == [1003] for e in honest.events()), 10,
                 what="the stream at a subscriber of the server's uid")
    finally:
        honest.close()
    assert out.stdout.split()[:1] == ["closed"], (out.stdout, out.stderr)


def test_requesters_on_many_connections_that_never_read_do_not_hold_an_honest_replay(start_server, engines):
    """One replay per requester stops one connection's flood; 48 connections (48 identities,
    under the 64 the ROUTER admits), each asking once and never reading, took the 16 replay
    slots three times over, each slot given up only after 5 s of a full queue."""
    http = _free_port()
    server, pub, replay = _events_server(start_server, "--http-port", str(http))
    engine = engines(server.url, blocks=64)
    engine.store([_advert(1)])
    for k in range(8):      # ~2.5 MiB more to replay: a requester that never reads fills its socket
        first = [(1 << 40) + ((k * 64 + i) << 10) for i in range(64)]
        engine.store([protocol.Advert(k.to_bytes(4, "big") + bytes([i]) * 28, 0, 16,
                                      list(range(first[i], first[i] + 1024))) for i in range(64)])
    wait_for(lambda: _metrics(http)["lmshm_kv_events_replay_buffered"] >= 9, 20, what="the replay buffer")
    stuck = [_stuck_requester(replay) for _ in range(48)]
    try:
        time.sleep(0.5)
        from test_kv_events_stream import _replay
        t0 = time.monotonic()
        got = _replay(replay, [b"", (0).to_bytes(8, "big")], timeout_s=30)
        waited = time.monotonic() - t0
    finally:
        for s in stuck:
            s.close()
    assert server.alive
    assert any(decode_seq_payload_has(p, 1001) for _, _, p in got)
    assert waited < 3, f"an honest replay waited {waited:.1f} s behind 48 requesters that never read"


@pytest.mark.parametrize("target", ["pub", "replay"])
def test_connections_that_never_finish_a_handshake_do_not_lock_out_an_honest_subscriber(start_server, engines,
                                                                                       target):
    """The 64-connection cap refused the newcomer: 64 TCP connections that never send a greeting
    (libzmq waits 30 s for a handshake, and the attacker then connects again) kept every honest
    subscriber or requester out, with CURVE too (a client without a key never finishes one)."""
    server, pub, replay = _events_server(start_server)
    port = int((pub if target == "pub" else replay).rpartition(":")[2])
    held = _hold(port, 64)
    try:
        time.sleep(0.5)
        engine = engines(server.url)
        t0 = time.monotonic()
        if target == "pub":
            reader = Sub(pub, wait=False)
            try:
                time.sleep(1)
                for i in range(5):      # 5 batches in a row (a refused SUB may catch one in a race)
                    engine.store([_advert(20 + i)])
                    time.sleep(0.1)
                wait_for(lambda: {1020, 1021, 1022, 1023, 1024} <= {
                    h for e in reader.events() for h in e.get("block_hashes") or []}, 4,
                    what="5 batches at an honest subscriber beside 64 idle connections")
            finally:
                reader.close()
        else:
            engine.store([_advert(1)])
            from test_kv_events_stream import _replay
            got = _replay(replay, [b"", (0).to_bytes(8, "big")], timeout_s=20)
            assert any(decode_seq_payload_has(p, 1001) for _, _, p in got)
        waited = time.monotonic() - t0
    finally:
        for s in held:
            s.close()
    assert waited < 5, f"an honest {target} peer waited {waited:.1f} s beside 64 idle connections"
