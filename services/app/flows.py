"""The flows of a run that span its aggregate and its workspace's: create and enqueue, a
run command that ends it and the release that follows; admission and pinning build on
these (services/app/admission.py).

Every writer (api, scheduler, executor) goes through these (`App`, services/app/commands.py,
adds the single-aggregate commands), so the rules that span two aggregates live in one
place. Each append touches one aggregate (atomic batches cost the
server ~2 ms each, ten plain appends' worth), and every step that spans two is ordered
so that a crash between its appends leaves a state the scheduler finishes or heals:

- create: `run.created`, then `ws.run_enqueued`. A run created but never enqueued (its
  writer died) is enqueued by the scheduler when `run.created` comes round again.
- admission: `ws.run_admitted`, then `run.queued` (services/app/admission.py).
- a terminal run: its terminal event, then `ws.run_released`. A workspace holding a
  terminal run (or with one at the head of its queue) is released by the next admission
  attempt, which the scheduler makes on every terminal run event.

A speculative plan (setting `speculative_plans`) is never enqueued: admitted on its own,
it holds and releases nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import datetime

import msgspec
import structlog

from events import inherit
from events import org as org_agg
from events import run as run_agg
from events import templates as te
from events import workspace as ws_agg
from events.codec import org_subject, run_subject, ws_subject
from events.errors import (
    Conflict,
    Deleted,
    DomainError,
    IllegalTransition,
    NotFound,
)
from events.run import Workspace
from infra import tracing
from infra.eventstore import LATEST, EventStore
from infra.ids import new_id, utcnow
from services.app.aggregates import ORG, RUN, WORKSPACE
from services.app.execute import ATTEMPTS, Loaded, Repository, Result
from services.app.openruns import OpenRuns

# Takes a run's admission snapshot (services/app/snapshot.py); raises SnapshotFailed.
SnapshotHook = Callable[[run_agg.RunState], Awaitable[run_agg.Snapshot]]

log = structlog.get_logger(__name__)


class RunFlows(Repository):
    """A run's flows across its aggregate and its workspace's. `snapshot`: the admission
    snapshot's hook (the scheduler's); without one, admitted runs are not pinned."""

    def __init__(
        self,
        store: EventStore,
        *,
        clock: Callable[[], datetime] = utcnow,
        ids: Callable[[], str] = new_id,
        attempts: int = ATTEMPTS,
        snapshot: SnapshotHook | None = None,
    ) -> None:
        super().__init__(store, clock=clock, ids=ids, attempts=attempts)
        self.snapshot = snapshot
        self.open_runs: OpenRuns | None = None  # the quota of open runs (set by the root)
        self._enqueue_locks: dict[str, asyncio.Lock] = {}  # per workspace subject

    def remember(self, subject: str, seq: int, state: run_agg.RunState) -> None:
        """Note a run as this App just wrote it: tried first by run_command, with no read."""
        self.states.remember(RUN.name, subject, seq, state)

    def known_run(self, subject: str) -> Loaded[run_agg.RunState] | None:
        """The run as this process last wrote, read or folded it (infra/folds.py), unread."""
        found = self.states.peek(RUN.name, subject)
        if found is None:
            return None
        real, seq, state = found
        return Loaded(subject=real, seq=seq, state=state)

    # ------------------------------------------------------------ loading

    async def load_run(
        self, org: str, ws: str | None, run: str, *, min_seq: int = 0
    ) -> Loaded[run_agg.RunState]:
        """Load a run; with `ws` unknown the subject is found by wildcard. `min_seq`: the
        stream sequence the read must be at least as new as (`eventstore.LATEST`: as the
        stream's leader has it now)."""
        return await self.load(RUN, run_subject(org, ws or "*", run), min_seq=min_seq)

    async def load_ws(self, org: str, ws: str) -> Loaded[ws_agg.WorkspaceState]:
        return await self.load(WORKSPACE, ws_subject(org, ws))

    async def load_org(self, org: str) -> Loaded[org_agg.OrgState]:
        return await self.load(ORG, org_subject(org))

    # ------------------------------------------------------------ runs

    async def run_is_open(self, org: str, ws: str, run_id: str) -> bool:
        """Whether the run exists and has not ended (the open-runs quota's question)."""
        run: run_agg.RunState = (await self.load_run(org, ws, run_id)).state
        return run.exists and not run.terminal

    @tracing.command
    async def create_run(
        self,
        org: str,
        ws: str,
        run_type: str,
        actor: str,
        message: str = "",
        template: str = "",
        *,
        cause: run_agg.Cause | None = None,
        commit: str = "",
        run_id: str = "",
        speculative: bool | None = None,
        source: run_agg.ConfigSource | None = None,
        options: run_agg.RunOptions | None = None,
    ) -> Result[run_agg.RunState]:
        """Record a pending run, then enqueue it on its workspace (`enqueue_run`).

        The run records its template's steps (`events.templates.resolve`): the one named,
        else the workspace's default for the run type (setting `templates`), else the
        built-in; Invalid if that template does not exist or does not suit the run type.
        Once `run.created` has landed the create has succeeded: should the enqueue fail,
        the scheduler enqueues the run when it sees `run.created`.

        `cause`: why it exists (`events.values.Cause`). `commit`: the commit it plans
        (a webhook's), pinned at admission instead of the branch head. `speculative`: a
        plan outside the queue (True) whatever the workspace's setting says (None).
        `run_id`: the run's id, derived by the caller from what identifies its cause
        (`derived_id`): if that run exists already, nothing is written and it is answered
        with `existed` (a redelivered webhook, a second scheduler replica). `source`: an
        uploaded configuration the executor extracts instead of checking the repository
        out; `options`: the plan's targets, replaces, refresh and run variables. A deleted
        workspace starts no run (`_shape`)."""
        new_run = run_id or self.ids()

        async def attempt() -> tuple[Result[run_agg.RunState], Loaded[ws_agg.WorkspaceState]]:
            w, o = await asyncio.gather(self.load_ws(org, ws), self.load_org(org))
            config, steps, outside_queue = _shape(o.state, w.state, run_type, template, speculative)
            if self.open_runs is not None:  # the workspace takes it: counted, or refused
                await self.open_runs.reserve(org, ws, new_run)
            create = run_agg.CreateRun(
                actor=actor,
                run_id=new_run,
                org=org,
                workspace=ws,
                run_type=run_type,
                config=config,
                message=message,
                speculative=run_type == "plan" and outside_queue,
                template=steps,
                cause=cause,
                commit=commit,
                source=source,
                options=options,
            )
            return await self._record_created(create, derived=bool(run_id)), w

        created, seen = await self.retrying(attempt)  # seen: the workspace the create saw
        return await self._enqueue_created(created, actor, seen)

    async def _record_created(
        self, create: run_agg.CreateRun, *, derived: bool
    ) -> Result[run_agg.RunState]:
        """Append `run.created`; a derived id's run that exists already is answered as it
        is (`existed`), nothing written."""
        run_events = run_agg.decide(run_agg.INITIAL, create, now=self.clock(), new_id=self.ids)
        subject = run_subject(create.org, create.workspace, create.run_id)
        appends = self.appends(subject, 0, run_events)
        try:
            seq = await self.append(appends)
        except Conflict:
            if not derived:
                raise
            found = await self.load_run(create.org, create.workspace, create.run_id, min_seq=LATEST)
            if not found.state.exists:
                raise
            return Result(state=found.state, seq=found.seq, existed=True)
        state = run_agg.fold(run_events)
        self.remember(subject, seq, state)
        return Result(state=state, seq=seq, events=list(run_events))

    async def _enqueue_created(
        self,
        created: Result[run_agg.RunState],
        actor: str,
        seen: Loaded[ws_agg.WorkspaceState],
    ) -> Result[run_agg.RunState]:
        """Enqueue a run just created, and answer the create with its last write's
        sequence (read-your-writes: a read after it shows the run on its workspace's
        queue too). The create has succeeded whatever happens here. On run.created the
        scheduler admits a speculative run, and enqueues a stray one."""
        if created.existed or created.state.speculative:
            return created
        run = created.state
        org, ws, run_id = run.org, run.workspace, run.run_id
        try:
            enqueued = int(await self.enqueue_run(org, ws, run_id, actor, seen=seen))
        except Deleted:  # deleted since it was loaded: the delete won, the run is refused
            await self._refuse_deleted(org, ws, run_id, actor)
            raise
        except Exception as e:  # noqa: BLE001 - created it is: the scheduler enqueues it
            # (module docstring); an error here would have the caller create it again.
            log.warning("run_enqueue_deferred", org=org, workspace=ws, run_id=run_id, error=repr(e))
            return created
        return msgspec.structs.replace(created, seq=max(created.seq, enqueued))

    @tracing.command
    async def enqueue_run(
        self,
        org: str,
        ws: str,
        run_id: str,
        actor: str,
        *,
        seen: Loaded[ws_agg.WorkspaceState] | None = None,
    ) -> int:
        """Put a pending run at the back of its workspace's queue, unless it is there (or
        holds the workspace) already; the sequence of the `ws.run_enqueued` this call
        appended, 0 (false) if it appended none. `seen`: the workspace as loaded just
        before, tried first (a conflict reloads it).

        A run that is no longer pending is left alone; should it be canceled between the
        check and the append, admission finds it terminal at the head and releases it."""
        first = [seen] if seen is not None else []

        async def attempt() -> int:
            w = first.pop() if first else await self.load_ws(org, ws)
            if w.state.holds(run_id):
                return 0
            enqueue = ws_agg.EnqueueRun(actor=actor, run_id=run_id)
            evs = ws_agg.decide(w.state, enqueue, now=self.clock(), new_id=self.ids)
            return await self.append(self.appends(w.subject, w.seq, list(evs)))

        # Creates on one workspace enqueue one at a time within a process: racing, they
        # would all reload, all but one conflict, and a burst would exhaust its retries.
        lock = self._enqueue_locks.setdefault(ws_subject(org, ws), asyncio.Lock())
        if lock.locked():  # another enqueue goes first: what we saw will be stale
            first.clear()
        async with lock:
            return await self.retrying(attempt)

    @tracing.command
    async def ensure_enqueued(self, org: str, ws: str, run_id: str, actor: str) -> bool:
        """The scheduler's repair of a create whose writer died between its two appends:
        enqueue the run if it is pending, not speculative, and not on its workspace."""
        r = await self.load_run(org, ws, run_id)
        if not r.state.exists or r.state.speculative or r.state.status != run_agg.Status.PENDING:
            return False
        try:
            return bool(await self.enqueue_run(org, ws, run_id, actor))
        except Deleted:  # its creator died before it could cancel it
            await self._refuse_deleted(org, ws, run_id, actor)
            return False

    async def _refuse_deleted(self, org: str, ws: str, run_id: str, actor: str) -> None:
        """Cancel a pending run whose workspace was deleted before it was enqueued: it
        never runs, and its record says why."""
        cancel = run_agg.CancelRun(actor=actor, reason="workspace_deleted")
        try:
            await self.run_command(org, ws, run_id, cancel)
        except IllegalTransition:  # ended already (canceled by another repair)
            pass
        log.info("run_refused_workspace_deleted", org=org, workspace=ws, run_id=run_id)

    async def is_enqueued(self, org: str, ws: str, run_id: str) -> bool:
        """Whether the run is on its workspace: queued there or holding it."""
        w = await self.load_ws(org, ws)
        return w.state.holds(run_id)

    @tracing.command
    async def run_command(
        self,
        org: str,
        ws: str | None,
        run_id: str,
        command: run_agg.RunCommand,
        *,
        guard: Callable[[run_agg.RunState], None] | None = None,
        release: bool = True,
    ) -> Result[run_agg.RunState]:
        """Apply a command to a run; a run it ends gives its workspace back (`release`;
        False: the scheduler's admission on the run's end does, events/react.py).

        `guard` sees the very state the command is decided on (on every retry) and may
        raise a DomainError to refuse it: a precondition the core does not know about.

        The run as this process last knew it (`known_run`) is tried first, with no read: the
        append's expected sequence proves it current, and a conflict reloads. Only an
        append can prove it, so a refusal or a decision of nothing is made again before it
        counts, on a load the stream's leader confirms (a follower that is behind may
        have answered the first).
        """
        known = self.known_run(run_subject(org, ws, run_id)) if ws else None
        first = [known] if known is not None else []
        reads = [0]  # loads so far: a refusal counts on a second one, which the leader confirms

        async def attempt() -> tuple[Result[run_agg.RunState], bool]:
            trusted = not first  # read here (else as last written)
            if first:
                r = first.pop()
            else:
                reads[0] += 1
                r = await self.load_run(org, ws, run_id, min_seq=LATEST if reads[0] > 1 else 0)
            proven = trusted and reads[0] > 1
            try:
                if not r.state.exists:
                    raise NotFound("run does not exist")
                if guard is not None:
                    guard(r.state)
                evs = run_agg.decide(r.state, command, now=self.clock(), new_id=self.ids)
            except DomainError:
                if proven:
                    raise
                return await attempt()  # on a fresh load (a follower may have been behind)
            if not evs and not proven:
                return await attempt()
            new_state = run_agg.fold(evs, r.state)
            appends = self.appends(r.subject, r.seq, list(evs))
            seq = await self.append(appends) if appends else r.seq
            self.remember(r.subject, seq, new_state)
            ended = new_state.terminal and not r.state.terminal
            return Result(state=new_state, seq=seq, events=list(evs)), ended

        result, ended = await self.retrying(attempt)
        # A speculative plan never held its workspace: there is nothing to release.
        if ended and release and not result.state.speculative:
            await self._release_ended(result.state, command.actor)
        return result

    async def _release_ended(self, run: run_agg.RunState, actor: str) -> None:
        """Release the workspace of a run a command just ended; the command has landed
        whatever happens here."""
        try:
            await self.release(run, actor)
        except Exception as e:  # noqa: BLE001 - the command landed: the scheduler
            # releases the workspace (module docstring); the caller must not retry it.
            log.warning("run_release_deferred", run_id=run.run_id, error=repr(e))

    @tracing.command
    async def release(self, run: run_agg.RunState, actor: str) -> bool:
        """Give a terminal run's place back: off its workspace's queue, or the workspace
        itself if it held it. True if this call released it."""

        async def attempt() -> bool:
            w = await self.load_ws(run.org, run.workspace)
            cmd = ws_agg.ReleaseRun(actor=actor, run_id=run.run_id, status=str(run.status))
            evs = ws_agg.decide(w.state, cmd, now=self.clock(), new_id=self.ids)
            if not evs:
                return False
            await self.append(self.appends(w.subject, w.seq, list(evs)))
            return True

        return await self.retrying(attempt)


def _shape(
    o: org_agg.OrgState,
    w: ws_agg.WorkspaceState,
    run_type: str,
    template: str,
    speculative: bool | None,
) -> tuple[Workspace, te.Template | None, bool]:
    """A new run's configuration (its workspace's), steps (`events.templates.resolve`: the
    template named, else the workspace's default for the run type, else the built-in)
    and whether it runs outside the queue (`speculative`, else the workspace's setting
    `speculative_plans`).

    A deleted workspace starts no run: `events.errors.Deleted` (an IllegalTransition,
    409 `workspace-deleted`), also when the delete lands between `run.created` and the
    enqueue (the enqueue is refused on the workspace subject, and the run canceled)."""
    if not w.exists or w.config is None:  # a workspace has a config
        raise NotFound("workspace does not exist")
    if w.deleted:
        raise Deleted(f"workspace {w.name} was deleted: it starts no run")
    effective = inherit.for_workspace(o, w)
    steps = None
    if run_type in run_agg.RUN_TYPES:  # else decide refuses the run type
        defaults = effective["templates"]["value"] or {}
        steps = te.resolve(run_type, template, o.templates, defaults)
    if speculative is None:
        return w.config, steps, bool(effective["speculative_plans"]["value"])
    return w.config, steps, speculative
