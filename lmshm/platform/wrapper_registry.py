"""The explicit allow-list of wrapper classes a peer's payload may name: names, and nothing else.

``DeviceIPCWrapper.Deserialize`` decodes wrapper bytes from another process with an unpickler
whose ``find_class`` admits exactly the ``(module, qualname)`` pairs listed here (nothing from
``builtins``, ``os``, ...); a name that is not listed is refused before anything is imported.
The list is data and imports nothing, so ``base`` reads it without importing ``cpu`` or ``cuda``.

The trap: the list is written out by hand on purpose. Subclassing ``DeviceIPCWrapper`` does not
put a class on it, so no import anywhere can widen what a peer may make this process
instantiate; a new wrapper kind joins by being added here, and
``tests/v1/platform/test_wrapper_contract.py`` checks the list names exactly lmshm's wrappers.
"""

#: Every concrete wrapper class a peer may send, as ``(module, qualname)``.
ALLOWED_WRAPPER_CLASSES: tuple[tuple[str, str], ...] = (
    ("lmshm.platform.cpu.wrappers", "CpuShmIPCWrapper"),
    ("lmshm.platform.cpu.wrappers", "CpuFdIPCWrapper"),
    ("lmshm.platform.cuda.torch_ipc", "CudaIPCWrapper"),
    ("lmshm.platform.cuda.raw_ipc", "RawCudaIPCWrapper"),
    ("lmshm.platform.cuda.vmm_ipc", "VmmCudaIPCWrapper"),
)
