"""The reads a user or operator makes routinely stay bounded on a big table: each walks an
index in the order it returns rows and stops at its page's end, rather than reading (and
sorting) every row that matches. Asked of the planner with sequential scans turned off (the
test tables are tiny); at production size (1M instances, an instance of 50,000 steps) the
figures are in the commits that added each index."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from django.db import connection, transaction

from tests.test_operating import explain
from workflows_app.client import InstanceHandle
from workflows_app.models import Instance, StepRecord

pytestmark = pytest.mark.django_db(transaction=True)

NOW = datetime(2026, 1, 1, tzinfo=UTC)


@pytest.fixture(autouse=True)
def tables_the_planner_has_no_statistics_for():
    """Each test asks the planner of tables and indexes it holds no statistics for, as in a
    fresh test database. A CREATE INDEX records the size of its table and of itself: after
    test_migrations' builds (back and forth, with rows) the planner took the instance
    table for empty, and two plans here chose other indexes, by the order the files ran in."""
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute(
                "UPDATE pg_class SET reltuples = -1, relpages = 0, relallvisible = 0 "
                "WHERE relnamespace = 'public'::regnamespace AND relkind IN ('r', 'i')"
            )


def assert_read_in_order(plan: str, index: str) -> None:
    assert index in plan, plan
    if connection.vendor == "sqlite":
        assert "TEMP B-TREE" not in plan, plan
    else:
        assert "Sort" not in plan, plan


def instance(instance_id: str, **fields) -> Instance:
    fields = {"workflow": "big", "version": 1, "created_at": NOW, "updated_at": NOW, **fields}
    return Instance.objects.create(instance_id=instance_id, **fields)


def test_the_newest_steps_and_a_page_of_steps_walk_the_step_order_index():
    row = instance("many-steps")
    StepRecord.objects.bulk_create(
        StepRecord(instance=row, name=f"s{n}", kind="do", seq=n, status="complete", started_at=NOW)
        for n in range(1, 41)
    )
    steps = StepRecord.objects.filter(instance_id=row.pk)
    handle = InstanceHandle("big", "many-steps", row)
    assert [s.seq for s in handle.steps(last=3)] == [38, 39, 40]
    assert [s.seq for s in handle.steps(after=10, limit=2)] == [11, 12]
    # The instance pages and GET …/instances/<id>: the newest N.
    assert_read_in_order(explain(steps.order_by("-seq")[:1001]), "step_seq")
    # GET …/steps?cursor=: a page after a seq.
    assert_read_in_order(explain(steps.filter(seq__gt=10).order_by("seq")[:1001]), "step_seq")


def test_the_newest_children_and_a_page_of_children_walk_the_children_index():
    parent = instance("fan-out")
    for n in range(30):
        instance(f"other-{n}")  # instances of no parent: the page skips none of them
        instance(f"child-{n}", parent=parent, parent_step=f"spawn {n}")
    handle = InstanceHandle("big", "fan-out", parent)
    page = handle.children_rows(after=0, limit=2)
    assert [c.instance_id for c in page] == ["child-0", "child-1"]
    after = handle.children_rows(after=page[-1].pk, limit=1)
    assert [c.instance_id for c in after] == ["child-2"]
    children = Instance.objects.filter(parent_id=parent.pk)
    # GET …/children?cursor=: a page after a child's id.
    page_plan = explain(children.filter(id__gt=page[-1].pk).order_by("id")[:1001])
    assert_read_in_order(page_plan, "instance_children")
    # The instance pages and GET …/instances/<id>: the newest N.
    assert_read_in_order(explain(children.order_by("-id")[:1001]), "instance_children")


def test_a_scrape_counts_the_unfinished_instances_from_their_index_alone():
    # Prometheus scrapes every 15 s. COUNT(id) made PostgreSQL read every unfinished
    # instance's row besides its index entry: 330-420 ms at 100,000 of them, 28-40 ms
    # counted from instance_live alone.
    from workflows_app import metrics

    for n in range(5):
        instance(f"live-{n}", status="waiting")
        instance(f"done-{n}", status="complete")
    counts = {(r["workflow"], r["status"]): r["n"] for r in metrics.live_counts()}
    assert counts == {("big", "waiting"): 5}
    if connection.vendor == "postgresql":  # the visibility map, as autovacuum keeps it
        with connection.cursor() as cursor:
            cursor.execute(f"VACUUM ANALYZE {Instance._meta.db_table}")
    plan = explain(metrics.live_counts())
    if connection.vendor == "sqlite":
        assert "COVERING INDEX instance_live" in plan, plan
    else:
        assert "Index Only Scan using instance_live" in plan, plan


def test_a_prune_batch_takes_the_expired_instances_along_the_expiry_index():
    # A worker prunes one batch between runs. Chosen ORDER BY id, PostgreSQL walked the
    # primary key whenever its statistics guessed many expired rows (after a prune had
    # emptied the backlog, until the next ANALYZE): 930 ms over 1M instances for none.
    from datetime import timedelta

    from django.test.utils import CaptureQueriesContext

    from workflows_app.engine.store import catalog

    for n in range(4):
        instance(f"kept-{n}", status="complete", expires_at=NOW + timedelta(days=30))
    for n in range(3):  # expired in the reverse order of their ids
        instance(f"gone-{n}", status="complete", expires_at=NOW - timedelta(minutes=n))
    with CaptureQueriesContext(connection) as queries:
        assert catalog.prune(now=NOW, batch=2, max_batches=1) == 2
    left = set(Instance.objects.values_list("instance_id", flat=True))
    assert left == {"kept-0", "kept-1", "kept-2", "kept-3", "gone-0"}  # the longest expired went
    table = f'"{Instance._meta.db_table}"'
    [chosen] = [q["sql"] for q in queries.captured_queries if "LIMIT 2" in q["sql"]]
    assert f'ORDER BY {table}."expires_at" ASC' in chosen, chosen
    expired = Instance.objects.filter(expires_at__lte=NOW, status="complete")
    plan = explain(expired.order_by("expires_at", "id").values_list("id")[:500])
    assert "instance_expiry" in plan, plan


def test_the_workflows_with_instances_are_read_by_one_index_probe_each():
    # `wf list` without --workflow lists every workflow with instances: SELECT DISTINCT
    # workflow read every instance (260-340 ms at 1M); the loose index scan reads one
    # entry of instance_wf_id per workflow.
    from django.test.utils import CaptureQueriesContext

    from workflows_app import surfaces

    for name in ("gone-b", "gone-a", "gone-b", "gone-c"):
        Instance.objects.create(
            workflow=name,
            instance_id=f"{name}-{Instance.objects.count()}",
            version=1,
            created_at=NOW,
            updated_at=NOW,
        )
    with CaptureQueriesContext(connection) as queries:
        names = surfaces.workflow_names()
    assert {"gone-a", "gone-b", "gone-c"} <= set(names)
    assert names == sorted(names)
    reads = [q["sql"] for q in queries.captured_queries if Instance._meta.db_table in q["sql"]]
    assert reads and not any("DISTINCT" in sql.upper() for sql in reads), reads


def test_a_list_filtered_by_status_across_workflows_walks_the_status_index():
    # The dashboard's list and the admin, ?status= with no workflow, newest first. By the
    # primary key PostgreSQL read back from the newest instance until it had a page of
    # that status: 104 ms for terminated at 1M instances, the whole table for a status
    # no recent instance has; along instance_status, the page's rows (9 ms).
    from workflows_app import dashboard

    for n in range(30):
        instance(f"done-{n}", status="complete")
    for n in range(3):
        instance(f"stopped-{n}", status="terminated")
    page = dashboard.instance_page(dashboard.ListFilters(status="terminated"), None, None)
    assert [r.instance_id for r in page.rows] == ["stopped-2", "stopped-1", "stopped-0"]
    if connection.vendor == "sqlite":
        return  # it takes a partial index for literals only (the lists bind parameters)
    query = Instance.objects.filter(status="terminated").order_by("-id")
    assert_read_in_order(explain(query.values_list("id")[:51]), "instance_finished_status")
    newer = Instance.objects.filter(status="terminated", id__lt=page.rows[0].pk).order_by("-id")
    assert_read_in_order(explain(newer.values_list("id")[:51]), "instance_finished_status")


def test_a_page_of_a_version_walks_the_version_index():
    # The dashboard's and the admin's lists filter by version, of a workflow or across
    # them, as does GET …/instances?version=: by the primary key a version no recent
    # instance runs meant a walk over the whole table (1.07M instances: 972 ms; 8 ms).
    from workflows_app import dashboard

    for n in range(30):
        instance(f"old-{n}", version=1 if n % 10 else 2)
        instance(f"other-{n}", workflow="other", version=2)
    page = dashboard.instance_page(dashboard.ListFilters(workflow="big", version=2))
    assert [r.instance_id for r in page.rows] == ["old-20", "old-10", "old-0"]
    across = dashboard.instance_page(dashboard.ListFilters(version=2), limit=2)
    assert [r.instance_id for r in across.rows] == ["other-29", "other-28"]
    of_workflow = Instance.objects.filter(workflow="big", version=2)
    assert_read_in_order(explain(of_workflow.order_by("-id")[:51]), "instance_version")
    plan = explain(Instance.objects.filter(version=2).order_by("-id")[:51])
    assert "instance_version" in plan, plan


def explain_captured(sql: str) -> str:
    """The plan of a statement a page ran (its parameters inlined), as explain() asks it."""
    from django.db import transaction

    with transaction.atomic(), connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute("SET LOCAL enable_seqscan = off")
        cursor.execute(
            ("EXPLAIN QUERY PLAN " if connection.vendor == "sqlite" else "EXPLAIN ") + sql
        )
        return " ".join(str(cell) for row in cursor.fetchall() for cell in row)


def test_a_list_created_before_a_bound_deep_in_the_past_reads_its_range_not_the_newer_rows():
    # The dashboard's list ?created_to= and wf.list(created_before=), newest first. The
    # planner takes the range's rows as spread over the whole key: walking the primary key
    # down to them read every newer instance (1M instances over 30 days, a bound 25 days
    # back: 833,000 rows, 417-496 ms; 29 days back 484-683 ms). Read through
    # instance_created and sorted: 163-170 and 40-59 ms. A recent bound still walks the
    # key (a page, 5-9 ms with the three probes that choose).
    from datetime import timedelta

    from django.test.utils import CaptureQueriesContext

    from workflows_app import dashboard
    from workflows_app.client import WorkflowBinding

    old = NOW - timedelta(days=30)
    for n in range(3):
        instance(f"old-{n}", created_at=old + timedelta(minutes=n))
    for n in range(20):
        instance(f"new-{n}", created_at=NOW + timedelta(minutes=n))
    bound = dashboard.ListFilters(created_to=NOW - timedelta(days=1))
    with CaptureQueriesContext(connection) as queries:
        first = dashboard.instance_page(bound, limit=2)
    assert [r.instance_id for r in first.rows] == ["old-2", "old-1"]
    second = dashboard.instance_page(bound, after=first.older, limit=2)
    assert [r.instance_id for r in second.rows] == ["old-0"] and second.older is None
    back = dashboard.instance_page(bound, before=second.newer, limit=2)
    assert [r.instance_id for r in back.rows] == ["old-2", "old-1"] and back.newer is None
    page_sql = queries.captured_queries[-1]["sql"]
    assert "+ 0) DESC" in page_sql, page_sql
    plan = explain_captured(page_sql)
    assert "instance_created" in plan, plan
    if connection.vendor == "postgresql":
        assert "Backward using workflows_app_instance_pkey" not in plan, plan
    client_page = WorkflowBinding("big").list(created_before=NOW - timedelta(days=1), limit=2)
    assert [i.id for i in client_page.instances] == ["old-2", "old-1"]
    # A bound after most instances keeps the walk down the primary key, read in order.
    recent = dashboard.ListFilters(created_to=NOW + timedelta(minutes=19))
    with CaptureQueriesContext(connection) as queries:
        page = dashboard.instance_page(recent, limit=2)
    assert [r.instance_id for r in page.rows] == ["new-18", "new-17"]
    assert "+ 0" not in queries.captured_queries[-1]["sql"]


def rows_read(sql: str) -> tuple[int, str]:
    """Rows a statement's scans read (returned plus filtered out), on PostgreSQL."""
    import re

    from django.db import transaction

    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SET LOCAL enable_seqscan = off")
        cursor.execute("EXPLAIN (ANALYZE, FORMAT TEXT) " + sql)
        lines = [row[0] for row in cursor.fetchall()]
    read = 0
    for line in lines:
        if re.search(r"((?<!Bitmap )Index Scan|Index Only Scan|Seq Scan|Bitmap Heap Scan)", line):
            read += int(re.search(r"actual time=\S+ rows=(\d+)", line).group(1))
        elif "Rows Removed by Filter" in line:
            read += int(line.split(":")[1])
    return read, "\n".join(lines)


