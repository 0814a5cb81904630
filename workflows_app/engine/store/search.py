"""Search attributes in the database: the rows list filters look up, and the filter.

Every write of an instance's attributes goes through here, inside the writer's
transaction, so the rows (models.InstanceAttribute) never disagree with the JSON column.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from typing import Any

from django.db import connection, models
from django.db.models import Count, F, FilteredRelation, OuterRef, Q, Subquery
from django.db.models.lookups import IContains

from ...models import Instance, InstanceAttribute
from ..attributes import index_text

ATTRIBUTE_TABLE = InstanceAttribute._meta.db_table
ATTRIBUTE_ALIAS = "attribute_match_"  # the joined row of the filter's n-th key
ATTRIBUTE_ORDER = "attribute_order"  # the first joined row's instance id: the list order
ATTRIBUTE_CHECKED = "attribute_checked"  # the count of the keys past JOINED_KEYS that match
DRIVER_PROBE = 1000  # rows counted at most per key of a filter, to pick the rarest
JOINED_KEYS = 4  # keys of a filter joined one row each; the rest are checked by one count
# Instances of a list's created range counted at most (reads_created_range): 200,000 index
# entries take 30-55 ms on PostgreSQL, reading and sorting as many rows about 200 ms.
CREATED_PROBE = 200_000
# No character past U+1E943 (Adlam) has a case (Unicode 15): the case classes of
# contains_any_case are read from below it (40 ms once, the whole range took 320 ms).
CASED_CODE_POINTS = 0x1E944


def index_attributes(instances: Iterable[Instance]) -> None:
    """Rows for the attributes of instances just inserted (create; inside its transaction)."""
    InstanceAttribute.objects.bulk_create(
        InstanceAttribute(instance_id=row.pk, key=key, value=index_text(value))
        for row in instances
        for key, value in (row.attributes or {}).items()
    )


def upsert_attributes(pk: int, attributes: Mapping[str, Any]) -> None:
    """step.set_attributes: the keys' rows take the new values (inside the caller's
    transaction, after the JSON column's own upsert)."""
    if not attributes:
        return
    values = ", ".join(["(%s, %s, %s)"] * len(attributes))
    params: list[Any] = []
    for key, value in attributes.items():
        params += [pk, key, index_text(value)]
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {ATTRIBUTE_TABLE} (instance_id, key, value) VALUES {values} "
            "ON CONFLICT (instance_id, key) DO UPDATE SET value = excluded.value",
            params,
        )


def filter_attributes(query: Any, attributes: Mapping[str, Any]) -> Any:
    """Instances whose attributes hold every key with exactly that value (index_text's
    equality: 1 matches 1.0, never true or "1").

    Each key joins its row by (key, value). Order the result with order_by_id(): it sorts
    by the first key's row, which SQLite then walks newest first in the index of (key,
    value, instance), stopping at the page's end: a rare value reads its own few rows, a
    common one about a page of them. Sorting by the instance's id instead would first
    collect every match.

    Past JOINED_KEYS keys (the rarest joined) the others are checked together by one
    count of the candidate's matching rows: PostgreSQL plans a join of every key's row
    by searching their orders, 200-236 ms of planning for 32 keys (under 1 ms to run).
    """
    items = rarest_first(attributes)
    joined, checked = items[:JOINED_KEYS], items[JOINED_KEYS:]
    for position, (key, value) in enumerate(joined):
        name = f"{ATTRIBUTE_ALIAS}{position}"
        query = query.alias(
            **{
                name: FilteredRelation(
                    "attribute_rows",
                    condition=Q(attribute_rows__key=key, attribute_rows__value=index_text(value)),
                )
            }
        ).filter(**{f"{name}__isnull": False})
        if position == 0:
            query = query.alias(**{ATTRIBUTE_ORDER: F(f"{name}__instance_id")})
    if checked:
        # (instance, key) is unique: as many matching rows as keys means every one holds.
        either = Q()
        for key, value in checked:
            either |= Q(key=key, value=index_text(value))
        matching = (
            InstanceAttribute.objects.filter(either, instance_id=OuterRef("pk"))
            .order_by()
            .values("instance_id")
            .annotate(n=Count("*"))
            .values("n")
        )
        query = query.alias(**{ATTRIBUTE_CHECKED: Subquery(matching)}).filter(
            **{ATTRIBUTE_CHECKED: len(checked)}
        )
    return query


