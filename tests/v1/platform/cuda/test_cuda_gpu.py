"""The CUDA wrappers on a real GPU, across spawned processes (skipped without CUDA).

The test process plays the consumer (the server's role); a spawned ``Producer`` allocates,
wraps and answers. Run them all, with the benchmark, through ``scripts/gpu-check``.
"""

from __future__ import annotations

import gc
import importlib.util
import os
import subprocess
import sys
import threading

import pytest

torch = pytest.importorskip("torch")


def _missing() -> str:
    if not torch.cuda.is_available():
        return "no CUDA device visible"
    for mod, pkg in (("cupy", "cupy-cuda13x / cupy-cuda12x"), ("cuda.bindings", "cuda-python")):
        try:
            if importlib.util.find_spec(mod) is None:
                return f"{pkg} is not installed"
        except ModuleNotFoundError:
            return f"{pkg} is not installed"
    return ""


_REASON = _missing()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(bool(_REASON), reason=_REASON or "n/a")]

if not _REASON:
    from cuda_testing import Producer, digest, measure_reclaim, open_count, receive

    from lmshm.platform.base.fds import FD_INBOX
    from lmshm.platform.base.mappings import MAPPINGS
    from lmshm.platform.cuda import NotCudaMallocMemoryError
    from lmshm.platform.cuda.driver import get_driver

DTYPES = ["float16", "bfloat16", "float8_e4m3fn"]
KIND_MEMORY = {"cuda-torch": "torch", "cuda-raw": "torch", "cuda-vmm": "vmm"}
MiB = 1 << 20


@pytest.fixture(scope="module")
def producer():
    with Producer() as p:
        yield p


@pytest.fixture(autouse=True)
def _clean_consumer():
    yield
    gc.collect()
    FD_INBOX.close_session("gpu-test")
    left = [k for k in MAPPINGS.keys() if str(k[0]).startswith("cuda")]
    assert not left, f"CUDA mappings left open: {left}"


def map_one(producer, name, kind, view=(), **options):
    out = producer.call("wrap", name, kind, view, **options)
    w = receive(out["payload"], out.get("fds"))
    return w, w.to_tensor()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["cuda-torch", "cuda-raw", "cuda-vmm"])
def test_round_trip_is_zero_copy(producer, kind, dtype):
    name = f"rt-{kind}-{dtype}"
    producer.call("alloc", name, (4, 64, 128), dtype, memory=KIND_MEMORY[kind], seed=7)
    w, t = map_one(producer, name, kind)
    assert t.dtype == getattr(torch, dtype) and t.shape == (4, 64, 128) and t.is_cuda
    assert digest(t) == producer.call("digest", name)
    t.view(torch.uint8).view(-1)[:16].fill_(0xA5)
    torch.cuda.synchronize()
    assert producer.call("read", name, (), 16) == b"\xa5" * 16
    del t
    w.close()
    producer.call("free", name)


@pytest.mark.parametrize("kind", ["cuda-raw", "cuda-vmm"])
def test_interior_pointers_carry_their_offset_and_share_one_open(producer, kind):
    name = f"interior-{kind}"
    producer.call("alloc", name, (8, 1024), "float16", memory=KIND_MEMORY[kind], seed=3)
    opens = open_count(kind)
    w3, t3 = map_one(producer, name, kind, (("select", 0, 3),))
    w5, t5 = map_one(producer, name, kind, (("select", 0, 5),))
    assert w5.alloc_offset - w3.alloc_offset == 2 * 1024 * 2 and w3.alloc_offset >= 3 * 2048
    assert open_count(kind) - opens == 1
    assert digest(t3) == producer.call("digest", name, (("select", 0, 3),))
    assert digest(t5) == producer.call("digest", name, (("select", 0, 5),))
    del t3, t5
    w3.close()
    w5.close()
    producer.call("free", name)


