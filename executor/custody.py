"""What a phase holds in trust: its secret variables, its managed state, its sealed plan.

`Vault` is executor-wide (NATS, the key ring, the state store). `guarded(job)` wraps one
phase: it fetches the run's secret variables under the phase's lease (masked from every
log, handed to Terraform's environment only), and serves the workspace's managed state on
loopback (`executor/statebackend.py`) until the phase ends. Plan files travel sealed.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import structlog
from nats.aio.client import Client as NATS

from events.run import secret_names
from executor import secrets as secret_vars
from executor.changes import show_plan
from executor.linksafe import open_regular
from executor.objects import Objects
from executor.statebackend import ERRORED_STATE, StateBackend
from executor.statestore import StateStore
from infra.crypto import KeyRing, load_keyring

if TYPE_CHECKING:
    from executor.job import Job

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class Vault:
    """NATS and the keys: everything an executor needs to keep plans, state and secrets."""

    nc: NATS
    keyring: KeyRing
    objects: Objects
    state: StateStore

    @classmethod
    def create(cls, nc: NATS, keyring: KeyRing | None, objects: Objects, work_dir: Path) -> Vault:
        """Without a key ring, one generated once in `work_dir` (a lone executor, tests)."""
        keys = keyring or load_keyring("", work_dir, create=True)
        return cls(nc, keys, objects, StateStore(nc.jetstream(), keys))

    async def upload_sealed(self, bucket: str, name: str, path: Path) -> None:
        """Seal `path` (bound to `bucket/name`) and store it; the clear file stays local."""
        sealed = path.with_name(f".{path.name}.sealed")
        try:
            await asyncio.to_thread(self.keyring.seal_file, path, sealed, f"{bucket}/{name}")
            await self.objects.upload(bucket, name, sealed)
        finally:
            sealed.unlink(missing_ok=True)

    async def download_sealed(self, bucket: str, name: str, dest: Path) -> bool:
        """Fetch and open object `name` into `dest`; False if there is no such object.

        Raises `infra.crypto.Tampered` or `UnknownKey` if it does not open.
        """
        sealed = dest.with_name(f".{dest.name}.sealed")
        try:
            if not await self.objects.download(bucket, name, sealed):
                return False
            await asyncio.to_thread(self.keyring.open_file, sealed, dest, f"{bucket}/{name}")
            return True
        finally:
            sealed.unlink(missing_ok=True)


@dataclass
class Custody:
    """One phase's share of the vault, and the state backend serving it."""

    vault: Vault
    backend: StateBackend | None = None

    def problems(self) -> str:
        """Why the state backend refused Terraform something, for the run's error."""
        if self.backend is None or not self.backend.problems:
            return ""
        return "runplane state backend: " + "; ".join(dict.fromkeys(self.backend.problems))


@asynccontextmanager
async def guarded(job: Job) -> AsyncIterator[None]:
    """For the length of a phase: its secret variables, and its managed state served.

    Both reach Terraform through the environment of every command the phase runs.
    """
    custody = job.tools.custody
    await _take_secrets(job)
    # A custom step's command (executor/custom.py) runs no Terraform of runplane's: no state.
    if not job.ctx.config.managed_state or job.ctx.phase not in ("plan", "apply"):
        yield
        return
    served = StateBackend(job.ctx, custody.vault.state, runs=job.tools.app, report=job.report)
    async with served as backend:
        custody.backend = backend
        _add_env(job, backend.env())
        yield


def _add_env(job: Job, env: dict[str, str]) -> None:
    tools = job.tools
    tools.terraform = replace(tools.terraform, extra_env={**tools.terraform.extra_env, **env})


async def _take_secrets(job: Job) -> None:
    """Fetch the run's secret values: masked everywhere, TF_VAR_* for the plan (and a
    custom step's command) only.

    The apply phase applies the saved plan, which carries the values it was planned with;
    it fetches them only so that its logs are masked too.
    """
    ctx = job.ctx
    tools = job.tools
    if not secret_names(ctx.run):
        return
    values = await secret_vars.fetch(
        tools.custody.vault.nc,
        tools.custody.vault.keyring,
        org=ctx.org,
        ws=ctx.ws,
        run_id=ctx.run_id,
        lease_id=ctx.lease_id,
    )
    tools.masker.add(values.values())  # in every form it may be printed
    if ctx.phase != "apply":  # the plan's Terraform, or a custom step's command
        _add_env(job, secret_vars.terraform_env(values))
    log.info("secret_variables_received", count=len(values))


async def mask_planned_secrets(job: Job) -> None:
    """Mask the secret values the saved plan carries (they may differ from today's)."""
    names = secret_names(job.ctx.run)
    if not names:
        return
    variables = (await show_plan(job)).get("variables") or {}
    planned = [str((variables.get(n) or {}).get("value", "")) for n in names]
    job.tools.masker.add(planned)


def rescue_errored_state(job: Job) -> Path | None:
    """Keep the state Terraform could not store (`errored.tfstate`) on this host (0600).

    Read only as a regular file, never through a link (executor/linksafe.py)."""
    ctx = job.ctx
    try:
        src = open_regular(ctx.workdir / ERRORED_STATE, within=ctx.src, step="apply")
    except FileNotFoundError:
        return None
    ctx.keep_dir.mkdir(parents=True, exist_ok=True)
    kept = ctx.keep_dir / f"{ctx.org}.{ctx.ws}.{ctx.run_id}.tfstate"
    fd = os.open(kept, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out, src:
        shutil.copyfileobj(src, out)
    log.error("state_not_stored", kept=str(kept))
    return kept
