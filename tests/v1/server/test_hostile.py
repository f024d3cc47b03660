"""Hostile input against lmshm-server: each test is an attack the server must refuse.

After every attack: an honest client's PING is answered, and the server's open fds, mappings,
undelivered fds, sessions and registrations are back where they started (``assert_back_to``).
Attackers are the test process itself (``RawSession``: a bare DEALER whose identity was proven
on the fd channel) or a process started as another uid (``setpriv``).
"""

from __future__ import annotations

import array
import ctypes
import os
import shutil
import socket
import subprocess
import sys
import time

import msgspec
import pytest
from harness import (
    OwnSegments,
    RawSession,
    assert_an_honest_worker_registers,
    assert_back_to,
    counters_come_back,
    proc_fd_count,
    server_counts,
    serving,
    shm_wrapper,
    wait_for,
)

from lmshm.platform.cpu.segments import create_segment, segment_name, shm_dir
from lmshm.platform.cpu.wrappers import CpuFdIPCWrapper, CpuShmIPCWrapper
from lmshm.transport import fdchannel
from lmshm.wire import codec, protocol
from lmshm.wire.protocol import ErrorCode

ISOLATED = {"LMSHM_ISOLATED_IPC": "1"}
NAMED = {"LMSHM_CPU_SEGMENTS": "shm"}   # workers that register named segments (the default is memfd)
NOBODY = 65534
MAX_REPLY = 2048


@pytest.fixture(scope="module")
def srv():
    with serving("--reap-timeout", "5") as server:
        yield server


@pytest.fixture
def baseline(srv):
    """The server's counters before the test; checked again after it."""
    yield from counters_come_back(srv)


@pytest.fixture
def own_segment():
    segments = OwnSegments()
    yield segments
    segments.unlink_all()


def _error(reply, code: ErrorCode, *needles: str) -> str:
    assert isinstance(reply, protocol.ErrorReply), reply
    assert reply.code == code, (ErrorCode(reply.code).name, reply.message)
    for needle in needles:
        assert needle in reply.message, reply.message
    assert len(reply.message) < MAX_REPLY
    return reply.message


# ---- 1. memory of another uid -------------------------------------------------------------


def test_another_uids_segment_is_refused_and_never_mapped(srv, baseline, own_segment):
    seg = own_segment(8192)  # carries our pid: only the owner uid is wrong
    os.chown(seg.path, NOBODY, NOBODY)
    with RawSession(srv.url) as attacker:
        msg = _error(attacker.register("foreign-uid", shm_wrapper(seg.name, 8192)),
                     ErrorCode.PERMISSION_DENIED, f"uid {NOBODY}")
        assert "owns" in msg
        assert server_counts(srv.url)["mappings"] == 0


_NOBODY_PROBE = r"""
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
s.settimeout(5)
try:
    s.connect(sys.argv[1])
except PermissionError:
    print("EACCES"); sys.exit(0)
s.settimeout(1)
try:
    data = s.recv(65536)  # a refused uid is answered at once, before it sends anything
except socket.timeout:
    s.settimeout(5)
    try:
        s.send(b"\x82\xa2op\xa4auth\xa5token\xa1x")
        data = s.recv(65536)
    except OSError as exc:
        print("ERR", exc); sys.exit(0)
print("REPLY", data.hex())
"""


_AS_NOBODY = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]


def _python_for_nobody() -> str:
    """A Python interpreter nobody may run (the probe needs only the standard library)."""
    for python in ("/usr/bin/python3", "/usr/local/bin/python3", sys.executable):
        if os.path.exists(python) and subprocess.run([*_AS_NOBODY, python, "-c", "pass"], capture_output=True,
                                                     timeout=30).returncode == 0:
            return python
    pytest.skip("no Python interpreter that uid nobody may execute")


