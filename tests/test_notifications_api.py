"""Notification configurations over HTTP: create, list, change, delete at organization
and workspace level; the token never answered nor stored in clear; roles; another
organization's configurations not found; destinations refused by the address guard;
`verify` against a real receiver that checks both signatures; the attempts listed."""

from __future__ import annotations

from typing import Any

import pytest

from events import notification as nt
from infra.streams import EVENTS
from tests.api_support import Http
from tests.helpers import eventually
from tests.notify_support import Receiver, nhttp_fixture  # noqa: F401  # the `nhttp` fixture

V1 = "/api/v1/orgs"
TOKEN = "tok-0f1e2d3c4b5a69788796a5b4c3d2e1f0"


async def _config(http: Http, org: str = "acme", ws: str = "", **body: Any) -> dict[str, Any]:
    path = f"{V1}/{org}/workspaces/{ws}/notifications" if ws else f"{V1}/{org}/notifications"
    fields = {"name": "ops", "url": "https://93.184.215.14/x", "triggers": ["run:errored"]}
    a = await http.post(path, json={**fields, **body})
    assert a.status == 201, a.body
    return a.body  # type: ignore[no-any-return]  # JSON object


@pytest.fixture
async def orgs(nhttp: Http) -> dict[str, Any]:
    acme = await nhttp.org("acme")
    beta = await nhttp.org("beta")
    await nhttp.workspace("acme", "net")
    await nhttp.workspace("acme", "db")
    return {"acme": acme, "beta": beta}


async def test_a_configuration_is_created_listed_changed_and_deleted(
    nhttp: Http, orgs: dict[str, Any]
) -> None:
    made = await _config(nhttp, destination="slack", token=TOKEN)
    assert made["has_token"] is True and "token" not in made
    assert made["destination"] == "slack" and made["triggers"] == ["run:errored"]
    one = f"{V1}/acme/notifications/{made['id']}"
    assert (await nhttp.get(one)).body == made
    assert [c["id"] for c in (await nhttp.get(f"{V1}/acme/notifications")).body["items"]] == [
        made["id"]
    ]
    a = await nhttp.call("PATCH", one, json={"enabled": False, "triggers": ["run:completed"]})
    assert a.status == 200, a.body
    assert (a.body["enabled"], a.body["triggers"], a.body["name"]) == (
        False,
        ["run:completed"],
        "ops",
    )
    a = await nhttp.call("PATCH", one, json={"token": ""})
    assert a.body["has_token"] is False
    assert (await nhttp.call("DELETE", one)).status == 204
    (await nhttp.get(one)).problem("not-found", 404)
    assert (await nhttp.get(f"{V1}/acme/notifications")).body["items"] == []


async def test_workspace_configurations_are_their_own_and_org_ones_apart(
    nhttp: Http, orgs: dict[str, Any]
) -> None:
    org_level = await _config(nhttp)
    ws_level = await _config(nhttp, ws="net", name="net-only")
    assert ws_level["workspace"] == "net" and org_level["workspace"] is None
    ids = lambda a: [c["id"] for c in a.body["items"]]  # noqa: E731 - a short probe
    assert ids(await nhttp.get(f"{V1}/acme/notifications")) == [org_level["id"]]
    assert ids(await nhttp.get(f"{V1}/acme/workspaces/net/notifications")) == [ws_level["id"]]
    assert ids(await nhttp.get(f"{V1}/acme/workspaces/db/notifications")) == []
    # through another workspace's path it is not found
    (await nhttp.get(f"{V1}/acme/workspaces/db/notifications/{ws_level['id']}")).problem(
        "not-found", 404
    )
    (await nhttp.get(f"{V1}/acme/workspaces/nope/notifications")).problem("not-found", 404)


async def test_bodies_are_checked(nhttp: Http, orgs: dict[str, Any]) -> None:
    path = f"{V1}/acme/notifications"
    base = {"name": "x", "url": "https://93.184.215.14/x"}
    bad = [
        ({**base, "triggers": ["run:exploded"]}, "invalid-command", 422),
        ({**base, "destination": "pager"}, "invalid-command", 422),
        ({**base, "url": "ftp://hooks.example.com/x"}, "invalid-command", 422),
        ({**base, "surprise": 1}, "invalid-body", 400),
        ({"url": "https://93.184.215.14/x"}, "invalid-body", 400),
    ]
    for body, slug, status in bad:
        (await nhttp.post(path, json=body)).problem(slug, status)
    assert (await nhttp.get(path)).body["items"] == []


