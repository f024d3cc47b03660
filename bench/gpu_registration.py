"""GPU benchmark of the three CUDA wrappers (run by scripts/gpu-check; needs one CUDA GPU).

For each wrapper kind -- cuda-torch (PyTorch storage sharing), cuda-raw (legacy IPC handles),
cuda-vmm (VMM, POSIX-fd handles) -- a spawned producer allocates and wraps, and this process
(the consumer, in the server's role) decodes and maps. Measured:

- register 64 views: 64 layer views of ONE allocation (64 x --layer-mib MiB): producer wrap +
  serialize, plus consumer decode + ``to_tensor()`` of all 64 (transport not included), in ms;
- opens: driver-level opens in the consumer for those 64 (1 is the goal: one per allocation);
- register 64 allocs / opens: the same for 64 SEPARATE allocations (64 opens expected);
- copy GB/s: the consumer copies all 64 mapped layers into a local buffer (device to device),
  against the same copy from a local source; ratio = mapped / local (1.0: no penalty);
- reclaim ms: the producer holding a --reclaim-gib GiB pool that the consumer maps is
  SIGKILLed; time until the device's free memory is back to within 5% of the pool of what it
  was before that producer started, the consumer releasing its mappings as soon as it sees the
  death (what the server's reclaim does); pinned: the share still missing after the death,
  before the release.

Usage: python bench/gpu_registration.py [--layers 64] [--layer-mib 32] [--reclaim-gib 4]
           [--kinds cuda-torch,cuda-raw,cuda-vmm] [--json OUT.json] [--table OUT.txt]
The table is printed last (and written to --table if given).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

# The spawned-producer helpers are test code, not part of the lmshm package: they live beside the
# GPU tests (tests/v1/platform/cuda/cuda_testing.py). Spawned producers inherit this sys.path.
_HELPERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "tests", "v1", "platform", "cuda")
sys.path.insert(0, os.path.normpath(_HELPERS))

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import no_cuda_device, parse_args, skip


def log(msg: str) -> None:
    print(f"[gpu-bench] {msg}", file=sys.stderr, flush=True)


def copy_bandwidth(srcs: list, reps: int = 5) -> tuple[float, float]:
    """GB/s copying ``srcs`` (mapped) into a local buffer, and the same from a local source."""
    import torch

    nbytes = sum(t.numel() * t.element_size() for t in srcs)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=srcs[0].device)
    local = torch.empty_like(dst)
    flat = [t.reshape(-1).view(torch.uint8) for t in srcs]
    local_parts, dst_parts, off = [], [], 0
    for f in flat:
        dst_parts.append(dst[off:off + f.numel()])
        local_parts.append(local[off:off + f.numel()])
        off += f.numel()

    def timed(sources: list) -> float:
        for d, s in zip(dst_parts, sources):   # warm-up
            d.copy_(s)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            for d, s in zip(dst_parts, sources):
                d.copy_(s)
        end.record()
        end.synchronize()
        return nbytes * reps / (start.elapsed_time(end) / 1e3) / 1e9

    mapped_bw = timed(flat)
    local_bw = timed(local_parts)
    del dst, local
    return mapped_bw, local_bw


def register(producer, kind: str, views: list, name: str = "pool", session: str = "bench") -> tuple[dict, list, list]:
    import torch
    from cuda_testing import open_count, receive

    opens = open_count(kind)
    out = producer.call("wrap_views", name, kind, views, timeout_s=300)
    t0 = time.perf_counter()
    wrappers = [receive(p, out["fds"] if i == 0 else None, session) for i, p in enumerate(out["payloads"])]
    tensors = [w.to_tensor() for w in wrappers]
    torch.cuda.synchronize()
    map_s = time.perf_counter() - t0
    stats = {"wrap_ms": out["wrap_s"] * 1e3, "map_ms": map_s * 1e3,
             "register_ms": (out["wrap_s"] + map_s) * 1e3, "opens": open_count(kind) - opens}
    return stats, wrappers, tensors


def release(producer, wrappers: list, tensors: list, session: str = "bench") -> None:
    from cuda_testing import release_consumer_side

    release_consumer_side(wrappers, tensors, session)
    producer.call("close_wrappers")


def bench_kind(kind: str, layers: int, layer_bytes: int, reclaim_bytes: int) -> dict:
    from cuda_testing import Producer, measure_reclaim

    memory = "vmm" if kind == "cuda-vmm" else "torch"
    row: dict = {"kind": kind}
    with Producer() as producer:
        producer.call("alloc", "pool", (layers, layer_bytes), "uint8", memory=memory)
        stats, ws, ts = register(producer, kind, [(("select", 0, i),) for i in range(layers)])
        row["views"] = stats
        row["copy_gbps"], row["local_gbps"] = copy_bandwidth(ts)
        release(producer, ws, ts)
        producer.call("free", "pool")
        for i in range(layers):
            producer.call("alloc", f"layer{i}", (layer_bytes,), "uint8", memory=memory)
        stats, ws, ts = register(producer, kind, [("tensor", f"layer{i}") for i in range(layers)])
        row["allocs"] = stats
        release(producer, ws, ts)
    log(f"{kind}: registration and copy done; measuring reclaim of a {reclaim_bytes >> 30} GiB pool")
    row["reclaim"] = measure_reclaim(kind, reclaim_bytes, session="bench-reclaim")
    return row


def environment() -> str:
    import torch

    parts = [torch.cuda.get_device_name(0)]
    try:
        drv = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout.split("\n")[0].strip()
        parts.append(f"driver {drv}")
    except (OSError, subprocess.SubprocessError):
        pass
    parts.append(f"Python {sys.version.split()[0]}")
    parts.append(f"torch {torch.__version__}")
    for mod, label in (("cupy", "cupy"), ("cuda.bindings", "cuda-bindings")):
        try:
            m = __import__(mod, fromlist=["__version__"])
            parts.append(f"{label} {m.__version__}")
        except Exception:
            parts.append(f"{label} missing")
    return ", ".join(parts)


def table(rows: list[dict], env: str, layers: int, layer_mib: int, reclaim_gib: int) -> str:
    lines = [
        f"lmshm GPU registration benchmark -- {env}",
        f"{layers} layers x {layer_mib} MiB; register = producer wrap+serialize + consumer decode+map "
        f"(transport excluded); reclaim pool {reclaim_gib} GiB",
        "",
        f"{'wrapper':<11} {'64 views ms':>11} {'opens':>5} {'64 allocs ms':>12} {'opens':>5} "
        f"{'copy GB/s':>9} {'local GB/s':>10} {'ratio':>5} {'reclaim ms':>10} {'pinned':>6}",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['kind']:<11} FAILED: {r['error']}")
            continue
        rc = r["reclaim"]
        lines.append(
            f"{r['kind']:<11} {r['views']['register_ms']:>11.1f} {r['views']['opens']:>5d} "
            f"{r['allocs']['register_ms']:>12.1f} {r['allocs']['opens']:>5d} "
            f"{r['copy_gbps']:>9.0f} {r['local_gbps']:>10.0f} {r['copy_gbps'] / r['local_gbps']:>5.2f} "
            f"{rc['reclaim_s'] * 1e3:>10.0f} {rc['pinned_frac']:>6.0%}"
        )
    lines.append("(opens: driver opens in the consumer; pinned: share of the pool still held after the "
                 "producer died, before the consumer released its mappings)")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=64)
    ap.add_argument("--layer-mib", type=int, default=32)
    ap.add_argument("--reclaim-gib", type=int, default=4)
    ap.add_argument("--kinds", default="cuda-torch,cuda-raw,cuda-vmm")
    ap.add_argument("--json", help="write the raw figures here")
    ap.add_argument("--table", help="also write the table here")
    args = parse_args(ap, smoke={"layers": 4, "layer_mib": 2, "reclaim_gib": 1})
    if args.smoke and no_cuda_device():
        skip("no CUDA device visible (gpu_registration registers GPU memory)")

    import torch

    if not torch.cuda.is_available():
        if args.smoke:
            skip("no CUDA device visible (gpu_registration registers GPU memory)")
        print("gpu_registration: no CUDA device visible", file=sys.stderr)
        return 2
    torch.cuda.init()
    env = environment()
    log(env)
    rows = []
    for kind in args.kinds.split(","):
        t0 = time.monotonic()
        try:
            rows.append(bench_kind(kind, args.layers, args.layer_mib << 20, args.reclaim_gib << 30))
        except Exception as exc:
            log(f"{kind} failed: {exc}")
            rows.append({"kind": kind, "error": str(exc).splitlines()[-1][:200]})
        log(f"{kind}: {time.monotonic() - t0:.1f} s")
    text = table(rows, env, args.layers, args.layer_mib, args.reclaim_gib)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": env, "layers": args.layers, "layer_mib": args.layer_mib,
                       "reclaim_gib": args.reclaim_gib, "rows": rows}, f, indent=2)
    if args.table:
        with open(args.table, "w") as f:
            f.write(text + "\n")
    print(text, flush=True)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
