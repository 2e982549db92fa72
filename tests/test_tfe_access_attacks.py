"""A workspace-level user through terraform's own endpoints (the TFE API): a person whose
team holds `plan` on workspace `net` of acme, with their personal token, tries what
Terraform's CLI would send for them: apply (a non-speculative run, the CLI's "yes" on a
run, discard, cancel of an apply), lock, unlock, force-unlock, state upload, workspace
settings, on `net` (403: plan is not enough), on acme's `other` and on beta's `net` (404:
not even seen), reading state and variables there too. What `plan` allows works: the
workspace, its variables, its state (download included) and a speculative plan. Once
suspended, the same token is refused everywhere (401). Every refusal leaves the state,
the lock and the runs as they were.

Each legitimate call is shown working first, so none of this passes on a server that
lacks the routes."""

from __future__ import annotations

from typing import Any

from yarl import URL

from services.surfaces.tfe import ids
from tests.access_support import person
from tests.tfe_login_support import _code, _exchange, _pkce, _signin
from tests.tfe_support import Tfe, a_state, new_run, new_run_as, tfe_fixture, uploaded

__all__ = ["tfe_fixture"]
V1 = "/api/v1/orgs"


async def _with_state(tfe: Tfe, org: str, ws: str) -> str:
    """A workspace made through the TFE API with one state pushed; its id."""
    ws_id = await tfe.cli_workspace(org, ws)
    assert (await tfe.lock(ws_id)).status == 200
    assert (await tfe.push(ws_id, a_state(1, outputs={"secret": f"{org}-{ws}"}))).status == 201
    a = await tfe.tfe("POST", f"/api/v2/workspaces/{ws_id}/actions/unlock")
    assert a.status == 200, a.body
    return ws_id


def _routes(ws_id: str, run_id: str, cv: str) -> list[tuple[str, str, Any]]:
    """What Terraform sends to apply, lock, push state and change a workspace."""
    push = a_state(9)
    return [
        ("POST", f"/api/v2/workspaces/{ws_id}/actions/lock", {"reason": "mine now"}),
        ("POST", f"/api/v2/workspaces/{ws_id}/actions/unlock", None),
        ("POST", f"/api/v2/workspaces/{ws_id}/actions/force-unlock", None),
        ("PATCH", f"/api/v2/workspaces/{ws_id}", {"data": {"type": "workspaces"}}),
        ("POST", f"/api/v2/runs/{run_id}/actions/apply", {}),
        ("POST", f"/api/v2/runs/{run_id}/actions/discard", {}),
        ("POST", f"/api/v2/runs/{run_id}/actions/cancel", {}),
        ("STATE", ws_id, push),
        ("RUN", ws_id, cv),
    ]


async def _call(tfe: Tfe, token: str, method: str, path: str, body: Any) -> int:
    if method == "STATE":
        return (await tfe.push(path, body, token=token, force=True)).status
    if method == "RUN":
        return (await new_run_as(tfe, path, body, token)).status
    kw = {} if body is None else {"json": body}
    return (await tfe.tfe(method, path, token=token, **kw)).status


async def _reads(tfe: Tfe, token: str, ws_id: str) -> list[int]:
    """The statuses of reading the workspace, its variables and its current state."""
    got = []
    for path in ("", "/vars", "/current-state-version", "/current-state-version-outputs"):
        got.append((await tfe.tfe("GET", f"/api/v2/workspaces/{ws_id}{path}", token=token)).status)
    return got


async def _admins_apply_run(tfe: Tfe, ws_id: str) -> tuple[str, str]:
    """An apply run (non-speculative upload) made by the admin: its TFE id, and a
    non-speculative configuration version for the user to try."""
    cv, _ = await uploaded(tfe, ws_id, speculative=False)
    run = await new_run(tfe, ws_id, cv)
    assert run.status == 201, run.body
    other_cv, _ = await uploaded(tfe, ws_id, speculative=False)
    return str(run.body["data"]["id"]), other_cv


