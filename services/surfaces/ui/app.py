"""The web UI, served by the api process itself: `mount(web_app)` adds its routes.

Server-rendered pages (aiohttp-jinja2, autoescaped) with htmx for the live parts over
server-sent events; every asset is served from services/surfaces/ui/static (htmx vendored from its
npm package: static/VENDORED.md), no CDN. The UI authenticates by its own session cookie
(services/surfaces/ui/sessions.py), so its routes are listed for the API's bearer middleware to
let through (`SELF_AUTHENTICATED`); everything else of the API is unchanged.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp_jinja2
import jinja2
from aiohttp import web

from services.surfaces.api.context import API
from services.surfaces.api.middleware import SELF_AUTHENTICATED, problems
from services.surfaces.ui import (
    actions,
    audit_page,
    device,
    live,
    pages,
    people,
    signin,
    sso,
    tokens,
)
from services.surfaces.ui.sessions import TLS_PROXY, Sessions
from services.surfaces.ui.templating import GLOBALS
from services.surfaces.ui.web import JINJA, SESSIONS, html_errors

HERE = Path(__file__).parent
ORG = "/orgs/{org}"
RUN = ORG + "/runs/{run}"
WS = ORG + "/workspaces/{ws}"
STATIC = "/static"

ROUTES = [
    web.get("/", signin.signin_page, allow_head=False),
    web.post("/signin", signin.signin),
    web.post("/signout", signin.signout),
    *sso.ROUTES,
    *device.ROUTES,
    web.get(tokens.TOKENS, tokens.tokens_page, allow_head=False),
    web.post(tokens.TOKENS, tokens.create_token),
    web.post(tokens.REVOKE, tokens.revoke_token),
    web.get(ORG, pages.org_page, allow_head=False),
    web.get(ORG + "/live", live.bar_feed, allow_head=False),
    web.get(WS, pages.workspace_page, allow_head=False),
    web.post(WS + "/runs", actions.start_run),
    web.post(WS + "/lock", actions.lock),
    web.post(WS + "/unlock", actions.unlock),
    web.post(WS + "/state-rollback", actions.rollback),
    web.get(RUN, pages.run_page, allow_head=False),
    web.get(ORG + "/people", people.people_page, allow_head=False),
    web.get(ORG + "/audit", audit_page.audit_page, allow_head=False),
    web.post(ORG + "/people/invite", people.invite),
    web.post(ORG + "/people/suspend", people.suspend),
    web.post(ORG + "/people/reactivate", people.reactivate),
    web.post(ORG + "/people/team", people.team_members),
    web.get(ORG + "/folders/{folder}", people.folder_page, allow_head=False),
    web.post(ORG + "/folders/{folder}/access", people.grant),
    web.post(WS + "/access", people.grant),
    web.get(RUN + "/live", live.run_feed, allow_head=False),
    web.get(RUN + "/log", live.log_page, allow_head=False),
    web.post(RUN + "/approve", actions.approve),
    web.post(RUN + "/discard", actions.discard),
    web.post(RUN + "/cancel", actions.cancel),
]


def mount(
    web_app: web.Application, *, sessions: Sessions | None = None, behind_tls_proxy: bool = False
) -> None:
    """Add the UI to the API's application (before it starts). `behind_tls_proxy`: the
    deployment says a TLS proxy sets X-Forwarded-Proto (else the header is ignored)."""
    env = aiohttp_jinja2.setup(
        web_app,
        app_key=JINJA,
        loader=jinja2.FileSystemLoader(HERE / "templates"),
        autoescape=True,
    )
    env.globals.update(GLOBALS)
    web_app[SESSIONS] = sessions or Sessions(web_app[API].app.store.nc)
    web_app[TLS_PROXY] = behind_tls_proxy
    web_app[live.CLOSING] = asyncio.Event()
    web_app.on_shutdown.append(live.close_streams)
    # Just outside the problem-details middleware (inside the request log): a browser's page
    # that is no route gets HTML before the API's JSON 404 / 405 / 401 is made.
    web_app.middlewares.insert(web_app.middlewares.index(problems), html_errors)
    web_app.add_routes(ROUTES)
    web_app.router.add_static(STATIC, HERE / "static")
    # Exactly the UI's own paths: whatever else is mounted keeps the bearer check.
    web_app[SELF_AUTHENTICATED] = frozenset({r.path for r in ROUTES} | {STATIC})