@pytest.mark.parametrize("kind", ["cuda-torch", "cuda-raw", "cuda-vmm"])
def test_gpu_layers_of_one_allocation_register_as_one_group(producer, kind):
    """vLLM's layers are views of one allocation: one wrapper, per-layer offsets, one open."""
    name = f"group-{kind}"
    producer.call("alloc", name, (6, 64, 256), "bfloat16", memory=KIND_MEMORY[kind], seed=11)
    out = producer.call("wrap_group", name, kind)
    assert len(out["groups"]) == 1
    payload, offsets = out["groups"][0]
    assert len(offsets) == 6
    opens = open_count(kind)
    w = receive(payload, out.get("fds"))
    base = w.to_tensor()
    assert open_count(kind) - opens == 1
    delta0 = offsets[0]
    for i, off in enumerate(offsets):
        layer = base.as_strided(base.size(), base.stride(), base.storage_offset() + off - delta0)
        assert digest(layer) == producer.call("digest", name, (("select", 0, i),)), f"layer {i}"
    del base, layer
    w.close()
    producer.call("close_wrappers")
    producer.call("free", name)


@pytest.mark.parametrize("kind", ["cuda-torch", "cuda-raw", "cuda-vmm"])
def test_an_nhd_view_over_hnd_storage_comes_back_with_its_strides(producer, kind):
    name = f"nhd-{kind}"
    producer.call("alloc", name, (2, 4, 8, 16, 64), "bfloat16", memory=KIND_MEMORY[kind], seed=5)  # HND
    nhd = (("permute", (0, 1, 3, 2, 4)),)
    w, t = map_one(producer, name, kind, nhd)
    ref = torch.empty(2, 4, 8, 16, 64, dtype=torch.bfloat16, device="meta").permute(0, 1, 3, 2, 4)
    assert t.shape == ref.shape and t.stride() == ref.stride()
    assert digest(t) == producer.call("digest", name, nhd)
    del t
    w.close()
    producer.call("free", name)


@pytest.mark.parametrize("kind", ["cuda-torch", "cuda-raw", "cuda-vmm"])
def test_two_wrappers_open_once_closing_one_keeps_the_other_and_the_last_close_unmaps(producer, kind):
    name = f"rc-{kind}"
    producer.call("alloc", name, (2, 4096), "float16", memory=KIND_MEMORY[kind], seed=11)
    drv = get_driver()
    opens = open_count(kind)
    closes = drv.calls["cuIpcCloseMemHandle"] + drv.calls["cuMemUnmap"]
    a, ta = map_one(producer, name, kind, (("select", 0, 0),))
    b, tb = map_one(producer, name, kind, (("select", 0, 1),))
    assert open_count(kind) - opens == 1
    a.close()
    del ta
    gc.collect()
    assert digest(tb) == producer.call("digest", name, (("select", 0, 1),))   # still mapped and valid
    b.close()
    del tb
    gc.collect()
    assert not [k for k in MAPPINGS.keys() if str(k[0]).startswith("cuda")]
    if kind != "cuda-torch":                                # torch closes its own handle
        assert drv.calls["cuIpcCloseMemHandle"] + drv.calls["cuMemUnmap"] - closes == 1
    b.close()
    producer.call("free", name)


def test_gpu_two_sessions_naming_one_raw_allocation_open_it_each_and_one_close_leaves_the_other_valid(producer):
    """Raw IPC mappings are keyed by session (issue 42 §4), so two sessions naming one
    allocation open it twice in this process. That relies on the driver counting opens
    (cuda-bindings 13: a second cuIpcOpenMemHandle in one context bumps a refcount and returns
    the same pointer): after session A's close, B's tensor must still read the producer's bytes,
    and B's close is the second cuIpcCloseMemHandle."""
    name = "raw-two-sessions"
    producer.call("alloc", name, (2, 4096), "float16", memory="torch", seed=13)
    drv = get_driver()
    opens, closes = drv.calls["cuIpcOpenMemHandle"], drv.calls["cuIpcCloseMemHandle"]
    out = producer.call("wrap", name, "cuda-raw", ())
    a, b = receive(out["payload"], session="session-a"), receive(out["payload"], session="session-b")
    ta, tb = a.to_tensor(), b.to_tensor()
    assert drv.calls["cuIpcOpenMemHandle"] - opens == 2 and ta.data_ptr() == tb.data_ptr()
    a.close()
    del ta
    gc.collect()
    assert drv.calls["cuIpcCloseMemHandle"] - closes == 1
    assert digest(tb) == producer.call("digest", name), "session A's close unmapped session B's view"
    b.close()
    del tb
    gc.collect()
    assert drv.calls["cuIpcCloseMemHandle"] - closes == 2
    producer.call("free", name)


