"""The ``lmshm`` command.

``lmshm status`` asks a running lmshm-server what it has mapped. STATUS needs no session, so
this command never registers anything and leaves no trace on the server. It lists the first
``--limit`` registrations (default 50), oldest first; when there are more, it says how many and
adds one line per owner (a worker's session, or the regions), so its cost does not grow with
the registrations. ``--all`` lists every one (one request per 1,000), ``--offset`` starts later.
Exit status: 0 on an answer, 1 when the server did not answer or refused.

``lmshm gc`` removes orphaned shared-memory names (``lmshm.platform.shm_orphans``) without
talking to any server and without importing torch. Exit status: 0, also when there was
nothing to remove or an entry could not be removed; 1 when the directory is unusable.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from typing import Optional, Sequence


def _human_bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return str(n)


def _human_age(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"
    return f"{int(seconds // 3600)}h{int(seconds % 3600 // 60):02d}m"


def _status_row(r) -> tuple[str, ...]:
    kind = getattr(r, "kind", "kv")  # servers before protocol 3.1 send no kind: all are KV caches
    if kind == "kv":
        block_dim = getattr(r, "block_dim", 0)  # 3.2; a block dim other than 0 is shown after the layers
        layers = f"{r.num_layers} (block dim {block_dim})" if block_dim else str(r.num_layers)
        return (r.instance_id, str(r.owner_pid), r.model_name or "-", f"{r.worker_rank}/{r.world_size}",
                layers, _human_bytes(r.nbytes), ",".join(r.kinds), ",".join(r.devices), _human_age(r.age_s))
    where = f"{r.key} +{r.offset}" if kind == "system" else f"device {r.device_id}"
    return (r.instance_id, "-", where, "-", "-", _human_bytes(r.nbytes), f"{kind} region ({r.client_name or '-'})",
            ",".join(r.devices), _human_age(r.age_s))


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(header)]
    return ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in [header, *rows]]


def _owner_row(o) -> tuple[str, ...]:
    if o.kind == "regions":
        return ("regions", "-", "-", "-", f"{o.registrations:,}", "-", _human_bytes(o.nbytes))
    return (str(o.owner_pid), str(o.owner_uid), str(o.owner_session), o.client_name or "-", f"{o.registrations:,}",
            f"{o.layers:,}", _human_bytes(o.nbytes))


def format_status_table(status) -> str:
    """A plain-text table of a ``StatusReply``: one row per registration listed; when it lists
    fewer than there are, a line saying so and one row per owner."""
    total = getattr(status, "registrations_total", -1)   # 3.4; a 3.3 server lists every one
    listed = len(status.registrations)
    total = listed if total < 0 else total
    header = ("NAME", "OWNER PID", "MODEL / KEY", "RANK", "LAYERS", "BYTES", "KIND", "DEVICE", "AGE")
    rows = [_status_row(r) for r in status.registrations]
    lines = [
        f"lmshm-server pid {status.server_pid}, up {_human_age(status.uptime_s)}, "
        f"isolated_ipc={'on' if status.isolated_ipc else 'off'}, {status.sessions} session(s), "
        f"{total:,} registration(s), {status.mappings} mapping(s), "
        f"{status.open_fds} open fds of {status.fd_limit}" + (f", {status.inbox_fds} fds unmapped" if status.inbox_fds else "")
        + (f", {status.draining} draining" if status.draining else ""),
        *_table(header, rows),
    ]
    if not rows:
        lines.append("(no registrations)" if not total else "(none listed)")
    if listed < total:
        first = getattr(status, "offset", 0)
        shown = f"registrations {first + 1:,}-{first + listed:,}" if listed else "no registration"
        lines.append(f"{shown} of {total:,} listed, oldest first; lmshm status --all lists every one, "
                     "--offset N --limit M a page")
        owners = getattr(status, "owners", [])
        if owners:
            lines.append("by owner:")
            lines += _table(("OWNER PID", "UID", "SESSION", "CLIENT", "REGISTRATIONS", "LAYERS", "BYTES"),
                            [_owner_row(o) for o in owners])
    p = status.pool
    if p.capacity:
        lines.append(
            f"pool: {_human_bytes(p.used)} of {_human_bytes(p.capacity)} used"
            + (f" ({_human_bytes(p.metadata_bytes)} of it bookkeeping)" if p.metadata_bytes else "")
            + f", {p.objects} object(s)" + (f" (+{p.in_flight} in flight)" if p.in_flight else "")
            + (f" of at most {p.max_objects}" if p.max_objects else "")
            + f", {p.pinned} pinned" + (f" ({_human_bytes(p.pinned_bytes)})" if p.pinned_bytes else "")
            + f", {p.leases} lease(s)" + (f" holding {p.lease_pins} pin(s)" if p.lease_pins else "")
            + (f", {p.uids} uids" if p.uids > 1 else "")
            + f"; {p.hits} hit(s), {p.misses} miss(es), {p.stored} stored, "
            f"{p.retrieved} retrieved, {p.store_skipped} store(s) skipped, {p.evictions} eviction(s)"
            + (f", {p.pins_capped} chunk(s) found but not pinned (per-uid caps)" if p.pins_capped else "")
            + (f", {p.failed} failed" if p.failed else "")
            + (f", {p.late} too late for their sender (not copied or not committed)" if getattr(p, "late", 0) else ""))
        path = getattr(p, "cuda_copy_path", "")
        if p.cuda_pinned_bytes or p.cuda_quarantined or p.cuda_events_dropped or path:
            lines.append(f"cuda: {_human_bytes(p.cuda_pinned_bytes)} of the pool page-locked"
                         + (f", copies {'in one cuMemcpyBatchAsync per request' if path == 'batch' else path}"
                            f" ({p.cuda_copy_calls} driver call(s), {p.cuda_copy_pieces} piece(s))" if path else "")
                         + (f", {p.cuda_quarantined} request(s) past --cuda-timeout (their bytes held until the "
                            "GPU was done)" if p.cuda_quarantined else "")
                         + (f", {p.cuda_events_dropped} server event(s) let go early (per-session cap)"
                            if p.cuda_events_dropped else ""))
    else:
        lines.append("pool: none (lmshm-server --capacity 0)")
    for t in getattr(p, "tiers", ()):   # 3.5
        lines.append(
            f"{t.name}: {_human_bytes(t.used)} of {_human_bytes(t.capacity)} used, {t.objects} chunk(s); "
            f"{t.hits} hit(s), {t.misses} miss(es), {t.promotions} promoted, {t.puts} written, "
            f"queue {t.queue_depth}/{t.queue_limit}, {t.drops} dropped, {t.errors} error(s), {t.timeouts} timeout(s), "
            f"{t.corrupt} corrupt, {t.evictions} eviction(s)"
            + (f", {t.direct_writes} written direct (O_DIRECT)" if t.direct_writes else "")
            + (f", {t.not_admitted} not admitted (first stores)" if t.not_admitted else "")
            + (f"; index rebuild: {t.scanned} file(s) scanned" + ("" if getattr(t, "scan_done", True) else
               ", still running (a chunk not reached yet is probed on disk)")
               + (f", {t.probed} found by a probe" if getattr(t, "probed", 0) else "") if getattr(t, "scanned", 0)
               or not getattr(t, "scan_done", True) or getattr(t, "probed", 0) else "")
            + (f"; read {t.read_seconds / t.reads * 1e3:.2f} ms mean" if t.reads else "")
            + (f", write {t.write_seconds / t.writes * 1e3:.2f} ms mean" if t.writes else ""))
    return "\n".join(lines)


def _count(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {text!r}")
    return n


def _status(args: argparse.Namespace) -> int:
    # lazy, here and in _gc: each subcommand imports only what it runs (`lmshm status` stays torch-free)
    from lmshm.transport.client import LmshmError, query_status, status_as_dict

    try:
        status = query_status(args.url, timeout_s=args.timeout, offset=args.offset,
                              limit=None if args.all else args.limit)
    except LmshmError as exc:
        print(f"lmshm status: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(status_as_dict(status), indent=2))
    else:
        print(format_status_table(status))
    return 0


GC_DESCRIPTION = """\
Remove orphaned lmshm shared memory: names left in the shm directory by a worker that died
(SIGKILL, OOM kill) before its memory was registered or reclaimed.

