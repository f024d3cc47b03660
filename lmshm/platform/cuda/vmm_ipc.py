"""VmmCudaIPCWrapper: CUDA VMM memory (cuMemCreate + cuMemMap) shared as a POSIX fd or a fabric handle.

Producer: ``cuMemGetAddressRange`` gives the physical chunk holding the tensor (a tensor running
past it is refused), which is exported with the requested handle type: ``posix-fd`` (default;
the wire carries a token, the fd goes over the server's fd channel) or ``fabric`` (64 bytes in
the wrapper). The wrapper owns its fd until ``close()``; its ``sibling()``s (the other layers of
one chunk) share it but never close it.

Consumer: import, reserve, map and grant access, undoing what succeeded if a step fails; the
mapping is shared through ``MAPPINGS`` and its last release unmaps only after
``streams.quiesce`` (else it is leaked and counted, never unmapped under DMA). The trap: the
driver hands a released allocation's handle value out again, so a worker that frees a pool and
makes another can send a new chunk under an old (producer, handle) pair; every export carries a
random ``export_nonce``, part of the mapping key. docs/design/cuda-wrappers.md has the rest.
"""

from __future__ import annotations

import os
import re
import secrets
from typing import Any, Hashable

from lmshm.platform.base.fds import FD_INBOX
from lmshm.platform.base.ipc_wrapper import WrapperDecodeError
from lmshm.platform.cuda import devices, streams
from lmshm.platform.cuda._common import (
    DeviceMapping,
    FlatCudaWrapper,
    check_bytes,
    check_int,
    producer_id,
    quietly,
)
from lmshm.platform.cuda.driver import (
    FABRIC_HANDLE_BYTES,
    HANDLE_TYPE_BITS,
    CudaDriverError,
    get_driver,
    handle_type_names,
    hexptr,
)
from lmshm.platform.cuda.errors import (
    FD_CHANNEL_HINT,
    NOT_VMM_HINT,
    SPANS_CHUNKS_HINT,
    VMM_HANDLE_TYPE_ENV,
    NotVmmMemoryError,
    VmmNotExportableError,
    VmmSpansChunksError,
    not_exportable_hint,
)
from lmshm.quoting import quote

HANDLE_TYPES = ("posix-fd", "fabric")
_TOKEN_RE = re.compile(r"^cuda-vmm-[0-9]{1,10}-[0-9a-f]{16}$")

FABRIC_EXPORT_HINT = (
    "fabric handles need a system with an NVSwitch/IMEX fabric and the process granted an IMEX "
    f"channel (/dev/nvidia-caps-imex-channels); on a single host use {VMM_HANDLE_TYPE_ENV}=posix-fd"
)


def vmm_handle_type() -> str:
    """The handle type new VMM wrappers use: ``LMSHM_VMM_HANDLE_TYPE`` (default posix-fd)."""
    raw = os.environ.get(VMM_HANDLE_TYPE_ENV, "").strip().lower() or "posix-fd"
    if raw not in HANDLE_TYPES:
        raise ValueError(f"{VMM_HANDLE_TYPE_ENV}={raw!r} is not a VMM handle type; use posix-fd or fabric")
    return raw


