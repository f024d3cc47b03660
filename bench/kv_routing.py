"""KV-aware routing on one machine: two "hosts" (an lmshm-server and a tiny vLLM engine each),
requests with shared prefixes, routed round robin or to the host with the longest cached prefix.

    .venv/bin/python bench/kv_routing.py [--requests 64] [--prompts 8] [--max-objects 4096,256] [--rounds 1]

Needs .venv-vllm (scripts/bootstrap-vllm). Per round and pool size, two runs on the same
requests in the same order, each on fresh servers and engines: ``round robin`` (hosts in turn)
and ``prefix-aware`` (``examples/kv_router.py``: the host whose KV events show the longest
cached prefix; ties to the host given fewer requests). Each host is an ``lmshm-server
--max-objects N`` (its pool holds N chunks) and one engine (``vllm_engine serve-stdin``: the
tiny random Llama, vLLM's own prefix caching off, so every cached token came through lmshm,
``max_tokens=1``, one unbound OpenMP thread each unless ``--bind``). The router reads each
engine's own vLLM KV-event stream (``--kv-events-config``, ZMQ PUB on an ipc:// endpoint),
which carries the blocks the engine's lmshm-server holds (LmshmConnector's ``take_events``), or
with ``--events server`` each lmshm-server's own stream (``lmshm-server --kv-events``, topic
``kv@node:host-X@MODEL``): the same blocks, published as the server commits them.

The workload: ``--prompts`` "system prompts" of random tokens (lengths uniform in ``--prefix``),
each request one of them (each equally often, in a seeded random order) plus a fresh suffix
(lengths uniform in ``--suffix``). One engine warm-up request each first, not counted.

What keeps the comparison fair: both policies see the same requests in the same order, the
same engines and the same pool per host; requests are sent one at a time, and after each one
the bench waits until the router has seen the served prompt's blocks on that host (or 5 s),
whichever policy runs, so both start every request from the same settled state. Two pool
sizes by default: 4096 chunks, which holds every prompt on each host (routing saves only the
second host's first miss per prompt), and 256, about 70% of the prompts' blocks on one host
(the two together hold them all, with room for the suffixes), where round robin makes each host
cycle through every prompt and its LRU pool evicts a prompt's first blocks before it comes back.

Prints, per pool size and policy: requests per host, prompt tokens, tokens from lmshm, the hit
rate (tokens from lmshm / prompt tokens), pool evictions, median and p90 TTFT, and the median
against round robin's. Everything started is stopped at the end; the script checks that no
lmshm segment is left in /dev/shm.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "examples"))

from _common import parse_args, skip, skip_slow
from _server import BenchServer
from kv_router import Router

from lmshm.transport.client import query_status

VLLM_PYTHON = Path(os.environ.get("LMSHM_VLLM_VENV", ROOT / ".venv-vllm")) / "bin" / "python"
ENGINE = [str(ROOT / "tools" / "vllm_engine.py")]
HOSTS = ("a", "b")


def lmshm_segments() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("lmshm-")}


class Engine:
    """One ``vllm_engine serve-stdin`` process: a request a line in, a result a line out."""

    def __init__(self, args: argparse.Namespace, tmp: Path, name: str, url: str, events: str, core: int) -> None:
        """``events``: the endpoint of the engine's own KV-event stream, or "" (the server publishes)."""
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
               "DO_NOT_TRACK": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "TMPDIR": str(tmp),
               "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        env.pop("PYTHONPATH", None)   # the engine imports lmshm from its own venv, run from ROOT
        if args.bind:
            env["VLLM_CPU_OMP_THREADS_BIND"] = str(core % (os.cpu_count() or 1))
        else:   # see bench/vllm_ttft.py: one unbound thread is stable on a shared 2-core machine
            env.update(VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS=str(args.engine_threads))
        self.name = name
        self.log_path = tmp / f"engine-{name}.log"
        if events:   # the connector's events reach vLLM's stream as the engine steps: keep it stepping
            stream = ["--kv-events", events, "--kv-events-topic", f"kv@host-{name}@tiny", "--pump-s", "5"]
        else:        # adverts with every STORE, for lmshm-server's own stream; nothing to step for
            stream = ["--extra", "lmshm.kv_events=true", "--pump-s", "0"]
        self.proc = subprocess.Popen(
            [str(VLLM_PYTHON), *ENGINE, "serve-stdin", str(tmp / "model"), url, "--max-tokens", "1",
             "--block-size", str(args.block_size), "--chunk-tokens", str(args.chunk_tokens), *stream],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(self.log_path, "w"), text=True, env=env,
            cwd=ROOT)

    def read(self, timeout_s: float = 300) -> dict:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            raise RuntimeError(f"engine {self.name} said nothing (exit status {self.proc.poll()}):\n"
                               + self.log_path.read_text()[-3000:])
        return json.loads(line)

    def send(self, obj: dict) -> None:
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc.stdout.close()


