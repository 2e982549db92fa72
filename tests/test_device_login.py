"""`runplane login URL --device --org ORG` end to end (RFC 8628, runplane the authorization
server): the real `runplane` process asks for a code and prints it; a browser (an HTTP
client following the real provider, oidc-provider-mock) signs in by single sign-on as a
new user, enters the code and approves; the CLI ends with that user's personal token,
stored where `--sso` stores it, and `runplane whoami`-equivalent `GET /whoami` names
them. A denial or an expiry ends the CLI with one line and a non-zero exit; polling too
fast is told `slow_down`; two polls of an approved grant at once get one token."""

from __future__ import annotations

import asyncio
import html
import json
import re
import stat
from pathlib import Path
from urllib.parse import urlencode

from services.root.bootstrap import Plane
from tests.cli_client_support import Cli
from tests.device_support import V1, Device, device_fixture, nora  # noqa: F401
from tests.sso_support import Idp, idp_fixture, sso_api  # noqa: F401

_LINE = re.compile(r"^Open (\S+/device) and enter ([A-Z]{4}-[A-Z]{4}) \(or open (\S+)\)$")


async def _printed(cli: Cli, device: Device) -> tuple[asyncio.subprocess.Process, str, str]:
    """Start `runplane login --device`; (process, page, user code) it printed."""
    proc = await cli.start("login", device.base, "--device", "--org", "acme")
    assert proc.stderr is not None
    line = (await asyncio.wait_for(proc.stderr.readline(), 30)).decode().rstrip("\n")
    found = _LINE.match(line)
    assert found, line
    page, code, complete = found.groups()
    assert page == device.base + "/device", page
    assert complete == f"{device.base}/device?user_code={code}&org=acme", complete
    return proc, page, code


async def test_device_login_signs_in_a_new_user_by_sso_and_stores_their_token(
    device: Device, idp: Idp, tmp_path: Path
) -> None:
    await nora(device.sso, idp)
    cli = Cli(tmp_path / "home")
    proc, _, code = await _printed(cli, device)
    browser = await device.signed_in(idp, "nora", user_code=code)  # a new user, by SSO
    status, page = await device.decide(browser, code)
    assert status == 200 and "Approved" in page, page
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 0, (out, err)
    assert "Logged in to" in out.decode() and "nora@acme.test" in out.decode(), out

    stored = json.loads(cli.credentials.read_text())
    token = stored["servers"][device.base]["token"]
    assert stat.S_IMODE(cli.credentials.stat().st_mode) == 0o600
    me = await device.sso.http.get("/api/v1/whoami", token=token)
    assert (me.body["kind"], me.body["user"], me.body["teams"]) == (
        "user",
        "nora@acme.test",
        ["network"],
    ), me.body
    tokens = (await device.sso.http.get(f"{V1}/acme/tokens")).body["items"]
    mine = next(t for t in tokens if t["token_id"] == me.body["token_id"])
    assert mine["name"] == "runplane's CLI device login from 127.0.0.1", mine
    assert mine["expires_at"], mine  # ends with the sign-in's token, as --sso's does
    # the person's access, no more: plans on net, no applies, nothing of beta
    plan = await cli("run", "create", "net", "--type", "plan", "--json")
    assert plan.code == 0 and json.loads(plan.out)["created_by"] == "nora@acme.test", plan
    (await cli("run", "create", "net", "--type", "apply")).one_error("forbidden")
    (await cli("workspace", "list", "--org", "beta")).one_error("not found")


async def test_a_denial_ends_the_cli_with_one_line_and_stores_nothing(
    device: Device, idp: Idp, tmp_path: Path
) -> None:
    await nora(device.sso, idp)
    cli = Cli(tmp_path / "home")
    proc, _, code = await _printed(cli, device)
    browser = await device.signed_in(idp, "nora", user_code=code)
    status, page = await device.decide(browser, code, "deny")
    assert status == 200 and "Denied" in page, page
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 2, (out, err)
    assert err.decode() == "runplane: the login was denied in the browser\n", err
    assert not cli.credentials.exists()
    helped = await cli("login", "--help")
    assert "--device" in helped.out and "not supported" not in helped.out, helped.out


async def test_an_expired_code_ends_the_cli_and_is_approved_by_no_one(
    device: Device, idp: Idp, tmp_path: Path
) -> None:
    await nora(device.sso, idp)
    cli = Cli(tmp_path / "home")
    proc, _, code = await _printed(cli, device)
    device.clock.offset = 601  # the grant's ten minutes are over
    browser = await device.signed_in(idp, "nora")
    status, _, page = await browser.get(f"/device?user_code={code}")
    assert status == 400 and "wrong, expired or used" in page, page
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 2 and not cli.credentials.exists(), (out, err)
    assert err.decode().splitlines() == [
        "runplane: the code expired before it was approved: run runplane login again"
    ], err


