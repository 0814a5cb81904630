"""User text made safe for a terminal or a log line, where no escaping happens downstream.

Step names, error messages, params, outputs, payloads, attributes and actors are user data.
Written raw to an operator's terminal, their control characters act on it (ESC starts
sequences that clear the screen, set the window title, print OSC 8 links; CR and BS
overwrite what was printed), a newline starts a line that looks like the tool's own,
and bidi controls (U+202E RIGHT-TO-LEFT OVERRIDE and its kin) reorder what is read.
These helpers show such characters as escapes and leave every other character as is.
"""

from __future__ import annotations

import json
import re
from typing import Any

from django.core.serializers.json import DjangoJSONEncoder

# Bidi controls (Unicode's Bidi_Control property: ALM, LRM, RLM, the embeddings and
# overrides, the isolates) and the line and paragraph separators some readers break on.
_BIDI_AND_SEPARATORS = "\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069"
# Lone surrogates: Python keeps undecodable bytes as them; no UTF-8 stream can carry one.
_SURROGATES = "\ud800-\udfff"
# What a terminal acts on: C0 but tab and newline, DEL, C1, and the above.
_TERMINAL_UNSAFE = re.compile(
    f"[\\x00-\\x08\\x0b-\\x1f\\x7f-\\x9f{_BIDI_AND_SEPARATORS}{_SURROGATES}]"
)
# One field of a line or a table row: tab and newline too.
_LINE_UNSAFE = re.compile(f"[\\x00-\\x1f\\x7f-\\x9f{_BIDI_AND_SEPARATORS}{_SURROGATES}]")
# What json.dumps(ensure_ascii=False) leaves raw of the above (it escapes C0 itself).
_JSON_UNSAFE = re.compile(f"[\\x7f-\\x9f{_BIDI_AND_SEPARATORS}{_SURROGATES}]")

_NAMED = {"\t": "\\t", "\n": "\\n", "\r": "\\r"}


def _escape(match: re.Match[str]) -> str:
    char = match.group()
    code = ord(char)
    return _NAMED.get(char) or (f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")


def printable(text: str) -> str:
    """text for a terminal: its lines kept, every character a terminal would act on
    (escape sequences, CR, BS, bidi controls) shown as \\xNN or \\uNNNN."""
    return _TERMINAL_UNSAFE.sub(_escape, text)


def first_line(exc: BaseException) -> str:
    """An error's message on one line (a database's may add DETAIL and HINT lines)."""
    lines = str(exc).strip().splitlines()
    return lines[0].strip() if lines else type(exc).__name__


def one_line(text: str) -> str:
    """A user's text as one field of a line (a table cell, "error: …", a log line's
    part): printable(), and its newlines and tabs shown as \\n and \\t, so it cannot
    end the line and start one that reads as the tool's own."""
    return _LINE_UNSAFE.sub(_escape, text)


def terminal_json(value: Any, *, indent: int | None = None) -> str:
    """JSON text (non-ASCII kept readable) that is safe on a terminal: the characters
    json.dumps leaves raw that a terminal acts on (DEL, C1, bidi controls, line
    separators, lone surrogates) written as \\uNNNN escapes, which parse to the same
    string. They can only occur inside JSON strings, where such an escape is valid."""
    separators = None if indent is not None else (",", ":")
    text = json.dumps(
        value, cls=DjangoJSONEncoder, indent=indent, ensure_ascii=False, separators=separators
    )
    return _JSON_UNSAFE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)
