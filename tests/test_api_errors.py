"""The HTTP API's refusals: authentication, roles, org isolation on every endpoint, bad
bodies and ids, unknown routes, unexpected errors; and the OpenAPI document's coverage."""

from __future__ import annotations

from typing import Any

import pytest
from aiohttp import web

from services.surfaces.api.app import ROUTES, build_app
from services.surfaces.api.middleware import PUBLIC
from tests.api_support import Http, http_fixture  # noqa: F401  # registers the `http` fixture

V1 = "/api/v1"
RUN_ID = "01jrunofanotherorg0000000a"

# Every route but the two public-ish documents, as (method, path template). `{run}` is
# filled with a run of org acme; `{ws}` with acme's workspace.
ORG_ENDPOINTS = [
    ("GET", "/api/v1/orgs/{org}"),
    ("GET", "/api/v1/orgs/{org}/audit"),
    ("GET", "/api/v1/orgs/{org}/audit/destinations"),
    ("POST", "/api/v1/orgs/{org}/audit/destinations"),
    ("GET", "/api/v1/orgs/{org}/audit/destinations/{destination}"),
    ("PATCH", "/api/v1/orgs/{org}/audit/destinations/{destination}"),
    ("DELETE", "/api/v1/orgs/{org}/audit/destinations/{destination}"),
    ("POST", "/api/v1/orgs/{org}/tokens"),
    ("GET", "/api/v1/orgs/{org}/tokens"),
    ("DELETE", "/api/v1/orgs/{org}/tokens/{token}"),
    ("GET", "/api/v1/orgs/{org}/workspaces"),
    ("POST", "/api/v1/orgs/{org}/workspaces"),
    ("GET", "/api/v1/orgs/{org}/workspaces/{ws}"),
    ("PATCH", "/api/v1/orgs/{org}/workspaces/{ws}"),
    ("DELETE", "/api/v1/orgs/{org}/workspaces/{ws}"),
    ("POST", "/api/v1/orgs/{org}/workspaces/{ws}/purge"),
    ("GET", "/api/v1/orgs/{org}/workspaces/{ws}/runs"),
    ("POST", "/api/v1/orgs/{org}/workspaces/{ws}/runs"),
    ("POST", "/api/v1/orgs/{org}/workspaces/{ws}/lock"),
    ("POST", "/api/v1/orgs/{org}/workspaces/{ws}/unlock"),
    ("GET", "/api/v1/orgs/{org}/runs"),
    ("GET", "/api/v1/orgs/{org}/runs/{run}"),
    ("POST", "/api/v1/orgs/{org}/runs/{run}/approve"),
    ("POST", "/api/v1/orgs/{org}/runs/{run}/discard"),
    ("POST", "/api/v1/orgs/{org}/runs/{run}/cancel"),
    ("POST", "/api/v1/orgs/{org}/runs/{run}/rerun"),
    ("POST", "/api/v1/orgs/{org}/workspaces/{ws}/run-triggers"),
    ("GET", "/api/v1/orgs/{org}/workspaces/{ws}/run-triggers"),
    ("DELETE", "/api/v1/orgs/{org}/workspaces/{ws}/run-triggers/{source}"),
    ("POST", "/api/v1/orgs/{org}/stacks"),
    ("GET", "/api/v1/orgs/{org}/stacks"),
    ("GET", "/api/v1/orgs/{org}/stacks/{stack}"),
    ("PUT", "/api/v1/orgs/{org}/stacks/{stack}"),
    ("DELETE", "/api/v1/orgs/{org}/stacks/{stack}"),
    ("POST", "/api/v1/orgs/{org}/stacks/{stack}/runs"),
    ("GET", "/api/v1/orgs/{org}/stack-runs/{stack_run}"),
    ("POST", "/api/v1/orgs/{org}/stack-runs/{stack_run}/resume"),
    ("GET", "/api/v1/orgs/{org}/runs/{run}/events"),
    ("GET", "/api/v1/orgs/{org}/runs/{run}/steps"),
    ("GET", "/api/v1/orgs/{org}/runs/{run}/changes"),
    ("GET", "/api/v1/orgs/{org}/runs/{run}/resources"),
    ("GET", "/api/v1/orgs/{org}/runs/{run}/logs"),
    ("GET", "/api/v1/orgs/{org}/workspaces/{ws}/state-versions"),
    ("POST", "/api/v1/orgs/{org}/workspaces/{ws}/state-versions/{id}/rollback"),
    ("PUT", "/api/v1/orgs/{org}/workspaces/{ws}/secret-variables/{name}"),
    ("DELETE", "/api/v1/orgs/{org}/workspaces/{ws}/secret-variables/{name}"),
    ("GET", "/api/v1/orgs/{org}/folders"),
    ("POST", "/api/v1/orgs/{org}/folders"),
    ("GET", "/api/v1/orgs/{org}/settings"),
    ("PATCH", "/api/v1/orgs/{org}/settings"),
    ("GET", "/api/v1/orgs/{org}/folders/{folder}/settings"),
    ("PATCH", "/api/v1/orgs/{org}/folders/{folder}/settings"),
    ("GET", "/api/v1/orgs/{org}/workspaces/{ws}/settings"),
    ("PATCH", "/api/v1/orgs/{org}/workspaces/{ws}/settings"),
    ("GET", "/api/v1/orgs/{org}/groups"),
    ("GET", "/api/v1/orgs/{org}/users"),
    ("POST", "/api/v1/orgs/{org}/users"),
    ("GET", "/api/v1/orgs/{org}/users/{user}"),
    ("POST", "/api/v1/orgs/{org}/users/{user}/suspend"),
    ("POST", "/api/v1/orgs/{org}/users/{user}/reactivate"),
    ("GET", "/api/v1/orgs/{org}/teams"),
    ("POST", "/api/v1/orgs/{org}/teams"),
    ("GET", "/api/v1/orgs/{org}/teams/{team}"),
    ("PATCH", "/api/v1/orgs/{org}/teams/{team}"),
    ("DELETE", "/api/v1/orgs/{org}/teams/{team}"),
    ("PUT", "/api/v1/orgs/{org}/teams/{team}/members"),
    ("GET", "/api/v1/orgs/{org}/access"),
    ("PUT", "/api/v1/orgs/{org}/access"),
    ("GET", "/api/v1/orgs/{org}/folders/{folder}/access"),
    ("PUT", "/api/v1/orgs/{org}/folders/{folder}/access"),
    ("GET", "/api/v1/orgs/{org}/workspaces/{ws}/access"),
    ("PUT", "/api/v1/orgs/{org}/workspaces/{ws}/access"),
    ("PUT", "/api/v1/orgs/{org}/sso"),
    ("GET", "/api/v1/orgs/{org}/sso"),
    ("DELETE", "/api/v1/orgs/{org}/sso"),
    ("POST", "/api/v1/orgs/{org}/groups"),
    ("PUT", "/api/v1/orgs/{org}/groups/{group}/members"),
    ("GET", "/api/v1/orgs/{org}/policies"),
    ("GET", "/api/v1/orgs/{org}/policies/{policy}"),
    ("PUT", "/api/v1/orgs/{org}/policies/{policy}"),
    ("DELETE", "/api/v1/orgs/{org}/policies/{policy}"),
    ("GET", "/api/v1/orgs/{org}/templates"),
    ("GET", "/api/v1/orgs/{org}/templates/{template}"),
    ("PUT", "/api/v1/orgs/{org}/templates/{template}"),
    ("DELETE", "/api/v1/orgs/{org}/templates/{template}"),
    ("GET", "/api/v1/orgs/{org}/notifications"),
    ("POST", "/api/v1/orgs/{org}/notifications"),
    ("GET", "/api/v1/orgs/{org}/notifications/{notification}"),
    ("PATCH", "/api/v1/orgs/{org}/notifications/{notification}"),
    ("DELETE", "/api/v1/orgs/{org}/notifications/{notification}"),
    ("POST", "/api/v1/orgs/{org}/notifications/{notification}/verify"),
    ("GET", "/api/v1/orgs/{org}/notifications/{notification}/deliveries"),
    ("GET", "/api/v1/orgs/{org}/workspaces/{ws}/notifications"),
    ("POST", "/api/v1/orgs/{org}/workspaces/{ws}/notifications"),
    ("GET", "/api/v1/orgs/{org}/workspaces/{ws}/notifications/{notification}"),
    ("PATCH", "/api/v1/orgs/{org}/workspaces/{ws}/notifications/{notification}"),
    ("DELETE", "/api/v1/orgs/{org}/workspaces/{ws}/notifications/{notification}"),
    ("POST", "/api/v1/orgs/{org}/workspaces/{ws}/notifications/{notification}/verify"),
    ("GET", "/api/v1/orgs/{org}/workspaces/{ws}/notifications/{notification}/deliveries"),
    ("PUT", "/api/v1/orgs/{org}/chat/slack"),
    ("GET", "/api/v1/orgs/{org}/chat/slack"),
    ("DELETE", "/api/v1/orgs/{org}/chat/slack"),
    ("GET", "/api/v1/orgs/{org}/chat/slack/users"),
    ("PUT", "/api/v1/orgs/{org}/chat/slack/users/{slack_id}"),
    ("GET", "/api/v1/orgs/{org}/chat/slack/users/{slack_id}"),
    ("DELETE", "/api/v1/orgs/{org}/chat/slack/users/{slack_id}"),
    ("GET", "/api/v1/orgs/{org}/vcs-connections"),
    ("POST", "/api/v1/orgs/{org}/vcs-connections"),
    ("GET", "/api/v1/orgs/{org}/vcs-connections/{connection}"),
    ("PATCH", "/api/v1/orgs/{org}/vcs-connections/{connection}"),
    ("DELETE", "/api/v1/orgs/{org}/vcs-connections/{connection}"),
    ("GET", "/api/v1/orgs/{org}/vcs-connections/{connection}/deliveries"),
    ("GET", "/api/v1/orgs/{org}/workspaces/{ws}/schedules"),
    ("POST", "/api/v1/orgs/{org}/workspaces/{ws}/schedules"),
    ("GET", "/api/v1/orgs/{org}/workspaces/{ws}/schedules/{schedule}"),
    ("PATCH", "/api/v1/orgs/{org}/workspaces/{ws}/schedules/{schedule}"),
    ("DELETE", "/api/v1/orgs/{org}/workspaces/{ws}/schedules/{schedule}"),
    ("GET", "/api/v1/orgs/{org}/workspaces/{ws}/schedules/{schedule}/fires"),
]
VALID_BODIES: dict[str, Any] = {
    "/api/v1/orgs": {"name": "zeta"},
    "/api/v1/orgs/{org}/tokens": {"role": "viewer"},
    "/api/v1/orgs/{org}/audit/destinations": {
        "name": "siem",
        "format": "runplane",
        "url": "https://siem.example/runplane",
        "secret": "s",
    },
    "/api/v1/orgs/{org}/audit/destinations/{destination}": {"enabled": False},
    "/api/v1/orgs/{org}/workspaces": {"name": "other", "repository": "r"},
    "/api/v1/orgs/{org}/workspaces/{ws}": {"variables": {"n": "2"}},
    "/api/v1/orgs/{org}/workspaces/{ws}/runs": {"type": "plan"},
    "/api/v1/orgs/{org}/workspaces/{ws}/lock": {"reason": "maintenance"},
    "/api/v1/orgs/{org}/workspaces/{ws}/state-versions/{id}/rollback": {"reason": "r"},
    "/api/v1/orgs/{org}/workspaces/{ws}/run-triggers": {"source": "other"},
    "/api/v1/orgs/{org}/stacks": {"name": "s", "workspaces": ["net"]},
    "/api/v1/orgs/{org}/stacks/{stack}": {"workspaces": ["net"]},
    "/api/v1/orgs/{org}/stacks/{stack}/runs": {"type": "plan"},
    "/api/v1/orgs/{org}/workspaces/{ws}/schedules": {"cron": "* * * * *", "run_type": "plan"},
    "/api/v1/orgs/{org}/workspaces/{ws}/schedules/{schedule}": {"enabled": False},
    "/api/v1/orgs/{org}/workspaces/{ws}/secret-variables/{name}": {"value": "v"},
    "/api/v1/orgs/{org}/folders": {"name": "platform"},
    "/api/v1/orgs/{org}/chat/slack": {"team_id": "T0ACME", "signing_secret": "s"},
    "/api/v1/orgs/{org}/chat/slack/users/{slack_id}": {"user": "bob"},
    "/api/v1/orgs/{org}/sso": {"issuer": "https://idp.example", "client_id": "runplane"},
    "/api/v1/orgs/{org}/vcs-connections": {
        "name": "gh",
        "provider": "github",
        "webhook_secret": "s",
    },
    "/api/v1/orgs/{org}/vcs-connections/{connection}": {"name": "gh2"},
    "/api/v1/orgs/{org}/settings": {"four_eyes": True},
    "/api/v1/orgs/{org}/folders/{folder}/settings": {"run_timeout": 60},
    "/api/v1/orgs/{org}/workspaces/{ws}/settings": {"require_approval": False},
    "/api/v1/orgs/{org}/groups": {"name": "ops", "members": ["alice"]},
    "/api/v1/orgs/{org}/groups/{group}/members": {"members": ["bob"]},
    "/api/v1/orgs/{org}/users": {"email": "bob@example.com"},
    "/api/v1/orgs/{org}/teams": {"name": "ops"},
    "/api/v1/orgs/{org}/teams/{team}": {"idp_groups": ["g"]},
    "/api/v1/orgs/{org}/teams/{team}/members": {"members": []},
    "/api/v1/orgs/{org}/access": {"team": "ops", "level": "read"},
    "/api/v1/orgs/{org}/folders/{folder}/access": {"team": "ops", "level": "read"},
    "/api/v1/orgs/{org}/workspaces/{ws}/access": {"team": "ops", "level": "read"},
    "/api/v1/orgs/{org}/policies/{policy}": {
        "enforcement": "advisory",
        "source": "package p\ndeny contains m if { m := input.x }\n",
    },
}