@pytest.mark.parametrize("handle_type", ["posix-fd", "fabric"])
def test_a_cumemcreate_pool_is_exported_both_ways(producer, handle_type):
    if handle_type == "fabric" and not producer.call("device_attribute", "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED"):
        pytest.skip("this GPU/driver does not support fabric handles (no IMEX fabric)")
    name = f"pool-{handle_type}"
    chunk = max(2 * MiB, get_driver().granularity(0))
    inside = (("select", 0, 2), ("slice", 0, 256, 768))
    try:
        producer.call("alloc", name, (4, chunk // 2), "float16", memory="vmm", handle_type=handle_type,
                      chunk_bytes=chunk, seed=9)             # 4 chunks, one row each
        w, t = map_one(producer, name, "cuda-vmm", inside, handle_type=handle_type)
    except Exception as exc:
        if handle_type == "fabric":
            producer.call("free", name)
            pytest.skip(f"fabric handles are refused on this system: {str(exc).splitlines()[-1]}")
        raise
    assert w.handle_type == handle_type
    # The design relies on cuMemGetAddressRange returning the *chunk* (one cuMemCreate
    # allocation) that holds a VMM pointer, not the whole reserved range: say what it gave.
    assert (w.alloc_size, w.alloc_offset) == (chunk, 512), (
        f"cuMemGetAddressRange on a {4 * chunk}-byte range of 4 mapped {chunk}-byte chunks gave "
        f"alloc_size={w.alloc_size}, alloc_offset={w.alloc_offset} for a view 512 bytes into chunk 2 "
        f"(expected the chunk: {chunk}, 512)")
    assert digest(t) == producer.call("digest", name, inside)
    spanning = producer.call("try_wrap", name, "cuda-vmm", (("slice", 0, 1, 3),), handle_type=handle_type)
    assert spanning["error"] == "VmmSpansChunksError" and "expandable segments" in spanning["message"], spanning
    del t
    w.close()
    producer.call("free", name)


def test_raw_on_vmm_memory_gives_the_not_cudamalloc_hint(producer):
    producer.call("alloc", "vmm-for-raw", (1024,), "float16", memory="vmm")
    out = producer.call("try_wrap", "vmm-for-raw", "cuda-raw")
    assert out["error"] == NotCudaMallocMemoryError.__name__
    assert "LMSHM_USE_VMM_API=1" in out["message"] and "expandable" in out["message"]
    producer.call("free", "vmm-for-raw")


def test_torch_expandable_segments_refuse_raw_and_share_through_vmm():
    with Producer(env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}) as p:
        p.call("alloc", "kv", (256, 1024), "float16", memory="torch", seed=1)   # 512 KiB
        raw = p.call("try_wrap", "kv", "cuda-raw")
        assert raw["error"] == "NotCudaMallocMemoryError" and "use_vmm_api" in raw["message"]
        probe = p.call("try_wrap", "kv", "cuda-vmm")
        if probe["error"] == "VmmNotExportableError":
            pytest.skip(f"this torch build allocates expandable segments without a POSIX-fd handle type: {probe['message']}")
        assert probe["error"] is None, probe
        w, t = map_one(p, "kv", "cuda-vmm")
        assert digest(t) == p.call("digest", "kv")
        del t
        w.close()


