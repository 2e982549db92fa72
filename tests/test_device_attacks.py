"""What a hostile tenant could do with the device flow (services/app/device.py,
services/surfaces/api/device.py, services/surfaces/ui/device.py), and that it cannot:
approve another organization's code, guess user codes, redeem a device code as another
client, approve while suspended (or be redeemed after), inject markup through the
client id or organization shown on the confirmation page, approve without the CSRF
token, or turn a grant of one organization into a token of another. On main (before the
device flow) none of these routes exist, so every test here fails there at its first
request (404)."""

from __future__ import annotations

from services.app.device import MAX_WRONG
from tests.device_support import V1, Device, device_fixture, hidden, nora  # noqa: F401
from tests.sso_support import Idp, idp_fixture  # noqa: F401


async def _pending(device: Device, device_code: str) -> None:
    device.clock.offset += 30  # past any interval: the poll is in time
    status, answer = await device.poll(device_code)
    assert (status, answer["error"]) == (400, "authorization_pending"), answer


async def test_a_member_of_another_organization_cannot_approve_and_the_token_stays_in_its_org(
    device: Device, idp: Idp
) -> None:
    await nora(device.sso, idp)
    answer = await device.code("acme")
    bob = await device.signed_in(idp, "bob", org="beta")  # beta's member, signed in to beta
    status, _, page = await bob.get(f"/device?user_code={answer['user_code']}")
    assert status == 403 and "This code is for organization acme" in page, page
    assert "device-confirm" not in page
    # a forged decision for it: refused the same, nothing decided
    fields = {"csrf": "x", "user_code": answer["user_code"], "decision": "approve"}
    async with bob.session.post(bob.url("/device/decide"), data=fields) as r:
        assert r.status == 403, await r.text()
    await _pending(device, answer["device_code"])
    # approved by acme's own member, the token is acme's and opens nothing of beta
    browser = await device.signed_in(idp, "nora", user_code=answer["user_code"])
    assert (await device.decide(browser, answer["user_code"]))[0] == 200
    device.clock.offset += 30
    status, token = await device.poll(answer["device_code"])
    assert status == 200, token
    me = await device.sso.http.get("/api/v1/whoami", token=token["access_token"])
    assert me.body["org"] == "acme", me.body
    for path in (f"{V1}/beta/workspaces", f"{V1}/beta/runs", f"{V1}/beta/tokens"):
        other = await device.sso.http.get(path, token=token["access_token"])
        assert other.status == 404, (path, other.body)


async def test_user_codes_cannot_be_guessed_past_the_limit_whatever_the_session(
    device: Device, idp: Idp
) -> None:
    await nora(device.sso, idp)
    answer = await device.code()
    first = await device.signed_in(idp, "nora")
    for i in range(MAX_WRONG):
        status, _, page = await first.get(f"/device?user_code=BBBB-BB{'BCDFGHJKLM'[i]}B")
        assert status == 400 and "wrong, expired or used" in page, (i, page)
    second = await device.signed_in(idp, "nora")  # another session of the same person
    for browser in (first, second):
        status, _, page = await browser.get(f"/device?user_code={answer['user_code']}")
        assert status == 429 and "Too many wrong codes" in page, page
        assert "device-confirm" not in page
    await _pending(device, answer["device_code"])


async def test_grants_per_address_are_limited_and_an_unknown_org_gets_the_same_answer(
    device: Device,
) -> None:
    unknown = await device.code("no-such-org")
    assert set(unknown) == set(await device.code("acme")), unknown
    r = await device.sso.client.post("/oauth/device/code", json={"organization": "acme"})
    assert r.status == 200 and set(await r.json()) == set(unknown)  # JSON as well as a form
    bad = await device.sso.client.post("/oauth/device/code", json=["acme"])
    problem = await bad.json(content_type=None)
    assert bad.status == 400 and problem["type"].endswith("/invalid-body"), problem
    for _ in range(6):
        await device.code("acme")
    status, refused = await device.ask("acme")
    assert status == 429, refused
    assert refused["type"].endswith("/rate-limited") and refused["error"] == "slow_down"


