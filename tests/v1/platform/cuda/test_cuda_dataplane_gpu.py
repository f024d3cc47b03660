"""The CUDA data plane under the conditions a first GPU run would otherwise miss (issue 26):
the VMM data plane, more than 256 requests in flight in one session, a pool of tens of GiB,
isolated mode with a private /dev/shm per worker, and error paths that could leave copies
running into unmapped memory.

Every test runs a real ``python -m lmshm.server`` (``harness.ServerProcess``) and worker
processes (``dataplane_worker.py``, spawned as scripts: one JSON command per stdin line), on
cuda:0. A worker writes random blocks ``delay_ms`` late on its stream (``torch.cuda._sleep``)
and sends its STORE at once, so only the ordering signals keep the bytes right; another worker
RETRIEVEs them (its own last write of the destination also late) and the two sides' per-block
sha256 digests are compared. Skipped without CUDA, CuPy, cuda-python, msgspec or pyzmq; the
isolated test also needs root and ``unshare`` (a mount namespace per worker).
"""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

import pytest

torch = pytest.importorskip("torch")

HERE = Path(__file__).resolve().parent
WORKER = HERE / "dataplane_worker.py"
_SERVER_TESTS = str(HERE.parents[1] / "server")
if _SERVER_TESTS not in sys.path:
    sys.path.append(_SERVER_TESTS)     # after everything else: shadows nothing already importable

from cuda_testing import server_gpu_missing
from harness import ServerProcess, scratch_dir, server_rss_kb, wait_for

_REASON = server_gpu_missing()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(bool(_REASON), reason=_REASON or "n/a")]

#: What a server log must never say: a copy ran into memory that was unmapped (or the context is
#: broken for good, which fails every later copy).
FATAL = re.compile(r"illegal (memory )?(address|access)|CUDA_ERROR_(ILLEGAL|LAUNCH|MISALIGNED|HARDWARE|ECC)|"
                   r"cudaError(IllegalAddress|Launch)|unspecified launch failure", re.I)
STORED = 0


class WorkerError(RuntimeError):
    """A worker's op failed (the message carries its traceback), or it died or hung."""


