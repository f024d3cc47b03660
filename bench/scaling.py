"""How lmshm-server's costs grow: with the pool, the request, the registrations; and what its
listener costs against another checkout's.

    .venv/bin/python bench/scaling.py                         # lookup, copy, registry (the issue's sizes)
    .venv/bin/python bench/scaling.py --sections lookup --objects 1000,10000
    .venv/bin/python bench/scaling.py --sections listener --against /path/to/other/checkout

Sections, each against its own ``lmshm-server`` (this process is the worker; client and server
share the machine's cores, so every figure includes both sides):

- ``lookup``: a KV cache of 1-byte blocks (one uint8 layer) and STOREs of 1-byte chunks with
  32-byte keys (65,536 per STORE) until the pool holds each of ``--objects``. At each size,
  ``--runs`` rounds of: an empty PING, a LOOKUP of 64 stored keys (a hit: 64 objects pinned
  under a lease, RELEASEd afterwards, untimed) and a LOOKUP of 64 keys not stored (a miss),
  the order rotating each round. Medians, and each LOOKUP's median over the PING's. The
  server's RSS growth per object is taken between sizes (its 64-byte extent included: the
  objects touch pool pages too).
- ``copy``: a KV cache of 32 layers x [blocks, 8, 16, 128] float16 (1 MiB per block over all
  layers) in shared memory, chunks of one block, block ids shuffled. Per request size of
  ``--sizes`` MiB: STORE with fresh keys, then RETRIEVE of those chunks (in another order),
  ``--copy-reps`` times, after a pass that touches every pool page (so STOREs reuse warm
  pages); and, in this process, a memmove of the same bytes between two touched buffers.
  GB/s are 10^9 bytes per second of the client-side median.
- ``registry``: one session registers one-layer views of one 4 KiB shared segment (one mapping
  for all: what is measured is the registry, not mmap) under distinct instance ids until it
  holds each of ``--registrations``. At each count, ``--reg-runs`` rounds of PING, REGISTER
  and UNREGISTER of one more instance, a STATUS request (sessionless, a fresh DEALER, as
  ``lmshm status`` sends it; its reply size too), and ``--cli-runs`` runs of the ``lmshm status``
  command (a fresh Python process each; ``python -c pass`` beside it), default and ``--all``.
  The server's RSS growth per registration is taken between counts.
- ``pool``: ``Pool.lookup`` of 64 keys, the lease's release and a miss in this process, CPU
  time, at each of ``--pool-objects``; with ``--against``, that checkout's pool beside this one's.
- ``listener``: PING and LOOKUP (64 keys, hit and miss, ``--listener-objects`` objects, default
  1,000) against this checkout's server and ``--against``'s, side by side: one child process per checkout (its own lmshm on
  the path, its own server), run in alternating blocks of ``--block`` requests, ``--rounds``
  rounds, the order swapping each round. Medians over all requests, and the ratio of medians.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import random
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import parse_args
from _server import BenchServer

KEYS_PER_STORE = 65536
LOOKUP_KEYS = 64


def rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def med_us(xs: list[float]) -> float:
    return statistics.median(xs) * 1e6


def key(i: int) -> bytes:
    return i.to_bytes(32, "big")


def missing_key(i: int) -> bytes:
    return b"\xff" + i.to_bytes(31, "big")


# ---- PING and LOOKUP: shared by the lookup section and the listener's child ----------------


def fill_pool(client, iid: str, have: int, target: int) -> int:
    """STORE 1-byte chunks ``key(have) .. key(target - 1)``; returns ``target``."""
    while have < target:
        n = min(KEYS_PER_STORE, target - have)
        reply = client.store(iid, [key(have + i) for i in range(n)], [0] * n, 1, timeout_s=300)
        bad = sum(1 for r in reply.results if r != 0)
        if bad:
            raise SystemExit(f"{bad} of {n} chunks were not stored: raise --capacity / --max-objects")
        have += n
    return have


def latency_rounds(client, stored: int, runs: int, rng: random.Random) -> dict[str, list[float]]:
    """``runs`` rounds of PING, LOOKUP hit and LOOKUP miss (64 keys each), order rotating."""
    out: dict[str, list[float]] = {"ping": [], "hit": [], "miss": []}
    order = ["ping", "hit", "miss"]
    for r in range(runs):
        for what in order[r % 3:] + order[:r % 3]:
            if what == "ping":
                out["ping"].append(client.ping())
                continue
            if what == "hit":
                start = rng.randrange(max(1, stored - LOOKUP_KEYS))
                keys = [key(start + i) for i in range(LOOKUP_KEYS)]
            else:
                base = rng.randrange(1 << 40)
                keys = [missing_key(base + i) for i in range(LOOKUP_KEYS)]
            t0 = time.perf_counter()
            reply = client.lookup([keys])
            out[what].append(time.perf_counter() - t0)
            if what == "hit":
                if reply.hits != LOOKUP_KEYS:
                    raise SystemExit(f"a LOOKUP of {LOOKUP_KEYS} stored keys found {reply.hits}")
                client.release(reply.lease)
            elif reply.hits:
                raise SystemExit("a LOOKUP of keys never stored found some")
    return out


def tiny_kv():
    import torch

    from lmshm.platform.cpu import empty_shared

    return {"layer.0": empty_shared((16, 1), torch.uint8)}


# ---- lookup -------------------------------------------------------------------------------


def section_lookup(args: argparse.Namespace) -> None:
    from lmshm.transport.client import MPClient

    sizes = sorted(int(s) for s in args.objects.split(","))
    rng = random.Random(1)
    print(f"\n== LOOKUP of {LOOKUP_KEYS} keys against the pool's size; {args.runs} rounds per size "
          f"(PING, LOOKUP hit, LOOKUP miss, order rotating); 1-byte chunks, 32-byte keys")
    with BenchServer("--capacity", args.lookup_capacity, "--max-objects", str(max(sizes) + KEYS_PER_STORE),
                     quiet=True) as server, \
            MPClient(server.url, fd_socket=server.fd_socket, heartbeat_interval_s=5.0, timeout_s=300) as client:
        iid = client.register_kv_caches(tiny_kv(), model_name="scaling")
        have = fill_pool(client, iid, 0, LOOKUP_KEYS)
        latency_rounds(client, have, 200, rng)  # warm-up, not counted
        rss0, have0 = rss_kb(server.pid), have
        print(f"{'objects':>9} {'PING us':>8} {'hit us':>8} {'x PING':>7} {'miss us':>8} {'x PING':>7} "
              f"{'fill s':>7} {'RSS MiB':>8} {'RSS B/object':>13}")
        prev_rss, prev_have = rss0, have0
        for size in sizes:
            t0 = time.perf_counter()
            have = fill_pool(client, iid, have, size)
            fill_s = time.perf_counter() - t0
            time.sleep(0.2)
            rss = rss_kb(server.pid)
            pool = client.status().pool
            if pool.objects != have:
                raise SystemExit(f"the pool holds {pool.objects} objects, {have} were stored (evicted?)")
            t = latency_rounds(client, have, args.runs, rng)
            ping, hit, miss = med_us(t["ping"]), med_us(t["hit"]), med_us(t["miss"])
            per_obj = (rss - prev_rss) * 1024 / max(1, have - prev_have)
            print(f"{have:>9,} {ping:>8.0f} {hit:>8.0f} {hit / ping:>7.2f} {miss:>8.0f} {miss / ping:>7.2f} "
                  f"{fill_s:>7.1f} {rss / 1024:>8.1f} {per_obj:>13.0f}", flush=True)
            prev_rss, prev_have = rss, have
        total = (prev_rss - rss0) * 1024 / max(1, prev_have - have0)
        print(f"server RSS per pool object, {have0:,} -> {prev_have:,} objects: {total:.0f} B "
              f"(64 B of it the object's extent in pool pages)")
        client.unregister_kv_caches(iid)
    print(f"server exit status {server.returncode}")


# ---- pool: Pool.lookup in one process ------------------------------------------------------


def section_pool(args: argparse.Namespace) -> None:
    """``Pool.lookup`` of 64 stored keys, its lease's release, and a miss, in this process (CPU
    time of this thread, so other processes' load counts less), for this checkout's pool and,
    with ``--against``, another's (an older checkout's ``lmshm/core/pool.py`` loaded by path), interleaved; and
    64 ``move_to_end`` calls on the LRU (the refresh a pin does) on their own."""
    import collections
    import importlib
    import importlib.util

    import lmshm.core.pool

    # this checkout's pool by its package name (a module or a package), another's by its file
    modules = {"this": importlib.import_module("lmshm.core.pool")}
    paths = {"this": os.path.dirname(lmshm.__file__)}
    if args.against:
        paths["against"] = os.path.join(os.path.abspath(args.against), "lmshm", "core", "pool.py")
        spec = importlib.util.spec_from_file_location("_pool_against", paths["against"])
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        modules["against"] = module
    print(f"\n== Pool.lookup of {LOOKUP_KEYS} keys in one process (CPU time, medians of {args.runs}): "
          + ", ".join(f"{n}: {p}" for n, p in paths.items()))
    print(f"{'objects':>9} {'pool':>8} {'hit us':>7} {'release us':>11} {'miss us':>8} {'64 refreshes us':>16}")
    rng = random.Random(3)
    for n in sorted(int(x) for x in args.pool_objects.split(",")):
        pools = {}
        for name, module in modules.items():
            pool = module.Pool(n * module.cost_of(1) + (1 << 20), max_objects=n + 1)
            for i in range(n):
                _, obj = pool.reserve(0, key(i), 1, b"L" * 16, 1)
                pool.commit([obj])
            pools[name] = pool
        times = {name: {"hit": [], "release": [], "miss": [], "refresh": []} for name in pools}
        clock = time.thread_time_ns
        for r in range(args.runs):
            start = rng.randrange(max(1, n - LOOKUP_KEYS))
            for name, pool in pools.items():
                keys = [[key(start + i) for i in range(LOOKUP_KEYS)]]       # fresh bytes, as decoded
                miss = [[missing_key(r * LOOKUP_KEYS + i) for i in range(LOOKUP_KEYS)]]
                t0 = clock()
                _, lease = pool.lookup(0, keys, "s", 30.0)
                t1 = clock()
                pool.release_lease(lease, 0)
                t2 = clock()
                pool.lookup(0, miss, "s", 30.0)
                t3 = clock()
                tenant = pool._tenants[0]
                lru = tenant.lru if hasattr(tenant, "lru") else tenant.ready     # (before: "ready")
                other = rng.randrange(max(1, n - LOOKUP_KEYS))                   # a window not just used
                again = [key(other + i) for i in range(LOOKUP_KEYS)]
                t4 = clock()
                collections.deque(map(lru.move_to_end, again), maxlen=0)
                t5 = clock()
                got = times[name]
                got["hit"].append(t1 - t0)
                got["release"].append(t2 - t1)
                got["miss"].append(t3 - t2)
                got["refresh"].append(t5 - t4)
        for name in pools:
            m = {k: statistics.median(v) / 1000 for k, v in times[name].items()}
            print(f"{n:>9,} {name:>8} {m['hit']:>7.1f} {m['release']:>11.1f} {m['miss']:>8.1f} {m['refresh']:>16.1f}",
                  flush=True)
        del pools


# ---- copy ---------------------------------------------------------------------------------

LAYERS, HEADS, TOKENS, DIM = 32, 8, 16, 128
BLOCK_BYTES = LAYERS * HEADS * TOKENS * DIM * 2   # 1 MiB over all layers


def memmove_s(nbytes: int, reps: int) -> list[float]:
    import torch

    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    times = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), nbytes)
        times.append(time.perf_counter() - t0)
    return times[1:]


def section_copy(args: argparse.Namespace) -> None:
    import torch

    from lmshm.platform.cpu import empty_shared
    from lmshm.transport.client import MPClient

    sizes = [int(s) for s in args.sizes.split(",")]
    cb = args.chunk_blocks
    if any(mib % cb for mib in sizes):
        raise SystemExit(f"--chunk-blocks {cb} must divide every request size in MiB")
    num_blocks = max(sizes) + 64
    rng = random.Random(2)
    print(f"\n== STORE and RETRIEVE against the request's size: KV cache of {LAYERS} layers x "
          f"[{num_blocks}, {HEADS}, {TOKENS}, {DIM}] float16 ({num_blocks} MiB), chunks of {cb} block(s) "
          f"({cb} MiB), block ids shuffled; pool {args.copy_capacity}; {args.copy_reps} requests per size "
          "(a third above 256 MiB)")
    extra = args.copy_server_args.split()
    if extra:
        print(f"server flags: {' '.join(extra)}")
    with BenchServer("--capacity", args.copy_capacity, *extra, quiet=True) as server, \
            MPClient(server.url, fd_socket=server.fd_socket, heartbeat_interval_s=5.0, timeout_s=600) as client:
        kv_pool = empty_shared((LAYERS, num_blocks, HEADS, TOKENS, DIM), torch.float16)
        kv_pool.fill_(1.0)
        iid = client.register_kv_caches({f"layer.{i}": kv_pool[i] for i in range(LAYERS)}, model_name="scaling")
        capacity_blocks = client.status().pool.capacity // BLOCK_BYTES
        made = 0

        def fresh(n: int) -> list[bytes]:
            nonlocal made
            made += n
            return [key(made - n + i) for i in range(n)]

        # touch every pool page once (a first STORE into untouched pages measures the kernel)
        for _ in range(-(-capacity_blocks // max(sizes)) + 1):
            client.store(iid, fresh(max(sizes) // cb), list(range(max(sizes))), cb, timeout_s=600)
        print(f"{'MiB':>5} {'n':>3} {'STORE ms':>9} {'GB/s':>6} {'RETRIEVE ms':>12} {'GB/s':>6} "
              f"{'memmove ms':>11} {'GB/s':>6} {'STORE x':>8} {'RETR x':>7}")
        for mib in sizes:
            reps = args.copy_reps if mib <= 256 else max(3, args.copy_reps // 3)
            stores, retrieves = [], []
            for _ in range(reps):
                blocks = rng.sample(range(num_blocks), mib)
                keys = fresh(mib // cb)
                t0 = time.perf_counter()
                reply = client.store(iid, keys, blocks, cb, timeout_s=600)
                stores.append(time.perf_counter() - t0)
                if any(r != 0 for r in reply.results):
                    raise SystemExit(f"STORE of {mib} MiB: not every chunk was stored ({set(reply.results)})")
                rng.shuffle(blocks)              # back into the same blocks, in another order
                t0 = time.perf_counter()
                client.retrieve(iid, keys, blocks, cb, timeout_s=600)
                retrieves.append(time.perf_counter() - t0)
            mm = memmove_s(mib * BLOCK_BYTES, reps)
            nbytes = mib * BLOCK_BYTES
            s, r, m = (statistics.median(x) for x in (stores, retrieves, mm))
            print(f"{mib:>5} {reps:>3} {s * 1e3:>9.2f} {nbytes / s / 1e9:>6.2f} {r * 1e3:>12.2f} "
                  f"{nbytes / r / 1e9:>6.2f} {m * 1e3:>11.2f} {nbytes / m / 1e9:>6.2f} {m / s:>8.2f} {m / r:>7.2f}",
                  flush=True)
        client.unregister_kv_caches(iid)
    print("x: memmove's median time over the request's (1.00 = memory speed)")
    print(f"server exit status {server.returncode}")


# ---- registry -----------------------------------------------------------------------------


def run_wall_ms(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited with {proc.returncode}: {proc.stderr[-500:]}")
    return (time.perf_counter() - t0) * 1e3


def section_registry(args: argparse.Namespace) -> None:
    import torch

    from lmshm.platform.cpu import empty_shared
    from lmshm.transport import mq
    from lmshm.transport.client import MPClient
    from lmshm.wire import codec, protocol

    counts = sorted(int(c) for c in args.registrations.split(","))
    print(f"\n== REGISTER, UNREGISTER and STATUS against the live registrations; {args.reg_runs} rounds "
          f"per count, `lmshm status` {args.cli_runs} runs; each registration one layer over one shared segment")
    status_cmd = [sys.executable, "-m", "lmshm.cli", "status"]
    knows_all = "--all" in subprocess.run(status_cmd + ["--help"], capture_output=True, text=True).stdout
    all_flag = ["--all"] if args.status_all and knows_all else []
    with BenchServer("--capacity", "0", "--max-registrations-per-session", str(max(counts) + 16),
                     quiet=True) as server, \
            MPClient(server.url, fd_socket=server.fd_socket, heartbeat_interval_s=5.0, timeout_s=60) as client:
        segment = empty_shared((1, 4096), torch.uint8)
        live = 0

        def register(name: str) -> None:
            client.register_kv_caches({"layer.0": segment}, name, model_name="scaling")

        def status_request(request) -> tuple[float, int]:
            """One STATUS on a fresh connection, as `lmshm status` sends it: ms (decoding
            included), reply bytes."""
            dealer = mq.DealerClient(server.url, timeout_s=30)
            try:
                t0 = time.perf_counter()
                raw = dealer.request(codec.encode(request))
                reply = codec.decode_reply(raw)
                ms = (time.perf_counter() - t0) * 1e3
            finally:
                dealer.close()
            if not isinstance(reply, protocol.StatusReply):
                raise SystemExit(f"STATUS was refused: {reply}")
            return ms, len(raw)

        # what `lmshm status` asks by default (50 rows; a server before 3.4 refuses the fields and
        # is asked as below), and a plain STATUS (a whole page; before 3.4: every registration)
        try:
            small = protocol.Status(0, 50, protocol.PROTOCOL_MINOR)
            status_request(small)
        except (SystemExit, TypeError, AttributeError):
            small = protocol.Status()

        for i in range(4):   # warm-up
            register(f"warm-{i}")
            client.unregister_kv_caches(f"warm-{i}")
        rss0, live0 = rss_kb(server.pid), 0
        print(f"{'live':>7} {'PING us':>8} {'REGISTER us':>12} {'UNREG us':>9} {'STATUS ms':>10} {'KiB':>6} "
              f"{'plain ms':>9} {'KiB':>7} {'cli ms':>7}" + (f" {'--all ms':>9}" if all_flag else "")
              + f" {'py ms':>6} {'RSS MiB':>8} {'RSS B/reg':>10}")
        prev_rss, prev_live = rss0, live0
        for count in counts:
            while live < count:
                register(f"reg-{live:06d}")
                live += 1
            time.sleep(0.2)
            rss = rss_kb(server.pid)
            pings, regs, unregs = [], [], []
            for _ in range(args.reg_runs):
                pings.append(client.ping())
                t0 = time.perf_counter()
                register("extra")
                regs.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                client.unregister_kv_caches("extra")
                unregs.append(time.perf_counter() - t0)
            statuses = [status_request(small) for _ in range(max(9, args.cli_runs))]
            plains = [status_request(protocol.Status()) for _ in range(max(9, args.cli_runs))]
            cli, cli_all, bare = [], [], []
            for _ in range(args.cli_runs):
                cli.append(run_wall_ms(status_cmd + ["--url", server.url]))
                if all_flag:
                    cli_all.append(run_wall_ms(status_cmd + ["--url", server.url] + all_flag))
                bare.append(run_wall_ms([sys.executable, "-c", "pass"]))
            per_reg = (rss - prev_rss) * 1024 / max(1, live - prev_live)
            line = (f"{live:>7,} {med_us(pings):>8.0f} {med_us(regs):>12.0f} {med_us(unregs):>9.0f} "
                    f"{statistics.median(s for s, _ in statuses):>10.2f} {statuses[0][1] / 1024:>6.1f} "
                    f"{statistics.median(s for s, _ in plains):>9.2f} {plains[0][1] / 1024:>7.1f} "
                    f"{statistics.median(cli):>7.0f}")
            if all_flag:
                line += f" {statistics.median(cli_all):>9.0f}"
            print(line + f" {statistics.median(bare):>6.0f} {rss / 1024:>8.1f} {per_reg:>10.0f}", flush=True)
            prev_rss, prev_live = rss, live
        total = (prev_rss - rss0) * 1024 / max(1, prev_live - live0)
        print(f"server RSS per registration, {live0:,} -> {prev_live:,}: {total:.0f} B")
        t0 = time.perf_counter()
        for i in range(live):
            client.unregister_kv_caches(f"reg-{i:06d}")
        print(f"unregistering all {live:,}: {time.perf_counter() - t0:.1f} s")
    print("STATUS: the request `lmshm status` sends (50 rows), on a fresh connection, decoded; plain: STATUS "
          "without fields (a 3.3 client's; a page of at most 1,000 rows); cli: wall time of `python -m lmshm.cli "
          "status --url URL`, a fresh process (--all: every row); py: `python -c pass`")
    print(f"server exit status {server.returncode}")


# ---- listener: this checkout against another, side by side -----------------------------------


def latency_child() -> None:
    """Driven over stdin by ``section_listener``: ``setup N`` (a server, N objects), ``run N``
    (N rounds; one JSON line back), ``quit``."""
    import lmshm
    from lmshm.transport.client import MPClient

    server = client = None
    rng = random.Random(os.getpid())
    stored = 0
    print(json.dumps({"lmshm": os.path.dirname(lmshm.__file__)}), flush=True)
    for line in sys.stdin:
        cmd, _, arg = line.strip().partition(" ")
        if cmd == "setup":
            more = int(arg) + KEYS_PER_STORE
            server = BenchServer("--capacity", "1GiB", *(["--max-objects", str(more)] if more > 1 << 18 else []),
                                 quiet=True)
            client = MPClient(server.url, fd_socket=server.fd_socket, heartbeat_interval_s=5.0, timeout_s=60)
            iid = client.register_kv_caches(tiny_kv(), model_name="scaling")
            stored = fill_pool(client, iid, 0, int(arg))
            latency_rounds(client, stored, 200, rng)
            print(json.dumps({"ready": stored}), flush=True)
        elif cmd == "run":
            t = latency_rounds(client, stored, int(arg), rng)
            print(json.dumps(t), flush=True)
        else:
            break
    if client is not None:
        client.close()
    if server is not None:
        server.stop()
    print(json.dumps({"exit": server.returncode if server else None}), flush=True)


def section_listener(args: argparse.Namespace) -> None:
    import lmshm

    here = os.path.dirname(os.path.dirname(os.path.abspath(lmshm.__file__)))   # the checkout on the path
    trees = {"this": here, "against": os.path.abspath(args.against)}
    children = {}
    for name, tree in trees.items():
        env = dict(os.environ, PYTHONPATH=tree)
        children[name] = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--latency-child"],
                                          cwd=tree, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          text=True)

    def ask(name: str, line: str) -> dict:
        child = children[name]
        child.stdin.write(line + "\n")
        child.stdin.flush()
        return json.loads(child.stdout.readline())

    where = {name: json.loads(children[name].stdout.readline())["lmshm"] for name in trees}
    for name in trees:
        ask(name, f"setup {args.listener_objects}")
    times = {name: {"ping": [], "hit": [], "miss": []} for name in trees}
    rounds = []
    for r in range(args.rounds):
        order = list(trees) if r % 2 == 0 else list(reversed(trees))
        this_round = {}
        for name in order:
            got = ask(name, f"run {args.block}")
            this_round[name] = {k: statistics.median(v) for k, v in got.items()}
            for k, v in got.items():
                times[name][k].extend(v)
        rounds.append(this_round)
    exits = {name: ask(name, "quit")["exit"] for name in trees}
    for child in children.values():
        child.wait(30)
    print(f"\n== PING and LOOKUP of {LOOKUP_KEYS} keys ({args.listener_objects:,} objects), this checkout against "
          f"another; {args.rounds} rounds of {args.block} requests each, alternating")
    for name in trees:
        print(f"{name}: lmshm from {where[name]}")
    print(f"{'request':<12} {'this us':>8} {'against us':>11} {'ratio':>6} {'per-round ratio':>16}")
    for k, label in (("ping", "PING"), ("hit", "LOOKUP hit"), ("miss", "LOOKUP miss")):
        a, b = med_us(times["this"][k]), med_us(times["against"][k])
        per_round = statistics.median(rd["this"][k] / rd["against"][k] for rd in rounds)
        print(f"{label:<12} {a:>8.0f} {b:>11.0f} {a / b:>6.2f} {per_round:>16.2f}")
    print("ratio: this over against (medians over every request); per-round: median of the rounds' ratios")
    print(f"server exit status: {exits}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sections", default="lookup,copy,registry",
                    help="comma-separated: lookup, copy, registry, listener, pool (default: the first three)")
    ap.add_argument("--objects", default="1000,10000,100000,1000000", help="pool sizes for LOOKUP")
    ap.add_argument("--runs", type=int, default=1000, help="rounds per pool size (lookup)")
    ap.add_argument("--pool-objects", default="1000,1000000", help="pool sizes (pool)")
    ap.add_argument("--lookup-capacity", default="1GiB", help="--capacity of the lookup section's server")
    ap.add_argument("--sizes", default="1,16,256,1024", help="request sizes in MiB (copy)")
    ap.add_argument("--copy-reps", type=int, default=9, help="requests per size (copy; a third above 256 MiB)")
    ap.add_argument("--copy-capacity", default="2GiB", help="--capacity of the copy section's server")
    ap.add_argument("--chunk-blocks", type=int, default=1, help="blocks (MiB) per chunk (copy; default 1)")
    ap.add_argument("--copy-server-args", default="", help="more lmshm-server flags for the copy section, "
                    "e.g. --copy-through-mapping")
    ap.add_argument("--registrations", default="10,1000,10000", help="live registration counts (registry)")
    ap.add_argument("--reg-runs", type=int, default=200, help="REGISTER/UNREGISTER rounds per count")
    ap.add_argument("--cli-runs", type=int, default=10, help="runs of `lmshm status` per count")
    ap.add_argument("--no-status-all", dest="status_all", action="store_false",
                    help="do not time `lmshm status --all`")
    ap.add_argument("--against", help="another checkout's root (listener; pool: optional)")
    ap.add_argument("--listener-objects", type=int, default=1000, help="objects in each pool (listener)")
    ap.add_argument("--rounds", type=int, default=20, help="alternating rounds (listener)")
    ap.add_argument("--block", type=int, default=100, help="requests of each kind per round (listener)")
    ap.add_argument("--latency-child", action="store_true", help=argparse.SUPPRESS)
    # smoke: every section but listener (it needs --against)
    args = parse_args(ap, smoke={"sections": "lookup,copy,registry,pool", "objects": "1000", "runs": 20, "pool_objects": "1000", "lookup_capacity": "64MiB", "sizes": "1", "copy_reps": 2, "copy_capacity": "64MiB", "registrations": "10", "reg_runs": 5, "cli_runs": 1})
    if args.latency_child:
        latency_child()
        return

    import lmshm

    sections = args.sections.split(",")
    with open("/proc/loadavg") as f:
        load0 = f.read().split()[0]
    print(f"lmshm from {os.path.dirname(lmshm.__file__)}; Python {sys.version.split()[0]}, {os.cpu_count()} CPUs; "
          f"load average {load0}")
    started = time.perf_counter()
    for name in sections:
        if name == "listener" and not args.against:
            raise SystemExit("--sections listener needs --against PATH")
        {"lookup": section_lookup, "copy": section_copy, "registry": section_registry,
         "listener": section_listener, "pool": section_pool}[name](args)
    with open("/proc/loadavg") as f:
        load1 = f.read().split()[0]
    print(f"\ntotal {time.perf_counter() - started:.0f} s; load average at the end {load1}")


if __name__ == "__main__":
    main()
