"""What the sealed memfd (the default CPU kind) guarantees on this kernel, and what the consumer
refuses. These are the facts behind the server's mapped fast path (docs/design/security.md):

- a memfd sealed F_SEAL_SHRINK | F_SEAL_GROW cannot change size by any path: ftruncate (to less,
  to 0, to more), truncate through /proc, a second read-write open, fallocate past the end;
- a hole punched in it (the seals do not stop that) refaults in every mapping as zeros, in
  another process too, for reads and writes: no SIGBUS;
- its owner closing the fd and exiting changes nothing for a mapping;
- the consumer maps only shmem memfds sealed against shrinking, and checks that before it reads
  the size.

Mappers run in spawned processes: a SIGBUS would show as their exit status.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import multiprocessing as mp
import os
import signal
import socket

import pytest
import torch

from lmshm.platform.base.fds import FD_INBOX
from lmshm.platform.base.ipc_wrapper import DeviceIPCWrapper
from lmshm.platform.cpu import CpuFdIPCWrapper, empty_shared, segment_of
from lmshm.platform.cpu.segments import create_segment
from lmshm.platform.cpu.wrappers import TMPFS_MAGIC, _fs_type, sealed_shmem

CTX = mp.get_context("spawn")
PAGE = 4096
_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]


def punch(fd: int, offset: int, length: int) -> None:
    if _libc.fallocate(fd, 3, offset, length) != 0:   # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def refused(call) -> str:
    try:
        call()
    except OSError as exc:
        return errno.errorcode[exc.errno]
    return "allowed"


def test_a_sealed_memfd_refuses_every_way_to_change_its_size():
    seg, u8 = create_segment(16 * PAGE, "memfd")
    fd = seg.fd
    try:
        assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) & (fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW) == \
            fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
        again = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)   # a second open file description
        try:
            attempts = {
                "ftruncate to less": lambda: os.ftruncate(fd, PAGE),
                "ftruncate to 0": lambda: os.ftruncate(fd, 0),
                "ftruncate to more": lambda: os.ftruncate(fd, 32 * PAGE),
                "truncate by path": lambda: os.truncate(f"/proc/self/fd/{fd}", 0),
                "ftruncate through a reopened fd": lambda: os.ftruncate(again, 0),
                "fallocate past the end": lambda: os.posix_fallocate(fd, 16 * PAGE, PAGE),
                "unseal (F_SEAL_SEAL)": lambda: fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE),
            }
            assert {what: refused(call) for what, call in attempts.items()} == {what: "EPERM" for what in attempts}
            assert os.fstat(fd).st_size == 16 * PAGE
            assert refused(lambda: punch(again, PAGE, PAGE)) == "allowed"      # what the seals leave open
        finally:
            os.close(again)
    finally:
        seg.unlink()
        del u8


def _map_and_touch(path: str, payload: bytes, conn) -> None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    _, fds, _, _ = socket.recv_fds(sock, 16, 1)
    sock.close()
    wrapper = DeviceIPCWrapper.Deserialize(payload)
    FD_INBOX.put(wrapper.segment, fds[0], session=None)
    t = wrapper.to_tensor().view(torch.uint8)
    conn.send("mapped")
    while (cmd := conn.recv()) != "done":
        if cmd == "read":
            conn.send([int(t[i]) for i in range(0, t.numel(), PAGE)])
        elif cmd == "write":
            t[::PAGE] = 9
            conn.send("written")
    wrapper.close()
    FD_INBOX.close_session(None)
    conn.send(int(t.sum()))


def _listener(tmp_path) -> tuple[socket.socket, str]:
    path = str(tmp_path / "fds.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    listener.settimeout(60)
    return listener, path


def _start_mapper(wrapper: CpuFdIPCWrapper, fd: int, tmp_path):
    listener, path = _listener(tmp_path)
    parent, child = CTX.Pipe()
    proc = CTX.Process(target=_map_and_touch, args=(path, wrapper.Serialize(), child))
    proc.start()
    with listener, listener.accept()[0] as conn:
        socket.send_fds(conn, [b"x"], [fd])
    assert parent.recv() == "mapped"
    return proc, parent


def test_a_hole_punched_under_another_process_mapping_refaults_as_zeros_for_reads_and_writes(tmp_path):
    t = empty_shared((64 * PAGE,), torch.uint8, kind="memfd")
    t.fill_(7)
    wrapper = CpuFdIPCWrapper.wrap(t, "kv")
    seg = segment_of(t)
    proc, conn = _start_mapper(wrapper, seg.fd, tmp_path)
    try:
        conn.send("read")
        assert set(conn.recv()) == {7}
        punch(seg.fd, 0, 64 * PAGE)                     # every page, while the other process maps it
        assert os.fstat(seg.fd).st_blocks == 0
        conn.send("read")
        assert set(conn.recv()) == {0}                  # zeros, not SIGBUS
        conn.send("write")
        assert conn.recv() == "written"
        assert set(t[::PAGE].tolist()) == {9}           # the same pages, again shared
        conn.send("done")
        assert conn.recv() == 9 * 64
        proc.join(30)
        assert proc.exitcode == 0, f"the mapper died: exit status {proc.exitcode} (SIGBUS is {-signal.SIGBUS})"
    finally:
        if proc.is_alive():
            proc.kill()
        wrapper.close()


def _own_and_leave(path: str, conn) -> None:
    """Owner: make a sealed memfd, send it, then try everything, close the fd and exit."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    t = empty_shared((16 * PAGE,), torch.uint8, kind="memfd")
    t.fill_(5)
    w = CpuFdIPCWrapper.wrap(t, "kv")
    socket.send_fds(sock, [w.Serialize()], [segment_of(t).fd])
    sock.close()
    assert conn.recv() == "go"
    fd = segment_of(t).fd
    results = [refused(lambda: os.ftruncate(fd, 0)), refused(lambda: punch(fd, 0, 8 * PAGE))]
    w.close()
    segment_of(t).unlink()     # closes the memfd
    conn.send(results)
    # and exits, with its own mapping gone


