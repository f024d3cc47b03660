"""Regions: Triton's shared-memory extension, as registrations of the server's registry.

A *system* region is ``byte_size`` bytes at ``offset`` of a POSIX shared-memory object a client
created (``key``); a *CUDA* region is ``byte_size`` bytes of a ``cudaMalloc`` allocation the
client exported as a ``cudaIpcMemHandle_t``. Both share the registry's one namespace with KV
caches (``Registry.add_region``). Validation follows Triton's order: name, key, offset and size
(``validate_*``), then the duplicate check, then the open and the bounds (``open_*``).

Who owns what: the client creates, sizes and unlinks the object; the server opens it without
``O_CREAT``, closes its fd on every path and never unlinks it. The mapping lives until the
region is unregistered *and* the last view handed out (``lmshm.Server.region_view``) is freed.
The trap: the HTTP and gRPC endpoints cannot see who calls, so ownership is decided by the
object: a system region is mapped only if it belongs to the server's uid or an ``--allow-uid``,
and lmshm's own segments (``lmshm-*``) are never accepted as keys.
"""

from __future__ import annotations

import errno
import mmap
import os
import stat
from dataclasses import dataclass
from typing import Any, Iterable

import torch

from lmshm.core.errors import ErrorCode, ServerError
from lmshm.platform.base.mappings import MAPPINGS
from lmshm.platform.cpu.wrappers import map_shared
from lmshm.platform.shm_names import SEGMENT_PREFIX, shm_dir
from lmshm.quoting import quote

#: The largest offset or size anyone can mean: off_t is signed 64-bit.
MAX_OFFSET = (1 << 63) - 1
MAX_KEY_BYTES = 255          # NAME_MAX: the file name after the leading '/'s
MAX_KEY_TOTAL_BYTES = 4096   # PATH_MAX: the whole key, leading '/'s included
CUDA_HANDLE_BYTES = 64


def _invalid(message: str) -> ServerError:
    return ServerError(ErrorCode.INVALID_ARG, message)


def _check_int(what: str, value: Any, lo: int) -> int:
    if type(value) is not int:  # bool is an int subclass: refused too
        raise _invalid(f"{what} must be an integer, got {type(value).__name__} {quote(value, 40)}")
    if not lo <= value <= MAX_OFFSET:
        raise _invalid(f"{what} {value} is out of range [{lo}, 2^63-1]")
    return value


def validate_system(key: Any, offset: Any, byte_size: Any) -> str:
    """Check a system region's request before anything is opened; return the file name."""
    if not isinstance(key, str):
        raise _invalid(f"key must be a string, got {type(key).__name__}")
    # Triton passes the key to shm_open(3), which drops every leading '/': "myobj", "/myobj" and
    # "//myobj" all name /dev/shm/myobj. What follows must be one file name (NAME_MAX bytes).
    file_name = key.lstrip("/")
    if (not file_name or "/" in file_name or file_name in (".", "..") or not file_name.isprintable()
            or len(file_name.encode("utf-8", "surrogatepass")) > MAX_KEY_BYTES
            or len(key.encode("utf-8", "surrogatepass")) > MAX_KEY_TOTAL_BYTES):
        raise _invalid(f"key {quote(key, 80)} is not a POSIX shared-memory name: any number of leading '/', then "
                       f"1 to {MAX_KEY_BYTES} bytes of printable characters without '/' (not '.' or '..'), "
                       f"{MAX_KEY_TOTAL_BYTES} bytes in all at most")
    if file_name.startswith(SEGMENT_PREFIX):
        raise _invalid(f"key {quote(key, 80)} names one of lmshm's own segments ({SEGMENT_PREFIX}*), "
                       "which cannot be registered as a region")
    _check_int("offset", offset, 0)
    _check_int("byte_size", byte_size, 1)
    if offset + byte_size > MAX_OFFSET:
        raise _invalid(f"offset {offset} + byte_size {byte_size} overflows a 64-bit file offset")
    return file_name


def validate_cuda(raw_handle: Any, device_id: Any, byte_size: Any) -> None:
    if not isinstance(raw_handle, (bytes, bytearray)) or len(raw_handle) != CUDA_HANDLE_BYTES:
        size = len(raw_handle) if isinstance(raw_handle, (bytes, bytearray)) else type(raw_handle).__name__
        raise _invalid(f"raw_handle must be a {CUDA_HANDLE_BYTES}-byte cudaIpcMemHandle_t, got {size}")
    _check_int("device_id", device_id, 0)
    _check_int("byte_size", byte_size, 1)


