"""Time to first token, miss against hit, with tensor parallel 2 and with a hybrid model.

    .venv/bin/python bench/vllm_parallel.py [--quick] [--prompts 7] [--lengths 1024,4096]
        [--hybrid-lengths 4096] [--chunk-tokens 32]

Needs .venv-vllm (scripts/bootstrap-vllm). Starts one lmshm-server and builds two tiny random
models with ``tools/vllm_engine.py build``: the Llama of the real-engine tests, served
with tensor parallel 2 (vLLM's multiprocess executor, one core per rank), and the Gemma-3-style
hybrid model (three sliding-window layers, one full-attention layer), served with TP=1. vLLM's
own prefix caching is off, so every cached token came through lmshm.

One engine process per configuration (a TP=2 engine takes about a minute to start here), with
two batches, all requests one at a time and ``max_tokens=1``:

- batch 0: a warm-up prompt, then every prompt once. A real miss: LOOKUP finds nothing, the
  engine computes the prompt and stores its chunks. Between the batches the script waits until
  the server has settled every STORE (nothing in flight, the stored count steady).
- batch 1: the warm-up prompt again (a hit, not counted), then per prompt a *miss* (the request
  has ``{"lmshm": {"load": false, "store": false}}``: it computes everything) and right after
  it the same prompt as a *hit* (loads the chunks batch 0 stored). Misses and hits alternate
  in one process, so the speedup compares figures taken under the same load.

TTFT is the driver's per-request seconds (``LLM.generate`` of one request with one output
token). Prints per configuration and prompt length the medians, the speedup (ratio of medians
and median of per-prompt ratios), the tokens computed (prompt - cached) and whether each hit's
output token equals its miss's.
"""

from __future__ import annotations

import argparse
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
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))

from _common import parse_args, skip, skip_slow
from _server import BenchServer

from lmshm.transport.client import query_status

ROOT = Path(__file__).resolve().parents[1]
ENGINE = [str(ROOT / "tools" / "vllm_engine.py")]
VLLM_PYTHON = Path(os.environ.get("LMSHM_VLLM_VENV", ROOT / ".venv-vllm")) / "bin" / "python"
MISS = {"lmshm": {"load": False, "store": False}}
WARMUP_TOKENS = 300


def engine_env(tmp: Path, tp: int) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
           "DO_NOT_TRACK": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "TMPDIR": str(tmp),
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    if tp > 1:  # one core per rank; vLLM's "auto" binding asserts on a single-NUMA 2-core machine
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(r % (os.cpu_count() or 1)) for r in range(tp))
    env.pop("PYTHONPATH", None)
    return env


def wait_for_stores(url: str, timeout_s: float = 120.0) -> int:
    """Until the server has nothing in flight and its stored count has not moved for 0.5 s;
    returns that count."""
    deadline = time.monotonic() + timeout_s
    last, since = -1, time.monotonic()
    while time.monotonic() < deadline:
        pool = query_status(url).pool
        if pool.in_flight or pool.stored != last:
            last, since = pool.stored, time.monotonic()
        elif time.monotonic() - since >= 0.5:
            return pool.stored
        time.sleep(0.1)
    raise RuntimeError(f"the server's stores did not settle within {timeout_s} s")


def run_config(name: str, model: Path, url: str, tmp: Path, tp: int, lengths: list[int], n: int,
               chunk_tokens: int, seed: int) -> tuple[list[dict], list[dict], float, int]:
    """One engine process: batch 0 stores every prompt, batch 1 serves each as miss then hit.
    Returns (batch 0 results, batch 1 results without the warm-up, engine wall s, chunks stored)."""
    r = random.Random(seed)
    warmup = [r.randrange(1, 500) for _ in range(WARMUP_TOKENS)]
    prompts = [[r.randrange(1, 500) for _ in range(length)] for _ in range(n) for length in lengths]
    b0, b1 = tmp / f"{name}-batch0.json", tmp / f"{name}-batch1.json"
    b0.write_text(json.dumps([warmup, *prompts]))
    pairs = [x for p in prompts for x in ({"tokens": p, "kv_transfer_params": MISS}, p)]   # miss, then hit
    b1.write_text(json.dumps([warmup, *pairs]))
    sync, out, log = tmp / f"{name}-sync", tmp / f"{name}-out.json", tmp / f"{name}.log"
    sync.mkdir()
    cmd = [str(VLLM_PYTHON), *ENGINE, "serve", str(model), url, str(out), "--batch", str(b0), "--batch", str(b1),
           "--sync", str(sync), "--tp", str(tp), "--max-tokens", "1", "--block-size", "32",
           "--chunk-tokens", str(chunk_tokens)]
    t0 = time.perf_counter()
    before = query_status(url).pool.stored
    with open(log, "w") as logf:
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=engine_env(tmp, tp))
        try:
            while not (sync / "ready-1").exists():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name}: the engine exited {proc.returncode}:\n{log.read_text()[-4000:]}")
                time.sleep(0.1)
            stored = wait_for_stores(url) - before
            (sync / "go-1").touch()
            rc = proc.wait(600)
        except BaseException:
            proc.kill()
            proc.wait()
            raise
    if rc:
        raise RuntimeError(f"{name}: the engine exited {rc}:\n{log.read_text()[-4000:]}")
    wall = time.perf_counter() - t0
    batches = json.loads(out.read_text())["batches"]
    return batches[0][1:], batches[1][1:], wall, stored


