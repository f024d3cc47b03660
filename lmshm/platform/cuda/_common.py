"""What the three CUDA wrappers share: device identity, producer identity, wire checks, and
the flat-bytes rebuild used by the raw and VMM kinds.

``FlatCudaWrapper`` is the common shape of the two driver-handle kinds: the producer carries
a handle for the *whole allocation* (or VMM chunk) plus the byte offset of the tensor inside
it; the consumer maps the allocation once per process through ``MAPPINGS`` and rebuilds the
tensor as ``uint8`` bytes at ``mapped_base + alloc_offset``, viewed as the dtype and laid out
with the caller's shape and stride. Because the rebuild starts from flat bytes, the tensor
must be dense (after undoing a permutation, see ``contiguity.require_dense``).

The easy thing to get wrong: a tensor built by ``to_tensor()`` holds its own lease (as the
CuPy memory owner), so closing the wrapper while the tensor lives never unmaps memory under it.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
from dataclasses import dataclass
from typing import Any, Callable, Hashable

import torch

from lmshm.platform.base.ipc_wrapper import (
    DeviceIPCWrapper,
    WrapperDecodeError,
    dtype_from_name,
    dtype_name,
)
from lmshm.platform.base.mappings import MAPPINGS, Lease
from lmshm.platform.contiguity import is_dense, require_dense
from lmshm.platform.cuda import devices
from lmshm.platform.cuda.driver import get_driver, hexptr
from lmshm.platform.cuda.rebuild import view_as
from lmshm.quoting import quote

logger = logging.getLogger(__name__)

_MAX_BYTES = 1 << 56          # larger than any GPU; bounds peer-supplied sizes and offsets
_PRODUCER_RE = re.compile(r"^[0-9]{1,10}-[0-9a-f]{12}$")
_NONCE = secrets.token_hex(6)


def producer_id() -> str:
    """Identifies this process among live processes on the host: ``"<pid>-<random>"``."""
    return f"{os.getpid()}-{_NONCE}"


def check_int(cls: type, field: str, value: Any, *, lo: int = 0, hi: int = _MAX_BYTES) -> None:
    if type(value) is not int or not lo <= value <= hi:
        raise WrapperDecodeError(f"{cls.__name__}: {field} must be an int in [{lo}, {hi}], got {quote(value)}")


def check_bytes(cls: type, field: str, value: Any, *, sizes: tuple[int, ...] = (), max_len: int = 0) -> None:
    if type(value) is not bytes:
        raise WrapperDecodeError(f"{cls.__name__}: {field} must be bytes, got {type(value).__name__}")
    if sizes and len(value) not in sizes:
        raise WrapperDecodeError(f"{cls.__name__}: {field} must be {' or '.join(map(str, sizes))} bytes, got {len(value)}")
    if max_len and len(value) > max_len:
        raise WrapperDecodeError(f"{cls.__name__}: {field} must be at most {max_len} bytes, got {len(value)}")


def producer_ordinal(cls: type, tensor: Any, name: str) -> int:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cuda":
        raise ValueError(f"{name}: {cls.__name__} wraps CUDA tensors, got one on {tensor.device}")
    return tensor.device.index if tensor.device.index is not None else torch.cuda.current_device()


class CudaWrapperBase(DeviceIPCWrapper):
    """Common checks of the CUDA kinds. Not registered itself (it has no ``kind``)."""

    device_type = "cuda"

    def _validate_extra(self) -> None:
        if not devices.is_gpu_uuid(self.device):
            raise WrapperDecodeError(f"{type(self).__name__}: device must be a GPU UUID, got {self.device!r}")
        producer = getattr(self, "producer", None)
        if not isinstance(producer, str) or not _PRODUCER_RE.match(producer):
            raise WrapperDecodeError(f"{type(self).__name__}: malformed producer id {quote(producer)}")

    def _admit_extra(self, peer: Any) -> None:
        producer_pid = int(self.producer.split("-", 1)[0])  # type: ignore[attr-defined]
        if peer.ns_pid and producer_pid != peer.ns_pid:
            raise PermissionError(
                f"{type(self).__name__} on {self.device}: the wrapper says it was exported by pid "
                f"{producer_pid}, but this worker is {peer.describe()}; a worker may register only "
                "memory it exported")

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{type(self).__name__} on {self.device} is closed")

    def _exported_here(self) -> bool:
        return self.producer == producer_id()  # type: ignore[attr-defined]

    def _close_extra(self) -> None:
        # Producer side: let the memory (tensor, storage) go.
        self.__dict__.pop("_keepalive", None)

    def _lease_for(self, key: Hashable, opener: Callable[[], Any], closer: Callable[[Any], None]) -> tuple[Lease, bool]:
        """This wrapper's lease on ``key``, acquiring it on first use; (lease, newly acquired)."""
        if self._lease is not None:
            return self._lease, False
        return MAPPINGS.acquire(key, opener, closer), True

    def _keep_lease(self, lease: Lease) -> None:
        """Make ``lease`` this wrapper's; a second one won by a racing thread is given back."""
        if self._lease is None:
            self._lease = lease
        elif self._lease is not lease:
            lease.release()

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        d["producer"] = getattr(self, "producer", "")
        return d