def _run_as_nobody(path: str) -> str:
    proc = subprocess.run([*_AS_NOBODY, _python_for_nobody(), "-c", _NOBODY_PROBE, path],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_a_process_of_another_uid_cannot_connect_to_the_fd_socket_or_is_refused_there(srv, baseline):
    if shutil.which("setpriv") is None or os.geteuid() != 0:
        pytest.skip("needs root and setpriv to run an attacker as nobody")
    path = srv.fd_socket
    # As deployed: the socket is 0600 in a 0700 directory; nobody cannot even connect.
    assert _run_as_nobody(path) == "EACCES"
    # Opened up by mistake: the server's uid policy must still refuse nobody (SO_PEERCRED).
    folder = os.path.dirname(path)
    old_dir, old_sock = os.stat(folder).st_mode & 0o7777, os.stat(path).st_mode & 0o7777
    os.chmod(folder, 0o711)
    os.chmod(path, 0o666)
    try:
        out = _run_as_nobody(path)
    finally:
        os.chmod(folder, old_dir)
        os.chmod(path, old_sock)
    assert out.startswith("REPLY "), out
    reply = msgspec.msgpack.decode(bytes.fromhex(out.split()[1]), type=fdchannel.Refused)
    assert reply.code == "PERMISSION_DENIED" and "not admitted" in reply.error and f"uid {NOBODY}" in reply.error


# ---- 2. memory of another session -----------------------------------------------------------


def test_another_sessions_segment_is_refused_and_its_registration_is_untouchable(srv, start_worker, baseline):
    worker = start_worker(srv.url, env=NAMED)
    reg = worker.ok("register", layers=2, layout="one", instance_id="victim")
    worker.ok("fill", instance_id="victim", layer="model.layers.1.attn", bytes=[7, 6, 5, 4])
    [victim_seg] = reg["segments"]
    size = os.stat(os.path.join(shm_dir(), victim_seg)).st_size
    mappings = server_counts(srv.url)["mappings"]
    with RawSession(srv.url) as attacker:
        assert attacker.link.verified_pid == os.getpid() != worker.pid
        _error(attacker.register("stolen", shm_wrapper(victim_seg, size)), ErrorCode.PERMISSION_DENIED,
               f"was made by pid {worker.pid}")
        _error(attacker.peek("victim", "model.layers.1.attn"), ErrorCode.PERMISSION_DENIED,
               "belongs to another session")
        _error(attacker.unregister("victim"), ErrorCode.PERMISSION_DENIED, "belongs to another session")
        assert server_counts(srv.url)["mappings"] == mappings
    assert worker.ok("peek", instance_id="victim", layer="model.layers.1.attn")["bytes"][:4] == [7, 6, 5, 4]
    worker.ok("unregister", instance_id="victim")
    worker.exit()


# ---- 3. a hard link to a segment ------------------------------------------------------------


def test_a_hard_link_to_a_segment_is_refused_for_its_links(srv, baseline, own_segment):
    seg = own_segment(8192)
    alias = segment_name()  # a second name that carries our pid too
    alias_path = os.path.join(shm_dir(), alias)
    os.link(seg.path, alias_path)
    try:
        with RawSession(srv.url) as attacker:
            _error(attacker.register("alias", shm_wrapper(alias, 8192)), ErrorCode.PERMISSION_DENIED, "2 links")
            _error(attacker.register("orig", shm_wrapper(seg.name, 8192)), ErrorCode.PERMISSION_DENIED, "links")
            assert server_counts(srv.url)["mappings"] == 0
    finally:
        os.unlink(alias_path)


# ---- 4. truncated, sparse, hole-punched -----------------------------------------------------


def test_a_segment_truncated_after_registering_is_refused_at_peek_without_sigbus(srv, baseline, own_segment):
    seg = own_segment(3 * 4096)
    with RawSession(srv.url) as attacker:
        assert isinstance(attacker.register("trunc", shm_wrapper(seg.name, 3 * 4096)), protocol.RegisterReply)
        assert isinstance(attacker.peek("trunc"), protocol.PeekReply)
        os.truncate(seg.path, 4096)
        _error(attacker.peek("trunc"), ErrorCode.UNAVAILABLE, "truncated")
        assert srv.alive
        assert isinstance(attacker.unregister("trunc"), protocol.UnregisterReply)


def test_a_sparse_segment_is_refused_at_register(srv, baseline):
    name = segment_name()
    path = os.path.join(shm_dir(), name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, 1 << 20)  # no fallocate: every page is a hole
        with RawSession(srv.url) as attacker:
            _error(attacker.register("sparse", shm_wrapper(name, 1 << 20)), ErrorCode.INVALID_ARG, "sparse")
            assert server_counts(srv.url)["mappings"] == 0
    finally:
        os.close(fd)
        os.unlink(path)


def test_a_hole_punched_after_registering_is_refused_at_peek(srv, baseline, own_segment):
    seg = own_segment(4 * 4096)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    with RawSession(srv.url) as attacker:
        assert isinstance(attacker.register("holes", shm_wrapper(seg.name, 4 * 4096)), protocol.RegisterReply)
        fd = os.open(seg.path, os.O_RDWR)
        try:
            rc = libc.fallocate(fd, 3, 4096, 4096)  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE
            assert rc == 0, os.strerror(ctypes.get_errno())
        finally:
            os.close(fd)
        _error(attacker.peek("holes"), ErrorCode.UNAVAILABLE, "holes")
        assert srv.alive
        assert isinstance(attacker.unregister("holes"), protocol.UnregisterReply)


# ---- 5. overflowing shapes, stride-0 bombs, huge ints inside the pickle ---------------------


def _tampered(**fields) -> CpuShmIPCWrapper:
    """A valid wrapper whose attributes were overwritten after validation (pickle reads them)."""
    w = shm_wrapper(segment_name(), 4096)
    w.__dict__.update(fields)
    return w


@pytest.mark.parametrize("fields, needle", [
    (dict(shape=(2 ** 40, 2 ** 40), stride=(1, 1)), "2**60"),
    (dict(shape=(2 ** 40, 2 ** 40), stride=(0, 0)), "2**60"),
    (dict(shape=(2 ** 47,) * 4, stride=(0,) * 4), "2**60"),
    (dict(shape=(2 ** 62,), stride=(1,)), "shape"),
    (dict(shape=(4,), stride=(-1,)), "stride"),
    (dict(shape=(2 ** 30,), stride=(0,)), "not a dense layout"),   # fits the cap, overlaps itself
    (dict(shape=(2, 2), stride=(1, 1)), "not a dense layout"),
    (dict(storage_offset=10 ** 5000), ""),
    (dict(shape=(10 ** 5000,), stride=(1,)), ""),
    (dict(segment_bytes=10 ** 5000), ""),
    (dict(byte_offset=-(10 ** 5000)), ""),
])
def test_overflowing_and_stride_zero_wrappers_are_invalid_arg_with_a_bounded_reply(srv, baseline, fields, needle):
    body = codec.encode(protocol.RegisterKVCache(instance_id="bomb", model_name="m", world_size=1, worker_rank=0,
                                                 groups=[protocol.LayerGroup(_tampered(**fields), ["l0"], [0])]))
    with RawSession(srv.url) as attacker:
        reply = attacker.request_raw(body)
        _error(reply, ErrorCode.INVALID_ARG, needle)
        assert attacker.last_reply_bytes < MAX_REPLY
    assert srv.alive


# ---- 6. repr bombs ----------------------------------------------------------------------------

MB = 1 << 20


@pytest.mark.parametrize("field", ["instance_id", "model_name", "layer_name", "client_name", "peek_id"])
@pytest.mark.parametrize("size", [4000, MB])
def test_huge_names_get_a_short_error_and_do_not_flood_the_log(srv, baseline, own_segment, field, size):
    huge = "\u00e9" * size  # 2 bytes each in UTF-8
    seg = own_segment(4096)
    wrapper = shm_wrapper(seg.name, 4096)
    log_before = len(srv.log())
    with RawSession(srv.url) as attacker:
        if field == "client_name":
            body = msgspec.msgpack.encode({"type": int(protocol.MsgType.HELLO), "protocol_version":
                                           protocol.PROTOCOL_VERSION, "isolated_ipc": False, "client_name": huge})
        elif field == "peek_id":
            body = msgspec.msgpack.encode({"type": int(protocol.MsgType.PEEK), "instance_id": huge,
                                           "layer_name": huge})
        else:
            names = {"instance_id": "x", "model_name": "m", "layer_name": "l0", field: huge}
            body = msgspec.msgpack.encode({
                "type": int(protocol.MsgType.REGISTER_KV_CACHE), "instance_id": names["instance_id"],
                "model_name": names["model_name"], "world_size": 1, "worker_rank": 0,
                "groups": [[msgspec.msgpack.Ext(1, wrapper.Serialize()), [names["layer_name"]], [0]]]})
        reply = attacker.request_raw(body)
        assert isinstance(reply, protocol.ErrorReply), reply
        assert reply.code in (ErrorCode.INVALID_ARG, ErrorCode.NOT_FOUND), reply
        assert attacker.last_reply_bytes < MAX_REPLY and len(reply.message) < MAX_REPLY
    assert len(srv.log()) - log_before < 100_000


# ---- 7. another session's fd token ---------------------------------------------------------------


def test_another_sessions_fd_token_is_refused_and_cannot_piggy_back_on_its_mapping(start_server, start_worker):
    server = start_server("--isolated-ipc", "--reap-timeout", "5")
    before = server_counts(server.url)
    victim = start_worker(server.url, env=ISOLATED)
    reg = victim.ok("register", layers=2, layout="one", instance_id="victim")
    victim.ok("fill", instance_id="victim", layer="model.layers.0.attn", bytes=[0xAA, 0xBB])
    [token] = reg["segments"]
    mappings = server_counts(server.url)["mappings"]
    assert mappings == 1
    with RawSession(server.url, isolated=True) as attacker:
        msg = _error(attacker.register("stolen", shm_wrapper(token, 1024, cls=CpuFdIPCWrapper)),
                     ErrorCode.INVALID_ARG, "no file descriptor was received")
        assert token[:20] in msg
        assert server_counts(server.url)["mappings"] == mappings
        # The attacker sends its own memfd under the victim's token: it maps its own memory,
        # under its own session's key, never the victim's mapping.
        seg, u8 = create_segment(4096, "memfd")
        try:
            u8[:2] = 0x11
            attacker.link.send_fds({token: seg.fd})
            reply = attacker.register("own", shm_wrapper(token, 4096, cls=CpuFdIPCWrapper))
            assert isinstance(reply, protocol.RegisterReply), reply
            assert server_counts(server.url)["mappings"] == mappings + 1
            assert attacker.peek("own", length=2).data == b"\x11\x11"
            assert isinstance(attacker.unregister("own"), protocol.UnregisterReply)
        finally:
            seg.unlink()
            del u8
    assert victim.ok("peek", instance_id="victim", layer="model.layers.0.attn")["bytes"][:2] == [0xAA, 0xBB]
    victim.ok("unregister", instance_id="victim")
    victim.exit()
    assert_back_to(server.url, before, fd_slack=1)


# ---- 8. pid claims in HELLO --------------------------------------------------------------------


@pytest.mark.parametrize("extra", [{"pid": 1}, {"pid": os.getpid(), "uid": 0}, {"peer_pid": 1}])
def test_a_hello_that_claims_a_pid_is_invalid_arg(srv, baseline, extra):
    body = msgspec.msgpack.encode({"type": int(protocol.MsgType.HELLO), "protocol_version": protocol.PROTOCOL_VERSION,
                                   "isolated_ipc": False, **extra})
    with RawSession(srv.url) as honest:  # a fresh DEALER for the attack, a session for the check
        sock = honest.ctx.socket(__import__("zmq").DEALER)
        sock.setsockopt(__import__("zmq").LINGER, 0)
        sock.connect(srv.url)
        try:
            sock.send_multipart([b"\x00" * 8, body])
            assert sock.poll(5000)
            reply = codec.decode_reply(sock.recv_multipart()[1])
        finally:
            sock.close(0)
        _error(reply, ErrorCode.INVALID_ARG, "unknown field")
        assert isinstance(honest.request(protocol.Ping()), protocol.Pong)


# ---- 9. garbage on the fd channel ----------------------------------------------------------------


def _fd_conn(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(5)
    s.connect(path)
    return s


def _answer(s: socket.socket):
    """The server's one answer: a decoded Refused/Ack, or None for a clean close."""
    data = s.recv(65536)
    if not data:
        return None
    return msgspec.msgpack.decode(data, type=fdchannel.Refused | fdchannel.Ack)


def _assert_refused(answer, *codes: str) -> None:
    assert answer is None or (isinstance(answer, fdchannel.Refused) and answer.code in codes), answer
    if answer is not None:
        assert len(answer.error) < MAX_REPLY


def _send_with_fds(s: socket.socket, data: bytes, fds: list[int]) -> None:
    s.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])


