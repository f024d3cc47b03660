"""Time to first token of the tiny vLLM engine: a miss, and a hit from each tier of lmshm.

    .venv/bin/python bench/vllm_ttft.py [--reps 5] [--rounds 3] [--lengths 4096] [--remote URL]

Needs .venv-vllm (scripts/bootstrap-vllm). Builds the tiny random Llama of the real-engine tests
and runs one engine process per row, one after another (single-process mode, vLLM's prefix
caching off, so every cached token came from lmshm), each serving the same ``--reps`` fresh
prompts per length one at a time with ``max_tokens=1`` (one warm-up prompt per engine, not
counted), with one unbound OpenMP thread each (``--engine-threads``). All rows come from one run:

- ``vLLM alone``: no connector (the reference; ``--no-baseline`` leaves it out);
- ``miss``: LmshmConnector on an empty ``lmshm-server --disk DIR`` (computes, stores; the
  stores are written through to the disk);
- ``pool hit``: a new engine on the same server (loads from the pool);
- ``disk hit``: the server restarted on the same ``--disk`` (an empty pool): LOOKUP promotes
  the chunks from the files, which are still in the kernel's page cache;
- ``disk hit, cold``: restarted again after every file was dropped from the page cache
  (``fdatasync`` + ``posix_fadvise(DONTNEED)``, per file: nothing else on the machine is
  touched), so the promotions read the device;
- ``remote hit``: with ``--remote URL`` (the miss's server then writes through to it too), a
  server with no disk and an empty pool on the same remote; both servers share a secret made for
  the run (``--remote-secret-file``, unless a ``--server-arg`` names one or
  ``--remote-insecure-unsigned``). Skipped, with the reason printed,
  without ``--remote`` or where this lmshm has no remote tier.

Prints per row and prompt length: the prompt tokens computed and loaded, the chunks the row's
server promoted from its tier, the median TTFT, and its ratio to the miss.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

sys.path.insert(0, os.path.dirname(__file__))

from _common import parse_args, skip, skip_slow
from _server import BenchServer

from lmshm.transport.client import query_status

ROOT = Path(__file__).resolve().parents[1]
ENGINE = [str(ROOT / "tools" / "vllm_engine.py")]
VLLM_PYTHON = Path(os.environ.get("LMSHM_VLLM_VENV", ROOT / ".venv-vllm")) / "bin" / "python"


class Bench:
    def __init__(self, args: argparse.Namespace, tmp: Path) -> None:
        self.args, self.tmp = args, tmp
        self.env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
                    "DO_NOT_TRACK": "1", "VLLM_CPU_KVCACHE_SPACE": "2", "TMPDIR": str(tmp),
                    "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        self.env.pop("PYTHONPATH", None)   # the engine imports lmshm from its own venv, run from ROOT
        if args.engine_threads:
            # vLLM binds one OpenMP thread per core; on a small machine shared with other work a
            # descheduled thread stalls every parallel region, and a whole engine process runs
            # several times slower at random (measured: 12 vs 120 ms for the same pool hit)
            self.env.update(VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS=str(args.engine_threads))
        self.model = tmp / "model"
        self.batch = tmp / "batch.json"
        self.secret = tmp / "remote.key"            # the servers' --remote-secret-file: 32 bytes, mode 600
        fd = os.open(self.secret, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, os.urandom(32))
        finally:
            os.close(fd)

    def engine(self, url: str, *extra: str) -> list[dict]:
        """One engine process over the batch; its results, the warm-up prompt left out."""
        out = self.tmp / "out.json"
        proc = subprocess.run(
            [str(VLLM_PYTHON), *ENGINE, "serve", str(self.model), url, str(out), "--batch", str(self.batch),
             "--max-tokens", "1", "--block-size", "32", "--chunk-tokens", str(self.args.chunk_tokens), *extra],
            env=self.env, capture_output=True, text=True, cwd=ROOT)
        if proc.returncode:
            raise RuntimeError(f"the engine exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        return json.loads(out.read_text())["batches"][0][1:]

    def server(self, disk: Optional[Path], remote: Optional[str] = None) -> BenchServer:
        args = ["--capacity", "2GiB", *self.args.server_arg]
        if disk is not None:
            args += ["--disk", str(disk), "--disk-capacity", "4GiB"]
        if remote:
            args += ["--remote", remote]
            if not {"--remote-secret-file", "--remote-insecure-unsigned"} & {a.split("=")[0] for a in args}:
                args += ["--remote-secret-file", str(self.secret)]
        return BenchServer(*args)


def written_through(server: BenchServer) -> None:
    """Wait until the tiers' write-through queues have taken every stored chunk."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        pool = query_status(server.url).pool
        if all(t.queue_depth == 0 and t.puts + t.drops + t.errors >= pool.stored for t in pool.tiers):
            for t in pool.tiers:
                if t.drops or t.errors:
                    print(f"warning: tier {t.name} dropped {t.drops} and failed {t.errors} writes", file=sys.stderr)
            return
        time.sleep(0.1)
    raise RuntimeError("the write-through did not finish in 120 s")


