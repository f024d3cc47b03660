"""Triton's shared-memory extension, driven by stock tritonclient over HTTP and gRPC.

Every case runs against both clients (the ``client`` fixture), with one application process
that embeds ``lmshm.Server`` (``embedded_app.py``); the regions' objects are made in this
process by ``tritonclient.utils.shared_memory``.
"""

from __future__ import annotations

import base64
import os

import numpy as np
import pytest
import tritonclient.utils.shared_memory as shared_memory
from triton_harness import STATUS

import lmshm


def test_register_then_status_of_all_regions_and_of_one(client, shm):
    key_a, _ = shm(1 << 16)
    key_b, _ = shm(8192)
    client.register("b_region", key_b, 8192)
    client.register("a_region", key_a, 4096, offset=100)
    assert client.status() == [
        {"name": "a_region", "key": key_a, "offset": 100, "byte_size": 4096},
        {"name": "b_region", "key": key_b, "offset": 0, "byte_size": 8192},
    ]
    assert client.status("b_region") == [{"name": "b_region", "key": key_b, "offset": 0, "byte_size": 8192}]
    assert client.cuda_status() == []


def test_two_regions_in_one_object_at_different_offsets_see_their_own_bytes(client, shm, app):
    key, handle = shm(3 * 4096)
    shared_memory.set_shared_memory_region(handle, [np.full(4096, 0x11, np.uint8)], offset=0)
    shared_memory.set_shared_memory_region(handle, [np.full(4096, 0x22, np.uint8)], offset=8192)
    client.register("lo", key, 4096, offset=0)
    client.register("hi", key, 4096, offset=8192)
    lo, hi = app.ok("view", name="lo")["view"], app.ok("view", name="hi")["view"]
    try:
        assert app.ok("read", view=lo)["hex"] == "11" * 4096
        assert app.ok("read", view=hi)["hex"] == "22" * 4096
    finally:
        app.ok("close", view=lo)
        app.ok("close", view=hi)


def test_a_duplicate_name_is_already_exists_whatever_its_kind(client, shm, app):
    key, _ = shm()
    client.register("dup", key, 1024)
    status, message = client.error(client.register, "dup", key, 1024, offset=1024)
    assert status == STATUS["ALREADY_EXISTS"][client.protocol]
    assert "'dup' is already registered, as a system shared memory region" in message
    # A CUDA region of that name: the duplicate check comes before the handle is opened.
    # (Both clients take the handle base64-encoded, as cuda_shared_memory.get_raw_handle gives it.)
    status, message = client.error(client.register_cuda, "dup", base64.b64encode(b"\x01" * 64), 0, 1024)
    assert status == STATUS["ALREADY_EXISTS"][client.protocol] and "system shared memory region" in message
    assert client.status() == [{"name": "dup", "key": key, "offset": 0, "byte_size": 1024}]


def test_names_are_shared_with_lmshm_kv_registrations(client, shm, app):
    key, _ = shm()
    pool = lmshm.empty_shared((2, 64), dtype=__import__("torch").float16)
    with lmshm.MPClient(app.url, heartbeat=False) as worker:
        worker.register_kv_caches({"l0": pool[0], "l1": pool[1]}, model_name="m", world_size=1, rank=0,
                                  instance_id="kv-instance")
        try:
            status, message = client.error(client.register, "kv-instance", key, 1024)
            assert status == STATUS["ALREADY_EXISTS"][client.protocol] and "KV-cache registration" in message
            # Status and unregister of the system kind do not see or touch it.
            status, message = client.error(client.status, "kv-instance")
            assert status == STATUS["NOT_FOUND"][client.protocol]
            assert "is a KV-cache registration, not a system shared memory region" in message
            client.unregister("kv-instance")
            client.unregister()
            assert ["kv-instance", "kv"] in app.ok("status")["registrations"]
            # And the other way round: a worker cannot take a region's name.
            client.register("region-name", key, 1024)
            with pytest.raises(lmshm.ServerError, match="already registered, as a system shared memory region"):
                worker.register_kv_caches({"l0": pool[0]}, model_name="m", world_size=1, rank=0,
                                          instance_id="region-name")
        finally:
            worker.unregister_kv_caches("kv-instance")
    del pool