def _routes() -> set[tuple[str, str]]:
    app = web.Application()
    app.add_routes(ROUTES)
    return {
        (r.method, r.resource.canonical)
        for r in app.router.routes()
        if r.resource is not None and r.method != "HEAD"
    }


def test_the_isolation_table_covers_every_org_route() -> None:
    """Isolation is checked on every org-scoped endpoint: the table is the router."""
    scoped = {(m, p) for m, p in _routes() if p.startswith("/api/v1/orgs/{org}")}
    assert scoped == set(ORG_ENDPOINTS)


@pytest.fixture
async def two_orgs(http: Http) -> dict[str, Any]:
    """Org acme with a workspace and a run; org beta with its own tokens."""
    acme = await http.org("acme")
    beta = await http.org("beta")
    await http.workspace("acme", "net")
    await http.workspace("beta", "net")
    run = await http.run("acme", "net")
    return {"acme": acme, "beta": beta, "run": run["id"]}


async def test_another_orgs_things_are_not_found_on_every_endpoint(
    http: Http, two_orgs: dict[str, Any]
) -> None:
    """A token of org beta, even its admin, gets 404 for anything of org acme: through
    acme's paths, and for acme's run through beta's own paths."""
    beta_admin = two_orgs["beta"]["admin"]
    for method, template in ORG_ENDPOINTS:
        body = VALID_BODIES.get(template)
        for org in ("acme", "beta"):
            if org == "beta" and "{run}" not in template:
                continue  # beta's own workspaces and org are visible to it
            path = template.format(
                org=org,
                ws="net",
                run=two_orgs["run"],
                name="token",
                token="01jtokenofanotherorg00000a",
                folder="platform",
                group="ops",
                user="u-0000000000",
                team="ops",
                policy="p",
                template="t",
                notification="01jnotifofanotherorg00000a",
                schedule="01jschedofanotherorg00000a",
                slack_id="U0BOB",
                connection="01jconnofanotherorg000000a",
                destination="01jdestofanotherorg000000a",
                source="other",
                stack="s",
                stack_run="01jstackrunofanotherorg0a",
                id="sv-acme.net.1.0123456789abcdef",
            )
            kw = {"json": body} if body is not None else {}
            a = await http.call(method, path, token=beta_admin, **kw)
            a.problem("not-found", 404)
    a = await http.get(f"{V1}/orgs/acme/runs/{two_orgs['run']}", token=two_orgs["acme"]["viewer"])
    assert a.status == 200  # the run exists: the 404s above were isolation


