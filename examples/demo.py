"""The end-to-end demo behind ``scripts/demo``: one server, two workers, zero copies.

Run it with ``scripts/demo`` (which builds .venv first) or ``python examples/demo.py`` in a
venv that has lmshm installed. It starts its workers and engines as this same script.

1. starts ``lmshm-server`` as a subprocess on a free port;
2. starts two worker processes; each allocates 8 layers of [2, 64, 16, 8, 64] fp16 KV cache
   with ``empty_shared`` (in shared memory from birth) and registers them with ``MPClient``;
3. runs ``lmshm status`` and prints its table;
4. proves zero copy: each worker writes a marker into layer 3 *after* registering, and the
   server reads it back through its own mapping (the PEEK request). Then the worker writes a
   second marker and the server sees that one too -- a copy taken at registration could not;
5. two engine processes share a prompt prefix: engine A computes a prompt (a toy model whose
   KV costs real arithmetic: a few matmuls per block and layer) and stores it; engine B gets
   the same 3,072-token prefix with another question, loads the prefix from lmshm and computes
   only the rest. It prints the hit rate and the time saved against computing it all, and
   checks that the reused KV is bit-identical to what B computes itself;
6. shuts down: the workers unregister and exit, the server gets SIGTERM and must exit 0, and
   no ``lmshm-`` segment may be left in /dev/shm. While it runs the server's status page and
   metrics are on an HTTP port it prints.
Exit status 0 when every step held.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import select
import signal
import subprocess
import sys
import time

SELF = os.path.abspath(__file__)     # workers and engines are this script too
LAYERS = 8
SHAPE = (2, 64, 16, 8, 64)  # [k/v, blocks, block size, kv heads, head dim]
PROBE_LAYER = "model.layers.3.self_attn"


def _segments() -> set[str]:
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith("lmshm-")}
    except FileNotFoundError:
        return set()


def _readline(proc: subprocess.Popen, what: str, timeout_s: float = 60) -> str:
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    line = proc.stdout.readline() if ready else ""
    if not line:
        raise RuntimeError(f"{what} did not answer (exit status {proc.poll()})")
    return line


# ---- worker side --------------------------------------------------------------------------

def _marker(index: int, round_: int) -> bytes:
    return f"worker {index} round {round_}".encode()


def worker_main(url: str, index: int) -> int:
    import torch

    from lmshm import MPClient
    from lmshm.platform.cpu import empty_shared

    kv_caches = {f"model.layers.{i}.self_attn": empty_shared(SHAPE, torch.float16) for i in range(LAYERS)}
    for t in kv_caches.values():
        t.zero_()

    def write(round_: int) -> bytes:
        data = _marker(index, round_)
        flat = kv_caches[PROBE_LAYER].view(-1).view(torch.uint8)
        flat[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return data

    with MPClient(url, client_name=f"demo-worker-{index}") as client:
        iid = client.register_kv_caches(kv_caches, f"demo-worker-{index}", model_name="demo-llama-8l",
                                        world_size=2, rank=index)
        write(1)  # after registration: only shared memory can carry it to the server
        nbytes = sum(t.numel() * t.element_size() for t in kv_caches.values())
        print(json.dumps({"instance_id": iid, "pid": os.getpid(), "nbytes": nbytes}), flush=True)
        for line in sys.stdin:
            cmd = line.strip()
            if cmd == "rewrite":
                write(2)
                print(json.dumps({"ok": True}), flush=True)
            elif cmd == "exit":
                break
    return 0


# ---- engine side: a toy model whose KV takes real work to compute --------------------------

BLOCK = 64                          # tokens per KV block
ENGINE_LAYERS, HEADS, HEAD_DIM = 4, 4, 64
HIDDEN = HEADS * HEAD_DIM
PREFIX, QUESTION = 3072, 256        # a shared system prompt, then each engine's own question


def _prompt(question_seed: int) -> list[int]:
    import random

    r = random.Random(0)
    prefix = [r.randrange(1, 32000) for _ in range(PREFIX)]
    q = random.Random(question_seed)
    return prefix + [q.randrange(1, 32000) for _ in range(QUESTION)]


class _ToyModel:
    """KV of a block = a function of its tokens, its position and the block before it
    (chained, as attention's KV depends on the prefix), through a few matmuls per layer."""

    def __init__(self) -> None:
        import torch

        g = torch.Generator().manual_seed(1)
        self.embed = torch.randn(32000, HIDDEN, generator=g) * 0.1
        self.w = [torch.randn(HIDDEN, 2 * HIDDEN, generator=g) * 0.05 for _ in range(ENGINE_LAYERS)]
        self.mix = [torch.randn(HIDDEN, HIDDEN, generator=g) * 0.05 for _ in range(ENGINE_LAYERS)]

    def prefill(self, pool, tokens: list[int], block_ids: list[int], first_block: int = 0) -> None:
        """Compute blocks ``first_block``.. of ``tokens`` into ``pool[block_ids[b]]``."""
        import torch

        carry = None
        if first_block:
            carry = pool[block_ids[first_block - 1], :, 1, -1].float().reshape(ENGINE_LAYERS, HIDDEN)
        for b in range(first_block, len(tokens) // BLOCK):
            x = self.embed[torch.tensor(tokens[b * BLOCK:(b + 1) * BLOCK])]
            for layer in range(ENGINE_LAYERS):
                h = x if carry is None else x + carry[layer]
                for _ in range(6):           # the work a real layer does per block
                    h = torch.tanh(h @ self.mix[layer])
                kv = (h @ self.w[layer]).reshape(BLOCK, 2, HEADS, HEAD_DIM).transpose(0, 1)
                pool[block_ids[b], layer] = kv.half()
            carry = pool[block_ids[b], :, 1, -1].float().reshape(ENGINE_LAYERS, HIDDEN)


def engine_main(url: str, name: str, question: int) -> int:
    """One engine: prefill its prompt, reusing what lmshm holds; report as one JSON line."""
    import torch

    from lmshm.integrations.trtllm import TrtllmKVPool

    tokens = _prompt(question)
    nblocks = len(tokens) // BLOCK
    pool = torch.zeros(nblocks * 2 + 1, ENGINE_LAYERS, 2, BLOCK, HEADS, HEAD_DIM, dtype=torch.float16)
    kv = TrtllmKVPool(pool, model="demo-toy", tokens_per_block=BLOCK, url=url)
    model = _ToyModel()
    try:
        kv.register(f"demo-engine-{name}")
        if not kv.link.wait_connected(30):
            raise RuntimeError("cannot reach lmshm-server")
        mine, again = list(range(nblocks)), list(range(nblocks, 2 * nblocks))
        t0 = time.perf_counter()
        model.prefill(pool, tokens, again)                 # the baseline: everything computed
        alone = time.perf_counter() - t0
        t0 = time.perf_counter()
        matched, lease = kv.lookup(tokens)
        loaded = matched // BLOCK if matched and kv.load(tokens, matched, mine, lease) else 0
        model.prefill(pool, tokens, mine, first_block=loaded)
        with_lmshm = time.perf_counter() - t0
        stored = kv.store(tokens, mine)
        same = bool(torch.equal(pool[mine], pool[again]))
        print(json.dumps({"tokens": len(tokens), "loaded_tokens": loaded * BLOCK, "alone_s": alone,
                          "with_lmshm_s": with_lmshm, "stored_chunks": stored, "identical": same}), flush=True)
    finally:
        kv.close()
    return 0


def _engines(py: str, url: str) -> None:
    print(f"== two engines share a {PREFIX}-token prompt prefix (a toy model on the CPU, {ENGINE_LAYERS} layers)")
    for name, question in (("A", 1), ("B", 2)):
        proc = subprocess.Popen([py, SELF, "engine", "--url", url, "--name", name,
                                 "--question", str(question)], stdout=subprocess.PIPE, text=True)
        try:
            r = json.loads(_readline(proc, f"engine {name}", 180))
        finally:
            if proc.wait(60) != 0:
                raise RuntimeError(f"engine {name} exited {proc.returncode}")
        hit = r["loaded_tokens"] / r["tokens"]
        print(f"   engine {name}: {r['loaded_tokens']} of {r['tokens']} prompt tokens from lmshm ({hit:.0%} hit rate), "
              f"stored {r['stored_chunks']} new chunks")
        if r["loaded_tokens"]:
            saved = r["alone_s"] - r["with_lmshm_s"]
            print(f"   engine {name}: prefill {r['alone_s']:.2f} s computing it all, {r['with_lmshm_s']:.2f} s with "
                  f"lmshm: {saved:.2f} s saved ({r['alone_s'] / max(r['with_lmshm_s'], 1e-6):.0f}x faster)")
        if not r["identical"]:
            raise RuntimeError(f"engine {name}: the KV it loaded differs from the KV it computes")
        if name == "B" and r["loaded_tokens"] < PREFIX:
            raise RuntimeError(f"engine B reused only {r['loaded_tokens']} of the {PREFIX} shared tokens")
    print("   the KV engine B loaded is bit-identical to what it computes itself")


# ---- orchestrator -------------------------------------------------------------------------

def main() -> int:
    py = sys.executable
    segments_before = _segments()
    print("== starting lmshm-server")
    # PEEK is owner-only; the checker below reads other sessions' layers, so the demo makes
    # its own uid an admin (--admin-uid), as an operator's diagnostic tool would be.
    http_port = _free_port()
    server = subprocess.Popen([py, "-m", "lmshm.server", "--port", "0", "--log-level", "WARNING",
                               "--admin-uid", str(os.geteuid()), "--http-port", str(http_port)],
                              stdout=subprocess.PIPE, text=True)
    workers: list[subprocess.Popen] = []
    try:
        ready = _readline(server, "lmshm-server")
        print("   " + ready.strip())
        url = re.search(r"listening on (\S+)", ready).group(1)

        print(f"== starting 2 workers: {LAYERS} layers of {list(SHAPE)} fp16 each, in shared memory")
        for k in range(2):
            workers.append(subprocess.Popen([py, SELF, "worker", "--url", url, "--index", str(k)],
                                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
        infos = [json.loads(_readline(w, f"worker {k}")) for k, w in enumerate(workers)]
        for info in infos:
            print(f"   worker pid {info['pid']} registered {info['instance_id']!r} ({info['nbytes'] >> 20} MiB)")

        print("== lmshm status")
        table = subprocess.run([py, "-m", "lmshm.cli", "status", "--url", url], capture_output=True, text=True,
                               timeout=60)
        print("\n".join("   " + line for line in table.stdout.splitlines()))
        if table.returncode != 0:
            raise RuntimeError(f"lmshm status failed: {table.stderr}")

        print("== zero copy: the server reads the workers' writes through its own mappings")
        from lmshm import MPClient

        with MPClient(url, client_name="demo-checker", heartbeat=False) as checker:
            for k, (w, info) in enumerate(zip(workers, infos)):
                for round_ in (1, 2):
                    if round_ == 2:
                        w.stdin.write("rewrite\n")
                        w.stdin.flush()
                        _readline(w, f"worker {k}")
                    want = _marker(k, round_)
                    got = checker.peek(info["instance_id"], PROBE_LAYER, 0, len(want))
                    verdict = "ok" if got == want else "MISMATCH"
                    read = got.decode(errors="replace")
                    print(f"   worker {k} wrote {want.decode()!r:22} -> server read {read!r:22} {verdict}")
                    if got != want:
                        raise RuntimeError("the server does not see the worker's memory")

        _engines(py, url)
        print(f"== while it runs, the server's status page is http://127.0.0.1:{http_port}/status "
              f"(metrics: /metrics)")

        print("== shutting down")
        for w in workers:
            w.stdin.write("exit\n")
            w.stdin.flush()
        for k, w in enumerate(workers):
            if w.wait(30) != 0:
                raise RuntimeError(f"worker {k} exited {w.returncode}")
        left = json.loads(subprocess.run([py, "-m", "lmshm.cli", "status", "--url", url, "--json"],
                                         capture_output=True, text=True, timeout=60).stdout)
        print(f"   workers exited; the server holds {len(left['registrations'])} registration(s), "
              f"{left['mappings']} mapping(s)")
        server.send_signal(signal.SIGTERM)
        rc = server.wait(30)
        print(f"   lmshm-server exited with status {rc} after SIGTERM")
        deadline = time.monotonic() + 5
        while (leaked := _segments() - segments_before) and time.monotonic() < deadline:
            time.sleep(0.05)
        if rc != 0 or left["registrations"] or leaked:
            raise RuntimeError(f"unclean shutdown: server status {rc}, leftovers {sorted(leaked)}")
        print("   /dev/shm holds no lmshm segment. Done.")
        return 0
    except Exception as exc:
        print(f"demo failed: {exc}", file=sys.stderr)
        return 1
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
                w.wait()
        if server.poll() is None:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                server.kill()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="python examples/demo.py")
    sub = ap.add_subparsers(dest="role")
    w = sub.add_parser("worker")
    w.add_argument("--url", required=True)
    w.add_argument("--index", type=int, required=True)
    e = sub.add_parser("engine")
    e.add_argument("--url", required=True)
    e.add_argument("--name", required=True)
    e.add_argument("--question", type=int, required=True)
    ns = ap.parse_args()
    if ns.role == "worker":
        sys.exit(worker_main(ns.url, ns.index))
    sys.exit(engine_main(ns.url, ns.name, ns.question) if ns.role == "engine" else main())
