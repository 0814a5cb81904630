"""Limits of Cloudflare Workflows, with their defaults, and the checks that enforce them."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass
from typing import Any, ClassVar

from ..codec import payload_codec, seal_value
from .durations import parse_duration
from .errors import (
    InvalidEventType,
    InvalidInput,
    LimitExceeded,
    SizeLimitExceeded,
    StepOutputError,
    shown,
)

DAY_MS = 86_400_000
EVENT_TYPE_PATTERN = re.compile(r"^[a-zA-Z0-9_][a-zA-Z0-9_-]{0,99}\Z")
INSTANCE_ID_PATTERN = re.compile(r"^[a-zA-Z0-9_][a-zA-Z0-9_.:-]*\Z")
BACKOFFS = ("constant", "linear", "exponential")
# The most retries a step may ask for: its attempt counts (limit + 1) are stored in 32-bit
# integer columns (PostgreSQL's integer).
MAX_RETRY_LIMIT = 2**31 - 2
# The most a count limit (max_concurrent_instances, max_concurrent_per_key,
# max_buffered_events, rate_limit's limit) may be: admission passes them to SQL as a LIMIT
# (10**600 was "bigint out of range" on PostgreSQL, an OverflowError on SQLite, at every
# create) and quotes them in waiting_reason. Far past any real bound; None is no bound.
MAX_COUNT_LIMIT = 2**31 - 1
# A rate_limit period as written is shown in the reason its queued instances wait
# (waiting_reason, 500 characters): "1" + 500 spaces + "minute" parsed, then failed every
# admission pass on PostgreSQL that reached the window's end.
MAX_PERIOD_CHARS = 50
MAX_ERROR_NAME_LENGTH = 200  # the error name columns (instance, step, error record)
# An error's message and stack as stored (step record, instance, errors table, history,
# span): one a step raised with a whole response in it is shortened, saying by how much.
MAX_ERROR_MESSAGE_CHARS = 8192
MAX_ERROR_STACK_CHARS = 16384
# An event payload is copied into its event.received history record up to this size; a
# larger one leaves its size and start there (the whole payload is in the step's output).
HISTORY_PAYLOAD_MAX_BYTES = 16 * 1024


def check_count(name: str, value: Any, none_allowed: bool = True) -> int | None:
    """A count limit: an integer from 1 to MAX_COUNT_LIMIT (or None, no bound, if allowed)."""
    if value is None and none_allowed:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_COUNT_LIMIT:
        # str() of an integer past 4,300 digits raises ValueError.
        huge = isinstance(value, int) and value.bit_length() > 64
        raise InvalidInput(
            f"{name} must be a positive integer{' or None' if none_allowed else ''} "
            f"(at most {MAX_COUNT_LIMIT}), got {'an integer past 2**64' if huge else repr(value)}"
        )
    return value


@dataclass(frozen=True)
class RateLimit:
    """limits={"rate_limit": {"limit": 10, "period": "1 minute"}}: at most `limit` starts
    per sliding `period` (milliseconds)."""

    limit: int
    period_ms: int
    period_label: str = dataclasses.field(default="", compare=False)

    @classmethod
    def build(cls, value: Any) -> RateLimit | None:
        if value is None or isinstance(value, RateLimit):
            return value
        if not isinstance(value, dict) or set(value) != {"limit", "period"}:
            raise InvalidInput(
                f'rate_limit must be {{"limit": <positive integer>, "period": <duration>}}, got {shown(value)}'
            )
        limit = check_count("rate_limit limit", value["limit"], none_allowed=False)
        if isinstance(value["period"], str) and len(value["period"]) > MAX_PERIOD_CHARS:
            raise InvalidInput(
                f"rate_limit period must be at most {MAX_PERIOD_CHARS} characters "
                f'(e.g. "1 minute"), got {len(value["period"])}'
            )
        period = parse_duration(value["period"])
        if period < 1:
            raise InvalidInput(
                f"rate_limit period must be longer than 0 ms, got {value['period']!r}"
            )
        label = value["period"] if isinstance(value["period"], str) else f"{period} ms"
        return cls(limit, period, label)


@dataclass(frozen=True)
class Limits:
    """Per-workflow limits. Durations are milliseconds; max_concurrent_instances None is ∞."""

    max_concurrent_instances: int | None = None
    max_steps_per_workflow: int = 1024
    max_step_output_bytes: int = 1024 * 1024
    max_instance_id_length: int = 100
    max_step_name_length: int = 256
    max_sleep: int = 365 * DAY_MS
    min_wait_for_event_timeout: int = 1_000
    max_wait_for_event_timeout: int = 365 * DAY_MS
    default_wait_for_event_timeout: int = DAY_MS
    max_step_timeout: int = 30 * 60_000
    default_step_timeout: int = 10 * 60_000
    default_retry_limit: int = 5
    default_retry_delay: int = 10_000
    default_retry_backoff: str = "exponential"
    max_batch_size: int = 100
    max_params_bytes: int = 1024 * 1024
    max_event_payload_bytes: int = 1024 * 1024
    max_retention: int = 0  # 0 keeps finished instances forever
    # Events sent to an instance and not yet taken by a wait (None: no bound). Cloudflare
    # names none; without one an instance kept every event sent to it, waited for or not.
    max_buffered_events: int | None = 1000
    # Flow control: active instances per concurrency_key (None: no bound), starts per period.
    max_concurrent_per_key: int | None = None
    rate_limit: RateLimit | None = None

    _DURATIONS = (
        "max_sleep",
        "min_wait_for_event_timeout",
        "max_wait_for_event_timeout",
        "default_wait_for_event_timeout",
        "max_step_timeout",
        "default_step_timeout",
        "default_retry_delay",
        "max_retention",
    )

    # Integer limits under which nothing could pass: a max_batch_size of 0 made
    # `wf start --count` fail with "range() arg 3 must not be zero".
    _LEAST: ClassVar[dict[str, int]] = {"max_batch_size": 1}

    @classmethod
    def build(cls, *overrides: dict[str, Any] | None) -> Limits:
        """Defaults, then each overrides dict in turn; durations accept any duration form."""
        fields = {f.name for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {}
        for layer in overrides:
            for key, given in (layer or {}).items():
                value = given
                if key not in fields:
                    raise InvalidInput(
                        f"unknown limit {key!r}; known limits: {', '.join(sorted(fields))}"
                    )
                if key in cls._DURATIONS:
                    value = parse_duration(value)
                elif key in (
                    "max_concurrent_instances",
                    "max_concurrent_per_key",
                    "max_buffered_events",
                ):
                    if key == "max_concurrent_instances" and (
                        isinstance(value, float) and math.isinf(value)
                    ):
                        value = None
                    value = check_count(key, value)
                elif key == "rate_limit":
                    value = RateLimit.build(value)
                elif key == "default_retry_backoff":
                    if value not in BACKOFFS:
                        raise InvalidInput(
                            f"default_retry_backoff must be one of {BACKOFFS}, got {shown(value)}"
                        )
                elif (
                    not isinstance(value, int)
                    or isinstance(value, bool)
                    or value < cls._LEAST.get(key, 0)
                ):
                    kind = "a positive" if cls._LEAST.get(key) else "a non-negative"
                    raise InvalidInput(f"limit {key} must be {kind} integer, got {shown(value)}")
                elif key == "default_retry_limit" and value > MAX_RETRY_LIMIT:
                    raise InvalidInput(
                        f"limit {key} must be an integer from 0 to {MAX_RETRY_LIMIT}, got {shown(value)}"
                    )
                values[key] = value
        built = cls(**values)
        built._check_consistent()
        return built

    # What the columns hold: an instance id (Instance.instance_id), a step name
    # (StepRecord.name).
    _COLUMN_LENGTHS = (("max_instance_id_length", 200), ("max_step_name_length", 300))

    def _check_consistent(self) -> None:
        """Limits that would fail later, in a create or a run, are refused now: a length
        past its column (a database error at the first long id), a default outside its
        own bounds (every step or wait that takes it fails)."""
        for key, column in self._COLUMN_LENGTHS:
            if not 1 <= getattr(self, key) <= column:
                raise InvalidInput(
                    f"limit {key} must be from 1 to {column} (what its column holds), "
                    f"got {shown(getattr(self, key))}"
                )
        pairs = (
            (
                "default_step_timeout",
                "max_step_timeout",
                self.default_step_timeout <= self.max_step_timeout,
            ),
            (
                "default_wait_for_event_timeout",
                "the wait_for_event timeout bounds",
                self.min_wait_for_event_timeout
                <= self.default_wait_for_event_timeout
                <= self.max_wait_for_event_timeout,
            ),
        )
        for key, bound, within in pairs:
            if not within:
                raise InvalidInput(f"limit {key} ({getattr(self, key)} ms) is outside {bound}")

    @property
    def flow_controlled(self) -> bool:
        """Whether admission must count anything: a queue can form under these limits."""
        return (
            self.max_concurrent_instances is not None
            or self.max_concurrent_per_key is not None
            or self.rate_limit is not None
        )


# Params, outputs and payloads nested deeper than this are refused: every reader of them
# (the dashboard's pretty-printer, the admin, the API) recurses once per level, and ~950
# levels stored fine but then failed every page that showed them.
MAX_JSON_DEPTH = 64


# json.dumps with options builds an encoder per call: a third of encoding a small value.
_encode = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode


def encode_json(value: Any, what: str) -> str:
    """Compact JSON of value, or InvalidInput naming what could not be encoded."""
    try:
        text = _encode(value)
    except (TypeError, ValueError) as exc:
        raise InvalidInput(f"{what} is not JSON-serialisable: {exc}") from None
    except RecursionError:
        raise InvalidInput(f"{what} is nested too deeply to encode as JSON") from None
    # Counting brackets is cheap (C); only text with enough of them could be too deep.
    if text.count("[") + text.count("{") > MAX_JSON_DEPTH:
        depth = json_text_depth(text)
        if depth > MAX_JSON_DEPTH:
            raise InvalidInput(
                f"{what} is nested {depth} levels deep; the nesting limit is {MAX_JSON_DEPTH} levels"
            )
    return text


# Every byte but brackets and quotes (multi-byte UTF-8, lone surrogates included, is all
# bytes >= 0x80: never one of these).
_NOT_STRUCTURE = bytes(b for b in range(256) if b not in b'[]{}"')
_EMPTY_PAIR = re.compile(r"\[\]|\{\}")


def json_text_depth(text: str) -> int:
    """How many arrays and objects deep JSON text (as json.dumps writes it) is; 0 for a scalar.

    No Python loop per character or per node (walking the value cost 5x its json.dumps
    for 1,000 small records; this about 0.5x): drop escaped backslashes and quotes, keep
    only brackets and quotes (bytes.translate), drop what lay between quotes (strings),
    then each pass removes the innermost empty pairs: the number of passes is the depth.
    """
    kept = (
        text.replace("\\\\", "")
        .replace('\\"', "")
        .encode(errors="surrogatepass")
        .translate(None, _NOT_STRUCTURE)
        .decode()
    )
    brackets = "".join(kept.split('"')[0::2])
    depth = 0
    while brackets:
        brackets = _EMPTY_PAIR.sub("", brackets)
        depth += 1
    return depth


def encode_step_output(value: Any, step_name: str, limits: Limits) -> str:
    """The checkpoint text of a step's output; StepOutputError if unserialisable or too large."""
    try:
        text = encode_json(value, f'output of step "{step_name}"')
    except InvalidInput as exc:
        raise StepOutputError(str(exc)) from None
    try:
        size = len(text.encode())
    except UnicodeEncodeError as exc:  # a lone surrogate: no database stores it
        raise StepOutputError(
            f'output of step "{step_name}" is not valid Unicode text: {exc.reason} '
            f"at position {exc.start}"
        ) from None
    if size > limits.max_step_output_bytes:
        raise StepOutputError(
            f'output of step "{step_name}" is {size} bytes of JSON; '
            f"max_step_output_bytes is {limits.max_step_output_bytes}"
        )
    return text


