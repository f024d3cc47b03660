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
from typing import Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import parse_args

from lmshm.core.registry import Registry
from lmshm.platform.base.peer import local_peer
from lmshm.platform.cpu import empty_shared
from lmshm.platform.kv_wrap import release_wrappers, wrap_kv_caches
from lmshm.transport.client import MPClient, layer_groups, query_status
from lmshm.wire import codec, protocol

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


def _layers(n: int, layout: str, kind: Optional[str] = None) -> dict[str, torch.Tensor]:
    if layout == "one":
        pool = empty_shared((n, *SHAPE), torch.float16, kind=kind)
        return {f"model.layers.{i}.attn": pool[i] for i in range(n)}
    return {f"model.layers.{i}.attn": empty_shared(SHAPE, torch.float16, kind=kind) for i in range(n)}


def _median_us(samples: list[float]) -> float:
    return statistics.median(samples) * 1e6


def bench_register(client: MPClient, n: int, layout: str, reps: int) -> tuple[float, float]:
    """Median register and median PING, interleaved (PING, register, unregister) so that
    both see the same machine load."""
    layers = _layers(n, layout)
    samples, pings = [], []
    for r in range(reps):
        pings.append(client.ping())
        t0 = time.perf_counter()
        iid = client.register_kv_caches(layers, f"bench-{layout}-{n}-{r}")
        samples.append(time.perf_counter() - t0)
        client.unregister_kv_caches(iid)
    return _median_us(samples), _median_us(pings)


def bench_server_cost(n: int, layout: str, reps: int) -> tuple[float, float, float]:
    """Per-layer microseconds, in this process: decode + register (maps every group, checks
    every layer's bounds); building every layer's server-side tensor; release. The layers are
    named shm segments: a memfd's fd reaches a registry only over a server's fd channel."""
    layers = _layers(n, layout, kind="shm")
    wrappers = wrap_kv_caches(layers)
    body = codec.encode(protocol.RegisterKVCache("bench", "m", 1, 0, layer_groups(list(layers), wrappers)))
    registry, peer = Registry(), local_peer("bench")
    reg_t, view_t, rel_t = [], [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        req = codec.decode_request(body)
        reg, _ = registry.register(peer=peer, instance_id="bench", model_name="m",
                                   world_size=1, worker_rank=0, groups=req.groups)
        t1 = time.perf_counter()
        for name in layers:  # every layer's server-side tensor, as a first data operation would
            reg.tensor(name)
        t2 = time.perf_counter()
        registry.unregister("bench")
        t3 = time.perf_counter()
        reg_t.append(t1 - t0)
        view_t.append(t2 - t1)
        rel_t.append(t3 - t2)
    release_wrappers(wrappers)
    return _median_us(reg_t) / n, _median_us(view_t) / n, _median_us(rel_t) / n


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
    ap.add_argument("--layer-counts", default=",".join(map(str, LAYER_COUNTS)), help="layers per registration")
    args = parse_args(ap, smoke={"reps": 2, "pings": 20, "kills": 1, "layer_counts": "8"})

    server = subprocess.Popen([sys.executable, "-m", "lmshm.server", "--port", "0",
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
            print("register: median end-to-end MPClient.register_kv_caches; PING: median of the pings\n"
                  "interleaved with those registrations; server columns: per layer, in-process\n")
            print(f"{'layers':>6}  {'layout':<13} {'register us':>11}  {'PING us':>7}  {'x PING':>6}  "
                  f"{'server us/layer':>15}  {'views us/layer':>14}  {'release us/layer':>16}")
            for n in (int(x) for x in args.layer_counts.split(",")):
                for layout, label in (("one", "one segment"), ("per-layer", "per layer")):
                    reg, row_ping = bench_register(client, n, layout, args.reps)
                    srv, views, rel = bench_server_cost(n, layout, args.reps)
                    print(f"{n:>6}  {label:<13} {reg:>11.0f}  {row_ping:>7.0f}  {reg / row_ping:>6.1f}  "
                          f"{srv:>15.1f}  {views:>14.1f}  {rel:>16.1f}")
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
