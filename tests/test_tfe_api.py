"""The TFE API's contract: each route as go-tfe (v0.15.0, Terraform 1.0.3's) calls it,
answered in the shapes its structs read. docs/tfe-api.md lists them."""

from __future__ import annotations

import json

from yarl import URL

from tests.tfe_support import JSONAPI, Tfe, a_state, tfe_fixture

__all__ = ["tfe_fixture"]


async def test_discovery_names_the_api_for_every_cli_and_needs_no_token(tfe: Tfe) -> None:
    a = await tfe.get("/.well-known/terraform.json", token=None)
    assert a.status == 200
    assert a.body == {
        "tfe.v2": "/api/v2/",
        "tfe.v2.1": "/api/v2/",
        "tfe.v2.2": "/api/v2/",
        "state.v2": "/api/v2/",
        "login.v1": {
            "client": "terraform-cli",
            "grant_types": ["authz_code"],
            "authz": "/app/oauth/authorize",
            "token": "/app/oauth/token",
            "ports": [10000, 10010],
        },
    }


async def test_ping_answers_the_api_version_the_cli_requires(tfe: Tfe) -> None:
    a = await tfe.get("/api/v2/ping", token=None)
    assert a.status == 204
    assert tuple(map(int, a.headers["TFP-API-Version"].split("."))) >= (2, 5)
    assert a.headers["TFP-AppName"] == "runplane"


async def test_account_details_name_the_tokens_user(tfe: Tfe) -> None:
    tokens = await tfe.org("acme")
    a = await tfe.tfe("GET", "/api/v2/account/details", token=tokens["operator"])
    assert a.status == 200 and a.content_type == JSONAPI
    assert a.body["data"]["type"] == "users"
    assert a.body["data"]["attributes"]["username"] == "operator-user"
    bad = await tfe.tfe("GET", "/api/v2/account/details", token="nope")
    assert bad.status == 401 and bad.content_type == JSONAPI
    assert bad.body["errors"][0]["status"] == "401"


async def test_the_organization_and_its_entitlements_allow_operations(tfe: Tfe) -> None:
    await tfe.org("acme")
    org = await tfe.tfe("GET", "/api/v2/organizations/acme")
    assert org.status == 200
    assert (org.body["data"]["type"], org.body["data"]["id"]) == ("organizations", "acme")
    ent = await tfe.tfe("GET", "/api/v2/organizations/acme/entitlement-set")
    assert ent.status == 200 and ent.body["data"]["type"] == "entitlement-sets"
    assert ent.body["data"]["attributes"]["operations"] is True
    assert ent.body["data"]["attributes"]["state-storage"] is True
    missing = await tfe.tfe("GET", "/api/v2/organizations/nope/entitlement-set")
    assert missing.status == 404 and missing.body["errors"][0]["status"] == "404"


async def test_a_workspace_the_cli_creates_is_read_by_name_and_id_and_listed(tfe: Tfe) -> None:
    await tfe.org("acme")
    assert (await tfe.tfe("GET", "/api/v2/organizations/acme/workspaces/net")).status == 404
    ws_id = await tfe.cli_workspace("acme", "net")
    by_name = await tfe.tfe("GET", "/api/v2/organizations/acme/workspaces/net?include=foo,bar")
    assert by_name.status == 200, by_name.body
    data = by_name.body["data"]
    assert (data["type"], data["id"]) == ("workspaces", ws_id)
    attrs = data["attributes"]
    assert attrs["name"] == "net" and attrs["locked"] is False
    assert attrs["terraform-version"] == "latest"
    assert attrs["operations"] is True and attrs["execution-mode"] == "remote"
    assert attrs["permissions"]["can-queue-run"] is True
    assert attrs["created-at"].endswith("Z") and "." not in attrs["created-at"]
    assert data["relationships"]["organization"]["data"] == {"type": "organizations", "id": "acme"}
    by_id = await tfe.tfe("GET", f"/api/v2/workspaces/{ws_id}")
    assert by_id.body["data"] == data
    await tfe.cli_workspace("acme", "net-two")
    await tfe.cli_workspace("acme", "other")
    listed = await tfe.tfe("GET", "/api/v2/organizations/acme/workspaces?search%5Bname%5D=net")
    assert [w["attributes"]["name"] for w in listed.body["data"]] == ["net", "net-two"]
    page = listed.body["meta"]["pagination"]
    assert (page["current-page"], page["total-pages"], page["total-count"]) == (1, 1, 2)
    paged = await tfe.tfe(
        "GET", "/api/v2/organizations/acme/workspaces?page%5Bsize%5D=1&page%5Bnumber%5D=2"
    )
    assert [w["attributes"]["name"] for w in paged.body["data"]] == ["net-two"]
    assert paged.body["meta"]["pagination"]["next-page"] == 3
    again = await tfe.tfe(
        "POST",
        "/api/v2/organizations/acme/workspaces",
        json={"data": {"type": "workspaces", "attributes": {"name": "net"}}},
    )
    assert again.status == 409 and again.body["errors"][0]["detail"]
    upper = await tfe.tfe(
        "POST",
        "/api/v2/organizations/acme/workspaces",
        json={"data": {"type": "workspaces", "attributes": {"name": "Net_1"}}},
    )
    assert upper.status == 422 and "lowercase" in upper.body["errors"][0]["detail"]