def check_size(text: str, limit_name: str, maximum: int, what: str) -> None:
    try:
        size = len(text.encode())
    except UnicodeEncodeError as exc:
        raise InvalidInput(
            f"{what} is not valid Unicode text: {exc.reason} at position {exc.start}"
        ) from None
    if size > maximum:
        raise SizeLimitExceeded(limit_name, f"{size} bytes", f"{maximum} bytes", what)


def check_text(value: str, what: str) -> str:
    """Text both databases store: valid Unicode (no lone surrogate, as a JSON escape
    like \\ud800 or a non-UTF-8 argv byte gives) and no NUL (PostgreSQL refuses it)."""
    try:
        value.encode()
    except UnicodeEncodeError as exc:
        raise InvalidInput(
            f"{what} is not valid Unicode text: {exc.reason} at position {exc.start}"
        ) from None
    if "\x00" in value:
        raise InvalidInput(f"{what} contains a NUL character at position {value.index(chr(0))}")
    return value


def check_event_type(event_type: object) -> str:
    if not isinstance(event_type, str) or not EVENT_TYPE_PATTERN.match(event_type):
        raise InvalidEventType(
            f"invalid event type {event_type!r}: must match ^[a-zA-Z0-9_][a-zA-Z0-9_-]{{0,99}}$ "
            "(1-100 letters, digits, '_' or '-', not starting with '-')"
        )
    return event_type


