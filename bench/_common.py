"""What the benchmark scripts share besides the server (``_server.py``): the ``--smoke`` run and
the helpers more than one script repeated.

``parse_args(parser, smoke)``: every script's argument parsing. It adds ``--smoke``, a run of a
few seconds through the same code paths with tiny sizes and one or two repetitions, so that
``tests/v1/test_bench_smoke.py`` catches a script a refactor broke. ``smoke`` holds the
defaults a smoke run uses instead; options given on the command line still win. Figures a
smoke run prints mean nothing.

``skip(why)``: a script that cannot run here (no GPU, no vLLM) says why and exits with
``SKIPPED`` (77, the status automake's test drivers read as "skipped"); the smoke test turns
that into a pytest skip with the same line, never into a pass. ``skip_slow(why)`` does so for
a script whose smallest run takes minutes, unless $LMSHM_BENCH_SMOKE_ALL=1.
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import sys
from typing import Any, Mapping, NoReturn, Optional

SKIPPED = 77


def parse_args(parser: argparse.ArgumentParser, smoke: Mapping[str, Any],
               argv: Optional[list] = None) -> argparse.Namespace:
    """``parser.parse_args(argv)`` with ``--smoke`` added: then ``smoke``'s values are the
    defaults (see the module docstring)."""
    parser.add_argument("--smoke", action="store_true",
                        help="a seconds-long run with tiny sizes, to check the script works (figures mean nothing)")
    first, _ = parser.parse_known_args(argv)
    if first.smoke:
        parser.set_defaults(**smoke)
    return parser.parse_args(argv)


def skip(why: str) -> NoReturn:
    """Print ``skipped: why`` and exit with ``SKIPPED``."""
    print(f"skipped: {why}", flush=True)
    sys.exit(SKIPPED)


def skip_slow(why: str) -> None:
    """In a smoke run, ``skip(why)`` unless $LMSHM_BENCH_SMOKE_ALL is 1: for scripts whose
    smallest run takes minutes (real engines started on CPU)."""
    if os.environ.get("LMSHM_BENCH_SMOKE_ALL") != "1":
        skip(f"{why} (LMSHM_BENCH_SMOKE_ALL=1 runs it anyway)")


def no_cuda_device() -> bool:
    """True when this machine shows no NVIDIA device node: a smoke run then skips before it
    pays for importing torch to ask."""
    return not os.path.exists("/dev/nvidiactl")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss(pid: int) -> int:
    """The resident set of process ``pid``, in bytes."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def open_fds(pid: int) -> int:
    """How many file descriptors process ``pid`` holds open."""
    return len(os.listdir(f"/proc/{pid}/fd"))


def raise_nofile(want: int) -> int:
    """Raise this process's soft limit on open files towards ``want`` (at most the hard limit);
    returns the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < want:
        soft = min(want, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    return soft