async def test_a_role_without_the_permission_is_forbidden(
    http: Http, two_orgs: dict[str, Any]
) -> None:
    """Within its own org a role lacking a permission gets 403; one holding it does not."""
    t = two_orgs["acme"]
    run = f"{V1}/orgs/acme/runs/{two_orgs['run']}"
    denied = [
        ("viewer", "POST", f"{V1}/orgs/acme/workspaces/net/runs", {"type": "plan"}),
        ("viewer", "POST", f"{run}/cancel", None),
        ("viewer", "POST", f"{run}/approve", None),
        ("viewer", "POST", f"{run}/discard", None),
        ("approver", "POST", f"{V1}/orgs/acme/workspaces", {"name": "x", "repository": "r"}),
        ("approver", "POST", f"{V1}/orgs/acme/tokens", None),
    ]
    for role, method, path, body in denied:
        kw: dict[str, Any] = {"json": body} if body is not None else {}
        (await http.call(method, path, token=t[role], **kw)).problem("forbidden", 403)
    # the same calls with enough rank pass the role check (and reach the domain)
    assert (await http.post(f"{run}/approve", token=t["approver"])).status == 409
    assert (await http.post(f"{run}/approve", token=t["operator"])).status == 409
    assert (await http.post(f"{run}/cancel", token=t["operator"])).status == 200
    assert (await http.get(f"{V1}/orgs/acme/workspaces", token=t["viewer"])).status == 200


