"""How peer data appears in error messages and logs: quoted, and never longer than a limit.

A peer's strings and numbers may be megabytes long; every message that mentions one goes
through ``quote`` so that a hostile value costs a few dozen bytes of output, never its size.
"""

from __future__ import annotations

from typing import Any

#: Integers at least this large are described by their size instead of printed.
_BIG_INT = 1 << 64


def quote(value: Any, limit: int = 80) -> str:
    """``repr(value)`` cut to about ``limit`` characters."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= _BIG_INT:
        return f"<int of {value.bit_length()} bits>"
    if isinstance(value, (str, bytes, bytearray, list, tuple)) and len(value) > limit:
        return f"{repr(value[:limit])[:limit]}... ({len(value)} in all)"
    if isinstance(value, dict) and len(value) > 8:
        return f"<dict of {len(value)} items>"
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def clip(text: str, limit: int = 1024) -> str:
    """A message cut to ``limit`` characters (for replies built from several quoted parts)."""
    return text if len(text) <= limit else text[: limit - 20] + f"... ({len(text)} chars)"