def _devnulls(n: int) -> list[int]:
    return [os.open(os.devnull, os.O_RDONLY) for _ in range(n)]


@pytest.mark.parametrize("garbage", [b"[" * 60000, b"\x91" * 60000, b"\xdd\xff\xff\xff\xff", b"\xc1",
                                     msgspec.msgpack.encode({"op": "auth"}),
                                     msgspec.msgpack.encode({"op": "nope", "token": "x"}),
                                     msgspec.msgpack.encode({"op": "auth", "token": "x", "pid": 1})],
                         ids=["brackets", "nested-arrays", "huge-array-header", "reserved-byte", "no-token",
                              "unknown-op", "extra-field"])
def test_fd_channel_garbage_is_refused_and_the_server_survives(srv, baseline, garbage):
    with _fd_conn(srv.fd_socket) as s:
        s.send(garbage)
        _assert_refused(_answer(s), "INVALID_ARG")


def test_fd_channel_random_bytes_are_refused(srv, baseline):
    rng = __import__("random").Random(1234)
    for _ in range(50):
        with _fd_conn(srv.fd_socket) as s:
            s.send(bytes(rng.randrange(256) for _ in range(rng.randrange(1, 300))))
            _assert_refused(_answer(s), "INVALID_ARG", "PERMISSION_DENIED")