def rarest_first(attributes: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """The filter's keys, the one with the fewest rows first (counted up to DRIVER_PROBE
    each) on SQLite, and on PostgreSQL when there are more than JOINED_KEYS: SQLite walks
    the first key's rows, so a common first key with a rare second one would walk every
    row of the common value, and the keys past JOINED_KEYS are only checked. PostgreSQL's
    planner keeps per-value statistics and picks the rare one itself among those joined."""
    items = list(attributes.items())
    if len(items) < 2 or (connection.vendor != "sqlite" and len(items) <= JOINED_KEYS):
        return items

    def rows_of(item: tuple[str, Any]) -> int:
        key, value = item
        matching = InstanceAttribute.objects.filter(key=key, value=index_text(value))
        return matching[:DRIVER_PROBE].count()

    return sorted(items, key=rows_of)


def order_by_id(query: Any, newest_first: bool = True, sorted_range: bool = False) -> Any:
    """query ordered by instance id; through the attribute row when filter_attributes
    joined one (the same order, read from an index instead of sorted).

    sorted_range (see reads_created_range): by `id + 0`, the same order, which no index
    returns, so that the database reads the created range and sorts it rather than walk
    the primary key down to it."""
    if ATTRIBUTE_ORDER in query.query.annotations:
        column = ATTRIBUTE_ORDER
    elif sorted_range:
        by = F("id") + 0
        return query.order_by(by.desc() if newest_first else by.asc())
    else:
        column = "id"
    return query.order_by(f"-{column}" if newest_first else column)


def reads_created_range(created_before: Any, created_after: Any = None) -> bool:
    """Whether a list bounded by created_before (and created_after) costs less read
    through instance_created and sorted (order_by_id(sorted_range=True)) than walked down
    the primary key, newest first, reading every instance newer than its range first.

    The planner cannot tell: it takes the range's rows as spread over the whole key, so a
    range deep in the past looked a few rows away (1M instances, created_before 25 days
    back of 30: the walk read 833,000 newer rows). Ids follow creation, so the ids of the
    range's newest and oldest instances, and the newest id, tell both sides' sizes in
    three index probes; a range read costs about twice a walked row (a row fetched and
    sorted). The range is then counted in the index, up to CREATED_PROBE rows: a longer
    one (ids and creation times apart) is walked, as before."""
    if created_before is None:
        return False
    in_range = Instance.objects.filter(created_at__lt=created_before)
    if created_after is not None:
        in_range = in_range.filter(created_at__gte=created_after)
    newest = in_range.order_by("-created_at").values_list("id", flat=True).first()
    if newest is None:
        return True  # nothing to read
    oldest = in_range.order_by("created_at").values_list("id", flat=True).first() or newest
    last = Instance.objects.order_by("-id").values_list("id", flat=True).first() or newest
    if 2 * (abs(newest - oldest) + 1) >= last - newest:
        return False
    return in_range.order_by()[:CREATED_PROBE].count() < CREATED_PROBE


def distinct_values(model: type[models.Model], column: str, limit: int) -> list[Any]:
    """The distinct values of a column an index starts with, smallest first, at most
    `limit`: one index probe per value (a loose index scan by a recursive query;
    PostgreSQL has no skip scan of its own), not SELECT DISTINCT's read of every row
    (the workflows of 1M instances: 260-370 ms, 8 probes well under 1 ms)."""
    quote = connection.ops.quote_name
    table, col = quote(model._meta.db_table), quote(column)
    sql = (
        f"WITH RECURSIVE v(value) AS (SELECT MIN({col}) FROM {table} UNION ALL "
        f"SELECT (SELECT MIN({col}) FROM {table} WHERE {col} > v.value) FROM v "
        f"WHERE v.value IS NOT NULL) SELECT value FROM v WHERE value IS NOT NULL LIMIT %s"
    )
    with connection.cursor() as cursor:
        cursor.execute(sql, [limit])
        return [row[0] for row in cursor.fetchall()]


def instance_workflows(limit: int = 10_000) -> list[str]:
    """The workflows that have instances, by name (instance_wf_id starts with it)."""
    return distinct_values(Instance, "workflow", limit)


# --- free text -----------------------------------------------------------------------------


def contains_any_case(column: str, text: str) -> Q:
    """The rows whose column holds text, whatever the case, alike on both databases.

    PostgreSQL (icontains: UPPER(column) LIKE UPPER(%text%)) compares every letter by its
    upper case; SQLite's LIKE folds ASCII letters only, so "münchen" did not find
    "MÜNCHEN" there. On SQLite a text with a non-ASCII letter that has another case is
    matched by GLOBs of the letters' case classes ("m[üÜ]nchen" or "M[üÜ]nchen": one per
    case of the first letter, so each skips ahead to it), behind a LIKE with "_" for those
    letters that keeps the GLOBs to the rows it may match. Search of 100,000 instances
    (SQLite, the list's SEARCH_SCAN): "MÜNCHEN" 44 ms as before; a rare all-Cyrillic
    term 70 -> 205 ms (no LIKE can narrow it); ASCII text stays the plain LIKE it was
    (only "ı" and "ſ", whose upper case is I and S, still differ from PostgreSQL there)."""
    return Q(_ContainsAnyCase(F(column), text))


class _ContainsAnyCase(IContains):
    def as_sqlite(self, compiler: Any, connection: Any) -> tuple[str, list[Any]]:
        patterns = any_case_patterns(self.rhs, connection.ops)
        if patterns is None:
            return self.as_sql(compiler, connection)
        like, globs = patterns
        lhs_sql, lhs_params = self.process_lhs(compiler, connection)
        any_glob = " OR ".join([f"{lhs_sql} GLOB %s"] * len(globs))
        params = [param for glob in globs for param in (*lhs_params, glob)]
        if like is None:
            return f"({any_glob})", params
        return f"({lhs_sql} LIKE %s ESCAPE '\\' AND ({any_glob}))", [*lhs_params, like, *params]


def _simple_upper(char: str) -> str:
    """One character's upper case as PostgreSQL's UPPER() gives it: one character for one
    (ß stays ß, where Python's str.upper() makes it SS)."""
    upper = char.upper()
    return upper if len(upper) == 1 else char


@functools.cache
def _case_classes() -> dict[str, str]:
    """Per upper-case letter, it and every character whose upper case it is: "I" has
    "Iiı", "Ü" has "Üü"."""
    classes: dict[str, str] = {}
    for code_point in range(CASED_CODE_POINTS):
        char = chr(code_point)
        upper = _simple_upper(char)
        if upper != char:
            classes[upper] = classes.get(upper, upper) + char
    return classes


def _case_class(char: str) -> str:
    """The characters that match char whatever the case; ASCII ones as LIKE matches them."""
    if char.isascii():
        return char.upper() + char.lower() if char.isalpha() else char
    return _case_classes().get(_simple_upper(char), char)


def any_case_patterns(text: str, ops: Any) -> tuple[str | None, list[str]] | None:
    """A LIKE pattern and GLOBs (one per case of text's first character) that find text
    in any case, or None when SQLite's LIKE does (no non-ASCII character of text has
    another case). No LIKE when it would be "_" only (it would read every row for none)."""
    if all(char.isascii() or len(_case_class(char)) == 1 for char in text):
        return None
    like, glob = [], []
    for char in text:
        members = _case_class(char)
        if len(members) == 1:
            like.append(ops.prep_for_like_query(char))
            glob.append(f"[{char}]" if char in "*?[" else char)
        else:  # letters only: no "]", "^" or "-" to escape in the class
            like.append(ops.prep_for_like_query(char) if char.isascii() else "_")
            glob.append(f"[{members}]")
    first = _case_class(text[0])
    rest = "".join(glob[1:])
    globs = [f"*{glob[0]}{rest}*"] if len(first) == 1 else [f"*{c}{rest}*" for c in first]
    return (f"%{''.join(like)}%" if set(like) != {"_"} else None), globs
