"""The run page over real Terraform, without a browser: confirm_destructive's checkboxes
and the server's 409, approve and discard through the same core rule as the API (the
approvers rule and four-eyes shown as the reason a button is absent), and what a tenant
controls (commit messages, attribute values, log lines) shown as text."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest

from events import run as R
from tests import stop_support
from tests.builders import api_workspace
from tests.executor_support import GATED_PLAN_TF
from tests.helpers import eventually
from tests.plane_support import Plane, commit, plane_fixture  # noqa: F401  # the fixture
from tests.ui.support import Browser

pytestmark = pytest.mark.terraform

V1 = "/api/v1/orgs/acme"
XSS = "<script>alert(1)</script>"
SHOUTING = """package shout
import rego.v1

deny contains msg if {
  some rc in input.resource_changes
  msg := sprintf("<script>alert(1)</script> %s", [rc.address])
}
"""
KEPT = 'resource "null_resource" "a" {\n  triggers = { v = "%s" }\n}\n'
TWO = KEPT % "1" + 'resource "null_resource" "b" {}\n'


async def _setup(plane: Plane, repo: Path, settings: dict[str, Any]) -> dict[str, str]:
    commit(repo, {"main.tf": TWO}, message=f"first {XSS}\n\nsecond line")
    await api_workspace(plane.http, repo, settings=settings)
    tokens = {}
    for user, role in (("alice", "approver"), ("bob", "operator"), ("vic", "viewer")):
        a = await plane.http.post(f"{V1}/tokens", json={"user": user, "role": role})
        assert a.status == 201, a.body
        tokens[user] = a.body["token"]
    await plane.executor("e1")
    return tokens


async def _awaiting(plane: Plane, token: str, message: str = "") -> str:
    a = await plane.http.post(
        f"{V1}/workspaces/net/runs", json={"type": "apply", "message": message}, token=token
    )
    assert a.status == 201, a.body
    await plane.reaches("net", a.body["id"], "awaiting_approval")
    # The pages read the projection: wait until it holds the run as awaiting approval
    # (a loaded CI run showed the page one event behind, without the approvers' rule).
    assert await plane.http.api.reached(await plane.app.store.last_seq(), 10)
    return str(a.body["id"])


async def _feed(b: Browser, path: str, last_id: str = "") -> list[tuple[str, str, str]]:
    """Every event (name, id, data) of a run's live feed, read until it ends."""
    headers = {"Last-Event-ID": last_id} if last_id else {}
    events, name, event_id, data = [], "", "", []
    async with b.session.get(b.url(path), headers=headers) as feed:
        async for raw in feed.content:
            line = raw.decode().rstrip("\n")
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("id: "):
                event_id = line[4:]
            elif line.startswith("data: "):
                data.append(line[6:])
            elif not line and name:
                events.append((name, event_id, "\n".join(data)))
                name, event_id, data = "", "", []
    return events


def _browser(plane: Plane) -> Browser:
    return Browser(plane.http.client.server)


