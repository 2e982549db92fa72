"""runplane as an OpenID Connect issuer of workload identity tokens: discovery and keys.

- `GET /.well-known/openid-configuration`: the issuer (the deployment's `--public-url`),
  where its keys are, and what its tokens are (docs/workload-identity.md);
- `GET /.well-known/jwks.json`: the public keys (infra/signing.py), never a private member.

Both unauthenticated, as a cloud fetches them, and cached briefly: relying parties may
keep the keys `JWKS_MAX_AGE` (a new key is published longer than that before it signs),
and each api process asks NATS at most every `CACHE_S` (infra/signing.py). Keys that
cannot be read are a 503 problem, never an empty set a cloud would cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from aiohttp import web

from events.workload import CLAIMS
from infra.signing import ALG, JWKS_MAX_AGE, SigningError, SigningKeys
from services.surfaces.api.common import json_response
from services.surfaces.api.middleware import SELF_AUTHENTICATED
from services.surfaces.api.problems import Problem

DISCOVERY = "/.well-known/openid-configuration"
JWKS = "/.well-known/jwks.json"
KEYS: web.AppKey[SigningKeys] = web.AppKey("runplane.signing_keys", SigningKeys)
ISSUER: web.AppKey[str] = web.AppKey("runplane.issuer", str)
_CACHE = {"Cache-Control": f"public, max-age={JWKS_MAX_AGE}"}


def document(issuer: str) -> dict[str, Any]:
    """The issuer's discovery document (OpenID Connect Discovery 1.0, section 3)."""
    return {
        "issuer": issuer,
        "jwks_uri": issuer + JWKS,
        "response_types_supported": ["id_token"],
        "subject_types_supported": ["public"],
        "id_token_signing_alg_values_supported": [ALG],
        "claims_supported": list(CLAIMS),
        "scopes_supported": ["openid"],
    }


async def discovery(request: web.Request) -> web.Response:
    return _cached(json_response(document(request.app[ISSUER])))


async def jwks(request: web.Request) -> web.Response:
    try:
        found = await request.app[KEYS].jwks()
    except SigningError as e:
        raise Problem("unavailable", "the signing keys cannot be read; try again") from e
    return _cached(json_response(found))


def _cached(response: web.Response) -> web.Response:
    response.headers.update(_CACHE)
    return response


ROUTES = [web.get(DISCOVERY, discovery, allow_head=False), web.get(JWKS, jwks, allow_head=False)]


@dataclass(frozen=True)
class Issuer:
    """What the API publishes: the deployment's keys, as the issuer `url`."""

    keys: SigningKeys
    url: str


def mount(web_app: web.Application, issuer: Issuer | None) -> None:
    """Serve discovery and keys (None: not at all); both routes are public (they
    authenticate nothing). Call it after the web UI's `mount`, which sets
    `SELF_AUTHENTICATED` rather than adding to it."""
    if issuer is None:
        return
    web_app[KEYS] = issuer.keys
    web_app[ISSUER] = issuer.url.rstrip("/")
    web_app.add_routes(ROUTES)
    own = web_app.get(SELF_AUTHENTICATED, frozenset())
    web_app[SELF_AUTHENTICATED] = frozenset(own | {DISCOVERY, JWKS})
