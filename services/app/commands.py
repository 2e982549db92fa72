"""Application service: load aggregates, run the pure `decide`, append.

Every writer (api, scheduler, executor) goes through here, so the rules that span two
aggregates live in one place. Each append touches one aggregate (atomic batches cost the
server ~2 ms each, ten plain appends' worth), and every step that spans two is ordered
so that a crash between its appends leaves a state the scheduler finishes or heals:

- create: `run.created`, then `ws.run_enqueued`. A run created but never enqueued (its
  writer died) is enqueued by the scheduler when `run.created` comes round again.
- admission: `ws.run_admitted` (the decision: who holds the workspace, an optimistic
  append), then `run.queued`. A workspace whose active run is still pending has its
  admission finished by the next admission attempt (`admit_next`).
- a terminal run: its terminal event, then `ws.run_released`. A workspace holding a
  terminal run (or with one at the head of its queue) is released by the next admission
  attempt, which the scheduler makes on every terminal run event.

A speculative plan (setting `speculative_plans`) is never enqueued: admitted on its own,
it holds and releases nothing.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import random
import secrets
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any, TypeVar

import msgspec
import structlog
from ulid import ULID

from events import folder as fo
from events import inherit
from events import org as org_agg
from events import policies as po
from events import run as run_agg
from events import templates as te
from events import workspace as ws_agg
from events.codec import AnyEvent, org_subject, run_subject, ws_subject
from events.errors import (
    Conflict,
    Deleted,
    DomainError,
    IllegalTransition,
    NotFound,
    SnapshotFailed,
)
from infra import tracing
from infra.eventstore import LATEST, Append, EventStore, StoreError

# Takes a run's admission snapshot (services/app/snapshot.py); raises SnapshotFailed.
SnapshotHook = Callable[[run_agg.RunState], Awaitable[run_agg.Snapshot]]

S = TypeVar("S")
KNOWN_RUNS = 4096  # runs each App remembers as it last wrote them

log = structlog.get_logger(__name__)


def utcnow() -> datetime:
    return datetime.now(UTC)


def new_id() -> str:
    """A ULID, lowercased so that it is a subject-safe token."""
    return str(ULID()).lower()


def derived_id(*parts: str) -> str:
    """A run id derived from what identifies its cause (a webhook delivery and workspace,
    a schedule and fire time): the same parts give the same id, so a second creation of
    the same run finds the first. 26 lowercase base32 characters, like `new_id`'s."""
    digest = hashlib.sha256("\x1f".join(parts).encode()).digest()
    return base64.b32encode(digest).decode().lower()[:26]


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class Loaded(msgspec.Struct, frozen=True, kw_only=True):
    subject: str
    seq: int  # last sequence on the subject, 0 if none
    state: Any


class Result(msgspec.Struct, frozen=True, kw_only=True):
    """What a command did: the new state of the aggregate and the last stream sequence."""

    state: Any
    seq: int
    events: list[Any] = []
    existed: bool = False  # nothing was written: the (derived) id's run was there already


