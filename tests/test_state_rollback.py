"""State rollback (`POST .../state-versions/{id}/rollback`): what it makes, who may, and
what it refuses; real NATS, runplane's real API, states pushed as the Terraform CLI
pushes them (the end to end with real Terraform: tests/test_state_rollback_e2e.py).

- a rollback is a new version with the earlier version's content, the next serial and
  the same lineage, recorded (`ws.state_pushed`, cause `rollback`) with who and why; the
  TFE API's current state is it, content and serial;
- only a workspace admin holding the workspace's lock, with no run active; a version of
  another workspace, organization or lineage is 404; one whose content is gone is 410;
- org A's admin cannot roll back (or probe) org B's versions; the reason is shown as
  text in the UI, never as markup;
- killed between any two of its writes, it leaves no new version or a whole one.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
from yarl import URL

from events.workspace import StatePushed
from executor.statestore import Head, LockRecord, StateStore, with_serial
from infra.streams import EVENTS, STATE_BUCKET
from services.app.commands import App
from tests.access_support import person
from tests.tfe_support import Tfe, _pushes, _states, a_state, tfe_fixture
from tests.ui.support import Browser

__all__ = ["tfe_fixture"]

V1 = "/api/v1/orgs/acme/workspaces/net"


async def _two_versions(tfe: Tfe, org: str = "acme") -> tuple[dict[str, str], list[Any]]:
    """`org` with workspace `net`, locked by its admin, who pushed serial 1 (output
    "one") and 2 ("two"); the tokens and the listed versions, oldest first."""
    tokens = await tfe.org(org)
    await tfe.workspace(org, "net")
    ws_id = f"ws-{org}.net"
    assert (await tfe.lock(ws_id, token=tokens["admin"])).status == 200
    lineage = str(uuid.uuid4())
    for serial, value in ((1, "one"), (2, "two")):
        pushed = await tfe.push(
            ws_id, a_state(serial, lineage, {"v": value}), token=tokens["admin"]
        )
        assert pushed.status == 201, pushed.body
    listed = await tfe.get(f"/api/v1/orgs/{org}/workspaces/net/state-versions")
    assert listed.status == 200, listed.body
    return tokens, list(reversed(listed.body["items"]))


async def _current(tfe: Tfe, token: str, org: str = "acme") -> tuple[dict[str, Any], bytes]:
    """The TFE API's current state version (what `terraform state pull` reads) and its
    content, through the download URL."""
    got = await tfe.tfe(
        "GET", f"/api/v2/workspaces/ws-{org}.net/current-state-version", token=token
    )
    assert got.status == 200, got.body
    attrs = got.body["data"]["attributes"]
    status, raw = await tfe.raw(URL(attrs["hosted-state-download-url"]).path)
    assert status == 200
    return attrs, raw


async def _rollback(
    tfe: Tfe, version: str, token: str, reason: str = "bad apply", **kw: Any
) -> Any:
    return await tfe.post(
        f"{kw.pop('path', V1)}/state-versions/{version}/rollback",
        json={"reason": reason},
        token=token,
    )


async def test_a_rollback_is_a_new_version_of_the_old_content_with_the_next_serial(
    tfe: Tfe,
) -> None:
    tokens, (v1, v2) = await _two_versions(tfe)
    assert (v1["serial"], v2["serial"]) == (1, 2) and v1["id"].startswith("sv-acme.net.1.")
    _, before = await _current(tfe, tokens["admin"])
    a = await _rollback(tfe, v1["id"], tokens["admin"], reason="v2 broke the network")
    assert a.status == 201, a.body
    assert (a.body["serial"], a.body["lineage"]) == (3, v1["lineage"])
    assert a.body["rollback_of"] == v1["object"] and a.body["pushed_by"] == "admin-user"
    # the TFE API (terraform state pull) serves v1's content with serial 3
    attrs, raw = await _current(tfe, tokens["admin"])
    assert attrs["serial"] == 3
    one = await _states(tfe).read(_head(v1))
    assert raw == with_serial(one, 3) and b'"one"' in raw and before != raw
    # recorded with who and why, and listed first
    last = (await _pushes(tfe))[-1]
    assert (last.cause, last.actor, last.reason) == (
        "rollback",
        "admin-user",
        "v2 broke the network",
    )
    assert last.rollback_of == v1["object"] and last.previous == v2["object"]
    listed = await tfe.get(f"{V1}/state-versions", headers={"RP-Min-Seq": str(a.body["seq"])})
    newest = listed.body["items"][0]
    assert (newest["serial"], newest["reason"], newest["id"]) == (
        3,
        "v2 broke the network",
        a.body["id"],
    )
    # a further push continues from it (serial 4 of the same lineage), as from any head
    st = a_state(4, v1["lineage"], {"v": "four"})
    assert (await tfe.push("ws-acme.net", st, token=tokens["admin"])).status == 201


def _head(row: dict[str, Any]) -> Head:
    fields = ("object", "serial", "lineage", "digest", "size")
    return Head(**{k: row[k] for k in fields})


async def test_only_a_workspace_admin_holding_the_lock_may_roll_back(tfe: Tfe) -> None:
    tokens, (v1, _) = await _two_versions(tfe)
    planner = await person(tfe, "acme", "pat@acme.test", "planners", **{"workspaces/net": "plan"})
    writer = await person(tfe, "acme", "wes@acme.test", "writers", **{"workspaces/net": "write"})
    for token in (planner, writer, tokens["operator"], tokens["approver"]):
        (await _rollback(tfe, v1["id"], token)).problem("forbidden", 403)
    # an admin who does not hold the lock (it is admin-user's)
    other_admin = await person(
        tfe, "acme", "ada@acme.test", "admins", **{"workspaces/net": "admin"}
    )
    (await _rollback(tfe, v1["id"], other_admin)).problem("workspace-not-locked", 409)
    assert (await tfe.post(f"{V1}/unlock", json={})).status == 200
    (await _rollback(tfe, v1["id"], tokens["admin"])).problem("workspace-not-locked", 409)
    assert all(p.cause == "cli" for p in await _pushes(tfe))
    # a reason is required, and bounded
    assert (await tfe.post(f"{V1}/lock", json={"reason": "x"}, token=tokens["admin"])).status == 200
    (await _rollback(tfe, v1["id"], tokens["admin"], reason="")).problem("invalid-body", 400)
    (await _rollback(tfe, v1["id"], tokens["admin"], reason="r" * 1025)).problem(
        "invalid-body", 400
    )


async def test_org_a_admin_cannot_roll_back_or_probe_org_b_versions(tfe: Tfe) -> None:
    b_tokens, (b1, _) = await _two_versions(tfe, org="bravo")
    a_tokens = await tfe.org("acme")
    await tfe.workspace("acme", "net")
    assert (
        await tfe.post(f"{V1}/lock", json={"reason": "x"}, token=a_tokens["admin"])
    ).status == 200
    b_path = "/api/v1/orgs/bravo/workspaces/net"
    _, b_before = await _current(tfe, b_tokens["admin"], org="bravo")
    # B's version id on A's workspace, on B's path with A's token, a made-up one of B's
    (await _rollback(tfe, b1["id"], a_tokens["admin"])).problem("not-found", 404)
    (await _rollback(tfe, b1["id"], a_tokens["admin"], path=b_path)).problem("not-found", 404)
    forged = b1["id"].replace("sv-bravo.", "sv-acme.")
    (await _rollback(tfe, forged, a_tokens["admin"])).problem("not-found", 404)
    for junk in ("sv-bravo.net.1", "..", "sv-acme.net.1.zzzzzzzzzzzzzzzz", "%2e%2e"):
        assert (await _rollback(tfe, junk, a_tokens["admin"])).status == 404
    # B's state and record are untouched; A's workspace got nothing
    _, b_after = await _current(tfe, b_tokens["admin"], org="bravo")
    assert b_after == b_before
    assert all(p.cause == "cli" for p in await _pushes(tfe, org="bravo"))
    assert await _pushes(tfe) == []


async def test_refused_while_a_run_is_active_or_holds_the_state_lock(tfe: Tfe) -> None:
    tokens, (v1, _) = await _two_versions(tfe)
    await tfe.post(f"{V1}/unlock", json={})
    run = await tfe.run("acme", "net", "apply")
    assert await tfe.app.admit_next("acme", "net") == run["id"]  # as the scheduler does

    await _projected(tfe)
    assert (await tfe.get(V1)).body["active_run"] == run["id"]
    # locked by its admin while the run is on (a lock stops admission, not a run)
    assert (await tfe.post(f"{V1}/lock", json={"reason": "x"}, token=tokens["admin"])).status == 200
    (await _rollback(tfe, v1["id"], tokens["admin"])).problem("run-active", 409)
    # the run ended, but a run's state backend still holds the state lock: refused too
    assert (await tfe.post(f"/api/v1/orgs/acme/runs/{run['id']}/cancel", json={})).status == 200

    await _projected(tfe)
    assert (await tfe.get(V1)).body["active_run"] is None
    held = LockRecord(id="l", info={}, org="acme", ws="net", run_id=run["id"], lease_id="x")
    assert (await _states(tfe).lock(held))[0] is None
    (await _rollback(tfe, v1["id"], tokens["admin"])).problem("run-active", 409)
    assert all(p.cause == "cli" for p in await _pushes(tfe))


async def test_another_lineage_is_404_and_a_pruned_version_410(tfe: Tfe) -> None:
    tokens, (v1, v2) = await _two_versions(tfe)
    # a push -force of a new lineage: v1 and v2 are of the old one now
    fresh = a_state(1, str(uuid.uuid4()), {"v": "new"})
    assert (await tfe.push("ws-acme.net", fresh, token=tokens["admin"], force=True)).status == 201
    (await _rollback(tfe, v1["id"], tokens["admin"])).problem("state-version-other-lineage", 404)
    # back on the old lineage (v2 pushed again with -force), v1's object let go
    back = a_state(5, v2["lineage"], {"v": "five"})
    assert (await tfe.push("ws-acme.net", back, token=tokens["admin"], force=True)).status == 201
    store = await tfe.app.store.nc.jetstream().object_store(STATE_BUCKET)
    await store.delete(v1["object"])
    (await _rollback(tfe, v1["id"], tokens["admin"])).problem("state-version-pruned", 410)
    attrs, _ = await _current(tfe, tokens["admin"])
    assert attrs["serial"] == 5
    assert [p.cause for p in await _pushes(tfe)].count("rollback") == 0


async def test_a_hostile_reason_is_text_in_the_api_and_the_ui(tfe: Tfe) -> None:
    tokens, (v1, _) = await _two_versions(tfe)
    hostile = '<script>alert("x")</script><img src=x onerror=alert(1)>\u202e\x1b[31m'
    a = await _rollback(tfe, v1["id"], tokens["admin"], reason=hostile)
    assert a.status == 201 and a.content_type == "application/json"
    assert a.body["reason"] == hostile  # JSON: a string, whatever it holds
    browser = Browser(tfe.client.server)
    try:
        await browser.signin(tokens["viewer"])
        page = await browser.get("/orgs/acme/workspaces/net")
        assert page.status == 200 and "rolled back by admin-user" in page.text
        assert "<script>alert" not in page.text and "<img src=x" not in page.text
        assert "&lt;script&gt;alert(" in page.text
        assert "Roll back to serial" not in page.text  # a viewer gets no rollback form
    finally:
        await browser.close()


async def test_the_ui_rolls_back_only_when_confirmed_with_its_csrf_token(tfe: Tfe) -> None:
    tokens, (v1, _) = await _two_versions(tfe)
    browser = Browser(tfe.client.server)
    try:
        await browser.signin(tokens["admin"])
        page = await browser.get("/orgs/acme/workspaces/net")
        assert (
            f'name="version" value="{v1["id"]}"' in page.text
            and "Roll back to serial 1" in page.text
        )
        form = {"version": v1["id"], "reason": "from the UI"}
        refused = await browser.post("/orgs/acme/workspaces/net/state-rollback", form)
        assert refused.status == 400 and "confirm" in refused.text  # not ticked
        await browser.get("/orgs/acme/workspaces/net")
        forged = await browser.post(
            "/orgs/acme/workspaces/net/state-rollback", {**form, "confirm": "yes"}, csrf=""
        )
        assert forged.status == 403
        assert [p.cause for p in await _pushes(tfe)].count("rollback") == 0
        await browser.get("/orgs/acme/workspaces/net")
        done = await browser.post(
            "/orgs/acme/workspaces/net/state-rollback", {**form, "confirm": "yes"}
        )
        assert done.status == 200 and "rolled back by admin-user" in done.text, done.text[:300]
    finally:
        await browser.close()
    last = (await _pushes(tfe))[-1]
    assert (last.cause, last.reason, last.serial) == ("rollback", "from the UI", 3)


async def _projected(tfe: Tfe) -> None:
    """Until this api's read model holds every event appended so far."""
    info = await tfe.app.store.nc.jetstream().stream_info(EVENTS)
    assert await tfe.api.projector.wait_for(info.state.last_seq)