def workload(args: argparse.Namespace, seed: int) -> tuple[list[list[int]], list[list[int]], int]:
    """``(warm-ups, requests, best)``: one warm-up per host, the shared-prefix requests in order,
    and the most prompt tokens any routing could load: every prompt's whole blocks, in every
    request but its prompt's first."""
    r = random.Random(seed)
    lo, hi = (int(x) for x in args.prefix.split(","))
    prompts = [[r.randrange(1, 500) for _ in range(r.randint(lo, hi))] for _ in range(args.prompts)]
    order = [i % args.prompts for i in range(args.requests)]
    r.shuffle(order)
    lo, hi = (int(x) for x in args.suffix.split(","))
    requests = [prompts[i] + [r.randrange(1, 500) for _ in range(r.randint(lo, hi))] for i in order]
    warmups = [[r.randrange(1, 500) for _ in range(300)] for _ in HOSTS]
    best = sum(len(prompts[i]) // args.block_size * args.block_size for i in order) - \
        sum(len(p) // args.block_size * args.block_size for p in prompts)
    return warmups, requests, best


def run_policy(args: argparse.Namespace, tmp: Path, policy: str, max_objects: int, warmups: list[list[int]],
               requests: list[list[int]]) -> dict:
    """One policy on fresh servers and engines: per request its host and result."""
    servers: dict[str, BenchServer] = {}
    engines: dict[str, Engine] = {}
    router = None
    try:
        endpoints = {name: f"ipc://{tmp}/events-{name}" for name in HOSTS}
        for name in HOSTS:
            stream = ["--kv-events", endpoints[name], "--kv-events-node", f"host-{name}"] \
                if args.events == "server" else []
            servers[name] = BenchServer("--capacity", "512MiB", "--max-objects", str(max_objects), *stream)
        router = Router(args.block_size, endpoints)
        for core, name in enumerate(HOSTS):
            engines[name] = Engine(args, tmp, name, servers[name].url,
                                   endpoints[name] if args.events == "engine" else "", core)
        for name in HOSTS:
            assert engines[name].read()["ready"]
        for name, tokens in zip(HOSTS, warmups):
            serve(engines[name], router, name, tokens)
        results, lags, late = [], [], 0
        for tokens in requests:
            host = router.round_robin() if policy == "round robin" else router.route(tokens)[0]
            result, lag = serve(engines[host], router, host, tokens)
            results.append({**result, "host": host})
            lags.append(lag)
            late += lag is None
        evictions = {name: query_status(s.url).pool.evictions for name, s in servers.items()}
        return {"results": results, "evictions": sum(evictions.values()), "late": late,
                "lag": max((x for x in lags if x is not None), default=0.0), "router": dict(router.stats)}
    finally:
        for engine in engines.values():
            engine.stop()
        if router is not None:
            router.close()
        for name, server in servers.items():
            if server.stop() != 0:
                print(f"warning: lmshm-server {name} exited {server.returncode}", file=sys.stderr)


def serve(engine: Engine, router: Router, host: str, tokens: list[int], wait_s: float = 5.0, quiet_s: float = 0.3):
    """Send one request; wait until the router sees all its blocks on ``host`` (the engine keeps
    stepping meanwhile), then stop the engine's stepping. ``(result, seconds until seen or None)``.
    A pool too small for the prompt can lose some of its blocks as it stores the others: then
    the wait ends once a batch came and ``quiet_s`` passed without another (or at ``wait_s``)."""
    view = router.views[host]
    seq = view.last_seq
    engine.send({"tokens": tokens})
    result = engine.read()
    t0 = time.monotonic()
    blocks = len(tokens) // router.block_size
    lag = None
    while time.monotonic() - t0 < wait_s:
        if router.match(tokens)[host] >= blocks:
            lag = time.monotonic() - t0
            break
        if view.last_seq != seq and time.monotonic() - view.last_batch_at > quiet_s:
            break
        time.sleep(0.005)
    engine.send({})
    assert engine.read().get("idle")
    return result, lag


def p90(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=10, method="inclusive")[-1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=8, help="shared system prompts")
    ap.add_argument("--prefix", default="1000,2000", help="system prompt lengths, min,max tokens")
    ap.add_argument("--suffix", default="50,200", help="unique suffix lengths, min,max tokens")
    ap.add_argument("--max-objects", default="4096,256",
                    help="chunks each host's pool holds, comma-separated: one pair of runs per value")
    ap.add_argument("--rounds", type=int, default=1, help="repeat everything on new prompts (seed + round)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--chunk-tokens", type=int, default=32)
    ap.add_argument("--engine-threads", type=int, default=1, help="unbound OpenMP threads per engine")
    ap.add_argument("--bind", action="store_true", help="bind engine a to core 0 and b to core 1 instead")
    ap.add_argument("--events", choices=["engine", "server"], default="engine",
                    help="the router reads each engine's vLLM KV-event stream (default), or each "
                         "lmshm-server's own (lmshm-server --kv-events)")
    ap.add_argument("--verbose", action="store_true", help="print every request's host, cached tokens and TTFT")
    args = parse_args(ap, smoke={"requests": 4, "prompts": 2, "prefix": "64,96", "suffix": "8,16", "max_objects": "4096"})
    if args.smoke:
        if not VLLM_PYTHON.exists():
            skip(f"{VLLM_PYTHON} is missing (scripts/bootstrap-vllm)")
        skip_slow("two real vLLM engines per policy: minutes on CPU, too long for a smoke run")
    if not VLLM_PYTHON.exists():
        print(f"{VLLM_PYTHON} is missing: run scripts/bootstrap-vllm", file=sys.stderr)
        return 2
    before = lmshm_segments()
    tmp = Path(tempfile.mkdtemp(prefix="lmshm-kvr-", dir="/tmp"))
    policies = ("round robin", "prefix-aware")
    runs: dict[tuple[int, str], list[dict]] = {}
    best = 0
    try:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TMPDIR": str(tmp)}
        env.pop("PYTHONPATH", None)
        subprocess.run([str(VLLM_PYTHON), *ENGINE, "build", str(tmp / "model")], check=True, env=env,
                       capture_output=True, cwd=ROOT)
        for rnd in range(args.rounds):
            warmups, requests, most = workload(args, args.seed + rnd)
            best += most
            for max_objects in (int(x) for x in args.max_objects.split(",")):
                # alternate which policy runs first, round by round (a shared machine drifts)
                for policy in policies if rnd % 2 == 0 else policies[::-1]:
                    run = run_policy(args, tmp, policy, max_objects, warmups, requests)
                    runs.setdefault((max_objects, policy), []).append(run)
                    if args.verbose:
                        print(f"# {max_objects} objects, {policy}, round {rnd}: router {run['router']}, "
                              f"slowest event lag {run['lag'] * 1e3:.0f} ms, {run['late']} not all seen")
                        for x in run["results"]:
                            print(f"  {x['host']} {x['prompt']:>5} {x['cached']:>5} {x['seconds'] * 1e3:8.1f} ms")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    left = lmshm_segments() - before
    print(f"tiny Llama (2 layers, 128 hidden, float32), vLLM CPU single-process, block {args.block_size}, "
          f"chunk {args.chunk_tokens} tokens, max_tokens=1, {args.requests} requests over {args.prompts} prompts "
          f"of {args.prefix.replace(',', '-')} tokens + suffixes of {args.suffix.replace(',', '-')}, "
          f"{args.rounds} round(s), seed {args.seed}; events from each {args.events}'s stream; engine threads "
          f"{'bound, one core each' if args.bind else f'{args.engine_threads} unbound'}; {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f}")
    print("| pool objects/host | policy | requests a/b | prompt tokens | from lmshm | hit rate | evictions "
          "| TTFT median ms | TTFT p90 ms | TTFT mean ms | median x round robin |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for max_objects in dict.fromkeys(k[0] for k in runs):
        base = statistics.median(x["seconds"] for run in runs[(max_objects, "round robin")] for x in run["results"])
        for policy in policies:
            rs = [x for run in runs[(max_objects, policy)] for x in run["results"]]
            prompt, cached = sum(x["prompt"] for x in rs), sum(x["cached"] for x in rs)
            ttft = [x["seconds"] for x in rs]
            per_host = "/".join(str(sum(x["host"] == h for x in rs)) for h in HOSTS)
            evictions = sum(run["evictions"] for run in runs[(max_objects, policy)])
            print(f"| {max_objects} | {policy} | {per_host} | {prompt:,} | {cached:,} | {cached / prompt:.1%} "
                  f"| {evictions:,} | {statistics.median(ttft) * 1e3:.1f} | {p90(ttft) * 1e3:.1f} "
                  f"| {statistics.mean(ttft) * 1e3:.1f} | {statistics.median(ttft) / base:.2f} |")
    prompt = sum(x["prompt"] for run in next(iter(runs.values())) for x in run["results"])
    print(f"best possible hit rate (every prompt's whole blocks loaded but at its first request): {best / prompt:.1%}")
    late = sum(run["late"] for rr in runs.values() for run in rr)
    lag = max(run["lag"] for rr in runs.values() for run in rr)
    totals = {k: sum(run["router"][k] for rr in runs.values() for run in rr) for k in ("gaps", "orphans", "bad")}
    print(f"router: slowest wait for a request's events {lag * 1e3:.0f} ms; {late} requests whose blocks were not "
          f"all seen (lost to eviction as they were stored); sequence gaps {totals['gaps']}, orphan blocks "
          f"{totals['orphans']}, bad batches {totals['bad']}; lmshm segments left in /dev/shm: {len(left)}")
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main())