async def test_the_token_is_never_answered_nor_stored_in_clear(
    nhttp: Http, orgs: dict[str, Any]
) -> None:
    """Attack: every answer about the configuration, and every message of the event
    stream, is searched for the token."""
    made = await _config(nhttp, token=TOKEN)
    one = f"{V1}/acme/notifications/{made['id']}"
    await nhttp.call("PATCH", one, json={"name": "renamed", "token": TOKEN + "-2"})
    answers = [
        await nhttp.get(one),
        await nhttp.get(f"{V1}/acme/notifications"),
        await nhttp.get(f"{one}/deliveries"),
    ]
    for a in answers:
        assert a.status == 200
        assert TOKEN not in str(a.body)
    js = nhttp.app.store.nc.jetstream()
    info = await js.stream_info(EVENTS)
    for seq in range(1, info.state.last_seq + 1):
        msg = await js.get_msg(EVENTS, seq)
        assert TOKEN.encode() not in (msg.data or b""), msg.subject


async def test_roles_viewer_reads_admin_writes(nhttp: Http, orgs: dict[str, Any]) -> None:
    made = await _config(nhttp)
    one = f"{V1}/acme/notifications/{made['id']}"
    t = orgs["acme"]
    for role in ("viewer", "operator", "approver"):
        tok = t[role]
        body = {"name": "x", "url": "https://93.184.215.14/y"}
        (await nhttp.post(f"{V1}/acme/notifications", json=body, token=tok)).problem(
            "forbidden", 403
        )
        (await nhttp.call("PATCH", one, json={"enabled": False}, token=tok)).problem(
            "forbidden", 403
        )
        (await nhttp.call("DELETE", one, token=tok)).problem("forbidden", 403)
        (await nhttp.post(f"{one}/verify", token=tok)).problem("forbidden", 403)
        assert (await nhttp.get(one, token=tok)).status == 200
        assert (await nhttp.get(f"{one}/deliveries", token=tok)).status == 200


async def test_another_orgs_configuration_is_not_found_even_by_its_id(
    nhttp: Http, orgs: dict[str, Any]
) -> None:
    """Attack: org beta's admin knows the id of acme's configuration; through acme's
    paths and through its own it can neither read, change, delete, verify, nor list
    its deliveries."""
    async with Receiver() as r:
        made = await _config(nhttp, url=r.url)
        ws_made = await _config(nhttp, ws="net", url=r.url)
        beta = orgs["beta"]["admin"]
        await nhttp.workspace("beta", "net")
        for cid, scopes in (
            (made["id"], ("acme", "beta")),
            (ws_made["id"], ("acme/workspaces/net", "beta/workspaces/net", "beta")),
        ):
            for where in scopes:
                one = f"{V1}/{where}/notifications/{cid}"
                calls = [
                    ("GET", one, None),
                    ("PATCH", one, {"url": "https://93.184.215.15/"}),
                    ("DELETE", one, None),
                    ("POST", f"{one}/verify", None),
                    ("GET", f"{one}/deliveries", None),
                ]
                for method, path, body in calls:
                    kw: dict[str, Any] = {"json": body} if body is not None else {}
                    a = await nhttp.call(method, path, token=beta, **kw)
                    a.problem("not-found", 404)
        assert r.got == []  # no verify went out
        a = await nhttp.get(f"{V1}/acme/notifications/{made['id']}")
        assert a.body["url"] == r.url  # unchanged, still there


REFUSED = [
    "http://127.0.0.1:8080/hook",
    "http://127.1/hook",
    "http://10.1.2.3/hook",
    "http://192.168.0.10/hook",
    "http://172.16.5.4/hook",
    "http://169.254.169.254/latest/meta-data/",
    "http://[::1]:8080/hook",
    "http://[::ffff:127.0.0.1]/hook",
    "http://[fd00::1]/hook",
    "http://0.0.0.0/hook",
    "http://224.0.0.1/hook",
    "http://localhost:8080/hook",  # a name resolving to loopback
    "http://100.64.0.1/hook",
]


@pytest.mark.parametrize("url", REFUSED)
async def test_destinations_on_forbidden_addresses_are_refused(
    nhttp: Http, orgs: dict[str, Any], monkeypatch: pytest.MonkeyPatch, url: str
) -> None:
    """Attack (SSRF): without the deployment's leave, a destination on loopback, a
    private range, link-local (the metadata service), multicast, or a name resolving to
    one is refused when saved, and a PATCH cannot move a configuration there."""
    made = await _config(nhttp)  # a public name: allowed
    monkeypatch.delenv("RUNPLANE_NOTIFY_ALLOW")
    body = {"name": "x", "url": url}
    (await nhttp.post(f"{V1}/acme/notifications", json=body)).problem("destination-refused", 422)
    one = f"{V1}/acme/notifications/{made['id']}"
    (await nhttp.call("PATCH", one, json={"url": url})).problem("destination-refused", 422)
    assert (await nhttp.get(one)).body["url"] == made["url"]


