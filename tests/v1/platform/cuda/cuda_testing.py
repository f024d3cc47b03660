"""Spawned producer processes for the GPU tests and the GPU benchmark.

A CUDA IPC handle cannot be opened by the process that exported it, so every GPU check needs
a second process. ``Producer`` spawns one (``multiprocessing`` spawn context: no CUDA state is
inherited) that allocates tensors, wraps them and answers named operations over a pipe; the
calling process plays the consumer (the server's role): it decodes the wrapper bytes, files
the fds it received in ``FD_INBOX`` and maps with ``to_tensor()``. File descriptors (VMM POSIX
handles) travel over the same pipe with SCM_RIGHTS, as they would over the fd channel.

``gpu_delay`` queues a calibrated ``torch.cuda._sleep`` on the current stream: the ordering tests
put it before a fill, so a server that ignored the worker's ordering signal would copy stale bytes.

``measure_reclaim`` is the worker-crash scenario: the producer exports a pool, the consumer
maps it, the producer is SIGKILLed, the consumer releases its mappings (what the server's
reclaim does) and the device's free memory is polled until the pool is back.

Nothing here runs at import; it needs a CUDA device, CuPy and cuda-python when used.

A test helper, not part of the shipped package: the tests beside it import it as the plain
module ``cuda_testing`` (conftest.py puts this directory on ``sys.path``; ``gpu_worker.py`` runs
from it), and bench/gpu_registration.py puts this directory on ``sys.path`` first. Spawned
producers find it too: multiprocessing's spawn start method hands the parent's ``sys.path``
to the child.
"""

from __future__ import annotations

import contextlib
import hashlib
import multiprocessing as mp
import os
import signal
import threading
import time
import traceback
from multiprocessing import reduction
from typing import Any, Iterator

PATTERN_PRIME = 251
_FILL_PERIODS = 1 << 16          # one fill block: 251 * 65536 bytes (~16 MiB)

KINDS = ("cuda-torch", "cuda-raw", "cuda-vmm")


class PeerError(RuntimeError):
    """An operation failed in the producer process; the message carries its traceback."""


def server_gpu_missing() -> str:
    """Why a test that runs lmshm-server and CUDA workers cannot run here ("" if it can)."""
    import importlib.util

    import torch

    if importlib.util.find_spec("lmshm.server") is None:
        return "lmshm.server is not available"
    if not torch.cuda.is_available():
        return "no CUDA device visible"
    for mod in ("cupy", "cuda.bindings", "zmq", "msgspec"):
        try:
            if importlib.util.find_spec(mod) is None:
                return f"{mod} is not installed"
        except ModuleNotFoundError:
            return f"{mod} is not installed"
    return ""


def wrapper_class(kind: str) -> type:
    from lmshm.platform import cuda

    return {"cuda-torch": cuda.CudaIPCWrapper, "cuda-raw": cuda.RawCudaIPCWrapper,
            "cuda-vmm": cuda.VmmCudaIPCWrapper}[kind]


def apply_view(t: Any, view: tuple = ()) -> Any:
    """Apply a small, picklable view recipe: ("select", dim, i), ("slice", dim, a, b), ("permute", dims)."""
    for step in view:
        op, *args = step
        if op == "select":
            t = t.select(args[0], args[1])
        elif op == "slice":
            t = t.narrow(args[0], args[1], args[2] - args[1])
        elif op == "permute":
            t = t.permute(*args[0])
        else:
            raise ValueError(f"unknown view step {step!r}")
    return t


def digest(t: Any) -> str:
    """sha256 of a tensor's elements in logical order (bytes, so fp8 NaN patterns compare)."""
    import torch

    u8 = t.contiguous().view(torch.uint8)
    return hashlib.sha256(u8.cpu().numpy().tobytes()).hexdigest()


