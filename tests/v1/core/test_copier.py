"""The copier's plans and copies in this process: blocks along any block_dim, permuted views,
gaps between blocks, through the mapping and through a named-shm file. The same layouts through
a real server and two workers: tests/v1/server/test_kv_layouts.py."""

from __future__ import annotations

import dataclasses
import os
import random

import pytest
import torch

from lmshm.core.dataplane import (
    MAX_RUNS,
    BlockLayout,
    FileSide,
    LayoutError,
    check_movable,
    copy_chunks,
    gather,
    pieces,
    scatter,
)
from lmshm.core.pool import Pool


def permuted(logical: tuple[int, ...], order: tuple[int, ...], dtype=torch.float16, pad: int = 0,
             storage: torch.Tensor | None = None) -> torch.Tensor:
    """A dense buffer in physical order ``order`` (plus ``pad`` elements between outermost
    slices), viewed in the logical shape: what engines hand out (vLLM's NHD over HND)."""
    physical = [logical[i] for i in order]
    inner = int(torch.Size(physical[1:]).numel())
    stride_outer = inner + pad
    n = physical[0] * stride_outer
    buf = storage if storage is not None else torch.randint(-1000, 1000, (n,)).to(dtype)
    phys_strides = [stride_outer] + list(torch.empty(physical[1:], device="meta").stride())
    strides = [0] * len(logical)
    for pos, dim in enumerate(order):
        strides[dim] = phys_strides[pos]
    return buf.as_strided(logical, strides)


def blocks_equal(a: torch.Tensor, b: torch.Tensor, bd: int, src: list[int], dst: list[int]) -> bool:
    return all(torch.equal(a.select(bd, s).view(torch.int16), b.select(bd, d).view(torch.int16))
               for s, d in zip(src, dst))


def round_trip(a: list[torch.Tensor], b: list[torch.Tensor], bd: int, src: list[int], dst: list[int],
               files: tuple | None = None) -> BlockLayout:
    names = [f"l{i}" for i in range(len(a))]
    la, lb = BlockLayout.of(names, a, bd), BlockLayout.of(names, b, bd)
    assert la.digest == lb.digest
    if files is not None:
        la, lb = files[0](la), files[1](lb)
    pool = Pool(max(1 << 22, 2 * la.chunk_bytes(len(src))))
    _, obj = pool.reserve(0, b"k", la.chunk_bytes(len(src)), la.digest, len(src))
    gather(la, src, pool.view(obj), len(src), pool.bytes)
    scatter(lb, dst, pool.view(obj), len(src), pool.bytes)
    pool.abort([obj])
    return la


@pytest.mark.parametrize("case", [
    # (logical shape, physical order, block_dim, runs per block)
    ((2, 10, 16, 4, 8), (0, 1, 2, 3, 4), 1, 2),      # K/V first, NHD (vLLM FlashAttention before 0.32)
    ((2, 10, 16, 4, 8), (0, 1, 3, 2, 4), 1, 2),      # K/V first, HND
    ((10, 2, 16, 4, 8), (0, 1, 3, 2, 4), 0, 1),      # blocks first, HND under an NHD view
    ((10, 4, 16, 16), (2, 0, 1, 3), 0, 16),          # refused: tokens outermost
    ((3, 10, 4, 16, 16), (1, 2, 0, 3, 4), 1, 1),     # vLLM 0.32 BHLNC, whole cache
    ((3, 10, 4, 16, 16), (0, 2, 1, 3, 4), 1, 12),    # refused: layer- and head-major, whole cache
])
def test_blocks_move_along_their_dim_in_as_few_runs_as_memory_allows(case):
    logical, order, bd, runs = case
    a = [permuted(logical, order) for _ in range(2)]
    b = [permuted(logical, order) for _ in range(2)]
    if runs > MAX_RUNS:
        with pytest.raises(LayoutError, match=f"'l0'.*block_dim {bd}.*{runs} separate byte runs"):
            check_movable(["l0", "l1"], a, bd)
        with pytest.raises(LayoutError, match=f"{runs} separate byte runs"):
            BlockLayout.of(["l0", "l1"], a, bd)
        return
    src, dst = [7, 3, 4, 5], [1, 8, 9, 0]
    layout = round_trip(a, b, bd, src, dst)
    assert [len(p.geometry.offsets) for p in layout.layers] == [runs, runs]
    assert all(blocks_equal(x, y, bd, src, dst) for x, y in zip(a, b))