Removed: a regular file named exactly lmshm-<pid>-<pid-ns>-<random>, owned by you, made in
this PID namespace, whose creator pid no longer exists. Mappings that still use the memory
stay valid; only the name goes.

Never touched: other names (lmshm-foo, names of older lmshm versions, anything not starting
with lmshm-), symlinks and other non-files, other users' files, names made in another PID
namespace (a container sharing /dev/shm: run lmshm gc there), and names of live pids (a
reused pid keeps the name until it exits too).
"""


def _gc(args: argparse.Namespace) -> int:
    from lmshm.platform.shm_names import shm_dir
    from lmshm.platform.shm_orphans import sweep_orphans

    directory = args.shm_dir or shm_dir()
    try:
        result = sweep_orphans(directory, dry_run=args.dry_run)
    except OSError as exc:
        print(f"lmshm gc: cannot sweep {directory}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result.as_dict(), indent=2))
        return 0
    verb = "would remove" if result.dry_run else "removed"
    for name in result.removed:
        print(f"{verb} {name}")
    reasons = ", ".join(f"{r} {n}" for r, n in sorted(result.skipped.items()))
    print(f"lmshm gc {result.shm_dir}: {verb} {len(result.removed)}, "
          f"skipped {result.skipped_total}" + (f": {reasons}" if reasons else ""))
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="lmshm", description="Talk to a running lmshm-server, or clean up after dead workers.")
    sub = parser.add_subparsers(dest="command", required=True)
    st = sub.add_parser("status", help="print the server's registrations")
    st.add_argument("--url", help="server endpoint (LMSHM_URL; default tcp://127.0.0.1:5555)")
    st.add_argument("--json", action="store_true",
                    help="print the status as JSON (the registrations listed, as in the table)")
    st.add_argument("--all", action="store_true", help="list every registration (one request per 1,000)")
    st.add_argument("--limit", type=_count, default=50, metavar="N",
                    help="list at most N registrations, oldest first (default 50); with more, a line per owner "
                         "sums them up")
    st.add_argument("--offset", type=_count, default=0, metavar="N", help="skip the N oldest registrations")
    st.add_argument("--timeout", type=float, default=5.0, metavar="SECONDS", help="how long to wait (default 5)")
    st.set_defaults(func=_status)
    gc = sub.add_parser("gc", help="remove shared memory left by dead workers",
                        description=GC_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    gc.add_argument("--shm-dir", metavar="DIR",
                    help="directory to sweep (default: LMSHM_SHM_DIR, else /dev/shm)")
    gc.add_argument("--dry-run", action="store_true", help="list what would be removed; remove nothing")
    gc.add_argument("--json", action="store_true", help="print the result as JSON")
    gc.set_defaults(func=_gc)
    args = parser.parse_args(argv)
    try:
        rc = args.func(args)
        sys.stdout.flush()          # here, not at exit, so that a closed pipe is caught below
        return rc
    except BrokenPipeError:
        # The reader went away (`lmshm status | head`): stop quietly, as a command killed by
        # SIGPIPE would, and point stdout at /dev/null so the interpreter's final flush is silent.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
