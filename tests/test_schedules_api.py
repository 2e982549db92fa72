"""Schedules over HTTP: create, list, read, change, delete with their next fire times (UTC
and local); bad cron, time zone, run type, template -> 422 invalid-schedule naming the
field; the cap per workspace; operator writes, viewer reads; another organization can
neither read, change, delete nor create one (attack)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from events import schedule as sc
from services.processes.schedules.loop import ScheduleLoop, run_id_for
from tests.api_support import Http, http_fixture  # noqa: F401  # the `http` fixture

V1 = "/api/v1/orgs"
NET = f"{V1}/acme/workspaces/net/schedules"


@pytest.fixture
async def orgs(http: Http) -> dict[str, Any]:
    acme = await http.org("acme")
    beta = await http.org("beta")
    await http.workspace("acme", "net")
    await http.workspace("beta", "net")
    await http.workspace("beta", "db")
    return {"acme": acme, "beta": beta}


async def _schedule(http: Http, path: str = NET, **body: Any) -> dict[str, Any]:
    a = await http.post(path, json={"cron": "0 9 * * 1-5", "run_type": "drift", **body})
    assert a.status == 201, a.body
    return a.body  # type: ignore[no-any-return]  # JSON object


async def test_a_schedule_is_created_listed_changed_and_deleted_with_its_next_fires(
    http: Http, orgs: dict[str, Any]
) -> None:
    made = await _schedule(http, timezone="Europe/Paris")
    assert (made["cron"], made["timezone"], made["run_type"], made["enabled"], made["missed"]) == (
        "0 9 * * 1-5",
        "Europe/Paris",
        "drift",
        True,
        "run_once",
    )
    assert len(made["next_fires"]) == 5
    for fire in made["next_fires"]:
        local = datetime.fromisoformat(fire["local"])
        assert (local.hour, local.minute) == (9, 0) and local.isoweekday() <= 5
        assert datetime.fromisoformat(fire["at"]) == local.astimezone(UTC)
    one = f"{NET}/{made['id']}"
    assert (await http.get(one)).body == made
    assert [s["id"] for s in (await http.get(NET)).body["items"]] == [made["id"]]
    a = await http.call("PATCH", one, json={"enabled": False})
    assert a.status == 200, a.body
    assert a.body["enabled"] is False and a.body["next_fires"] == []
    a = await http.call("PATCH", one, json={"enabled": True, "cron": "*/15 * * * *"})
    gaps = {
        (datetime.fromisoformat(b["at"]) - datetime.fromisoformat(x["at"])).total_seconds()
        for x, b in zip(a.body["next_fires"], a.body["next_fires"][1:], strict=False)
    }
    assert gaps == {900.0}
    assert (await http.call("DELETE", one)).status == 204
    (await http.get(one)).problem("not-found", 404)
    assert (await http.get(NET)).body["items"] == []


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"cron": "* * * * * *"}, "cron"),
        ({"cron": "@reboot"}, "cron"),
        ({"cron": "x" * 100_000}, "cron"),
        ({"cron": "٣ * * * *"}, "cron"),
        ({"cron": "0 0 30 2 *"}, "cron"),
        ({"timezone": "Mars/Olympus"}, "timezone"),
        ({"timezone": "../../../etc/passwd"}, "timezone"),
        ({"run_type": "import"}, "run_type"),
        ({"missed": "burst"}, "missed"),
        ({"template": "no-such-template"}, "template"),
    ],
)
async def test_a_bad_schedule_is_422_invalid_schedule_naming_the_field(
    http: Http, orgs: dict[str, Any], body: dict[str, Any], field: str
) -> None:
    fields = {"cron": "0 9 * * *", "run_type": "plan", **body}
    problem = (await http.post(NET, json=fields)).problem("invalid-schedule", 422)
    assert problem["field"] == field
    assert len(problem["detail"]) < 300  # the input is not echoed back
    assert (await http.get(NET)).body["items"] == []


async def test_a_patch_to_a_bad_cron_is_refused_and_the_schedule_kept(
    http: Http, orgs: dict[str, Any]
) -> None:
    made = await _schedule(http)
    one = f"{NET}/{made['id']}"
    (await http.call("PATCH", one, json={"cron": "* * * * * *"})).problem("invalid-schedule", 422)
    assert (await http.get(one)).body["cron"] == "0 9 * * 1-5"


async def test_a_workspace_has_at_most_max_schedules(http: Http, orgs: dict[str, Any]) -> None:
    for _ in range(sc.MAX_SCHEDULES):
        await _schedule(http)
    problem = (await http.post(NET, json={"cron": "0 9 * * *", "run_type": "plan"})).problem(
        "schedule-limit-exceeded", 422
    )
    assert problem["limit"] == sc.MAX_SCHEDULES
    # another workspace has its own
    await _schedule(http, path=f"{V1}/beta/workspaces/db/schedules")


async def test_operator_writes_viewer_reads(http: Http, orgs: dict[str, Any]) -> None:
    t = orgs["acme"]
    made = await _schedule(http)
    one = f"{NET}/{made['id']}"
    body = {"cron": "0 9 * * *", "run_type": "plan"}
    viewer = t["viewer"]
    (await http.post(NET, json=body, token=viewer)).problem("forbidden", 403)
    (await http.call("PATCH", one, json={"enabled": False}, token=viewer)).problem("forbidden", 403)
    (await http.call("DELETE", one, token=viewer)).problem("forbidden", 403)
    assert (await http.get(one, token=viewer)).status == 200
    assert (await http.get(NET, token=viewer)).status == 200
    op = t["operator"]
    a = await http.post(NET, json=body, token=op)
    assert a.status == 201 and a.body["created_by"] == "operator-user"
    assert (await http.call("PATCH", one, json={"enabled": False}, token=op)).status == 200
    assert (await http.call("DELETE", one, token=op)).status == 204


async def test_another_organization_cannot_read_change_delete_or_create_a_schedule(
    http: Http, orgs: dict[str, Any]
) -> None:
    """Attack: beta's admin knows acme's schedule id and workspace name; through acme's
    path, through its own workspace of the same name, and by creating through acme's
    path, it reaches nothing; acme's schedule is unchanged."""
    made = await _schedule(http)
    beta = orgs["beta"]["admin"]
    for where in ("acme/workspaces/net", "beta/workspaces/net", "beta/workspaces/db"):
        one = f"{V1}/{where}/schedules/{made['id']}"
        for method, body in (("GET", None), ("PATCH", {"enabled": False}), ("DELETE", None)):
            kw: dict[str, Any] = {"json": body} if body is not None else {}
            a = await http.call(method, one, token=beta, **kw)
            assert a.status in (403, 404), (where, method, a.status, a.body)
    a = await http.post(NET, json={"cron": "* * * * *", "run_type": "destroy"}, token=beta)
    assert a.status in (403, 404), a.body
    assert (await http.get(f"{V1}/acme/workspaces/net/schedules", token=beta)).status in (403, 404)
    assert (await http.get(f"{V1}/beta/workspaces/net/schedules", token=beta)).body["items"] == []
    assert (await http.get(NET)).body["items"] == [await _get(http, made["id"])]
    assert (await _get(http, made["id"]))["enabled"] is True


