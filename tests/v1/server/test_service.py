"""lmshm-server and its clients as separate processes over real ZeroMQ sockets."""

from __future__ import annotations

import json
import os
import pickle
import signal
import stat
import subprocess
import sys

import msgspec
import pytest
import torch
from harness import Evals, RunsACommand, ServerProcess, raw_exchange, raw_reply

from lmshm.platform import ipc_policy
from lmshm.platform.cpu import empty_shared
from lmshm.server import Server
from lmshm.settings import ServerConfig, build_arg_parser, resolve_config
from lmshm.transport.client import (
    MessageTooLarge,
    MPClient,
    ServerTimeout,
    Unsupported,
    query_status,
)
from lmshm.wire import codec, protocol
from lmshm.wire.protocol import ErrorCode


def _hello(**kw) -> bytes:
    args = dict(protocol_version=protocol.PROTOCOL_VERSION, isolated_ipc=False)
    args.update(kw)
    return codec.encode(protocol.Hello(**args))


# ---- register, status, unregister ---------------------------------------------------------

def test_worker_registers_status_lists_it_and_unregister_removes_it(shared_server, start_worker):
    worker = start_worker(shared_server.url)
    reg = worker.ok("register", layers=4, shape=[2, 8, 16], layout="one", model="llama-test")
    iid = reg["instance_id"]

    status = query_status(shared_server.url)
    [row] = [r for r in status.registrations if r.instance_id == iid]
    assert (row.owner_pid, row.model_name, row.num_layers) == (worker.pid, "llama-test", 4)
    assert row.nbytes == 4 * 2 * 8 * 16 * 2 and row.kinds == ["cpu-memfd"] and row.devices == ["cpu"]  # the default

    table = subprocess.run([sys.executable, "-m", "lmshm.cli", "status", "--url", shared_server.url],
                           capture_output=True, text=True, timeout=60)
    assert table.returncode == 0, table.stderr
    assert iid in table.stdout and "OWNER PID" in table.stdout and str(worker.pid) in table.stdout
    as_json = subprocess.run([sys.executable, "-m", "lmshm.cli", "status", "--url", shared_server.url, "--json"],
                             capture_output=True, text=True, timeout=60)
    assert [r["instance_id"] for r in json.loads(as_json.stdout)["registrations"]] == [iid]

    assert worker.ok("unregister", instance_id=iid)["deferred"] is False
    status = query_status(shared_server.url)
    assert status.registrations == [] and status.mappings == 0


def test_the_server_reads_what_the_worker_writes_through_its_own_mapping(shared_server, start_worker):
    worker = start_worker(shared_server.url)
    iid = worker.ok("register", layers=2, layout="per-layer")["instance_id"]
    worker.ok("fill", instance_id=iid, layer="model.layers.1.attn", bytes=[1, 2, 3, 4, 5, 6, 7, 8])
    assert worker.ok("peek", instance_id=iid, layer="model.layers.1.attn")["bytes"] == [1, 2, 3, 4, 5, 6, 7, 8]
    worker.ok("fill", instance_id=iid, layer="model.layers.1.attn", bytes=[9, 9])
    assert worker.ok("peek", instance_id=iid, layer="model.layers.1.attn")["bytes"][:3] == [9, 9, 3]
    worker.ok("unregister", instance_id=iid)


def test_views_of_one_pool_travel_as_one_group_and_each_layer_reads_its_own_bytes(shared_server, start_worker):
    worker = start_worker(shared_server.url)
    layers = 16
    iid = worker.ok("register", layers=layers, layout="one")["instance_id"]
    status = query_status(shared_server.url)
    [row] = [r for r in status.registrations if r.instance_id == iid]
    assert row.num_layers == layers and status.mappings == 1  # one segment, mapped once
    for i in (0, 7, layers - 1):
        name = f"model.layers.{i}.attn"
        worker.ok("fill", instance_id=iid, layer=name, bytes=[i, 100 + i, 200])
        assert worker.ok("peek", instance_id=iid, layer=name)["bytes"][:3] == [i, 100 + i, 200]
    # Never written (a fresh segment is zero-filled): each layer reads its own bytes.
    assert worker.ok("peek", instance_id=iid, layer="model.layers.1.attn")["bytes"][:3] == [0, 0, 0]
    worker.ok("unregister", instance_id=iid)