def search_pages(filters, direction: str = "after", cursor: str | None = None):
    """Every page of a search from a cursor on, following one direction."""
    from workflows_app import dashboard

    pages = []
    while True:
        page = dashboard.instance_page(filters, **({direction: cursor} if cursor else {}))
        pages.append(page)
        cursor = page.older if direction == "after" else page.newer
        if cursor is None:
            return pages


def test_a_search_page_reads_a_bounded_number_of_instances_and_goes_on_from_its_edge(
    monkeypatch,
):
    # ?q= is a substring no index serves: a rare term read the whole table for each page
    # (1M instances: 1.0-1.8 s; 4-6 s with bigger params). A page now reads SEARCH_SCAN
    # instances at most (100-190 ms) and Older goes on from where it stopped.
    from django.test.utils import CaptureQueriesContext

    from workflows_app import dashboard

    monkeypatch.setattr(dashboard, "SEARCH_SCAN", 5)
    for n in range(23):
        instance(f"row-{n}", params_json='{"needle": 1}' if n in (1, 2, 13) else "{}")
    needle = dashboard.ListFilters(q="needle")
    with CaptureQueriesContext(connection) as queries:
        first = dashboard.instance_page(needle)
    assert first.rows == [] and first.search_stopped == "older" and first.newer is None
    pages = search_pages(needle)
    found = [r.instance_id for p in pages for r in p.rows]
    assert found == ["row-13", "row-2", "row-1"]  # every match once, newest first
    assert [len(p.rows) for p in pages] == [0, 1, 0, 0, 2]  # 5 instances read a page
    # Back from the last page, Newer finds the matches newer than it, each once.
    back = search_pages(needle, "before", pages[-1].newer)
    assert [r.instance_id for p in back for r in p.rows] == ["row-13"]
    assert back[0].older is not None
    if connection.vendor == "postgresql":
        read, plan = rows_read(queries.captured_queries[-1]["sql"])
        assert read <= 5, plan
    # Matches within the bound: the page the unbounded search gave.
    common = dashboard.ListFilters(q="row-2")
    page = dashboard.instance_page(common, limit=2)
    assert [r.instance_id for r in page.rows] == ["row-22", "row-21"] and page.older


