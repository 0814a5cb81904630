"""Search attributes: small typed key/value pairs an instance is found by.

Values are str, int, float or bool, so an exact-match filter means the same on both
databases: a JSON object of scalars on the instance, mirrored one row per key (its value
as index_text) in the indexed table the filters read.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping

from .errors import InvalidInput, LimitExceeded, shown
from .limits import check_text

KEY_PATTERN = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,63}\Z")
MAX_ATTRIBUTES = 32  # keys per instance
MAX_VALUE_CHARS = 256  # a string value
INT64 = 2**63  # integers beyond it do not round-trip through every JSON column
Scalar = str | int | float | bool
# From here on a whole float's JSON is 1e+16: PostgreSQL's jsonb stores it as the number
# 10000000000000000 and gives it back as an integer, so Instance.attributes would read
# another type (and past 64 bits a value no filter takes) than SQLite's.
WHOLE_FLOATS_READ_AS_INTEGERS = 1e16


def check_key(key: object) -> str:
    if not isinstance(key, str) or not KEY_PATTERN.match(key):
        raise InvalidInput(
            f"invalid attribute key {key!r}: 1-64 letters, digits, '_', '.' or '-', "
            "starting with a letter or '_'"
        )
    return key


def check_value(key: str, value: object) -> Scalar:
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        if not -INT64 <= value < INT64:
            raise InvalidInput(f"attribute {key!r}: integer {shown(value)} is outside 64 bits")
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidInput(f"attribute {key!r}: {value} is not a finite number")
        if value.is_integer() and abs(value) >= WHOLE_FLOATS_READ_AS_INTEGERS:
            raise InvalidInput(
                f"attribute {key!r}: the float {value!r} is a whole number PostgreSQL's JSON "
                "reads back as an integer; give it as an integer (within 64 bits)"
            )
        return value + 0.0  # -0.0 as 0.0, as PostgreSQL's JSON (no negative zero) keeps it
    if isinstance(value, str):
        check_text(value, f"attribute {key!r}")
        if len(value) > MAX_VALUE_CHARS:
            raise LimitExceeded(
                "max attribute value length", len(value), MAX_VALUE_CHARS, f"attribute {key!r}"
            )
        return value
    raise InvalidInput(
        f"attribute {key!r}: values must be a string, integer, float or boolean, "
        f"got {type(value).__name__}"
    )


def check_attributes(attributes: object, what: str = "attributes") -> dict[str, Scalar]:
    """A validated copy of attributes; InvalidInput / LimitExceeded naming what was wrong."""
    if attributes is None:
        return {}
    if not isinstance(attributes, Mapping):
        raise InvalidInput(
            f"{what} must be an object of key: value, got {type(attributes).__name__}"
        )
    if len(attributes) > MAX_ATTRIBUTES:
        raise LimitExceeded("max attributes", len(attributes), MAX_ATTRIBUTES, what)
    return {check_key(k): check_value(k, v) for k, v in attributes.items()}


def index_text(value: Scalar) -> str:
    """The text a value is stored under in the attribute rows and looked up by: its JSON,
    with a float that is a whole number in the 64-bit range spelled as that integer. So a
    filter keeps the JSON filter's types: 1 finds 1 and 1.0, true is not 1, "1" is not 1."""
    if isinstance(value, float) and value.is_integer() and -INT64 <= value < INT64:
        value = int(value)
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def parse_value(text: str) -> Scalar:
    """A filter value typed on a command line or in a query string: a JSON number, true
    or false is that type ("5" finds the integer 5); a JSON string ('"5"') or anything
    else is a string."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    if isinstance(value, (bool, int, float, str)) and not (
        isinstance(value, float) and not math.isfinite(value)
    ):
        return value
    return text


def parse_filter(pairs: Mapping[str, str]) -> dict[str, Scalar]:
    """key -> typed text, as from `?attr.k=v` or `--attr k=v`, into a checked filter."""
    return check_attributes({k: parse_value(v) for k, v in pairs.items()}, "attribute filter")
