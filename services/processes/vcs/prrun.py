"""A run of a pull request, as the reporter sees it: the cause's PR and what to tell the VCS.

`pr_run` reads only the run's folded state (its `run.created`'s cause: provider,
connection, repository, pull request, commit), no other lookup; `verdict` is the status
a run's state maps to, and the word runplane shows for it (services/processes/vcs/comment.py
WORDS): the counts of a finished plan, or where the run is.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

from events import vcs_report as vr
from events.react import POLICY_REASON
from events.run import SUCCEEDED, RunState, Status
from services.processes.vcs.client import FAILURE, PENDING, SUCCESS


@dataclass(frozen=True)
class Verdict:
    state: str  # PENDING | SUCCESS | FAILURE
    word: str  # runplane's word for where the run is
    description: str  # the commit status's: the counts, or the word


def verdict(s: RunState) -> Verdict:
    """What the VCS is told of a run (its status, and its plan's counts)."""
    status = s.status
    if status in SUCCEEDED:
        plan = s.plan_summary
        counts = f"+{plan.add} ~{plan.change} -{plan.destroy}" if plan else "no plan"
        word = "no changes" if status == Status.NO_CHANGES else "planned"
        return Verdict(SUCCESS, word, counts)
    if status == Status.FAILED:
        word = "policy failed" if s.reason == POLICY_REASON else "errored"
        return Verdict(FAILURE, word, word)
    if status in (Status.CANCELED, Status.DISCARDED):
        word = str(status)
        return Verdict(FAILURE, word, word)
    word = {
        Status.PENDING: "queued",
        Status.QUEUED: "queued",
        Status.PLANNING: "planning",
        Status.AWAITING_APPROVAL: "needs attention",
    }.get(status or Status.PENDING, "running")
    return Verdict(PENDING, word, word)


@dataclass(frozen=True)
class PrRun:
    """A run of a pull request, as the reporter sees it."""

    org: str
    workspace: str
    run_id: str
    connection: str
    repository: str
    pull_request: int
    commit: str
    created_at: datetime
    seq: int  # the run subject's last sequence this view was folded through
    verdict: Verdict
    plan: tuple[int, int, int] | None  # add, change, destroy

    @property
    def key(self) -> str:
        return vr.pr_key(self.connection, self.repository, self.pull_request)

    def row(self) -> vr.PrRow:
        add, change, destroy = self.plan or (None, None, None)
        return vr.PrRow(
            workspace=self.workspace,
            run_id=self.run_id,
            commit=self.commit,
            status=self.verdict.word,
            add=add,
            change=change,
            destroy=destroy,
            created_at=self.created_at,
            event_seq=self.seq,
        )


def pr_run(s: RunState, seq: int) -> PrRun | None:
    """The run as a PR's run; None unless its cause is a VCS pull request."""
    cause = s.cause
    if cause is None or cause.kind != "vcs" or cause.pull_request <= 0:
        return None
    if not cause.connection or not cause.repository or not cause.commit:
        return None
    plan = s.plan_summary
    return PrRun(
        org=s.org,
        workspace=s.workspace,
        run_id=s.run_id,
        connection=cause.connection,
        repository=cause.repository,
        pull_request=cause.pull_request,
        commit=cause.commit,
        created_at=s.created_at or datetime.fromtimestamp(0, UTC),
        seq=seq,
        verdict=verdict(s),
        plan=(plan.add, plan.change, plan.destroy) if plan and s.terminal else None,
    )
