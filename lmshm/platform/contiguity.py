"""Zero-copy layout normalisation.

Engines often hand out a permuted view of a dense allocation: vLLM exposes an NHD view over
HND storage, so the tensor is not ``is_contiguous()`` although its elements fill one dense
block. Sorting the dimensions by stride (largest first) recovers a view that *is*
contiguous, without copying a byte. Wrappers that rebuild from flat bytes (CPU, raw CUDA,
VMM) need that dense block; they carry the caller's original shape and stride, and the
consumer rebuilds exactly the caller's view over the same bytes.

Never copies. A layout that no permutation makes contiguous (a slice with gaps, a broadcast
with stride 0, overlapping strides) raises a ValueError that shows shape, stride and
storage offset.
"""

from __future__ import annotations

import torch


def _describe(tensor: torch.Tensor) -> str:
    return (f"shape={tuple(tensor.shape)}, stride={tuple(tensor.stride())}, "
            f"storage_offset={tensor.storage_offset()}, dtype={tensor.dtype}")


def contiguous_permutation(tensor: torch.Tensor) -> tuple[int, ...]:
    """The dimension order that makes ``tensor.permute(order)`` contiguous.

    Raises ValueError if no order does. Dimensions of size 1 keep their relative place,
    since their stride means nothing.
    """
    dims = range(tensor.dim())
    # Sort by stride, largest first; among equal strides keep the original order. Size-1
    # dimensions sort by a stride that cannot disturb the others.
    def key(d: int) -> tuple[int, int]:
        size, stride = tensor.shape[d], tensor.stride(d)
        return (-(stride if size != 1 else _size1_stride(tensor, d)), d)

    order = tuple(sorted(dims, key=key))
    if not tensor.permute(order).is_contiguous():
        raise ValueError(
            f"tensor layout cannot be made contiguous without a copy ({_describe(tensor)}); "
            "lmshm shares dense blocks only: pass the whole allocation, or a permuted view of it"
        )
    return order


def _size1_stride(tensor: torch.Tensor, d: int) -> int:
    # Give a size-1 dim the stride it would have in a dense layout right after the nearest
    # larger-stride dimension before it, so it stays next to its neighbours.
    prev = [tensor.stride(i) * tensor.shape[i] for i in range(d) if tensor.shape[i] != 1]
    return min(prev) if prev else tensor.numel()


def to_contiguous_view(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous view of ``tensor``'s bytes; ``tensor`` itself if already contiguous."""
    if tensor.is_contiguous():
        return tensor
    return tensor.permute(contiguous_permutation(tensor))


def require_dense(tensor: torch.Tensor, what: str = "tensor") -> torch.Tensor:
    """Check that ``tensor`` covers one dense block; return its contiguous view.

    The error names ``what`` (for example the layer name) along with the layout.
    """
    if tensor.numel() == 0:
        raise ValueError(f"{what} is empty ({_describe(tensor)}); there is nothing to share")
    try:
        return to_contiguous_view(tensor)
    except ValueError as exc:
        raise ValueError(f"{what}: {exc}") from None


def is_dense(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """True if some permutation of the dims is a C-contiguous layout (no gaps, no overlap)."""
    dims = sorted((st, sz) for sz, st in zip(shape, stride) if sz != 1)
    expected = 1
    for st, sz in dims:
        if st != expected:
            return False
        expected *= sz
    return True
