"""`runplane login URL --sso ORG` end to end: the real `runplane` process, the real API,
a real OpenID provider process (oidc-provider-mock). The CLI sends the browser (here
`$BROWSER`, a script that hands the URL to the test, or the URL printed with
`--no-browser`) to the organization's single sign-on and runplane's consent page; the
browser comes back to the CLI's loopback listener with a code; the CLI exchanges it with
its PKCE verifier and stores the token where `runplane login` stores tokens.

The token is the signed-in person's and no more: a `plan` user's CLI queues plans and is
refused applies, finds nothing of another organization, and is locked out once
suspended. A request to the listener without the CLI's state is refused and changes
nothing; a denial at the consent page ends the login with an error and stores nothing."""

from __future__ import annotations

import asyncio
import json
import re
import stat
from pathlib import Path

import aiohttp

from tests.cli_client_support import Cli
from tests.device_support import Hidden
from tests.sso_support import Browser, Idp, Sso, idp_fixture, query_of, sso_fixture  # noqa: F401

V1 = "/api/v1/orgs/acme"
_URL = re.compile(r"^    (http://\S+)$", re.M)


async def _plan_user(sso: Sso, idp: Idp) -> None:
    """acme: workspaces net and other, team network (plan on net) from group net-eng."""
    for ws in ("net", "other"):
        await sso.http.workspace("acme", ws)
    await sso.http.workspace("beta", "net")
    team = {"name": "network", "idp_groups": ["net-eng"]}
    assert (await sso.http.post(f"{V1}/teams", json=team)).status == 201
    grant = {"team": "network", "level": "plan"}
    assert (await sso.http.call("PUT", f"{V1}/workspaces/net/access", json=grant)).status == 200
    await sso.configure("acme", idp)
    await idp.user("nora", email="nora@acme.test", groups=["net-eng"])


async def _url_on_stderr(proc: asyncio.subprocess.Process) -> tuple[str, str]:
    """The URL the CLI printed, and what it printed up to the wait."""
    assert proc.stderr is not None
    seen = ""
    while "Waiting for the browser" not in seen:
        line = await asyncio.wait_for(proc.stderr.readline(), 60)
        assert line, f"the CLI ended: {seen}"
        seen += line.decode()
    found = _URL.search(seen)
    assert found, seen
    return found.group(1), seen


async def _browse(browser: Browser, idp: Idp, url: str, sub: str, decision: str) -> str:
    """The person in the browser: the provider's sign-in, then runplane's consent page;
    where the consent sends the browser (the CLI's listener)."""
    status, location, page = await browser.get(url)
    assert status == 303, (status, page)
    status, consent, page = await browser.get(await idp.authorize(location, sub))
    assert status == 303 and consent.startswith("/app/oauth/authorize?"), (status, page)
    status, _, page = await browser.get(consent)
    assert status == 200 and "runplane's CLI on this machine asks" in page, page
    form = Hidden()
    form.feed(page)
    origin = browser.url("/").rstrip("/")
    async with browser.session.post(
        browser.url("/app/oauth/authorize"),
        data={**form.fields, "decision": decision},
        headers={"Origin": origin},
        allow_redirects=False,
    ) as r:
        assert r.status == 303, await r.text()
        return r.headers["Location"]


async def _come_back(location: str) -> tuple[int, str]:
    async with aiohttp.ClientSession() as s, s.get(location) as r:
        return r.status, await r.text()


