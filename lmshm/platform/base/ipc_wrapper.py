"""The contract every IPC wrapper follows: ``DeviceIPCWrapper``, and the safe way to decode one.

A wrapper is a small, picklable description of one tensor (dtype, shape, stride, storage offset,
device identity) plus what its kind needs to reach the same bytes from another process (a
segment name, an fd token, a CUDA handle). Producer: ``Wrapper.wrap(tensor)`` never copies GPU
memory. Consumer: ``to_tensor()`` maps through the process-wide ``MAPPINGS`` and returns a
tensor aliasing the producer's bytes; ``close()`` is idempotent, and tensors already built keep
the mapping alive, so closing never unmaps memory under a live tensor.

``Deserialize`` decodes with a restricted unpickler that can only name the classes listed in
``wrapper_registry``, so a peer cannot make this process run code; every field a peer sent is
checked in ``_validate_extra``. The trap: GPU identity travels as a UUID, never an ordinal:
``CUDA_VISIBLE_DEVICES`` may number the same GPU differently in each process.
docs/design/wrapper-contract.md has the whole contract.
"""

from __future__ import annotations

import io
import math
import pickle
from typing import Any, ClassVar

import torch

from lmshm.platform.base.mappings import Lease
from lmshm.platform.base.peer import Peer
from lmshm.platform.wrapper_registry import ALLOWED_WRAPPER_CLASSES
from lmshm.quoting import quote

# Every dtype a wrapper may carry, by the name torch prints without the "torch." prefix.
_DTYPE_NAMES = (
    "float64", "float32", "float16", "bfloat16",
    "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu",
    "int64", "int32", "int16", "int8", "uint8", "uint16", "uint32", "uint64", "bool",
    "complex64", "complex128",
)
_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name) for name in _DTYPE_NAMES if isinstance(getattr(torch, name, None), torch.dtype)
}

_MAX_DIMS = 16


class WrapperDecodeError(ValueError):
    """Raised when wrapper bytes from a peer are malformed or name a forbidden class."""


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if _DTYPES.get(name) is not dtype:
        raise ValueError(f"dtype {dtype} cannot be shared by lmshm; supported: {', '.join(_DTYPES)}")
    return name


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown dtype {name!r}; supported: {', '.join(_DTYPES)}") from None


#: The names a wrapper payload may use (``wrapper_registry``'s list; tests widen it with monkeypatch).
_ALLOWED: set[tuple[str, str]] = set(ALLOWED_WRAPPER_CLASSES)


def allowed_wrapper_classes() -> list[str]:
    """Dotted names of the classes a wrapper payload may name, sorted (for error messages)."""
    return sorted(f"{m}.{n}" for m, n in _ALLOWED)


class _WrapperUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _ALLOWED:
            raise WrapperDecodeError(
                f"refusing to unpickle {module}.{name}: wrapper payloads may only name lmshm "
                f"wrapper classes ({', '.join(allowed_wrapper_classes()) or 'none registered'})"
            )
        cls = super().find_class(module, name)  # imports the listed module, as pickle does
        if not (isinstance(cls, type) and issubclass(cls, DeviceIPCWrapper)
                and (cls.__module__, cls.__qualname__) == (module, name)):
            raise WrapperDecodeError(f"{module}.{name} is on the allow-list but is not an lmshm wrapper class")
        return cls

    def persistent_load(self, pid: Any) -> Any:
        raise WrapperDecodeError("refusing a pickle with persistent ids")


