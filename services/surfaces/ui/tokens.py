"""`/app/settings/tokens`: the signed-in person's own tokens, and a new one for the
Terraform CLI.

The page lists the personal tokens of the session's user that are not revoked: name,
when made, when last used, when they expire (the session's own marked), each with a
Revoke form (CSRF token, Origin checked). Only the user's own personal tokens are listed
or revoked here: another user's, a team's or an organization token is "not found", as
the API answers (services/surfaces/api/orgs.py); an org admin revokes those through the
API. Revoking the session's own token signs this browser out (and every session of that
token, at its next request: services/surfaces/ui/web.py `visit_of`). An organization token
(of before users) owns no personal token: its page lists none.

Where `terraform login` sends a person when discovery offers no login.v1 (`runplane
up --terraform-login token`): the CLI prints this page's URL and asks for the token made
here, pasted at its prompt, which it checks with `GET /api/v2/account/details`. The page
says whom a new token acts as; the form makes one for the session's user, organization
and role, never more (nor ending later than the session's own token), as login.v1's
exchange does (services/surfaces/tfe/login.py `issue_token`: `org.token_issued`), and
shows it once, in the post's own answer (no redirect: the token is kept nowhere to be
shown again; no-store, never framed: services/surfaces/ui/web.py SECURITY_HEADERS). An
admin-token session is refused: the admin token is no organization's user.
"""

from __future__ import annotations

from typing import Any, TypeGuard

from aiohttp import web

from events.codec import valid_id
from events.org import MAX_TOKEN_NAME, RevokeToken, TokenOwner
from infra.ids import hash_token
from services.surfaces.api.auth import Principal
from services.surfaces.api.problems import Problem
from services.surfaces.tfe.login import issue_token, token_expiry, token_kind
from services.surfaces.ui.sessions import COOKIE, SessionError
from services.surfaces.ui.web import (
    FORM,
    SESSIONS,
    Visit,
    base,
    error_page,
    form,
    guarded,
    render,
    see_other,
    visit_of,
)

TOKENS = "/app/settings/tokens"
REVOKE = TOKENS + "/revoke"
DEFAULT_NAME = "Terraform"


def _organization_user(visit: Visit) -> None:
    if visit.who.superuser:
        raise Problem(
            "forbidden",
            "signed in with the admin token, which is no organization's user: sign in with "
            "your own token to make one for Terraform",
        )


def _mine(owner: TokenOwner | None, who: Principal) -> TypeGuard[TokenOwner]:
    """Whether a token's owner record is `who`'s own personal token."""
    user_id = who.access.user_id
    return bool(user_id) and owner is not None and (owner.kind, owner.owner) == ("user", user_id)


async def own_tokens(visit: Visit) -> list[dict[str, Any]]:
    """The session user's personal tokens not revoked, oldest first, each with its name
    and whether it is this session's."""
    if not visit.who.access.user_id:
        return []
    state = (await visit.api.app.load_org(visit.org)).state
    session_row = await visit.api.token(hash_token(visit.session.token))
    current = session_row["token_id"] if session_row else ""
    now = visit.api.app.clock().isoformat()
    rows = []
    for row in await visit.api.read.orgs.tokens(visit.org):
        owner = state.owners.get(row["token_id"])
        if owner is None or not _mine(owner, visit.who) or row["token_id"] in state.revoked:
            continue
        expires = row["expires_at"]
        rows.append(
            {
                **row,
                "name": owner.name or "(no name)",
                "current": row["token_id"] == current,
                "expired": expires is not None and expires <= now,
            }
        )
    return rows


async def _page(visit: Visit, token: str = "", status: int = 200) -> web.Response:
    context: dict[str, Any] = await base(
        visit,
        token=token,
        host=visit.request.host,
        tokens=await own_tokens(visit),
        personal=bool(visit.who.access.user_id),
        max_name=MAX_TOKEN_NAME,
    )
    return render(visit.request, "tokens.html", context, status=status)


async def tokens_page(request: web.Request) -> web.StreamResponse:
    """GET: the user's tokens, whom a new token would act as, and the form that makes it."""

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


def _name(visit: Visit) -> str:
    value = visit.request[FORM].get("name", "")
    name = value.strip() if isinstance(value, str) else ""
    if len(name) > MAX_TOKEN_NAME or not name.isprintable():
        raise Problem("invalid-body", f"a name is at most {MAX_TOKEN_NAME} printable characters")
    return name or DEFAULT_NAME


@form("tokens.personal")
async def create_token(visit: Visit) -> web.StreamResponse:
    """POST: a new token of the session's user and access, shown this once."""
    _organization_user(visit)
    expires = await token_expiry(visit.api, visit.session.token)  # never outlives it
    kind, owner, level = token_kind(visit.who)
    issued = await issue_token(
        visit.api, visit.org, visit.who.user, visit.who.role, expires,
        kind=kind, owner=owner, level=level, name=_name(visit),
    )  # fmt: skip
    return await _page(visit, issued)


@form("tokens.personal")
async def revoke_token(visit: Visit) -> web.StreamResponse:
    """POST: revoke one of the user's own personal tokens (anything else is not found)."""
    _organization_user(visit)
    token_id = visit.request[FORM].get("token", "")
    state = (await visit.api.app.load_org(visit.org)).state
    if not isinstance(token_id, str) or not valid_id(token_id):
        raise Problem("not-found", "token not found")
    if not _mine(state.owners.get(token_id), visit.who):
        raise Problem("not-found", f"token {token_id} not found")
    command = RevokeToken(actor=visit.who.user, token_id=token_id)
    result = await visit.api.app.org_command(visit.org, command)
    await visit.api.after_write(result.seq)
    row = await visit.api.token(hash_token(visit.session.token))
    if row is not None and row["token_id"] == token_id:  # this session's own: signed out
        await visit.request.app[SESSIONS].end(visit.request.cookies.get(COOKIE))
        response = see_other("/")
        response.del_cookie(COOKIE, path="/")
        return response
    return see_other(TOKENS)
