"""The web UI served by the api process, without a browser: sign-in, the session cookie,
CSRF, roles, one organization's session against another's objects, escaping, and bad
input answered as a page. Every tenant is hostile: each attack here must be refused."""

from __future__ import annotations

import re
from pathlib import Path

import aiohttp
from aiohttp import web
from aiohttp.test_utils import BaseTestServer, TestClient, TestServer, make_mocked_request
from nats.aio.client import Client as NATS

from services.root.processes import banner
from services.surfaces.ui.sessions import COOKIE, Sessions, set_cookie
from tests.api_support import ADMIN_TOKEN, web_app_of
from tests.bootstrap_support import System
from tests.helpers import eventually
from tests.ui.support import Page, Ui, ui_fixture  # noqa: F401  # the fixture

XSS = '<script>alert("x")</script><img src=x onerror=alert(1)>'


async def _setup(ui: Ui) -> tuple[dict[str, str], dict[str, str]]:
    """Organizations acme (workspace net) and evil (workspace loot); tokens per role."""
    acme = await ui.http.org("acme")
    evil = await ui.http.org("evil")
    await ui.http.workspace("acme", "net")
    await ui.http.workspace("evil", "loot")
    return acme, evil


def _set_cookie(page_headers: object, name: str) -> str:
    headers = page_headers.getall("Set-Cookie", [])  # type: ignore[attr-defined]
    found = [h for h in headers if h.startswith(f"{name}=")]
    assert found, headers
    return str(found[0])


async def test_sign_in_sets_an_httponly_strict_session_cookie_and_opens_the_org(ui: Ui) -> None:
    """`/` is a form (no 401 JSON); a good token signs in: an HttpOnly, SameSite=Strict
    cookie (not Secure over plain HTTP), then the organization's page with its bar."""
    acme, _ = await _setup(ui)
    b = ui.browser()
    form = await b.get("/")
    assert form.status == 200 and 'name="token"' in form.text
    assert form.headers["Content-Type"].startswith("text/html")
    assert "default-src 'self'" in form.headers["Content-Security-Policy"]
    page = await b.post("/signin", {"token": acme["viewer"]}, follow=False)
    assert page.status == 303 and page.headers["Location"] == "/orgs/acme"
    cookie = _set_cookie(page.headers, "rp_session").lower()
    assert "httponly" in cookie and "samesite=strict" in cookie and "secure" not in cookie
    org = await b.get("/orgs/acme")
    assert org.status == 200 and "Organization acme" in org.text and "Active runs: 0" in org.text
    assert "/static/htmx.min.js" in org.text
    js = await b.get("/static/htmx.min.js")
    assert js.status == 200 and "htmx" in js.text


async def test_a_bad_token_or_no_csrf_is_refused_with_a_page(ui: Ui) -> None:
    acme, _ = await _setup(ui)
    b = ui.browser()
    await b.get("/")
    bad = await b.post("/signin", {"token": "not-a-token"})
    assert bad.status == 401 and "Not signed in" in bad.text and "Traceback" not in bad.text
    assert b.cookie("rp_session") is None
    forged = await b.post("/signin", {"token": acme["admin"]}, csrf="forged")
    assert forged.status == 403 and "CSRF" in forged.text
    missing = await b.post("/signin", {"token": acme["admin"]}, csrf="")
    assert missing.status == 403 and b.cookie("rp_session") is None


async def test_sign_out_ends_the_session_on_the_server(ui: Ui) -> None:
    """The cookie's value, replayed after sign-out (a stolen copy), opens nothing."""
    acme, _ = await _setup(ui)
    b = ui.browser()
    await b.signin(acme["viewer"])
    stolen = b.cookie("rp_session")
    assert stolen
    await b.get("/orgs/acme")
    out = await b.post("/signout", {}, follow=False)
    assert out.status == 303
    thief = ui.browser()
    thief.plant("rp_session", stolen)
    replay = await thief.get("/orgs/acme", allow_redirects=False)
    assert replay.status == 303 and replay.headers["Location"] == "/"