class Worker:
    """``dataplane_worker.py`` as a subprocess (optionally under ``prefix``, e.g. ``unshare``)."""

    def __init__(self, server: ServerProcess, name: str, *, memory: str = "torch", isolated: bool = False,
                 prefix: Optional[list[str]] = None) -> None:
        self.name = name
        self.err_path = server.tmp / f"{name}.err"
        cmd = [*(prefix or []), sys.executable, str(WORKER), "--url", server.url, "--fd-socket", server.fd_socket,
               "--memory", memory, "--name", name, *(["--isolated"] if isolated else [])]
        with open(self.err_path, "w") as err:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True)
        self.hello: dict = {}

    def ready(self, timeout_s: float = 90.0) -> dict:
        self.hello = self._reply("start", timeout_s)
        return self.hello

    def stderr(self) -> str:
        try:
            return self.err_path.read_text()[-4000:]
        except OSError:
            return ""

    def _reply(self, op: str, timeout_s: float) -> dict:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait(10)
            raise WorkerError(f"worker {self.name} gave no answer to {op!r} within {timeout_s} s "
                              f"(exit code {self.proc.returncode}); stderr:\n{self.stderr()}")
        out = json.loads(line)
        if not out.get("ok"):
            raise WorkerError(f"worker {self.name}: {op!r} failed:\n{out.get('error')}")
        return out

    def call(self, op: str, timeout_s: float = 60.0, **kw: Any) -> dict:
        try:
            self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            self.proc.wait(10)
            raise WorkerError(f"worker {self.name} is gone (exit code {self.proc.returncode}) before {op!r}; "
                              f"stderr:\n{self.stderr()}") from None
        return self._reply(op, timeout_s)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "exit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(20)
            except (BrokenPipeError, OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(10)
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass


def start_workers(server: ServerProcess, *specs: tuple) -> list[Worker]:
    """Start every worker (name, kwargs) before waiting for any: their CUDA start-ups overlap."""
    workers = [Worker(server, name, **kw) for name, kw in specs]
    try:
        for w in workers:
            w.ready()
    except BaseException:
        for w in workers:
            w.close()
        raise
    return workers


def keys(n: int, tag: str) -> list[str]:
    return [(tag.encode()[:8].ljust(8, b"_") + i.to_bytes(8, "big")).hex() for i in range(n)]


def registration(url: str, instance_id: str) -> Any:
    from lmshm.transport.client import query_status

    found = [r for r in query_status(url).registrations if r.instance_id == instance_id]
    return found[0] if found else None


def wait_unpinned(url: str) -> None:
    from lmshm.transport.client import query_status

    wait_for(lambda: query_status(url).pool.pinned == 0, 15, 0.02, "the pool to have no pinned chunk")


def assert_clean_log(server: ServerProcess) -> None:
    bad = [line for line in server.log().splitlines() if FATAL.search(line)]
    assert not bad, "the server's log shows a CUDA fault:\n" + "\n".join(bad[:20])


def round_trip(url: str, a: Worker, b: Worker, ia: str, ib: str, tag: str, blocks: list, dst: list,
               chunk_blocks: int = 1, delay_ms: float = 50.0) -> dict:
    """A STOREs ``blocks`` (written ``delay_ms`` late), B RETRIEVEs them into ``dst`` (its last
    write of them late too); the digests of both sides must be equal, block for block."""
    ks = keys(len(blocks) // chunk_blocks, tag)
    put = a.call("put", instance_id=ia, keys=ks, blocks=blocks, chunk_blocks=chunk_blocks, delay_ms=delay_ms)
    assert put["results"] == [STORED] * len(ks), put["results"]
    got = b.call("get", instance_id=ib, keys=ks, blocks=dst, chunk_blocks=chunk_blocks, delay_ms=delay_ms)
    differ = [(s, d) for s, d, x, y in zip(blocks, dst, put["digests"], got["digests"]) if x != y]
    assert not differ, f"(stored block, retrieved block) pairs whose bytes differ: {differ}"
    wait_unpinned(url)
    return put


@pytest.fixture(scope="module")
def shared_server():
    """One default-mode server for the VMM and the in-flight tests: a session may have 1024
    requests in flight (the default, 256, would refuse the 257th of 600 as UNAVAILABLE)."""
    with scratch_dir() as tmp:
        server = ServerProcess(tmp, "--no-isolated-ipc", "--capacity", "1GiB", "--max-inflight-per-session", "1024",
                               "--reap-timeout", "5")
        try:
            yield server
        finally:
            log = server.log()
            rc = server.stop()
            assert rc == 0, f"lmshm-server exited {rc}:\n{log[-4000:]}"


def test_gpu_vmm_pools_store_and_retrieve_between_two_workers(shared_server):
    """Proves the VMM data plane (not only VMM registration): two workers with ``empty_vmm``
    pools (cuMemCreate, POSIX fd handles over the fd channel) register as cuda-vmm; blocks one
    writes late on its stream, STOREs and the other RETRIEVEs into other blocks come back byte
    for byte, in runs of two blocks per chunk."""
    a, b = start_workers(shared_server, ("vmm-a", {"memory": "vmm"}), ("vmm-b", {"memory": "vmm"}))
    try:
        for w, iid in ((a, "vmm-a"), (b, "vmm-b")):
            w.call("register", instance_id=iid, layers=3, blocks=32, block_bytes=64 << 10)
            reg = registration(shared_server.url, iid)
            assert reg is not None and reg.kinds == ["cuda-vmm"], reg
        round_trip(shared_server.url, a, b, "vmm-a", "vmm-b", "vmm", [5, 6, 20, 21, 0, 31], [1, 2, 9, 10, 30, 3],
                   chunk_blocks=2)
        for w, iid in ((a, "vmm-a"), (b, "vmm-b")):
            w.call("unregister", instance_id=iid)
    finally:
        a.close()
        b.close()
    assert_clean_log(shared_server)


def test_gpu_600_stores_in_flight_in_one_session_all_land(shared_server):
    """Proves a session can have far more than 256 CUDA requests in flight: 600 STOREs, each
    with its own ordering signal recorded after its block's (late) fill, are all sent before any
    reply is read (behind one 1 s delay); only then is each reply's server signal waited for, oldest first (the server
    must keep its signals alive that long, not recycle them after 256 newer ones). All 600 must
    be STORED, and a second worker RETRIEVEs every one byte for byte."""
    n, blocks = 600, 640
    a, b = start_workers(shared_server, ("many-a", {}), ("many-b", {}))
    try:
        for w, iid in ((a, "many-a"), (b, "many-b")):
            w.call("register", instance_id=iid, layers=2, blocks=blocks, block_bytes=4096)
        ks = keys(n, "many")
        ids = list(range(n))
        put = a.call("put_many", instance_id="many-a", keys=ks, blocks=ids, delay_ms=1000, timeout_s=120)
        print(f"\n600 STOREs sent in {put['sent_s'] * 1000:.0f} ms, {put['unanswered_after_send']} unanswered then, "
              f"all settled after {put['settled_s'] * 1000:.0f} ms")
        assert put["sent_s"] < 1.0, "sending took longer than the fills' delay: fewer were in flight together"
        assert put["results"] == [STORED] * n, [i for i, r in enumerate(put["results"]) if r != STORED][:20]
        got = b.call("get", instance_id="many-b", keys=ks, blocks=ids, delay_ms=20, timeout_s=120)
        differ = [i for i, (x, y) in enumerate(zip(put["digests"], got["digests"])) if x != y]
        assert not differ, f"{len(differ)} of {n} blocks differ, first {differ[:20]}"
        wait_unpinned(shared_server.url)
        for w, iid in ((a, "many-a"), (b, "many-b")):
            w.call("unregister", instance_id=iid)
    finally:
        a.close()
        b.close()
    assert_clean_log(shared_server)


def test_gpu_a_32gib_pool_answers_the_first_cuda_store_within_3s_without_pinning_it_whole():
    """Proves the pool is not page-locked (and so faulted in) whole at the first CUDA request:
    with ``--capacity 32GiB`` the first CUDA STORE is answered within 3 s, and the server's
    resident memory (VmRSS) stays far below the capacity through a STORE/RETRIEVE round trip."""
    capacity = 32 << 30
    with scratch_dir() as tmp:
        server = ServerProcess(tmp, "--no-isolated-ipc", "--capacity", "32GiB", "--reap-timeout", "5")
        workers: list[Worker] = []
        try:
            workers = start_workers(server, ("big-a", {}), ("big-b", {}))
            a, b = workers
            for w, iid in ((a, "big-a"), (b, "big-b")):
                w.call("register", instance_id=iid, layers=4, blocks=64, block_bytes=256 << 10)
            rss0 = server_rss_kb(server.proc.pid) << 10
            t0 = time.monotonic()
            put = a.call("put", instance_id="big-a", keys=keys(8, "big"), blocks=list(range(8)), chunk_blocks=1,
                         delay_ms=1, timeout_s=60)
            took = time.monotonic() - t0
            rss1 = server_rss_kb(server.proc.pid) << 10
            print(f"\nfirst CUDA STORE answered in {put['reply_s'] * 1000:.0f} ms; server VmRSS "
                  f"{rss0 >> 20} MiB before, {rss1 >> 20} MiB after (capacity {capacity >> 30} GiB)")
            assert put["results"] == [STORED] * 8, put
            assert put["reply_s"] <= 3.0, f"the first CUDA STORE took {put['reply_s']:.1f} s (limit 3 s; {took:.1f} s round)"
            round_trip(server.url, a, b, "big-a", "big-b", "big2", list(range(8, 40)), list(range(32, 64)))
            rss2 = server_rss_kb(server.proc.pid) << 10
            assert max(rss1, rss2) < capacity // 8, (f"the server holds {max(rss1, rss2) >> 20} MiB resident with a "
                                                     f"{capacity >> 30} GiB pool: it was pinned or faulted in whole")
            assert max(rss1, rss2) - rss0 < 2 << 30, f"the server's RSS grew by {(max(rss1, rss2) - rss0) >> 20} MiB"
        finally:
            for w in workers:
                w.close()
            log = server.log()
            rc = server.stop()
        assert rc == 0, f"lmshm-server exited {rc}:\n{log[-4000:]}"
        assert not FATAL.search(log), log[-4000:]


# ---- isolated mode, each worker with its own /dev/shm ---------------------------------------

_PRIVATE_SHM = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                'mount -t tmpfs -o size=256m tmpfs /dev/shm && exec "$0" "$@"']


