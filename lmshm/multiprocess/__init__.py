"""The service: wire protocol, transport, registry, server and worker client."""
