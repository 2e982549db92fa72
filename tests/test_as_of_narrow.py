"""`?as_of=`, second pass (issue 25, item 3): a workspace's answers are folded from that
workspace's history alone, and `as_of` where it is not taken is refused.

- a workspace's answers as of each recorded moment (its queue, lock, state versions, its
  runs and their lists) equal, byte for byte, what GET answered then, in an organization
  where folders, teams, grants, a run trigger, another workspace's runs, lock and state
  and the organization's settings changed in between: they come from models folded from
  `rp.org.<org>`, `rp.ws.<org>.<ws>` and `rp.run.<org>.<ws>.>` alone;
- a cursor (`before`) naming another workspace's run is placed by the organization's
  model, as the live list places it; the organization's runs, from a model without
  `rp.org.<org>.>` (a run trigger, a token's use), are as they were too;
- a workspace's answer folds its own events, not the organization's: under a cap between
  the two it answers at once where the whole organization's fold is 503;
- `as_of` on any other API route is 400 `as-of-unsupported` naming those that take it,
  and a command under it never runs; the UI's and the TFE API's routes ignore it;
- another organization learns nothing: its run ids under its own path are 404 with
  nothing folded, its routes refuse `as_of` exactly as a made-up organization's.

On main the cap test, the refusals and the nothing-folded test fail (as_of was ignored on
other routes, a command under it ran, and every as_of folded the whole organization).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from infra.streams import EVENTS
from services.root.bootstrap import Plane
from services.surfaces.api.asof import PAST
from services.surfaces.api.context import API
from tests.api_support import Answer, Http, served
from tests.tfe_support import Tfe, tfe_fixture

__all__ = ["tfe_fixture"]

V1 = "/api/v1/orgs"
ORG = V1 + "/acme"
NET = ORG + "/workspaces/net"
APP = ORG + "/workspaces/app"
OWN = ("as_of_seq", "as_of_omitted")


async def _last_seq(http: Http) -> int:
    return (await http.app.store.nc.jetstream().stream_info(EVENTS)).state.last_seq


def _shape(a: Answer) -> Any:
    return (a.status, a.body["type"]) if a.status != 200 else a.body


def _without(body: Any, omitted: list[str]) -> Any:
    if isinstance(body, dict):
        return {k: _without(v, omitted) for k, v in body.items() if k not in omitted}
    if isinstance(body, list):
        return [_without(v, omitted) for v in body]
    return body


async def _as_of(http: Http, path: str, seq: int, **kw: Any) -> Answer:
    return await http.get(f"{path}{'&' if '?' in path else '?'}as_of={seq}", **kw)


def _net_paths(net_runs: list[str], app_runs: list[str]) -> list[str]:
    """A workspace's answers: each folded from one workspace's history."""
    return [
        NET,
        NET + "/state-versions",
        NET + "/runs",
        NET + "/runs?status=pending,queued&limit=2",
        ORG + "/runs?workspace=net",
        APP,
        *(f"{ORG}/runs/{r}" for r in net_runs + app_runs),
        *(f"{NET}/runs?limit=1&before={r}" for r in net_runs[-1:]),  # its own cursor
        *_ORG_PATHS,
    ]


# The organization's runs: its model, folded without `rp.org.<org>.>` (run triggers, ...).
_ORG_PATHS = (ORG + "/runs", ORG + "/runs?limit=1&status=pending,queued")


async def _record(tfe: Tfe, points: list[tuple[int, dict[str, Any]]], paths: list[str]) -> None:
    seq = await _last_seq(tfe)
    assert await tfe.api.projector.wait_for(seq, timeout=5)
    points.append((seq, {p: _shape(await tfe.get(p)) for p in paths}))


async def test_a_workspace_s_answers_from_its_own_history_equal_the_answers_then(
    tfe: Tfe,
) -> None:
    tokens = await tfe.org("acme")
    assert (await tfe.post(ORG + "/folders", json={"name": "infra"})).status == 201
    await tfe.workspace("acme", "net", folder="infra")
    await tfe.workspace("acme", "app")
    net_runs: list[str] = []
    app_runs: list[str] = []
    points: list[tuple[int, dict[str, Any]]] = []

    async def record() -> None:
        await _record(tfe, points, _net_paths(net_runs, app_runs))

    await record()
    net_runs.append((await tfe.run("acme", "net"))["id"])
    app_runs.append((await tfe.run("acme", "app"))["id"])
    await record()
    trigger = await tfe.post(APP + "/run-triggers", json={"source": "net"})
    assert trigger.status == 201, trigger.body
    assert (await tfe.post(ORG + "/teams", json={"name": "ops"})).status == 201
    grant = await tfe.call("PUT", NET + "/access", json={"team": "ops", "level": "write"})
    assert grant.status == 200, grant.body
    org_set = await tfe.call("PATCH", ORG + "/settings", json={"heartbeat_timeout": 300})
    assert org_set.status == 200, org_set.body
    await record()
    assert (await tfe.get(NET, token=tokens["viewer"])).status == 200  # a token used
    assert (await tfe.post(APP + "/lock", json={"reason": "other"})).status == 200
    net_runs.append((await tfe.run("acme", "net", "plan"))["id"])
    app_runs.append((await tfe.run("acme", "app", "plan"))["id"])
    await record()
    assert (await tfe.post(NET + "/lock", json={"reason": "mine"})).status == 200
    canceled = await tfe.post(f"{ORG}/runs/{net_runs[0]}/cancel", json={"reason": "no"})
    assert canceled.status == 200, canceled.body
    await record()
    assert (await tfe.post(NET + "/unlock")).status == 200
    net_runs.append((await tfe.run("acme", "net"))["id"])
    await record()
    assert len({repr(p[1][NET]) for p in points}) >= 5  # the history changed the answer
    past = tfe.client.app[PAST]
    for seq, then in points:
        for path, expected in then.items():
            if path in _ORG_PATHS:
                continue  # below, once the workspaces' models are counted
            a = await _as_of(tfe, path, seq)
            if a.status != 200:
                assert _shape(a) == expected, (path, seq, a.body)
                continue
            assert a.body["as_of_seq"] == seq
            got = _without(a.body, [*OWN])
            assert got == _without(expected, a.body["as_of_omitted"]), (path, seq)
    # every answer came from a workspace's own model: none of the organization's was made
    assert {m.ws for m in past._models.values()} == {"net", "app"}
    assert past.built == 2, past.built
    # a cursor of another workspace's run: the organization's model places it, as live
    cursor = f"{NET}/runs?before={app_runs[-1]}"
    live = await tfe.get(cursor)
    assert live.status == 200 and live.body["items"], live.body
    placed = await _as_of(tfe, cursor, points[-1][0])
    assert _without(placed.body, [*OWN]) == _without(live.body, placed.body["as_of_omitted"])
    assert None in {m.ws for m in past._models.values()}
    # the organization's runs, from a model without its other subjects, are as they were
    assert await _count(tfe, ["rp.org.acme.>"]) > 0  # there was something to leave out
    for seq, then in points:
        for path in _ORG_PATHS:
            a = await _as_of(tfe, path, seq)
            assert a.status == 200, a.body
            got = _without(a.body, [*OWN])
            assert got == _without(then[path], a.body["as_of_omitted"]), (path, seq)


async def _count(http: Http, filters: list[str]) -> int:
    js = http.app.store.nc.jetstream()
    total = 0
    for f in filters:  # subjects_filter takes one; each of ours names disjoint subjects
        info = await js.stream_info(EVENTS, subjects_filter=f)
        total += sum((info.state.subjects or {}).values())
    return total


async def test_a_workspace_s_as_of_folds_its_own_events_not_the_organization_s(
    system: Plane, tmp_path: Path
) -> None:
    """Under a cap of just the small workspace's events (and the organization's own),
    its answers come at once; the organization's runs list, folding all, is 503. On main
    the workspace's answer was 503 too (it folded the whole organization)."""
    async with served(system, tmp_path / "rm.sqlite", "acme") as (web, client):
        http = Http(client, web[API], system.app)
        await http.workspace("acme", "big")
        await http.workspace("acme", "small")
        for _ in range(12):
            await http.run("acme", "big", "plan")
        small = (await http.run("acme", "small", "plan"))["id"]
        seq = await _last_seq(http)
        # (the subjects spelled out, not projections/asof.py's: this runs against main too)
        mine = await _count(http, ["rp.org.acme", "rp.ws.acme.small", "rp.run.acme.small.>"])
        everything = await _count(http, ["rp.org.acme", "rp.org.acme.>", "rp.ws.acme.>"])
        everything += await _count(http, ["rp.run.acme.>"])
        assert 0 < 3 * mine < everything, (mine, everything)
        web[PAST].max_events = mine  # the cap: exactly the workspace's history
        for path in (f"{ORG}/workspaces/small", f"{ORG}/runs/{small}"):
            got = await _as_of(http, path, seq)
            assert got.status == 200, got.body
        listed = await _as_of(http, f"{ORG}/workspaces/small/runs", seq)
        assert [r["id"] for r in listed.body["items"]] == [small]
        (await _as_of(http, ORG + "/runs", seq)).problem("as-of-too-costly", 503)


