"""The end-to-end demo behind ``scripts/demo``: one server, two workers, zero copies.

1. starts ``lmshm-server`` as a subprocess on a free port;
2. starts two worker processes; each allocates 8 layers of [2, 64, 16, 8, 64] fp16 KV cache
   with ``empty_shared`` (in shared memory from birth) and registers them with ``MPClient``;
3. runs ``lmshm status`` and prints its table;
4. proves zero copy: each worker writes a marker into layer 3 *after* registering, and the
   server reads it back through its own mapping (the PEEK request). Then the worker writes a
   second marker and the server sees that one too -- a copy taken at registration could not;
5. shuts down: the workers unregister and exit, the server gets SIGTERM and must exit 0, and
   no ``lmshm-`` segment may be left in /dev/shm.
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


# ---- orchestrator -------------------------------------------------------------------------

def main() -> int:
    py = sys.executable
    segments_before = _segments()
    print("== starting lmshm-server")
    # PEEK is owner-only; the checker below reads other sessions' layers, so the demo makes
    # its own uid an admin (--admin-uid), as an operator's diagnostic tool would be.
    server = subprocess.Popen([py, "-m", "lmshm.server", "--port", "0", "--log-level", "WARNING",
                               "--admin-uid", str(os.geteuid())], stdout=subprocess.PIPE, text=True)
    workers: list[subprocess.Popen] = []
    try:
        ready = _readline(server, "lmshm-server")
        print("   " + ready.strip())
        url = re.search(r"listening on (\S+)", ready).group(1)

        print(f"== starting 2 workers: {LAYERS} layers of {list(SHAPE)} fp16 each, in shared memory")
        for k in range(2):
            workers.append(subprocess.Popen([py, "-m", "lmshm.demo", "worker", "--url", url, "--index", str(k)],
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
                    print(f"   worker {k} wrote {want.decode()!r:22} -> server read {got.decode(errors='replace')!r:22} {verdict}")
                    if got != want:
                        raise RuntimeError("the server does not see the worker's memory")

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
    except Exception as exc:  # noqa: BLE001 - report and clean up
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


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="python -m lmshm.demo")
    sub = ap.add_subparsers(dest="role")
    w = sub.add_parser("worker")
    w.add_argument("--url", required=True)
    w.add_argument("--index", type=int, required=True)
    ns = ap.parse_args()
    sys.exit(worker_main(ns.url, ns.index) if ns.role == "worker" else main())
