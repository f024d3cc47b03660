"""STATUS and ``lmshm status`` with many registrations: a bounded page, the total, a line per
owner; ``--all`` pages through; 3.3 clients and 3.3 servers still understand each other.
(The cost at 10,000 registrations is measured by bench/scaling.py, not timed here.)"""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import msgspec
import pytest
from harness import raw_exchange, raw_reply

from lmshm.transport.client import InvalidArgument, query_status
from lmshm.wire import codec, protocol
from lmshm.wire.protocol import ErrorCode

MANY = 1010           # more than one page (protocol.STATUS_PAGE)


@pytest.fixture(scope="module")
def crowded(tmp_path_factory):
    """A server where worker A holds MANY registrations and worker B 3, A's first."""
    from harness import ServerProcess, WorkerProcess

    server = ServerProcess(tmp_path_factory.mktemp("crowded"), "--max-registrations-per-session", str(MANY + 10))
    a = WorkerProcess(server.url, "--name", "worker-a")
    b = WorkerProcess(server.url, "--name", "worker-b")
    try:
        assert a.ok("register_many", prefix="a-", count=MANY, timeout_s=120)["count"] == MANY
        b.ok("register_many", prefix="b-", count=3)
        yield server, a, b
    finally:
        for w in (a, b):
            w.exit()
        assert server.stop() == 0, server.log()


def _cli(url: str, *args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "lmshm.cli", "status", "--url", url, *args],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_a_status_reply_lists_one_bounded_page_with_the_total_and_a_line_per_owner(crowded):
    server, a, b = crowded
    status = query_status(server.url)
    assert isinstance(status, protocol.StatusPageReply)
    assert len(status.registrations) == protocol.STATUS_PAGE and status.registrations_total == MANY + 3
    assert status.registrations[0].instance_id == "a-00000" and status.offset == 0      # oldest first
    owners = {o.owner_pid: o for o in status.owners}
    assert owners[a.pid].registrations == MANY and owners[b.pid].registrations == 3
    assert (owners[b.pid].client_name, owners[b.pid].layers, owners[b.pid].kind) == ("worker-b", 3, "kv")
    assert owners[b.pid].nbytes == 3 * 64 * 2

    page = query_status(server.url, offset=MANY - 2, limit=10)
    assert [r.instance_id for r in page.registrations] == [f"a-{MANY - 2:05d}", f"a-{MANY - 1:05d}", "b-00000",
                                                           "b-00001", "b-00002"]
    assert page.offset == MANY - 2 and page.registrations_total == MANY + 3

    every = query_status(server.url, limit=None)                                         # two requests
    assert len({r.instance_id for r in every.registrations}) == len(every.registrations) == MANY + 3


def test_a_page_larger_than_the_bound_is_refused_and_a_full_page_stays_small(crowded):
    server, _, _ = crowded
    refused = raw_reply(server.url, codec.encode(protocol.Status(0, protocol.STATUS_PAGE + 1, protocol.PROTOCOL_MINOR)))
    assert isinstance(refused, protocol.ErrorReply) and refused.code == ErrorCode.INVALID_ARG
    frames = raw_exchange(server.url, [b"\x00" * 7 + b"\x02", codec.encode(protocol.Status(minor=4))])
    assert frames is not None and len(frames[1]) < protocol.STATUS_PAGE * 400, len(frames[1])


def test_a_3_3_client_gets_the_first_page_in_the_shape_it_decodes(crowded):
    server, _, _ = crowded
    body = codec.encode(protocol.Status())
    assert msgspec.msgpack.decode(body) == {"type": int(protocol.MsgType.STATUS)}     # the same bytes as 3.3's
    frames = raw_exchange(server.url, [b"\x00" * 7 + b"\x03", body])
    assert frames is not None
    reply = msgspec.msgpack.decode(frames[1])
    assert reply["type"] == protocol.MsgType.STATUS_REPLY                              # 3.3 refuses unknown fields
    assert not {"registrations_total", "offset", "owners"} & set(reply)
    assert len(reply["registrations"]) == protocol.STATUS_PAGE