def _private_shm_missing() -> str:
    if os.geteuid() != 0:
        return "needs root (unshare --mount and mount -t tmpfs)"
    if shutil.which("unshare") is None:
        return "unshare is not installed"
    probe = subprocess.run([*_PRIVATE_SHM, "true"], capture_output=True, text=True, timeout=20)
    if probe.returncode != 0:
        return f"a mount namespace with a private /dev/shm cannot be made here: {probe.stderr.strip()[:200]}"
    return ""


def test_gpu_isolated_mode_works_with_a_private_dev_shm_per_worker():
    """Proves isolated mode's CUDA data plane needs no /dev/shm shared with the server: each of
    two workers runs in its own mount namespace with a private tmpfs on /dev/shm (checked: other
    device, a file made there invisible elsewhere), registers cudaMalloc KV caches with raw IPC
    handles (cuda-raw) to a ``--isolated-ipc`` server, one STOREs blocks written late on its
    stream (ordering by the isolated mode's signal, not interprocess events, which need a shared
    /dev/shm), the other RETRIEVEs them, its own last write late too: equal byte for byte."""
    reason = _private_shm_missing()
    if reason:
        pytest.skip(reason)
    with scratch_dir() as tmp:
        server = ServerProcess(tmp, "--isolated-ipc", "--capacity", "1GiB", "--reap-timeout", "5")
        workers: list[Worker] = []
        marker = ""
        try:
            workers = start_workers(server, ("iso-a", {"isolated": True, "prefix": _PRIVATE_SHM}),
                                    ("iso-b", {"isolated": True, "prefix": _PRIVATE_SHM}))
            a, b = workers
            sa, sb = a.call("shm"), b.call("shm")
            host = os.stat("/dev/shm").st_dev
            assert len({sa["dev"], sb["dev"], host}) == 3, (sa, sb, host)
            marker = sa["marker"]
            assert sa["marker"] not in sb["entries"] and not os.path.exists(f"/dev/shm/{marker}"), (sa, sb)
            for w, iid in ((a, "iso-a"), (b, "iso-b")):
                w.call("register", instance_id=iid, layers=2, blocks=32, block_bytes=64 << 10)
                reg = registration(server.url, iid)
                assert reg is not None and reg.kinds == ["cuda-raw"], reg
            put = round_trip(server.url, a, b, "iso-a", "iso-b", "iso", [3, 4, 17, 30], [8, 9, 0, 1], delay_ms=100)
            # isolated mode answers once its copies completed, and those waited for the late fill
            assert put["reply_s"] >= 0.05, f"isolated STORE answered after {put['reply_s'] * 1000:.0f} ms, " \
                                           "before the fill it must wait for had landed"
            for w, iid in ((a, "iso-a"), (b, "iso-b")):
                w.call("unregister", instance_id=iid)
        finally:
            for w in workers:
                w.close()
            log = server.log()
            rc = server.stop()
        assert rc == 0, f"lmshm-server exited {rc}:\n{log[-4000:]}"
        assert not FATAL.search(log), log[-4000:]
        assert not marker or not os.path.exists(f"/dev/shm/{marker}"), "a worker's private /dev/shm leaked out"


