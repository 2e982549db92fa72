"""Bearer tokens: who calls, and their access.

The admin token (given at start) may do everything in every organization. Any other token
is scoped to one organization: an organization token of a role (as before users), a
personal token (its user's access now, at most) or a team token (its team's). Each
request resolves the caller's `Access` (events/access.py) from the organization's
aggregate at or past its last event (services/app/identity.py `org_at`), and every
surface asks `events.access.allowed` / `require` about it. A suspended user's tokens
are refused (401 `user-suspended`) at their next use, on every replica; the suspension
revokes their personal tokens, so a reactivation brings none of them back.
Another organization's things are invisible: a request for them is answered 404, never
403, so a token cannot probe what exists elsewhere.

An organization's token may expire (`expires_at`, compared with the App's clock: 401
`token-expired`) and be revoked (`org.token_revoked`: 401). Revocation holds on every
replica from the moment it is acknowledged: each request authenticated by an org token asks
the stream's leader for the last sequence on its organization's subject (where tokens are
issued and revoked) and reads the token only from a projection at or past it, waiting a bounded
`token_wait` and answering 503 `stale-read` rather than trusting a read model that may be
behind a revocation. That costs one JetStream API round trip per such request; the admin
token needs none.

Uses are recorded as `org.token_used` (on the token's own uses subject, so the
organization's aggregate does not grow with them) at most once per `Api.token_use_every`
(15 minutes) per token per replica, and not while the read model already shows a use that
recent: "last used" is exact to within that period, and the log grows by about one event
per token in use and period, however busy the token.
"""

from __future__ import annotations

import hashlib
import hmac
from datetime import datetime
from typing import Any

import msgspec
import nats.errors
import structlog
from aiohttp import web

from events import access as ac
from events.codec import org_subject
from events.errors import DomainError
from events.org import ROLES
from infra.eventstore import StoreError
from services.app.identity import org_at
from services.surfaces.api.context import Api
from services.surfaces.api.problems import Problem, unauthorized

VIEWER, OPERATOR, APPROVER, ADMIN = ROLES
ADMIN_USER = "admin"
USES_KEPT = 100_000  # token ids a replica remembers recording a use of (then it forgets all)

log = structlog.get_logger("runplane.api")


class Principal(msgspec.Struct, frozen=True, kw_only=True):
    """Who is calling. `org` None means the admin token: every organization. `role` is
    an organization token's ("" for personal and team tokens); `access` decides."""

    user: str
    role: str
    access: ac.Access
    org: str | None = None
    token_id: str = ""

    @property
    def superuser(self) -> bool:
        return self.org is None

    def may(self, action: str, target: ac.Target) -> bool:
        return ac.allowed(self.access, action, target)


PRINCIPAL: web.RequestKey[Principal] = web.RequestKey("runplane.principal", Principal)


def bearer(header: str | None) -> str:
    """The token of an `Authorization: Bearer <token>` header."""
    if not header:
        raise unauthorized("an Authorization: Bearer <token> header is required")
    scheme, _, token = header.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise unauthorized("the Authorization header must be: Bearer <token>")
    return token


async def authenticate(api: Api, header: str | None) -> Principal:
    """The principal of a request's Authorization header, or a 401 problem."""
    digest = hashlib.sha256(bearer(header).encode()).digest()
    if hmac.compare_digest(digest, api.admin_digest):
        return Principal(user=ADMIN_USER, role=ADMIN, access=ac.superuser(ADMIN_USER))
    token_hash = digest.hex()
    projected = api.projector.seq  # the first read below sees at least this much
    row = await api.token(token_hash)
    if row is None:
        raise unauthorized("the token is not valid", invalid_token=True)
    row, last = await _fresh(api, row, token_hash, projected)
    now = api.app.clock()
    org, user = row["org"], row["user"]
    state = await org_at(api.app, org, last)
    found = ac.resolve(state, token_id=row["token_id"], user=user, role=row["role"])
    if found is None:  # first: a suspension revokes the user's tokens, and says so
        raise unauthorized(
            f"{user} is suspended in {org}, or the token's team is gone",
            invalid_token=True,
            slug="user-suspended",
        )
    _check_lifecycle(row, now)
    await _record_use(api, row, now)
    return Principal(user=user, role=row["role"], org=org, token_id=row["token_id"], access=found)


async def _fresh(
    api: Api, row: dict[str, Any], token_hash: str, projected: int
) -> tuple[dict[str, Any], int]:
    """The token's row from a projection at or past its organization's last event, so that
    no replica trusts a token revoked through another one; and that event's sequence."""
    last = await api.app.store.last_seq_of(org_subject(row["org"]))
    if projected >= last:
        return row, last
    if not await api.reached(last, api.token_wait):
        raise Problem(
            "stale-read",
            f"the read model is at {api.projector.seq}, behind the token's organization at {last}",
            headers={"Retry-After": "1"},
            projected_seq=api.projector.seq,
        )
    fresh = await api.read.orgs.token(token_hash)
    if fresh is None:  # tokens are never deleted: only a rebuilt read model could miss it
        raise unauthorized("the token is not valid", invalid_token=True)
    return fresh, last


def _check_lifecycle(row: dict[str, Any], now: datetime) -> None:
    if row["revoked_at"] is not None:
        raise unauthorized(f"the token was revoked at {row['revoked_at']}", invalid_token=True)
    expires = row["expires_at"]
    if expires is not None and datetime.fromisoformat(expires) <= now:
        raise unauthorized(
            f"the token expired at {expires}",
            invalid_token=True,
            slug="token-expired",
            expired_at=expires,
        )


async def _record_use(api: Api, row: dict[str, Any], now: datetime) -> None:
    """Record that the token is used, unless a use within `token_use_every` is known. A
    failure is logged and the request goes on: "last used" is a hint, not a gate."""
    every, token_id = api.token_use_every, row["token_id"]
    last = row["last_used_at"]
    if last is not None and now - datetime.fromisoformat(last) < every:
        return
    noted = api.token_uses.get(token_id)
    if noted is not None and now - noted < every:
        return
    if len(api.token_uses) >= USES_KEPT:
        api.token_uses.clear()  # at worst one more event per token
    api.token_uses[token_id] = now  # before the append: concurrent requests record once
    try:
        await api.app.record_token_use(row["org"], token_id, row["user"])
    except (DomainError, StoreError, nats.errors.Error) as e:
        log.warning("token_use_not_recorded", token_id=token_id, error=str(e))
