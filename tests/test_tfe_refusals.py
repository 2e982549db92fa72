"""The TFE API's refusals on the audit record (issue 25, item 1): what Terraform's CLI is
refused through runplane's TFE surface is recorded as runplane's own API's refusals are
(services/surfaces/tfe/refusals.py): a 403, and a 409 on apply, discard, cancel, lock,
unlock or a state upload, via `tfe`, with the caller, the thing, the request id and the
client's address, under the same flood limits. Another organization's caller is
recorded in its own organization's chain, never in the other's, and learns nothing."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from nats.aio.client import Client as NATS

from services.surfaces.api import audit as audit_api
from tests.audit_support import recorded, records, verify
from tests.tfe_support import Tfe, a_state, new_run, new_run_as, tfe_fixture, uploaded

__all__ = ["tfe_fixture"]
LOCK = "refused POST /api/v2/workspaces/{workspace_id}/actions/lock"
APPLY = "refused POST /api/v2/runs/{object_id}/actions/apply"
PUSH = "refused POST /api/v2/workspaces/{workspace_id}/state-versions"


async def _pending_run(tfe: Tfe, ws_id: str) -> str:
    """An apply run of the admin's (pending: no executor here); its TFE id."""
    cv, _ = await uploaded(tfe, ws_id, speculative=False)
    run = await new_run(tfe, ws_id, cv)
    assert run.status == 201, run.body
    return str(run.body["data"]["id"])


def _refusals(chain: list[tuple[int, dict[str, Any]]]) -> list[dict[str, Any]]:
    return [r for _, r in chain if r.get("outcome") == "refused"]


async def test_a_viewers_lock_and_apply_through_terraform_are_refused_on_the_record(
    tfe: Tfe, nc: NATS
) -> None:
    """A viewer's lock, apply (the CLI's "yes") and run are 403 and each a `refused` record
    of the organization via tfe, naming the viewer, the workspace or run (the run's: the
    one its body names), the request id the answer carried and the client; the admin's
    apply of a run that awaits nothing and push without the lock are 409s on the record
    too. A 409 elsewhere (a body of the
    wrong type) and a 404 are not. On main none of these was recorded."""
    tokens = await tfe.org("acme")
    ws_id = await tfe.cli_workspace("acme", "net")
    run_id = await _pending_run(tfe, ws_id)
    lock = await tfe.tfe(
        "POST", f"/api/v2/workspaces/{ws_id}/actions/lock", token=tokens["viewer"], json={}
    )
    assert lock.status == 403, lock.body
    (locked,) = await recorded(nc, "acme", LOCK)
    assert (locked["via"], locked["actor"], locked["actor_kind"]) == ("tfe", "viewer-user", "token")
    assert (locked["outcome"], locked["status"], locked["detail"]) == ("refused", 403, "forbidden")
    assert locked["thing"] == "workspace net" and locked["client"] == "127.0.0.1"
    assert locked["request_id"] == lock.headers["X-Request-ID"]

    apply = f"/api/v2/runs/{run_id}/actions/apply"
    headers = {"X-Request-Id": "cli-yes-1"}
    got = await tfe.tfe("POST", apply, token=tokens["viewer"], json={}, headers=headers)
    assert got.status == 403, got.body
    (refused,) = await recorded(nc, "acme", APPLY)
    assert refused["thing"] == f"run {run_id.rsplit('.', 1)[1]}"
    assert (refused["request_id"], refused["status"]) == ("cli-yes-1", 403)

    assert (await tfe.tfe("POST", apply, json={})).status == 409  # pending: nothing to apply
    conflict = (await recorded(nc, "acme", APPLY, 2))[1]
    assert (conflict["actor_kind"], conflict["status"]) == ("admin", 409)
    assert conflict["detail"] == "transition-not-allowed"
    assert (await tfe.push(ws_id, a_state(1))).status == 409  # not locked
    (pushed,) = await recorded(nc, "acme", PUSH)
    assert (pushed["detail"], pushed["thing"]) == ("workspace-not-locked", "workspace net")

    cv, _ = await uploaded(tfe, ws_id, speculative=False)
    assert (await new_run_as(tfe, ws_id, cv, tokens["viewer"])).status == 403
    (made_run,) = await recorded(nc, "acme", "refused POST /api/v2/runs")  # the body's workspace
    assert (made_run["thing"], made_run["actor"]) == ("workspace net", "viewer-user")

    wrong = {"data": {"type": "runs", "attributes": {"name": "x"}}}
    made = await tfe.tfe("POST", "/api/v2/organizations/acme/workspaces", json=wrong)
    assert made.status == 409, made.body
    missing = await tfe.tfe("GET", "/api/v2/workspaces/ws-acme.nope", token=tokens["viewer"])
    assert missing.status == 404, missing.body
    await asyncio.sleep(0.2)
    assert len(_refusals(await records(nc, "acme"))) == 5
    assert (await verify(nc))[0] == 0