def test_gpu_isolated_mode_a_flag_word_never_written_fails_the_store_at_its_deadline_and_the_server_recovers():
    """Proves the isolated mode's bounded wait: a STORE whose flag token names a number the
    worker never writes is waited for on the host (the word read with 8-byte copies), never on
    the GPU; at --cuda-timeout (2 s) the request fails UNAVAILABLE with nothing reserved or
    queued (counted as late, nothing quarantined), and a later round trip on the same server is
    byte for byte right."""
    from lmshm.transport.client import query_status
    from lmshm.wire.protocol import ErrorCode

    with scratch_dir() as tmp:
        server = ServerProcess(tmp, "--isolated-ipc", "--capacity", "1GiB", "--cuda-timeout", "2",
                               "--reap-timeout", "5")
        workers: list[Worker] = []
        try:
            workers = start_workers(server, ("stuck-a", {"isolated": True}), ("stuck-b", {"isolated": True}))
            a, b = workers
            for w, iid in ((a, "stuck-a"), (b, "stuck-b")):
                w.call("register", instance_id=iid, layers=2, blocks=16, block_bytes=64 << 10)
            got = a.call("store_never_signalled", instance_id="stuck-a", keys=keys(1, "stuck"), blocks=[2])
            assert got.get("error", {}).get("code") == ErrorCode.UNAVAILABLE, got
            assert 1.5 <= got["s"] < 15, f"the STORE was answered after {got['s']:.2f} s, not at its 2 s deadline"
            wait_for(lambda: query_status(server.url).pool.in_flight == 0, 15, 0.05,
                     "the failed STORE's reserved bytes to come back")
            pool = query_status(server.url).pool
            assert pool.objects == 0 and pool.late >= 1 and pool.cuda_quarantined == 0, pool
            round_trip(server.url, a, b, "stuck-a", "stuck-b", "after", [3, 4], [8, 9], delay_ms=50)
        finally:
            for w in workers:
                w.close()
            log = server.log()
            rc = server.stop()
        assert rc == 0, f"lmshm-server exited {rc}:\n{log[-4000:]}"
        assert not FATAL.search(log), log[-4000:]


