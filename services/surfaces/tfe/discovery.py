"""Service discovery and the handshake: what the CLI reads before anything else.

- `GET /.well-known/terraform.json`: the TFE API for every version of it the CLI asks
  for (the `remote` backend of Terraform 1.0 looks up `tfe.v2.1`, the `cloud` block
  `tfe.v2`), `state.v2` (TF_FORCE_LOCAL_BACKEND) and `login.v1` (services/surfaces/tfe/login.py:
  `terraform login` by authorization code with PKCE). A deployment started with
  `--terraform-login token` (`BROWSER_LOGIN` off) leaves login.v1 out: the CLI then
  prints `/app/settings/tokens` (services/surfaces/ui/tokens.py), asks for the token made there
  and checks it with `GET /account/details`.
- `GET /api/v2/ping`: 204 with `TFP-API-Version` (go-tfe, and so the CLI, refuses a
  server below 2.5 or without one) and `TFP-AppName`.
"""

from __future__ import annotations

from aiohttp import web

from services.surfaces.tfe.jsonapi import response
from services.surfaces.tfe.login import SERVICE

BASE = "/api/v2/"
API_VERSION = "2.5"
APP_NAME = "runplane"
TFE_VERSION = "v202107-1"  # the TFE release whose API this slice follows

SERVICES = {"tfe.v2": BASE, "tfe.v2.1": BASE, "tfe.v2.2": BASE, "state.v2": BASE}
HANDSHAKE = {
    "TFP-API-Version": API_VERSION,
    "TFP-AppName": APP_NAME,
    "X-TFE-Version": TFE_VERSION,
}
# Whether `terraform login` is offered login.v1 (a browser signed in to the web UI
# allows it) or, off, asks for a token pasted from `/app/settings/tokens`.
BROWSER_LOGIN: web.AppKey[bool] = web.AppKey("runplane.tfe.browser_login", bool)
LOGIN_MODES = ("browser", "token")


async def well_known(request: web.Request) -> web.Response:
    if not request.app.get(BROWSER_LOGIN, True):
        return web.json_response(SERVICES)
    return web.json_response({**SERVICES, "login.v1": SERVICE})


async def ping(request: web.Request) -> web.Response:
    return response(None, status=204, headers=HANDSHAKE)
