"""Values at rest: the optional payload codec and sensitive step outputs.

Params, outputs and event payloads are stored as JSON text (see models.py). When
`settings.WFDASH["PAYLOAD_CODEC"]` names a class with `encode(bytes) -> bytes` and
`decode(bytes) -> bytes` (Fernet encryption, say), that text is stored as an envelope
that is still JSON, so the columns keep their type on both databases:

    {"$codec": "<base64 of codec.encode(utf-8 JSON text)>"}

`"plain": true` in the envelope means the bytes were not passed through the codec (a
sensitive output with no codec configured, or a user value that itself looks like an
envelope and is wrapped so that it round-trips exactly). `"sensitive": true` marks the
output of `step.do(..., sensitive=True)`: the engine replays the value, every surface
shows REDACTED instead. The seal and open functions are the only place that knows this
format; the store writes and reads the text they give it. (Outside the engine package:
the models use it, and the engine imports the models.)
"""

from __future__ import annotations

import base64
import json
from functools import cache
from typing import Any, Protocol

# At module level: a function's own `from django.conf import settings` costs a Python call
# (importlib's _handle_fromlist, django.conf being a package) each time it runs, and
# seal() asks for the codec twice an instance in a herd of timers.
from django.conf import settings

ENVELOPE_START = '{"$codec":'
SENSITIVE_END = ',"sensitive":true}'
REDACTED = "[REDACTED]"


class PayloadCodec(Protocol):
    def encode(self, data: bytes) -> bytes: ...

    def decode(self, data: bytes) -> bytes: ...


@cache
def _codec_from_path(path: str) -> PayloadCodec:
    from django.utils.module_loading import import_string

    return import_string(path)()


def payload_codec() -> PayloadCodec | None:
    """The configured codec instance, or None (the default: values stored as plain JSON)."""
    path = getattr(settings, "WFDASH", {}).get("PAYLOAD_CODEC")
    return _codec_from_path(path) if path else None


def seal(text: str, sensitive: bool = False, envelope: bool = False) -> str:
    """The stored form of JSON text: the text itself unless a codec, sensitivity, a
    look-alike value or the caller (`envelope`) asks for an envelope."""
    codec = payload_codec()
    if codec is None and not (sensitive or envelope) and not text.startswith(ENVELOPE_START):
        return text
    data = text.encode()
    sealed: dict[str, Any] = {"$codec": ""}
    if codec is not None:
        data = codec.encode(data)
    else:
        sealed["plain"] = True
    sealed["$codec"] = base64.b64encode(data).decode("ascii")
    if sensitive:
        sealed["sensitive"] = True  # written last: is_sensitive() reads the text's end
    return json.dumps(sealed, separators=(",", ":"))


def unseal(text: str | None) -> str | None:
    """The JSON text a stored value holds (the inverse of seal)."""
    if text is None or not text.startswith(ENVELOPE_START):
        return text
    envelope = json.loads(text)
    data = base64.b64decode(envelope["$codec"])
    if not envelope.get("plain"):
        from .engine.errors import CodecError  # the engine package imports the models

        codec = payload_codec()
        if codec is None:
            raise CodecError(
                'a stored value is encoded by a payload codec, but WFDASH["PAYLOAD_CODEC"] '
                "is not set: configure the codec it was written with"
            )
        try:
            data = codec.decode(data)
        except Exception as exc:
            raise CodecError(
                f"the payload codec could not decode a stored value: {type(exc).__name__} {exc}"
            ) from None
    return data.decode()


def is_sensitive(text: str | None) -> bool:
    return text is not None and text.startswith(ENVELOPE_START) and text.endswith(SENSITIVE_END)


def seal_value(value: Any, text: str, envelope: bool = False) -> Any:
    """A JSON value (already encoded as `text`) as it may be copied into another stored
    JSON document (history data): the value itself, or its envelope as an object."""
    sealed = seal(text, envelope=envelope)
    return value if sealed is text else json.loads(sealed)


def open_value(value: Any) -> Any:
    """The inverse of seal_value."""
    if isinstance(value, dict) and "$codec" in value:
        # PostgreSQL's jsonb orders keys its own way ("plain" before "$codec"): the text
        # starts with "$codec" again, as unseal recognises an envelope by.
        envelope = {"$codec": value["$codec"], **value}
        return json.loads(unseal(json.dumps(envelope, separators=(",", ":"))) or "null")
    return value


def shown_value(value: Any) -> Any:
    """A value copied into history data as a surface may show it: decoded, or a message
    rather than an error (a page must not fail) when it cannot be decoded."""
    try:
        return open_value(value)
    except ValueError as exc:  # CodecError, or an envelope damaged in the database
        return f"[cannot decode: {exc}]"


def shown_text(text: str | None) -> str | None:
    """Stored text as a surface may show it: REDACTED for a sensitive output, decoded
    otherwise, and a message rather than an error when it cannot be decoded."""
    if is_sensitive(text):
        return json.dumps(REDACTED)
    try:
        return unseal(text)
    except ValueError as exc:  # CodecError, or an envelope damaged in the database
        return json.dumps(f"[cannot decode: {exc}]")


def clear_cache() -> None:
    """Forget the codec instance (tests change the setting)."""
    _codec_from_path.cache_clear()
