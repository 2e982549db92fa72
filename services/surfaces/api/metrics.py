"""`GET /metrics`: the deployment's figures for Prometheus (projections/metrics.py).

They are the whole deployment's (every organization's runs, the consumers' lag), so they
are answered only to the admin token or to the metrics token (`RUNPLANE_METRICS_TOKEN`:
a credential that opens this route and nothing else, for the scraper, which then needs
no admin token). An organization's token, even its admin's, gets 403: one tenant must not
learn from the totals how busy the others are. No label names a tenant's things either.
"""

from __future__ import annotations

import hashlib
import hmac

from aiohttp import web
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from projections.metrics import Metrics
from services.surfaces.api.auth import PRINCIPAL, authenticate, bearer
from services.surfaces.api.context import API
from services.surfaces.api.problems import Problem

METRICS: web.AppKey[Metrics] = web.AppKey("runplane.metrics", Metrics)
# sha256 of the metrics token (b"": none; only the admin token opens /metrics)
METRICS_TOKEN: web.AppKey[bytes] = web.AppKey("runplane.metrics_token", bytes)


def token_digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest() if token else b""


async def metrics(request: web.Request) -> web.Response:
    await _allowed(request)
    body = await request.app[METRICS].render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_PLAIN_0_0_4})


async def _allowed(request: web.Request) -> None:
    """The metrics token, or a principal of every organization (the admin token)."""
    header = request.headers.get("Authorization")
    digest = request.app.get(METRICS_TOKEN, b"")
    if digest and hmac.compare_digest(hashlib.sha256(bearer(header).encode()).digest(), digest):
        return
    who = await authenticate(request.app[API], header)
    request[PRINCIPAL] = who
    if not who.superuser:
        raise Problem(
            "forbidden",
            "the metrics are the deployment's: they need the admin token or the metrics token",
        )
