"""Run triggers and policy sets name workspaces: neither may tell a caller anything of a
workspace it may not read (issue 24's loose ends, item 5).

Eve is admin on `mine`, reads `shared`, holds the right `manage-policies`, and may not
read `secret` or `vault`; `nope` does not exist. Whatever Eve asks about `secret` is
answered as about `nope`. On main: the run-trigger lists named `secret` and `vault`, a
cycle named `secret`, deleting the edge to `vault` answered 204 (to `nope`: 404), a
policy set scoped to `secret` was listed to every member and taken from Eve where one
scoped to `nope` was 404.
"""

from __future__ import annotations

from typing import Any

from tests.access_support import person
from tests.api_support import Answer, Http, http_fixture  # noqa: F401  # `http`

V1 = "/api/v1/orgs/a"
SOURCE = 'package guard\n\ndeny contains msg if {\n  false\n  msg := "never"\n}\n'


def _same_refusal(hidden: Answer, missing: Answer, names: tuple[str, str]) -> None:
    """Both 404 `not-found`, word for word but the name asked for (`names`)."""
    hidden.problem("not-found", 404)
    missing.problem("not-found", 404)
    said = str({k: v for k, v in hidden.body.items() if k != "instance"})
    other = str({k: v for k, v in missing.body.items() if k != "instance"})
    assert said.replace(names[0], "X") == other.replace(names[1], "X"), (said, other)


async def _setup(http: Http) -> str:
    await http.org("a")
    for ws in ("mine", "shared", "secret", "vault"):
        await http.workspace("a", ws)
    a = await http.post(f"{V1}/teams", json={"name": "ops", "rights": ["manage-policies"]})
    assert a.status == 201, a.body
    grants = {"workspaces/mine": "admin", "workspaces/shared": "read"}
    return await person(http, "a", "eve@a.io", "ops", **grants)


async def _trigger(http: Http, follower: str, source: str, token: str | None = None) -> Answer:
    body: dict[str, Any] = {"json": {"source": source}}
    if token is not None:
        body["token"] = token
    return await http.post(f"{V1}/workspaces/{follower}/run-triggers", **body)


async def test_run_triggers_tell_nothing_of_a_workspace_the_caller_may_not_read(
    http: Http,
) -> None:
    eve = await _setup(http)
    hidden = await _trigger(http, "mine", "secret", eve)
    _same_refusal(hidden, await _trigger(http, "mine", "nope", eve), ("secret", "nope"))
    # the admin wires mine -> secret -> shared, and mine follows vault
    assert (await _trigger(http, "secret", "mine")).status == 201
    assert (await _trigger(http, "shared", "secret")).status == 201
    assert (await _trigger(http, "mine", "vault")).status == 201

    listed = await http.get(f"{V1}/workspaces/mine/run-triggers", token=eve)
    assert listed.body == {"workspace": "mine", "sources": [], "followers": []}, listed.body
    shared = await http.get(f"{V1}/workspaces/shared/run-triggers", token=eve)
    assert shared.body["sources"] == [], shared.body
    whole = await http.get(f"{V1}/workspaces/mine/run-triggers")  # the admin sees all
    assert whole.body["sources"] == [{"workspace": "vault"}], whole.body

    cycle = await _trigger(http, "mine", "shared", eve)  # mine -> secret -> shared -> mine
    body = cycle.problem("run-trigger-cycle", 422)
    assert body["cycle"] == ["mine", "(hidden)", "shared", "mine"], body
    assert "secret" not in str(body), body

    path = f"{V1}/workspaces/mine/run-triggers"
    _same_refusal(
        await http.call("DELETE", f"{path}/vault", token=eve),
        await http.call("DELETE", f"{path}/nope", token=eve),
        ("vault", "nope"),
    )
    assert (await http.get(f"{V1}/workspaces/mine/run-triggers")).body["sources"] != []
    # another organization's workspaces are no sources at all: its paths are 404 to Eve
    await http.org("b")
    await http.workspace("b", "mine")
    across = await http.post(
        "/api/v1/orgs/b/workspaces/mine/run-triggers", json={"source": "mine"}, token=eve
    )
    across.problem("not-found", 404)
    # and following gives nothing of the source: its state stays out of reach
    versions = await http.get(f"{V1}/workspaces/vault/state-versions", token=eve)
    versions.problem("not-found", 404)


async def test_policy_sets_tell_nothing_of_a_workspace_the_caller_may_not_read(
    http: Http,
) -> None:
    eve = await _setup(http)
    put = {"enforcement": "advisory", "source": SOURCE}
    on = {ws: {**put, "scope": f"workspace:{ws}"} for ws in ("secret", "nope", "mine")}
    _same_refusal(
        await http.call("PUT", f"{V1}/policies/probe", json=on["secret"], token=eve),
        await http.call("PUT", f"{V1}/policies/probe", json=on["nope"], token=eve),
        ("secret", "nope"),
    )
    assert "probe" not in (await http.app.load_org("a")).state.policies
    assert (await http.call("PUT", f"{V1}/policies/guard", json=on["secret"])).status == 201
    made = await http.call("PUT", f"{V1}/policies/own", json=on["mine"], token=eve)
    assert made.status == 201, made.body

    listed = await http.get(f"{V1}/policies", token=eve)
    assert [p["name"] for p in listed.body["items"]] == ["own"], listed.body
    scoped = await http.get(f"{V1}/policies?scope=workspace:secret", token=eve)
    assert scoped.body["items"] == [], scoped.body
    _same_refusal(
        await http.get(f"{V1}/policies/guard", token=eve),
        await http.get(f"{V1}/policies/nope", token=eve),
        ("guard", "nope"),
    )
    gone = await http.call("DELETE", f"{V1}/policies/guard", token=eve)
    gone.problem("not-found", 404)
    taken = await http.call("PUT", f"{V1}/policies/guard", json=on["mine"], token=eve)
    taken.problem("conflict", 409)
    kept = (await http.app.load_org("a")).state.policies["guard"]
    assert kept.scope == "workspace:secret"  # neither replaced nor deleted
    every = (await http.get(f"{V1}/policies")).body["items"]  # the admin's: both
    assert [p["name"] for p in every] == ["own", "guard"], every
