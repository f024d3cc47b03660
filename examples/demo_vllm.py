"""The vLLM demo behind ``scripts/demo-vllm``: two engine processes share a prompt prefix
through lmshm-server.

1. builds a tiny random Llama (no download) and starts ``lmshm-server``;
2. engine 1, a real vLLM process with ``LmshmConnector``, answers a prompt: a 2,048-token
   shared context plus question 1. It computes every token and stores whole chunks;
3. engine 2, a *new* process, answers the same context plus question 2: the context comes from
   lmshm, only the question is computed;
4. a third process, vLLM alone (no connector), answers prompt 2 as the reference: engine 2's
   greedy output must be the same;
5. prints the tokens saved and ``lmshm status``, stops the server (exit status 0) and checks
   that nothing of lmshm is left in /dev/shm.

Needs ``.venv-vllm`` (``scripts/bootstrap-vllm``); the engines are ``tools/vllm_engine.py``, run
with the lmshm of this checkout. Exit status 0 when every step held.
"""

from __future__ import annotations

import json
import os
import random
import re
import select
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENGINE = [str(ROOT / "tools" / "vllm_engine.py")]
CONTEXT, QUESTION = 2048, 200


def _segments() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("lmshm-")} if os.path.isdir("/dev/shm") else set()


def main() -> int:
    vpy = Path(os.environ.get("LMSHM_VLLM_VENV", ROOT / ".venv-vllm")) / "bin" / "python"
    if not vpy.exists():
        print(f"demo-vllm: {vpy} is missing; run scripts/bootstrap-vllm", file=sys.stderr)
        return 2
    before = _segments()
    tmp = Path(tempfile.mkdtemp(prefix="lmshm-demo-", dir="/tmp"))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
           "DO_NOT_TRACK": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "TMPDIR": str(tmp),
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_LOGGING_LEVEL": "WARNING", "PYTHONPATH": str(ROOT)}
    r = random.Random(2026)
    context = [r.randrange(1, 500) for _ in range(CONTEXT)]
    prompts = [context + [r.randrange(1, 500) for _ in range(QUESTION)] for _ in range(2)]
    server = None
    try:
        print("== building a tiny random Llama (2 layers, float32; no download)")
        subprocess.run([str(vpy), *ENGINE, "build", str(tmp / "model")], check=True, env=env, capture_output=True)
        print("== starting lmshm-server")
        server = subprocess.Popen([sys.executable, "-m", "lmshm.server", "--port", "0",
                                   "--capacity", "512MiB", "--log-level", "WARNING"], stdout=subprocess.PIPE,
                                  text=True, env={**os.environ, "TMPDIR": str(tmp)})
        ready, _, _ = select.select([server.stdout], [], [], 60)
        line = server.stdout.readline() if ready else ""
        m = re.search(r"listening on (\S+)", line)
        if not m:
            raise RuntimeError(f"lmshm-server did not start: {line!r}")
        url = m.group(1)
        print("   " + line.strip())

        def engine(name: str, prompt: list[int], *extra: str) -> dict:
            (tmp / "p.json").write_text(json.dumps([prompt]))
            out = tmp / f"{name}.json"
            proc = subprocess.run([str(vpy), *ENGINE, "serve", str(tmp / "model"), url, str(out), "--batch",
                                   str(tmp / "p.json"), "--chunk-tokens", "256", "--max-tokens", "16", *extra],
                                  env=env, capture_output=True, text=True)
            if proc.returncode:
                raise RuntimeError(f"{name} failed ({proc.returncode}):\n{proc.stdout[-3000:]}")
            return json.loads(out.read_text())["batches"][0][0]

        print(f"== engine 1: {CONTEXT}-token context + question 1")
        e1 = engine("engine1", prompts[0])
        print(f"   computed {e1['prompt'] - e1['cached']} of {e1['prompt']} prompt tokens in {e1['seconds']:.2f} s")
        print("== engine 2 (a new process): the same context + question 2")
        e2 = engine("engine2", prompts[1])
        print(f"   computed {e2['prompt'] - e2['cached']} of {e2['prompt']} prompt tokens in {e2['seconds']:.2f} s; "
              f"{e2['cached']} came from lmshm")
        print("== vLLM alone (no connector) on prompt 2, the reference")
        ref = engine("reference", prompts[1], "--no-connector")
        same = ref["output"] == e2["output"]
        print(f"   reference computed {ref['prompt']} tokens in {ref['seconds']:.2f} s; "
              f"engine 2's output {'matches' if same else 'DIFFERS from'} it: {e2['output']}")
        print("== lmshm status")
        st = subprocess.run([sys.executable, "-m", "lmshm.cli", "status", "--url", url], capture_output=True,
                            text=True, timeout=60)
        print("\n".join("   " + x for x in st.stdout.splitlines()))
        saved = e2["cached"]
        ok = same and saved >= CONTEXT // 256 * 256 and e1["cached"] == 0
        print(f"== {saved} of {e2['prompt']} prompt tokens saved ({100 * saved / e2['prompt']:.0f} %)")
    except Exception as exc:
        print(f"demo-vllm: {exc}", file=sys.stderr)
        ok = False
    finally:
        if server is not None:
            server.terminate()
            rc = server.wait(30)
            print(f"== lmshm-server stopped, exit status {rc}")
            ok = ok and rc == 0
        shutil.rmtree(tmp, ignore_errors=True)
    left = _segments() - before
    if left:
        print(f"demo-vllm: left in /dev/shm: {sorted(left)}", file=sys.stderr)
    ok = ok and not left
    print("demo-vllm: OK" if ok else "demo-vllm: FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
