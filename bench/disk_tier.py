"""The disk tier's throughput, against ``dd`` with O_DIRECT on the same file system, in one run.

    .venv/bin/python bench/disk_tier.py [--dir /var/tmp] [--request-mib 256] [--reps 3]

Prints medians of:

1. checksums of one request's bytes in this process: CRC-32 (zlib), BLAKE2b-256 (hashlib),
   xxh3-128 (if the ``xxhash`` package is installed);
2. on files in ``--dir``: ``dd`` writing (``oflag=direct``, 4 MiB blocks) and reading
   (``iflag=direct``) a request's bytes; the tier's own file format written buffered (fsynced,
   and not: the fallback) and with O_DIRECT from a page-aligned buffer (what the tier does from
   a pool object), and read back cold (its pages dropped with ``posix_fadvise(DONTNEED)``
   first) buffered (``read_file``: what the tier does) and with O_DIRECT into a page-aligned
   buffer;
3. end to end, a real lmshm-server with ``--disk`` in ``--dir``, this process as the worker
   (32 layers x 16-block chunks of 32 MiB): write-through (from the STORE's send until STATUS
   counts the chunks written; the pool holds two requests and is filled by two untimed ones
   first, so the timed STOREs reuse warm pool pages), and LOOKUP (promotion from disk, cold,
   into a fresh server's pool) + RETRIEVE after a restart of the server on the same directory.

GB/s are 1e9 bytes per second. Nothing is left behind: the files are removed at the end.
"""

from __future__ import annotations

import argparse
import hashlib
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import zlib

sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402

from _server import BenchServer  # noqa: E402
from lmshm.core.tiers.base import ChunkMeta  # noqa: E402
from lmshm.core.tiers.disk import (CHECKSUMS, HEADER_BYTES, checksum_algorithm, direct_ok, read_file,  # noqa: E402
                                   write_file)
from lmshm.multiprocess.client import MPClient  # noqa: E402
from lmshm.platform.cpu import empty_shared  # noqa: E402

LAYERS, HEADS, TOKENS, DIM = 32, 8, 32, 128
BLOCK_LAYER_BYTES = HEADS * TOKENS * DIM * 2
CHUNK_BLOCKS = 16


def gbps(nbytes: int, seconds: list[float]) -> float:
    return nbytes / statistics.median(seconds) / 1e9


def timed(fn, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def drop_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def checksums(data: memoryview, reps: int) -> dict[str, float]:
    out = {"crc32": gbps(len(data), timed(lambda: zlib.crc32(data), reps)),
           "blake2b": gbps(len(data), timed(lambda: hashlib.blake2b(data, digest_size=32).digest(), reps))}
    try:
        import xxhash

        out["xxh3"] = gbps(len(data), timed(lambda: xxhash.xxh3_128_digest(data), reps))
    except ImportError:
        out["xxh3"] = float("nan")
    return out


def files(where: str, data: memoryview, reps: int) -> dict[str, float]:
    n = len(data)
    path = os.path.join(where, "chunk")
    ddfile = os.path.join(where, "dd")
    mib = n >> 20
    out: dict[str, float] = {}

    def dd(*args: str) -> None:
        subprocess.run(["dd", *args, "bs=4M", f"count={mib // 4}", "status=none"], check=True)

    out["dd write oflag=direct"] = gbps(n, timed(lambda: dd("if=/dev/zero", f"of={ddfile}", "oflag=direct"), reps))
    read_dd = []
    for _ in range(reps):
        drop_cache(ddfile)
        read_dd += timed(lambda: dd(f"if={ddfile}", "of=/dev/null", "iflag=direct"), 1)
    out["dd read iflag=direct"] = gbps(n, read_dd)

    meta = ChunkMeta(n, b"L" * 16, 16)
    algo = checksum_algorithm("auto")
    name = CHECKSUMS[algo][0]

    def write_synced() -> None:
        write_file(path, 0, b"k", meta, algo, data)
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)

    out[f"tier write buffered+fsync ({name})"] = gbps(n, timed(write_synced, reps))
    out[f"tier write buffered, no fsync ({name}; the fallback)"] = gbps(n, timed(
        lambda: write_file(path, 0, b"k", meta, algo, data), reps))
    pages = mmap.mmap(-1, n)                # page-aligned, as a pool object is with a disk tier
    pages[:] = data
    on_pages = memoryview(pages)
    assert direct_ok(on_pages)
    out[f"tier write O_DIRECT from the pages ({name}; what the tier does)"] = gbps(n, timed(
        lambda: write_file(path, 0, b"k", meta, algo, on_pages, direct=True), reps))
    on_pages.release()
    pages.close()
    dest = memoryview(bytearray(n))
    cold = []
    for _ in range(reps):
        drop_cache(path)
        cold += timed(lambda: read_file(path, 0, b"k", meta, dest), 1)
    out[f"tier read buffered, cold ({name} checked)"] = gbps(n, cold)
    out[f"tier read buffered, page cache ({name} checked)"] = gbps(n, timed(lambda: read_file(path, 0, b"k", meta,
                                                                                               dest), reps))
    aligned = mmap.mmap(-1, n)
    view = memoryview(aligned)
    direct = []
    for _ in range(reps):
        drop_cache(path)
        t0 = time.perf_counter()
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            done = 0
            while done < n:
                done += os.preadv(fd, [view[done:]], HEADER_BYTES + done)
        finally:
            os.close(fd)
        CHECKSUMS[algo][1](view)
        direct.append(time.perf_counter() - t0)
    out[f"O_DIRECT read into an aligned buffer, cold (+{name})"] = gbps(n, direct)
    view.release()
    aligned.close()
    for p in (path, ddfile):
        os.unlink(p)
    return out


