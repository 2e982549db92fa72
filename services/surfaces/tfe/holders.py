"""A capability URL acts as the caller it was handed to, at every use.

The state download and log URLs (services/surfaces/tfe/state.py, logs.py) are fetched
without an Authorization header, so they carry the token id of the caller they were
handed to (`holder`, signed into the capability). Each use asks the organization, as the
stream's leader has it, whether that token still stands and may still do what the URL
does on its workspace (events/access.py): a revoked token, a suspended user, a deleted
team or a grant taken back ends the URL at once, not at its expiry (10 minutes for a
state, an hour for a log). An organization token's role never changes: it stands until
revoked. The deployment's admin token is no organization's to end: its URLs name no
holder.
"""

from __future__ import annotations

from aiohttp import web

from events import access
from events.codec import org_subject
from services.app.identity import org_at
from services.surfaces.api.common import workspace_target
from services.surfaces.tfe.context import api_of, principal


def holder_of(request: web.Request) -> str:
    """The caller's token id, "" for the admin token."""
    who = principal(request)
    return "" if who.superuser else who.token_id


async def still_may(request: web.Request, org: str, holder: str, action: str, ws: str) -> bool:
    """Whether the token `holder` of `org` stands and may `action` on workspace `ws` now."""
    if not holder:
        return True
    api = api_of(request)
    last = await api.app.store.last_seq_of(org_subject(org))
    state = await org_at(api.app, org, last)
    if holder not in state.tokens or holder in state.revoked:
        return False
    if holder not in state.owners:  # an organization token: its role is fixed at issue
        return True
    who = access.resolve(state, token_id=holder, user="", role="")
    if who is None:
        return False
    return access.allowed(who, action, await workspace_target(api, org, ws))
