"""SGLang HiCache: an L3 storage backend (``HiCacheStorage``, interface v1) over lmshm-server.

It registers SGLang's *whole host pool* once, so a page moves between the host pool and the
server's pool with one ``memmove`` inside the server and no KV byte on the socket:
``batch_exists`` is one LOOKUP, ``batch_set_v1`` one STORE, ``batch_get_v1`` one RETRIEVE. Each
kind of page region (``get_page_buffer_meta``), over all pages, is registered as one layer,
block dimension 0, so lmshm block ``p`` is page ``p``. Keys are ``H(namespace, SGLang's key)``.
Every call goes through ``adapter.Link``: a dead server costs misses, never a stall.

The trap: the server maps only sealed memfds, and SGLang's ``"allocator": "shm"`` memfd cannot
be sealed, so at registration the backend *re-backs the pool in place* (``reback_pool``), before
SGLang moves a page; a pinned pool is unpinned and pinned again around it. Imports without
SGLang (``HiCacheStorage`` is the base class only where SGLang is installed). docs/sglang.md has
the layouts, what a key covers, and what is verified where.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import logging
import mmap
import os
import uuid
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from lmshm.integrations.adapter import KEY_BYTES, Link, LinkConfig, Namespace
from lmshm.platform.cpu import segments

try:  # SGLang's loader checks issubclass(cls, HiCacheStorage)
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage as _Base
except ImportError:  # pragma: no cover - exercised where SGLang is not installed
    _Base = object

logger = logging.getLogger("lmshm.sglang")

#: extra-config keys this backend reads (``--hicache-storage-backend-extra-config``); SGLang's own
#: keys (the loader's, the allocator) pass through.
CONFIG_KEYS = {
    "lmshm.url": str,
    "lmshm.salt": str,
    "lmshm.timeout_s": (int, float),
    "lmshm.lookup_timeout_s": (int, float),
    "lmshm.retry_s": (int, float),
    "lmshm.connect_timeout_s": (int, float),
}
SGLANG_KEYS = {"backend_name", "module_path", "class_name", "interface_v1", "interface_v2", "allocator",
               "tp_lcm_size"}


class PoolNotRegistrable(ValueError):
    """SGLang's host pool cannot be shared with lmshm-server; the message says which setting to use."""


# ---- the host pool's pages as lmshm blocks -------------------------------------------------


@dataclass(frozen=True)
class Region:
    """One kind of region of every page: page ``p``'s bytes are at ``offset + p * size``."""

    offset: int
    size: int


def page_regions(pool: Any) -> list[Region]:
    """The regions ``pool.get_page_buffer_meta`` gives each page, checked to be dense runs over
    all pages (page ``p`` of region ``j`` right after page ``p - 1``) inside the pool's buffer."""
    buf = pool.kv_buffer
    base, nbytes = buf.data_ptr(), buf.numel() * buf.element_size()
    ps, pages = pool.page_size, pool.size // pool.page_size
    if pages < 2:
        raise PoolNotRegistrable(f"SGLang's host pool has {pages} page(s); lmshm needs at least 2")
    ptrs, sizes = pool.get_page_buffer_meta(torch.arange(2 * ps, dtype=torch.int64))
    n = len(ptrs) // 2
    if n == 0 or len(ptrs) != 2 * n or len(sizes) != len(ptrs):
        raise PoolNotRegistrable(f"{type(pool).__name__}.get_page_buffer_meta gave {len(ptrs)} regions for "
                                 "2 pages; lmshm expects the same number per page")
    regions = []
    for j in range(n):
        off, size = int(ptrs[j]) - base, int(sizes[j])
        if int(ptrs[n + j]) - int(ptrs[j]) != size or sizes[n + j] != size:
            raise PoolNotRegistrable(
                f"{type(pool).__name__} (layout {pool.layout!r}): region {j} of page 1 is not right after page "
                f"0's ({int(ptrs[n + j]) - int(ptrs[j])} bytes apart, {size} bytes long); lmshm registers each "
                "region as a dense run over all pages")
        if off < 0 or off + pages * size > nbytes:
            raise PoolNotRegistrable(f"region {j} of {type(pool).__name__} lies outside its kv_buffer")
        regions.append(Region(off, size))
    return regions