class App:
    """The command side. `clock` and `ids` are injected so tests can pin them."""

    def __init__(
        self,
        store: EventStore,
        *,
        clock: Callable[[], datetime] = utcnow,
        ids: Callable[[], str] = new_id,
        attempts: int = 20,
        snapshot: SnapshotHook | None = None,
    ) -> None:
        self.store = store
        self.clock = clock
        self.ids = ids
        self.attempts = attempts
        self.snapshot = snapshot
        self._enqueue_locks: dict[str, asyncio.Lock] = {}  # per workspace subject
        # Runs as this App last wrote them: tried first by run_command, checked by the append.
        self._known: OrderedDict[str, Loaded] = OrderedDict()

    def remember(self, subject: str, seq: int, state: Any) -> None:
        """Note a run as this App just wrote it (least recently written dropped first)."""
        self._known[subject] = Loaded(subject=subject, seq=seq, state=state)
        self._known.move_to_end(subject)
        while len(self._known) > KNOWN_RUNS:
            self._known.popitem(last=False)

    # ------------------------------------------------------------ loading

    async def _load(
        self, subject: str, fold: Callable[[list[Any]], S], min_seq: int = 0
    ) -> tuple[S, int, str]:
        envs = await self.store.read(subject, min_seq=min_seq)
        real = envs[-1].subject if envs else subject
        return fold([e.event for e in envs]), (envs[-1].seq if envs else 0), real

    async def load_run(self, org: str, ws: str | None, run: str, *, min_seq: int = 0) -> Loaded:
        """Load a run; with `ws` unknown the subject is found by wildcard. `min_seq`: the
        stream sequence the read must be at least as new as (`eventstore.LATEST`: as the
        stream's leader has it now)."""
        subject = run_subject(org, ws or "*", run)
        state, seq, real = await self._load(subject, run_agg.fold, min_seq)
        return Loaded(subject=real, seq=seq, state=state)

    async def load_ws(self, org: str, ws: str) -> Loaded:
        subject = ws_subject(org, ws)
        state, seq, real = await self._load(subject, ws_agg.fold)
        return Loaded(subject=real, seq=seq, state=state)

    async def load_org(self, org: str) -> Loaded:
        subject = org_subject(org)
        state, seq, real = await self._load(subject, org_agg.fold)
        return Loaded(subject=real, seq=seq, state=state)

    async def _retrying(self, attempt: Callable[[], Any]) -> Any:
        for i in range(self.attempts):
            try:
                return await attempt()
            except Conflict:
                if i == self.attempts - 1:
                    raise
                await asyncio.sleep(random.uniform(0, 0.002 * (2 ** min(i, 6))))
        raise AssertionError("unreachable")

    def _appends(self, subject: str, seq: int, events: list[AnyEvent]) -> list[Append]:
        return [
            Append(subject=subject, event=e, expected=seq + i, msg_id=self.ids())
            for i, e in enumerate(events)
        ]

    # ------------------------------------------------------------ organizations

    @tracing.command
    async def create_org(self, name: str, actor: str) -> Result:
        return await self.org_command(name, org_agg.CreateOrg(actor=actor, name=name))

    @tracing.command
    async def issue_token(
        self, org: str, user: str, role: str, actor: str, *, expires_at: datetime | None = None
    ) -> tuple[str, Result]:
        """Issue a token scoped to the organization; only its hash is stored."""
        token = f"rp_{secrets.token_urlsafe(32)}"
        cmd = org_agg.IssueToken(
            actor=actor,
            token_id=self.ids(),
            token_hash=hash_token(token),
            user=user,
            role=role,
            expires_at=expires_at,
        )
        return token, await self.org_command(org, cmd)

    @tracing.command
    async def record_token_use(self, org: str, token_id: str, user: str) -> int:
        """Record that a token was used now, on its own uses subject: a fact the api saw
        (the token authenticated a request), so there is nothing to decide. Raises
        Conflict if another replica recorded one at the same moment: that one will do."""
        subject = org_agg.uses_subject(org, token_id)
        seq, _ = await self.store.last(subject)
        event = org_agg.TokenUsed(at=self.clock(), actor=user, token_id=token_id)
        append = Append(subject=subject, event=event, expected=seq, msg_id=self.ids())
        return await self.store.append([append])

    # ------------------------------------------------------------ workspaces

    @tracing.command
    async def create_workspace(
        self, org: str, name: str, config: run_agg.Workspace, actor: str, *, folder: str = ""
    ) -> Result:
        """Create a workspace, in `folder` of the organization if given (it must exist:
        folders are never removed, so checking first is enough)."""

        async def attempt() -> Result:
            o = await self.load_org(org)
            if not o.state.exists:
                raise NotFound("organization does not exist")
            if folder and folder not in o.state.folders:
                raise NotFound(f"folder {folder} does not exist")
            cur = await self.load_ws(org, name)
            cmd = ws_agg.CreateWorkspace(
                actor=actor, org=org, name=name, config=config, folder=folder
            )
            evs = ws_agg.decide(cur.state, cmd, now=self.clock(), new_id=self.ids)
            seq = await self.store.append(self._appends(cur.subject, cur.seq, list(evs)))
            return Result(state=ws_agg.fold(evs, cur.state), seq=seq, events=list(evs))

        return await self._retrying(attempt)  # type: ignore[no-any-return]  # Result

    @tracing.command
    async def set_variables(
        self, org: str, name: str, variables: dict[str, str], actor: str
    ) -> Result:
        """Replace a workspace's plain variables; runs already created keep their own."""
        cmd = ws_agg.SetVariables(actor=actor, variables=variables)
        return await self._workspace_command(org, name, cmd)

    @tracing.command
    async def change_workspace(
        self, org: str, name: str, changes: dict[str, Any], actor: str
    ) -> Result:
        """Change members of a workspace's configuration (`ws.config_changed`, only those
        that differ); runs already created keep the configuration they copied."""
        cmd = ws_agg.ChangeConfig(actor=actor, changes=changes)
        return await self._workspace_command(org, name, cmd)

    @tracing.command
    async def delete_workspace(self, org: str, name: str, actor: str) -> Result:
        """Delete a workspace no run holds or waits for (IllegalTransition naming one
        otherwise). A run created meanwhile finds its enqueue refused and is canceled
        (`create_run`): the workspace subject's checked appends decide which goes."""
        return await self._workspace_command(org, name, ws_agg.DeleteWorkspace(actor=actor))

    @tracing.command
    async def purge_workspace(self, org: str, name: str, actor: str) -> Result:
        """Free a deleted workspace's name (`ws.purged`); its events stay in the stream."""
        return await self._workspace_command(org, name, ws_agg.PurgeWorkspace(actor=actor))

    @tracing.command
    async def lock_workspace(self, org: str, name: str, reason: str, actor: str) -> Result:
        """Lock a workspace: runs still queue, none is admitted until it is unlocked."""
        return await self._workspace_command(
            org, name, ws_agg.LockWorkspace(actor=actor, reason=reason)
        )

    @tracing.command
    async def unlock_workspace(self, org: str, name: str, actor: str, *, admin: bool) -> Result:
        """Lift a workspace's lock (its holder, or an org admin); the scheduler then admits."""
        return await self._workspace_command(
            org, name, ws_agg.UnlockWorkspace(actor=actor, admin=admin)
        )

    @tracing.command
    async def record_state_push(self, org: str, name: str, cmd: ws_agg.RecordStatePush) -> Result:
        """Record a state version the lock's holder pushed (services/surfaces/tfe/state_push.py)."""
        return await self._workspace_command(org, name, cmd)

    async def _workspace_command(self, org: str, name: str, cmd: ws_agg.WorkspaceCommand) -> Result:
        async def attempt() -> Result:
            cur = await self.load_ws(org, name)
            evs = ws_agg.decide(cur.state, cmd, now=self.clock(), new_id=self.ids)
            appends = self._appends(cur.subject, cur.seq, list(evs))
            seq = await self.store.append(appends) if appends else cur.seq  # none: no change
            return Result(state=ws_agg.fold(evs, cur.state), seq=seq, events=list(evs))

        return await self._retrying(attempt)  # type: ignore[no-any-return]  # Result

    # ------------------------------------------------------------ runs

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
    ) -> Result:
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
        out; `options`: the plan's targets, replaces, refresh and run variables.

        A deleted workspace starts no run: `events.errors.Deleted` (an IllegalTransition,
        409 `workspace-deleted`), also when the delete lands between `run.created` and the
        enqueue (the enqueue is refused on the workspace subject, and the run canceled)."""
        new_run = run_id or self.ids()

        async def attempt() -> tuple[Result, Loaded]:
            w, o = await asyncio.gather(self.load_ws(org, ws), self.load_org(org))
            if not w.state.exists:
                raise NotFound("workspace does not exist")
            if w.state.deleted:
                raise Deleted(f"workspace {ws} was deleted: it starts no run")
            effective = inherit.for_workspace(o.state, w.state)
            steps = None
            if run_type in run_agg.RUN_TYPES:  # else decide refuses the run type
                defaults = effective["templates"]["value"] or {}
                steps = te.resolve(run_type, template, o.state.templates, defaults)
            if speculative is None:
                outside_queue = bool(effective["speculative_plans"]["value"])
            else:
                outside_queue = speculative
            create = run_agg.CreateRun(
                actor=actor,
                run_id=new_run,
                org=org,
                workspace=ws,
                run_type=run_type,
                config=w.state.config,
                message=message,
                speculative=run_type == "plan" and outside_queue,
                template=steps,
                cause=cause,
                commit=commit,
                source=source,
                options=options,
            )
            run_events = run_agg.decide(run_agg.INITIAL, create, now=self.clock(), new_id=self.ids)
            appends = self._appends(run_subject(org, ws, new_run), 0, list(run_events))
            try:
                seq = await self.store.append(appends)
            except Conflict:
                if not run_id:
                    raise
                found = await self.load_run(org, ws, new_run, min_seq=LATEST)
                if not found.state.exists:
                    raise
                return Result(state=found.state, seq=found.seq, existed=True), w
            state = run_agg.fold(run_events)
            self.remember(appends[-1].subject, seq, state)
            return Result(state=state, seq=seq, events=list(run_events)), w

        # `seen`: the workspace as the create saw it
        created, seen = await self._retrying(attempt)
        if created.existed or created.state.speculative:
            # the scheduler admits a speculative run on run.created, and enqueues one
            # whose creator stopped before enqueueing it
            return created  # type: ignore[no-any-return]  # Result
        try:
            await self.enqueue_run(org, ws, new_run, actor, seen=seen)
        except Deleted:  # deleted since it was loaded: the delete won, the run is refused
            await self._refuse_deleted(org, ws, new_run, actor)
            raise
        except Exception as e:  # noqa: BLE001 - created it is: the scheduler enqueues it
            # (module docstring); an error here would have the caller create it again.
            log.warning(
                "run_enqueue_deferred", org=org, workspace=ws, run_id=new_run, error=repr(e)
            )
        return created  # type: ignore[no-any-return]  # Result

    @tracing.command
    async def enqueue_run(
        self, org: str, ws: str, run_id: str, actor: str, *, seen: Loaded | None = None
    ) -> bool:
        """Put a pending run at the back of its workspace's queue, unless it is there (or
        holds the workspace) already; True if this call enqueued it. `seen`: the
        workspace as loaded just before, tried first (a conflict reloads it).

        A run that is no longer pending is left alone; should it be canceled between the
        check and the append, admission finds it terminal at the head and releases it."""
        first = [seen] if seen is not None else []

        async def attempt() -> bool:
            w = first.pop() if first else await self.load_ws(org, ws)
            if w.state.holds(run_id):
                return False
            enqueue = ws_agg.EnqueueRun(actor=actor, run_id=run_id)
            evs = ws_agg.decide(w.state, enqueue, now=self.clock(), new_id=self.ids)
            await self.store.append(self._appends(w.subject, w.seq, list(evs)))
            return True

        # Creates on one workspace enqueue one at a time within a process: racing, they
        # would all reload, all but one conflict, and a burst would exhaust its retries.
        lock = self._enqueue_locks.setdefault(ws_subject(org, ws), asyncio.Lock())
        if lock.locked():  # another enqueue goes first: what we saw will be stale
            first.clear()
        async with lock:
            return await self._retrying(attempt)  # type: ignore[no-any-return]  # bool

    @tracing.command
    async def ensure_enqueued(self, org: str, ws: str, run_id: str, actor: str) -> bool:
        """The scheduler's repair of a create whose writer died between its two appends:
        enqueue the run if it is pending, not speculative, and not on its workspace."""
        r = await self.load_run(org, ws, run_id)
        if not r.state.exists or r.state.speculative or r.state.status != run_agg.Status.PENDING:
            return False
        try:
            return await self.enqueue_run(org, ws, run_id, actor)
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
        return w.state.holds(run_id)  # type: ignore[no-any-return]

    @tracing.command
    async def run_command(
        self,
        org: str,
        ws: str | None,
        run_id: str,
        command: run_agg.RunCommand,
        *,
        guard: Callable[[run_agg.RunState], None] | None = None,
    ) -> Result:
        """Apply a command to a run; a run it ends gives its workspace back (`release`).

        `guard` sees the very state the command is decided on (on every retry) and may
        raise a DomainError to refuse it: a precondition the core does not know about.

        The run as this App last wrote it (`_known`) is tried first, with no read: the
        append's expected sequence proves it current, and a conflict reloads. Only an
        append can prove it, so a refusal or a decision of nothing is made again before it
        counts, on a load the stream's leader confirms (a follower that is behind may
        have answered the first).
        """
        known = self._known.get(run_subject(org, ws, run_id)) if ws else None
        first = [known] if known is not None else []
        reads = [0]  # loads so far: a refusal counts on a second one, which the leader confirms

        async def attempt() -> tuple[Result, bool]:
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
            appends = self._appends(r.subject, r.seq, list(evs))
            try:
                seq = await self.store.append(appends, forget=trusted) if appends else r.seq
            except Conflict:
                self._known.pop(r.subject, None)
                raise
            self.remember(r.subject, seq, new_state)
            ended = new_state.terminal and not r.state.terminal
            return Result(state=new_state, seq=seq, events=list(evs)), ended

        result, ended = await self._retrying(attempt)
        # A speculative plan never held its workspace: there is nothing to release.
        if ended and not result.state.speculative:
            try:
                await self.release(result.state, command.actor)
            except Exception as e:  # noqa: BLE001 - the command landed: the scheduler
                # releases the workspace (module docstring); the caller must not retry it.
                log.warning("run_release_deferred", run_id=run_id, error=repr(e))
        return result  # type: ignore[no-any-return]  # Result

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
            await self.store.append(self._appends(w.subject, w.seq, list(evs)))
            return True

        return await self._retrying(attempt)  # type: ignore[no-any-return]  # bool

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
            await self.store.append(self._appends(w.subject, w.seq, list(ws_events)))
            return await queue(r)

        async def queue(r: Loaded) -> str:
            state: run_agg.RunState = r.state
            admit = run_agg.AdmitRun(actor=actor, pinning=self.snapshot is not None)
            run_events = run_agg.decide(state, admit, now=self.clock(), new_id=self.ids)
            seq = await self.store.append(self._appends(r.subject, r.seq, list(run_events)))
            self.remember(r.subject, seq, run_agg.fold(run_events, state))
            return state.run_id

        return await self._retrying(attempt)  # type: ignore[no-any-return]  # str

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
            await self.store.append(self._appends(r.subject, r.seq, list(evs)))
            return True

        return await self._retrying(attempt)  # type: ignore[no-any-return]  # bool

    @tracing.command
    async def pin_run(
        self,
        org: str,
        ws: str,
        run_id: str,
        actor: str = "scheduler",
        *,
        loaded: Loaded | None = None,
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

    # ------------------------------------------------------------ settings and folders

    @tracing.command
    async def org_command(self, org: str, command: org_agg.OrgCommand) -> Result:
        """Decide and append an organization command (folders, settings, tokens)."""

        async def attempt() -> Result:
            cur = await self.load_org(org)
            evs = org_agg.decide(cur.state, command, now=self.clock(), new_id=self.ids)
            appends = self._appends(cur.subject, cur.seq, list(evs))
            seq = await self.store.append(appends) if appends else cur.seq  # none: no change
            return Result(state=org_agg.fold(evs, cur.state), seq=seq, events=list(evs))

        return await self._retrying(attempt)  # type: ignore[no-any-return]  # Result

    @tracing.command
    async def set_workspace_settings(
        self, org: str, name: str, changes: dict[str, Any], actor: str
    ) -> Result:
        """Change a workspace's own settings (null unsets one); runs admitted keep theirs."""
        cmd = ws_agg.SetSettings(actor=actor, changes=changes)
        return await self._workspace_command(org, name, cmd)

    async def effective_settings(self, org: str, ws: str) -> inherit.Resolved:
        """Every setting's effective value for a workspace, with its origin, read from
        the organization and workspace aggregates (no read model needed)."""
        o, w = await asyncio.gather(self.load_org(org), self.load_ws(org, ws))
        return inherit.for_workspace(o.state, w.state)

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
