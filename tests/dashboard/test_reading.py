"""Reading an instance's data on the dashboard: search, attempt history, JSON, chart axes."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
from django.urls import reverse

from tests.trace_clock import (
    DAY_SLEEPER,
    FLAKY,
    register_day_sleeper,
    register_flaky,
    run_a_day_long_sleep,
    run_flaky,
)
from workflows_app import testing
from workflows_app.client import get_workflow
from workflows_app.dashboard import time_axis, workflow_summaries
from workflows_app.engine import NonRetryableError, WorkflowEntrypoint, register, registry

pytestmark = pytest.mark.django_db(transaction=True)

XSS = "<script>alert(1)</script>"


@pytest.fixture
def reading_workflow() -> Iterator[str]:
    """Returns its params' note, or fails for good with a message made of it."""

    @register("dash-reading")
    class DashReading(WorkflowEntrypoint):
        async def run(self, event: Any, step: Any) -> Any:
            note = event.payload["note"]
            if event.payload.get("fail"):
                raise NonRetryableError(f"refused: {note}")
            return await step.do("echo", lambda: {"echoed": note.upper()})

    yield "dash-reading"
    registry.unregister("dash-reading")


def listed_ids(client: Any, **params: str) -> set[str]:
    page = client.get(reverse("workflows:instances"), params).content.decode()
    return set(re.findall(r'data-instance-id="([^"]+)"', page))


def test_the_list_search_finds_text_in_params_output_and_error(operator_client, reading_workflow):
    workflow = get_workflow(reading_workflow)
    workflow.create(id="plain", params={"note": "Blue Whale"})
    workflow.create(id="shouted", params={"note": "narwhal"})
    workflow.create(id="refused", params={"note": "kraken", "fail": True})
    testing.run_until_idle()

    assert listed_ids(operator_client, q="blue whale") == {"plain"}  # params, any case
    assert listed_ids(operator_client, q="NARWHAL") == {"shouted"}  # params and output
    assert listed_ids(operator_client, q='"echoed":"NARWHAL"') == {"shouted"}  # output's JSON
    assert listed_ids(operator_client, q="refused: krak") == {"refused"}  # error message
    assert listed_ids(operator_client, q="NonRetryable") == {"refused"}  # error name
    assert listed_ids(operator_client, q="sea serpent") == set()
    assert listed_ids(operator_client, q="shouted") == {"shouted"}  # ids still match


def test_the_list_search_ignores_sealed_values(operator_client, reading_workflow, settings):
    settings.WFDASH = {**settings.WFDASH, "PAYLOAD_CODEC": "tests.codecs.FernetCodec"}
    from workflows_app import codec

    codec.clear_cache()
    try:
        get_workflow(reading_workflow).create(id="sealed", params={"note": "hidden"})
        assert listed_ids(operator_client, q="codec") == set()  # the envelope's own key
    finally:
        codec.clear_cache()


@pytest.fixture
def day_sleeper() -> Iterator[str]:
    register_day_sleeper()
    yield DAY_SLEEPER
    registry.unregister(DAY_SLEEPER)


def trace_rows(page: str) -> dict[str, dict[str, Any]]:
    """Each waterfall row's span name → its data attributes."""
    rows = {}
    for li, name in re.findall(
        r'(<li class="span[^>]*>)\s*<button[^>]*>\s*<span class="span-name" dir="auto">([^<]+)</span>',
        page,
    ):
        rows[name] = {
            "start": int(re.search(r'data-start-ms="(\d+)"', li).group(1)),
            "end": int(re.search(r'data-end-ms="(\d+)"', li).group(1)),
            "wait": 'data-wait="1"' in li,
        }
    return rows


def test_the_trace_of_a_day_long_sleep_marks_the_sleep_as_a_wait(operator_client, day_sleeper):
    run_a_day_long_sleep(day_sleeper, "day")
    page = operator_client.get(reverse("workflows:instance", args=[day_sleeper, "day"]))
    rows = trace_rows(page.content.decode())
    first, sleep, second = rows["step first"], rows["sleep overnight"], rows["step second"]
    assert (first["end"] - first["start"], second["end"] - second["start"]) == (10, 10)
    assert sleep["end"] - sleep["start"] == 86_400_000
    assert first["end"] <= sleep["start"] and sleep["end"] <= second["start"]
    assert sleep["wait"] and not first["wait"] and not second["wait"]
    assert 'class="trace-axis"' in page.content.decode()
    assert 'data-trace-zoom="reset"' in page.content.decode()


@pytest.fixture
def flaky_workflow() -> Iterator[str]:
    register_flaky()
    yield FLAKY
    registry.unregister(FLAKY)


def test_each_attempt_of_a_step_shows_its_duration_and_error(operator_client, flaky_workflow):
    run_flaky("flaky", params={"note": "a\nb"})
    page = operator_client.get(reverse("workflows:instance", args=[flaky_workflow, "flaky"]))
    html = page.content.decode()
    row = re.search(r'<tr data-step="fetch">.*?</tr>', html, re.S).group(0)
    attempts = re.findall(
        r'<li data-attempt="(\d+)">.*?data-field="duration">([^<]+)</a>(.*?)</li>', row, re.S
    )
    assert [(n, duration) for n, duration, _ in attempts] == [
        ("1", "5 ms"),
        ("2", "10 ms"),
        ("3", "15 ms"),
    ]
    assert "ConnectionError" in attempts[0][2] and "flaky 1" in attempts[0][2]
    assert "flaky 2" in attempts[1][2] and "ok" in attempts[2][2]
    assert "Traceback (most recent call last)" in attempts[0][2]  # the attempt's stack
    assert XSS not in html and "&lt;script&gt;" in html


