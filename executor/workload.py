"""A phase's workload identity token: asked under the lease, handed to the job, refreshed.

For a plan or apply phase of a workspace that sets `workload_identity`, the executor asks
the secrets responder (services/app/workload.py: it signs; this process never holds the
signing key) for the phase's token and gives it to every command of the phase:

- `TFC_WORKLOAD_IDENTITY_TOKEN` in the environment (HCP Terraform agents' variable), the
  token as of the command's start;
- a file in the phase's directory (`workload-identity.jwt`, the job's uid its owner, 0400)
  named by `RUNPLANE_WORKLOAD_IDENTITY_TOKEN_FILE` and, relative to the working directory,
  by the Terraform variable `runplane_workload_identity_token_file` (`TF_VAR_...`: a
  configuration that declares it hands it to a provider's `web_identity_token_file`, or
  reads it with `file()`), replaced by a fresh token at half
  the token's life, so a phase longer than a token's ttl always finds a live one.

Every token is added to the masker before the job can print it. The phase's directory is
the executor's (0711): the job cannot replace the file with a link, and the file is
written under a new name and renamed over the old, never opened through a path the job
controls.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace

import jwt
import structlog
from nats.aio.client import Client as NATS

from events import workload as wl
from events.wire import SecretsRequest
from events.workload_rules import PHASES
from executor.errors import StepFailed
from executor.job import Job
from executor.secrets import ask
from infra.crypto import KeyRing

log = structlog.get_logger(__name__)

REASON = "workload_identity_unavailable"
FILE = "workload-identity.jwt"
MIN_REFRESH_S = 10.0


def wanted(job: Job) -> bool:
    return job.ctx.phase in PHASES and wl.enabled(job.ctx.run)


@asynccontextmanager
async def provided(job: Job) -> AsyncIterator[None]:
    """For the length of the phase: its token in the job's environment and file,
    refreshed at half its life; nothing when the workspace does not ask for one."""
    if not wanted(job):
        yield
        return
    token = await _fetch(job)
    _hand_over(job, token)
    refresher = asyncio.create_task(_refresh(job, token), name="workload-token-refresh")
    try:
        yield
    finally:
        refresher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await refresher


async def _refresh(job: Job, token: str) -> None:
    """A new token each time the last has lived half its life, until the phase ends; a
    failed refresh is tried again every `MIN_REFRESH_S` (the token in hand has at most
    half its life left: waiting another half would let it expire)."""
    wait = _half_life(token)
    while True:
        await asyncio.sleep(wait)
        try:
            token = await _fetch(job)
        except StepFailed as e:  # the phase goes on with the token it has
            log.warning("workload_token_refresh_failed", error=e.error)
            wait = MIN_REFRESH_S
            continue
        _hand_over(job, token)
        log.info("workload_token_refreshed")
        wait = _half_life(token)


def _half_life(token: str) -> float:
    claims = jwt.decode(token, options={"verify_signature": False})
    return max((int(claims["exp"]) - int(claims["iat"])) / 2, MIN_REFRESH_S)


def _hand_over(job: Job, token: str) -> None:
    """Mask it, write the file, and put both in the environment of the next commands."""
    tools = job.tools
    tools.masker.add([token])
    path = job.ctx.root / FILE
    _write(job, token)
    # Relative to the working directory for Terraform: a saved plan keeps the value it was
    # planned with, and the apply phase's directory is another, laid out alike.
    relative = os.path.relpath(path, job.ctx.workdir)
    env = {wl.TOKEN_ENV: token, wl.TOKEN_FILE_ENV: str(path), wl.TOKEN_FILE_VAR: relative}
    tools.terraform = replace(tools.terraform, extra_env={**tools.terraform.extra_env, **env})


def _write(job: Job, token: str) -> None:
    """Replace the token file: a new file made in the phase's directory (the
    executor's, which the job cannot write), then renamed over the old one."""
    root = os.open(job.ctx.root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    part = f".{FILE}.{secrets.token_hex(4)}"
    try:
        fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o400, dir_fd=root)
        try:
            os.write(fd, token.encode())
            uid = job.tools.jail.uid if job.tools.jail is not None else None
            if uid is not None:
                os.fchown(fd, uid, uid)
        finally:
            os.close(fd)
        os.rename(part, FILE, src_dir_fd=root, dst_dir_fd=root)
    finally:
        os.close(root)


async def _fetch(job: Job) -> str:
    ctx = job.ctx
    vault = job.tools.custody.vault
    return await fetch(
        vault.nc, vault.keyring, org=ctx.org, ws=ctx.ws, run_id=ctx.run_id, lease_id=ctx.lease_id
    )


async def fetch(
    nc: NATS,
    keyring: KeyRing,
    *,
    org: str,
    ws: str,
    run_id: str,
    lease_id: str,
    timeout: float = 10.0,
) -> str:
    """The phase's token; StepFailed (`workload_identity_unavailable`) if none is had."""
    request = SecretsRequest(run_id=run_id, lease_id=lease_id, workload=True)
    try:
        return (await ask(nc, keyring, org, ws, request, timeout, _failed)).decode()
    except StepFailed:
        raise
    except Exception as e:  # a lost connection, an answer no text: the same one reason
        raise _failed(f"the secrets responder gave no answer: {type(e).__name__}") from e


def _failed(message: str) -> StepFailed:
    return StepFailed("workload-identity", f"workload identity token: {message}", reason=REASON)