def test_duplicate_id_is_already_exists_and_a_foreign_unregister_is_refused(shared_server, start_worker):
    a = start_worker(shared_server.url)
    b = start_worker(shared_server.url)
    a.ok("register", instance_id="dup", layers=2)
    reply = b.call("register", instance_id="dup", layers=2)
    assert (reply["error"], reply["code"]) == ("AlreadyExists", ErrorCode.ALREADY_EXISTS)
    assert "'dup' is already registered" in reply["message"]
    reply = a.call("register", instance_id="dup", layers=3)  # same owner, different content
    assert reply["code"] == ErrorCode.ALREADY_EXISTS
    reply = b.call("unregister", instance_id="dup")
    assert (reply["error"], reply["code"]) == ("PermissionDenied", ErrorCode.PERMISSION_DENIED)
    assert [r.instance_id for r in query_status(shared_server.url).registrations] == ["dup"]
    a.ok("unregister", instance_id="dup")


def test_unknown_id_is_not_found(shared_server, start_worker):
    worker = start_worker(shared_server.url)
    reply = worker.call("unregister", instance_id="never-registered")
    assert (reply["error"], reply["code"]) == ("NotFound", ErrorCode.NOT_FOUND)
    assert "'never-registered'" in reply["message"]


def test_one_segment_may_back_two_registrations_and_each_releases_its_own_share(shared_server, start_worker):
    worker = start_worker(shared_server.url)
    first = worker.ok("register", layers=3, layout="one")["instance_id"]
    second = worker.ok("register_same", of=first)["instance_id"]
    assert query_status(shared_server.url).mappings == 1
    worker.ok("unregister", instance_id=first)
    worker.ok("fill", instance_id=second, layer="model.layers.0.attn", bytes=[42])
    assert worker.ok("peek", instance_id=second, layer="model.layers.0.attn")["bytes"][0] == 42
    worker.ok("unregister", instance_id=second)
    assert query_status(shared_server.url).mappings == 0


# ---- hostile and malformed input ----------------------------------------------------------

@pytest.mark.parametrize("frames, match", [
    ([b"short", b"\x80"], "malformed message"),
    ([b"\x00" * 8], "malformed message"),
    ([b"\x00" * 8, codec.encode(protocol.Ping()), b"extra"], "malformed message"),
    ([b"\x00" * 8, b"\xc1\xff\x00garbage"], "undecodable"),
    ([b"\x00" * 8, msgspec.msgpack.encode({"type": 77})], "invalid message"),
])
def test_malformed_frames_get_invalid_arg_and_the_server_survives(shared_server, frames, match):
    reply_frames = raw_exchange(shared_server.url, frames)
    assert reply_frames is not None and len(reply_frames) == 2
    reply = codec.decode_reply(reply_frames[1])
    assert isinstance(reply, protocol.ErrorReply) and reply.code == ErrorCode.INVALID_ARG
    assert match in reply.message
    assert isinstance(raw_reply(shared_server.url, codec.encode(protocol.Ping())), protocol.Pong)




def test_malicious_pickles_are_refused_over_the_wire_and_run_nothing(shared_server, tmp):
    marker = tmp / "pwned"
    for payload in (pickle.dumps(RunsACommand(f"touch {marker}")),
                    pickle.dumps(Evals(f"open({str(marker)!r}, 'w')"))):
        body = msgspec.msgpack.encode({
            "type": int(protocol.MsgType.REGISTER_KV_CACHE), "instance_id": "evil", "model_name": "m",
            "world_size": 1, "worker_rank": 0, "groups": [[msgspec.msgpack.Ext(1, payload), ["l0"], [0]]]})
        reply = raw_reply(shared_server.url, body)
        assert isinstance(reply, protocol.ErrorReply) and reply.code == ErrorCode.INVALID_ARG
        assert "refusing to unpickle" in reply.message
    assert not marker.exists()
    assert shared_server.alive
    assert query_status(shared_server.url).registrations == []


