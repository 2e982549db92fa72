"""`terraform state push` (and every state write of the CLI's backend: `state rm`,
`state mv`, `import`, `taint`) through the TFE API: `POST /workspaces/:id/state-versions`.

A push is taken only:

- from the holder of the workspace's lock (the CLI locks before it writes; runplane's
  lock also keeps runs from being admitted meanwhile), with no run active and no run
  holding the state lock;
- with the serial and lineage the state itself says and the md5 it was sent with;
- continuing the current state: the same lineage and a higher serial, unless the CLI
  says `force` (`terraform state push -force`), as Terraform's own backends refuse;
- with the head still where it was read (optimistic: another writer wins, this one 409s).

A push is recorded as `ws.state_pushed` (events/workspace.py) before the head moves:
the event is the decision (the workspace aggregate checks, on its own subject and at
the moment of the append, that the pusher holds the lock, that no run is active and
that no other push landed since the head was read, nor the lock was taken again: a push
names the lock it read the head under), and the head follows it. Event
first, because the other order could leave a head moved by nobody on record, which is
what the record is for. Between the two the version is marked pending (as a run's is,
executor/statebackend.py): a crash there leaves an event whose head has not moved, and
the next reader of the state (`state.current_head`, or a run's state backend) promotes
the pending version if, and only if, its event is recorded and names the current head
as the one it replaced. So no head moves without its event, and no event stays without
its head but one whose head was moved meanwhile by a writer outside these rules
(logged as `tfe_state_head_moved`; the event's `previous` shows it). A refused push (a
stale serial, no lock, a lie about the state) writes no event. A push refused only
because the same bytes over the same head were recorded meanwhile through another
replica (the CLI's retry of a try still running elsewhere) is answered 201 as that one;
a push whose head move finds its version already promoted by a reader is done, not a
409; a refused push clears the pending mark only if it is still its own. A push refused
because the lock's last recorded push is not the head it read (that push's head move
failed after a racing push replaced its pending mark, so no read promotes it) puts the
recorded version in place if it replaced that head.

Not yet here: newer clients' upload URLs (`hosted-state-upload-url`): a version without
an inline `state` is refused with a 422 that says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
from collections.abc import AsyncIterator
from datetime import datetime
from pathlib import Path
from typing import Any

import structlog
from aiohttp import web

from events.errors import DomainError, IllegalTransition
from events.workspace import RecordStatePush, StatePushed
from executor.statefile import CHUNK, StateFile, StateRefused, StateTooLarge, too_large
from executor.statestore import Head, HeadMoved, StateStore, StateStoreError
from services.surfaces.api.auth import Principal
from services.surfaces.tfe.context import api_of, tfe_of
from services.surfaces.tfe.jsonapi import TfeError, document, response
from services.surfaces.tfe.state import (
    current_head,
    existing_workspace,
    last_pushed,
    may_read_state,
    recorded_at,
    render,
)
from services.surfaces.tfe.state_body import document_limit, read_state, tfe_refusal
from services.surfaces.tfe.workspaces import workspace_by_id

log = structlog.get_logger("runplane.tfe")


def _check_attributes(attrs: dict[str, Any], state: StateFile) -> tuple[int, str, bool]:
    """The state sent, checked against what the request says of it."""
    md5 = attrs.get("md5")
    if not isinstance(md5, str) or state.md5 != md5:
        raise TfeError(422, "invalid attribute", "md5 does not match the state sent")
    try:
        serial, lineage = state.parse()
    except StateRefused as e:
        raise TfeError(422, "invalid attribute", f"state is not a Terraform state: {e}") from e
    if attrs.get("serial") != serial:
        raise TfeError(422, "invalid attribute", f"serial must be the state's own ({serial})")
    if attrs.get("lineage") not in (None, lineage):
        raise TfeError(422, "invalid attribute", "lineage must be the state's own")
    return serial, lineage, attrs.get("force") is True


def _continues(head: Head | None, serial: int, lineage: str, digest: str, force: bool) -> None:
    """409 unless the new state continues the current one (or `force`)."""
    if head is None or force:
        return
    if lineage != head.lineage:
        raise TfeError(
            409,
            "lineage mismatch",
            f"the state's lineage {lineage!r} is not the workspace's ({head.lineage!r}); "
            "push -force to replace it",
        )
    if serial <= head.serial and digest != head.digest:
        raise TfeError(
            409,
            "serial not newer",
            f"the state's serial {serial} is not above the workspace's ({head.serial})",
        )


class _Gate:
    """One organization's state pushes, one at a time."""

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.users = 0


