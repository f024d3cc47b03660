"""lmshm-server's open file descriptors over many register/unregister cycles in isolated mode. A script, not a test.

    .venv/bin/python bench/fd_cycles.py [--cycles 10000] [--every 1000] [--seconds 150] [--same-pool]

Starts lmshm-server as a subprocess with ``--isolated-ipc`` (tcp://127.0.0.1, a free port, its fd
socket in a temporary directory) and one worker process with ``LMSHM_ISOLATED_IPC=1``, so CPU
memory is a memfd and travels as a file descriptor over the fd socket at every registration. The
worker opens an ``MPClient(url)`` and runs ``--cycles`` cycles of register + unregister of 32
layers: by default a fresh small pool each cycle, ``empty_shared((32, 2, 4, 16, 8, 8), fp16)``
(512 KiB, 32 views of one memfd: one fd per registration), dropped after its unregister; with
``--same-pool`` the same pool every cycle under a new instance id (which re-sends its fd each
time). The worker stops at cycle 0 (connected, nothing registered yet), after every ``--every``
cycles and at the end, and waits while this script reads, from outside the server:
- ``server fds``: ``len(os.listdir(f"/proc/{server_pid}/fd"))``;
- ``lmshm maps``: lines of /proc/{server_pid}/maps that name an lmshm segment;
- ``status maps``: the ``mappings`` field of ``query_status(url)`` (the server's own count);
- ``worker fds``: the worker's own open fds, as a control.
The delta of the server's fd count from cycle 0 to the end is the figure: with every fd released
at unregister it stays 0. Then the worker closes its client and exits, and the server's fd count
is read again after its session ends. Bounded: the worker stops at ``--seconds`` (default 150) even
if the server slows down or fails, and gives up after 20 failed cycles in a row; a failure does
not stop the run (exit status 1 then). The server gets SIGTERM at the end and must exit 0.
"""

from __future__ import annotations

import argparse
import os
import selectors
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import parse_args
from _server import BenchServer

POOL_SHAPE = (32, 2, 4, 16, 8, 8)
MAX_CONSECUTIVE_FAILURES = 20


# ---- worker -------------------------------------------------------------------------------


def worker_main(url: str, cycles: int, every: int, same_pool: bool, deadline: float) -> int:
    """Lines on stdout: 'at|end N FAILED OWN_FDS [note]', each answered by 'go' on stdin; then 'closed ...'."""
    import torch

    import lmshm

    def pool() -> dict[str, torch.Tensor]:
        p = lmshm.empty_shared(POOL_SHAPE, torch.float16)
        return {f"model.layers.{i}.attn": p[i] for i in range(POOL_SHAPE[0])}

    def checkpoint(kind: str, n: int, failed: int, note: str = "", wait: bool = True) -> bool:
        own = len(os.listdir("/proc/self/fd"))
        print(f"{kind} {n} {failed} {own} {note}".rstrip(), flush=True)
        return not wait or sys.stdin.readline().strip() == "go"

    client = lmshm.MPClient(url, timeout_s=5.0)
    n = failed = consecutive = 0
    reason = "done"
    last_error = ""
    try:
        layers = pool() if same_pool else None
        if not checkpoint("at", 0, 0):
            return 3
        while n < cycles:
            if time.monotonic() > deadline:
                reason = "time cap"
                break
            these = layers if same_pool else pool()
            iid = None
            try:
                iid = client.register_kv_caches(these, f"fd-{n}")
                client.unregister_kv_caches(iid)
                consecutive = 0
            except Exception as exc:
                failed += 1
                consecutive += 1
                last_error = f"{type(exc).__name__}: {exc}".replace("\n", " ")[:200]
                if iid is not None and iid in getattr(client, "registered", list)():
                    try:
                        client.unregister_kv_caches(iid)
                    except Exception:
                        pass
            del these
            n += 1
            if consecutive >= MAX_CONSECUTIVE_FAILURES:
                reason = f"{consecutive} failures in a row"
                break
            if n % every == 0 and n < cycles and not checkpoint("at", n, failed, last_error):
                return 3
        checkpoint("end", n, failed, f"{reason}|{last_error}")
    finally:
        layers = None
        client.close()
    checkpoint("closed", n, failed, wait=False)
    return 0


# ---- driver -------------------------------------------------------------------------------


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _lmshm_maps(pid: int) -> int:
    with open(f"/proc/{pid}/maps") as f:
        return sum(1 for line in f if "lmshm" in line)


def _status_mappings(url: str) -> str:
    from lmshm.transport.client import query_status

    try:
        st = query_status(url, timeout_s=5.0)
    except Exception as exc:
        return f"({type(exc).__name__})"
    return str(st.mappings)


