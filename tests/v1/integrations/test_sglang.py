"""SGLang's HiCache against a real lmshm-server, through SGLang's own code.

Each test spawns ``lmshm-server`` and runs ``sglang_driver.py`` in ``.venv-sglang``
(``scripts/bootstrap-sglang``; ``scripts/test`` makes it), where SGLang's ``HiCacheController``
loads ``lmshm.integrations.sglang.LmshmHiCacheStorage`` through its ``dynamic`` factory, backs
pages up through its backup thread and prefetches them through its hit query and page transfer.
Stand-ins, for what needs a GPU only: device pools on ``device="cpu"``, host pools unpinned, and
a torchvision stand-in (PyPI's builds are CUDA-only). Every page compared is compared byte for
byte against what was written, in a pool whose pages were zeroed first.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from harness import ServerProcess, lmshm_segments, wait_for

from lmshm.transport.client import query_status

ROOT = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.sglang
SGLANG_PYTHON = Path(os.environ.get("LMSHM_SGLANG_VENV", ROOT / ".venv-sglang")) / "bin" / "python"
DRIVER = Path(__file__).with_name("sglang_driver.py")


#: SGLang's caches (its JIT-compiled page-hash helper, Triton's): one scratch directory for the
#: module, so the helper is compiled once, not once per SGLang process.
SCRATCH: list[Path] = []


@pytest.fixture(scope="module", autouse=True)
def sglang_venv(tmp_path_factory):
    if os.environ.get("LMSHM_SKIP_SGLANG") == "1":
        pytest.skip("LMSHM_SKIP_SGLANG=1: the SGLang HiCache tests are off")
    if not SGLANG_PYTHON.exists():
        pytest.fail(f"{SGLANG_PYTHON} is missing: run scripts/bootstrap-sglang (scripts/test does), "
                    "or set LMSHM_SKIP_SGLANG=1 to skip the SGLang tests")
    SCRATCH[:] = [tmp_path_factory.mktemp("sglang-scratch")]
    yield
    SCRATCH.clear()


@pytest.fixture
def server(sockets):
    before = lmshm_segments()
    s = ServerProcess(sockets, "--capacity", "128MiB", "--reap-timeout", "5")
    yield s
    if s.alive:
        assert s.stop() == 0, s.log()
    assert lmshm_segments() <= before, "an lmshm segment outlived the test"


def driver_env(tmp_path: Path, env: dict | None = None) -> dict:
    scratch = SCRATCH[0]
    return {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "SGLANG_CACHE_DIR": str(scratch), "TORCH_EXTENSIONS_DIR": str(scratch / "torch-ext"),
            "TRITON_CACHE_DIR": str(scratch / "triton"), **(env or {})}


def result_of(stdout: str, stderr: str, rc: int, what: str) -> list:
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    assert rc == 0 and lines, f"driver {what} failed ({rc}):\n{stdout[-3000:]}\n{stderr[-6000:]}"
    return json.loads(lines[-1][len("RESULT "):])


def drive(steps: list[dict], url: str, tmp_path: Path, env: dict | None = None, timeout_s: float = 120) -> list:
    """Run ``steps`` (each ``{"scenario": NAME, ...}``) in one SGLang process; their results."""
    full_env = driver_env(tmp_path, env)
    r = subprocess.run([str(SGLANG_PYTHON), str(DRIVER), json.dumps([{"url": url, **st} for st in steps])],
                       capture_output=True, text=True, timeout=timeout_s, env=full_env, cwd=str(ROOT))
    return result_of(r.stdout, r.stderr, r.returncode, str([st["scenario"] for st in steps]))


def registrations(server) -> int:
    return len(query_status(server.url).registrations)


# ---- 1. the real HiCacheController through the dynamic factory -----------------------------

LAYOUTS = [("mha", "page_first", 2), ("mha", "page_first_direct", 2), ("mha", "page_head", 2),
           ("mha", "layer_first", 6), ("mla", "page_first", 1), ("mla", "page_first_direct", 1),
           ("mla", "layer_first", 3)]


def test_controller_backs_up_and_prefetches_pages_byte_exact_in_every_layout(server, tmp_path):
    results = drive([{"scenario": "roundtrip", "kind": k, "layout": lay, "pages": 5} for k, lay, _ in LAYOUTS],
                    server.url, tmp_path)
    for (kind, layout, regions), r in zip(LAYOUTS, results):
        where = f"{kind} {layout}: {r}"
        assert r["backend"] == "LmshmHiCacheStorage", where
        assert r["regions"] == regions, where                 # the layout SGLang describes, per page
        assert r["stored"] == 5 and r["stored_again"] == 5, where   # a second set of the same keys succeeds
        assert (r["hits"], r["loaded"]) == (5, 5), where      # a 7-page prompt: the 5 stored pages hit, no more
        assert r["exact"], f"a prefetched page differs from the page backed up ({where})"
        assert r["fresh_miss"] == 0, where


def test_a_private_host_pool_is_refused_naming_the_setting_and_a_dead_server_costs_misses(server, tmp_path):
    import socket

    with socket.socket() as sock:     # a port nobody listens on: lmshm-server is "dead"
        sock.bind(("127.0.0.1", 0))
        dead = f"tcp://127.0.0.1:{sock.getsockname()[1]}"
    refused, down = drive([{"scenario": "not_shared"}, {"scenario": "dead_server", "url": dead}], server.url,
                          tmp_path)
    assert refused["error"] and "host pool is private memory" in refused["error"], refused
    assert '"allocator": "shm"' in refused["error"], refused       # says what to set
    assert (down["stored"], down["hits"], down["loaded"]) == (0, 0, 0), down
    assert down["start_s"] < 20 and down["ops_s"] < 5, down        # misses, never a stuck engine


def test_sglang_failure_injection_never_corrupts_a_page(server, tmp_path):
    [r] = drive([{"scenario": "failures", "kind": "mha", "layout": "page_first", "rounds": 6}], server.url, tmp_path,
                env={"SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE": "0.3",
                     "SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY": "0.01"})
    assert r["backend"] == "HiCacheStorageFailureInjector"   # SGLang's own wrapper is in the path
    assert r["bad"] == 0, r
    assert r["loaded"] > 0, r                        # some pages went through despite the failures
    assert r["loaded"] < 6 * 6 or r["stored"] < 6 * 6, r   # and the injection did cost something


# ---- 2 and 4: another process loads the prefix; another tenant, model or layout never does ----


def test_second_instance_loads_the_prefix_and_no_other_tenant_model_or_layout_does(server, tmp_path):
    common = {"kind": "mha", "seed": 11, "pages": 6}
    [stored] = drive([{"scenario": "store", "layout": "page_first", "salt": "tenant-a", "model": "org/model-a",
                       **common}], server.url, tmp_path)
    assert stored["stored"] == 6
    others = [{"salt": "tenant-b", "model": "org/model-a", "layout": "page_first"},
              {"salt": None, "model": "org/model-a", "layout": "page_first"},
              {"salt": "tenant-a", "model": "org/model-b", "layout": "page_first"},
              {"salt": "tenant-a", "model": "org/model-a", "layout": "layer_first"}]
    owner = {"salt": "tenant-a", "model": "org/model-a", "layout": "page_first"}
    results = drive([{"scenario": "load", **o, **common} for o in [*others, owner]], server.url, tmp_path)
    for other, got in zip(others, results):
        assert (got["hits"], got["loaded"]) == (0, 0), (other, got)
    same = results[-1]
    assert (same["hits"], same["loaded"]) == (6, 6)      # the control: the owner's own prompt hits
    assert same["digests"] == stored["digests"]           # bit-identical, in another process
    # Every instance's registration went with its process: nothing of theirs is left mapped.
    wait_for(lambda: registrations(server) == 0, 10, what="the server to release every SGLang host pool")


# ---- 2. two SGLang instances, each with SGLang's own radix cache (its in-wheel test kit) --------


def test_second_radix_cache_instance_loads_the_first_ones_prefix_from_lmshm(server, tmp_path):
    """Instance 1 inserts a 6-page prompt into its UnifiedRadixCache, writes random KV into its
    device pool, and backs the path up to host and to L3; instance 2, another process with an
    empty tree, prefetches the prompt (SGLang's prefetch thread, hit query and page transfer),
    then loads it to its device pool. Stand-ins: the kit's accelerator (CPU), pinning, and the
    two sgl_kernel device<->host copy kernels (``standin_*`` in the driver)."""
    [produced] = drive([{"scenario": "kit_produce", "seed": 5, "pages": 6}], server.url, tmp_path)
    assert produced["stats"]["stored_pages"] >= 6
    [consumed] = drive([{"scenario": "kit_consume", "seed": 5, "pages": 6}], server.url, tmp_path)
    assert (consumed["device_before"], consumed["host_before"]) == (0, 0)   # nothing of its own
    assert consumed["stats"]["loaded_pages"] == 6
    assert consumed["host_hit"] == consumed["loaded"] == 24
    assert consumed["digests"] == produced["digests"]      # every layer's K and V, bit-identical


# ---- 3. TP=2 over gloo: per-rank keys, and no rank served another rank's bytes ---------------


def test_tp2_ranks_keep_their_own_pages(server, tmp_path):
    rendezvous = tmp_path / "gloo-rendezvous"
    procs = [subprocess.Popen([str(SGLANG_PYTHON), str(DRIVER), json.dumps(
                [{"scenario": "tp", "url": server.url, "rank": rank, "rendezvous": str(rendezvous)}])],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=driver_env(tmp_path), cwd=str(ROOT))
             for rank in (0, 1)]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=150)
            outs.append(result_of(out, err, p.returncode, "tp")[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    r0, r1 = outs
    assert r0["q_stored"] == 4
    assert (r0["q_own_hits"], r1["q_own_hits"]) == (4, 0)   # rank 1 never finds rank 0's pages
    assert r0["q_hits"] == r1["q_hits"] == 0                 # the controller's MIN over ranks
    assert r0["p_keys"] == r1["p_keys"]                      # SGLang's keys are the same on every rank
    assert r0["p_stored"] == r1["p_stored"] == 4
    assert r0["p_hits"] == r1["p_hits"] == 4
    assert r0["p_loaded"] == r1["p_loaded"] == 4
    assert r0["stored_digests"] != r1["stored_digests"]      # the ranks wrote different bytes
    assert r0["loaded_digests"] == r0["stored_digests"]      # and each read back its own
    assert r1["loaded_digests"] == r1["stored_digests"]
