"""The wire codec: every message round-trips; hostile bytes are refused and run nothing."""

from __future__ import annotations

import pickle
import subprocess
import sys

import msgspec
import pytest
import torch
from harness import Evals, RunsACommand

from lmshm.platform.cpu import CpuFdIPCWrapper, CpuShmIPCWrapper
from lmshm.wire import codec, protocol
from lmshm.wire.codec import CodecError


def _shm_wrapper(name: str = "lmshm-1-abcdef") -> CpuShmIPCWrapper:
    return CpuShmIPCWrapper(dtype="float16", shape=(2, 4, 8), stride=(32, 8, 1), storage_offset=64,
                            device="cpu", segment=name, segment_bytes=1 << 20, byte_offset=0)


def _register(*groups: protocol.LayerGroup) -> protocol.RegisterKVCache:
    return protocol.RegisterKVCache(instance_id="inst-0", model_name="llama", world_size=2,
                                    worker_rank=1, groups=list(groups))




def _raw_register(payload: bytes, ext_code: int = codec.WRAPPER_EXT_CODE) -> bytes:
    """A REGISTER_KV_CACHE body whose one layer group carries ``payload`` under ``ext_code``."""
    return msgspec.msgpack.encode({
        "type": int(protocol.MsgType.REGISTER_KV_CACHE), "instance_id": "x", "model_name": "m",
        "world_size": 1, "worker_rank": 0,
        "groups": [[msgspec.msgpack.Ext(ext_code, payload), ["layer0"], [0]]],
    })


@pytest.mark.parametrize("msg", [
    protocol.Hello(protocol_version=2, isolated_ipc=True, client_name="w", resume_token="t"),
    protocol.UnregisterKVCache("inst-0"),
    protocol.Status(),
    protocol.Ping(),
    protocol.Peek("inst-0", "layer0", 16, 32),
])
def test_every_request_round_trips(msg):
    assert codec.decode_request(codec.encode(msg)) == msg


def test_wrappers_travel_as_ext_code_1_and_decode_to_equal_wrappers():
    fd_wrapper = CpuFdIPCWrapper(dtype="bfloat16", shape=(8,), stride=(1,), storage_offset=0, device="cpu",
                                 segment="lmshm-2-beef", segment_bytes=4096, byte_offset=0)
    msg = _register(protocol.LayerGroup(_shm_wrapper(), ["l0", "l0b"], [0, 16]),
                    protocol.LayerGroup(fd_wrapper, ["l1"], [fd_wrapper.storage_offset]))
    data = codec.encode(msg)
    raw = msgspec.msgpack.decode(data, ext_hook=lambda code, buf: (code, bytes(buf)))
    assert [group[0][0] for group in raw["groups"]] == [1, 1]  # the wrapper of each group is ext 1
    back = codec.decode_request(data)
    assert back == msg
    assert [type(group.wrapper) for group in back.groups] == [CpuShmIPCWrapper, CpuFdIPCWrapper]


def test_a_negative_storage_offset_in_a_group_is_refused_by_the_decoder():
    msg = _register(protocol.LayerGroup(_shm_wrapper(), ["l0", "l1"], [0, 16]))
    raw = msgspec.msgpack.decode(codec.encode(msg), ext_hook=lambda code, buf: msgspec.msgpack.Ext(code, bytes(buf)))
    raw["groups"][0][2][1] = -16
    with pytest.raises(codec.CodecError, match=">= 0"):
        codec.decode_request(msgspec.msgpack.encode(raw))


def test_replies_round_trip_including_status_and_errors():
    status = protocol.StatusReply(
        server_id="s", server_pid=1, protocol_version=2, isolated_ipc=False, uptime_s=1.5, sessions=1,
        mappings=2, draining=0, open_fds=12, fd_limit=1024, inbox_fds=0, registrations=[protocol.RegistrationInfo(
            "i", 1, 2, 0, "w", "m", 1, 0, 3, 4096, ["cpu-shm"], ["cpu"], 0.25)],
        pool=protocol.PoolInfo(1 << 30, 4096, 1, 0, 0, 0, 3, 1, 1, 0, 0, 0, 2, 0))
    for reply in (status, protocol.ErrorReply(protocol.ErrorCode.NOT_FOUND, "no such id"),
                  protocol.Pong("s", True), protocol.PeekReply(b"\x00\x01"),
                  protocol.StoreReply([0, 1, 2], 4096), protocol.LookupReply(2, b"l" * 16, 30.0),
                  protocol.RetrieveReply(2, 8192), protocol.ReleaseReply(True)):
        assert codec.decode_reply(codec.encode(reply)) == reply


