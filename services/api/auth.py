"""Bearer tokens and roles.

The admin token (given at start) may do everything in every organization. Any other token
is scoped to one organization with one role; roles are ordered, each adding to the last:
viewer (read), operator (+ create and cancel runs), approver (+ approve and discard, where
the workspace names no approvers: events/approval.py), admin (+ workspaces and tokens).
Another organization's things are invisible: a request for them is answered 404, never
403, so a token cannot probe what exists elsewhere.
"""

from __future__ import annotations

import hashlib
import hmac

import msgspec
from aiohttp import web

from events.org import ROLES
from services.api.context import Api
from services.api.problems import Problem, unauthorized

VIEWER, OPERATOR, APPROVER, ADMIN = ROLES
_RANK = {role: i for i, role in enumerate(ROLES)}
ADMIN_USER = "admin"


class Principal(msgspec.Struct, frozen=True, kw_only=True):
    """Who is calling. `org` None means the admin token: every organization."""

    user: str
    role: str
    org: str | None = None
    token_id: str = ""

    @property
    def superuser(self) -> bool:
        return self.org is None

    def require(self, org: str, role: str) -> None:
        """Allow the call in `org` if the principal holds at least `role` there."""
        if self.superuser:
            return
        if self.org != org:
            raise Problem("not-found", f"organization {org} not found")
        if _RANK.get(self.role, -1) < _RANK[role]:
            raise Problem("forbidden", f"role {self.role} may not do this; it needs {role}")


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
        return Principal(user=ADMIN_USER, role=ADMIN)
    row = await api.token(digest.hex())
    if row is None:
        raise unauthorized("the token is not valid", invalid_token=True)
    return Principal(user=row["user"], role=row["role"], org=row["org"], token_id=row["token_id"])
