"""vLLM's KV-event format and the token packer, in process (``lmshm.core.kv_events.format``):
the bytes lmshm writes, what it reads, and what it refuses. Against a real vLLM's own structs:
``tests/v1/integrations/test_vllm_kv_events.py``."""

from __future__ import annotations

import msgspec
import pytest

from lmshm.core.kv_events import (
    TIER_MEDIA,
    AllBlocksCleared,
    BadBatch,
    BlockRemoved,
    BlockStored,
    block_salt,
    decode_batch,
    encode_batch,
    packed_tokens,
)
from lmshm.core.kv_events.format import UNNAMED, media_of, token_tuple, unpacked_tokens


def test_token_ids_pack_as_little_endian_int32_whatever_the_host():
    assert packed_tokens([1, -1, 0x01020304, -(1 << 31)]) == bytes.fromhex("01000000" "ffffffff" "04030201" "00000080")
    assert packed_tokens(range(3)) == packed_tokens((0, 1, 2)) == bytes.fromhex("000000000100000002000000")
    assert packed_tokens([]) == b""


@pytest.mark.parametrize("bad, error", [([1 << 31], OverflowError), ([-(1 << 31) - 1], OverflowError),
                                        (["7"], TypeError), ([1.5], TypeError)])
def test_a_token_id_outside_int32_or_not_an_int_is_refused_never_wrapped(bad, error):
    with pytest.raises(error):
        packed_tokens(bad)


def test_packed_tokens_unpack_to_the_same_ids_as_a_list_and_as_a_tuple():
    ids = [0, 5, 150_000, (1 << 31) - 1, -(1 << 31)] * 7
    packed = packed_tokens(ids)
    assert unpacked_tokens(packed) == ids and token_tuple(packed) == tuple(ids)


def test_a_batch_encodes_as_vllms_map_tagged_events_their_defaults_left_out():
    stored = BlockStored([1, b"\x02" * 32], None, [7, 8], 2, None, "CPU", None, group_idx=0, locality="LOCAL")
    payload = encode_batch([stored, BlockRemoved([1], "STORAGE"), AllBlocksCleared()], ts=12.5)
    assert msgspec.msgpack.decode(payload) == [12.5, [
        {"type": "BlockStored", "block_hashes": [1, b"\x02" * 32], "parent_block_hash": None, "token_ids": [7, 8],
         "block_size": 2, "lora_id": None, "medium": "CPU", "lora_name": None, "group_idx": 0, "locality": "LOCAL"},
        {"type": "BlockRemoved", "block_hashes": [1], "medium": "STORAGE"},
        {"type": "AllBlocksCleared"}], None]                      # the batch: [ts, events, data_parallel_rank]


def test_decode_batch_reads_both_encodings_vllm_has_used_alike():
    events = [BlockStored([1, 2], 0, [7, 8, 9, 10], 2, None, "CPU", "lora", [["lora"], ["lora"]]),
              BlockRemoved([1, 2], "CPU"), AllBlocksCleared()]
    mapped = decode_batch(encode_batch(events, ts=3.0))
    # before vLLM PR #42892: each event an array, its tag first, its fields in order
    arrays = msgspec.msgpack.encode([3.0, [["BlockStored", [1, 2], 0, [7, 8, 9, 10], 2, None, "CPU", "lora",
                                            [["lora"], ["lora"]]],
                                           ["BlockRemoved", [1, 2], "CPU"], ["AllBlocksCleared"]], 0])
    assert decode_batch(arrays) == mapped
    ts, got = mapped
    assert ts == 3.0 and [e["type"] for e in got] == ["BlockStored", "BlockRemoved", "AllBlocksCleared"]
    assert got[0]["token_ids"] == [7, 8, 9, 10] and got[0]["lora_name"] == "lora" and got[1]["medium"] == "CPU"


BAD_BATCHES = {
    "not msgpack": b"\xc1",
    "not an array": msgspec.msgpack.encode({"ts": 1.0, "events": []}),
    "no events": msgspec.msgpack.encode([1.0]),
    "an unknown tag": msgspec.msgpack.encode([1.0, [{"type": "BlockEvicted"}]]),
    "an unknown tag, array form": msgspec.msgpack.encode([1.0, [["Nothing", 1]]]),
    "an event neither a map nor an array": msgspec.msgpack.encode([1.0, [7]]),
}


@pytest.mark.parametrize("payload", BAD_BATCHES.values(), ids=BAD_BATCHES.keys())
def test_decode_batch_refuses_what_is_not_a_batch_with_bad_batch(payload):
    with pytest.raises(BadBatch):
        decode_batch(payload)


@pytest.mark.parametrize("extra, lora, first, salt", [
    (None, None, True, None),                           # no keys: nothing to name
    (["adapter"], "adapter", False, None),              # a LoRA's blocks carry its name
    (["adapter", "s1"], "adapter", True, "s1"),         # the cache salt, first block only
    (["s1"], None, True, "s1"),
    (["s1"], None, False, UNNAMED),                     # a string past the first block: not a salt
    ([["image-1", 0]], None, True, UNNAMED),            # a multimodal input
    ([b"embeds-digest"], None, False, UNNAMED),         # prompt embeddings
    (["other"], "adapter", False, UNNAMED),             # another LoRA's name
])
def test_block_salt_reads_vllms_extra_keys(extra, lora, first, salt):
    got = block_salt(extra, lora, first)
    assert (got is UNNAMED) if salt is UNNAMED else (got == salt and got is not UNNAMED)


def test_each_tier_has_vllms_medium_and_locality():
    assert TIER_MEDIA == {"pool": ("CPU", "LOCAL"), "disk": ("STORAGE", "LOCAL"), "remote": ("STORAGE", "REMOTE")}
    assert [media_of(t) for t in ("pool", "remote", "tape")] == [("CPU", "LOCAL"), ("STORAGE", "REMOTE"),
                                                                  ("STORAGE", "LOCAL")]