async def test_a_planted_session_id_is_never_promoted_by_a_sign_in(ui: Ui) -> None:
    """Session fixation: an id the attacker set before the victim signs in stays worthless;
    the sign-in mints a new one."""
    acme, _ = await _setup(ui)
    victim = ui.browser()
    victim.plant("rp_session", "attacker-chosen-id")
    await victim.signin(acme["admin"])
    assert victim.cookie("rp_session") not in (None, "attacker-chosen-id")
    other = ui.browser()
    await other.signin(acme["admin"])
    assert other.cookie("rp_session") not in (None, victim.cookie("rp_session"))
    attacker = ui.browser()
    attacker.plant("rp_session", "attacker-chosen-id")
    page = await attacker.get("/orgs/acme", allow_redirects=False)
    assert page.status == 303 and page.headers["Location"] == "/"


async def test_one_orgs_session_can_neither_read_nor_act_on_anothers_objects(ui: Ui) -> None:
    """evil's admin session: acme's pages, runs and forms are 404, and nothing changes;
    acme's run id under evil's own path is 404 too."""
    acme, evil = await _setup(ui)
    run = await ui.http.run("acme", "net", "plan", token=acme["operator"])
    b = ui.browser()
    await b.signin(evil["admin"])
    home = await b.get("/orgs/evil")
    for path in (
        "/orgs/acme",
        "/orgs/acme/workspaces/net",
        f"/orgs/acme/runs/{run['id']}",
        f"/orgs/evil/runs/{run['id']}",
        f"/orgs/evil/runs/{run['id']}/log",
        "/orgs/evil/workspaces/net",
        "/orgs/acme/live",
    ):
        page = await b.get(path)
        assert page.status == 404, (path, page.status)
        # (the error page may be in evil's own frame: its bar, with none of acme's runs)
        assert "/workspaces/net" not in page.text and 'href="/orgs/acme' not in page.text
        assert "Active runs: 1" not in page.text, (path, page.text)
    csrf = home.csrf
    for path in (
        f"/orgs/acme/runs/{run['id']}/cancel",
        f"/orgs/evil/runs/{run['id']}/cancel",
        "/orgs/acme/workspaces/net/lock",
        "/orgs/acme/workspaces/net/runs",
    ):
        page = await b.post(path, {"reason": "mine now", "type": "destroy"}, csrf=csrf)
        assert page.status == 404, (path, page.status)
    got = await ui.http.get(f"/api/v1/orgs/acme/runs/{run['id']}")
    assert got.body["status"] != "canceled"
    ws = await ui.http.get("/api/v1/orgs/acme/workspaces/net")
    assert ws.body["lock"] is None
    listed = await ui.http.get("/api/v1/orgs/acme/runs")
    assert [r["id"] for r in listed.body["items"]] == [run["id"]]
    # Even the admin token's session is bound to the organization it signed in to.
    root = ui.browser()
    await root.signin(ADMIN_TOKEN, org="evil")
    assert (await root.get("/orgs/evil")).status == 200
    assert (await root.get("/orgs/acme")).status == 404
    assert (await root.get(f"/orgs/acme/runs/{run['id']}")).status == 404