@pytest.mark.parametrize("case", [
    # (logical shape, physical order, block_dim, pad, copied as numpy rows)
    ((10, 4, 16, 8), (0, 1, 2, 3), 0, 0, True),      # vLLM CPU: blocks first, dense
    ((2, 10, 16, 4, 8), (0, 1, 2, 3, 4), 1, 0, True),  # K/V first: each half's blocks back to back
    ((10, 2, 16, 4, 8), (0, 1, 3, 2, 4), 0, 0, True),  # HND under an NHD view: still one run per block
    ((10, 64), (0, 1), 0, 16, False),                # gaps between blocks: pieces
    ((10, 2, 16, 8), (1, 0, 2, 3), 0, 0, True),      # K/V outermost under a blocks-first view: 2 runs
    ((10, 2, 16, 8), (0, 1, 2, 3), 0, 4, False),     # K and V in a block, then a gap: pieces
])
def test_cpu_layers_whose_blocks_are_rows_are_copied_as_rows_and_the_others_as_pieces(case):
    logical, order, bd, pad, rows = case
    a, b = permuted(logical, order, pad=pad), permuted(logical, order, pad=pad)
    src, dst = [7, 3, 3, 9, 0], [1, 8, 2, 0, 5]         # shuffled, a repeated source block
    layout = round_trip([a], [b], bd, src, dst)
    assert layout.rows is rows
    assert blocks_equal(a, b, bd, src, dst)


def test_a_large_shuffled_chunk_split_over_threads_round_trips_as_rows():
    layers, blocks, block_elems = 6, 48, 16 << 10        # 32 KiB blocks: 16 per chunk is 3 MiB, split
    a = [torch.randint(-1000, 1000, (blocks, block_elems)).to(torch.float16) for _ in range(layers)]
    b = [torch.zeros(blocks, block_elems, dtype=torch.float16) for _ in range(layers)]
    order = list(range(blocks))
    random.Random(5).shuffle(order)
    src, dst = order[:16], order[16:32]
    layout = round_trip(a, b, 0, src, dst)
    assert layout.rows and layout.chunk_bytes(16) >= 2 << 20
    assert all(blocks_equal(x, y, 0, src, dst) for x, y in zip(a, b))
    untouched = sorted(set(range(blocks)) - set(dst))
    assert all(not y[untouched].any() for y in b), "a RETRIEVE wrote blocks it was not asked to"


def test_a_requests_chunks_copy_as_one_batch_and_the_first_failure_is_named():
    layers, blocks, block_elems = 4, 64, 8 << 10          # 16 KiB blocks; 6 chunks of 4 blocks: 1.5 MiB
    a = [torch.randint(-1000, 1000, (blocks, block_elems)).to(torch.float16) for _ in range(layers)]
    b = [torch.zeros(blocks, block_elems, dtype=torch.float16) for _ in range(layers)]
    la, lb = BlockLayout.of([f"l{i}" for i in range(layers)], a, 0), BlockLayout.of([f"l{i}" for i in range(layers)], b, 0)
    order = list(range(blocks))
    random.Random(9).shuffle(order)
    src, dst = order[:24], order[24:48]
    pool = Pool(4 << 20)
    objs = [pool.reserve(0, bytes([c]), la.chunk_bytes(4), la.digest, 4)[1] for c in range(6)]
    chunks = [(src[c * 4:(c + 1) * 4], pool.view(o)) for c, o in enumerate(objs)]
    assert copy_chunks(la, chunks, 4, store=True) == (6, None)
    assert copy_chunks(lb, [(dst[c * 4:(c + 1) * 4], pool.view(o)) for c, o in enumerate(objs)], 4,
                       store=False) == (6, None)
    assert all(blocks_equal(x, y, 0, src, dst) for x, y in zip(a, b))
    for o in objs:
        pool.view(o).zero_()
    bad = list(chunks)
    bad[3] = ([1, 2, 3, blocks], bad[3][1])                # out of range: refused before any copy of it
    done, exc = copy_chunks(la, bad, 4, store=True)
    assert done == 3 and isinstance(exc, ValueError) and "must lie in" in str(exc)
    assert all(pool.view(o).any() for o in objs[:3]), "a chunk before the failure was not copied"
    pool.release()