def page_ids(host_indices: torch.Tensor, page_size: int, pages: int) -> list[int]:
    """The host pages of ``host_indices`` (token slots, ``pages * page_size`` of them), or
    ``ValueError`` when they are not whole, aligned pages."""
    idx = host_indices.reshape(-1)
    if idx.numel() != pages * page_size:
        raise ValueError(f"{idx.numel()} host slots for {pages} pages of {page_size}")
    first = idx[::page_size]
    want = (first // page_size * page_size).repeat_interleave(page_size) + \
        torch.arange(page_size, dtype=idx.dtype).repeat(pages)
    if not torch.equal(idx.to(torch.int64), want.to(torch.int64)):
        raise ValueError("host slots are not whole, aligned pages")
    return (first // page_size).tolist()


# ---- re-backing SGLang's memfd pool with a sealed lmshm memfd --------------------------------

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
_MAP_FIXED = 0x10
_FALLOC_PUNCH = 0x01 | 0x02        # FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE

NOT_SHARED_HINT = ('start SGLang with "allocator": "shm" in --hicache-storage-backend-extra-config, e.g. '
                   '\'{"backend_name": "lmshm", "module_path": "lmshm.integrations.sglang", '
                   '"class_name": "LmshmHiCacheStorage", "interface_v1": 1, "allocator": "shm"}\'')


def reback_pool(pool: Any) -> tuple[Any, torch.Tensor]:
    """Move SGLang's memfd host pool into a sealed lmshm memfd at the same addresses; return the
    segment and a uint8 tensor over it (this process's own second mapping, which is what gets
    registered). See the module docstring."""
    buf = pool.kv_buffer
    if not isinstance(buf, torch.Tensor) or buf.device.type != "cpu" or not buf.is_contiguous():
        raise PoolNotRegistrable(f"{type(pool).__name__}.kv_buffer is not one contiguous CPU tensor; lmshm "
                                 "registers MHA and MLA host pools only")
    fd = getattr(pool, "fd", None)
    ptr, nbytes = buf.data_ptr(), buf.numel() * buf.element_size()
    if fd is None:
        raise PoolNotRegistrable("SGLang's HiCache host pool is private memory (the default allocator), which "
                                 "lmshm-server cannot map: " + NOT_SHARED_HINT)
    if ptr % mmap.PAGESIZE:
        raise PoolNotRegistrable(f"SGLang's host pool at {ptr:#x} does not start on a page; lmshm can share "
                                 "only a page-aligned pool: " + NOT_SHARED_HINT)
    length = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
    if os.fstat(fd).st_size < length:
        raise PoolNotRegistrable(f"SGLang's host pool memfd has {os.fstat(fd).st_size} bytes, the pool needs "
                                 f"{length}")
    pinned = _pinned_ranges(pool, buf)
    seg, u8 = segments.create_segment(length, "memfd")
    try:
        u8[:nbytes].copy_(buf.view(-1).view(torch.uint8))
        _unpin(pinned)
        got = _libc.mmap(ptr, length, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | _MAP_FIXED, seg.fd, 0)
        if got != ptr:
            err = ctypes.get_errno()
            raise OSError(err, f"mapping lmshm's memfd over SGLang's host pool at {ptr:#x} failed: "
                               f"{os.strerror(err)}")
        _repin(pinned)
    except BaseException:
        seg.unlink()
        raise
    # SGLang's memfd is no longer mapped by anyone: give its pages back (it keeps its size).
    if _libc.fallocate(fd, _FALLOC_PUNCH, 0, length) != 0:
        logger.debug("lmshm: releasing the pages of SGLang's old host pool failed (errno %d)", ctypes.get_errno())
    return seg, u8


def _pinned_ranges(pool: Any, buf: torch.Tensor) -> list[tuple[int, int]]:
    if not getattr(pool, "pin_memory", False) or not torch.cuda.is_available():
        return []
    # SGLang records the ranges it cudaHostRegister'ed on the buffer (pool_host/common.py); an
    # older SGLang registered the whole buffer in one call.
    ranges = getattr(buf, "_sglang_cuda_host_registered_ranges", None)
    return list(ranges) if ranges else [(buf.data_ptr(), buf.numel() * buf.element_size())]


def _unpin(ranges: list[tuple[int, int]]) -> None:
    for ptr, _size in ranges:
        rc = int(torch.cuda.cudart().cudaHostUnregister(ptr))
        if rc != 0:
            raise OSError(errno.EINVAL, f"cudaHostUnregister({ptr:#x}) failed ({rc}) before re-backing the pool")


def _repin(ranges: list[tuple[int, int]]) -> None:
    for ptr, size in ranges:
        rc = int(torch.cuda.cudart().cudaHostRegister(ptr, size, 0))
        if rc != 0:
            raise OSError(errno.EINVAL, f"cudaHostRegister({ptr:#x}, {size}) failed ({rc}) after re-backing "
                                        "the pool")


# ---- the backend ---------------------------------------------------------------------------


def _layout_fingerprint(pool: Any, regions: Sequence[Region], config: Any) -> str:
    geometry = {k: getattr(pool, k) for k in ("layer_num", "head_num", "head_dim", "kv_lora_rank",
                                              "qk_rope_head_dim", "start_layer", "end_layer")
                if isinstance(getattr(pool, k, None), int)}
    parts = [f"sglang-hicache:{type(pool).__name__}", f"layout={pool.layout}", f"page_size={pool.page_size}",
             f"dtype={pool.dtype}", f"geometry={sorted(geometry.items())}",
             f"regions={[(r.offset // max(1, pool.size // pool.page_size), r.size) for r in regions]}",
             f"pp={config.pp_rank}/{config.pp_size}",
             f"cp={getattr(config, 'attn_cp_rank', 0)}/{getattr(config, 'attn_cp_size', 1)}"]
    return ";".join(parts)


def _read_config(extra: dict) -> dict:
    unknown = [k for k in extra if k.startswith("lmshm.") and k not in CONFIG_KEYS]
    if unknown:
        raise ValueError(f"unknown lmshm key(s) {unknown} in --hicache-storage-backend-extra-config; known: "
                         f"{sorted(CONFIG_KEYS)}")
    out = {}
    for k, types in CONFIG_KEYS.items():
        if k in extra:
            v = extra[k]
            if not isinstance(v, types) or isinstance(v, bool):
                raise ValueError(f"{k} must be {types}, got {v!r}")
            out[k] = v
    return out


class LmshmHiCacheStorage(_Base):
    """SGLang HiCache storage backend over lmshm-server (see the module docstring).

    Loaded by SGLang's ``dynamic`` factory as ``cls(storage_config, kwargs)``."""

    def __init__(self, storage_config: Any, kwargs: Optional[dict] = None, *, link: Optional[Link] = None) -> None:
        self.config = storage_config
        extra = dict(getattr(storage_config, "extra_config", None) or {})
        opts = _read_config(extra)
        self.is_mla = bool(getattr(storage_config, "is_mla_model", False))
        self.tp_rank, self.tp_size = int(storage_config.tp_rank), int(storage_config.tp_size)
        self.model = getattr(storage_config, "model_name", None) or ""
        self.salt = opts.get("lmshm.salt", "")
        rank = f"tp{self.tp_rank}-pp{storage_config.pp_rank}"
        self.link = link or Link(LinkConfig(
            url=opts.get("lmshm.url"), client_name=f"sglang-{rank}",
            timeout_s=float(opts.get("lmshm.timeout_s", 5.0)),
            lookup_timeout_s=float(opts.get("lmshm.lookup_timeout_s", 1.0)),
            retry_s=float(opts.get("lmshm.retry_s", 5.0))))
        self._connect_timeout_s = float(opts.get("lmshm.connect_timeout_s", 5.0))
        self.mem_pool_host: Any = None
        self.page_size = 0
        self._ns = b""
        self._segment: Any = None
        self._u8: Optional[torch.Tensor] = None
        self.stats = {"exists": 0, "hits": 0, "set_pages": 0, "stored_pages": 0, "get_pages": 0,
                      "loaded_pages": 0, "failures": 0}

    # ---- registration -------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Share SGLang's host pool with lmshm-server (now, or once the server answers)."""
        pool = mem_pool_host
        regions = page_regions(pool)
        seg, u8 = reback_pool(pool)
        self.mem_pool_host, self._segment, self._u8 = pool, seg, u8
        self.page_size = pool.page_size
        pages = pool.size // pool.page_size
        world, rank = (1, 0) if self.is_mla else (self.tp_size, self.tp_rank)
        ns = Namespace(self.model, str(pool.dtype), _layout_fingerprint(pool, regions, self.config),
                       world_size=world, rank=rank, chunk_tokens=pool.page_size, salt=self.salt)
        self._ns = ns.digest
        views = {f"region{j}": u8[r.offset:r.offset + pages * r.size].view(pages, r.size)
                 for j, r in enumerate(regions)}
        iid = (f"sglang-{self.model.replace('/', '-')[:40]}-tp{self.tp_rank}-pp{self.config.pp_rank}-"
               f"{os.getpid()}-{uuid.uuid4().hex[:8]}")
        self.link.register(views, model_name=self.model, world_size=world, rank=rank, instance_id=iid)
        self.link.wait_connected(self._connect_timeout_s)
        logger.info("lmshm: SGLang host pool (%s, layout %s, %d pages, %d region(s) a page) shared with "
                    "lmshm-server", type(pool).__name__, pool.layout, pages, len(regions))

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        if str(host_pool_name) in ("kv", "PoolName.KV") or getattr(host_pool_name, "value", None) == "kv":
            self.register_mem_pool_host(host_pool)
        else:
            logger.warning("lmshm: SGLang pool %r is not stored by lmshm (KV pools only)", str(host_pool_name))

    # ---- keys ---------------------------------------------------------------------------
    def lmshm_keys(self, keys: Sequence[str]) -> list[bytes]:
        ns = self._ns
        return [hashlib.blake2b(ns + b"\x1fsglang\x1f" + str(k).encode(), digest_size=KEY_BYTES).digest()
                for k in keys]

    # ---- the v1 interface ---------------------------------------------------------------
    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        if not keys or not self._ns:
            return 0
        self.stats["exists"] += 1
        hits, lease = self.link.lookup([self.lmshm_keys(keys)])
        self.link.release(lease)
        self.stats["hits"] += hits
        return hits

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        n = len(keys)
        if not n:
            return []
        self.stats["set_pages"] += n
        try:
            ids = page_ids(host_indices, self.page_size, n)
        except ValueError as exc:
            logger.warning("lmshm: batch_set_v1: %s; nothing stored", exc)
            return [False] * n
        p = self.link.store(self.lmshm_keys(keys), ids, 1)
        reply = self.link.outcome("store", p) if p is not None else None
        if reply is None:
            self.stats["failures"] += 1
            return [False] * n
        ok = [r in (0, 1) for r in reply.results]     # STORED, PRESENT; NO_SPACE is a miss
        self.stats["stored_pages"] += sum(ok)
        return ok

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        n = len(keys)
        if not n:
            return []
        self.stats["get_pages"] += n
        try:
            ids = page_ids(host_indices, self.page_size, n)
        except ValueError as exc:
            logger.warning("lmshm: batch_get_v1: %s; nothing loaded", exc)
            return [False] * n
        lkeys = self.lmshm_keys(keys)
        if self._retrieve(lkeys, ids):
            self.stats["loaded_pages"] += n
            return [True] * n
        # All or nothing failed (a page evicted since batch_exists, the server away): load the
        # leading pages the server still holds, pinned under a lease so they stay until copied.
        hits, lease = self.link.lookup([lkeys])
        if hits and self._retrieve(lkeys[:hits], ids[:hits], lease):
            self.stats["loaded_pages"] += hits
            return [True] * hits + [False] * (n - hits)
        self.link.release(lease)
        self.stats["failures"] += 1
        return [False] * n

    def _retrieve(self, keys: list[bytes], ids: list[int], lease: bytes = b"") -> bool:
        p = self.link.retrieve(keys, ids, 1, lease)
        return p is not None and self.link.outcome("retrieve", p) is not None

    # ---- the pre-v1 interface: not served (the controller uses v1 with interface_v1) ----------
    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        return None

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> list:
        return [None] * len(keys)

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return False

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        return False

    def clear(self) -> None:
        """SGLang's "clear storage": lmshm's pool is shared with other engines; nothing is dropped."""

    def get_stats(self) -> Any:
        return None

    def close(self) -> None:
        """Unregister and disconnect (the server also reclaims on process exit)."""
        self.link.close()
