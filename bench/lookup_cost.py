"""What one lmshm lookup costs the scheduler, against one vLLM step of the tiny model.

    .venv/bin/python bench/lookup_cost.py [--quick] [--runs 2000] [--step-tp 1,2] [--no-engine]

vLLM asks the connector once per new request (``get_num_new_matched_tokens``), in the
scheduler, before the step that computes the request, and that step waits for the answer. Here
the scheduler half runs without vLLM (``lmshm.integrations.adapter``, as the adapter tests
drive it) against a real lmshm-server:

- per world size W (1, and 2 for tensor parallel 2), W worker ``Link``s register a small CPU KV
  cache each (2 layers of [136 blocks, 2, 32 tokens, 64] float32: the tiny Llama's bytes per
  block and rank) and store every chunk of one 4,096-token request, planned by a
  ``SchedulerSide`` of world size W;
- ``SchedulerSide.matched_tokens`` is then timed for a new request each time (new request id:
  its keys are derived again, as for every request vLLM sees) with the engine's kind of block
  hashes: 128 random 32-byte hashes, one per 32-token block, chunk 32 tokens, so 128 keys per
  rank, W key lists in one LOOKUP. *hit*: the stored request's hashes (4,095 tokens matched, a
  lease pinned, released after the timing by ``finished``); *miss*: other hashes (0 matched).
- for the parts: deriving the keys alone (in-process), a bare ``Link.lookup`` of the same keys,
  and an empty PING on the same connection.

All of these run interleaved, in rounds with the order rotating, so noise falls on all alike.

The step it is compared with: vLLM 0.32.0 CPU serving the same tiny Llama (no connector: vLLM's
own step) at the same TP size, one request at a time, ``max_tokens=M`` (32), in one engine
process per TP size. The *step* is the per-token time of 32-token prompts, median over the
prompts of (request seconds / M): one 32-token prefill and M - 1 decode steps, which cost about
the same for a model this small (its step is mostly fixed overhead), plus one request's own
overhead spread over M. The *4k prefill* is the median over 4,096-token prompts of (request
seconds - (M - 1) x step): the step a 4k request's lookup precedes. Four warm-up prompts (two
of 300 tokens, two of 4,096) are not counted. A decode step is the smallest step there is, so
its fraction is the upper bound; the minimum per-token time is printed too, for a machine busy
with other work (the step's OpenMP threads, one per core, wait for the slowest of them, so one
busy core stalls every step). The engine runs after the lookups, not interleaved with them:
the ratio carries whatever the machine's load did in between.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))

import torch
from _common import parse_args
from _server import BenchServer
from vllm_parallel import engine_env

from lmshm.integrations.adapter import (
    Link,
    LinkConfig,
    Namespace,
    SchedulerSide,
    WorkerSide,
    chunk_keys_from_hashes,
)

ROOT = Path(__file__).resolve().parents[1]
ENGINE = [str(ROOT / "tools" / "vllm_engine.py")]
VLLM_PYTHON = Path(os.environ.get("LMSHM_VLLM_VENV", ROOT / ".venv-vllm")) / "bin" / "python"
PROMPT = 4096
BLOCK = 32          # vLLM's block size here, and lmshm's chunk
LAYERS = 2
KV_BLOCKS = PROMPT // BLOCK + 8


class Deployment:
    """One engine's lmshm side, without the engine: a scheduler link and ``world`` worker links,
    each worker with its own registered KV cache, and one stored 4k request."""

    def __init__(self, url: str, world: int) -> None:
        self.world = world
        ns = Namespace("tiny-llama", "float32", f"{LAYERS}x[{KV_BLOCKS},2,{BLOCK},64]", world_size=world,
                       chunk_tokens=BLOCK)
        self.kv = [{f"layer.{i}": torch.randn(KV_BLOCKS, 2, BLOCK, 64) for i in range(LAYERS)} for _ in range(world)]
        self.wlinks = [Link(LinkConfig(url=url, client_name=f"bench-worker{r}")) for r in range(world)]
        for r, (link, kv) in enumerate(zip(self.wlinks, self.kv)):
            link.register(kv, model_name="tiny-llama", world_size=world, rank=r)
        self.slink = Link(LinkConfig(url=url, client_name="bench-scheduler"))
        if not all(link.wait_connected(15) for link in (self.slink, *self.wlinks)):
            raise RuntimeError(f"could not connect to and register with lmshm-server at {url}")
        self.sched = SchedulerSide(self.slink, ns, chunk_tokens=BLOCK, block_size=BLOCK)
        self.tokens = list(range(PROMPT))   # only its length counts when block hashes are given
        self.hit_hashes = [os.urandom(32) for _ in range(PROMPT // BLOCK)]
        self.miss_hashes = [os.urandom(32) for _ in range(PROMPT // BLOCK)]
        # store every chunk of the hit request, for every rank, as the engine would
        assert self.sched.matched_tokens("store", self.tokens, 0, hashes=self.hit_hashes) == 0
        plan = self.sched.plan()
        self.sched.scheduled("store", block_ids=[list(range(PROMPT // BLOCK))], replace_blocks=True,
                             computed_after_step=PROMPT, plan=plan)
        for r, link in enumerate(self.wlinks):
            worker = WorkerSide(link, rank=r)
            worker.save(plan)
            worker.wait_for_stores()
            if worker.stored_chunks != PROMPT // BLOCK:
                raise RuntimeError(f"rank {r} stored {worker.stored_chunks} of {PROMPT // BLOCK} chunks")
        self.sched.finished("store")
        self.namespaces = [rank[0] for rank in self.sched.namespaces]
        self.hit_keys = self.keys(self.hit_hashes)

    def keys(self, hashes: list[bytes]) -> list[list[bytes]]:
        return [chunk_keys_from_hashes(ns, hashes, 1) for ns in self.namespaces]

    def matched(self, hashes: list[bytes], expect: int) -> float:
        req = uuid.uuid4().hex
        t0 = time.perf_counter()
        got = self.sched.matched_tokens(req, self.tokens, 0, hashes=hashes, hashes_per_chunk=1)
        dt = time.perf_counter() - t0
        self.sched.finished(req)           # ends a hit's lease (not awaited), as when vLLM frees the request
        if got != expect:
            raise RuntimeError(f"matched_tokens gave {got}, expected {expect}")
        return dt

    def derive(self) -> float:
        t0 = time.perf_counter()
        self.keys(self.miss_hashes)
        return time.perf_counter() - t0

    def bare_lookup(self) -> float:
        t0 = time.perf_counter()
        hits, lease = self.slink.lookup(self.hit_keys)
        dt = time.perf_counter() - t0
        self.slink.release(lease)
        if hits != PROMPT // BLOCK:
            raise RuntimeError(f"LOOKUP found {hits} chunks, expected {PROMPT // BLOCK}")
        return dt

    def ping(self) -> float:
        return self.slink.client().ping()

    def close(self) -> None:
        for link in (self.slink, *self.wlinks):
            link.close()
        self.kv.clear()


def measure_lookups(url: str, worlds: list[int], runs: int, rounds: int) -> dict[tuple[int, str], list[float]]:
    deps = {w: Deployment(url, w) for w in worlds}
    try:
        cases = []
        for w, d in deps.items():
            cases += [((w, "hit"), lambda d=d: d.matched(d.hit_hashes, PROMPT - 1)),
                      ((w, "miss"), lambda d=d: d.matched(d.miss_hashes, 0)),
                      ((w, "keys"), d.derive),
                      ((w, "lookup"), d.bare_lookup),
                      ((w, "ping"), d.ping)]
        times: dict[tuple[int, str], list[float]] = {name: [] for name, _ in cases}
        for _, fn in cases:        # warm-up
            for _ in range(50):
                fn()
        per_round = max(1, runs // rounds)
        for i in range(rounds):
            for name, fn in cases[i % len(cases):] + cases[:i % len(cases)]:
                times[name] += [fn() for _ in range(per_round)]
        return times
    finally:
        for d in deps.values():
            d.close()
        gc.collect()


def measure_steps(url: str, tp: int, n: int, max_tokens: int, tmp: Path) -> dict[str, float]:
    """Step s (median and minimum), 4k prefill s, and the load average before and after, of the
    tiny Llama with vLLM alone at tensor parallel ``tp``."""
    model = tmp / "llama"
    subprocess.run([str(VLLM_PYTHON), *ENGINE, "build", str(model)], check=True, env=engine_env(tmp, 1),
                   capture_output=True)
    r = random.Random(5)
    warmup = [[r.randrange(1, 500) for _ in range(length)] for length in (300, 300, PROMPT, PROMPT)]
    short = [[r.randrange(1, 500) for _ in range(32)] for _ in range(n)]
    long = [[r.randrange(1, 500) for _ in range(PROMPT)] for _ in range(max(4, n // 4))]
    batch, out = tmp / f"tp{tp}.json", tmp / f"tp{tp}-out.json"
    batch.write_text(json.dumps(warmup + short + long))
    load_before = os.getloadavg()[0]
    proc = subprocess.run([str(VLLM_PYTHON), *ENGINE, "serve", str(model), url, str(out), "--batch", str(batch),
                           "--no-connector", "--tp", str(tp), "--max-tokens", str(max_tokens), "--block-size",
                           str(BLOCK)], env=engine_env(tmp, tp), capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"the TP={tp} engine exited {proc.returncode}:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    results = json.loads(out.read_text())["batches"][0][len(warmup):]
    per_token = [x["seconds"] / max_tokens for x in results if x["prompt"] == 32]
    step = statistics.median(per_token)
    prefill = statistics.median(x["seconds"] - (max_tokens - 1) * step for x in results if x["prompt"] == PROMPT)
    return {"step": step, "min_step": min(per_token), "prefill": prefill, "load_before": load_before,
            "load_after": os.getloadavg()[0]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=2000, help="timed calls per case (default 2000)")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--step-tp", default="1,2", help="TP sizes whose vLLM step is measured (default 1,2)")
    ap.add_argument("--step-prompts", type=int, default=16, help="32-token prompts per step engine")
    ap.add_argument("--decode-tokens", type=int, default=32, help="M, output tokens per request of the step engine")
    ap.add_argument("--no-engine", action="store_true", help="lookups only, no vLLM step")
    ap.add_argument("--quick", action="store_true", help="500 runs, step at TP=1 only, 8 prompts")
    # smoke: the lookups alone: the vLLM step needs .venv-vllm and a minute
    args = parse_args(ap, smoke={"runs": 50, "rounds": 2, "no_engine": True})
    if args.quick:
        args.runs, args.step_tp, args.step_prompts = 500, "1", 8
    step_tps = [] if args.no_engine else [int(x) for x in args.step_tp.split(",") if x]
    if step_tps and not VLLM_PYTHON.exists():
        print(f"{VLLM_PYTHON} is missing: run scripts/bootstrap-vllm, or pass --no-engine", file=sys.stderr)
        return 2
    load_start = os.getloadavg()
    t_start = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="lmshm-lk-", dir="/tmp"))  # short: vLLM puts Unix sockets in TMPDIR
    try:
        with BenchServer("--capacity", "256MiB") as server:
            times = measure_lookups(server.url, [1, 2], args.runs, args.rounds)
            steps = {tp: measure_steps(server.url, tp, args.step_prompts, args.decode_tokens, tmp) for tp in step_tps}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    us = {k: statistics.median(v) * 1e6 for k, v in times.items()}
    p90 = {k: statistics.quantiles(v, n=10)[-1] * 1e6 for k, v in times.items()}
    print(f"scheduler-side lookup cost: lmshm-server at tcp://127.0.0.1, one 4,096-token request = 128 blocks "
          f"of 32 tokens, chunk 32 tokens, 32-byte block hashes; {args.runs} calls per case in {args.rounds} "
          f"rotating rounds; {os.cpu_count()} CPUs, Python {platform.python_version()}, torch {torch.__version__}")
    print(f"load average at start {load_start[0]:.2f}, at end {os.getloadavg()[0]:.2f} (the machine is shared "
          f"with other work); total {time.perf_counter() - t_start:.0f} s; server exit status {server.returncode}")
    print()
    print(f"{'TP':>2} {'case':<44} {'median us':>10} {'p90 us':>8}")
    labels = {"hit": "matched_tokens, hit (4,095 tokens)",
              "miss": "matched_tokens, miss (0 tokens)",
              "keys": "  part: deriving the keys alone (in-process)",
              "lookup": "  part: bare Link.lookup of the keys, hit",
              "ping": "  reference: empty PING, same connection"}
    for w in (1, 2):
        for case in ("hit", "miss", "keys", "lookup", "ping"):
            print(f"{w:>2} {labels[case]:<44} {us[w, case]:>10.0f} {p90[w, case]:>8.0f}")
    if steps:
        print()
        print(f"vLLM 0.32.0 CPU step, tiny Llama, no connector, one request at a time, "
              f"max_tokens={args.decode_tokens}: step = per-token time of {args.step_prompts} 32-token prompts "
              f"(median; minimum); 4k prefill = median (request time - {args.decode_tokens - 1} steps) of "
              f"4,096-token prompts")
        print(f"{'TP':>2} {'step ms':>8} {'min ms':>7} {'hit / step':>11} {'miss / step':>12} {'hit / min':>10} "
              f"{'4k prefill ms':>14} {'hit / prefill':>14} {'miss / prefill':>15} {'load avg':>12}")
        for tp, m in steps.items():
            step, prefill = m["step"] * 1e6, m["prefill"] * 1e6
            load = f"{m['load_before']:.2f}-{m['load_after']:.2f}"
            print(f"{tp:>2} {step / 1e3:>8.2f} {m['min_step'] * 1e3:>7.2f} {us[tp, 'hit'] / step:>11.1%} "
                  f"{us[tp, 'miss'] / step:>12.1%} {us[tp, 'hit'] / (m['min_step'] * 1e6):>10.1%} "
                  f"{prefill / 1e3:>14.1f} {us[tp, 'hit'] / prefill:>14.2%} {us[tp, 'miss'] / prefill:>15.2%} "
                  f"{load:>12}")
        print("hit / min: against the quietest request's per-token time (an upper bound under this load); "
              "load avg: 1-minute load average before and after that engine ran")
    return 0


if __name__ == "__main__":
    sys.exit(main())
