"""The run aggregate's vocabulary and its events (see events/run.py for the aggregate).

The events that move a run to another status carry that status (`status`, and the step
it is at, `step_at`): `decide` works them out, `evolve` copies them. Events recorded
before they carried it have `None` there; events/run_upcast.py gives them the outcome
the code of their day derived, once, as they are folded.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum

import msgspec

from events import policies as po
from events import templates as te
from events.base import Event
from events.values import (
    Cause,
    ConfigSource,
    PlanSummary,
    ResourceChange,
    RunOptions,
    Snapshot,
    Workspace,
)


class Status(StrEnum):
    PENDING = "pending"
    QUEUED = "queued"
    PLANNING = "planning"
    RUNNING = "running"
    AWAITING_APPROVAL = "awaiting_approval"
    APPLY_QUEUED = "apply_queued"
    APPLYING = "applying"
    APPLIED = "applied"
    PLANNED = "planned"
    NO_CHANGES = "no_changes"
    DRIFTED = "drifted"
    DISCARDED = "discarded"
    FAILED = "failed"
    CANCELED = "canceled"


TERMINAL = frozenset(
    {
        Status.APPLIED,
        Status.PLANNED,
        Status.NO_CHANGES,
        Status.DRIFTED,
        Status.DISCARDED,
        Status.FAILED,
        Status.CANCELED,
    }
)
# The terminal statuses of a run that ended well: what the CLI's exit codes, the PR
# reports and the TFE API read as success.
SUCCEEDED = frozenset({Status.APPLIED, Status.PLANNED, Status.NO_CHANGES, Status.DRIFTED})
CANCELABLE = frozenset({Status.PENDING, Status.QUEUED, Status.APPLY_QUEUED})
# A run in one of these is stopped: its executor interrupts Terraform, then cancels it.
STOPPABLE = frozenset({Status.PLANNING, Status.RUNNING})
RUN_TYPES = ("plan", "apply", "destroy", "drift")

# The statuses in which the run's current step waits for an executor to claim its phase
# (plan, apply or custom-<number>: events/templates.py `phase_of`).
WAITING = frozenset({Status.QUEUED, Status.APPLY_QUEUED})
RUNNING_STATUS = {"plan": Status.PLANNING, "apply": Status.APPLYING}


def running_status(phase: str) -> Status:
    """The status of a run while an executor runs `phase`."""
    return RUNNING_STATUS.get(phase, Status.RUNNING)


# ---------------------------------------------------------------- events


class RunCreated(Event, frozen=True, kw_only=True, tag="run.created"):
    run_id: str
    org: str
    workspace: str
    run_type: str
    config: Workspace
    message: str = ""
    speculative: bool = False  # a plan-only run outside the workspace queue
    template: te.Template | None = None  # None: the built-in of the run type (older runs)
    cause: Cause | None = None  # why it exists; None: recorded before causes were
    commit: str = ""  # a pin asked at creation (a webhook's commit), else the branch head
    source: ConfigSource | None = None  # an uploaded configuration instead of the repository
    options: RunOptions | None = None  # the plan's targets, replaces, refresh, variables


class RunQueued(Event, frozen=True, kw_only=True, tag="run.queued"):
    """Admitted: the first step now waits for an executor, pinned to its snapshot; with
    `pinning` the snapshot is still to come (`run.pinned`) and no executor may claim the
    run before it has come."""

    phase: str = "plan"
    snapshot: Snapshot | None = None
    pinning: bool = False
    # The outcome (None in events recorded before it was: events/run_upcast.py).
    status: Status | None = None  # the run's status after this event
    step_at: int | None = None  # the index of the step it is at then


class RunPinned(Event, frozen=True, kw_only=True, tag="run.pinned"):
    """The admitted run's snapshot: what it will plan and apply, whatever moves later."""

    snapshot: Snapshot


class PhaseStarted(Event, frozen=True, kw_only=True, tag="run.phase_started"):
    """An executor claimed the waiting phase under a fresh lease."""

    phase: str
    lease_id: str
    executor_id: str
    status: Status | None = None  # the run's status while it runs (None: recorded before)


class PhaseReleased(Event, frozen=True, kw_only=True, tag="run.phase_released"):
    """The executor holding the phase gave it back before it began anything that must run
    once (it drains: SIGTERM). The phase waits for an executor again under no lease, so
    the old executor's late reports are refused; `attempt` numbers the claims given back
    (1: the first). A retry, not a failure."""

    phase: str
    lease_id: str
    executor_id: str
    reason: str = "executor_draining"
    attempt: int = 1
    status: Status | None = None  # the run's status after it (queued, apply_queued)
    step_at: int | None = None


class StepStarted(Event, frozen=True, kw_only=True, tag="run.step_started"):
    lease_id: str
    step: str


class StepFinished(Event, frozen=True, kw_only=True, tag="run.step_finished"):
    lease_id: str
    step: str
    ok: bool
    started_at: datetime
    log_object: str = ""
    error: str = ""
    metrics: dict[str, int] = {}
    # What the step's processes used, from the phase's control group (executor/
    # cgroups.py): CPU time, the highest memory in use at once, and the step's own wall
    # time. None: not measured (events recorded before these were, or a phase with no
    # control group: not root, no cgroup hierarchy).
    cpu_seconds: float | None = None
    peak_memory_bytes: int | None = None
    wall_seconds: float | None = None


