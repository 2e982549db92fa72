"""Real git behind GitHub's example pushes, for the stale and duplicate push tests: a
repository on `master` the test commits to, reached by runplane as the workspaces name it
(`https://github.com/acme/net.git`, git's own `url.<base>.insteadOf` pointing it at the
local repository, so the code under test runs the git it runs in production), pushes of
its commits in GitHub's own payload, and a run driven to `applied` at a commit as an
executor would report it. Holds no tests itself."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from events.run import ClaimPhase, FinishApply, FinishPlan, FinishStep, StartStep
from events.values import PlanSummary
from services.app.commands import App
from services.app.gitcreds import GitAccess
from services.root.bootstrap import Plane
from tests.executor_support import git
from tests.vcs_support import GITHUB_REPO, fixture, github_repo, pushed


def origin(root: Path) -> Path:
    """A repository on `master` with one commit (net/main.tf)."""
    repo = root / "origin" / "net"
    repo.mkdir(parents=True)
    git(repo, "init", "-q", "-b", "master")
    commit(repo, {"net/main.tf": "# v0\n"})
    return repo


def commit(repo: Path, files: dict[str, str]) -> str:
    """Write `files`, commit them on the checked-out branch; the commit's sha."""
    for name, text in files.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(text)
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", f"change {sorted(files)}")
    return git(repo, "rev-parse", "HEAD")


def redirect(monkeypatch: pytest.MonkeyPatch, repo: Path, url: str = GITHUB_REPO) -> None:
    """git (in this process and its children) fetches `url` from `repo`: through the
    host's git configuration, which runplane's git reads only for the organizations a
    deployment allows the host's credentials (`host_git`; a process started now:
    `RUNPLANE_HOST_GIT_CREDENTIALS=*`)."""
    monkeypatch.setenv("RUNPLANE_HOST_GIT_CREDENTIALS", "*")
    monkeypatch.setenv("GIT_CONFIG_COUNT", "1")
    monkeypatch.setenv("GIT_CONFIG_KEY_0", f"url.{repo.as_uri()}.insteadOf")
    monkeypatch.setenv("GIT_CONFIG_VALUE_0", url)


def host_git(plane: Plane) -> GitAccess:
    """git with the host's configuration (the redirect) for every organization, as
    `--host-git-credentials '*'` gives it."""
    return GitAccess(plane.app, None, lambda _: True)


def redirect_env(repo: Path, url: str = GITHUB_REPO) -> dict[str, str]:
    """`redirect`'s variables, for a process of its own."""
    return {
        "RUNPLANE_HOST_GIT_CREDENTIALS": "*",
        "GIT_CONFIG_COUNT": "1",
        "GIT_CONFIG_KEY_0": f"url.{repo.as_uri()}.insteadOf",
        "GIT_CONFIG_VALUE_0": url,
    }


def push_of(sha: str, files: list[str]) -> dict[str, Any]:
    """GitHub's push example on acme/net's master, its one commit `sha` changing `files`."""
    return pushed(github_repo(fixture("github/push.branch.json"), "acme/net"), files, sha)


async def applied_at(app: App, org: str, ws: str, run_id: str, sha: str) -> None:
    """Admit the run and report it planned at `sha` (no approval asked) and applied, as
    an executor would."""
    await app.admit_next(org, ws)
    for phase in ("plan", "apply"):
        lease = f"{run_id}-{phase}"
        claim = ClaimPhase(actor="exec", phase=phase, lease_id=lease, executor_id="exec")
        await app.run_command(org, ws, run_id, claim)
        for step in ("checkout", "init", phase):
            await app.run_command(
                org, ws, run_id, StartStep(actor="exec", lease_id=lease, step=step)
            )
            done = FinishStep(
                actor="exec",
                lease_id=lease,
                step=step,
                ok=True,
                started_at=app.clock(),
                log_object=f"{run_id}/{step}.log",
            )
            await app.run_command(org, ws, run_id, done)
        summary = PlanSummary(add=1, change=0, destroy=0)
        finish: FinishPlan | FinishApply = (
            FinishPlan(
                actor="exec",
                lease_id=lease,
                commit=sha,
                has_changes=True,
                summary=summary,
                plan_digest="sha256:feed",
                require_approval=False,
            )
            if phase == "plan"
            else FinishApply(actor="exec", lease_id=lease, summary=summary)
        )
        await app.run_command(org, ws, run_id, finish)
    await app.admit_next(org, ws)  # releases the workspace