async def test_every_form_refuses_a_missing_forged_or_foreign_csrf_token(ui: Ui) -> None:
    """Missing, forged, another session's token, or a cross-site Origin: 403, no effect."""
    acme, _ = await _setup(ui)
    run = await ui.http.run("acme", "net", "plan", token=acme["operator"])
    other = ui.browser()
    await other.signin(acme["operator"])
    foreign = (await other.get("/orgs/acme")).csrf
    b = ui.browser()
    await b.signin(acme["operator"])
    own = (await b.get(f"/orgs/acme/runs/{run['id']}")).csrf
    cancel = f"/orgs/acme/runs/{run['id']}/cancel"
    for token in ("", "forged", foreign):
        page = await b.post(cancel, {"reason": "csrf"}, csrf=token)
        assert page.status == 403, token
    lock = "/orgs/acme/workspaces/net/lock"
    page = await b.post(lock, {"reason": "x"}, csrf=own, headers={"Origin": "https://evil.example"})
    assert page.status == 403 and "another origin" in page.text
    out = await b.post("/signout", {}, csrf="forged")
    assert out.status == 403 and (await b.get("/orgs/acme")).status == 200
    assert (await ui.http.get(f"/api/v1/orgs/acme/runs/{run['id']}")).body["status"] != "canceled"
    assert (await ui.http.get("/api/v1/orgs/acme/workspaces/net")).body["lock"] is None
    done = await b.post(cancel, {"reason": "by the form"}, csrf=own)
    assert done.status == 200 and "canceled" in done.text


async def test_a_viewer_sees_no_action_and_may_post_none(ui: Ui) -> None:
    """What the role may not do is neither shown nor accepted."""
    acme, _ = await _setup(ui)
    run = await ui.http.run("acme", "net", "plan", token=acme["operator"])
    b = ui.browser()
    await b.signin(acme["viewer"])
    page = await b.get(f"/orgs/acme/runs/{run['id']}")
    assert page.status == 200 and 'id="cancel"' not in page.text
    assert "viewer-user may only read" in page.text  # (events/access.py)
    ws = await b.get("/orgs/acme/workspaces/net")
    assert "Start a run" not in ws.text and "/lock" not in ws.text
    for path, fields in (
        (f"/orgs/acme/runs/{run['id']}/cancel", {"reason": "no"}),
        ("/orgs/acme/workspaces/net/lock", {"reason": "no"}),
        ("/orgs/acme/workspaces/net/runs", {"type": "destroy"}),
    ):
        refused = await b.post(path, fields, csrf=ws.csrf)
        assert refused.status == 403, path
    assert (await ui.http.get("/api/v1/orgs/acme/workspaces/net")).body["lock"] is None
    assert len((await ui.http.get("/api/v1/orgs/acme/runs")).body["items"]) == 1


async def test_an_operator_starts_locks_and_unlocks_through_the_forms(ui: Ui) -> None:
    acme, _ = await _setup(ui)
    b = ui.browser()
    await b.signin(acme["operator"])
    await b.get("/orgs/acme/workspaces/net")
    locked = await b.post("/orgs/acme/workspaces/net/lock", {"reason": "freeze " + XSS})
    assert locked.status == 200 and "Locked by operator-user" in locked.text
    started = await b.post(
        "/orgs/acme/workspaces/net/runs", {"type": "plan", "message": XSS, "template": ""}
    )
    assert started.status == 200 and "Run " in started.text
    run_id = started.url.rsplit("/", 1)[-1]
    ws = await b.get("/orgs/acme/workspaces/net")
    assert run_id in ws.text and "waits for the lock to be lifted" in ws.text
    unlocked = await b.post("/orgs/acme/workspaces/net/unlock", {})
    assert unlocked.status == 200 and "Unlocked." in unlocked.text
    api = await ui.http.get(f"/api/v1/orgs/acme/runs/{run_id}")
    assert api.body["created_by"] == "operator-user" and api.body["message"] == XSS


async def test_names_messages_and_reasons_are_text_never_markup(ui: Ui) -> None:
    """A run message and a lock reason full of markup are escaped on every page that
    shows them (org, workspace, run, the bar's feed)."""
    acme, _ = await _setup(ui)
    await ui.http.post(
        "/api/v1/orgs/acme/workspaces/net/lock", json={"reason": XSS}, token=acme["operator"]
    )
    run = await ui.http.post(
        "/api/v1/orgs/acme/workspaces/net/runs",
        json={"type": "plan", "message": XSS},
        token=acme["operator"],
    )
    b = ui.browser()
    await b.signin(acme["viewer"])
    for path in ("/orgs/acme", "/orgs/acme/workspaces/net", f"/orgs/acme/runs/{run.body['id']}"):
        page = await b.get(path)
        assert page.status == 200
        assert "<script>alert" not in page.text and "<img src=x" not in page.text, path
        assert "&lt;script&gt;alert(" in page.text, path


