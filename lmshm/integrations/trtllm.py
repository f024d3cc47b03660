"""TensorRT-LLM: register one KV pool and store, look up and retrieve its blocks through lmshm.

TensorRT-LLM keeps every layer's KV in one cudaMalloc'ed pool, ``[blocks, layers, 2, ...]``
(block dim 0). ``TrtllmKVPool`` registers it as *one* ``RawCudaIPCWrapper.from_pointer`` and
moves blocks with the engine-neutral adapter (keys chained over token ids plus a per-request
salt, a ``Link`` that never stalls the engine). A CPU pool is CPU shared memory (the tests'). Use::

    pool = TrtllmKVPool(kv_pool_tensor, model="llama-3-8b", tokens_per_block=64, url="tcp://...")
    pool.register()
    matched, lease = pool.lookup(prompt_tokens)            # tokens lmshm can supply
    pool.load(prompt_tokens, matched, block_ids, lease)    # before the forward pass
    pool.store(prompt_tokens, block_ids)                   # after it

The trap: unified (cudaMallocManaged) and VMM (cuMemCreate) pools have no legacy IPC handle:
``wrap_device_pool`` refuses them, saying what to allocate instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from lmshm.core.cuda_sync import WorkerCudaSync
from lmshm.integrations.adapter import (
    Link,
    LinkConfig,
    Namespace,
    chunk_block_ids,
    chunk_keys,
)
from lmshm.platform.cuda import devices
from lmshm.platform.cuda.driver import get_driver
from lmshm.platform.cuda.raw_ipc import RawCudaIPCWrapper


class UnsupportedPoolMemory(ValueError):
    """The pool is unified (UVM) or VMM memory: lmshm cannot share it as one raw IPC handle."""


@dataclass(frozen=True)
class PoolPointer:
    """A device pool no torch tensor describes: its address, shape, dtype and device."""

    ptr: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: Any = 0

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for s in self.shape:
            n *= s
        return n


def wrap_device_pool(pool: PoolPointer, name: str = "kv_pool") -> Any:
    """One ``RawCudaIPCWrapper`` for the whole pool, after refusing memory it cannot share."""
    drv = get_driver()
    ordinal = devices.ordinal_of(pool.device)
    if drv.is_managed(pool.ptr, ordinal):
        raise UnsupportedPoolMemory(
            f"{name} at {pool.ptr:#x} is unified memory (cudaMallocManaged): it has no CUDA IPC handle, so "
            "lmshm-server cannot map it. Allocate the TensorRT-LLM KV pool with cudaMalloc (the default) "
            "instead of UVM")
    if not drv.is_legacy_ipc_capable(pool.ptr, ordinal):
        raise UnsupportedPoolMemory(
            f"{name} at {pool.ptr:#x} is not cudaMalloc memory (a VMM / cuMemCreate pool, or a pool "
            "allocator): a raw CUDA IPC handle cannot share it. Use a cudaMalloc'ed pool, or register it "
            "with the VMM wrapper (LMSHM_USE_VMM_API=1) through MPClient.register_kv_caches")
    return RawCudaIPCWrapper.from_pointer(pool.ptr, pool.nbytes, pool.dtype, pool.shape, pool.device, name=name)


class TrtllmKVPool:
    """See the module docstring. ``pool`` is a torch tensor ``[blocks, layers, 2, ...]`` (CPU
    or CUDA) or a ``PoolPointer``."""

    def __init__(self, pool: torch.Tensor | PoolPointer, *, model: str, tokens_per_block: int,
                 url: Optional[str] = None, chunk_tokens: Optional[int] = None, salt: str = "",
                 world_size: int = 1, rank: int = 0, link: Optional[Link] = None,
                 timeout_s: float = 5.0) -> None:
        shape = tuple(pool.shape)
        if len(shape) < 3 or shape[2] != 2:
            raise ValueError(f"a TensorRT-LLM KV pool is [blocks, layers, 2, ...]; got shape {shape}")
        self.pool = pool
        self.tokens_per_block = tokens_per_block
        self.chunk_tokens = chunk_tokens or tokens_per_block
        if self.chunk_tokens % tokens_per_block:
            raise ValueError(f"chunk_tokens ({self.chunk_tokens}) must be a multiple of tokens_per_block "
                             f"({tokens_per_block})")
        self.chunk_blocks = self.chunk_tokens // tokens_per_block
        self.rank, self.world_size = rank, world_size
        layout = f"trtllm:block0:{shape[1:]}:tokens_per_block={tokens_per_block}"
        self.namespaces = [Namespace(model, str(pool.dtype), layout, world_size, r, self.chunk_tokens, salt).digest
                           for r in range(world_size)]
        self.link = link or Link(LinkConfig(url=url, client_name=f"trtllm-rank{rank}", timeout_s=timeout_s))
        self._model = model
        self._cuda: Any = None
        device = pool.device if isinstance(pool, torch.Tensor) else torch.device("cuda", pool.device) \
            if isinstance(pool.device, int) else torch.device(pool.device)
        if device.type == "cuda":
            self._cuda = WorkerCudaSync(device.index or 0, client=self.link.client)   # isolated: a flag page
        self.cuda_errors = 0          # CUDA ordering steps that failed: a failed load, a dropped store

    def register(self, instance_id: Optional[str] = None) -> None:
        """Register the pool (now, or as soon as the server answers)."""
        iid = instance_id or f"trtllm-{self._model}-rank{self.rank}"
        pool = self.pool
        if isinstance(pool, torch.Tensor) and pool.device.type == "cpu":
            self.link.register({"kv_pool": pool}, model_name=self._model, world_size=self.world_size,
                               rank=self.rank, instance_id=iid)
            return
        if isinstance(pool, torch.Tensor):
            pool = PoolPointer(pool.data_ptr(), tuple(pool.shape), pool.dtype, pool.device)
        wrap_device_pool(pool)  # refuse UVM / VMM here, in the caller's thread, with its message
        self.link.register_with(lambda client: client.register_wrappers(
            ["kv_pool"], [wrap_device_pool(pool)], iid, model_name=self._model, world_size=self.world_size,
            rank=self.rank))

    def keys(self, tokens: Sequence[int], salt: bytes | str = b"") -> list[list[bytes]]:
        """Per rank, the keys of every whole chunk of ``tokens``. ``salt``: the request's own
        identity (a tenant, a LoRA adapter, an image digest): requests with different salts
        share nothing, whatever their tokens."""
        salt = salt.encode() if isinstance(salt, str) else bytes(salt)
        return [chunk_keys(ns, tokens, self.chunk_tokens, salt) for ns in self.namespaces]

    def lookup(self, tokens: Sequence[int], salt: bytes | str = b"") -> tuple[int, bytes]:
        """``(tokens lmshm can supply, lease)``: whole chunks every rank has; a full hit leaves
        the last token to compute. Release the lease (``release``) if you do not ``load``."""
        hits, lease = self.link.lookup(self.keys(tokens, salt))
        return min(hits * self.chunk_tokens, max(0, len(tokens) - 1)) if hits else 0, lease

    def load(self, tokens: Sequence[int], matched: int, block_ids: Sequence[int], lease: bytes = b"",
             salt: bytes | str = b"") -> bool:
        """Copy the chunks behind ``lookup``'s ``matched`` tokens of prompt ``tokens`` into the
        sequence's ``block_ids`` (from its first block). Waits. False: nothing usable arrived;
        compute those tokens."""
        chunks = -(-matched // self.chunk_tokens)
        keys = self.keys(tokens, salt)[self.rank][:chunks]
        if not keys:
            self.release(lease)
            return False
        ready = self._ready()
        if ready is None:
            self.release(lease)
            return False
        ev, handle = ready
        pending = self.link.retrieve(keys, chunk_block_ids(block_ids, 0, chunks, self.chunk_blocks),
                                     self.chunk_blocks, lease, handle)
        reply = self.link.outcome("retrieve", pending) if pending is not None else None
        if reply is not None and not self._wait(reply.event):   # the stream reads the blocks after the copies
            reply = None
        del ev
        return reply is not None

    def store(self, tokens: Sequence[int], block_ids: Sequence[int], *, wait: bool = True,
              salt: bytes | str = b"") -> Any:
        """Store every whole chunk of ``tokens`` from ``block_ids``. With ``wait``, returns the
        number of chunks newly stored (0 if the server is unreachable); else the ``Pending``."""
        keys = self.keys(tokens, salt)[self.rank]
        if not keys:
            return 0 if wait else None
        ready = self._ready()
        if ready is None:
            return 0 if wait else None
        ev, handle = ready
        pending = self.link.store(keys, chunk_block_ids(block_ids, 0, len(keys), self.chunk_blocks),
                                  self.chunk_blocks, handle)
        if not wait or pending is None:
            if pending is not None:
                pending._lmshm_event = ev  # alive until the caller has the reply
            return pending if not wait else 0
        reply = self.link.outcome("store", pending)
        if reply is not None:
            self._wait(reply.event)        # reuse the blocks only after the server read them
        return 0 if reply is None else sum(1 for r in reply.results if r == 0)

    # ---- CUDA ordering: no CUDA error reaches the engine ------------------------------------
    def _ready(self) -> Optional[tuple[Any, bytes]]:
        if self._cuda is None:
            return None, b""
        try:
            return self._cuda.ready()
        except Exception as exc:
            self.cuda_errors += 1
            self.link.warn("cuda-ready", "cannot make a CUDA ordering token (%s)", str(exc))
            return None

    def _wait(self, handle: bytes) -> bool:
        if self._cuda is None:
            return True
        try:
            self._cuda.wait(handle)
            return True
        except Exception as exc:
            self.cuda_errors += 1
            self.link.warn("cuda-wait", "cannot wait for the server's CUDA event (%s)", str(exc))
            return False

    def release(self, lease: bytes) -> None:
        self.link.release(lease)

    def close(self) -> None:
        self.link.close()
