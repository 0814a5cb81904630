"""Instance pks from URLs and forms: only those the database can hold.

Django's `int` converter takes any number of digits; a pk of 2**63 or more then overflows
the bigint column (a 500 on SQLite and PostgreSQL alike). The `pk` converter makes such
a URL a plain 404, and forms and sockets use the same bound.
"""

from __future__ import annotations

import re

from django.urls import register_converter

MAX_PK = 2**63 - 1  # the largest value of a bigint column
_DIGITS = re.compile(r"[0-9]{1,19}")  # ASCII digits only: "²".isdigit() is True


def parse_pk(text: str) -> int | None:
    """The pk `text` spells, or None if it is not one (not ASCII digits, 0, or past MAX_PK)."""
    if not _DIGITS.fullmatch(text):
        return None
    pk = int(text)
    return pk if 0 < pk <= MAX_PK else None


class PkConverter:
    regex = "[0-9]{1,19}"

    def to_python(self, value: str) -> int:
        pk = parse_pk(value)
        if pk is None:
            raise ValueError(f"{value} is not a pk")  # the URL does not match: a 404
        return pk

    def to_url(self, value: int) -> str:
        return str(value)


register_converter(PkConverter, "pk")
