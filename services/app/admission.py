"""Admission: a workspace's next run (or a speculative plan) becomes `queued`, and the
scheduler's snapshot pins it before any executor may claim it.

Admission is `ws.run_admitted` (the decision: who holds the workspace, an optimistic
append), then `run.queued`. A workspace whose active run is still pending has its
admission finished by the next admission attempt (`admit_next`); a terminal run holding
the workspace, or at the head of its queue, is released before the next goes.
"""

from __future__ import annotations

import asyncio

import msgspec

from events import folder as fo
from events import inherit
from events import policies as po
from events import run as run_agg
from events import workspace as ws_agg
from events.errors import Conflict, IllegalTransition, SnapshotFailed
from infra import tracing
from infra.eventstore import StoreError
from services.app.execute import Loaded
from services.app.flows import RunFlows


class Admission(RunFlows):
    """The scheduler's flows: admit, admit a speculative plan, pin."""

    @tracing.command
    async def admit_next(
        self, org: str, ws: str, actor: str = "scheduler", *, hint: str = ""
    ) -> str:
        """Admit the oldest pending run of the workspace if none is active; return its id.

        Admission is `ws.run_admitted`, then `run.queued`; with a `snapshot` hook the run
        is queued `pinning`, and its snapshot follows (`pin_run`, the scheduler's next
        step): no `git` on the way to `queued`. It also finishes what a writer that died
        left half done: an admitted run still pending is queued, and a terminal run
        holding the workspace or at the head of its queue is released before the next
        goes. `hint`: a run likely at the head (just enqueued), loaded beside the
        workspace rather than after it.
        """

        async def attempt() -> str:
            if hint:
                w, hinted = await asyncio.gather(
                    self.load_ws(org, ws), self.load_run(org, ws, hint)
                )
            else:
                w, hinted = await self.load_ws(org, ws), None
            if w.state.active:
                r = await self.load_run(org, ws, w.state.active)
                if r.state.terminal:
                    await self.release(r.state, actor)
                    raise Conflict("released a terminal run: admit the next")
                if r.state.status != run_agg.Status.PENDING:
                    return ""  # busy
                return await queue(r)  # admitted, and its writer died before run.queued
            ws_events = ws_agg.decide(
                w.state, ws_agg.AdmitNext(actor=actor), now=self.clock(), new_id=self.ids
            )
            if not ws_events:
                return ""
            run_id = ws_events[0].run_id  # type: ignore[union-attr]  # AdmitNext yields RunAdmitted
            if hinted is not None and hinted.state.run_id == run_id:
                r = hinted
            else:
                r = await self.load_run(org, ws, run_id)
            if not r.state.exists:  # the stream has every run before its enqueue
                raise StoreError(f"run {run_id} of the queue of {ws} is not in the stream")
            if r.state.terminal:  # canceled as it was being enqueued
                await self.release(r.state, actor)
                raise Conflict("released a terminal run: admit the next")
            if r.state.status != run_agg.Status.PENDING:  # another scheduler admitted it
                raise Conflict("the workspace moved on: reload it")
            await self.append(self.appends(w.subject, w.seq, list(ws_events)))
            return await queue(r)

        async def queue(r: Loaded[run_agg.RunState]) -> str:
            state: run_agg.RunState = r.state
            admit = run_agg.AdmitRun(actor=actor, pinning=self.snapshot is not None)
            run_events = run_agg.decide(state, admit, now=self.clock(), new_id=self.ids)
            seq = await self.append(self.appends(r.subject, r.seq, list(run_events)))
            self.remember(r.subject, seq, run_agg.fold(run_events, state))
            return state.run_id

        return await self.retrying(attempt)

    @tracing.command
    async def admit_speculative(
        self, org: str, ws: str, run_id: str, actor: str = "scheduler"
    ) -> bool:
        """Admit a pending speculative plan at once, pinned like any run (`pin_run`) but
        with no workspace event: it neither waits for its workspace nor holds it, and a
        locked workspace does not stop it (it changes nothing). False if there was nothing
        to admit: not speculative, or admitted already (by another scheduler)."""

        async def attempt() -> bool:
            r, w = await asyncio.gather(self.load_run(org, ws, run_id), self.load_ws(org, ws))
            if not r.state.speculative or r.state.status != run_agg.Status.PENDING:
                return False
            if w.state.deleted:  # created as its workspace was deleted
                await self._refuse_deleted(org, ws, run_id, actor)
                return False
            admit = run_agg.AdmitRun(actor=actor, pinning=self.snapshot is not None)
            evs = run_agg.decide(r.state, admit, now=self.clock(), new_id=self.ids)
            await self.append(self.appends(r.subject, r.seq, list(evs)))
            return True

        return await self.retrying(attempt)

    @tracing.command
    async def pin_run(
        self,
        org: str,
        ws: str,
        run_id: str,
        actor: str = "scheduler",
        *,
        loaded: Loaded[run_agg.RunState] | None = None,
    ) -> bool:
        """Take and record the snapshot of an admitted run that waits for it (`run.pinned`,
        before any executor may claim it); a run whose snapshot cannot be taken fails with
        `checkout_failed`. False if there was nothing to pin (pinned already, by another
        scheduler; or the run ended meanwhile). `loaded`: the run as just read (the pin's
        append checks it is still current)."""
        r = loaded if loaded is not None else await self.load_run(org, ws, run_id)
        if self.snapshot is None or not r.state.pinning:
            return False
        try:
            snap = await self._snapshot_of(r.state)
        except SnapshotFailed as e:
            await self._unpinnable(org, ws, run_id, actor, e)
            return False
        pin = run_agg.PinRun(actor=actor, snapshot=snap)
        try:
            done = await self.run_command(org, ws, run_id, pin)
        except IllegalTransition:  # canceled while its snapshot was taken
            return False
        return bool(done.events)

    async def _snapshot_of(self, run: run_agg.RunState) -> run_agg.Snapshot:
        """The hook's snapshot, its settings the effective ones (value and origin) now,
        and the policy sets of the workspace's organization, folders and its own."""
        assert self.snapshot is not None
        snap = await self.snapshot(run)
        o, w = await asyncio.gather(self.load_org(run.org), self.load_ws(run.org, run.workspace))
        settings = {**snap.settings, **inherit.for_workspace(o.state, w.state)}
        # The policy sets the plan will be checked against, as they are now.
        folders = fo.path(o.state.folders, w.state.folder)
        policies = po.for_workspace(o.state.policies, folders, run.workspace)
        return msgspec.structs.replace(snap, settings=settings, policies=policies)

    async def _unpinnable(
        self, org: str, ws: str, run_id: str, actor: str, error: SnapshotFailed
    ) -> str:
        """Fail a run whose snapshot cannot be taken, if it still waits for it (another
        scheduler may have pinned it meanwhile); it gives its workspace back."""
        fail = run_agg.FailRun(actor=actor, reason="checkout_failed", message=str(error))

        def still_pinning(run: run_agg.RunState) -> None:
            if not run.pinning:
                raise IllegalTransition("the run was pinned meanwhile", status=str(run.status))

        try:
            await self.run_command(org, ws, run_id, fail, guard=still_pinning)
        except IllegalTransition:  # pinned, or failed, by another scheduler first
            pass
        return ""
