"""Issue 23, item 11: one body reader for every route. A JSON body nested past the bound
(`[` a hundred thousand times, as the attacker's review sent it; or nested twenty thousand
deep inside an otherwise good body, within every route's size cap) or naming a key twice
is the route's bad body on every route that reads one: a 4xx in the route's own error
style, never a 500, never a traceback in the logs, and nothing written.

The routes come from the routers, so a new one is attacked or refused here: the HTTP
API's bodies are its OpenAPI document's (tests/test_api_errors.py holds the document to
the routes), the TFE API's and the webhooks' are its ROUTES and the public routes; a
route that writes must be named below as reading no body, or be given a good body (whose
first key the attack writes twice)."""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import time
import urllib.parse
from collections.abc import AsyncIterator, Iterator, MutableMapping
from contextlib import contextmanager
from typing import Any

import aiohttp
import pytest
import structlog
from aiohttp import web
from nats.aio.client import Client as NATS

from events.members import user_id_of
from events.run import CancelRun, ClaimPhase, Workspace
from executor.statebackend import USER
from executor.statefile import MAX_STATE_DEPTH
from executor.statestore import parse_state
from infra.crypto import KeyRing
from services.app.commands import App
from services.processes.chat import signing as slack_signing
from services.surfaces.api import openapi
from services.surfaces.api.app import ROUTES
from services.surfaces.api.middleware import PUBLIC
from services.surfaces.tfe import configs, login
from services.surfaces.tfe import routes as tfe_routes
from tests.api_support import Answer
from tests.lock_support import backends
from tests.tfe_support import Tfe, a_state, new_run, tfe_fixture, uploaded
from tests.vcs_support import connection, deliver, fixture

__all__ = ["tfe_fixture"]

WRITES = frozenset({"POST", "PUT", "PATCH", "DELETE"})
RECORDED = "[" * 100_000  # the review's body: 100 KB, past every bound
DEEP = 20_000  # levels nested inside a good body: within every route's size cap
SLACK_SECRET = "slack-signing-secret-0123456789"
TEAM = "T0ACME"

# ---------------------------------------------------------------- the HTTP API

