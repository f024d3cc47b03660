"""The explicit allow-list of wrapper classes a peer's payload may name: names, and nothing else.

``DeviceIPCWrapper.Deserialize`` (``safe_loads`` in ``base/ipc_wrapper.py``) decodes wrapper
bytes from another process with an unpickler whose ``find_class`` admits exactly the
``(module, qualname)`` pairs below, and nothing else (nothing from ``builtins``, ``os``, ...). The
list is written out by hand on purpose: subclassing ``DeviceIPCWrapper`` does not put a class on
it, so no import anywhere can widen what a peer may make this process instantiate. A new
wrapper kind joins by being added here.

The list is data: this module imports nothing, so ``base`` can read it without importing
``cpu`` or ``cuda`` (which import ``base``). Unpickling a listed name imports that module, as
pickle does for any class; a name that is not listed is refused before anything is imported.
``tests/v1/platform/test_wrapper_contract.py`` checks that the list names exactly the concrete
wrappers lmshm ships.
"""

#: Every concrete wrapper class a peer may send, as ``(module, qualname)``.
ALLOWED_WRAPPER_CLASSES: tuple[tuple[str, str], ...] = (
    ("lmshm.platform.cpu.wrappers", "CpuShmIPCWrapper"),
    ("lmshm.platform.cpu.wrappers", "CpuFdIPCWrapper"),
    ("lmshm.platform.cuda.torch_ipc", "CudaIPCWrapper"),
    ("lmshm.platform.cuda.raw_ipc", "RawCudaIPCWrapper"),
    ("lmshm.platform.cuda.vmm_ipc", "VmmCudaIPCWrapper"),
)
