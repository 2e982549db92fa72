"""What a verified webhook delivery does: the webhook (services/surfaces/webhooks/vcs.py)
reads the body, finds the connection and checks the signature; this is the rest. In order:

1. a delivery id already recorded (`X-GitHub-Delivery`, GitLab's `Idempotency-Key`) is a
   `replay`: it starts nothing and is not recorded again;
2. the payload is read (services/processes/vcs/payloads.py; a malformed or hostile one is
   `BadPayload`, which writes nothing); a ping or an event that starts nothing says so;
3. once this replica's read model holds what the stream held when the delivery came
   (bounded by `read_wait`, else `Unavailable`), the bound workspaces of its repository
   are read (one indexed query) and matched (services/processes/vcs/matching.py);
4. a push (a branch or a tag) starts a workspace only if runplane finds it current when
   it looks (`Heads`, of the repository the workspace names): its commit is where the
   ref is now, or it is in the ref's history and descends from every commit the
   workspace applied last or will apply before it (its apply and destroy runs not ended).
   Any other is `stale` for that workspace: a captured push replayed later, or a slow
   delivery overtaken by a newer push, never applies an older commit over a newer one.
   A repository that cannot tell now is `Unavailable` (nothing written: deliver again);
5. a push that starts anything is claimed on its own subject (connection, ref, commit;
   `PushClaimed`, expecting the subject empty): another delivery of the same push, under
   any delivery id and through any replica, finds the claim and starts nothing
   (`duplicate`). The claim's owner handled again (a redelivery after a crash) goes on;
6. each run is created with an id derived from the organization, connection, delivery
   and workspace, so the same delivery handled twice at once creates each run once;
7. the delivery is recorded on its own subject, expecting it empty: the runs it started,
   or why it started nothing (`stale`, `duplicate`), and the workspaces it was stale for.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog

from events import vcs
from events.errors import Conflict, DomainError
from events.values import Cause
from infra.eventstore import LATEST, Append
from infra.ids import derived_id
from projections.projector import Projector
from services.app.commands import App
from services.processes.vcs import VcsError, matching, payloads
from services.processes.vcs.heads import Heads
from services.processes.vcs.payloads import Change

log = structlog.get_logger(__name__)

READ_WAIT_S = 2.0
CONCURRENT_RUNS = 64  # run creations in flight for one delivery
CONCURRENT_REPOSITORIES = 8  # repositories asked at once for one delivery
_CHECKED = (payloads.PUSH, payloads.TAG)  # what is checked against its repository


class Unavailable(VcsError):
    """Nothing was written and a redelivery will do it: the read model is behind, or a
    repository could not tell where its ref is."""

    retryable = True


@dataclass(frozen=True)
class Outcome:
    """What a delivery did: the runs it started (`workspace`, `run_id`, `existed`), or
    why it started nothing (`ignored`), and the workspaces its commit was stale for."""

    runs: list[dict[str, Any]] = field(default_factory=list)
    ignored: str = ""
    stale: list[str] = field(default_factory=list)
    duplicate_of: str = ""


class Deliveries:
    """A verified delivery's handling (module docstring), over the process's `App`, its
    read model and what tells a repository's refs."""

    def __init__(
        self, app: App, projector: Projector, heads: Heads, *, read_wait: float = READ_WAIT_S
    ) -> None:
        self.app = app
        self.projector = projector
        self.heads = heads
        self.read_wait = read_wait

    async def handle(
        self, conn: vcs.VcsConnection, delivery: str, event: str, body: bytes
    ) -> Outcome:
        subject = vcs.delivery_subject(conn.org, conn.id, delivery)
        if await self.app.store.last_seq_of(subject):
            log.info("vcs_delivery_replayed", connection=conn.id)
            return Outcome(ignored="replay")
        change = payloads.parse(conn.provider, event, body)
        if change.kind in (payloads.PING, payloads.IGNORED):
            return Outcome(ignored=change.reason or change.kind)
        await self._caught_up()
        fresh, stale = await self._fresh(conn, change, await self._targets(conn, change))
        owner = await self._claim(conn, delivery, change) if fresh else delivery
        if owner != delivery:
            log.info("vcs_push_duplicate", connection=conn.id, first=owner)
            outcome = Outcome(ignored=vcs.DUPLICATE, stale=stale, duplicate_of=owner)
        else:
            runs = await self._start(conn, delivery, change, fresh)
            ignored = vcs.STALE if stale and not fresh else ""
            outcome = Outcome(runs=runs, ignored=ignored, stale=stale)
        await self._record(conn, subject, delivery, change, outcome)
        return outcome

    async def _caught_up(self) -> None:
        if not await self.projector.wait_for(await self.app.store.last_seq(), self.read_wait):
            raise Unavailable("the read model is behind; deliver again shortly")

    async def _targets(self, conn: vcs.VcsConnection, change: Change) -> list[matching.Target]:
        tag = change.kind == payloads.TAG
        complete = change.kind == payloads.PUSH and not change.everything
        bindings = await self.projector.read.integrations.vcs_bindings(
            conn.org,
            conn.id,
            change.repo_keys,
            branch=None if tag else change.branch,
            files=change.files if complete else None,
            tags=tag,
        )
        return matching.targets(change, bindings)

    # ------------------------------------------------------------ is it current?

    async def _fresh(
        self, conn: vcs.VcsConnection, change: Change, targets: list[matching.Target]
    ) -> tuple[list[matching.Target], list[str]]:
        """The targets the change may start, and the workspaces it is stale for (asked of
        the repository with the connection's own credential)."""
        org = conn.org
        if change.kind not in _CHECKED or not targets:
            return targets, []  # a pull request plans, speculatively: nothing to undo
        read = self.projector.read
        repos = await read.integrations.vcs_repositories(org, [t.workspace for t in targets])
        by_repo: dict[str, list[matching.Target]] = {}
        for t in targets:
            by_repo.setdefault(repos.get(t.workspace, ""), []).append(t)
        gate = asyncio.Semaphore(CONCURRENT_REPOSITORIES)

        async def judged(repo: str, ts: list[matching.Target]) -> list[bool]:
            async with gate:
                return await self._current(conn, repo, change, ts)

        verdicts = await asyncio.gather(*(judged(r, ts) for r, ts in by_repo.items()))
        fresh: list[matching.Target] = []
        stale: list[str] = []
        for ts, marks in zip(by_repo.values(), verdicts, strict=True):
            fresh += [t for t, ok in zip(ts, marks, strict=True) if ok]
            stale += [t.workspace for t, ok in zip(ts, marks, strict=True) if not ok]
        return fresh, sorted(stale)

    async def _current(
        self, conn: vcs.VcsConnection, repo: str, change: Change, targets: Sequence[matching.Target]
    ) -> list[bool]:
        """Whether the change is current for each target, all naming `repo`."""
        if not repo:  # the workspace went between the match and this read
            return [False] * len(targets)
        org, whose = conn.org, {"org": conn.org, "connection": conn.id}
        try:
            head = await self.heads.head(repo, change.ref, **whose)
            if head == change.commit:
                return [True] * len(targets)
            if not head:  # the branch or tag is gone
                return [False] * len(targets)
            read = self.projector.read
            lines = [await read.runs.applied_line(org, t.workspace) for t in targets]
            return await self.heads.follows(repo, change.ref, change.commit, lines, **whose)
        except VcsError as e:
            if not e.retryable:
                raise
            log.warning("vcs_repository_unanswered", error=str(e))
            raise Unavailable(f"the repository could not tell where {change.ref} is: {e}") from e

    # ------------------------------------------------------------ once per push

    async def _claim(self, conn: vcs.VcsConnection, delivery: str, change: Change) -> str:
        """The delivery that owns the push: this one if it claims it first."""
        if change.kind not in _CHECKED:
            return delivery
        subject = vcs.push_subject(conn.org, conn.id, change.ref, change.commit)
        claim = vcs.PushClaimed(
            at=self.app.clock(),
            actor=f"vcs:{conn.id}",
            connection_id=conn.id,
            ref=change.ref,
            commit=change.commit,
            delivery=delivery,
        )
        msg_id = derived_id("vcs-push", conn.org, conn.id, change.ref, change.commit, delivery)
        try:
            await self.app.store.append(
                [Append(subject=subject, event=claim, expected=0, msg_id=msg_id)]
            )
            return delivery
        except Conflict:
            pass
        found = await self.app.store.read(subject, min_seq=LATEST)  # the leader's word
        owner = vcs.claimed_by([e.event for e in found])
        if not owner:
            raise Unavailable("the push's claim was taken but cannot be read yet")
        return owner

    async def _start(
        self,
        conn: vcs.VcsConnection,
        delivery: str,
        change: Change,
        targets: Sequence[matching.Target],
    ) -> list[dict[str, Any]]:
        """Create every run the change starts (concurrently, bounded); what they are."""
        cause, message = _cause(conn, delivery, change), _message(change)
        gate = asyncio.Semaphore(CONCURRENT_RUNS)

        async def one(t: matching.Target) -> dict[str, Any] | None:
            run_id = derived_id("vcs", conn.org, conn.id, delivery, t.workspace)
            async with gate:
                try:
                    result = await self.app.create_run(
                        conn.org,
                        t.workspace,
                        t.run_type,
                        f"vcs:{conn.id}",
                        message,
                        cause=cause,
                        commit=change.commit,
                        run_id=run_id,
                        speculative=True if t.speculative else None,
                    )
                except DomainError as e:
                    if e.retryable:
                        raise
                    # the workspace went, or names a run type it cannot have: the others run
                    log.warning("vcs_run_refused", workspace=t.workspace, error=str(e))
                    return None
            return {"workspace": t.workspace, "run_id": run_id, "existed": result.existed}

        made = await asyncio.gather(*(one(t) for t in targets))
        return [m for m in made if m is not None]

    async def _record(
        self,
        conn: vcs.VcsConnection,
        subject: str,
        delivery: str,
        change: Change,
        outcome: Outcome,
    ) -> None:
        event = vcs.DeliveryAccepted(
            at=self.app.clock(),
            actor=f"vcs:{conn.id}",
            connection_id=conn.id,
            delivery=delivery,
            event=change.kind,
            repository=change.repository,
            ref=change.ref,
            commit=change.commit,
            runs=[f"{r['workspace']}/{r['run_id']}" for r in outcome.runs],
            ignored=outcome.ignored,
            stale=outcome.stale,
            duplicate_of=outcome.duplicate_of,
        )
        append = Append(subject=subject, event=event, expected=0, msg_id=self.app.ids())
        try:
            await self.app.store.append([append])
        except Conflict:  # a twin of this delivery, handled at once elsewhere: same runs
            log.info("vcs_delivery_twin", connection=conn.id)


def _cause(conn: vcs.VcsConnection, delivery: str, change: Change) -> Cause:
    return Cause(
        kind="vcs",
        provider=conn.provider,
        connection=conn.id,
        delivery=delivery,
        event=change.kind,
        ref=change.ref,
        commit=change.commit,
        repository=change.repository,
        pull_request=change.pull_request,
    )


def _message(change: Change) -> str:
    if change.kind == payloads.PULL_REQUEST:
        return f"pull request #{change.pull_request} of {change.repository} at {change.commit[:12]}"
    return f"{change.kind} of {change.ref} at {change.commit[:12]}"