async def test_every_route_needs_a_valid_bearer_token(http: Http) -> None:
    """Without a token, with another scheme or with an unknown token: 401 and a Bearer
    challenge, on every route but /healthz, /readyz and the API reference."""
    http.api.token_wait = 0.2
    for method, template in sorted(_routes()):
        if template in PUBLIC:
            continue
        path = template.format(
            org="acme",
            ws="net",
            run=RUN_ID,
            name="token",
            token="01jtokenofanotherorg00000a",
            folder="f",
            group="g",
            user="u-1",
            team="t",
            policy="p",
            template="t",
            notification="01jnotifofanotherorg00000a",
            schedule="01jschedofanotherorg00000a",
            slack_id="U0BOB",
            connection="01jconnofanotherorg000000a",
            destination="01jdestofanotherorg000000a",
            source="other",
            stack="s",
            stack_run="01jstackrunofanotherorg0a",
            id="sv-acme.net.1.0123456789abcdef",
            asset="swagger-ui.css",
        )
        for hdrs in ({}, {"Authorization": "Basic YTpi"}, {"Authorization": "Bearer rp_nope"}):
            a = await http.call(method, path, token=None, headers=hdrs)
            a.problem("unauthorized", 401)
            assert a.headers["WWW-Authenticate"].startswith("Bearer")


