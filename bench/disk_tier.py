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
   first, so the timed STOREs reuse warm pool pages), then, after a restart of the server on
   the same directory, LOOKUP (promotion from cold files) + RETRIEVE: the first request right
   after the restart (a fresh pool, the index rebuild still running) timed apart, against a
   cold O_DIRECT read of other files into memory never touched before (what a fresh pool is up
   against: page faults as well as the disk), then, once
   the rebuild is done and two requests have warmed the pool, each rep a cold sequential
   O_DIRECT read of another request's files, one thread (the ``dd`` of those bytes), and
   then the timed LOOKUP + RETRIEVE: ratios are medians of the per-rep ratios.
   ``--chunk-kib N[,M...]``: chunks of one block of N KiB instead (256 KiB, 2-16 MiB...), each
   size in turn; ``--compare-tree DIR``: the promotion also through a server run from another
   lmshm tree (a before/after in one run); ``--restart-args ARGS``: also through this tree's
   server restarted with those extra arguments (``--prefault-pool``: the fresh-pool remedy);
4. ``ops``: small chunks (``--ops-kib``, default 64) through ``DiskTier`` itself, put (O_DIRECT
   from page-aligned memory) and read back (page cache): microseconds per operation, the cost
   of reaching each file from the tier's directory fds; ``--compare-with FILE`` runs another
   ``disk/tier.py`` (e.g. ``git show HEAD:lmshm/core/tiers/disk/tier.py > /tmp/old.py``) alternately, for
   a before/after on the same host at the same time;
5. ``start`` (only when named in ``--parts``): ``--start-files N`` chunk files (8 KiB payloads,
   sparse: ``ftruncate``; valid headers under the directory's key) are made, the page cache is
   dropped (as root), and a ``DiskTier`` is opened on them: the time until it returned and
   answered ``contains`` and ``put``, and until its index rebuild (a background thread) was done.

    .venv/bin/python bench/disk_tier.py --dir /work --parts start --start-files 1000000

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
from typing import Optional

sys.path.insert(0, os.path.dirname(__file__))

import torch
from _common import parse_args
from _server import BenchServer

from lmshm.core.tiers.base import ChunkMeta
from lmshm.core.tiers.disk import DiskTier
from lmshm.core.tiers.disk.format import HEADER_BYTES, direct_ok, encode_header, file_bytes, read_file, write_file
from lmshm.core.tiers.integrity import CHECKSUMS, checksum_algorithm
from lmshm.platform.cpu import empty_shared
from lmshm.transport.client import MPClient

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
    key = os.urandom(32)                    # the MAC key a tier keeps in DIR/.key
    name = CHECKSUMS[algo][0]

    def write_synced() -> None:
        write_file(path, 0, b"k", meta, algo, data, mac_key=key)
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)

    out[f"tier write buffered+fsync ({name})"] = gbps(n, timed(write_synced, reps))
    out[f"tier write buffered, no fsync ({name}; the fallback)"] = gbps(n, timed(
        lambda: write_file(path, 0, b"k", meta, algo, data, mac_key=key), reps))
    pages = mmap.mmap(-1, n)                # page-aligned, as a pool object is with a disk tier
    pages[:] = data
    on_pages = memoryview(pages)
    assert direct_ok(on_pages)
    out[f"tier write O_DIRECT from the pages ({name}; what the tier does)"] = gbps(n, timed(
        lambda: write_file(path, 0, b"k", meta, algo, on_pages, direct=True, mac_key=key), reps))
    on_pages.release()
    pages.close()
    dest = memoryview(bytearray(n))
    cold = []
    for _ in range(reps):
        drop_cache(path)
        cold += timed(lambda: read_file(path, 0, b"k", meta, dest, mac_key=key), 1)
    out[f"tier read buffered, cold ({name} checked)"] = gbps(n, cold)
    out[f"tier read buffered, page cache ({name} checked)"] = gbps(n, timed(lambda: read_file(
        path, 0, b"k", meta, dest, mac_key=key), reps))
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


