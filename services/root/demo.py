"""The demo organization `demo` with workspace `hello`, created once by `runplane up`."""

from __future__ import annotations

import subprocess
from pathlib import Path

from events.errors import AlreadyExists
from events.run import Workspace
from services.app.commands import App

DEMO_ORG = "demo"
DEMO_WS = "hello"

MAIN_TF = """\
# runplane demo: null resources, so plan and apply run for real with no cloud account.
variable "greeting" {
  type    = string
  default = "hello"
}

variable "n" {
  type    = string
  default = "2"
}

resource "null_resource" "hello" {
  count = tonumber(var.n)
  triggers = {
    greeting = var.greeting
    index    = count.index
  }
}

output "ids" {
  value = null_resource.hello[*].id
}
"""


def _git(repo: Path, *args: str) -> None:
    subprocess.run(
        ["git", "-C", str(repo), *args],
        check=True,
        capture_output=True,
        env={
            "GIT_AUTHOR_NAME": "runplane demo",
            "GIT_AUTHOR_EMAIL": "demo@runplane.invalid",
            "GIT_COMMITTER_NAME": "runplane demo",
            "GIT_COMMITTER_EMAIL": "demo@runplane.invalid",
            "PATH": "/usr/bin:/bin:/usr/local/bin",
            "HOME": str(repo),
        },
    )


def make_demo_repo(path: Path) -> Path:
    """A local git repository with a small Terraform configuration (idempotent)."""
    if (path / ".git").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    (path / "main.tf").write_text(MAIN_TF)
    _git(path, "init", "-q", "-b", "main")
    _git(path, "add", "main.tf")
    _git(path, "commit", "-q", "-m", "demo: two null resources")
    return path


async def ensure_demo(app: App, data_dir: Path) -> None:
    """Create the demo org and workspace unless they exist already. The repository is
    recorded by its absolute path: git runs in other directories (an executor's job
    directory), where a path relative to the data directory's parent means nothing."""
    repo = make_demo_repo((data_dir / "demo-repo").resolve())
    try:
        await app.create_org(DEMO_ORG, "admin")
    except AlreadyExists:
        pass
    try:
        await app.create_workspace(
            DEMO_ORG,
            DEMO_WS,
            Workspace(repository=str(repo), branch="main", directory=".", variables={"n": "2"}),
            "admin",
        )
    except AlreadyExists:
        pass
