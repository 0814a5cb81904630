"""SPEC §9 in the client: search attributes, delete, retention by outcome."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from django.db import connection, transaction
from django.test import override_settings

from workflows_app import testing
from workflows_app.client import get_workflow
from workflows_app.engine import NonRetryableError, WorkflowEntrypoint, register, store
from workflows_app.engine.errors import (
    InstanceNotFound,
    InvalidDuration,
    InvalidInput,
    InvalidTransition,
    LimitExceeded,
)
from workflows_app.engine.store import search
from workflows_app.models import (
    BulkJobItem,
    ErrorRecord,
    HistoryRecord,
    InboxEvent,
    Instance,
    InstanceAttribute,
    Span,
    StepRecord,
)

pytestmark = pytest.mark.django_db(transaction=True)

START = datetime(2026, 1, 1, tzinfo=UTC)


@pytest.fixture
def tagged(registered):
    @register("tagged")
    class Tagged(WorkflowEntrypoint):
        async def run(self, event, step):
            await step.set_attributes("tag plan", {"plan": event.payload or "enterprise"})
            got = await step.wait_for_event("go", type="go")
            if got.payload == "fail":
                raise NonRetryableError("asked to fail")
            return "done"

    return get_workflow("tagged")


def ids(page):
    return [i.id for i in page.instances]


# --- search attributes ---------------------------------------------------------------------


def test_list_filters_by_attributes_and_status_with_keyset_pages(tagged):
    for n in range(5):
        tagged.create(id=f"c9-{n}", attributes={"customer": "c-9", "n": n, "vip": n % 2 == 0})
    tagged.create(id="c1", attributes={"customer": "c-1"})
    tagged.create(id="bare")

    first = tagged.list(attributes={"customer": "c-9"}, limit=2)
    assert ids(first) == ["c9-4", "c9-3"]
    second = tagged.list(attributes={"customer": "c-9"}, limit=2, cursor=first.cursor)
    assert ids(second) == ["c9-2", "c9-1"]
    assert ids(tagged.list(attributes={"customer": "c-9", "n": 3})) == ["c9-3"]
    assert ids(tagged.list(attributes={"customer": "c-9", "vip": False})) == ["c9-3", "c9-1"]
    assert ids(tagged.list(attributes={"customer": "c-2"})) == []
    assert ids(tagged.list(attributes={"customer": "c-1"}, status="running")) == ["c1"]
    assert ids(tagged.list(attributes={"customer": "c-1"}, status="waiting")) == []
    assert tagged.get("c1").status().status == "running"
    assert tagged.list(attributes={"customer": "c-1"}).instances[0].attributes == {
        "customer": "c-1"
    }


def test_set_attributes_is_a_durable_upsert_that_replay_does_not_repeat(tagged):
    inst = tagged.create(id="up", attributes={"customer": "c-9", "plan": "pro"})
    testing.run_until_idle()
    assert inst.status().status == "waiting"
    assert inst.row().attributes == {"customer": "c-9", "plan": "enterprise"}
    assert ids(tagged.list(attributes={"plan": "enterprise"}, status="waiting")) == ["up"]
    assert ids(tagged.list(attributes={"plan": "pro"})) == []
    # An operator edit after the step: replay returns the checkpoint and writes nothing.
    Instance.objects.filter(pk=inst.row().pk).update(attributes={"customer": "c-9", "plan": "x"})
    inst.send_event("go", "ok")
    testing.run_until_idle()
    assert inst.status().output == "done"
    assert inst.row().attributes == {"customer": "c-9", "plan": "x"}
    (step,) = [s for s in inst.steps() if s.name == "tag plan"]
    assert step.output == {"plan": "enterprise"} and step.attempts == 1


@pytest.mark.parametrize(
    ("attributes", "error", "message"),
    [
        (["plan"], InvalidInput, "must be an object"),
        ({"": "x"}, InvalidInput, "invalid attribute key ''"),
        ({"a b": "x"}, InvalidInput, "invalid attribute key 'a b'"),
        ({"plan": None}, InvalidInput, "attribute 'plan': values must be"),
        ({"plan": {"nested": 1}}, InvalidInput, "got dict"),
        ({"n": float("nan")}, InvalidInput, "not a finite number"),
        ({"n": 2**70}, InvalidInput, "outside 64 bits"),
        ({"s": "x" * 257}, LimitExceeded, "max attribute value length"),
        ({f"k{i}": i for i in range(33)}, LimitExceeded, "max attributes"),
    ],
)
def test_bad_attributes_are_refused_naming_what_is_wrong_and_store_nothing(
    tagged, attributes, error, message
):
    with pytest.raises(error, match=message):
        tagged.create(id="bad", attributes=attributes)
    with pytest.raises(error, match=message):
        tagged.list(attributes=attributes)
    assert not Instance.objects.filter(instance_id="bad").exists()


def test_set_attributes_with_bad_values_fails_the_instance_with_the_reason(registered):
    @register("badtag")
    class BadTag(WorkflowEntrypoint):
        async def run(self, event, step):
            await step.set_attributes("tag", {"plan": ["a", "list"]})

    inst = get_workflow("badtag").create()
    testing.run_until_idle()
    status = inst.status()
    assert status.status == "errored"
    assert "attribute 'plan'" in status.error["message"]


def test_an_attribute_key_with_double_underscores_or_dots_is_one_key(tagged):
    tagged.create(id="odd", attributes={"a__b": 1, "x.y": "z"})
    tagged.create(id="other", attributes={"a": "b"})
    assert ids(tagged.list(attributes={"a__b": 1})) == ["odd"]
    assert ids(tagged.list(attributes={"x.y": "z"})) == ["odd"]


def test_a_filter_tells_strings_numbers_and_booleans_apart_alike_on_both_databases(tagged):
    # SPEC §9: str/int/float/bool values; numbers compare as numbers (1 == 1.0), a boolean
    # is not a number and a string of digits is not a number.
    for name, value in [("one", 1), ("one-float", 1.0), ("true", True), ("text", "1")]:
        tagged.create(id=name, attributes={"v": value})
    tagged.create(id="half", attributes={"v": 1.5, "w": False})
    assert ids(tagged.list(attributes={"v": 1})) == ["one-float", "one"]
    assert ids(tagged.list(attributes={"v": 1.0})) == ["one-float", "one"]
    assert ids(tagged.list(attributes={"v": True})) == ["true"]
    assert ids(tagged.list(attributes={"v": "1"})) == ["text"]
    assert ids(tagged.list(attributes={"v": 1.5, "w": False})) == ["half"]
    assert ids(tagged.list(attributes={"w": 0})) == []
    assert ids(tagged.list(attributes={"v": "true"})) == []


def explain(query):
    sql, params = query.query.sql_with_params()
    with transaction.atomic(), connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute("SET LOCAL enable_seqscan = off")  # a tiny table: ask what it can use
        cursor.execute(
            ("EXPLAIN QUERY PLAN " if connection.vendor == "sqlite" else "EXPLAIN ") + sql, params
        )
        return " ".join(str(cell) for row in cursor.fetchall() for cell in row)


def test_a_filtered_page_walks_the_attribute_index_newest_first_without_sorting(tagged):
    for n in range(20):
        tagged.create(id=f"i{n}", attributes={"customer": f"c-{n % 3}"})
    page = store.order_by_id(tagged.matching(attributes={"customer": "c-1"}))
    assert [r.instance_id for r in page[:3]] == ["i19", "i16", "i13"]
    plan = explain(page.values_list("id")[:51])
    assert "instance_attribute_lookup" in plan, plan
    if connection.vendor == "sqlite":
        assert "TEMP B-TREE" not in plan, plan  # read in order, stopped at the page's end
    # Across workflows (the dashboard without a workflow) the same index serves.
    across = store.order_by_id(store.filter_attributes(Instance.objects.all(), {"customer": "c-1"}))
    assert "instance_attribute_lookup" in explain(across.values_list("id")[:51])


def test_a_filter_of_several_keys_walks_the_rarest_one_on_sqlite(tagged):
    for n in range(12):
        tagged.create(id=f"k{n}", attributes={"plan": "pro", "customer": f"c-{n}"})
    query = tagged.matching(attributes={"plan": "pro", "customer": "c-4"})
    assert [r.instance_id for r in store.order_by_id(query)] == ["k4"]
    if connection.vendor == "sqlite":  # the first joined row is the one walked
        assert [key for key, _ in search.rarest_first({"plan": "pro", "customer": "c-4"})] == [
            "customer",
            "plan",
        ]
        sql = str(query.query)  # and the filter joins the rare key's row first
        assert sql.index("customer") < sql.index("plan"), sql


def test_a_filter_of_many_keys_joins_a_few_and_counts_the_rest(tagged):
    # PostgreSQL planned a join of one attribute row per key by searching their orders:
    # 32 keys took 1150-1340 ms to plan (60 ms to run) at 640,000 attribute rows. Past
    # JOINED_KEYS the keys are checked by one count of the candidate's rows.
    from workflows_app.engine.attributes import MAX_ATTRIBUTES

    every = {f"k{n}": n for n in range(MAX_ATTRIBUTES)}
    tagged.create(id="all", attributes=every)
    tagged.create(id="last-differs", attributes={**every, "k31": -1})
    tagged.create(id="one-missing", attributes={k: v for k, v in every.items() if k != "k20"})
    tagged.create(id="rare", attributes={**every, "k9": "rare"})
    for n in range(5):
        tagged.create(id=f"common-{n}", attributes={"k0": 0})
    assert ids(tagged.list(attributes=every)) == ["all"]
    assert ids(tagged.list(attributes={**every, "k9": "rare"})) == ["rare"]
    both = ids(tagged.list(attributes={"k0": 0, "k1": 1}))
    assert both == ["rare", "one-missing", "last-differs", "all"]
    query = tagged.matching(attributes=every)
    sql = str(query.query)
    assert sql.count("JOIN") <= 4, sql  # search.JOINED_KEYS rows joined, not 32
    # The rarest keys are the ones joined (the first walked): k9's rare value first.
    assert search.rarest_first({**every, "k9": "rare"})[0] == ("k9", "rare")
    assert query.count() == 1


def test_attribute_rows_follow_create_set_attributes_and_delete(tagged):
    def rows(inst):
        return dict(
            InstanceAttribute.objects.filter(instance_id=inst.row().pk).values_list("key", "value")
        )

    inst = tagged.create(id="r", attributes={"customer": "c-9", "plan": "pro", "seats": 2.0})
    assert rows(inst) == {"customer": '"c-9"', "plan": '"pro"', "seats": "2"}
    testing.run_until_idle()  # step.set_attributes: plan -> enterprise
    assert rows(inst) == {"customer": '"c-9"', "plan": '"enterprise"', "seats": "2"}
    assert ids(tagged.list(attributes={"plan": "enterprise", "seats": 2})) == ["r"]
    inst.terminate()
    pk = inst.row().pk
    inst.delete()
    assert not InstanceAttribute.objects.filter(instance_id=pk).exists()


def test_set_attributes_that_fails_its_fence_writes_no_rows(tagged):
    inst = tagged.create(id="f", attributes={"plan": "pro"})
    with pytest.raises(store.LeaseLost):
        store.merge_attributes(inst.row().pk, "not-the-lease", {"plan": "stolen"})
    assert ids(tagged.list(attributes={"plan": "pro"})) == ["f"]
    assert ids(tagged.list(attributes={"plan": "stolen"})) == []


# --- delete ------------------------------------------------------------------------------


def test_delete_removes_every_row_of_a_finished_instance_and_refuses_a_live_one(tagged):
    done = tagged.create(id="done")
    live = tagged.create(id="live")
    testing.run_until_idle()
    done.send_event("go", "fail")
    testing.run_until_idle()
    assert done.status().status == "errored"
    pk, trace = done.row().pk, done.row().trace_id
    assert ErrorRecord.objects.filter(instance_id=pk).exists()
    assert Span.objects.filter(trace_id=trace).exists()

    with pytest.raises(InvalidTransition, match="it is waiting; only finished"):
        live.delete()
    done.delete()
    assert not Instance.objects.filter(pk=pk).exists()
    for model in (StepRecord, InboxEvent, HistoryRecord, ErrorRecord):
        assert not model.objects.filter(instance_id=pk).exists(), model
    assert not Span.objects.filter(trace_id=trace).exists()
    with pytest.raises(InstanceNotFound):
        done.status()
    with pytest.raises(InstanceNotFound):
        done.send_event("go")  # an event for a deleted instance is refused
    assert live.status().status == "waiting"


def test_spans_stored_before_their_instance_go_with_it_found_without_a_trace_index(tagged):
    done = tagged.create(id="done")
    done.send_event("go", "fail")
    testing.run_until_idle()
    trace = done.row().trace_id
    when = datetime(2026, 1, 1, tzinfo=UTC)
    orphan = {"span_id": "1" * 16, "name": "create tagged", "kind": "PRODUCER"}
    Span.objects.create(trace_id=trace, start_time=when, end_time=when, **orphan)
    other = Span.objects.create(trace_id="f" * 32, start_time=when, end_time=when, **orphan)
    # Spans without an instance are few, at the NULL end of the instance's index.
    lookup = Span.objects.filter(instance__isnull=True, trace_id__in=[trace])
    assert "span_instance" in explain(lookup.values_list("id"))

    done.delete()
    assert not Span.objects.filter(trace_id=trace).exists()
    assert list(Span.objects.filter(instance__isnull=True)) == [other]


def test_an_instance_s_children_are_found_through_the_per_step_index(tagged):
    """No index of instances' trace ids nor of the parent key alone (each insert and
    indexed update of an instance wrote into both): children are looked up by parent
    through an index of children only (instance_child_per_step, or instance_children, the
    one in start order), and a deleted parent lets its children go."""
    with connection.cursor() as cursor:
        indexes = connection.introspection.get_constraints(cursor, Instance._meta.db_table)
    on = {tuple(c["columns"]) for c in indexes.values() if c["index"] or c["unique"]}
    assert ("trace_id",) not in on and ("parent_id",) not in on
    parent = tagged.create(id="parent")
    children = [tagged.create(id=f"child-{n}") for n in range(2)]
    for n, child in enumerate(children):
        Instance.objects.filter(pk=child.row().pk).update(
            parent_id=parent.row().pk, parent_step=f"start {n}"
        )
    plan = explain(Instance.objects.filter(parent_id=parent.row().pk).values_list("id"))
    assert "instance_child_per_step" in plan or "instance_children" in plan, plan
    parent.send_event("go", "fail")
    testing.run_until_idle()
    parent.delete()
    left = Instance.objects.filter(instance_id__startswith="child-").values_list("parent_id")
    assert list(left) == [(None,), (None,)]


def test_delete_batch_is_all_or_nothing(tagged):
    for n in range(3):
        tagged.create(id=f"d{n}")
    testing.run_until_idle()
    for n in range(2):
        tagged.get(f"d{n}").terminate()
    with pytest.raises(InvalidTransition, match="'d2'"):
        tagged.delete_batch(["d0", "d1", "d2"])
    with pytest.raises(InstanceNotFound, match="'nope'"):
        tagged.delete_batch(["d0", "nope"])
    assert Instance.objects.filter(workflow="tagged").count() == 3
    assert tagged.delete_batch(["d0", "d1", "d0"]) == 2
    assert ids(tagged.list()) == ["d2"]
    with pytest.raises(InvalidInput):
        tagged.delete_batch("d2")
    with pytest.raises(LimitExceeded, match="max_batch_size"):
        tagged.delete_batch([f"x{n}" for n in range(101)])


async def test_the_async_twins_delete(tagged):
    inst = await tagged.acreate(id="a")
    await inst.aterminate()
    await inst.adelete()
    assert await tagged.adelete_batch([]) == 0
    with pytest.raises(InstanceNotFound):
        await inst.astatus()


# --- retention -----------------------------------------------------------------------------


def test_retention_by_outcome_on_the_engine_clock(tagged):
    with testing.fake_clock(START) as clock:
        ok = tagged.create(id="ok", retention={"success": "1 hour", "error": "1 day"})
        bad = tagged.create(id="bad", retention={"success": "1 hour", "error": "1 day"})
        stopped = tagged.create(id="stopped", retention={"success": "1 hour", "error": "1 day"})
        only_ok = tagged.create(id="only-ok", retention={"success": "1 hour"})
        testing.run_until_idle()
        ok.send_event("go", "fine")
        bad.send_event("go", "fail")
        only_ok.send_event("go", "fail")  # errors: no error retention, kept (no max_retention)
        stopped.terminate()
        testing.run_until_idle()
        assert [i.status().status for i in (ok, bad, stopped, only_ok)] == [
            "complete",
            "errored",
            "terminated",
            "errored",
        ]
        clock.advance("2 hours")
        assert store.prune() == 1
        assert ids(tagged.list()) == ["only-ok", "stopped", "bad"]
        clock.advance("1 day")
        assert store.prune() == 2
        assert ids(tagged.list()) == ["only-ok"]


def grow_history(handle, count):
    """`count` more history records for an instance (a long-running one's history)."""
    row = handle.row()
    HistoryRecord.objects.bulk_create(
        (
            HistoryRecord(
                instance_id=row.pk,
                sequence=row.history_seq + n,
                created_at=START,
                type="probe.logged",
            )
            for n in range(1, count + 1)
        ),
        batch_size=5_000,
    )
    Instance.objects.filter(pk=row.pk).update(history_seq=row.history_seq + count)


def test_a_prune_batch_is_bounded_by_the_rows_it_deletes_not_only_instances(tagged):
    """Three expired instances of 30,000 history records each: a batch of 500 instances
    deleted all 90,000 rows in one transaction; it now stops at PRUNE_ROWS (50,000),
    taking at least one instance, and the rest go in the next batches."""
    with testing.fake_clock(START) as clock:
        handles = [tagged.create(id=f"long-{n}", retention="1 hour") for n in range(3)]
        testing.run_until_idle()
        for handle in handles:
            handle.send_event("go", "ok")
        testing.run_until_idle()
        for handle in handles:
            grow_history(handle, 30_000)
        clock.advance("2 hours")
        sizes = []
        assert store.prune(max_batches=1, on_batch=sizes.append) == 1
        assert sizes == [1]
        cuts = []  # a worker prunes one batch, then again at once when it was cut short
        assert store.prune(max_batches=1, on_cut=lambda: cuts.append(True)) == 1
        assert cuts == [True]
        assert store.prune() == 1
        assert not HistoryRecord.objects.exists() and not Instance.objects.exists()


@override_settings(WFDASH={"RETENTION": {"success": "1 hour", "error": "3 hours"}})
def test_settings_retention_applies_by_outcome_unless_the_instance_gives_its_own(tagged):
    with testing.fake_clock(START) as clock:
        ok = tagged.create(id="ok")
        bad = tagged.create(id="bad")
        kept = tagged.create(id="kept", retention=0)
        testing.run_until_idle()
        ok.send_event("go")
        bad.send_event("go", "fail")
        kept.send_event("go")
        testing.run_until_idle()
        clock.advance("2 hours")
        assert store.prune() == 1 and ids(tagged.list()) == ["kept", "bad"]
        clock.advance("2 hours")
        assert store.prune() == 1 and ids(tagged.list()) == ["kept"]


@pytest.mark.parametrize(
    ("retention", "error", "message"),
    [
        ({"sucess": "1 day"}, InvalidInput, "unknown outcome"),
        ({"error": "forever"}, InvalidDuration, "forever"),
        ("soon", InvalidDuration, "soon"),
    ],
)
def test_bad_retention_is_refused(tagged, retention, error, message):
    with pytest.raises(error, match=message):
        tagged.create(id="r", retention=retention)
    assert not Instance.objects.filter(instance_id="r").exists()


# --- bulk operations -------------------------------------------------------------------------


def waiting_instances(wf, n, **attributes):
    handles = [wf.create(id=f"w{i}", attributes=attributes) for i in range(n)]
    testing.run_until_idle()
    assert {h.status().status for h in handles} == {"waiting"}
    return handles


def test_bulk_terminate_by_filter_acts_on_what_matched_at_the_start_in_batches(tagged):
    waiting_instances(tagged, 5, customer="c-9")
    tagged.create(id="free", attributes={"customer": "c-1"})
    testing.run_until_idle()
    job = tagged.bulk("terminate", status="waiting", attributes={"customer": "c-9"}, actor="ops")
    assert (job.matched, job.applied, job.done) == (5, 0, False)
    tagged.create(id="later", attributes={"customer": "c-9"})  # after the start: not in the job
    testing.run_until_idle()  # not started: run_until_idle also processes bulk jobs
    assert tagged.get("later").status().status == "waiting"
    # Batches of 2: the job's progress grows batch by batch.
    from workflows_app import bulk

    job2 = tagged.bulk("pause", attributes={"customer": "c-1"})
    assert bulk.process_batch(job2.id, size=2) is not None
    assert job2.refresh().done and job2.applied == 1

    job.refresh()
    assert (job.done, job.matched, job.applied, job.skipped, job.failed) == (True, 5, 5, 0, 0)
    assert [tagged.get(f"w{i}").status().status for i in range(5)] == ["terminated"] * 5
    assert tagged.get("free").status().status == "paused"
    history = tagged.get("w0").history()
    assert history[-1].type == "instance.terminated" and history[-1].actor == "ops"


def test_bulk_progress_is_recorded_per_batch_and_a_repeat_skips_what_is_done(tagged):
    from workflows_app import bulk

    waiting_instances(tagged, 5)
    job = tagged.bulk("terminate", status="waiting")
    assert bulk.process_batch(job.id, size=2).processed == 2
    job.refresh()
    assert (job.processed, job.applied, job.done) == (2, 2, False)
    assert bulk.process_batch(job.id, size=2).processed == 4
    assert bulk.process_batch(job.id, size=2).done
    assert bulk.process_batch(job.id, size=2) is None  # finished: nothing more to take
    again = tagged.bulk("terminate")  # every status: all five already terminated
    testing.run_until_idle()
    again.refresh()
    assert (again.matched, again.applied, again.skipped, again.failed) == (5, 0, 5, 0)


def version_loads(queries) -> int:
    """Statements that load an instance's deferred `version` alone: what a handle built
    from a row read without it costs when it reads its limits (one more query each)."""
    return sum(
        q["sql"].startswith(
            'SELECT "workflows_app_instance"."id", "workflows_app_instance"."version" FROM'
        )
        for q in queries.captured_queries
    )


def test_a_bulk_job_reads_each_instance_s_version_with_its_row(tagged):
    """batch_rows left out `version`: every resume, cancel, restart or send_event of a bulk
    job loaded it once more per instance (3 statements here) to read the limits."""
    from django.test.utils import CaptureQueriesContext

    from workflows_app import bulk

    for handle in waiting_instances(tagged, 3):
        handle.pause()
    job = tagged.bulk("resume", status="paused")
    with CaptureQueriesContext(connection) as queries:
        assert bulk.process_batch(job.id).applied == 3
    assert version_loads(queries) == 0


def test_a_job_keeps_the_item_rows_of_the_work_left_only(tagged, monkeypatch):
    """A job's snapshot (one row per matched instance) shrinks batch by batch: a finished
    job of 100,000 instances left 100,000 rows behind for ever, job after job."""
    from workflows_app import bulk

    waiting_instances(tagged, 5)
    job = tagged.bulk("pause")
    left = BulkJobItem.objects.filter(job_id=job.id)
    assert left.count() == 5
    bulk.process_batch(job.id, size=2)
    assert sorted(left.values_list("instance_pk", flat=True)) == sorted(
        Instance.objects.filter(instance_id__in=["w2", "w3", "w4"]).values_list("id", flat=True)
    )
    # A worker that dies after recording its batch, before the commit: the deletions roll
    # back with the rest, and the batch is taken again whole.
    record = bulk.store.bulk.record_batch

    def record_then_die(*args):
        record(*args)
        raise KeyboardInterrupt("the worker died")

    monkeypatch.setattr(bulk.store.bulk, "record_batch", record_then_die)
    with pytest.raises(KeyboardInterrupt):
        bulk.process_batch(job.id, size=2)
    assert left.count() == 3
    monkeypatch.undo()
    testing.run_until_idle()
    job.refresh()
    assert (job.done, job.processed, job.applied) == (True, 5, 5)
    assert left.count() == 0


def test_a_bulk_delete_batch_is_bounded_by_the_rows_it_deletes(tagged):
    """As a prune's: three finished instances of 30,000 history records each were one
    batch, 90,000 rows in one transaction; a batch now stops at PRUNE_ROWS (50,000)."""
    from workflows_app import bulk

    for handle in waiting_instances(tagged, 3):
        handle.terminate()
        grow_history(handle, 30_000)
    job = tagged.bulk("delete")
    assert bulk.process_batch(job.id).processed == 1
    assert bulk.process_batch(job.id).processed == 2
    assert bulk.process_batch(job.id).done
    job.refresh()
    assert (job.matched, job.applied, job.skipped) == (3, 3, 0)
    assert not HistoryRecord.objects.exists() and not Instance.objects.exists()


def test_a_crash_mid_batch_rolls_the_batch_back_and_it_is_taken_again(tagged, monkeypatch):
    from workflows_app import bulk

    waiting_instances(tagged, 4)
    job = tagged.bulk("send_event", event_type="go", payload="ok")
    calls = []
    real = bulk.ACTIONS["send_event"]

    def crash_on_third(h, options, actor):
        calls.append(h.id)
        if len(calls) == 3:
            raise KeyboardInterrupt("the worker died")  # not an error the batch handles
        return real(h, options, actor)

    monkeypatch.setitem(bulk.ACTIONS, "send_event", crash_on_third)
    with pytest.raises(KeyboardInterrupt):
        bulk.process_batch(job.id)
    assert InboxEvent.objects.count() == 0  # the two sent before the crash were rolled back
    assert job.refresh().processed == 0
    monkeypatch.setitem(bulk.ACTIONS, "send_event", real)
    testing.run_until_idle()
    assert job.refresh().done and job.applied == 4
    assert InboxEvent.objects.count() == 4  # each instance got its event exactly once
    assert {tagged.get(f"w{i}").status().output for i in range(4)} == {"done"}


def restart_records(handle):
    return HistoryRecord.objects.filter(
        instance_id=handle.row().pk, type="instance.restarted"
    ).count()


def test_a_repeated_bulk_restart_of_errored_instances_restarts_each_once(tagged):
    handles = waiting_instances(tagged, 3)
    for handle in handles:
        handle.send_event("go", "fail")
    testing.run_until_idle()
    assert {h.status().status for h in handles} == {"errored"}
    # The same request twice (a retried POST, a double click): both snapshot the three.
    from workflows_app import bulk

    first = tagged.bulk("restart", status="errored")
    second = tagged.bulk("restart", status="errored")
    assert (first.matched, second.matched) == (3, 3)
    bulk.process_batch(first.id)
    bulk.process_batch(second.id)
    assert [restart_records(h) for h in handles] == [1, 1, 1]
    second.refresh()
    assert (second.done, second.applied, second.skipped) == (True, 0, 3)


def test_a_bulk_restart_of_waiting_instances_takes_one_a_worker_claimed_since(tagged):
    """Live statuses alternate as an instance runs (waiting, running, waiting): a job's
    live status filter is not checked again, or it would skip instances at random."""
    from workflows_app import bulk

    handles = waiting_instances(tagged, 2)
    job = tagged.bulk("restart", status="waiting")
    Instance.objects.filter(instance_id="w0").update(status="running")  # a worker's claim
    bulk.process_batch(job.id)
    job.refresh()
    assert (job.applied, job.skipped) == (2, 0)
    assert [restart_records(h) for h in handles] == [1, 1]


def test_a_bulk_delete_of_errored_instances_spares_one_restarted_and_completed_since(
    tagged, monkeypatch
):
    handles = waiting_instances(tagged, 2)
    for handle in handles:
        handle.send_event("go", "fail")
    testing.run_until_idle()
    job = tagged.bulk("delete", status="errored")
    # No worker takes the job's batches until the one below (run_until_idle would).
    from workflows_app import bulk

    monkeypatch.setattr(bulk, "process_pending", lambda: False)
    handles[0].restart()
    testing.run_until_idle()
    handles[0].send_event("go", "ok")
    testing.run_until_idle()
    assert handles[0].status().status == "complete"
    bulk.process_batch(job.id)
    job.refresh()
    assert (job.applied, job.skipped) == (1, 1)
    assert handles[0].status().status == "complete"  # still there
    assert not Instance.objects.filter(instance_id="w1").exists()


def test_bulk_actions_with_options_and_failures_reported_on_the_job(registered):
    @register("gated")
    class Gated(WorkflowEntrypoint):
        async def run(self, event, step):
            got = await step.wait_for_event(
                "go", type="go", schema={"type": "object", "required": ["n"]}
            )
            return got.payload["n"]

    wf = get_workflow("gated")
    for i in range(3):
        wf.create(id=f"g{i}")
    testing.run_until_idle()
    job = wf.bulk("send_event", event_type="go", payload={"wrong": 1})
    testing.run_until_idle()
    job.refresh()
    assert (job.applied, job.failed) == (0, 3)
    assert "does not match the schema" in job.errors[0] and "gated/g0" in job.errors[0]
    wf.bulk("send_event", event_type="go", payload={"n": 7})
    testing.run_until_idle()
    assert [wf.get(f"g{i}").status().output for i in range(3)] == [7, 7, 7]
    restarted = wf.bulk("restart", status="complete", from_step="go")
    testing.run_until_idle()
    assert restarted.refresh().applied == 3
    assert {wf.get(f"g{i}").status().status for i in range(3)} == {"waiting"}
    cancelled = wf.bulk("cancel", compensate=False, created_after=START)
    deleted = wf.bulk("delete", status="terminated")  # snapshot now: none terminated yet
    testing.run_until_idle()
    assert cancelled.refresh().applied == 3 and deleted.refresh().matched == 0
    assert deleted.done  # nothing matched: done at once
    final = wf.bulk("delete", status="terminated")
    testing.run_until_idle()
    assert final.wait(timeout=5).applied == 3
    assert not Instance.objects.filter(workflow="gated").exists()


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"action": "explode"}, InvalidInput, "unknown bulk action 'explode'"),
        ({"action": "terminate", "event_type": "go"}, InvalidInput, "takes no event_type"),
        ({"action": "send_event"}, InvalidInput, "needs event_type"),
        ({"action": "send_event", "event_type": "bad type"}, InvalidInput, "invalid event type"),
        ({"action": "pause", "status": "sleepy"}, InvalidInput, "unknown status"),
        ({"action": "pause", "attributes": {"a": [1]}}, InvalidInput, "attribute 'a'"),
        ({"action": "pause", "created_before": "yesterday"}, InvalidInput, "aware datetime"),
        ({"action": "restart", "from_step": ""}, InvalidInput, "from_step"),
    ],
)
def test_a_bad_bulk_request_is_refused_before_any_job_exists(tagged, kwargs, error, message):
    from workflows_app.models import BulkJob

    action = kwargs.pop("action")
    with pytest.raises(error, match=message):
        tagged.bulk(action, **kwargs)
    assert not BulkJob.objects.exists()


