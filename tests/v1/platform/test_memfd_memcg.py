"""A hole punched in a sealed memfd, refaulted by a process whose memory cgroup has no room left.

Opt-in (``LMSHM_TEST_MEMCG=1``, as root, with a writable memory cgroup): the test makes a child
cgroup of its own process's cgroup with a 64 MiB limit, moves a spawned "server" into it, maps a
128 MiB sealed memfd that the test process filled (and was charged for), punches every page, and
lets the server touch them again. What this kernel does, recorded in docs/design/security.md:

- reading or writing the punched pages through the mapping allocates them again, charged to the
  server's cgroup: past its limit the cgroup's OOM killer ends the server with SIGKILL. Never
  SIGBUS (shmem has no size limit on the kernel's internal mount);
- ``pwritev`` into the holes (the file path for named segments) is charged the same way and ends
  the same way;
- ``preadv`` of the holes reads zeros and allocates nothing.

So a worker can move up to the bytes it registered from its own memory account to the server's;
the server's per-copy hole check narrows that to punches racing a copy. The cost is bounded by
what the worker registered, which the worker held before.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import signal
import time
from pathlib import Path

import pytest

from lmshm.platform.cpu.segments import create_segment

CTX = mp.get_context("spawn")
SIZE = 128 << 20
LIMIT = 64 << 20

pytestmark = pytest.mark.skipif(os.environ.get("LMSHM_TEST_MEMCG") != "1",
                                reason="opt-in: LMSHM_TEST_MEMCG=1 (root, writable memory cgroup)")


def _memory_cgroup() -> tuple[Path, str]:
    """This process's memory cgroup directory, and the limit file's name (v1 or v2)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return Path("/sys/fs/cgroup/memory") / path.lstrip("/"), "memory.limit_in_bytes"
        if controllers == "" and Path("/sys/fs/cgroup/cgroup.controllers").exists():
            if "memory" in Path("/sys/fs/cgroup/cgroup.controllers").read_text().split():
                return Path("/sys/fs/cgroup") / path.lstrip("/"), "memory.max"
    pytest.skip("no memory cgroup controller found")


def _server(cgroup: str, fd_path: str, how: str, conn) -> None:
    import mmap

    with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))
    fd = os.open(fd_path, os.O_RDWR)
    m = mmap.mmap(fd, SIZE)
    conn.send("ready")
    assert conn.recv() == "go"
    if how == "read-mapping":
        total = sum(m[i] for i in range(0, SIZE, 4096))
    elif how == "write-mapping":
        for i in range(0, SIZE, 4096):
            m[i] = 1
        total = 0
    elif how == "pread":
        buf, total = bytearray(1 << 20), 0
        for off in range(0, SIZE, 1 << 20):
            total += os.preadv(fd, [buf], off)
    else:  # pwrite
        zeros, total = bytes(1 << 20), 0
        for off in range(0, SIZE, 1 << 20):
            total += os.pwritev(fd, [zeros], off)
    conn.send(("done", total))


@pytest.mark.parametrize("how,ends", [("read-mapping", "SIGKILL"), ("write-mapping", "SIGKILL"),
                                      ("pread", "exit 0"), ("pwrite", "SIGKILL")])
def test_refaulting_punched_pages_past_the_cgroup_limit_is_an_oom_kill_not_sigbus(how, ends):
    parent_cg, limit_file = _memory_cgroup()
    cg = parent_cg / f"lmshm-test-{os.getpid()}"
    try:
        cg.mkdir()
    except OSError as exc:
        pytest.skip(f"cannot make a memory cgroup under {parent_cg}: {exc}")
    seg, u8 = create_segment(SIZE, "memfd")
    try:
        (cg / limit_file).write_text(str(LIMIT))
        u8.fill_(7)                                   # charged to this process's cgroup
        parent, child = CTX.Pipe()
        proc = CTX.Process(target=_server, args=(str(cg), f"/proc/{os.getpid()}/fd/{seg.fd}", how, child))
        proc.start()
        assert parent.recv() == "ready"
        libc = ctypes.CDLL(None, use_errno=True)
        assert libc.fallocate(seg.fd, 3, ctypes.c_long(0), ctypes.c_long(SIZE)) == 0   # punch it all
        parent.send("go")
        proc.join(60)
        status = f"signal {signal.Signals(-proc.exitcode).name}" if proc.exitcode < 0 else f"exit {proc.exitcode}"
        assert status != "signal SIGBUS"
        assert status == ("signal SIGKILL" if ends == "SIGKILL" else "exit 0"), status
    finally:
        seg.unlink()
        del u8
        for _ in range(50):
            try:
                cg.rmdir()
                break
            except OSError:
                time.sleep(0.1)
