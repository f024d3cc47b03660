"""The ``lmshm`` command. ``lmshm status`` asks a running lmshm-server what it has mapped.

STATUS needs no session, so this command never registers anything and leaves no trace on
the server. Exit status: 0 on an answer, 1 when the server did not answer or refused.
"""

from __future__ import annotations

import argparse
import json
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


def format_status_table(status) -> str:
    """A plain-text table of a ``StatusReply``: one row per registration."""
    header = ("INSTANCE", "OWNER PID", "MODEL", "RANK", "LAYERS", "BYTES", "KIND", "DEVICE", "AGE")
    rows = [
        (r.instance_id, str(r.owner_pid), r.model_name or "-", f"{r.worker_rank}/{r.world_size}",
         str(r.num_layers), _human_bytes(r.nbytes), ",".join(r.kinds), ",".join(r.devices), _human_age(r.age_s))
        for r in status.registrations
    ]
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(header)]
    lines = [
        f"lmshm-server pid {status.server_pid}, up {_human_age(status.uptime_s)}, "
        f"isolated_ipc={'on' if status.isolated_ipc else 'off'}, {status.sessions} session(s), "
        f"{len(status.registrations)} registration(s), {status.mappings} mapping(s)"
        + (f", {status.draining} draining" if status.draining else ""),
        "  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip(),
    ]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    if not rows:
        lines.append("(no registrations)")
    return "\n".join(lines)


def _status(args: argparse.Namespace) -> int:
    from lmshm.multiprocess.client import LmshmError, query_status, status_as_dict

    try:
        status = query_status(args.url, timeout_s=args.timeout)
    except LmshmError as exc:
        print(f"lmshm status: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(status_as_dict(status), indent=2))
    else:
        print(format_status_table(status))
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="lmshm", description="Talk to a running lmshm-server.")
    sub = parser.add_subparsers(dest="command", required=True)
    st = sub.add_parser("status", help="print the server's registrations")
    st.add_argument("--url", help="server endpoint (LMSHM_URL; default tcp://127.0.0.1:5555)")
    st.add_argument("--json", action="store_true", help="print the full status as JSON")
    st.add_argument("--timeout", type=float, default=5.0, metavar="SECONDS", help="how long to wait (default 5)")
    st.set_defaults(func=_status)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