async def test_a_json_body_past_one_mib_is_refused_before_it_is_held(tfe: Tfe) -> None:
    """Only states are large, and they are streamed to a file: every other body the TFE
    slice reads (a workspace, a lock reason) stops at 1 MiB with 413 (it was 96 MiB,
    held whole, for any token's request)."""
    await tfe.org("acme")
    ws_id = await tfe.cli_workspace("acme", "net")
    reason = "x" * (1024 * 1024)
    big = {"data": {"type": "workspaces", "attributes": {"name": "big", "pad": reason}}}
    made = await tfe.tfe("POST", "/api/v2/organizations/acme/workspaces", json=big)
    assert made.status == 413, made.body
    assert made.body["errors"][0]["title"] == "body too large"
    locked = await tfe.tfe(
        "POST", f"/api/v2/workspaces/{ws_id}/actions/lock", json={"reason": reason}
    )
    assert locked.status == 413, locked.body
    assert (await tfe.get("/api/v1/orgs/acme/workspaces/net")).body["lock"] is None
    assert (await tfe.get("/api/v1/orgs/acme/workspaces/big")).status == 404


async def test_lock_unlock_and_force_unlock_are_runplanes_workspace_lock(tfe: Tfe) -> None:
    tokens = await tfe.org("acme")
    ws_id = await tfe.cli_workspace("acme", "net")
    op = tokens["operator"]
    assert (await tfe.lock(ws_id, token=op)).status == 200
    v1 = await tfe.get("/api/v1/orgs/acme/workspaces/net")
    assert v1.body["lock"]["holder"] == "operator-user"
    again = await tfe.lock(ws_id, token=tokens["approver"])
    assert again.status == 409  # go-tfe: ErrWorkspaceLocked
    other = await tfe.tfe(
        "POST", f"/api/v2/workspaces/{ws_id}/actions/unlock", token=tokens["approver"]
    )
    assert other.status == 403
    forced_by_op = await tfe.tfe(
        "POST", f"/api/v2/workspaces/{ws_id}/actions/force-unlock", token=op
    )
    assert forced_by_op.status == 403
    ok = await tfe.tfe("POST", f"/api/v2/workspaces/{ws_id}/actions/unlock", token=op)
    assert ok.status == 200 and ok.body["data"]["attributes"]["locked"] is False
    not_locked = await tfe.tfe("POST", f"/api/v2/workspaces/{ws_id}/actions/unlock", token=op)
    assert not_locked.status == 409
    assert (await tfe.lock(ws_id, token=op)).status == 200
    forced = await tfe.tfe(
        "POST", f"/api/v2/workspaces/{ws_id}/actions/force-unlock", token=tokens["admin"]
    )
    assert forced.status == 200 and forced.body["data"]["attributes"]["locked"] is False


async def test_vars_list_plain_values_and_secret_names_only(tfe: Tfe) -> None:
    await tfe.org("acme")
    await tfe.workspace(
        "acme", "net", variables={"region": "eu"}, secret_variables={"password": "hunter2"}
    )
    a = await tfe.tfe("GET", "/api/v2/workspaces/ws-acme.net/vars")
    assert a.status == 200
    got = {v["attributes"]["key"]: v["attributes"] for v in a.body["data"]}
    assert got["region"]["value"] == "eu" and got["region"]["sensitive"] is False
    assert got["password"]["value"] is None and got["password"]["sensitive"] is True
    assert "hunter2" not in str(a.body)


