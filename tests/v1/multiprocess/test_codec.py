"""The wire codec: every message round-trips; hostile bytes are refused and run nothing."""

from __future__ import annotations

import pickle
import subprocess
import sys

import msgspec
import pytest
import torch

from lmshm.multiprocess import codec, protocol
from lmshm.multiprocess.codec import CodecError
from lmshm.platform.cpu import CpuFdIPCWrapper, CpuShmIPCWrapper

from harness import Evals, RunsACommand


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
    modules = ["lmshm.multiprocess.protocol", "lmshm.multiprocess.codec", "lmshm.multiprocess.client",
               "lmshm.multiprocess.mq", "lmshm.multiprocess.fdchannel", "lmshm.cli"]
    code = (f"import sys\nfor m in {modules!r}: __import__(m)\n"
            "from lmshm.multiprocess import codec, protocol\n"
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