async def test_bad_input_is_a_clear_page_never_a_traceback(ui: Ui) -> None:
    acme, _ = await _setup(ui)
    b = ui.browser()
    await b.signin(acme["operator"])
    cases = {
        "/orgs/acme?status=bogus": (400, "status must be one of"),
        "/orgs/acme?before=%3Cx%3E": (400, "before must be a run id"),
        "/orgs/acme/runs/01nosuchrun": (404, "not found"),
        "/orgs/acme/runs/01NOSUCH": (422, ""),
        "/orgs/acme/workspaces/Bad..Name": (422, ""),
        "/orgs/acme/workspaces/nope": (404, "workspace nope not found"),
    }
    for path, (status, words) in cases.items():
        page = await b.get(path)
        assert page.status == status, (path, page.status, page.text[:300])
        assert page.headers["Content-Type"].startswith("text/html")
        assert words in page.text and "Traceback" not in page.text
    csrf = (await b.get("/orgs/acme/workspaces/net")).csrf
    bad = await b.post("/orgs/acme/workspaces/net/runs", {"type": "explode"})
    assert bad.status == 400 and "type must be one of" in bad.text
    empty = await b.post("/orgs/acme/workspaces/net/lock", {"reason": "  "}, csrf=csrf)
    assert empty.status == 400 and "reason is required" in empty.text


async def test_a_revoked_token_ends_its_sessions(ui: Ui) -> None:
    acme, _ = await _setup(ui)
    b = ui.browser()
    await b.signin(acme["viewer"])
    assert (await b.get("/orgs/acme")).status == 200
    tokens = (await ui.http.get("/api/v1/orgs/acme/tokens")).body["items"]
    viewer = next(t for t in tokens if t["role"] == "viewer")
    gone = await ui.http.call("DELETE", f"/api/v1/orgs/acme/tokens/{viewer['token_id']}")
    assert gone.status in (200, 204), gone.body
    page = await b.get("/orgs/acme", allow_redirects=False)
    assert page.status == 303 and page.headers["Location"] == "/"


async def test_the_bar_lists_active_runs_and_its_feed_sends_the_change(ui: Ui) -> None:
    """The bar counts the organization's active runs (not another's) and the live feed
    sends a new bar when a run is created."""
    acme, evil = await _setup(ui)
    await ui.http.run("evil", "loot", "plan", token=evil["operator"])
    b = ui.browser()
    await b.signin(acme["viewer"])
    page = await b.get("/orgs/acme")
    assert "Active runs: 0" in page.text
    async with b.session.get(b.url("/orgs/acme/live")) as feed:
        assert feed.headers["Content-Type"].startswith("text/event-stream")
        first = await _event(feed)
        assert "Active runs: 0" in first
        run = await ui.http.run("acme", "net", "plan", token=acme["operator"])
        second = await eventually(lambda: _event(feed), timeout=10, what="the bar's update")
        assert "Active runs: 1" in second and run["id"] in second and "loot" not in second


async def _event(feed: object) -> str:
    """The data of the next event of an SSE response."""
    lines: list[str] = []
    while True:
        raw = await feed.content.readline()  # type: ignore[attr-defined]
        line = raw.decode().rstrip("\n")
        if not line and lines:
            return "\n".join(re.sub(r"^data: ?", "", x) for x in lines if x.startswith("data:"))
        if line and not line.startswith(":"):
            lines.append(line)


def test_the_cookie_is_secure_when_the_request_came_by_tls() -> None:
    plain, tls = (
        make_mocked_request("GET", "/"),
        make_mocked_request("GET", "/").clone(scheme="https"),
    )
    for request, secure in ((plain, False), (tls, True)):
        response = web.Response()
        set_cookie(response, request, COOKIE, "id")
        header = response.cookies[COOKIE].output().lower()
        assert "httponly" in header and "samesite=strict" in header
        assert ("secure" in header.replace("samesite", "")) is secure, header