# A good body for every route whose OpenAPI operation takes one.
API_BODIES: dict[tuple[str, str], dict[str, Any]] = {
    ("POST", "/api/v1/orgs"): {"name": "zeta"},
    ("POST", "/api/v1/orgs/{org}/tokens"): {"role": "viewer"},
    ("POST", "/api/v1/orgs/{org}/workspaces"): {"name": "other", "repository": "r"},
    ("PATCH", "/api/v1/orgs/{org}/workspaces/{ws}"): {"variables": {"n": "2"}},
    ("POST", "/api/v1/orgs/{org}/workspaces/{ws}/runs"): {"type": "plan"},
    ("POST", "/api/v1/orgs/{org}/runs/{run}/approve"): {"acknowledged": []},
    ("POST", "/api/v1/orgs/{org}/runs/{run}/discard"): {"reason": "no"},
    ("POST", "/api/v1/orgs/{org}/runs/{run}/cancel"): {"reason": "no"},
    ("POST", "/api/v1/orgs/{org}/runs/{run}/rerun"): {},
    ("PUT", "/api/v1/orgs/{org}/workspaces/{ws}/secret-variables/{name}"): {"value": "v"},
    ("POST", "/api/v1/orgs/{org}/folders"): {"name": "platform2"},
    ("PATCH", "/api/v1/orgs/{org}/settings"): {"four_eyes": True},
    ("PATCH", "/api/v1/orgs/{org}/folders/{folder}/settings"): {"run_timeout": 60},
    ("PATCH", "/api/v1/orgs/{org}/workspaces/{ws}/settings"): {"require_approval": False},
    ("POST", "/api/v1/orgs/{org}/workspaces/{ws}/lock"): {"reason": "maintenance"},
    ("POST", "/api/v1/orgs/{org}/workspaces/{ws}/unlock"): {},
    ("POST", "/api/v1/orgs/{org}/workspaces/{ws}/state-versions/{id}/rollback"): {"reason": "r"},
    ("POST", "/api/v1/orgs/{org}/groups"): {"name": "ops2", "members": ["alice"]},
    ("PUT", "/api/v1/orgs/{org}/groups/{group}/members"): {"members": ["bob"]},
    ("PUT", "/api/v1/orgs/{org}/templates/{template}"): {"steps": [{"kind": "plan", "order": 100}]},
    ("PUT", "/api/v1/orgs/{org}/policies/{policy}"): {
        "enforcement": "advisory",
        "source": "package p\ndeny contains m if { m := input.x }\n",
    },
    ("POST", "/api/v1/orgs/{org}/notifications"): {"name": "n", "url": "https://example.com/h"},
    ("POST", "/api/v1/orgs/{org}/audit/destinations"): {
        "name": "siem",
        "format": "runplane",
        "url": "https://siem.example/runplane",
        "secret": "s",
    },
    ("PATCH", "/api/v1/orgs/{org}/audit/destinations/{destination}"): {"enabled": False},
    ("PATCH", "/api/v1/orgs/{org}/notifications/{notification}"): {"enabled": False},
    ("POST", "/api/v1/orgs/{org}/workspaces/{ws}/notifications"): {
        "name": "n",
        "url": "https://example.com/h",
    },
    ("PATCH", "/api/v1/orgs/{org}/workspaces/{ws}/notifications/{notification}"): {
        "enabled": False
    },
    ("POST", "/api/v1/orgs/{org}/workspaces/{ws}/schedules"): {
        "cron": "* * * * *",
        "run_type": "plan",
    },
    ("PATCH", "/api/v1/orgs/{org}/workspaces/{ws}/schedules/{schedule}"): {"enabled": False},
    ("PUT", "/api/v1/orgs/{org}/chat/slack"): {"team_id": TEAM, "signing_secret": "s"},
    ("PUT", "/api/v1/orgs/{org}/chat/slack/users/{slack_id}"): {"user": "bob"},
    ("POST", "/api/v1/orgs/{org}/vcs-connections"): {
        "name": "gh2",
        "provider": "github",
        "webhook_secret": "s",
    },
    ("PATCH", "/api/v1/orgs/{org}/vcs-connections/{connection}"): {"name": "gh3"},
    ("POST", "/api/v1/orgs/{org}/workspaces/{ws}/run-triggers"): {"source": "other"},
    ("POST", "/api/v1/orgs/{org}/users"): {"email": "carol@acme.io"},
    ("POST", "/api/v1/orgs/{org}/users/{user}/suspend"): {"reason": "left"},
    ("POST", "/api/v1/orgs/{org}/teams"): {"name": "storage"},
    ("PATCH", "/api/v1/orgs/{org}/teams/{team}"): {"rights": []},
    ("PUT", "/api/v1/orgs/{org}/teams/{team}/members"): {"members": ["bob@acme.io"]},
    ("PUT", "/api/v1/orgs/{org}/access"): {"team": "network", "level": "read"},
    ("PUT", "/api/v1/orgs/{org}/folders/{folder}/access"): {"team": "network", "level": "read"},
    ("PUT", "/api/v1/orgs/{org}/workspaces/{ws}/access"): {"team": "network", "level": "plan"},
    ("PUT", "/api/v1/orgs/{org}/sso"): {"issuer": "https://idp.example", "client_id": "c"},
    ("POST", "/api/v1/orgs/{org}/stacks"): {"name": "s2", "workspaces": ["net"]},
    ("PUT", "/api/v1/orgs/{org}/stacks/{stack}"): {"workspaces": ["net"]},
    ("POST", "/api/v1/orgs/{org}/stacks/{stack}/runs"): {"type": "plan"},
    ("POST", "/api/v1/orgs/{org}/stack-runs/{stack_run}/resume"): {},
}
# Routes that write and read no body (a DELETE never does).
API_NO_BODY = frozenset(
    {
        ("POST", "/api/v1/orgs/{org}/workspaces/{ws}/purge"),
        ("POST", "/api/v1/orgs/{org}/notifications/{notification}/verify"),
        ("POST", "/api/v1/orgs/{org}/workspaces/{ws}/notifications/{notification}/verify"),
        ("POST", "/api/v1/orgs/{org}/users/{user}/reactivate"),
    }
)
SLACK_COMMANDS = "/api/v1/chat/slack/commands"
SLACK_INTERACTIONS = "/api/v1/chat/slack/interactions"
VCS_WEBHOOK = "/api/v1/vcs/{connection}/webhook"
WEBHOOKS = frozenset(
    {("POST", SLACK_COMMANDS), ("POST", SLACK_INTERACTIONS), ("POST", VCS_WEBHOOK)}
)


def _api_routes() -> set[tuple[str, str]]:
    app = web.Application()
    app.add_routes(ROUTES)
    return {
        (r.method, r.resource.canonical)
        for r in app.router.routes()
        if r.resource is not None and r.method in WRITES
    }