async def test_approve_needs_every_destructive_box_and_the_page_shows_the_409(
    plane: Plane, repo: Path
) -> None:
    """A box per address to delete or replace; an approval without them all is refused by
    the core (409, the missing addresses on the page); with them all the run applies and
    records them. Four-eyes stops the creator, and the page says so."""
    tokens = await _setup(plane, repo, {"confirm_destructive": True, "four_eyes": True})
    first = await _awaiting(plane, tokens["bob"])
    await plane.approve(first)
    await plane.reaches("net", first, "applied")
    shout = (  # its output is in the apply's log
        'resource "null_resource" "c" {\n'
        f'  provisioner "local-exec" {{\n    command = "echo \'{XSS}\'"\n  }}\n}}\n'
    )
    commit(repo, {"main.tf": KEPT % f"2{XSS}" + shout}, message="replace a, delete b")
    run_id = await _awaiting(plane, tokens["bob"])
    both = ["null_resource.a", "null_resource.b"]

    bob = _browser(plane)
    await bob.signin(tokens["bob"])
    mine = await bob.get(f"/orgs/acme/runs/{run_id}")
    assert 'id="approve"' not in mine.text
    assert "four_eyes is on: bob created this run and may not approve it" in mine.text
    alice = _browser(plane)
    try:
        await alice.signin(tokens["alice"])
        page = await alice.get(f"/orgs/acme/runs/{run_id}")
        assert page.status == 200 and 'id="approve"' in page.text
        assert all(f'name="ack" value="{a}"' in page.text for a in both)
        assert "Will be replaced (1)" in page.text and "Will be deleted (1)" in page.text
        assert "(forces replacement)" in page.text
        assert XSS not in page.text and "&lt;script&gt;alert(1)&lt;/script&gt;" in page.text
        assert "awaiting approval" in page.text and 'class="awaiting"' in page.text

        refused = await alice.post(f"/orgs/acme/runs/{run_id}/approve", [("ack", both[0])])
        assert refused.status == 409 and "missing: null_resource.b" in refused.text
        assert (await plane.run("net", run_id)).status == "awaiting_approval"
        done = await alice.post(f"/orgs/acme/runs/{run_id}/approve", [("ack", a) for a in both])
        assert done.status == 200, done.text[:500]
        state = await plane.reaches("net", run_id, "applied")
        assert (state.approved_by, sorted(state.acknowledged)) == ("alice", both)
        log = await alice.get(f"/orgs/acme/runs/{run_id}/log")
        assert "null_resource.a" in log.text and XSS not in log.text
        assert "&lt;script&gt;alert(1)&lt;/script&gt;" in log.text  # the output, as text
        page = await alice.get(f"/orgs/acme/runs/{run_id}")
        assert "log?phase=plan&amp;step=plan" in page.text
        step = await alice.get(f"/orgs/acme/runs/{run_id}/log?phase=plan&step=plan")
        assert step.status == 200 and "step plan/plan" in step.text
        assert "Plan:" in step.text and "Apply complete" not in step.text
        events = await _feed(alice, f"/orgs/acme/runs/{run_id}/live")
        lines = [e for e in events if e[0] == "line"]
        assert lines and [int(e[1]) for e in lines] == list(range(1, len(lines) + 1))
        assert any("&lt;script&gt;alert(1)&lt;/script&gt;" in e[2] for e in lines)
        assert not any(XSS in e[2] for e in lines)
        assert any('class="line stderr"' in e[2] or 'class="line stdout"' in e[2] for e in lines)
        shown = [e for e in events if e[0] == "state"]
        assert shown and 'id="run-status">applied<' in shown[-1][2]
        assert events[-1][0] == "end"
        resumed = await _feed(alice, f"/orgs/acme/runs/{run_id}/live", last_id=lines[-3][1])
        assert [e[1] for e in resumed if e[0] == "line"] == [e[1] for e in lines[-2:]]
        bad = await alice.get(f"/orgs/acme/runs/{run_id}/log?phase=../x&step=plan")
        assert bad.status == 400 and "needs phase" in bad.text
    finally:
        await bob.close()
        await alice.close()


async def test_discard_with_a_reason_and_the_approvers_rule_shown(plane: Plane, repo: Path) -> None:
    """approvers ["alice"]: bob (operator) gets no Approve or Discard and reads why; a
    viewer gets nothing; alice discards with a reason; the commit's first line shows."""
    tokens = await _setup(plane, repo, {"approvers": ["alice"]})
    policy = {"enforcement": "advisory", "source": SHOUTING}
    assert (await plane.http.call("PUT", f"{V1}/policies/shout", json=policy)).status in (200, 201)
    run_id = await _awaiting(plane, tokens["bob"], message=XSS)
    bob, vic, alice = _browser(plane), _browser(plane), _browser(plane)
    try:
        await bob.signin(tokens["bob"])
        page = await bob.get(f"/orgs/acme/runs/{run_id}")
        assert 'id="approve"' not in page.text and 'id="discard"' not in page.text
        assert "bob is not among the workspace&#39;s approvers (alice)" in page.text
        forced = await bob.post(f"/orgs/acme/runs/{run_id}/discard", {"reason": "me"})
        assert forced.status == 403 and "not among the workspace" in forced.text
        await vic.signin(tokens["vic"])
        viewed = await vic.get(f"/orgs/acme/runs/{run_id}")
        assert (
            "may only read this workspace" in viewed.text
            and '<form method="post" action="/orgs/acme/runs' not in viewed.text
        )
        await alice.signin(tokens["alice"])
        page = await alice.get(f"/orgs/acme/runs/{run_id}")
        assert "first &lt;script&gt;alert(1)&lt;/script&gt;" in page.text
        assert "second line" not in page.text
        assert "<strong>shout</strong> (advisory" in page.text and "failed" in page.text
        assert f"{XSS} null_resource.a" not in page.text
        assert "&lt;script&gt;alert(1)&lt;/script&gt; null_resource.a" in page.text
        done = await alice.post(f"/orgs/acme/runs/{run_id}/discard", {"reason": "not today"})
        assert done.status == 200
        state = await plane.reaches("net", run_id, "discarded")
        assert state.reason == "not today"
    finally:
        for b in (bob, vic, alice):
            await b.close()


