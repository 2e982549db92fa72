"""The run aggregate's commands (see events/run.py for the aggregate)."""

from __future__ import annotations

from datetime import datetime

from events import policies as po
from events import templates as te
from events.approval import Caller
from events.base import Command
from events.run_events import PrunedObject
from events.values import (
    Cause,
    ConfigSource,
    PlanSummary,
    ResourceChange,
    RunOptions,
    Snapshot,
    Workspace,
)


class CreateRun(Command, frozen=True, kw_only=True):
    run_id: str
    org: str
    workspace: str
    run_type: str
    config: Workspace
    message: str = ""
    speculative: bool = False
    template: te.Template | None = None
    cause: Cause | None = None
    commit: str = ""  # the commit to pin at admission instead of the branch head
    source: ConfigSource | None = None  # an uploaded configuration (events/values.py)
    options: RunOptions | None = None  # targets, replaces, refresh, run variables


class AdmitRun(Command, frozen=True, kw_only=True):
    snapshot: Snapshot | None = None
    pinning: bool = False  # the snapshot follows (PinRun)


class PinRun(Command, frozen=True, kw_only=True):
    snapshot: Snapshot


class ClaimPhase(Command, frozen=True, kw_only=True):
    phase: str
    lease_id: str
    executor_id: str


class ReleasePhase(Command, frozen=True, kw_only=True):
    """Give the claimed phase back to its pool (the executor drains), fenced by its lease:
    refused once the phase began what must run once (an apply's `apply` step, a custom
    step's command)."""

    lease_id: str
    reason: str = ""


class StartStep(Command, frozen=True, kw_only=True):
    lease_id: str
    step: str


class FinishStep(Command, frozen=True, kw_only=True):
    lease_id: str
    step: str
    ok: bool
    started_at: datetime
    log_object: str = ""
    error: str = ""
    metrics: dict[str, int] = {}
    # What the step's processes used (None: not measured; see StepFinished).
    cpu_seconds: float | None = None
    peak_memory_bytes: int | None = None
    wall_seconds: float | None = None


class FinishPlan(Command, frozen=True, kw_only=True):
    lease_id: str
    commit: str
    has_changes: bool
    summary: PlanSummary
    plan_object: str = ""
    plan_digest: str = ""
    require_approval: bool = True
    commit_author: str = ""
    commit_message: str = ""
    changes: list[ResourceChange] = []
    policies: list[po.PolicyResult] = []


class FinishApply(Command, frozen=True, kw_only=True):
    lease_id: str
    summary: PlanSummary


class ReportResource(Command, frozen=True, kw_only=True):
    lease_id: str
    address: str
    action: str
    state: str
    error: str = ""


class RecordStateVersion(Command, frozen=True, kw_only=True):
    lease_id: str
    serial: int
    lineage: str = ""
    digest: str
    object: str
    size: int = 0


class RecoverStateVersion(Command, frozen=True, kw_only=True):
    """Record a state version a dead executor left on disk: on any run, even ended."""

    serial: int
    lineage: str = ""
    digest: str
    object: str
    size: int = 0
    message: str = ""


class ApproveRun(Command, frozen=True, kw_only=True):
    """Approve a run awaiting approval. `caller` is who asks, as the shell resolved them
    (role, groups): the approval rule (events/approval.py) is decided on it. Without one
    the writer is the system itself, held only to four-eyes and confirm_destructive."""

    acknowledged: list[str] = []
    caller: Caller | None = None
    via: str = ""  # where the approval was given: "api", "slack", ...
    via_detail: dict[str, str] = {}  # where exactly: slack's {"user", "channel", "message"}


class FinishCustomStep(Command, frozen=True, kw_only=True):
    lease_id: str
    number: int


class DiscardRun(Command, frozen=True, kw_only=True):
    """Discard a run awaiting approval: `caller` as for ApproveRun (without one, the
    system: an approval timeout)."""

    reason: str = ""
    caller: Caller | None = None
    via: str = ""
    via_detail: dict[str, str] = {}  # where exactly: slack's {"user", "channel", "message"}


class CancelRun(Command, frozen=True, kw_only=True):
    """Cancel a waiting run, or ask a planning one to stop. With a lease_id it is the
    executor's report that it stopped the phase, and is fenced."""

    reason: str = ""
    lease_id: str = ""


class ExceedLimit(Command, frozen=True, kw_only=True):
    """Record that a limit passed during an apply, which no limit interrupts (once)."""

    limit: str
    message: str = ""


class FailRun(Command, frozen=True, kw_only=True):
    """Fail the run. With a lease_id it is an executor's report and is fenced."""

    reason: str
    message: str = ""
    lease_id: str = ""


class PruneLog(Command, frozen=True, kw_only=True):
    """Retention: record that the run's stored logs are removed. Only a run that ended at
    or before `ended_before` (and whose logs are not removed already)."""

    objects: list[PrunedObject]
    ended_before: datetime
    days: int


class RemoveRun(Command, frozen=True, kw_only=True):
    """Retention: record that the run's whole record is removed. Only a run that ended
    at or before `ended_before`, and only once."""

    objects: list[PrunedObject]
    ended_before: datetime
    days: int


RunCommand = (
    CreateRun
    | AdmitRun
    | PinRun
    | ClaimPhase
    | ReleasePhase
    | StartStep
    | FinishStep
    | FinishPlan
    | FinishApply
    | ReportResource
    | RecordStateVersion
    | RecoverStateVersion
    | ApproveRun
    | DiscardRun
    | CancelRun
    | FailRun
    | ExceedLimit
    | FinishCustomStep
    | PruneLog
    | RemoveRun
)