def drop_page_cache(directory: Path) -> tuple[int, int]:
    """Drop every file under ``directory`` from the page cache; (bytes resident before, after)."""
    files = [p for p in directory.rglob("*") if p.is_file() and p.name != ".lock"]
    before = resident(files)
    for p in files:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)   # DONTNEED drops clean pages only
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return before, resident(files)


def resident(files: list[Path]) -> int:
    """Bytes of ``files`` in the page cache (util-linux ``fincore``); -1 without it."""
    if not shutil.which("fincore") or not files:
        return -1
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", *map(str, files)],
                         capture_output=True, text=True)
    return sum(int(x) for x in out.stdout.split()) if out.returncode == 0 else -1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", "--prompts", dest="reps", type=int, default=5,
                    help="prompts per length and round (each row of a round serves the same ones)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every row this many times, in turn, on fresh prompts and a fresh disk directory; "
                         "medians over all rounds (spreads the drift of a shared machine over every row)")
    ap.add_argument("--lengths", default="4096", help="prompt lengths in tokens, comma-separated")
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--remote", default="", help="a Valkey/Redis URL for the remote row (lmshm-server --remote)")
    ap.add_argument("--server-arg", action="append", default=[],
                    help="one more lmshm-server argument for every server (repeat: --server-arg=--remote-ttl ...)")
    ap.add_argument("--engine-threads", type=int, default=1,
                    help="OpenMP threads per engine, unbound (default 1: stable on a shared 2-core machine); "
                         "0: vLLM's own binding, one thread per core")
    ap.add_argument("--verbose", action="store_true", help="print every prompt's TTFT too")
    ap.add_argument("--no-baseline", action="store_true", help="leave out the vLLM-alone row")
    args = parse_args(ap, smoke={"reps": 1, "lengths": "64", "chunk_tokens": 32})
    if args.smoke:
        if not VLLM_PYTHON.exists():
            skip(f"{VLLM_PYTHON} is missing (scripts/bootstrap-vllm)")
        skip_slow("real vLLM engines, one per row: minutes on CPU, too long for a smoke run")
    if not VLLM_PYTHON.exists():
        print(f"{VLLM_PYTHON} is missing: run scripts/bootstrap-vllm", file=sys.stderr)
        return 2
    remote, skipped = args.remote or None, ""
    if remote is None:
        skipped = "no --remote URL given"
    elif importlib.util.find_spec("lmshm.core.tiers.remote") is None:
        remote, skipped = None, "this lmshm has no remote tier (lmshm.core.tiers.remote)"
    lengths = [int(x) for x in args.lengths.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="lmshm-ttft-", dir="/tmp"))
    rows: dict[str, Row] = {}
    cache: list[tuple[int, int]] = []
    try:
        bench = Bench(args, tmp)
        subprocess.run([str(VLLM_PYTHON), *ENGINE, "build", str(bench.model)], check=True, env=bench.env,
                       capture_output=True, cwd=ROOT)
        for i in range(args.rounds):
            r = random.Random(11 + i)
            warmup = [r.randrange(1, 500) for _ in range(300)]
            prompts = [[r.randrange(1, 500) for _ in range(n)] for n in lengths for _ in range(args.reps)]
            bench.batch.write_text(json.dumps([warmup, *prompts]))
            cache.append(run_round(bench, tmp / f"disk-{i}", remote, rows))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"tiny Llama (2 layers, 128 hidden, float32), vLLM CPU single-process, block 32, chunk "
          f"{args.chunk_tokens} tokens, max_tokens=1, {args.rounds} round(s) x {args.reps} prompts per length "
          f"(medians), engine threads {args.engine_threads or 'vLLM-bound'}, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f}")
    print("disk files in the page cache before / after the drop, per round (bytes): "
          + "; ".join(f"{a} / {b}" for a, b in cache))
    print(f"{'row':<16} {'prompt':>7} {'computed':>9} {'loaded':>7} {'promoted (reads)':>20} {'TTFT ms':>9} "
          f"{'x miss':>7}")
    for n in lengths:
        miss = statistics.median(x["seconds"] for x in rows["miss"].results if x["prompt"] == n)
        for name, row in rows.items():
            mine = [x for x in row.results if x["prompt"] == n]
            ttft = statistics.median(x["seconds"] for x in mine)
            cached = statistics.median(x["cached"] for x in mine)
            source = f"{row.promotions} in {row.read_s * 1e3:.0f} ms" if row.tier else "-"
            print(f"{name:<16} {n:>7} {n - cached:>9.0f} {cached:>7.0f} {source:>20} {ttft * 1e3:>9.1f} "
                  f"{ttft / miss:>7.2f}")
            if args.verbose:
                each = ", ".join(f"{x['seconds'] * 1e3:.1f}" for x in mine)
                print(f"{'':<16} each, ms: {each}")
    if skipped:
        print(f"remote hit: skipped ({skipped})")
    return 0


