"""lmshm-server's limits: each one refuses with a message naming its setting, and the server
recovers once the pressure is gone (an honest client registers; fds and mappings come back)."""

from __future__ import annotations

import os
import resource
import socket
import subprocess
import sys
import time

import msgspec
import pytest
from harness import (
    OwnSegments,
    PrefixedServerProcess,
    RawSession,
    ServerProcess,
    assert_an_honest_worker_registers,
    assert_back_to,
    counters_come_back,
    proc_fd_count,
    server_counts,
    serving,
    shm_wrapper,
    wait_for,
)

from lmshm.platform.cpu.segments import create_segment
from lmshm.transport import fdchannel
from lmshm.transport.client import MPClient, query_status
from lmshm.transport.fdchannel import FdChannelClient, FdChannelError
from lmshm.wire import codec, protocol
from lmshm.wire.protocol import ErrorCode

ISOLATED = {"LMSHM_ISOLATED_IPC": "1"}


def _error(reply, code: ErrorCode, *needles: str) -> str:
    assert isinstance(reply, protocol.ErrorReply), reply
    assert reply.code == code, (ErrorCode(reply.code).name, reply.message)
    for needle in needles:
        assert needle in reply.message, reply.message
    return reply.message


def _hello_body(isolated: bool = False) -> bytes:
    return codec.encode(protocol.Hello(protocol_version=protocol.PROTOCOL_VERSION, isolated_ipc=isolated))


@pytest.fixture(scope="module")
def limited():
    with serving("--reap-timeout", "5", "--max-registrations-per-session", "2", "--max-layers-per-session", "8",
                 "--max-name-bytes", "32", "--max-pending-auth", "4") as server:
        yield server


@pytest.fixture
def baseline(limited):
    yield from counters_come_back(limited)


@pytest.fixture
def segments():
    made = OwnSegments(4096)
    yield made
    made.unlink_all()


# ---- per-session limits ----------------------------------------------------------------------


def test_a_third_registration_is_unavailable_naming_the_setting_until_one_is_unregistered(limited, baseline,
                                                                                          segments):
    with RawSession(limited.url) as s:
        for iid in ("r1", "r2"):
            assert isinstance(s.register(iid, shm_wrapper(segments().name, 4096)), protocol.RegisterReply)
        third = shm_wrapper(segments().name, 4096)
        _error(s.register("r3", third), ErrorCode.UNAVAILABLE, "--max-registrations-per-session")
        assert server_counts(limited.url)["mappings"] == 2
        assert isinstance(s.unregister("r1"), protocol.UnregisterReply)
        assert isinstance(s.register("r3", third), protocol.RegisterReply)
        for iid in ("r2", "r3"):
            s.unregister(iid)


def test_registering_more_layers_than_the_session_may_hold_is_refused(limited, baseline, segments):
    seg = segments(9 * 64)
    w = shm_wrapper(seg.name, 64)  # 32 float16 per layer, nine layers side by side
    w.segment_bytes = 9 * 64
    nine = protocol.LayerGroup(w, [f"l{i}" for i in range(9)], [32 * i for i in range(9)])
    eight = protocol.LayerGroup(w, [f"l{i}" for i in range(8)], [32 * i for i in range(8)])
    with RawSession(limited.url) as s:
        reply = s.request(protocol.RegisterKVCache("nine", "m", 1, 0, [nine]))
        _error(reply, ErrorCode.UNAVAILABLE, "9 layers", "--max-layers-per-session")
        assert server_counts(limited.url)["mappings"] == 0
        assert isinstance(s.request(protocol.RegisterKVCache("eight", "m", 1, 0, [eight])), protocol.RegisterReply)
        one_more = protocol.LayerGroup(shm_wrapper(segments().name, 4096), ["x"], [0])
        _error(s.request(protocol.RegisterKVCache("ninth", "m", 1, 0, [one_more])), ErrorCode.UNAVAILABLE,
               "--max-layers-per-session")
        s.unregister("eight")


