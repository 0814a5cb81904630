"""The dashboard shows flow control and children: why an instance is queued (detail and
list), parent and child linked both ways, children beside the steps that started them."""

from __future__ import annotations

import pytest
from django.urls import reverse

from workflows_app import testing
from workflows_app.client import get_workflow
from workflows_app.engine import WorkflowEntrypoint, register

pytestmark = pytest.mark.django_db(transaction=True)

XSS_KEY = "<b>key</b>"


def page_url(handle) -> str:
    row = handle.row()
    return reverse("workflows:instance", args=[row.workflow, row.instance_id])


def test_a_queued_instance_says_why_on_its_page_and_in_the_list(operator_client, registered):
    @register("dash-keyed", limits={"max_concurrent_per_key": 1})
    class Keyed(WorkflowEntrypoint):
        async def run(self, event, step):
            await step.wait_for_event("go", type="go")

    wf = get_workflow("dash-keyed")
    wf.create(id="first", concurrency_key=XSS_KEY)
    second = wf.create(id="second", concurrency_key=XSS_KEY, priority=2)
    page = operator_client.get(page_url(second)).content.decode()
    assert "queued: max_concurrent_per_key (1) reached for key" in page
    assert XSS_KEY not in page and "&lt;b&gt;key&lt;/b&gt;" in page  # escaped
    assert 'data-field="priority">2<' in page
    listing = operator_client.get(reverse("workflows:instances") + "?workflow=dash-keyed")
    text = listing.content.decode()
    assert 'data-field="queued-reason"' in text and "max_concurrent_per_key (1)" in text


def test_parent_and_child_pages_link_each_other_and_the_step_shows_its_child(
    operator_client, registered
):
    @register("dash-child")
    class Child(WorkflowEntrypoint):
        async def run(self, event, step):
            await step.wait_for_event("go", type="go")

    @register("dash-parent")
    class Parent(WorkflowEntrypoint):
        async def run(self, event, step):
            return await step.invoke("make child", "dash-child")

    parent = get_workflow("dash-parent").create(id="p1")
    testing.run_until_idle()
    (child,) = parent.children()
    page = operator_client.get(page_url(parent)).content.decode()
    child_link = page_url(child)
    assert 'data-section="children"' in page and child_link in page
    assert 'data-field="child"' in page  # beside the invoke step
    assert "waiting for child" in page
    child_page = operator_client.get(child_link).content.decode()
    assert 'data-field="parent"' in child_page and page_url(parent) in child_page


def test_the_admin_change_page_shows_flow_control_and_the_parent(registered):
    from django.contrib.auth.models import User
    from django.test import Client

    @register("admin-child")
    class AdminChild(WorkflowEntrypoint):
        async def run(self, event, step):
            await step.wait_for_event("go", type="go")

    @register("admin-parent")
    class AdminParent(WorkflowEntrypoint):
        async def run(self, event, step):
            return await step.invoke("child step", "admin-child")

    parent = get_workflow("admin-parent").create(id="ap", priority=3)
    testing.run_until_idle()
    (child,) = parent.children()
    client = Client()
    client.force_login(User.objects.create_superuser("root", password="pw"))
    url = reverse("admin:workflows_app_instance_change", args=[child.row().pk])
    page = client.get(url).content.decode()
    assert "Flow control and children" in page and "child step" in page
    assert reverse("admin:workflows_app_instance_change", args=[parent.row().pk]) in page


def test_a_restarted_parent_lists_its_children_before_its_replay_reaches_them(
    operator_client, registered
):
    """A restart drops the parent's steps but not its children (the replay finds them by
    step). The page listed children only when a step that starts one was stored, so a
    restarted parent that had not run again (paused, queued) showed none of its live children."""

    @register("dash-restarted-child")
    class Child(WorkflowEntrypoint):
        async def run(self, event, step):
            await step.wait_for_event("go", type="go")

    @register("dash-restarted-parent")
    class Parent(WorkflowEntrypoint):
        async def run(self, event, step):
            return await step.invoke("make child", "dash-restarted-child")

    parent = get_workflow("dash-restarted-parent").create(id="rp1")
    testing.run_until_idle()
    (child,) = parent.children()
    parent.restart()
    parent.pause()
    assert parent.status().status == "paused" and child.status().status == "waiting"
    page = operator_client.get(page_url(parent)).content.decode()
    assert 'data-section="children"' in page and page_url(child) in page
