"""The server's checks on a cuda-torch wrapper's reference counter, before torch may touch it.

torch's consumer side decrements an int64 at ``ref_counter_offset`` of the /dev/shm file named
``ref_counter_handle`` -- both chosen by the peer. ``admit`` must refuse anything but the
producer's own counter file, in torch's form, with the offset inside it. These checks are file
and string logic: they run here without a GPU or a driver (nothing here calls CUDA). On a GPU,
``cuda_testing.receive`` runs the same ``admit`` on torch's real counter files for every
cuda-torch GPU test.
"""

from __future__ import annotations

import os

import pytest

from lmshm.platform.base.peer import Peer, own_pid_namespace
from lmshm.platform.cuda.torch_ipc import REF_COUNTER_FILE_SIZE, CudaIPCWrapper

UUID = "GPU-00000000-1111-2222-3333-444444444444"


def peer(pid: int = 0) -> Peer:
    pid = pid or os.getpid()
    return Peer(session="s", pid=pid, uid=os.geteuid(), gid=os.getegid(), ns_pid=pid, pid_ns=own_pid_namespace())


def wrapper(handle: str, offset: int = 3, producer_pid: int = 0) -> CudaIPCWrapper:
    return CudaIPCWrapper(
        dtype="float16", shape=(64,), stride=(1,), storage_offset=0, device=UUID,
        producer=f"{producer_pid or os.getpid()}-0123456789ab", torch_handle=b"\x01" * 64, storage_bytes=128,
        storage_byte_offset=0, ref_counter_handle=handle.encode(), ref_counter_offset=offset,
        event_handle=b"", event_sync_required=False)


#: What torch's RefcountedMapAllocator makes for 10000 counters: their 80000 bytes plus a 64-byte
#: header (seen with torch 2.13's CPU ``file_system`` sharing, the same allocator the CUDA
#: counters use: /dev/shm/torch_<pid>_<random>_<n> of 80064 bytes).
TORCH_FILE_BYTES = REF_COUNTER_FILE_SIZE * 8 + 64


@pytest.fixture
def counter_file():
    """A file shaped like torch's: /dev/shm/torch_<pid>_<random>_<n>, of this uid."""
    name = f"/torch_{os.getpid()}_123456789_7"
    path = "/dev/shm" + name
    with open(path, "wb") as f:
        f.truncate(TORCH_FILE_BYTES)
    yield name, path
    if os.path.exists(path):
        os.unlink(path)


def test_the_producers_own_counter_file_is_admitted(counter_file):
    name, _ = counter_file
    wrapper(name, offset=REF_COUNTER_FILE_SIZE - 1).admit(peer())


@pytest.mark.parametrize("handle", ["/etc/passwd", "/../../etc/passwd", "/torch_1_2", "torch_1_2_3", "/torch_x_1_2"])
def test_a_counter_name_not_in_torchs_form_is_refused(handle):
    with pytest.raises(PermissionError, match="is not a torch counter file"):
        wrapper(handle).admit(peer())


def test_another_processs_counter_file_is_refused(counter_file):
    name, _ = counter_file
    other = os.getppid()
    with pytest.raises(PermissionError, match=rf"belongs to pid {os.getpid()}, not to this worker"):
        wrapper(name, producer_pid=other).admit(peer(other))


def test_an_offset_outside_the_counter_file_is_refused(counter_file):
    name, _ = counter_file
    with pytest.raises(PermissionError, match=f"outside torch's counter file \\({REF_COUNTER_FILE_SIZE} counters"):
        wrapper(name, offset=REF_COUNTER_FILE_SIZE).admit(peer())


def test_a_missing_or_foreign_or_wrongly_sized_counter_file_is_refused(counter_file):
    name, path = counter_file
    os.truncate(path, 16)
    with pytest.raises(PermissionError, match="is not this worker's torch counter file"):
        wrapper(name).admit(peer())
    os.truncate(path, TORCH_FILE_BYTES)
    os.chown(path, 65534, 65534)
    with pytest.raises(PermissionError, match="is not this worker's torch counter file"):
        wrapper(name).admit(peer())
    os.unlink(path)
    with pytest.raises(PermissionError, match="No such file"):
        wrapper(name).admit(peer())


def test_a_wrapper_exported_by_another_pid_is_refused(counter_file):
    name, _ = counter_file
    with pytest.raises(PermissionError, match="exported by pid"):
        wrapper(name, producer_pid=os.getppid()).admit(peer())