@pytest.mark.parametrize("field", ["instance_id", "model_name", "layer_name"])
def test_a_name_one_byte_over_the_limit_is_refused_naming_max_name_bytes(limited, baseline, segments, field):
    seg = segments()
    names = {"instance_id": "i", "model_name": "m", "layer_name": "l0"}
    with RawSession(limited.url) as s:
        for value, ok in (("x" * 32, True), ("x" * 33, False), ("\u00e9" * 17, False)):  # 17 x 2 bytes = 34
            n = {**names, field: value}
            reply = s.request(protocol.RegisterKVCache(n["instance_id"], n["model_name"], 1, 0,
                                                       [protocol.LayerGroup(shm_wrapper(seg.name, 4096),
                                                                            [n["layer_name"]], [0])]))
            if ok:
                assert isinstance(reply, protocol.RegisterReply), reply
                s.unregister(n["instance_id"])
            else:
                _error(reply, ErrorCode.INVALID_ARG, "--max-name-bytes", "32 bytes")


def test_a_long_client_name_is_refused_at_hello(limited, baseline):
    body = codec.encode(protocol.Hello(protocol_version=protocol.PROTOCOL_VERSION, isolated_ipc=False,
                                       client_name="c" * 33))
    _error(_raw(limited.url, body), ErrorCode.INVALID_ARG, "client name", "--max-name-bytes")


def test_a_fifth_unauthenticated_fd_channel_connection_displaces_the_oldest(limited, baseline):
    # Past --max-pending-auth the oldest connection that has not authenticated gives way, so a
    # flood of such connections cannot lock a new worker out (issue 15, finding 8).
    conns = []
    try:
        for _ in range(4):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            s.connect(limited.fd_socket)
            conns.append(s)
        wait_for(lambda: proc_fd_count(limited.proc.pid) >= baseline["open_fds"] + 4, 3, 0.02, "accepts")
        fifth = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        conns.append(fifth)
        fifth.connect(limited.fd_socket)
        conns[0].settimeout(5)
        answer = msgspec.msgpack.decode(conns[0].recv(65536), type=fdchannel.Refused)
        assert answer.code == "UNAVAILABLE" and "displaced by a newer connection" in answer.error
        assert conns[0].recv(100) == b""
        # The other pending ones, and the newcomer, are still served: they authenticate fine.
        for conn in (conns[1], fifth):
            with RawSession(limited.url, verify=False) as honest:
                conn.settimeout(5)
                conn.send(msgspec.msgpack.encode({"op": "auth", "token": honest.hello.session_token}))
                assert isinstance(msgspec.msgpack.decode(conn.recv(65536), type=fdchannel.Ack), fdchannel.Ack)
                assert isinstance(honest.request(protocol.Ping()), protocol.Pong)
    finally:
        for s in conns:
            s.close()


def _raw(url: str, body: bytes):
    from harness import raw_reply

    return raw_reply(url, body)


# ---- sessions ----------------------------------------------------------------------------------


def test_the_fourth_hello_is_unavailable_under_max_sessions_3(start_server):
    server = start_server("--max-sessions", "3", "--auth-timeout", "1", "--reap-timeout", "5")
    before = server_counts(server.url)
    sessions = [RawSession(server.url) for _ in range(3)]  # verified: they keep their slots
    try:
        with pytest.raises(AssertionError, match="--max-sessions"):
            RawSession(server.url, verify=False)
        reply = _raw(server.url, _hello_body())
        _error(reply, ErrorCode.UNAVAILABLE, "holds 3 verified sessions", "--max-sessions")
        assert isinstance(_raw(server.url, codec.encode(protocol.Ping())), protocol.Pong)
    finally:
        for s in sessions:
            s.close()
    assert_back_to(server.url, before, fd_slack=1)
    with RawSession(server.url) as s:
        assert s.hello.session_id >= 4


def test_unverified_hellos_cannot_lock_a_worker_out(start_server):
    # An attacker fills every slot with HELLOs it never verifies; an honest worker still gets in,
    # because the oldest unverified session gives way.
    server = start_server("--max-sessions", "8", "--max-pending-auth", "4", "--auth-timeout", "2",
                          "--reap-timeout", "5")
    before = server_counts(server.url)
    squatters = [RawSession(server.url, verify=False) for _ in range(20)]
    try:
        assert server_counts(server.url)["sessions"] <= 4
        with RawSession(server.url) as honest:
            assert honest.hello.session_id > 20
            _error(honest.peek("nothing"), ErrorCode.NOT_FOUND, "no registration")
    finally:
        for s in squatters:
            s.close()
    assert "displaced by newer sessions" in server.log()
    assert_back_to(server.url, before, fd_slack=1, timeout_s=8)  # the last squatters expire (--auth-timeout)


