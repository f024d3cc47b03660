"""A GPU worker for the end-to-end test: allocates CUDA KV caches and registers them with
lmshm-server through ``MPClient``, prints one JSON line, then waits (to be SIGKILLed).

Run as a script by test_cuda_server_e2e.py; not a test module.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--fd-socket", default=None)
    ap.add_argument("--kind", required=True, choices=["cuda-torch", "cuda-raw", "cuda-vmm"])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--layer-bytes", type=int, default=256 << 20)
    args = ap.parse_args()

    import torch
    from cuda_testing import fill_pattern

    from lmshm.platform import ipc_policy
    from lmshm.platform.cuda import empty_vmm
    from lmshm.transport.client import MPClient

    ipc_policy.set_isolated_ipc(args.kind == "cuda-raw")
    ipc_policy.set_use_vmm_api(args.kind == "cuda-vmm")
    shape = (args.layers, args.layer_bytes // 2)
    if args.kind == "cuda-vmm":
        pool = empty_vmm(shape, torch.float16, "cuda")       # one chunk: layer views stay inside it
    else:
        pool = torch.empty(shape, dtype=torch.float16, device="cuda")
    u8 = pool.view(torch.uint8).view(-1)
    fill_pattern(u8)
    torch.cuda.synchronize()
    # Hold the pool and nothing else: cached scratch freed by this process's death would pass
    # for the pool coming back in the test's measurement.
    torch.cuda.empty_cache()
    layers = {f"model.layers.{i}.attn": pool[i] for i in range(args.layers)}
    client = MPClient(args.url, fd_socket=args.fd_socket, client_name="gpu-worker", timeout_s=30)
    iid = client.register_kv_caches(layers, model_name="gpu-e2e", world_size=1, rank=0)
    head = bytes(pool[1].view(torch.uint8)[:32].cpu().tolist()).hex()
    sys.stdout.write(json.dumps({"ok": True, "pid": os.getpid(), "instance_id": iid, "head": head,
                                 "pool_bytes": u8.numel()}) + "\n")
    sys.stdout.flush()
    while True:           # keep the pool alive until the test kills this process
        time.sleep(3600)


if __name__ == "__main__":
    sys.exit(main())
