"""The VCS reporter: a pull request's plans shown on the pull request.

A subscriber on run events (services/processes/subscribers/registry.py). When the reaction table
(events/react.py) raises a notification trigger for a run whose cause is a VCS pull
request (`Cause(kind="vcs", pull_request=N)`, recorded by the webhook's side), it
reports the run as it is NOW (read again: an event redelivered late never puts an older
status back), on the connection the cause names, looked up within the run's own
organization:

- the commit status `runplane/<workspace>` on the PR's head commit: `pending` while the
  plan waits or runs, `success` with its counts (`+2 ~1 -0`) or `failure` with a word
  (`errored`, `policy failed`, `canceled`, `discarded`), linking the run's page;
- the PR's one comment (a merge request's note on GitLab), a row per workspace, its id
  remembered in the log (events/vcs_report.py) and edited in place.

Nothing a tenant writes reaches the comment but ids runplane validated (workspace names
are `[a-z0-9-]`, and are reduced to that again here) and numbers: no variable, no plan
attribute, no error text.

Convergence of the comment: each reporter, after editing it, reads the PR's subject
again and edits again if a row landed meanwhile, so the last edit to reach the VCS
renders every row (an edit rendered before a row was recorded is always followed, from
its writer, by one rendered after it). Posting is claimed on the subject first (one
claimant wins, the others wait for its link), and a claimant that died is taken over
after `CLAIM_TTL`, adopting the comment it may have posted (found by its marker).

Reports to one connection are at most `Policy.per_connection` at a time and one
organization's at most `per_org` (each call within `Policy.timeout`); a connection with
`waiting` reports queued puts the next ones back on the stream (they hold no room of
the consumer's while they wait), so a tenant's slow or hanging VCS holds only its own.
On a cluster the convergence above rests on the PR subject's reads being current (the
event store reads from the leader when a follower may be behind the floor).
A retryable failure (429, 5xx, no answer) puts the event back after the policy's next
delay; after the last, and on any other 4xx or a refused address, it is logged and
dropped.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import structlog

from events import run as run_agg
from events import vcs_report as vr
from events.errors import Conflict
from events.react import notifications, quiet, react
from events.run import RunState
from infra.consumer import Received, Retry, Subscription, by_subject
from infra.eventstore import Append, EventStore
from infra.options import ConfigError
from services.app.commands import App
from services.app.secrets import SecretStore
from services.processes.notifications.formats import PUBLIC_URL_ENV
from services.processes.subscribers.context import SubscriberContext
from services.processes.vcs import connections
from services.processes.vcs.client import (
    Client,
    Gone,
    Policy,
    VcsError,
    policy_from_env,
)
from services.processes.vcs.comment import marker, render, run_url, safe
from services.processes.vcs.github import GitHubClient
from services.processes.vcs.gitlab import GitLabClient
from services.processes.vcs.prrun import PrRun, Verdict, pr_run

log = structlog.get_logger(__name__)

NAME = "vcs-report"
OVERFLOW_DELAY = 1.0  # a connection's queue is full: the event comes back later
CLAIM_WAIT = 1.0  # another reporter is posting the comment: look again after this
POSTED_KEPT = 10_000  # runs whose last posted status is remembered
ROUNDS = 8  # edits of the comment one report makes at most while rows keep landing


# ---------------------------------------------------------------- the reporter

Lookup = Callable[[str, str], Awaitable[tuple[connections.Connection, str] | None]]
ClientFactory = Callable[[connections.Connection, str, Policy], Client]


def make_client(conn: connections.Connection, token: str, policy: Policy) -> Client:
    if conn.provider == "github":
        return GitHubClient(conn.api_url, token, policy, owner=conn.org)
    if conn.provider == "gitlab":
        return GitLabClient(conn.api_url, token, policy, owner=conn.org)
    raise VcsError(f"connection {conn.id}: no such provider {conn.provider!r}")


@dataclass
class _Lane:
    slots: asyncio.Semaphore
    waiting: int = 0  # reports waiting for a slot
    users: int = 0  # reports waiting or holding one


@dataclass
class Reporter:
    """The handler; `reported` counts reports made (tests)."""

    store: EventStore
    lookup: Lookup
    policy: Policy = field(default_factory=Policy)
    base_url: str = ""
    clients: ClientFactory = make_client
    clock: Callable[[], datetime] = lambda: datetime.now(UTC)
    reported: int = 0
    _lanes: dict[str, _Lane] = field(default_factory=dict)
    _orgs: dict[str, _Lane] = field(default_factory=dict)
    # The status this process last posted per run: a report put back (a claim to wait
    # for, a comment call to retry) does not post the same status again.
    _posted: OrderedDict[str, Verdict] = field(default_factory=OrderedDict)

    async def handle(self, r: Received) -> None:
        """The subscriber's handler (infra/consumer.py)."""
        state = r.state
        if not isinstance(state, RunState) or not state.exists:
            return
        if not notifications(react(r.event, state)):
            return
        pr = pr_run(state, r.seq)
        if pr is None:
            return
        try:
            await self.report(r.subject, pr.org, pr.connection)
        except VcsError as e:
            self._failed(r, e)

    def _failed(self, r: Received, e: VcsError) -> None:
        delay = self.policy.backoff(r.num_delivered) if e.retryable else None
        if delay is not None:
            raise Retry(delay, str(e)) from e
        event = "vcs_report_gave_up" if e.retryable else "vcs_report_refused"
        log.warning(event, subject=r.subject, error=str(e), status=e.status or None)

    async def report(self, run_subject: str, org: str, connection_id: str) -> None:
        """Report the run on `run_subject` as it is now, on its connection."""
        found = await self.lookup(org, connection_id)
        if found is None or found[0].org != org:
            log.warning("vcs_report_no_connection", org=org, connection=connection_id)
            return
        conn, token = found
        if not token:
            log.warning("vcs_report_no_token", org=org, connection=conn.id)
            return
        async with self._slot(org, conn.id):
            client = self.clients(conn, token, self.policy)
            try:
                pr = await self._statuses(client, run_subject)
                if pr is not None:
                    await self.show(client, pr)
                    self.reported += 1
            finally:
                await client.aclose()

    # ------------------------------------------------------------ lanes

    @asynccontextmanager
    async def _slot(self, org: str, conn_id: str) -> AsyncIterator[None]:
        """One of the connection's slots and one of its organization's (the org's first:
        waiting for it holds none of the connection's); Retry at once when too many wait.
        A lane nobody uses any more is forgotten."""
        lane = self._lanes.get(conn_id) or _Lane(asyncio.Semaphore(self.policy.per_connection))
        of_org = self._orgs.get(org) or _Lane(asyncio.Semaphore(self.policy.per_org))
        if lane.waiting >= self.policy.waiting or of_org.waiting >= 4 * self.policy.waiting:
            raise Retry(OVERFLOW_DELAY, f"connection {conn_id}: {lane.waiting} reports wait")
        self._lanes[conn_id], self._orgs[org] = lane, of_org
        lane.users, of_org.users = lane.users + 1, of_org.users + 1
        lane.waiting, of_org.waiting = lane.waiting + 1, of_org.waiting + 1
        waiting = True
        try:
            async with of_org.slots, lane.slots:
                lane.waiting, of_org.waiting, waiting = lane.waiting - 1, of_org.waiting - 1, False
                yield
        finally:
            if waiting:
                lane.waiting, of_org.waiting = lane.waiting - 1, of_org.waiting - 1
            lane.users, of_org.users = lane.users - 1, of_org.users - 1
            if not lane.users:
                self._lanes.pop(conn_id, None)
            if not of_org.users:
                self._orgs.pop(org, None)

    # ------------------------------------------------------------ statuses

    async def _latest(self, run_subject: str) -> PrRun | None:
        envs = await self.store.read(run_subject)
        if not envs:
            return None
        events: list[Any] = [e.event for e in envs]
        state = run_agg.fold(events)
        return pr_run(state, envs[-1].seq) if state.exists else None

    async def _statuses(self, client: Client, run_subject: str) -> PrRun | None:
        """Post the run's status as it is now; again while it moved meanwhile (a reporter
        of an older event, on another replica, may have posted an older one)."""
        posted = self._posted.get(run_subject)
        pr = await self._latest(run_subject)
        for _ in range(ROUNDS):
            if pr is None or pr.verdict == posted:
                return pr
            await client.set_status(
                pr.repository,
                pr.commit,
                state=pr.verdict.state,
                context=f"runplane/{safe(pr.workspace)}",
                description=pr.verdict.description,
                url=run_url(self.base_url, pr.org, pr.workspace, pr.run_id),
            )
            posted = self._remember(run_subject, pr.verdict)
            pr = await self._latest(run_subject)
        return pr

    def _remember(self, run_subject: str, posted: Verdict) -> Verdict:
        self._posted[run_subject] = posted
        self._posted.move_to_end(run_subject)
        while len(self._posted) > POSTED_KEPT:
            self._posted.popitem(last=False)
        return posted

    # ------------------------------------------------------------ the PR's subject

    async def _read(self, org: str, key: str, at_least: int = 0) -> tuple[vr.PrReport, int]:
        """The PR's state and its subject's last sequence, as of a stream at least at
        `at_least` (what this reporter appended: a follower behind it is not read)."""
        envs = await self.store.read(vr.subject(org, key), min_seq=at_least)
        events = [
            e.event
            for e in envs
            if isinstance(e.event, vr.RowSet | vr.CommentClaimed | vr.CommentLinked)
        ]
        return vr.fold(events), (envs[-1].seq if envs else 0)

    async def _append(
        self, org: str, key: str, event: vr.VcsReportEvent, last: int, mid: str
    ) -> int:
        item = Append(subject=vr.subject(org, key), event=event, expected=last, msg_id=mid)
        return await self.store.append([item])

    async def show(self, client: Client, pr: PrRun) -> None:
        """Record the run's row on its PR and bring the PR's comment up to date."""
        await self._comment(client, pr, await self._record(pr))

    async def _record(self, pr: PrRun) -> int:
        """The run's row on the PR's subject (unless a newer one of its workspace is)."""
        row = pr.row()
        for _ in range(20):
            state, last = await self._read(pr.org, pr.key)
            if not vr.newer(row, state.rows.get(row.workspace)):
                return last
            event = vr.RowSet(
                at=self.clock(),
                actor="vcs",
                connection=pr.connection,
                repository=pr.repository,
                pull_request=pr.pull_request,
                row=row,
            )
            try:
                mid = f"{pr.key}-{pr.run_id}-{pr.seq}"
                return await self._append(pr.org, pr.key, event, last, mid)
            except Conflict:
                continue
        raise VcsError("the pull request's record keeps moving", retryable=True)

    async def _comment(self, client: Client, pr: PrRun, at_least: int) -> None:
        """Edit (or post) the PR's comment until it shows every recorded row."""
        sent = ""  # what this reporter last put in the comment (the same again is not sent)
        for _ in range(ROUNDS):
            state, last = await self._read(pr.org, pr.key, at_least)
            if not state.comment_id:
                await self._post(client, pr, state, last)
                continue
            body = render(state, key=pr.key, org=pr.org, base_url=self.base_url)
            if body != sent:
                try:
                    await client.edit_comment(
                        pr.repository, pr.pull_request, state.comment_id, body
                    )
                except Gone:
                    log.info("vcs_comment_gone", key=pr.key, comment=state.comment_id)
                    await self._post(client, pr, state, last, anew=True)
                    continue
                sent = body
            if (await self._read(pr.org, pr.key, last))[1] == last:
                return
        raise Retry(CLAIM_WAIT, "the pull request's rows keep landing")

    async def _post(
        self, client: Client, pr: PrRun, state: vr.PrReport, last: int, *, anew: bool = False
    ) -> None:
        """Claim the posting of the comment, post it (or adopt the one a claimant that
        died posted: `anew`, the one linked is gone, adopts none) and link it; Retry if
        another reporter holds the claim. A claim lost to another is no error: the
        caller reads again."""
        if not anew and not vr.claim_open(state, self.clock()):
            raise Retry(CLAIM_WAIT, "another reporter is posting the comment")
        claim = uuid.uuid4().hex
        claimed = vr.CommentClaimed(at=self.clock(), actor="vcs", claim=claim)
        try:
            seq = await self._append(pr.org, pr.key, claimed, last, f"{pr.key}-claim-{claim}")
        except Conflict:
            return
        comment_id = 0
        if not anew:
            comment_id = await client.find_comment(pr.repository, pr.pull_request, marker(pr.key))
        if not comment_id:
            body = render(state, key=pr.key, org=pr.org, base_url=self.base_url)
            comment_id = await client.create_comment(pr.repository, pr.pull_request, body)
        linked = vr.CommentLinked(at=self.clock(), actor="vcs", claim=claim, comment_id=comment_id)
        await self._link(pr, linked, seq)

    async def _link(self, pr: PrRun, linked: vr.CommentLinked, after: int) -> None:
        """Record the comment's id after our claim (rows may have landed in between; a
        claim of another's since means ours was taken over: theirs stands)."""
        last = after
        for _ in range(20):
            try:
                await self._append(pr.org, pr.key, linked, last, f"{pr.key}-link-{linked.claim}")
                return
            except Conflict:
                state, last = await self._read(pr.org, pr.key)
                if state.claim != linked.claim or state.comment_id:
                    log.warning("vcs_comment_claim_lost", key=pr.key, claim=linked.claim)
                    return
        raise VcsError("the pull request's record keeps moving", retryable=True)