def test_a_third_verified_session_of_one_uid_is_refused_at_auth(start_server):
    server = start_server("--max-sessions-per-uid", "2", "--auth-timeout", "1", "--reap-timeout", "5")
    before = server_counts(server.url)
    a, b = RawSession(server.url), RawSession(server.url)
    try:
        with RawSession(server.url, verify=False) as c:
            with pytest.raises(FdChannelError, match="--max-sessions-per-uid") as exc:
                FdChannelClient(c.hello.fd_socket, c.hello.session_token)
            assert exc.value.code == "UNAVAILABLE" and f"uid {os.geteuid()} already holds 2" in str(exc.value)
            _error(c.peek("x"), ErrorCode.PERMISSION_DENIED, "needs a verified identity")
    finally:
        a.close()
        b.close()
    assert_back_to(server.url, before, fd_slack=1)
    with RawSession(server.url), RawSession(server.url):
        pass  # once the two are gone, two more verify


def test_sending_more_fds_than_the_session_may_hold_is_refused_and_they_are_closed(start_server):
    server = start_server("--isolated-ipc", "--max-fds-per-session", "4", "--reap-timeout", "5")
    before = server_counts(server.url)
    made = [create_segment(4096, "memfd") for _ in range(5)]
    try:
        with RawSession(server.url, isolated=True) as s:
            fds_before = proc_fd_count(server.proc.pid)
            with pytest.raises(FdChannelError, match="--max-fds-per-session") as exc:
                s.link.send_fds({seg.name: seg.fd for seg, _ in made})
            assert exc.value.code == "UNAVAILABLE" and "would hold 5" in str(exc.value)
            assert server_counts(server.url)["inbox_fds"] == 0
            # (server_counts' own connection may still be open on the server's side for a moment)
            wait_for(lambda: proc_fd_count(server.proc.pid) <= fds_before, 5, 0.02, "the refused fds to be closed")
            # Four fit; the fifth in a second message does not; four register.
            s.link.send_fds({seg.name: seg.fd for seg, _ in made[:4]})
            with pytest.raises(FdChannelError, match="--max-fds-per-session"):
                s.link.send_fds({made[4][0].name: made[4][0].fd})
            assert server_counts(server.url)["inbox_fds"] == 4
            from lmshm.platform.cpu.wrappers import CpuFdIPCWrapper

            for i, (seg, _) in enumerate(made[:4]):
                assert isinstance(s.register(f"m{i}", shm_wrapper(seg.name, 4096, cls=CpuFdIPCWrapper)),
                                  protocol.RegisterReply)
            assert server_counts(server.url)["inbox_fds"] == 0
    finally:
        for seg, _ in made:
            seg.unlink()
    assert_back_to(server.url, before, fd_slack=1)


# ---- 2,000 sessions against a server limited to 1,024 open files ------------------------------