class Row:
    """One row's results over the rounds, and what its servers' tier promoted (every prompt, the
    warm-ups included)."""

    def __init__(self, tier: str) -> None:
        self.tier = tier
        self.results: list[dict] = []
        self.promotions = 0
        self.read_s = 0.0

    def add(self, results: list[dict], server: Optional[BenchServer] = None) -> None:
        self.results += results
        if server is not None and self.tier:
            t = next(t for t in query_status(server.url).pool.tiers if t.name == self.tier)
            self.promotions += t.promotions
            self.read_s += t.read_seconds


def run_round(bench: Bench, disk: Path, remote: Optional[str], rows: dict[str, Row]) -> tuple[int, int]:
    """Every row once, in order, on ``bench.batch``; returns the page-cache bytes of the disk
    files before and after they were dropped for the cold row."""
    def row(name: str, tier: str = "") -> Row:
        return rows.setdefault(name, Row(tier))

    disk.mkdir(mode=0o700)
    server = bench.server(disk, remote=remote)
    try:
        if not bench.args.no_baseline:
            row("vLLM alone").add(bench.engine(server.url, "--no-connector"))
        row("miss").add(bench.engine(server.url))
        row("pool hit").add(bench.engine(server.url))
        written_through(server)
    finally:
        check(server)
    cache = (-1, -1)
    for name in ("disk hit", "disk hit, cold"):
        if name.endswith("cold"):
            cache = drop_page_cache(disk)
        server = bench.server(disk)
        try:
            row(name, "disk").add(bench.engine(server.url), server)
        finally:
            check(server)
    if remote:
        server = bench.server(None, remote=remote)
        try:
            row("remote hit", "remote").add(bench.engine(server.url), server)
        finally:
            check(server)
    return cache


def check(server: BenchServer) -> None:
    if server.stop() != 0:
        raise RuntimeError(f"lmshm-server exited {server.returncode}")


if __name__ == "__main__":
    sys.exit(main())
