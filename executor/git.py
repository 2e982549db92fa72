"""Checking out a workspace's repository: a fresh clone per phase, never an interactive prompt."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import NamedTuple

from executor import process
from executor.errors import StepFailed
from executor.output import Output
from executor.process import StepLog
from services.infra.childenv import git_env

_SHA = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")


# A checkout that hangs (a silent git server) must not hold a run forever.
GIT_TIMEOUT_S = 600.0


async def _git(args: list[str], *, cwd: Path, step_log: StepLog, grace: float) -> Output:
    out = Output()
    try:
        code = await asyncio.wait_for(
            process.run(
                ["git", *args],
                cwd=cwd,
                env=git_env(),
                step_log=step_log,
                on_line=out.feed,
                grace=grace,
            ),
            GIT_TIMEOUT_S,
        )
    except TimeoutError as e:
        raise StepFailed("checkout", f"git {args[0]} timed out after {GIT_TIMEOUT_S:g}s") from e
    if code != 0:
        raise StepFailed("checkout", f"git {args[0]} failed (exit {code}): {out.error_text()}")
    return out


async def checkout(
    repository: str,
    dest: Path,
    *,
    branch: str,
    commit: str = "",
    step_log: StepLog,
    grace: float = 5.0,
) -> str:
    """Clone `repository` (a path or URL) into `dest` at `branch`, or at `commit` if given.

    Returns the checked-out commit sha. The apply phase passes the plan's commit: a branch
    that moved since the plan must not change what gets applied.
    """
    if commit and not _SHA.fullmatch(commit):
        raise StepFailed("checkout", f"not a commit sha: {commit!r}")
    if commit:
        # All branches, not only `branch`: the commit may no longer be its head.
        args = ["clone", "--no-checkout", "--", repository, str(dest)]
    else:
        args = ["clone", "--single-branch", "--branch", branch, "--", repository, str(dest)]
    await _git(args, cwd=dest.parent, step_log=step_log, grace=grace)
    if commit:
        await _git(["checkout", "--detach", commit], cwd=dest, step_log=step_log, grace=grace)
    head = await _git(["rev-parse", "HEAD"], cwd=dest, step_log=step_log, grace=grace)
    sha = head.last_line.strip()
    if commit and sha != commit:
        raise StepFailed("checkout", f"checked out {sha}, expected {commit}")
    return sha


class Commit(NamedTuple):
    """A checked-out commit: its sha, author (`Name <email>`) and subject line."""

    sha: str
    author: str = ""
    message: str = ""


async def describe(dest: Path, sha: str, *, step_log: StepLog, grace: float = 5.0) -> Commit:
    """Who made the checked-out commit and the first line of its message."""
    fmt = "--format=%an <%ae>%x1f%s"  # one line: author, unit separator, subject
    out = await _git(["log", "-1", fmt, sha], cwd=dest, step_log=step_log, grace=grace)
    author, _, subject = out.last_line.partition("\x1f")
    return Commit(sha, author.strip(), subject.strip())