async def test_sessions_expire_when_idle_and_a_tokens_oldest_go_past_its_limit(
    nc: NATS,
) -> None:
    idle = Sessions(nc, idle_s=-1)
    session_id, _ = await idle.start("t", "acme")
    assert await idle.get(session_id) is None
    few = Sessions(nc, per_token=2, touch_s=0)
    first, _ = await few.start("t1", "acme")
    second, _ = await few.start("t1", "acme")
    other, _ = await few.start("t2", "acme")
    assert await few.get(first) is not None  # used: now the most recent of t1's
    third, _ = await few.start("t1", "acme")
    assert await few.get(second) is None
    assert await few.get(first) is not None and await few.get(third) is not None
    assert await few.get(other) is not None  # another token's are not counted
    await few.end_token("t1")
    assert await few.get(first) is None and await few.get(third) is None
    assert await few.get(other) is not None


async def test_the_organization_page_shows_each_workspaces_folder_from_the_read_model(
    ui: Ui,
) -> None:
    """The folder column of the read model (no workspace loaded from the event store)."""
    acme, _ = await _setup(ui)
    made = await ui.http.post("/api/v1/orgs/acme/folders", json={"name": "platform"})
    assert made.status == 201, made.body
    await ui.http.workspace("acme", "dns", folder="platform")
    b = ui.browser()
    await b.signin(acme["viewer"])
    page = await b.get("/orgs/acme")
    rows = {m[0]: m[1] for m in re.findall(r">(dns|net)</a></td><td>([^<]*)</td>", page.text)}
    assert rows == {"dns": "platform", "net": "(organization)"}, rows
    assert (await ui.http.api.read.workspaces.summaries("acme"))[0]["folder"] == "platform"


HTML = {"Accept": "text/html,application/xhtml+xml,*/*;q=0.8"}


async def test_a_signed_in_browser_gets_html_error_pages_with_the_nav_and_the_bar(
    ui: Ui,
) -> None:
    """An unknown path, a wrong method, a run that is not there: an HTML page in the
    signed-in frame (nav, sign-out form, the active runs bar), never JSON."""
    acme, _ = await _setup(ui)
    await ui.http.run("acme", "net", "plan", token=acme["operator"])
    b = ui.browser()
    await b.signin(acme["viewer"])
    missing = await b.get("/orgs/acme/nowhere", headers=HTML)
    wrong = await b.get("/signin", headers=HTML)  # a form's path, asked by GET
    no_run = await b.get("/orgs/acme/runs/r0000000000000000000000000", headers=HTML)
    for page, status in ((missing, 404), (wrong, 405), (no_run, 404)):
        assert page.status == status, (page.status, page.text[:300])
        assert page.headers["Content-Type"].startswith("text/html"), page.headers
        assert 'aria-label="Main"' in page.text and 'action="/signout"' in page.text
        assert "Active runs: 1" in page.text, page.text[:2000]
    assert "no route for GET /orgs/acme/nowhere" in missing.text
    assert wrong.headers["Allow"] == "POST" and "GET is not allowed" in wrong.text
    signed_out = ui.browser()
    bare = await signed_out.get("/orgs/acme/nowhere", headers=HTML)
    assert bare.status == 404 and bare.headers["Content-Type"].startswith("text/html")
    assert 'action="/signout"' not in bare.text and "Active runs" not in bare.text


