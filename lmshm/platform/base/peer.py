"""Who is on the other end: a peer's identity as the kernel reports it (``Peer``).

lmshm-server learns a worker's pid, uid and gid from ``SO_PEERCRED`` (and a pidfd from
``SO_PEERPIDFD``) on the worker's fd-channel connection, once, when the worker authenticates
its session there. From then on the identity travels inward as this value; nothing a peer
*says* about itself (a pid in a HELLO, a pid in a segment name) is believed unless it matches.
Consumer-side wrappers check it in ``DeviceIPCWrapper.admit(peer)``: a named segment must be
owned by ``uid`` and carry ``ns_pid`` and ``pid_ns`` in its name; fd tokens and mapping keys
are scoped to ``session``, so no session can reach another's mapping by naming it.

The trap: ``pid`` is the worker's pid *in the server's PID namespace* (0 if invisible there),
while names carry the pid the worker sees itself as (``ns_pid``, the last NSpid entry in
/proc/PID/status). They differ in containers.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Hashable, Optional


@dataclass(frozen=True)
class Peer:
    """A kernel-verified peer. ``session`` scopes fd tokens and mapping keys."""

    session: Hashable
    pid: int        # in this process's PID namespace; 0 if not visible from here
    uid: int
    gid: int
    ns_pid: int     # the pid the peer sees itself as (innermost PID namespace); 0 if unknown
    pid_ns: int     # inode of the peer's PID namespace; 0 if unknown

    def describe(self) -> str:
        inner = f", pid {self.ns_pid} in its namespace" if self.ns_pid and self.ns_pid != self.pid else ""
        return f"pid {self.pid} (uid {self.uid}{inner})"


def own_pid_namespace() -> int:
    """Inode of this process's PID namespace (0 if /proc does not tell)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def namespace_view(pid: int) -> tuple[int, int]:
    """``(ns_pid, pid_ns)`` of a process visible here as ``pid``: the pid it sees itself as and
    the inode of its PID namespace. ``(0, 0)`` where /proc does not say (or ``pid`` is 0)."""
    if pid <= 0:
        return 0, 0
    ns_pid = 0
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("NSpid:"):
                    fields = line.split()[1:]
                    ns_pid = int(fields[-1]) if fields else 0
                    single = len(fields) == 1
                    break
            else:
                ns_pid, single = pid, True  # kernels without NSpid have no nested view to give
    except (OSError, ValueError):
        return 0, 0
    try:
        pid_ns = os.stat(f"/proc/{pid}/ns/pid").st_ino
    except OSError:
        # Not allowed to look (another uid): a process with a single NSpid entry lives in the
        # namespace our /proc belongs to, which is ours.
        pid_ns = own_pid_namespace() if single else 0
    return ns_pid, pid_ns


def local_peer(session: Optional[Hashable] = None) -> Peer:
    """This process as a peer (for in-process use and tests)."""
    pid = os.getpid()
    return Peer(session=session, pid=pid, uid=os.geteuid(), gid=os.getegid(), ns_pid=pid,
                pid_ns=own_pid_namespace())
