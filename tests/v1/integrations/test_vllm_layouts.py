"""The connector moves every KV layout vLLM 0.32 allocates, with vLLM's own allocation code.

A script run by ``.venv-vllm``'s Python builds each layer's cache exactly as vLLM's workers do:
a flat buffer viewed per layer by ``vllm.v1.kv_cache_interface.create_kv_cache_views`` for a
``FullAttentionSpec``, in each ``KVCacheLayout`` (LBHNC is the CPU backend's; FlashAttention,
Triton attention and FlashInfer take the resolved layout, block-outermost ones included), and
with a kernel block smaller than the manager block. It then does what
``LmshmConnector.register_kv_caches`` does (``block_view`` from the layer's spec, then
``check_movable``), registers two such "engines" with a real lmshm-server, stores shuffled
blocks from one and retrieves them into other blocks of the other, and compares the bytes.
A layout the data plane cannot move (LHBNC with more KV heads than byte runs allowed) and a
tensor that is not the spec's layout must be refused before anything is registered.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from vllm_harness import VLLM_PYTHON, _env

pytestmark = pytest.mark.vllm

SCRIPT = r'''
import json, random, sys
import torch
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor,
                                        compute_layout_strides, create_kv_cache_views)
from vllm.v1.kv_cache_layout import KVCacheLayout
from lmshm.core.dataplane import LayoutError, check_movable
from lmshm.integrations.vllm import LayoutRefused, block_view, registration_groups
from lmshm.transport.client import MPClient
from lmshm.platform.cpu import move_to_shared

url, out = sys.argv[1], sys.argv[2]
BLOCKS, LAYERS = 16, 3


def engine(layout, heads, kernel=None):
    spec = FullAttentionSpec(block_size=32, num_kv_heads=heads, head_size=64, dtype=torch.float16)
    page = spec.page_size_bytes
    # the strides vLLM's get_kv_cache_config gives a group's KVCacheTensor
    interleaved = page * LAYERS if layout.is_block_outermost else None
    layer_stride, block_stride, _, _, _ = compute_layout_strides(spec, BLOCKS, LAYERS, layout,
                                                                 fixed_strides=(None, interleaved, None, None, None))
    raw = torch.zeros(page * BLOCKS * LAYERS, dtype=torch.int8)
    tensor = KVCacheTensor(size=raw.numel(), layers=[f"layer.{i}" for i in range(LAYERS)],
                           layer_stride=layer_stride, block_stride=block_stride)
    views = create_kv_cache_views(raw, spec, BLOCKS, layout, tensor, kernel)
    config = KVCacheConfig(num_blocks=BLOCKS, kv_cache_tensors=[tensor],
                           kv_cache_groups=[KVCacheGroupSpec(list(tensor.layers), spec)])
    return config, dict(zip(tensor.layers, views)), raw


def registered(config, caches):
    """Exactly what LmshmConnector.register_kv_caches registers (one group here): vLLM's views
    move into shared memory first, then the registered views are made over them."""
    move_to_shared(caches.values())
    (group,) = registration_groups(caches, config)
    return group


def group_blocks(view, block):
    """Manager block ``block`` of one of vLLM's layer views (kernel blocks regrouped)."""
    ratio = view.shape[0] // BLOCKS
    return view[block * ratio:(block + 1) * ratio].view(torch.int16)   # bits: random halves hold NaNs


results = []
cases = [(layout.name, 4, None) for layout in KVCacheLayout] + [("LBHNC", 4, 16), ("LBNHC", 2, 16),
                                                                 ("LHBNC", 16, None)]
with MPClient(url) as client:
    for n, (name, heads, kernel) in enumerate(cases):
        layout = KVCacheLayout[name]
        row = {"layout": name, "heads": heads, "kernel_block": kernel}
        config, a, _ = engine(layout, heads, kernel)
        _, b, _ = engine(layout, heads, kernel)
        row["shape"], row["stride"] = list(a["layer.0"].shape), list(a["layer.0"].stride())
        try:
            ra, rb = registered(config, a), registered(config, b)
            row["registered"] = {n: [list(t.shape), list(t.stride())] for n, t in ra.items()}
        except (LayoutRefused, LayoutError) as exc:
            row["refused"] = str(exc)
            results.append(row)
            continue
        for t in a.values():   # written through vLLM's own views, which now alias the shared memory
            bits = t.view(torch.int16)
            bits.copy_(torch.randint(-(1 << 15), 1 << 15, bits.shape, dtype=torch.int16))
        ia = client.register_kv_caches(ra, f"a{n}", block_dim=0)
        ib = client.register_kv_caches(rb, f"b{n}", block_dim=0)
        src = random.Random(n).sample(range(BLOCKS), 8)
        dst = random.Random(n + 100).sample(range(BLOCKS), 8)
        keys = [bytes([n, i]) * 16 for i in range(4)]
        client.store(ia, keys, src, 2)
        hit = client.lookup([keys])
        client.retrieve(ib, keys, dst, 2, hit.lease)
        # compare through vLLM's own per-layer views, not through what was registered
        row["equal"] = all(torch.equal(group_blocks(a[l], s), group_blocks(b[l], d))
                           for l in a for s, d in zip(src, dst))
        row["nonzero"] = all(group_blocks(b[l], d).any() for l in b for d in dst)
        untouched = [x for x in range(BLOCKS) if x not in dst]
        row["others_untouched"] = all(not group_blocks(b[l], x).any() for l in b for x in untouched)
        client.unregister_kv_caches(ia)
        client.unregister_kv_caches(ib)
        results.append(row)
    # a tensor that is not its spec's layout is refused by name, never guessed
    config, a, _ = engine(KVCacheLayout.LBHNC, 4)
    try:
        block_view("layer.0", a["layer.0"].transpose(0, 1), config.kv_cache_groups[0].kv_cache_spec, BLOCKS)
        results.append({"layout": "transposed", "refused": ""})
    except LayoutRefused as exc:
        results.append({"layout": "transposed", "refused": str(exc)})