async def test_login_sso_through_the_browser_stores_the_persons_token_and_no_more(
    sso: Sso, idp: Idp, tmp_path: Path
) -> None:
    await _plan_user(sso, idp)
    base = str(sso.client.make_url("")).rstrip("/")
    opened = tmp_path / "opened-url"
    script = tmp_path / "browser.sh"
    script.write_text(f'#!/bin/sh\nprintf %s "$1" > {opened}\n')
    script.chmod(stat.S_IRWXU)
    cli = Cli(tmp_path / "home", BROWSER=f"{script} %s")
    proc = await cli.start("login", base, "--sso", "acme")
    printed, _ = await _url_on_stderr(proc)
    for _ in range(100):  # the browser was started with the URL printed
        if opened.exists() and opened.read_text():
            break
        await asyncio.sleep(0.05)
    assert opened.read_text() == printed
    back = await _browse(sso.browser(), idp, printed, "nora", "allow")
    assert back.startswith("http://localhost:1000") and "code=" in back, back
    status, page = await _come_back(back)
    assert status == 200 and "CLI is logged in" in page, page
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, (out, err)
    assert "Logged in to" in out.decode() and "nora@acme.test" in out.decode(), out

    stored = json.loads(cli.credentials.read_text())
    token = stored["servers"][base]["token"]
    assert stored["default"] == base and stat.S_IMODE(cli.credentials.stat().st_mode) == 0o600
    me = await sso.http.get("/api/v1/whoami", token=token)
    assert (me.body["kind"], me.body["user"], me.body["teams"]) == (
        "user",
        "nora@acme.test",
        ["network"],
    ), me.body
    names = {t["token_id"]: t["name"] for t in (await sso.http.get(f"{V1}/tokens")).body["items"]}
    assert names[me.body["token_id"]] == "runplane's CLI login", names

    # What that token may do through the CLI: plans on net, no apply, nothing elsewhere.
    plan = await cli("run", "create", "net", "--type", "plan", "--json")
    assert plan.code == 0 and json.loads(plan.out)["created_by"] == "nora@acme.test", plan
    (await cli("run", "create", "net", "--type", "apply")).one_error("needs write", "forbidden")
    (await cli("workspace", "show", "other")).one_error("not found")
    (await cli("workspace", "list", "--org", "beta")).one_error("not found")
    (await cli("run", "create", "net", "--org", "beta", "--type", "plan")).one_error("not found")
    listed = await cli("workspace", "list", "--json")
    assert [w["name"] for w in json.loads(listed.out)["items"]] == ["net"], listed

    users = (await sso.http.get(f"{V1}/users")).body["items"]
    nora = next(u for u in users if u["email"] == "nora@acme.test")
    assert (await sso.http.post(f"{V1}/users/{nora['id']}/suspend")).status == 200
    (await cli("workspace", "list")).one_error("suspended", "user-suspended")


async def test_no_browser_prints_the_url_a_foreign_state_is_ignored_and_a_denial_stores_nothing(
    sso: Sso, idp: Idp, tmp_path: Path
) -> None:
    await _plan_user(sso, idp)
    base = str(sso.client.make_url("")).rstrip("/")
    opened = tmp_path / "opened-url"
    cli = Cli(tmp_path / "home", BROWSER=f"/bin/sh -c 'touch {opened}' %s")
    proc = await cli.start("login", base, "--sso", "acme", "--no-browser")
    printed, seen = await _url_on_stderr(proc)
    assert printed.startswith(base + "/app/sso/start?org=acme&next=")
    port = int(re.search(r"localhost:(\d+)", seen).group(1))  # type: ignore[union-attr]
    # Anything on the port without the CLI's state: refused, and the CLI waits on.
    for probe in ("/login?code=planted&state=guess", "/login?code=planted", "/other"):
        status, _ = await _come_back(f"http://localhost:{port}{probe}")
        assert status == 400, probe
    assert proc.returncode is None
    back = await _browse(sso.browser(), idp, printed, "nora", "deny")
    assert query_of(back)["error"] == "access_denied", back
    assert (await _come_back(back))[0] == 200
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 2 and "refused in the browser" in err.decode(), (out, err)
    assert not opened.exists() and not cli.credentials.exists()
    helped = await cli("login", "--help")
    assert "--device --org ORG on a machine without a browser" in " ".join(helped.out.split())
