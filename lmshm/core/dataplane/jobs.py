"""What the rooms of the data plane share: the caller's types, a copy job, its answer.

A request is validated on the loop (``checks.py``) into a ``CopyJob``; a copier thread hands
it to ``HostCopies`` or ``CudaCopies``, both ``Copies``: ``run(job)`` returns the reply, or a
``Then`` (the reply, and what to do once it is sent). ``Copies`` also owns what both paths do
alike: pinning a RETRIEVE's sources, committing a STORE (and writing it through to the tiers),
and refusing a request that waited past its sender's ``wait_s``.

The trap: a job's registration is held (``Registry.acquire``) from validation to the end of
its copy; whoever ends the job early must ``let_go`` it (``DataPlane._queue`` does, on every
path).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Hashable, Optional, Protocol, Union

from lmshm.core.dataplane.layout import BlockLayout
from lmshm.core.errors import ErrorCode
from lmshm.core.pool import BLOCKS, LAYOUT, Pool
from lmshm.core.registry import Registration
from lmshm.core.tiers.stack import TierStack
from lmshm.platform.base.peer import Peer
from lmshm.quoting import clip, quote
from lmshm.wire import protocol

#: What the data plane answers: a reply message, or an error.
Answer = Union[protocol.StoreReply, protocol.RetrieveReply, protocol.LookupReply, protocol.ReleaseReply,
               protocol.ErrorReply]
#: Who asked: the endpoint's ``(identity, request_id)``, opaque to the core, handed back to ``reply``.
ReplyTo = tuple[bytes, bytes]
#: ``reply(identity, request_id, answer)``: how a queued job answers its request (any thread).
Reply = Callable[[bytes, bytes, Answer], None]
#: A copy request.
CopyRequest = Union[protocol.Store, protocol.Retrieve]


class Session(Protocol):
    """A verified client session, as an endpoint keeps it: its id, its kernel-checked peer,
    and whether it has ended (a job of an ended session copies nothing)."""

    @property
    def id(self) -> Hashable: ...

    @property
    def peer(self) -> Peer: ...

    @property
    def ended(self) -> bool: ...


class Queued:
    """The answer of a request whose reply comes later, through ``reply`` (``QUEUED``)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "QUEUED"


QUEUED = Queued()


def error(code: ErrorCode, message: str) -> protocol.ErrorReply:
    return protocol.ErrorReply(int(code), clip(message, 1024))


@dataclass(frozen=True)
class CopyJob:
    """A validated STORE or RETRIEVE, its registration held, on its way to a copier thread.
    ``deadline``: when its sender stops waiting, on this clock (``inf``: it did not say)."""

    session: Session
    reg: Registration
    layout: BlockLayout
    uid: int
    req: CopyRequest
    deadline: float

    @property
    def store(self) -> bool:
        return isinstance(self.req, protocol.Store)

    @property
    def what(self) -> str:
        return "STORE" if self.store else "RETRIEVE"


class Then:
    """A job's reply, and what the job does after sending it (CUDA: wait for the server's
    event, then commit or unpin)."""

    __slots__ = ("reply", "after")

    def __init__(self, reply: Answer, after: Callable[[], None]) -> None:
        self.reply, self.after = reply, after


class Copies:
    """What host and CUDA copies share; ``run`` is theirs."""

    def __init__(self, pool: Pool, tiers: Optional[TierStack]) -> None:
        self.pool = pool
        self.tiers = tiers
        self.late_requests = 0     # STORE/RETRIEVEs refused or not committed: past their sender's wait_s

    def run(self, job: CopyJob) -> Union[Answer, Then]:
        raise NotImplementedError

    def late(self, what: str, outcome: str) -> protocol.ErrorReply:
        self.late_requests += 1
        return error(ErrorCode.UNAVAILABLE, f"{what}: the request waited past its sender's timeout (wait_s) "
                                            f"before its copy could run; {outcome}")

    def commit(self, objs: list) -> None:
        """Make a STORE's copied objects visible (one hold of the pool's lock), then queue them
        for the tiers below."""
        self.pool.commit(objs)
        if self.tiers is not None:
            self.tiers.write_through(objs)

    def pin_sources(self, job: CopyJob) -> tuple[list, Optional[protocol.ErrorReply]]:
        """Pin a RETRIEVE's chunks: ``(objects, None)``, or ``([], error reply)`` with nothing
        left pinned: a chunk missing, of another layout or chunk size, or the session gone."""
        req, layout = job.req, job.layout
        objs, missing = self.pool.pin_for_copy(job.uid, req.keys, req.lease)
        if missing is not None:
            self.pool.count_failure()
            return [], error(ErrorCode.NOT_FOUND, f"RETRIEVE: {missing}; no block was written")
        cb = req.chunk_blocks
        for i, obj in enumerate(objs):
            if obj[LAYOUT] != layout.digest or obj[BLOCKS] != cb:
                self.pool.unpin(objs, retrieved=False)
                self.pool.count_failure()
                return [], error(ErrorCode.LAYOUT,
                                 f"RETRIEVE: chunk {i} was stored from another layout ({obj[BLOCKS]} blocks per "
                                 f"chunk, layout {obj[LAYOUT].hex()}) than instance {quote(job.reg.instance_id, 60)} "
                                 f"has ({cb} blocks, layout {layout.digest.hex()}); no block was written")
        if job.session.ended:
            self.pool.unpin(objs, retrieved=False)
            return [], error(ErrorCode.UNAVAILABLE, "RETRIEVE: the session ended before its copy ran")
        return objs, None
