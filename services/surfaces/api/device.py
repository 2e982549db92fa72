"""The device authorization grant's endpoints (RFC 8628), for `runplane login --device`
on a terminal without a browser (services/surfaces/client/device.py); the browser's side
is the web UI's `/device` (services/surfaces/ui/device.py). The grants are
services/app/device.py's.

`POST /oauth/device/code` (form or JSON: `organization`, `client_id` default
`runplane-cli`) answers RFC 8628 3.2's JSON: `device_code`, `user_code` (`XXXX-XXXX`),
`verification_uri` (`<--public-url>/device`), `verification_uri_complete`, `expires_in`,
`interval`. An organization that does not exist gets the same answer (nothing tells which
organizations exist), and its grant can never be approved: only a signed-in member of the
grant's organization approves, and no session exists for an organization that does not.
Grants are made at most `PER_ADDRESS` a minute per client address (an IPv6 address's
/64), per api process (429 `rate-limited`); a malformed request is 400 `invalid-body`.
Both are problem details with the OAuth `error` too.

`POST /oauth/device/token` (`grant_type=urn:ietf:params:oauth:grant-type:device_code`,
`device_code`, `client_id`) answers RFC 8628 3.5's errors as `{"error", ...}` with 400
(`authorization_pending`, `slow_down`, `access_denied`, `expired_token`,
`invalid_grant`), and once approved, once, a personal token of the approving user for
the grant's organization: the kind `runplane login --sso` ends with
(services/surfaces/tfe/login.py `issue_token`: at most the user's access, ending when
their sign-in's token does, refused once they are suspended), recorded as
`org.token_issued` by that user and named after the client and the device's address.
"""

from __future__ import annotations

import ipaddress
import time
from collections import deque
from urllib.parse import urlencode

import msgspec
import structlog
from aiohttp import web

from events import members as mb
from events.errors import NotFound
from infra.directget import InfraError
from services.app.device import MAX_CLIENT_ID, DeviceError, DeviceGrants, shown
from services.surfaces.api.audit import client_address
from services.surfaces.api.context import API
from services.surfaces.api.middleware import SELF_AUTHENTICATED
from services.surfaces.api.problems import Problem
from services.surfaces.tfe.login import CLIENTS, issue_token
from services.surfaces.ui.sso import public_base
from services.surfaces.ui.web import read_form

CODE, TOKEN, VERIFY = "/oauth/device/code", "/oauth/device/token", "/device"
GRANT_TYPE = "urn:ietf:params:oauth:grant-type:device_code"
DEFAULT_CLIENT = "runplane-cli"
PER_ADDRESS = 10  # grants a client address may ask for in WINDOW_S
WINDOW_S = 60.0
MAX_BODY = 16 * 1024
MAX_ORG = 100
DEVICE: web.AppKey[DeviceGrants] = web.AppKey("runplane.device", DeviceGrants)
PUBLIC_URL: web.AppKey[str] = web.AppKey("runplane.device.public_url", str)

log = structlog.get_logger("runplane.device")


class Window:
    """At most `limit` events per key in the last `window` seconds (one process's)."""

    def __init__(self, limit: int, window: float) -> None:
        self.limit, self.window = limit, window
        self.seen: dict[str, deque[float]] = {}

    def allow(self, key: str, now: float) -> bool:
        if len(self.seen) > 10_000:  # forget the quiet ones
            self.seen = {k: v for k, v in self.seen.items() if v and now - v[-1] < self.window}
        times = self.seen.setdefault(key, deque())
        while times and now - times[0] >= self.window:
            times.popleft()
        if len(times) >= self.limit:
            return False
        times.append(now)
        return True


LIMIT: web.AppKey[Window] = web.AppKey("runplane.device.limit", Window)


def limit_key(address: str) -> str:
    """What the grants' limit counts by: an IPv6 address's /64 (a host holds one whole
    and draws a new address per request for nothing), an IPv4 address itself (mapped
    into IPv6 or not), anything else as given."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


def client_label(client_id: str) -> str:
    """What a person is told asks: a known client's name, else its id as given."""
    return CLIENTS.get(client_id, f"a client calling itself {client_id!r}")


async def _fields(request: web.Request) -> dict[str, str]:
    """The request's form or JSON object, as text fields."""
    if request.content_type == "application/json":
        raw = await request.content.read(MAX_BODY + 1)
        if len(raw) > MAX_BODY:
            raise Problem("body-too-large", f"a body is at most {MAX_BODY} bytes")
        try:
            found = msgspec.json.decode(raw) if raw else {}
        except msgspec.DecodeError as e:
            raise Problem("invalid-body", "the body is not JSON", error="invalid_request") from e
        if not isinstance(found, dict):
            raise Problem("invalid-body", "the body is not an object", error="invalid_request")
        return {str(k): v for k, v in found.items() if isinstance(v, str)}
    return {k: str(v) for k, v in (await read_form(request)).items()}