async def test_api_clients_still_get_problem_details_for_unknown_paths(ui: Ui) -> None:
    """A bearer client, a client asking for JSON and any /api/ path keep the API's JSON."""
    acme, _ = await _setup(ui)
    b = ui.browser()
    await b.signin(acme["viewer"])
    bearer = await ui.http.get("/orgs/acme/nowhere", headers=HTML)
    assert bearer.status == 404 and bearer.content_type == "application/problem+json"
    api = await b.get("/api/v1/nowhere", headers=HTML)  # the browser's cookie is no bearer
    assert api.status == 401 and api.headers["Content-Type"].startswith("application/problem+json")
    curl = await b.get("/orgs/acme/nowhere", headers={"Accept": "*/*"})
    assert curl.headers["Content-Type"].startswith("application/problem+json")
    wrong = await ui.http.call("PUT", "/api/v1/orgs/acme", json={})
    assert wrong.status == 405 and wrong.content_type == "application/problem+json"


async def _signin_headers(server: BaseTestServer, token: str, headers: dict[str, str]) -> Page:
    """A sign-in through `server` with `headers` on both requests, redirects not followed;
    the pre-session cookie sent by hand (a Secure one is not sent back over plain HTTP by
    the test's client, as a browser would over the proxy's TLS)."""
    async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as s:
        async with s.get(server.make_url("/"), headers=headers) as r:
            form = Page(r.status, await r.text(), r.headers, str(r.url))
            presign = r.cookies["rp_presign"].value
        async with s.post(
            server.make_url("/signin"),
            data={"token": token, "csrf": form.csrf},
            headers={**headers, "Cookie": f"rp_presign={presign}"},
            allow_redirects=False,
        ) as r:
            return Page(r.status, await r.text(), r.headers, str(r.url))


async def test_x_forwarded_proto_is_ignored_unless_the_deployment_is_behind_a_tls_proxy(
    ui: Ui, system: System, tmp_path: Path
) -> None:
    """Attack: a client over plain HTTP says X-Forwarded-Proto: https. Without the flag
    nothing changes (no Secure cookie, its https Origin is another origin). With it (a
    proxy that sets the header), the cookie is Secure and the https Origin is ours."""
    acme, _ = await _setup(ui)
    host = ui.server.make_url("/").authority
    forged = {"X-Forwarded-Proto": "https", "Origin": f"https://{host}"}
    plain = await _signin_headers(ui.server, acme["viewer"], forged)
    assert plain.status == 403 and "another origin" in plain.text  # https is not this site
    plain = await _signin_headers(ui.server, acme["viewer"], {"X-Forwarded-Proto": "https"})
    assert plain.status == 303
    assert "secure" not in _set_cookie(plain.headers, "rp_session").lower().replace("samesite", "")
    async with system.projector(tmp_path / "proxied.sqlite") as projector:
        assert await projector.wait_for(ui.http.api.projector.seq)
        web_app = web_app_of(system, projector, secret_store=None, behind_tls_proxy=True)
        async with TestClient(TestServer(web_app)) as client:
            host = client.server.make_url("/").authority
            proxied = {"X-Forwarded-Proto": "https", "Origin": f"https://{host}"}
            page = await _signin_headers(client.server, acme["viewer"], proxied)
            assert page.status == 303, page.text[:300]
            cookie = _set_cookie(page.headers, "rp_session").lower().replace("samesite", "")
            assert "secure" in cookie
            direct = await _signin_headers(client.server, acme["viewer"], {})
            assert direct.status == 303  # plain HTTP to the proxied deployment: not Secure
            assert "secure" not in _set_cookie(direct.headers, "rp_session").lower().replace(
                "samesite", ""
            )


def test_up_s_banner_says_to_open_the_url_in_a_browser_and_sign_in_with_the_token() -> None:
    lines = banner("http://127.0.0.1:8080", "rp_admin_x", "demo", "hello", runplane="rp")
    assert lines[0] == "runplane is up at http://127.0.0.1:8080"
    assert lines[1] == (
        "Open http://127.0.0.1:8080/ in a browser and sign in with the admin token below "
        "(organization demo)."
    )
    assert "admin token: rp_admin_x" in lines
    bare = banner("http://127.0.0.1:9", "t", "demo", "", runplane="rp")
    assert "(an organization's name)" in bare[1]