# A sample of the API routes that do not take as_of: reads, and commands of each method.
_READS = (
    ORG,
    ORG + "/workspaces",
    ORG + "/tokens",
    ORG + "/settings",
    ORG + "/audit",
    NET + "/run-triggers",
    NET + "/access",
)


async def test_as_of_where_it_is_not_taken_is_a_400_problem_and_changes_nothing(
    tfe: Tfe,
) -> None:
    await tfe.org("acme")
    await tfe.workspace("acme", "net")
    run_id = (await tfe.run("acme", "net"))["id"]
    seq = await _last_seq(tfe)
    for path in (*_READS, f"{ORG}/runs/{run_id}/events", f"{ORG}/runs/{run_id}/steps"):
        got = await _as_of(tfe, path, seq)
        got.problem("as-of-unsupported", 400)
        assert (
            f"GET {NET.replace('acme', '{org}').replace('net', '{ws}')}" in got.body["supported"]
        ), got.body
        assert (await tfe.get(path)).status == 200, path  # the route itself answers
    before = await tfe.get(NET)
    settings = await tfe.get(NET + "/settings")
    commands = (
        ("POST", NET + "/runs", {"type": "plan"}),
        ("POST", NET + "/lock", {"reason": "past"}),
        ("PATCH", NET + "/settings", {"heartbeat_timeout": 77}),
        ("POST", f"{ORG}/runs/{run_id}/cancel", {"reason": "past"}),
        ("DELETE", NET, None),
        ("POST", ORG + "/workspaces", {"name": "new", "repository": "https://e.com/r.git"}),
    )
    for method, path, body in commands:
        for key in ({}, {"Idempotency-Key": f"k-{method}-{len(path)}"}):
            got = await tfe.call(method, f"{path}?as_of={seq}", json=body, headers=key)
            got.problem("as-of-unsupported", 400)
    assert await _last_seq(tfe) == seq  # not one event: no command ran
    assert (await tfe.get(NET)).body == before.body
    assert (await tfe.get(NET + "/settings")).body == settings.body
    # the routes that take it still do; the TFE API's and the UI's ignore it
    assert (await _as_of(tfe, NET, seq)).status == 200
    assert (await tfe.get(f"/api/v2/ping?as_of={seq}")).status in (200, 204)
    ui = await tfe.client.get(f"/?as_of={seq}")
    assert ui.status == 200


