"""End-to-end: the metrics page in real headless Chromium (fixtures of test_browser.py:
`manage.py runserver` with the demo workflows and an embedded engine)."""

from __future__ import annotations

import re

from tests.test_browser import (  # noqa: F401  (fixtures)
    ARTIFACTS,
    badge,
    browser,
    create_from_form,
    page,
    pytestmark,
    server,
)

try:
    from playwright.sync_api import Page, expect
except ImportError:  # skipped by pytestmark
    Page = object  # type: ignore[assignment,misc]


def test_the_metrics_page_charts_throughput_failures_and_durations(page: Page) -> None:  # noqa: F811
    create_from_form(page, "data-pipeline", "m-ok", '{"rows": 4, "flaky_attempts": 0}')
    expect(badge(page)).to_have_attribute("data-status", "complete")
    create_from_form(page, "data-pipeline", "m-bad", '{"flaky_attempts": 0, "corrupt": true}')
    expect(badge(page)).to_have_attribute("data-status", "errored")

    page.get_by_role("link", name="Metrics", exact=True).click()
    expect(page).to_have_url(re.compile(r"/stats/$"))
    card = page.locator('article[data-workflow="data-pipeline"]')
    expect(card.locator('[data-field="finished"]')).to_have_text("2")
    expect(card.locator('[data-field="failure_rate"]')).to_have_text("50.0%")
    bars = card.locator("figure.throughput g[data-bucket]")
    expect(bars).to_have_count(12)
    # The newest bucket holds both: a completed bar and an errored bar of equal height.
    newest = bars.nth(11)
    assert float(newest.locator("rect.ok").get_attribute("height") or 0) > 0
    assert float(newest.locator("rect.err").get_attribute("height") or 0) > 0
    for row in ("(whole instance)", "extract", "load"):
        expect(card.locator(f'.duration-row[data-row="{row}"] rect.p95')).to_have_count(1)
    expect(card.locator('table.steps-metrics tr[data-step="validate"] td').nth(3)).to_have_text(
        "100.0%"
    )
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=ARTIFACTS / "metrics.png", full_page=True)

    page.get_by_role("link", name="last day").click()
    expect(page.locator("h1")).to_contain_text("last day")
    expect(card.locator("figure.throughput g[data-bucket]")).to_have_count(24)
    expect(card.locator('[data-field="finished"]')).to_have_text("2")
    assert (ARTIFACTS / "metrics.png").stat().st_size > 10_000