def test_requests_that_need_a_session_without_hello_are_unavailable(shared_server):
    reply = raw_reply(shared_server.url, codec.encode(protocol.UnregisterKVCache("x")))
    assert reply.code == ErrorCode.UNAVAILABLE and "send HELLO" in reply.message


def test_protocol_version_mismatch_is_refused_naming_both_versions(shared_server):
    reply = raw_reply(shared_server.url, _hello(protocol_version=99))
    assert reply.code == ErrorCode.UNSUPPORTED
    assert "version 99" in reply.message and f"version {protocol.PROTOCOL_VERSION}" in reply.message


def test_isolated_mode_mismatch_is_refused_naming_both_settings(shared_server):
    ipc_policy.set_isolated_ipc(True)
    try:
        with pytest.raises(Unsupported, match=r"worker .* isolated_ipc=on, the server has isolated_ipc=off") as exc:
            MPClient(shared_server.url, heartbeat=False)
        assert exc.value.code == ErrorCode.UNSUPPORTED
    finally:
        ipc_policy.set_isolated_ipc(None)


def test_oversized_messages_are_refused_and_the_server_survives(start_server):
    server = start_server("--max-message-bytes", "4096")
    # A frame over the limit: libzmq drops that connection; the sender gets no reply.
    assert raw_exchange(server.url, [b"\x00" * 8, b"\x00" * 8192], timeout_s=1.0) is None
    # Frames under the limit that add up to more: an INVALID_ARG reply.
    frames = raw_exchange(server.url, [b"\x00" * 8, b"\x00" * 3000, b"\x00" * 3000])
    reply = codec.decode_reply(frames[1])
    assert reply.code == ErrorCode.INVALID_ARG and "exceeds the server's limit of 4096 bytes" in reply.message
    # lmshm's own client knows the limit from HELLO and refuses before sending.
    # (64 separate segments: views of one pool would travel as one compact group.)
    layers = {f"layer.{i}": empty_shared((4,), torch.float16) for i in range(64)}
    with MPClient(server.url, heartbeat=False) as client:
        with pytest.raises(MessageTooLarge, match=r"more than the server .* accepts \(4096 bytes"):
            client.register_kv_caches(layers)
        assert client.ping() > 0
    del layers
    assert server.alive


def test_a_server_that_does_not_answer_is_a_timeout_naming_the_url(tmp):
    url = f"ipc://{tmp}/nobody.ipc"
    with pytest.raises(ServerTimeout, match=f"lmshm server at {url} did not answer") as exc:
        MPClient(url, timeout_s=0.3, heartbeat=False)
    assert exc.value.url == url


def test_a_handler_exception_becomes_an_internal_error_reply(tmp, monkeypatch):
    server = Server(ServerConfig(url=f"ipc://{tmp}/s.ipc", fd_socket=str(tmp / "s.fds")))
    try:
        def broken(identity, request):
            raise RuntimeError("boom")
        monkeypatch.setitem(server.zmq._handlers, protocol.Status, broken)
        reply = server.zmq._dispatch(b"peer", codec.encode(protocol.Status()), None)
        assert reply.code == ErrorCode.INTERNAL and "RuntimeError: boom" in reply.message
    finally:
        server.shutdown()


# ---- lifecycle ------------------------------------------------------------------------