PUSHES: web.AppKey[dict[str, _Gate]] = web.AppKey("runplane.tfe.pushes", dict)


@contextlib.asynccontextmanager
async def _one_push_at_a_time(request: web.Request, org: str) -> AsyncIterator[None]:
    """A push's body and its state take disk (up to the bounds of state_body.py) and a
    pass of the CPU each: one organization's many concurrent pushes would take them
    from every organization. Another organization's waits for none of them."""
    gates = request.app[PUSHES]
    gate = gates.setdefault(org, _Gate())
    gate.users += 1
    try:
        async with gate.lock:
            yield
    finally:
        gate.users -= 1
        if not gate.users:
            del gates[org]


def _writable(row: dict[str, Any], who: Principal) -> datetime | None:
    """When the caller's lock was taken, as the read model has it (None: not known);
    refused if the caller holds no lock there or a run is active."""
    lock = row.get("lock")
    if lock is None or lock.get("holder") != who.user:
        raise TfeError(409, "workspace not locked", "lock the workspace before writing its state")
    if row.get("active_run"):
        raise TfeError(409, "run active", f"run {row['active_run']} is active on the workspace")
    try:
        return datetime.fromisoformat(str(lock["locked_at"]))
    except (KeyError, ValueError):
        return None


async def create_state_version(request: web.Request) -> web.Response:
    """POST /workspaces/:id/state-versions {serial, md5, lineage, state, force}: the
    lock's holder only, which is checked before the body is read. The body goes to a
    file as it arrives, and the state out of it to another (state_body.py): past the
    deployment's --state-max-mb it is a 413 `state too large`, and nothing is stored."""
    org, ws, who = await workspace_by_id(request, "state.write")
    states = tfe_of(request).need_states()
    _writable(await existing_workspace(request, org, ws), who)
    async with _one_push_at_a_time(request, org):
        folder = Path(tempfile.mkdtemp(prefix="runplane-tfe-state-"))
        try:
            return await _receive(request, org, ws, who, states, folder)
        finally:
            shutil.rmtree(folder, ignore_errors=True)


async def _receive(
    request: web.Request, org: str, ws: str, who: Principal, states: StateStore, folder: Path
) -> web.Response:
    state_max = states.quotas.state_max_bytes
    try:
        document = await StateFile.receive(
            request.content.iter_chunked(CHUNK),
            folder,
            document_limit(state_max),
            announced=request.content_length,
        )
    except StateTooLarge as e:
        raise tfe_refusal(too_large(state_max)) from e
    with document:
        state, attrs = await read_state(document, folder, state_max)
    with state:
        serial, lineage, force = await asyncio.to_thread(_check_attributes, attrs, state)
        return await _push(request, org, ws, who, states, state, (serial, lineage), force)


async def _push(
    request: web.Request,
    org: str,
    ws: str,
    who: Principal,
    states: StateStore,
    state: StateFile,
    parsed: tuple[int, str],
    force: bool,
) -> web.Response:
    serial, lineage = parsed
    lock_since = _writable(await existing_workspace(request, org, ws), who)
    try:
        holder, _ = await states.holder(org, ws)
    except StateStoreError as e:
        raise TfeError(503, "unavailable", str(e)) from e
    if holder is not None:
        raise TfeError(409, "state locked", f"run {holder.run_id} holds the state lock")
    head, revision = await current_head(request, org, ws)
    digest = state.digest
    _continues(head, serial, lineage, digest, force)
    if head is not None and head.digest == digest:
        created = await recorded_at(request, org, ws, head)
        return response(
            document(
                render(request, org, ws, head, created, await may_read_state(request, org, ws))
            ),
            status=201,
        )
    try:
        version = await states.put_state(org, ws, state, parsed, head=head)
        await states.mark_pending(org, ws, version)
    except StateRefused as e:
        raise tfe_refusal(e) from e
    except StateStoreError as e:
        raise TfeError(503, "unavailable", str(e)) from e
    seq = await _record(request, org, ws, who, version, head, revision, force, lock_since)
    if seq is None:  # the same bytes, pushed at once elsewhere, were recorded: ours too
        return await _theirs(request, org, ws, version, who)
    await _move(request, org, ws, version, revision)
    log.info("tfe_state_pushed", org=org, ws=ws, serial=serial, user=who.user, force=force)
    await api_of(request).after_write(seq)
    created = await recorded_at(request, org, ws, version)
    return response(
        document(
            render(request, org, ws, version, created, await may_read_state(request, org, ws))
        ),
        status=201,
    )