# ---- error paths: nothing may copy into memory that is gone -----------------------------------


def test_gpu_bad_block_ids_and_workers_killed_with_copies_queued_leave_the_server_and_pool_sound():
    """Proves the CUDA error paths do not free or unmap memory under queued copies, and that a
    dead worker holds neither its GPU memory nor the server's copies (issue 42 §3): a STORE whose
    block ids are partly out of range is refused (or stores only what it may) and leaves no CUDA
    error; then a cuda-torch worker and a cuda-vmm worker, each with a 2 GiB KV cache, send 64
    STOREs whose fills are 500 ms late on their stream and are SIGKILLed with their ordering
    signals pending. The server must stay up, reclaim both, quarantine nothing
    (``cuda_quarantined`` 0: no copy waited on a dead worker's signal), give the dead workers'
    device memory back (``cudaMemGetInfo`` at least what it was before they allocated their
    caches), answer the others, a later STORE/RETRIEVE round trip between two other workers must
    compare equal, and its log must show no illegal address or launch failure."""
    from lmshm.transport.client import query_status

    with scratch_dir() as tmp:
        server = ServerProcess(tmp, "--no-isolated-ipc", "--capacity", "1GiB", "--reap-timeout", "2")
        workers: list[Worker] = []
        try:
            workers = start_workers(server, ("err-a", {}), ("err-b", {}), ("doomed-torch", {}),
                                    ("doomed-vmm", {"memory": "vmm"}))
            a, b, doomed_torch, doomed_vmm = workers
            for w, iid in ((a, "err-a"), (b, "err-b")):
                w.call("register", instance_id=iid, layers=2, blocks=64, block_bytes=64 << 10)
            torch.cuda.synchronize()
            free_before = torch.cuda.mem_get_info(0)[0]     # before the doomed workers' caches exist
            for w, iid in ((doomed_torch, "doomed-torch"), (doomed_vmm, "doomed-vmm")):
                w.call("register", instance_id=iid, layers=2, blocks=64, block_bytes=16 << 20)   # 2 GiB each

            # 1. partly invalid block ids: the first chunk's are fine, the second's beyond the pool
            bad = a.call("store_raw", instance_id="err-a", keys=keys(2, "bad"), blocks=[1, 2, 63, 1 << 20],
                         chunk_blocks=2)
            print(f"\nSTORE with a block id beyond the pool: {bad}")
            assert "error" in bad or bad["results"][1] != STORED, bad
            wait_unpinned(server.url)
            round_trip(server.url, a, b, "err-a", "err-b", "after-bad", [1, 2, 3], [10, 11, 12])
            assert_clean_log(server)

            # 2. workers killed with their STOREs' copies queued behind a late fill
            for w, iid in ((doomed_torch, "doomed-torch"), (doomed_vmm, "doomed-vmm")):
                said = w.call("put_and_die", instance_id=iid, keys=keys(64, iid), blocks=list(range(64)),
                              delay_ms=500)
                print(f"{iid}: {said}")
                w.proc.wait(30)
                wait_for(lambda: registration(server.url, iid) is None, 20, 0.05, f"{iid} to be reclaimed")
                assert server.alive, f"lmshm-server died after {iid} was killed:\n{server.log()[-4000:]}"
            time.sleep(1.0)                   # whatever the server still had queued has run by now
            assert query_status(server.url).registrations is not None
            assert query_status(server.url).pool.cuda_quarantined == 0, \
                "a copy was queued behind a dead worker's signal: its bytes and mapping went to the quarantine"
            # their contexts, scratch and 4 GiB of caches are gone; the server's new streams may cost a little
            slack = 256 << 20
            wait_for(lambda: torch.cuda.mem_get_info(0)[0] >= free_before - slack, 10, 0.05,
                     "the dead workers' device memory to come back")
            round_trip(server.url, a, b, "err-a", "err-b", "after-kill", list(range(20, 36)), list(range(40, 56)),
                       chunk_blocks=2)
            assert_clean_log(server)
            for w, iid in ((a, "err-a"), (b, "err-b")):
                w.call("unregister", instance_id=iid)
        finally:
            for w in workers:
                w.close()
            log = server.log()
            rc = server.stop()
        assert rc == 0, f"lmshm-server exited {rc}:\n{log[-4000:]}"