class VmmCudaIPCWrapper(FlatCudaWrapper):
    """A CUDA tensor in VMM memory, shared as a POSIX fd or fabric handle of its chunk."""

    kind = "cuda-vmm"
    fd_channel_hint = FD_CHANNEL_HINT
    extra_fields = ("producer", "handle_type", "fd_token", "fabric_handle", "alloc_id",
                    "export_nonce", "alloc_offset", "alloc_size")
    # The exported fd is the leader's alone: siblings never close it (see export_fds).
    leader_only_attrs = ("_fd",)

    # ---- producer --------------------------------------------------------------------------
    @classmethod
    def _export(cls, ptr: int, nbytes: int, dtype: str, shape: tuple[int, ...], stride: tuple[int, ...],
                ordinal: int, name: str, handle_type: str | None = None) -> "VmmCudaIPCWrapper":
        handle_type = handle_type or vmm_handle_type()
        if handle_type not in HANDLE_TYPES:
            raise ValueError(f"handle_type must be one of {HANDLE_TYPES}, got {handle_type!r}")
        drv = get_driver()
        uuid = drv.device_uuid(ordinal)
        where = f"{name!r} (ptr={hexptr(ptr)}, cuda:{ordinal} {uuid})"
        try:
            base, size = drv.address_range(ptr, ordinal)
        except CudaDriverError as exc:
            raise NotVmmMemoryError(f"cannot share {where}: {exc}", NOT_VMM_HINT) from exc
        if ptr + nbytes > base + size:
            raise VmmSpansChunksError(
                f"cannot share {where}: its {nbytes} bytes span several physical allocations (the "
                f"chunk holding its first byte is [{hexptr(base)}, {hexptr(base + size)}), the "
                f"tensor ends at {hexptr(ptr + nbytes)})",
                SPANS_CHUNKS_HINT,
            )
        try:
            legacy = drv.is_legacy_ipc_capable(ptr, ordinal)
        except CudaDriverError:
            legacy = False  # drivers without the attribute: let the retain below decide
        if legacy:
            raise NotVmmMemoryError(f"cannot share {where}: it is cudaMalloc memory, not VMM memory", NOT_VMM_HINT)
        try:
            alloc = drv.retain_allocation(ptr, ordinal)
        except CudaDriverError as exc:
            raise NotVmmMemoryError(f"cannot share {where}: {exc}", NOT_VMM_HINT) from exc
        fd: int | None = None
        fabric = b""
        try:
            requested = drv.allocation_handle_types(alloc, ordinal)
            if not requested & HANDLE_TYPE_BITS[handle_type]:
                raise VmmNotExportableError(
                    f"cannot export {where} as a {handle_type} handle",
                    not_exportable_hint(handle_type, handle_type_names(requested)),
                )
            try:
                if handle_type == "posix-fd":
                    fd = drv.export_posix_fd(alloc, ordinal)
                else:
                    fabric = drv.export_fabric(alloc, ordinal)
            except CudaDriverError as exc:
                hint = FABRIC_EXPORT_HINT if handle_type == "fabric" else not_exportable_hint(
                    handle_type, handle_type_names(requested))
                raise VmmNotExportableError(f"cannot export {where}: {exc}", hint) from exc
        finally:
            quietly("releasing a retained allocation handle", drv.release_allocation, alloc, ordinal)
        try:
            wrapper = cls(dtype=dtype, shape=shape, stride=stride, storage_offset=0, device=uuid,
                          producer=producer_id(), handle_type=handle_type,
                          fd_token=_new_token() if fd is not None else "", fabric_handle=fabric,
                          alloc_id=alloc, export_nonce=secrets.randbits(64),
                          alloc_offset=ptr - base, alloc_size=size)
        except BaseException:
            if fd is not None:
                os.close(fd)
            raise
        wrapper._fd = fd
        return wrapper

    @property
    def needs_fd_channel(self) -> bool:
        """True if this wrapper's handle is a file descriptor that must travel out of band."""
        return self.handle_type == "posix-fd"

    def export_fds(self) -> dict[str, int]:
        """``{fd_token: fd}``; a sibling gives its leader's fd (the same token), which the
        leader owns: it is valid while the leader is open, and refused after."""
        if not self.needs_fd_channel:
            return {}
        owner = self.leader if self.leader is not None else self
        fd = None if self._closed or owner.closed else owner.__dict__.get("_fd")
        if fd is None:
            if owner is not self and not self._closed:
                raise RuntimeError(
                    f"{type(self).__name__} {self.fd_token!r}: no fd to export: this wrapper is a "
                    "sibling of a leader that was closed, and the leader owned the exported fd "
                    "(export a group while its first wrapper is open, or wrap the tensor again)"
                )
            raise RuntimeError(
                f"{type(self).__name__} {self.fd_token!r}: no fd to export (only the producer "
                "that wrapped the tensor can export it, while the wrapper is open)"
            )
        return {self.fd_token: fd}

    def fd_tokens(self) -> tuple[str, ...]:
        return (self.fd_token,) if self.needs_fd_channel else ()

    def _close_extra(self) -> None:
        super()._close_extra()
        fd = self.__dict__.pop("_fd", None)
        if fd is not None:
            quietly("closing an exported VMM fd", os.close, fd)

    # ---- wire checks -----------------------------------------------------------------------
    def _validate_extra(self) -> None:
        super()._validate_extra()
        cls = type(self)
        if self.handle_type not in HANDLE_TYPES:
            raise WrapperDecodeError(f"{cls.__name__}: handle_type must be one of {HANDLE_TYPES}, got {quote(self.handle_type)}")
        check_int(cls, "alloc_id", self.alloc_id, hi=(1 << 64) - 1)
        check_int(cls, "export_nonce", self.export_nonce, hi=(1 << 64) - 1)
        check_bytes(cls, "fabric_handle", self.fabric_handle, max_len=FABRIC_HANDLE_BYTES)
        if self.handle_type == "posix-fd":
            if not isinstance(self.fd_token, str) or not _TOKEN_RE.match(self.fd_token) or self.fabric_handle:
                raise WrapperDecodeError(f"{cls.__name__}: a posix-fd wrapper needs a valid fd_token and no fabric handle")
        elif self.fd_token != "" or len(self.fabric_handle) != FABRIC_HANDLE_BYTES:
            raise WrapperDecodeError(
                f"{cls.__name__}: a fabric wrapper needs a {FABRIC_HANDLE_BYTES}-byte fabric_handle and no fd_token"
            )

    # ---- consumer --------------------------------------------------------------------------
    def _mapping_key(self) -> Hashable:
        # Scoped to the session: another session naming the same producer and allocation
        # gets (and must prove with its own fd) an import of its own. The nonce tells two
        # exports apart whose handle value the producer's driver recycled.
        return ("cuda-vmm", self._scope(), devices.normalize_uuid(self.device), self.producer,
                self.alloc_id, self.export_nonce, self.alloc_size)

    def _open(self, ordinal: int) -> DeviceMapping:
        drv = get_driver()
        if self.handle_type == "posix-fd":
            try:
                fd = FD_INBOX.take(self.fd_token, self._scope())
            except LookupError as exc:
                raise LookupError(f"{type(self).__name__}: {exc}. {FD_CHANNEL_HINT}") from None
            try:
                alloc = drv.import_posix_fd(fd, ordinal)
            finally:
                quietly("closing a received VMM fd", os.close, fd)  # the import holds the memory
        else:
            alloc = drv.import_fabric(self.fabric_handle, ordinal)
        size = self.alloc_size
        va: int | None = None
        mapped = False
        try:
            gran = drv.granularity(ordinal, self.handle_type)
            if size % gran:
                raise ValueError(
                    f"{type(self).__name__}: alloc_size {size} is not a multiple of the device's "
                    f"allocation granularity ({gran})"
                )
            va = drv.reserve(size, ordinal)
            drv.map(va, size, alloc, ordinal)
            mapped = True
            drv.set_access(va, size, ordinal)
        except BaseException:
            if mapped:
                quietly("unmapping a half-imported VMM allocation", drv.unmap, va, size, ordinal)
            if va is not None:
                quietly("freeing a reserved VMM range", drv.free_address, va, size, ordinal)
            quietly("releasing an imported VMM handle", drv.release_allocation, alloc, ordinal)
            raise
        return DeviceMapping(base=va, size=size, ordinal=ordinal, handle=alloc, scope=self._scope())

    @staticmethod
    def _close_mapping(mapping: DeviceMapping) -> None:
        what = f"a VMM import at {hexptr(mapping.base)} ({mapping.size} bytes, cuda:{mapping.ordinal})"
        if not streams.quiesce(mapping.ordinal, scope=mapping.scope):
            streams.leak_mapping(what)
            return
        drv = get_driver()
        quietly("cuMemUnmap of a VMM import", drv.unmap, mapping.base, mapping.size, mapping.ordinal)
        quietly("cuMemAddressFree of a VMM import", drv.free_address, mapping.base, mapping.size, mapping.ordinal)
        quietly("cuMemRelease of a VMM import", drv.release_allocation, mapping.handle, mapping.ordinal)

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        d["handle_type"] = self.handle_type
        return d


def _new_token() -> str:
    return f"cuda-vmm-{os.getpid()}-{secrets.token_hex(8)}"
