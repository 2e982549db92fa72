"""A long answer (a log followed until its run ends) stands only while its caller does.

The bearer was checked when the request began; a follow may last as long as an apply.
`Standing.check` authenticates the request's bearer again (services/surfaces/api/auth.py:
at or past its organization's last event, as the stream's leader has it) and asks whether
it may still read the workspace (events/access.py), at most every `every` seconds: a
revoked or expired token, a suspended user, a deleted team or a grant taken back ends the
stream within that time of its next write (or its next keep-alive, when it is quiet).
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from services.surfaces.api.auth import authenticate
from services.surfaces.api.common import workspace_target
from services.surfaces.api.context import API
from services.surfaces.api.problems import Problem

RECHECK_S = 1.0


class Lapsed(Exception):
    """The caller no longer stands, or may no longer read the workspace."""


class Standing:
    """The request's caller, checked again as its answer goes on."""

    def __init__(self, request: web.Request, org: str, ws: str, every: float = RECHECK_S) -> None:
        self.request = request
        self.org = org
        self.ws = ws
        self.every = every
        self.last = asyncio.get_running_loop().time()  # the request's own check

    async def check(self, *, now: bool = False) -> None:
        """Raise Lapsed if the caller no longer may read the workspace (checked at most
        every `every` seconds, unless `now`)."""
        clock = asyncio.get_running_loop().time()
        if not now and clock - self.last < self.every:
            return
        self.last = clock
        api = self.request.app[API]
        try:
            who = await authenticate(api, self.request.headers.get("Authorization"))
        except Problem as p:
            if p.status == 401:
                raise Lapsed(p.detail) from p
            raise
        target = await workspace_target(api, self.org, self.ws)
        if not who.may("workspace.read", target):
            raise Lapsed(f"{who.user} may no longer read workspace {self.ws}")
