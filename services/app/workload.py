"""Minting a phase's workload identity token: the trusted side (the secrets responder).

The executor asks under the phase's lease (`SecretsRequest(workload=True)`); the
responder has already checked that the lease is the run's current one. What the token
says comes from the run as recorded, loaded from the subject the request came on (so of
that organization and workspace only), and the workspace's folder from the organization's
aggregate: never from the request. The phase is the run's own claimed phase (`plan` or
`apply`). The private key never leaves this process: the executor gets the token, sealed
for its run and lease, and the job gets the token alone.
"""

from __future__ import annotations

import time
from datetime import datetime

import structlog

from events import folder
from events import workload as wl
from events.run import RunState
from infra.signing import SigningKeys
from services.app.commands import App

log = structlog.get_logger(__name__)


class Minter:
    """Signs phases' tokens with the deployment's current key, as `issuer`."""

    def __init__(self, app: App, keys: SigningKeys, issuer: str) -> None:
        self.app = app
        self.keys = keys
        self.issuer = issuer.rstrip("/")

    async def mint(self, run: RunState) -> str:
        """The token of the run's claimed phase; WorkloadRefused if it gets none."""
        started = time.perf_counter()
        now: datetime = self.app.clock()
        org = (await self.app.load_org(run.org)).state
        ws = (await self.app.load_ws(run.org, run.workspace)).state
        folders = folder.path(org.folders, ws.folder) if ws.folder else []
        claims = wl.claims(
            run,
            phase=run.phase,
            folders=folders,
            issuer=self.issuer,
            now=now,
            jti=self.app.ids(),
        )
        token = await self.keys.sign(claims)
        log.info(
            "workload_token_issued",
            org=run.org,
            workspace=run.workspace,
            run_id=run.run_id,
            phase=run.phase,
            jti=claims["jti"],
            exp=claims["exp"],
            ms=round((time.perf_counter() - started) * 1000, 2),
        )
        return token
