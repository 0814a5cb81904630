"""The JSON Schemas of typed event waits (wait_for_event's `schema`): checked where the
wait is declared, and the validator both the sender (client.send_event) and the wait
(Run.take_event) check a payload with.

References are looked up in the schema itself and in the JSON Schema meta-schemas only.
jsonschema's default registry fetched any other document a `$ref` named, over HTTP, at
each payload's check: synchronously inside the worker's event loop (a slow server stalled
every run of the worker) or the request that sends the event, from whatever address the
schema names, and a payload's fate hung on a server the engine does not keep.
"""

from __future__ import annotations

from typing import Any

import jsonschema
import referencing
import referencing.exceptions
from jsonschema_specifications import REGISTRY as META_SCHEMAS
from referencing.jsonschema import DRAFT202012

from .errors import InvalidInput

# Why a payload check raised RecursionError: a reference comes back to a schema it is part
# of without going down the payload (every check recurses until Python stops it), or the
# payload is nested deeper than a recursive schema's check can follow.
CHECK_RECURSED = (
    "checking it recursed too deep: a $ref of the schema comes back to a schema it is part "
    "of without going down the payload, or the payload is nested deeper than the check can "
    "follow"
)


def event_validator(schema: dict[str, Any]) -> Any:
    """A validator of `schema` whose references never leave it (nor the meta-schemas)."""
    return jsonschema.validators.validator_for(schema)(schema, registry=META_SCHEMAS)


def check_event_schema(name: str, schema: dict[str, Any]) -> None:
    """InvalidInput for a wait's schema that is no JSON Schema, or that has a $ref (or
    $dynamicRef) that does not resolve: a missing $defs entry or anchor, or another
    document than a meta-schema (never fetched, see above). No payload could ever pass
    such a wait, and check_schema checks only the form."""
    dialect = schema.get("$schema") if isinstance(schema, dict) else None
    if dialect is not None and not isinstance(dialect, str):
        # validator_for looks it up as a URI: AttributeError or TypeError, not SchemaError.
        raise InvalidInput(
            f'wait_for_event "{name}": invalid JSON Schema: its $schema must be the URI of a '
            f"dialect, got {dialect!r}"
        )
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise InvalidInput(f'wait_for_event "{name}": invalid JSON Schema: {exc.message}') from None
    root = referencing.Resource.from_contents(schema, default_specification=DRAFT202012)

    def check(resolver: referencing.Resolver[Any], resource: referencing.Resource[Any]) -> None:
        if resource is not root and resource.id():
            resolver = resolver.in_subresource(resource)  # its $id is the base of its refs
        contents = resource.contents if isinstance(resource.contents, dict) else {}
        # $dynamicRef (2020-12) first resolves as a $ref does: a dangling one fails alike.
        for ref in (contents.get("$ref"), contents.get("$dynamicRef")):
            if not isinstance(ref, str):
                continue
            try:
                resolver.lookup(ref)
            except referencing.exceptions.Unresolvable:
                raise InvalidInput(
                    f'wait_for_event "{name}": the reference {ref!r} in its JSON Schema does '
                    "not resolve within the schema (another document is never fetched): no "
                    "payload could match it"
                ) from None
        for subresource in resource.subresources():
            check(resolver, subresource)

    check(META_SCHEMAS.resolver_with_root(root), root)
