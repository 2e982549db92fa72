"""Each run records its cause in `run.created`, and a run created for a commit plans that
commit: the API's, the CLI's claim (api or cli only), derived ids that make a second
creation find the first, the pin asked at creation. Real nats-server, real git, real
Terraform."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from events import vcs
from events.errors import Invalid
from events.run import Cause, RunCreated
from infra.ids import derived_id
from services.processes.vcs import connections as vcs_connections
from tests.builders import api_workspace
from tests.helpers import eventually
from tests.plane_support import (  # noqa: F401  # registers the fixtures
    Plane,
    commit,
    plane_fixture,
)

MAIN_TF = 'resource "null_resource" "a" {\n  triggers = { v = "1" }\n}\n'


async def _created(plane: Plane, run_id: str) -> RunCreated:
    first = (await plane.events("net", run_id))[0]
    assert isinstance(first, RunCreated)
    return first


async def _projected(plane: Plane, run_id: str) -> dict[str, Any]:
    async def probe() -> dict[str, Any]:
        listed = (await plane.http.get("/api/v1/orgs/acme/runs")).body["items"]
        row = next(r for r in listed if r["id"] == run_id)
        return row  # type: ignore[no-any-return]  # JSON object

    return await eventually(probe, timeout=10, what="the run in the read model")


async def test_the_api_records_its_cause_and_the_cli_header_names_only_cli(
    plane: Plane, repo: Path
) -> None:
    """A POST records `api` with the token's user; `X-Runplane-Client: cli` records `cli`;
    any other claim (a webhook's kind) is not taken: `api`. GET, lists and the event agree."""
    commit(repo, {"main.tf": MAIN_TF})
    await api_workspace(plane.http, repo)
    path = "/api/v1/orgs/acme/workspaces/net/runs"
    kinds = {}
    for claim in ("", "cli", "vcs", "schedule"):
        headers = {"X-Runplane-Client": claim} if claim else {}
        a = await plane.http.post(path, json={"type": "plan"}, headers=headers)
        assert a.status == 201, a.body
        kinds[claim] = a.body
    assert kinds[""]["cause"]["kind"] == "api"
    assert kinds["cli"]["cause"]["kind"] == "cli"
    assert kinds["vcs"]["cause"]["kind"] == "api"
    assert kinds["schedule"]["cause"]["kind"] == "api"
    user = kinds[""]["created_by"]
    assert kinds["cli"]["cause"] == {"kind": "cli", "user": user}  # nothing else shown
    cli = kinds["cli"]["id"]
    assert (await _created(plane, cli)).cause == Cause(kind="cli", user=user)
    assert (await _projected(plane, cli))["cause"] == {"kind": "cli", "user": user}
    got = (await plane.http.get(f"/api/v1/orgs/acme/runs/{cli}")).body
    assert got["cause"] == {"kind": "cli", "user": user}


async def test_a_derived_id_makes_a_second_creation_find_the_first(
    plane: Plane, repo: Path
) -> None:
    """Two creations with one derived id, even at once: one run.created, both answers
    the same run, the second `existed`; the run is queued once."""
    commit(repo, {"main.tf": MAIN_TF})
    await api_workspace(plane.http, repo)
    fire = datetime(2026, 12, 1, 3, 0, tzinfo=UTC)
    cause = Cause(kind="schedule", schedule="s1", fire_time=fire)
    run_id = derived_id("s1", fire.isoformat())
    assert run_id == derived_id("s1", fire.isoformat()) != derived_id("s1", "other")
    assert len(run_id) == 26 and run_id.isalnum() and run_id.islower()

    async def create() -> Any:
        return await plane.app.create_run(
            "acme", "net", "plan", "sched", cause=cause, run_id=run_id
        )

    a, b = await asyncio.gather(create(), create())
    assert a.state.run_id == b.state.run_id == run_id
    assert sorted([a.existed, b.existed]) == [False, True]
    again = await create()
    assert again.existed and again.state.cause == cause
    created = [e for e in await plane.events("net", run_id) if isinstance(e, RunCreated)]
    assert len(created) == 1 and created[0].cause == cause
    ws = (await plane.app.load_ws("acme", "net")).state
    assert list(ws.queue).count(run_id) + (ws.active == run_id) == 1
    row = await _projected(plane, run_id)
    assert row["cause"] == {
        "kind": "schedule",
        "schedule": "s1",
        "fire_time": "2026-12-01T03:00:00Z",
    }


@pytest.mark.terraform
async def test_a_run_created_for_a_commit_plans_that_commit_not_the_branch_head(
    plane: Plane, repo: Path
) -> None:
    """`commit=` (a webhook's push) is pinned at admission, however far the branch moved."""
    asked = commit(repo, {"main.tf": MAIN_TF})
    await api_workspace(plane.http, repo)
    head = commit(repo, {"main.tf": MAIN_TF.replace('"1"', '"2"') + MAIN_TF.replace('"a"', '"b"')})
    cause = Cause(kind="vcs", provider="github", event="push", commit=asked, delivery="d-1")
    done = await plane.app.create_run("acme", "net", "plan", "vcs", cause=cause, commit=asked)
    run_id = done.state.run_id
    assert (await _created(plane, run_id)).commit == asked
    queued = await plane.pinned("net", run_id)
    assert queued.snapshot is not None and queued.snapshot.commit == asked != head
    await plane.executor("ex1")
    planned = await plane.reaches("net", run_id, "planned")
    assert planned.commit == asked
    assert planned.plan_summary is not None and planned.plan_summary.add == 1  # not head's 2


async def test_a_bad_cause_or_commit_is_refused_and_writes_nothing(
    plane: Plane, repo: Path
) -> None:
    commit(repo, {"main.tf": MAIN_TF})
    await api_workspace(plane.http, repo)
    for kwargs in (
        {"cause": Cause(kind="forged")},
        {"commit": "main"},
        {"commit": "--upload-pack=touch /tmp/x"},
        {"commit": "A" * 40},
    ):
        run_id = derived_id("bad", repr(kwargs))
        with pytest.raises(Invalid):
            await plane.app.create_run("acme", "net", "plan", "t", run_id=run_id, **kwargs)  # type: ignore[arg-type]
        assert await plane.events("net", run_id) == []


def test_notifications_and_the_ui_show_the_cause() -> None:
    """The notification payload's `runplane.cause`, the UI run page's words for it."""
    from events.run import INITIAL, CreateRun, Workspace, decide, fold
    from services.processes.notifications import formats
    from services.surfaces.ui.pages import _cause

    sha = "ab" * 20
    cause = Cause(kind="vcs", provider="gitlab", event="push", commit=sha, ref="refs/heads/main")
    create = CreateRun(
        actor="vcs",
        run_id="r1",
        org="acme",
        workspace="net",
        run_type="apply",
        config=Workspace(repository="https://example.com/r.git"),
        cause=cause,
        commit=sha,
    )
    now = datetime(2026, 12, 1, tzinfo=UTC)
    state = fold(decide(INITIAL, create, now=now, new_id=lambda: "x"))
    view = formats.view_of(state, at=now, actor="vcs")
    body = formats.generic(view, "run:created", "nc-1")
    assert body["runplane"]["cause"] == {
        "kind": "vcs",
        "provider": "gitlab",
        "event": "push",
        "ref": "refs/heads/main",
        "commit": sha,
    }
    assert _cause(body["runplane"]["cause"]) == "push of abababab on refs/heads/main (gitlab)"
    assert _cause(None) == ""
    assert _cause({"kind": "api", "user": "alice"}) == "api by alice"


async def test_a_workspace_keeps_its_vcs_binding_and_refuses_bad_globs(
    plane: Plane, repo: Path
) -> None:
    """The create takes the VCS binding (what webhooks start); GET and the list show it;
    a glob with a control character, too many globs, or another run type is refused."""
    body = {
        "name": "net",
        "repository": str(repo),
        "vcs_connection": "conn-1",
        "trigger_paths": ["modules/**", "net/*.tf"],
        "trigger_tags": ["v*"],
        "vcs_run_type": "plan",
    }
    # a workspace may name only a connection of its organization (services/surfaces/api/vcs.py)
    (await plane.http.post("/api/v1/orgs/acme/workspaces", json=body)).problem(
        "invalid-command", 422
    )
    save = vcs.SaveConnection(
        actor="t", connection_id="conn-1", org="acme", create=True, name="gh", provider="github"
    )
    await vcs_connections.command(plane.app, "acme", save)
    a = await plane.http.post("/api/v1/orgs/acme/workspaces", json=body)
    assert a.status == 201, a.body
    want: dict[str, Any] = {k: v for k, v in body.items() if k not in ("name", "repository")}
    want["trigger_any_change"] = False
    assert {k: a.body[k] for k in want} == want

    async def listed() -> dict[str, Any]:
        rows = (await plane.http.get("/api/v1/orgs/acme/workspaces")).body["items"]
        assert rows, "not projected yet"
        return rows[0]  # type: ignore[no-any-return]  # JSON object

    row = await eventually(listed, timeout=10, what="the workspace in the read model")
    assert {k: row[k] for k in want} == want
    for bad in (
        {"trigger_paths": ["a\x1b[2Jb"]},
        {"trigger_paths": ["x"] * 51},
        {"vcs_run_type": "destroy"},
        {"vcs_connection": "../other-org"},
    ):
        b = await plane.http.post(
            "/api/v1/orgs/acme/workspaces", json={"name": "bad", "repository": str(repo), **bad}
        )
        assert b.status in (400, 422), (bad, b.status)
        assert b.body["type"].endswith(("invalid-body", "invalid-id")), b.body
    assert (await plane.http.get("/api/v1/orgs/acme/workspaces/bad")).status == 404
