"""Groups through the HTTP API: admins write them, everyone in the organization reads
them, and each change is an `org.group_set` event with its actor."""

from __future__ import annotations

from events.groups import GroupSet
from tests.api_support import Http, http_fixture  # noqa: F401  # registers the `http` fixture

GROUPS = "/api/v1/orgs/acme/groups"


async def test_an_admin_creates_a_group_and_replaces_its_members(http: Http) -> None:
    tokens = await http.org("acme")
    a = await http.post(GROUPS, json={"name": "ops", "members": ["alice", "bob", "alice"]})
    assert (a.status, a.body) == (201, {"name": "ops", "members": ["alice", "bob"]})
    assert a.headers["Location"] == f"{GROUPS}/ops"
    put = await http.call(
        "PUT", f"{GROUPS}/ops/members", json={"members": ["carol"]}, token=tokens["admin"]
    )
    assert (put.status, put.body) == (200, {"name": "ops", "members": ["carol"]})
    listed = await http.get(GROUPS, token=tokens["viewer"])
    assert listed.body == {"items": [{"name": "ops", "members": ["carol"]}]}
    org = (await http.app.load_org("acme")).state
    assert org.groups == {"ops": ("carol",)}
    stored = [e.event for e in await http.app.store.read("rp.org.acme")]
    sets = [(e.actor, e.name, e.members) for e in stored if isinstance(e, GroupSet)]
    assert sets == [("admin", "ops", ["alice", "bob"]), ("admin-user", "ops", ["carol"])]


async def test_group_writes_are_refused_with_the_reason(http: Http) -> None:
    """Not an admin: 403; a group that exists: 409; a missing one: 404; a bad name: 422."""
    tokens = await http.org("acme")
    body = {"name": "ops", "members": []}
    (await http.post(GROUPS, json=body, token=tokens["approver"])).problem("forbidden", 403)
    assert (await http.post(GROUPS, json=body)).status == 201
    (await http.post(GROUPS, json=body)).problem("already-exists", 409)
    missing = await http.call("PUT", f"{GROUPS}/sre/members", json={"members": ["a"]})
    assert "group sre does not exist" in missing.problem("not-found", 404)["detail"]
    (await http.post(GROUPS, json={"name": "Ops"})).problem("invalid-id", 422)
    (await http.post(GROUPS, json={"name": "x", "members": [""]})).problem("invalid-body", 400)
