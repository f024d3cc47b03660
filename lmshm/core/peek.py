"""PEEK: a few bytes of a registered layer, read through the server's own mapping.

A diagnostic for operators and tests: it proves zero copy (the worker writes, the server reads
the same memory) and that a mapping is alive. The registry holds the mapping; this module reads
it and knows nothing of sessions: who may peek is the endpoint's check, made before it calls.

The trap: a named shm segment truncated by its owner would SIGBUS a read through the mapping,
so such a layer is read through its file (``pread``), checked to be the same inode; any other
layer is checked with ``verify_mapped`` and read as a tensor (a GPU layer: one small D2H copy).
"""

from __future__ import annotations

import os

import torch

from lmshm.core.dataplane import FileSide, open_checked
from lmshm.core.errors import InvalidArgument, NotFound, Unavailable
from lmshm.core.registry import Registration
from lmshm.quoting import quote


def read_layer(reg: Registration, layer_name: str, offset: int, length: int) -> bytes:
    """Up to ``length`` bytes of layer ``layer_name`` of registration ``reg`` (held by the
    caller), from byte ``offset`` of its first element; fewer where the layer ends first."""
    found = reg.layer(layer_name)
    if found is None:
        raise NotFound(f"instance {quote(reg.instance_id, 60)} has no layer {quote(layer_name, 60)}")
    tensor, wrapper = found
    item = tensor.element_size()
    span = (sum((s - 1) * st for s, st in zip(tensor.shape, tensor.stride())) + 1) * item if tensor.numel() else 0
    if offset > span:
        raise InvalidArgument(f"peek offset {offset} is outside layer {quote(layer_name, 60)} ({span} bytes)")
    try:
        wrapper.verify_mapped()  # a truncated segment would SIGBUS us below
    except OSError as exc:
        raise Unavailable(str(exc)) from None
    n = min(length, span - offset)
    backing = getattr(wrapper, "backing_file", None)
    where = backing() if backing is not None else None
    if where is None:
        u8 = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(
            tensor.untyped_storage(), tensor.storage_offset() * item + offset, (n,))
        return u8.cpu().numpy().tobytes()
    # Named shm: read through the file, so a segment truncated right now cannot SIGBUS us.
    path, inode, start = where
    try:
        fd = open_checked(FileSide(path, inode, 0))
        try:
            data = os.pread(fd, n, tensor.data_ptr() - start + offset)
        finally:
            os.close(fd)
    except OSError as exc:
        raise Unavailable(f"cannot read segment {quote(path, 80)}: {exc}") from None
    if len(data) != n:
        raise Unavailable(f"segment {quote(path, 80)} was truncated; refusing to read it")
    return data