def test_json_values_are_marked_for_the_viewer_and_escaped(operator_client, reading_workflow):
    get_workflow(reading_workflow).create(id="json", params={"note": XSS})
    testing.run_until_idle()
    html = operator_client.get(
        reverse("workflows:instance", args=[reading_workflow, "json"])
    ).content.decode()
    params = re.search(r"<h2>Params</h2><pre ([^>]*)>(.*?)</pre>", html, re.S)
    assert params.group(1) == 'class="json" data-json-view'
    assert "&lt;script&gt;" in params.group(2) and XSS not in html
    assert html.count('<h3>Attributes</h3><pre class="json" data-json-view>') >= 2  # per span
    assert 'data-json-view="folded"' in html  # history data starts folded


def test_chart_time_axes_read_back_from_now():
    assert [t["label"] for t in time_axis(60)] == [
        "−60 min",
        "−45 min",
        "−30 min",
        "−15 min",
        "now",
    ]
    assert [t["label"] for t in time_axis(24 * 60)] == ["−24 h", "−18 h", "−12 h", "−6 h", "now"]
    assert [t["left"] for t in time_axis(60)] == [0, 25, 50, 75, 100]


def x_labels(html: str) -> list[str]:
    return re.findall(r'<span style="left: [\d.]+%">([^<]+)</span>', html)


def test_the_overview_and_metrics_charts_have_a_time_axis_and_a_scale(
    operator_client, reading_workflow
):
    workflow = get_workflow(reading_workflow)
    for n in range(3):
        workflow.create(id=f"done-{n}", params={"note": "x"})
    testing.run_until_idle()

    overview = operator_client.get(reverse("workflows:overview")).content.decode()
    assert "{#" not in overview and "comment" not in overview  # the partial's notes stay out
    card = re.search(
        r'<article class="card" data-workflow="dash-reading">.*?</article>', overview, re.S
    )
    assert x_labels(card.group(0)) == ["−60 min", "−45 min", "−30 min", "−15 min", "now"]
    # All three finished in the same 5-minute bucket: the top of the scale is 3.
    assert '<span data-axis="y-max">3</span><span>0</span>' in card.group(0)
    (summary,) = [s for s in workflow_summaries() if s.name == reading_workflow]
    assert summary.as_json()["chart_peak"] == 3

    metrics = operator_client.get("/stats/?window=day").content.decode()
    assert x_labels(metrics) == ["−24 h", "−18 h", "−12 h", "−6 h", "now"]
    assert '<span data-axis="y-max">3</span>' in metrics


def test_user_text_beside_other_text_is_isolated_with_its_own_direction(
    operator_client, reading_workflow
):
    """An error message, an error name or an actor shown inline beside the page's own text
    (`Name: message`, `by actor`) shared its line's bidi run: a right-to-left message or
    a U+202E in one reordered the text after it ("… by ops" read backwards). Each is
    now dir="auto": isolated, and laid out in its own first letter's direction."""
    note = "\u202eקובץ חסר"
    get_workflow(reading_workflow).create(id="rtl", params={"note": note, "fail": True})
    testing.run_until_idle()
    page = operator_client.get(reverse("workflows:instance", args=[reading_workflow, "rtl"]))
    html = page.content.decode()
    assert f'<span class="pre-line" dir="auto">refused: {note}</span>' in html
    assert '<b class="error-name" dir="auto">NonRetryableError</b>' in html
    errors = operator_client.get(reverse("workflows:errors")).content.decode()
    assert f'<span class="pre-line" dir="auto">refused: {note}</span>' in errors
    rows = operator_client.get(reverse("workflows:instances")).content.decode()
    assert '<td class="error-name" dir="auto" data-field="error">NonRetryableError</td>' in rows


def test_an_event_payload_s_one_line_json_isolates_each_string(operator_client, reading_workflow):
    """The inbox showed a payload as one line of JSON text: between two right-to-left
    strings the bidi algorithm turned `","` right-to-left too, so {"שם":"עולם","עיר":"חיפה"}
    read its values out of order. Each string (keys too) is in a <bdi> now; the line is
    still cut at 300 characters, and escaped."""
    inst = get_workflow(reading_workflow).create(id="inbox", params={"note": "n"})
    inst.send_event("note", {"שם": "עולם", "עיר": "<b>חיפה</b>", "n": [1, None]})
    inst.send_event("long", {"k": "x" * 400})
    html = operator_client.get(
        reverse("workflows:instance", args=[reading_workflow, "inbox"])
    ).content.decode()
    assert (
        "<code>{<bdi>&quot;שם&quot;</bdi>:<bdi>&quot;עולם&quot;</bdi>,<bdi>&quot;עיר&quot;</bdi>:"
        "<bdi>&quot;&lt;b&gt;חיפה&lt;/b&gt;&quot;</bdi>,<bdi>&quot;n&quot;</bdi>:[1,null]}</code>"
    ) in html
    assert f"<code>{{<bdi>&quot;k&quot;</bdi>:<bdi>&quot;{'x' * 293}</bdi>…</code>" in html
