"""Device-specific wrapping of tensors for sharing between processes. Knows nothing of sockets.

A wrapper is plain, picklable data naming the memory behind one tensor (a segment, an fd token,
a CUDA handle) and the caller's exact view; it never copies GPU memory, and the consumer maps
the memory once per process and rebuilds that view. Who owns what: ``base`` the contract and
the process-wide tables (mappings, received fds, peer identity); ``cpu`` and ``cuda`` the
wrapper kinds; ``ipc_policy`` and ``device_registry`` the choice of kind; ``kv_wrap`` a
worker's whole batch; ``shm_names`` and ``shm_orphans`` segment names and their sweep.
The trap: the control plane (``lmshm status``, ``lmshm gc``, the fd channel) imports
``shm_names``, ``shm_orphans``, ``base.fds`` and ``base.files``; they must stay torch-free.
docs/design/wrapper-contract.md, cpu-wrappers.md and cuda-wrappers.md say the rest.
"""