@pytest.mark.parametrize("offset, byte_size, needle", [
    (0, (1 << 16) + 1, "runs past the end"),
    (60000, 8192, "runs past the end"),
    ((1 << 16), 1, "runs past the end"),
    ((1 << 63) - 1, 16, "overflows a 64-bit file offset"),
    ((1 << 64) - 1, 16, "out of range"),
    (0, 0, "byte_size 0 is out of range"),
])
def test_an_offset_or_size_past_the_end_or_overflowing_is_invalid(client, shm, offset, byte_size, needle):
    key, _ = shm(1 << 16)
    status, message = client.error(client.register, "big", key, byte_size, offset=offset)
    assert status == STATUS["INVALID_ARG"][client.protocol] and needle in message, message
    assert client.status() == []


def test_a_missing_object_is_not_found(client):
    status, message = client.error(client.register, "gone", "/lmshm_test_no_such_object", 16)
    assert status == STATUS["NOT_FOUND"][client.protocol]
    assert "unable to open shared memory object '/lmshm_test_no_such_object'" in message


@pytest.mark.parametrize("key, needle", [
    ("/lmshm-1-2-0123456789abcdef", "one of lmshm's own segments"),
    ("/", "is not a POSIX shared-memory name"),
    ("/a/b", "is not a POSIX shared-memory name"),
    ("/..", "is not a POSIX shared-memory name"),
])
def test_bad_and_reserved_keys_are_refused_before_the_duplicate_check(client, shm, key, needle):
    good, _ = shm()
    client.register("taken", good, 16)
    status, message = client.error(client.register, "taken", key, 16)  # the name is taken too
    assert status == STATUS["INVALID_ARG"][client.protocol] and needle in message, message


def test_a_reserved_region_name_is_refused(client, shm):
    key, _ = shm()
    status, message = client.error(client.register, "__lmshm_internal", key, 16)
    assert status == STATUS["INVALID_ARG"][client.protocol] and "reserved for the server" in message


def test_status_of_an_unknown_name_or_of_the_other_kind_is_not_found(client, shm):
    key, _ = shm()
    status, message = client.error(client.status, "nobody")
    assert status == STATUS["NOT_FOUND"][client.protocol]
    assert "no system shared memory region named 'nobody'" in message
    client.register("sys", key, 16)
    status, message = client.error(client.cuda_status, "sys")
    assert status == STATUS["NOT_FOUND"][client.protocol]
    assert "'sys' is a system shared memory region, not a CUDA shared memory region" in message


def test_unregister_of_an_unknown_name_succeeds_and_unregister_all_covers_its_kind(client, shm):
    key, _ = shm()
    client.unregister("never-registered")
    client.unregister_cuda("never-registered")
    client.register("one", key, 16)
    client.register("two", key, 16, offset=16)
    client.unregister_cuda()              # the CUDA kind's unregister-all leaves system regions
    client.unregister_cuda("one")         # so does a CUDA unregister of a system region's name
    assert [r["name"] for r in client.status()] == ["one", "two"]
    client.unregister()
    assert client.status() == []
    assert os.path.exists(f"/dev/shm/{key.lstrip('/')}")  # the server never unlinks the client's object


def test_unregister_while_a_view_is_open_is_deferred_then_released(client, shm, app):
    key, handle = shm(8192)
    client.register("busy", key, 8192)
    before = app.ok("status")
    view = app.ok("view", name="busy", offset=4096, byte_size=16)["view"]
    client.unregister("busy")
    assert client.status() == []
    during = app.ok("status")
    assert during["draining"] == 1 and during["mappings"] == before["mappings"]
    # The memory is still mapped and still the client's: a write through it is read there.
    app.ok("write", view=view, hex="5a" * 16)
    assert bytes(shared_memory.get_contents_as_numpy(handle, np.uint8, [16], offset=4096)) == b"\x5a" * 16
    client.register("busy", key, 4096)   # the name is free at once: re-register works
    client.unregister("busy")
    app.ok("close", view=view)
    after = app.ok("status")
    assert after["draining"] == 0 and after["mappings"] == before["mappings"] - 1


