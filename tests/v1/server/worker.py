"""A worker process for the service tests: an MPClient driven by JSON lines on stdin.

Started by ``conftest.WorkerProcess``. Prints one JSON line when connected, then answers each
command line with one JSON line. Not a test module (pytest collects ``test_*.py`` only).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback


def vllm_layout_strides(shape: list[int], order: list[int]) -> list[int]:
    """vLLM 0.32's ``compute_layout_strides`` (vllm/v1/kv_cache_interface.py) for an unpadded
    page: the strides, in logical ``[L, B, H, N, C]`` order, of a dense buffer whose physical
    dim order is ``order`` (a ``KVCacheLayout``'s stride order, outermost first)."""
    strides, step = [0] * len(shape), 1
    for dim in reversed(order):
        strides[dim] = step
        step *= shape[dim]
    return strides


def vllm_kv_caches(spec: dict) -> dict:
    """Layer name -> tensor, allocated as vLLM 0.32's model runner does (``allocate_kv_cache``
    in vllm/v1/worker/utils.py, ``create_kv_cache_views`` in vllm/v1/kv_cache_interface.py):
    one flat ``torch.zeros(..., dtype=torch.int8)`` buffer, ``as_strided`` to the logical
    ``[L, B, H, N, C bytes]`` with the layout's strides, each layer ``view_5d[l].view(dtype)``.

    ``spec``: ``layers`` L, ``blocks`` B, ``heads`` H, ``tokens`` N, ``content`` C (elements),
    ``dtype``, ``order`` (the layout's stride order); ``storage``: ``"one"`` (vLLM: every layer
    in one buffer) or ``"separate"`` (a buffer per layer); ``register``: ``"layers"`` (one
    ``[B, H, N, C]`` view per layer, what vLLM hands a connector) or ``"whole"`` (the
    ``[L, B, H, N, C]`` view as one tensor, ``"kv_cache"``).
    """
    import torch

    dtype = getattr(torch, spec["dtype"])
    L, B, H, N, C = spec["layers"], spec["blocks"], spec["heads"], spec["tokens"], spec["content"]
    order = spec["order"]

    def view_5d(num_layers: int):
        shape = [num_layers, B, H, N, C * dtype.itemsize]
        buf = torch.zeros(math.prod(shape), dtype=torch.int8)
        return torch.as_strided(buf, shape, vllm_layout_strides(shape, order), 0)

    names = [f"model.layers.{i}.self_attn.attn" for i in range(L)]
    if spec.get("register", "layers") == "whole":
        return {"kv_cache": view_5d(L).view(dtype)}
    if spec.get("storage", "one") == "one":
        v = view_5d(L)
        return {n: v[i].view(dtype) for i, n in enumerate(names)}
    return {n: view_5d(1)[0].view(dtype) for n in names}


def _reopen(seg) -> int:
    """A new read-write fd for a segment: its name, or (a memfd) this process's own fd."""
    return os.open(seg.path if seg.kind == "shm" else f"/proc/self/fd/{seg.fd}", os.O_RDWR)


def _punch(fd: int, offset: int, length: int) -> None:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE
    if libc.fallocate(fd, 3, ctypes.c_long(offset), ctypes.c_long(length)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--heartbeat", type=float, default=0.1, help="heartbeat interval, seconds")
    ap.add_argument("--fd-socket", default=None)
    ap.add_argument("--name", default="test-worker")
    args = ap.parse_args()

    import torch

    from lmshm.platform.cpu import empty_shared, segment_of
    from lmshm.transport import client as client_mod

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
        if op == "register_many":  # ids PREFIX00000.. over one one-layer segment (STATUS paging tests)
            layers = allocate(1, [64], "one")
            for i in range(cmd["count"]):
                caches[client.register_kv_caches(layers, f"{cmd['prefix']}{i:05d}")] = layers
            return {"count": cmd["count"]}
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
        # ---- the data plane: blocks are dim 0 of every layer; keys travel as hex ----
        if op == "register_kv":  # every layer [blocks, *shape] float32, views of one pool or separate
            n, shape = cmd.get("layers", 2), [cmd.get("blocks", 16), *cmd.get("shape", [2, 16, 8])]
            if cmd.get("layout", "one") == "kv-split":  # [2, blocks, ...] per layer, seen block-first: 2 runs a block
                pool = empty_shared((n, 2, *shape), torch.float32)
                layers = {f"layer.{i}": pool[i].transpose(0, 1) for i in range(n)}
            elif cmd.get("layout", "one") == "one":
                pool = empty_shared((n, *shape), torch.float32)
                layers = {f"layer.{i}": pool[i] for i in range(n)}
            else:
                layers = {f"layer.{i}": empty_shared(shape, torch.float32) for i in range(n)}
            if cmd.get("transpose"):  # a layout the data plane must refuse: blocks scattered in the last dim
                layers = {k: v.transpose(0, -1) for k, v in layers.items()}
            iid = client.register_kv_caches(layers, cmd.get("instance_id"))
            caches[iid] = layers
            return {"instance_id": iid}
        if op == "register_vllm":  # a KV cache made as vLLM 0.32 makes it (vllm_kv_caches)
            layers = vllm_kv_caches(cmd)
            iid = client.register_kv_caches(layers, cmd.get("instance_id"), block_dim=cmd["block_dim"])
            caches[iid] = layers
            return {"instance_id": iid, "shapes": [list(t.shape) for t in layers.values()],
                    "strides": [list(t.stride()) for t in layers.values()]}
        if op == "fill_random":  # every byte of every storage the layers view, from a seed
            gen = torch.Generator().manual_seed(cmd["seed"])
            seen = set()
            for t in caches[cmd["instance_id"]].values():
                storage = t.untyped_storage()
                if storage.data_ptr() in seen:
                    continue
                seen.add(storage.data_ptr())
                flat = torch.empty(0, dtype=torch.uint8).set_(storage)
                flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=gen))
            return {}
        if op == "block_parts":  # sha1 of each part of each block: [block][tensor][layer][part]
            import hashlib

            def sha(t: torch.Tensor) -> str:
                return hashlib.sha1(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()

            # parts: [start, size] along the last dim (vLLM: K = C[:head_size], V = the rest);
            # a block of a whole-cache registration ([L, B, H, N, C]) is split by layer too
            bd, parts, by_layer = cmd["block_dim"], cmd["parts"], cmd.get("by_layer", False)
            out = []
            for b in cmd["blocks"]:
                row = []
                for t in caches[cmd["instance_id"]].values():
                    block = t.select(bd, b)
                    units = list(block.unbind(0)) if by_layer else [block]
                    row.append([[sha(u.narrow(-1, start, size)) for start, size in parts] for u in units])
                out.append(row)
            return {"digests": out}
        if op == "fill_blocks":  # block b of layer i <- seed * 1e6 + i * 1e4 + b * 10 + element index
            for i, t in enumerate(caches[cmd["instance_id"]].values()):
                for b in cmd["blocks"]:
                    base = cmd["seed"] * 1e6 + i * 1e4 + b * 10
                    t[b] = base + torch.arange(t[b].numel(), dtype=torch.float32).view(t[b].shape) / 1e3
            return {}
        if op == "digest_blocks":  # per block: a hash of its bytes in every layer
            import hashlib

            layers = list(caches[cmd["instance_id"]].values())
            return {"digests": [hashlib.sha1(b"".join(t[b].contiguous().numpy().tobytes() for t in layers)).hexdigest()
                                for b in cmd["blocks"]]}
        if op == "store":
            keys = [bytes.fromhex(k) for k in cmd["keys"]]
            if cmd.get("pipelined"):  # many STOREs in flight at once, then every reply
                pend = [client.store(cmd["instance_id"], [k], cmd["blocks"][i * cmd["chunk_blocks"]:(i + 1) * cmd["chunk_blocks"]],
                                     cmd["chunk_blocks"], wait=False) for i, k in enumerate(keys)]
                return {"results": [p.result().results[0] for p in pend]}
            r = client.store(cmd["instance_id"], keys, cmd["blocks"], cmd["chunk_blocks"])
            return {"results": list(r.results), "nbytes": r.nbytes}
        if op == "late_behind_big":  # a big STORE, then at once a STORE or RETRIEVE with a short timeout
            big = [bytes.fromhex(k) for k in cmd["big_keys"]]
            p1 = client.store(cmd["instance_id"], big, cmd["big_blocks"], 1, wait=False, timeout_s=60)
            keys = [bytes.fromhex(k) for k in cmd["keys"]]
            if cmd["what"] == "store":
                p2 = client.store(cmd["instance_id"], keys, cmd["blocks"], 1, wait=False, timeout_s=cmd["give_up_s"])
            else:
                p2 = client.retrieve(cmd["instance_id"], keys, cmd["blocks"], 1, wait=False, timeout_s=cmd["give_up_s"])
            try:
                second = f"answered: {p2.result()!r}"
            except Exception as exc:
                second = f"{type(exc).__name__}: {exc}"
            return {"big": list(p1.result().results), "second": second}
        if op == "store_then_retrieve":  # sent back to back, never waiting in between
            keys = [bytes.fromhex(k) for k in cmd["keys"]]
            p1 = client.store(cmd["instance_id"], keys, cmd["blocks"], cmd["chunk_blocks"], wait=False)
            p2 = client.retrieve(cmd["instance_id"], keys, cmd["into"], cmd["chunk_blocks"], wait=False)
            return {"stored": list(p1.result().results), "chunks": p2.result().chunks}
        if op == "lookup":
            r = client.lookup([[bytes.fromhex(k) for k in ks] for ks in cmd["keys"]], cmd.get("ttl_s", 0.0))
            return {"hits": r.hits, "lease": r.lease.hex(), "ttl_s": r.ttl_s}
        if op == "retrieve":
            keys = [bytes.fromhex(k) for k in cmd["keys"]]
            r = client.retrieve(cmd["instance_id"], keys, cmd["blocks"], cmd["chunk_blocks"],
                                bytes.fromhex(cmd.get("lease", "")))
            return {"chunks": r.chunks, "nbytes": r.nbytes}
        if op == "release":
            return {"released": client.release(bytes.fromhex(cmd["lease"]))}
        if op == "damage_segment":  # what a hostile worker may do to its own registered segment
            seg = segment_of(next(iter(caches[cmd["instance_id"]].values())))
            how = cmd["how"]
            fd = _reopen(seg)
            try:
                try:
                    if how in ("truncated", "zero", "grown"):
                        os.ftruncate(fd, {"truncated": 4096, "zero": 0, "grown": 2 * seg.size}[how])
                    else:
                        _punch(fd, 4096, seg.size - 4096)   # everything after the first page
                except OSError as exc:  # a sealed memfd refuses: the cache stays intact and usable
                    import errno

                    return {"refused": errno.errorcode[exc.errno]}
            finally:
                os.close(fd)
            caches.pop(cmd["instance_id"])  # this process must not touch those pages again either
            return {"refused": None}
        if op == "damage_while_copying":  # punch holes / try to shrink, in a loop, while copies run
            import threading

            seg = segment_of(next(iter(caches[cmd["instance_id"]].values())))
            stop, attempts, refusals = threading.Event(), [0], set()

            def damage() -> None:
                import random

                rng, pages = random.Random(cmd.get("seed", 0)), seg.size // 4096
                fd = _reopen(seg)
                try:
                    while not stop.is_set():
                        try:
                            if cmd["how"] == "punch":   # a random run of pages, refilled a moment later
                                n = rng.randint(1, 256)
                                at = 4096 * rng.randrange(pages - n)
                                _punch(fd, at, 4096 * n)
                                time.sleep(rng.random() * 0.002)
                                os.pwrite(fd, bytes(4096 * n), at)
                            else:
                                os.ftruncate(fd, 0)
                        except OSError as exc:
                            import errno

                            refusals.add(errno.errorcode[exc.errno])
                        attempts[0] += 1
                        time.sleep(rng.random() * 0.003)
                finally:
                    os.close(fd)

            th = threading.Thread(target=damage)
            th.start()
            outcomes: dict[str, int] = {}
            keys = [bytes.fromhex(k) for k in cmd["keys"]]
            cb, blocks, into = cmd["chunk_blocks"], cmd["blocks"], cmd["into"]
            try:
                for n in range(cmd["rounds"]):
                    fresh = [bytes([0xF0, n]) + k[2:] for k in keys]   # every STORE copies: new keys each round
                    for what, call in (("store", lambda: client.store(cmd["instance_id"], fresh, blocks, cb)),
                                       ("retrieve", lambda: client.retrieve(cmd["instance_id"], keys, into, cb))):
                        try:
                            call()
                            tag = f"{what} ok"
                        except client_mod.ServerError as exc:
                            reason = "holes" if "holes" in exc.message else exc.message[:80]
                            tag = f"{what} {exc.code.name if hasattr(exc.code, 'name') else exc.code}: {reason}"
                        outcomes[tag] = outcomes.get(tag, 0) + 1
            finally:
                stop.set()
                th.join()
            caches.pop(cmd["instance_id"])  # its pages may read back as zeros now
            return {"outcomes": outcomes, "attempts": attempts[0], "refusals": sorted(refusals)}
        if op == "store_and_die":  # a large STORE in flight, the memfd fds closed, then SIGKILL
            import signal

            keys = [bytes.fromhex(k) for k in cmd["keys"]]
            client.store(cmd["instance_id"], keys, cmd["blocks"], cmd["chunk_blocks"], wait=False)
            for t in caches[cmd["instance_id"]].values():
                seg = segment_of(t)
                if seg is not None:
                    seg.unlink()     # memfd: closes the fd this process kept; the server's mapping stays
            sys.stdout.write(json.dumps({"ok": True, "dying": True}) + "\n")   # (``out`` is a local name here)
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        if op == "pool":
            import msgspec

            return {"pool": msgspec.to_builtins(client.status().pool)}
        if op == "ping_during_store":  # a large STORE in flight; PINGs must still come back at once
            keys = [bytes.fromhex(k) for k in cmd["keys"]]
            p = client.store(cmd["instance_id"], keys, cmd["blocks"], cmd["chunk_blocks"], wait=False)
            pings = []
            while not p.done():
                pings.append(client.ping())
            p.result()
            return {"pings": pings}
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
        except Exception as exc:
            out({"ok": False, "error": type(exc).__name__, "message": str(exc), "trace": traceback.format_exc()})
    client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
