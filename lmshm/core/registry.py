"""The server's registry: which KV caches and regions are mapped, under which name, owned by
which session. It is the single owner of "what is registered"; it does not count mappings
(each wrapper's ``to_tensor()`` takes its share of ``platform.base.mappings.MAPPINGS``).

Guarantees: ``register`` maps every layer or none; it ``admit``s every wrapper for the
kernel-verified peer first, and closes every wrapper and fd it does not keep. One namespace:
a live name with other content is ALREADY_EXISTS, the same content from the same owner a
refresh. Every registration is released exactly once, by unregister, owner reclaim or
shutdown; one taken out while a ``hold`` is open is released when the last holder leaves.
Who may unregister or read a registration is the caller's decision (``Registration.owner``).

One lock guards the tables, indexed by name and by owner, so no request walks them; mapping
and unmapping run outside it. The one trap: a release drops the tensors before closing the
wrappers, since a tensor keeps its mapping alive. docs/design/service.md has the rules.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Iterator, Sequence

import torch

from lmshm.core.errors import (
    AlreadyExists,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ServerError,
    Unavailable,
)
from lmshm.platform.base.fds import FD_INBOX
from lmshm.platform.base.ipc_wrapper import DeviceIPCWrapper
from lmshm.platform.base.peer import Peer
from lmshm.quoting import clip, quote
from lmshm.wire.protocol import MAX_LAYERS, LayerGroup

logger = logging.getLogger(__name__)

#: Instance ids starting with this are the server's own; clients may not register them.
RESERVED_ID_PREFIX = "__lmshm"


# The registry's refusals are the service's error types (lmshm.core.errors), by these names.
RegistryError = ServerError
InvalidRegistration = InvalidArgument
InstanceExists = AlreadyExists
InstanceNotFound = NotFound
NotPermitted = PermissionDenied      # the peer may not register that memory
RegionLimit = Unavailable


#: What a registration is: a worker's KV cache (``kv``) or a Triton-style region.
KINDS = ("kv", "system", "cuda")
KIND_WORDS = {"kv": "KV-cache registration", "system": "system shared memory region",
              "cuda": "CUDA shared memory region"}
#: The owner of every region: regions belong to no session and outlive every connection.
REGION_OWNER = "regions"


def _discard_fds(wrappers: Sequence[DeviceIPCWrapper], session: Hashable) -> None:
    tokens = [t for w in wrappers for t in w.fd_tokens()]
    if tokens:
        FD_INBOX.discard(tokens, session)


@dataclass(eq=False)
class Registration:
    instance_id: str
    owner: Hashable                 # the server's session id
    owner_pid: int                  # kernel-verified (the session's Peer)
    owner_uid: int
    client_name: str
    model_name: str
    world_size: int
    worker_rank: int
    layer_names: tuple[str, ...]
    groups: tuple[LayerGroup, ...]
    # Per group, the tensor its wrapper's to_tensor() built; layer views derive from it.
    bases: list[torch.Tensor]
    # Layer name -> (group index, storage offset on the wire).
    where: dict[str, tuple[int, int]]
    created: float = field(default_factory=time.time)
    holds: int = 0
    unregistered: bool = False      # out of the namespace; released when holds reach 0
    orphaned: bool = False          # the owner died: release_orphaned() on release
    released: bool = False
    views: dict[str, torch.Tensor] = field(default_factory=dict)
    block_layout: Any = None        # the data plane's BlockLayout, built on first use
    kind: str = "kv"                # one of KINDS
    region: Any = None              # a region's mapping (lmshm.core.regions); None for "kv"
    block_dim: int = 0              # the dim of every layer (its logical shape) that indexes blocks

    @property
    def wrappers(self) -> tuple[DeviceIPCWrapper, ...]:
        """One wrapper per group: what this registration maps and must close."""
        return tuple(g.wrapper for g in self.groups)

    @property
    def num_layers(self) -> int:
        return len(self.layer_names)

    @property
    def nbytes(self) -> int:
        if self.region is not None:
            return self.region.byte_size
        return sum(g.wrapper.nbytes * len(g.names) for g in self.groups)

    def describe_kind(self) -> str:
        return KIND_WORDS[self.kind]

    def tensor(self, layer_name: str) -> torch.Tensor | None:
        """The server-side tensor of one layer (aliasing the worker's memory), or None.

        Built on first use: a view of its group's mapped tensor at the layer's offset, whose
        bounds were checked at register time.
        """
        view = self.views.get(layer_name)
        if view is not None:
            return view
        loc = self.where.get(layer_name)
        if loc is None or self.released:
            return None
        group, offset = loc
        base = self.bases[group]
        delta = offset - self.groups[group].wrapper.storage_offset
        view = base if delta == 0 else base.as_strided(base.size(), base.stride(), base.storage_offset() + delta)
        return self.views.setdefault(layer_name, view)

    def layer(self, layer_name: str) -> tuple[torch.Tensor, DeviceIPCWrapper] | None:
        """``(tensor, wrapper that maps it)`` for one layer, or None."""
        tensor = self.tensor(layer_name)
        if tensor is None:
            return None
        return tensor, self.groups[self.where[layer_name][0]].wrapper

    def drop_tensors(self) -> None:
        """Forget every tensor; they hold the mappings (child leases) until dropped. The data
        plane's layout holds views of the mappings too."""
        self.views.clear()
        self.bases.clear()
        self.block_layout = None

    def same_content(self, model_name: str, world_size: int, worker_rank: int,
                     groups: Sequence[LayerGroup], block_dim: int = 0) -> bool:
        return (self.model_name == model_name and self.world_size == world_size
                and self.worker_rank == worker_rank and self.block_dim == block_dim and self.groups == tuple(groups))


def _close_quietly(wrappers: Sequence[DeviceIPCWrapper], orphaned: bool = False) -> None:
    for w in wrappers:
        try:
            w.close()
        except Exception:
            logger.exception("lmshm: closing %r failed", w)
        if orphaned:
            try:
                w.release_orphaned()
            except Exception:
                logger.exception("lmshm: release_orphaned on %r failed", w)


def _exists_message(name: str, existing: Registration) -> str:
    if existing.kind == "kv":
        what = (f"a {existing.describe_kind()} (model {quote(existing.model_name)}, {existing.num_layers} layers, "
                f"owner pid {existing.owner_pid})")
    else:
        what = f"a {existing.describe_kind()}"
    return (f"{quote(name, 80)} is already registered, as {what}: system, CUDA and KV-cache registrations share "
            "one namespace; unregister it first or choose another name")


def check_name(what: str, name: str) -> None:
    """A registration's or region's name: printable, not empty, not the server's own prefix."""
    if not name or not name.isprintable():  # its length is the server's setting
        raise InvalidRegistration(f"{what} {quote(name)} must be printable characters, at least one")
    if name.startswith(RESERVED_ID_PREFIX):
        raise InvalidRegistration(
            f"{what} {quote(name)} starts with {RESERVED_ID_PREFIX!r}, which is reserved for the server")


def _check_request(instance_id: str, world_size: int, worker_rank: int,
                   groups: Sequence[LayerGroup], block_dim: int = 0) -> dict[str, tuple[int, int]]:
    """Validate a request; return layer name -> (group index, storage offset)."""
    check_name("instance id", instance_id)
    if world_size < 1 or not 0 <= worker_rank < world_size:
        raise InvalidRegistration(
            f"instance {instance_id!r}: worker_rank {worker_rank} is not in [0, world_size={world_size})")
    total = sum(len(g.names) for g in groups)
    if total == 0:
        raise InvalidRegistration(f"instance {instance_id!r}: a registration needs at least one layer")
    if total > MAX_LAYERS:
        raise InvalidRegistration(f"instance {instance_id!r}: {total} layers is more than {MAX_LAYERS}")
    where: dict[str, tuple[int, int]] = {}
    for gi, g in enumerate(groups):
        w = g.wrapper
        if len(g.names) != len(g.storage_offsets) or not g.names:
            raise InvalidRegistration(
                f"instance {instance_id!r}: group {gi} has {len(g.names)} names and "
                f"{len(g.storage_offsets)} storage offsets; it needs one of each per layer, at least one")
        if not w.groupable and (len(g.names) != 1 or g.storage_offsets[0] != w.storage_offset):
            raise InvalidRegistration(
                f"instance {instance_id!r}: a {w.kind} wrapper stands for exactly one layer at its own "
                f"storage offset; group {gi} ({quote(g.names[0])}) asks for {len(g.names)}")
        if not 0 <= block_dim < len(w.shape):
            raise InvalidRegistration(
                f"instance {instance_id!r}: block_dim {block_dim} is not a dimension of layer {quote(g.names[0])} "
                f"(shape {tuple(w.shape)}, {len(w.shape)} dims): block_dim names the dim of each layer's "
                "shape, as the worker sees it, whose index is the block id")
        for name, offset in zip(g.names, g.storage_offsets):
            if not name:
                raise InvalidRegistration(f"instance {instance_id!r}: a layer has an empty name")
            if name in where:
                raise InvalidRegistration(f"instance {instance_id!r}: layer name {quote(name)} appears twice")
            where[name] = (gi, offset)
    return where


class _Owned:
    """One owner's live registrations (in the order they entered) and their totals."""

    __slots__ = ("regs", "layers", "nbytes")

    def __init__(self) -> None:
        self.regs: dict[str, Registration] = {}
        self.layers = 0
        self.nbytes = 0


class Registry:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: dict[str, Registration] = {}     # in the order they entered the namespace
        self._owned: dict[Hashable, _Owned] = {}     # owner (a session, or REGION_OWNER) -> its part of _live
        self._mapping: set[str] = set()  # ids reserved while their layers are being mapped
        self._draining: dict[Registration, None] = {}  # unregistered, still held (an ordered set)
        self._regions_opening = 0

    def _enter_locked(self, reg: Registration) -> None:
        self._live[reg.instance_id] = reg
        owned = self._owned.get(reg.owner)
        if owned is None:
            owned = self._owned[reg.owner] = _Owned()
        owned.regs[reg.instance_id] = reg
        owned.layers += reg.num_layers
        owned.nbytes += reg.nbytes

    # ---- register -----------------------------------------------------------------------
    def register(
        self,
        *,
        peer: Peer,
        instance_id: str,
        model_name: str,
        world_size: int,
        worker_rank: int,
        groups: Sequence[LayerGroup],
        client_name: str = "",
        block_dim: int = 0,
    ) -> tuple[Registration, bool]:
        """Map and record every layer for the kernel-verified ``peer``. Returns
        ``(registration, refreshed)``.

        Takes ownership of the groups' wrappers: on any outcome they are either kept by the
        registration or closed, and every fd the peer sent for them is mapped or closed.
        """
        owner = peer.session
        wrappers = [g.wrapper for g in groups]
        try:
            where = _check_request(instance_id, world_size, worker_rank, groups, block_dim)
            with self._lock:
                existing = self._live.get(instance_id)
                if existing is not None:
                    same = existing.same_content(model_name, world_size, worker_rank, groups, block_dim)
                    if existing.owner == owner and same:
                        self.refuse(groups, owner)
                        return existing, True
                    raise InstanceExists(_exists_message(instance_id, existing))
                if instance_id in self._mapping:
                    raise InstanceExists(f"instance {instance_id!r} is being registered right now")
                self._mapping.add(instance_id)  # reserve the id; map outside the lock
        except RegistryError:
            self.refuse(groups, owner)
            raise

        try:
            bases = self._map_all(instance_id, groups, peer)
        except BaseException:
            with self._lock:
                self._mapping.discard(instance_id)
            self.refuse(groups, owner)
            raise
        finally:
            _discard_fds(wrappers, owner)  # fds of objects mapped before: not needed again
        reg = Registration(instance_id, owner, peer.pid, peer.uid, client_name, model_name, world_size,
                           worker_rank, tuple(where), tuple(groups), bases, where, block_dim=block_dim)
        with self._lock:
            self._mapping.discard(instance_id)
            self._enter_locked(reg)
        return reg, False

    @staticmethod
    def refuse(groups: Sequence[LayerGroup], session: Hashable) -> None:
        """Close the wrappers of a request that will not be registered, and the fds sent for them."""
        wrappers = [g.wrapper for g in groups]
        _close_quietly(wrappers)
        _discard_fds(wrappers, session)

    @staticmethod
    def _map_all(instance_id: str, groups: Sequence[LayerGroup], peer: Peer) -> list[torch.Tensor]:
        """Check ownership of and map every group; check that every layer's view fits its
        mapping. All or nothing."""
        bases: list[torch.Tensor] = []
        first = 0  # index of the group's first layer among all layers
        for g in groups:
            w = g.wrapper
            try:
                w.admit(peer)
            except PermissionError as exc:
                bases.clear()
                raise NotPermitted(
                    f"instance {instance_id!r}: layer {first} ({quote(g.names[0])}, {w.kind}) refused: {exc}; "
                    "no layer of this registration was kept") from None
            try:
                base = w.to_tensor()
            except Exception as exc:
                bases.clear()  # drop layers < k before the caller closes the wrappers
                kind = NotPermitted if isinstance(exc, PermissionError) else InvalidRegistration
                raise kind(
                    f"instance {instance_id!r}: layer {first} ({quote(g.names[0])}, {w.kind}) could not be mapped: "
                    f"{clip(str(exc), 400)}; no layer of this registration was kept") from None
            bases.append(base)
            if len(g.storage_offsets) > 1:
                # Same shape and stride for every layer: the extremes bound all the others.
                for offset in (min(g.storage_offsets), max(g.storage_offsets)):
                    try:
                        base.as_strided(base.size(), base.stride(),
                                        base.storage_offset() + offset - w.storage_offset)
                    except RuntimeError:
                        k = g.storage_offsets.index(offset)
                        bases.clear()
                        raise InvalidRegistration(
                            f"instance {instance_id!r}: layer {first + k} ({quote(g.names[k])}, {w.kind}) at "
                            f"storage offset {offset} does not fit its mapped object ({w.describe()}); "
                            "no layer of this registration was kept") from None
            first += len(g.names)
        return bases

    # ---- regions (Triton's shared-memory extension) --------------------------------------
    def add_region(self, name: str, kind: str, open_region: Callable[[], Any], *, client_name: str = "",
                   max_regions: int = 1 << 30) -> Registration:
        """Register a region: reserve ``name`` (one namespace with KV registrations), then run
        ``open_region()`` outside the lock. It returns the region's mapping (``byte_size``,
        ``tensor``, ``close()``); if it raises, the name is free again and nothing is kept.
        At most ``max_regions`` regions (both kinds, being opened included) live at once."""
        check_name(f"{KIND_WORDS[kind]} name", name)
        with self._lock:
            existing = self._live.get(name)
            if existing is not None:
                raise InstanceExists(_exists_message(name, existing))
            if name in self._mapping:
                raise InstanceExists(f"{quote(name, 80)} is being registered right now")
            held = len(self._owned_regs(REGION_OWNER)) + self._regions_opening
            if held >= max_regions:
                raise RegionLimit(f"the server holds {held} regions, its limit (lmshm-server --max-regions); "
                                  "unregister some first")
            self._mapping.add(name)
            self._regions_opening += 1
        try:
            region = open_region()
        except BaseException:
            with self._lock:
                self._mapping.discard(name)
                self._regions_opening -= 1
            raise
        reg = Registration(name, REGION_OWNER, 0, -1, client_name, "", 1, 0, (), (), [region.tensor], {},
                           kind=kind, region=region)
        with self._lock:
            self._mapping.discard(name)
            self._regions_opening -= 1
            self._enter_locked(reg)
        return reg

    def region(self, name: str, kind: str) -> Registration:
        """The live region ``name`` of ``kind``; NOT_FOUND, naming its kind, for anything else."""
        with self._lock:
            reg = self._live.get(name)
        if reg is None:
            raise InstanceNotFound(f"no {KIND_WORDS[kind]} named {quote(name, 80)} is registered")
        if reg.kind != kind:
            raise InstanceNotFound(f"{quote(name, 80)} is a {reg.describe_kind()}, not a {KIND_WORDS[kind]}")
        return reg

    def regions(self, kind: str) -> list[Registration]:
        with self._lock:
            return [r for r in self._owned_regs(REGION_OWNER).values() if r.kind == kind]

    def unregister_region(self, name: str, kind: str) -> bool:
        """Unregister region ``name`` if it is one of ``kind``; an unknown name, or a name of
        another kind, is left alone and is not an error (Triton's rule). Returns True if a
        region was taken out of the namespace."""
        with self._lock:
            reg = self._live.get(name)
            if reg is None or reg.kind != kind:
                return False
            deferred = self._unlink_locked(reg)
        if not deferred:
            self._release(reg)
        return True

    def unregister_regions(self, kind: str) -> int:
        """Unregister every region of ``kind`` (and nothing else). Returns how many."""
        with self._lock:
            regs = [r for r in self._owned_regs(REGION_OWNER).values() if r.kind == kind]
            now = [r for r in regs if not self._unlink_locked(r)]
        for r in now:
            self._release(r)
        return len(regs)

    # ---- unregister and reclaim ---------------------------------------------------------
    def unregister(self, instance_id: str) -> bool:
        """Take ``instance_id`` out of the namespace (the caller checked who may). Returns True
        if the release is deferred."""
        with self._lock:
            reg = self._live.get(instance_id)
            if reg is None:
                raise InstanceNotFound(f"no registration with instance id {quote(instance_id)}")
            deferred = self._unlink_locked(reg)
        if not deferred:
            self._release(reg)
        return deferred

    def release_owner(self, owner: Hashable, *, orphaned: bool) -> list[str]:
        """Unregister everything ``owner`` holds (its session ended). Returns the instance ids."""
        if owner == REGION_OWNER:
            return []
        with self._lock:
            regs = list(self._owned_regs(owner).values())
            now = [r for r in regs if not self._unlink_locked(r, orphaned=orphaned)]
            for r in regs:
                r.orphaned = r.orphaned or orphaned
        for r in now:
            self._release(r)
        return [r.instance_id for r in regs]

    def release_all(self) -> int:
        """Shutdown: release every registration now, held or not. Returns how many."""
        with self._lock:
            regs = list(self._live.values()) + list(self._draining)
            self._live.clear()
            self._owned.clear()
            self._draining = {}
            for r in regs:
                r.unregistered = True
        for r in regs:
            self._release(r)
        return len(regs)

    def _unlink_locked(self, reg: Registration, orphaned: bool = False) -> bool:
        del self._live[reg.instance_id]
        owned = self._owned[reg.owner]
        del owned.regs[reg.instance_id]
        owned.layers -= reg.num_layers
        owned.nbytes -= reg.nbytes
        if not owned.regs:
            del self._owned[reg.owner]
        reg.unregistered = True
        reg.orphaned = reg.orphaned or orphaned
        if reg.holds:
            self._draining[reg] = None
            return True
        return False

    def _owned_regs(self, owner: Hashable) -> dict[str, Registration]:
        owned = self._owned.get(owner)
        return owned.regs if owned is not None else {}

    def _release(self, reg: Registration) -> None:
        with self._lock:
            if reg.released:
                return
            reg.released = True
            self._draining.pop(reg, None)
        reg.drop_tensors()  # tensors hold child leases: drop them before closing
        if reg.region is not None:  # never unlinked: the client created its object and owns it
            try:
                reg.region.close()
            except Exception:
                logger.exception("lmshm: closing region %r failed", reg.instance_id)
            logger.debug("lmshm: released %s %r", reg.describe_kind(), reg.instance_id)
            return
        _close_quietly(reg.wrappers, orphaned=reg.orphaned)
        logger.info("lmshm: released instance %r (%d layers%s)", reg.instance_id, reg.num_layers,
                    ", owner gone" if reg.orphaned else "")

    # ---- data operations ----------------------------------------------------------------
    @contextlib.contextmanager
    def hold(self, instance_id: str) -> Iterator[Registration]:
        """Keep ``instance_id``'s mappings alive for the duration of a data operation."""
        reg = self.acquire(instance_id)
        try:
            yield reg
        finally:
            self.let_go(reg)

    def acquire(self, instance_id: str) -> Registration:
        """``hold`` in two halves, for an operation that ends on another thread: every
        ``acquire`` is matched by exactly one ``let_go``."""
        with self._lock:
            reg = self._live.get(instance_id)
            if reg is None:
                raise InstanceNotFound(f"no registration with instance id {quote(instance_id)}")
            reg.holds += 1
        return reg

    def hold_more(self, reg: Registration) -> None:
        """One more hold on a registration the caller already holds (matched by a ``let_go``):
        for memory that must outlive the operation, e.g. CUDA copies past their deadline."""
        with self._lock:
            assert reg.holds > 0, "hold_more needs a registration already held"
            reg.holds += 1

    def let_go(self, reg: Registration) -> None:
        with self._lock:
            reg.holds -= 1
            release = reg.holds == 0 and reg.unregistered
        if release:
            self._release(reg)

    # ---- introspection ------------------------------------------------------------------
    def get(self, instance_id: str) -> Registration:
        with self._lock:
            reg = self._live.get(instance_id)
        if reg is None:
            raise InstanceNotFound(f"no registration with instance id {quote(instance_id)}")
        return reg

    def registrations(self) -> list[Registration]:
        """Every live registration, in the order they entered (a walk: not for requests)."""
        with self._lock:
            return list(self._live.values())

    def page(self, offset: int, limit: int) -> tuple[list[Registration], int]:
        """Up to ``limit`` live registrations from the ``offset``-th, in the order they entered
        (oldest first), and how many are live. Walks ``offset + limit`` entries, in C."""
        with self._lock:
            return list(itertools.islice(self._live.values(), offset, offset + limit)), len(self._live)

    def owners(self) -> list[tuple[Registration, int, int, int]]:
        """Per owner (a session; ``REGION_OWNER`` for all regions): ``(its oldest registration,
        registrations, layers, bytes)``. One entry per owner, from counts kept as they change."""
        with self._lock:
            return [(next(iter(o.regs.values())), len(o.regs), o.layers, o.nbytes) for o in self._owned.values()]

    def count_owned(self, owner: Hashable, instance_id: str = "") -> tuple[int, int, bool]:
        """``(registrations, layers, holds instance_id)`` of ``owner``."""
        with self._lock:
            owned = self._owned.get(owner)
            if owned is None:
                return 0, 0, False
            return len(owned.regs), owned.layers, instance_id in owned.regs

    @property
    def draining(self) -> int:
        with self._lock:
            return len(self._draining)

    def __len__(self) -> int:
        with self._lock:
            return len(self._live)