def _readline(proc: subprocess.Popen, timeout_s: float) -> str:
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    try:
        if not sel.select(timeout_s):
            raise TimeoutError(f"the worker said nothing for {timeout_s:.0f} s")
    finally:
        sel.close()
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"the worker exited (rc {proc.wait()}) early")
    return line.rstrip("\n")


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--_worker":
        url, cycles, every, same, deadline = sys.argv[2:7]
        return worker_main(url, int(cycles), int(every), same == "1", float(deadline))

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cycles", type=int, default=10000, help="register/unregister cycles (default 10000)")
    ap.add_argument("--every", type=int, default=1000, help="read the fd count every N cycles (default 1000)")
    ap.add_argument("--seconds", type=float, default=150.0,
                    help="stop the cycles after this many seconds whatever the count (default 150)")
    ap.add_argument("--same-pool", action="store_true",
                    help="register the same pool every cycle under a new id (default: a fresh pool per cycle)")
    args = parse_args(ap, smoke={"cycles": 20, "every": 10, "seconds": 10.0})
    if args.cycles < 1 or args.every < 1:
        ap.error("--cycles and --every must be positive")

    import torch
    import zmq

    server = BenchServer("--isolated-ipc")
    worker = None
    server_rc = None
    ok = True
    try:
        url, spid = server.url, server.pid
        print(f"Python {sys.version.split()[0]}, torch {torch.__version__}, pyzmq {zmq.__version__} "
              f"(libzmq {zmq.zmq_version()}), {os.cpu_count()} CPUs; server at {url} (pid {spid}), isolated_ipc on")
        nbytes = 2 * torch.Size(POOL_SHAPE).numel()
        print(f"{args.cycles} cycles of register + unregister, {POOL_SHAPE[0]} layers as views of "
              f"{'the same pool every cycle' if args.same_pool else 'a fresh pool per cycle'} "
              f"{list(POOL_SHAPE)} fp16 ({nbytes >> 10} KiB, one memfd); cap {args.seconds:g} s")
        fds_start = _fds(spid)
        print(f"\nserver fds at start (no worker): {fds_start}; lmshm maps {_lmshm_maps(spid)}; "
              f"status maps {_status_mappings(url)}; RLIMIT_NOFILE here {os.sysconf('SC_OPEN_MAX')}\n")
        print(f"{'cycles':>7}  {'server fds':>10}  {'delta':>6}  {'lmshm maps':>10}  {'status maps':>11}  "
              f"{'worker fds':>10}  {'failed':>6}  {'elapsed s':>9}")  # elapsed: since cycle 0

        t0 = t_spawn = time.monotonic()
        deadline = t0 + args.seconds
        env = dict(os.environ, LMSHM_ISOLATED_IPC="1")
        worker = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--_worker", url, str(args.cycles),
                                   str(args.every), "1" if args.same_pool else "0", repr(deadline)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1, env=env)
        base = None
        rows: list[tuple[int, int]] = []
        end_note = ""
        while True:
            line = _readline(worker, max(30.0, deadline - time.monotonic() + 30.0))
            kind, n, failed, wfds, *rest = line.split(" ", 4)
            if kind == "closed":
                break
            fds = _fds(spid)  # before query_status, whose own connection would count
            maps = _lmshm_maps(spid)
            status = _status_mappings(url)
            if base is None:
                base = fds
                t0 = time.monotonic()  # from cycle 0: the worker's start-up (imports) is not counted
            rows.append((int(n), fds))
            print(f"{n:>7}  {fds:>10}  {fds - base:>+6}  {maps:>10}  {status:>11}  {wfds:>10}  {failed:>6}  "
                  f"{time.monotonic() - t0:>9.1f}", flush=True)
            if kind == "end":
                end_note = rest[0] if rest else ""
            worker.stdin.write("go\n")
            worker.stdin.flush()
        worker_rc = worker.wait(30)
        t_cycles = time.monotonic() - t0
        startup = t0 - t_spawn

        n_done, fds_end = rows[-1]
        reason, _, last_error = end_note.partition("|")
        delta = fds_end - base
        print(f"\nfinal delta over {n_done} cycles: {delta:+d} server fds "
              f"({delta / max(1, n_done) * 1000:+.0f} per 1000 cycles); stopped: {reason or '?'}"
              f"; {int(failed)} failed cycles")
        if last_error:
            print(f"last error: {last_error}")
        if n_done < args.cycles:
            print(f"WARNING: only {n_done} of {args.cycles} cycles ran")
            ok = False
        if int(failed):
            ok = False
        # After the worker exits the server ends its session (pidfd), which also closes what the
        # session still holds; give it a moment.
        settle = time.monotonic() + 3.0
        while True:
            after = _fds(spid)
            if after <= fds_start or time.monotonic() > settle:
                break
            time.sleep(0.05)
        print(f"after the worker closed and exited (rc {worker_rc}): server fds {after} "
              f"({after - fds_start:+d} vs start), lmshm maps {_lmshm_maps(spid)}, status maps {_status_mappings(url)}")
        print(f"{n_done} cycles in {t_cycles:.1f} s from cycle 0, including the readings "
              f"({n_done / max(t_cycles, 1e-9):.0f} cycles/s); worker start-up {startup:.1f} s")
        if worker_rc != 0:
            print(f"WARNING: the worker exited with status {worker_rc}")
            ok = False
    finally:
        if worker is not None:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
            for f in (worker.stdin, worker.stdout):
                try:
                    f.close()
                except OSError:
                    pass
        server_rc = server.stop()
    if server_rc != 0:
        print(f"WARNING: lmshm-server exited with status {server_rc} after SIGTERM")
        ok = False
    else:
        print(f"lmshm-server exited {server_rc}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