def test_random_layouts_round_trip_through_the_mapping_and_through_a_file():
    from lmshm.platform.cpu import empty_shared, segment_of

    rng = random.Random(11)
    # first two fixed ones: gaps between blocks (a padded page), and gaps between the runs of a block
    fixed = [((9, 3, 4), (0, 1, 2), 0, 5), ((2, 9, 4), (0, 1, 2), 1, 7)]
    done = 0
    while done < 14:
        if fixed:
            logical, order, bd, pad = fixed.pop(0)
            rank = len(logical)
        else:
            rank = rng.randint(2, 5)
            logical = tuple(rng.choice([1, 2, 3, 4]) for _ in range(rank))
            bd = rng.randrange(rank)
            logical = logical[:bd] + (9,) + logical[bd + 1:]
            order = tuple(rng.sample(range(rank), rank))
            pad = rng.choice([0, 0, 3])
        size = [logical[i] for i in order]
        total = size[0] * (int(torch.Size(size[1:]).numel()) + pad)
        try:
            check_movable(["x"], [permuted(logical, order, pad=pad)], bd)
        except LayoutError:
            continue
        done += 1
        src = rng.sample(range(9), 4)
        dst = rng.sample(range(9), 4)
        # through the mapping (memmove / torch copy_)
        a, b = permuted(logical, order, pad=pad), permuted(logical, order, pad=pad)
        round_trip([a], [b], bd, src, dst)
        assert blocks_equal(a, b, bd, src, dst), (logical, order, bd, pad)
        # through named-shm files (preadv / pwritev), as the server copies named shm
        segs = []
        for seed in (1, 2):
            shm = empty_shared((total,), torch.float16, kind="shm")
            shm.copy_(torch.randint(-1000, 1000, (total,), generator=torch.Generator().manual_seed(seed)))
            segs.append(shm)

        def with_file(shm):
            def attach(layout: BlockLayout) -> BlockLayout:
                seg, st = segment_of(shm), os.stat(segment_of(shm).path)
                start = shm.untyped_storage().data_ptr()
                plans = tuple(dataclasses.replace(p, file=FileSide(seg.path, (st.st_dev, st.st_ino), p.base - start))
                              for p in layout.layers)
                return dataclasses.replace(layout, layers=plans)
            return attach

        fa, fb = (permuted(logical, order, pad=pad, storage=s) for s in segs)
        round_trip([fa], [fb], bd, src, dst, files=(with_file(segs[0]), with_file(segs[1])))
        assert blocks_equal(fa, fb, bd, src, dst), (logical, order, bd, pad)
        del fa, fb, segs


def test_consecutive_blocks_are_one_piece_where_memory_allows():
    kv_first = permuted((2, 10, 16, 4, 8), (0, 1, 2, 3, 4))
    plan = BlockLayout.of(["l"], [kv_first], 1).layers[0]
    run = 16 * 4 * 8 * 2
    runs = [(0, 3, 3), (3, 8, 1)]                      # blocks 3, 4, 5 then 8
    assert pieces(plan, runs, 4) == [(0, 3 * run, 3 * run), (3 * run, 8 * run, run),
                                     (4 * run, 10 * run + 3 * run, 3 * run), (7 * run, 10 * run + 8 * run, run)]
    gapped = permuted((10, 64), (0, 1), pad=16)        # 16 elements between blocks
    plan = BlockLayout.of(["l"], [gapped], 0).layers[0]
    assert pieces(plan, [(0, 2, 2)], 2) == [(0, 2 * 80 * 2, 128), (128, 3 * 80 * 2, 128)]