def _documented_bodies() -> set[tuple[str, str]]:
    return {
        (method.upper(), path)
        for path, ops in openapi.document()["paths"].items()
        for method, op in ops.items()
        if "requestBody" in op
    }


def test_every_api_route_that_writes_is_attacked_or_reads_no_body() -> None:
    """A route that takes a body documents it, and is given a good body here; every other
    route that writes is a DELETE, a webhook (below) or named as reading none."""
    assert set(API_BODIES) == _documented_bodies()
    writes = _api_routes()
    others = {(m, p) for m, p in writes - set(API_BODIES) if m != "DELETE"}
    assert others == API_NO_BODY | WEBHOOKS
    assert {(m, p) for m, p in writes if p in PUBLIC} == WEBHOOKS


# ---------------------------------------------------------------- the TFE API

# A good JSON:API body for every TFE route that reads one ({cv}, {ws_id}: filled in).
TFE_BODIES: dict[tuple[str, str], dict[str, Any]] = {
    ("POST", tfe_routes.WS + "/configuration-versions"): {
        "data": {"type": "configuration-versions", "attributes": {"speculative": True}}
    },
    ("POST", tfe_routes.V2 + "/runs"): {
        "data": {
            "type": "runs",
            "attributes": {},
            "relationships": {
                "workspace": {"data": {"type": "workspaces", "id": "{ws_id}"}},
                "configuration-version": {"data": {"type": "configuration-versions", "id": "{cv}"}},
            },
        }
    },
    ("POST", tfe_routes.RUN + "/actions/discard"): {"comment": "no"},
    ("POST", tfe_routes.RUN + "/actions/cancel"): {"comment": "no"},
    ("POST", tfe_routes.RUN + "/actions/force-cancel"): {"comment": "no"},
    ("POST", tfe_routes.ORG + "/workspaces"): {
        "data": {"type": "workspaces", "attributes": {"name": "fresh"}}
    },
    ("POST", tfe_routes.WS + "/actions/lock"): {"reason": "Locked by Terraform"},
    ("POST", tfe_routes.WS + "/state-versions"): {"data": "{push}"},
}
# TFE routes that write and read no JSON body: login's forms, the archive upload, and
# those that take no body (the workspace's PATCH is refused whatever it says).
TFE_NO_BODY = frozenset(
    {
        ("POST", login.AUTHZ),
        ("POST", login.TOKEN),
        ("PUT", configs.UPLOAD_PATH + "{token}"),
        ("PATCH", tfe_routes.WS),
        ("POST", tfe_routes.WS + "/actions/unlock"),
        ("POST", tfe_routes.WS + "/actions/force-unlock"),
        ("POST", tfe_routes.RUN + "/actions/apply"),
    }
)


def _tfe_routes() -> set[tuple[str, str]]:
    return {(r.method, r.path) for r in tfe_routes.ROUTES if r.method in WRITES}


def test_every_tfe_route_that_writes_is_attacked_or_reads_no_body() -> None:
    assert _tfe_routes() == set(TFE_BODIES) | TFE_NO_BODY


# ---------------------------------------------------------------- the attacks


def _encode(body: Any) -> str:
    return json.dumps(body, separators=(",", ":"))


def _nested(body: dict[str, Any]) -> str:
    """`body` with a member holding arrays `DEEP` deep (closed: valid JSON)."""
    inner = _encode(body)[1:-1]
    deep = "[" * DEEP + "]" * DEEP
    return "{" + (inner + "," if inner else "") + '"x":' + deep + "}"


def _repeated(body: dict[str, Any]) -> str:
    """`body` with its first key written twice (the same value: only the repeat is
    wrong); `{}`'s stand-in names one twice."""
    if not body:
        return '{"x":0,"x":0}'
    key, value = next(iter(body.items()))
    return "{" + _encode(key) + ":" + _encode(value) + "," + _encode(body)[1:]


def _attacks(body: dict[str, Any]) -> list[tuple[str, str]]:
    return [("recorded", RECORDED), ("nested", _nested(body)), ("repeated", _repeated(body))]


@contextmanager
def _quiet_logs(warning: str = "") -> Iterator[list[MutableMapping[str, Any]]]:
    """The attacks' log lines: none an error or with a traceback; with `warning`, that
    warning (and no other) once per attack, counted by the caller."""
    with structlog.testing.capture_logs() as seen:
        yield seen
    for line in seen:
        assert line["log_level"] not in ("error", "critical", "exception"), line
        assert "exc_info" not in line and "exception" not in line, line
        if line["log_level"] == "warning":
            assert line["event"] == warning, line


