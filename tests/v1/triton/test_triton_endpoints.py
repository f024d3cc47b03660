"""The HTTP and gRPC endpoints themselves: health, metadata, errors of the transport (routes,
methods, sizes, JSON), the restricted API, metrics, the wire schema, versions, and
``lmshm-server --http-port/--grpc-port`` as a user runs it."""

from __future__ import annotations

import base64
import http.client
import json
import re
import signal
import subprocess
import sys

import grpc
import pytest
from triton_harness import STATUS, EmbeddedApp, Triton

import lmshm
from lmshm.endpoints import triton_proto


def _http(app: EmbeddedApp, method: str, path: str, body: bytes | None = None,
          headers: dict | None = None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", app.http_port, timeout=10)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def _error_of(body: bytes) -> str:
    data = json.loads(body)
    assert set(data) == {"error"}, data
    return data["error"]


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_health_and_metadata(app, protocol):
    c = Triton(protocol, app)
    try:
        assert c.client.is_server_live() and c.client.is_server_ready()
        meta = c.client.get_server_metadata(**({"as_json": True} if protocol == "grpc" else {}))
        assert meta["name"] == "lmshm" and meta["version"] == lmshm.__version__
        assert {"system_shared_memory", "cuda_shared_memory"} <= set(meta["extensions"])
    finally:
        c.close()


def test_http_errors_are_triton_json_bodies_with_its_status_codes(app, shm):
    key, _ = shm()
    assert _http(app, "GET", "/v2/health/live") == (200, b"")
    status, body = _http(app, "GET", "/v2/nothing/here")
    assert status == 404 and "no route '/v2/nothing/here'" in _error_of(body)
    status, body = _http(app, "GET", "/v2/systemsharedmemory/region/x/register")
    assert status == 405 and "use POST" in _error_of(body)
    status, body = _http(app, "DELETE", "/v2/systemsharedmemory/status")
    assert status == 405
    route = "/v2/systemsharedmemory/region/r/register"
    for payload, needle in (
        (b"{not json", "not valid JSON"),
        (b"[1, 2]", "must be a JSON object"),
        (json.dumps({"key": key, "byte_size": "16"}).encode(), "'byte_size' must be an integer, got str"),
        (json.dumps({"key": key, "byte_size": 16, "offset": 1.5}).encode(), "'offset' must be an integer"),
        (json.dumps({"key": key, "byte_size": True}).encode(), "'byte_size' must be an integer, got bool"),
        (json.dumps({"key": 7, "byte_size": 16}).encode(), "'key' must be a string"),
        (json.dumps({"byte_size": 16}).encode(), "no 'key'"),
        (json.dumps({"key": key}).encode(), "no 'byte_size'"),
        (b"", "no 'key'"),
    ):
        status, body = _http(app, "POST", route, payload, {"Content-Type": "application/json"})
        assert status == 400 and needle in _error_of(body), (payload, body)
    cuda = "/v2/cudasharedmemory/region/c/register"
    for payload, needle in (
        ({"raw_handle": "AAAA", "device_id": 0, "byte_size": 16}, "'raw_handle' must be a JSON object"),
        ({"raw_handle": {"b64": "!!"}, "device_id": 0, "byte_size": 16}, "not valid base64"),
        ({"raw_handle": {"b64": base64.b64encode(b"x" * 8).decode()}, "device_id": 0, "byte_size": 16},
         "must be a 64-byte cudaIpcMemHandle_t, got 8"),
    ):
        status, body = _http(app, "POST", cuda, json.dumps(payload).encode())
        assert status == 400 and needle in _error_of(body), (payload, body)
    status, body = _http(app, "GET", "/v2/systemsharedmemory/status")
    assert status == 200 and json.loads(body) == []


def test_a_body_over_the_limit_is_a_clear_400(app, shm):
    key, _ = shm()
    big = json.dumps({"key": key, "byte_size": 16, "pad": "x" * (70 << 10)}).encode()
    status, body = _http(app, "POST", "/v2/systemsharedmemory/region/big/register", big)
    assert status == 400 and "larger than 65536 bytes (lmshm-server --http-max-body-bytes)" in _error_of(body)
    status, body = _http(app, "GET", "/v2/systemsharedmemory/status")
    assert json.loads(body) == []


def test_a_cuda_region_without_a_gpu_in_the_server_is_refused_clearly(app):
    pytest.importorskip("tritonclient")
    import torch

    if torch.cuda.is_available():
        pytest.skip("this server has a GPU: tests/v1/triton/test_triton_cuda_gpu.py covers it")
    for protocol in ("http", "grpc"):
        c = Triton(protocol, app)
        try:
            status, message = c.error(c.register_cuda, "c0", base64.b64encode(b"\x07" * 64), 0, 1024)
            assert status == STATUS["UNAVAILABLE"][protocol] and "cannot open CUDA device 0" in message
            assert c.cuda_status() == []
        finally:
            c.close()


def test_grpc_answers_unimplemented_for_every_other_rpc_and_limits_message_size(app):
    c = Triton("grpc", app)
    try:
        status, message = c.error(c.client.get_model_metadata, "some-model")
        assert status == "UNIMPLEMENTED"
        status, message = c.error(c.client.get_inference_statistics)
        assert status == "UNIMPLEMENTED"
        status, message = c.error(c.register, "n" * 100, "/k" + "x" * (70 << 10), 16)
        assert status == "RESOURCE_EXHAUSTED"
    finally:
        c.close()


def test_the_grpc_schema_matches_tritonclients_field_for_field():
    from tritonclient.grpc import service_pb2

    def fields(desc):
        return {f.name: (f.number, f.type, f.is_repeated, f.message_type.name if f.message_type else "")
                for f in desc.fields}

    ours_service = triton_proto.SERVICE.split(".")[-1]
    theirs = service_pb2.DESCRIPTOR.services_by_name[ours_service]
    for rpc, (req, resp) in triton_proto.RPCS.items():
        method = theirs.methods_by_name[rpc]
        assert (method.input_type.name, method.output_type.name) == (req, resp)
    for name, cls in triton_proto.CLASSES.items():
        mine, real = cls.DESCRIPTOR, service_pb2.DESCRIPTOR.message_types_by_name[name]
        assert mine.full_name == real.full_name and fields(mine) == fields(real), name
        for nested in real.nested_types:
            assert fields(mine.nested_types_by_name[nested.name]) == fields(nested), (name, nested.name)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_the_restricted_api_guards_the_shared_memory_operations_only(shm, protocol):
    app = EmbeddedApp(http_restricted_api="shared-memory:admin-key=s3cret", grpc_restricted_api="admin-key=s3cret")
    key, _ = shm()
    header = "admin-key" if protocol == "http" else "triton-grpc-protocol-admin-key"
    try:
        for headers in (None, {header: "wrong"}, {"other": "s3cret"}):
            c = Triton(protocol, app, headers=headers)
            try:
                assert c.client.is_server_live()
                status, message = c.error(c.register, "r", key, 16)
                if protocol == "http":
                    assert status == "403" and message == "This API is restricted, expecting header 'admin-key'"
                else:
                    assert status == "UNAVAILABLE"
                    assert message == f"This protocol is restricted, expecting header '{header}'"
                assert c.error(c.status)[0] == status
            finally:
                c.close()
        c = Triton(protocol, app, headers={header: "s3cret"})
        try:
            c.register("r", key, 16)
            assert [r["name"] for r in c.status()] == ["r"]
            c.unregister()
        finally:
            c.close()
    finally:
        assert app.stop() == 0


def test_metrics_cover_requests_registrations_mappings_reclaims_and_the_pool(app, shm):
    key, _ = shm()
    c = Triton("http", app)
    try:
        c.register("m0", key, 4096)
        c.register("m1", key, 4096, offset=4096)
        c.error(c.register, "m0", key, 16)
        status, body = _http(app, "GET", "/metrics")
        text = body.decode()
        assert status == 200
        for line in ('lmshm_registrations{kind="system"} 2.0', 'lmshm_registered_bytes{kind="system"} 8192.0',
                     'lmshm_requests_total{code="OK",endpoint="http",request="SystemSharedMemoryRegister"}',
                     'lmshm_requests_total{code="ALREADY_EXISTS",endpoint="http",request="SystemSharedMemoryRegister"} 1.0',
                     'lmshm_request_seconds_bucket{endpoint="http",le=', 'lmshm_pool_capacity 0.0',
                     'lmshm_pool_hits_total 0.0', 'lmshm_reclaim_seconds_count', 'lmshm_sessions ',
                     'lmshm_zmq_unverified_bytes 0.0', 'lmshm_zmq_over_budget_closed 0.0',
                     'lmshm_zmq_replies_dropped 0.0'):
            assert line in text, line
        assert re.search(r'lmshm_mappings\{kind="system-region"\} [12]\.0', text)
        c.unregister()
        # A worker that dies is reclaimed, and counted.
        worker = subprocess.Popen([sys.executable, "-c", (
            "import lmshm, torch, os, sys\n"
            f"c = lmshm.MPClient({app.url!r}, heartbeat=False)\n"
            "p = lmshm.empty_shared((1, 64), torch.float16)\n"
            "c.register_kv_caches({'l0': p[0]}, model_name='m', world_size=1, rank=0, instance_id='dies')\n"
            "print('ok', flush=True); os.kill(os.getpid(), 9)\n")], stdout=subprocess.PIPE, text=True)
        assert worker.stdout.readline().strip() == "ok"
        worker.wait(30)
        worker.stdout.close()
        deadline = __import__("time").monotonic() + 10
        while "dies" in json.dumps(app.ok("status")["registrations"]):
            assert __import__("time").monotonic() < deadline
        text = _http(app, "GET", "/metrics")[1].decode()
        assert 'lmshm_reclaims_total{reason="worker exited"} 1.0' in text
        assert 'lmshm_requests_total{code="OK",endpoint="zmq",request="RegisterKVCache"}' in text
    finally:
        c.close()


def test_api_versions_newer_minor_or_other_major_are_refused():
    assert lmshm.API_VERSION == lmshm.Server.API_VERSION and len(lmshm.API_VERSION) == 2
    major, minor = lmshm.API_VERSION
    lmshm.check_api_version((major, 0))
    lmshm.check_api_version((major, minor))
    with pytest.raises(lmshm.ServerError, match=rf"needs lmshm API {major}\.{minor + 1}.*upgrade lmshm") as exc:
        lmshm.Server(api_version=(major, minor + 1))
    assert exc.value.code == lmshm.ErrorCode.UNSUPPORTED
    with pytest.raises(lmshm.ServerError, match="another major version"):
        lmshm.check_api_version((major + 1, 0))
    with pytest.raises(lmshm.ServerError, match=r"must be \(major, minor\)"):
        lmshm.check_api_version("1.0")


def test_hello_of_a_newer_minor_or_another_major_is_refused_naming_both(app):
    import msgspec
    import zmq

    from lmshm.wire import codec, protocol

    ctx = zmq.Context.instance()
    for extra, needle in (
        ({"protocol_version": protocol.PROTOCOL_VERSION, "protocol_minor": protocol.PROTOCOL_MINOR + 1},
         "newer than this lmshm-server's"),
        ({"protocol_version": protocol.PROTOCOL_VERSION, "protocol_minor": protocol.PROTOCOL_MINOR + 1,
          "a_field_of_the_future": 1}, "upgrade lmshm-server"),
        ({"protocol_version": protocol.PROTOCOL_VERSION + 1}, "another major version"),
    ):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(app.url)
        try:
            body = msgspec.msgpack.encode({"type": int(protocol.MsgType.HELLO), "isolated_ipc": False, **extra})
            sock.send_multipart([b"\x00" * 7 + b"\x01", body])
            assert sock.poll(5000)
            reply = codec.decode_reply(sock.recv_multipart()[1])
        finally:
            sock.close()
        assert reply.code == lmshm.ErrorCode.UNSUPPORTED and needle in reply.message, reply
        assert f"{protocol.PROTOCOL_VERSION}.{protocol.PROTOCOL_MINOR}" in reply.message


def test_lmshm_server_serves_both_endpoints_shows_regions_in_status_and_releases_them_on_sigterm(tmp_path, shm):
    key, _ = shm()
    proc = subprocess.Popen([sys.executable, "-m", "lmshm.server", "--url", f"ipc://{tmp_path}/s.ipc",
                             "--fd-socket", str(tmp_path / "s.fds"), "--http-port", "0", "--grpc-port", "0",
                             "--capacity", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        m = re.search(r"HTTP on 127\.0\.0\.1:(\d+), gRPC on 127\.0\.0\.1:(\d+)", line)
        assert m, line
        import tritonclient.grpc as grpcclient
        import tritonclient.http as httpclient

        h = httpclient.InferenceServerClient(f"127.0.0.1:{m.group(1)}")
        g = grpcclient.InferenceServerClient(f"127.0.0.1:{m.group(2)}")
        h.register_system_shared_memory("via-http", key, 1024)
        g.register_system_shared_memory("via-grpc", key, 1024, offset=1024)
        out = subprocess.run([sys.executable, "-m", "lmshm.cli", "status", "--url", f"ipc://{tmp_path}/s.ipc"],
                             capture_output=True, text=True, timeout=60).stdout
        assert re.search(rf"via-http\s+-\s+{re.escape(key)} \+0\s.*system region \(http\)", out), out
        assert re.search(rf"via-grpc\s+-\s+{re.escape(key)} \+1024\s.*system region \(grpc\)", out), out
        h.close()
        g.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(30)
        err = proc.stderr.read()
        proc.stdout.close()
        proc.stderr.close()
    assert rc == 0, err
    assert "released 2 registration(s)" in err, err


def test_the_endpoints_are_off_by_default_and_a_busy_port_fails_clearly(tmp_path, app):
    help_text = subprocess.run([sys.executable, "-m", "lmshm.server", "--help"], capture_output=True,
                               text=True, timeout=60).stdout
    for flag in ("--http-port", "--http-host", "--grpc-port", "--grpc-host", "--http-restricted-api",
                 "--grpc-restricted-api", "--http-max-body-bytes", "--grpc-max-message-bytes"):
        assert flag in help_text
    assert lmshm.ServerConfig().http_port is None and lmshm.ServerConfig().grpc_port is None
    assert lmshm.ServerConfig().http_host == "127.0.0.1" == lmshm.ServerConfig().grpc_host
    for flag, port in (("--http-port", app.http_port), ("--grpc-port", app.grpc_port)):
        proc = subprocess.run([sys.executable, "-m", "lmshm.server", "--url", f"ipc://{tmp_path}/b.ipc",
                               "--fd-socket", str(tmp_path / "b.fds"), flag, str(port), "--capacity", "0"],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 1 and f"127.0.0.1:{port}" in proc.stderr, proc.stderr
        assert not (tmp_path / "b.ipc").exists() and not (tmp_path / "b.fds").exists()


def test_a_bad_restricted_api_setting_is_a_clear_error(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "lmshm.server", "--http-restricted-api", "inference:k=v"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "restricts only the 'shared-memory' API" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "lmshm.server", "--grpc-restricted-api", "novalue"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "expected HEADER=VALUE" in proc.stderr


def test_grpc_status_codes_follow_tritons_mapping():
    from lmshm.endpoints.triton import GRPC_STATUS, HTTP_STATUS

    assert HTTP_STATUS[lmshm.ErrorCode.ALREADY_EXISTS] == 400 and HTTP_STATUS[lmshm.ErrorCode.UNSUPPORTED] == 501
    assert GRPC_STATUS[lmshm.ErrorCode.UNSUPPORTED] == grpc.StatusCode.UNIMPLEMENTED
    assert set(HTTP_STATUS) == set(GRPC_STATUS) == set(lmshm.ErrorCode)


def test_the_in_process_api_views_a_workers_kv_layer_and_defers_its_unregister(app):
    import torch

    pool = lmshm.empty_shared((2, 64), torch.float16)
    pool[1].fill_(1.5)
    with lmshm.MPClient(app.url, heartbeat=False) as worker:
        worker.register_kv_caches({"l0": pool[0], "l1": pool[1]}, model_name="m", world_size=1, rank=0,
                                  instance_id="kv-viewed")
        view = app.ok("layer_view", instance_id="kv-viewed", layer="l1")
        assert view["bytes"] == 128
        assert bytes.fromhex(app.ok("read", view=view["view"], n=4)["hex"]) == pool[1][:2].numpy().tobytes()
        app.ok("write", view=view["view"], hex="0040", at=0)        # 2.0 in float16, written by the app
        assert pool[1][0].item() == 2.0
        assert app.call("layer_view", instance_id="kv-viewed", layer="nope")["code"] == "NOT_FOUND"
        assert app.ok("unregister", instance_id="kv-viewed")["deferred"] is True
        assert app.ok("status")["draining"] == 1
        app.ok("close", view=view["view"])
        assert app.ok("status")["draining"] == 0
        assert app.call("unregister", instance_id="kv-viewed")["code"] == "NOT_FOUND"
    del pool


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_regions_are_bounded_by_max_regions(shm, protocol):
    app = EmbeddedApp(max_regions=3)
    key, _ = shm()
    c = Triton(protocol, app)
    try:
        for i in range(3):
            c.register(f"r{i}", key, 16, offset=16 * i)
        status, message = c.error(c.register, "r3", key, 16)
        assert status == STATUS["UNAVAILABLE"][protocol] and "its limit (lmshm-server --max-regions)" in message
        c.unregister("r0")
        c.register("r3", key, 16)
        assert [r["name"] for r in c.status()] == ["r1", "r2", "r3"]
        c.unregister()
    finally:
        c.close()
        assert app.stop() == 0


def test_a_flood_of_http_connections_is_capped_and_the_server_answers_after_it():
    import socket
    import time

    app = EmbeddedApp(http_max_connections=8)
    socks = []
    try:
        base = app.fd_count()
        for _ in range(40):
            s = socket.create_connection(("127.0.0.1", app.http_port), timeout=5)
            socks.append(s)
        # the cap's connections give way in turns (GIVE_WAY_AFTER_S), the ones closed let their
        # fds go on the loop's next turn: once the backlog has been through, the server holds the
        # cap (a busy machine may catch it mid-turn with those closing too, so it is polled)
        time.sleep(0.5)
        deadline, seen = time.monotonic() + 10, []
        while time.monotonic() < deadline:
            seen.append(app.fd_count())
            if seen[-1] <= base + 8 + 2:
                break
            time.sleep(0.1)
        assert seen[-1] <= base + 8 + 2, (base, seen)
        refused = 0
        for s in socks:
            s.settimeout(0.2)
            try:
                refused += s.recv(1) == b""
            except (ConnectionResetError, TimeoutError, socket.timeout):
                refused += not isinstance(__import__("sys").exc_info()[1], (TimeoutError, socket.timeout))
        assert refused >= 30, refused
        for s in socks:
            s.close()
        socks.clear()
        deadline = time.monotonic() + 10
        while app.fd_count() > base and time.monotonic() < deadline:
            time.sleep(0.05)
        assert app.fd_count() <= base
        assert _http(app, "GET", "/v2/health/ready") == (200, b"")
    finally:
        for s in socks:
            s.close()
        assert app.stop() == 0


def test_garbage_on_either_port_is_answered_and_the_server_goes_on(app, shm):
    import socket

    for junk in (b"\x00\xff\x10 not http at all\r\n\r\n", b"GET /" + b"a" * 20000 + b" HTTP/1.1\r\n\r\n",
                 b"POST /v2/systemsharedmemory/region/x/register HTTP/1.1\r\nContent-Length: -5\r\n\r\n",
                 b"GET /v2 HTTP/1.1\r\n" + b"X-H: v\r\n" * 5000 + b"\r\n"):
        with socket.create_connection(("127.0.0.1", app.http_port), timeout=5) as s:
            s.sendall(junk)
            try:
                answer = s.recv(200)
            except ConnectionResetError:
                answer = b""
        assert answer == b"" or re.match(rb"HTTP/1\.[01] 4\d\d ", answer), answer  # aiohttp refuses it
    channel = grpc.insecure_channel(app.grpc_url)
    try:
        for rpc in ("SystemSharedMemoryRegister", "CudaSharedMemoryRegister", "SystemSharedMemoryStatus"):
            call = channel.unary_unary(f"/inference.GRPCInferenceService/{rpc}")
            for junk in (b"\xff" * 64, b"\x0a\xff\xff\xff\xff\x0f", b"\x08" + b"\x80" * 20):
                with pytest.raises(grpc.RpcError) as exc:
                    call(junk, timeout=10)
                assert exc.value.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.INVALID_ARGUMENT), exc.value
    finally:
        channel.close()
    key, _ = shm()
    for protocol in ("http", "grpc"):
        c = Triton(protocol, app)
        try:
            for bad_name in ("a\x00b", "tab\there", "\u200bzero-width", "x" * 300):
                assert c.error(c.register, bad_name, key, 16)[0] in (STATUS["INVALID_ARG"][protocol], "404")
            c.register("honest", key, 16)
            assert [r["name"] for r in c.status()] == ["honest"]
            c.unregister()
        finally:
            c.close()