def test_re_register_after_unregister(client, shm):
    key_a, _ = shm()
    key_b, _ = shm()
    for key in (key_a, key_b, key_a):
        client.register("again", key, 64)
        assert client.status("again") == [{"name": "again", "key": key, "offset": 0, "byte_size": 64}]
        client.unregister("again")
    assert client.status() == []


def test_the_server_closes_the_objects_fd_on_every_path(client, shm, app):
    key, _ = shm(8192)
    client.status()  # the client's connection is open before the count
    base = app.fd_count()
    client.register("ok", key, 4096)
    client.error(client.register, "past", key, 8193)
    client.error(client.register, "ok", key, 16)
    client.error(client.register, "missing", "/lmshm_test_missing", 16)
    assert app.fd_count() <= base  # fewer: an earlier client's connection may close meanwhile
    client.unregister("ok")
    assert app.fd_count() <= base  # fewer: an earlier client's connection may close meanwhile
    assert not [fd for fd in os.listdir(f"/proc/{app.pid}/fd")
                if "lmshm_test" in os.readlink(f"/proc/{app.pid}/fd/{fd}")]


def test_bytes_cross_between_the_client_shm_and_the_server_view_both_ways(client, shm, app):
    key, handle = shm(1 << 16)
    payload = np.arange(1024, dtype=np.uint8)
    shared_memory.set_shared_memory_region(handle, [payload], offset=512)
    client.register("xfer", key, 4096, offset=512)
    view = app.ok("view", name="xfer", offset=0, byte_size=1024)["view"]
    try:
        assert bytes.fromhex(app.ok("read", view=view)["hex"]) == payload.tobytes()
        app.ok("write", view=view, hex="c3" * 8, at=100)
        got = shared_memory.get_contents_as_numpy(handle, np.uint8, [8], offset=512 + 100)
        assert bytes(got) == b"\xc3" * 8
    finally:
        app.ok("close", view=view)


def test_views_are_bounds_and_overflow_checked(client, shm, app):
    key, _ = shm()
    client.register("bounded", key, 1024)
    for offset, size in ((1000, 25), (1025, 0), ((1 << 63) - 1, 2), (-1, 4)):
        reply = app.call("view", name="bounded", offset=offset, byte_size=size)
        assert not reply["ok"] and reply["code"] == "INVALID_ARG", reply
    assert app.call("view", name="nothing")["code"] == "NOT_FOUND"
    assert app.ok("status")["draining"] == 0


@pytest.fixture
def foreign_object():
    """A shm object owned by another uid (needs root to chown); removed at teardown."""
    if os.geteuid() != 0:
        pytest.skip("making an object of another uid needs root")
    path = f"/dev/shm/lmshm_test_foreign_{os.getpid()}"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o666)
    os.ftruncate(fd, 8192)
    os.fchown(fd, 54321, 54321)
    os.close(fd)
    yield "/" + os.path.basename(path)
    os.unlink(path)


def test_an_object_of_another_uid_is_refused_unless_that_uid_is_allowed(client, app, foreign_object):
    client.status()                     # the client connected (gRPC opens its channel lazily)
    base = app.fd_count()
    status, message = client.error(client.register, "foreign", foreign_object, 4096)
    assert status == STATUS["PERMISSION_DENIED"][client.protocol]
    assert "belongs to uid 54321" in message and "--allow-uid" in message
    assert client.status() == []
    import time
    deadline = time.monotonic() + 5     # a connection grpcio is still closing may count a moment
    while app.fd_count() > base + 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert app.fd_count() <= base + 1   # +1: a connection of the client's
    from triton_harness import EmbeddedApp, Triton

    allowing = EmbeddedApp(allowed_uids=[54321])
    c = Triton(client.protocol, allowing)
    try:
        c.register("foreign", foreign_object, 4096)
        assert [r["name"] for r in c.status()] == ["foreign"]
        c.unregister()
    finally:
        c.close()
        assert allowing.stop() == 0
