"""The remote tier end to end: real lmshm-servers (own pools, own --disk directories) sharing one
real Valkey (standalone or a 3-master cluster, started by tests/v1/conftest.py), workers in
their own processes, and real faults on the Valkey processes. Every check compares the bytes the
workers see, or what the servers report in STATUS. The servers of a test share one secret
(``--remote-secret-file``, required with ``--remote``) unless the test is about going without."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from harness import wait_for
from valkey_servers import command, secret_file

TIMEOUT_S = 0.3
REMOTE = ("--remote-timeout", str(TIMEOUT_S), "--remote-prefix", "it:")


def key(i: int) -> str:
    return bytes([0xE1, i]).hex() * 8   # 16 bytes


def tiers(w) -> dict:
    return {t["name"]: t for t in w.ok("pool")["pool"]["tiers"]}


@pytest.fixture
def secret(tmp) -> Path:
    """The ``--remote-secret-file`` the servers of one test share."""
    return secret_file(tmp)


@pytest.fixture
def start_server(start_server, tmp, secret):
    """Several servers in one test: each its own fd socket. One given ``--remote`` gets the
    test's ``secret`` unless its arguments say otherwise (their own ``--remote-secret-file``, or
    ``--remote-insecure-unsigned``) or ``signed=False``."""
    count = iter(range(1000))

    def start(*args: str, signed: bool = True):
        if signed and "--remote" in args and not {"--remote-secret-file", "--remote-insecure-unsigned"} & set(args):
            args += ("--remote-secret-file", str(secret))
        return start_server(*args, fd_socket=str(tmp / f"fds-{next(count)}.sock"))
    return start


@pytest.fixture
def disks(tmp) -> list[Path]:
    ds = []
    for name in ("disk1", "disk2"):
        d = tmp / name
        d.mkdir(mode=0o700)
        ds.append(d)
    yield ds
    for d in ds:
        shutil.rmtree(d, ignore_errors=True)


def stored_by_one(start_server, start_worker, url: str, n: int, *extra: str, seed: int = 3):
    """A server storing ``n`` chunks written through to the remote; (server, worker, digests)."""
    server = start_server("--remote", url, *REMOTE, *extra)
    a = start_worker(server.url)
    ia = a.ok("register_kv")["instance_id"]
    a.ok("fill_blocks", instance_id=ia, blocks=list(range(n)), seed=seed)
    want = a.ok("digest_blocks", instance_id=ia, blocks=list(range(n)))["digests"]
    a.ok("store", instance_id=ia, keys=[key(i) for i in range(n)], blocks=list(range(n)), chunk_blocks=1)
    wait_for(lambda: tiers(a)["remote"]["puts"] >= n, timeout_s=20, what="write-through to the remote")
    return server, a, want


def lookup_and_retrieve(w, keys: list[str], blocks: list[int]) -> tuple[int, list]:
    """LOOKUP the keys, RETRIEVE the hits into ``blocks``; (hits, digests of those blocks)."""
    iid = w.ok("register_kv")["instance_id"] if not hasattr(w, "iid") else w.iid
    w.iid = iid
    found = w.ok("lookup", keys=[keys])
    n = found["hits"]
    if n:
        w.ok("retrieve", instance_id=iid, keys=keys[:n], blocks=blocks[:n], chunk_blocks=1, lease=found["lease"])
    return n, w.ok("digest_blocks", instance_id=iid, blocks=blocks[:n])["digests"] if n else []


def test_a_chunk_stored_on_one_server_is_a_hit_with_equal_bytes_on_another(start_server, start_worker, valkey,
                                                                          disks):
    _, a, want = stored_by_one(start_server, start_worker, valkey.url, 3, "--disk", str(disks[0]),
                               "--disk-capacity", "64MiB")
    second = start_server("--remote", valkey.url, *REMOTE, "--disk", str(disks[1]), "--disk-capacity", "64MiB")
    b = start_worker(second.url)
    assert lookup_and_retrieve(b, [key(0), key(1), key(2), key(3)], [9, 10, 11, 12]) == (3, want)
    t = tiers(b)
    assert t["remote"]["promotions"] == 3 and t["disk"]["promotions"] == 0 and t["remote"]["corrupt"] == 0
    status = subprocess.run([sys.executable, "-m", "lmshm.cli", "status", "--url", second.url], capture_output=True,
                            text=True, timeout=30, env={**os.environ})
    assert status.returncode == 0, status.stderr
    assert "remote: " in status.stdout and "3 promoted" in status.stdout


def test_with_the_remote_stopped_a_restarted_server_hits_from_disk_alone(start_server, start_worker, valkey, disks):
    args = ("--disk", str(disks[0]), "--disk-capacity", "64MiB")
    first, a, want = stored_by_one(start_server, start_worker, valkey.url, 3, *args)
    wait_for(lambda: tiers(a)["disk"]["puts"] == 3, timeout_s=20)
    a.exit()
    assert first.stop() == 0
    valkey.kill()
    second = start_server("--remote", valkey.url, *REMOTE, *args)
    b = start_worker(second.url)
    t0 = time.monotonic()
    assert lookup_and_retrieve(b, [key(0), key(1), key(2), key(3)], [5, 6, 7, 8]) == (3, want)
    assert time.monotonic() - t0 < 5
    t = tiers(b)
    assert t["disk"]["promotions"] == 3 and t["remote"]["promotions"] == 0
    assert t["remote"]["timeouts"] + t["remote"]["errors"] >= 1     # key(3) was looked for, and failed


@pytest.mark.parametrize("fault", ["SIGSTOP", "SIGKILL"])
def test_a_silent_or_dead_valkey_is_a_miss_within_the_timeout_and_recovers(start_server, start_worker, valkey,
                                                                           fault):
    _, a, want = stored_by_one(start_server, start_worker, valkey.url, 2)
    second = start_server("--remote", valkey.url, *REMOTE)
    b = start_worker(second.url)
    if fault == "SIGSTOP":
        valkey.pause()
    else:
        valkey.kill()
    took = []
    for _ in range(6):
        t0 = time.monotonic()
        assert b.ok("lookup", keys=[[key(0), key(1)]])["hits"] == 0
        took.append(time.monotonic() - t0)
        b.ok("pool")                          # the loop answers while the remote is down
    assert max(took) < TIMEOUT_S + 1.0, f"a LOOKUP waited past the remote's timeout: {took}"
    t = tiers(b)["remote"]
    assert t["timeouts"] + t["errors"] >= 1
    if fault == "SIGSTOP":
        valkey.resume()
        n, got = 0, []
        deadline = time.monotonic() + 40
        while n < 2 and time.monotonic() < deadline:      # the breaker lets a probe through
            n, got = lookup_and_retrieve(b, [key(0), key(1)], [4, 5])
            time.sleep(0.2)
        assert (n, got) == (2, want)
    else:
        valkey.start()                        # an empty server: the values died with it
        _, c, want2 = stored_by_one(start_server, start_worker, valkey.url, 2, seed=11)
        deadline = time.monotonic() + 40
        n = 0
        while time.monotonic() < deadline:
            n, got = lookup_and_retrieve(b, [key(0), key(1)], [4, 5])
            if n == 2:
                break
            time.sleep(0.2)
        assert (n, got) == (2, want2)


def test_lookups_waiting_on_a_paused_remote_hold_up_no_other_sessions_copies(start_server, start_worker, valkey):
    _, _, want = stored_by_one(start_server, start_worker, valkey.url, 8)
    server = start_server("--remote", valkey.url, "--remote-timeout", "4", "--remote-prefix", "it:")
    c = start_worker(server.url)                # an engine whose chunks are in this server's pool
    ic = c.ok("register_kv")["instance_id"]
    c.ok("fill_blocks", instance_id=ic, blocks=[0, 1], seed=5)
    mine = c.ok("digest_blocks", instance_id=ic, blocks=[0, 1])["digests"]
    c.ok("store", instance_id=ic, keys=[key(100), key(101)], blocks=[0, 1], chunk_blocks=1)
    wait_for(lambda: tiers(c)["remote"]["puts"] >= 2, timeout_s=20, what="write-through to the remote")
    lookers = [start_worker(server.url) for _ in range(3)]      # more LOOKUPs than copier threads (2)
    answers: dict[int, tuple[float, dict]] = {}

    def look(i: int) -> None:
        t0 = time.monotonic()
        found = lookers[i].ok("lookup", keys=[[key(j) for j in range(2 * i, 2 * i + 2)]])
        answers[i] = (time.monotonic() - t0, found)

    assert command(valkey.port, "CLIENT", "PAUSE", "2500", "ALL").startswith(b"+OK")    # silent, not failing
    threads = [threading.Thread(target=look, args=(i,)) for i in range(len(lookers))]
    for t in threads:
        t.start()
    time.sleep(0.5)                             # every LOOKUP is waiting on the remote by now
    t0 = time.monotonic()
    found = c.ok("lookup", keys=[[key(100), key(101)]])         # in the pool: answered on the loop
    c.ok("retrieve", instance_id=ic, keys=[key(100), key(101)], blocks=[4, 5], chunk_blocks=1, lease=found["lease"])
    c.ok("store", instance_id=ic, keys=[key(102)], blocks=[0], chunk_blocks=1)
    took = time.monotonic() - t0
    for t in threads:
        t.join(30)
    assert c.ok("digest_blocks", instance_id=ic, blocks=[4, 5])["digests"] == mine
    assert took < 1.0, f"another session's RETRIEVE and STORE waited {took:.2f} s behind LOOKUPs on a paused remote"
    assert sorted(answers) == [0, 1, 2] and all(f["hits"] == 2 for _, f in answers.values()), answers
    assert min(t for t, _ in answers.values()) > 1.5, f"the LOOKUPs did not wait on the remote: {answers}"
    w = lookers[0]
    assert lookup_and_retrieve(w, [key(0), key(1)], [0, 1]) == (2, want[:2])


def test_through_a_cluster_a_node_down_costs_misses_for_its_slots_only(start_server, start_worker, valkey_cluster):
    from lmshm.core.tiers.remote import RemoteTier
    n = 12
    _, a, want = stored_by_one(start_server, start_worker, valkey_cluster.url, n)
    second = start_server("--remote", valkey_cluster.url, *REMOTE)
    b = start_worker(second.url)
    namer = RemoteTier(valkey_cluster.url, prefix="it:", insecure_unsigned=True)    # it only names keys
    rkeys = [namer.remote_key(os.getuid(), bytes.fromhex(key(i))) for i in range(n)]
    namer.close()
    down = valkey_cluster.nodes[0]
    on_down = [valkey_cluster.node_for(k) is down for k in rkeys]
    assert any(on_down) and not all(on_down)
    down.kill()
    for i in range(n):
        hits, got = lookup_and_retrieve(b, [key(i)], [i])
        if on_down[i]:
            assert hits == 0
        else:
            assert (hits, got) == (1, [want[i]]), f"chunk {i} on a live node was a miss"


def test_a_writer_without_the_secret_cannot_poison_a_reader_with_it(start_server, start_worker, valkey, tmp):
    secret = tmp / "secret"
    secret.write_bytes(os.urandom(32))
    secret.chmod(0o600)
    signed = ("--remote-secret-file", str(secret))
    _, a, want = stored_by_one(start_server, start_worker, valkey.url, 2, *signed)
    # a server without the secret stores other bytes under the same keys: it overwrites the values
    stored_by_one(start_server, start_worker, valkey.url, 2, "--remote-insecure-unsigned", seed=99)
    reader = start_server("--remote", valkey.url, *REMOTE, *signed)
    b = start_worker(reader.url)
    assert lookup_and_retrieve(b, [key(0), key(1)], [4, 5]) == (0, [])
    assert tiers(b)["remote"]["corrupt"] >= 1
    # the signed writer stores again (a new key): the reader with the secret takes it
    ia = a.ok("register_kv")["instance_id"]
    a.ok("fill_blocks", instance_id=ia, blocks=[7], seed=5)
    want7 = a.ok("digest_blocks", instance_id=ia, blocks=[7])["digests"]
    a.ok("store", instance_id=ia, keys=[key(7)], blocks=[7], chunk_blocks=1)
    wait_for(lambda: tiers(a)["remote"]["puts"] >= 3, timeout_s=20)
    assert lookup_and_retrieve(b, [key(7)], [8]) == (1, want7)


def test_a_password_in_the_url_is_refused_and_the_message_says_where_it_goes(tmp):
    out = subprocess.run([sys.executable, "-m", "lmshm.server", "--url", "tcp://127.0.0.1:0", "--fd-socket",
                          str(tmp / "fds.sock"), "--remote", "redis://u:hunter2@127.0.0.1:1"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "LMSHM_REMOTE_PASSWORD" in out.stderr and "hunter2" not in out.stderr
    out = subprocess.run([sys.executable, "-m", "lmshm.server", "--url", "tcp://127.0.0.1:0", "--fd-socket",
                          str(tmp / "fds.sock"), "--remote", "memcached://127.0.0.1:1"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "redis+cluster://" in out.stderr


@pytest.mark.parametrize("source", ["environment", "file"])
def test_the_remote_password_comes_from_the_environment_or_a_file(start_server, start_worker, valkey_dir, tmp,
                                                                 source):
    from valkey_servers import ValkeyServer
    password = os.urandom(12).hex()
    guarded = ValkeyServer(valkey_dir / "guarded", extra=("--requirepass", password))
    try:
        if source == "environment":
            os.environ["LMSHM_REMOTE_PASSWORD"] = password
            extra: tuple[str, ...] = ()
        else:
            f = tmp / "password"
            f.write_text(password + "\n")
            f.chmod(0o600)
            extra = ("--remote-password-file", str(f))
        try:
            _, a, want = stored_by_one(start_server, start_worker, guarded.url, 1, *extra)
        finally:
            os.environ.pop("LMSHM_REMOTE_PASSWORD", None)
        assert tiers(a)["remote"]["errors"] == 0
        # without the password: refused by the server, so misses and drops, and no hit
        anonymous = start_server("--remote", guarded.url, *REMOTE)
        b = start_worker(anonymous.url)
        assert lookup_and_retrieve(b, [key(0)], [3]) == (0, [])
        assert tiers(b)["remote"]["errors"] + tiers(b)["remote"]["timeouts"] >= 1
    finally:
        guarded.close()


def test_a_tls_remote_with_a_ca_file_serves_another_server(start_server, start_worker, valkey, valkey_tls):
    # stored through TLS (rediss:// and the test CA), found by a server reading the same Valkey
    _, a, want = stored_by_one(start_server, start_worker, valkey_tls.url, 2,
                               "--remote-ca-file", str(valkey_tls.ca), "--remote-timeout", "2")
    second = start_server("--remote", valkey.url, *REMOTE)
    b = start_worker(second.url)
    assert lookup_and_retrieve(b, [key(0), key(1)], [7, 8]) == (2, want)
    # a CA file with a plain redis:// URL is refused at start, naming the fix
    bad = subprocess.run([sys.executable, "-m", "lmshm.server", "--url", "tcp://127.0.0.1:0", "--remote",
                          valkey.url, "--remote-ca-file", str(valkey_tls.ca), "--remote-insecure-unsigned"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "rediss://" in bad.stderr, bad.stderr


def test_a_remote_without_a_secret_is_refused_at_start_saying_how_to_make_one(start_server, valkey):
    with pytest.raises(RuntimeError, match="did not start") as refused:
        start_server("--remote", valkey.url, *REMOTE, signed=False)
    said = str(refused.value)
    assert "--remote-secret-file" in said and "head -c 32 /dev/urandom" in said and "chmod 600" in said, said
    assert "--remote-insecure-unsigned" in said, said


def test_a_secret_and_the_insecure_opt_out_together_are_refused(start_server, valkey, secret):
    with pytest.raises(RuntimeError, match="did not start") as refused:
        start_server("--remote", valkey.url, *REMOTE, "--remote-secret-file", str(secret), "--remote-insecure-unsigned")
    assert "contradict each other" in str(refused.value)


def test_servers_signing_with_either_mac_serve_each_other_and_an_unknown_mac_is_refused(start_server, start_worker,
                                                                                     valkey, tmp):
    # a deployment upgrading one server at a time: the old MAC (blake3) and the new default read both
    _, a, want = stored_by_one(start_server, start_worker, valkey.url, 2, "--remote-mac", "blake3")
    new = start_server("--remote", valkey.url, *REMOTE)
    b = start_worker(new.url)
    assert lookup_and_retrieve(b, [key(0), key(1)], [5, 6]) == (2, want)
    assert tiers(b)["remote"]["corrupt"] == 0
    from lmshm.core.tiers.remote import RemoteTier
    from lmshm.core.tiers.remote.value import MAC_BLAKE3, MAC_GMAC
    probe = RemoteTier(valkey.url, prefix="it:", insecure_unsigned=True)
    try:
        uid = os.getuid()
        assert bytes(probe._get_client().get(probe.remote_key(uid, bytes.fromhex(key(0)))))[11] == MAC_BLAKE3
        b.ok("fill_blocks", instance_id=b.iid, blocks=[7], seed=9)
        b.ok("store", instance_id=b.iid, keys=[key(7)], blocks=[7], chunk_blocks=1)
        wait_for(lambda: tiers(b)["remote"]["puts"] >= 1, timeout_s=20, what="write-through to the remote")
        assert bytes(probe._get_client().get(probe.remote_key(uid, bytes.fromhex(key(7)))))[11] == MAC_GMAC
    finally:
        probe.close()
    c = start_worker(start_server("--remote", valkey.url, *REMOTE, "--remote-mac", "blake3").url)
    assert lookup_and_retrieve(c, [key(7)], [1]) == (1, b.ok("digest_blocks", instance_id=b.iid, blocks=[7])["digests"])
    with pytest.raises(RuntimeError, match="did not start") as refused:
        start_server("--remote", valkey.url, *REMOTE, "--remote-mac", "hmac")
    assert "aes-gmac, blake3" in str(refused.value)
    from lmshm.settings import build_arg_parser, resolve_config
    assert "--remote-mac" in build_arg_parser().format_help()
    assert resolve_config(build_arg_parser().parse_args([]), {"LMSHM_REMOTE_MAC": "blake3"}).remote_mac == "blake3"


def test_the_opt_out_is_a_setting_in_help_environment_and_toml(tmp):
    from lmshm.settings import build_arg_parser, resolve_config
    assert "--remote-insecure-unsigned" in build_arg_parser().format_help()
    none = build_arg_parser().parse_args([])
    assert not resolve_config(none, {}).remote_insecure_unsigned
    assert resolve_config(none, {"LMSHM_REMOTE_INSECURE_UNSIGNED": "1"}).remote_insecure_unsigned
    toml = tmp / "lmshm.toml"
    toml.write_text("remote_insecure_unsigned = true\n")
    assert resolve_config(build_arg_parser().parse_args(["--config", str(toml)]), {}).remote_insecure_unsigned


def forge(url: str, uid: int, victim: str, source: str) -> None:
    """What anyone who can write to the Valkey can do: overwrite ``victim``'s value with
    ``source``'s payload under a valid header and checksum (format 3 unsigned), no secret."""
    from lmshm.core.tiers.remote import RemoteTier
    from lmshm.core.tiers.remote.value import HEADER_BYTES, decode_header
    forger = RemoteTier(url, prefix="it:", insecure_unsigned=True)
    try:
        src = bytes.fromhex(source)
        value = bytes(forger._get_client().get(forger.remote_key(uid, src)))
        meta = decode_header(value, uid, src)[0]
        assert forger.put(uid, bytes.fromhex(victim), meta, memoryview(value)[HEADER_BYTES:])
    finally:
        forger.close()


