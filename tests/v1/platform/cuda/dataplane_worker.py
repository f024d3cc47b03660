"""A CUDA worker for test_cuda_dataplane_gpu.py: owns an ``MPClient`` and a KV pool on cuda:0
and obeys one JSON command per stdin line, answering one JSON line each (``{"ok": true, ...}``
or ``{"ok": false, "error": traceback}``). Run as a script (so a test can start it under
``unshare`` with a private /dev/shm); not a test module.

Every fill that a STORE copies, and every last write before a RETRIEVE, is queued late on the
worker's stream (``cuda_testing.gpu_delay``) while the request goes at once: only the ordering
signals (``WorkerCudaSync``) keep the bytes right. Digests of what was written are taken from a
source that is complete *before* the delay, so taking them never waits for the delayed work.

The pool is ``[layers, blocks, block_elems]`` float16, registered as one view per layer
(block_dim 0): ``torch`` (cudaMalloc through PyTorch; cuda-torch, or cuda-raw with
``--isolated``), ``vmm`` (``empty_vmm``, cuda-vmm).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _digests(t) -> list:
    """sha256 (16 hex digits) of each block of ``t`` (``[layers, n, ...]``), all layers together."""
    import torch

    host = t.transpose(0, 1).contiguous().view(torch.uint8).cpu()
    return [hashlib.sha256(host[i].numpy().tobytes()).hexdigest()[:16] for i in range(host.shape[0])]


class Worker:
    def __init__(self, args: argparse.Namespace) -> None:
        import torch
        from cuda_testing import cycles_per_ms

        from lmshm.core.cuda_sync import WorkerCudaSync
        from lmshm.platform import ipc_policy
        from lmshm.transport.client import MPClient

        self.torch = torch
        ipc_policy.set_isolated_ipc(args.isolated)
        ipc_policy.set_use_vmm_api(args.memory == "vmm")
        torch.cuda.set_device(0)
        self.memory = args.memory
        self.client = MPClient(args.url, fd_socket=args.fd_socket or None, client_name=args.name, timeout_s=30)
        self.sync = WorkerCudaSync(0, client=self.client)
        self.cycles_per_ms = cycles_per_ms(0)
        self.pools: dict = {}
        self.keep: list = []

    # ---- ops ------------------------------------------------------------------------------
    def op_register(self, instance_id: str, layers: int, blocks: int, block_bytes: int) -> dict:
        torch = self.torch
        from lmshm.platform.cuda import empty_vmm

        shape = (layers, blocks, block_bytes // 2)
        if self.memory == "vmm":
            pool = empty_vmm(shape, torch.float16, "cuda")      # one chunk: layer views stay inside it
            pool.zero_()
        else:
            pool = torch.zeros(shape, dtype=torch.float16, device="cuda:0")
        torch.cuda.synchronize()
        self.pools[instance_id] = pool
        self.client.register_kv_caches({f"model.layers.{i}.attn": pool[i] for i in range(layers)}, instance_id,
                                       model_name="dataplane-gpu")
        return {"nbytes": pool.numel() * 2}

    def _source(self, instance_id: str, blocks: list, seed: int):
        torch = self.torch
        pool = self.pools[instance_id]
        gen = torch.Generator(device="cuda:0")
        gen.manual_seed(seed)
        src = torch.randn((pool.shape[0], len(blocks), pool.shape[2]), dtype=torch.float16, device="cuda:0",
                          generator=gen)            # finite values: every copy keeps their bits
        digests = _digests(src)                  # synchronises: before any delay is queued
        return src, digests

    def op_put(self, instance_id: str, keys: list, blocks: list, chunk_blocks: int = 1, seed: int = 1,
               delay_ms: float = 50.0, signal: bool = True) -> dict:
        """Write random bytes into ``blocks`` ``delay_ms`` late, STORE them at once (with the
        ordering signal unless ``signal`` is false), wait (on the GPU) for the server's. Returns
        the digests of what was written and the STORE's results."""
        from cuda_testing import gpu_delay

        torch = self.torch
        pool = self.pools[instance_id]
        src, digests = self._source(instance_id, blocks, seed)
        idx = torch.tensor(blocks, device="cuda:0")
        gpu_delay(delay_ms)
        pool.index_copy_(1, idx, src)
        keep, token = self.sync.ready() if signal else (None, b"")
        t0 = time.monotonic()
        reply = self.client.store(instance_id, [bytes.fromhex(k) for k in keys], blocks, chunk_blocks, event=token)
        took = time.monotonic() - t0
        self.sync.wait(reply.event)
        del keep
        return {"digests": digests, "results": [int(r) for r in reply.results], "reply_s": took}

    def op_put_many(self, instance_id: str, keys: list, blocks: list, seed: int = 1, delay_ms: float = 300.0) -> dict:
        """One STORE per block, all sent with ``wait=False`` before any reply is read: the fills
        queue behind one ``delay_ms`` delay, each STORE with its own ordering signal recorded
        after its block's fill. Then every reply is settled in order (the server's signal of the
        first is waited for after all the others were sent)."""
        from cuda_testing import gpu_delay

        pool = self.pools[instance_id]
        src, digests = self._source(instance_id, blocks, seed)
        gpu_delay(delay_ms)
        pending, keeps = [], []
        t0 = time.monotonic()
        for i, (key, block) in enumerate(zip(keys, blocks)):
            pool[:, block].copy_(src[:, i])
            keep, token = self.sync.ready()
            keeps.append(keep)
            pending.append(self.client.store(instance_id, [bytes.fromhex(key)], [block], 1, wait=False, event=token))
        sent_s = time.monotonic() - t0
        unanswered = sum(1 for p in pending if not p.done())
        results = []
        for p in pending:
            reply = p.result()
            self.sync.wait(reply.event)
            results.extend(int(r) for r in reply.results)
        settled_s = time.monotonic() - t0
        keeps.clear()
        return {"digests": digests, "results": results, "sent_s": sent_s, "settled_s": settled_s,
                "unanswered_after_send": unanswered}

    def _lookup(self, keys: list, timeout_s: float = 15.0) -> bytes:
        deadline = time.monotonic() + timeout_s
        while True:
            found = self.client.lookup([keys])
            if found.hits == len(keys):
                return found.lease
            if found.lease:
                self.client.release(found.lease)
            if time.monotonic() > deadline:
                raise TimeoutError(f"LOOKUP found {found.hits} of {len(keys)} stored chunks after {timeout_s} s")
            time.sleep(0.01)

    def op_get(self, instance_id: str, keys: list, blocks: list, chunk_blocks: int = 1, delay_ms: float = 50.0,
               batch: int = 256) -> dict:
        """RETRIEVE ``keys`` into ``blocks`` (in batches of ``batch`` chunks, each after a LOOKUP
        that waits for them), the worker's last write of each batch's blocks landing ``delay_ms``
        late. Returns the digests of the blocks afterwards (read on the stream, after the wait)."""
        from cuda_testing import gpu_delay

        torch = self.torch
        pool = self.pools[instance_id]
        raw = [bytes.fromhex(k) for k in keys]
        for at in range(0, len(raw), batch):
            ks = raw[at:at + batch]
            bs = blocks[at * chunk_blocks:(at + len(ks)) * chunk_blocks]
            lease = self._lookup(ks)
            idx = torch.tensor(bs, device="cuda:0")
            gpu_delay(delay_ms)
            pool.index_fill_(1, idx, -1.5)           # the last use of these blocks, late
            keep, token = self.sync.ready()
            reply = self.client.retrieve(instance_id, ks, bs, chunk_blocks, lease, event=token)
            self.sync.wait(reply.event)
            del keep
            if reply.chunks != len(ks):
                raise AssertionError(f"RETRIEVE brought {reply.chunks} of {len(ks)} chunks")
        idx = torch.tensor(blocks, device="cuda:0")
        return {"digests": _digests(pool.index_select(1, idx))}

    def op_digests(self, instance_id: str, blocks: list) -> dict:
        torch = self.torch
        torch.cuda.synchronize()
        idx = torch.tensor(blocks, device="cuda:0")
        return {"digests": _digests(self.pools[instance_id].index_select(1, idx))}

    def op_store_raw(self, instance_id: str, keys: list, blocks: list, chunk_blocks: int = 1) -> dict:
        """A STORE as sent (with the ordering signal), its error returned rather than raised."""
        from lmshm.transport.client import ServerError

        keep, token = self.sync.ready()
        try:
            reply = self.client.store(instance_id, [bytes.fromhex(k) for k in keys], blocks, chunk_blocks,
                                      event=token)
        except ServerError as exc:
            return {"error": {"code": int(exc.code), "message": exc.message}}
        self.sync.wait(reply.event)
        del keep
        return {"results": [int(r) for r in reply.results]}

    def op_store_never_signalled(self, instance_id: str, keys: list, blocks: list) -> dict:
        """Isolated mode: a STORE whose flag token names a number this worker's stream never
        writes. Its error (and how long it took) is returned."""
        from lmshm.core.cuda_sync import SLOTS, flag_token
        from lmshm.transport.client import ServerError

        keep, _ = self.sync.ready()                     # the flag page is registered by now
        seq = self.sync._seq + 10 * SLOTS               # far ahead: never written
        token = flag_token(seq % SLOTS, seq, self.sync._page_id)
        t0 = time.monotonic()
        try:
            reply = self.client.store(instance_id, [bytes.fromhex(k) for k in keys], blocks, 1, event=token,
                                      timeout_s=60)
        except ServerError as exc:
            return {"error": {"code": int(exc.code), "message": exc.message}, "s": time.monotonic() - t0}
        del keep
        return {"results": [int(r) for r in reply.results], "s": time.monotonic() - t0}

    def op_put_and_die(self, instance_id: str, keys: list, blocks: list, delay_ms: float = 500.0,
                       seed: int = 7) -> None:
        """Queue fills ``delay_ms`` late, send one STORE per block (``wait=False``), let the first
        reply come or 0.3 s pass (the server waits on its host for this stream's signals before
        it queues any copy, so with a delay longer than that no reply has come), say so, and
        SIGKILL this process with everything in flight: the signals never complete."""
        from cuda_testing import gpu_delay

        pool = self.pools[instance_id]
        src, _ = self._source(instance_id, blocks, seed)
        gpu_delay(delay_ms)
        pending = []
        for i, (key, block) in enumerate(zip(keys, blocks)):
            pool[:, block].copy_(src[:, i])
            keep, token = self.sync.ready()
            self.keep.append(keep)
            pending.append(self.client.store(instance_id, [bytes.fromhex(key)], [block], 1, wait=False, event=token))
        deadline = time.monotonic() + 0.3
        while not pending[0].done() and time.monotonic() < deadline:
            time.sleep(0.002)
        sys.stdout.write(json.dumps({"ok": True, "dying": os.getpid(), "first_answered": pending[0].done()}) + "\n")
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    def op_unregister(self, instance_id: str) -> dict:
        self.client.unregister_kv_caches(instance_id)
        self.pools.pop(instance_id, None)
        return {}

    def op_shm(self) -> dict:
        """Where this worker's /dev/shm is, and a file made there (isolation checks)."""
        marker = f"lmshm-private-{os.getpid()}"
        with open(f"/dev/shm/{marker}", "w") as f:
            f.write("x")
        st = os.stat("/dev/shm")
        return {"dev": st.st_dev, "ino": st.st_ino, "marker": marker, "entries": sorted(os.listdir("/dev/shm"))[:50]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--fd-socket", default="")
    ap.add_argument("--memory", choices=["torch", "vmm"], default="torch")
    ap.add_argument("--isolated", action="store_true")
    ap.add_argument("--name", default="dataplane-gpu-worker")
    args = ap.parse_args()
    try:
        w = Worker(args)
    except BaseException:
        print(json.dumps({"ok": False, "error": traceback.format_exc()}), flush=True)
        return 1
    print(json.dumps({"ok": True, "pid": os.getpid(), "cycles_per_ms": w.cycles_per_ms}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("op")
        if op == "exit":
            w.client.close()
            print(json.dumps({"ok": True}), flush=True)
            return 0
        try:
            out = {"ok": True, **(getattr(w, f"op_{op}")(**cmd) or {})}
        except BaseException:
            out = {"ok": False, "error": traceback.format_exc()}
        print(json.dumps(out), flush=True)
    w.client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
