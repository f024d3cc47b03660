"""CPU wrappers: sealed memfd (the default) and named POSIX shared memory.

``empty_shared(shape, dtype)`` allocates a KV pool directly in a shareable segment, so
wrapping it later copies nothing. Which kind is the ``cpu_segments`` switch
(``lmshm.platform.ipc_policy``): memfd unless a caller asks for ``shm``.
"""

from __future__ import annotations

import math
from typing import Iterable, Sequence

import torch

from lmshm.platform import ipc_policy
from lmshm.platform.base.ipc_wrapper import dtype_name
from lmshm.platform.cpu.segments import (
    SEGMENT_PREFIX,
    Segment,
    live_segments,
    segment_of,
    shm_dir,
)
from lmshm.platform.cpu.wrappers import (
    CpuFdIPCWrapper,
    CpuSegmentWrapper,
    CpuShmIPCWrapper,
    _place_in_segment,
    migration_scope,
)


def _kind(kind: str | None, isolated: bool | None) -> str:
    if kind is not None:
        if kind not in ipc_policy.CPU_SEGMENT_KINDS:
            raise ValueError(f"kind must be 'memfd' or 'shm', got {kind!r}")
        return kind
    if isolated is None:
        return ipc_policy.cpu_segment_kind()
    return "memfd" if isolated else "shm"   # the older spelling: isolated=False asked for a name


def empty_shared(
    shape: Sequence[int] | int,
    dtype: torch.dtype = torch.float16,
    *,
    isolated: bool | None = None,
    kind: str | None = None,
) -> torch.Tensor:
    """An uninitialised CPU tensor that lives in a shareable lmshm segment.

    ``kind``: ``"memfd"`` (a sealed memfd, passed to lmshm-server over its fd channel and
    copied there through its mapping) or ``"shm"`` (a named POSIX segment in ``/dev/shm``, for
    consumers that cannot receive an fd). Default: the ``cpu_segments`` switch (memfd; always
    memfd under the process-wide ``isolated_ipc`` switch). ``isolated=True`` / ``False`` is the
    older spelling of ``kind="memfd"`` / ``kind="shm"``. Its
    space is reserved up front; it is released when the last tensor on it is freed, or at
    interpreter exit.
    """
    from lmshm.platform.cpu.segments import create_segment

    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    if not shape or any(not isinstance(s, int) or s <= 0 for s in shape):
        raise ValueError(f"shape must be positive ints, got {shape!r}")
    dtype_name(dtype)  # refuses dtypes lmshm cannot carry
    nbytes = math.prod(shape) * dtype.itemsize
    _, u8 = create_segment(nbytes, _kind(kind, isolated))
    out = torch.empty(0, dtype=dtype)
    out.set_(u8.untyped_storage(), 0, shape)
    return out


def move_to_shared(tensors: Iterable[torch.Tensor], *, isolated: bool | None = None,
                   kind: str | None = None) -> list[Segment]:
    """Move the private storages of these CPU tensors into lmshm segments now: one copy per
    storage, every tensor given re-pointed (views of one storage move together). Tensors
    already in a segment of the kind stay where they are; non-CPU tensors are skipped. Returns
    the segments created. ``kind`` and ``isolated`` choose the segment as for ``empty_shared``.

    Call it from the thread that owns the tensors, before anything writes to them elsewhere: a
    write between the copy and the re-pointing would be lost, and views not given here keep the
    private memory. (``wrap`` migrates the same way, later; an engine registering in the
    background calls this first, in its own thread.)"""
    kind = _kind(kind, isolated)
    with migration_scope() as created:
        for t in tensors:
            if t.device.type == "cpu":
                _place_in_segment(t, kind)
    return list(created)


__all__ = [
    "SEGMENT_PREFIX",
    "CpuFdIPCWrapper",
    "CpuSegmentWrapper",
    "CpuShmIPCWrapper",
    "Segment",
    "empty_shared",
    "live_segments",
    "migration_scope",
    "move_to_shared",
    "segment_of",
    "shm_dir",
]
