"""Service discovery and the handshake: what the CLI reads before anything else.

- `GET /.well-known/terraform.json`: the TFE API for every version of it the CLI asks
  for (the `remote` backend of Terraform 1.0 looks up `tfe.v2.1`, the `cloud` block
  `tfe.v2`), `state.v2` (TF_FORCE_LOCAL_BACKEND) and `login.v1` (services/tfe/login.py:
  `terraform login` by authorization code with PKCE; without it the CLI would ask for a
  token made in runplane, which it checks with `GET /account/details`).
- `GET /api/v2/ping`: 204 with `TFP-API-Version` (go-tfe, and so the CLI, refuses a
  server below 2.5 or without one) and `TFP-AppName`.
"""

from __future__ import annotations

from aiohttp import web

from services.tfe.jsonapi import response

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


async def well_known(request: web.Request) -> web.Response:
    from services.tfe.login import SERVICE

    return web.json_response({**SERVICES, "login.v1": SERVICE})


async def ping(request: web.Request) -> web.Response:
    return response(None, status=204, headers=HANDSHAKE)
