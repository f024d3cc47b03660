"""Time to first token of the tiny vLLM engine with and without lmshm hits.

    .venv/bin/python bench/vllm_ttft.py [--prompts 3] [--lengths 1024,4096]

Needs .venv-vllm (scripts/bootstrap-vllm). Builds the tiny random Llama of the real-engine tests,
starts one lmshm-server, and runs three engine processes one after another (single-process
mode, vLLM prefix caching off), each serving the same prompts one at a time with max_tokens=1:

- ``no connector``: vLLM alone;
- ``lmshm, miss``: LmshmConnector on an empty server (computes and stores);
- ``lmshm, hit``: a new engine process, same prompts (loads from lmshm).

Prints per prompt length the prompt tokens computed and the median time to first token (one
warm-up prompt per engine is not counted).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
from _server import BenchServer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# Run as a module: as a script, its directory would shadow the vllm package with lmshm's vllm.py.
ENGINE = ["-m", "lmshm.integrations.vllm_engine"]
VLLM_PYTHON = Path(os.environ.get("LMSHM_VLLM_VENV", ROOT / ".venv-vllm")) / "bin" / "python"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=3, help="prompts per length")
    ap.add_argument("--lengths", default="1024,4096")
    ap.add_argument("--chunk-tokens", type=int, default=256)
    args = ap.parse_args()
    if not VLLM_PYTHON.exists():
        print(f"{VLLM_PYTHON} is missing: run scripts/bootstrap-vllm", file=sys.stderr)
        return 2
    lengths = [int(x) for x in args.lengths.split(",")]
    r = random.Random(11)
    warmup = [r.randrange(1, 500) for _ in range(300)]
    prompts = [[r.randrange(1, 500) for _ in range(n)] for n in lengths for _ in range(args.prompts)]
    tmp = Path(tempfile.mkdtemp(prefix="lmshm-ttft-", dir="/tmp"))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
           "DO_NOT_TRACK": "1", "VLLM_CPU_KVCACHE_SPACE": "2", "TMPDIR": str(tmp),
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    model = tmp / "model"
    subprocess.run([str(VLLM_PYTHON), *ENGINE, "build", str(model)], check=True, env=env, capture_output=True)
    batch = tmp / "batch.json"
    batch.write_text(json.dumps([warmup, *prompts]))
    results = {}
    with BenchServer("--capacity", "2GiB") as server:
        for name, extra in (("no connector", ["--no-connector"]), ("lmshm, miss", []), ("lmshm, hit", [])):
            out = tmp / "out.json"
            proc = subprocess.run(
                [str(VLLM_PYTHON), *ENGINE, "serve", str(model), server.url, str(out), "--batch", str(batch),
                 "--max-tokens", "1", "--block-size", "32", "--chunk-tokens", str(args.chunk_tokens), *extra],
                env=env, capture_output=True, text=True)
            if proc.returncode:
                print(proc.stdout[-3000:], proc.stderr[-3000:], file=sys.stderr)
                return 1
            results[name] = json.loads(out.read_text())["batches"][0][1:]
    print(f"tiny Llama (2 layers, 128 hidden, float32), CPU, block 32, chunk {args.chunk_tokens} tokens, "
          f"{args.prompts} prompts per length, {os.cpu_count()} CPUs; server exit status {server.returncode}")
    print(f"{'engine':<14} {'prompt':>7} {'computed':>9} {'from lmshm':>11} {'TTFT ms':>9} {'x vLLM alone':>13}")
    for n in lengths:
        base = statistics.median(x["seconds"] for x in results["no connector"] if x["prompt"] == n)
        for name, rs in results.items():
            mine = [x for x in rs if x["prompt"] == n]
            ttft = statistics.median(x["seconds"] for x in mine)
            cached = statistics.median(x["cached"] for x in mine)
            print(f"{name:<14} {n:>7} {n - cached:>9.0f} {cached:>11.0f} {ttft * 1e3:>9.1f} {ttft / base:>13.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