@dataclass(frozen=True)
class DeviceMapping:
    """A consumer-side mapping: where it starts, how many bytes, on which device."""

    base: int
    size: int
    ordinal: int
    handle: int = 0   # VMM: the imported allocation handle
    scope: Hashable = None   # the session that opened it: its copy streams are the ones to wait for


class FlatCudaWrapper(CudaWrapperBase):
    """Raw and VMM kinds: a handle for the allocation + the tensor's byte offset in it.

    Groupable: the consumer's tensor is built on bytes that run from ``alloc_offset`` to the end
    of the mapped allocation, so the per-layer views of one allocation travel as one wrapper
    (at ``alloc_offset``) and per-layer ``storage_offset``s in elements from there, and the
    allocation is opened once for all of them.
    """

    groupable = True

    # ---- producer --------------------------------------------------------------------------
    @classmethod
    def wrap(cls, tensor: torch.Tensor, name: str = "tensor", **options: Any) -> "FlatCudaWrapper":
        ordinal = producer_ordinal(cls, tensor, name)
        dt = dtype_name(tensor.dtype)
        dense = require_dense(tensor, name)
        nbytes = dense.numel() * dense.element_size()
        wrapper = cls._export(dense.data_ptr(), nbytes, dt, tuple(tensor.shape), tuple(tensor.stride()),
                              ordinal, name, **options)
        wrapper._keepalive = tensor
        return wrapper

    def sibling_for(self, tensor: torch.Tensor, storage_ptr: int) -> "FlatCudaWrapper | None":
        """This wrapper for ``tensor``, another view with the same dtype, shape and stride in
        the same allocation: the same handle, at ``storage_offset`` elements past this one's
        first byte. None when ``tensor`` starts before it (``wrap_kv_caches`` then wraps it on
        its own)."""
        first = self.__dict__.get("_keepalive")
        if first is None:
            return None
        delta = tensor.data_ptr() - first.data_ptr()
        item = self.torch_dtype.itemsize
        if delta < 0 or delta % item or self.alloc_offset + delta + self.span_bytes > self.alloc_size:
            return None
        sib = self.sibling(delta // item)
        sib._keepalive = tensor
        return sib

    @classmethod
    def from_pointer(
        cls,
        ptr: int,
        nbytes: int,
        dtype: torch.dtype | str,
        shape: tuple[int, ...],
        device: Any,
        *,
        stride: tuple[int, ...] | None = None,
        name: str = "buffer",
        **options: Any,
    ) -> "FlatCudaWrapper":
        """Wrap device memory that no torch tensor describes (a TRT-LLM-style pool).

        ``ptr`` may point anywhere inside a cudaMalloc (raw kind) or cuMemCreate (VMM kind)
        allocation; ``nbytes`` must equal ``prod(shape) * itemsize``; ``device`` is an ordinal,
        ``"cuda:N"``, a torch.device or a GPU UUID; ``stride`` defaults to C-contiguous and
        must describe a dense layout. The caller keeps the memory alive while it is shared.
        """
        dt = dtype if isinstance(dtype, str) else dtype_name(dtype)
        item = dtype_from_name(dt).itemsize
        shape = tuple(int(s) for s in shape)
        if stride is None:
            stride = torch.empty(shape, dtype=torch.uint8, device="meta").stride()
        stride = tuple(int(s) for s in stride)
        numel = 1
        for s in shape:
            numel *= s
        if type(ptr) is not int or ptr <= 0:
            raise ValueError(f"{name}: ptr must be a positive int device address, got {ptr!r}")
        if numel == 0 or nbytes != numel * item:
            raise ValueError(
                f"{name}: nbytes={nbytes} does not match shape={shape} of {dt} "
                f"({numel} elements x {item} bytes = {numel * item})"
            )
        if len(stride) != len(shape) or not is_dense(shape, stride):
            raise ValueError(f"{name}: shape={shape}, stride={stride} is not a dense layout")
        if ptr % item:
            raise ValueError(f"{name}: ptr={hexptr(ptr)} is not aligned to {dt} ({item} bytes)")
        if isinstance(device, str) and devices.is_gpu_uuid(device):
            ordinal = get_driver().local_ordinal(device)
        else:
            ordinal = devices.ordinal_of(device)
        return cls._export(ptr, nbytes, dt, shape, stride, ordinal, name, **options)

    @classmethod
    def _export(cls, ptr: int, nbytes: int, dtype: str, shape: tuple[int, ...], stride: tuple[int, ...],
                ordinal: int, name: str, **options: Any) -> "FlatCudaWrapper":
        raise NotImplementedError

    # ---- wire checks -----------------------------------------------------------------------
    def _validate_extra(self) -> None:
        super()._validate_extra()
        cls = type(self)
        check_int(cls, "alloc_offset", self.alloc_offset)
        check_int(cls, "alloc_size", self.alloc_size, lo=1)
        if self.numel == 0:
            raise WrapperDecodeError(f"{cls.__name__}: empty tensors are not shared")
        if not is_dense(self.shape, self.stride):
            raise WrapperDecodeError(
                f"{cls.__name__}: shape={self.shape}, stride={self.stride} is not a dense layout"
            )
        if self.alloc_offset % self.torch_dtype.itemsize:
            raise WrapperDecodeError(
                f"{cls.__name__}: alloc_offset {self.alloc_offset} is not aligned to {self.dtype}"
            )
        end = self.alloc_offset + self.storage_offset * self.torch_dtype.itemsize + self.span_bytes
        if end > self.alloc_size:
            raise WrapperDecodeError(
                f"{cls.__name__}: the view's bytes (storage_offset {self.storage_offset}, {self.span_bytes} bytes "
                f"at offset {self.alloc_offset}) do not fit an allocation of {self.alloc_size} bytes"
            )

    # ---- consumer --------------------------------------------------------------------------
    def _mapping_key(self) -> Hashable:
        raise NotImplementedError

    def _open(self, ordinal: int) -> DeviceMapping:
        raise NotImplementedError

    @staticmethod
    def _close_mapping(mapping: DeviceMapping) -> None:
        raise NotImplementedError

    def to_tensor(self) -> torch.Tensor:
        self._check_open()
        drv = get_driver()
        ordinal = drv.local_ordinal(self.device)
        lease, fresh = self._lease_for(self._mapping_key(), lambda: self._open(ordinal), self._close_mapping)
        child = None
        try:
            mapping: DeviceMapping = lease.value
            item = self.torch_dtype.itemsize
            need = self.alloc_offset + self.storage_offset * item + self.span_bytes
            if need > mapping.size:
                raise ValueError(
                    f"{type(self).__name__}: the view needs bytes up to {need}: they run past the mapped "
                    f"allocation ({mapping.size} bytes at {hexptr(mapping.base)}); the wrapper does not describe "
                    "the memory its handle maps"
                )
            child = lease.child()
            # Every byte from alloc_offset to the end of the allocation (whole elements): the
            # other layers of a group are views of the same bytes at other storage offsets.
            tail = (mapping.size - self.alloc_offset) // item * item
            flat = drv.as_uint8_tensor(mapping.base + self.alloc_offset, tail, mapping.ordinal, child)
            out = view_as(flat, self.torch_dtype, self.shape, self.stride, self.storage_offset)
        except BaseException:
            if child is not None:
                child.release()
            if fresh:
                lease.release()
            raise
        self._keep_lease(lease)
        return out

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        d.update(alloc_offset=self.alloc_offset, alloc_size=self.alloc_size)
        return d


def quietly(what: str, fn: Callable[..., Any], *args: Any) -> None:
    """Run a teardown step; log a failure instead of raising (teardown must go on)."""
    try:
        fn(*args)
    except Exception:
        logger.exception("lmshm: %s failed", what)