@pytest.mark.parametrize("endpoint", ["tcp", "ipc"])
def test_2000_sessions_under_ulimit_1024_never_kill_the_server_and_it_recovers(tmp, endpoint):
    # ipc:// is the hard case: libzmq 4.3.5 aborts when its ipc listener meets EMFILE, so the
    # server's accept gate must close before the fds run out.
    import zmq

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    if max(soft, hard) < 4500:
        pytest.skip(f"the test process needs ~4,500 fds for 2,000 sockets; its limit is {hard}")
    server = PrefixedServerProcess(tmp, "--reap-timeout", "5", "--auth-timeout", "2",
                                   prefix=["prlimit", "--nofile=1024:1024"],
                                   url=f"ipc://{tmp}/s.ipc" if endpoint == "ipc" else None)
    try:
        start = server_counts(server.url)
        assert query_status(server.url).fd_limit == 1024
        ctx = zmq.Context()
        ctx.set(zmq.MAX_SOCKETS, 4096)
        socks, outcome = [], {"session": 0, "sessions limit": 0, "out of fds": 0, "other": 0, "no answer": 0,
                                 "not connected": 0}
        other = []
        t0 = time.monotonic()
        try:
            for _ in range(10):
                new = []
                for _ in range(200):
                    sock = ctx.socket(zmq.DEALER)
                    socks.append(sock)  # closed in the finally below, whatever happens
                    sock.setsockopt(zmq.LINGER, 0)
                    sock.setsockopt(zmq.SNDTIMEO, 2000)  # a DEALER without a connection blocks on send
                    sock.connect(server.url)
                    try:
                        sock.send_multipart([b"\x00" * 8, _hello_body()])
                    except zmq.Again:
                        outcome["not connected"] += 1
                        continue
                    new.append(sock)
                poller = zmq.Poller()
                for sock in new:
                    poller.register(sock, zmq.POLLIN)
                waiting, deadline = set(new), time.monotonic() + 3
                while waiting and time.monotonic() < deadline:
                    for sock, _ in poller.poll(100):
                        reply = codec.decode_reply(sock.recv_multipart()[1])
                        poller.unregister(sock)
                        waiting.discard(sock)
                        if isinstance(reply, protocol.HelloReply):
                            outcome["session"] += 1
                        elif "--max-sessions" in reply.message:
                            assert reply.code == ErrorCode.UNAVAILABLE
                            outcome["sessions limit"] += 1
                        elif "out of file descriptors" in reply.message:
                            assert reply.code == ErrorCode.UNAVAILABLE
                            outcome["out of fds"] += 1
                        else:
                            outcome["other"] += 1
                            other.append(reply)
                outcome["no answer"] += len(waiting)
                assert server.alive, server.log()[-4000:]
            elapsed = time.monotonic() - t0
        finally:
            for sock in socks:
                sock.close(0)
            ctx.term()
        print(f"\n2,000 HELLOs against a 1,024-fd server in {elapsed:.1f} s: {outcome}; "
              f"other replies: {other[:3]}")
        assert server.alive, server.log()[-4000:]
        assert not other, other[:3]
        assert sum(outcome.values()) == 2000 and outcome["session"] >= 1
        # The attacker is gone: the server recovers, an honest client registers.
        assert_back_to(server.url, start, fd_slack=1, timeout_s=30)
        assert_an_honest_worker_registers(server.url)
        with MPClient(server.url, heartbeat=False) as client:
            assert client.ping() > 0
        assert_back_to(server.url, start, fd_slack=1, timeout_s=10)
    finally:
        rc = server.stop()
    assert rc == 0, server.log()[-4000:]


# ---- a second server on the same sockets ---------------------------------------------------------


def test_a_second_server_on_the_same_endpoint_or_fd_socket_exits_1_and_the_first_keeps_working(tmp):
    ipc, fds = tmp / "s.ipc", tmp / "s.fds"
    first = ServerProcess(tmp, "--reap-timeout", "5", url=f"ipc://{ipc}", fd_socket=str(fds))
    try:
        inodes = {p: os.stat(p).st_ino for p in (ipc, fds)}
        base = [sys.executable, "-m", "lmshm.server", "--log-level", "DEBUG"]
        same_url = subprocess.run([*base, "--url", first.url, "--fd-socket", str(tmp / "other.fds")],
                                  capture_output=True, text=True, timeout=60)
        assert same_url.returncode == 1 and f"cannot listen on {first.url}" in same_url.stderr, same_url.stderr
        same_fds = subprocess.run([*base, "--url", f"ipc://{tmp}/other.ipc", "--fd-socket", str(fds)],
                                  capture_output=True, text=True, timeout=60)
        assert same_fds.returncode == 1 and str(fds) in same_fds.stderr, same_fds.stderr
        assert "Traceback" not in same_url.stderr + same_fds.stderr
        assert not (tmp / "other.fds").exists() and not (tmp / "other.ipc").exists()
        # The first server's socket files are still its own, and it still serves.
        assert {p: os.stat(p).st_ino for p in (ipc, fds)} == inodes
        assert first.alive
        assert_an_honest_worker_registers(first.url, server_pid=first.proc.pid)
        with MPClient(first.url, heartbeat=False) as client:
            assert client.ping() > 0
    finally:
        rc = first.stop()
    assert rc == 0, first.log()
    assert not ipc.exists() and not fds.exists()


# ---- many cycles in isolated mode ----------------------------------------------------------------

CYCLES = int(os.environ.get("LMSHM_TEST_CYCLES", "10000"))