def test_the_owner_truncating_punching_closing_and_exiting_leaves_the_consumer_mapping_usable(tmp_path):
    listener, path = _listener(tmp_path)
    parent, child = CTX.Pipe()
    owner = CTX.Process(target=_own_and_leave, args=(path, child))
    owner.start()
    with listener, listener.accept()[0] as conn:
        msg, fds, _, _ = socket.recv_fds(conn, 1 << 16, 1)
    wrapper = DeviceIPCWrapper.Deserialize(msg)
    FD_INBOX.put(wrapper.segment, fds[0], session=None)
    try:
        t = wrapper.to_tensor().view(torch.uint8)
        parent.send("go")
        assert parent.recv() == ["EPERM", "allowed"]
        owner.join(30)
        assert owner.exitcode == 0
        # this process maps it now, alone: the first half was punched (zeros), the rest is the owner's
        assert set(t[:8 * PAGE:PAGE].tolist()) == {0} and set(t[8 * PAGE::PAGE].tolist()) == {5}
        t.fill_(3)
        assert int(t.sum()) == 3 * 16 * PAGE
        del t
    finally:
        wrapper.close()
        FD_INBOX.close_session(None)


def _refusal(fd: int, token: str, size: int) -> str:
    wrapper = CpuFdIPCWrapper(dtype="uint8", shape=(size,), stride=(1,), storage_offset=0, device="cpu",
                              segment=token, segment_bytes=size, byte_offset=0)
    FD_INBOX.put(token, os.dup(fd), session=None)
    try:
        wrapper.to_tensor()
    except PermissionError as exc:
        return str(exc)
    finally:
        wrapper.close()
        FD_INBOX.close_session(None)
    return "mapped"


def test_the_consumer_maps_only_shmem_memfds_sealed_against_shrinking(tmp_path):
    token = "lmshm-1-effffffc-00000000000000aa"
    unsealed = os.memfd_create("x", os.MFD_ALLOW_SEALING)
    os.ftruncate(unsealed, PAGE)
    os.posix_fallocate(unsealed, 0, PAGE)
    assert "not sealed against shrinking" in _refusal(unsealed, token, PAGE)
    fcntl.fcntl(unsealed, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)       # F_SEAL_SHRINK alone is enough
    assert _refusal(unsealed, token, PAGE) == "mapped"
    os.close(unsealed)
    tmpfs = os.open("/dev/shm", os.O_TMPFILE | os.O_RDWR, 0o600)          # shmem, but no memfd: no seals
    os.ftruncate(tmpfs, PAGE)
    os.posix_fallocate(tmpfs, 0, PAGE)
    assert "not sealed against shrinking" in _refusal(tmpfs, token, PAGE)
    os.close(tmpfs)
    disk = os.open(tmp_path / "f", os.O_CREAT | os.O_RDWR, 0o600)
    os.ftruncate(disk, PAGE)
    assert "is not a memfd" in _refusal(disk, token, PAGE)
    os.close(disk)


def test_a_hugetlb_memfd_is_refused_even_when_sealed():
    try:
        fd = os.memfd_create("huge", os.MFD_HUGETLB | os.MFD_ALLOW_SEALING)
    except OSError as exc:
        pytest.skip(f"no hugetlbfs memfds here: {exc}")
    try:
        os.ftruncate(fd, 2 << 20)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        with pytest.raises(PermissionError, match="not on shmem.*SIGBUS"):
            sealed_shmem(fd, "memfd 'huge'")
    finally:
        os.close(fd)


def test_a_memfd_is_shmem_outside_dev_shm_so_a_full_dev_shm_cannot_touch_it():
    seg, u8 = create_segment(PAGE, "memfd")
    try:
        assert _fs_type(seg.fd) == TMPFS_MAGIC
        assert os.fstat(seg.fd).st_dev != os.stat("/dev/shm").st_dev   # the kernel's own shmem mount
    finally:
        seg.unlink()
        del u8