def _checked(value: str, what: str, limit: int) -> str:
    if not value or len(value) > limit or not value.isprintable():
        raise Problem(
            "invalid-body", f"{what} is 1 to {limit} printable characters", error="invalid_request"
        )
    return value


async def device_code(request: web.Request) -> web.Response:
    """POST /oauth/device/code: a new grant (RFC 8628 3.1, 3.2)."""
    address = client_address(request)
    if not request.app[LIMIT].allow(limit_key(address), time.monotonic()):
        raise Problem(
            "rate-limited",
            f"at most {PER_ADDRESS} device logins a minute from one address",
            error="slow_down",
            headers={"Retry-After": str(int(WINDOW_S))},
        )
    fields = await _fields(request)
    org = _checked(fields.get("organization", "").strip(), "organization", MAX_ORG)
    client_id = _checked(fields.get("client_id", DEFAULT_CLIENT), "client_id", MAX_CLIENT_ID)
    grants = request.app[DEVICE]
    device, grant = await grants.create(org, client_id, address)
    log.info("device_grant_created", org=org, client=client_id, address=address)
    verify = (request.app.get(PUBLIC_URL) or public_base(request)) + VERIFY
    complete = verify + "?" + urlencode({"user_code": shown(grant.user_code), "org": org})
    answer = {
        "device_code": device,
        "user_code": shown(grant.user_code),
        "verification_uri": verify,
        "verification_uri_complete": complete,
        "expires_in": int(grants.ttl),
        "interval": int(grant.interval),
    }
    return web.json_response(answer, headers={"Cache-Control": "no-store"})


def _error(error: str, detail: str, status: int = 400) -> web.Response:
    return web.json_response(
        {"error": error, "error_description": detail},
        status=status,
        headers={"Cache-Control": "no-store"},
    )


async def device_token(request: web.Request) -> web.Response:
    """POST /oauth/device/token: the client's poll (RFC 8628 3.4, 3.5)."""
    try:
        fields = await _fields(request)
    except Problem as p:
        return _error("invalid_request", p.detail)
    if fields.get("grant_type") != GRANT_TYPE:
        return _error("unsupported_grant_type", f"only {GRANT_TYPE}")
    client_id = fields.get("client_id", DEFAULT_CLIENT)
    try:
        grant = await request.app[DEVICE].poll(fields.get("device_code", "")[:200], client_id)
    except DeviceError as e:
        return _error(e.error, str(e))
    except InfraError as e:
        log.warning("device_grants_unavailable", error=repr(e))
        return _error("temporarily_unavailable", "try again", status=503)
    address = grant.address
    name = f"{CLIENTS.get(client_id, client_id)} device login from {address}"[:100]
    try:
        issued = await issue_token(
            request.app[API], grant.org, grant.user, grant.role, grant.token_expires,
            kind=grant.kind, owner=grant.owner, level=grant.level, name=name,
        )  # fmt: skip
    except (mb.Suspended, NotFound) as e:  # suspended (or gone) since the approval
        log.info("device_grant_refused", org=grant.org, user=grant.user, reason=str(e))
        return _error("access_denied", str(e))
    log.info(
        "device_grant_redeemed", org=grant.org, user=grant.user, client=client_id, address=address
    )
    return web.json_response(
        {"access_token": issued, "token_type": "Bearer"}, headers={"Cache-Control": "no-store"}
    )


ROUTES = [web.post(CODE, device_code), web.post(TOKEN, device_token)]


def mount(
    web_app: web.Application, grants: DeviceGrants | None = None, *, public_url: str = ""
) -> None:
    """Add the endpoints (after the web UI: they add to the routes that authenticate
    themselves). `grants`: the bucket's grants (None: over the API's NATS connection).
    `public_url`: the deployment's (`--public-url`), the verification URI's base; ""
    `RUNPLANE_PUBLIC_URL`, else the URL the request reached."""
    web_app[DEVICE] = grants or DeviceGrants(web_app[API].app.store.nc)
    web_app[PUBLIC_URL] = public_url.rstrip("/")
    web_app[LIMIT] = Window(PER_ADDRESS, WINDOW_S)
    web_app.add_routes(ROUTES)
    own = web_app.get(SELF_AUTHENTICATED, frozenset())
    web_app[SELF_AUTHENTICATED] = frozenset(own | {r.path for r in ROUTES})
