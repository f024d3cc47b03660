"""``dataplane.layout.plan_cuda_copies``: a request's CUDA copies as address arrays, computed with numpy.

Pure arithmetic on layouts of CPU tensors (no copy is made): the plan must move exactly the bytes
the per-piece plan (``layout.pieces``, which the CPU path copies with) moves, in no more pieces,
and, with pin extents, in pieces none of which crosses an extent's edge on the pool side.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from lmshm.core.dataplane.layout import BlockLayout, _runs, pieces, plan_cuda_copies

L, B, H, N, C = 3, 10, 2, 4, 8                # float16


def _layouts():
    dense = [torch.empty(B, H, N, C, dtype=torch.float16) for _ in range(L)]
    kv_first = [torch.empty(2, B, N, C, dtype=torch.float16) for _ in range(L)]
    head_major = [torch.empty(H, B, N, C, dtype=torch.float16).transpose(0, 1) for _ in range(L)]
    whole = torch.empty(B, L, H, N, C, dtype=torch.float16).transpose(0, 1)    # BLHNC, registered whole
    one_buffer = torch.empty(L, B, H, N, C, dtype=torch.float16)               # LBHNC: layers back to back
    return {"dense": (dense, 0), "kv-first": (kv_first, 1), "head-major": (head_major, 0),
            "block-outermost": ([whole], 1), "one-buffer": ([one_buffer[i] for i in range(L)], 0)}


def _bytes(pairs) -> set:
    """Every (pool byte, KV byte) pair the copies move."""
    out = set()
    for pool, kv, n in pairs:
        out.update(zip(range(pool, pool + n), range(kv, kv + n)))
    return out


def _reference(layout, ids, objs, cb):
    out = []
    for c, obj in enumerate(objs):
        runs, at = _runs(ids[c]), 0
        for p in layout.layers:
            out += [(obj + at + o, p.flat.data_ptr() + k, n) for o, k, n in pieces(p, runs, cb)]
            at += p.block_bytes * cb
    return out


@pytest.mark.parametrize("name", list(_layouts()))
def test_the_plan_moves_the_bytes_the_per_piece_plan_moves_in_no_more_pieces(name):
    tensors, block_dim = _layouts()[name]
    layout = BlockLayout.of([f"l{i}" for i in range(len(tensors))], tensors, block_dim)
    rng = random.Random(name)
    for cb in (1, 3):
        ids = [rng.sample(range(B), cb), list(range(4, 4 + cb)), list(range(B - cb, B))]
        chunk = layout.chunk_bytes(cb)
        objs = [1 << 32, (1 << 32) + chunk, (1 << 32) + 5 * chunk]      # two objects back to back
        ref = _reference(layout, ids, objs, cb)
        store = plan_cuda_copies(layout, ids, objs, cb, store=True)
        got = list(zip(store.dst.tolist(), store.src.tolist(), store.size.tolist()))
        assert _bytes(got) == _bytes(ref) and len(got) <= len(ref)
        assert store.nbytes == chunk * len(objs)
        back = plan_cuda_copies(layout, ids, objs, cb, store=False)     # RETRIEVE: the other way round
        assert np.array_equal(back.dst, store.src) and np.array_equal(back.src, store.dst)


def test_consecutive_blocks_and_neighbouring_layers_merge_into_one_piece():
    tensors, _ = _layouts()["one-buffer"]     # every layer's blocks back to back, layers too
    layout = BlockLayout.of([f"l{i}" for i in range(L)], tensors)
    plan = plan_cuda_copies(layout, [list(range(B))], [1 << 32], B, store=True)
    assert len(plan) == 1 and plan.nbytes == layout.chunk_bytes(B)      # the whole cache, one copy
    kv_first, _ = _layouts()["kv-first"]
    layout = BlockLayout.of([f"l{i}" for i in range(L)], kv_first, 1)
    plan = plan_cuda_copies(layout, [[2, 3, 4, 7]], [1 << 32], 4, store=True)
    assert len(plan) == L * 2 * 2                                       # per layer, K and V: 2-4 and 7


@pytest.mark.parametrize("extent", [4096, 1000, 64])
def test_with_pin_extents_no_piece_crosses_an_edge_and_the_same_bytes_move(extent):
    tensors, block_dim = _layouts()["block-outermost"]
    layout = BlockLayout.of(["kv"], tensors, block_dim)
    cb, base = 3, (1 << 32) - 100
    chunk = layout.chunk_bytes(cb)              # 3 x 384 bytes: objects straddle every extent
    objs = [base + 64 * i + i * chunk for i in range(6)]
    ids = [[(3 * i + j) % B for j in range(cb)] for i in range(6)]
    whole = plan_cuda_copies(layout, ids, objs, cb, store=True)
    cut = plan_cuda_copies(layout, ids, objs, cb, store=True, pool_base=base, extent=extent)
    rel = cut.dst.astype(np.int64) - base
    assert ((rel // extent) == ((rel + cut.size.astype(np.int64) - 1) // extent)).all()
    assert len(cut) > len(whole) and cut.nbytes == whole.nbytes
    assert _bytes(zip(cut.dst.tolist(), cut.src.tolist(), cut.size.tolist())) == \
        _bytes(zip(whole.dst.tolist(), whole.src.tolist(), whole.size.tolist()))
    back = plan_cuda_copies(layout, ids, objs, cb, store=False, pool_base=base, extent=extent)
    rel = back.src.astype(np.int64) - base      # RETRIEVE: the pool is the source
    assert ((rel // extent) == ((rel + back.size.astype(np.int64) - 1) // extent)).all()


def test_objects_inside_one_extent_are_not_cut():
    tensors, block_dim = _layouts()["block-outermost"]
    layout = BlockLayout.of(["kv"], tensors, block_dim)
    plan = plan_cuda_copies(layout, [[1, 2]], [(1 << 32) + 4096], 2, store=True, pool_base=1 << 32, extent=8192)
    assert len(plan) == 1


def test_block_ids_out_of_range_and_a_wrong_number_of_objects_are_refused():
    tensors, block_dim = _layouts()["dense"]
    layout = BlockLayout.of([f"l{i}" for i in range(L)], tensors, block_dim)
    with pytest.raises(ValueError, match=r"block ids must lie in \[0, 10\), got 0..10"):
        plan_cuda_copies(layout, [[0, 10]], [1 << 32], 2, store=True)
    with pytest.raises(ValueError, match=r"block ids must lie in \[0, 10\), got -1..1"):
        plan_cuda_copies(layout, [[-1, 1]], [1 << 32], 2, store=True)
    with pytest.raises(ValueError, match="2 chunk objects for 1 chunks"):
        plan_cuda_copies(layout, [[0, 1]], [1 << 32, 1 << 33], 2, store=True)
