"""Making text read from Redis safe to print: anything there may hold terminal escape sequences (clear the
screen, write the clipboard), bidi overrides or rich console markup. Every value the CLI prints from Redis
goes through :func:`printable` (plain text) or :func:`json_safe` (inside JSON output), and reaches rich as
a ``Text`` object, never as a markup string.
"""

from __future__ import annotations

import re
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console

#: Width of tables printed to a pipe or file: nothing is cut to fit an imagined 80-column terminal.
PIPE_WIDTH = 1000

# C0 controls (ESC, BEL, CR, ...), DEL, C1 controls, bidi embeddings/overrides/isolates and LRM/RLM.
_TERMINAL = "\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069\u2028\u2029"
_UNSAFE = re.compile(f"[\x00-\x1f{_TERMINAL}]")
_UNSAFE_KEEP_LINES = re.compile(f"[\x00-\x08\x0b-\x1f{_TERMINAL}]")


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group(0))
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def console(stderr: bool = False) -> Console:
    """A rich console: the terminal's width on a terminal; on a pipe or file, wide enough that no cell
    is cut (``closed (finis…``) -- tables still take only the width their contents need."""
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    return Console(stderr=stderr, width=None if stream.isatty() else PIPE_WIDTH)


def printable(value: Any, limit: int | None = None, keep_newlines: bool = False) -> str:
    """``value`` as text with every control or bidi character shown as an escape (``\\x1b``), cut to
    ``limit`` characters (with ``…``) if given. Bytes are decoded as UTF-8 with replacement."""
    text = value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
    if limit is not None and len(text) > limit:
        text = text[:limit] + "…"
    return (_UNSAFE_KEEP_LINES if keep_newlines else _UNSAFE).sub(_escape, text)


def json_safe(document: str) -> str:
    """A JSON document (from ``json.dumps(..., ensure_ascii=False)``) with the characters JSON leaves
    unescaped but a terminal obeys (DEL, C1 controls, bidi controls) written as ``\\uXXXX`` escapes --
    still the same JSON (they can only occur inside strings)."""
    return re.sub(f"[{_TERMINAL}]", lambda m: f"\\u{ord(m.group(0)):04x}", document)
