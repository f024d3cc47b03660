"""Drives SGLang's own HiCache code (in .venv-sglang) against a real lmshm-server.

Run as ``.venv-sglang/bin/python sglang_driver.py SCENARIO JSON``; prints one JSON line of
results. Nothing here stands in for SGLang except what needs a GPU: SGLang's device pools run
on ``device="cpu"`` and its host pools with ``pin_memory=False`` (pinning needs CUDA). Each
scenario builds SGLang's device and host pools, a real ``HiCacheController`` that loads
``lmshm.integrations.sglang.LmshmHiCacheStorage`` through SGLang's ``dynamic`` factory, and
moves pages through the controller's backup thread and its prefetch code.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import torch

STANDINS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sglang_standins")


def _install_standins() -> None:
    """Named stand-ins (GPU-only or CUDA-only pieces), see each module's docstring."""
    from transformers.utils import import_utils

    assert not import_utils.is_torchvision_available()   # decided (and cached) before the stand-in
    sys.path.append(STANDINS)


_install_standins()

MODULE = "lmshm.integrations.sglang"


def extra_config(url: str, **more) -> dict:
    return {"backend_name": "lmshm", "module_path": MODULE, "class_name": "LmshmHiCacheStorage",
            "interface_v1": 1, "allocator": "shm", "lmshm.url": url, **more}


def build(kind: str, layout: str, page_size: int, pages: int, url: str, model: str = "tiny",
          extra: dict | None = None, tp_rank: int = 0, tp_size: int = 1, tp_group=None, dtype=torch.bfloat16,
          allocator: str = "shm"):
    from sglang.srt.managers.cache_controller import HiCacheController
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.runtime_context import get_parallel
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    cfg = extra_config(url, **(extra or {}))
    if allocator != "shm":
        cfg.pop("allocator")
    args = ServerArgs(model_path="dummy", page_size=page_size, hicache_storage_backend="dynamic",
                      hicache_storage_backend_extra_config=json.dumps(cfg))
    set_global_server_args_for_scheduler(args)
    size = pages * page_size
    if kind == "mha":
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
        from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

        dev = MHATokenToKVPool(size, page_size, dtype, head_num=2, head_dim=16, layer_num=3, device="cpu",
                               enable_memory_saver=False, start_layer=0, end_layer=2)
        host = MHATokenToKVPoolHost(dev._mha_buffer_info(), 1.0, 0, page_size, layout, pin_memory=False,
                                    device="cpu", allocator_type=allocator, device_capacity_tokens=size,
                                    start_layer=0, end_layer=2)
    else:
        from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
        from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

        dev = MLATokenToKVPool(size, page_size, dtype, kv_lora_rank=32, qk_rope_head_dim=8, layer_num=3,
                               device="cpu", enable_memory_saver=False, start_layer=0, end_layer=2)
        host = MLATokenToKVPoolHost(dev._mla_buffer_info(), 1.0, 0, page_size, layout, pin_memory=False,
                                    device="cpu", allocator_type="shm", device_capacity_tokens=size,
                                    start_layer=0, end_layer=2, target_layer_num=3)
    alloc = PagedTokenToKVPoolAllocator(size, page_size, dtype, "cpu", dev, need_sort=False)
    override = get_parallel().override(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1,
                                       attn_tp_rank=tp_rank, attn_tp_size=tp_size, moe_tp_rank=tp_rank,
                                       moe_tp_size=tp_size)
    override.__enter__()
    ctrl = HiCacheController(alloc, host, page_size, tp_group, threading.Event(), io_backend="direct",
                             storage_backend="dynamic", model_name=model, storage_backend_extra_config=dict(cfg))
    return ctrl, host


# ---- pages: deterministic bytes, written into and read out of SGLang's host pool ----------

import ctypes


def page_bytes(host, page: int) -> bytes:
    """A host page's bytes, region by region, as ``get_page_buffer_meta`` describes them."""
    ps = host.page_size
    ptrs, sizes = host.get_page_buffer_meta(torch.arange(page * ps, (page + 1) * ps, dtype=torch.int64))
    return b"".join(ctypes.string_at(p, n) for p, n in zip(ptrs, sizes))


