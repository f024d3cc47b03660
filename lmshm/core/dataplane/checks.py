"""The checks a request passes on the loop, before a byte moves.

``Checks`` refuses with a ``DataPlaneError`` (its code is the reply's): no pool, an instance
the session does not own, too many requests in flight or leases held (per session, per uid),
block-id counts and bounds, a layout that does not move in few byte runs along the
registration's ``block_dim``, a CPU layer that is neither a sealed memfd nor a named segment the
server can copy through its file. A STORE or RETRIEVE that passes becomes a ``CopyJob`` holding
its registration (``Registry.acquire``).

The trap: these run on the request loop, so they read tables and shapes only; anything that
may block (a mapping's ``verify_mapped``, a tier) belongs to the copy, on a copier thread.
"""

from __future__ import annotations

import dataclasses
import time

from lmshm.core.dataplane.config import DataPlaneConfig
from lmshm.core.dataplane.executor import OrderedExecutor
from lmshm.core.dataplane.jobs import CopyJob, CopyRequest, Session
from lmshm.core.dataplane.layout import BlockLayout, FileSide, LayoutError
from lmshm.core.errors import ErrorCode, ServerError
from lmshm.core.pool import Pool
from lmshm.core.registry import Registration, Registry
from lmshm.platform.cuda.driver import get_driver
from lmshm.quoting import quote
from lmshm.wire import protocol

#: A request's sender stops waiting ``wait_s`` after sending; the server takes 10 % of it and
#: this much off, for the trips and a loop turn, when it decides whether a copy is too late.
SENDER_MARGIN_S = 0.05


class DataPlaneError(ServerError):
    """A refused data-plane request (a ``ServerError``: its code is the reply's)."""