async def _written(app: App) -> dict[str, int]:
    """Every stream's last sequence: the events, and the buckets and object stores (the
    secrets, the Slack app's, the states, the locks), so that nothing written goes unseen."""
    infos = await app.store.nc.jetstream().streams_info()
    return {info.config.name or "": info.state.last_seq for info in infos}


@pytest.fixture
async def world(tfe: Tfe) -> AsyncIterator[dict[str, str]]:
    """Org acme with what the routes name: workspace `net` (API) with a run, folder
    `platform`, group `ops`, a schedule, a notification, its Slack app and a GitHub
    connection; workspace `cli` (TFE) with an uploaded configuration and a run asked to
    stop while it plans (so cancel and force-cancel read their bodies), and workspace
    `state` (TFE), locked (so a push reads its body)."""
    await tfe.org("acme")
    await tfe.workspace("acme", "net")
    await tfe.workspace("acme", "other")
    run = (await tfe.run("acme", "net"))["id"]
    ids = {"run": run}
    for path, body in (
        ("/api/v1/orgs/acme/folders", {"name": "platform"}),
        ("/api/v1/orgs/acme/groups", {"name": "ops", "members": []}),
        ("/api/v1/orgs/acme/users", {"email": "bob@acme.io"}),
        ("/api/v1/orgs/acme/teams", {"name": "network"}),
        ("/api/v1/orgs/acme/workspaces/net/schedules", {"cron": "0 0 * * *", "run_type": "plan"}),
        ("/api/v1/orgs/acme/vcs-connections", None),
    ):
        if body is None:
            ids["connection"] = (await connection(tfe))["id"]
            continue
        a = await tfe.post(path, json=body)
        assert a.status == 201, a.body
        if "schedules" in path:
            ids["schedule"] = a.body["id"]
    slack = {"team_id": TEAM, "signing_secret": SLACK_SECRET}
    assert (await tfe.call("PUT", "/api/v1/orgs/acme/chat/slack", json=slack)).status == 200
    ws_id = await tfe.cli_workspace("acme", "cli")
    cv, _ = await uploaded(tfe, ws_id, speculative=False)
    tfe_run = (await new_run(tfe, ws_id, cv)).body["data"]["id"]
    run_id = tfe_run.removeprefix("run-").split(".")[2]
    assert await tfe.app.admit_next("acme", "cli") == run_id
    claim = ClaimPhase(actor="executor", phase="plan", lease_id="l1", executor_id="e1")
    await tfe.app.run_command("acme", "cli", run_id, claim)
    await tfe.app.run_command("acme", "cli", run_id, CancelRun(actor="admin", reason="stop"))
    state_ws = await tfe.cli_workspace("acme", "state")  # no run: a push reads its body
    assert (await tfe.lock(state_ws)).status == 200
    ids.update(ws_id=ws_id, cv=cv, tfe_run=tfe_run, state_ws=state_ws)
    yield ids


def _api_path(template: str, ids: dict[str, str]) -> str:
    return template.format(
        org="acme",
        ws="net",
        run=ids["run"],
        name="db_password",
        folder="platform",
        group="ops",
        policy="p",
        template="t",
        notification="01jnotificationofnone00000",
        destination="01jdestinationofnone000000",
        schedule=ids["schedule"],
        id="sv-acme.net.1.0123456789abcdef",
        slack_id="U0BOB",
        connection=ids["connection"],
        team="network",
        user=user_id_of("bob@acme.io"),
        stack="s1",
        stack_run="01jstackrunofnone000000000",
    )


async def test_every_api_route_refuses_a_deep_or_repeating_body_as_invalid_body(
    tfe: Tfe, world: dict[str, str]
) -> None:
    """400 invalid-body on each route (settings' and templates' `Any` members answered
    500 for a deep one), nothing written, no error logged."""
    with _quiet_logs():
        for (method, template), body in sorted(API_BODIES.items()):
            path = _api_path(template, world)
            for name, attack in _attacks(body):
                before = await _written(tfe.app)
                a = await tfe.call(method, path, data=attack.encode())
                try:
                    a.problem("invalid-body", 400)
                except AssertionError as e:
                    raise AssertionError(f"{method} {template} {name}: {a.status} {a.body}") from e
                assert await _written(tfe.app) == before, (method, template, name)


