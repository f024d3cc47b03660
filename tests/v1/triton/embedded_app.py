"""A cache-server application that embeds lmshm in-process: ``lmshm.Server`` plus a command pipe.

The test process starts it (``python embedded_app.py '<settings as JSON>'``) and drives it with
one JSON command per stdin line, answered by one JSON line: ``{"ok": true, ...}`` or
``{"ok": false, "code": "NOT_FOUND", "message": ...}``. Bytes travel as hex. The commands use
only the public in-process API: views of regions, status, registrations, stop.
"""

from __future__ import annotations

import json
import os
import sys

import torch

import lmshm


def main() -> int:
    settings = json.loads(sys.argv[1])
    server = lmshm.Server(lmshm.ServerConfig(**settings), api_version=lmshm.API_VERSION).start()
    views: dict[int, lmshm.View] = {}
    next_view = 1
    print(json.dumps({"ok": True, "pid": os.getpid(), "url": server.url, "http_port": server.http_port,
                      "grpc_port": server.grpc_port, "fd_socket": server.fd_socket}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("op")
        try:
            if op == "view":
                views[next_view] = server.region_view(cmd["name"], cmd.get("offset", 0), cmd.get("byte_size"))
                out = {"view": next_view, "bytes": views[next_view].tensor.numel()}
                next_view += 1
            elif op == "layer_view":
                views[next_view] = server.layer_view(cmd["instance_id"], cmd["layer"])
                views[next_view].tensor = views[next_view].tensor.view(torch.uint8).flatten()
                out = {"view": next_view, "bytes": views[next_view].tensor.numel()}
                next_view += 1
            elif op == "unregister":
                out = {"deferred": server.unregister(cmd["instance_id"])}
            elif op == "write":
                data = bytes.fromhex(cmd["hex"])
                t = views[cmd["view"]].tensor
                t[cmd.get("at", 0):cmd.get("at", 0) + len(data)] = torch.frombuffer(
                    bytearray(data), dtype=torch.uint8).to(t.device)
                if t.is_cuda:
                    torch.cuda.synchronize(t.device)
                out = {}
            elif op == "read":
                t = views[cmd["view"]].tensor
                out = {"hex": t[:cmd.get("n", t.numel())].cpu().numpy().tobytes().hex()}
            elif op == "close":
                views.pop(cmd["view"]).close()
                out = {}
            elif op == "register_system":
                server.register_system_region(cmd["name"], cmd["key"], cmd["byte_size"], cmd.get("offset", 0))
                out = {}
            elif op == "status":
                st = server.status()
                out = {"draining": st.draining, "mappings": st.mappings, "open_fds": st.open_fds,
                       "registrations": [[r.instance_id, r.kind] for r in st.registrations]}
            elif op == "metrics":
                out = {"text": server.metrics_text().decode()}
            elif op == "stop":
                for v in views.values():
                    v.close()
                server.stop()
                print(json.dumps({"ok": True}), flush=True)
                return 0
            else:
                raise ValueError(f"unknown op {op!r}")
            print(json.dumps({"ok": True, **out}), flush=True)
        except lmshm.ServerError as exc:
            print(json.dumps({"ok": False, "code": exc.code.name, "message": exc.message}), flush=True)
    server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