class Checks:
    def __init__(self, config: DataPlaneConfig, registry: Registry, pool: Pool, copier: OrderedExecutor) -> None:
        self.config = config
        self.registry = registry
        self.pool = pool
        self.copier = copier

    def copy_job(self, session: Session, req: CopyRequest) -> CopyJob:
        """Validate a STORE or RETRIEVE and hold its registration (the caller lets it go)."""
        what = "STORE" if isinstance(req, protocol.Store) else "RETRIEVE"
        reg = self.owned(session, req.instance_id, what)
        layout = self.layout(reg)
        self.blocks(what, layout, req.keys, req.block_ids, req.chunk_blocks)
        reg = self.registry.acquire(req.instance_id)
        return CopyJob(session, reg, layout, session.peer.uid, req, sender_deadline(req))

    def adverts(self, req: protocol.Store) -> int:
        """How many adverts a STORE carries: none, or one per key."""
        try:
            n = protocol.advert_count(req.adverts)
        except ValueError as exc:
            raise DataPlaneError(ErrorCode.INVALID_ARG, f"STORE: {exc}") from None
        if n and n != len(req.keys):
            raise DataPlaneError(ErrorCode.INVALID_ARG, f"STORE: {n} adverts for {len(req.keys)} keys "
                                                        "(one per key, or none)")
        return n

    def lookup(self, session: Session, req: protocol.Lookup) -> None:
        """A LOOKUP's key lists and the session's and uid's lease limits."""
        lengths = {len(k) for k in req.keys}
        if len(lengths) != 1:
            raise DataPlaneError(ErrorCode.INVALID_ARG,
                                 f"LOOKUP: every rank must list the same number of keys, got {sorted(lengths)}")
        if sum(len(k) for k in req.keys) > protocol.MAX_KEYS:
            raise DataPlaneError(ErrorCode.INVALID_ARG, f"LOOKUP: more than {protocol.MAX_KEYS} keys in all")
        limit = self.config.max_leases_per_session
        if self.pool.leases_of(session.id) >= limit:
            raise DataPlaneError(ErrorCode.UNAVAILABLE,
                                 f"LOOKUP: this session holds {limit} leases, the server's limit "
                                 "(lmshm-server --max-leases-per-session); RELEASE or RETRIEVE them")
        uid, limit = session.peer.uid, self.config.max_leases_per_uid
        if self.pool.leases_of_uid(uid) >= limit:
            raise DataPlaneError(ErrorCode.UNAVAILABLE,
                                 f"LOOKUP: uid {uid} holds {limit} leases over all its sessions, the "
                                 "server's limit (lmshm-server --max-leases-per-uid); RELEASE or RETRIEVE them")

    def owned(self, session: Session, instance_id: str, what: str) -> Registration:
        if not self.pool.capacity:
            raise DataPlaneError(ErrorCode.UNAVAILABLE,
                                 f"{what}: this lmshm-server has no pool (started with --capacity 0)")
        reg = self.owner_of(session, instance_id, what)
        limit = self.config.max_inflight_per_session
        if self.copier.pending(session.id) >= limit:
            raise DataPlaneError(ErrorCode.UNAVAILABLE,
                                 f"{what}: this session already has {limit} STORE/RETRIEVE requests in "
                                 "flight, the server's limit (lmshm-server --max-inflight-per-session)")
        return reg

    def owner_of(self, session: Session, instance_id: str, what: str) -> Registration:
        """``instance_id``'s registration if ``session`` owns it (nothing about the in-flight
        limit: a running request's flag page is checked with this, and it counts itself)."""
        reg = self.registry.get(instance_id)
        if reg.owner != session.id:
            raise DataPlaneError(ErrorCode.PERMISSION_DENIED,
                                 f"{what}: instance {quote(instance_id, 60)} belongs to another session "
                                 f"(pid {reg.owner_pid}); only the worker that registered it may copy blocks "
                                 "in or out of it")
        return reg

    def layout(self, reg: Registration) -> BlockLayout:
        """The registration's layout, built once and kept on it (a refusal is kept too)."""
        if reg.block_layout is None:
            tensors = [reg.tensor(n) for n in reg.layer_names]
            if any(t is None for t in tensors):
                raise DataPlaneError(ErrorCode.NOT_FOUND, f"instance {quote(reg.instance_id, 60)} is being released")
            kinds = {w.device_type for w in reg.wrappers}
            devices = {w.device for w in reg.wrappers}
            if len(kinds) > 1 or len(devices) > 1:
                raise DataPlaneError(ErrorCode.UNSUPPORTED,
                                     f"instance {quote(reg.instance_id, 60)} spans {', '.join(sorted(devices))}: the "
                                     "data plane moves registrations of one device")
            try:
                layout = BlockLayout.of(reg.layer_names, tensors, reg.block_dim)
                if kinds == {"cpu"} and self.config.through_files:
                    layout = with_files(reg, layout)
                if kinds == {"cuda"}:
                    layout = dataclasses.replace(layout, cuda_device=get_driver().local_ordinal(next(iter(devices))))
                reg.block_layout = layout
            except LayoutError as exc:
                reg.block_layout = exc
        if isinstance(reg.block_layout, LayoutError):
            raise DataPlaneError(ErrorCode.LAYOUT, f"instance {quote(reg.instance_id, 60)}: {reg.block_layout}")
        return reg.block_layout

    @staticmethod
    def blocks(what: str, layout: BlockLayout, keys: list[bytes], block_ids: list[int], chunk_blocks: int) -> None:
        if len(block_ids) != len(keys) * chunk_blocks:
            raise DataPlaneError(ErrorCode.INVALID_ARG,
                                 f"{what}: {len(keys)} chunk(s) of {chunk_blocks} block(s) need "
                                 f"{len(keys) * chunk_blocks} block ids, the request has {len(block_ids)}")
        if block_ids and max(block_ids) >= layout.num_blocks:
            bad = next(b for b in block_ids if b >= layout.num_blocks)
            raise DataPlaneError(ErrorCode.INVALID_ARG,
                                 f"{what}: block id {bad} is out of range; the registration has "
                                 f"{layout.num_blocks} blocks")


def with_files(reg: Registration, layout: BlockLayout) -> BlockLayout:
    """Choose how each CPU layer is copied. A sealed shmem memfd (checked when it was mapped,
    ``CpuFdIPCWrapper``) keeps every byte it has, so it is copied through the mapping, one
    ``memmove`` per piece. A named segment can be truncated or punched by its owner at any
    time, so it is copied through its file (``preadv``/``pwritev``: a short count, never
    SIGBUS). Anything else is refused before a byte moves."""
    plans = []
    for plan in layout.layers:
        found = reg.layer(plan.name)
        wrapper = found[1] if found else None
        if wrapper is not None and wrapper.mapping_cannot_fault():
            plans.append(plan)
            continue
        backing = getattr(wrapper, "backing_file", None)
        where = backing() if backing is not None else None
        if where is None:
            raise LayoutError(f"layer {plan.name!r} is neither a sealed memfd nor a named segment the server "
                              "can copy through its file")
        path, inode, start = where
        plans.append(dataclasses.replace(plan, file=FileSide(path, inode, plan.base - start)))
    return dataclasses.replace(layout, layers=tuple(plans))


def sender_deadline(req: CopyRequest) -> float:
    """When the sender stops waiting for this request's reply, on this server's clock, from
    ``wait_s`` counted from now (the request was just decoded), less a margin for the trip each
    way and a loop turn: 10 %, and 50 ms more (at most another 10 %). ``inf`` when the sender
    did not say."""
    wait = getattr(req, "wait_s", 0.0)
    return time.monotonic() + wait * 0.9 - min(SENDER_MARGIN_S, wait * 0.1) if wait else float("inf")
