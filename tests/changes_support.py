"""Shared by the change-review tests and the drift schedule's (real Terraform with the
fake provider, tests/provider): a drift configuration, files committed to a repository,
an executor with the fake provider's mirror (the `executor` fixture, conftest's
overridden), and a run driven to `applied`. Holds no tests itself."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from executor import Executor, TerraformConfig
from tests import bootstrap_support
from tests.bootstrap_support import System
from tests.executor_support import Harness, git
from tests.provider import REQUIRED_PROVIDERS

DRIFT_TF = (
    REQUIRED_PROVIDERS
    + """
resource "fake_thing" "a" {
  name  = "a"
  value = "planned"
}
resource "fake_thing" "b" { name = "b" }
"""
)


def commit_files(repo: Path, files: dict[str, str]) -> str:
    for name, text in files.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(text)
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "change")
    return git(repo, "rev-parse", "HEAD")


@pytest.fixture
async def executor(system: System, tmp_path: Path, fake_mirror: Path) -> AsyncIterator[Executor]:
    """conftest's, with the fake provider's mirror."""
    async with bootstrap_support.executor(
        system,
        work_dir=tmp_path / "exec",
        executor_id="test-exec",
        terraform=TerraformConfig(provider_mirrors=[fake_mirror]),
    ) as ex:
        yield ex


async def applied_run(h: Harness, ws: str) -> str:
    run_id = await h.start_run(ws)
    await h.reaches(ws, run_id, "awaiting_approval")
    await h.approve(ws, run_id)
    await h.reaches(ws, run_id, "applied")
    return run_id