async def test_another_organization_learns_nothing_and_folds_nothing(tfe: Tfe) -> None:
    """Org B's admin: A's run under B's own path is 404 with nothing folded (the run's
    workspace is looked up among B's subjects alone; on main B's whole organization was
    folded first); A's routes refuse as_of exactly as a made-up organization's do, so the
    400 tells nothing; a cursor naming A's run lists nothing of A's."""
    await tfe.org("acme")
    b = await tfe.org("bravo")
    await tfe.workspace("acme", "net")
    await tfe.workspace("bravo", "web")
    run_a = (await tfe.run("acme", "net"))["id"]
    run_b = (await tfe.run("bravo", "web"))["id"]
    seq = await _last_seq(tfe)
    past = tfe.client.app[PAST]
    admin_b = b["admin"]
    (await _as_of(tfe, f"{V1}/bravo/runs/{run_a}", seq, token=admin_b)).problem("not-found", 404)
    (await _as_of(tfe, f"{ORG}/runs/{run_a}", seq, token=admin_b)).problem("not-found", 404)
    assert past.built == 0 and not past._models
    for path in ("/workspaces/net/run-triggers", "/tokens", f"/runs/{run_a}/events"):
        real = await _as_of(tfe, ORG + path, seq, token=admin_b)
        made_up = await _as_of(tfe, V1 + "/nobody" + path, seq, token=admin_b)
        real.problem("as-of-unsupported", 400)
        assert (real.status, real.body) == (made_up.status, made_up.body)
    for path in (f"{V1}/bravo/workspaces/web/runs", f"{V1}/bravo/runs"):
        listed = await _as_of(tfe, f"{path}?before={run_a}", seq, token=admin_b)
        assert listed.status == 200 and listed.body["items"] == [], listed.body
        plain = await _as_of(tfe, path, seq, token=admin_b)
        assert [r["id"] for r in plain.body["items"]] == [run_b]
    assert {m.org for m in past._models.values()} == {"bravo"}