def test_torch_dtypes_and_sizes_travel_as_plain_data():
    class Shape(msgspec.Struct):
        dtype: torch.dtype
        size: torch.Size

    data = codec.encode(Shape(torch.bfloat16, torch.Size([2, 3])))
    assert msgspec.msgpack.decode(data) == {"dtype": "bfloat16", "size": [2, 3]}
    back = codec.Decoder(Shape).decode(data)
    assert back.dtype is torch.bfloat16 and back.size == torch.Size([2, 3])
    with pytest.raises(CodecError, match="unknown dtype"):
        codec.Decoder(Shape).decode(msgspec.msgpack.encode({"dtype": "float1024", "size": []}))


def test_pickle_that_would_run_a_shell_command_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "pwned"
    body = _raw_register(pickle.dumps(RunsACommand(f"touch {marker}")))
    with pytest.raises(CodecError, match=r"refusing to unpickle .*system"):
        codec.decode_request(body)
    assert not marker.exists()


def test_pickle_naming_builtins_eval_is_refused(tmp_path):
    marker = tmp_path / "pwned"
    body = _raw_register(pickle.dumps(Evals(f"open({str(marker)!r}, 'w')")))
    with pytest.raises(CodecError, match=r"refusing to unpickle builtins\.eval"):
        codec.decode_request(body)
    assert not marker.exists()


def test_unknown_extension_code_is_refused():
    with pytest.raises(CodecError, match="unknown msgpack extension type 7"):
        codec.decode_request(_raw_register(_shm_wrapper().Serialize(), ext_code=7))


def test_a_plain_value_where_a_wrapper_belongs_is_refused():
    body = msgspec.msgpack.encode({"type": 2, "instance_id": "x", "model_name": "m", "world_size": 1,
                                   "worker_rank": 0, "groups": [["lmshm-1-ab", ["layer0"], [0]]]})
    with pytest.raises(CodecError, match="expected an lmshm wrapper"):
        codec.decode_request(body)