def test_a_search_for_an_id_finds_it_however_old_it_is(monkeypatch):
    # An instance's id or idempotency key (indexed) is found on the first page: the
    # bound reaches as far as its newest instance.
    from workflows_app import dashboard

    monkeypatch.setattr(dashboard, "SEARCH_SCAN", 3)
    instance("order-7", idempotency_key="k-1")
    for n in range(10):
        instance(f"later-{n}")
    page = dashboard.instance_page(dashboard.ListFilters(q="order-7"))
    assert [r.instance_id for r in page.rows] == ["order-7"]
    rest = search_pages(dashboard.ListFilters(q="order-7"), cursor=page.older)
    assert [r for p in rest for r in p.rows] == []
    by_key = dashboard.instance_page(dashboard.ListFilters(q="k-1"))
    assert [r.instance_id for r in by_key.rows] == ["order-7"]
    # A live list prepends the rows its search would show, from the newest SEARCH_SCAN.
    newer = dashboard.rows_newer_than(dashboard.ListFilters(q="later"), 0)
    assert [r.instance_id for r in newer] == ["later-9", "later-8", "later-7"]


def test_admission_reads_its_line_along_the_line_index_and_ended_debounces_by_admit_at():
    # The line's index (instance_in_line) holds no pending debounce: through the queue
    # index a first page read every one ahead of it (100,000: 134 ms), and so did the look
    # for stranded queues every 5 s. The debounces that ended are read by their admit_at.
    from workflows_app.engine.store import control

    debounced = {"status": "queued", "waiting_reason": control.DEBOUNCED + "…"}
    for n in range(30):
        instance(f"pending-{n}", admit_at=NOW + timedelta(hours=1), **debounced)
        instance(f"queued-{n}", status="queued")
    ended = instance("ended", admit_at=NOW, priority=1, **debounced)
    statements: list[tuple[str, list]] = []

    def capture(execute, sql, params, many, context):
        statements.append((sql, params))
        return execute(sql, params, many, context)

    scan = control._QueueScan("big", NOW, {"k"})
    with connection.execute_wrapper(capture):
        [first] = list(scan)
        scan._page((5, 0), (5, 10**9))
        scan._boundary((5, 0))
        assert control._queued_for_a_place(["big", "none"]) == {"big"}
    queued = Instance.objects.filter(instance_id__startswith="queued").values_list("id", flat=True)
    assert [c.pk for c in first] == [ended.pk, *sorted(queued)]
    plans = [explain_sql(sql, params) for sql, params in statements]
    assert all("instance_in_line" in plan for plan in plans), plans
    assert "instance_admit_at" in plans[0], plans[0]  # the ended debounces, beside it