json.dump(results, open(out, "w"))
'''


def test_every_vllm_kv_layout_moves_or_is_refused_before_registration(server, tmp):
    if not VLLM_PYTHON.exists():
        pytest.skip(f"{VLLM_PYTHON} is missing")
    out = Path(tmp) / "layouts.json"
    r = subprocess.run([str(VLLM_PYTHON), "-c", SCRIPT, server.url, str(out)], capture_output=True, text=True,
                       timeout=300, env=_env(str(tmp)), cwd=str(tmp))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    rows = {(row["layout"], row.get("heads"), row.get("kernel_block")): row for row in json.loads(out.read_text())}
    for name in ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"):
        row = rows[(name, 4, None)]
        assert row.get("equal") and row.get("nonzero") and row.get("others_untouched"), row
        if name.startswith("B"):   # block-outermost: the three layers travel as one tensor
            assert list(row["registered"]) == ["layer.0+2"], row
        else:
            assert list(row["registered"]) == ["layer.0", "layer.1", "layer.2"], row
    for key in (("LBHNC", 4, 16), ("LBNHC", 2, 16)):   # a manager block of two kernel blocks
        assert rows[key].get("equal") and rows[key].get("nonzero") and rows[key].get("others_untouched"), rows[key]
        assert rows[key]["shape"][0] == 32               # vLLM counts kernel blocks in dim 0
    refused = rows[("LHBNC", 16, None)]
    assert "16 separate byte runs" in refused.get("refused", ""), refused
    transposed = rows[("transposed", None, None)]
    assert "not vLLM's [blocks, heads, tokens, content] KV layout" in transposed["refused"], transposed


GROUPS_SCRIPT = r'''
import json, sys
import torch
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec,
                                        SlidingWindowSpec)
from lmshm.integrations.vllm import cache_groups

full = FullAttentionSpec(block_size=32, num_kv_heads=1, head_size=64, dtype=torch.float32)
window = SlidingWindowSpec(block_size=32, num_kv_heads=1, head_size=64, dtype=torch.float32, sliding_window=128)
mamba = MambaSpec(block_size=32, shapes=((4, 64),), dtypes=(torch.float32,))
out = {}
hybrid = KVCacheConfig(num_blocks=8, kv_cache_tensors=[],
                       kv_cache_groups=[KVCacheGroupSpec(["w.0", "w.1"], window), KVCacheGroupSpec(["f.0"], full)])
groups, names = cache_groups(hybrid)
out["hybrid"] = [[g.window for g in groups], names]
try:
    cache_groups(KVCacheConfig(num_blocks=8, kv_cache_tensors=[],
                               kv_cache_groups=[KVCacheGroupSpec(["f.0"], full), KVCacheGroupSpec(["m.0"], mamba)]))
    out["mamba"] = ""
except ValueError as exc:
    out["mamba"] = str(exc)
json.dump(out, open(sys.argv[1], "w"))
'''


def test_sliding_window_groups_are_served_and_mamba_groups_refused_at_start(tmp):
    if not VLLM_PYTHON.exists():
        pytest.skip(f"{VLLM_PYTHON} is missing")
    out = Path(tmp) / "groups.json"
    r = subprocess.run([str(VLLM_PYTHON), "-c", GROUPS_SCRIPT, str(out)], capture_output=True, text=True,
                       timeout=300, env=_env(str(tmp)), cwd=str(tmp))
    assert r.returncode == 0, r.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["hybrid"] == [[128, 0], [["w.0", "w.1"], ["f.0"]]]
    assert "KV cache group 1 (MambaSpec" in result["mamba"] and "Mamba/SSM" in result["mamba"], result


ASK = r'''
from types import SimpleNamespace as NS
from vllm.v1.attention.backends.registry import AttentionBackendEnum as E
from lmshm.integrations.vllm import LmshmConnector

def ask(extra, device="cuda", backend=None):
    return LmshmConnector.get_required_kvcache_layout(NS(
        kv_transfer_config=NS(kv_connector_extra_config=extra), device_config=NS(device_type=device),
        attention_config=NS(backend=backend)))

assert ask({}) is None                                                  # off by default: the engine's choice
assert ask({"lmshm.kv_layout": "BLHNC"}) == "BLHNC"                     # backend left to vLLM
assert ask({"lmshm.kv_layout": "BLNHC"}, backend=E.FLASH_ATTN) == "BLNHC"   # takes any layout
assert ask({"lmshm.kv_layout": "BLHNC"}, device="cpu") is None          # the CPU backend: LBHNC only
assert ask({"lmshm.kv_layout": "BLHNC"}, backend=E.CPU_ATTN) is None
try:
    ask({"lmshm.kv_layout": "LHBNC"})
    raise SystemExit("LHBNC was not refused")
except ValueError as exc:
    assert "BLHNC, BLNHC" in str(exc), exc
print("ok")
'''


def test_the_connector_asks_for_a_block_outermost_layout_only_when_told_and_never_one_the_backend_refuses(tmp):
    if not VLLM_PYTHON.exists():
        pytest.skip(f"{VLLM_PYTHON} is missing")
    root = str(Path(__file__).resolve().parents[3])
    r = subprocess.run([str(VLLM_PYTHON), "-c", ASK], capture_output=True, text=True, timeout=300,
                       env={**_env(str(tmp)), "PYTHONPATH": root}, cwd=str(tmp))
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout[-3000:] + r.stderr[-6000:]
