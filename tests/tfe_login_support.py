"""`terraform login`'s browser side (login.v1, services/surfaces/tfe/login.py) for the
tests: a PKCE verifier and challenge, a browser signed in to the web UI, the consent
form allowed for a code, and the code exchanged for a token at the CLI's redirect.
Holds no tests itself."""

from __future__ import annotations

import base64
import hashlib
import html
import re
import secrets
from typing import Any
from urllib.parse import parse_qs, urlencode, urlsplit

from tests.tfe_support import Tfe

REDIRECT = "http://localhost:10003/login"


def _pkce() -> tuple[str, str]:
    verifier = secrets.token_urlsafe(48)
    digest = hashlib.sha256(verifier.encode()).digest()
    return verifier, base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def _query(challenge: str, **change: str) -> dict[str, str]:
    return {
        "client_id": "terraform-cli",
        "response_type": "code",
        "redirect_uri": REDIRECT,
        "code_challenge": challenge,
        "code_challenge_method": "S256",
        "state": "st4te",
        **change,
    }


async def _signin(tfe: Tfe, token: str, org: str = "") -> None:
    """Sign the test client's browser in to the web UI with `token`."""
    async with tfe.client.get("/", headers={"Accept": "text/html"}) as r:
        csrf = re.search(r'name="csrf" value="([^"]+)"', await r.text())
    assert csrf
    form = {"token": token, "csrf": csrf.group(1), "org": org}
    async with tfe.client.post("/signin", data=form, allow_redirects=False) as r:
        assert r.status == 303, await r.text()


async def _consent(tfe: Tfe, query: dict[str, str]) -> tuple[int, str]:
    async with tfe.client.get("/app/oauth/authorize?" + urlencode(query)) as r:
        return r.status, await r.text()


async def _allow(tfe: Tfe, page: str, **change: str) -> tuple[int, str]:
    """Post the consent form of `page` (fields changed as told): status, Location."""
    fields = {k: html.unescape(v) for k, v in re.findall(r"name='([^']+)' value='([^']*)'", page)}
    fields.update({"decision": "allow", **change})
    async with tfe.client.post("/app/oauth/authorize", data=fields, allow_redirects=False) as r:
        return r.status, r.headers.get("Location", "")


async def _code(tfe: Tfe, challenge: str) -> str:
    status, page = await _consent(tfe, _query(challenge))
    assert status == 200, page
    status, back = await _allow(tfe, page)
    assert status == 303 and back.startswith(REDIRECT + "?"), back
    answer = parse_qs(urlsplit(back).query)
    assert answer["state"] == ["st4te"]
    return answer["code"][0]


async def _exchange(tfe: Tfe, code: str, verifier: str, **extra: str) -> tuple[int, Any]:
    form = {
        "grant_type": "authorization_code",
        "code": code,
        "code_verifier": verifier,
        "redirect_uri": REDIRECT,
        **extra,
    }
    async with tfe.client.post("/app/oauth/token", data=form) as r:
        return r.status, await r.json()