def push_command(
    version: Head,
    actor: str,
    previous: str = "",
    forced: bool = False,
    lock_since: datetime | None = None,
) -> RecordStatePush:
    """The `ws.state_pushed` command of a sealed version replacing the head `previous`
    (an object name, "" for none)."""
    return RecordStatePush(
        actor=actor,
        serial=version.serial,
        lineage=version.lineage,
        digest=version.digest,
        object=version.object,
        size=version.size,
        previous=previous,
        forced=forced,
        lock_since=lock_since,
    )


async def _record(
    request: web.Request,
    org: str,
    ws: str,
    who: Principal,
    version: Head,
    head: Head | None,
    revision: int,
    force: bool,
    lock_since: datetime | None,
) -> int | None:
    """`ws.state_pushed`, decided on the workspace's own subject; refused (a lock lost,
    a run admitted, another push landed), nothing is recorded. The sealed version is
    kept: its object is named by serial and content, so it may be an earlier version
    (a rollback) or the head another replica's push of the same state just moved to.
    None: refused because that push, of these bytes over the same head, was recorded."""
    previous = head.object if head is not None else ""
    command = push_command(version, who.user, previous, force, lock_since)
    states = tfe_of(request).need_states()
    try:
        result = await api_of(request).app.record_state_push(org, ws, command)
    except DomainError as e:
        last = await last_pushed(request, org, ws)
        if last is not None and (last.object, last.previous) == (version.object, command.previous):
            return None  # the CLI's retry, sent elsewhere while this try ran, won
        await _clear_if_ours(states, org, ws, version)
        if isinstance(e, IllegalTransition) and e.status == "moved" and last is not None:
            await _finish_recorded(request, org, ws, last, head, revision)
        raise
    # Any other failure leaves it unknown whether the event landed: the pending version
    # stays, and `current_head` promotes it only if its event is recorded.
    return int(result.seq)


async def _clear_if_ours(states: StateStore, org: str, ws: str, version: Head) -> None:
    """Clear the pending mark only if it is still this push's: a racing push that won
    may have marked its own since, which its head move (or the next read) needs."""
    with contextlib.suppress(StateStoreError):
        if await states.pending(org, ws) == version:
            await states.clear_pending(org, ws)


async def _finish_recorded(
    request: web.Request, org: str, ws: str, last: StatePushed, head: Head | None, revision: int
) -> None:
    """Refused because the lock's last recorded push is not the head read: a push whose
    head move failed after a racing push replaced its pending mark, which no read
    promotes then. Put it in place if it replaced `head` (what its event says), so the
    CLI's next try continues from it instead of being refused while the lock is held."""
    if last.previous != (head.object if head is not None else ""):
        return
    recorded = Head(
        object=last.object,
        serial=last.serial,
        lineage=last.lineage,
        digest=last.digest,
        size=last.size,
    )
    try:
        await tfe_of(request).need_states().move_head(org, ws, recorded, revision)
    except StateStoreError:  # moved meanwhile (HeadMoved) or unreachable: the next try
        return
    log.warning("tfe_state_head_recovered", org=org, ws=ws, object=last.object)


async def _theirs(
    request: web.Request, org: str, ws: str, version: Head, who: Principal
) -> web.Response:
    """201 for a push whose bytes another push recorded over the same head: they are on
    record, and the head (promoted by this read if the winner has not moved it yet)
    follows them."""
    await current_head(request, org, ws)
    created = await recorded_at(request, org, ws, version)
    return response(
        document(
            render(request, org, ws, version, created, await may_read_state(request, org, ws))
        ),
        status=201,
    )


async def _move(request: web.Request, org: str, ws: str, version: Head, revision: int) -> None:
    """The head to the recorded version, then the pending mark cleared."""
    states = tfe_of(request).need_states()
    try:
        await states.move_head(org, ws, version, revision)
    except HeadMoved as e:
        if await _is_head(states, org, ws, version):
            return  # a reader (or a push of the same bytes) promoted it first: done
        log.error("tfe_state_head_moved", org=org, ws=ws, object=version.object)
        raise TfeError(409, "state changed", "the workspace's state changed meanwhile") from e
    except StateStoreError as e:
        # recorded but not moved: the next read promotes it (`current_head`)
        raise TfeError(503, "unavailable", str(e)) from e
    await states.clear_pending(org, ws)


async def _is_head(states: StateStore, org: str, ws: str, version: Head) -> bool:
    try:
        head, _ = await states.head(org, ws)
    except StateStoreError as e:
        raise TfeError(503, "unavailable", str(e)) from e
    return head is not None and head.object == version.object
