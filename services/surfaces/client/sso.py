"""`runplane login URL --sso ORG`: a token through the browser, as `terraform login` gets
one (login.v1: OAuth's authorization code with PKCE, services/surfaces/tfe/login.py), the
person signing in with their organization's identity provider on the way.

The CLI makes a PKCE verifier (S256 challenge) and a `state`, listens on the loopback
(`http://localhost:<port>/login`, the first free port of 10000-10010, the range the
server's consent page accepts), and sends the browser to the server's single sign-on
(`/app/sso/start?org=ORG`) with the consent page, client `runplane-cli`, as where to go
after. The provider signs the person in; runplane's consent page asks them; allowed, the
browser comes back to the listener with a code, which the CLI exchanges with its verifier
at `/app/oauth/token` for a personal token of the signed-in person (their access, never
more; ending when their sign-in's token does). Only a request to `/login` carrying the
CLI's own `state` is taken: anything else on the port is answered 400 and ignored.

`--no-browser` prints the URL to open (on this machine or, with a tunnel to the port,
another) instead of starting one. A terminal without a browser uses `--device` instead
(services/surfaces/client/device.py): runplane's own device authorization grant, not
the provider's (runplane, not the provider, issues the token, and the tested provider,
oidc-provider-mock, has no device endpoint).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import errno
import hashlib
import html
import secrets
import sys
import webbrowser
from collections.abc import AsyncIterator
from urllib.parse import urlencode

import aiohttp
import msgspec
from aiohttp import web

from services.surfaces.client.errors import ClientError
from services.surfaces.client.http import tls_context

CLIENT_ID = "runplane-cli"
PORTS = range(10000, 10011)  # login.v1's range (services/surfaces/tfe/login.py PORTS)
HOSTS = ("127.0.0.1", "::1")  # what `localhost` is, both families where there are both
AUTHZ, TOKEN, START = "/app/oauth/authorize", "/app/oauth/token", "/app/sso/start"
WAIT_S = 600.0  # for the person to sign in and allow
_TIMEOUT = aiohttp.ClientTimeout(total=60, connect=10)
_DONE = (
    "<!doctype html><html><head><meta charset='utf-8'><title>runplane</title></head>"
    "<body><h1>{title}</h1><p>{detail}</p></body></html>"
)


def challenge_of(verifier: str) -> str:
    digest = hashlib.sha256(verifier.encode()).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


class _Listener:
    """The loopback listener: the first answer carrying our state (code or error)."""

    def __init__(self, state: str) -> None:
        self.state = state
        self.answer: asyncio.Future[tuple[str, str]] = asyncio.get_running_loop().create_future()

    async def handle(self, request: web.Request) -> web.Response:
        q = request.query
        if request.path != "/login" or not secrets.compare_digest(q.get("state", ""), self.state):
            return _page("Not runplane's login", "This is no answer to this login.", 400)
        if not self.answer.done():
            self.answer.set_result((q.get("code", ""), q.get("error", "")))
        if q.get("error") or not q.get("code"):
            return _page("Login refused", "runplane's CLI was not given a token.", 200)
        return _page("runplane's CLI is logged in", "You may close this tab.", 200)


def _page(title: str, detail: str, status: int) -> web.Response:
    text = _DONE.format(title=html.escape(title), detail=html.escape(detail))
    headers = {"Cache-Control": "no-store", "Referrer-Policy": "no-referrer"}
    return web.Response(text=text, status=status, content_type="text/html", headers=headers)


@contextlib.asynccontextmanager
async def _listening(listener: _Listener) -> AsyncIterator[int]:
    """Serve `listener` on the first port of PORTS free on the loopback; its port."""
    app = web.Application()
    app.router.add_get("/{tail:.*}", listener.handle)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    try:
        for port in PORTS:
            if await _bind(runner, port):
                yield port
                return
        raise ClientError(
            f"no free port in {PORTS.start}-{PORTS.stop - 1} on localhost for the browser "
            "to come back to",
            kind="login",
        )
    finally:
        await runner.cleanup()


async def _bind(runner: web.AppRunner, port: int) -> bool:
    """Listen on `port` of every loopback address this host has; False if it is taken."""
    sites: list[web.TCPSite] = []
    for host in HOSTS:
        site = web.TCPSite(runner, host, port, reuse_address=False)
        try:
            await site.start()
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                for started in sites:
                    await started.stop()
                return False
            if host == HOSTS[0]:
                raise ClientError(f"cannot listen on localhost: {e.strerror}", kind="login") from e
            continue  # no IPv6 loopback here: 127.0.0.1 is localhost
        sites.append(site)
    return True


def authorization_url(url: str, org: str, *, port: int, challenge: str, state: str) -> str:
    """Where the browser goes: the organization's single sign-on, then the consent page."""
    query = {
        "client_id": CLIENT_ID,
        "response_type": "code",
        "redirect_uri": f"http://localhost:{port}/login",
        "code_challenge": challenge,
        "code_challenge_method": "S256",
        "state": state,
    }
    consent = f"{AUTHZ}?{urlencode(query)}"
    return f"{url}{START}?{urlencode({'org': org, 'next': consent})}"


async def sso_token(url: str, org: str, *, ca_file: str = "", browser: bool = True) -> str:
    """A personal token of whoever signs in to `org` in the browser."""
    verifier = secrets.token_urlsafe(64)
    state = secrets.token_urlsafe(24)
    listener = _Listener(state)
    async with _listening(listener) as port:
        where = authorization_url(
            url, org, port=port, challenge=challenge_of(verifier), state=state
        )
        print(f"Open this URL in a browser to sign in to {org}:\n\n    {where}\n", file=sys.stderr)
        if browser and not await asyncio.to_thread(webbrowser.open, where):
            print("(no browser could be started: open the URL yourself)", file=sys.stderr)
        print(f"Waiting for the browser on localhost:{port} ...", file=sys.stderr, flush=True)
        try:
            code, error = await asyncio.wait_for(listener.answer, WAIT_S)
        except TimeoutError as e:
            raise ClientError(f"no sign-in within {WAIT_S:.0f} s", kind="login") from e
    if error or not code:
        raise ClientError(f"the login was refused in the browser ({error[:64]})", kind="login")
    redirect = f"http://localhost:{port}/login"
    return await _exchange(url, code, verifier, redirect, ca_file)


async def _exchange(url: str, code: str, verifier: str, redirect: str, ca_file: str) -> str:
    """The code and its verifier for the token, at the server's token endpoint."""
    form = {
        "grant_type": "authorization_code",
        "client_id": CLIENT_ID,
        "code": code,
        "code_verifier": verifier,
        "redirect_uri": redirect,
    }
    connector = aiohttp.TCPConnector(ssl=tls_context(ca_file))
    try:
        async with (
            aiohttp.ClientSession(timeout=_TIMEOUT, connector=connector) as http,
            http.post(url + TOKEN, data=form, allow_redirects=False) as resp,
        ):
            raw = await resp.content.read(64 * 1024)
            status = resp.status
    except (aiohttp.ClientError, TimeoutError) as e:
        raise ClientError(f"cannot reach {url} for the token ({e})", kind="unreachable") from e
    try:
        answer = msgspec.json.decode(raw)
    except msgspec.DecodeError as e:
        raise ClientError(f"bad answer from {url}: HTTP {status}", kind="bad-answer") from e
    token = answer.get("access_token") if isinstance(answer, dict) else None
    if status != 200 or not isinstance(token, str) or not token:
        why = answer.get("error_description") if isinstance(answer, dict) else None
        raise ClientError(f"no token from {url}: {str(why)[:200]} (HTTP {status})", kind="login")
    return token
