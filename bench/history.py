"""Valid runplane histories, fast: drive one real run through the `App`, then copy its
encoded events for many runs and workspaces (ids substituted) with pipelined publishes."""

from __future__ import annotations

from datetime import UTC, datetime

import msgspec
from nats.aio.client import Client as NATS

from events.codec import encode, tag_of
from events.run import (
    ClaimPhase,
    FinishApply,
    FinishPlan,
    FinishStep,
    PlanSummary,
    StartStep,
    Workspace,
)
from infra.eventstore import EventStore
from services.app.commands import App

from .common import Firehose

ORG = "bench"
EXECUTOR = "exec-bench"
TPL_WS = "wstplxq"
CONFIG = Workspace(repository="/repo", variables={"region": "eu-west-1", "env": "bench"})


async def run_phase(app: App, org: str, ws: str, run_id: str, phase: str) -> str:
    """Claim a phase and run its three steps like an executor would; returns the lease."""
    lease = f"{run_id}-{phase}"
    claim = ClaimPhase(actor=EXECUTOR, phase=phase, lease_id=lease, executor_id=EXECUTOR)
    await app.run_command(org, ws, run_id, claim)
    for step in ("checkout", "init", phase):
        started = datetime.now(UTC)
        await app.run_command(org, ws, run_id, StartStep(actor=EXECUTOR, lease_id=lease, step=step))
        finish = FinishStep(
            actor=EXECUTOR,
            lease_id=lease,
            step=step,
            ok=True,
            started_at=started,
            log_object=f"{run_id}/{phase}/{step}.log",
        )
        await app.run_command(org, ws, run_id, finish)
    return lease


async def full_run(app: App, org: str, ws: str) -> str:
    """Create, admit, plan (no approval needed), apply: the commands of a whole run."""
    created = await app.create_run(org, ws, "apply", "alice", message="bench")
    run_id = str(created.state.run_id)
    await app.admit_next(org, ws)
    lease = await run_phase(app, org, ws, run_id, "plan")
    summary = PlanSummary(add=2, change=1, destroy=0)
    await app.run_command(
        org,
        ws,
        run_id,
        FinishPlan(
            actor=EXECUTOR,
            lease_id=lease,
            commit="0" * 40,
            has_changes=True,
            summary=summary,
            plan_digest="sha256:" + "f" * 64,
            require_approval=False,
        ),
    )
    lease = await run_phase(app, org, ws, run_id, "apply")
    await app.run_command(
        org, ws, run_id, FinishApply(actor=EXECUTOR, lease_id=lease, summary=summary)
    )
    return run_id


Msg = tuple[str, bytes, dict[str, str]]


class Template:
    """One workspace's creation and one run's whole lifecycle, as stored."""

    def __init__(
        self, workspace: list[Msg], run: list[Msg], run_id: str, lock: list[Msg], unlock: list[Msg]
    ) -> None:
        self.workspace = workspace
        self.run = run
        self.run_id = run_id
        self.lock = lock
        self.unlock = unlock

    @staticmethod
    def _sub(msgs: list[Msg], pairs: list[tuple[str, str]]) -> list[Msg]:
        out = []
        for subject, data, hdrs in msgs:
            for old, new in pairs:
                subject = subject.replace(old, new)
                data = data.replace(old.encode(), new.encode())
            out.append((subject, data, hdrs))
        return out

    def workspace_msgs(self, ws: str) -> list[Msg]:
        return self._sub(self.workspace, [(TPL_WS, ws)])

    def lock_msgs(self, ws: str) -> list[Msg]:
        return self._sub(self.lock, [(TPL_WS, ws)])

    def unlock_msgs(self, ws: str) -> list[Msg]:
        return self._sub(self.unlock, [(TPL_WS, ws)])

    def run_msgs(self, ws: str, run_id: str, types: frozenset[str] | None = None) -> list[Msg]:
        """The run's events for this workspace and id; only `types` if given."""
        msgs = [m for m in self.run if types is None or m[2]["Rp-Type"] in types]
        return self._sub(msgs, [(TPL_WS, ws), (self.run_id, run_id)])


async def capture(nc: NATS, repository: str = "/repo") -> Template:
    """Drive one real run on a fresh organization and keep its events as the template."""
    app = App(EventStore(nc))
    store = app.store
    await app.create_org(ORG, "admin")
    before = await store.last_seq()
    config = msgspec.structs.replace(CONFIG, repository=repository)
    await app.create_workspace(ORG, TPL_WS, config, "alice")
    after_ws = await store.last_seq()
    run_id = await full_run(app, ORG, TPL_WS)
    after_run = await store.last_seq()
    await app.lock_workspace(ORG, TPL_WS, "bench", "alice")
    after_lock = await store.last_seq()
    await app.unlock_workspace(ORG, TPL_WS, "alice", admin=True)
    envs = await store.read("rp.>", after=before)
    parts: list[list[Msg]] = [[], [], [], []]
    for env in envs:
        msg = (env.subject, encode(env.event), {"Rp-Type": tag_of(env.event)})
        part = sum(env.seq > bound for bound in (after_ws, after_run, after_lock))
        parts[part].append(msg)
    return Template(parts[0], parts[1], run_id, parts[2], parts[3])


def run_id_for(k: int) -> str:
    return f"r{k:025d}"


def ws_name(j: int) -> str:
    return f"ws{j:06d}"


async def publish_history(
    nc: NATS, template: Template, *, events: int, workspaces: int, runs_offset: int = 0
) -> tuple[int, int]:
    """Publish at least `events` events: `workspaces` workspaces, then whole runs spread
    over them round robin. Returns (events published, runs)."""
    sent = 0
    runs = 0
    async with Firehose(nc) as hose:
        for j in range(workspaces):
            for subject, data, hdrs in template.workspace_msgs(ws_name(j)):
                await hose.put(subject, data, hdrs)
                sent += 1
        while sent < events:
            ws = ws_name(runs % workspaces)
            run_id = run_id_for(runs_offset + runs)
            for i, (subject, data, hdrs) in enumerate(template.run_msgs(ws, run_id)):
                # As stored by the App: the type and a message id (not the expected sequence:
                # the server would check it).
                await hose.put(subject, data, {**hdrs, "Nats-Msg-Id": f"{run_id}-{i}"})
                sent += 1
            runs += 1
    return sent, runs
