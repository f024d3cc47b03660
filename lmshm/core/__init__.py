"""The server's core, independent of any endpoint: the data plane's pool and copier.

(The registry and sessions still live in ``lmshm.multiprocess``; they move here with the
in-process server API.)
"""