def explain_sql(sql: str, params: list) -> str:
    with transaction.atomic(), connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute("SET LOCAL enable_seqscan = off")  # a tiny table: ask what it can use
        prefix = "EXPLAIN QUERY PLAN " if connection.vendor == "sqlite" else "EXPLAIN "
        cursor.execute(prefix + sql, params)
        return " ".join(str(cell) for row in cursor.fetchall() for cell in row)


def test_a_task_claim_and_a_queue_workers_timer_read_the_unleased_tasks_by_their_indexes():
    # A running task stays due: the task indexes hold those no worker holds only, so the
    # claim of a worker that runs tasks (each level of priority; of each queue: a queue
    # worker) and a queue worker's next timer read none of the fleet's leased tasks
    # (0032). SQLite uses a partial index only when the read spells its WHERE's terms:
    # the reads say `lease_token IS NULL`, and read the tasks whose lease ran out by
    # instance_lease_expiry.
    from workflows_app.engine.store import leases
    from workflows_app.engine.store.dialect import db_time

    live = NOW + timedelta(minutes=1)
    for n in range(30):
        task = {"queue": "emails", "wake_at": NOW, "priority": n % 10}
        instance(f"task-{n}", **task)
        instance(f"held-{n}", lease_token=f"t{n}", lease_expires_at=live, **task)
    if connection.vendor == "postgresql":
        statements = [
            (sql, leases._claim_params("w", 50, NOW, NOW, [], None, queues))
            for sql, queues in [
                (leases.CLAIM_BY_PRIORITY_SQL, None),
                (leases.CLAIM_IN_QUEUES_SQL, ["emails"]),
            ]
        ]
        statements.append((leases.NEXT_WAKE_IN_QUEUES_SQL, [["emails"]]))
    else:
        due = [db_time(NOW), db_time(NOW), "[]", db_time(NOW), None, None, "[]"]
        in_queues = [*due, '["emails"]']
        statements = [
            leases._tasks_by_rank_sqlite("queue IS NOT NULL", leases.RUNNABLE_WHERE, due, 50),
            leases._tasks_by_rank_sqlite(
                "queue IS NOT NULL", leases.RUNNABLE_IN_QUEUES_WHERE, in_queues, 50
            ),
            leases._any_runnable_sqlite(leases.RUNNABLE_IN_QUEUES_WHERE, in_queues),
            (leases.NEXT_WAKE_IN_QUEUES_SQLITE, ['["emails"]']),
        ]
    by_priority, in_queues_claim, any_or_timer, *timer = [explain_sql(*s) for s in statements]
    for plan in (by_priority, in_queues_claim):
        assert "instance_unleased_task_prio" in plan or "instance_unleased_queue_prio" in plan
    for plan in (any_or_timer, *timer):  # PostgreSQL: any of the three, on a tiny table
        assert "instance_unleased_queue" in plan or "instance_unleased_task_prio" in plan, plan
    if connection.vendor == "sqlite":  # not by instance_runnable, each due row of the fleet
        assert not any("instance_runnable" in p for p in (by_priority, in_queues_claim))
        assert all("instance_unleased_queue" in p for p in (any_or_timer, *timer))
        assert all(
            "instance_lease_expiry" in p for p in (by_priority, in_queues_claim, any_or_timer)
        )


