"""The server as a library, with no endpoint: ``Core`` (``service.py``) owns the registry of KV
caches and regions, the data plane's pool and copier, the metrics, its settings
(``CoreConfig``), its clock (timed work on a thread of its own) and the one error type. The
values it takes and returns are declared in ``messages.py``. Nothing here imports
``multiprocess``, ``endpoints``, ``integrations`` or the top-level ``lmshm.Server``
(``lmshm/server.py``), which composes this core with its endpoints (docs/design/layers.md).
"""
