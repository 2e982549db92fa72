"""VCS connections over HTTP: created, listed, changed, deleted by an organization's
admin; secrets write-only and sealed; api_url checked; another organization's connection
not found, not changed; the webhook finds a connection made a moment ago."""

from __future__ import annotations

from typing import Any

import pytest

from events import vcs
from events.codec import encode
from infra.kv import SECRETS_BUCKET
from infra.streams import EVENTS
from services.processes.vcs import connections as conns
from services.surfaces.api.secrets import SECRETS
from tests.api_support import Http
from tests.vcs_support import SECRET, V1, connection, deliver, fixture, vhttp_fixture

_ = vhttp_fixture  # the `vhttp` fixture


@pytest.fixture
async def orgs(vhttp: Http) -> dict[str, Any]:
    return {"acme": await vhttp.org("acme"), "beta": await vhttp.org("beta")}


async def test_a_connection_is_created_listed_changed_and_deleted(
    vhttp: Http, orgs: dict[str, Any]
) -> None:
    made = await connection(vhttp, token="ghp_secret_token")
    assert made["provider"] == "github" and made["api_url"] == "https://api.github.com"
    assert made["has_secret"] is True and made["has_token"] is True
    assert "webhook_secret" not in made and "token" not in made
    assert made["webhook_path"] == f"/api/v1/vcs/{made['id']}/webhook"
    one = f"{V1}/acme/vcs-connections/{made['id']}"
    assert (await vhttp.get(one)).body == made
    listed = (await vhttp.get(f"{V1}/acme/vcs-connections", token=orgs["acme"]["viewer"])).body
    assert [c["id"] for c in listed["items"]] == [made["id"]]
    a = await vhttp.call(
        "PATCH", one, json={"api_url": "https://ghe.acme.test/api/v3", "token": ""}
    )
    assert a.status == 200, a.body
    assert (a.body["api_url"], a.body["has_token"]) == ("https://ghe.acme.test/api/v3", False)
    assert (await vhttp.call("DELETE", one)).status == 204
    (await vhttp.get(one)).problem("not-found", 404)
    assert (await vhttp.get(f"{V1}/acme/vcs-connections")).body["items"] == []


async def test_secrets_are_sealed_never_in_an_event_and_the_token_reads_back(
    vhttp: Http, orgs: dict[str, Any]
) -> None:
    made = await connection(vhttp, token="ghp_secret_token")
    found = await vhttp.app.store.read(vcs.connection_subject("acme", made["id"]))
    raw = b"".join(encode(e.event) for e in found)
    assert SECRET.encode() not in raw and b"ghp_secret_token" not in raw
    kv = await vhttp.app.store.nc.jetstream().key_value(SECRETS_BUCKET)
    sealed = await kv.get(conns.sealed_key("acme", made["id"], conns.SECRET))
    assert sealed.value and SECRET.encode() not in sealed.value
    store = vhttp.client.app[SECRETS]
    assert await conns.connection_token(store, "acme", made["id"]) == "ghp_secret_token"
    loaded = await conns.load_connection(vhttp.app, "acme", made["id"])
    assert loaded is not None and loaded.provider == "github" and loaded.org == "acme"
    assert await conns.load_connection(vhttp.app, "beta", made["id"]) is None


@pytest.mark.parametrize(
    "body",
    [
        {"provider": "bitbucket"},
        {"api_url": "https://user:pw@ghe.acme.test/api/v3"},
        {"api_url": "file:///etc/passwd"},
        {"api_url": "https://ghe.acme.test/api?token=x"},
        {"name": "two\nlines"},
    ],
)
async def test_a_bad_connection_is_refused_and_nothing_is_written(
    vhttp: Http, orgs: dict[str, Any], body: dict[str, Any]
) -> None:
    fields = {"name": "gh", "provider": "github", "webhook_secret": SECRET, **body}
    before = (await vhttp.app.store.nc.jetstream().stream_info(EVENTS)).state.last_seq
    (await vhttp.post(f"{V1}/acme/vcs-connections", json=fields)).problem("invalid-command", 422)
    after = (await vhttp.app.store.nc.jetstream().stream_info(EVENTS)).state.last_seq
    assert after == before


async def test_only_an_admin_manages_connections(vhttp: Http, orgs: dict[str, Any]) -> None:
    fields = {"name": "gh", "provider": "github", "webhook_secret": SECRET}
    for role in ("viewer", "operator", "approver"):
        a = await vhttp.post(f"{V1}/acme/vcs-connections", json=fields, token=orgs["acme"][role])
        a.problem("forbidden", 403)
    made = await connection(vhttp)
    one = f"{V1}/acme/vcs-connections/{made['id']}"
    a = await vhttp.call("PATCH", one, json={"name": "x"}, token=orgs["acme"]["operator"])
    a.problem("forbidden", 403)


async def test_attack_org_a_cannot_see_or_alter_org_bs_connection(
    vhttp: Http, orgs: dict[str, Any]
) -> None:
    theirs = await connection(vhttp, org="beta")
    a_admin = orgs["acme"]["admin"]
    # through its own organization's path: not found, whatever it tries
    mine = f"{V1}/acme/vcs-connections/{theirs['id']}"
    (await vhttp.get(mine, token=a_admin)).problem("not-found", 404)
    (await vhttp.call("PATCH", mine, json={"webhook_secret": "mine"}, token=a_admin)).problem(
        "not-found", 404
    )
    (await vhttp.call("DELETE", mine, token=a_admin)).problem("not-found", 404)
    # through the other organization's path: not found either (its token has no standing)
    there = f"{V1}/beta/vcs-connections/{theirs['id']}"
    (await vhttp.get(there, token=a_admin)).problem("not-found", 404)
    (await vhttp.call("PATCH", there, json={"webhook_secret": "x"}, token=a_admin)).problem(
        "not-found", 404
    )
    assert (await vhttp.get(f"{V1}/acme/vcs-connections", token=a_admin)).body["items"] == []
    # and beta's secret is still beta's: a delivery signed with it is accepted
    a = await deliver(vhttp, theirs["id"], "ping", fixture("github/ping.json"))
    assert a.status == 200, a.body


async def test_a_deleted_connection_takes_no_more_deliveries(
    vhttp: Http, orgs: dict[str, Any]
) -> None:
    made = await connection(vhttp)
    assert (await deliver(vhttp, made["id"], "ping", fixture("github/ping.json"))).status == 200
    assert (await vhttp.call("DELETE", f"{V1}/acme/vcs-connections/{made['id']}")).status == 204
    a = await deliver(vhttp, made["id"], "ping", fixture("github/ping.json"))
    a.problem("unauthorized", 401)