def test_a_bulk_job_is_found_by_id_within_its_workflow(tagged, registered):
    from workflows_app.engine.errors import BulkJobNotFound

    job = tagged.bulk("pause")
    assert tagged.bulk_job(job.id).action == "pause"
    with pytest.raises(BulkJobNotFound):
        tagged.bulk_job(job.id + 1)

    @register("elsewhere")
    class Elsewhere(WorkflowEntrypoint):
        async def run(self, event, step):
            return 1

    with pytest.raises(BulkJobNotFound):
        get_workflow("elsewhere").bulk_job(job.id)


def test_two_workers_share_a_job_without_applying_any_batch_twice(tagged):
    import threading

    from django.db import connections

    from workflows_app import bulk
    from workflows_app.models import BulkJob

    waiting_instances(tagged, 12)
    job = tagged.bulk("terminate")
    start = threading.Barrier(2)
    failures: list[BaseException] = []

    def worker():
        try:
            start.wait(10)
            while not BulkJob.objects.get(pk=job.id).done:
                bulk.process_batch(job.id, size=3)  # None while the other holds the job
        except BaseException as exc:  # reported by the test
            failures.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert failures == []
    job.refresh()
    assert (job.processed, job.applied, job.skipped, job.failed) == (12, 12, 0, 0)
    terminated = HistoryRecord.objects.filter(
        instance__workflow="tagged", type="instance.terminated"
    ).count()
    assert terminated == 12


