"""Test harness for the service tests: an ``lmshm-server`` subprocess and worker subprocesses.

``ServerProcess`` runs ``python -m lmshm.server`` on a free port (or an ipc://
path) and reads the URL from its ready line. ``WorkerProcess`` runs ``worker.py`` beside this
file, which owns an ``MPClient`` and obeys one JSON command per stdin line (register, fill,
unregister, ...), answering one JSON line each. Every helper is bounded in time.

Fixtures built on these live in conftest.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).parent
WORKER = HERE / "worker.py"
READY = re.compile(r"listening on (\S+) \(fd socket (\S+),")
SHM_DIR = "/dev/shm"


def lmshm_segments() -> set[str]:
    return {n for n in os.listdir(SHM_DIR) if n.startswith("lmshm-")}


def _readline(stream, timeout_s: float, what: str) -> str:
    ready, _, _ = select.select([stream], [], [], timeout_s)
    if not ready:
        raise TimeoutError(f"{what} said nothing within {timeout_s} s")
    line = stream.readline()
    if not line:
        raise EOFError(f"{what} closed its output")
    return line


class ServerProcess:
    def __init__(self, tmp: Path, *args: str, url: Optional[str] = None, fd_socket: Optional[str] = None,
                 env: Optional[dict] = None, prefix: Optional[list[str]] = None) -> None:
        self.tmp = tmp
        self.log_path = tmp / f"server-{time.monotonic_ns()}.log"
        # fd_socket="" leaves the server its default path (read back from its ready line).
        self.fd_socket = str(tmp / "fds.sock") if fd_socket is None else fd_socket
        cmd = [*(prefix or []), sys.executable, "-m", "lmshm.server", "--url", url or "tcp://127.0.0.1:0",
               *(["--fd-socket", self.fd_socket] if self.fd_socket else []), "--log-level", "DEBUG", *args]
        self._log = open(self.log_path, "w")
        # The leak checks compare the server's RSS before and after (``assert_back_to``): the
        # 256 MiB the pool populates ahead after the first registration would read as growth,
        # so these servers do not populate ahead unless a test asks (test_dataplane.py tests it).
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self._log, text=True,
                                     env={**os.environ, "LMSHM_POOL_POPULATE_AHEAD": "0", **(env or {})})
        try:
            line = _readline(self.proc.stdout, 30, "lmshm-server")
        except (TimeoutError, EOFError):
            self.proc.kill()
            self.proc.wait()
            raise RuntimeError(f"lmshm-server did not start:\n{self.log()}") from None
        m = READY.search(line)
        assert m, line
        self.url = m.group(1)
        self.fd_socket = m.group(2)

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text()

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 15) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            rc = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"lmshm-server ignored signal {sig}:\n{self.log()}") from None
        self.proc.stdout.close()
        self._log.close()
        return rc

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None


class WorkerProcess:
    def __init__(self, url: str, *args: str, env: Optional[dict] = None, prefix: Optional[list[str]] = None) -> None:
        cmd = [*(prefix or []), sys.executable, str(WORKER), "--url", url, *args]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})
        self.hello = self._reply(60)
        self.pid = self.hello.get("pid")

    def _reply(self, timeout_s: float) -> dict:
        try:
            line = _readline(self.proc.stdout, timeout_s, "worker")
        except (TimeoutError, EOFError) as exc:
            err = ""
            if self.proc.poll() is not None:
                err = self.proc.stderr.read()
            raise RuntimeError(f"{exc}; worker stderr:\n{err}") from None
        return json.loads(line)

    def call(self, op: str, timeout_s: float = 60, **kw: Any) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        return self._reply(timeout_s)

    def ok(self, op: str, **kw: Any) -> dict:
        reply = self.call(op, **kw)
        assert reply.get("ok"), reply
        return reply

    def ask_to_exit(self) -> None:
        """Send ``exit`` without waiting: a teardown asks every worker first, then waits for all."""
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "exit"}) + "\n")
                self.proc.stdin.flush()
            except BrokenPipeError:
                pass

    def exit(self, timeout_s: float = 20) -> int:
        self.ask_to_exit()
        try:
            return self.proc.wait(timeout_s)
        finally:
            self._close_pipes()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        self._close_pipes()

    def _close_pipes(self) -> None:
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            try:
                stream.close()
            except (OSError, BrokenPipeError):
                pass


def exit_all(workers: list[WorkerProcess]) -> None:
    """Stop the workers still running: ask each, then wait for each (they exit side by side)."""
    alive = [w for w in workers if w.proc.poll() is None]
    for worker in alive:
        worker.ask_to_exit()
    for worker in alive:
        worker.exit()


def wait_for(predicate, timeout_s: float, interval_s: float = 0.01, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(interval_s)


@contextlib.contextmanager
def serving(*args: str, **kw: Any):
    """A server for a whole module: started in a scratch directory; at the end it must stop on
    SIGTERM with exit status 0 and leave no socket file."""
    with scratch_dir() as path:
        server = ServerProcess(path, *args, **kw)
        try:
            yield server
        finally:
            if server.alive:
                rc = server.stop()
                assert rc == 0, f"lmshm-server exited {rc}:\n{server.log()}"


@contextlib.contextmanager
def scratch_dir():
    """A short directory under /tmp (Unix socket paths are limited to 107 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="lmshm-t-", dir="/tmp"))
    try:
        yield path
    finally:
        leftovers = [p.name for p in path.iterdir() if p.suffix in (".sock", ".ipc", ".fds")]
        for p in path.iterdir():
            p.unlink()
        path.rmdir()
    assert not leftovers, f"socket files left behind: {leftovers}"



