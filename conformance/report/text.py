"""Text from backends and sets, made safe for a terminal and for XML."""

from __future__ import annotations

import re

# control characters (C0 but tab and newline, DEL, C1), lone surrogates and the XML non-characters:
# a terminal acts on them (ESC starts an escape sequence, C1 0x9b too) and XML 1.0 cannot hold them
_UNPRINTABLE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff\ufffe\uffff]")


def printable(text: str) -> str:
    """``text`` with every control character written as a visible escape (ESC as ``\\x1b``, NUL as
    ``\\x00``): safe for a terminal and for XML. Tabs and newlines stay. Text from a backend or a set
    (exception messages, an engine's stderr, case ids) goes through this before it reaches the console
    or JUnit; the JSON report keeps it as it was (JSON escapes control characters itself)."""
    return _UNPRINTABLE.sub(_escape, str(text))


def _escape(m: re.Match) -> str:
    c = ord(m.group())
    return f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}"