async def test_verify_sends_a_signed_verification_and_answers_the_receivers_response(
    nhttp: Http, orgs: dict[str, Any]
) -> None:
    async with Receiver(token=TOKEN, answers=[200, 500]) as r:
        made = await _config(nhttp, url=r.url, token=TOKEN)
        one = f"{V1}/acme/notifications/{made['id']}"
        a = await nhttp.post(f"{one}/verify")
        assert a.status == 200, a.body
        assert (a.body["delivered"], a.body["response_code"]) == (True, 200)
        assert a.body["response_excerpt"] == "answer 200"
        got = r.got[0]
        assert got.tfe_ok and got.rp_ok and got.delivery == a.body["delivery_id"]
        payload = got.json
        assert payload["payload_version"] == 1
        assert payload["notification_configuration_id"] == made["id"]
        assert payload["notifications"][0]["trigger"] == "verification"
        assert payload["run_id"] is None and payload["organization_name"] == "acme"
        b = await nhttp.post(f"{one}/verify")
        assert (b.body["delivered"], b.body["response_code"]) == (False, 500)
        assert len(r.got) == 2  # a verification is not retried
        listed = await nhttp.get(f"{one}/deliveries", headers={"RP-Min-Seq": b.headers["RP-Seq"]})
        rows = listed.body["items"]
        assert [(x["trigger"], x["response_code"], x["outcome"]) for x in rows] == [
            ("verification", 500, "failed"),
            ("verification", 200, "delivered"),
        ]
        assert rows[1]["delivery_id"] == a.body["delivery_id"]


async def test_the_guard_judges_again_at_send_time(
    nhttp: Http, orgs: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A destination allowed when saved is refused when sent to if the deployment no
    longer allows its address (as for a name that now resolves to loopback): nothing is
    sent and the attempt records why."""
    async with Receiver() as r:
        made = await _config(nhttp, url=r.url)
        monkeypatch.delenv("RUNPLANE_NOTIFY_ALLOW")
        a = await nhttp.post(f"{V1}/acme/notifications/{made['id']}/verify")
        assert a.status == 200
        assert a.body["delivered"] is False and "loopback" in a.body["error"]
        assert r.got == []


async def test_a_run_created_through_the_api_is_notified_by_the_subscriber(
    nhttp: Http, orgs: dict[str, Any]
) -> None:
    """End to end: configurations made through the API (token sealed by the API), the
    subscriber on the shared consumer loop opening it with the same key, a run created
    through the API; the organization's and the workspace's configurations both send."""
    from services.processes.notifications.delivery import Policy
    from services.processes.notifications.subscriber import serving
    from services.surfaces.api import secrets as secrets_api

    keyring = nhttp.client.app[secrets_api.SECRETS].keyring
    policy = Policy(allow=frozenset({"loopback"}), schedule=(0.1,))
    async with Receiver(token=TOKEN) as r:
        await _config(nhttp, url=r.url, token=TOKEN, triggers=["run:created"])
        await _config(nhttp, ws="net", url=r.url, token=TOKEN, triggers=["run:created"])
        await _config(nhttp, ws="db", url=r.url, token=TOKEN, triggers=["run:created"])
        async with serving(nhttp.app.store.nc, nhttp.app, keyring, policy=policy):
            run = await nhttp.run("acme", "net", "plan")

            async def two() -> bool:
                return len(r.got) >= 2

            await eventually(two, what="both deliveries")
        assert {g.json["run_id"] for g in r.got} == {run["id"]}
        assert len(r.deliveries()) == 2 and all(g.tfe_ok and g.rp_ok for g in r.got)


async def test_an_organization_has_a_bounded_number_of_configurations(
    nhttp: Http, orgs: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each configuration is a lane of deliveries: one tenant cannot add them without
    bound. Past the bound (its workspaces' included) a create is 422; another
    organization is not counted against it."""
    monkeypatch.setattr(nt, "MAX_CONFIGS", 3)
    await _config(nhttp)
    await _config(nhttp, ws="net")
    await _config(nhttp, ws="db")
    a = await nhttp.post(
        f"{V1}/acme/notifications", json={"name": "x", "url": "https://93.184.215.14/"}
    )
    assert a.status == 422 and "at most 3" in a.body["detail"], a.body
    await _config(nhttp, org="beta")
