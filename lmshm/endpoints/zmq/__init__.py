"""lmshm's own protocol over ZeroMQ: the sessions and the dispatch of each request to the core.

``endpoint.ZmqEndpoint`` runs the loop (``lmshm.transport.mq``) and is the trust boundary: every
request becomes its reply or an ``ErrorReply``. ``sessions`` keeps each session's kernel-verified
identity (from the fd channel) and its limits. The messages are ``lmshm.wire.protocol``'s; what
a STATUS reports is built by ``lmshm.Server`` (``status_reply``), which every endpoint shares.
"""

from lmshm.endpoints.zmq.endpoint import ZmqEndpoint

__all__ = ["ZmqEndpoint"]
