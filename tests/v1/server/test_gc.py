"""lmshm-server keeps what its start made out of the cyclic GC's full collections (gc.freeze):
those collections hold every thread of the server, and walked about 170,000 objects (torch's
modules among them), 74 ms each."""

from __future__ import annotations

import urllib.request

from attacks import free_port
from harness import ServerProcess


def test_the_server_freezes_what_its_start_made_and_says_how_much_in_its_metrics(tmp_path):
    port = free_port()
    server = ServerProcess(tmp_path, "--capacity", "64MiB", "--http-port", str(port))
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            text = r.read().decode()
        line = next(ln for ln in text.splitlines() if ln.startswith("lmshm_gc_frozen_objects "))
        assert float(line.split()[1]) > 50_000, line
    finally:
        assert server.stop() == 0, server.log()
