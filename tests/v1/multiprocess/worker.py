"""A worker process for the service tests: an MPClient driven by JSON lines on stdin.

Started by ``conftest.WorkerProcess``. Prints one JSON line when connected, then answers each
command line with one JSON line. Not a test module (pytest collects ``test_*.py`` only).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--heartbeat", type=float, default=0.1, help="heartbeat interval, seconds")
    ap.add_argument("--fd-socket", default=None)
    ap.add_argument("--name", default="test-worker")
    args = ap.parse_args()

    import torch

    from lmshm.multiprocess import client as client_mod
    from lmshm.platform.cpu import empty_shared, segment_of

    def out(obj: dict) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    try:
        client = client_mod.MPClient(args.url, client_name=args.name, fd_socket=args.fd_socket,
                                     heartbeat_interval_s=args.heartbeat, timeout_s=5)
    except client_mod.LmshmError as exc:
        out({"ok": False, "pid": os.getpid(), "error": type(exc).__name__, "message": str(exc),
             "code": int(getattr(exc, "code", 0))})
        return 0
    out({"ok": True, "pid": os.getpid(), "session": client.session_id})

    caches: dict[str, dict[str, torch.Tensor]] = {}

    def allocate(n: int, shape: list[int], layout: str) -> dict[str, torch.Tensor]:
        if layout == "one":
            pool = empty_shared((n, *shape), torch.float16)
            return {f"model.layers.{i}.attn": pool[i] for i in range(n)}
        return {f"model.layers.{i}.attn": empty_shared(shape, torch.float16) for i in range(n)}

    def register(cmd: dict) -> dict:
        layers = allocate(cmd.get("layers", 4), cmd.get("shape", [2, 8, 16]), cmd.get("layout", "per-layer"))
        iid = client.register_kv_caches(layers, cmd.get("instance_id"), model_name=cmd.get("model", "test-model"),
                                        world_size=cmd.get("world_size", 1), rank=cmd.get("rank", 0))
        caches[iid] = layers
        segs = sorted({segment_of(t).name for t in layers.values()})
        return {"instance_id": iid, "segments": segs, "layers": list(layers)}

    def handle(cmd: dict) -> dict:
        op = cmd["op"]
        if op == "register":
            return register(cmd)
        if op == "register_same":  # the very tensors of an earlier registration, under a new id
            iid = client.register_kv_caches(caches[cmd["of"]], cmd.get("instance_id"))
            caches[iid] = caches[cmd["of"]]
            return {"instance_id": iid}
        if op == "fill":
            t = caches[cmd["instance_id"]][cmd["layer"]]
            t.view(-1).view(torch.uint8)[: len(cmd["bytes"])] = torch.tensor(cmd["bytes"], dtype=torch.uint8)
            return {}
        if op == "unregister":
            deferred = client.unregister_kv_caches(cmd["instance_id"])
            caches.pop(cmd["instance_id"], None)
            return {"deferred": deferred}
        if op == "peek":
            return {"bytes": list(client.peek(cmd["instance_id"], cmd["layer"], 0, cmd.get("length", 8)))}
        if op == "registered":
            return {"ids": client.registered(), "reregistrations": client.reregistrations}
        if op == "loop":  # register/unregister for a bounded count and time
            deadline = time.monotonic() + cmd["seconds"]
            n = 0
            while n < cmd["iterations"] and time.monotonic() < deadline:
                r = register({**cmd, "instance_id": f"{cmd['prefix']}-{n}"})
                client.unregister_kv_caches(r["instance_id"])
                caches.pop(r["instance_id"])
                n += 1
            return {"iterations": n}
        if op == "close":
            client.close()
            return {}
        raise ValueError(f"unknown op {op!r}")

    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "exit":
            break
        try:
            out({"ok": True, **handle(cmd)})
        except client_mod.ServerError as exc:
            out({"ok": False, "error": type(exc).__name__, "code": int(exc.code), "message": exc.message})
        except Exception as exc:  # noqa: BLE001 - report, keep serving
            out({"ok": False, "error": type(exc).__name__, "message": str(exc), "trace": traceback.format_exc()})
    client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
