"""What a command prints of a publisher's text (an article's id or title) on a terminal: shown,
never obeyed (``escaped``, ``json_escaped``). ``newsvec search`` and ``newsvec check-model`` print
through them."""
from __future__ import annotations


def escaped(text: str) -> str:
    """``text`` (an article's id or title: a publisher's) with every character that is not
    printable (C0 and C1 controls, which start terminal escape sequences; format characters such
    as a right-to-left override; line and paragraph separators) written as ``\\xNN``,
    ``\\uNNNN`` or ``\\UNNNNNNNN``: it is shown, never obeyed by the terminal."""
    return "".join(ch if ch.isprintable() else
                   f"\\x{ord(ch):02x}" if ord(ch) < 0x100 else
                   f"\\u{ord(ch):04x}" if ord(ch) < 0x10000 else f"\\U{ord(ch):08x}"
                   for ch in text)


def json_escaped(line: str) -> str:
    """A JSON line with every character that is not printable as a ``\\uNNNN`` escape (a pair
    beyond the BMP): the same JSON values, nothing a terminal obeys. Such characters can only be
    inside its strings, where the escape is valid."""
    def escape(ch: str) -> str:
        code = ord(ch)
        if code < 0x10000:
            return f"\\u{code:04x}"
        code -= 0x10000
        return f"\\u{0xD800 + (code >> 10):04x}\\u{0xDC00 + (code & 0x3FF):04x}"

    return "".join(ch if ch.isprintable() else escape(ch) for ch in line)
