"""Custody applied to one phase (executor/custody.py holds what is kept in trust): its
secret variables fetched under its lease and masked, its managed state served, the
planned secrets masked, the state Terraform could not store kept on this host."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import BinaryIO

import structlog

from events.run import secret_names
from executor import secrets as secret_vars
from executor import workload
from executor.custody import Custody
from executor.job import Job
from executor.jobinit import STATE_SOCKET
from executor.linksafe import open_regular
from executor.statebackend import ERRORED_STATE, StateBackend
from executor.statefile import CHUNK
from infra.quotas import MIB

log = structlog.get_logger(__name__)


@asynccontextmanager
async def guarded(job: Job) -> AsyncIterator[None]:
    """For the length of a phase: its secret variables, and its managed state served.

    Both reach Terraform through the environment of every command the phase runs.
    """
    custody = job.tools.custody
    await _take_secrets(job)
    async with workload.provided(job):  # executor/workload.py: when the workspace asks
        async with _state_served(job, custody):
            yield


@asynccontextmanager
async def _state_served(job: Job, custody: Custody) -> AsyncIterator[None]:
    # A custom step's command (executor/custom.py) runs no Terraform of runplane's: no state.
    if not job.ctx.config.managed_state or job.ctx.phase not in ("plan", "apply"):
        yield
        return
    jail = job.tools.jail
    socket = job.ctx.root / STATE_SOCKET if jail and jail.isolation.network == "none" else None
    served = StateBackend(
        job.ctx, custody.vault.state, runs=job.tools.app, report=job.report, socket=socket
    )
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
    variables = (await job.show_plan()).get("variables") or {}
    planned = [str((variables.get(n) or {}).get("value", "")) for n in names]
    job.tools.masker.add(planned)


async def rescue_errored_state(job: Job) -> str:
    """Keep the state Terraform could not store (`errored.tfstate`) on this host (0600),
    as `<work>/unsaved-state/<org>.<ws>.<run>.tfstate`; what the run's error says of it
    ("" if Terraform left none).

    The file is the job's to write: read only as a regular file, never through a link
    (executor/linksafe.py), its size taken from the open file and refused past the
    deployment's `--state-max-mb` (a sparse `truncate -s 10G` costs the job nothing and
    would have cost the executor 10 GiB of zeros), and copied off the event loop, no more
    than that bound even if it grows meanwhile."""
    ctx = job.ctx
    limit = job.tools.custody.vault.state.quotas.state_max_bytes
    try:
        src = open_regular(ctx.workdir / ERRORED_STATE, within=ctx.src, step="apply")
    except FileNotFoundError:
        return ""
    kept = ctx.keep_dir / f"{ctx.org}.{ctx.ws}.{ctx.run_id}.tfstate"
    with src:
        size = os.fstat(src.fileno()).st_size
        if size <= limit:
            size = await asyncio.to_thread(_copy_bounded, src, kept, limit)
    if size > limit:
        log.error("state_not_kept", size=size, limit=limit)
        return (
            f"Terraform could not store the new state, and its {ERRORED_STATE} "
            f"({size // MIB} MiB) passes this deployment's bound of {limit // MIB} MiB "
            "(--state-max-mb): not kept"
        )
    log.error("state_not_stored", kept=str(kept))
    return f"the new state was not stored; a copy is kept at {kept} on this host"


def _copy_bounded(src: BinaryIO, kept: Path, limit: int) -> int:
    """Copy `src` to `kept` (a new private file), at most `limit` bytes: the bytes
    copied, or one past `limit` (then `kept` is removed)."""
    kept.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(kept, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    copied = 0
    with os.fdopen(fd, "wb") as out:
        while chunk := src.read(min(CHUNK, limit + 1 - copied)):
            copied += len(chunk)
            if copied > limit:
                break
            out.write(chunk)
    if copied > limit:
        kept.unlink(missing_ok=True)
    return copied