def test_lmshm_status_prints_a_page_and_who_holds_the_rest_and_all_of_them_with_all(crowded):
    server, a, b = crowded
    table = _cli(server.url)
    assert f"{MANY + 3:,} registration(s)" in table and "a-00049" in table and "a-00050" not in table
    assert f"registrations 1-50 of {MANY + 3:,} listed" in table and "--all" in table
    summary = table[table.index("by owner:"):]
    assert f"{a.pid}" in summary and "worker-a" in summary and f"{MANY:,}" in summary and "worker-b" in summary

    every = _cli(server.url, "--all")
    assert sum(1 for line in every.splitlines() if line.startswith(("a-", "b-"))) == MANY + 3
    assert "by owner:" not in every and "listed" not in every

    tail = _cli(server.url, "--offset", str(MANY + 1), "--limit", "5")
    assert "b-00001" in tail and "b-00002" in tail and "a-" not in tail.split("by owner:")[0].split("\n", 2)[2]
    as_json = json.loads(_cli(server.url, "--json", "--limit", "3"))
    assert [r["instance_id"] for r in as_json["registrations"]] == ["a-00000", "a-00001", "a-00002"]
    assert as_json["registrations_total"] == MANY + 3 and len(as_json["owners"]) == 2

    bad = subprocess.run([sys.executable, "-m", "lmshm.cli", "status", "--url", server.url, "--limit", "-1"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "whole number" in bad.stderr


def test_lmshm_status_into_a_reader_that_stops_early_ends_quietly(crowded):
    """``lmshm status --all | head -1``: the table is far longer than the pipe holds, so the
    CLI writes into a closed pipe; it stops without a traceback, as a command killed by SIGPIPE."""
    server, _, _ = crowded
    out = subprocess.run(["bash", "-c", 'set -o pipefail; "$0" -m lmshm.cli status --all --url "$1" | head -1',
                          sys.executable, server.url], capture_output=True, text=True, timeout=60)
    assert out.stdout.count("\n") == 1 and out.stdout.strip()
    assert "Traceback" not in out.stderr and "BrokenPipe" not in out.stderr, out.stderr
    assert out.returncode == 141, (out.returncode, out.stderr)


def test_a_session_that_ends_takes_only_its_own_registrations_and_limits_count_each_owners_own(crowded):
    from harness import WorkerProcess

    server, a, b = crowded
    c = WorkerProcess(server.url)
    c.ok("register_many", prefix="c-", count=5)
    assert query_status(server.url, limit=0).registrations_total == MANY + 8
    assert c.exit() == 0
    status = query_status(server.url, limit=0)
    assert status.registrations_total == MANY + 3 and {o.owner_pid for o in status.owners} == {a.pid, b.pid}
    refused = b.call("register_many", prefix="d-", count=11)       # B may hold MANY + 10: it holds 3
    assert refused["ok"], refused
    refused = a.call("register_many", prefix="e-", count=11)       # A holds MANY: the 11th is refused
    assert not refused["ok"] and f"already holds {MANY + 10} registrations" in refused["message"], refused
    for who, prefix, n in ((a, "e-", 10), (b, "d-", 11)):
        for i in range(n):
            who.ok("unregister", instance_id=f"{prefix}{i:05d}")
    assert query_status(server.url, limit=0).registrations_total == MANY + 3


def test_against_a_3_3_server_lmshm_status_asks_the_old_way(tmp_path):
    """A stand-in for a 3.3 server on a real ZeroMQ ROUTER: it refuses STATUS's new fields as a
    3.3 server's decoder does, and answers a plain STATUS with every registration."""
    import zmq

    rows = [protocol.RegistrationInfo(f"old-{i}", 1, 100, 0, "c", "m", 1, 0, 1, 64, ["cpu-shm"], ["cpu"], 1.0)
            for i in range(3)]
    old_reply = protocol.StatusReply("old", 1, 3, False, 1.0, 1, 1, 0, 10, 1024, 0, rows,
                                     protocol.PoolInfo(*[0] * 14), protocol_minor=3)
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    done = threading.Event()
    asked: list[dict] = []

    def serve() -> None:
        while not done.is_set():
            if not router.poll(50):
                continue
            peer, rid, body = router.recv_multipart()
            request = msgspec.msgpack.decode(body)
            asked.append(request)
            if set(request) != {"type"}:
                answer = protocol.ErrorReply(int(ErrorCode.INVALID_ARG),
                                             "invalid message: Object contains unknown field `offset`")
            else:
                answer = old_reply
            router.send_multipart([peer, rid, codec.encode(answer)])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        url = f"tcp://127.0.0.1:{port}"
        page = query_status(url, offset=1, limit=1)
        assert [r.instance_id for r in page.registrations] == ["old-1"]
        assert type(page) is protocol.StatusReply and not hasattr(page, "registrations_total")
        assert [set(r) for r in asked] == [{"type", "offset", "limit", "minor"}, {"type"}]
        table = _cli(url)
        assert "3 registration(s)" in table and "old-2" in table and "listed" not in table
    finally:
        done.set()
        thread.join(10)
        router.close(0)
        ctx.term()


def test_an_invalid_argument_that_is_not_about_the_new_fields_is_not_retried(tmp_path):
    import zmq

    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    done = threading.Event()
    seen = []

    def serve() -> None:
        while not done.is_set():
            if not router.poll(50):
                continue
            peer, rid, body = router.recv_multipart()
            seen.append(body)
            router.send_multipart([peer, rid, codec.encode(protocol.ErrorReply(int(ErrorCode.INVALID_ARG), "no"))])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        with pytest.raises(InvalidArgument, match="no"):
            query_status(f"tcp://127.0.0.1:{port}")
        assert len(seen) == 1
    finally:
        done.set()
        thread.join(10)
        router.close(0)
        ctx.term()
