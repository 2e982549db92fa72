"""Single sign-on's configuration over HTTP (an organization's admin), and the kit the
web UI's sign-in uses (services/surfaces/ui/sso.py).

`PUT /api/v1/orgs/{org}/sso` `{"issuer", "client_id", "client_secret"?, "display_name"?,
"allowed_domains"?, "groups_claim"?, "group_rules"?, "require_email_verified"?}`: the body
is checked, then the issuer's address is judged (`RUNPLANE_SSO_ALLOW`, as notifications'
destinations are) and its discovery document fetched and checked (it must name exactly
this issuer) before anything is written; a refusal is 422 `invalid-sso-issuer` with the
`reason`. The client secret is write-only: sealed (services/app/sso.py), shown as
`(sensitive)`, never logged; a later PUT without it keeps it, `""` removes it (a public
client: PKCE alone). `GET` answers the configuration, `DELETE` turns single sign-on off
and purges the secret.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Annotated, Any

import aiohttp
import msgspec
from aiohttp import web

from events import sso
from events.values import SENSITIVE
from infra.oidc import OidcClient, OidcError
from services.app.sso import SignIn, SsoConfigs, sign_in_of
from services.app.sso_flows import SsoFlows
from services.processes.notifications import Refused
from services.processes.notifications.guard import KINDS, GuardedResolver, check_url
from services.surfaces.api.bodies import Body, read_body
from services.surfaces.api.common import command_answer, json_response, scope
from services.surfaces.api.context import API
from services.surfaces.api.problems import Problem
from services.surfaces.api.schemas import REF, STR, TIME, Doc, operation, problems
from services.surfaces.api.secrets import SECRETS

SSO = "/api/v1/orgs/{org}/sso"
ALLOW_ENV = "RUNPLANE_SSO_ALLOW"
NOTIFY_ALLOW_ENV = "RUNPLANE_NOTIFY_ALLOW"


def allow_from_env() -> frozenset[str]:
    """The address kinds an issuer may have besides public ones: `RUNPLANE_SSO_ALLOW`,
    else `RUNPLANE_NOTIFY_ALLOW` (comma lists of `loopback`, `private`)."""
    raw = os.environ.get(ALLOW_ENV, os.environ.get(NOTIFY_ALLOW_ENV, ""))
    return frozenset(k.strip() for k in raw.split(",") if k.strip() in KINDS)


@dataclass
class SsoKit:
    """What the API's routes and the web UI's sign-in share in one api process."""

    configs: SsoConfigs
    flows: SsoFlows
    oidc: OidcClient


def kit(
    request_app: web.Application, *, allow: frozenset[str], sign_in: SignIn | None = None
) -> SsoKit | None:
    """The kit over the API's App and secret store (None without the key: no sealing)."""
    store = request_app.get(SECRETS)
    if store is None:
        return None

    def connect() -> aiohttp.ClientSession:
        return aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(resolver=GuardedResolver(allow))
        )

    async def guard(url: str) -> None:
        try:
            await check_url(url, allow)
        except Refused as e:
            raise OidcError(str(e), reason="sso-issuer-refused") from e

    api = request_app[API]
    configs = SsoConfigs(store.nc, api.app, store.keyring)
    oidc = OidcClient(connect, guard)
    flows = SsoFlows(store.nc, configs, oidc, sign_in or sign_in_of(api.app))
    return SsoKit(configs=configs, flows=flows, oidc=oidc)


KIT: web.AppKey[SsoKit] = web.AppKey("runplane.sso", SsoKit)


def mount(
    web_app: web.Application,
    *,
    allow: frozenset[str] | None = None,
    sign_in: SignIn | None = None,
) -> None:
    """Single sign-on for the API's application (after its secret store is set): `allow`,
    the address kinds an identity provider may have besides public ones (None:
    `RUNPLANE_SSO_ALLOW`); `sign_in`, the identity hook a sign-in ends in (None: the
    App's `sign_in_user`)."""
    found = kit(web_app, allow=allow_from_env() if allow is None else allow, sign_in=sign_in)
    if found is not None:
        web_app[KIT] = found


def kit_of(request: web.Request) -> SsoKit:
    found = request.app.get(KIT)
    if found is None:
        raise Problem("unavailable", "single sign-on needs the encryption key; this api has none")
    return found


class RuleBody(Body, frozen=True, kw_only=True):
    group: Annotated[str, msgspec.Meta(min_length=1, max_length=sso.MAX_GROUP)]
    team: Annotated[str, msgspec.Meta(min_length=1, max_length=63)]