async def test_tfe_and_the_api_share_the_callers_and_the_organizations_flood_limits(
    tfe: Tfe, nc: NATS, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A viewer flooding refusals through both surfaces gets the caller's limit once, not
    once a surface; a second caller gets what is left of the organization's: the rest
    are counted, not recorded."""
    monkeypatch.setattr(audit_api, "FLOOD_LIMIT", 4, raising=False)
    monkeypatch.setattr(audit_api, "ORG_FLOOD_LIMIT", 6, raising=False)
    monkeypatch.setattr(audit_api, "FLOOD_WINDOW_S", 30.0, raising=False)
    tokens = await tfe.org("acme")
    ws_id = await tfe.cli_workspace("acme", "net")
    for _ in range(3):
        runs = await tfe.post(
            "/api/v1/orgs/acme/workspaces/net/runs", json={"type": "apply"}, token=tokens["viewer"]
        )
        runs.problem("forbidden", 403)
        assert (await tfe.lock(ws_id, token=tokens["viewer"])).status == 403
    await recorded(nc, "acme", LOCK)
    await asyncio.sleep(0.3)
    assert len(_refusals(await records(nc, "acme"))) == 4
    made = await tfe.post("/api/v1/orgs/acme/tokens", json={"user": "v2", "role": "viewer"})
    for _ in range(5):
        assert (await tfe.lock(ws_id, token=tokens["viewer"] + "x")).status == 401  # nobody's
        assert (await tfe.lock(ws_id, token=made.body["token"])).status == 403
    await recorded(nc, "acme", LOCK, 4)
    await asyncio.sleep(0.3)
    chain = _refusals(await records(nc, "acme"))
    assert len(chain) == 6 and [r["actor"] for r in chain[4:]] == ["v2"] * 2


async def test_org_a_refused_on_org_b_s_things_is_on_a_s_record_and_never_b_s(
    tfe: Tfe, nc: NATS, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A's admin token locks, applies, pushes and runs on B's workspace and run, and on ids
    of B that name nothing: each is 404 with the same body whether B's thing exists or not.
    B's chain gets not one record (it holds none but B's own, however hard A tries); A's
    chain gets each attempt, naming what A sent and nothing more, the same for B's real
    workspace as for the made-up one, and no more than A's caller's flood limit. On main
    A's attempts were recorded nowhere."""
    monkeypatch.setattr(audit_api, "FLOOD_LIMIT", 8, raising=False)
    monkeypatch.setattr(audit_api, "FLOOD_WINDOW_S", 30.0, raising=False)
    a = await tfe.org("a")
    await tfe.org("b")
    b_net = await tfe.cli_workspace("b", "net")
    b_run = await _pending_run(tfe, b_net)
    cv, _ = await uploaded(tfe, b_net, speculative=False)
    fake_run = b_run.rsplit(".", 1)[0] + ".nosuchrun"
    b_before = await records(nc, "b")
    answers: dict[str, list[Any]] = {}
    for ws_id, run_id in ((b_net, b_run), ("ws-b.nothere", fake_run)):
        got = answers.setdefault(ws_id, [])
        for path in (
            f"/api/v2/workspaces/{ws_id}/actions/lock",
            f"/api/v2/runs/{run_id}/actions/apply",
        ):
            answer = await tfe.tfe("POST", path, token=a["admin"], json={})
            got.append((answer.status, answer.body))
        pushed = await tfe.push(ws_id, a_state(1), token=a["admin"])
        got.append((pushed.status, pushed.body))
        ran = await new_run_as(tfe, ws_id, cv, a["admin"])
        got.append((ran.status, ran.body))
    real, made_up = answers.values()
    assert [s for s, _ in real] == [404, 404, 404, 404]
    assert real == made_up  # status and body: nothing tells B's real things apart
    assert [b["errors"][0]["title"] for _, b in real] == ["not found"] * 4

    locks = await recorded(nc, "a", LOCK, 2)
    assert [r["thing"] for r in locks] == [
        "workspace net of organization b",
        "workspace nothere of organization b",
    ]
    assert all((r["org"], r["actor"], r["status"]) == ("a", "admin-user", 404) for r in locks)
    assert all(r["detail"] == "not-found" and r["via"] == "tfe" for r in locks)
    runs = await recorded(nc, "a", "refused POST /api/v2/runs", 2)
    assert [r["thing"] for r in runs] == [t["thing"] for t in locks]
    assert len(_refusals(await records(nc, "a"))) == 8

    for _ in range(10):  # a flood: A's own chain takes its caller's limit, B's nothing
        assert (await tfe.lock(b_net, token=a["admin"])).status == 404
    await asyncio.sleep(0.3)
    assert len(_refusals(await records(nc, "a"))) == 8
    assert await records(nc, "b") == b_before
    assert "admin-user" not in json.dumps(await records(nc, "b"))
    assert (await verify(nc))[0] == 0