def test_truncated_random_and_mistyped_bytes_give_a_codec_error():
    good = codec.encode(_register(protocol.LayerGroup(_shm_wrapper(), ["l0"], [0])))
    rng = torch.Generator().manual_seed(7)
    bad_bodies = [good[:n] for n in (0, 1, len(good) // 2, len(good) - 1)]
    bad_bodies += [bytes(torch.randint(0, 256, (n,), generator=rng, dtype=torch.uint8).tolist())
                   for n in (1, 17, 300)]
    bad_bodies += [msgspec.msgpack.encode({"type": 42}), msgspec.msgpack.encode([1, 2, 3]),
                   msgspec.msgpack.encode({"type": 5, "surprise": 1}),
                   _raw_register(pickle.dumps(_shm_wrapper())[:-3])]
    for body in bad_bodies:
        with pytest.raises(CodecError):
            codec.decode_request(body)


def test_message_codes_are_explicit_and_distinct():
    assert protocol.MsgType.HELLO == 1 and protocol.MsgType.PING == 5 and protocol.MsgType.ERROR == 199
    assert [c.value for c in protocol.ErrorCode] == list(range(1, 10))
    assert protocol.MsgType.STORE == 7 and protocol.MsgType.RELEASE == 10 and protocol.MsgType.RELEASE_REPLY == 110
    tags = [t.__struct_config__.tag for t in (*protocol.Request.__args__, *protocol.Reply.__args__)]
    assert len(set(tags)) == len(tags)


class _UnlistedWrapper(CpuShmIPCWrapper):
    kind = "cpu-unlisted"


def test_a_wrapper_subclass_off_the_allow_list_is_refused():
    payload = _UnlistedWrapper(**_shm_wrapper().__getstate__()).Serialize()
    with pytest.raises(CodecError, match=r"refused wrapper payload: refusing to unpickle \S+\._UnlistedWrapper"):
        codec.decode_request(_raw_register(payload))


def test_the_control_plane_imports_neither_torch_nor_the_wrappers():
    # What `lmshm status` loads: a STATUS round trip needs msgspec and ZeroMQ, nothing heavier.
    modules = ["lmshm.wire.protocol", "lmshm.wire.codec", "lmshm.transport.client",
               "lmshm.transport.mq", "lmshm.transport.fdchannel", "lmshm.cli"]
    code = (f"import sys\nfor m in {modules!r}: __import__(m)\n"
            "from lmshm.wire import codec, protocol\n"
            "codec.decode_reply(codec.encode(protocol.ErrorReply(1, 'x')))\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy')"
            " or m.startswith(('lmshm.platform.base.ipc_wrapper', 'lmshm.platform.cpu', 'lmshm.platform.cuda'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_block_dim_travels_defaults_to_0_and_is_bounded_on_the_wire():
    group = protocol.LayerGroup(_shm_wrapper(), ["l0"], [64])
    msg = protocol.RegisterKVCache(instance_id="i", model_name="m", world_size=1, worker_rank=0, groups=[group],
                                   block_dim=2)
    assert codec.decode_request(codec.encode(msg)).block_dim == 2
    older = _raw_register(_shm_wrapper().Serialize())          # a 3.1 client sends no block_dim
    assert codec.decode_request(older).block_dim == 0
    for bad in (-1, protocol.MAX_BLOCK_DIM + 1):
        with pytest.raises(CodecError, match="block_dim"):
            codec.decode_request(codec.encode(msgspec.structs.replace(msg, block_dim=bad)))


# ---- the wire format, byte for byte --------------------------------------------------------
#: Every message of protocol 3.3 as ``codec.encode`` wrote it before the layering move (issue 16:
#: the data plane's messages, layer groups and status rows moved into the core; issue 43: all into lmshm.wire).
#: A change here is a change of the wire: it needs a new protocol version, not a new golden.
WIRE_3_3 = {
    'Hello': '86a47479706501b070726f746f636f6c5f76657273696f6e03ac69736f6c617465645f697063c2ab636c69656e745f6e616d65a163ac726573756d655f746f6b656ea174ae70726f746f636f6c5f6d696e6f7203',
    'RegisterKVCache': '87a47479706502ab696e7374616e63655f6964a169aa6d6f64656c5f6e616d65a16daa776f726c645f73697a6502ab776f726b65725f72616e6b01a667726f7570739193c707015752415050455292a26c30a26c31920006a9626c6f636b5f64696d01',
    'UnregisterKVCache': '82a47479706503ab696e7374616e63655f6964a169',
    'Status': '81a47479706504',
    'Ping': '81a47479706505',
    'Peek': '85a47479706506ab696e7374616e63655f6964a169aa6c617965725f6e616d65a26c30a66f666673657408a66c656e67746810',
    'Store': '86a47479706507ab696e7374616e63655f6964a169a46b65797392c4026b31c4026b32a9626c6f636b5f6964739401020304ac6368756e6b5f626c6f636b7302a56576656e74c44065656565656565656565656565656565656565656565656565656565656565656565656565656565656565656565656565656565656565656565656565656565',
    'Lookup': '83a47479706508a46b6579739291c4026b3191c4026b32a574746c5f73cb3ff8000000000000',
    'Retrieve': '87a47479706509ab696e7374616e63655f6964a169a46b65797391c4026b31a9626c6f636b5f696473920506ac6368756e6b5f626c6f636b7302a56c65617365c4106c6c6c6c6c6c6c6c6c6c6c6c6c6c6c6ca56576656e74c400',
    'Release': '82a4747970650aa56c65617365c4106c6c6c6c6c6c6c6c6c6c6c6c6c6c6c6c',
    'HelloReply': 'de0011a47479706565b070726f746f636f6c5f76657273696f6e03a97365727665725f6964a173aa7365727665725f70696401aa7365727665725f75696402ad7365727665725f7069645f6e7303aa73657373696f6e5f696404ad73657373696f6e5f746f6b656ea3746f6ba7726573756d6564c2a87665726966696564c3a966645f736f636b6574a62f782e666473ac69736f6c617465645f697063c2b46865617274626561745f696e74657276616c5f73cb3fe0000000000000ae726561705f74696d656f75745f73cb4000000000000000ae617574685f74696d656f75745f73cb4014000000000000b16d61785f6d6573736167655f6279746573ce00100000ae70726f746f636f6c5f6d696e6f7203',
    'RegisterReply': '85a47479706566ab696e7374616e63655f6964a169aa6e756d5f6c617965727302a66e6279746573cd1000a9726566726573686564c2',
    'UnregisterReply': '83a47479706567ab696e7374616e63655f6964a169a86465666572726564c3',
    'StatusReply': '8fa47479706568a97365727665725f6964a173aa7365727665725f70696401b070726f746f636f6c5f76657273696f6e03ac69736f6c617465645f697063c2a8757074696d655f73cb3ff8000000000000a873657373696f6e7301a86d617070696e677302a8647261696e696e6700a86f70656e5f6664730ca866645f6c696d6974cd0400a9696e626f785f66647300ad726567697374726174696f6e7391de0012ab696e7374616e63655f6964a169ad6f776e65725f73657373696f6e01a96f776e65725f70696402a96f776e65725f75696400ab636c69656e745f6e616d65a177aa6d6f64656c5f6e616d65a16daa776f726c645f73697a6501ab776f726b65725f72616e6b00aa6e756d5f6c617965727303a66e6279746573cd1000a56b696e647391a76370752d73686da76465766963657391a3637075a56167655f73cb3fd0000000000000a46b696e64a26b76a36b6579a0a66f666673657400a96465766963655f6964ffa9626c6f636b5f64696d02a4706f6f6cde0014a86361706163697479ce40000000a475736564cd1000a76f626a6563747301a9696e5f666c6967687400a670696e6e656400a66c656173657300a46869747303a66d697373657301a673746f72656401ad73746f72655f736b697070656400a96576696374696f6e7300ad657669637465645f627974657300a972657472696576656402a66661696c656400ab6d61785f6f626a6563747307ae6d657461646174615f6279746573cd0280ac70696e6e65645f627974657340aa6c656173655f70696e7305ab70696e735f63617070656401a47569647302ae70726f746f636f6c5f6d696e6f7203',
    'Pong': '83a47479706569a97365727665725f6964a173ad73657373696f6e5f6b6e6f776ec3',
    'PeekReply': '82a4747970656aa464617461c4020001',
    'StoreReply': '84a4747970656ba7726573756c747393000102a66e6279746573cd1000a56576656e74c4026576',
    'LookupReply': '84a4747970656ca46869747302a56c65617365c4106c6c6c6c6c6c6c6c6c6c6c6c6c6c6c6ca574746c5f73cb403e000000000000',
    'RetrieveReply': '84a4747970656da66368756e6b7302a66e6279746573cd2000a56576656e74c400',
    'ReleaseReply': '82a4747970656ea872656c6561736564c3',
    'ErrorReply': '83a474797065ccc7a4636f646503a76d657373616765aa6e6f2073756368206964',
}


def test_every_message_encodes_to_the_same_bytes_as_protocol_3_3():
    p = protocol
    w = CpuShmIPCWrapper(dtype="float16", shape=(2, 3), stride=(3, 1), storage_offset=0, device="cpu",
                         segment="lmshm-1-abcdef", segment_bytes=12, byte_offset=0)
    info = p.RegistrationInfo("i", 1, 2, 0, "w", "m", 1, 0, 3, 4096, ["cpu-shm"], ["cpu"], 0.25, "kv", "", 0, -1, 2)
    pool = p.PoolInfo(1 << 30, 4096, 1, 0, 0, 0, 3, 1, 1, 0, 0, 0, 2, 0, 7, 640, 64, 5, 1, 2)
    msgs = [
        p.Hello(3, False, "c", "t", 3), p.RegisterKVCache("i", "m", 2, 1, [p.LayerGroup(w, ["l0", "l1"], [0, 6])], 1),
        p.UnregisterKVCache("i"), p.Status(), p.Ping(), p.Peek("i", "l0", 8, 16),
        p.Store("i", [b"k1", b"k2"], [1, 2, 3, 4], 2, b"e" * 64), p.Lookup([[b"k1"], [b"k2"]], 1.5),
        p.Retrieve("i", [b"k1"], [5, 6], 2, b"l" * 16, b""), p.Release(b"l" * 16),
        p.HelloReply(3, "s", 1, 2, 3, 4, "tok", False, True, "/x.fds", False, 0.5, 2.0, 5.0, 1 << 20, 3),
        p.RegisterReply("i", 2, 4096, False), p.UnregisterReply("i", True),
        p.StatusReply("s", 1, 3, False, 1.5, 1, 2, 0, 12, 1024, 0, [info], pool, 3),
        p.Pong("s", True), p.PeekReply(b"\x00\x01"), p.StoreReply([0, 1, 2], 4096, b"ev"),
        p.LookupReply(2, b"l" * 16, 30.0), p.RetrieveReply(2, 8192, b""), p.ReleaseReply(True),
        p.ErrorReply(p.ErrorCode.NOT_FOUND, "no such id"),
    ]
    assert [type(m).__name__ for m in msgs] == list(WIRE_3_3)
    for m in msgs:
        data = codec.encode(m)
        if isinstance(m, p.RegisterKVCache):  # the wrapper's pickle is its own: compare the frame around it
            raw = msgspec.msgpack.decode(data, ext_hook=lambda c, b: msgspec.msgpack.Ext(c, b"WRAPPER"))
            data = msgspec.msgpack.encode(raw)
        if isinstance(m, (p.Store, p.Retrieve)):   # 3.6 added wait_s (0 here): the rest is 3.3's bytes
            raw = msgspec.msgpack.decode(data)
            assert raw.pop("wait_s") == 0.0
            if isinstance(m, p.Store):   # 3.7 added the KV-event fields (empty here)
                assert (raw.pop("adverts"), raw.pop("space"), raw.pop("pod")) == ([], b"", "")
            data = msgspec.msgpack.encode(raw)
        if isinstance(m, p.StatusReply):   # 3.5 added pool.tiers (empty here): the rest is 3.3's bytes
            raw = msgspec.msgpack.decode(data)
            assert raw["pool"].pop("tiers") == []
            for added in ("cuda_pinned_bytes", "cuda_quarantined", "cuda_events_dropped", "late"):   # 3.6
                assert raw["pool"].pop(added) == 0
            # issue 42 (no minor: pool is a map both sides read leniently): how CUDA copies are queued
            assert (raw["pool"].pop("cuda_copy_path"), raw["pool"].pop("cuda_copy_calls"),
                    raw["pool"].pop("cuda_copy_pieces")) == ("", 0, 0)
            data = msgspec.msgpack.encode(raw)
        assert data.hex() == WIRE_3_3[type(m).__name__], type(m).__name__
    # 3.4 added STATUS's optional fields and STATUS_PAGE_REPLY; every 3.3 message keeps its bytes,
    # 3.5 added pool.tiers and 3.6 pool's CUDA counters (taken out above: the rest of STATUS_REPLY
    # is 3.3's bytes); 3.6's flag tokens travel in STORE/RETRIEVE's existing event field; 3.7
    # added STORE's KV-event fields and KV_EVENTS (docs/design/kv-events.md), 3.8 Advert.tokens
    assert (p.PROTOCOL_VERSION, p.PROTOCOL_MINOR) == (3, 8)


def test_a_3_3_status_decodes_as_3_5_and_a_3_3_pool_reads_a_3_5_one():
    """Minor 5 added ``pool.tiers``: an older server's STATUS has none, and an older client's
    ``PoolInfo`` (no ``tiers`` field) ignores them."""
    p = protocol
    old = codec.decode_reply(bytes.fromhex(WIRE_3_3["StatusReply"]))
    assert old.pool.tiers == [] and old.pool.uids == 2

    class PoolInfo33(msgspec.Struct, frozen=True):
        capacity: int
        used: int
        uids: int = 0

    tier = p.TierInfo("disk", capacity=1 << 30, used=8192, objects=1, promotions=3)
    new = msgspec.structs.replace(old.pool, tiers=[tier])
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(new), type=PoolInfo33) == PoolInfo33(1 << 30, 4096, 2)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(new), type=p.PoolInfo).tiers == [tier]