def instance_rows_read(sql: str, params) -> int:
    """Rows a statement read from the instance table (each scan's rows, over its loops and
    with those its filter dropped), asked of PostgreSQL with EXPLAIN ANALYZE."""
    import json

    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + sql, params)
        [[plan]] = cursor.fetchall()
    plan = json.loads(plan) if isinstance(plan, str) else plan
    read, nodes = 0, [plan[0]["Plan"]]
    while nodes:
        node = nodes.pop()
        nodes.extend(node.get("Plans", []))
        if node.get("Relation Name") == Instance._meta.db_table:
            read += node["Actual Loops"] * (
                node["Actual Rows"] + node.get("Rows Removed by Filter", 0)
            )
    return read


def test_the_metrics_page_reads_the_instances_of_its_window_not_every_instance():
    # /stats/ joined the steps of its window to every instance, hashed against the whole
    # table (1M instances, a day of 100 a minute: the ranking of a day's steps 600 ms, the
    # durations of an hour's 440 ms). Each statement now reads the instances its window
    # holds: here 30,000 instances over 7 days, 4,320 a day, 180 an hour.
    from django.test.utils import CaptureQueriesContext

    from workflows_app import dashboard_metrics

    if connection.vendor != "postgresql":
        pytest.skip("PostgreSQL only: the plans its statistics choose at this size")
    table, steps = Instance._meta.db_table, StepRecord._meta.db_table
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {table} (workflow, instance_id, version, status, params_json, "
            "error_name, error_message, error_stack, created_by, created_at, updated_at, "
            "started_at, finished_at, waiting_reason, lease_owner, unproductive_claims, "
            "run_count, history_seq, step_seq, compensate_on_cancel, trace_id, parent_span, "
            "parent_step, priority, schedule, attributes) "
            "SELECT 'wf-' || g %% 5, 'i-' || g, 1, "
            "CASE WHEN g <= 20 THEN 'waiting' WHEN g %% 7 = 0 THEN 'errored' ELSE 'complete' END, "
            "'{}', '', '', '', '', c, c, c, CASE WHEN g > 20 THEN c + interval '9 seconds' END, "
            "'', '', 0, 1, 0, 3, false, '', '', '', 5, '', '{}' "
            "FROM (SELECT g, %s - g * interval '20 seconds' AS c "
            "FROM generate_series(1, 30000) g) AS made",
            [NOW],
        )
        cursor.execute(
            f"INSERT INTO {steps} (instance_id, name, kind, seq, status, attempts, "
            "max_attempts, last_error_name, last_error_message, last_error_stack, started_at, "
            "completed_at, event_type, has_compensation) "
            "SELECT i.id, 'step ' || n, 'do', n, 'complete', 1, 1, '', '', '', "
            "i.created_at + n * interval '1 second', i.created_at + n * interval '2 seconds', "
            f"'', false FROM {table} i, generate_series(1, 3) n",
        )
        cursor.execute(f"ANALYZE {table}")
        cursor.execute(f"ANALYZE {steps}")
    for key in ("day", "hour"):
        with CaptureQueriesContext(connection) as queries:
            page = dashboard_metrics.metrics_page(key, now=NOW)
        assert len(page.workflows) == 5 and page.workflows[0].steps["step 1"].finished
        for query in queries.captured_queries:
            read = instance_rows_read(query["sql"], None)
            assert read < 15_000, (key, read, query["sql"])