class Crash(Exception):
    """Stands for the process dying at that line."""


@pytest.mark.parametrize("at", ["record", "move"])
async def test_killed_at_any_write_it_leaves_no_version_or_a_whole_one(
    tfe: Tfe, monkeypatch: pytest.MonkeyPatch, at: str
) -> None:
    tokens, (v1, v2) = await _two_versions(tfe)

    async def crash(*args: Any, **kwargs: Any) -> Any:
        raise Crash(at)

    if at == "record":  # stored and marked pending: the event never appended
        monkeypatch.setattr(App, "record_state_push", crash)
    else:  # recorded: the head never moved
        monkeypatch.setattr(StateStore, "move_head", crash)
    assert (await _rollback(tfe, v1["id"], tokens["admin"])).status == 500
    monkeypatch.undo()
    attrs, raw = await _current(tfe, tokens["admin"])
    pushes = await _pushes(tfe)
    if at == "record":  # no new version: the head and the record are where they were
        assert attrs["serial"] == 2 and b'"two"' in raw
        assert all(p.cause == "cli" for p in pushes)
    else:  # a whole one: its event names it, so the next read put it in place
        assert attrs["serial"] == 3 and b'"one"' in raw
        assert isinstance(pushes[-1], StatePushed) and pushes[-1].cause == "rollback"
    # either way the admin may roll back again, and it lands once
    a = await _rollback(tfe, v1["id"], tokens["admin"])
    assert a.status == 201, a.body
    attrs, _ = await _current(tfe, tokens["admin"])
    assert attrs["serial"] == a.body["serial"] == (3 if at == "record" else 4)
    assert v2["serial"] == 2


async def test_two_rollbacks_at_once_land_one_version(tfe: Tfe) -> None:
    tokens, (v1, _) = await _two_versions(tfe)
    answers = await asyncio.gather(
        *(_rollback(tfe, v1["id"], tokens["admin"], reason=f"try {i}") for i in range(3))
    )
    assert sorted(a.status for a in answers) == [201, 409, 409], [a.body for a in answers]
    rollbacks = [p for p in await _pushes(tfe) if p.cause == "rollback"]
    assert len(rollbacks) == 1 and rollbacks[0].serial == 3
    attrs, raw = await _current(tfe, tokens["admin"])
    assert attrs["serial"] == 3 and b'"one"' in raw
    # a loser may mark its (identical) version pending after the winner cleared it:
    # readers ignore a pending entry its run's event does not name, and this one names
    # the head itself; nothing else may be left pending
    left = await _states(tfe).pending("acme", "net")
    head, _ = await _states(tfe).head("acme", "net")
    assert head is not None and head.serial == 3
    assert left is None or left == head
