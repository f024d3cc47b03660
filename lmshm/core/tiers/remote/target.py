"""What ``--remote`` names and the secrets it is given: ``parse_url``, ``read_secret_file``, ``read_ca_file``.

``parse_url`` accepts ``redis://``, ``rediss://`` (TLS) and their ``+cluster`` forms, and
refuses a password in the URL (it would show in ``ps`` and in logs). ``read_secret_file``
accepts only a regular file of the server's uid (or root's) that no one else may read.
``NO_SECRET``, ``BOTH`` and ``UNSIGNED_WARNING`` are the words the tier says when it is made
without a secret, with a secret and the opt-out together, or with the opt-out alone.

Who owns what: this module parses and checks; it opens no connection. ``tier.RemoteTier``
decides what a missing secret means.

The one trap: a secret file is read through ``O_NOFOLLOW`` and checked on its fd, so a link or
a file swapped between a check and the read is never taken for the secret.
"""

from __future__ import annotations

import os
import stat
import urllib.parse
from dataclasses import dataclass

MIN_SECRET_BYTES = 16
MAX_CA_BYTES = 1 << 20

SECRET_HOWTO = ("(umask 077; mkdir -p /etc/lmshm; head -c 32 /dev/urandom > /etc/lmshm/remote.key); "
                "chmod 600 /etc/lmshm/remote.key")
#: RemoteTier without a secret or the opt-out: how to make a secret (read_secret_file's rules)
NO_SECRET = ("--remote {url} needs a secret shared by the servers that use it: without one, anyone who can "
             "write to the remote can make every server serve engines KV of their choosing (a forged value with "
             "a valid header and checksum is a hit). Make one, owned by the server's user, mode 600, at least "
             f"{MIN_SECRET_BYTES} bytes: {SECRET_HOWTO}, copy that file to every server of the deployment, and "
             "give each --remote-secret-file /etc/lmshm/remote.key (LMSHM_REMOTE_SECRET_FILE). To trust anyone "
             "who can write to the remote instead, say so: --remote-insecure-unsigned "
             "(LMSHM_REMOTE_INSECURE_UNSIGNED=1)")
BOTH = ("--remote-secret-file and --remote-insecure-unsigned contradict each other: with a secret every value "
        "is signed and checked; drop --remote-insecure-unsigned")
#: logged once at start with --remote-insecure-unsigned
UNSIGNED_WARNING = ("lmshm: the remote tier %s is unsigned (--remote-insecure-unsigned): anyone who can write to "
                    "that Valkey/Redis can feed engines wrong KV, which this server serves as hits. Give every "
                    "server the same --remote-secret-file to sign and check every value")

ACCEPTED = ("redis://HOST[:PORT][/DB], rediss://HOST[:PORT][/DB] (TLS), "
            "redis+cluster://HOST:PORT[,HOST:PORT...] or rediss+cluster://... (a cluster, by its seed nodes)")


@dataclass(frozen=True)
class RemoteTarget:
    """What ``--remote URL`` names: the nodes, TLS, cluster or standalone, the database."""

    nodes: tuple[tuple[str, int], ...]
    tls: bool
    cluster: bool
    db: int = 0
    username: str = ""

    def describe(self) -> str:
        scheme = ("rediss" if self.tls else "redis") + ("+cluster" if self.cluster else "")
        return f"{scheme}://" + ",".join(f"{h}:{p}" for h, p in self.nodes)


def parse_url(url: str) -> RemoteTarget:
    """``--remote URL`` -> a ``RemoteTarget``; ``ValueError`` naming the accepted forms otherwise.
    A password in the URL is refused: it would show in ``ps`` and in logs."""
    scheme, sep, rest = url.partition("://")
    forms = {"redis": (False, False), "rediss": (True, False), "redis+cluster": (False, True),
             "rediss+cluster": (True, True)}
    if not sep or scheme.lower() not in forms:
        raise ValueError(f"--remote {url[:80]!r} is not a URL lmshm accepts; use {ACCEPTED}")
    tls, cluster = forms[scheme.lower()]
    if any(c in rest for c in "?#"):
        raise ValueError(f"--remote {url[:80]!r}: query strings and fragments are not accepted; use {ACCEPTED}")
    username = ""
    if "@" in rest:
        userinfo, _, rest = rest.rpartition("@")
        if ":" in userinfo:
            raise ValueError("--remote must not carry a password (it would show in ps and logs): put it in "
                             "LMSHM_REMOTE_PASSWORD or in a file named by --remote-password-file, and the user "
                             "name in LMSHM_REMOTE_USERNAME")
        username = urllib.parse.unquote(userinfo)
    hostports, _, path = rest.partition("/")
    db = 0
    if path:
        if cluster or not path.isdigit():
            raise ValueError(f"--remote {url[:80]!r}: only a standalone server takes a database number "
                             f"(/0../15); use {ACCEPTED}")
        db = int(path)
    nodes = []
    for hp in hostports.split(","):
        host, port = hp, "6379"
        if hp.startswith("["):                          # [v6 address]:port
            host, _, after = hp[1:].partition("]")
            port = after[1:] if after.startswith(":") else "6379"
        elif ":" in hp:
            host, _, port = hp.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"--remote {url[:80]!r}: {hp[:60]!r} is not HOST:PORT; use {ACCEPTED}")
        nodes.append((host, int(port)))
    if len(nodes) > 1 and not cluster:
        raise ValueError(f"--remote {url[:80]!r}: several nodes make a cluster; write it as "
                         f"redis+cluster://HOST:PORT,HOST:PORT (accepted: {ACCEPTED})")
    return RemoteTarget(tuple(nodes), tls, cluster, db, username)


def read_secret_file(path: str, what: str, min_bytes: int = 1) -> bytes:
    """A secret from a file the server's uid owns and nobody else may read (a trailing newline
    is dropped); ``ValueError`` with what to do otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError as exc:
        raise ValueError(f"cannot open {what} {path!r}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{what} {path!r} is not a regular file")
        if st.st_uid not in (os.geteuid(), 0):
            raise ValueError(f"{what} {path!r} belongs to uid {st.st_uid}, who could change it; it must be the "
                             f"server's (uid {os.geteuid()}) or root's: chown it")
        if st.st_mode & 0o077:
            raise ValueError(f"{what} {path!r} is readable by group or others (mode {st.st_mode & 0o777:o}); "
                             f"chmod 600 it")
        data = os.read(fd, 1 << 16).rstrip(b"\r\n")
    finally:
        os.close(fd)
    if len(data) < min_bytes:
        raise ValueError(f"{what} {path!r} holds {len(data)} bytes; it needs at least {min_bytes} "
                         f"(e.g. head -c 32 /dev/urandom > FILE)")
    return data


def read_ca_file(path: str) -> bytes:
    """The PEM certificates of ``--remote-ca-file`` (public: any mode will do); ``ValueError``
    unless the file holds at least one certificate."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_CA_BYTES + 1)
    except OSError as exc:
        raise ValueError(f"cannot read --remote-ca-file {path!r}: {exc.strerror}") from None
    if len(data) > MAX_CA_BYTES or b"-----BEGIN CERTIFICATE-----" not in data:
        raise ValueError(f"--remote-ca-file {path!r} is not a PEM file of certificates "
                         f"(-----BEGIN CERTIFICATE----- ..., at most {MAX_CA_BYTES >> 20} MiB)")
    return data

