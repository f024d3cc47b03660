"""Errors of the CUDA wrappers, each carrying the hint that tells the user what to change.

Every refusal on the producer side is a ``CudaExportError`` subclass whose message names the
tensor (layer), the pointer and device, what went wrong and -- in ``.hint`` -- what to do.
The hints are written once here (``*_HINT``) and shared by every wrapper that refuses for that
reason. The trap: a hint that sends a user to another wrapper must say what that wrapper needs
(``VMM_ALLOCATION_NEEDED``), or it sends them to a second refusal.
"""

from __future__ import annotations

from lmshm.platform import ipc_policy

VMM_HANDLE_TYPE_ENV = "LMSHM_VMM_HANDLE_TYPE"

#: What the VMM wrapper can export, said once for every hint that sends a user there.
VMM_ALLOCATION_NEEDED = (
    "VmmCudaIPCWrapper (use_vmm_api) needs memory from cuMemCreate with "
    "CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR in CUmemAllocationProp.requestedHandleTypes (or "
    f"CU_MEM_HANDLE_TYPE_FABRIC, exported with {VMM_HANDLE_TYPE_ENV}=fabric), each tensor inside one "
    "such allocation: lmshm.platform.cuda.empty_vmm(shape, dtype, device) allocates it"
)

#: Raw wrapper, memory that is not cuMemCreate memory either (retaining its handle failed).
NOT_CUDA_MALLOC_HINT = (
    "this memory was not allocated with cudaMalloc, so it has no legacy CUDA IPC handle, and it is "
    "no cuMemCreate allocation either (cudaMallocAsync pools and managed memory are neither): "
    "allocate the KV cache with cudaMalloc (PyTorch's default caching allocator) for the raw or "
    f"torch wrapper, or as exportable VMM memory for the VMM wrapper ({VMM_ALLOCATION_NEEDED})"
)

NOT_VMM_HINT = (
    f"{VMM_ALLOCATION_NEEDED}. For cudaMalloc memory turn use_vmm_api off "
    f"({ipc_policy.USE_VMM_API_ENV}=0): the raw or torch wrapper serves it"
)

SPANS_CHUNKS_HINT = (
    "a VMM handle covers one physical allocation and the importer maps exactly one, so a tensor "
    "must lie inside one chunk. PyTorch expandable segments map memory in 20 MiB chunks (2 MiB "
    "for small pools): allocate the KV cache as one cuMemCreate allocation exportable as a POSIX "
    "fd (lmshm.platform.cuda.empty_vmm), wrap per-chunk views, or turn expandable segments off "
    "and use the raw or torch wrapper"
)

FD_CHANNEL_HINT = (
    "a POSIX-fd VMM handle is a file descriptor: it travels over the server's fd side channel "
    "(a Unix socket with SCM_RIGHTS), whose socket path the worker must be able to reach. Start "
    "lmshm-server with its fd channel on a path both containers mount, or export fabric handles "
    f"instead ({VMM_HANDLE_TYPE_ENV}=fabric, on systems with IMEX/NVSwitch fabric support), or turn "
    "use_vmm_api off for cudaMalloc memory"
)

_NO_HANDLE_TYPES = (
    "vLLM sleep mode's CuMemAllocator (csrc/cumem_allocator.cpp) creates its memory this way: "
    "it never sets requestedHandleTypes"
)


def _has(requested: str, name: str) -> bool:
    return name in requested.split("|")


def not_exportable_hint(handle_type: str, requested: str) -> str:
    """The VMM wrapper asked for ``handle_type`` of an allocation whose requestedHandleTypes
    are ``requested`` (``driver.handle_type_names``: "NONE", "FABRIC", ...)."""
    head = f"the allocation was created with requestedHandleTypes={requested}"
    if requested == "NONE":
        return (f"{head}, so the driver cannot export it as any shareable handle and no lmshm "
                f"wrapper can share it ({_NO_HANDLE_TYPES}). Turn sleep mode off and share the KV "
                f"cache with the raw or torch wrapper, or allocate it exportable: {VMM_ALLOCATION_NEEDED}")
    if handle_type == "posix-fd" and _has(requested, "FABRIC"):
        return (f"{head}, not POSIX_FILE_DESCRIPTOR. Recent PyTorch expandable segments try "
                "FABRIC first and keep it wherever cuMemCreate grants it (an IMEX channel is "
                f"present): export it with {VMM_HANDLE_TYPE_ENV}=fabric (both processes need the "
                "IMEX channel), or allocate the KV cache yourself: " + VMM_ALLOCATION_NEEDED)
    if handle_type == "fabric" and _has(requested, "POSIX_FILE_DESCRIPTOR"):
        return (f"{head}, not FABRIC: export it as a POSIX fd ({VMM_HANDLE_TYPE_ENV}=posix-fd, "
                "sent over the server's fd side channel)")
    return f"{head}, which does not include {handle_type}. {VMM_ALLOCATION_NEEDED}"


def vmm_not_cuda_malloc_hint(requested: str) -> str:
    """The raw wrapper was given cuMemCreate memory whose requestedHandleTypes are ``requested``."""
    head = (f"this is CUDA VMM memory (cuMemCreate), which has no legacy CUDA IPC handle; it was "
            f"created with requestedHandleTypes={requested}")
    if requested == "NONE":
        return (f"{head}, so it cannot be exported at all ({_NO_HANDLE_TYPES}). Turn sleep mode "
                f"off, or allocate the KV cache exportable: {VMM_ALLOCATION_NEEDED}")
    if _has(requested, "POSIX_FILE_DESCRIPTOR"):
        return (f"{head} (PyTorch expandable segments, PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, "
                "where FABRIC was not granted): enable the VMM wrapper "
                f"({ipc_policy.USE_VMM_API_ENV}=1 or lmshm.set_use_vmm_api(True)) -- each tensor must lie "
                "inside one chunk -- or turn expandable segments off")
    if _has(requested, "FABRIC"):
        return (f"{head} (recent PyTorch expandable segments keep FABRIC where the driver grants "
                f"it): enable the VMM wrapper (use_vmm_api: {ipc_policy.USE_VMM_API_ENV}=1) with fabric "
                f"handles ({VMM_HANDLE_TYPE_ENV}=fabric, an IMEX channel in both processes), or turn "
                "expandable segments off")
    return f"{head}. {VMM_ALLOCATION_NEEDED}"


#: cuda-torch on memory from PyTorch's expandable segments (the consumer's open failed).
TORCH_EXPANDABLE_HINT = (
    "the tensor lives in PyTorch expandable segments (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:"
    "True). PyTorch shares those as POSIX fds that the consumer copies out of the worker with "
    "pidfd_open + pidfd_getfd (torch's CUDACachingAllocator, ExpandableSegment::fromShared): the "
    "server must see the worker's pid (the same PID namespace) and may take its fds (the same uid "
    "and ptrace allowed: kernel.yama.ptrace_scope=0, or CAP_SYS_PTRACE for the server, or the worker "
    "naming the server with prctl(PR_SET_PTRACER); in a container, a seccomp profile that also "
    "allows pidfd_getfd; Docker: --cap-add=SYS_PTRACE). Otherwise enable the VMM wrapper "
    f"({ipc_policy.USE_VMM_API_ENV}=1: its fd travels over the server's fd channel; each tensor "
    "must lie inside one expandable-segment chunk, or be allocated with "
    "lmshm.platform.cuda.empty_vmm), or turn expandable segments off"
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
