"""Errors of the CUDA wrappers, each carrying the hint that tells the user what to change.

Every refusal on the producer side is a ``CudaExportError`` subclass whose message names the
tensor (layer), the pointer and device, what went wrong and -- in ``.hint`` -- what to do.
"""

from __future__ import annotations

from lmshm.platform import ipc_policy

VMM_HANDLE_TYPE_ENV = "LMSHM_VMM_HANDLE_TYPE"

NOT_CUDA_MALLOC_HINT = (
    "this memory was not allocated with cudaMalloc, so it has no legacy CUDA IPC handle. "
    "PyTorch expandable segments (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True), vLLM sleep "
    "mode (CuMemAllocator) and cudaMallocAsync pools allocate through other APIs: enable the VMM "
    f"wrapper ({ipc_policy.USE_VMM_API_ENV}=1 or lmshm.set_use_vmm_api(True)), or turn those "
    "features off"
)

NOT_VMM_HINT = (
    "VmmCudaIPCWrapper shares memory allocated through the CUDA VMM API (cuMemCreate + cuMemMap: "
    "PyTorch expandable segments, vLLM sleep mode). For cudaMalloc memory turn use_vmm_api off "
    f"({ipc_policy.USE_VMM_API_ENV}=0): the raw or torch wrapper serves it"
)

SPANS_CHUNKS_HINT = (
    "a VMM handle covers one physical allocation and the importer maps exactly one, so a tensor "
    "must lie inside one chunk. PyTorch expandable segments map memory in 20 MiB chunks (2 MiB "
    "for small pools): allocate the KV cache as one cuMemCreate allocation (vLLM sleep mode "
    "does), wrap per-chunk views, or turn expandable segments off and use the raw wrapper"
)

FD_CHANNEL_HINT = (
    "a POSIX-fd VMM handle is a file descriptor: it travels over the server's fd side channel "
    "(a Unix socket with SCM_RIGHTS), whose socket path the worker must be able to reach. Start "
    "lmshm-server with its fd channel on a path both containers mount, or export fabric handles "
    f"instead ({VMM_HANDLE_TYPE_ENV}=fabric, on systems with IMEX/NVSwitch fabric support), or turn "
    "use_vmm_api off for cudaMalloc memory"
)


def not_exportable_hint(handle_type: str, requested: str) -> str:
    return (
        f"the allocation was created with requestedHandleTypes={requested}, which does not include "
        f"{handle_type}. Allocate with that handle type in CUmemAllocationProp.requestedHandleTypes "
        f"(PyTorch expandable segments request POSIX file descriptors), or choose the handle type "
        f"the allocation supports with {VMM_HANDLE_TYPE_ENV}=posix-fd|fabric"
    )


class CudaUnavailableError(RuntimeError):
    """cuda-python, CuPy or a CUDA device is missing in this process."""


class CudaExportError(RuntimeError):
    """The producer cannot export this tensor with the chosen wrapper; see ``.hint``."""

    def __init__(self, message: str, hint: str = "") -> None:
        self.hint = hint
        super().__init__(f"{message}: {hint}" if hint else message)


class NotCudaMallocMemoryError(CudaExportError):
    """Legacy CUDA IPC asked to export memory that is not cudaMalloc-style."""


class NotVmmMemoryError(CudaExportError):
    """The VMM wrapper asked to export memory that the VMM API did not allocate."""


class VmmSpansChunksError(CudaExportError):
    """The tensor covers more than one physical VMM allocation."""


class VmmNotExportableError(CudaExportError):
    """The VMM allocation cannot be exported as the requested handle type."""


class FdChannelRequiredError(CudaExportError):
    """A POSIX-fd VMM wrapper must travel with its fd, and no fd channel can be reached."""


def fd_channel_required(what: str, reason: str) -> FdChannelRequiredError:
    """The error a client raises when it has POSIX-fd VMM wrappers but no fd channel.

    ``what`` names the layer(s), ``reason`` says why the channel is unreachable (for
    example the socket path and the OS error).
    """
    return FdChannelRequiredError(
        f"{what}: cannot register VMM memory exported as POSIX file descriptors: the fd side "
        f"channel cannot be reached ({reason})",
        FD_CHANNEL_HINT,
    )