async def test_a_plan_user_through_the_tfe_api_plans_and_reads_but_applies_locks_and_pushes_nothing(
    tfe: Tfe,
) -> None:
    await tfe.org("acme")
    await tfe.org("beta")
    net, other, b_net = [
        await _with_state(tfe, org, ws)
        for org, ws in (("acme", "net"), ("acme", "other"), ("beta", "net"))
    ]
    pam = await person(tfe, "acme", "pam@acme.io", "network", **{"workspaces/net": "plan"})

    # What plan allows: read the workspace, its variables and its state; a speculative plan.
    assert await _reads(tfe, pam, net) == [200, 200, 200, 200]
    current = await tfe.tfe("GET", f"/api/v2/workspaces/{net}/current-state-version", token=pam)
    download = URL(current.body["data"]["attributes"]["hosted-state-download-url"]).path
    status, raw = await tfe.raw(download)
    assert status == 200 and b"acme-net" in raw
    spec_cv, _ = await uploaded(tfe, net, speculative=True)
    plan = await new_run_as(tfe, net, spec_cv, pam)
    assert plan.status == 201, plan.body
    _, _, plan_id = plan.body["data"]["id"].removeprefix("run-").split(".")
    made = (await tfe.app.load_run("acme", "net", plan_id)).state
    assert (made.run_type, made.created_by) == ("plan", "pam@acme.io")

    # Beyond it: 403 on net, 404 on other and on beta's net, nothing changed.
    before = await _states(tfe)
    for ws_id, wanted in ((net, 403), (other, 404), (b_net, 404)):
        run_id, cv = await _admins_apply_run(tfe, ws_id)
        for method, path, body in _routes(ws_id, run_id, cv):
            got = await _call(tfe, pam, method, path, body)
            assert got == wanted, (ws_id, method, path, got)
        run = await tfe.tfe("GET", f"/api/v2/runs/{run_id}")
        assert run.body["data"]["attributes"]["status"] == "pending", run.body
        if wanted == 404:
            assert await _reads(tfe, pam, ws_id) == [404, 404, 404, 404]
            run = (await tfe.tfe("GET", f"/api/v2/runs/{run_id}")).body["data"]
            plan_id = run["relationships"]["plan"]["data"]["id"]
            for path in (
                f"/api/v2/runs/{run_id}",
                f"/api/v2/plans/{plan_id}",
                f"/api/v2/workspaces/{ws_id}/runs",
                f"/api/v2/configuration-versions/{cv}",
            ):
                got = (await tfe.tfe("GET", path, token=pam)).status
                assert got == 404, (path, got)
    assert await _states(tfe) == before
    listed = await tfe.tfe("GET", "/api/v2/organizations/acme/workspaces", token=pam)
    assert [w["attributes"]["name"] for w in listed.body["data"]] == ["net"], listed.body
    elsewhere = await tfe.tfe("GET", "/api/v2/organizations/beta/workspaces", token=pam)
    assert elsewhere.status == 404, elsewhere.body
    for org in ("acme", "beta"):
        row = (await tfe.get(f"{V1}/{org}/workspaces/net")).body
        assert row["lock"] is None, row
    assert (await tfe.lock(net)).status == 200  # the admin's lock: pam may not lift it
    lifted = await tfe.tfe("POST", f"/api/v2/workspaces/{net}/actions/unlock", token=pam)
    assert lifted.status == 403, lifted.body
    assert (await tfe.get(f"{V1}/acme/workspaces/net")).body["lock"]["holder"] != "pam@acme.io"

    # Suspended: the same token is refused on every route, reads included.
    user_id = (await tfe.get("/api/v1/whoami", token=pam)).body["user_id"]
    assert (await tfe.post(f"{V1}/acme/users/{user_id}/suspend")).status == 200
    assert await _reads(tfe, pam, net) == [401, 401, 401, 401]
    assert (await tfe.tfe("GET", "/api/v2/account/details", token=pam)).status == 401
    assert (await new_run_as(tfe, net, spec_cv, pam)).status == 401


async def _states(tfe: Tfe) -> list[tuple[str, int]]:
    """(workspace, serial) of every workspace's current state."""
    found = []
    for org, ws in (("acme", "net"), ("acme", "other"), ("beta", "net")):
        ws_id = ids.workspace_id(org, ws)
        a = await tfe.tfe("GET", f"/api/v2/workspaces/{ws_id}/current-state-version")
        found.append((ws_id, a.body["data"]["attributes"]["serial"]))
    return found