async def _get(http: Http, sid: str) -> dict[str, Any]:
    return (await http.get(f"{NET}/{sid}")).body  # type: ignore[no-any-return]  # JSON


async def test_a_schedule_of_a_missing_workspace_or_a_bad_id_is_not_found_or_invalid(
    http: Http, orgs: dict[str, Any]
) -> None:
    (
        await http.post(
            f"{V1}/acme/workspaces/nope/schedules", json={"cron": "* * * * *", "run_type": "plan"}
        )
    ).problem("not-found", 404)
    (await http.get(f"{NET}/NOT.A.TOKEN")).problem("invalid-id", 422)
    (await http.post(NET, json={"cron": "* * * * *", "run_type": "plan", "extra": 1})).problem(
        "invalid-body", 400
    )


async def test_a_schedule_cannot_be_put_on_another_organizations_workspace(
    http: Http, orgs: dict[str, Any]
) -> None:
    """Attack: acme's operator names beta's workspace `db` through acme's path (acme has
    no `db`), or beta and `db` in the body; beta's path refuses acme's token. Nothing
    lands on beta's workspace."""
    op = orgs["acme"]["operator"]
    body = {"cron": "* * * * *", "run_type": "destroy"}
    (await http.post(f"{V1}/acme/workspaces/db/schedules", json=body, token=op)).problem(
        "not-found", 404
    )
    a = await http.post(NET, json={**body, "org": "beta", "workspace": "db"}, token=op)
    a.problem("invalid-body", 400)
    a = await http.post(f"{V1}/beta/workspaces/db/schedules", json=body, token=op)
    assert a.status in (403, 404), a.body
    assert (await http.get(f"{V1}/beta/workspaces/db/schedules")).body["items"] == []
    assert (await http.get(NET)).body["items"] == []


async def test_the_fires_list_shows_each_fire_time_fired_or_skipped_newest_first(
    http: Http, orgs: dict[str, Any]
) -> None:
    """Two fire times: the first makes a run, the second finds it still waiting and is
    skipped; both are listed with their outcome, the other organization sees neither."""
    made = await _schedule(http, cron="*/5 * * * *", run_type="plan")
    one = f"{NET}/{made['id']}"
    first, second = (datetime.fromisoformat(f["at"]) for f in made["next_fires"][:2])
    loop = ScheduleLoop(http.app)
    assert len(await loop.tick(first + timedelta(seconds=1))) == 1
    assert len(await loop.tick(second + timedelta(seconds=1))) == 1
    seq = str(await http.app.store.last_seq())
    a = await http.get(f"{one}/fires", headers={"RP-Min-Seq": seq})
    assert a.status == 200, a.body
    newest, oldest = a.body["items"]
    assert (oldest["outcome"], oldest["run_id"], oldest["reason"]) == (
        "fired",
        run_id_for(made["id"], first),
        None,
    )
    assert (newest["outcome"], newest["run_id"], newest["reason"], newest["waiting_run"]) == (
        "skipped",
        None,
        "waiting",
        oldest["run_id"],
    )
    assert datetime.fromisoformat(newest["fire_time"]) == second
    shown = (await http.get(one)).body
    assert datetime.fromisoformat(shown["last_fire_time"]) == second
    assert shown["last_run"] == oldest["run_id"]
    beta = orgs["beta"]["admin"]
    for where in ("acme/workspaces/net", "beta/workspaces/net"):
        a = await http.get(f"{V1}/{where}/schedules/{made['id']}/fires", token=beta)
        assert a.status in (403, 404), a.body