class PlanFinished(Event, frozen=True, kw_only=True, tag="run.plan_finished"):
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
    # Why the run did not wait for the approval its settings asked for ("" it did, or
    # none was asked): "auto_apply_run_triggers" (events/run_decide.py `_auto_applies`).
    approval_skipped: str = ""
    # The outcome (None in events recorded before it was: events/run_upcast.py).
    status: Status | None = None  # the run's status after this event
    step_at: int | None = None  # the index of the step it is at then


class RunApproved(Event, frozen=True, kw_only=True, tag="run.approved"):
    acknowledged: list[str] = []
    overridden: list[str] = []  # soft-mandatory policies that failed and were overridden
    via: str = ""  # where it was given: "api", "slack", ... ("" before it was recorded)
    via_detail: dict[str, str] = {}  # where exactly: slack's {"user", "channel", "message"}
    # The outcome (None in events recorded before it was: events/run_upcast.py).
    status: Status | None = None  # the run's status after this event
    step_at: int | None = None  # the index of the step it is at then


class CustomStepFinished(Event, frozen=True, kw_only=True, tag="run.custom_finished"):
    """A custom step's command exited 0 (a failing one fails the run)."""

    lease_id: str
    number: int
    # The outcome (None in events recorded before it was: events/run_upcast.py).
    status: Status | None = None  # the run's status after this event
    step_at: int | None = None  # the index of the step it is at then


class ApplyFinished(Event, frozen=True, kw_only=True, tag="run.apply_finished"):
    lease_id: str
    summary: PlanSummary
    # The outcome (None in events recorded before it was: events/run_upcast.py).
    status: Status | None = None  # the run's status after this event
    step_at: int | None = None  # the index of the step it is at then


class ResourceStateChanged(Event, frozen=True, kw_only=True, tag="run.resource_state"):
    """One resource moved during the apply: pending, applying, done, failed, not_applied.

    A replacement reports each of its stages (`action` delete / create) in the order run.
    """

    lease_id: str
    address: str
    action: str
    state: str
    error: str = ""


class StateVersionCreated(Event, frozen=True, kw_only=True, tag="run.state_version"):
    """Terraform wrote a new state version (stored encrypted in the object store)."""

    lease_id: str
    serial: int
    lineage: str = ""
    digest: str
    object: str
    size: int = 0
    # Left on disk by an executor that died before recording it, and recorded by the next
    # start on its work directory (`lease_id` empty); `message` says what happened.
    recovered: bool = False
    message: str = ""


class RunDiscarded(Event, frozen=True, kw_only=True, tag="run.discarded"):
    reason: str = ""
    via: str = ""  # where it was given: "api", "slack", ... (a timeout: "")
    via_detail: dict[str, str] = {}  # where exactly: slack's {"user", "channel", "message"}


class RunCanceled(Event, frozen=True, kw_only=True, tag="run.canceled"):
    reason: str = ""


class RunStopRequested(Event, frozen=True, kw_only=True, tag="run.stop_requested"):
    """Someone asked to stop a running phase; its executor interrupts it and cancels."""

    reason: str = ""


class RunLimitExceeded(Event, frozen=True, kw_only=True, tag="run.limit_exceeded"):
    """A limit passed while the run could not be stopped (an apply): recorded, not acted on."""

    limit: str
    message: str = ""


class RunFailed(Event, frozen=True, kw_only=True, tag="run.failed"):
    reason: str
    message: str = ""
    lease_id: str = ""


class PrunedObject(msgspec.Struct, frozen=True, kw_only=True):
    """A stored object retention removed: its name and SHA-256 (the object store's digest)."""

    name: str
    sha256: str = ""
    size: int = 0
    bucket: str = ""  # "" in run.log_pruned: rp-logs; run.removed names each one's


class LogPruned(Event, frozen=True, kw_only=True, tag="run.log_pruned"):
    """Retention removed the run's stored logs (`objects`, named with their digests); the
    run's row, steps, changes and events remain. Recorded before anything is deleted."""

    objects: list[PrunedObject] = []
    days: int = 0  # the retention (days after the run ended) that applied


# The read model's rows a removal drops (projections/working.py REMOVED_BY_RUN): named in
# the event, so what a replay drops is what the record says.
REMOVED_ROWS = ("runs", "steps", "changes", "resource_states")


class RunRemoved(Event, frozen=True, kw_only=True, tag="run.removed"):
    """Retention removed the run's whole record: its read-model rows (`rows`: the run's
    row with its approvals and cause, its steps with their metrics, its plan's changes,
    its resource states) and stored objects (`objects`, each with its bucket and digest:
    logs, the saved plan). Its events (this one too) stay: the event log is append-only.
    Recorded before anything is deleted."""

    objects: list[PrunedObject] = []
    rows: list[str] = []
    days: int = 0  # the record retention (days after the run ended) that applied


RunEvent = (
    RunCreated
    | RunQueued
    | RunPinned
    | PhaseStarted
    | PhaseReleased
    | StepStarted
    | StepFinished
    | PlanFinished
    | RunApproved
    | ApplyFinished
    | ResourceStateChanged
    | StateVersionCreated
    | RunDiscarded
    | RunCanceled
    | RunFailed
    | RunStopRequested
    | RunLimitExceeded
    | CustomStepFinished
    | LogPruned
    | RunRemoved
)
