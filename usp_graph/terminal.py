"""Text from files, made safe to print on a terminal (issue 31).

Graph files, compile dump manifests and the messages that quote them carry names, sites, source
lines and refusal reasons that anyone may have written. Printed as they are, one crafted file could
retitle the terminal or clear it (ESC sequences), or start a line of its own (a newline or a
carriage return before a fake ``verify: ok``). Everything the CLI prints from a file goes through
`escape`. No torch import here: ``usp-graph --help`` and usage errors stay fast.
"""

from __future__ import annotations

from typing import Any

__all__ = ["escape"]

_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escaped(c: str) -> str:
    if c in _NAMED:
        return _NAMED[c]
    o = ord(c)
    return f"\\x{o:02x}" if o < 0x100 else (f"\\u{o:04x}" if o < 0x10000 else f"\\U{o:08x}")


def escape(v: Any) -> str:
    """``str(v)`` as one printable line: every character Python does not call printable (C0 and C1
    controls, DEL, line and paragraph separators, bidi overrides and other format characters,
    unassigned code points) written as its escape, ESC as ``\\x1b``, a newline as ``\\n``; the
    rest (non-ASCII letters included) as it is."""
    s = v if isinstance(v, str) else str(v)
    if s.isprintable():
        return s
    return "".join(c if c.isprintable() else _escaped(c) for c in s)
