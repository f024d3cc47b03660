"""The KV event stream for routers: the core's event log, published in vLLM's format over libzmq.

``publisher.KvEventPublisher`` reads every record of the core's event log
(``lmshm.core.kv_events``) and sends it on a PUB socket, with a ROUTER for replays, as vLLM's own
publisher does; ``peers.PeerGuard`` bounds the connections of those libzmq listeners. The core
knows nothing of these sockets; ``lmshm.Server`` starts the publisher when ``--kv-events`` is set.
"""