async def test_polling_faster_than_the_interval_is_told_slow_down_and_the_interval_grows(
    device: Device,
) -> None:
    device.clock.freeze()
    answer = await device.code()
    assert answer["interval"] == 1 and answer["expires_in"] == 600, answer
    assert re.fullmatch(r"[BCDFGHJKLMNPQRSTVWXZ]{4}-[BCDFGHJKLMNPQRSTVWXZ]{4}", answer["user_code"])
    assert len(answer["device_code"]) >= 43, answer  # 32 random bytes, url-safe
    first = await device.poll(answer["device_code"])
    assert first == (
        400,
        {"error": "authorization_pending", "error_description": "not approved yet"},
    )
    status, again = await device.poll(answer["device_code"])
    assert (status, again["error"]) == (400, "slow_down"), again
    device.clock.offset += 1.0  # the old interval: too fast for the new one (6 s)
    status, again = await device.poll(answer["device_code"])
    assert (status, again["error"]) == (400, "slow_down"), again
    device.clock.offset += 12  # a poll after the grown interval is in time
    status, later = await device.poll(answer["device_code"])
    assert (status, later["error"]) == (400, "authorization_pending"), later


async def test_two_polls_of_an_approved_grant_at_once_get_one_token(
    device: Device, idp: Idp
) -> None:
    await nora(device.sso, idp)
    answer = await device.code()
    browser = await device.signed_in(idp, "nora", user_code=answer["user_code"])
    assert (await device.decide(browser, answer["user_code"]))[0] == 200
    before = len((await device.sso.http.get(f"{V1}/acme/tokens")).body["items"])
    polls = await asyncio.gather(*(device.poll(answer["device_code"]) for _ in range(6)))
    won = [a for s, a in polls if s == 200]
    assert len(won) == 1 and won[0]["token_type"] == "Bearer", polls
    assert {a["error"] for s, a in polls if s != 200} == {"invalid_grant"}, polls
    after = (await device.sso.http.get(f"{V1}/acme/tokens")).body["items"]
    assert len(after) == before + 1, after
    again = await device.poll(answer["device_code"])
    assert again[0] == 400 and again[1]["error"] == "invalid_grant", again


async def test_without_a_session_the_page_signs_in_by_sso_and_comes_back_to_the_code(
    device: Device, idp: Idp
) -> None:
    await nora(device.sso, idp)
    answer = await device.code()
    complete = answer["verification_uri_complete"].removeprefix(device.base)
    browser = device.sso.browser()
    status, _, page = await browser.get(complete)
    assert status == 401 and "Sign in with" in page, page
    start = html.unescape(re.search(r'id="sso" href="([^"]+)"', page).group(1))  # type: ignore[union-attr]
    back = "/device?" + urlencode({"user_code": answer["user_code"]})
    assert start == "/app/sso/start?" + urlencode({"org": "acme", "next": back}), start
    status, to_idp, _ = await browser.get(start)
    assert status == 303, to_idp
    status, location, _ = await browser.get(await idp.authorize(to_idp, "nora"))
    assert (status, location) == (303, back)
    # typed in lower case without the dash, the code is the same code
    typed = answer["user_code"].replace("-", "").lower()
    status, _, page = await browser.get(f"/device?user_code={typed}")
    assert status == 200 and answer["user_code"] in page and "nora@acme.test" in page, page
    # a next that leaves /device (or the site) is not followed after the sign-in
    for wanted in ("/device/../orgs/beta", "//evil.test/device", "https://evil.test/device"):
        other = device.sso.browser()
        status, location = await other.sign_in(idp, "acme", "nora", wanted)
        assert (status, location) == (303, "/orgs/acme"), wanted


async def test_the_verification_uri_is_the_deployments_public_url(
    system: Plane, tmp_path: Path
) -> None:
    public = "https://runplane.example.test/base"
    async with sso_api(system, tmp_path / "rm.sqlite", public_url=public + "/") as sso:
        r = await sso.client.post("/oauth/device/code", data={"organization": "acme"})
        answer = await r.json()
    assert answer["verification_uri"] == public + "/device", answer
    assert answer["verification_uri_complete"].startswith(public + "/device?user_code="), answer
