"""Identity and endpoints: the client trusts only the server it said HELLO to, the default fd
socket lives where nobody else can put one, the server sweeps dead workers' names, and a second
signal cannot cut its shutdown short."""

from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from harness import ServerProcess, lmshm_segments, wait_for

from lmshm.platform.cpu import empty_shared
from lmshm.transport.client import LmshmError, MPClient, query_status
from lmshm.transport.fdchannel import user_runtime_dir


def test_the_client_refuses_a_squatting_fd_socket_before_sending_its_token(shared_server, tmp):
    # Someone listens on a path the worker was told to use: it must get nothing, not even the token.
    path = str(tmp / "squat.sock")
    squatter = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    squatter.bind(path)
    squatter.listen(4)
    try:
        with pytest.raises(LmshmError, match=r"is pid \d+, not the lmshm-server \(pid \d+\).*refusing to send"):
            MPClient(shared_server.url, fd_socket=path, heartbeat=False)
        conn, _ = squatter.accept()
        conn.settimeout(1.0)
        try:
            assert conn.recv(65536) == b"", "the client sent something to the squatter"
        except socket.timeout:
            pytest.fail("the client kept the connection open instead of leaving")
        finally:
            conn.close()
    finally:
        squatter.close()
        os.unlink(path)


def test_the_default_fd_socket_lives_in_a_private_per_uid_directory(tmp):
    server = ServerProcess(tmp, "--reap-timeout", "5", fd_socket="")
    try:
        fd_socket = Path(server.fd_socket)
        directory = fd_socket.parent
        assert directory == Path(user_runtime_dir())
        st = os.lstat(directory)
        assert stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o700
        assert stat.S_IMODE(os.stat(fd_socket).st_mode) == 0o600
        with MPClient(server.url, heartbeat=False) as client:
            assert client.ping() > 0
    finally:
        assert server.stop() == 0, server.log()
    assert not fd_socket.exists()


def test_a_squatted_per_uid_directory_is_refused(tmp, monkeypatch):
    # The directory is open to others: a server must not put its fd socket there.
    monkeypatch.setenv("TMPDIR", str(tmp))
    bad = tmp / f"lmshm-{os.geteuid()}"
    bad.mkdir(mode=0o777)
    os.chmod(bad, 0o777)
    proc = subprocess.run([sys.executable, "-m", "lmshm.server", "--port", "0"],
                          capture_output=True, text=True, timeout=60, env={**os.environ, "TMPDIR": str(tmp)})
    assert proc.returncode == 1
    assert "must be a directory of uid" in proc.stderr and "mode 0700" in proc.stderr
    bad.rmdir()


_ORPHAN = """
import sys, torch
from lmshm import empty_shared
from lmshm.platform.cpu import segment_of
t = empty_shared((1024,), torch.float16, kind="shm")
print(segment_of(t).name, flush=True)
sys.stdin.read()
"""


def _orphan(tmp) -> str:
    """A segment whose creator was SIGKILLed before registering it."""
    proc = subprocess.Popen([sys.executable, "-c", _ORPHAN], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    name = proc.stdout.readline().strip()
    proc.kill()
    proc.wait()
    proc.stdout.close()
    proc.stdin.close()
    assert name in lmshm_segments()
    return name


def test_the_server_sweeps_dead_workers_names_at_start_and_periodically(tmp):
    before = _orphan(tmp)
    server = ServerProcess(tmp, "--reap-timeout", "5", "--sweep-interval", "0.3")
    try:
        wait_for(lambda: before not in lmshm_segments(), 5, 0.05, "the start-up sweep")
        live = empty_shared((16,), torch.float16, kind="shm")  # a live creator's name is never swept
        later = _orphan(tmp)
        wait_for(lambda: later not in lmshm_segments(), 5, 0.05, "a periodic sweep")
        assert "removed 1 orphaned segment name(s)" in server.log()
        from lmshm.platform.cpu import segment_of

        assert segment_of(live).name in lmshm_segments()
        del live
    finally:
        assert server.stop() == 0, server.log()


def test_a_second_sigterm_during_shutdown_does_not_cut_the_release_short(tmp, start_worker):
    server = ServerProcess(tmp, "--reap-timeout", "5")
    try:
        worker = start_worker(server.url)
        for _ in range(4):
            worker.ok("register", layers=64, layout="per-layer", shape=[2, 4, 8])
        assert query_status(server.url).mappings == 256
    finally:
        server.proc.send_signal(signal.SIGTERM)
        for _ in range(20):  # keep signalling while it releases
            time.sleep(0.005)
            if server.proc.poll() is not None:
                break
            server.proc.send_signal(signal.SIGTERM)
        rc = server.stop()
    assert rc == 0, server.log()
    assert "released 4 registration(s)" in server.log()