def _tfe_body(body: dict[str, Any], world: dict[str, str]) -> dict[str, Any]:
    if body == {"data": "{push}"}:
        state = a_state(1)
        raw = json.dumps(state).encode()
        attrs = {
            "serial": 1,
            "lineage": state["lineage"],
            "md5": hashlib.md5(raw).hexdigest(),
            "state": base64.b64encode(raw).decode(),
        }
        return {"data": {"type": "state-versions", "attributes": attrs}}
    text = json.dumps(body).replace("{ws_id}", world["ws_id"]).replace("{cv}", world["cv"])
    return json.loads(text)  # type: ignore[no-any-return]  # a JSON object


async def test_every_tfe_route_refuses_a_deep_or_repeating_body_as_its_invalid_body(
    tfe: Tfe, world: dict[str, str]
) -> None:
    """The TFE API's bad body, a JSON:API 422 `invalid body`, on each route (each
    answered 500 for a deep one, with a traceback logged); or 413 where the review's
    100 KB passes the route's cap. Nothing written."""
    with _quiet_logs():
        for (method, template), body in sorted(TFE_BODIES.items()):
            ws_id = world["state_ws" if template.endswith("/state-versions") else "ws_id"]
            path = template.format(org="acme", workspace_id=ws_id, object_id=world["tfe_run"])
            for name, attack in _attacks(_tfe_body(body, world)):
                before = await _written(tfe.app)
                headers = {"Content-Type": "application/vnd.api+json"}
                a = await tfe.call(method, path, data=attack.encode(), headers=headers)
                what = (method, template, name, a.status, a.body)
                if name == "recorded" and a.status == 413:
                    assert a.body["errors"][0]["title"] == "body too large", what
                else:
                    assert a.status == 422, what
                    assert a.body["errors"][0]["title"] == "invalid body", what
                assert await _written(tfe.app) == before, what


# ---------------------------------------------------------------- the webhooks


def _form(payload: str) -> bytes:
    """`payload=<payload>` as a form, its brackets and quotes left as they are (parsed
    the same): a deep payload stays within Slack's 64 KiB."""
    return b"payload=" + urllib.parse.quote(payload, safe='[]{}":,').encode()


async def _slack(tfe: Tfe, path: str, body: bytes, secret: str) -> Answer:
    stamp = str(int(time.time()))
    headers = {
        "X-Slack-Request-Timestamp": stamp,
        "X-Slack-Signature": slack_signing.signature(secret, stamp, body),
        "Content-Type": "application/x-www-form-urlencoded",
    }
    return await tfe.call("POST", path, token=None, data=body, headers=headers)


def _click() -> dict[str, Any]:
    return {
        "type": "block_actions",
        "team": {"id": TEAM},
        "user": {"id": "U0BOB"},
        "response_url": "https://hooks.slack.com/actions/x",
        "actions": [{"action_id": "approve", "value": "x"}],
    }


async def test_slack_interactions_refuse_a_deep_or_repeating_payload_before_anything(
    tfe: Tfe, world: dict[str, str]
) -> None:
    """A deep payload answered 500 with a traceback before any signature was checked
    (one that matches no organization's secret is enough); a repeated key was read last
    wins. Now 400 invalid-body and one warning line, signed or not; the review's 100 KB
    passes Slack's cap (413); nothing written. A slash command carries no JSON: the same
    bodies are a form of nothing, refused."""
    attacks = [(n, _form(a)) for n, a in _attacks(_click())]
    with _quiet_logs("slack_body_refused") as seen:
        for secret in ("not-the-apps-secret", SLACK_SECRET):
            for name, body in attacks:
                before = await _written(tfe.app)
                a = await _slack(tfe, SLACK_INTERACTIONS, body, secret)
                if name == "recorded":
                    a.problem("body-too-large", 413)
                else:
                    a.problem("invalid-body", 400)
                assert await _written(tfe.app) == before, (secret, name, a.status, a.body)
        refused = [line for line in seen if line["event"] == "slack_body_refused"]
        assert len(refused) == 4
        for name, attack in _attacks({"text": "status"}):
            before = await _written(tfe.app)
            a = await _slack(tfe, SLACK_COMMANDS, attack.encode()[:60_000], SLACK_SECRET)
            assert 400 <= a.status < 500, (name, a.status, a.body)
            assert await _written(tfe.app) == before, name


