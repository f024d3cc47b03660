"""CudaIPCWrapper: PyTorch's own CUDA storage sharing (the default CUDA wrapper).

Producer: ``storage._share_cuda_()``, the call ``torch.multiprocessing`` makes, yields the
block's IPC handle, the storage's size and offset, a reference-counter slot in a ``/dev/shm``
file and an event handle; lmshm carries them as plain bytes and ints with the caller's exact
view, so any stride works. Consumer: ``UntypedStorage._new_shared_cuda(...)`` opens it, shared
through ``MAPPINGS`` and torch's cache of received storages (64 views of one storage map it once).

Release is explicit: the last lease drops the table's reference, and once no tensor built from
it remains torch's IPC deleter decrements the producer's counter and closes the handle. Needs a
shared ``/dev/shm``; each wrapper's bytes are meant for one consumer process. The trap:
expandable-segments memory is shared as the worker's fds, which the server copies out with
``pidfd_getfd``: it needs the same PID namespace, the same uid and ptrace rights, and says so,
naming ``use_vmm_api`` as the way around. docs/design/cuda-wrappers.md has the rest.
"""

from __future__ import annotations

import os
import re
import stat
from collections import Counter
from typing import Any, Hashable

import torch

from lmshm.platform.base.ipc_wrapper import WrapperDecodeError, dtype_name
from lmshm.platform.cuda._common import (
    CudaWrapperBase,
    check_bytes,
    check_int,
    producer_id,
    producer_ordinal,
)
from lmshm.platform.cuda.driver import get_driver
from lmshm.platform.cuda.errors import TORCH_EXPANDABLE_HINT
from lmshm.quoting import quote

#: Storages opened with ``_new_shared_cuda`` in this process (torch maps each block once).
stats: Counter[str] = Counter()

_MAX_HANDLE = 64 * 1024
#: torch's CUDA_IPC_REF_COUNTER_FILE_SIZE: counters (int64) per reference-counter file.
REF_COUNTER_FILE_SIZE = 10000
_REF_COUNTER_RE = re.compile(r"/torch_([0-9]{1,10})_([0-9]{1,20})_([0-9]{1,20})")


#: torch's ShareableHandleType for a block in expandable segments (CUDACachingAllocator.cpp).
_SHAREABLE_EXPANDABLE_SEGMENT = b"e"


def is_expandable_segment_handle(handle: bytes) -> bool:
    """True for torch's shareable handle of an expandable-segments block: ``<version> 'e' ...``
    (SHAREABLE_HANDLE_VERSION is 2 in torch 2.x)."""
    return len(handle) >= 2 and handle[0] in (1, 2) and handle[1:2] == _SHAREABLE_EXPANDABLE_SEGMENT


