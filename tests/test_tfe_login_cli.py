"""`terraform login`'s fallback with the real Terraform 1.0.3 against `runplane up --tls
--terraform-login token` (here by RUNPLANE_TERRAFORM_LOGIN): discovery has no login.v1,
so the CLI prints runplane's `/app/settings/tokens`, asks for a token on its terminal
(a pseudo-terminal: it reads a secret), checks it with `GET /account/details` and saves
it; `init` of a `backend "remote"` workspace then works with it. A wrong token is
refused by the CLI (account/details answers 401) and nothing is saved."""

from __future__ import annotations

import asyncio
import json
import os
import re
import ssl
from pathlib import Path

import aiohttp
import pytest

from executor.terraform import default_binary
from services.surfaces.ui.tokens import TOKENS
from tests.tfe_cli_support import HCL, ok, plane, terraform
from tests.tfe_support import Terminal


async def _token_from_the_page(base: str, ca: Path, token: str) -> str:
    """A person's browser: signs in to runplane's web UI with `token`, opens the page the
    CLI printed and makes a token there; the token it shows."""
    ctx = ssl.create_default_context(cafile=str(ca))
    jar = aiohttp.CookieJar(unsafe=True)
    html = {"Accept": "text/html"}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx), cookie_jar=jar) as b:
        async with b.get(base + "/", headers=html) as r:
            csrf = re.search(r'name="csrf" value="([^"]+)"', await r.text())
        assert csrf
        signin = {"token": token, "csrf": csrf.group(1)}
        async with b.post(base + "/signin", data=signin, allow_redirects=False) as r:
            assert r.status == 303, await r.text()
        async with b.get(base + TOKENS + "?source=terraform-login", headers=html) as r:
            page = await r.text()
            assert r.status == 200 and "alice" in page, page
        csrf = re.search(r'name="csrf" value="([^"]+)"', page)
        assert csrf
        async with b.post(base + TOKENS, data={"csrf": csrf.group(1)}, headers=html) as r:
            made = await r.text()
            assert r.status == 200, made
            assert r.headers["Cache-Control"] == "no-store"
    found = re.search(r'<code id="new-token">([^<]+)</code>', made)
    assert found, made
    return found.group(1)


async def _login(binary: str, host: str, env: dict[str, str], paste: object) -> tuple[int, str]:
    """`terraform login HOST` on a pseudo-terminal: "yes" to its question, then at its
    token prompt what `paste()` gives (awaited once the CLI has printed the page's URL);
    its exit status and what it printed."""
    term = Terminal([binary, "login", "-no-color", host], env)
    try:
        await asyncio.to_thread(term.expect, rb"Enter a value:")
        term.send("yes\n")
        await asyncio.to_thread(
            term.expect, rb"https://[^\s]+/app/settings/tokens\?source=terraform-login"
        )
        await asyncio.to_thread(
            term.expect, rb"Token for " + re.escape(host.encode()) + rb":\s+Enter a value:"
        )
        assert callable(paste)
        term.send(await paste() + "\n")
        code = await asyncio.to_thread(term.finish)
        return code, term.text()
    finally:
        term.close()


async def test_terraform_login_takes_a_token_made_on_the_tokens_page(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RUNPLANE_TERRAFORM_LOGIN", "token")
    async with plane(tmp_path) as (api, host, ca, _):
        status, services = await api.call("GET", "/.well-known/terraform.json")
        assert status == 200 and "login.v1" not in services and services["tfe.v2"]
        await api.ok("POST", "/api/v1/orgs", {"name": "acme"})
        alice = await api.ok("POST", "/api/v1/orgs/acme/tokens", {"user": "alice", "role": "admin"})
        home = tmp_path / "home"
        (home / ".terraform.d").mkdir(parents=True)  # Terraform 1.0's login makes no directory
        creds = home / ".terraform.d" / "credentials.tfrc.json"
        env = {
            "PATH": os.environ["PATH"],
            "HOME": str(home),
            "SSL_CERT_FILE": str(ca),
            "CHECKPOINT_DISABLE": "1",
            "BROWSER": "/bin/false",
        }
        binary = str(default_binary())

        # a wrong token: account/details answers 401, the CLI says so and saves nothing
        async def wrong() -> str:
            return "rp_not-a-token-of-runplane"

        ctx = ssl.create_default_context(cafile=str(ca))
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx)) as s:
            headers = {"Authorization": f"Bearer {await wrong()}"}
            async with s.get(f"https://{host}/api/v2/account/details", headers=headers) as r:
                assert r.status == 401
        code, said = await _login(binary, host, env, wrong)
        assert code != 0, said
        assert "Error: Token is invalid: unauthorized" in said, said
        assert not creds.exists()

        # the page's token: checked, saved, and good for init
        made: list[str] = []

        async def from_the_page() -> str:
            made.append(await _token_from_the_page(f"https://{host}", ca, alice["token"]))
            return made[0]

        code, said = await _login(binary, host, env, from_the_page)
        assert code == 0, said
        assert "Retrieved token for user alice" in said, said
        assert f"Success! Logged in to Terraform Enterprise ({host})" in said, said
        saved = json.loads(creds.read_text())["credentials"][host]["token"]
        assert saved == made[0] and saved != alice["token"]
        tokens = (await api.ok("GET", "/api/v1/orgs/acme/tokens"))["items"]
        assert sorted((t["user"], t["role"]) for t in tokens) == [("alice", "admin")] * 2

        work = tmp_path / "cli"
        work.mkdir()
        (work / "main.tf").write_text(HCL.format(host=host, ws="net"))
        env["TF_IN_AUTOMATION"] = "1"
        ok(terraform(work, env, "init", "-input=false", "-no-color"))
        created = await api.ok("GET", "/api/v1/orgs/acme/workspaces/net")
        assert created["created_by"] == "alice"
        state = {
            "version": 4,
            "terraform_version": "1.0.3",
            "serial": 1,
            "lineage": "8e5b8f54-0000-4000-8000-00000000a11c",
            "outputs": {"greeting": {"value": "pasted", "type": "string"}},
            "resources": [],
        }
        (work / "s.tfstate").write_text(json.dumps(state))
        ok(terraform(work, env, "state", "push", "s.tfstate"))
        out = json.loads(ok(terraform(work, env, "output", "-json")))
        assert out["greeting"]["value"] == "pasted"
