"""vLLM 0.32's KV-cache layouts on a GPU, moved block by block through a real lmshm-server.

The CUDA twin of ``tests/v1/server/test_kv_layouts.py`` (its ``LAYOUTS`` table and
``worker.vllm_layout_strides`` are imported from there). Two spawned worker processes each
allocate on cuda:0 exactly as vLLM's model runner does: one flat ``torch.int8`` buffer, viewed
as the logical ``[L, B, H, N, C bytes]`` with the layout's strides, each layer
``view_5d[l].view(dtype)``. Each registers what ``LmshmConnector`` would (``registration_groups``
in lmshm/integrations/vllm/layout.py): per-layer ``[B, H, N, C]`` views for layer-outermost layouts,
one combined ``[B, L, H, N, C]`` view for block-outermost ones, block_dim 0; a kernel block
smaller than the block is regrouped as ``block_view`` does. Worker A STOREs shuffled blocks,
worker B RETRIEVEs them into other blocks; B compares, on the GPU, K and V of every layer of
every block with what A had, and its other blocks with a snapshot taken before. An NHD store
must be refused by an HND registration with LAYOUT, leaving B's memory as it was. Before each
STORE the stored bytes, and before each RETRIEVE the destination's last write, land 50 ms late
on the worker's stream (``cuda_testing.gpu_delay``) while the request goes at once: only the
ordering signals keep the comparisons true.

One server and two workers serve every test of a wrapper kind (module-scoped fixture): the
default CUDA wrapper (PyTorch storage sharing, ``cuda-torch``) and the isolated one (raw driver
IPC handles, ``cuda-raw``, server started with --isolated-ipc). The workers are spawned, never
forked: a forked child of a process that has initialised CUDA cannot use it. Every worker
function lives at module level so the spawned child can import it. Skipped without CUDA.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

_SERVER_TESTS = str(Path(__file__).resolve().parents[2] / "server")
if _SERVER_TESTS not in sys.path:
    sys.path.append(_SERVER_TESTS)     # after everything else: shadows nothing already importable

from cuda_testing import cycles_per_ms, gpu_delay, server_gpu_missing
from harness import ServerProcess, scratch_dir, wait_for
from test_kv_layouts import LAYOUTS
from worker import vllm_layout_strides

_REASON = server_gpu_missing()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(bool(_REASON), reason=_REASON or "n/a")]

# FlashAttention's shape (it reads all six layouts): K and V of 64 halves each per token.
LAYERS, BLOCKS, HEADS, TOKENS, HEAD_SIZE, HEAD_SIZE_V, DTYPE = 3, 16, 4, 32, 64, 64, "float16"
SRC = [13, 3, 4, 5, 11, 0, 14, 15]      # shuffled, with runs of consecutive ids (3..5, 14..15)
DST = [2, 9, 10, 8, 1, 6, 12, 7]        # other blocks (9..10 a run)
CHUNK = 2                               # blocks per chunk: four chunks
KINDS = ("cuda-torch", "cuda-raw")      # the default wrapper, and the isolated (raw IPC) one
DELAY_MS = 50                           # how late the worker's writes land before each STORE/RETRIEVE
CASES = [pytest.param(name, 1, id=name) for name in LAYOUTS]
CASES.append(pytest.param("LBHNC", 2, id="LBHNC-kernel-blocks-of-half-a-block"))


class WorkerError(RuntimeError):
    """An operation failed in a worker process (the message carries its traceback), or it died."""


# ---- the worker process (spawned; everything it runs is at module level) -------------------


class _Cache:
    """One registration's memory: the flat buffer and vLLM's ``[L, B', H, N', C bytes]`` view."""

    def __init__(self, buf: Any, view_5d: Any, split: int) -> None:
        self.buf, self.view_5d, self.split = buf, view_5d, split

    def blocks_of(self, flat: Any) -> Any:
        """``[L, B, kernel blocks, H, N', C bytes]`` over ``flat`` (the buffer or a copy of it)."""
        v = torch.as_strided(flat, self.view_5d.shape, self.view_5d.stride(), 0)
        return v.unflatten(1, (BLOCKS, self.split))


class _WorkerState:
    def __init__(self, client: Any) -> None:
        from lmshm.core.cuda_sync import WorkerCudaSync

        self.client = client
        self.sync = WorkerCudaSync(0, client=client)    # isolated mode: registers its flag page
        cycles_per_ms(0)                                # calibrate gpu_delay before anything is queued
        self.caches: dict[str, _Cache] = {}

    # every op_* method is callable from the test process
    def op_register(self, instance_id: str, order: list, split: int, seed: int) -> dict:
        """Allocate as vLLM does, fill with random bytes, register as LmshmConnector does."""
        from lmshm.core.dataplane import check_movable
        from lmshm.platform.contiguity import is_dense

        dtype = getattr(torch, DTYPE)
        item = dtype.itemsize
        # vLLM counts kernel blocks in dim 0: B * split of them, each N / split tokens
        shape = [LAYERS, BLOCKS * split, HEADS, TOKENS // split, (HEAD_SIZE + HEAD_SIZE_V) * item]
        buf = torch.zeros(math.prod(shape), dtype=torch.int8, device="cuda:0")   # allocate_kv_cache
        view_5d = torch.as_strided(buf, shape, vllm_layout_strides(shape, order), 0)
        gen = torch.Generator(device="cuda:0")
        gen.manual_seed(seed)
        buf.copy_(torch.randint(-128, 128, buf.shape, dtype=torch.int8, device="cuda:0", generator=gen))
        names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
        # what vLLM hands the connector, then block_view: kernel blocks regrouped per block
        views = [view_5d[i].view(dtype) for i in range(LAYERS)]
        views = [v if split == 1 else v.unflatten(0, (BLOCKS, split)) for v in views]
        if all(is_dense(tuple(v.shape), tuple(v.stride())) for v in views):
            registered = dict(zip(names, views))
        else:   # block-outermost: _combined, one [B, L, ...] view over the KVCacheTensor's layers
            first = views[0]
            step = view_5d.stride(0) // item            # vLLM's layer_stride, in elements
            combined = first.as_strided((first.shape[0], LAYERS, *first.shape[1:]),
                                        (first.stride(0), step, *first.stride()[1:]), first.storage_offset())
            for i, v in enumerate(views):
                same = combined[:, i]
                assert (same.data_ptr(), same.shape, same.stride()) == (v.data_ptr(), v.shape, v.stride()), i
            registered = {f"{names[0]}+{LAYERS - 1}": combined}
        check_movable(list(registered), list(registered.values()), 0)
        torch.cuda.synchronize()
        self.client.register_kv_caches(registered, instance_id, model_name="kv-layouts-gpu", block_dim=0)
        self.caches[instance_id] = _Cache(buf, view_5d, split)
        return {name: [list(t.shape), list(t.stride())] for name, t in registered.items()}

    def op_blocks(self, instance_id: str, blocks: list) -> bytes:
        """The bytes of ``blocks`` of every layer, ``[L, len(blocks), ...]``, as vLLM's views hold them."""
        c = self.caches[instance_id]
        idx = torch.tensor(blocks, device=c.buf.device)
        return c.blocks_of(c.buf)[:, idx].contiguous().cpu().numpy().tobytes()

    def op_store(self, instance_id: str, keys: list, blocks: list, chunk_blocks: int) -> dict:
        """STORE ``blocks`` with their bytes written ``DELAY_MS`` late on this worker's stream:
        the buffer is zeroed (and that finished), then the real bytes are copied back behind a
        ``gpu_delay`` and the request goes at once. A server that did not wait for the ordering
        signal would store zeros, and the comparison in B would show it."""
        c = self.caches[instance_id]
        real = c.buf.clone()
        c.buf.zero_()
        torch.cuda.synchronize()
        gpu_delay(DELAY_MS)
        c.buf.copy_(real)
        _event, handle = self.sync.ready()      # after the fill: the server's copies wait on it
        reply = self.client.store(instance_id, keys, blocks, chunk_blocks, event=handle)
        self.sync.wait(reply.event)
        del real                                # the caching allocator orders its reuse on this stream
        return {"results": [int(r) for r in reply.results], "nbytes": reply.nbytes}

    def _lookup(self, keys: list, timeout_s: float = 10.0) -> tuple[int, bytes]:
        """A CUDA STORE's chunks become visible once the server's copies completed, just after
        its reply: ask again until all are there."""
        deadline = time.monotonic() + timeout_s
        while True:
            found = self.client.lookup([keys])
            if found.hits == len(keys) or time.monotonic() > deadline:
                return found.hits, found.lease
            if found.lease:
                self.client.release(found.lease)
            time.sleep(0.01)

    def op_retrieve(self, instance_id: str, keys: list, blocks: list, chunk_blocks: int,
                    expect: bytes | None = None) -> dict:
        """RETRIEVE ``keys`` into ``blocks`` and check, on the GPU: with ``expect`` (what the
        storing worker's blocks held), K and V of every layer of every block, the other blocks
        against a snapshot taken before; without, that nothing changed. Lists (layer, block) pairs."""
        from lmshm.transport.client import ServerError

        c = self.caches[instance_id]
        snap = c.buf.clone()
        hits, lease = self._lookup(keys)
        if hits != len(keys):
            if lease:
                self.client.release(lease)
            return {"error": {"code": -1, "message": f"LOOKUP found {hits} of {len(keys)} stored chunks"}}
        # The worker's last use of the blocks lands DELAY_MS late (it rewrites what they hold): a
        # server that did not wait for the ordering signal would have its writes overwritten.
        gpu_delay(DELAY_MS)
        c.buf.copy_(snap)
        _event, handle = self.sync.ready()      # after that last use: the server's writes wait on it
        try:
            got = self.client.retrieve(instance_id, keys, blocks, chunk_blocks, lease, event=handle)
        except ServerError as exc:
            torch.cuda.synchronize()
            return {"error": {"code": int(exc.code), "message": exc.message},
                    "unchanged": bool(torch.equal(c.buf, snap))}
        self.sync.wait(got.event)               # the comparisons below are queued after the copies
        out: dict[str, Any] = {"chunks": got.chunks, "nbytes": got.nbytes}
        if expect is None:
            out["unchanged"] = bool(torch.equal(c.buf, snap))
            return out
        now, before = c.blocks_of(c.buf), c.blocks_of(snap)
        other_ids = [b for b in range(BLOCKS) if b not in blocks]
        dst = torch.tensor(blocks, device=c.buf.device)
        others = torch.tensor(other_ids, device=c.buf.device)

        def pairs(bad: Any, ids: list) -> list:
            return [(layer, ids[j]) for layer, j in bad.nonzero().tolist()]

        got_blocks = now[:, dst]
        want = torch.frombuffer(bytearray(expect), dtype=torch.int8).to(c.buf.device).view(got_blocks.shape)
        k = HEAD_SIZE * getattr(torch, DTYPE).itemsize    # C holds K, then V (FlashAttention's split)
        out["k_differs"] = pairs(~(got_blocks[..., :k] == want[..., :k]).flatten(2).all(-1), blocks)
        out["v_differs"] = pairs(~(got_blocks[..., k:] == want[..., k:]).flatten(2).all(-1), blocks)
        out["not_written"] = pairs((got_blocks == before[:, dst]).flatten(2).all(-1), blocks)
        out["others_changed"] = pairs(~(now[:, others] == before[:, others]).flatten(2).all(-1), other_ids)
        return out

    def op_unregister(self, instance_id: str) -> None:
        if self.caches.pop(instance_id, None) is not None:
            self.client.unregister_kv_caches(instance_id)


def _worker_main(conn: Any, url: str, fd_socket: str, isolated: bool, name: str) -> None:
    """A spawned worker: an MPClient on cuda:0 that runs ``op_<name>`` for each (op, kwargs) it
    receives and answers ("ok", result) or ("err", traceback). Its first answer says it is ready."""
    client = None
    try:
        from lmshm.platform import ipc_policy
        from lmshm.transport.client import MPClient

        ipc_policy.set_isolated_ipc(isolated)       # cuda-raw; else the default, cuda-torch
        ipc_policy.set_use_vmm_api(False)
        torch.cuda.set_device(0)
        client = MPClient(url, fd_socket=fd_socket, client_name=name, timeout_s=30)
        state = _WorkerState(client)
        conn.send(("ok", {"pid": os.getpid()}))
        while True:
            try:
                op, kwargs = conn.recv()
            except EOFError:
                return
            if op == "exit":
                client.close()
                conn.send(("ok", None))
                return
            try:
                reply = ("ok", getattr(state, f"op_{op}")(**kwargs))
            except BaseException:
                reply = ("err", traceback.format_exc())
            conn.send(reply)
    except BaseException:
        try:
            conn.send(("err", traceback.format_exc()))
        except (OSError, EOFError):
            pass
    finally:
        if client is not None:
            client.close()          # a no-op after "exit"
        conn.close()


# ---- the test process's side ---------------------------------------------------------------


class CudaWorker:
    """A spawned worker process; ``call(op, ...)`` runs ``op_<op>`` there and returns its result."""

    def __init__(self, url: str, fd_socket: str, isolated: bool, name: str) -> None:
        ctx = mp.get_context("spawn")
        self.name = name
        self._broken = ""
        self.conn, child = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(target=_worker_main, args=(child, url, fd_socket, isolated, name), name=name,
                                daemon=True)
        try:
            self.proc.start()
        except BaseException:
            self.conn.close()
            raise
        finally:
            child.close()

    def ready(self, timeout_s: float = 90.0) -> dict:
        return self._answer("start", timeout_s)

    def call(self, op: str, timeout_s: float = 60.0, **kwargs: Any) -> Any:
        if self._broken:
            raise WorkerError(f"worker {self.name} is unusable: {self._broken}")
        try:
            self.conn.send((op, kwargs))
        except (OSError, EOFError):
            self._died(op)
        return self._answer(op, timeout_s)

    def _died(self, op: str) -> None:
        self.proc.join(5)
        self._broken = f"it is gone (exit code {self.proc.exitcode}) since {op!r}"
        raise WorkerError(f"worker {self.name} is gone (exit code {self.proc.exitcode}) during {op!r}") from None

    def _answer(self, op: str, timeout_s: float) -> Any:
        try:
            answered = self.conn.poll(timeout_s)
            if answered:
                status, result = self.conn.recv()
        except (OSError, EOFError):
            self._died(op)
        if not answered:
            # Kill it and refuse further calls: a late answer would pass for the next call's reply.
            self.proc.kill()
            self._broken = f"it did not answer {op!r} within {timeout_s} s and was killed"
            raise TimeoutError(f"worker {self.name} did not answer {op!r} within {timeout_s} s (killed it)")
        if status == "err":
            raise WorkerError(f"worker {self.name}: {op!r} failed:\n{result}")
        return result

    @property
    def usable(self) -> bool:
        return not self._broken and self.proc.is_alive()

    def close(self) -> None:
        try:
            if self.usable:
                try:
                    self.conn.send(("exit", {}))
                    self.conn.poll(15)
                except (OSError, EOFError):
                    pass
            self.proc.join(15)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(10)
            self._broken = "closed"
            if self.proc.exitcode is not None:
                self.proc.close()           # its sentinel fd, now rather than at garbage collection
        finally:
            self.conn.close()


class Rig:
    def __init__(self, kind: str, server: ServerProcess, a: CudaWorker, b: CudaWorker) -> None:
        self.kind, self.server, self.a, self.b = kind, server, a, b

    def registration(self, instance_id: str) -> Any:
        from lmshm.transport.client import query_status

        regs = query_status(self.server.url).registrations
        found = [r for r in regs if r.instance_id == instance_id]
        assert len(found) == 1, f"{instance_id!r} is not registered once: {[r.instance_id for r in regs]}"
        return found[0]

    def wait_unpinned(self) -> None:
        """CUDA copies unpin their chunks once the server's event completes, after the reply."""
        from lmshm.transport.client import query_status

        wait_for(lambda: query_status(self.server.url).pool.pinned == 0, 10, 0.02, "the pool to have no pinned chunk")


@pytest.fixture(scope="module", params=KINDS)
def rig(request):
    """One lmshm-server and two CUDA workers (A stores, B retrieves) per wrapper kind."""
    kind = request.param
    isolated = kind == "cuda-raw"
    with scratch_dir() as tmp:
        server = ServerProcess(tmp, "--isolated-ipc" if isolated else "--no-isolated-ipc", "--capacity", "256MiB",
                               "--reap-timeout", "5")
        workers: list[CudaWorker] = []
        try:
            for side in ("a", "b"):       # both start before either is waited for
                workers.append(CudaWorker(server.url, server.fd_socket, isolated, f"kv-layouts-{kind}-{side}"))
            for w in workers:
                w.ready()
            yield Rig(kind, server, *workers)
        finally:
            for w in workers:
                w.close()
            rc = server.stop()              # also closes its pipe and log, dead or alive
            assert rc == 0, f"lmshm-server exited {rc}:\n{server.log()[-4000:]}"


def _unregister(*pairs: tuple) -> None:
    for worker, iid in pairs:
        if worker.usable:
            worker.call("unregister", instance_id=iid)


@pytest.mark.parametrize("layout,split", CASES)
def test_gpu_blocks_of_each_vllm_layout_round_trip_between_two_cuda_workers(rig, layout, split):
    from lmshm.wire.protocol import StoreResult

    ia, ib = f"{layout}-{split}-{rig.kind}-a", f"{layout}-{split}-{rig.kind}-b"
    try:
        ra = rig.a.call("register", instance_id=ia, order=list(LAYOUTS[layout]), split=split, seed=1)
        rb = rig.b.call("register", instance_id=ib, order=list(LAYOUTS[layout]), split=split, seed=2)
        names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
        if LAYOUTS[layout][0] == 0:        # layer-outermost: each layer's view
            assert list(ra) == names, ra
        else:                              # block-outermost: the layers together, [B, L, H, N, C]
            assert list(ra) == [f"{names[0]}+{LAYERS - 1}"] and ra[list(ra)[0]][0][:2] == [BLOCKS, LAYERS], ra
        assert ra == rb
        for iid in (ia, ib):
            reg = rig.registration(iid)
            assert reg.kinds == [rig.kind] and reg.block_dim == 0 and reg.num_layers == len(ra), reg

        want = rig.a.call("blocks", instance_id=ia, blocks=SRC)
        keys = [os.urandom(16) for _ in range(len(SRC) // CHUNK)]
        stored = rig.a.call("store", instance_id=ia, keys=keys, blocks=SRC, chunk_blocks=CHUNK)
        assert stored["results"] == [StoreResult.STORED] * len(keys), stored
        got = rig.b.call("retrieve", instance_id=ib, keys=keys, blocks=DST, chunk_blocks=CHUNK, expect=want)
        assert "error" not in got, got
        assert got["chunks"] == len(keys) and got["nbytes"] == stored["nbytes"], got
        assert got["k_differs"] == [] and got["v_differs"] == [], f"(layer, block) pairs that differ: {got}"
        assert got["not_written"] == [], f"(layer, block) pairs RETRIEVE left as they were: {got}"
        assert got["others_changed"] == [], f"(layer, block) pairs outside the RETRIEVE that changed: {got}"
        rig.wait_unpinned()
    finally:
        _unregister((rig.a, ia), (rig.b, ib))


def test_gpu_nhd_blocks_are_refused_with_layout_by_an_hnd_registration(rig):
    from lmshm.wire.protocol import ErrorCode, StoreResult

    ia, ib = f"nhd-{rig.kind}", f"hnd-{rig.kind}"
    try:
        rig.a.call("register", instance_id=ia, order=list(LAYOUTS["LBNHC"]), split=1, seed=3)   # NHD
        rig.b.call("register", instance_id=ib, order=list(LAYOUTS["LBHNC"]), split=1, seed=4)   # HND
        key = os.urandom(16)
        stored = rig.a.call("store", instance_id=ia, keys=[key], blocks=[1, 2], chunk_blocks=2)
        assert stored["results"] == [StoreResult.STORED], stored
        r = rig.b.call("retrieve", instance_id=ib, keys=[key], blocks=[1, 2], chunk_blocks=2)
        assert r.get("error", {}).get("code") == ErrorCode.LAYOUT, r
        assert "another layout" in r["error"]["message"], r
        assert r["unchanged"], "a refused RETRIEVE changed the registration's GPU memory"
        rig.wait_unpinned()
    finally:
        _unregister((rig.a, ia), (rig.b, ib))