def table(rows: list[tuple[str, int, list[dict], list[dict]]]) -> None:
    print(f"{'config':<18} {'prompt':>6} {'n':>2} {'first ms':>9} {'miss ms':>9} {'hit ms':>8} {'speedup':>8} "
          f"{'pairwise':>9} {'computed miss/hit':>18} {'same output':>12}")
    for config, length, first, pairs in rows:
        misses, hits = pairs[0::2], pairs[1::2]
        first = [x for x in first if x["prompt"] == length]
        misses = [x for x in misses if x["prompt"] == length]
        hits = [x for x in hits if x["prompt"] == length]
        med = {k: statistics.median(x["seconds"] for x in v) for k, v in
               (("first", first), ("miss", misses), ("hit", hits))}
        pairwise = statistics.median(m["seconds"] / h["seconds"] for m, h in zip(misses, hits))
        computed_miss = statistics.median(x["prompt"] - x["cached"] for x in misses)
        computed_hit = statistics.median(x["prompt"] - x["cached"] for x in hits)
        same = sum(m["output"] == h["output"] for m, h in zip(misses, hits))
        print(f"{config:<18} {length:>6} {len(hits):>2} {med['first'] * 1e3:>9.1f} {med['miss'] * 1e3:>9.1f} "
              f"{med['hit'] * 1e3:>8.1f} {med['miss'] / med['hit']:>7.1f}x {pairwise:>8.1f}x "
              f"{f'{computed_miss:.0f}/{computed_hit:.0f}':>18} {f'{same}/{len(hits)}':>12}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=7, help="distinct prompts per length (default 7)")
    ap.add_argument("--quick", action="store_true", help="3 prompts per length")
    ap.add_argument("--lengths", default="1024,4096", help="prompt lengths for TP=2")
    ap.add_argument("--hybrid-lengths", default="4096", help="prompt lengths for the hybrid model")
    ap.add_argument("--chunk-tokens", type=int, default=32,
                    help="lmshm chunk (the hybrid model needs the block size, 32)")
    args = parse_args(ap, smoke={"prompts": 1, "lengths": "64", "hybrid_lengths": "64"})
    if args.smoke:
        if not VLLM_PYTHON.exists():
            skip(f"{VLLM_PYTHON} is missing (scripts/bootstrap-vllm)")
        skip_slow("real vLLM engines at TP=2 and a hybrid model: minutes on CPU, too long for a smoke run")
    if not VLLM_PYTHON.exists():
        print(f"{VLLM_PYTHON} is missing: run scripts/bootstrap-vllm", file=sys.stderr)
        return 2
    n = 3 if args.quick else args.prompts
    lengths = [int(x) for x in args.lengths.split(",") if x]
    hybrid_lengths = [int(x) for x in args.hybrid_lengths.split(",") if x]
    tmp = Path(tempfile.mkdtemp(prefix="lmshm-par-", dir="/tmp"))  # short: vLLM puts Unix sockets in TMPDIR
    load_start = os.getloadavg()
    t_start = time.perf_counter()
    try:
        llama, gemma = tmp / "llama", tmp / "gemma3"
        for path, flag in ((llama, []), (gemma, ["--hybrid"])):
            subprocess.run([str(VLLM_PYTHON), *ENGINE, "build", str(path), *flag], check=True,
                           env=engine_env(tmp, 1), capture_output=True)
        rows, notes = [], []
        with BenchServer("--capacity", "2GiB") as server:
            for name, tag, model, tp, lens, seed in (("TP=2 Llama", "tp2", llama, 2, lengths, 11),
                                                      ("TP=1 hybrid Gemma3", "hybrid", gemma, 1, hybrid_lengths, 12)):
                if not lens:
                    continue
                first, pairs, wall, stored = run_config(tag, model, server.url, tmp, tp, lens, n,
                                                        args.chunk_tokens, seed)
                rows += [(name, length, first, pairs) for length in lens]
                notes.append(f"{name}: one engine process, {wall:.0f} s from start to exit; "
                             f"{stored} chunks stored by batch 0")
            pool = query_status(server.url).pool
        print(f"lmshm TTFT, miss vs hit: vLLM 0.32.0 CPU, tiny random models (float32), block 32, "
              f"chunk {args.chunk_tokens} tokens, max_tokens=1, vLLM prefix caching off; "
              f"{n} prompts per length; {os.cpu_count()} CPUs, Python {platform.python_version()}")
        print(f"load average at start {load_start[0]:.2f}, at end {os.getloadavg()[0]:.2f} "
              f"(the machine is shared with other work); total {time.perf_counter() - t_start:.0f} s")
        for note in notes:
            print(note)
        print()
        table(rows)
        print()
        print("first: batch 0 (LOOKUP misses, computes, stores); miss: batch 1, loads and stores off (computes "
              "the whole prompt); hit: batch 1, right after its miss, same prompt (loads from lmshm). "
              "speedup: miss median / hit median; pairwise: median of per-prompt miss/hit; "
              "computed: prompt - cached tokens (medians)")
        print(f"server: stored {pool.stored}, retrieved {pool.retrieved}, failed {pool.failed}, leases {pool.leases}; "
              f"exit status after SIGTERM {server.returncode}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


def _vllm_cpu_shm() -> set[Path]:
    """vLLM's CPU tensor-parallel communicator never unlinks its /dev/shm segments."""
    return set(Path("/dev/shm").glob("vllm_dist_*-cpushm*"))


if __name__ == "__main__":
    _before = _vllm_cpu_shm()
    try:
        sys.exit(main())
    finally:
        for _leftover in _vllm_cpu_shm() - _before:   # the ones our TP engines left
            _leftover.unlink(missing_ok=True)