@pytest.mark.parametrize("kind", ["cuda-raw", "cuda-vmm"])
def test_a_producer_thread_with_no_current_context_still_exports(producer, kind):
    name = f"thread-{kind}"
    producer.call("alloc", name, (64, 64), "float16", memory=KIND_MEMORY[kind], seed=13)
    out = producer.call("wrap", name, kind, (), in_fresh_thread=True)
    assert out["ctx_before"] == 0 and out["ctx_after"] != 0   # no context, then the primary one
    w = receive(out["payload"], out.get("fds"))
    result: dict = {}

    def consume():                                         # and the consumer side likewise
        try:
            result["ctx_before"] = get_driver().current_context()
            t = w.to_tensor()
            result["digest"] = digest(t)
        except BaseException as exc:
            result["error"] = repr(exc)

    th = threading.Thread(target=consume)
    th.start()
    th.join(120)
    assert not th.is_alive(), "mapping from a fresh consumer thread did not finish within 120 s"
    assert "error" not in result, result
    assert result["ctx_before"] == 0, result
    assert result["digest"] == producer.call("digest", name)
    w.close()
    producer.call("free", name)


@pytest.mark.parametrize("kind", ["cuda-torch", "cuda-raw", "cuda-vmm"])
def test_a_sigkilled_workers_gpu_memory_comes_back_within_two_seconds(kind):
    pool = 4 << 30
    r = measure_reclaim(kind, pool, session="gpu-test")
    print(f"\n{kind}: reclaim {r['reclaim_s'] * 1000:.0f} ms, pinned after death "
          f"{r['pinned_frac']:.0%}, recovered {r['recovered_frac']:.0%}")
    assert r["recovered_frac"] >= 0.95, (
        f"{kind}: only {r['recovered_frac']:.0%} of the {pool >> 30} GiB pool came back within 10 s of "
        f"the producer's SIGKILL and this process's release (measured: {r})")
    assert r["reclaim_s"] <= 2.0, f"{kind}: the pool came back {r['reclaim_s']:.2f} s after the kill (limit 2 s): {r}"


def test_vmm_wrapper_refuses_cudamalloc_memory_with_a_hint(producer):
    producer.call("alloc", "plain", (1024,), "float16", memory="torch")
    out = producer.call("try_wrap", "plain", "cuda-vmm")
    assert out["error"] == "NotVmmMemoryError" and "LMSHM_USE_VMM_API=0" in out["message"]
    producer.call("free", "plain")


# ---- issue 26: sibling fds, and unmapping after queued work -----------------------------------

def test_gpu_vmm_siblings_export_the_leaders_fd_and_never_close_it():
    """wrap_kv_caches-style leader + siblings over a real cuMemCreate chunk: the siblings hand
    out the leader's exported fd, and closing them after the leader never closes the file that
    took the leader's fd number (on the broken code each sibling closed it again)."""
    from lmshm.platform.cuda import VmmCudaIPCWrapper, empty_vmm

    t = empty_vmm((4, 1024), torch.float16, "cuda")
    lead = VmmCudaIPCWrapper.wrap(t[0], name="layer0")
    sibs = [lead.sibling_for(t[i], t.untyped_storage().data_ptr()) for i in (1, 2, 3)]
    assert all(s is not None for s in sibs)
    fd = lead._fd
    os.fstat(fd)
    assert all(s.export_fds() == {lead.fd_token: fd} for s in sibs)
    lead.close()
    null = os.open("/dev/null", os.O_RDONLY)
    if null != fd:
        os.dup2(null, fd)
        os.close(null)
        null = fd
    try:
        for s in sibs:
            s.close()
        assert os.readlink(f"/proc/self/fd/{null}") == "/dev/null", "a sibling closed the leader's fd number"
    finally:
        os.close(null)
    del t


