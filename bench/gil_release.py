"""What a checksum or MAC call costs a thread while another thread runs Python (the GIL).

    .venv/bin/python bench/gil_release.py [--sizes-kib 16,64,96,256,2048] [--seconds 0.3]

A C function that releases the GIL around its work must take it back afterwards; while another
thread runs Python (the server's request loop under a burst of STOREs, say), that waits until
the other thread gives it up, at the latest after the switch interval (``sys.getswitchinterval``,
5 ms). For each function the tiers use on a value (xxh3-128, BLAKE2b, CRC-32, keyed BLAKE3,
AES-GMAC's associated data) and each size, one call is timed on this thread, first alone, then
with a second thread spinning in a Python loop. Prints the median µs per call of each. A call
that keeps the GIL costs about the same both ways (the spinner waits); one that releases it
costs up to the switch interval more.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import threading
import time
import zlib
from typing import Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import parse_args


def functions() -> dict[str, Callable[[memoryview], object]]:
    """The value checks the disk and remote tiers run, where their packages are installed."""
    out: dict[str, Callable[[memoryview], object]] = {
        "blake2b-256": lambda v: hashlib.blake2b(v, digest_size=32).digest(),
        "crc32": zlib.crc32,
    }
    try:
        import xxhash
        out["xxh3-128"] = xxhash.xxh3_128_digest
    except ImportError:
        pass
    try:
        import blake3
        key = os.urandom(32)
        out["keyed blake3"] = lambda v: blake3.blake3(v, key=key).digest()
    except ImportError:
        pass
    try:
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
        key, iv = os.urandom(32), bytes(12)

        def gmac(v: memoryview) -> bytes:
            enc = Cipher(algorithms.AES(key), modes.GCM(iv)).encryptor()
            enc.authenticate_additional_data(v)
            enc.finalize()
            return enc.tag
        out["AES-GMAC"] = gmac
    except ImportError:
        pass
    return out


def per_call_us(fn: Callable[[memoryview], object], data: memoryview, seconds: float) -> float:
    times = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or len(times) < 5:
        t0 = time.perf_counter()
        fn(data)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-kib", default="16,64,96,256,2048")
    ap.add_argument("--seconds", type=float, default=0.3, help="per function, size and case")
    args = parse_args(ap, smoke={"sizes_kib": "16,256", "seconds": 0.02})
    sizes = [int(s) for s in args.sizes_kib.split(",")]
    buf = memoryview(os.urandom(max(sizes) << 10))
    fns = functions()
    print(f"Python {sys.version.split()[0]}, switch interval {sys.getswitchinterval() * 1e3:g} ms; "
          "median µs per call: alone / with a thread spinning in Python")
    print(f"{'':14s}" + "".join(f"{f'{k} KiB':>22s}" for k in sizes))
    for name, fn in fns.items():
        cells = []
        for kib in sizes:
            data = buf[:kib << 10]
            alone = per_call_us(fn, data, args.seconds)
            stop = threading.Event()

            def spin() -> None:
                n = 0
                while not stop.is_set():
                    n += 1
            spinner = threading.Thread(target=spin, daemon=True)
            spinner.start()
            time.sleep(0.02)
            try:
                busy = per_call_us(fn, data, args.seconds)
            finally:
                stop.set()
                spinner.join()
            cells.append(f"{alone:9.1f} / {busy:8.1f}")
        print(f"{name:14s}" + "".join(f"{c:>22s}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
