"""Application service: load aggregates, run the pure `decide`, append atomically.

Every writer (api, scheduler, executor) goes through here, so the rules that span two
aggregates live in one place: a new run is enqueued on its workspace in the same atomic
batch, admission moves the workspace and the run together, and a run that reaches a
terminal status gives its workspace back in the same batch. A speculative plan (setting
`speculative_plans`) is the exception: never enqueued, admitted on its own, it holds and
releases nothing.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import secrets
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any, TypeVar

import msgspec
from ulid import ULID

from events import folder as fo
from events import inherit
from events import org as org_agg
from events import policies as po
from events import run as run_agg
from events import templates as te
from events import workspace as ws_agg
from events.codec import AnyEvent, org_subject, run_subject, ws_subject
from events.errors import Conflict, IllegalTransition, NotFound
from services.infra.eventstore import Append, EventStore
from services.snapshot import SnapshotFailed

# Takes a run's admission snapshot (services/snapshot.py); raises SnapshotFailed.
SnapshotHook = Callable[[run_agg.RunState], Awaitable[run_agg.Snapshot]]

S = TypeVar("S")


def utcnow() -> datetime:
    return datetime.now(UTC)


def new_id() -> str:
    """A ULID, lowercased so that it is a subject-safe token."""
    return str(ULID()).lower()


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

    # ------------------------------------------------------------ loading

    async def _load(self, subject: str, fold: Callable[[list[Any]], S]) -> tuple[S, int, str]:
        envs = await self.store.read(subject)
        real = envs[-1].subject if envs else subject
        return fold([e.event for e in envs]), (envs[-1].seq if envs else 0), real

    async def load_run(self, org: str, ws: str | None, run: str) -> Loaded:
        """Load a run; with `ws` unknown the subject is found by wildcard."""
        subject = run_subject(org, ws or "*", run)
        state, seq, real = await self._load(subject, run_agg.fold)
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

    async def create_org(self, name: str, actor: str) -> Result:
        return await self.org_command(name, org_agg.CreateOrg(actor=actor, name=name))

    async def issue_token(self, org: str, user: str, role: str, actor: str) -> tuple[str, Result]:
        """Issue a token scoped to the organization; only its hash is stored."""
        token = f"rp_{secrets.token_urlsafe(32)}"
        cmd = org_agg.IssueToken(
            actor=actor, token_id=self.ids(), token_hash=hash_token(token), user=user, role=role
        )
        return token, await self.org_command(org, cmd)

    # ------------------------------------------------------------ workspaces

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

    async def set_variables(
        self, org: str, name: str, variables: dict[str, str], actor: str
    ) -> Result:
        """Replace a workspace's plain variables; runs already created keep their own."""
        cmd = ws_agg.SetVariables(actor=actor, variables=variables)
        return await self._workspace_command(org, name, cmd)

    async def lock_workspace(self, org: str, name: str, reason: str, actor: str) -> Result:
        """Lock a workspace: runs still queue, none is admitted until it is unlocked."""
        return await self._workspace_command(
            org, name, ws_agg.LockWorkspace(actor=actor, reason=reason)
        )

    async def unlock_workspace(self, org: str, name: str, actor: str, *, admin: bool) -> Result:
        """Lift a workspace's lock (its holder, or an org admin); the scheduler then admits."""
        return await self._workspace_command(
            org, name, ws_agg.UnlockWorkspace(actor=actor, admin=admin)
        )

    async def _workspace_command(self, org: str, name: str, cmd: ws_agg.WorkspaceCommand) -> Result:
        async def attempt() -> Result:
            cur = await self.load_ws(org, name)
            evs = ws_agg.decide(cur.state, cmd, now=self.clock(), new_id=self.ids)
            seq = await self.store.append(self._appends(cur.subject, cur.seq, list(evs)))
            return Result(state=ws_agg.fold(evs, cur.state), seq=seq, events=list(evs))

        return await self._retrying(attempt)  # type: ignore[no-any-return]  # Result

    # ------------------------------------------------------------ runs

    async def create_run(
        self,
        org: str,
        ws: str,
        run_type: str,
        actor: str,
        message: str = "",
        template: str = "",
    ) -> Result:
        """Record a pending run and enqueue it on its workspace, in one atomic batch.

        The run records its template's steps (`events.templates.resolve`): the one named,
        else the workspace's default for the run type (setting `templates`), else the
        built-in; Invalid if that template does not exist or does not suit the run type."""
        run_id = self.ids()

        async def attempt() -> Result:
            w, o = await asyncio.gather(self.load_ws(org, ws), self.load_org(org))
            if not w.state.exists:
                raise NotFound("workspace does not exist")
            effective = inherit.for_workspace(o.state, w.state)
            steps = None
            if run_type in run_agg.RUN_TYPES:  # else decide refuses the run type
                defaults = effective["templates"]["value"] or {}
                steps = te.resolve(run_type, template, o.state.templates, defaults)
            now = self.clock()
            create = run_agg.CreateRun(
                actor=actor,
                run_id=run_id,
                org=org,
                workspace=ws,
                run_type=run_type,
                config=w.state.config,
                message=message,
                speculative=run_type == "plan" and bool(effective["speculative_plans"]["value"]),
                template=steps,
            )
            run_events = run_agg.decide(run_agg.INITIAL, create, now=now, new_id=self.ids)
            enqueue = ws_agg.EnqueueRun(actor=actor, run_id=run_id)
            # A speculative plan is not enqueued: the scheduler admits it on run.created.
            ws_events = (
                []
                if create.speculative
                else ws_agg.decide(w.state, enqueue, now=now, new_id=self.ids)
            )
            seq = await self.store.append(
                self._appends(run_subject(org, ws, run_id), 0, list(run_events))
                + self._appends(w.subject, w.seq, list(ws_events))
            )
            return Result(state=run_agg.fold(run_events), seq=seq, events=list(run_events))

        # Creates on one workspace enqueue one at a time within a process: racing, they
        # would all reload, all but one conflict, and a burst would exhaust its retries.
        async with self._enqueue_locks.setdefault(ws_subject(org, ws), asyncio.Lock()):
            return await self._retrying(attempt)  # type: ignore[no-any-return]  # Result

    async def run_command(
        self,
        org: str,
        ws: str | None,
        run_id: str,
        command: run_agg.RunCommand,
        *,
        guard: Callable[[run_agg.RunState], None] | None = None,
    ) -> Result:
        """Apply a command to a run; a terminal outcome releases the workspace atomically.

        `guard` sees the very state the command is decided on (on every retry) and may
        raise a DomainError to refuse it: a precondition the core does not know about.
        """

        async def attempt() -> Result:
            r = await self.load_run(org, ws, run_id)
            if not r.state.exists:
                raise NotFound("run does not exist")
            if guard is not None:
                guard(r.state)
            now = self.clock()
            evs = run_agg.decide(r.state, command, now=now, new_id=self.ids)
            new_state = run_agg.fold(evs, r.state)
            appends = self._appends(r.subject, r.seq, list(evs))
            # A speculative plan never held its workspace: there is nothing to release.
            if new_state.terminal and not r.state.terminal and not new_state.speculative:
                w = await self.load_ws(org, new_state.workspace)
                release = ws_agg.ReleaseRun(
                    actor=command.actor, run_id=run_id, status=str(new_state.status)
                )
                ws_events = ws_agg.decide(w.state, release, now=now, new_id=self.ids)
                appends += self._appends(w.subject, w.seq, list(ws_events))
            seq = await self.store.append(appends) if appends else r.seq
            return Result(state=new_state, seq=seq, events=list(evs))

        return await self._retrying(attempt)  # type: ignore[no-any-return]  # Result

    async def admit_next(self, org: str, ws: str, actor: str = "scheduler") -> str:
        """Admit the oldest pending run of the workspace if none is active; return its id.

        With a `snapshot` hook the run is pinned to its snapshot in the same append; a run
        whose snapshot cannot be taken fails with `checkout_failed` instead.
        """
        pinned: dict[str, run_agg.Snapshot] = {}  # taken once, even if the append is retried

        async def attempt() -> str:
            w = await self.load_ws(org, ws)
            now = self.clock()
            ws_events = ws_agg.decide(
                w.state, ws_agg.AdmitNext(actor=actor), now=now, new_id=self.ids
            )
            if not ws_events:
                return ""
            run_id = ws_events[0].run_id  # type: ignore[union-attr]  # AdmitNext yields RunAdmitted
            r = await self.load_run(org, ws, run_id)
            try:
                admit = run_agg.AdmitRun(actor=actor, snapshot=await self._pin(r.state, pinned))
            except SnapshotFailed as e:
                return await self._unpinnable(org, ws, run_id, actor, e)
            run_events = run_agg.decide(r.state, admit, now=now, new_id=self.ids)
            await self.store.append(
                self._appends(w.subject, w.seq, list(ws_events))
                + self._appends(r.subject, r.seq, list(run_events))
            )
            return run_id

        return await self._retrying(attempt)  # type: ignore[no-any-return]  # str

    async def admit_speculative(
        self, org: str, ws: str, run_id: str, actor: str = "scheduler"
    ) -> bool:
        """Admit a pending speculative plan at once, pinned like any run (`_pin`) but with
        no workspace event: it neither waits for its workspace nor holds it, and a locked
        workspace does not stop it (it changes nothing). False if there was nothing to
        admit: not speculative, or admitted already (by another scheduler)."""
        pinned: dict[str, run_agg.Snapshot] = {}

        async def attempt() -> bool:
            r = await self.load_run(org, ws, run_id)
            if not r.state.speculative or r.state.status != run_agg.Status.PENDING:
                return False
            try:
                admit = run_agg.AdmitRun(actor=actor, snapshot=await self._pin(r.state, pinned))
            except SnapshotFailed as e:
                await self._unpinnable(org, ws, run_id, actor, e)
                return False
            evs = run_agg.decide(r.state, admit, now=self.clock(), new_id=self.ids)
            await self.store.append(self._appends(r.subject, r.seq, list(evs)))
            return True

        return await self._retrying(attempt)  # type: ignore[no-any-return]  # bool

    async def _pin(
        self, run: run_agg.RunState, pinned: dict[str, run_agg.Snapshot]
    ) -> run_agg.Snapshot | None:
        """The hook's snapshot, its settings the effective ones (value and origin) now,
        and the policy sets of the workspace's organization, folders and its own."""
        if self.snapshot is None:
            return None
        if run.run_id not in pinned:
            snap = await self.snapshot(run)
            o, w = await asyncio.gather(
                self.load_org(run.org), self.load_ws(run.org, run.workspace)
            )
            settings = {**snap.settings, **inherit.for_workspace(o.state, w.state)}
            # The policy sets the plan will be checked against, as they are now.
            folders = fo.path(o.state.folders, w.state.folder)
            policies = po.for_workspace(o.state.policies, folders, run.workspace)
            pinned[run.run_id] = msgspec.structs.replace(
                snap, settings=settings, policies=policies
            )
        return pinned[run.run_id]

    # ------------------------------------------------------------ settings and folders

    async def org_command(self, org: str, command: org_agg.OrgCommand) -> Result:
        """Decide and append an organization command (folders, settings, tokens)."""

        async def attempt() -> Result:
            cur = await self.load_org(org)
            evs = org_agg.decide(cur.state, command, now=self.clock(), new_id=self.ids)
            appends = self._appends(cur.subject, cur.seq, list(evs))
            seq = await self.store.append(appends) if appends else cur.seq  # none: no change
            return Result(state=org_agg.fold(evs, cur.state), seq=seq, events=list(evs))

        return await self._retrying(attempt)  # type: ignore[no-any-return]  # Result

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
        """Fail a run whose snapshot cannot be taken; it leaves the queue, the next may go."""
        fail = run_agg.FailRun(actor=actor, reason="checkout_failed", message=str(error))
        try:
            await self.run_command(org, ws, run_id, fail)
        except IllegalTransition:  # another scheduler failed it first
            pass
        return ""
