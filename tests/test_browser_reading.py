"""End-to-end in Chromium: reading a trace and an instance's data on the instance page.

The server runs no engine: each test's instance is run to its end by `manage.py shell`
under the fake clock (tests/trace_clock.py), so a day-long sleep takes no time and no
worker of the server races the script for it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator

import pytest

from tests.test_browser import (  # noqa: F401  (fixtures)
    SQLITE_LEG_ONLY,
    LiveServer,
    _reason,
    browser,
    free_port,
    page,
)
from tests.trace_clock import LONG_WORDS

pytestmark = [pytest.mark.skipif(_reason is not None, reason=_reason or ""), SQLITE_LEG_ONLY]

if _reason is None:
    from playwright.sync_api import Page, expect

MIN_STEP_BAR_PX = 20  # a 10 ms step beside a 1-day sleep, on a ~800 px track


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    tmp = tmp_path_factory.mktemp("browser-reading")
    env = {
        **os.environ,
        "DATABASE_URL": f"sqlite:///{tmp / 'db.sqlite3'}",
        "DJANGO_DEBUG": "1",
        "WFDASH_DEMO": "0",
        "REDIS_URL": "",
        "WFDASH_EMBEDDED_WORKER": "0",
        "PYTHONUNBUFFERED": "1",
    }
    live = LiveServer(env, free_port(), tmp / "server.log")
    # One process for all of it (each manage.py run is a Django start-up): the tables,
    # the admin, then each instance run to its end on the fake clock, and a schedule's.
    live.manage(
        "shell",
        "-c",
        "from django.core.management import call_command; "
        "call_command('migrate', interactive=False, verbosity=0); "
        "from django.contrib.auth.models import User; "
        "User.objects.create_superuser('admin', 'admin@example.com', 'admin'); "
        "from tests.trace_clock import DAY_SLEEPER, register_day_sleeper, run_a_day_long_sleep; "
        "from tests.trace_clock import register_flaky, run_flaky; "
        "register_day_sleeper(); run_a_day_long_sleep(DAY_SLEEPER, 'e2e-day'); "
        "register_flaky(); "
        "run_flaky('e2e-flaky', {'note': '<b>bold</b>', 'deep': {'list': [1, True, None]}}); "
        "from tests.trace_clock import NIGHT_ENDER, LONG_WORDS, run_to_the_end; "
        "from tests.trace_clock import register_night_ender, register_long_words; "
        "register_night_ender(); run_to_the_end(NIGHT_ENDER, 'e2e-night'); "
        "register_long_words(); run_to_the_end(LONG_WORDS, 'e2e-long'); "
        "from workflows_app.client import schedules; "
        "schedules.create('digest-every-5-minutes-for-the-eu-region', DAY_SLEEPER, '*/5 * * * *', timezone='America/Argentina/Buenos_Aires')"
        ".trigger()",
    )
    live.start()
    yield live
    live.stop()


def bar_width(page: Page, span_name: str) -> float:  # noqa: F811
    row = page.locator("ol.waterfall > li.span").filter(
        has=page.locator(".span-name", has_text=span_name)
    )
    box = row.first.locator(".span-bar").bounding_box()
    assert box is not None
    return float(box["width"])


def axis_labels(page: Page) -> list[str]:  # noqa: F811
    return page.locator(".trace-axis .axis-tick").all_text_contents()


def test_a_day_long_sleep_is_drawn_as_a_short_break_between_readable_steps(page: Page) -> None:  # noqa: F811
    page.goto("/workflows/day-sleeper/e2e-day/")
    expect(page.locator("h1.mono")).to_have_text("e2e-day")
    expect(page.locator(".trace-axis .axis-gap")).to_have_count(1)
    assert page.locator(".trace-axis .axis-gap").text_content() == "⋯ 1 d ⋯"
    assert bar_width(page, "step first") > MIN_STEP_BAR_PX
    assert bar_width(page, "step second") > MIN_STEP_BAR_PX
    # The sleep runs across the break, and the break is hatched in every row's track.
    track = page.locator("ol.waterfall .span-track").first.bounding_box()
    assert track is not None
    assert bar_width(page, "sleep overnight") < track["width"]
    assert (
        page.locator("ol.waterfall .gap-band").count() == page.locator("ol.waterfall > li").count()
    )
    labels = axis_labels(page)
    assert labels[0] == "0"
    assert any(label.endswith(" ms") for label in labels), labels
    assert any(label.startswith("1 d ") for label in labels), labels  # after the break


def test_zoom_in_out_and_reset_move_the_axis(page: Page) -> None:  # noqa: F811
    page.goto("/workflows/day-sleeper/e2e-day/")
    expect(page.locator(".trace-axis .axis-tick").first).to_have_text("0")
    whole = axis_labels(page)
    first_bar = bar_width(page, "step first")

    page.get_by_role("button", name="zoom in", exact=True).click()
    expect(page.locator(".trace-axis .axis-track")).to_have_attribute("data-zoomed", "true")
    assert axis_labels(page) != whole
    assert bar_width(page, "step first") > first_bar

    page.get_by_role("button", name="Reset zoom").click()
    expect(page.locator(".trace-axis .axis-track")).to_have_attribute("data-zoomed", "false")
    assert axis_labels(page) == whole

    # Dragging across the first tenth of the axis zooms into the first step.
    page.locator(".trace-axis .axis-track").scroll_into_view_if_needed()
    axis = page.locator(".trace-axis .axis-track").bounding_box()
    assert axis is not None
    y = axis["y"] + axis["height"] / 2
    page.mouse.move(axis["x"] + 1, y)
    page.mouse.down()
    page.mouse.move(axis["x"] + axis["width"] * 0.05, y, steps=4)
    page.mouse.move(axis["x"] + axis["width"] * 0.1, y, steps=4)
    page.mouse.up()
    expect(page.locator(".trace-axis .axis-track")).to_have_attribute("data-zoomed", "true")
    zoomed = axis_labels(page)
    assert zoomed != whole
    assert all(label.endswith(" ms") for label in zoomed), zoomed  # the first 3 ms only
    assert page.locator(".trace-axis .axis-gap").count() == 0  # the break is out of view
    assert bar_width(page, "step first") > 3 * first_bar

    page.get_by_role("button", name="zoom out", exact=True).click()
    assert axis_labels(page) != zoomed


def test_axis_labels_stay_inside_the_track_when_a_break_ends_the_trace(page: Page) -> None:  # noqa: F811
    # The day-long sleep is the trace's last stretch: its break's label, centred on the
    # break, would hang past the track's right edge and be cut ("⋯ 1 d" with no end).
    page.goto("/workflows/night-ender/e2e-night/")
    expect(page.locator(".trace-axis .axis-gap")).to_have_text("⋯ 1 d ⋯")
    for width in (1400, 390):
        page.set_viewport_size({"width": width, "height": 900})
        # The resize handler redraws the axis's labels (replaced, not moved): read them
        # once it has run (two frames on), and all in one go, so no label read is one a
        # redraw (the resize's, or a live update's) has just taken away.
        track, labels = page.evaluate(
            """() => new Promise((done) => requestAnimationFrame(() => requestAnimationFrame(() => {
                const axis = document.querySelector(".trace-axis .axis-track");
                const box = (el) => { const r = el.getBoundingClientRect(); return {x: r.x, width: r.width}; };
                done([box(axis), [...axis.querySelectorAll(":scope > span")].map(
                    (span) => [span.textContent, box(span)])]);
            })))"""
        )
        assert labels, f"no labels on the axis at {width} px"
        for text, box in labels:
            assert box["x"] >= track["x"] - 0.5, f"{text!r} starts left of the axis at {width} px"
            assert box["x"] + box["width"] <= track["x"] + track["width"] + 0.5, (
                f"{text!r} runs past the axis's right edge at {width} px"
            )


def test_long_names_and_an_error_with_a_long_word_do_not_widen_the_page(page: Page) -> None:  # noqa: F811
    # A 400-character token in an error message, a long exception class name and a step
    # name too long for the restart picker stay inside their boxes, at both widths.
    for width in (1400, 390):
        page.set_viewport_size({"width": width, "height": 900})
        page.goto(f"/workflows/{LONG_WORDS}/e2e-long/")
        expect(page.locator('[data-section="head"] .badge')).to_have_text("errored")
        expect(page.locator(".error-panel")).to_contain_text("tok_xxx")
        scroll = page.evaluate("document.documentElement.scrollWidth")
        assert scroll <= width, f"the instance page is {scroll} px wide at {width} px"
        group = page.locator(".action-group", has=page.locator("select")).bounding_box()
        picker = page.locator('select[name="from_step"]').bounding_box()
        assert group is not None and picker is not None
        assert picker["x"] + picker["width"] <= group["x"] + group["width"], "the picker overflows"
        page.goto("/instances/")  # the workflow filter lists the long workflow names too
        scroll = page.evaluate("document.documentElement.scrollWidth")
        assert scroll <= width, f"the instance list is {scroll} px wide at {width} px"


def test_json_is_a_folding_tree_and_a_stack_reads_as_lines(page: Page) -> None:  # noqa: F811
    page.goto("/workflows/flaky-fetch/e2e-flaky/")
    params = page.locator('[data-section="io"] .panel').first.locator(".json-view")
    expect(params.locator(".json-key").first).to_have_text('"note"')
    expect(params.locator(".json-string").first).to_have_text('"<b>bold</b>"')  # as text
    assert params.locator("b", has_text="bold").count() == 0
    deep = params.locator("details.json-node", has=page.locator(".json-index")).first
    expect(deep.locator(".json-boolean")).to_have_text("true")
    expect(deep.locator(".json-null")).to_have_text("null")
    outer = params.locator("details.json-node").first
    assert outer.evaluate("d => d.open")
    outer.locator("summary").first.click()
    assert not outer.evaluate("d => d.open")
    expect(outer.locator(".json-preview").first).to_be_visible()

    # A failed attempt's span event: the stack is preformatted lines, not a "\n" string.
    page.locator(".span-row", has_text="step fetch").first.click()
    stack = page.locator(".span-detail:not([hidden]) pre.json-lines", has_text="Traceback")
    expect(stack.first).to_be_visible()
    text = stack.first.inner_text()
    assert "ConnectionError: flaky 1 <script>alert(1)</script>\nsecond line" in text
    box = stack.first.bounding_box()
    assert box is not None and box["height"] > 40  # several lines tall

    # Every attempt of the step, with its duration and error.
    attempts = page.locator('[data-step="fetch"] details.attempts')
    attempts.locator("summary").first.click()
    expect(attempts.locator("li[data-attempt]")).to_have_count(3)
    expect(attempts.locator('li[data-attempt="1"]')).to_contain_text("ConnectionError")


def test_the_admin_instance_list_fits_1400_px_with_ids_on_one_line(page: Page) -> None:  # noqa: F811
    page.set_viewport_size({"width": 1400, "height": 900})
    page.goto("/admin/workflows_app/instance/")
    main = page.locator("#main")
    if "shifted" not in (main.get_attribute("class") or ""):
        page.locator("#toggle-nav-sidebar").click()  # the widest case: both sidebars open
    expect(main).to_have_class(re.compile(r"\bshifted\b"))
    results = page.locator("#changelist .results")
    assert results.evaluate("el => el.scrollWidth <= el.clientWidth")  # no column cut off
    headers = page.locator("#result_list thead th")
    assert headers.last.bounding_box()["x"] + headers.last.bounding_box()["width"] <= 1400
    line = page.locator("#result_list thead th").first.bounding_box()["height"]
    for cell in page.locator("#result_list th.field-instance_label").all():
        assert cell.bounding_box()["height"] <= line * 1.5  # one line, not four
        assert cell.locator(".wf-cut").get_attribute("title")


def test_a_time_names_its_zone_when_hovered(browser, server: LiveServer) -> None:  # noqa: F811
    # Times read "2 minutes ago"; the hover title is the viewer's local date and time, which
    # is ambiguous unless it says which zone it is in.
    context = browser.new_context(
        base_url=server.url, locale="en-US", timezone_id="America/New_York"
    )
    try:
        page = context.new_page()
        page.goto("/admin/login/?next=/")
        page.fill("#id_username", "admin")
        page.fill("#id_password", "admin")
        page.click("input[type=submit]")
        page.goto("/workflows/day-sleeper/e2e-day/")
        created = page.locator('[data-section="head"] .meta time').first
        expect(created).to_have_text(re.compile(r"ago$"))
        title = created.get_attribute("title") or ""
        assert re.search(r"\b(EST|EDT)\b", title), f"the hover time names no zone: {title!r}"
        page.goto("/schedules/")
        assert "Times are UTC" not in page.locator("main").inner_text()  # they are local
    finally:
        context.close()


def test_a_phone_sees_every_page_link_and_a_cron_on_one_line(page: Page) -> None:  # noqa: F811
    page.set_viewport_size({"width": 390, "height": 844})
    page.goto("/schedules/")
    cron = page.locator('tr[data-schedule="digest-every-5-minutes-for-the-eu-region"] td.cron')
    expect(cron).to_have_text("*/5 * * * *")
    lines = cron.evaluate(
        "td => { const r = document.createRange(); r.selectNodeContents(td);"
        " return new Set([...r.getClientRects()].map((box) => Math.round(box.top))).size; }"
    )
    assert lines == 1, f"the cron expression wraps over {lines} lines"
    for link in page.locator("header.top nav a").all():  # none hidden past the edge
        edge = link.bounding_box()
        assert edge is not None and edge["x"] + edge["width"] <= 390, link.text_content()


def test_right_to_left_strings_in_json_read_in_their_order(server: LiveServer, page: Page) -> None:  # noqa: F811
    """A JSON preview was one text node and a key and its value two plain spans: the bidi
    algorithm runs right-to-left strings together with the neutral `":"` / `","` between
    them, so {"שם": "עולם", "עיר": "חיפה"} read its values before their keys and the
    second pair before the first. Each string is isolated now (<bdi> in the preview, and
    unicode-bidi: isolate on keys and strings), so they stand in their JSON order."""
    server.manage(
        "shell",
        "-c",
        "from tests.trace_clock import register_flaky, run_flaky; register_flaky(); "
        "run_flaky('e2e-rtl', {'שם': 'עולם', 'עיר': 'חיפה'})",
    )
    page.goto("/workflows/flaky-fetch/e2e-rtl/")
    params = page.locator('[data-section="io"] .panel').first.locator(".json-view")
    row = params.locator(".json-row").first
    key, value = row.locator(".json-key").bounding_box(), row.locator(".json-string").bounding_box()
    assert key is not None and value is not None
    # "שם": "עולם" with the key wholly left of its value; run together, the key's quote
    # stayed at the left and its letters went to the right of the value's.
    assert key["x"] + key["width"] <= value["x"], (key, value)
    outer = params.locator("details.json-node").first
    outer.locator("summary").first.click()  # folded: its one-line preview shows
    strings = outer.locator(".json-preview").first.locator("bdi")
    expect(strings).to_have_text(['"שם"', '"עולם"', '"עיר"', '"חיפה"'])
    xs = [box["x"] for box in (strings.nth(i).bounding_box() for i in range(4)) if box]
    assert xs == sorted(xs), xs