async def test_malformed_bodies_are_invalid_body(http: Http, two_orgs: dict[str, Any]) -> None:
    """Not JSON, not an object, an unknown field, a wrong type or a missing field: 400."""
    run = two_orgs["run"]
    posts = [
        ("/api/v1/orgs", {"name": 3}),
        ("/api/v1/orgs/acme/tokens", {"role": ["admin"]}),
        ("/api/v1/orgs/acme/workspaces", {"name": "x", "repository": "r", "variables": {"a": 1}}),
        ("/api/v1/orgs/acme/workspaces/net/runs", {"type": None}),
        (f"/api/v1/orgs/acme/runs/{run}/approve", {"acknowledged": "all"}),
        (f"/api/v1/orgs/acme/runs/{run}/discard", {"reason": 1}),
        (f"/api/v1/orgs/acme/runs/{run}/cancel", {"reason": False}),
    ]
    for path, wrong_type in posts:
        for bad in (b"{not json", b"[1, 2]", b'"text"', b'{"surprise": 1}'):
            (await http.post(path, data=bad)).problem("invalid-body", 400)
        (await http.post(path, json=wrong_type)).problem("invalid-body", 400)
    for path in ("/api/v1/orgs", "/api/v1/orgs/acme/workspaces/net/runs"):
        a = await http.post(path, json={})
        assert "missing required field" in a.problem("invalid-body", 400)["detail"]


