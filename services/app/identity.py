"""People and their access, on the command side: the organization as of a sequence (what
every access decision reads), and single sign-on's one hook.

`org_at` answers the organization's aggregate at or past a sequence the caller learned
from the stream's leader (services/surfaces/api/auth.py asks it for every request made
with an organization's token): from what this process already folded when that is new
enough (no read at all), else read on from there. So a suspension, a team change or a
revoked grant acknowledged through any replica holds on every replica at its next
request.

`sign_in_user` is what an identity provider's sign-in (services/surfaces/ui, the `sso`
surface) calls once it has checked the ID token: it records the user (first time), their
identity and their synced teams in one checked append to the organization, and issues a
personal token for the session, which carries the user's access at each use (never
frozen at sign-in) and ends with the session's lifetime.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta

import msgspec

from events import members as mb
from events import org as org_agg
from events import teams as tm
from events.codec import org_subject
from events.errors import NotFound
from services.app.aggregates import ORG
from services.app.commands import App

SESSION_LIFETIME = timedelta(hours=12)  # a sign-in's token, unless the caller says
SESSION_TOKEN_NAME = "single sign-on session"


class SignedIn(msgspec.Struct, frozen=True, kw_only=True):
    """What a UI session needs of a sign-in: whom it is, and the token it holds (shown
    to nobody: the session keeps it, sealed, services/surfaces/ui/sessions.py)."""

    org: str
    user_id: str
    email: str
    name: str
    teams: list[str]
    token: str
    token_id: str
    expires_at: datetime
    seq: int  # the stream sequence of the sign-in's last event (read-your-writes)


async def org_at(app: App, org: str, seq: int) -> org_agg.OrgState:
    """The organization's aggregate at or past `seq` (its subject's sequence)."""
    kept = app.states.peek(ORG.name, org_subject(org))
    if kept is not None and kept[1] >= seq:
        state: org_agg.OrgState = kept[2]
        return state
    return (await app.load(ORG, org_subject(org), min_seq=seq)).state


async def sign_in_user(
    app: App,
    org: str,
    *,
    email: str,
    name: str,
    groups: list[str],
    issuer: str,
    subject: str,
    rules: Sequence[tuple[str, str]] = (),
    lifetime: timedelta = SESSION_LIFETIME,
) -> SignedIn:
    """Create or find the user of `email` in `org`, record their identity (`issuer`,
    `subject`: the first one seen stays, another is refused), set their synced teams from
    `groups` (each team's `idp_groups`, and the configuration's (group, team) `rules`), and
    issue a personal token for the session.

    Raises NotFound (no such organization), members.Suspended, members.IdentityMismatch,
    Invalid (a malformed email, issuer, subject or groups)."""
    cmd = org_agg.SignInUser(
        actor=mb.normal_email(email), email=email, name=name, groups=list(groups),
        issuer=issuer, subject=subject, rules=list(rules),
    )  # fmt: skip
    signed = await app.org_command(org, cmd)
    user_id = mb.user_id_of(email)
    member = signed.state.members.get(user_id)
    if member is None:
        raise NotFound(f"organization {org} not found")
    expires = app.clock() + lifetime
    token, issued = await app.issue_token(
        org, member.email, "", member.email, expires_at=expires, kind="user", owner=user_id,
        name=SESSION_TOKEN_NAME,
    )  # fmt: skip
    return SignedIn(
        org=org,
        user_id=user_id,
        email=member.email,
        name=member.name,
        teams=tm.teams_of(issued.state.teams, user_id),
        token=token,
        token_id=issued.events[-1].token_id,
        expires_at=expires,
        seq=issued.seq,
    )
