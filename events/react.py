"""What the system does about an event: one pure table, `react(event, state)`.

The scheduler and every subscriber act on its output and on nothing else, so "when to
react" is written once: no hand-kept sets of event tags. It decides from the event and
the aggregate's state folded THROUGH it (not later), which since transitions are
recorded facts (events/run_events.py: the event that moves a run carries the status it
leads to) is where the event led: a plan that ended awaiting approval, a run that
ended, a phase waiting for an executor. Nothing here reads the clock or the stream.

Actions (all idempotent to carry out, so a redelivered event is harmless):

- `Admit`: an admission attempt on a workspace (it also releases a terminal run still
  holding it: services/app/commands.py `admit_next`);
- `Enqueue`: a created run must be on its workspace's queue (its creator's second append;
  the scheduler repairs it for a creator that died);
- `AdmitSpeculative`: a speculative plan is admitted at once, outside the queue;
- `Dispatch`: a phase waits for an executor (`phase`), or the admitted run waits for its
  snapshot first (`pin`);
- `Watch`: the reaper's board (services/processes/scheduler/watch.py): a claimed phase gets a beat
  on its lease's behalf (`adopt`), ended phases' entries are purged (`purge`, and the
  custom steps' with `custom`);
- `Deadline`: the run's limits marker may have moved (services/processes/scheduler/limits.py);
- `Notify`: a notification trigger, named as HCP Terraform names them (plus runplane's
  own `run:drifted`, `run:policy_failed`, `run:discarded`, `run:canceled`);
- `Follow`: a run ended `applied` having changed something (its apply's summary, else
  its plan's, counts a resource): the workspaces that follow its workspace each get a
  run (services/processes/triggers/subscriber.py).
"""

from __future__ import annotations

from typing import Final, TypedDict, assert_never

import msgspec

from events import audit_stream as ads
from events import chat as ch
from events import members as mb
from events import run_triggers as rt
from events import schedule as sc
from events import sso, stacks, vcs
from events import teams as tm
from events.codec import AnyEvent
from events.folder import FolderCreated, FolderSettingsSet, OrgSettingsSet
from events.groups import GroupSet
from events.notification import (
    ConfigDeleted,
    ConfigSaved,
    DeliveryAttempted,
    DeliveryScheduled,
    NotificationEvent,
)
from events.org import OrgCreated, OrgEvent, TokenIssued, TokenRevoked, TokenUsed
from events.policies import PolicyDeleted, PolicySaved
from events.run import (
    SUCCEEDED,
    ApplyFinished,
    CustomStepFinished,
    LogPruned,
    PhaseReleased,
    PhaseStarted,
    PlanFinished,
    ResourceStateChanged,
    RunApproved,
    RunCanceled,
    RunCreated,
    RunDiscarded,
    RunFailed,
    RunLimitExceeded,
    RunPinned,
    RunQueued,
    RunRemoved,
    RunState,
    RunStopRequested,
    StateVersionCreated,
    Status,
    StepFinished,
    StepStarted,
)
from events.stack_run_events import STACK_RUN_EVENTS, StackRunEvent
from events.templates import TemplateDeleted, TemplateSaved
from events.vcs_report import CommentClaimed, CommentLinked, RowSet, VcsReportEvent
from events.workspace import (
    ConfigChanged,
    RunAdmitted,
    RunEnqueued,
    RunReleased,
    SettingsSet,
    StatePushed,
    VariablesSet,
    WorkspaceCreated,
    WorkspaceDeleted,
    WorkspaceLocked,
    WorkspacePurged,
    WorkspaceState,
    WorkspaceUnlocked,
)

# Every phase a run's board entries may be under but its custom steps' (`custom-<n>`).
PHASES: Final = ("plan", "apply")

CREATED: Final = "run:created"
PLANNING: Final = "run:planning"
NEEDS_ATTENTION: Final = "run:needs_attention"  # awaiting approval, or a policy override
APPLYING: Final = "run:applying"
COMPLETED: Final = "run:completed"  # every successful end: applied, planned, no changes, drifted
ERRORED: Final = "run:errored"
DRIFTED: Final = "run:drifted"  # a drift run that found drift (with run:completed)
POLICY_FAILED: Final = "run:policy_failed"  # a hard-mandatory policy failed the run (with errored)
DISCARDED: Final = "run:discarded"
CANCELED: Final = "run:canceled"
TRIGGERS: Final = (
    CREATED,
    PLANNING,
    NEEDS_ATTENTION,
    APPLYING,
    COMPLETED,
    ERRORED,
    DRIFTED,
    POLICY_FAILED,
    DISCARDED,
    CANCELED,
)

