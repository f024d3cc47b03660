"""The server, independent of any endpoint: ``lmshm.Server`` (``server.py``), the registry of
KV caches and regions, the data plane's pool and copier, metrics, and the one error type.
The endpoints (ZeroMQ in ``lmshm.multiprocess``, HTTP and gRPC in ``lmshm.endpoints``) are thin
adapters over ``Server``.
"""