@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_releases_everything_and_exits_zero(tmp, start_worker, sig):
    ipc = tmp / "srv.ipc"
    server = ServerProcess(tmp, "--reap-timeout", "5", url=f"ipc://{ipc}")
    try:
        assert stat.S_IMODE(os.stat(ipc).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(server.fd_socket).st_mode) == 0o600
        worker = start_worker(server.url)
        worker.ok("register", layers=3)
        assert len(query_status(server.url).registrations) == 1
    finally:
        rc = server.stop(sig)
    assert rc == 0, server.log()
    assert "released 1 registration(s)" in server.log()
    assert not ipc.exists() and not os.path.exists(server.fd_socket)


def test_a_second_server_on_a_busy_endpoint_fails_clearly(shared_server, tmp):
    proc = subprocess.run([sys.executable, "-m", "lmshm.server", "--url", shared_server.url,
                           "--fd-socket", str(tmp / "other.fds")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and f"cannot listen on {shared_server.url}" in proc.stderr


def test_settings_come_from_the_command_line_then_the_environment_then_the_config_file(tmp):
    config = tmp / "server.toml"
    config.write_text('[lmshm-server]\nport = 6000\nreap_timeout = 3.5\nisolated_ipc = true\n'
                      'max_message_bytes = 65536\n')
    parse = build_arg_parser().parse_args
    c = resolve_config(parse(["--config", str(config)]), environ={})
    assert (c.url, c.reap_timeout_s, c.isolated_ipc, c.max_message_bytes) == (
        "tcp://127.0.0.1:6000", 3.5, True, 65536)
    c = resolve_config(parse(["--config", str(config)]),
                       environ={"LMSHM_ISOLATED_IPC": "0", "LMSHM_REAP_TIMEOUT": "2"})
    assert (c.isolated_ipc, c.reap_timeout_s) == (False, 2.0)
    c = resolve_config(parse(["--config", str(config), "--reap-timeout", "1", "--url", "ipc:///tmp/x"]),
                       environ={"LMSHM_REAP_TIMEOUT": "2"})
    assert (c.reap_timeout_s, c.url) == (1.0, "ipc:///tmp/x")
    c = resolve_config(parse(["--allow-uid", "7", "--allow-uid", "8", "--admin-uid", "9"]),
                       environ={"LMSHM_ALLOW_GIDS": "10, 11", "LMSHM_ISOLATED_IPC": "on"})
    assert (c.allowed_uids, c.allowed_gids, c.admin_uids, c.isolated_ipc) == ([7, 8], [10, 11], [9], True)
    config.write_text("nonsense = 1\n")
    with pytest.raises(ValueError, match="unknown key"):
        resolve_config(parse(["--config", str(config)]), environ={})


@pytest.mark.parametrize("environ,match", [
    ({"LMSHM_PORT": "abc"}, r"bad setting --port \(LMSHM_PORT, or --config key 'port'\): expected an integer, got 'abc'"),
    ({"LMSHM_REAP_TIMEOUT": "soon"}, r"--reap-timeout \(LMSHM_REAP_TIMEOUT, .*'reap_timeout'\): Expected `float`, got `str`, got 'soon'"),
    ({"LMSHM_REAP_TIMEOUT": "0"}, r"--reap-timeout .*Expected `float` > 0.0"),
    ({"LMSHM_MAX_MESSAGE_BYTES": "1e3x"}, r"--max-message-bytes .*Expected `int`"),
    ({"LMSHM_MAX_SESSIONS": "0"}, r"--max-sessions \(LMSHM_MAX_SESSIONS.*Expected `int` >= 1"),
    ({"LMSHM_ALLOW_UIDS": "1,x"}, r"--allow-uid .*Expected `int`"),
    ({"LMSHM_ISOLATED_IPC": "maybe"}, r"--isolated-ipc \(LMSHM_ISOLATED_IPC.*Expected `bool`, got `str`, got 'maybe'"),
])
def test_bad_settings_name_the_setting_and_the_value(environ, match):
    with pytest.raises(ValueError, match=match):
        resolve_config(build_arg_parser().parse_args([]), environ=environ)
