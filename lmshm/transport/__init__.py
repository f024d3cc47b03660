"""How lmshm's bytes travel between a worker and the server; no message is interpreted here.

- ``zmtp``: lmshm's own ZMTP 3.1 listener (the server's ROUTER side), one file descriptor per peer;
- ``mq``: the ROUTER loop over it (fairness, unverified share, fd budget) and the DEALER client;
- ``fdchannel``: the Unix-socket side channel where the kernel vouches for a peer's pid and uid
  (``SO_PEERCRED``) and file descriptors pass (``SCM_RIGHTS``);
- ``client``: ``MPClient``, the worker's side (``lmshm.MPClient``), and ``lmshm status``'s query.

It sits above the core (its loggers and error types) and below the endpoints, which give the
bytes meaning: sessions and dispatch are ``lmshm.endpoints.zmq``'s.
"""