async def test_state_pushed_is_current_downloaded_and_continued(tfe: Tfe) -> None:
    await tfe.org("acme")
    ws_id = await tfe.cli_workspace("acme", "net")
    none = await tfe.tfe("GET", f"/api/v2/workspaces/{ws_id}/current-state-version")
    assert none.status == 404
    first = a_state(1, outputs={"greeting": "hello"})
    unlocked = await tfe.push(ws_id, first)
    assert unlocked.status == 409  # the CLI locks first; a writer that did not is refused
    assert (await tfe.lock(ws_id)).status == 200
    pushed = await tfe.push(ws_id, first)
    assert pushed.status == 201, pushed.body
    sv = pushed.body["data"]
    assert sv["type"] == "state-versions" and sv["attributes"]["serial"] == 1
    current = await tfe.tfe("GET", f"/api/v2/workspaces/{ws_id}/current-state-version")
    assert current.status == 200 and current.body["data"]["id"] == sv["id"]
    url = current.body["data"]["attributes"]["hosted-state-download-url"]
    assert url.startswith("http://") and "/api/v2/capabilities/state/" in url
    status, raw = await tfe.raw(URL(url).path)  # no Authorization: the URL is enough
    assert status == 200
    assert json.loads(raw) == first
    read = await tfe.tfe("GET", f"/api/v2/state-versions/{sv['id']}")
    assert read.status == 200 and read.body["data"]["attributes"]["serial"] == 1
    # stale serial, other lineage: refused; the same state again: the same version
    stale = await tfe.push(ws_id, {**first, "outputs": {}})
    assert stale.status == 409 and "serial" in stale.body["errors"][0]["detail"]
    other = await tfe.push(ws_id, a_state(5))
    assert other.status == 409 and "lineage" in other.body["errors"][0]["detail"]
    same = await tfe.push(ws_id, first)
    assert same.status == 201 and same.body["data"]["id"] == sv["id"]
    second = a_state(2, lineage=first["lineage"])
    assert (await tfe.push(ws_id, second)).status == 201
    forced = await tfe.push(ws_id, a_state(1), force=True)
    assert forced.status == 201


async def test_a_push_that_lies_about_its_state_is_refused(tfe: Tfe) -> None:
    await tfe.org("acme")
    ws_id = await tfe.cli_workspace("acme", "net")
    await tfe.lock(ws_id)
    st = a_state(3)
    bad_md5 = await tfe.push(ws_id, st, md5="0" * 32)
    assert bad_md5.status == 422 and "md5" in bad_md5.body["errors"][0]["detail"]
    bad_serial = await tfe.push(ws_id, st, serial=9)
    assert bad_serial.status == 422
    no_state = await tfe.tfe(
        "POST",
        f"/api/v2/workspaces/{ws_id}/state-versions",
        json={"data": {"type": "state-versions", "attributes": {"serial": 1, "md5": "x"}}},
    )
    assert no_state.status == 422 and "inline" in no_state.body["errors"][0]["detail"]
    not_json = await tfe.call("POST", f"/api/v2/workspaces/{ws_id}/state-versions", data=b"{nope")
    assert not_json.status == 422 and not_json.content_type == JSONAPI


async def test_current_outputs_name_each_output_and_show_no_sensitive_value(tfe: Tfe) -> None:
    await tfe.org("acme")
    ws_id = await tfe.cli_workspace("acme", "net")
    none = await tfe.tfe("GET", f"/api/v2/workspaces/{ws_id}/current-state-version-outputs")
    assert none.status == 404
    await tfe.lock(ws_id)
    st = a_state(1, outputs={"plain": "shown"})
    st["outputs"]["secret"] = {"value": "hunter2", "type": "string", "sensitive": True}
    assert (await tfe.push(ws_id, st)).status == 201
    a = await tfe.tfe("GET", f"/api/v2/workspaces/{ws_id}/current-state-version-outputs")
    assert a.status == 200
    got = {o["attributes"]["name"]: o["attributes"] for o in a.body["data"]}
    assert {o["type"] for o in a.body["data"]} == {"state-version-outputs"}
    assert got["plain"]["value"] == "shown" and got["plain"]["sensitive"] is False
    assert got["secret"]["sensitive"] is True and got["secret"]["value"] is None
    # the state's own types: a Terraform >= 1.3 reads the values from here, not the state
    assert all(o["detailed-type"] == "string" for o in got.values())
    assert "hunter2" not in json.dumps(a.body)


async def test_updating_a_workspace_is_refused_in_json_api(tfe: Tfe) -> None:
    await tfe.org("acme")
    ws_id = await tfe.cli_workspace("acme", "net")
    a = await tfe.tfe(
        "PATCH",
        f"/api/v2/workspaces/{ws_id}",
        json={"data": {"type": "workspaces", "attributes": {"terraform-version": "1.11.4"}}},
    )
    assert a.status == 422 and a.content_type == JSONAPI
    assert "chooses the Terraform version" in a.body["errors"][0]["detail"]
