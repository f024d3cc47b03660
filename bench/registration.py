"""Registration and reclaim figures for lmshm-server on CPU. A script, not a test.

    .venv/bin/python bench/registration.py [--reps 30] [--pings 1000] [--kills 5]

Starts lmshm-server as a subprocess on a free port, then measures, side by side in one run:
- the median empty PING round trip (MPClient.ping);
- the median end-to-end ``MPClient.register_kv_caches`` latency for 8, 32, 64 and 128 layers
  of [2, 16, 16, 8, 64] fp16, (a) all layers views of one ``empty_shared`` segment and (b)
  one segment per layer; reported in microseconds and as a multiple of the PING median;
- the server's own cost per layer: decoding the REGISTER body and mapping every layer
  (``codec.decode_request`` + ``Registry.register``), timed in this process on the same body;
- reclaim latency: a worker process registers 32 layers and is SIGKILLed; the time until
  ``lmshm status`` no longer lists its registration.
Medians only; the machine's noise shows in the spread between runs, not here.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import time

import torch

from lmshm.multiprocess import codec, protocol
from lmshm.multiprocess.client import MPClient, query_status
from lmshm.multiprocess.registry import Registry
from lmshm.platform.cpu import empty_shared
from lmshm.platform.kv_wrap import release_wrappers, wrap_kv_caches

SHAPE = (2, 16, 16, 8, 64)
LAYER_COUNTS = (8, 32, 64, 128)

_KILL_WORKER = """
import sys, torch
from lmshm import MPClient
from lmshm.platform.cpu import empty_shared
client = MPClient(sys.argv[1], heartbeat=False)
pool = empty_shared((32, *{shape}), torch.float16)
client.register_kv_caches({{f"layer.{{i}}": pool[i] for i in range(32)}}, sys.argv[2])
print("ready", flush=True)
sys.stdin.read()
""".format(shape=SHAPE)


def _layers(n: int, layout: str) -> dict[str, torch.Tensor]:
    if layout == "one":
        pool = empty_shared((n, *SHAPE), torch.float16)
        return {f"model.layers.{i}.attn": pool[i] for i in range(n)}
    return {f"model.layers.{i}.attn": empty_shared(SHAPE, torch.float16) for i in range(n)}


def _median_us(samples: list[float]) -> float:
    return statistics.median(samples) * 1e6


def bench_register(client: MPClient, n: int, layout: str, reps: int) -> float:
    layers = _layers(n, layout)
    samples = []
    for r in range(reps):
        t0 = time.perf_counter()
        iid = client.register_kv_caches(layers, f"bench-{layout}-{n}-{r}")
        samples.append(time.perf_counter() - t0)
        client.unregister_kv_caches(iid)
    return _median_us(samples)


def bench_server_cost(n: int, layout: str, reps: int) -> tuple[float, float]:
    """Per-layer microseconds of decode+map and of release, in this process."""
    layers = _layers(n, layout)
    wrappers = wrap_kv_caches(layers)
    body = codec.encode(protocol.RegisterKVCache("bench", "m", 1, 0, [
        protocol.Layer(name, w) for name, w in zip(layers, wrappers)]))
    registry = Registry()
    reg_t, rel_t = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        req = codec.decode_request(body)
        registry.register(owner=1, owner_pid=os.getpid(), instance_id="bench", model_name="m", world_size=1,
                          worker_rank=0, layers=[(layer.name, layer.wrapper) for layer in req.layers])
        t1 = time.perf_counter()
        registry.unregister("bench", owner=1)
        t2 = time.perf_counter()
        reg_t.append(t1 - t0)
        rel_t.append(t2 - t1)
    release_wrappers(wrappers)
    return _median_us(reg_t) / n, _median_us(rel_t) / n


def bench_reclaim(url: str, kills: int) -> list[float]:
    out = []
    for k in range(kills):
        iid = f"kill-{k}"
        worker = subprocess.Popen([sys.executable, "-c", _KILL_WORKER, url, iid],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert worker.stdout.readline().strip() == "ready"
        t0 = time.perf_counter()
        worker.send_signal(signal.SIGKILL)
        while any(r.instance_id == iid for r in query_status(url).registrations):
            if time.perf_counter() - t0 > 30:
                raise RuntimeError("a killed worker was not reclaimed within 30 s")
            time.sleep(0.001)
        out.append(time.perf_counter() - t0)
        worker.wait()
        worker.stdout.close()
        worker.stdin.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--pings", type=int, default=1000)
    ap.add_argument("--kills", type=int, default=5)
    args = ap.parse_args()

    server = subprocess.Popen([sys.executable, "-m", "lmshm.multiprocess.server", "--port", "0",
                               "--log-level", "WARNING"], stdout=subprocess.PIPE, text=True)
    try:
        url = re.search(r"listening on (\S+)", server.stdout.readline()).group(1)
        print(f"Python {sys.version.split()[0]}, torch {torch.__version__}, {os.cpu_count()} CPUs; server at {url}")
        print(f"layer shape {list(SHAPE)} fp16 ({2 * torch.Size(SHAPE).numel() >> 10} KiB); "
              f"medians of {args.reps} registrations, {args.pings} pings")
        with MPClient(url, heartbeat=False) as client:
            for _ in range(50):
                client.ping()  # warm up
            ping = _median_us([client.ping() for _ in range(args.pings)])
            print(f"\nempty PING round trip: {ping:.0f} us\n")
            print(f"{'layers':>6}  {'layout':<13} {'register us':>11}  {'x PING':>7}  "
                  f"{'server us/layer':>15}  {'release us/layer':>16}")
            for n in LAYER_COUNTS:
                for layout, label in (("one", "one segment"), ("per-layer", "per layer")):
                    reg = bench_register(client, n, layout, args.reps)
                    srv, rel = bench_server_cost(n, layout, args.reps)
                    print(f"{n:>6}  {label:<13} {reg:>11.0f}  {reg / ping:>7.1f}  {srv:>15.1f}  {rel:>16.1f}")
        if args.kills:
            times = bench_reclaim(url, args.kills)
            print(f"\nreclaim after SIGKILL (32 layers, {args.kills} kills): median "
                  f"{statistics.median(times) * 1e3:.1f} ms, max {max(times) * 1e3:.1f} ms")
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