async def test_a_device_code_is_refused_to_another_client_id_and_stays_its_own(
    device: Device, idp: Idp
) -> None:
    await nora(device.sso, idp)
    mine = await device.code(client_id="runplane-cli")
    theirs = await device.code(client_id="other-tool")
    browser = await device.signed_in(idp, "nora", user_code=mine["user_code"])
    assert (await device.decide(browser, mine["user_code"]))[0] == 200
    status, answer = await device.poll(mine["device_code"], client_id="other-tool")
    assert (status, answer["error"]) == (400, "invalid_grant"), answer
    status, answer = await device.poll(theirs["device_code"], client_id="runplane-cli")
    assert (status, answer["error"]) == (400, "invalid_grant"), answer
    status, answer = await device.poll(mine["device_code"], client_id="runplane-cli")
    assert status == 200 and answer["token_type"] == "Bearer", answer


async def _suspend(device: Device, email: str) -> None:
    users = (await device.sso.http.get(f"{V1}/acme/users")).body["items"]
    user = next(u for u in users if u["email"] == email)
    assert (await device.sso.http.post(f"{V1}/acme/users/{user['id']}/suspend")).status == 200


async def test_a_suspended_user_neither_approves_nor_is_redeemed_after(
    device: Device, idp: Idp
) -> None:
    await nora(device.sso, idp)
    # approved, then suspended before the device polls: no token
    answer = await device.code()
    browser = await device.signed_in(idp, "nora", user_code=answer["user_code"])
    assert (await device.decide(browser, answer["user_code"]))[0] == 200
    await _suspend(device, "nora@acme.test")
    status, refused = await device.poll(answer["device_code"])
    assert (status, refused["error"]) == (400, "access_denied"), refused
    assert "suspended" in refused["error_description"], refused
    # suspended, her open confirmation page approves nothing
    other = await device.code()
    status, _, page = await browser.get(f"/device?user_code={other['user_code']}")
    assert "device-confirm" not in page, page
    fields = {"user_code": other["user_code"], "decision": "approve"}
    async with browser.session.post(browser.url("/device/decide"), data=fields) as r:
        assert r.status == 403, await r.text()
    await _pending(device, other["device_code"])


async def test_the_confirmation_page_escapes_a_hostile_client_id_and_organization(
    device: Device, idp: Idp
) -> None:
    await nora(device.sso, idp)
    script = "<script>alert(1)</script>"
    hostile = await device.code(client_id=script)
    browser = await device.signed_in(idp, "nora", user_code=hostile["user_code"])
    status, _, page = await browser.get(f"/device?user_code={hostile['user_code']}")
    assert status == 200 and "device-confirm" in page, page
    assert script not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page, page
    org = "<img src=x onerror=alert(2)>"
    other = await device.code(org)
    status, _, page = await browser.get(f"/device?user_code={other['user_code']}")
    assert status == 403 and org not in page and "&lt;img src=x" in page, page
    # the page it points people to without a session escapes its query as well
    anonymous = device.sso.browser()
    status, _, page = await anonymous.get(f"/device?user_code=%22%3E{script}&org={org}")
    assert status == 401 and script not in page and org not in page, page


async def test_an_approval_without_the_csrf_token_or_from_another_origin_is_refused(
    device: Device, idp: Idp
) -> None:
    await nora(device.sso, idp)
    answer = await device.code()
    browser = await device.signed_in(idp, "nora", user_code=answer["user_code"])
    status, page = await device.decide(browser, answer["user_code"], csrf="-")
    assert status == 403 and "CSRF" in page, page
    status, page = await device.decide(browser, answer["user_code"], csrf="forged")
    assert status == 403 and "CSRF" in page, page
    await _pending(device, answer["device_code"])
    status, _, page = await browser.get(f"/device?user_code={answer['user_code']}")
    fields = hidden(page) | {"decision": "approve"}
    async with browser.session.post(
        browser.url("/device/decide"), data=fields, headers={"Origin": "https://evil.test"}
    ) as r:
        assert r.status == 403 and "another origin" in await r.text()
    await _pending(device, answer["device_code"])