def tier_status(client: MPClient) -> dict:
    t = client.status().pool.tiers[0]
    return {"puts": t.puts, "drops": t.drops, "promotions": t.promotions, "direct_writes": t.direct_writes}


def end_to_end(where: str, request_bytes: int, reps: int) -> dict[str, float]:
    chunk_bytes = LAYERS * CHUNK_BLOCKS * BLOCK_LAYER_BYTES
    chunks = request_bytes // chunk_bytes
    blocks = chunks * CHUNK_BLOCKS
    disk = os.path.join(where, "disk")
    os.mkdir(disk, 0o700)
    args = ("--capacity", str(2 * request_bytes + (64 << 20)), "--disk", disk,
            "--disk-capacity", str(8 * request_bytes * (reps + 2)), "--disk-timeout", "30", "--disk-queue", str(4 * chunks))
    kv_all = empty_shared((LAYERS, 2 * blocks, HEADS, TOKENS, DIM), torch.float16)
    kv_all.normal_()
    kv = {f"layer.{i}": kv_all[i] for i in range(LAYERS)}
    src, dst = list(range(blocks)), list(range(blocks, 2 * blocks))
    keysets = [[os.urandom(32) for _ in range(chunks)] for _ in range(reps)]
    out: dict[str, float] = {}
    write_through, store_only = [], []
    with BenchServer(*args, quiet=True) as server, MPClient(server.url, timeout_s=120) as client:
        iid = client.register_kv_caches(kv, "bench")
        # untimed: two requests fill the pool, so that the timed STOREs reuse warm pool pages
        # (evicting chunks already written through), as a server that has run a while does
        for _ in range(2):
            before = tier_status(client)["puts"]
            client.store(iid, [os.urandom(32) for _ in range(chunks)], src, CHUNK_BLOCKS)
            while tier_status(client)["puts"] < before + chunks:
                time.sleep(0.01)
        for keys in keysets:
            before = tier_status(client)["puts"]
            t0 = time.perf_counter()
            client.store(iid, keys, src, CHUNK_BLOCKS)
            store_only.append(time.perf_counter() - t0)
            while tier_status(client)["puts"] < before + chunks:
                time.sleep(0.002)
            write_through.append(time.perf_counter() - t0)
        t = tier_status(client)
        assert t["drops"] == 0 and t["direct_writes"] == t["puts"], t
    for root, _, names in os.walk(disk):
        for name in names:
            if name != ".lock":
                drop_cache(os.path.join(root, name))
    promote, retrieve = [], []
    with BenchServer(*args, quiet=True) as server, MPClient(server.url, timeout_s=120) as client:
        iid = client.register_kv_caches(kv, "bench")
        for keys in keysets:
            t0 = time.perf_counter()
            found = client.lookup([keys])
            t1 = time.perf_counter()
            assert found.hits == chunks, (found.hits, chunks)
            client.retrieve(iid, keys, dst, CHUNK_BLOCKS, found.lease)
            t2 = time.perf_counter()
            promote.append(t1 - t0)
            retrieve.append(t2 - t0)
    assert torch.equal(kv_all[:, :blocks], kv_all[:, blocks:])
    out["STORE into the pool (reply)"] = gbps(request_bytes, store_only)
    out["STORE + write-through to disk done"] = gbps(request_bytes, write_through)
    out["LOOKUP with promotion from disk, cold"] = gbps(request_bytes, promote)
    out["LOOKUP (promotion, cold) + RETRIEVE"] = gbps(request_bytes, retrieve)
    del kv, kv_all
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default="/var/tmp", help="a directory on the file system to measure (default /var/tmp)")
    ap.add_argument("--request-mib", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    n = args.request_mib << 20
    where = tempfile.mkdtemp(prefix="lmshm-disk-bench-", dir=args.dir)
    try:
        fs = subprocess.run(["df", "-T", where], capture_output=True, text=True).stdout.splitlines()[-1].split()[1]
        print(f"disk tier bench: {args.request_mib} MiB per request, {args.reps} reps, {where} ({fs}), "
              f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; disk checksum "
              f"{CHECKSUMS[checksum_algorithm('auto')][0]}; GB/s, medians")
        data = memoryview(torch.randint(0, 255, (n,), dtype=torch.uint8).numpy())
        for name, v in checksums(data, args.reps).items():
            print(f"  checksum {name:<52} {v:6.2f}")
        for name, v in files(where, data, args.reps).items():
            print(f"  {name:<61} {v:6.2f}")
        for name, v in end_to_end(where, n, args.reps).items():
            print(f"  end to end: {name:<49} {v:6.2f}")
    finally:
        shutil.rmtree(where, ignore_errors=True)


if __name__ == "__main__":
    main()