def safe_loads(data: bytes) -> "DeviceIPCWrapper":
    """Unpickle wrapper bytes from a peer: only allowed lmshm wrapper classes and plain data."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise WrapperDecodeError(f"wrapper payload must be bytes, got {type(data).__name__}")
    try:
        obj = _WrapperUnpickler(io.BytesIO(bytes(data))).load()
    except WrapperDecodeError:
        raise
    except Exception as exc:
        raise WrapperDecodeError(f"malformed wrapper payload: {type(exc).__name__}: {exc}") from None
    if not isinstance(obj, DeviceIPCWrapper) or not getattr(obj, "_state_checked", False):
        raise WrapperDecodeError(f"wrapper payload decoded to {type(obj).__name__}, not an lmshm wrapper")
    return obj


#: Largest size, stride or offset a wrapper may carry: far above any real memory, far below
#: where products of them stop fitting the wire's 64-bit integers.
MAX_WIRE_INT = 1 << 48
MAX_WRAPPER_BYTES = 1 << 60


def _check_int_tuple(name: str, value: Any, *, allow_negative: bool = False) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or len(value) > _MAX_DIMS:
        raise WrapperDecodeError(f"{name} must be a tuple of at most {_MAX_DIMS} ints, got {quote(value)}")
    out = []
    for v in value:
        if type(v) is not int or (v < 0 and not allow_negative) or abs(v) > MAX_WIRE_INT:
            raise WrapperDecodeError(f"{name} must hold ints in [0, 2**48], got {quote(value)}")
        out.append(v)
    return tuple(out)


class DeviceIPCWrapper:
    """Base class of every lmshm IPC wrapper. See the module docstring for the contract."""

    #: "cpu" or "cuda"; set by each concrete class.
    device_type: ClassVar[str] = ""
    #: A short name for status tables ("cpu-shm", "cuda-raw", ...).
    kind: ClassVar[str] = ""
    #: True when one wrapper can stand for several layers that differ only in storage
    #: offset: ``to_tensor()`` returns a tensor whose storage covers the whole mapped object,
    #: so a sibling layer is ``as_strided`` at another offset (bounds-checked by torch).
    groupable: ClassVar[bool] = False
    #: What to do when this kind's fds cannot reach the consumer (see ``export_fds``).
    fd_channel_hint: ClassVar[str] = ""
    #: Wire fields beyond the common ones, in order. Plain data only.
    extra_fields: ClassVar[tuple[str, ...]] = ()
    common_fields: ClassVar[tuple[str, ...]] = ("dtype", "shape", "stride", "storage_offset", "device")

    def __init__(
        self,
        *,
        dtype: str,
        shape: tuple[int, ...],
        stride: tuple[int, ...],
        storage_offset: int,
        device: str,
        **extra: Any,
    ) -> None:
        state = dict(dtype=dtype, shape=tuple(shape), stride=tuple(stride),
                     storage_offset=storage_offset, device=device, **extra)
        self.__setstate__(state)

    # ---- fields and identity -------------------------------------------------------------
    @classmethod
    def wire_fields(cls) -> tuple[str, ...]:
        return cls.common_fields + cls.extra_fields

    def _wire_values(self) -> tuple[Any, ...]:
        return tuple(getattr(self, f) for f in self.wire_fields())

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_name(self.dtype)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor's elements (numel x itemsize)."""
        return self.numel * self.torch_dtype.itemsize

    @property
    def span_bytes(self) -> int:
        """Bytes from the first element of the view to one past its last, in storage order."""
        if self.numel == 0:
            return 0
        last = sum((s - 1) * st for s, st in zip(self.shape, self.stride))
        return (last + 1) * self.torch_dtype.itemsize

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and self._wire_values() == other._wire_values()  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((type(self), self._wire_values()))

    def __repr__(self) -> str:
        fields = ", ".join(f"{f}={getattr(self, f)!r}" for f in self.wire_fields())
        return f"{type(self).__name__}({fields})"

    # ---- pickling: plain data only -------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in self.wire_fields()}

    def __setstate__(self, state: Any) -> None:
        if not isinstance(state, dict) or set(state) != set(self.wire_fields()):
            got = quote(sorted(map(str, state))[:20], 200) if isinstance(state, dict) else type(state).__name__
            raise WrapperDecodeError(
                f"{type(self).__name__} state must have exactly the fields {list(self.wire_fields())}, got {got}"
            )
        dtype = state["dtype"]
        if dtype not in _DTYPES:
            raise WrapperDecodeError(f"unknown dtype {quote(dtype)}")
        shape = _check_int_tuple("shape", state["shape"])
        stride = _check_int_tuple("stride", state["stride"])
        if len(shape) != len(stride):
            raise WrapperDecodeError(f"shape {shape} and stride {stride} differ in rank")
        offset = state["storage_offset"]
        if type(offset) is not int or not 0 <= offset <= MAX_WIRE_INT:
            raise WrapperDecodeError(f"storage_offset must be an int in [0, 2**48], got {quote(offset)}")
        if not isinstance(state["device"], str) or len(state["device"]) > 128:
            raise WrapperDecodeError(f"device must be a short string, got {quote(state['device'])}")
        self.dtype, self.shape, self.stride = dtype, shape, stride
        self.storage_offset, self.device = offset, state["device"]
        # Stride-0 and overflowing shapes: what the view claims must stay a sane byte count.
        item = _DTYPES[dtype].itemsize
        numel = math.prod(shape)
        span = (sum((s - 1) * st for s, st in zip(shape, stride)) + 1) * item if numel else 0
        if numel * item > MAX_WRAPPER_BYTES or offset * item + span > MAX_WRAPPER_BYTES:
            raise WrapperDecodeError(
                f"shape {quote(shape)} with stride {quote(stride)} of {dtype} describes more than "
                f"2**60 bytes; no memory is that large")
        for f in self.extra_fields:
            setattr(self, f, state[f])
        self._peer: Peer | None = None
        self._validate_extra()
        self._lease: Lease | None = None
        self._closed = False
        self._state_checked = True

    def _validate_extra(self) -> None:
        """Check the kind-specific fields of a state that may come from a peer."""

    def sibling(self, storage_offset: int) -> "DeviceIPCWrapper":
        """Producer side: this wrapper for another view with the same dtype, shape and stride
        in the same storage, at ``storage_offset``. Only for ``groupable`` kinds; copies the
        (already validated) state without checking it again, which is what makes wrapping
        the per-layer views of one pool cheap. ``leader`` points at the wrapper it came from.
        Attributes named in ``leader_only_attrs`` stay with the leader: a sibling never
        closes what the leader owns (one fd closed N times closes N-1 unrelated files).
        """
        if not self.groupable:
            raise TypeError(f"{type(self).__name__} cannot derive sibling wrappers")
        new = object.__new__(type(self))
        new.__dict__.update((k, v) for k, v in self.__dict__.items() if k not in self.leader_only_attrs)
        new.storage_offset = storage_offset
        new._lease = None
        new._closed = False
        new.leader = self.leader if self.leader is not None else self
        return new

    #: The wrapper this one was derived from with ``sibling()`` (None for an original).
    leader: "DeviceIPCWrapper | None" = None
    #: Producer-side attributes that only the leader holds and ``sibling()`` does not copy:
    #: what ``close()`` frees exactly once (the VMM kind's exported fd).
    leader_only_attrs: ClassVar[tuple[str, ...]] = ()

    def Serialize(self) -> bytes:
        return pickle.dumps(self, protocol=pickle.HIGHEST_PROTOCOL)

    @staticmethod
    def Deserialize(data: bytes) -> "DeviceIPCWrapper":
        return safe_loads(data)

    # ---- the contract --------------------------------------------------------------------
    @classmethod
    def wrap(cls, tensor: torch.Tensor, name: str = "tensor") -> "DeviceIPCWrapper":
        """Producer side: describe ``tensor`` for another process. ``name`` (for example the
        layer name) appears in every error message."""
        raise NotImplementedError

    def admit(self, peer: Peer) -> None:
        """Consumer side, before ``to_tensor()``: check what this wrapper names against the
        kernel-verified ``peer`` that sent it, and scope its mapping to the peer's session.

        Raises ``PermissionError`` when the peer may not name that memory (another uid's
        segment, a name that does not carry the peer's pid, a token it did not send).
        """
        self._peer = peer
        self._admit_extra(peer)

    def _admit_extra(self, peer: Peer) -> None:
        """Kind-specific ownership checks (see ``admit``)."""

    def _scope(self) -> Any:
        """The session this wrapper's mapping belongs to (None outside a server)."""
        return None if self._peer is None else self._peer.session

    def to_tensor(self) -> torch.Tensor:
        raise NotImplementedError

    def verify_mapped(self) -> None:
        """Consumer side, right before touching mapped memory: raise ``OSError`` if the mapped
        object lost pages since it was mapped (a truncated or hole-punched segment would
        otherwise kill this process with SIGBUS). Kinds that cannot shrink do nothing."""

    def close(self) -> None:
        """Release this wrapper's share of its mapping. Idempotent; never raises."""
        if self._closed:
            return
        self._closed = True
        lease, self._lease = self._lease, None
        if lease is not None:
            lease.release()
        self._close_extra()

    def _close_extra(self) -> None:
        """Kind-specific teardown (producer-side references, received fds)."""

    @property
    def closed(self) -> bool:
        return self._closed

    def export_fds(self) -> dict[str, int]:
        """Producer side: file descriptors that must travel out of band, by token.

        Kinds whose handle is a file descriptor (memfd, VMM POSIX-fd) return ``{token: fd}``;
        the fds stay owned by the wrapper (send them with ``socket.send_fds``; do not close
        them). The consumer files what it receives in ``FD_INBOX`` under the same tokens.
        Kinds that need no side channel return ``{}``.
        """
        return {}

    def fd_tokens(self) -> tuple[str, ...]:
        """Consumer side: the tokens of the fds this wrapper maps from (see ``export_fds``)."""
        return ()

    def release_orphaned(self) -> None:
        """Consumer side, after the producer died: free what the producer can no longer free.

        The default does nothing; the named-shm wrapper unlinks its segment name.
        """

    def describe(self) -> dict[str, Any]:
        """Plain-data summary for status tables."""
        return {"kind": self.kind, "device": self.device, "dtype": self.dtype,
                "shape": list(self.shape), "nbytes": self.nbytes}

    def __enter__(self) -> "DeviceIPCWrapper":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