async def test_stop_on_a_planning_run_interrupts_terraform_and_an_applying_run_has_none(
    plane: Plane, repo: Path, tmp_path: Path
) -> None:
    """A run Terraform is planning shows Stop; the UI's Stop (with a reason) interrupts
    it and the run ends canceled by the executor. An applying run shows no Stop, says
    why, and a forged Stop is the core's 409 on a page while the apply completes."""
    gate = tmp_path / "gate"
    os.mkfifo(gate)
    writer = os.open(gate, os.O_RDWR)  # Terraform's open() returns, its read() waits
    try:
        commit(repo, {"main.tf": GATED_PLAN_TF})
        await api_workspace(plane.http, repo, variables={"gate": str(gate)})
        tokens = {}
        for user, role in (("bob", "operator"), ("vic", "viewer")):
            a = await plane.http.post(f"{V1}/tokens", json={"user": user, "role": role})
            tokens[user] = a.body["token"]
        await plane.executor("e1")
        planning = await plane.start("net")
        await plane.reaches("net", planning, "planning")
        await eventually(
            lambda: stop_support.at_the_gate(gate), timeout=60, what="Terraform at the gate"
        )
        viewer = _browser(plane)
        await viewer.signin(tokens["vic"])
        seen = await viewer.get(f"/orgs/acme/runs/{planning}")
        assert 'id="cancel"' not in seen.text and "may only read" in seen.text
        b = _browser(plane)
        await b.signin(tokens["bob"])
        page = await b.get(f"/orgs/acme/runs/{planning}")
        assert re.search(r'<button type="submit" id="cancel">Stop</button>', page.text)
        out = await b.post(f"/orgs/acme/runs/{planning}/cancel", {"reason": "wrong branch"})
        assert out.status == 200, out.text[:500]
        await eventually(
            lambda: stop_support.at_the_gate_not(gate), timeout=30, what="Terraform gone"
        )
    finally:
        os.close(writer)
    run = await plane.reaches("net", planning, "canceled")
    assert run.reason == "wrong branch"
    events = await plane.events("net", planning)
    [asked] = [e for e in events if isinstance(e, R.RunStopRequested)]
    assert (asked.actor, asked.reason) == ("bob", "wrong branch")
    [ended] = [e for e in events if isinstance(e, R.RunCanceled)]
    assert ended.actor == "executor:e1"

    commit(repo, {"main.tf": stop_support.SLOW_APPLY_TF})
    applying = await plane.start("net")
    await plane.reaches("net", applying, "awaiting_approval")
    await plane.approve(applying)
    await plane.reaches("net", applying, "applying")

    async def shows_applying() -> Any:  # the page reads the read model, maybe a step behind
        page = await b.get(f"/orgs/acme/runs/{applying}")
        assert "cannot be stopped" in page.text, page.text[:300]
        return page

    page = await eventually(shows_applying, timeout=10, what="the page shows it applying")
    assert 'id="cancel"' not in page.text
    csrf = page.csrf
    refused = await b.post(f"/orgs/acme/runs/{applying}/cancel", {"reason": "now"}, csrf=csrf)
    assert refused.status == 409 and "corrupt state" in refused.text, refused.text[:500]
    await plane.reaches("net", applying, "applied")
