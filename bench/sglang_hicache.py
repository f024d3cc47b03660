"""SGLang HiCache L3 throughput: lmshm's backend against a memcpy and SGLang's own ``HiCacheFile``.

    .venv/bin/python bench/sglang_hicache.py [--reps 9] [--page-size 16] [--layers 8] [--heads 8]
        [--head-dim 128] [--layout page_first] [--file-dir DIR]

Starts one lmshm-server (this checkout, this venv) and runs the measurement in ``.venv-sglang``
(``scripts/bootstrap-sglang``; ``$LMSHM_SGLANG_VENV`` elsewhere). There SGLang's own
``MHATokenToKVPoolHost`` (``"allocator": "shm"``, unpinned: no GPU here) holds two batches of
128 pages, and SGLang's ``StorageBackendFactory`` makes both backends: ``dynamic`` loading
``lmshm.integrations.sglang.LmshmHiCacheStorage``, and ``file`` (``HiCacheFile``, in
``--file-dir``, default a fresh directory under ``/tmp``). Each rep, in this order, timed in the
calling thread:

- memcpy: one ``ctypes.memmove`` of a batch's bytes between two touched buffers;
- lmshm (as the controller calls it with ``interface_v1``): ``batch_set_v1`` of 128 pages under
  fresh keys, ``batch_exists`` of them, ``batch_get_v1`` of them into the other 128 pages;
- HiCacheFile: the same, as SGLang's controller calls it (``HiCacheFile`` has no v1 calls: the
  controller's generic page functions copy each page flat, then ``batch_set`` / ``batch_get``).

Prints the medians, pages/s, GB/s and the memcpy median over each median ("x memcpy": above 1
is faster than the one-thread memcpy, which the server's copier threads can be, splitting a
request over cores), the load average before and after, and whether every page read back equals
the page written.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from _common import parse_args, skip, skip_slow

BATCH = 128


def inner(a: argparse.Namespace) -> None:
    """Runs in .venv-sglang."""
    import ctypes
    import time

    import torch

    sys.path.insert(0, str(ROOT / "tests" / "v1" / "integrations"))
    from types import SimpleNamespace

    import sglang_driver  # noqa: F401 - the named torchvision stand-in, before SGLang imports
    from sglang.srt.managers.cache_controller import HiCacheController, PrefetchOperation
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
    from sglang.srt.runtime_context import get_parallel
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    ps = a.page_size
    extra = {"backend_name": "lmshm", "module_path": "lmshm.integrations.sglang",
             "class_name": "LmshmHiCacheStorage", "interface_v1": 1, "allocator": "shm", "lmshm.url": a.url,
             "lmshm.timeout_s": 30}
    set_global_server_args_for_scheduler(ServerArgs(model_path="dummy", page_size=ps,
                                                    hicache_storage_backend="dynamic",
                                                    hicache_storage_backend_extra_config=json.dumps(extra)))
    get_parallel().override(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1).__enter__()
    size = 2 * BATCH * ps
    dev = MHATokenToKVPool(ps * 2, ps, torch.bfloat16, head_num=a.heads, head_dim=a.head_dim,
                           layer_num=a.layers, device="cpu", enable_memory_saver=False, start_layer=0,
                           end_layer=a.layers - 1)
    host = MHATokenToKVPoolHost(dev._mha_buffer_info(), 1.0, 0, ps, a.layout, pin_memory=False, device="cpu",
                                allocator_type="shm", device_capacity_tokens=size, start_layer=0,
                                end_layer=a.layers - 1, host_token_capacity=size + ps)
    host.kv_buffer.view(torch.uint8).random_(0, 256)

    def config(extra_config: dict) -> HiCacheStorageConfig:
        return HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                    is_mla_model=False, enable_storage_metrics=False,
                                    is_page_first_layout=a.layout == "page_first", model_name="bench",
                                    extra_config=extra_config)

    lmshm = StorageBackendFactory.create_backend("dynamic", config(dict(extra)), host)
    os.environ["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] = a.file_dir
    hfile = StorageBackendFactory.create_backend("file", config({}), host)
    for backend in (lmshm, hfile):
        if getattr(backend, "mem_pool_host", None) is not host:
            backend.register_mem_pool_host(host)

    # How SGLang's controller moves a batch with each backend: lmshm through the zero-copy v1
    # calls (interface_v1), HiCacheFile through the controller's generic page functions (it has no
    # v1 calls): a flat copy of each page, then the file (and back).
    def set_v1(backend, keys, idx):
        return all(backend.batch_set_v1(keys, idx))

    def get_v1(backend, keys, idx):
        return sum(backend.batch_get_v1(keys, idx))

    def set_generic(backend, keys, idx):
        return HiCacheController._generic_page_set(SimpleNamespace(storage_host_pool=host, page_size=ps,
                                                                   storage_backend=backend), keys, idx)

    def get_generic(backend, keys, idx):
        ctrl = SimpleNamespace(storage_host_pool=host, page_size=ps, storage_backend=backend)
        return HiCacheController._generic_page_get(ctrl, PrefetchOperation("bench", []), keys, idx)

    calls = {"lmshm": (lmshm, set_v1, get_v1), "file": (hfile, set_generic, get_generic)}
    src = torch.arange(ps, (BATCH + 1) * ps, dtype=torch.int64)             # pages 1..128
    dst = torch.arange((BATCH + 1) * ps, (2 * BATCH + 1) * ps, dtype=torch.int64)
    ptrs, sizes = host.get_page_buffer_meta(src)
    batch_bytes = sum(sizes)
    a_buf = torch.empty(batch_bytes, dtype=torch.uint8).fill_(1)
    b_buf = torch.empty(batch_bytes, dtype=torch.uint8).fill_(2)

    def pages(idx: torch.Tensor) -> list[bytes]:
        p, s = host.get_page_buffer_meta(idx)
        per = len(p) // BATCH
        return [b"".join(ctypes.string_at(p[i * per + j], s[i * per + j]) for j in range(per))
                for i in range(BATCH)]

    times: dict[str, list[float]] = {k: [] for k in ("memcpy", "lmshm set", "lmshm exists", "lmshm get",
                                                      "file set", "file exists", "file get")}
    ok = {"lmshm": True, "file": True}
    load0 = os.getloadavg()
    for rep in range(a.reps):
        t = time.perf_counter()
        ctypes.memmove(b_buf.data_ptr(), a_buf.data_ptr(), batch_bytes)
        times["memcpy"].append(time.perf_counter() - t)
        for name, (backend, put, fetch) in calls.items():
            keys = [f"{name}-{rep}-{i:04d}-{os.getpid()}" for i in range(BATCH)]
            t = time.perf_counter()
            res = put(backend, keys, src)
            times[f"{name} set"].append(time.perf_counter() - t)
            ok[name] &= bool(res)
            t = time.perf_counter()
            hits = backend.batch_exists(keys)
            times[f"{name} exists"].append(time.perf_counter() - t)
            ok[name] &= hits == BATCH
            for ptr, n in zip(*host.get_page_buffer_meta(dst)):   # the destination pages start as zeros
                ctypes.memset(ptr, 0, n)
            t = time.perf_counter()
            res = fetch(backend, keys, dst)
            times[f"{name} get"].append(time.perf_counter() - t)
            ok[name] &= res == BATCH
            if rep == a.reps - 1:
                ok[name] &= pages(src) == pages(dst)
    load1 = os.getloadavg()
    mem = statistics.median(times["memcpy"])
    print(f"SGLang HiCache L3, {BATCH}-page batches of {a.layout} MHA pages: page {ps} tokens x {a.layers} layers x "
          f"{a.heads} heads x {a.head_dim} bf16 = {sizes[0] * (len(sizes) // BATCH) / 2**10:.0f} KiB a page, "
          f"{batch_bytes / 2**20:.0f} MiB a batch; median of {a.reps} reps; load average "
          f"{load0[0]:.2f} -> {load1[0]:.2f}")
    print(f"{'operation':<14}{'median ms':>10}{'pages/s':>10}{'GB/s':>8}{'x memcpy':>10}")
    for k, v in times.items():
        m = statistics.median(v)
        moves = "exists" not in k
        print(f"{k:<14}{m * 1e3:>10.2f}{BATCH / m:>10.0f}" + (f"{batch_bytes / m / 1e9:>8.2f}{mem / m:>10.2f}"
                                                             if moves else f"{'-':>8}{'-':>10}"))
    print(f"read back equals written: lmshm {ok['lmshm']}, HiCacheFile {ok['file']}")
    lmshm.close()
    os._exit(0 if all(ok.values()) else 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--layout", default="page_first",
                   choices=["page_first", "page_first_direct", "page_head", "layer_first"])
    p.add_argument("--file-dir", default="")
    p.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--url", default="", help=argparse.SUPPRESS)
    a = parse_args(p, smoke={"reps": 1, "layers": 2, "heads": 2, "head_dim": 64})
    if a.inner:
        inner(a)
        return
    from _server import BenchServer

    venv = Path(os.environ.get("LMSHM_SGLANG_VENV", ROOT / ".venv-sglang"))
    if a.smoke:
        if not (venv / "bin" / "python").exists():
            skip(f"{venv} is missing (scripts/bootstrap-sglang)")
        skip_slow("SGLang's import and its HiCache controller in .venv-sglang: too long for a smoke run")
    batch_mib = 2 * BATCH * a.page_size * a.layers * a.heads * a.head_dim * 2 / 2**20
    with tempfile.TemporaryDirectory(prefix="hicache-file-") as file_dir, \
            BenchServer("--capacity", f"{int(3 * batch_mib) + 64}MiB", quiet=True) as server:
        scratch = Path(file_dir) / "scratch"
        env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "SGLANG_CACHE_DIR": str(scratch), "TRITON_CACHE_DIR": str(scratch / "triton")}
        args = [str(venv / "bin" / "python"), __file__, "--inner", "--url", server.url,
                "--file-dir", a.file_dir or str(Path(file_dir) / "store"), "--reps", str(a.reps),
                "--page-size", str(a.page_size), "--layers", str(a.layers), "--heads", str(a.heads),
                "--head-dim", str(a.head_dim), "--layout", a.layout]
        rc = subprocess.run(args, env=env, cwd=str(ROOT)).returncode
    sys.exit(rc)


if __name__ == "__main__":
    main()
