"""vLLM 0.32's KV-cache layouts, moved block by block through a real lmshm-server.

vLLM 0.32 gives every attention layer the same logical view, ``[B, H, N, C]``: blocks, KV heads,
tokens per block, and per token K then V (``C = head_size + head_size_v`` elements; MLA keeps
one latent, ``head_size_v = 0``). A backend no longer has a shape of its own
(``get_kv_cache_shape`` and ``get_kv_cache_stride_order`` are gone): it only says which physical
orders (``KVCacheLayout``, a stride order over ``[L, B, H, N, C]``) its kernels can read, and the
model runner allocates one flat int8 buffer and views it with that order (``worker.py``'s
``vllm_kv_caches`` does exactly that). The table below is where each layout comes from; the
``vllm``-marked test checks it against vLLM itself (``.venv-vllm``, scripts/bootstrap-vllm).

Each round trip: worker A registers its layers (block_dim 0 for the per-layer ``[B, H, N, C]``
views vLLM hands a connector, 1 for a whole ``[L, B, H, N, C]`` cache), fills them with random
bytes and STOREs shuffled blocks; worker B (same layout, other bytes) RETRIEVEs them into other
blocks; K and V of every layer of every block must match, and B's other blocks must not change.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from harness import wait_for
from worker import vllm_kv_caches

from lmshm.transport.client import query_status
from lmshm.wire.protocol import ErrorCode, StoreResult

ROOT = Path(__file__).resolve().parents[3]
VLLM_PYTHON = Path(os.environ.get("LMSHM_VLLM_VENV", ROOT / ".venv-vllm")) / "bin" / "python"

#: vllm/v1/kv_cache_layout.py, ``KVCacheLayout``: stride orders over logical [L, B, H, N, C],
#: outermost first. vLLM's legacy names: NHD = LBNHC, HND = LBHNC
#: (vllm/v1/attention/backends/utils.py, ``resolve_kv_cache_layout`` and ``_FLASHINFER_LAYOUT_NAMES``).
LAYOUTS = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}
BACKENDS = "vllm/v1/attention/backends/"
ANY_LAYOUT = ("supported_kv_cache_layouts() is None (vllm/v1/attention/backend.py): any layout, "
              "_DEFAULT_LAYOUT_PREFERENCE (backends/utils.py) puts LBNHC (NHD) first")


@dataclasses.dataclass(frozen=True)
class Row:
    name: str
    backend: str            # "module:Class" of the vLLM backend that reads this layout
    layout: str             # a KVCacheLayout name
    heads: int              # H: num_kv_heads (MLA: 1)
    head_size: int          # K part of C (MLA: kv_lora_rank + rope dim)
    head_size_v: int        # V part of C (MLA: 0)
    dtype: str
    source: str             # where in vLLM 0.32 the layout comes from
    register: str = "layers"  # "layers": one [B, H, N, C] view per layer; "whole": [L, B, H, N, C]
    runs: int = 1           # byte runs one block of one registered tensor takes
    mla: bool = False

    @property
    def block_dim(self) -> int:
        return 1 if self.register == "whole" else 0

    def spec(self, **kw) -> dict:
        s = dict(layers=3, blocks=12, heads=self.heads, tokens=16, content=self.head_size + self.head_size_v,
                 dtype=self.dtype, order=list(LAYOUTS[self.layout]), register=self.register, storage="one")
        return {**s, **kw}

    def parts(self) -> list[list[int]]:
        """K and V along the last dim (flash_attn.py ``FlashAttentionImpl.forward``:
        ``kv_cache.transpose(1, 2).split(self.head_size, dim=-1)``); MLA: the one latent."""
        if not self.head_size_v:
            return [[0, self.head_size]]
        return [[0, self.head_size], [self.head_size, self.head_size_v]]


# The allocation of every row: vllm/v1/worker/utils.py ``allocate_kv_cache`` (one torch.zeros int8
# buffer), vllm/v1/core/kv_cache_utils.py ``get_kv_cache_config_from_groups`` (layer and block
# strides from ``compute_layout_strides``), vllm/v1/kv_cache_interface.py ``create_kv_cache_views``
# (as_strided to [L, B, H, N, C bytes], then ``view_5d[l].view(dtype)`` per layer).
ROWS = [
    Row("flash-attn-NHD", "vllm.v1.attention.backends.flash_attn:FlashAttentionBackend", "LBNHC", 4, 8, 8,
        "float16", BACKENDS + "flash_attn.py FlashAttentionBackend: " + ANY_LAYOUT),
    Row("flash-attn-HND", "vllm.v1.attention.backends.flash_attn:FlashAttentionBackend", "LBHNC", 4, 8, 8,
        "float16", BACKENDS + "flash_attn.py FlashAttentionBackend: " + ANY_LAYOUT + "; HND by VLLM_KV_CACHE_LAYOUT"),
    Row("triton-attn", "vllm.v1.attention.backends.triton_attn:TritonAttentionBackend", "LBNHC", 2, 16, 16,
        "bfloat16", BACKENDS + "triton_attn.py TritonAttentionBackend: " + ANY_LAYOUT),
    Row("flashinfer-NHD", "vllm.v1.attention.backends.flashinfer:FlashInferBackend", "LBNHC", 4, 8, 8,
        "float16", BACKENDS + "flashinfer.py FlashInferBackend.supported_kv_cache_layouts: None but on SM100; "
        "_FLASHINFER_LAYOUT_NAMES: LBNHC = NHD"),
    Row("flashinfer-HND", "vllm.v1.attention.backends.flashinfer:FlashInferBackend", "LBHNC", 4, 8, 8,
        "float16", BACKENDS + "flashinfer.py FlashInferBackend.supported_kv_cache_layouts: (LBHNC, BLHNC) on "
        "SM100; _FLASHINFER_LAYOUT_NAMES: LBHNC = HND"),
    Row("flashinfer-sm100-BLHNC", "vllm.v1.attention.backends.flashinfer:FlashInferBackend", "BLHNC", 4, 8, 8,
        "float16", BACKENDS + "flashinfer.py FlashInferBackend.supported_kv_cache_layouts: (LBHNC, BLHNC) on SM100 "
        "(block-outermost: registered whole, block_dim 1)", register="whole"),
    Row("flash-mla", "vllm.v1.attention.backends.mla.flashmla:FlashMLABackend", "LBNHC", 1, 576, 0, "bfloat16",
        BACKENDS + "mla/flashmla.py FlashMLABackend: " + ANY_LAYOUT + "; MLAAttentionSpec (kv_cache_interface.py): "
        "head_size_v = 0, one head", mla=True),
    Row("triton-mla", "vllm.v1.attention.backends.mla.triton_mla:TritonMLABackend", "LBNHC", 1, 576, 0, "bfloat16",
        BACKENDS + "mla/triton_mla.py TritonMLABackend: " + ANY_LAYOUT, mla=True),
    Row("cpu-attn", "vllm.v1.attention.backends.cpu_attn:CPUAttentionBackend", "LBHNC", 4, 32, 32, "bfloat16",
        BACKENDS + "cpu_attn.py CPUAttentionBackend.supported_kv_cache_layouts: (LBHNC,)"),
    # The other layouts a backend without a declared set accepts (VLLM_KV_CACHE_LAYOUT, or a
    # connector's get_required_kvcache_layout). Block-outermost ones put other layers' pages
    # between the blocks of a layer: register the whole cache with block_dim 1.
    Row("flash-attn-LHBNC", "vllm.v1.attention.backends.flash_attn:FlashAttentionBackend", "LHBNC", 4, 8, 8,
        "float16", BACKENDS + "flash_attn.py FlashAttentionBackend: " + ANY_LAYOUT + "; head-major: H runs",
        runs=4),
    Row("flash-attn-BLNHC", "vllm.v1.attention.backends.flash_attn:FlashAttentionBackend", "BLNHC", 4, 8, 8,
        "float16", BACKENDS + "flash_attn.py FlashAttentionBackend: " + ANY_LAYOUT, register="whole"),
    Row("flash-attn-BHLNC", "vllm.v1.attention.backends.flash_attn:FlashAttentionBackend", "BHLNC", 4, 8, 8,
        "float16", BACKENDS + "flash_attn.py FlashAttentionBackend: " + ANY_LAYOUT, register="whole"),
]
BY_NAME = {r.name: r for r in ROWS}


def key() -> str:
    return os.urandom(16).hex()


def cases():
    for row in ROWS:
        storages = ["one", "separate"] if row.register == "layers" else ["one"]
        for storage in storages:
            yield pytest.param(row, storage, id=f"{row.name}-{storage}")


# ---- without a server: the plan of each layout ------------------------------------------


@pytest.mark.parametrize("row", ROWS, ids=lambda r: r.name)
def test_each_layout_moves_in_its_number_of_byte_runs(row):
    from lmshm.core.dataplane import BlockLayout, check_movable

    tensors = vllm_kv_caches(row.spec())
    check_movable(list(tensors), list(tensors.values()), row.block_dim)
    layout = BlockLayout.of(list(tensors), list(tensors.values()), row.block_dim)
    assert [len(p.geometry.offsets) for p in layout.layers] == [row.runs] * len(tensors)
    t = next(iter(tensors.values()))
    assert layout.block_bytes * layout.num_blocks == sum(x.numel() * x.element_size() for x in tensors.values())
    assert layout.num_blocks == t.shape[row.block_dim] == 12
    # another number of blocks, same layout: the same digest (a bigger worker reads what a smaller stored)
    more = vllm_kv_caches(row.spec(blocks=20))
    assert BlockLayout.of(list(more), list(more.values()), row.block_dim).digest == layout.digest


def test_layouts_of_one_logical_shape_have_different_digests():
    from lmshm.core.dataplane import BlockLayout

    digests = {}
    for name in ("LBHNC", "LBNHC", "LHBNC"):
        tensors = vllm_kv_caches(BY_NAME["flash-attn-NHD"].spec(order=list(LAYOUTS[name])))
        assert {tuple(t.shape) for t in tensors.values()} == {(12, 4, 16, 16)}
        digests[name] = BlockLayout.of(list(tensors), list(tensors.values())).digest
    for name in ("BLHNC", "BLNHC", "BHLNC"):
        tensors = vllm_kv_caches(BY_NAME["flash-attn-NHD"].spec(order=list(LAYOUTS[name]), register="whole"))
        digests[name] = BlockLayout.of(list(tensors), list(tensors.values()), 1).digest
    assert len(set(digests.values())) == len(digests), digests


# ---- through a server -------------------------------------------------------------------


def register(start_worker, server, row: Row, block_dim: int | None = None, **kw):
    w = start_worker(server.url)
    reply = w.ok("register_vllm", **row.spec(**kw), block_dim=row.block_dim if block_dim is None else block_dim)
    return w, reply["instance_id"]


def digests(w, iid: str, row: Row, blocks: list[int]) -> list:
    return w.ok("block_parts", instance_id=iid, blocks=blocks, block_dim=row.block_dim, parts=row.parts(),
                by_layer=row.register == "whole")["digests"]


@pytest.mark.parametrize("row,storage", list(cases()))
def test_blocks_of_a_vllm_layout_round_trip_between_two_workers(start_worker, shared_server, row, storage):
    round_trip(start_worker, shared_server, row, storage)


@pytest.mark.parametrize("name", ["flash-attn-LHBNC", "flash-attn-BHLNC", "cpu-attn"])
def test_layouts_round_trip_through_the_mapping_too(start_worker, start_server, name):
    """--copy-through-mapping (and memfd registrations) copy with memmove, not through the file."""
    round_trip(start_worker, start_server("--copy-through-mapping"), BY_NAME[name], "one")


def round_trip(start_worker, server, row: Row, storage: str) -> None:
    a, ia = register(start_worker, server, row, storage=storage)
    b, ib = register(start_worker, server, row, storage=storage)
    a.ok("fill_random", instance_id=ia, seed=1)
    b.ok("fill_random", instance_id=ib, seed=2)
    src = [7, 3, 4, 5, 11, 0]       # shuffled, with a run of consecutive ids (3, 4, 5)
    dst = [2, 9, 10, 8, 1, 6]
    others = [x for x in range(12) if x not in dst]
    want = digests(a, ia, row, src)
    keep = digests(b, ib, row, others)
    assert want != digests(b, ib, row, dst)
    keys = [key() for _ in range(3)]
    stored = a.ok("store", instance_id=ia, keys=keys, blocks=src, chunk_blocks=2)
    assert stored["results"] == [StoreResult.STORED] * 3
    found = b.ok("lookup", keys=[keys])
    assert found["hits"] == 3
    got = b.ok("retrieve", instance_id=ib, keys=keys, blocks=dst, chunk_blocks=2, lease=found["lease"])
    assert got["chunks"] == 3 and got["nbytes"] == stored["nbytes"]
    assert digests(b, ib, row, dst) == want          # K and V of every layer of every block
    assert digests(b, ib, row, others) == keep        # and nothing else was written


def test_a_block_dim_that_is_not_a_dimension_is_refused_at_register(start_worker, shared_server):
    row = BY_NAME["flash-attn-NHD"]
    w = start_worker(shared_server.url)
    r = w.call("register_vllm", **row.spec(), block_dim=4)
    assert not r["ok"] and r["code"] == ErrorCode.INVALID_ARG, r
    for part in ("block_dim 4", "'model.layers.0.self_attn.attn'", "(12, 4, 16, 16)"):
        assert part in r["message"], r["message"]
    r = w.call("register_vllm", **row.spec(), block_dim=16)       # beyond the wire's cap: refused by the client
    assert not r["ok"] and r["error"] == "ValueError" and "block_dim" in r["message"], r
    assert w.ok("registered")["ids"] == [] and query_status(shared_server.url).registrations == []


def test_a_block_of_too_many_byte_runs_is_refused_with_layout_naming_the_layer(start_worker, shared_server):
    from lmshm.core.dataplane import LayoutError, check_movable

    # head-major with 16 KV heads: 16 runs a block, of each layer
    w, iid = register(start_worker, shared_server, BY_NAME["flash-attn-LHBNC"], heads=16)
    r = w.call("store", instance_id=iid, keys=[key()], blocks=[0], chunk_blocks=1)
    assert not r["ok"] and r["code"] == ErrorCode.LAYOUT, r
    assert "'model.layers.0.self_attn.attn'" in r["message"] and "16 separate byte runs" in r["message"], r
    # a layer-outermost cache registered whole: one run per layer, 12 layers
    w2, iid2 = register(start_worker, shared_server, BY_NAME["flash-attn-HND"], register="whole", layers=12,
                        block_dim=1)
    r = w2.call("retrieve", instance_id=iid2, keys=[key()], blocks=[0], chunk_blocks=1)
    assert not r["ok"] and r["code"] == ErrorCode.LAYOUT and "'kv_cache'" in r["message"], r
    assert "12 separate byte runs" in r["message"], r
    # the worker-side check says the same without a server
    tensors = vllm_kv_caches(BY_NAME["flash-attn-LHBNC"].spec(heads=16))
    with pytest.raises(LayoutError, match=r"'model.layers.0.self_attn.attn'.*16 separate byte runs"):
        check_movable(list(tensors), list(tensors.values()), 0)


def test_nhd_and_hnd_never_exchange_bytes(start_worker, shared_server):
    nhd, hnd = BY_NAME["flash-attn-NHD"], BY_NAME["flash-attn-HND"]
    a, ia = register(start_worker, shared_server, nhd)
    b, ib = register(start_worker, shared_server, hnd)
    a.ok("fill_random", instance_id=ia, seed=3)
    b.ok("fill_random", instance_id=ib, seed=4)
    k = key()
    assert a.ok("store", instance_id=ia, keys=[k], blocks=[1, 2], chunk_blocks=2)["results"] == [StoreResult.STORED]
    before = digests(b, ib, hnd, list(range(12)))
    r = b.call("retrieve", instance_id=ib, keys=[k], blocks=[1, 2], chunk_blocks=2)
    assert not r["ok"] and r["code"] == ErrorCode.LAYOUT and "another layout" in r["message"], r
    assert digests(b, ib, hnd, list(range(12))) == before
    assert b.ok("pool")["pool"]["pinned"] == 0


def test_per_layer_views_of_a_block_outermost_layout_must_be_registered_whole(start_worker, shared_server):
    """A layer of BLHNC has other layers' pages between its blocks: no wrapper shares such a view
    (it is not dense); the whole [L, B, H, N, C] cache is, with block_dim 1."""
    w = start_worker(shared_server.url)
    r = w.call("register_vllm", **BY_NAME["flash-attn-BLNHC"].spec(register="layers"), block_dim=0)
    assert not r["ok"] and "cannot be made contiguous" in r["message"], r
    assert query_status(shared_server.url).registrations == []


def test_block_dim_is_kept_across_a_server_restart_and_shown_by_status(start_server, start_worker):
    row = BY_NAME["flashinfer-sm100-BLHNC"]
    first = start_server("--reap-timeout", "5")
    w, iid = register(start_worker, first, row)
    w.ok("fill_random", instance_id=iid, seed=5)
    [info] = query_status(first.url).registrations
    assert info.block_dim == 1
    table = subprocess.run([sys.executable, "-m", "lmshm.cli", "status", "--url", first.url],
                           capture_output=True, text=True, timeout=30)
    assert table.returncode == 0 and "1 (block dim 1)" in table.stdout, table.stdout + table.stderr
    assert first.stop() == 0

    second = start_server("--reap-timeout", "5", url=first.url)
    status = wait_for(lambda: (s := query_status(second.url)).registrations and s, 10, 0.05,
                      "the worker to re-register")
    [info] = status.registrations
    assert (info.instance_id, info.block_dim) == (iid, 1)
    want = digests(w, iid, row, [4, 5])
    k = key()
    w.ok("store", instance_id=iid, keys=[k], blocks=[4, 5], chunk_blocks=2)
    w.ok("retrieve", instance_id=iid, keys=[k], blocks=[9, 0], chunk_blocks=2)
    assert digests(w, iid, row, [9, 0]) == want


# ---- the table against vLLM itself ----------------------------------------------------------

_CHECK = r"""
import importlib, json, sys
import torch
from vllm.v1.attention.backends.utils import _DEFAULT_LAYOUT_PREFERENCE
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheTensor, MLAAttentionSpec,
                                        compute_layout_strides, create_kv_cache_views)
