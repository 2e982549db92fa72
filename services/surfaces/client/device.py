"""`runplane login URL --device --org ORG`: a token by the device authorization grant
(RFC 8628), for a terminal without a browser, runplane being the authorization server
(services/surfaces/api/device.py).

The CLI asks `/oauth/device/code` for a grant of ORG and prints one line: the page to
open, in a browser on any machine, and the code to enter there (and the page with the
code in it). The person signs in there (single sign-on or a token), checks the request
and approves it; meanwhile the CLI polls `/oauth/device/token` every `interval` seconds
(5 more after each `slow_down`), and ends with a personal token of that person (their
access, never more), or with one line saying it was denied or expired.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import aiohttp
import msgspec

from services.surfaces.client.errors import ClientError
from services.surfaces.client.http import tls_context
from services.surfaces.client.output import short

CLIENT_ID = "runplane-cli"
CODE, TOKEN = "/oauth/device/code", "/oauth/device/token"
GRANT_TYPE = "urn:ietf:params:oauth:grant-type:device_code"
SLOW_DOWN_S = 5.0
MAX_FAILURES = 5  # polls in a row that reach no answer before giving up
_TIMEOUT = aiohttp.ClientTimeout(total=30, connect=10)
_ENDED = {
    "access_denied": "the login was denied in the browser",
    "expired_token": "the code expired before it was approved: run runplane login again",
}


async def _post(http: aiohttp.ClientSession, url: str, form: dict[str, str]) -> tuple[int, Any]:
    async with http.post(url, data=form, allow_redirects=False) as resp:
        raw = await resp.content.read(64 * 1024)
        status = resp.status
    try:
        return status, msgspec.json.decode(raw)
    except msgspec.DecodeError as e:
        raise ClientError(f"bad answer from {url}: HTTP {status}", kind="bad-answer") from e


def _text(answer: dict[str, Any], key: str) -> str:
    value = answer.get(key)
    if not isinstance(value, str) or not value:
        raise ClientError(f"bad answer from the server: no {key}", kind="bad-answer")
    return value


def _number(answer: dict[str, Any], key: str, default: float) -> float:
    value = answer.get(key, default)
    return float(value) if isinstance(value, int | float) and 0 < value <= 3600 else default


async def device_token(url: str, org: str, *, ca_file: str = "") -> str:
    """A personal token of whoever approves this device's code for `org` in a browser."""
    connector = aiohttp.TCPConnector(ssl=tls_context(ca_file))
    async with aiohttp.ClientSession(timeout=_TIMEOUT, connector=connector) as http:
        try:
            status, answer = await _post(
                http, url + CODE, {"organization": org, "client_id": CLIENT_ID}
            )
        except (aiohttp.ClientError, TimeoutError) as e:
            raise ClientError(f"cannot reach {url} ({e})", kind="unreachable") from e
        if status != 200 or not isinstance(answer, dict):
            why = answer.get("detail") if isinstance(answer, dict) else None
            raise ClientError(f"no device login from {url}: {why} (HTTP {status})", kind="login")
        device_code = _text(answer, "device_code")
        verify, code = _text(answer, "verification_uri"), _text(answer, "user_code")
        complete = answer.get("verification_uri_complete")
        also = f" (or open {short(complete, 300)})" if isinstance(complete, str) else ""
        print(f"Open {short(verify, 300)} and enter {short(code, 20)}{also}", file=sys.stderr)
        sys.stderr.flush()
        interval = _number(answer, "interval", 5.0)
        deadline = asyncio.get_running_loop().time() + _number(answer, "expires_in", 600.0)
        return await _poll(http, url, device_code, interval, deadline)


async def _poll(
    http: aiohttp.ClientSession, url: str, device_code: str, interval: float, deadline: float
) -> str:
    """Poll until a token, a denial or the end (RFC 8628 3.4, 3.5)."""
    form = {"grant_type": GRANT_TYPE, "device_code": device_code, "client_id": CLIENT_ID}
    failures = 0
    loop = asyncio.get_running_loop()
    while loop.time() < deadline:
        await asyncio.sleep(interval)
        try:
            status, answer = await _post(http, url + TOKEN, form)
        except (aiohttp.ClientError, TimeoutError, ClientError) as e:
            failures += 1
            if failures >= MAX_FAILURES:
                raise ClientError(f"cannot reach {url} ({e})", kind="unreachable") from e
            continue
        failures = 0
        error = answer.get("error") if isinstance(answer, dict) else None
        if status == 200 and isinstance(answer, dict):
            return _text(answer, "access_token")
        if error == "authorization_pending" or status >= 500:
            continue
        if error == "slow_down":
            interval += SLOW_DOWN_S
            continue
        if isinstance(error, str) and error in _ENDED:
            raise ClientError(_ENDED[error], kind="login")
        why = answer.get("error_description") if isinstance(answer, dict) else None
        raise ClientError(f"no token from {url}: {error}: {why} (HTTP {status})", kind="login")
    raise ClientError(_ENDED["expired_token"], kind="login")