async def test_the_vcs_webhook_refuses_a_deep_or_repeating_signed_payload(
    tfe: Tfe, world: dict[str, str]
) -> None:
    """A signed delivery whose payload nests deep answered 500 with a traceback; one
    with a repeated key was read last wins. Now 400 invalid-body, one warning line each,
    nothing written."""
    push = fixture("github/push.branch.json")
    with _quiet_logs("vcs_payload_refused") as seen:
        for name, attack in _attacks(push):
            before = await _written(tfe.app)
            a = await deliver(tfe, world["connection"], "push", attack.encode())
            try:
                a.problem("invalid-body", 400)
            except AssertionError as e:
                raise AssertionError(f"{name}: {a.status} {a.body}") from e
            assert await _written(tfe.app) == before, name
        assert [line["event"] for line in seen if line["log_level"] == "warning"] == [
            "vcs_payload_refused"
        ] * 3


# ---------------------------------------------------------------- states inside bodies

# A Terraform state nested as deep as the review's bodies (its own bound, 512:
# executor/statestore.py), valid but for its depth.
DEEP_STATE = (
    b'{"version": 4, "serial": 1, "lineage": "l", "outputs": '
    + b"[" * 100_000
    + b"]" * 100_000
    + b"}"
)


def test_a_state_is_read_to_its_bound_of_512_levels() -> None:
    """Deeper than any request's body may be (a tenant's values), not past 512."""
    for depth in (MAX_STATE_DEPTH, MAX_STATE_DEPTH + 1):
        arrays = depth - 1  # inside the state's own object
        state = b'{"serial": 3, "lineage": "l", "x": ' + b"[" * arrays + b"]" * arrays + b"}"
        if depth > 512:
            with pytest.raises(ValueError, match="deeper than 512 levels"):
                parse_state(state)
        else:
            assert parse_state(state) == (3, "l")


async def test_a_pushed_state_nested_past_its_bound_is_refused_not_a_500(
    tfe: Tfe, world: dict[str, str]
) -> None:
    """The state inside a good push: 422 as any state that is not one (it answered 500,
    with a traceback), nothing written."""
    attrs = {
        "serial": 1,
        "lineage": "l",
        "md5": hashlib.md5(DEEP_STATE).hexdigest(),
        "state": base64.b64encode(DEEP_STATE).decode(),
    }
    body = {"data": {"type": "state-versions", "attributes": attrs}}
    with _quiet_logs():
        before = await _written(tfe.app)
        a = await tfe.tfe(
            "POST", f"/api/v2/workspaces/{world['state_ws']}/state-versions", json=body
        )
        assert a.status == 422, a.body
        assert a.body["errors"][0]["title"] == "invalid attribute"
        assert "deeper than 512 levels" in a.body["errors"][0]["detail"]
        assert await _written(tfe.app) == before


async def test_the_executors_state_backend_refuses_a_deep_state_or_lock_and_a_repeated_lock(
    nc: NATS, app: App, caplog: pytest.LogCaptureFixture
) -> None:
    """The http backend an executor serves a phase's Terraform (the tenant's code runs
    beside it): a deep state POSTed or a deep lock answered 500, with aiohttp's traceback;
    a lock naming its ID twice locked or unlocked by the last. Now 400 and the backend's
    warning, nothing written."""
    await app.create_org("acme", "alice")
    await app.create_workspace("acme", "net", Workspace(repository="/nowhere"), "alice")
    async with backends(nc, app, KeyRing.generate()) as (a, _):
        assert (await a.call("LOCK", {"ID": "lock-a", "Who": "alice@a"})).status == 200
        auth = aiohttp.encode_basic_auth(USER, a.backend.password)
        deep = "[" * 100_000
        attacks = [
            ("POST", "?ID=lock-a", DEEP_STATE, "not a Terraform state"),
            ("LOCK", "", deep.encode(), "not a Terraform lock"),
            ("LOCK", "", b'{"ID": "lock-a", "ID": "lock-x"}', "not a Terraform lock"),
            ("UNLOCK", "", deep.encode(), "not a Terraform lock"),
            ("UNLOCK", "", b'{"ID": "x", "ID": "lock-a"}', "not a Terraform lock"),
        ]
        with _quiet_logs("state_request_refused") as seen:
            for method, query, body, refusal in attacks:
                before = await _written(app)
                async with a.session.request(
                    method, a.backend.url + query, data=body, headers={"Authorization": auth}
                ) as resp:
                    assert (resp.status, refusal in await resp.text()) == (400, True), method
                assert await _written(app) == before, (method, body[:40])
        assert [line["event"] for line in seen if line["log_level"] == "warning"] == [
            "state_request_refused"
        ] * len(attacks)
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert (await a.call("UNLOCK", {"ID": "lock-a"})).status == 200  # still the holder
