"""Helpers for the access attack tests (tests/test_tfe_access_attacks.py,
tests/test_slack_access_attacks.py): a person of an organization with a team's grant and
a personal token. Holds no tests itself."""

from __future__ import annotations

from tests.api_support import Http

V1 = "/api/v1/orgs"


async def person(http: Http, org_name: str, email: str, team: str = "", **grant: str) -> str:
    """Invite `email` into `org_name` (in `team`, granted `grant` {target: level}, "org"
    for the organization, else e.g. "workspaces/net"); a personal token of theirs."""
    org = org_name
    a = await http.post(f"{V1}/{org}/users", json={"email": email})
    assert a.status == 201, a.body
    user_id = a.body["id"]
    if team:
        assert (await http.post(f"{V1}/{org}/teams", json={"name": team})).status in (201, 409)
        a = await http.call("PUT", f"{V1}/{org}/teams/{team}/members", json={"members": [email]})
        assert a.status == 200, a.body
        for target, level in grant.items():
            path = f"{V1}/{org}/access" if target == "org" else f"{V1}/{org}/{target}/access"
            a = await http.call("PUT", path, json={"team": team, "level": level})
            assert a.status == 200, a.body
    a = await http.post(f"{V1}/{org}/tokens", json={"kind": "user", "user_id": user_id})
    assert a.status == 201, a.body
    return str(a.body["token"])
