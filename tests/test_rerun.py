"""Rerun: `POST .../runs/{id}/rerun` on an ended run makes a new run of its type and
template on the workspace's current commit and settings, caused by it; the old run is
kept exactly as it was. Real Terraform (null provider), through the HTTP API."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from events import errors
from tests.api_support import Http, http_fixture  # noqa: F401  # the `http` fixture
from tests.plane_support import (  # noqa: F401  # registers the fixtures
    Plane,
    commit,
    plane_fixture,
)

V1 = "/api/v1/orgs/acme"
TF = 'resource "null_resource" "x" {\n  triggers = { v = "%s" }\n}\n'
QUICK = {"steps": [{"number": 100, "kind": "plan"}]}


async def _raw(plane: Plane, run_id: str) -> list[bytes]:
    """The run's stored events, byte for byte."""
    envs = await plane.app.store.read(f"rp.run.acme.*.{run_id}")
    return [repr(e).encode() for e in envs]


@pytest.mark.terraform
async def test_a_rerun_repeats_type_and_template_on_the_current_commit_and_settings(
    plane: Plane, repo: Path
) -> None:
    first_commit = commit(repo, {"main.tf": TF % "1"})
    made = await plane.http.post(f"{V1}/workspaces", json={"name": "net", "repository": str(repo)})
    assert made.status == 201, made.body
    assert (await plane.http.call("PUT", f"{V1}/templates/quick", json=QUICK)).status in (200, 201)
    await plane.executor("e1")
    a = await plane.http.post(
        f"{V1}/workspaces/net/runs", json={"type": "plan", "template": "quick"}
    )
    assert a.status == 201, a.body
    old_id = a.body["id"]
    old = await plane.reaches("net", old_id, "planned")
    assert old.commit == first_commit
    before = await _raw(plane, old_id)

    second_commit = commit(repo, {"main.tf": TF % "2"})
    patched = await plane.http.call(
        "PATCH", f"{V1}/workspaces/net/settings", json={"heartbeat_timeout": 77}
    )
    assert patched.status == 200, patched.body
    ops = await plane.http.post(f"{V1}/tokens", json={"user": "ops", "role": "operator"})
    r = await plane.http.post(f"{V1}/runs/{old_id}/rerun", token=ops.body["token"])
    assert r.status == 201, r.body
    new_id = r.body["id"]
    assert new_id != old_id
    assert r.headers["Location"] == f"{V1}/runs/{new_id}"
    assert r.body["type"] == "plan" and r.body["template"] == "quick"
    assert r.body["cause"] == {"kind": "rerun", "rerun_of": old_id, "user": "ops"}
    new = await plane.reaches("net", new_id, "planned")
    assert new.commit == second_commit
    assert new.snapshot is not None
    assert new.snapshot.settings["heartbeat_timeout"]["value"] == 77
    assert new.cause is not None and new.cause.rerun_of == old_id
    # the old run is untouched: its events exactly as they were
    assert await _raw(plane, old_id) == before


async def _workspace_and_run(http: Http, org: str, ws: str) -> str:
    await http.workspace(org, ws)
    run: dict[str, Any] = await http.run(org, ws, "plan")
    return str(run["id"])


async def test_a_run_that_has_not_ended_is_refused_409_and_a_viewer_403(http: Http) -> None:
    tokens = await http.org("acme")
    run_id = await _workspace_and_run(http, "acme", "net")  # no scheduler: it stays pending
    body = (await http.post(f"{V1}/runs/{run_id}/rerun", token=tokens["operator"])).problem(
        "conflict", 409
    )
    assert body["current_status"] == "pending"
    (await http.post(f"{V1}/runs/{run_id}/rerun", token=tokens["viewer"])).problem("forbidden", 403)
    (await http.post(f"{V1}/runs/nope/rerun", token=tokens["operator"])).problem("not-found", 404)
    (await http.post(f"{V1}/runs/{run_id}/rerun", json={"x": 1}, token=tokens["operator"])).problem(
        "invalid-body", 400
    )


async def test_a_canceled_run_is_rerun_and_the_old_one_stays_canceled(http: Http) -> None:
    tokens = await http.org("acme")
    run_id = await _workspace_and_run(http, "acme", "net")
    c = await http.post(f"{V1}/runs/{run_id}/cancel", token=tokens["operator"])
    assert c.status == 200 and c.body["status"] == "canceled", c.body
    before = (await http.app.load_run("acme", "net", run_id)).seq
    r = await http.post(f"{V1}/runs/{run_id}/rerun", token=tokens["operator"])
    assert r.status == 201, r.body
    assert r.body["status"] == "pending" and r.body["type"] == "plan"
    assert r.body["cause"]["rerun_of"] == run_id
    after = await http.app.load_run("acme", "net", run_id)
    assert (after.seq, str(after.state.status)) == (before, "canceled")


async def test_org_a_s_admin_cannot_rerun_org_b_s_runs(http: Http) -> None:
    """Attack: by B's path (the token is A's) or by A's path with B's run id, the run is
    not found, and nothing is written to B."""
    a_tokens = await http.org("orga")
    b_tokens = await http.org("orgb")
    b_run = await _workspace_and_run(http, "orgb", "theirs")
    c = await http.post(f"/api/v1/orgs/orgb/runs/{b_run}/cancel", token=b_tokens["operator"])
    assert c.status == 200, c.body
    await http.workspace("orga", "theirs")  # the same workspace name in A changes nothing
    before = await _runs(http, "orgb"), await _runs(http, "orga")
    attacker = a_tokens["admin"]
    for path in (f"/api/v1/orgs/orgb/runs/{b_run}/rerun", f"/api/v1/orgs/orga/runs/{b_run}/rerun"):
        (await http.post(path, token=attacker)).problem("not-found", 404)
    assert (await _runs(http, "orgb"), await _runs(http, "orga")) == before
    assert before == ([b_run], [])
    # B's own operator may (the route is there: what A's admin met was the scope)
    own = await http.post(f"/api/v1/orgs/orgb/runs/{b_run}/rerun", token=b_tokens["operator"])
    assert own.status == 201, own.body


async def _runs(http: Http, org: str) -> list[str]:
    """The ids of the organization's runs, from the stream."""
    envs = await http.app.store.read(f"rp.run.{org}.*.*")
    return sorted({e.subject.split(".")[-1] for e in envs})


async def test_a_run_of_a_deleted_workspace_is_a_clear_409(http: Http) -> None:
    """Its history stays readable; its runs are not rerun (workspace deletion: item 7)."""
    if not hasattr(errors, "Deleted"):
        pytest.skip("workspace deletion (issue 14 item 7) is not on this tree yet")
    tokens = await http.org("acme")
    run_id = await _workspace_and_run(http, "acme", "net")
    assert (await http.post(f"{V1}/runs/{run_id}/cancel", token=tokens["operator"])).status == 200
    gone = await http.call("DELETE", f"{V1}/workspaces/net", token=tokens["admin"])
    assert gone.status in (200, 202, 204), gone.body
    r = await http.post(f"{V1}/runs/{run_id}/rerun", token=tokens["operator"])
    assert r.body["type"].endswith("/workspace-deleted") and r.status == 409, r.body
    assert "deleted" in r.body["detail"]