async def test_malformed_ids_are_invalid_id(http: Http, two_orgs: dict[str, Any]) -> None:
    """Ids and names must be subject-safe tokens: anything else is a 422 invalid-id."""
    run = two_orgs["run"]
    bad_paths = [
        ("GET", "/api/v1/orgs/Acme"),
        ("GET", "/api/v1/orgs/acme/workspaces/net_1"),
        ("GET", "/api/v1/orgs/acme/runs/-x"),
        ("POST", "/api/v1/orgs/acme/runs/a*b/cancel"),
        ("GET", f"/api/v1/orgs/acme/runs/{'x' * 64}/events"),
        ("GET", f"/api/v1/orgs/ac%20me/runs/{run}"),
    ]
    for method, path in bad_paths:
        (await http.call(method, path)).problem("invalid-id", 422)
    (await http.post(f"{V1}/orgs", json={"name": "Big.Org"})).problem("invalid-id", 422)
    a = await http.post(f"{V1}/orgs/acme/workspaces", json={"name": "a b", "repository": "r"})
    a.problem("invalid-id", 422)


async def test_unknown_routes_and_methods_are_problems(http: Http) -> None:
    """No route is a 404 problem, a wrong method a 405 problem with Allow: never HTML."""
    (await http.get(f"{V1}/nothing/here")).problem("not-found", 404)
    a = await http.call("DELETE", f"{V1}/orgs/acme")
    a.problem("method-not-allowed", 405)
    assert "GET" in a.headers["Allow"]


async def test_an_unexpected_error_is_a_500_problem_without_details(
    http: Http, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug answers 500 problem details; the exception's text never reaches the client."""
    await http.org("acme")

    async def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("secret internals")

    monkeypatch.setattr(http.api.read.orgs, "get", broken)
    a = await http.get(f"{V1}/orgs/acme")
    a.problem("internal-error", 500)
    assert "secret" not in str(a.body) and "Traceback" not in str(a.body)


async def test_openapi_documents_exactly_the_routes(http: Http) -> None:
    """Every routed operation is documented and every documented one is routed; bodies
    forbid unknown fields; errors are problem details; the scheme is bearer."""
    a = await http.get(f"{V1}/openapi.json")
    assert a.status == 200
    doc = a.body
    assert doc["openapi"].startswith("3.1")
    documented = {(m.upper(), p) for p, ops in doc["paths"].items() for m in ops}
    assert documented == _routes()
    schemas = doc["components"]["schemas"]
    for path, ops in doc["paths"].items():
        for op in ops.values():
            for ref in _refs(op):
                assert _resolve(doc, ref) is not None, (path, ref)
            body = op.get("requestBody")
            if body:
                name = body["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[1]
                assert schemas[name]["additionalProperties"] is False, name
            params = {p["$ref"].rsplit("/", 1)[1] for p in op.get("parameters", [])}
            assert {seg.strip("{}") for seg in path.split("/") if seg.startswith("{")} <= params
    assert doc["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    assert doc["paths"]["/healthz"]["get"]["security"] == []
    assert doc["paths"]["/readyz"]["get"]["security"] == []
    assert set(schemas["Problem"]["required"]) == {"type", "title", "status", "detail"}


async def test_build_app_refuses_an_empty_admin_token(http: Http) -> None:
    """An empty admin token would let an empty bearer through: refuse to start."""
    with pytest.raises(ValueError):
        build_app(app=http.app, projector=http.api.projector, admin_token="")


def _refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        own = [node["$ref"]] if "$ref" in node else []
        return own + [r for v in node.values() for r in _refs(v)]
    if isinstance(node, list):
        return [r for v in node for r in _refs(v)]
    return []


def _resolve(doc: dict[str, Any], ref: str) -> Any:
    node: Any = doc
    for part in ref.removeprefix("#/").split("/"):
        node = node.get(part) if isinstance(node, dict) else None
    return node