from vllm.v1.kv_cache_layout import KVCacheLayout

out = {"layouts": {m.name: list(m.value) for m in KVCacheLayout},
       "default": [m.name for m in _DEFAULT_LAYOUT_PREFERENCE], "rows": {}}
for row in json.load(sys.stdin):
    module, cls_name = row["backend"].split(":")
    try:
        cls = getattr(importlib.import_module(module), cls_name)
    except Exception as exc:  # the CPU build lacks some kernels' packages
        out["rows"][row["name"]] = {"skip": f"{row['backend']} does not import here: {type(exc).__name__}: {exc}"}
        continue
    supported = cls.supported_kv_cache_layouts()
    dtype = getattr(torch, row["dtype"])
    s = row["spec"]
    if row["mla"]:
        spec = MLAAttentionSpec(block_size=s["tokens"], num_kv_heads=1, head_size=row["head_size"], dtype=dtype)
    else:
        spec = FullAttentionSpec(block_size=s["tokens"], num_kv_heads=s["heads"], head_size=row["head_size"],
                                 head_size_v=row["head_size_v"], dtype=dtype)
    layout = KVCacheLayout[row["layout"]]
    names = [f"model.layers.{i}.self_attn.attn" for i in range(s["layers"])]
    # as get_kv_cache_config_from_groups (vllm/v1/core/kv_cache_utils.py) places one group
    layer_stride, block_stride, *_ = compute_layout_strides(spec, s["blocks"], len(names), layout)
    size = spec.page_size_bytes * s["blocks"] * len(names)
    tensor = KVCacheTensor(size=size, layers=names, layer_stride=layer_stride, block_stride=block_stride)
    buf = torch.zeros(size, dtype=torch.int8)      # allocate_kv_cache (vllm/v1/worker/utils.py)
    views = create_kv_cache_views(buf, spec, s["blocks"], layout, tensor)
    out["rows"][row["name"]] = {
        "supported": None if supported is None else [m.name for m in supported],
        "views": [[list(v.shape), list(v.stride()), v.storage_offset(), str(v.dtype)] for v in views]}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def from_vllm(tmp_path_factory) -> dict:
    """What vLLM (``.venv-vllm``) makes of every row: its layouts, and the views it allocates."""
    if not VLLM_PYTHON.exists():
        if os.environ.get("LMSHM_SKIP_VLLM") == "1":
            pytest.skip("LMSHM_SKIP_VLLM=1: the real-vLLM tests are off")
        pytest.fail(f"{VLLM_PYTHON} is missing: run scripts/bootstrap-vllm (scripts/test does), "
                    "or set LMSHM_SKIP_VLLM=1 to skip the real-engine tests")
    tmp = tmp_path_factory.mktemp("vllm-layouts")
    rows = [{**dataclasses.asdict(r), "spec": r.spec()} for r in ROWS]
    env = {**os.environ, "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "TMPDIR": str(tmp)}
    env.pop("PYTHONPATH", None)
    done = subprocess.run([str(VLLM_PYTHON), "-c", _CHECK], input=json.dumps(rows), capture_output=True, text=True,
                          timeout=300, cwd=tmp, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.vllm
def test_the_layouts_are_vllms(from_vllm):
    assert {k: tuple(v) for k, v in from_vllm["layouts"].items()} == LAYOUTS
    assert from_vllm["default"][0] == "LBNHC"      # what "NHD first" in the table means
    assert {r.layout for r in ROWS} == set(LAYOUTS)


@pytest.mark.vllm
@pytest.mark.parametrize("row", ROWS, ids=lambda r: r.name)
def test_the_table_is_what_vllm_allocates(from_vllm, row):
    got = from_vllm["rows"][row.name]
    if "skip" in got:
        pytest.skip(got["skip"])
    supported = got["supported"] if got["supported"] is not None else from_vllm["default"]
    assert row.layout in supported, got["supported"]
    ours = vllm_kv_caches(row.spec())
    if row.register == "whole":
        [whole] = ours.values()
        ours = {i: whole[i] for i in range(whole.shape[0])}
    assert [[list(t.shape), list(t.stride()), t.storage_offset(), str(t.dtype)] for t in ours.values()] \
        == got["views"]
