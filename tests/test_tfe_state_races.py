"""State pushes racing through several api replicas (services/surfaces/tfe/state_push.py): what a
losing push leaves behind. The cluster run of the same (with kill -9) is
tests/reliability/test_cluster_state_push.py."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from nats.aio.client import Client as NATS

from events.workspace import RecordStatePush
from executor.statestore import Head
from services.surfaces.tfe.state_push import push_command
from tests.helpers import eventually
from tests.tfe_support import Tfe, _pushes, _states, _with_state, a_state, replica, tfe_fixture

__all__ = ["tfe_fixture"]


async def test_a_push_recorded_but_never_in_place_is_put_in_place_by_the_next_push(
    tfe: Tfe,
) -> None:
    """A push's event landed, its head move failed, and its pending mark is gone (a
    racing push marked its own over it, then was refused and cleared it): no read can
    promote it, and every push continuing the head it replaced is refused, for as long
    as the lock is held. The first such refusal puts the recorded version in place, so
    the CLI's next try continues from it."""
    tokens, ws_id, _ = await _with_state(tfe, {})
    operator = tokens["operator"]
    states = _states(tfe)
    first = (await _pushes(tfe))[0]
    head, _ = await states.head("acme", "net")
    assert head is not None
    won = a_state(2, lineage=head.lineage, outputs={"by": "winner"})
    version = await states.put_version("acme", "net", json.dumps(won).encode())
    command = push_command(version, "operator-user", first.object)
    await tfe.app.record_state_push("acme", "net", command)  # recorded; no pending mark

    lost = a_state(2, lineage=head.lineage, outputs={"by": "loser"})
    refused = await tfe.push(ws_id, lost, token=operator)
    assert refused.status == 409, refused.body
    current = await tfe.tfe(
        "GET", f"/api/v2/workspaces/{ws_id}/current-state-version", token=operator
    )
    assert current.body["data"]["attributes"]["serial"] == 2
    moved, _ = await states.head("acme", "net")
    assert moved is not None and moved.object == version.object
    nxt = await tfe.push(ws_id, a_state(3, lineage=head.lineage), token=operator)
    assert nxt.status == 201, nxt.body
    pushed = await _pushes(tfe)
    assert [p.object for p in pushed[:2]] == [first.object, version.object]
    assert pushed[-1].previous == version.object and len(pushed) == 3


async def test_the_same_state_pushed_through_two_replicas_at_once_is_kept_once(
    tfe: Tfe, nc: NATS, tmp_path: Path
) -> None:
    """The CLI's retry of a push whose first try still runs, sent by a load balancer to
    the other replica: both read the same head and seal the same object; the first to
    record wins. The other's refusal must not drop the object the winner's event and
    head name (it did before 6355a86: the state then failed to open), and it is
    answered as the winner's, 201 (its bytes are recorded: a 409 made the CLI report a
    push that landed as failed), recorded once."""
    tokens, ws_id, _ = await _with_state(tfe, {})
    operator = tokens["operator"]
    head, _ = await _states(tfe).head("acme", "net")
    assert head is not None
    state = a_state(2, lineage=head.lineage, outputs={"try": "the same bytes"})
    raw = json.dumps(state).encode()
    async with replica(nc, tfe.keyring, tmp_path / "rm-2.sqlite") as other:

        async def locked() -> bool:
            row = await other.api.read.workspaces.get("acme", "net")
            return row is not None and row.get("lock") is not None

        await eventually(locked, timeout=10, what="the other replica to see the lock")
        real = other.app.record_state_push
        first: list[Any] = []

        async def after_the_first_try(org: str, name: str, cmd: RecordStatePush) -> Any:
            # the retry has read the head, sealed and marked its version: now the first
            # try, on the other replica, lands whole
            first.append(await tfe.push(ws_id, state, token=operator))
            return await real(org, name, cmd)

        other.app.record_state_push = after_the_first_try  # type: ignore[method-assign]
        retry = await other.push(ws_id, state, token=operator)
    assert first[0].status == 201, first[0].body
    [_, pushed] = await _pushes(tfe)
    assert pushed.digest == hashlib.sha256(raw).hexdigest() and pushed.previous == head.object
    version = Head(object=pushed.object, serial=2, digest=pushed.digest)
    assert await _states(tfe).read(version) == raw  # still there
    assert retry.status == 201, retry.body
    moved, _ = await _states(tfe).head("acme", "net")
    assert moved is not None and moved.object == pushed.object


async def test_a_push_whose_version_a_reader_promoted_first_is_answered_201(
    tfe: Tfe, nc: NATS, tmp_path: Path
) -> None:
    """Between a push's event and its head move, a read through another replica finds
    the pending version recorded and promotes it: the push's own move then finds the
    head moved, by its own version. That is done (it answered 409: a refusal with its
    event recorded and its version in place)."""
    tokens, ws_id, _ = await _with_state(tfe, {})
    operator = tokens["operator"]
    head, _ = await _states(tfe).head("acme", "net")
    assert head is not None
    state = a_state(2, lineage=head.lineage)
    async with replica(nc, tfe.keyring, tmp_path / "rm-2.sqlite") as other:
        real = tfe.app.record_state_push
        read: list[Any] = []

        async def then_a_reader(org: str, name: str, cmd: RecordStatePush) -> Any:
            result = await real(org, name, cmd)
            path = f"/api/v2/workspaces/{ws_id}/current-state-version"
            read.append(await other.tfe("GET", path, token=operator))
            return result

        tfe.app.record_state_push = then_a_reader  # type: ignore[method-assign]
        pushed = await tfe.push(ws_id, state, token=operator)
    assert read[0].status == 200 and read[0].body["data"]["attributes"]["serial"] == 2
    assert pushed.status == 201, pushed.body
    moved, _ = await _states(tfe).head("acme", "net")
    assert moved is not None and moved.serial == 2 and len(await _pushes(tfe)) == 2
