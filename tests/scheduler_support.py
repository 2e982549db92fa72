"""Shared by the scheduler's tests and the process tests: `FakeExecutor`, which stands in
for Terraform on the real work queue, and `check_history`, which reads FIFO admission
and one active run per workspace from the event history alone. Holds no tests itself."""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict

from nats.aio.client import Client as NATS

from events import run as R
from events.workspace import RunAdmitted, RunEnqueued, RunReleased
from infra import streams
from infra.eventstore import Envelope
from infra.ids import new_id
from services.app.commands import App


class FakeExecutor:
    """Stands in for Terraform only: claims dispatched phases through the real work queue
    and finishes each plan with no changes, so runs end and free their workspace."""

    def __init__(self, nc: NATS, app: App) -> None:
        self.nc, self.app = nc, app
        self.claimed: list[str] = []
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> FakeExecutor:
        js = self.nc.jetstream()
        await streams.ensure_executor_consumer(js, "default")
        self.sub = await js.pull_subscribe_bind(
            durable=streams.executor_consumer("default"), stream=streams.DISPATCH
        )
        self._task = asyncio.create_task(self._loop())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)

    async def _loop(self) -> None:
        while True:
            try:
                msgs = await self.sub.fetch(10, timeout=0.5)
            except Exception:  # noqa: BLE001  # fetch timeouts: poll again
                continue
            for m in msgs:
                body = json.loads(m.data)
                await m.ack()
                await self._work(body)

    async def _work(self, body: dict[str, str]) -> None:
        lease = new_id()
        org, ws, run = body["org"], body["workspace"], body["run_id"]
        try:
            await self.app.run_command(
                org,
                ws,
                run,
                R.ClaimPhase(actor="fake", phase=body["phase"], lease_id=lease, executor_id="f"),
            )
        except Exception:  # noqa: BLE001  # claim refused: already claimed or canceled
            return
        self.claimed.append(run)
        await self.app.run_command(
            org,
            ws,
            run,
            R.FinishPlan(
                actor="fake", lease_id=lease, commit="c", has_changes=False, summary=R.PlanSummary()
            ),
        )


def check_history(envs: list[Envelope]) -> dict[str, list[str]]:
    """From the event history alone: FIFO admission and one active run per workspace.
    Returns each workspace's admission order."""
    enqueued: dict[str, list[str]] = defaultdict(list)
    admitted: dict[str, list[str]] = defaultdict(list)
    active: dict[str, str] = {}
    gone: set[str] = set()
    for env in envs:
        ev, ws = env.event, env.subject
        if isinstance(ev, RunEnqueued):
            enqueued[ws].append(ev.run_id)
        elif isinstance(ev, RunAdmitted):
            assert not active.get(ws), f"{ev.run_id} admitted while {active[ws]} active in {ws}"
            waiting = [r for r in enqueued[ws] if r not in gone and r not in admitted[ws]]
            assert waiting and waiting[0] == ev.run_id, f"{ev.run_id} overtook {waiting[:1]}"
            admitted[ws].append(ev.run_id)
            active[ws] = ev.run_id
        elif isinstance(ev, RunReleased):
            gone.add(ev.run_id)
            if active.get(ws) == ev.run_id:
                active[ws] = ""
    return admitted
