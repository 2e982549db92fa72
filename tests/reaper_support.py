"""The reaper's tests play executors themselves: runs claimed through the App (queued by
tests/builders.py), beats put on the board, a run's state and failures read back; and
for the tests with real `runplane executor` processes, the deployment's key, signals to
a process tree and counts over a run's events. Holds no tests itself."""

from __future__ import annotations

import base64
import os
import signal
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from events import run as R
from infra.heartbeats import Beat, Board, Body, body, subject
from infra.ids import new_id
from services.app.commands import App
from tests import builders
from tests.helpers import eventually
from tests.procs import Proc, descendants

ORG = builders.ORG


async def workspace(app: App, ws: str, *, heartbeat: int = 600, dispatch: int = 0) -> None:
    await builders.workspace(app, ws, heartbeat_timeout=heartbeat, dispatch_timeout=dispatch)


async def claim(app: App, ws: str, run_id: str, phase: str = "plan") -> str:
    lease = new_id()
    cmd = R.ClaimPhase(actor="executor:t", phase=phase, lease_id=lease, executor_id="t")
    await app.run_command(ORG, ws, run_id, cmd)
    return lease


async def beat(board: Board, ws: str, run_id: str, lease: str, timeout: int, **extra: str) -> None:
    data = body(lease_id=lease, executor_id="t", org=ORG, workspace=ws, timeout=timeout, **extra)
    assert await board.put(subject(run_id, "plan"), data)


async def state(app: App, ws: str, run_id: str) -> R.RunState:
    return (await app.load_run(ORG, ws, run_id)).state  # type: ignore[no-any-return]


async def reaches(app: App, ws: str, run_id: str, status: str, timeout: float = 15) -> R.RunState:
    async def probe() -> R.RunState:
        s = await state(app, ws, run_id)
        assert str(s.status) == status, f"{s.status} {s.reason} {s.error_message}"
        return s

    return await eventually(probe, timeout=timeout, what=f"run {run_id} {status}")


async def failures(app: App, ws: str, run_id: str) -> list[R.RunFailed]:
    envs = await app.store.read(f"rp.run.{ORG}.{ws}.{run_id}")
    return [e.event for e in envs if isinstance(e.event, R.RunFailed)]


NOW = datetime(2025, 1, 2, tzinfo=UTC)


def entry(phase: str, lease: str) -> Beat:
    return Beat(
        subject=f"rp.hb.run-1.{phase}",
        seq=1,
        time=NOW,
        run_id="run-1",
        phase=phase,
        body=Body(lease_id=lease, kind="" if lease else "dispatched"),
    )


# Executors of one deployment share the key that seals plans and state.
KEY = base64.b64encode(os.urandom(32)).decode()


def signal_tree(proc: Proc, sig: signal.Signals) -> None:
    """Signal the process and its descendants: SIGKILL is a host lost, SIGSTOP a VM paused."""
    assert proc.proc is not None
    for pid in descendants(proc.proc.pid):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


async def setup_workspace(app: App, ws: str, repo: Path, **cfg: Any) -> None:
    await builders.workspace(app, ws, repository=str(repo), **cfg)


async def run_events(app: App, ws: str, run_id: str) -> list[Any]:
    return [e.event for e in await app.store.read(f"rp.run.{ORG}.{ws}.{run_id}")]


def count(events: list[Any], kind: type, **match: str) -> int:
    return sum(
        isinstance(e, kind) and all(getattr(e, k) == v for k, v in match.items()) for e in events
    )