class SsoBody(Body, frozen=True, kw_only=True):
    issuer: Annotated[str, msgspec.Meta(min_length=1, max_length=sso.MAX_ISSUER)]
    client_id: Annotated[str, msgspec.Meta(min_length=1, max_length=255)]
    client_secret: Annotated[str, msgspec.Meta(max_length=1024)] | None = None
    display_name: Annotated[str, msgspec.Meta(max_length=64)] = ""
    allowed_domains: Annotated[list[str], msgspec.Meta(max_length=sso.MAX_DOMAINS)] = []
    groups_claim: Annotated[str, msgspec.Meta(min_length=1, max_length=64)] = "groups"
    group_rules: Annotated[list[RuleBody], msgspec.Meta(max_length=sso.MAX_RULES)] = []
    require_email_verified: bool = False


def _row(state: sso.SsoState, *, secret: bool) -> dict[str, Any]:
    return {
        "issuer": state.issuer,
        "client_id": state.client_id,
        "client_secret": SENSITIVE if secret else None,
        "display_name": state.display_name,
        "label": state.label,
        "allowed_domains": state.allowed_domains,
        "groups_claim": state.groups_claim,
        "group_rules": [{"group": r.group, "team": r.team} for r in state.group_rules],
        "require_email_verified": state.require_email_verified,
        "configured_at": state.configured_at.isoformat() if state.configured_at else None,
        "configured_by": state.configured_by,
    }


async def put_sso(request: web.Request) -> web.Response:
    """PUT .../sso: configure the organization's identity provider."""
    api, org, who = await scope(request, "org.access")
    body = await read_body(request, SsoBody)
    command = sso.ConfigureSso(
        actor=who.user,
        issuer=body.issuer,
        client_id=body.client_id,
        display_name=body.display_name,
        allowed_domains=[d.lower() for d in body.allowed_domains],
        groups_claim=body.groups_claim,
        group_rules=[sso.GroupRule(group=r.group, team=r.team) for r in body.group_rules],
        secret_changed=body.client_secret is not None,
        require_email_verified=body.require_email_verified,
    )
    sso.check_configuration(command)  # 422 before the provider is asked anything
    found = kit_of(request)
    await api.app.load_org(org)
    try:
        await found.oidc.discover(body.issuer, fresh=True)
    except OidcError as e:
        raise Problem("invalid-sso-issuer", str(e), reason=e.reason) from e
    if body.client_secret:
        await found.configs.put_secret(org, body.client_secret)
    elif body.client_secret == "":
        await found.configs.forget_secret(org)
    result = await found.configs.command(org, command)
    secret = bool(await found.configs.secret(org))
    return command_answer(_row(result.state, secret=secret), result.seq)


async def get_sso(request: web.Request) -> web.Response:
    _, org, _ = await scope(request, "org.access")
    found = kit_of(request)
    state = await found.configs.load(org)
    if not state.configured:
        raise Problem("not-found", f"organization {org} has no single sign-on")
    return json_response(_row(state, secret=bool(await found.configs.secret(org))))


async def delete_sso(request: web.Request) -> web.Response:
    _, org, who = await scope(request, "org.access")
    found = kit_of(request)
    result = await found.configs.command(org, sso.RemoveSso(actor=who.user))
    await found.configs.forget_secret(org)
    return web.Response(status=204, headers={"RP-Seq": str(result.seq)})


ROUTES = [
    web.put(SSO, put_sso),
    web.get(SSO, get_sso, allow_head=False),
    web.delete(SSO, delete_sso),
]


# ---------------------------------------------------------------- OpenAPI

_SSO: Doc = {
    "type": "object",
    "required": ["issuer", "client_id"],
    "properties": {
        "issuer": STR,
        "client_id": STR,
        "client_secret": {"anyOf": [{"const": SENSITIVE}, {"type": "null"}]},
        "display_name": STR,
        "label": STR,
        "allowed_domains": {"type": "array", "items": STR},
        "groups_claim": STR,
        "group_rules": {"type": "array", "items": {"$ref": REF.format(name="RuleBody")}},
        "require_email_verified": {"type": "boolean"},
        "configured_at": {"anyOf": [TIME, {"type": "null"}]},
        "configured_by": STR,
    },
}
SCHEMAS: dict[str, Doc] = {
    **msgspec.json.schema_components((SsoBody,), ref_template=REF)[1],
    "Sso": _SSO,
}
PATHS: dict[str, Doc] = {
    SSO: {
        "put": operation(
            "putSso",
            "Configure single sign-on (OpenID Connect)",
            (200, "Sso"),
            params=("org",),
            body="SsoBody",
            errors=(400, 403, 404, 422),
        ),
        "get": operation(
            "getSso",
            "Single sign-on's configuration (the secret never shown)",
            (200, "Sso"),
            params=("org",),
            errors=(403, 404),
        ),
        "delete": {
            "operationId": "deleteSso",
            "summary": "Turn single sign-on off",
            "parameters": [{"$ref": "#/components/parameters/org"}],
            "responses": {"204": {"description": "removed"}, **problems(403, 404)},
        },
    },
}