class CudaIPCWrapper(CudaWrapperBase):
    """A CUDA tensor shared through PyTorch's storage IPC (needs a shared /dev/shm; for
    expandable-segments memory also pidfd_getfd rights on the worker, see the module docstring)."""

    kind = "cuda-torch"
    groupable = True  # to_tensor() sets the whole shared storage: other layers are other offsets
    extra_fields = ("producer", "torch_handle", "storage_bytes", "storage_byte_offset",
                    "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required")

    # ---- producer --------------------------------------------------------------------------
    @classmethod
    def wrap(cls, tensor: torch.Tensor, name: str = "tensor") -> "CudaIPCWrapper":
        ordinal = producer_ordinal(cls, tensor, name)
        dt = dtype_name(tensor.dtype)
        if tensor.numel() == 0:
            raise ValueError(f"{name} is empty (shape={tuple(tensor.shape)}); there is nothing to share")
        storage = tensor.untyped_storage()
        (_device, handle, size_bytes, offset_bytes, ref_handle, ref_offset,
         event_handle, event_sync) = storage._share_cuda_()
        wrapper = cls(dtype=dt, shape=tuple(tensor.shape), stride=tuple(tensor.stride()),
                      storage_offset=tensor.storage_offset(), device=get_driver().device_uuid(ordinal),
                      producer=producer_id(), torch_handle=bytes(handle), storage_bytes=int(size_bytes),
                      storage_byte_offset=int(offset_bytes), ref_counter_handle=bytes(ref_handle),
                      ref_counter_offset=int(ref_offset), event_handle=bytes(event_handle or b""),
                      event_sync_required=bool(event_sync))
        wrapper._keepalive = storage
        return wrapper

    def sibling_for(self, tensor: torch.Tensor, storage_ptr: int) -> "CudaIPCWrapper":
        """This wrapper for another view of the same storage (``wrap_kv_caches``): one storage
        handle for every layer, per-layer storage offsets."""
        return self.sibling(tensor.storage_offset())

    @property
    def expandable_segment(self) -> bool:
        """True when the storage is in PyTorch expandable segments (torch's shareable handle:
        version byte, then ``'e'``; see the module docstring for what the consumer then needs)."""
        return is_expandable_segment_handle(self.torch_handle)

    # ---- wire checks -----------------------------------------------------------------------
    def _validate_extra(self) -> None:
        super()._validate_extra()
        cls = type(self)
        check_bytes(cls, "torch_handle", self.torch_handle, max_len=_MAX_HANDLE)
        check_bytes(cls, "ref_counter_handle", self.ref_counter_handle, max_len=4096)
        check_bytes(cls, "event_handle", self.event_handle, max_len=4096)
        if not self.torch_handle:
            raise WrapperDecodeError(f"{cls.__name__}: torch_handle is empty")
        check_int(cls, "storage_bytes", self.storage_bytes, lo=1)
        check_int(cls, "storage_byte_offset", self.storage_byte_offset)
        check_int(cls, "ref_counter_offset", self.ref_counter_offset)
        if type(self.event_sync_required) is not bool:
            raise WrapperDecodeError(f"{cls.__name__}: event_sync_required must be a bool")
        item = self.torch_dtype.itemsize
        need = (self.storage_offset * item + self.span_bytes) if self.numel else 0
        if self.numel == 0 or need > self.storage_bytes:
            raise WrapperDecodeError(
                f"{cls.__name__}: view (shape={self.shape}, stride={self.stride}, storage_offset="
                f"{self.storage_offset}, {self.dtype}) needs {need} bytes of a {self.storage_bytes}-byte storage"
            )

    # ---- ownership -------------------------------------------------------------------------
    def _admit_extra(self, peer: Any) -> None:
        """torch's consumer decrements the producer's counter at ``ref_counter_offset`` of the
        ``/dev/shm`` file ``ref_counter_handle``: both come from the peer, so they must be what
        torch makes -- ``/torch_<pid>_<random>_<n>`` of the producer's own pid, a file it owns
        holding REF_COUNTER_FILE_SIZE counters, and an offset inside it."""
        super()._admit_extra(peer)
        name = self.ref_counter_handle.decode("ascii", "replace")
        m = _REF_COUNTER_RE.fullmatch(name)
        where = f"{type(self).__name__} on {self.device}"
        if m is None:
            raise PermissionError(f"{where}: ref_counter_handle {quote(name)} is not a torch counter file "
                                  "(/torch_<pid>_<random>_<n>)")
        if peer.ns_pid and int(m.group(1)) != peer.ns_pid:
            raise PermissionError(f"{where}: counter file {name} belongs to pid {m.group(1)}, not to this "
                                  f"worker ({peer.describe()})")
        if not 0 <= self.ref_counter_offset < REF_COUNTER_FILE_SIZE:
            raise PermissionError(f"{where}: ref_counter_offset {self.ref_counter_offset} is outside torch's "
                                  f"counter file ({REF_COUNTER_FILE_SIZE} counters)")
        path = os.path.join("/dev/shm", name.lstrip("/"))
        try:
            st = os.lstat(path)
        except OSError as exc:
            raise PermissionError(f"{where}: counter file {path}: {exc.strerror}") from None
        # torch maps the counters with a RefcountedMapAllocator, which may put a small header
        # in front: the file holds at least the counters and at most a page more.
        need = REF_COUNTER_FILE_SIZE * 8
        if not stat.S_ISREG(st.st_mode) or st.st_uid != peer.uid or not need <= st.st_size <= need + 4096:
            raise PermissionError(
                f"{where}: {path} is not this worker's torch counter file (a regular file of uid "
                f"{peer.uid} holding {REF_COUNTER_FILE_SIZE} 8-byte counters)")

    # ---- consumer --------------------------------------------------------------------------
    def _mapping_key(self) -> Hashable:
        return ("cuda-torch", self.torch_handle, self.storage_byte_offset,
                self.ref_counter_handle, self.ref_counter_offset)

    def _open(self, ordinal: int) -> torch.UntypedStorage:
        if self._exported_here():
            raise RuntimeError(
                f"{type(self).__name__}: a CUDA IPC handle cannot be opened in the process that "
                "exported it; map it in another process, or use the original tensor here"
            )
        from torch.multiprocessing import reductions

        torch.cuda._lazy_init()
        cache_key = (self.torch_handle, self.storage_byte_offset)
        storage = reductions.storage_from_cache(torch.UntypedStorage, cache_key)
        if storage is not None:
            # Already open here: this share's counter is not needed, give it back now.
            torch.UntypedStorage._release_ipc_counter(self.ref_counter_handle, self.ref_counter_offset,
                                                       device=ordinal)
            return storage
        try:
            storage = torch.UntypedStorage._new_shared_cuda(
                ordinal, self.torch_handle, self.storage_bytes, self.storage_byte_offset,
                self.ref_counter_handle, self.ref_counter_offset, self.event_handle, self.event_sync_required,
            )
        except RuntimeError as exc:
            if self.expandable_segment:
                raise RuntimeError(
                    f"{type(self).__name__} on {self.device}: opening a storage of producer "
                    f"{self.producer} failed ({exc}): {TORCH_EXPANDABLE_HINT}") from exc
            raise
        reductions.shared_cache[cache_key] = reductions.StorageWeakRef(storage)
        stats["storage_opens"] += 1
        return storage

    @staticmethod
    def _close_mapping(storage: Any) -> None:
        # Dropping the table's reference is the whole job: torch unmaps when the last tensor
        # on the storage is gone (see the module docstring).
        del storage

    def to_tensor(self) -> torch.Tensor:
        self._check_open()
        ordinal = get_driver().local_ordinal(self.device)
        lease, fresh = self._lease_for(self._mapping_key(), lambda: self._open(ordinal), self._close_mapping)
        try:
            out = torch.empty(0, dtype=self.torch_dtype, device=torch.device("cuda", ordinal))
            out.set_(lease.value, self.storage_offset, self.shape, self.stride)
        except BaseException:
            if fresh:
                lease.release()
            raise
        self._keep_lease(lease)
        return out