POLICY_REASON: Final = "policy_failed"  # events/run_decide.py: a hard-mandatory failure


class Admit(msgspec.Struct, frozen=True, kw_only=True):
    """Try to admit the workspace's next run (releasing a terminal one that holds it)."""

    org: str
    ws: str
    hint: str = ""  # a run likely at the head of the queue: just enqueued


class Enqueue(msgspec.Struct, frozen=True, kw_only=True):
    """Make sure a created run is on its workspace (if its creator did not live to)."""

    org: str
    ws: str
    run_id: str


class AdmitSpeculative(msgspec.Struct, frozen=True, kw_only=True):
    org: str
    ws: str
    run_id: str


class Dispatch(msgspec.Struct, frozen=True, kw_only=True):
    """The run waits: for an executor to claim `phase`, or with `pin` for its snapshot
    (then `run.pinned` comes back here with the phase)."""

    org: str
    ws: str
    run_id: str
    phase: str = ""
    pin: bool = False


class Watch(msgspec.Struct, frozen=True, kw_only=True):
    """The reaper's board: `adopt` the claimed phase's lease, or `purge` ended phases."""

    org: str
    ws: str
    run_id: str
    adopt: bool = False
    purge: tuple[str, ...] = ()
    custom: bool = False  # the custom steps that ran, but the one live now


class Deadline(msgspec.Struct, frozen=True, kw_only=True):
    """Bring the run's deadline marker up to date (or purge it once the run ended)."""

    org: str
    ws: str
    run_id: str


class Notify(msgspec.Struct, frozen=True, kw_only=True):
    trigger: str  # one of TRIGGERS
    org: str
    ws: str
    run_id: str


class Follow(msgspec.Struct, frozen=True, kw_only=True):
    """The run changed its workspace: each of its followers gets a run (run triggers)."""

    org: str
    ws: str
    run_id: str


class StackChild(msgspec.Struct, frozen=True, kw_only=True):
    """A stack run's child run ended: its stack run records it (services/processes/stacks)."""

    org: str
    ws: str
    run_id: str
    stack_run: str


class _Key(TypedDict):
    org: str
    ws: str
    run_id: str


Action = (
    Admit | Enqueue | AdmitSpeculative | Dispatch | Watch | Deadline | Notify | Follow | StackChild
)


def react(event: AnyEvent, state: RunState | WorkspaceState | None) -> list[Action]:
    """The actions `event` calls for, in the order to carry them out; `state` is its
    aggregate's state folded through it. An event that is `quiet` calls for nothing
    (its state may be None); any other needs its state (who it is about, where it led)."""
    if quiet(event):
        return []
    if isinstance(event, RunEventT):
        if not isinstance(state, RunState) or not state.exists:
            raise ValueError(f"{type(event).__name__}: react needs the run's state")
        return _run(event, state)
    if isinstance(event, WsEventT):
        if not isinstance(state, WorkspaceState) or not state.exists:
            raise ValueError(f"{type(event).__name__}: react needs the workspace's state")
        return _workspace(event, state)
    # unreachable: `quiet` says which events are not (tests/test_react.py)
    raise AssertionError(f"{type(event).__name__} is neither quiet nor reacted to")


def quiet(event: AnyEvent) -> bool:
    """Whether `event` calls for nothing, whatever its aggregate's state: a consumer
    need not fold the state for it (`with_state=lambda e: not quiet(e)`)."""
    if isinstance(event, RunEventT | WsEventT):
        return False
    match event:
        case (
            StepStarted()
            | StepFinished()
            | ResourceStateChanged()
            | StateVersionCreated()
            | RunStopRequested()  # its executor interrupts the phase, then cancels
            | RunLimitExceeded()  # recorded, not acted on: the apply ends as it does
            | LogPruned()  # retention's record of an ended run
            | RunRemoved()
        ):
            return True
        case RunAdmitted() | VariablesSet() | SettingsSet() | WorkspaceLocked():
            return True  # an admission's `run.queued` follows on the run
        case ConfigChanged() | WorkspaceDeleted() | WorkspacePurged():
            return True  # a deleted workspace holds no run: nothing to admit or release
        case StatePushed():
            return True  # recorded while the pusher holds the lock: nothing is admitted
        case _:
            return _others_own(event)