def test_the_first_admit_at_of_some_workflows_is_theirs_alone():
    # first_admit (a worker's look after a create's hint): the earliest admit_at among
    # the queued instances of the workflows asked about, whatever other workflows and
    # other statuses hold.
    from workflows_app.engine.store import control

    debounced = {"status": "queued", "waiting_reason": control.DEBOUNCED + "…"}
    for n in range(3):
        instance(f"pending-{n}", admit_at=NOW + timedelta(minutes=n), **debounced)
    later = NOW + timedelta(hours=2)
    instance("mine-rate", workflow="mine", status="queued", admit_at=later)
    instance("mine-sooner", workflow="mine", status="queued", admit_at=later - timedelta(hours=1))
    instance("mine-paused", workflow="mine", status="paused", admit_at=NOW - timedelta(days=1))
    instance("mine-line", workflow="mine", status="queued")
    instance("other-line", workflow="other", status="queued")
    assert control.first_admit(["mine", "other"]) == later - timedelta(hours=1)
    assert control.first_admit(["other"]) is None
    assert control.first_admit(["other", "none"]) is None
    assert control.first_admit(["big"]) == NOW
    assert control.first_admit(["mine", "big", "none"]) == NOW
    assert control.first_admit([]) is None
    sql, params = control.first_admit_statement(["mine", "other"])
    plan = explain_sql(sql, params)
    assert "instance_queue_admit_at" in plan, plan
    assert "instance_admit_at" not in plan, plan