def test_many_isolated_register_unregister_cycles_leak_no_fd_and_no_mapping(start_server, start_worker):
    server = start_server("--isolated-ipc", "--reap-timeout", "5", "--log-level", "WARNING")
    worker = start_worker(server.url, env=ISOLATED)
    worker.ok("loop", seconds=5, iterations=20, prefix="warm", layers=4, layout="one")  # warm both sides up
    before = server_counts(server.url)
    t0 = time.monotonic()
    done = worker.ok("loop", timeout_s=200, seconds=150, iterations=CYCLES, prefix="c", layers=4,
                     layout="one")["iterations"]
    elapsed = time.monotonic() - t0
    print(f"\n{done} isolated register/unregister cycles in {elapsed:.1f} s")
    assert done == CYCLES, f"only {done} of {CYCLES} cycles in {elapsed:.0f} s"
    after = server_counts(server.url)
    assert abs(after["open_fds"] - before["open_fds"]) <= 2, (before, after)
    assert after["mappings"] == 0 and after["inbox_fds"] == 0 and after["registrations"] == 0, after
    worker.exit()


def test_a_worker_with_1100_separate_layers_fits_a_1024_fd_server_and_another_worker_may_come_and_go(
        tmp, start_worker):
    # Each mapping used to hold an fd (Python's mmap keeps a dup), so 1,100 segments exhausted a
    # 1,024-fd server, and pidfds numbered past 1023 crashed the select() liveness check. Named
    # segments: 1,100 memfds would need 1,100 fds in flight to the server at once (see
    # docs/design/cpu-wrappers.md, "Limits and trust").
    server = PrefixedServerProcess(tmp, "--reap-timeout", "5", prefix=["prlimit", "--nofile=1024:1024"])
    try:
        start = server_counts(server.url)
        big = start_worker(server.url, env={"LMSHM_CPU_SEGMENTS": "shm"})
        reg = big.ok("register", layers=1100, layout="per-layer", shape=[2, 4, 8], timeout_s=120)
        status = query_status(server.url)
        assert status.mappings == 1100 and status.open_fds < start["open_fds"] + 16, status.open_fds
        other = start_worker(server.url)
        other.ok("register", layers=2)
        other.ok("close")  # its link closes while the big worker's mappings are all open
        other.exit()
        assert server.alive, server.log()[-4000:]
        big.ok("fill", instance_id=reg["instance_id"], layer="model.layers.1099.attn", bytes=[5, 6, 7])
        assert big.ok("peek", instance_id=reg["instance_id"], layer="model.layers.1099.attn")["bytes"][:3] == [5, 6, 7]
        big.ok("unregister", instance_id=reg["instance_id"])
        big.exit()
        assert_back_to(server.url, start, fd_slack=2, timeout_s=10)
    finally:
        rc = server.stop()
    assert rc == 0, server.log()[-4000:]


def test_connections_without_a_session_are_closed_and_cannot_hold_the_servers_fds(start_server):
    # Any local user can open ZeroMQ connections to a tcp:// endpoint and just sit on them. The
    # server closes connections that have no session after 5 s (at least --auth-timeout); a
    # verified worker's connection stays, however quiet it is.
    import zmq

    server = start_server("--reap-timeout", "30", "--auth-timeout", "1")
    before = server_counts(server.url)
    ctx = zmq.Context()
    idle = []
    try:
        with RawSession(server.url) as worker:
            for _ in range(200):
                sock = ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.RECONNECT_IVL, 60_000)  # stay down once dropped
                sock.connect(server.url)
                idle.append(sock)
            wait_for(lambda: server_counts(server.url)["open_fds"] >= before["open_fds"] + 200, 10, 0.05,
                     "the idle connections to be accepted")
            wait_for(lambda: server_counts(server.url)["open_fds"] <= before["open_fds"] + 4, 15, 0.1,
                     "the idle connections to be closed")
            assert "closed 200 ZeroMQ connection(s) without a session" in server.log() or \
                "ZeroMQ connection(s) without a session" in server.log()
            time.sleep(1)
            assert isinstance(worker.request(protocol.Ping()), protocol.Pong)  # the quiet worker stays
            assert worker.request(protocol.Ping()).session_known
    finally:
        for sock in idle:
            sock.close(0)
        ctx.term()
    assert_back_to(server.url, before, fd_slack=1)