@pytest.mark.parametrize("signed", [True, False], ids=["secret", "insecure-unsigned"])
def test_a_forged_value_is_a_counted_miss_with_a_secret_and_served_with_the_opt_out(start_server, start_worker,
                                                                                    valkey, signed):
    mode = () if signed else ("--remote-insecure-unsigned",)
    _, a, want = stored_by_one(start_server, start_worker, valkey.url, 2, *mode)
    forge(valkey.url, os.getuid(), key(0), key(1))          # key(0) now holds key(1)'s KV
    reader = start_server("--remote", valkey.url, *REMOTE, *mode)
    b = start_worker(reader.url)
    warnings = [line for line in reader.log().splitlines() if " WARNING " in line and "anyone who can write" in line]
    if signed:
        assert lookup_and_retrieve(b, [key(0)], [4]) == (0, []), "a forged value was served"
        assert tiers(b)["remote"]["corrupt"] == 1 and tiers(b)["remote"]["promotions"] == 0
        assert lookup_and_retrieve(b, [key(1)], [5]) == (1, [want[1]])     # the signed one next to it
        assert not warnings
    else:
        # the risk the opt-out takes, documented: the engine gets the forger's KV for key(0)
        assert lookup_and_retrieve(b, [key(0), key(1)], [4, 5]) == (2, [want[1], want[1]])
        assert tiers(b)["remote"]["corrupt"] == 0
        assert len(warnings) == 1, reader.log()
        assert "can feed engines wrong KV" in warnings[0] and "--remote-secret-file" in warnings[0]