def test_the_first_admit_at_of_a_workers_workflows_reads_no_other_workflows_queue():
    # Every claim after a create's hint reads the first admit_at of the worker's workflows
    # (first_admit, in the claim's pipeline). MIN over them all at once walked
    # instance_admit_at in time order past every queued instance of other workflows due
    # before the first of theirs: one workflow's 100,000 pending debounces cost every claim
    # of a worker not running it 20-22 ms of the server's time (52-90 ms on a loaded
    # machine); one probe of instance_queue_admit_at a workflow, 0.1 ms.
    if connection.vendor != "postgresql":
        pytest.skip("PostgreSQL only: it counts the tuples a transaction read")
    from tests.test_admission_many_keys import tuples_read
    from workflows_app.engine.store import control

    debounced = {"status": "queued", "waiting_reason": control.DEBOUNCED + "…"}
    template = instance("pending", admit_at=NOW + timedelta(hours=1), **debounced)
    instance("mine-rate", workflow="mine", status="queued", admit_at=NOW + timedelta(hours=3))
    table = Instance._meta.db_table
    columns = ", ".join(
        f.column
        for f in Instance._meta.concrete_fields
        if f.column not in ("id", "instance_id", "admit_at")
    )
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {table} ({columns}, instance_id, admit_at) SELECT {columns}, "
            "'pending-' || g::text, admit_at + g * interval '1 second' "
            f"FROM {table}, generate_series(1, 20000) g WHERE id = %s",
            [template.pk],
        )
        cursor.execute(f"ANALYZE {table}")
    names = ["mine", "other", "third"]
    for _ in range(6):  # past the custom plans a prepared statement starts with
        assert control.first_admit(names) == NOW + timedelta(hours=3)
    with transaction.atomic():
        before = tuples_read()
        assert control.first_admit(names) == NOW + timedelta(hours=3)
        read = tuples_read() - before
    assert read < 100, f"the first admit_at of 3 workflows read {read} tuples"


def test_admission_counts_the_places_held_from_the_index_alone():
    # Every create and run's end of a flow-controlled workflow counts the places held
    # (max_concurrent_instances, max_concurrent_per_key). With a paused instance holding
    # one only once started, the count read every holding row besides its index entry (a
    # bitmap heap scan): 7.7-11.9 ms an admission at 10,000 places held. The statuses
    # that hold a place are counted from the index alone (2.0-3.9 ms once the visibility
    # map has the rows, as for instances parked a while), the started paused ones apart.
    from workflows_app.engine.limits import Limits
    from workflows_app.engine.store import control

    for n, status in enumerate(["running", "waiting", "waiting", "complete", "queued"]):
        instance(f"{status}-{n}", status=status, concurrency_key=f"k{n % 2}", started_at=NOW)
    instance("paused-started", status="paused", concurrency_key="k0", started_at=NOW)
    instance("paused-queued", status="paused", concurrency_key="k0")
    if connection.vendor == "postgresql":  # the visibility map, as autovacuum keeps it
        with connection.cursor() as cursor:
            cursor.execute(f"VACUUM ANALYZE {Instance._meta.db_table}")
    statements: list[tuple[str, list]] = []

    def capture(execute, sql, params, many, context):
        statements.append((sql, params))
        return execute(sql, params, many, context)

    limits = Limits(max_concurrent_instances=10, max_concurrent_per_key=10)
    with connection.execute_wrapper(capture):
        assert control._free_slots("big", limits) == 10 - 4
        admission = control.Admission("big", limits, NOW)
        admission.learn_keys({"k0", "k1", "k2"})
    assert admission.key_active == {"k0": 3, "k1": 1, "k2": 0}
    # A key's count: a probe of its index a holding status, so its LIMIT stops the read.
    (of_keys,) = [(sql, params) for sql, params in statements if "asked" in sql]
    plan = explain_sql(*of_keys)
    if connection.vendor == "sqlite":
        assert (
            plan.count("instance_concurrency_key (workflow=? AND concurrency_key=? AND status=?)")
            == 5
        ), plan
        return
    assert "Filter: ((status)::text = ANY" not in plan, plan
    counts = [(sql, params) for sql, params in statements if "count(*)" in sql]
    assert len(counts) >= 2, statements
    for sql, params in counts:
        plan = explain_sql(sql, params)
        assert "Index Only Scan using instance_" in plan, plan
        assert "Bitmap Heap Scan" not in plan, plan