async def test_a_serving_worker_prunes_expired_instances_on_the_engine_clock(tagged):
    from asgiref.sync import sync_to_async

    from workflows_app.engine.worker import Worker

    def left():
        return sorted(Instance.objects.values_list("instance_id", flat=True))

    with testing.fake_clock(START) as clock:
        first = await tagged.acreate(id="first", retention={"success": "1 hour"})
        second = await tagged.acreate(id="second", retention={"success": "3 hours"})
        await testing.arun_until_idle()
        await first.asend_event("go")
        await second.asend_event("go")
        await testing.arun_until_idle()
        worker = Worker()
        worker.prune_seconds = 600
        await worker.start()
        try:
            assert await worker.prune_once() == 0  # nothing expired; next look in 10 minutes
            clock.advance("2 hours")
            assert await worker.prune_once() == 1
            assert await sync_to_async(left)() == ["second"]
            clock.advance("1 hour")
            assert await worker.prune_once() == 1  # due again: 10 minutes passed
            third = await tagged.acreate(id="third", retention={"success": "1 minute"})
            await testing.arun_until_idle()
            await third.asend_event("go")
            await testing.arun_until_idle()
            clock.advance("2 minutes")
            assert await worker.prune_once() == 0  # expired, but the next look is in 8 minutes
            assert await sync_to_async(left)() == ["third"]
            clock.advance("8 minutes")
            assert await worker.prune_once() == 1
        finally:
            await worker.stop()
        assert await sync_to_async(left)() == []


def test_the_delete_log_line_shows_an_actor_with_a_newline_escaped_on_its_line(tagged, caplog):
    """delete_batch logs who deleted what; the actor (a token's name, the caller's text)
    went in raw, so "ops\\n<date> INFO … deleted 0 instance(s)" forged a second log line."""
    inst = tagged.create(id="gone")
    inst.terminate()
    actor = "ops\n2026-12-07 INFO workflows_app.client nobody deleted 0 instance(s) of tagged"
    with caplog.at_level("INFO", logger="workflows_app.client"):
        assert tagged.delete_batch(["gone"], actor=actor) == 1
    [line] = [r.getMessage() for r in caplog.records if "deleted" in r.getMessage()]
    assert line == (
        "ops\\n2026-12-07 INFO workflows_app.client nobody deleted 0 instance(s) of tagged "
        "deleted 1 instance(s) of tagged"
    )