# The events of the aggregates but the run's and the workspace's.
OthersEvent = (
    OrgEvent
    | NotificationEvent
    | ch.ChatEvent
    | vcs.VcsEvent
    | VcsReportEvent
    | rt.RunTriggerEvent
    | sc.ScheduleEvent
    | sso.SsoEvent
    | ads.AuditDestinationEvent
    | stacks.StackEvent
    | StackRunEvent
)


# Who is who and may do what (events/members.py, events/teams.py): read by each request
# from its organization's aggregate, never reacted to.
_IDENTITY = (
    mb.UserAdded,
    mb.UserSuspended,
    mb.UserReactivated,
    mb.UserLinked,
    tm.TeamSet,
    tm.TeamDeleted,
    tm.TeamMembersSet,
    tm.UserTeamsSynced,
    tm.AccessGranted,
    tm.AccessRevoked,
)


def _others_own(event: OthersEvent) -> bool:
    """Every other aggregate's event calls for nothing here: each is read by its own
    process, or by none."""
    if isinstance(event, _IDENTITY) or isinstance(event, STACK_RUN_EVENTS):
        return True  # a stack run's: its process reads its subject on each (processes/stacks)
    match event:
        case (
            OrgCreated()
            | TokenIssued()
            | TokenRevoked()
            | TokenUsed()
            | FolderCreated()
            | OrgSettingsSet()
            | FolderSettingsSet()
            | GroupSet()
            | TemplateSaved()
            | TemplateDeleted()
            | PolicySaved()
            | PolicyDeleted()
            | ConfigSaved()
            | ConfigDeleted()
            | DeliveryScheduled()
            | DeliveryAttempted()
        ):
            return True
        case rt.RunTriggerAdded() | rt.RunTriggerRemoved():
            return True  # the graph is read when an apply ends (`Follow`)
        case (  # chat-ops' own (events/chat.py): its worker reads them itself
            ch.SlackConfigured()
            | ch.SlackRemoved()
            | ch.SlackUserMapped()
            | ch.SlackUserUnmapped()
            | ch.SlackRequestReceived()
            | ch.SlackRequestDone()
            | ch.SlackMessageLinked()
        ):
            return True
        case (  # VCS connections and the deliveries they accepted (events/vcs.py)
            vcs.ConnectionSaved()
            | vcs.ConnectionDeleted()
            | vcs.DeliveryAccepted()
            | vcs.PushClaimed()
        ):
            return True
        case RowSet() | CommentClaimed() | CommentLinked():  # the VCS reporter's own
            return True
        case (  # schedules' own (events/schedule.py): the schedule loop reads them itself
            sc.ScheduleSaved() | sc.ScheduleDeleted() | sc.ScheduleFired() | sc.ScheduleSkipped()
        ):
            return True
        case sso.SsoConfigured() | sso.SsoRemoved():  # read by sign-ins from its subject
            return True
        case ads.DestinationSaved() | ads.DestinationDeleted():  # the audit streamer's own
            return True
        case stacks.StackCreated() | stacks.StackChanged() | stacks.StackDeleted():
            return True  # read by a stack run from its subject when it starts
        case _:
            assert_never(event)


RunEventT = (
    RunCreated
    | RunQueued
    | RunPinned
    | PhaseStarted
    | PhaseReleased
    | PlanFinished
    | RunApproved
    | ApplyFinished
    | RunDiscarded
    | RunCanceled
    | RunFailed
    | CustomStepFinished
)


WsEventT = WorkspaceCreated | RunEnqueued | RunReleased | WorkspaceUnlocked


