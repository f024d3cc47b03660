"""Endpoints that speak other projects' protocols over ``lmshm.Server``.

- ``http``: Triton's HTTP/REST health, metadata and shared-memory routes, and ``/metrics``;
- ``grpc``: the same operations as Triton's ``inference.GRPCInferenceService`` RPCs;
- ``triton``: what both share -- status codes, the restricted-API check, region listings;
- ``triton_proto``: the gRPC messages, built at import from a table of Triton's field numbers.

None of them keeps registry state: every request is one call into the server.
"""