def raw_exchange(url: str, frames: list[bytes], timeout_s: float = 5.0) -> Optional[list[bytes]]:
    """Send ``frames`` from a bare DEALER (no lmshm client logic); the reply frames, or None."""
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(url)
        sock.send_multipart(frames)
        if not sock.poll(int(timeout_s * 1000)):
            return None
        return sock.recv_multipart()
    finally:
        sock.close(0)
        ctx.term()


def raw_reply(url: str, body: bytes, request_id: bytes = b"\x00" * 7 + b"\x01", timeout_s: float = 5.0):
    """Send one well-framed request body; decode the reply struct."""
    from lmshm.wire import codec

    frames = raw_exchange(url, [request_id, body], timeout_s)
    assert frames is not None, f"no reply from {url}"
    assert frames[0] == request_id and len(frames) == 2, frames
    return codec.decode_reply(frames[1])


# ---- hostile payloads: pickles that would run code if a decoder trusted them -------------


class RunsACommand:
    """Unpickling this runs ``os.system(command)`` -- unless the decoder refuses it."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


class Evals:
    """Unpickling this runs ``eval(source)`` -- unless the decoder refuses it."""

    def __init__(self, source: str) -> None:
        self.source = source

    def __reduce__(self):
        return (eval, (self.source,))


# ---- hostile-input helpers: raw sessions, server counters, prefixed servers ----------------


class RawSession:
    """A bare DEALER that said HELLO, and (unless ``verify=False``) proved its identity on the
    fd channel with ``FdChannelClient`` -- no MPClient logic, no heartbeat. The session lives
    as long as the fd-channel link (``self.link``) stays open."""

    def __init__(self, url: str, *, isolated: bool = False, client_name: str = "", verify: bool = True,
                 ctx: Any = None, timeout_s: float = 5.0) -> None:
        import zmq

        from lmshm.transport.fdchannel import FdChannelClient
        from lmshm.wire import protocol

        self._own_ctx = ctx is None
        self.ctx = ctx if ctx is not None else zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(url)
        self.timeout_s = timeout_s
        self._n = 0
        self.link = None
        self.hello = self.request(protocol.Hello(protocol_version=protocol.PROTOCOL_VERSION,
                                                 isolated_ipc=isolated, client_name=client_name))
        if not isinstance(self.hello, protocol.HelloReply):
            self.close()
            raise AssertionError(f"HELLO refused: {self.hello}")
        if verify:
            try:
                self.link = FdChannelClient(self.hello.fd_socket, self.hello.session_token, timeout_s=timeout_s)
            except BaseException:
                self.close()
                raise

    def request_raw(self, body: bytes, timeout_s: Optional[float] = None) -> Any:
        from lmshm.wire import codec

        self._n += 1
        rid = self._n.to_bytes(8, "big")
        self.sock.send_multipart([rid, body])
        if not self.sock.poll(int((timeout_s or self.timeout_s) * 1000)):
            raise TimeoutError("no reply from lmshm-server")
        frames = self.sock.recv_multipart()
        assert frames[0] == rid and len(frames) == 2, frames
        self.last_reply_bytes = len(frames[1])
        return codec.decode_reply(frames[1])

    def request(self, msg: Any, timeout_s: Optional[float] = None) -> Any:
        from lmshm.wire import codec

        return self.request_raw(codec.encode(msg), timeout_s)

    def register(self, instance_id: str, *wrappers: Any, names: Optional[list[str]] = None) -> Any:
        """REGISTER one layer per wrapper (layer names ``l0``, ``l1``, ... unless given)."""
        from lmshm.wire import protocol

        names = names or [f"l{i}" for i in range(len(wrappers))]
        groups = [protocol.LayerGroup(w, [n], [w.storage_offset]) for w, n in zip(wrappers, names)]
        return self.request(protocol.RegisterKVCache(instance_id=instance_id, model_name="m", world_size=1,
                                                     worker_rank=0, groups=groups))

    def unregister(self, instance_id: str) -> Any:
        from lmshm.wire import protocol

        return self.request(protocol.UnregisterKVCache(instance_id))

    def peek(self, instance_id: str, layer: str = "l0", length: int = 8) -> Any:
        from lmshm.wire import protocol

        return self.request(protocol.Peek(instance_id, layer, 0, length))

    def close(self) -> None:
        if self.link is not None:
            self.link.close()
            self.link = None
        if self.sock is not None:
            self.sock.close(0)
            self.sock = None
        if self._own_ctx and self.ctx is not None:
            self.ctx.term()
            self.ctx = None

    def __enter__(self) -> "RawSession":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def shm_wrapper(name: str, size: int, *, cls: Any = None, dtype: str = "float16") -> Any:
    """A wrapper for the first ``size`` bytes of segment (or memfd token) ``name``."""
    if cls is None:
        from lmshm.platform.cpu.wrappers import CpuShmIPCWrapper as cls
    item = 2 if dtype == "float16" else 1
    return cls(dtype=dtype, shape=(size // item,), stride=(1,), storage_offset=0, device="cpu",
               segment=name, segment_bytes=size, byte_offset=0)


def server_counts(url: str) -> dict:
    """What must come back after every hostile action: fds, mappings, undelivered fds, sessions."""
    from lmshm.transport.client import query_status

    s = query_status(url)
    return {"open_fds": s.open_fds, "mappings": s.mappings, "inbox_fds": s.inbox_fds, "sessions": s.sessions,
            "registrations": len(s.registrations), "rss_kb": server_rss_kb(s.server_pid)}


#: How much a server's RSS may stay above where it started after a hostile action: the
#: allocator keeps some freed memory, but a peer must not be able to grow it at will.
RSS_SLACK_KB = 48 * 1024


def server_rss_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def assert_back_to(url: str, before: dict, *, fd_slack: int = 0, timeout_s: float = 15.0) -> dict:
    """An honest PING is answered, and the counters return to ``before`` (open_fds may settle
    lower or within ``fd_slack`` above: connections of earlier status queries close lazily; the
    RSS within ``RSS_SLACK_KB``). The wait is generous: on a busy host the server's timers
    (auth timeout, idle sessions) fire late; it costs nothing when the counters are back."""
    from lmshm.wire import codec, protocol

    pong = raw_reply(url, codec.encode(protocol.Ping()))
    assert isinstance(pong, protocol.Pong), pong
    last: dict = {}

    def settled() -> bool:
        last.clear()
        last.update(server_counts(url))
        return (last["open_fds"] <= before["open_fds"] + fd_slack
                and last["rss_kb"] <= before["rss_kb"] + RSS_SLACK_KB
                and all(last[k] == before[k] for k in ("mappings", "inbox_fds", "sessions", "registrations")))

    try:
        wait_for(settled, timeout_s, 0.05, "the server's counters to return")
    except AssertionError:
        raise AssertionError(f"server counters did not return: before {before}, now {last}") from None
    return last


def proc_fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


class PrefixedServerProcess(ServerProcess):
    """A ``ServerProcess`` started under a command prefix (``prlimit --nofile=...``, ...)."""

    def __init__(self, tmp: Path, *args: str, prefix: list[str], **kw: Any) -> None:
        super().__init__(tmp, *args, prefix=prefix, **kw)


class OwnSegments:
    """Segments made by this (the attacker's) process, as lmshm makes them; ``unlink_all()``
    removes their names."""

    def __init__(self, default_size: int = 8192) -> None:
        self._made: list = []
        self.default_size = default_size

    def __call__(self, size: int = 0):
        size = size or self.default_size
        from lmshm.platform.cpu.segments import create_segment

        seg, u8 = create_segment(size)
        self._made.append((seg, u8))
        return seg

    def unlink_all(self) -> None:
        for seg, _ in self._made:
            seg.unlink()
        self._made.clear()


def counters_come_back(server: ServerProcess):
    """Generator for a ``baseline`` fixture: yields the counters, then checks they came back."""
    before = server_counts(server.url)
    yield before
    assert server.alive, server.log()[-4000:]
    assert_back_to(server.url, before, fd_slack=1)


# ---- a leak guard that tolerates other lmshm users of /dev/shm (benchmarks run alongside) ----

#: Pids of the processes the current test started (workers); their names count as leaks.
OUR_PIDS: set[int] = set()


def _creator_pid(name: str) -> Optional[int]:
    parts = name.split("-")
    try:
        return int(parts[1], 16)
    except (IndexError, ValueError):
        return None


def our_segments() -> set[str]:
    """lmshm names in /dev/shm made by this process or by a process the test started."""
    mine = OUR_PIDS | {os.getpid()}
    return {n for n in lmshm_segments() if _creator_pid(n) in mine}


# Fixtures for modules that run beside other /dev/shm users: import them under the names
# ``no_segment_outlives_a_test`` and ``start_worker`` to replace conftest's.
import pytest


@pytest.fixture(name="no_segment_outlives_a_test", autouse=True)
def narrow_segment_guard():
    """conftest's guard, narrowed to names made by this test's processes: other lmshm users
    (a benchmark running beside the suite) may own names in /dev/shm meanwhile."""
    before = our_segments()
    yield
    deadline = time.monotonic() + 5
    while (leaked := our_segments() - before) and time.monotonic() < deadline:
        time.sleep(0.05)
    OUR_PIDS.clear()
    assert not leaked, f"lmshm segments left in /dev/shm: {sorted(leaked)}"


@pytest.fixture(name="start_worker")
def local_start_worker(start_server):
    """Start workers; at teardown they exit side by side, before the servers stop (a worker
    leaving a stopped server waits out its timeouts)."""
    workers: list[WorkerProcess] = []

    def start(url: str, *args: str, **kw: Any) -> WorkerProcess:
        worker = WorkerProcess(url, *args, **kw)
        workers.append(worker)
        OUR_PIDS.add(worker.proc.pid)
        return worker

    yield start
    exit_all(workers)


def assert_an_honest_worker_registers(url: str, *, server_pid: Optional[int] = None) -> None:
    """After a hostile action: a verified session registers its own segment, reads it through
    the server and unregisters it (and, if given, is served by ``server_pid``)."""
    from lmshm.platform.cpu.segments import create_segment
    from lmshm.wire import protocol

    seg, u8 = create_segment(4096)
    try:
        with RawSession(url) as honest:
            if server_pid is not None:
                assert honest.hello.server_pid == server_pid
            assert isinstance(honest.register("honest", shm_wrapper(seg.name, 4096)), protocol.RegisterReply)
            assert isinstance(honest.peek("honest"), protocol.PeekReply)
            honest.unregister("honest")
    finally:
        seg.unlink()
        del u8