def _run(event: RunEventT, s: RunState) -> list[Action]:
    key = _Key(org=s.org, ws=s.workspace, run_id=s.run_id)
    match event:
        case RunCreated():
            first: Action = AdmitSpeculative(**key) if s.speculative else Enqueue(**key)
            return [first, Deadline(**key), Notify(trigger=CREATED, **key)]
        case RunQueued():
            if s.pinning:  # its snapshot first; `run.pinned` brings the deadline up to date
                return [Dispatch(**key, pin=True)]
            return [*_dispatch(s, key), Deadline(**key)]
        case RunPinned():
            return [*_dispatch(s, key), Deadline(**key)]
        case PhaseStarted():
            return [Watch(**key, adopt=True), *_started(s, key)]
        case PhaseReleased():  # its board entry first: the new dispatch marks it afresh
            return [Watch(**key, purge=(event.phase,)), *_dispatch(s, key), Deadline(**key)]
        case PlanFinished() | RunApproved() | ApplyFinished() | CustomStepFinished():
            return [*_moved(s, key), *_ended(event, key), Deadline(**key), *_reached(s, key)]
        case RunDiscarded():
            return [*_release(s), Deadline(**key), Notify(trigger=DISCARDED, **key)]
        case RunCanceled():
            watch = Watch(**key, purge=PHASES, custom=True)
            return [*_release(s), watch, Deadline(**key), Notify(trigger=CANCELED, **key)]
        case RunFailed():
            watch = Watch(**key, purge=PHASES, custom=True)
            notes = [Notify(trigger=ERRORED, **key)]
            if event.reason == POLICY_REASON:
                notes.append(Notify(trigger=POLICY_FAILED, **key))
            return [*_release(s), watch, Deadline(**key), *notes]
        case (
            StepStarted()
            | StepFinished()
            | ResourceStateChanged()
            | StateVersionCreated()
            | RunStopRequested()
            | RunLimitExceeded()
            | LogPruned()
            | RunRemoved()
        ):
            return []
        case _:
            assert_never(event)


def _workspace(event: WsEventT, w: WorkspaceState) -> list[Action]:
    match event:
        case RunEnqueued():
            return [Admit(org=w.org, ws=w.name, hint=event.run_id)]
        case WorkspaceCreated() | RunReleased() | WorkspaceUnlocked():
            return [Admit(org=w.org, ws=w.name)]
        case _:
            assert_never(event)


def _dispatch(s: RunState, key: _Key) -> list[Action]:
    phase = s.waiting_phase
    return [Dispatch(**key, phase=phase)] if phase else []


def _release(s: RunState) -> list[Action]:
    """An ended run gives its workspace back: an admission attempt releases it if its
    writer did not live to, then admits the next. A speculative plan never held it. A
    stack run's child tells its stack run."""
    out: list[Action] = [] if s.speculative else [Admit(org=s.org, ws=s.workspace)]
    if s.cause is not None and s.cause.kind == "stack_run":
        key = _Key(org=s.org, ws=s.workspace, run_id=s.run_id)
        out.append(StackChild(**key, stack_run=s.cause.stack_run))
    return out


def _moved(s: RunState, key: _Key) -> list[Action]:
    """Where a finished step led: the run's end, or the next phase waiting."""
    if s.terminal:
        return _release(s)
    return _dispatch(s, key)


def _ended(
    event: PlanFinished | RunApproved | ApplyFinished | CustomStepFinished, key: _Key
) -> list[Action]:
    """The board entries of the phase that just ended."""
    match event:
        case PlanFinished():
            return [Watch(**key, purge=("plan",))]
        case ApplyFinished():
            return [Watch(**key, purge=("apply",))]
        case CustomStepFinished():
            return [Watch(**key, custom=True)]
        case RunApproved():
            return []
        case _:
            assert_never(event)


def _started(s: RunState, key: _Key) -> list[Action]:
    """The trigger of a phase an executor claimed (a custom step's has none)."""
    match s.status:
        case Status.PLANNING:
            return [Notify(trigger=PLANNING, **key)]
        case Status.APPLYING:
            return [Notify(trigger=APPLYING, **key)]
        case _:
            return []


def _reached(s: RunState, key: _Key) -> list[Action]:
    """The triggers of where a finished step led: a wait for a person, or a good end (a
    plan a hard-mandatory policy failed stays planning: its `run.failed` says it)."""
    if s.status == Status.AWAITING_APPROVAL:
        return [Notify(trigger=NEEDS_ATTENTION, **key)]
    if s.status not in SUCCEEDED:
        return []
    drifted = [Notify(trigger=DRIFTED, **key)] if s.status == Status.DRIFTED else []
    follow = [Follow(**key)] if changed(s) else []
    return [Notify(trigger=COMPLETED, **key), *drifted, *follow]


def changed(s: RunState) -> bool:
    """Whether the run ended `applied` having changed a resource: its apply's summary
    says so (else, recorded without one, its plan's). A plan-only, failed or no-change
    run changed nothing; nor did an apply whose plan changed only outputs."""
    if s.status != Status.APPLIED:
        return False
    summary = s.apply_summary or s.plan_summary
    return summary is not None and summary.add + summary.change + summary.destroy > 0


def notifications(actions: list[Action]) -> list[Notify]:
    """The `Notify` actions of a reaction (what a notifying subscriber acts on)."""
    return [a for a in actions if isinstance(a, Notify)]