@pytest.mark.parametrize("batch", [True, False], ids=["batched", "per-piece"])
def test_gpu_objects_straddling_small_pin_extents_round_trip(batch):
    """Issue 42 §2: the driver refuses a copy whose host range is page-locked only in part. With
    ``--cuda-pin-extent 64KiB`` and chunk objects of 120 KiB (3 layers x 2 blocks x 20 KiB), every
    object reaches across one or two extent edges; STOREs and RETRIEVEs of shuffled blocks must
    come back byte for byte, in one cuMemcpyBatchAsync per request (``batched``: needs a CUDA
    12.8+ driver) or one cuMemcpyAsync per piece (``--no-cuda-copy-batch``)."""
    from lmshm.transport.client import query_status

    extent = 64 << 10
    with scratch_dir() as tmp:
        server = ServerProcess(tmp, "--no-isolated-ipc", "--capacity", "64MiB", "--cuda-pin-extent", "64KiB",
                               *([] if batch else ["--no-cuda-copy-batch"]))
        try:
            a, b = start_workers(server, ("ext-a", {}), ("ext-b", {}))
            try:
                for w, iid in ((a, "ext-a"), (b, "ext-b")):
                    w.call("register", instance_id=iid, layers=3, blocks=64, block_bytes=20 << 10)
                src = [7, 3, 40, 41, 12, 60, 5, 6, 33, 2, 50, 18]
                dst = [1, 9, 20, 21, 63, 0, 44, 45, 8, 30, 31, 11]
                round_trip(server.url, a, b, "ext-a", "ext-b", "ext", src, dst, chunk_blocks=2)
                pool = query_status(server.url).pool
                assert pool.cuda_copy_path == ("batch" if batch else "per-piece"), \
                    f"{pool.cuda_copy_path!r}: a batched run needs a driver with cuMemcpyBatchAsync (CUDA 12.8+)"
                assert pool.cuda_copy_calls == (2 if batch else pool.cuda_copy_pieces), pool
                # uncut: per layer, a chunk of 2 blocks is 2 pieces, 1 where both sides are consecutive
                # (STORE: 40-41 and 5-6; RETRIEVE: 20-21 and 44-45): (10 + 10) x 3 layers = 60; every
                # 120 KiB object crosses at least one 64 KiB edge, on both ways: 12 pieces more at least
                assert pool.cuda_copy_pieces >= 60 + 12, pool
                assert pool.cuda_pinned_bytes % extent == 0 and pool.cuda_pinned_bytes >= 6 * 120 * 1024, pool
                for w, iid in ((a, "ext-a"), (b, "ext-b")):
                    w.call("unregister", instance_id=iid)
            finally:
                a.close()
                b.close()
            assert_clean_log(server)
        finally:
            log = server.log()
            rc = server.stop()
            assert rc == 0, f"lmshm-server exited {rc}:\n{log[-4000:]}"
