"""What every handler needs: the command side, this replica's projection, and the waits
that give clients read-your-writes across the two."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from datetime import datetime
from typing import Any

import structlog
from aiohttp import web

from events.org import USE_EVERY
from infra.auditlog import AuditLog
from projections.projector import Projector
from projections.readmodel import ReadModel
from services.app.commands import App

log = structlog.get_logger("runplane.api")

# Bounds on how long a request may wait for this replica's projection.
WRITE_WAIT_S = 5.0  # after a command, until the projection holds its events
READ_WAIT_S = 5.0  # for a read's RP-Min-Seq
TOKEN_WAIT_S = 2.0  # for a token issued a moment ago, maybe through another replica
SETTLE_WAIT_S = 1.0  # for what reached this process (events, board writes) before a run's read


class Api:
    """The dependencies of the HTTP API, built once in `build_app`."""

    def __init__(
        self,
        *,
        app: App,
        projector: Projector,
        admin_token: str,
        ready: Callable[[], bool] | None = None,
    ) -> None:
        if not admin_token:
            raise ValueError("an admin token is required")
        self.app = app
        self.projector = projector
        self.admin_digest = hashlib.sha256(admin_token.encode()).digest()
        self.ready = ready or (lambda: True)
        self.write_wait = WRITE_WAIT_S
        self.read_wait = READ_WAIT_S
        self.token_wait = TOKEN_WAIT_S
        self.settle_wait = SETTLE_WAIT_S
        self.token_use_every = USE_EVERY  # how stale a token's "last used" may be
        self.token_uses: dict[str, datetime] = {}  # token id: when this replica last recorded
        self.audit = AuditLog(app.store.nc)  # refusals recorded, the audit log read

    @property
    def read(self) -> ReadModel:
        return self.projector.read

    async def reached(self, seq: int, timeout: float) -> bool:
        """Whether the projection is at or past `seq`, waiting at most `timeout` seconds."""
        return await self.projector.wait_for(seq, timeout=timeout)

    async def after_write(self, seq: int) -> bool:
        """Wait until the projection holds a write; a miss is logged, the write stands."""
        if await self.reached(seq, self.write_wait):
            return True
        log.warning("projection_lagging", seq=seq, projected=self.projector.seq)
        return False

    async def token(self, token_hash: str) -> dict[str, Any] | None:
        """The token's row; a miss waits (bounded) for the projection to reach the stream's
        end, since the token may have been issued a moment ago through another replica."""
        row = await self.read.orgs.token(token_hash)
        if row is not None:
            return row
        await self.reached(await self.app.store.last_seq(), self.token_wait)
        return await self.read.orgs.token(token_hash)


API: web.AppKey[Api] = web.AppKey("runplane.api", Api)