@dataclass
class SystemRegion:
    key: str
    offset: int
    byte_size: int
    tensor: Any              # torch.uint8 tensor of byte_size bytes over the server's mapping
    lease: Any               # its share of MAPPINGS
    device: str = "cpu"

    def close(self) -> None:
        self.tensor = None   # the bytes stay mapped while any view's tensor lives
        self.lease.release()


@dataclass
class CudaRegion:
    device_id: int
    byte_size: int
    tensor: Any
    wrapper: Any             # a RawCudaIPCWrapper of the handle (owns the MAPPINGS share)
    device: str = ""         # the GPU's UUID

    def close(self) -> None:
        self.tensor = None
        self.wrapper.close()


def open_system(key: str, file_name: str, offset: int, byte_size: int, allowed_uids: Iterable[int]) -> SystemRegion:
    """Open ``key``, check its owner and size, map ``[offset, offset + byte_size)``. The fd is
    closed before this returns, whatever happens."""

    path = os.path.join(shm_dir(), file_name)
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError as exc:
        code = ErrorCode.NOT_FOUND if exc.errno == errno.ENOENT else ErrorCode.INVALID_ARG
        raise ServerError(code, f"unable to open shared memory object {quote(key, 80)}: "
                                f"{os.strerror(exc.errno or 0)}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _invalid(f"{quote(key, 80)} is not a shared-memory object")
        uids = {os.geteuid(), *allowed_uids}
        if st.st_uid not in uids:
            raise ServerError(ErrorCode.PERMISSION_DENIED,
                              f"shared memory object {quote(key, 80)} belongs to uid {st.st_uid}; lmshm-server "
                              f"(uid {os.geteuid()}) maps only objects of its own uid or of one allowed with "
                              "--allow-uid")
        if offset + byte_size > st.st_size:
            raise _invalid(f"offset {offset} + byte_size {byte_size} = {offset + byte_size} runs past the end of "
                           f"shared memory object {quote(key, 80)} ({st.st_size} bytes)")
        start = offset - offset % mmap.PAGESIZE
        length = offset - start + byte_size
        lease = MAPPINGS.acquire(("system-region", st.st_dev, st.st_ino, start, length),
                                 lambda: map_shared(fd, length, key, start)[0], _forget)
    finally:
        os.close(fd)
    u8 = torch.frombuffer(lease.value, dtype=torch.uint8)[offset - start:]
    return SystemRegion(key, offset, byte_size, u8, lease)


def _forget(buf: Any) -> None:
    del buf  # unmapped by its finaliser once the last tensor on it is freed


def open_cuda(raw_handle: bytes, device_id: int, byte_size: int) -> CudaRegion:
    """Open a client's CUDA IPC handle on ``device_id`` and view ``byte_size`` bytes of it."""
    try:    # lazy: cuda-python is optional; a CPU-only install never imports it
        from lmshm.platform.cuda.driver import get_driver
        from lmshm.platform.cuda.raw_ipc import RawCudaIPCWrapper

        uuid = get_driver().device_uuid(device_id)
    except Exception as exc:
        raise ServerError(ErrorCode.UNAVAILABLE,
                          f"cannot open CUDA device {device_id} in lmshm-server: {type(exc).__name__}: "
                          f"{quote(str(exc), 200)}") from None
    wrapper = RawCudaIPCWrapper(dtype="uint8", shape=(byte_size,), stride=(1,), storage_offset=0, device=uuid,
                                producer=f"0-{'0' * 12}", ipc_handle=bytes(raw_handle), alloc_offset=0,
                                alloc_size=byte_size)
    try:
        tensor = wrapper.to_tensor()
    except Exception as exc:
        wrapper.close()
        raise _invalid(f"cannot open the CUDA IPC handle on device {device_id} ({byte_size} bytes): "
                       f"{quote(str(exc), 300)}") from None
    return CudaRegion(device_id, byte_size, tensor, wrapper, uuid)


def view_of(tensor: Any, region_bytes: int, offset: Any, byte_size: Any, what: str) -> Any:
    """``byte_size`` bytes at ``offset`` of a region's uint8 tensor, bounds- and overflow-checked."""
    _check_int("offset", offset, 0)
    _check_int("byte_size", byte_size, 0)
    if offset + byte_size > region_bytes:
        raise _invalid(f"offset {offset} + byte_size {byte_size} runs past the end of {what} "
                       f"({region_bytes} bytes)")
    return tensor[offset:offset + byte_size]

