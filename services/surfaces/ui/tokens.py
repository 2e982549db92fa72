"""`/app/settings/tokens`: a token for the Terraform CLI, made by the signed-in user.

Where `terraform login` sends a person when discovery offers no login.v1 (`runplane
up --terraform-login token`): the CLI prints this page's URL and asks for the token made
here, pasted at its prompt, which it checks with `GET /api/v2/account/details`. The page
says whom a new token acts as; the form (CSRF token, Origin checked) makes one for the
session's user, organization and role, never more (nor ending later than the
session's own token), as login.v1's exchange does
(services/surfaces/tfe/login.py `issue_token`: `org.token_issued`), and shows it once, in the
post's own answer (no redirect: the token is kept nowhere to be shown again; no-store,
never framed: services/surfaces/ui/web.py SECURITY_HEADERS). An admin-token session is refused:
the admin token is no organization's user.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from services.surfaces.api.problems import Problem
from services.surfaces.tfe.login import issue_token, token_expiry, token_kind
from services.surfaces.ui.sessions import SessionError
from services.surfaces.ui.web import Visit, base, error_page, form, guarded, render, visit_of

TOKENS = "/app/settings/tokens"


def _organization_user(visit: Visit) -> None:
    if visit.who.superuser:
        raise Problem(
            "forbidden",
            "signed in with the admin token, which is no organization's user: sign in with "
            "your own token to make one for Terraform",
        )


async def _page(visit: Visit, token: str = "") -> web.Response:
    context: dict[str, Any] = await base(visit, token=token, host=visit.request.host)
    return render(visit.request, "tokens.html", context)


async def tokens_page(request: web.Request) -> web.StreamResponse:
    """GET: whom a new token would act as, and the form that makes it."""

    async def call() -> web.StreamResponse:
        try:
            visit = await visit_of(request)
        except SessionError as e:
            return error_page(
                request,
                401,
                "Sign in to runplane first",
                f"{e}: sign in with your organization token, then open this page again",
            )
        _organization_user(visit)
        return await _page(visit)

    return await guarded(request, call)


@form("tokens.personal")
async def create_token(visit: Visit) -> web.StreamResponse:
    """POST: a new token of the session's user and access, shown this once."""
    _organization_user(visit)
    expires = await token_expiry(visit.api, visit.session.token)  # never outlives it
    kind, owner, level = token_kind(visit.who)
    issued = await issue_token(
        visit.api, visit.org, visit.who.user, visit.who.role, expires,
        kind=kind, owner=owner, level=level,
    )  # fmt: skip
    return await _page(visit, issued)