def check_instance_id(instance_id: object, limits: Limits) -> str:
    if not isinstance(instance_id, str) or not instance_id:
        raise InvalidInput(f"instance id must be a non-empty string, got {instance_id!r}")
    if len(instance_id) > limits.max_instance_id_length:
        raise LimitExceeded(
            "max_instance_id_length", len(instance_id), limits.max_instance_id_length, "instance id"
        )
    if not INSTANCE_ID_PATTERN.match(instance_id):
        raise InvalidInput(
            f"invalid instance id {instance_id!r}: use letters, digits, '_', '-', '.', ':' "
            "and start with a letter, digit or '_'"
        )
    return instance_id


def check_step_name(name: object, limits: Limits) -> str:
    if not isinstance(name, str) or not name:
        raise InvalidInput(f"step name must be a non-empty string, got {name!r}")
    if len(name) > limits.max_step_name_length:
        raise LimitExceeded(
            "max_step_name_length",
            len(name),
            limits.max_step_name_length,
            f"step name {name[:40]!r}…",
        )
    # Checkpoints, history and spans store the name: a NUL (PostgreSQL) or a lone
    # surrogate (either database) would fail every write of the run, not the step.
    return check_text(name, f"step name {name[:40]!r}")


def error_name(name: str) -> str:
    """An error name as stored: one past the column's length is shortened, ending in "…",
    so a long NonRetryableError(name=…) errors the instance the same way on every database."""
    if len(name) <= MAX_ERROR_NAME_LENGTH:
        return name
    return name[: MAX_ERROR_NAME_LENGTH - 1] + "…"