@pytest.mark.parametrize("chars", [129, 60000, 200_000, MB])
def test_fd_channel_auth_with_a_huge_token_is_refused(srv, baseline, chars):
    data = msgspec.msgpack.encode({"op": "auth", "token": "t" * chars})
    with _fd_conn(srv.fd_socket) as s:
        try:
            s.send(data)
        except OSError as exc:  # the kernel itself refuses a message above the socket buffer
            assert chars >= 200_000, exc
            return
        _assert_refused(_answer(s), "INVALID_ARG")


def test_fd_channel_fds_sent_before_auth_are_refused_and_closed(srv, baseline):
    fds_before = proc_fd_count(srv.proc.pid)
    fds = _devnulls(3)
    try:
        with _fd_conn(srv.fd_socket) as s:
            _send_with_fds(s, msgspec.msgpack.encode({"op": "fds", "tokens": ["a", "b", "c"]}), fds)
            _assert_refused(_answer(s), "PERMISSION_DENIED")
            # The connection is still open (pending auth); the three fds must already be gone.
            assert proc_fd_count(srv.proc.pid) <= fds_before + 2  # + this connection and its pidfd
        wait_for(lambda: proc_fd_count(srv.proc.pid) <= fds_before, 3, 0.02, "the closed connection's fds to go")
        with _fd_conn(srv.fd_socket) as s:  # fds riding on an Auth: refused too
            _send_with_fds(s, msgspec.msgpack.encode({"op": "auth", "token": "x"}), fds)
            _assert_refused(_answer(s), "INVALID_ARG")
            assert proc_fd_count(srv.proc.pid) <= fds_before + 2
    finally:
        for fd in fds:
            os.close(fd)
    wait_for(lambda: proc_fd_count(srv.proc.pid) <= fds_before, 3, 0.02, "the server's fds to be closed")