def fill_page(host, page: int, seed: int) -> bytes:
    ps = host.page_size
    ptrs, sizes = host.get_page_buffer_meta(torch.arange(page * ps, (page + 1) * ps, dtype=torch.int64))
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (sum(sizes),), dtype=torch.uint8, generator=g).numpy().tobytes()
    at = 0
    for p, n in zip(ptrs, sizes):
        ctypes.memmove(p, data[at:at + n], n)
        at += n
    return data


def keys_for(tokens, page_size, salt=None):
    from sglang.srt.mem_cache.utils import get_storage_hash_str, storage_namespace_seed

    return get_storage_hash_str(list(tokens), storage_namespace_seed(None, salt), page_size=page_size)


def backup(ctrl, host, tokens, keys, seed, timeout_s=20.0):
    """Fill fresh host pages, back them up through the controller's backup thread."""
    ps = host.page_size
    n = len(keys)
    idx = host.alloc(n * ps)
    pages = (idx[::ps] // ps).tolist()
    expect = [fill_page(host, p, seed * 1000 + i) for i, p in enumerate(pages)]
    op_id = ctrl.write_storage(idx, list(tokens[:n * ps]), hash_value=list(keys))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            op = ctrl.ack_backup_queue.get(timeout=0.5)
        except Exception:
            continue
        if op.id == op_id:
            host.free(idx)
            return op.completed_tokens // ps, expect
    raise TimeoutError("backup did not finish")


def prefetch(ctrl, host, tokens, salt=None, rid="r"):
    """SGLang's prefetch path: its hit query (batch_exists), then its page transfer (batch_get_v1)
    into freshly allocated host pages; returns (hit pages, loaded pages, their bytes)."""
    from sglang.srt.managers.cache_controller import PrefetchOperation
    from sglang.srt.mem_cache.utils import storage_namespace_seed

    ps = host.page_size
    op = PrefetchOperation(rid, list(tokens), last_hash=storage_namespace_seed(None, salt))
    hash_value, hit_tokens = ctrl._storage_hit_query(op)
    hits = hit_tokens // ps
    if not hits:
        return 0, 0, []
    idx = host.alloc(hits * ps)
    ptrs, sizes = host.get_page_buffer_meta(idx)   # the pages start as zeros: one not loaded stays so
    for p, n in zip(ptrs, sizes):
        ctypes.memset(p, 0, n)
    op.hash_value, op.host_indices = hash_value[:hits], idx
    loaded = ctrl._page_transfer(op)
    got = [page_bytes(host, p) for p in (idx[::ps] // ps).tolist()]
    host.free(idx)
    return hits, loaded, got


def digest(chunks) -> list[str]:
    import hashlib

    return [hashlib.sha256(c).hexdigest()[:16] for c in chunks]


def tokens_of(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 30000, (n,), generator=g).tolist()


def scenario_roundtrip(a: dict) -> dict:
    """Back up N pages, then prefetch N + 2 pages (partial hit): byte-exact pages back."""
    ctrl, host = build(a["kind"], a["layout"], a.get("page_size", 4), a.get("pool_pages", 64), a["url"])
    ps, n = host.page_size, a.get("pages", 5)
    toks = tokens_of(a.get("seed", 1), (n + 2) * ps)
    keys = keys_for(toks, ps)
    stored, expect = backup(ctrl, host, toks, keys[:n], a.get("seed", 1))
    stored_again, _ = backup(ctrl, host, toks, keys[:n], a.get("seed", 1))   # the same keys twice
    hits, loaded, got = prefetch(ctrl, host, toks)
    backend = ctrl.storage_backend
    return {"stored": stored, "stored_again": stored_again, "hits": hits, "loaded": loaded,
            "exact": got == expect[:loaded], "n": n, "backend": type(backend).__name__,
            "regions": len(host.get_page_buffer_meta(torch.arange(ps))[0]),
            "fresh_miss": prefetch(ctrl, host, tokens_of(999, 3 * ps))[0]}


def scenario_not_shared(a: dict) -> dict:
    """SGLang's default host allocator: the engine stops at start with the setting to use."""
    try:
        build("mha", "page_first", 4, 16, a["url"], allocator="default")
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"error": None}


def scenario_dead_server(a: dict) -> dict:
    """lmshm-server is not there: backups and prefetches cost misses, quickly, never an error."""
    t0 = time.monotonic()
    ctrl, host = build("mha", "page_first", 4, 64, a["url"], extra={"lmshm.connect_timeout_s": 1})
    start_s = time.monotonic() - t0
    ps = host.page_size
    toks = tokens_of(3, 4 * ps)
    keys = keys_for(toks, ps)    # before the clock: the first hash JIT-compiles SGLang's helper
    t0 = time.monotonic()
    stored, _ = backup(ctrl, host, toks, keys, 3)
    backup_s = time.monotonic() - t0
    hits, loaded, _ = prefetch(ctrl, host, toks)
    return {"start_s": start_s, "backup_s": backup_s, "ops_s": time.monotonic() - t0, "stored": stored,
            "hits": hits, "loaded": loaded}


def scenario_failures(a: dict) -> dict:
    """SGLang's failure injection wraps the backend: every page loaded equals what was stored."""
    ctrl, host = build(a["kind"], a["layout"], 4, 256, a["url"])
    ps, rounds, n = host.page_size, a.get("rounds", 6), 6
    out = {"backend": type(ctrl.storage_backend).__name__, "stored": 0, "loaded": 0, "bad": 0, "partial": 0}
    for r in range(rounds):
        toks = tokens_of(100 + r, n * ps)
        keys = keys_for(toks, ps)
        stored, expect = backup(ctrl, host, toks, keys, 100 + r)
        out["stored"] += stored
        hits, loaded, got = prefetch(ctrl, host, toks, rid=f"r{r}")
        out["loaded"] += loaded
        out["partial"] += int(0 < loaded < n)
        out["bad"] += sum(1 for i in range(loaded) if got[i] != expect[i])
    return out


def scenario_store(a: dict) -> dict:
    """One instance: back up a prompt's pages (model, salt, rank as given)."""
    ctrl, host = build(a["kind"], a["layout"], 4, 64, a["url"], model=a.get("model", "tiny"),
                       tp_rank=a.get("tp_rank", 0), tp_size=a.get("tp_size", 1))
    ps = host.page_size
    toks = tokens_of(a.get("seed", 7), a.get("pages", 6) * ps)
    keys = keys_for(toks, ps, a.get("salt"))
    stored, expect = backup(ctrl, host, toks, keys, a.get("fill", 7))
    return {"stored": stored, "digests": digest(expect), "keys": [k[:16] for k in keys]}


def scenario_load(a: dict) -> dict:
    """Another instance: prefetch the same prompt (model, salt, rank as given)."""
    ctrl, host = build(a["kind"], a["layout"], 4, 64, a["url"], model=a.get("model", "tiny"),
                       tp_rank=a.get("tp_rank", 0), tp_size=a.get("tp_size", 1))
    ps = host.page_size
    toks = tokens_of(a.get("seed", 7), a.get("pages", 6) * ps)
    hits, loaded, got = prefetch(ctrl, host, toks, a.get("salt"))
    return {"hits": hits, "loaded": loaded, "digests": digest(got)}


def scenario_tp(a: dict) -> dict:
    """One rank of TP=2 over gloo (torch.distributed, the controller's own hit all-reduce).

    Prompt Q is backed up by rank 0 only: the hit query, all-reduced (MIN) across ranks, must be
    0 on both -- rank 1 finds none of its keys, and rank 0's pages are not its. Prompt P is backed
    up by both ranks with different bytes; each loads P through the controller's page getter and
    must get its own bytes."""
    import torch.distributed as dist
    from sglang.srt.managers.cache_controller import PrefetchOperation

    rank, world = a["rank"], 2
    dist.init_process_group("gloo", init_method=f"file://{a['rendezvous']}", rank=rank, world_size=world)
    ctrl, host = build("mha", "page_first", 4, 64, a["url"], tp_rank=rank, tp_size=world,
                       tp_group=dist.group.WORLD)
    ps, n = host.page_size, 4
    out = {"rank": rank}
    q = tokens_of(31, n * ps)
    if rank == 0:
        out["q_stored"], _ = backup(ctrl, host, q, keys_for(q, ps), 3100)
    dist.barrier()
    p = tokens_of(32, n * ps)
    pkeys = keys_for(p, ps)
    out["p_stored"], expect = backup(ctrl, host, p, pkeys, 3200 + rank)
    out["p_keys"] = [k[:16] for k in pkeys]
    out["stored_digests"] = digest(expect)
    dist.barrier()
    for name, toks in (("q", q), ("p", p)):
        op = PrefetchOperation(f"{name}-{rank}", list(toks))
        hashes, hit_tokens = ctrl._storage_hit_query(op)
        out[f"{name}_own_hits"] = hit_tokens // ps
        out[f"{name}_hits"] = ctrl._sync_prefetch_hit_query(op, hit_tokens) // ps
    hits = out["p_hits"]
    idx = host.alloc(hits * ps)
    ptrs, sizes = host.get_page_buffer_meta(idx)
    for ptr, size in zip(ptrs, sizes):
        ctypes.memset(ptr, 0, size)
    op = PrefetchOperation(f"p-load-{rank}", list(p))
    out["p_loaded"] = ctrl.page_get_func(op, pkeys[:hits], idx, None)
    out["loaded_digests"] = digest(page_bytes(host, pg) for pg in (idx[::ps] // ps).tolist())
    dist.barrier()
    return out


# ---- two SGLang instances with SGLang's own radix cache (its in-wheel unified-radix-cache kit) ----


def _kit(url: str, salt_cfg: dict):
    """A test-kit object (``UnifiedRadixCacheStorageFixtures``) whose HiCache uses lmshm."""
    import unittest

    from sglang.srt.runtime_context import get_parallel
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler
    from sglang.test.kits.unified_radix_cache.config import CacheConfig
    from sglang.test.kits.unified_radix_cache.storage import UnifiedRadixCacheStorageFixtures

    class Kit(UnifiedRadixCacheStorageFixtures, unittest.TestCase):
        cfg = CacheConfig(page_size=4, num_layers=2, full_attention_layer_ids=(0, 1), kv_size=256, head_dim=32)
        _rid = 0

        def runTest(self):
            pass

        def _init_hicache(self, cache, **_ignored):
            """The kit's set-up with storage "dynamic" (the kit wires "file" only)."""
            args = ServerArgs(model_path="dummy", page_size=self.cfg.page_size, hicache_io_backend="direct",
                              hicache_mem_layout="page_first_direct", hicache_write_policy="write_through",
                              hicache_storage_backend="dynamic",
                              hicache_storage_backend_extra_config=json.dumps(
                                  extra_config(url, prefetch_threshold=1, **salt_cfg)),
                              hicache_storage_prefetch_policy="wait_complete")
            set_global_server_args_for_scheduler(args)
            get_parallel().override_permanently(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1)
            import sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler as assembler

            original = assembler.get_mha_host_pool_cls

            def unpinned(device_pool):   # STAND-IN: pinning needs CUDA; the host pool is left unpinned
                cls = original(device_pool)
                return lambda *args, **kw: cls(*args, **{**kw, "pin_memory": False})

            assembler.get_mha_host_pool_cls = unpinned
            try:
                cache.init_hicache(args, cache.cache_init_params)
            finally:
                assembler.get_mha_host_pool_cls = original
            cache.write_through_threshold = 1 << 30
            cache.load_back_threshold = 0
            cache.cache_controller.prefetch_threshold = 1
            cache.cache_controller.prefetch_capacity_limit = max(
                cache.cache_controller.prefetch_capacity_limit, cache.cache_controller.mem_pool_host.size)

    import sglang.srt.mem_cache.pool_host.mha as mha
    import sglang.test.kits.unified_radix_cache.fixtures as fixtures

    mha.transfer_kv_all_layer_direct_lf_pf = standin_device_to_host
    mha.transfer_kv_per_layer_direct_pf_lf = standin_host_to_device

    fixtures.get_device = lambda *a: "cpu"   # STAND-IN: the kit asks for an accelerator; its pools run on CPU
    return Kit()


def standin_device_to_host(src_ptrs, dst_ptrs, src_indices, dst_indices, page_size):
    """STAND-IN for sgl_kernel's ``transfer_kv_all_layer_direct_lf_pf`` (a GPU kernel): every
    layer's device rows ``src_indices`` into the page-first-direct host buffers
    (``[pages, layers, page_size, ...]``) at token slots ``dst_indices``. ``src_ptrs`` holds
    each host buffer's layers in turn (K layers, then V layers)."""
    layers = len(src_ptrs) // len(dst_ptrs)
    pages, slots = dst_indices // page_size, dst_indices % page_size
    for j, host in enumerate(dst_ptrs):
        for layer in range(layers):
            host[pages, layer, slots] = src_ptrs[j * layers + layer][src_indices].to(host.dtype)


def standin_host_to_device(src_ptrs, dst_ptrs, src_indices, dst_indices, layer_id, page_size):
    """STAND-IN for sgl_kernel's ``transfer_kv_per_layer_direct_pf_lf`` (a GPU kernel): one
    layer's host rows back into the device buffers."""
    pages, slots = src_indices // page_size, src_indices % page_size
    for host, dev in zip(src_ptrs, dst_ptrs):
        dev[dst_indices] = host[pages, layer_id, slots].to(dev.dtype)


def _device_kv(kit, allocator, indices) -> list[bytes]:
    pool = kit._get_full_kv_pool(allocator)
    return [bytes(pool.get_key_buffer(layer)[indices].contiguous().view(torch.uint8).numpy().tobytes()) +
            bytes(pool.get_value_buffer(layer)[indices].contiguous().view(torch.uint8).numpy().tobytes())
            for layer in range(pool.start_layer, pool.start_layer + pool.layer_num)]


def scenario_kit_produce(a: dict) -> dict:
    """Instance 1: insert a prompt into SGLang's radix cache, fill its device KV with random
    bytes, back it up to host and then to L3 (lmshm) through the tree cache's own calls."""
    from sglang.test.kits.unified_radix_cache.fixtures import build_fixture, match_prefix

    kit = _kit(a["url"], a.get("extra", {}))
    cache, alloc, rtp = build_fixture(kit.cfg)
    kit._init_hicache(cache)
    seq = tokens_of(a.get("seed", 5), a.get("pages", 6) * kit.cfg.page_size)
    kit._insert(cache, alloc, rtp, seq)
    leaf = match_prefix(cache, seq).last_device_node
    indices = cache.path_device_indices(leaf)
    pool = kit._get_full_kv_pool(alloc)
    g = torch.Generator().manual_seed(a.get("seed", 5))
    for layer in range(pool.start_layer, pool.start_layer + pool.layer_num):
        for buf in (pool.get_key_buffer(layer), pool.get_value_buffer(layer)):
            buf[indices] = torch.randn(buf[indices].shape, generator=g).to(buf.dtype)
    expected = _device_kv(kit, alloc, indices)
    kit._backup_node(cache, leaf)
    kit._write_path_to_l3(cache, leaf)
    kit._flush_l3_backups(cache)
    return {"digests": digest(expected), "tokens": len(seq),
            "stats": getattr(cache.cache_controller.storage_backend, "stats", None)}


def scenario_kit_consume(a: dict) -> dict:
    """Instance 2: a fresh radix cache prefetches the prompt from L3 (lmshm), then loads it back
    to its device pool; returns the device KV it got."""
    from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle
    from sglang.test.kits.unified_radix_cache.fixtures import build_fixture, match_prefix

    kit = _kit(a["url"], a.get("extra", {}))
    cache, alloc, rtp = build_fixture(kit.cfg)
    kit._init_hicache(cache)
    seq = tokens_of(a.get("seed", 5), a.get("pages", 6) * kit.cfg.page_size)
    before = match_prefix(cache, seq)
    kit._consume_prefetch(cache, seq, CacheRequestHandle("consumer", 0))
    m = match_prefix(cache, seq)
    host_hit = getattr(m, "host_hit_length", None)
    node = m.last_host_node if hasattr(m, "last_host_node") else None
    out = {"device_before": int(before.device_prefix_len), "host_before": int(before.host_hit_length),
           "host_hit": int(host_hit) if host_hit is not None else None,
           "stats": getattr(cache.cache_controller.storage_backend, "stats", None)}
    if node is not None and host_hit:
        device = kit._load_back_node(cache, node)
        out["loaded"] = int(len(device))
        out["digests"] = digest(_device_kv(kit, alloc, device))
    return out


if __name__ == "__main__":
    # argv[1]: a JSON list of steps, {"scenario": NAME, ...its arguments}, run in order in this one
    # process (SGLang's import costs seconds); one RESULT line with every step's result.
    steps = json.loads(sys.argv[1])
    results = [globals()[f"scenario_{step['scenario']}"](step) for step in steps]
    print("RESULT " + json.dumps(results), flush=True)
    os._exit(0)   # SGLang's storage threads are daemons; the server reclaims the registration
