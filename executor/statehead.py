"""A workspace's current state version as a phase's state backend reads it
(executor/statebackend.py): the head, repaired first when a writer died half way.

A new version is recorded on its run, then the head moves; a pending mark names it in
between. A writer that died there left the version pending: the next reader promotes it
when its run recorded it (`run.state_version`), or when it is the last version a user's
CLI pushed (`ws.state_pushed`), and leaves it otherwise (an older entry, or a write still
in flight).
"""

from __future__ import annotations

import structlog

from events.codec import run_subject, ws_subject
from events.run import StateVersionCreated
from events.workspace import StatePushed
from executor.ports import RunReader
from executor.statestore import Head, HeadMoved, StateStore
from infra.eventstore import LATEST

log = structlog.get_logger(__name__)


async def current_head(
    store: StateStore, runs: RunReader, org: str, ws: str
) -> tuple[Head | None, int]:
    """The head, after promoting a pending version its run recorded (a writer that
    died between recording a version and moving the head left it behind)."""
    head, revision = await store.head(org, ws)
    pending = await store.pending(org, ws)
    if pending is None or (head is not None and head.object == pending.object):
        return head, revision
    newer = head is None or (pending.lineage == head.lineage and pending.serial > head.serial)
    pushed = not pending.run_id and await _pushed(runs, org, ws, pending, head)
    if not pushed and (not newer or not await _recorded(runs, org, ws, pending)):
        return head, revision  # an older entry, or a write still in flight: not ours
    try:
        revision = await store.move_head(org, ws, pending, revision)
    except HeadMoved:
        return await store.head(org, ws)
    log.warning("state_head_recovered", object=pending.object, run_id=pending.run_id)
    await store.clear_pending(org, ws)
    return pending, revision


async def _pushed(runs: RunReader, org: str, ws: str, version: Head, head: Head | None) -> bool:
    """Whether a user's CLI pushed the version over `head` (`ws.state_pushed`:
    services/surfaces/tfe/state_push.py records it before it moves the head): the last push
    only, as an earlier one may name the same object (services/surfaces/tfe/state.py)."""
    subject = ws_subject(org, ws)
    was = head.object if head is not None else ""
    for envelope in reversed(await runs.store.read(subject, min_seq=LATEST)):
        event = envelope.event
        if isinstance(event, StatePushed):
            return event.object == version.object and event.previous == was
    return False


async def _recorded(runs: RunReader, org: str, ws: str, version: Head) -> bool:
    """Whether the version's run recorded it (`run.state_version`)."""
    if not version.run_id:
        return False
    subject = run_subject(org, ws, version.run_id)
    for envelope in await runs.store.read(subject, min_seq=LATEST):
        event = envelope.event
        if isinstance(event, StateVersionCreated) and event.object == version.object:
            return True
    return False