def read_files_direct(paths: list[str], buf: memoryview) -> None:
    """Read each whole file with O_DIRECT into ``buf`` (page-aligned, as long as the longest),
    one after the other: a cold sequential read of those bytes, as ``dd iflag=direct`` does."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            size, done = os.fstat(fd).st_size, 0
            while done < size:
                n = os.preadv(fd, [buf[done:size]], done)
                assert n > 0, path
                done += n
        finally:
            os.close(fd)


def read_files_fresh(paths: list[str]) -> float:
    """Seconds to read each whole file with O_DIRECT, one after the other, into consecutive
    page-aligned stretches of memory never touched before (a new mapping, huge pages asked for
    as the pool asks): the cold read a promotion into a fresh pool is up against, page faults
    included."""
    sizes = [os.stat(p).st_size for p in paths]
    spans = [-(-s // 4096) * 4096 for s in sizes]
    buf = mmap.mmap(-1, sum(spans))
    if hasattr(mmap, "MADV_HUGEPAGE"):
        buf.madvise(mmap.MADV_HUGEPAGE)
    view = memoryview(buf)
    t0 = time.perf_counter()
    off = 0
    for path, span in zip(paths, spans):
        read_files_direct([path], view[off:off + span])
        off += span
    took = time.perf_counter() - t0
    view.release()
    buf.close()
    return took


def end_to_end(where: str, request_bytes: int, reps: int, chunk_bytes: int = 0,
               trees: Optional[list[tuple[str, Optional[str], tuple[str, ...]]]] = None) -> dict[str, float]:
    """STORE and write-through, then LOOKUP with promotion from cold files and RETRIEVE, through
    a real server. ``chunk_bytes``: one block of that many bytes (all layers) per chunk (default:
    16 blocks of 2 MiB, 32 MiB). ``trees``: ``(label, directory of another lmshm tree or None
    for this one, extra server arguments)``; the promotion part runs a server of each, one
    after the other, each on its own cold files."""
    trees = trees or [("", None, ())]
    tokens, chunk_blocks = (chunk_bytes // (LAYERS * HEADS * DIM * 2), 1) if chunk_bytes else (TOKENS, CHUNK_BLOCKS)
    chunk_bytes = LAYERS * chunk_blocks * HEADS * tokens * DIM * 2
    chunks = request_bytes // chunk_bytes
    request_bytes = chunks * chunk_bytes
    blocks = chunks * chunk_blocks
    disk = os.path.join(where, "disk")
    os.mkdir(disk, 0o700)
    # the timed STOREs' keysets, then per tree two that warm a fresh pool and, per rep, one for
    # the baseline read and one timed promotion: every promotion and read meets files no one read
    nsets = reps + len(trees) * (3 + 2 * reps)
    args = ("--capacity", str(2 * request_bytes + (64 << 20)), "--disk", disk,
            "--disk-capacity", str(request_bytes * (nsets + 4) + chunks * 2 * HEADER_BYTES * (nsets + 4)),
            "--disk-timeout", "30", "--disk-queue", str(4 * chunks))
    kv_all = empty_shared((LAYERS, 2 * blocks, HEADS, tokens, DIM), torch.float16)
    kv_all.normal_()
    kv = {f"layer.{i}": kv_all[i] for i in range(LAYERS)}
    src, dst = list(range(blocks)), list(range(blocks, 2 * blocks))
    keysets = [[os.urandom(32) for _ in range(chunks)] for _ in range(nsets)]
    out: dict[str, float] = {}
    write_through, store_only = [], []
    with BenchServer(*args, quiet=True) as server, MPClient(server.url, timeout_s=120) as client:
        iid = client.register_kv_caches(kv, "bench")
        # untimed: two requests fill the pool, so that the timed STOREs reuse warm pool pages
        # (evicting chunks already written through), as a server that has run a while does
        for _ in range(2):
            before = tier_status(client)["puts"]
            client.store(iid, [os.urandom(32) for _ in range(chunks)], src, chunk_blocks)
            while tier_status(client)["puts"] < before + chunks:
                time.sleep(0.01)
        for i, keys in enumerate(keysets):
            before = tier_status(client)["puts"]
            t0 = time.perf_counter()
            client.store(iid, keys, src, chunk_blocks)
            if i < reps:
                store_only.append(time.perf_counter() - t0)
            while tier_status(client)["puts"] < before + chunks:
                time.sleep(0.002)
            if i < reps:
                write_through.append(time.perf_counter() - t0)
        t = tier_status(client)
        assert t["drops"] == 0 and t["direct_writes"] == t["puts"], t
    paths = {}
    for root, _, names in os.walk(disk):
        for name in names:
            if name != ".lock" and name != ".key":
                paths[name] = os.path.join(root, name)
                drop_cache(paths[name])
    out["STORE into the pool (reply)"] = gbps(request_bytes, store_only)
    out["STORE + write-through to disk done"] = gbps(request_bytes, write_through)
    rest = iter(keysets[reps:])
    buf = mmap.mmap(-1, HEADER_BYTES + chunk_bytes)
    view = memoryview(buf)
    for label, tree, extra in trees:
        warm_sets = [next(rest) for _ in range(2)]
        fresh_keys = next(rest)
        for path in paths.values():         # the headers an earlier server's index rebuild read, too
            drop_cache(path)
        fresh, fresh_rebuilt, scan, baseline, promote, retrieve = [], [], [], [], [], []
        with BenchServer(*args, *extra, quiet=True, cwd=tree) as server, MPClient(server.url, timeout_s=120) as client:
            t_start = time.perf_counter()
            # the reference for the first LOOKUP: the same cold read, into memory as fresh as a
            # new pool's (read before the registration starts the pool's populate-ahead thread)
            fresh_base = read_files_fresh([paths[k.hex()] for k in fresh_keys])
            iid = client.register_kv_caches(kv, "bench")
            # right after the restart: a fresh pool, and the index rebuild still running (a key
            # it has not reached is probed on disk); then wait for the rebuild to end, so that
            # its header reads do not compete with the timed ones
            for i, keys in enumerate(warm_sets):
                t0 = time.perf_counter()
                found = client.lookup([keys])
                t1 = time.perf_counter()
                # a tree without the probe of keys the rebuild has not reached finds fewer
                assert found.hits == chunks or (i == 0 and tree), (found.hits, chunks, client.status().pool.tiers[0])
                if found.hits:
                    client.retrieve(iid, keys[:found.hits], dst[:found.hits * chunk_blocks], chunk_blocks, found.lease)
                if i == 1:
                    fresh_rebuilt.append(t1 - t0)
                if i == 0:
                    fresh.append(t1 - t0)
                    first_hits = found.hits
                    while not client.status().pool.tiers[0].scan_done:
                        time.sleep(0.01)
                    scan.append(time.perf_counter() - t_start)
            # the warm sets promoted two requests into the pool: the timed ones reuse warm pool
            # pages, as in a server that has run a while. Each rep: the baseline (a cold
            # sequential O_DIRECT read of one request's files, one thread: the dd of those
            # bytes), then LOOKUP (promotion of another request's cold files) + RETRIEVE
            for _ in range(reps):
                base_keys, keys = next(rest), next(rest)
                baseline += timed(lambda: read_files_direct([paths[k.hex()] for k in base_keys], view), 1)
                t0 = time.perf_counter()
                found = client.lookup([keys])
                t1 = time.perf_counter()
                assert found.hits == chunks, (found.hits, chunks, client.status().pool.tiers[0])
                client.retrieve(iid, keys, dst, chunk_blocks, found.lease)
                t2 = time.perf_counter()
                promote.append(t1 - t0)
                retrieve.append(t2 - t0)
        assert torch.equal(kv_all[:, :blocks], kv_all[:, blocks:])
        kv_all[:, blocks:].zero_()
        tag = f"{label}: " if label else ""
        cold = gbps(request_bytes, baseline)
        out[f"{tag}cold sequential O_DIRECT read of the same files, 1 thread"] = cold
        first = gbps(first_hits * chunk_bytes, fresh)      # of the chunks it found
        out[f"{tag}first LOOKUP after the restart (fresh pool, rebuild running)"] = first
        out[f"{tag}  first LOOKUP / cold read (x)"] = first / cold
        into_fresh = gbps(request_bytes, [fresh_base])
        out[f"{tag}cold O_DIRECT read of other files into fresh memory (page faults too), 1 thread"] = into_fresh
        out[f"{tag}  first LOOKUP / that read into fresh memory (x)"] = first / into_fresh
        out[f"{tag}  chunks the first LOOKUP found, of {chunks}"] = first_hits
        out[f"{tag}index rebuild done after the restart (s)"] = scan[0]
        out[f"{tag}second LOOKUP (pool pages not used yet, index rebuilt)"] = gbps(request_bytes, fresh_rebuilt)
        out[f"{tag}  second LOOKUP / cold read (x)"] = gbps(request_bytes, fresh_rebuilt) / cold
        out[f"{tag}LOOKUP with promotion from disk, cold files, warm pool"] = gbps(request_bytes, promote)
        out[f"{tag}  LOOKUP / cold read, median of per-rep ratios (x)"] = statistics.median(
            b / p for b, p in zip(baseline, promote))
        out[f"{tag}LOOKUP (promotion, cold files) + RETRIEVE"] = gbps(request_bytes, retrieve)
        out[f"{tag}  LOOKUP + RETRIEVE / cold read, median of per-rep ratios (x)"] = statistics.median(
            b / r for b, r in zip(baseline, retrieve))
    view.release()
    buf.close()
    del kv, kv_all
    return out


def load_tier(path: str):
    """``DiskTier`` of another copy of disk/tier.py (for a before/after)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("lmshm_disk_compared", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.DiskTier


def ops(where: str, kib: int, count: int, reps: int, compare_with: str = "") -> dict[str, float]:
    """Microseconds per put and per read of ``kib`` KiB chunks through a DiskTier (medians of
    ``reps`` runs of ``count`` operations; each run a fresh directory)."""
    tiers = [("this", DiskTier)] + ([("compared", load_tier(compare_with))] if compare_with else [])
    nbytes = kib << 10
    meta = ChunkMeta(nbytes, b"L" * 16, 1)
    pages = mmap.mmap(-1, nbytes)                  # page-aligned: put writes it with O_DIRECT
    pages[:] = os.urandom(nbytes)
    data = memoryview(pages)
    dest = memoryview(bytearray(nbytes))
    times: dict[str, list[float]] = {}
    for rep in range(reps):
        for label, cls in tiers:                   # alternately, so that both meet the same load
            d = os.path.join(where, f"ops-{label}-{rep}")
            os.mkdir(d, 0o700)
            tier = cls(d, 4 * count * file_bytes(nbytes))
            keys = [os.urandom(16) for _ in range(count)]
            t0 = time.perf_counter()
            for k in keys:
                assert tier.put(0, k, meta, data)
            t1 = time.perf_counter()
            for k in keys:
                assert tier.get_into(0, k, meta, dest)
            t2 = time.perf_counter()
            tier.close()
            shutil.rmtree(d)
            times.setdefault(f"{label}: put {kib} KiB (us/op)", []).append((t1 - t0) / count * 1e6)
            times.setdefault(f"{label}: read {kib} KiB, page cache (us/op)", []).append((t2 - t1) / count * 1e6)
    data.release()
    pages.close()
    return {name: statistics.median(v) for name, v in times.items()}


def start(where: str, files: int, drop: bool = True) -> dict[str, float]:
    """Seconds from opening a DiskTier on ``files`` chunk files until it answers, and until its
    index is rebuilt (the files made first, sparse, with valid headers; page cache dropped)."""
    d = os.path.join(where, "start")
    os.mkdir(d, 0o700)
    payload_bytes = 8192
    meta = ChunkMeta(payload_bytes, b"L" * 16, 1)
    capacity = 2 * files * file_bytes(payload_bytes)
    tier = DiskTier(d, capacity)                   # makes DIR/.key
    mac_key = tier._mac_key
    tier.close()
    algo = checksum_algorithm("crc32")
    zeros = memoryview(bytes(payload_bytes))      # what a sparse payload reads as
    made_dirs: set[str] = set()
    umask = os.umask(0o077)                        # directories 0700, as the tier makes them
    t0 = time.perf_counter()
    for i in range(files):
        key = hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).digest()   # spread as real keys are
        h = key.hex()
        leaf = os.path.join(d, "0", h[0:2], h[2:4])
        if leaf not in made_dirs:
            os.makedirs(leaf, mode=0o700, exist_ok=True)
            made_dirs.add(leaf)
        fd = os.open(os.path.join(leaf, h), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.pwrite(fd, encode_header(0, key, meta, algo, zeros, mac_key=mac_key), 0)
            os.ftruncate(fd, HEADER_BYTES + payload_bytes)
        finally:
            os.close(fd)
    made_s = time.perf_counter() - t0
    os.umask(umask)
    os.sync()
    try:
        if not drop:                               # a smoke run leaves the machine's page cache alone
            raise PermissionError
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        cold = 1.0
    except OSError:
        cold = 0.0                                 # not root: the headers may be in the page cache
    probe = hashlib.blake2b((files - 1).to_bytes(8, "little"), digest_size=16).digest()
    t0 = time.perf_counter()
    tier = DiskTier(d, capacity)
    opened = time.perf_counter() - t0
    tier.contains(0, [probe])
    answered = time.perf_counter() - t0
    assert tier.put(0, b"written-while-scanning", meta, zeros)
    put = time.perf_counter() - t0
    scanned_then = tier.info().scanned
    assert tier.wait_scan(3600)
    done = time.perf_counter() - t0
    info = tier.info()
    assert info.objects == files + 1 and tier.contains(0, [probe]) == 1, info
    tier.close()
    t0 = time.perf_counter()
    shutil.rmtree(d)
    return {"files": files, "made in (s)": made_s, "page cache dropped (1 = yes)": cold,
            "DiskTier() returned after (s)": opened, "first contains answered after (s)": answered,
            "first put done after (s)": put, "files scanned when that put was done": scanned_then,
            "index rebuild done after (s)": done, "scan: microseconds per file": done / files * 1e6,
            "removed in (s)": time.perf_counter() - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default="/var/tmp", help="a directory on the file system to measure (default /var/tmp)")
    ap.add_argument("--request-mib", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--parts", default="checksums,files,end-to-end,ops",
                    help="comma-separated, of checksums, files, end-to-end, ops, start (default: all but start)")
    ap.add_argument("--ops-kib", type=int, default=64, help="chunk size of the ops part (default 64 KiB)")
    ap.add_argument("--ops-count", type=int, default=2000, help="operations per run of the ops part")
    ap.add_argument("--compare-with", default="", help="ops part: another disk/tier.py to run alternately")
    ap.add_argument("--chunk-kib", default="0",
                    help="end-to-end part: chunks of one block of this many KiB, a multiple of 64, or a "
                         "comma-separated list of sizes run one after the other (default 0: 16-block chunks of 32 MiB)")
    ap.add_argument("--compare-tree", default="",
                    help="end-to-end part: also promote through a server of this other lmshm tree (after this one's)")
    ap.add_argument("--restart-args", default="",
                    help="end-to-end part: also promote through a server of this tree restarted with these extra "
                         "arguments (after the others'), e.g. --restart-args=--prefault-pool")
    ap.add_argument("--start-files", type=int, default=1_000_000, help="files for the start part (default 1M)")
    args = parse_args(ap, smoke={"request_mib": 4, "reps": 1, "chunk_kib": "64", "ops_count": 20, "start_files": 50, "parts": "checksums,files,end-to-end,ops,start"})
    parts = set(args.parts.split(","))
    n = args.request_mib << 20
    where = tempfile.mkdtemp(prefix="lmshm-disk-bench-", dir=args.dir)
    try:
        fs = subprocess.run(["df", "-T", where], capture_output=True, text=True).stdout.splitlines()[-1].split()[1]
        print(f"disk tier bench: {args.request_mib} MiB per request, {args.reps} reps, {where} ({fs}), "
              f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; disk checksum "
              f"{CHECKSUMS[checksum_algorithm('auto')][0]}; GB/s, medians")
        data = memoryview(torch.randint(0, 255, (n,), dtype=torch.uint8).numpy()) \
            if parts & {"checksums", "files"} else None
        if "checksums" in parts:
            for name, v in checksums(data, args.reps).items():
                print(f"  checksum {name:<52} {v:6.2f}")
        if "files" in parts:
            for name, v in files(where, data, args.reps).items():
                print(f"  {name:<61} {v:6.2f}")
        if "end-to-end" in parts:
            trees = [("this", None, ())] + ([("compared", args.compare_tree, ())] if args.compare_tree else [])
            if args.restart_args:
                trees.append((f"this, {args.restart_args}", None, tuple(args.restart_args.split())))
            trees = trees if len(trees) > 1 else None
            for kib in [int(k) for k in args.chunk_kib.split(",")]:
                size = f"{kib} KiB chunks" if kib else "32 MiB chunks (16 blocks)"
                for name, v in end_to_end(where, n, args.reps, kib << 10, trees).items():
                    print(f"  end to end, {size}: {name:<66} {v:7.2f}", flush=True)
                shutil.rmtree(os.path.join(where, "disk"))
        if "ops" in parts:
            for name, v in ops(where, args.ops_kib, args.ops_count, args.reps, args.compare_with).items():
                print(f"  ops, {name:<56} {v:8.1f}")
        if "start" in parts:
            for name, v in start(where, args.start_files, drop=not args.smoke).items():
                print(f"  start, {name:<54} {v:10.2f}" if isinstance(v, float) else f"  start, {name:<54} {v:10d}")
    finally:
        shutil.rmtree(where, ignore_errors=True)


if __name__ == "__main__":
    main()