def test_fd_channel_250_fds_with_one_token_are_refused_and_closed(srv, baseline):
    fds_before = proc_fd_count(srv.proc.pid)
    fds = _devnulls(250)
    try:
        with RawSession(srv.url, verify=False) as attacker, _fd_conn(srv.fd_socket) as s:
            s.send(msgspec.msgpack.encode({"op": "auth", "token": attacker.hello.session_token}))
            assert isinstance(_answer(s), fdchannel.Ack)
            _send_with_fds(s, msgspec.msgpack.encode({"op": "fds", "tokens": ["only-one"]}), fds)
            _assert_refused(_answer(s), "INVALID_ARG")
            # Link + pidfd of the verified session, plus its ZeroMQ connection: no received fd.
            assert proc_fd_count(srv.proc.pid) <= fds_before + 3
            assert server_counts(srv.url)["inbox_fds"] == 0
            # 250 fds under 250 distinct tokens are accepted, and close with the session.
            _send_with_fds(s, msgspec.msgpack.encode({"op": "fds", "tokens": [f"t{i}" for i in range(250)]}), fds)
            assert _answer(s) == fdchannel.Ack(received=250)
            assert server_counts(srv.url)["inbox_fds"] == 250
    finally:
        for fd in fds:
            os.close(fd)
    wait_for(lambda: server_counts(srv.url)["inbox_fds"] == 0, 3, 0.05, "the session's fds to be closed")
    wait_for(lambda: proc_fd_count(srv.proc.pid) <= fds_before + 1, 3, 0.02, "the server's fds to be closed")