def test_a_claim_on_sqlite_reads_none_of_the_rows_the_workers_hold():
    # A running instance stays due, so instance_runnable holds every row the workers on
    # the WAL file hold (and the claiming worker's own): the claim's look and pick by
    # wake_at went past each before the first row they could take. They now read the
    # unleased rows by instance_unleased_runnable (the read spells its WHERE's terms) and
    # those whose lease ran out by instance_lease_expiry, merged by wake_at. Counted in
    # SQLite's virtual machine steps: timing-free. PostgreSQL's claim:
    # test_a_claim_and_the_next_timer_read_none_of_the_fleets_leased_rows.
    if connection.vendor != "sqlite":
        pytest.skip("SQLite's claim; PostgreSQL's is counted in test_postgres_fast_path")
    from django.test.utils import CaptureQueriesContext

    from workflows_app.engine import clock
    from workflows_app.engine.store import leases

    clock.set_clock(clock.ControllableClock(NOW))
    table = Instance._meta.db_table

    def due(name: str, minutes: int, **fields) -> int:
        return instance(name, wake_at=NOW - timedelta(minutes=minutes), **fields).pk

    def lost(name: str, minutes: int) -> int:  # its worker died: the lease ran out
        late = {"lease_token": f"dead-{name}", "lease_expires_at": NOW - timedelta(seconds=1)}
        return due(name, minutes, status="running", **late)

    def claim(exclude: int) -> tuple[list[int], int, list[str]]:
        steps = [0]

        def step() -> int:
            steps[0] += 1
            return 0

        raw = connection.connection
        raw.set_progress_handler(step, 10)
        try:
            with CaptureQueriesContext(connection) as queries:
                claimed = leases.claim_runnable("w", 3, 30, exclude=[exclude])
        finally:
            raw.set_progress_handler(None, 10)
        reads = [
            q["sql"]
            for q in queries.captured_queries
            if q["sql"].startswith("SELECT") and "wake_at <=" in q["sql"] and table in q["sql"]
        ]
        return [pk for pk, _ in claimed], steps[0], reads

    first = [due("a-0", 9), lost("lost-a", 8), due("a-1", 7), due("a-2", 6), due("a-3", 5)]
    claimed, alone, _ = claim(exclude=first[2])
    assert claimed == [first[0], first[1], first[3]]  # by wake_at, a-1 excluded, 3 at most
    Instance.objects.bulk_create(
        Instance(
            instance_id=f"held-{n}",
            workflow="big",
            version=1,
            created_at=NOW,
            updated_at=NOW,
            status="running",
            wake_at=NOW - timedelta(hours=1),
            lease_owner="other",
            lease_token=f"held-{n}",
            lease_expires_at=NOW + timedelta(minutes=1),
        )
        for n in range(2000)
    )
    second = [due("b-0", 4), lost("lost-b", 3), due("b-1", 2), due("b-2", 1)]
    claimed, behind_leases, reads = claim(exclude=second[2])
    assert claimed == [first[2], first[4], second[0]]  # a-1 and a-3 first: due before
    claimed, _, _ = claim(exclude=second[2])
    assert claimed == [second[1], second[3]]
    assert Instance.objects.filter(lease_owner="other").count() == 2000
    assert behind_leases < 2 * alone, (alone, behind_leases)
    # The look and the pick, each by the two indexes: not 2,000 leased rows read each.
    assert len(reads) == 2, reads
    for plan in [explain_captured(sql) for sql in reads]:
        assert "instance_runnable" not in plan, plan
        assert "instance_unleased_runnable" in plan and "instance_lease_expiry" in plan, plan
