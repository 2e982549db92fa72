"""Driving the executor's tests: git repositories on disk, the Terraform configurations
they commit, and `Harness`, which creates, admits, dispatches and approves runs the way
the scheduler would. Holds no tests itself."""

from __future__ import annotations

import io
import json
import os
import subprocess
from pathlib import Path
from typing import Any

from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

from events.run import ApproveRun, RunState, StepFinished, Workspace
from infra.streams import DISPATCH, DISPATCHES, dispatch_subject
from services.app.commands import App
from tests import builders
from tests.helpers import eventually

MAIN_TF = """
variable "n" { default = "1" }
resource "null_resource" "hello" {
  count    = tonumber(var.n)
  triggers = { n = var.n }
}
"""

# The plan blocks reading a named pipe until the test writes to it: a plan that is
# running for as long as the test wants, with nothing but the null provider.
GATED_PLAN_TF = """
variable "gate" {}
resource "null_resource" "gated" {
  triggers = { gate = file(var.gate) }
}
"""

_GIT_ENV = {
    **os.environ,
    "GIT_AUTHOR_NAME": "t",
    "GIT_AUTHOR_EMAIL": "t@example.com",
    "GIT_COMMITTER_NAME": "t",
    "GIT_COMMITTER_EMAIL": "t@example.com",
}


def git(repo: Path, *args: str) -> str:
    done = subprocess.run(
        ["git", *args], cwd=repo, env=_GIT_ENV, check=True, capture_output=True, text=True
    )
    return done.stdout.strip()


def commit(repo: Path, main_tf: str) -> str:
    """Write main.tf, commit it on `main`, return the commit sha."""
    (repo / "main.tf").write_text(main_tf)
    git(repo, "add", "main.tf")
    git(repo, "commit", "-q", "-m", "change")
    return git(repo, "rev-parse", "HEAD")


class Harness:
    """Drives runs the way the scheduler would: create, admit, dispatch, approve."""

    def __init__(self, nc: NATS, app: App) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.app = app

    async def workspace(self, ws: str, config: Workspace, org: str = "acme") -> None:
        await builders.workspace(self.app, ws, org=org, actor="alice", config=config)

    async def start_run(self, ws: str, run_type: str = "apply", org: str = "acme") -> str:
        run_id = (await self.app.create_run(org, ws, run_type, "alice")).state.run_id
        assert await self.app.admit_next(org, ws) == run_id
        await self.dispatch(ws, run_id, "plan", org)
        return str(run_id)

    async def dispatch(self, ws: str, run_id: str, phase: str, org: str = "acme") -> None:
        body = {"org": org, "workspace": ws, "run_id": run_id, "phase": phase}
        await self.js.publish(
            dispatch_subject("default", org),
            json.dumps(body).encode(),
            headers={"Nats-Msg-Id": f"{run_id}:{phase}"},
        )

    async def approve(self, ws: str, run_id: str, org: str = "acme") -> None:
        await self.app.run_command(org, ws, run_id, ApproveRun(actor="alice"))
        await self.dispatch(ws, run_id, "apply", org)

    async def run(self, ws: str, run_id: str, org: str = "acme") -> RunState:
        return (await self.app.load_run(org, ws, run_id)).state  # type: ignore[no-any-return]

    async def reaches(self, ws: str, run_id: str, status: str, org: str = "acme") -> RunState:
        async def probe() -> RunState:
            state = await self.run(ws, run_id, org)
            assert str(state.status) == status, (
                f"{state.status} {state.reason} {state.error_message}"
            )
            return state

        return await eventually(probe, timeout=30, what=f"run {run_id} {status}")

    async def events(self, ws: str, run_id: str, org: str = "acme") -> list[Any]:
        envs = await self.app.store.read(f"rp.run.{org}.{ws}.{run_id}")
        return [e.event for e in envs]

    async def get(self, bucket: str, name: str) -> bytes:
        buf = io.BytesIO()
        store = await self.js.object_store(bucket)
        await store.get(name, writeinto=buf)
        return buf.getvalue()


def step_results(events: list[Any]) -> dict[str, StepFinished]:
    return {e.step: e for e in events if isinstance(e, StepFinished)}


async def dispatches_left(js: JetStreamContext, pool: str = "default") -> int:
    """How many dispatch messages wait in a pool's queue, every organization's."""
    info = await js.stream_info(DISPATCH, subjects_filter=DISPATCHES)
    prefix = dispatch_subject(pool)
    subjects = (info.state.subjects or {}).items()
    return sum(n for s, n in subjects if s == prefix or s.startswith(prefix + "."))