def test_block_dim_and_memory_order_are_in_the_digest_and_the_number_of_blocks_is_not():
    def digest(logical, order, bd=0):
        return BlockLayout.of(["l"], [permuted(logical, order)], bd).digest

    nhd, hnd = digest((10, 16, 4, 8), (0, 1, 2, 3)), digest((10, 16, 4, 8), (0, 2, 1, 3))
    assert nhd != hnd
    assert nhd == digest((30, 16, 4, 8), (0, 1, 2, 3))
    # the same bytes per block in the same order, split into runs differently: other packing
    assert digest((2, 10, 64), (0, 1, 2), 1) != digest((10, 2, 64), (0, 1, 2), 0)
    # block_dim alone
    t = permuted((6, 6, 8), (0, 1, 2))
    assert BlockLayout.of(["l"], [t], 0).digest != BlockLayout.of(["l"], [t.transpose(0, 1)], 1).digest


def test_a_block_dim_outside_the_tensor_is_a_clear_error():
    t = torch.zeros(4, 8)
    with pytest.raises(LayoutError, match=r"layer 'x' \(shape \(4, 8\).*block_dim 2 is not one of its 2 dimensions"):
        check_movable(["x"], [t], 2)
    with pytest.raises(LayoutError, match="same number of blocks"):
        check_movable(["a", "b"], [torch.zeros(4, 8), torch.zeros(8, 4)], 1)


def test_the_ordered_executor_keeps_each_keys_order_starts_its_workers_with_jobs_and_cancels_at_shutdown():
    """OrderedExecutor (the copier's and the promoter's): no thread before the first job, at
    most ``threads``; a key's jobs one at a time in order while other keys' run beside them;
    at shutdown the running job finishes, the queued ones are cancelled, the workers end."""
    import threading
    import time

    from lmshm.core.dataplane import OrderedExecutor

    ex = OrderedExecutor(2, "test-ordered")

    def named() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name.startswith("test-ordered")]

    assert named() == []
    ran: list[tuple[str, int]] = []
    cancelled: list[tuple[str, int]] = []
    gate, started = threading.Event(), threading.Event()
    running: dict[str, int] = {}

    def job(key: str, i: int):
        def run() -> None:
            running[key] = running.get(key, 0) + 1
            assert running[key] == 1, "two jobs of one key at once"
            if (key, i) == ("a", 0):
                started.set()
                assert gate.wait(10)
            time.sleep(0.001)
            ran.append((key, i))
            running[key] -= 1
        return run

    for i in range(20):
        for key in ("a", "b", "c"):
            ex.submit(key, job(key, i), lambda key=key, i=i: cancelled.append((key, i)))
    assert started.wait(10)
    assert len(named()) == 2                      # three keys with jobs, two threads at most
    assert ex.pending("a") == 20 and not ex.idle()
    deadline = time.monotonic() + 10
    while ex.pending("b") or ex.pending("c"):     # a's first job holds one worker; the other serves b and c
        assert time.monotonic() < deadline, "b and c did not run beside a's held job"
        time.sleep(0.01)
    for key in ("b", "c"):
        assert [i for k, i in ran if k == key] == list(range(20))

    stopping = threading.Thread(target=ex.shutdown)
    stopping.start()
    time.sleep(0.05)
    gate.set()                                    # the running job finishes; a's queued ones are cancelled
    stopping.join(10)
    assert not stopping.is_alive()
    assert [i for k, i in ran if k == "a"] == [0]
    assert sorted(cancelled) == [("a", i) for i in range(1, 20)]
    assert named() == [] and ex.idle()
    late: list[int] = []
    ex.submit("d", lambda: late.append(1), lambda: late.append(0))
    assert late == [0]                            # after shutdown: cancelled at once, on the caller