# ---- 10. unauthenticated fd-channel connections ----------------------------------------------------


def test_unauthenticated_fd_channel_connections_are_closed_after_the_auth_timeout(start_server):
    server = start_server("--auth-timeout", "0.5", "--reap-timeout", "5")
    fds_before = proc_fd_count(server.proc.pid)
    before = server_counts(server.url)
    conns = [_fd_conn(server.fd_socket) for _ in range(10)]
    try:
        wait_for(lambda: proc_fd_count(server.proc.pid) >= fds_before + 10, 2, 0.02, "the server to accept")
        t0 = time.monotonic()
        for s in conns:
            s.settimeout(3)
            answer = _answer(s)
            _assert_refused(answer, "UNAVAILABLE")
            if answer is not None:
                assert "no auth within 0.5 s" in answer.error
                assert s.recv(100) == b""  # and then closed
        assert time.monotonic() - t0 < 2.0
    finally:
        for s in conns:
            s.close()
    wait_for(lambda: proc_fd_count(server.proc.pid) <= fds_before, 3, 0.02, "the server's fds to be closed")
    assert_back_to(server.url, before, fd_slack=1)


# ---- 11. the data plane ---------------------------------------------------------------------


def _registered(session: RawSession, own_segment, iid: str, size: int = 8192) -> None:
    assert isinstance(session.register(iid, shm_wrapper(own_segment(size).name, size)), protocol.RegisterReply)


def _pool(url: str) -> protocol.PoolInfo:
    from lmshm.transport.client import query_status

    return query_status(url).pool


def test_data_plane_requests_need_a_verified_owner(srv, baseline, own_segment):
    key = b"k" * 32
    with RawSession(srv.url) as owner, RawSession(srv.url) as other, RawSession(srv.url, verify=False) as anon:
        _registered(owner, own_segment, "dp-owned")
        assert isinstance(owner.request(protocol.Store("dp-owned", [key], [0], 1)), protocol.StoreReply)
        for msg in (protocol.Store("dp-owned", [key], [1], 1), protocol.Retrieve("dp-owned", [key], [1], 1),
                    protocol.Lookup([[key]]), protocol.Release(b"x" * 16)):
            _error(anon.request(msg), ErrorCode.PERMISSION_DENIED, "verified identity")
        for msg in (protocol.Store("dp-owned", [b"m" * 32], [1], 1), protocol.Retrieve("dp-owned", [key], [1], 1)):
            _error(other.request(msg), ErrorCode.PERMISSION_DENIED, "belongs to another session")
        hit = owner.request(protocol.Lookup([[key]]))
        assert hit.hits == 1
        assert other.request(protocol.Release(b"\x00" * 16)).released is False     # a guessed lease: nothing
        assert owner.request(protocol.Release(hit.lease)).released is True
        owner.unregister("dp-owned")
    assert _pool(srv.url).leases == 0 and _pool(srv.url).pinned == 0
    assert_an_honest_worker_registers(srv.url)


