"""What the KV event index costs per chunk, in process: each phase of a chunk's life, apart.

    .venv/bin/python bench/kv_index_cost.py [--stores 1000] [--runs 7]
                                            [--compare-with OLD_kv_events.py]

A ``KvIndex`` (lmshm/core/kv_events/) is fed what a server feeds it for STOREs of 16 chunks,
one 32-token block each, chained (bench/kv_events_overhead.py's workload), phase by phase, each
phase queued and then applied (``drain``), and timed in µs per chunk:

- ``describe``: a STORE's adverts queued and applied (checked, indexed by key, hash and tokens);
- ``present``: each chunk reported resident in the pool (a ``BlockStored`` each);
- ``evict``: each chunk reported gone from the pool (a ``BlockRemoved`` each, the chunk forgotten);
- ``read``: the log read back and its events encoded (what a KV_EVENTS reply or the publisher does).

``--compare-with FILE`` loads a one-file ``kv_events.py`` from before it became a package (e.g.
``git show aabf88e:lmshm/core/kv_events.py > /tmp/old.py``) and runs it alternately with this
tree's, so a before/after shares the machine's moments. Prints the median over ``--runs`` of each phase. The server pays more per chunk than
this (its caches are cold after each copy, and it shares the cores): bench/kv_events_overhead.py
measures that.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import msgspec
from _common import parse_args

from lmshm.core.kv_events import packed_tokens
from lmshm.wire import protocol

CHUNKS, TOKENS = 16, 32
PHASES = ("describe", "present", "evict", "read")


def load(path: str, name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def workload(stores: int) -> list[tuple[list[bytes], list[Any]]]:
    out, parent = [], None
    for i in range(stores):
        keys, adverts = [os.urandom(16) for _ in range(CHUNKS)], []
        for c, k in enumerate(keys):
            h = os.urandom(32)
            first = (i * CHUNKS + c) * TOKENS
            adverts.append(protocol.Advert(k, 0, TOKENS, [h], parent, [], None, None,
                                           packed_tokens(list(range(first, first + TOKENS)))))
            parent = h
        out.append((keys, adverts))
    return out


def one_run(module: Any, stores: list[tuple[list[bytes], list[Any]]]) -> dict[str, float]:
    """µs per chunk of each phase."""
    index = module.KvIndex(max_chunks=1 << 18)
    record = index.recorder("pool")
    encoder = msgspec.msgpack.Encoder()
    spent = {}

    def timed(phase: str, work: Any) -> None:
        t = time.perf_counter()
        work()
        index.drain()
        spent[phase] = time.perf_counter() - t

    def describe() -> None:
        for keys, adverts in stores:
            index.describe(1, b"space", "model", "pod", 0, 1, keys, adverts)

    def report(present: bool) -> None:
        for keys, _ in stores:
            for k in keys:
                record(1, k, present)

    def read() -> None:
        cursor = -1
        while True:
            records, cursor, _ = index.log.read(cursor, 4096)
            if not records:
                break
            encoder.encode([r.event for r in records])

    timed("describe", describe)
    timed("present", lambda: report(True))
    timed("evict", lambda: report(False))
    timed("read", read)
    return {k: v / (len(stores) * CHUNKS) * 1e6 for k, v in spent.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--stores", type=int, default=1000, help="STOREs of 16 chunks per run (default 1000)")
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--compare-with", default="", metavar="FILE", help="another kv_events.py, run alternately")
    args = parse_args(ap, smoke={"stores": 20, "runs": 1})
    # this tree's by its package name (a module or a package), another by its file
    modules = {"this tree": importlib.import_module("lmshm.core.kv_events")}
    if args.compare_with:
        modules[os.path.basename(args.compare_with)] = load(args.compare_with, "kv_events_other")
    stores = workload(args.stores)
    results: dict[str, list[dict[str, float]]] = {name: [] for name in modules}
    names = list(modules)
    for i in range(args.runs):
        for name in (names if i % 2 == 0 else names[::-1]):
            results[name].append(one_run(modules[name], stores))
    print(f"# KvIndex in process, µs per chunk, medians of {args.runs} runs of {args.stores} STOREs x {CHUNKS} "
          f"chunks; load average {os.getloadavg()[0]:.2f}")
    print("| | " + " | ".join(PHASES) + " | all |")
    print("|---" * (len(PHASES) + 2) + "|")
    for name, runs in results.items():
        cells = [statistics.median(r[p] for r in runs) for p in PHASES]
        total = statistics.median(sum(r[p] for p in PHASES) for r in runs)
        print(f"| {name} | " + " | ".join(f"{c:.2f}" for c in cells) + f" | {total:.2f} |")


if __name__ == "__main__":
    main()