async def test_a_state_or_log_url_handed_to_a_user_ends_with_their_token_or_access(
    tfe: Tfe,
) -> None:
    """The URLs Terraform fetches without a token carry the token they were handed to:
    a grant taken back or a suspension ends them at once (they lived on 10 minutes, a
    log's an hour); a grant given back brings them back within their life, a reactivation
    does not (the suspension revoked the token they name). The admin token's URLs name
    nobody and stand."""
    await tfe.org("acme")
    net = await _with_state(tfe, "acme", "net")
    pam = await person(tfe, "acme", "pam@acme.io", "network", **{"workspaces/net": "plan"})
    current = await tfe.tfe("GET", f"/api/v2/workspaces/{net}/current-state-version", token=pam)
    state_url = URL(current.body["data"]["attributes"]["hosted-state-download-url"]).path
    spec_cv, _ = await uploaded(tfe, net, speculative=True)
    run = (await new_run_as(tfe, net, spec_cv, pam)).body["data"]
    plan = await tfe.tfe("GET", f"/api/v2/plans/{run['relationships']['plan']['data']['id']}")
    assert plan.status == 200, plan.body
    _, _, run_id = run["id"].removeprefix("run-").split(".")
    assert (await tfe.post(f"{V1}/acme/runs/{run_id}/cancel", json={})).status == 200
    pams_plan = await tfe.tfe("GET", f"/api/v2/plans/{plan.body['data']['id']}", token=pam)
    log_url = URL(pams_plan.body["data"]["attributes"]["log-read-url"]).path
    admins = await tfe.tfe("GET", f"/api/v2/workspaces/{net}/current-state-version")
    admins_url = URL(admins.body["data"]["attributes"]["hosted-state-download-url"]).path

    async def statuses() -> tuple[int, int, int]:
        return (
            (await tfe.raw(state_url))[0],
            (await tfe.raw(log_url))[0],
            (await tfe.raw(admins_url))[0],
        )

    assert await statuses() == (200, 200, 200)
    taken = {"team": "network", "level": "none"}
    assert (await tfe.call("PUT", f"{V1}/acme/workspaces/net/access", json=taken)).status == 200
    assert await statuses() == (404, 404, 200)
    back = {"team": "network", "level": "plan"}
    assert (await tfe.call("PUT", f"{V1}/acme/workspaces/net/access", json=back)).status == 200
    assert await statuses() == (200, 200, 200)
    user_id = (await tfe.get("/api/v1/whoami", token=pam)).body["user_id"]
    assert (await tfe.post(f"{V1}/acme/users/{user_id}/suspend")).status == 200
    assert await statuses() == (404, 404, 200)
    assert (await tfe.post(f"{V1}/acme/users/{user_id}/reactivate")).status == 200
    # the suspension revoked pam's token: its URLs stay ended
    assert await statuses() == (404, 404, 200)


async def test_a_login_code_allowed_before_a_suspension_buys_no_token_after_it(
    tfe: Tfe,
) -> None:
    """`terraform login`'s consent given, then the user suspended within the code's
    minute: the exchange is an OAuth invalid_grant (what the CLI reads), no token made."""
    await tfe.org("acme")
    pam = await person(tfe, "acme", "pam@acme.io", "ops", org="read")
    await _signin(tfe, pam)
    verifier, challenge = _pkce()
    code = await _code(tfe, challenge)
    user_id = (await tfe.get("/api/v1/whoami", token=pam)).body["user_id"]
    assert (await tfe.post(f"{V1}/acme/users/{user_id}/suspend")).status == 200
    before = len((await tfe.get(f"{V1}/acme/tokens")).body["items"])
    status, answer = await _exchange(tfe, code, verifier)
    assert (status, answer["error"]) == (400, "invalid_grant"), answer
    assert "suspended" in answer["error_description"] and "access_token" not in answer
    assert len((await tfe.get(f"{V1}/acme/tokens")).body["items"]) == before