def test_forged_but_valid_data_plane_messages_are_answered_and_copy_nothing(srv, baseline, own_segment):
    with RawSession(srv.url) as s:
        _registered(s, own_segment, "dp-forged")
        blocks = 8192 // 2
        cases = [
            (protocol.Store("dp-forged", [b"k"], [0] * protocol.MAX_BLOCK_IDS, 1), ErrorCode.INVALID_ARG, "need 1 block ids"),
            (protocol.Store("dp-forged", [b"k"], [1 << 48], 1), ErrorCode.INVALID_ARG, "out of range"),
            (protocol.Retrieve("dp-forged", [b"k"], [blocks], 1), ErrorCode.INVALID_ARG, "out of range"),
            (protocol.Store("dp-forged", [b"k"] * 2, [0] * (1 << 16), 1 << 16), ErrorCode.INVALID_ARG, "need 131072"),
            (protocol.Retrieve("dp-forged", [b"never"], [0], 1, b"\xff" * 16), ErrorCode.NOT_FOUND, "not stored"),
            (protocol.Lookup([[b"k"]] * 3 + [[]]), ErrorCode.INVALID_ARG, "same number of keys"),
            (protocol.Store("dp-forged", [b"k"], [0], 1, event=b"e" * 64), None, ""),   # CPU: an event is ignored
        ]
        for msg, code, needle in cases:
            reply = s.request(msg, timeout_s=30)
            if code is None:
                assert isinstance(reply, protocol.StoreReply), reply
            else:
                _error(reply, code, needle)
        many = s.request(protocol.Lookup([[bytes([i % 256, i // 256]) * 32 for i in range(protocol.MAX_KEYS)]]),
                         timeout_s=30)
        assert many.hits == 0 and many.lease == b""
        too_many = codec.encode(protocol.Lookup([[b"k"] * (protocol.MAX_KEYS + 1)]))
        _error(s.request_raw(too_many, timeout_s=30), ErrorCode.INVALID_ARG)
        s.unregister("dp-forged")
    assert _pool(srv.url).pinned == 0
    assert_an_honest_worker_registers(srv.url)


def test_a_flood_of_copies_and_leases_is_bounded_and_every_request_answered(start_server, own_segment):
    server = start_server("--max-inflight-per-session", "8", "--max-leases-per-session", "50")
    before = server_counts(server.url)
    n = 2000
    with RawSession(server.url, timeout_s=60) as s:
        _registered(s, own_segment, "dp-flood")
        s.request(protocol.Store("dp-flood", [b"hot"], [0], 1))
        for i in range(n):  # everything sent before a single reply is read
            s.sock.send_multipart([i.to_bytes(8, "big"), codec.encode(
                protocol.Store("dp-flood", [i.to_bytes(4, "big")], [i % 4096], 1) if i % 2 else
                protocol.Lookup([[b"hot"]]))])
        replies = []
        for _ in range(n):
            assert s.sock.poll(60_000), f"only {len(replies)} of {n} requests were answered"
            replies.append(codec.decode_reply(s.sock.recv_multipart()[1]))
        stored = sum(isinstance(r, protocol.StoreReply) for r in replies)
        leased = sum(isinstance(r, protocol.LookupReply) and r.hits == 1 for r in replies)
        refused = [r for r in replies if isinstance(r, protocol.ErrorReply)]
        assert stored + leased + len(refused) == n
        assert leased == 50 and stored >= 8                     # the lease cap holds; copies go on
        assert all(r.code == ErrorCode.UNAVAILABLE for r in refused)
        assert {m for r in refused for m in ("--max-inflight-per-session", "--max-leases-per-session")
                if m in r.message} == {"--max-inflight-per-session", "--max-leases-per-session"}
        assert isinstance(s.request(protocol.Ping()), protocol.Pong)
        s.unregister("dp-flood")
    wait_for(lambda: _pool(server.url).leases == 0 and _pool(server.url).pinned == 0, 10, 0.05,
             "the flooder's leases to end with its session")
    assert_back_to(server.url, before, fd_slack=1)
    assert_an_honest_worker_registers(server.url)