def shortened_message(text: str) -> str:
    """An error message as stored: its first MAX_ERROR_MESSAGE_CHARS characters, and how
    many more there were."""
    if len(text) <= MAX_ERROR_MESSAGE_CHARS:
        return text
    left_out = len(text) - MAX_ERROR_MESSAGE_CHARS
    return f"{text[:MAX_ERROR_MESSAGE_CHARS]}… ({left_out} characters more)"


def shortened_stack(text: str) -> str:
    """A stack as stored: its beginning and its end (where it was raised, and what), the
    middle left out past MAX_ERROR_STACK_CHARS characters."""
    if len(text) <= MAX_ERROR_STACK_CHARS:
        return text
    half = MAX_ERROR_STACK_CHARS // 2
    left_out = len(text) - 2 * half
    return f"{text[:half]}\n… ({left_out} characters left out) …\n{text[-half:]}"


_SURROGATE = re.compile("[\ud800-\udfff]")


def storable_text(text: str) -> str:
    """Text both databases store: a NUL (PostgreSQL's text and jsonb take none) and a lone
    surrogate (no UTF-8 for it) become U+FFFD."""
    if "\x00" in text:
        text = text.replace("\x00", "\ufffd")
    return _SURROGATE.sub("\ufffd", text) if not text.isascii() else text


# What PostgreSQL's jsonb would not give back as written: a NUL (refused), a whole float
# with an exponent (1e+20 read back as an integer), -0.0 (read as 0.0); and objects whose
# keys it reorders (_order_kept). A payload whose JSON has one (or only looks so, inside a
# string: no harm) is copied as an envelope of its text, which every surface opens to the
# payload exactly (codec.open_value).
_CHANGED_BY_JSONB = re.compile(r"\\u0000|[0-9][eE]|-0\.0(?![0-9])")


def _jsonb_key(key: str) -> tuple[int, bytes]:
    return len(key.encode()), key.encode()


def _order_kept(value: Any) -> bool:
    """Whether jsonb gives value's objects back with their keys in the same order: it
    orders them by length in bytes, then bytewise ({"bb", "a"} comes back {"a", "bb"})."""
    if isinstance(value, dict):
        keys = list(value)
        if len(keys) > 1 and keys != sorted(keys, key=_jsonb_key):
            return False
        return all(_order_kept(v) for v in value.values())
    if isinstance(value, list):
        return all(_order_kept(v) for v in value)
    return True


def payload_for_history(payload: Any, payload_json: str) -> dict[str, Any]:
    """What a history record shows of an event payload, so an operator can see what was
    received without the history growing by max_event_payload_bytes per event: the
    payload exactly (on both databases) up to HISTORY_PAYLOAD_MAX_BYTES, else its size
    and beginning."""
    encoded = payload_json.encode(errors="surrogatepass")
    if len(encoded) <= HISTORY_PAYLOAD_MAX_BYTES:
        changed = _CHANGED_BY_JSONB.search(payload_json) is not None or not _order_kept(payload)
        return {"payload": seal_value(payload, payload_json, envelope=changed)}
    if payload_codec() is not None:  # a preview would be the payload in clear
        return {"payload_bytes": len(encoded)}
    preview = encoded[:HISTORY_PAYLOAD_MAX_BYTES].decode(errors="ignore")
    return {"payload_bytes": len(encoded), "payload_preview": preview + "…"}
