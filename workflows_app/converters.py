"""The `pk` path converter: an instance pk the database can hold.

Django's `int` takes any number of digits; a pk of 2**63 or more then overflows the
bigint column (a 500 on SQLite and PostgreSQL alike). This one matches 1-18 digits, so
larger numbers are a plain 404.
"""

from __future__ import annotations

from django.urls import register_converter


class PkConverter:
    regex = "[0-9]{1,18}"

    def to_python(self, value: str) -> int:
        return int(value)

    def to_url(self, value: int) -> str:
        return str(value)


register_converter(PkConverter, "pk")
