"""The admission snapshot: what a run is pinned to before any executor sees it.

The scheduler resolves the workspace branch's head with `git ls-remote` (bounded by a
timeout) of the repository as the deployment's sources take it for the run's
organization (checked again here: a local path is pinned, services/app/repopaths.py),
lists the variable names with their origins (secret values never: only the names of the
secret variables stored for the workspace), and copies the effective settings. The plan
then checks out exactly that commit, however far the branch has moved.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

from events.errors import RepositoryRefused, SnapshotFailed
from events.inherit import config_settings
from events.run import RunState, Snapshot, VariableRef, Workspace
from events.settings import effective
from infra.childenv import run_quietly
from infra.gitenv import NONE, GitCredential, git_access
from services.app.gitcreds import GitAccess
from services.app.repositories import Sources
from services.app.secrets import SecretStore

# A slow remote holds only its workspace's lane, marked in progress while it waits.
DEFAULT_TIMEOUT = 20.0
_SHA = re.compile(r"^[0-9a-f]{40}([0-9a-f]{24})?$")
_MAX_ERROR = 2000


async def resolve_commit(
    repository: str,
    branch: str,
    *,
    timeout: float = DEFAULT_TIMEOUT,
    credential: GitCredential = NONE,
    sources: Sources | None = None,
    org: str = "",
) -> str:
    """The sha `refs/heads/<branch>` points at in `repository`, asked with `credential`
    only (infra/gitenv.py: never the host's unless it is `HOST`); SnapshotFailed if none,
    or if `sources` (default: any source, but never a local path that is not safe to
    read: services/app/repopaths.py) do not take it for a workspace of `org`."""
    ref = f"refs/heads/{branch}"
    try:
        target = (sources or Sources()).check(repository, org=org)
    except RepositoryRefused as e:
        raise SnapshotFailed(str(e)) from e
    argv = ("git", "ls-remote", "--exit-code", "--", target, ref)
    with git_access(credential, repository) as env:
        try:
            code, out, err = await run_quietly(argv, env, timeout)
        except TimeoutError as e:
            raise SnapshotFailed(f"git ls-remote {repository} timed out after {timeout:g}s") from e
    return _listed(code, out, err, repository, branch, credential)


def _listed(
    code: int | None, out: bytes, err: bytes, repository: str, branch: str, cred: GitCredential
) -> str:
    ref = f"refs/heads/{branch}"
    if code == 2:
        raise SnapshotFailed(f"branch {branch!r} not found in {repository}")
    if code != 0:
        text = err.decode(errors="replace").strip()[-_MAX_ERROR:]
        for secret in cred.secrets():
            text = text.replace(secret, "***")
        raise SnapshotFailed(f"git ls-remote {repository} failed (exit {code}): {text}")
    return _sha_of(out.decode(errors="replace"), ref, repository)


def _sha_of(listing: str, ref: str, repository: str) -> str:
    for line in listing.splitlines():
        sha, _, name = line.partition("\t")
        if name == ref and _SHA.fullmatch(sha):
            return sha
    raise SnapshotFailed(f"git ls-remote {repository} did not list {ref}")


def variables(config: Workspace, secret_names: list[str]) -> list[VariableRef]:
    """Plain variables, then secret ones, each by name with its origin."""
    plain = [VariableRef(name=n, origin="workspace") for n in sorted(config.variables)]
    hidden = [VariableRef(name=n, origin="workspace", sensitive=True) for n in secret_names]
    return plain + hidden


def settings(config: Workspace) -> dict[str, Any]:
    """The settings the run executes under, each `{"value", "origin"}`, as far as the
    workspace's configuration knows them. The scheduler's `App` overlays the effective
    settings resolved along organization -> folders -> workspace (services/app/commands.py)."""
    return {
        **effective([("workspace", config_settings(config))]),
        "managed_state": {"value": config.managed_state, "origin": "workspace"},
    }


class Snapshotter:
    """Takes a run's snapshot at admission; the scheduler's `App` calls it."""

    def __init__(
        self,
        secrets: SecretStore | None = None,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        access: GitAccess | None = None,
        sources: Sources | None = None,
    ):
        self.secrets = secrets
        self.timeout = timeout
        # What `ls-remote` may ask (the deployment's sources: the root sets them).
        self.sources = sources
        # Whose credential `ls-remote` asks with (services/app/gitcreds.py); the root sets
        # it. None: none at all, anonymously.
        self.access = access
        # One `git ls-remote` per repository and branch at a time: admissions that ask
        # while one runs share its answer (the branch head as of at most one query ago;
        # at 10,000 workspaces the spawns were half the scheduler's time: bench/README.md).
        # Per organization: each asks with its own credential.
        self._resolving: dict[tuple[str, str, str], asyncio.Future[str]] = {}

    async def _commit(self, org: str, config: Workspace) -> str:
        key = (org, config.repository, config.branch)
        running = self._resolving.get(key)
        if running is None:
            running = asyncio.ensure_future(self._resolve(org, config))
            self._resolving[key] = running
            running.add_done_callback(lambda _: self._resolving.pop(key, None))
        return await asyncio.shield(running)

    async def _resolve(self, org: str, config: Workspace) -> str:
        cred = NONE if self.access is None else await self.access.credential(org, config)
        return await resolve_commit(
            config.repository,
            config.branch,
            timeout=self.timeout,
            credential=cred,
            sources=self.sources,
            org=org,
        )

    async def __call__(self, run: RunState) -> Snapshot:
        config = run.config
        if config is None:
            raise SnapshotFailed("the run has no workspace configuration")
        # A run created for a commit (a webhook's push or pull request) plans exactly it;
        # else the branch head as of now. A run of an uploaded configuration (the CLI's)
        # has no commit: its archive's digest, in run.created, pins what it plans.
        if run.source is not None:
            commit = ""
        else:
            commit = run.requested_commit or await self._commit(run.org, config)
        return Snapshot(
            commit=commit,
            variables=variables(config, await self._secret_names(run, config)),
            settings=settings(config),
        )

    async def _secret_names(self, run: RunState, config: Workspace) -> list[str]:
        """The secret variables stored now; without a store, the names the workspace had."""
        if self.secrets is None:
            return sorted(config.secret_variables)
        return await self.secrets.names(run.org, run.workspace)