# ---------------------------------------------------------------- the registration


def subscription(reporter: Reporter) -> Subscription:
    """Run events, one lane per run (its events in order), the run folded through each
    event that calls for anything (the reporter reads it again before it reports)."""
    return Subscription(
        name=NAME,
        handle=reporter.handle,
        subjects=("rp.run.>",),
        lane=by_subject,
        with_state=lambda e: not quiet(e),
    )


def lookup_for(app: App, secrets: SecretStore) -> Lookup:
    """Connections and their tokens as services/processes/vcs/connections.py has them."""

    async def lookup(org: str, connection_id: str) -> tuple[connections.Connection, str] | None:
        conn = await connections.load_connection(app, org, connection_id)
        if conn is None:
            return None
        return conn, await connections.connection_token(secrets, org, conn.id)

    return lookup


def subscriptions(ctx: SubscriberContext) -> list[Subscription]:
    """The registry's entry (services/processes/subscribers/registry.py); none without the
    encryption key (a connection's token opens only with it)."""
    try:
        keyring = ctx.keys()
    except ConfigError as e:
        log.warning("vcs_report_off", reason=str(e))
        return []
    base_url = os.environ.get(PUBLIC_URL_ENV, "") or f"http://{ctx.opts.listen}"
    secrets = SecretStore(ctx.nc, keyring)
    reporter = Reporter(
        ctx.app.store, lookup_for(ctx.app, secrets), policy_from_env(), base_url=base_url
    )
    return [subscription(reporter)]
