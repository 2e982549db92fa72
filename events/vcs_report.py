"""What runplane has reported on a pull request: its plans' rows and its one comment. Pure.

One aggregate per (connection, repository, pull request) on
`rp.org.<org>.vcspr.<key>` (`pr_key`): every speculative plan of the PR's workspaces
records its row there (`org.vcs_pr_row_set`: the workspace, the run, its status word and
its plan's counts, never more), and the PR's comment id is remembered there once it is
posted (`org.vcs_comment_linked`), so every replica and every restart edits that comment
and none posts a second. Posting it is claimed first (`org.vcs_comment_claimed`, appended
expecting the subject's last sequence: two claimants, one wins), and a claim not
followed by a link within `CLAIM_TTL` may be taken over (its holder died).

A workspace's row is its latest run's: a row replaces the one there when its run was
created later, or it is the same run at a later event, so an old commit's plan ending
late, or an event redelivered, never puts an older row back.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import assert_never

import msgspec

from events.base import Event

CLAIM_TTL = timedelta(seconds=60)


class PrRow(msgspec.Struct, frozen=True, kw_only=True):
    """One workspace's plan on the PR: nothing of the plan but counts."""

    workspace: str
    run_id: str
    commit: str
    status: str  # a word of runplane's vocabulary (services/processes/vcs/report.py WORDS)
    add: int | None = None
    change: int | None = None
    destroy: int | None = None
    created_at: datetime  # of its run: a later run's row replaces it
    event_seq: int  # the run event's stream sequence it reflects


class RowSet(Event, frozen=True, kw_only=True, tag="org.vcs_pr_row_set"):
    connection: str
    repository: str
    pull_request: int
    row: PrRow


class CommentClaimed(Event, frozen=True, kw_only=True, tag="org.vcs_comment_claimed"):
    """A reporter is posting the PR's comment: others wait for its link."""

    claim: str  # the claimant's id


class CommentLinked(Event, frozen=True, kw_only=True, tag="org.vcs_comment_linked"):
    """The PR's comment: edited in place from now on."""

    claim: str
    comment_id: int


VcsReportEvent = RowSet | CommentClaimed | CommentLinked


class PrReport(msgspec.Struct, frozen=True, kw_only=True):
    connection: str = ""
    repository: str = ""
    pull_request: int = 0
    rows: dict[str, PrRow] = {}
    claim: str = ""
    claimed_at: datetime | None = None
    comment_id: int = 0


def pr_key(connection: str, repository: str, pull_request: int) -> str:
    """The subject token of one PR of one connection (a repository's name is the VCS's
    and may hold any character: hashed)."""
    raw = f"{connection}\0{repository}\0{pull_request}".encode()
    return "p" + hashlib.sha256(raw).hexdigest()[:40]


def subject(org: str, key: str) -> str:
    return f"rp.org.{org}.vcspr.{key}"


def newer(row: PrRow, than: PrRow | None) -> bool:
    """Whether `row` replaces `than` as its workspace's row."""
    if than is None:
        return True
    return (row.created_at, row.event_seq) > (than.created_at, than.event_seq)


def evolve(state: PrReport, event: VcsReportEvent) -> PrReport:
    match event:
        case RowSet():
            row = event.row
            base = msgspec.structs.replace(
                state,
                connection=event.connection,
                repository=event.repository,
                pull_request=event.pull_request,
            )
            if not newer(row, state.rows.get(row.workspace)):
                return base
            return msgspec.structs.replace(base, rows={**state.rows, row.workspace: row})
        case CommentClaimed():  # posting anew: the comment linked before is gone
            return msgspec.structs.replace(
                state, claim=event.claim, claimed_at=event.at, comment_id=0
            )
        case CommentLinked():
            return msgspec.structs.replace(state, comment_id=event.comment_id, claim=event.claim)
        case _:
            assert_never(event)


def fold(events: Sequence[VcsReportEvent], state: PrReport | None = None) -> PrReport:
    out = state or PrReport()
    for e in events:
        out = evolve(out, e)
    return out


def claim_open(state: PrReport, now: datetime) -> bool:
    """Whether someone may claim the posting of the comment now: none posted, and no
    claim, or one older than CLAIM_TTL (its holder died between claim and link)."""
    if state.comment_id:
        return False
    return state.claimed_at is None or now - state.claimed_at >= CLAIM_TTL


def head_commit(state: PrReport) -> str:
    """The commit of the PR's latest run (what the comment is about now)."""
    rows = sorted(state.rows.values(), key=lambda r: (r.created_at, r.event_seq))
    return rows[-1].commit if rows else ""
