"""The workspace aggregate: its configuration and its FIFO run queue.

The queue lives here so that admission is one optimistic append on the workspace subject:
two schedulers racing to admit can never both win, and the order of `ws.run_enqueued`
events on the subject *is* the FIFO order.

A workspace's configuration changes by `ws.config_changed` (runs already created keep
the configuration they copied). It goes by `ws.deleted`, decided only while no run holds
it or waits in its queue; a run created as it was deleted finds its enqueue refused (the
same subject, an optimistic append: one of the two wins), and its creator cancels it.
A deleted workspace keeps its history and takes no command but `PurgeWorkspace`; its
name is free again only after `ws.purged`, which folds to a workspace never created (the
subject's events stay: the stream denies deletes).

The aggregate lives in a few modules, all imported from here: its events
(`workspace_events`), commands (`workspace_commands`), state and the configuration
members a change may touch (`workspace_state`), and `decide` (`workspace_decide`). This
module folds: `evolve(state, event)`, pure.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import assert_never

import msgspec

from events.settings import merge
from events.workspace_commands import (
    AdmitNext,
    ChangeConfig,
    CreateWorkspace,
    DeleteWorkspace,
    EnqueueRun,
    LockWorkspace,
    PurgeWorkspace,
    RecordStatePush,
    ReleaseRun,
    SetSettings,
    SetVariables,
    UnlockWorkspace,
    WorkspaceCommand,
)
from events.workspace_decide import decide, repository_problem
from events.workspace_events import (
    ConfigChanged,
    RunAdmitted,
    RunEnqueued,
    RunReleased,
    SettingsSet,
    StatePushed,
    VariablesSet,
    WorkspaceCreated,
    WorkspaceDeleted,
    WorkspaceEvent,
    WorkspaceLocked,
    WorkspacePurged,
    WorkspaceUnlocked,
)
from events.workspace_state import (
    CONFIG_MEMBERS,
    INITIAL,
    VCS_MEMBERS,
    VCS_RUN_TYPES,
    Lock,
    WorkspaceState,
    changed,
)


def evolve(state: WorkspaceState, event: WorkspaceEvent) -> WorkspaceState:
    s = msgspec.structs.replace(state, version=state.version + 1)
    match event:
        case WorkspaceCreated():
            return msgspec.structs.replace(
                s,
                org=event.org,
                name=event.name,
                config=event.config,
                created_at=event.at,
                folder=event.folder,
            )
        case RunEnqueued():
            return msgspec.structs.replace(s, queue=(*s.queue, event.run_id))
        case RunAdmitted():
            queue = tuple(r for r in s.queue if r != event.run_id)
            return msgspec.structs.replace(s, queue=queue, active=event.run_id)
        case RunReleased():
            queue = tuple(r for r in s.queue if r != event.run_id)
            active = "" if s.active == event.run_id else s.active
            return msgspec.structs.replace(s, queue=queue, active=active)
        case VariablesSet():
            assert s.config is not None, "variables of a workspace that was never created"
            config = msgspec.structs.replace(s.config, variables=dict(event.variables))
            return msgspec.structs.replace(s, config=config)
        case SettingsSet():
            return msgspec.structs.replace(s, settings=merge(s.settings, event.changes))
        case WorkspaceLocked():
            lock = Lock(holder=event.actor, reason=event.reason, locked_at=event.at)
            return msgspec.structs.replace(s, lock=lock, pushed="")
        case WorkspaceUnlocked():
            return msgspec.structs.replace(s, lock=None, pushed="")
        case ConfigChanged():
            assert s.config is not None, "a change of a workspace that was never created"
            return msgspec.structs.replace(s, config=changed(s.config, event.changes))
        case WorkspaceDeleted():
            return msgspec.structs.replace(s, deleted_at=event.at)
        case WorkspacePurged():
            return WorkspaceState(version=s.version, purges=s.purges + 1)
        case StatePushed():
            return msgspec.structs.replace(s, pushed=event.object)
        case _:
            assert_never(event)


def fold(events: Sequence[WorkspaceEvent], state: WorkspaceState = INITIAL) -> WorkspaceState:
    for e in events:
        state = evolve(state, e)
    return state


__all__ = [
    "CONFIG_MEMBERS",
    "INITIAL",
    "VCS_MEMBERS",
    "VCS_RUN_TYPES",
    "AdmitNext",
    "ChangeConfig",
    "ConfigChanged",
    "CreateWorkspace",
    "DeleteWorkspace",
    "EnqueueRun",
    "Lock",
    "LockWorkspace",
    "PurgeWorkspace",
    "RecordStatePush",
    "ReleaseRun",
    "RunAdmitted",
    "RunEnqueued",
    "RunReleased",
    "SetSettings",
    "SetVariables",
    "SettingsSet",
    "StatePushed",
    "UnlockWorkspace",
    "VariablesSet",
    "WorkspaceCommand",
    "WorkspaceCreated",
    "WorkspaceDeleted",
    "WorkspaceEvent",
    "WorkspaceLocked",
    "WorkspacePurged",
    "WorkspaceState",
    "WorkspaceUnlocked",
    "changed",
    "decide",
    "evolve",
    "fold",
    "repository_problem",
]