def fill_pattern(u8: Any, seed: int = 0) -> None:
    """Write ``(i * 131 + seed) % 251`` into byte ``i`` of the flat uint8 tensor ``u8``.

    The pattern repeats every 251 bytes, so one block of whole periods (at most ~16 MiB) is
    built once and copied along the tensor. No temporary the size of the tensor is made: an
    int64 ``arange`` over a 4 GiB pool would leave ~64 GiB in the allocator's cache, which the
    process's death then frees -- and which the reclaim measurements would mistake for the
    pool coming back.
    """
    import torch

    n = u8.numel()
    period = torch.arange(PATTERN_PRIME, device=u8.device, dtype=torch.int64)
    period = ((period * 131 + seed) % PATTERN_PRIME).to(torch.uint8)
    block = period.repeat(min(_FILL_PERIODS, -(-n // PATTERN_PRIME)))
    step = block.numel()                      # a multiple of the period: every block starts in phase
    for start in range(0, n, step):
        stop = min(n, start + step)
        u8[start:stop].copy_(block[:stop - start])


# ---- delays on the GPU: what makes an ordering test able to fail --------------------------

_CYCLES_PER_MS: dict[int, float] = {}


def cycles_per_ms(device: int = 0) -> float:
    """``torch.cuda._sleep``'s spin cycles per millisecond on ``device``, measured once per process.

    Measured rather than taken from the clock rate: the SM clock boosts, and the figure only has
    to be right to a factor of two. It synchronises the device, so call it before anything whose
    ordering a test checks is queued.
    """
    import torch

    if device not in _CYCLES_PER_MS:
        with torch.cuda.device(device):
            torch.cuda._sleep(1000)                  # loads the kernel
            torch.cuda.synchronize()
            n = 20_000_000                           # ~10 ms at 2 GHz
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.cuda._sleep(n)
            end.record()
            end.synchronize()
            _CYCLES_PER_MS[device] = n / max(start.elapsed_time(end), 1e-3)
    return _CYCLES_PER_MS[device]


def gpu_delay(ms: float, device: int = 0) -> None:
    """Queue ``ms`` milliseconds of spinning on the current stream and return at once: whatever is
    queued after it on this stream (a fill) runs that much later, while the host goes on and
    sends its request. A peer that does not wait for this stream's ordering signal sees the bytes
    as they were before."""
    import torch

    torch.cuda._sleep(max(1, int(ms * cycles_per_ms(device))))


# ---- the producer process -----------------------------------------------------------------

class _ProducerState:
    def __init__(self) -> None:
        self.tensors: dict[str, Any] = {}
        self.wrappers: list[Any] = []

    # every op_* method is callable from the parent
    def op_ping(self) -> int:
        return os.getpid()

    def op_memfd(self, data: bytes) -> dict:
        """A memfd holding ``data`` (checks the fd plumbing without a GPU)."""
        fd = os.memfd_create("lmshm-selftest", os.MFD_CLOEXEC)
        os.write(fd, data)
        self.wrappers.append(_FdCloser(fd))
        return {"fds": {"selftest": fd}}

    def op_alloc(self, name: str, shape: tuple, dtype: str, memory: str = "torch",
                 handle_type: str = "posix-fd", chunk_bytes: int | None = None, seed: int = 0) -> dict:
        import torch

        from lmshm.platform.cuda import empty_vmm

        dt = getattr(torch, dtype)
        if memory == "torch":
            t = torch.empty(shape, dtype=dt, device="cuda")
        elif memory == "vmm":
            t = empty_vmm(shape, dt, "cuda", handle_type=handle_type, chunk_bytes=chunk_bytes)
        else:
            raise ValueError(f"unknown memory kind {memory!r}")
        u8 = t.view(torch.uint8).view(-1)
        fill_pattern(u8, seed)
        torch.cuda.synchronize()
        # Hand the fill's scratch back to the driver: this process should hold its tensors and
        # nothing else (reclaim measurements; one cudaMalloc segment per separate allocation).
        torch.cuda.empty_cache()
        self.tensors[name] = t
        return {"ptr": t.data_ptr(), "nbytes": u8.numel()}

    def _wrap(self, name: str, kind: str, view: tuple, options: dict) -> Any:
        t = apply_view(self.tensors[name], view)
        w = wrapper_class(kind).wrap(t, name=name, **options)
        self.wrappers.append(w)
        return w

    def op_wrap(self, name: str, kind: str, view: tuple = (), in_fresh_thread: bool = False,
                **options: Any) -> dict:
        """Wrap one view; optionally from a new thread that has no current CUDA context."""
        from lmshm.platform.cuda.driver import get_driver

        if not in_fresh_thread:
            w = self._wrap(name, kind, view, options)
            return {"payload": w.Serialize(), "fds": w.export_fds()}
        t = self.tensors[name]
        get_driver().device_uuid(t.device.index)   # warm torch's cache: the thread makes driver calls only
        out: dict[str, Any] = {}

        def run() -> None:
            try:
                out["ctx_before"] = get_driver().current_context()
                w = self._wrap(name, kind, view, options)
                out["ctx_after"] = get_driver().current_context()
                out.update(payload=w.Serialize(), fds=w.export_fds())
            except BaseException as exc:
                out["error"] = exc

        th = threading.Thread(target=run, name="lmshm-fresh-thread")
        th.start()
        th.join()
        if "error" in out:
            raise out["error"]
        return out

    def op_wrap_views(self, name: str, kind: str, views: list, **options: Any) -> dict:
        """Wrap many views (or many tensors: views of ("", name_i)); timed."""
        t0 = time.perf_counter()
        ws = []
        for v in views:
            tname, view = (v[1], ()) if v and v[0] == "tensor" else (name, v)
            ws.append(self._wrap(tname, kind, tuple(view), options))
        payloads = [w.Serialize() for w in ws]
        elapsed = time.perf_counter() - t0
        fds: dict[str, int] = {}
        for w in ws:
            fds.update(w.export_fds())
        return {"payloads": payloads, "fds": fds, "wrap_s": elapsed}

    def op_wrap_group(self, name: str, kind: str) -> dict:
        """Wrap every t[i] of tensor ``name`` the way wrap_kv_caches does (leader + siblings)
        and fold them into wire groups; returns each group's payload and storage offsets."""
        from lmshm.transport.client import layer_groups

        t = self.tensors[name]
        leader = wrapper_class(kind).wrap(t[0], name=f"{name}[0]")
        ws = [leader] + [leader.sibling_for(t[i], t.untyped_storage().data_ptr()) for i in range(1, t.shape[0])]
        self.wrappers.extend(ws)
        groups = layer_groups([f"l{i}" for i in range(len(ws))], ws)
        fds: dict[str, int] = {}
        for g in groups:
            fds.update(g.wrapper.export_fds())
        return {"groups": [(g.wrapper.Serialize(), list(g.storage_offsets)) for g in groups], "fds": fds}

    def op_try_wrap(self, name: str, kind: str, view: tuple = (), **options: Any) -> dict:
        try:
            self._wrap(name, kind, view, options)
        except Exception as exc:
            return {"error": type(exc).__name__, "message": str(exc)}
        return {"error": None, "message": ""}

    def op_digest(self, name: str, view: tuple = ()) -> str:
        return digest(apply_view(self.tensors[name], view))

    def op_read(self, name: str, view: tuple = (), n: int = 16) -> bytes:
        import torch

        torch.cuda.synchronize()
        u8 = apply_view(self.tensors[name], view).contiguous().view(torch.uint8).view(-1)
        return bytes(u8[:n].cpu().tolist())

    def op_free(self, name: str) -> None:
        """Drop a tensor and return its memory to the driver (not to torch's cache)."""
        import torch

        self.tensors.pop(name, None)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()

    def op_close_wrappers(self) -> None:
        for w in self.wrappers:
            w.close()
        self.wrappers.clear()

    def op_device_attribute(self, name: str) -> int:
        from lmshm.platform.cuda.driver import get_driver

        return get_driver().device_attribute(name, 0)


class _FdCloser:
    def __init__(self, fd: int) -> None:
        self.fd = fd

    def close(self) -> None:
        os.close(self.fd)


def _producer_main(conn: Any) -> None:
    state = _ProducerState()
    while True:
        try:
            op, args, kwargs = conn.recv()
        except EOFError:
            return
        if op == "exit":
            conn.send(("ok", None, []))
            return
        fds: dict[str, int] = {}
        try:
            result = getattr(state, f"op_{op}")(*args, **kwargs)
            if isinstance(result, dict) and "fds" in result:
                fds = result.pop("fds")
            reply = ("ok", result, list(fds))
        except BaseException:
            reply = ("err", traceback.format_exc(), [])
            fds = {}
        conn.send(reply)
        for fd in fds.values():
            reduction.send_handle(conn, fd, os.getppid())


@contextlib.contextmanager
def _environment(env: dict[str, str] | None) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class Producer:
    """A spawned producer process. ``call(op, ...)`` runs ``op_<op>`` there and returns its result.

    Results that carry file descriptors come back with ``"fds": {token: fd}``, the fds now
    owned by this process (file them in ``FD_INBOX``). ``env`` is set in the child's
    environment before it starts (e.g. ``PYTORCH_CUDA_ALLOC_CONF``).
    """

    def __init__(self, env: dict[str, str] | None = None, start_timeout_s: float = 60.0) -> None:
        ctx = mp.get_context("spawn")
        self._broken = ""
        self.conn, child = ctx.Pipe(duplex=True)
        with _environment(env):
            self.proc = ctx.Process(target=_producer_main, args=(child,), name="lmshm-producer", daemon=True)
            self.proc.start()
        child.close()
        self.pid = self.call("ping", timeout_s=start_timeout_s)

    def call(self, op: str, *args: Any, timeout_s: float = 60.0, **kwargs: Any) -> Any:
        if self._broken:
            raise PeerError(f"producer is unusable: {self._broken}")
        try:
            self.conn.send((op, args, kwargs))
            answered = self.conn.poll(timeout_s)
            if answered:
                status, result, tokens = self.conn.recv()
        except (EOFError, OSError) as exc:   # it died: fail now, with its exit code
            self.proc.join(5)
            raise PeerError(f"producer process is gone (exit code {self.proc.exitcode}) during {op!r}: "
                            f"{type(exc).__name__}") from None
        if not answered:
            # Kill it and refuse further calls: a late answer would pass for the next call's reply.
            self.proc.kill()
            self._broken = f"it did not answer {op!r} within {timeout_s} s and was killed"
            raise TimeoutError(f"producer did not answer {op!r} within {timeout_s} s (killed it)")
        if status == "err":
            raise PeerError(f"producer op {op!r} failed:\n{result}")
        if tokens:
            result["fds"] = {t: reduction.recv_handle(self.conn) for t in tokens}
        return result

    def kill(self) -> float:
        """SIGKILL the producer; returns the monotonic time of the kill."""
        t = time.monotonic()
        os.kill(self.proc.pid, signal.SIGKILL)
        return t

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send(("exit", (), {}))
                self.conn.poll(10)
            except (OSError, EOFError):
                pass
            self.proc.join(10)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(5)
        self.conn.close()

    def __enter__(self) -> "Producer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# ---- the consumer side ------------------------------------------------------------------------

def receive(payload: bytes, fds: dict[str, int] | None = None, session: str = "gpu-test") -> Any:
    """Decode a wrapper as the server would: file its fds in FD_INBOX under ``session``, then
    ``admit`` it for the producer (a child of this process, same uid and PID namespace), which
    runs the server's ownership checks -- for cuda-torch, on torch's real counter file."""
    import os

    from lmshm.platform.base.fds import FD_INBOX
    from lmshm.platform.base.ipc_wrapper import DeviceIPCWrapper
    from lmshm.platform.base.peer import Peer, own_pid_namespace

    for token, fd in (fds or {}).items():
        FD_INBOX.put(token, fd, session)
    wrapper = DeviceIPCWrapper.Deserialize(payload)
    pid = int(wrapper.producer.split("-", 1)[0])
    wrapper.admit(Peer(session=session, pid=pid, uid=os.geteuid(), gid=os.getegid(), ns_pid=pid,
                       pid_ns=own_pid_namespace()))
    return wrapper


def open_count(kind: str) -> int:
    """Driver-level opens so far in this process for wrappers of ``kind``."""
    if kind == "cuda-torch":
        from lmshm.platform.cuda.torch_ipc import stats

        return stats["storage_opens"]
    from lmshm.platform.cuda.driver import get_driver

    name = "cuIpcOpenMemHandle" if kind == "cuda-raw" else "cuMemImportFromShareableHandle"
    return get_driver().calls[name]


def release_consumer_side(wrappers: list, tensors: list, session: str) -> None:
    """What the server's reclaim does: close every wrapper, drop every tensor, close the fds."""
    import gc

    from lmshm.platform.base.fds import FD_INBOX

    for w in wrappers:
        w.close()
    wrappers.clear()
    tensors.clear()
    gc.collect()
    FD_INBOX.close_session(session)


def free_bytes(ordinal: int = 0) -> int:
    from lmshm.platform.cuda.driver import get_driver

    return get_driver().mem_info(ordinal)[0]


def measure_reclaim(kind: str, pool_bytes: int, layers: int = 8, timeout_s: float = 10.0,
                    session: str = "reclaim") -> dict[str, float]:
    """Kill a producer whose pool this process maps; release; time until the pool is free again.

    Free memory is compared with what the device had *before the producer started*, so the
    producer's own context (freed by its death whatever happens) is not counted as the pool.
    Returns ``reclaim_s`` (kill -> at most 5% of the pool still missing), ``pinned_frac``
    (share of the pool still missing after the producer died, before this process released its
    mappings) and ``recovered_frac`` (share back at the end).
    """
    import torch

    memory = "vmm" if kind == "cuda-vmm" else "torch"
    per_layer = pool_bytes // layers
    wrappers, tensors = [], []
    torch.cuda.synchronize()
    free0 = free_bytes()
    with Producer() as producer:
        try:
            producer.call("alloc", "pool", (layers, per_layer), "uint8", memory=memory)
            out = producer.call("wrap_views", "pool", kind, [(("select", 0, i),) for i in range(layers)])
            for i, payload in enumerate(out["payloads"]):
                w = receive(payload, out["fds"] if i == 0 else None, session)
                wrappers.append(w)
                tensors.append(w.to_tensor())
            torch.cuda.synchronize()
            t_kill = producer.kill()
            producer.proc.join(timeout_s)
            time.sleep(0.05)
            pinned = min(1.0, max(0.0, (free0 - free_bytes()) / pool_bytes))
        finally:
            release_consumer_side(wrappers, tensors, session)
        deadline = t_kill + timeout_s
        missing = free0 - free_bytes()
        while missing > 0.05 * pool_bytes and time.monotonic() < deadline:
            time.sleep(0.005)
            missing = free0 - free_bytes()
        reclaim_s = time.monotonic() - t_kill
    return {"reclaim_s": reclaim_s, "pinned_frac": pinned,
            "recovered_frac": 1.0 - max(0, missing) / pool_bytes}