def _run_isolated(code: str, timeout_s: float = 180.0) -> str:
    """Run ``code`` in a fresh interpreter: a fault under DMA poisons the CUDA context of the
    process it happens in, and must not take the rest of this module down with it."""
    env = dict(os.environ)
    here = os.path.dirname(os.path.abspath(__file__))
    env["PYTHONPATH"] = os.pathsep.join([here] + [p for p in sys.path if p])
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=timeout_s, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"the isolated check failed (rc={proc.returncode}):\n{out[-4000:]}"
    return out


_DELAY_MS = 300

_PRODUCER_RELEASE = f"""
import gc, time, torch
from cuda_testing import gpu_delay
from lmshm.platform.cuda import empty_vmm
src = torch.full((64 << 20,), 7, dtype=torch.uint8, device="cuda")
t = empty_vmm((64 << 20,), torch.uint8, "cuda")
torch.cuda.synchronize()
gpu_delay({_DELAY_MS})                 # the copy below runs ~{_DELAY_MS} ms from now, on this stream
t.copy_(src)
t0 = time.monotonic()
del t                                  # the last reference: VmmAllocation.release() runs now
gc.collect()
waited = time.monotonic() - t0
torch.cuda.synchronize()               # a fault under the unmap would raise here
print("RELEASE_WAITED", round(waited, 3))
"""


def test_gpu_releasing_vmm_memory_with_a_copy_queued_waits_for_it_and_does_not_fault():
    out = _run_isolated(_PRODUCER_RELEASE)
    waited = float(out.split("RELEASE_WAITED", 1)[1].split()[0])
    assert waited >= _DELAY_MS / 1000 * 0.5, (
        f"VmmAllocation.release() returned after {waited:.3f} s with a ~{_DELAY_MS} ms copy still queued: "
        "it did not synchronise before cuMemUnmap")


_CONSUMER_CLOSE = f"""
import gc, time, torch
from cuda_testing import Producer, gpu_delay, receive
from lmshm.platform.cuda import streams
from lmshm.platform.cuda.driver import get_driver

drv = get_driver()
with Producer() as p:
    for kind, memory in (("cuda-raw", "torch"), ("cuda-vmm", "vmm")):
        name = "close-" + kind
        p.call("alloc", name, (32 << 20,), "uint8", memory=memory, seed=3)
        out = p.call("wrap", name, kind, ())
        w = receive(out["payload"], out.get("fds"))
        t = w.to_tensor()
        handle = drv.stream_create(0)
        streams.register(handle, 0)
        stream = torch.cuda.ExternalStream(handle)
        src = torch.full_like(t, 9)
        torch.cuda.synchronize()
        with torch.cuda.stream(stream):
            gpu_delay({_DELAY_MS})
            t.copy_(src)               # a copy into mapped memory, still queued
        t0 = time.monotonic()
        w.close()
        del t
        gc.collect()                   # the last lease: quiesce, then the unmap
        waited = time.monotonic() - t0
        torch.cuda.synchronize()       # a fault under the unmap would raise here
        streams.unregister(handle, 0)
        drv.stream_destroy(handle, 0)
        assert streams.LEAKED_MAPPINGS == 0, streams.LEAKED_MAPPINGS
        print("CLOSE_WAITED", kind, round(waited, 3))
        p.call("free", name)
"""


def test_gpu_the_last_consumer_close_waits_for_a_registered_copy_stream_and_does_not_fault():
    out = _run_isolated(_CONSUMER_CLOSE)
    waits = dict(line.split()[1:3] for line in out.splitlines() if line.startswith("CLOSE_WAITED"))
    assert set(waits) == {"cuda-raw", "cuda-vmm"}, out[-2000:]
    for kind, waited in waits.items():
        assert float(waited) >= _DELAY_MS / 1000 * 0.5, (
            f"{kind}: the last close returned after {waited} s with a ~{_DELAY_MS} ms copy queued on a "
            "registered stream: it did not quiesce before unmapping")
