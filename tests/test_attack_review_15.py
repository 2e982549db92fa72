"""Attack review of issue 15's finish (d1f426f..18fde7a): TFE state reads and pushes,
`terraform login`'s pasted token, Ctrl-C. Real nats-server, real API; a crash "at a
line" is played by doing the steps the handler does up to that line and no more.

Findings (each test here fails without its fix):

- a run's state version recorded (`run.state_version`) whose head move its executor's
  death cut short was never promoted by the TFE API's reader, only by a run's state
  backend: `terraform state pull` served the state before it, and the next CLI push
  continued from that one and replaced it, losing what the run applied;
- the promotion of a pushed pending version looked at the first `ws.state_pushed`
  naming its object: after a rollback (`state push -force` of an earlier version, so
  the same object name again) a version whose push was never recorded was promoted on
  an older push's event, and a recorded re-push was never promoted;
- a push refused at its record dropped "its" sealed version, which is any version of
  the same serial and content: rolling back to an earlier version and being refused
  (the lock taken over meanwhile) deleted that earlier version, and two replicas
  pushing the same state at once deleted the head's own object;
- a token made at /app/settings/tokens (and by login.v1's exchange) never expired, even
  when the session's own token does: an expiring token bought a permanent one;
- the outputs endpoints (a viewer's) `json.loads` the whole state: one organization's
  operator pushes a state of millions of empty resources and every outputs read builds
  them all, memory and the event loop every organization shares;
- after a purge the head's key holds a purge marker, but a head read gave revision 0:
  a workspace created again under the name had every head move refused (its first CLI
  push 409'd after its event was recorded; a run's applied state likewise);
- a purge left the state's pending mark: a push (or a run's write) cut short before
  its head move, then delete and purge, and the workspace created again promoted the
  old one's state on its first read (and, with the revision above, retried forever).

Older than this round, seen here and fixed after it: the executor's state backend
dropped "its" version when a fenced write was refused (executor/statebackend.py
`_record`), the same object-name collision as the push's. Seen, not fixed: a login.v1 or
tokens-page token outlives the revocation of the session's token (it has no parent to be
revoked with).

Checked, not findings:

- cross-organization: output ids, state-version ids, force-cancel and the push all
  check the id's organization against the caller's (404); the tokens page makes a token
  only for the session's organization, user and role, with its CSRF token and Origin
  checked, no-store, frame-ancestors 'none', Referrer-Policy same-origin, no redirect
  (the token is in the POST's answer only, never in a URL), the admin token refused;
- a viewer: `current-state-version` 403, no download URL on any route, sensitive
  output values null; its cancel and force-cancel 403;
- login codes: `create`-like `update(last=0)` on the stream leader takes each code
  once across replicas; a publish that timed out answers 503 and a retry "used"
  (fails closed); marks outlive the code (120 s against 60 s);
- two pushes decided on one head inside one lock: the aggregate's `pushed` refuses the
  second. Left: a push decided in one lock and recorded in the next lock of the same
  user is taken with a stale `previous` (its head move then 409s and nothing moves);
- held log reads: end when the client goes (checked each STATUS_EVERY_S) and after
  HOLD_S anyway; force-cancel records nothing more than the first cancel.
"""

from __future__ import annotations

import asyncio
import json
import re
import tracemalloc
from typing import Any

from aiohttp.test_utils import TestClient, TestServer

from events import run as R
from events.codec import ws_subject
from events.workspace import StatePushed
from executor.statebackend import StateBackend
from executor.statestore import StateStore
from infra.eventstore import LATEST
from infra.ids import new_id
from services.app.commands import App
from services.surfaces.api.context import API
from services.surfaces.tfe.context import TFE
from services.surfaces.tfe.state_push import push_command
from tests.api_support import web_app_of
from tests.tfe_login_support import _code, _exchange, _pkce, _signin
from tests.tfe_support import Tfe, a_state, tfe_fixture

__all__ = ["tfe_fixture"]

HTML = {"Accept": "text/html"}


def _states(tfe: Tfe) -> StateStore:
    states = tfe.client.app[TFE].states
    assert states is not None
    return states


async def _pushes(tfe: Tfe) -> list[StatePushed]:
    envelopes = await tfe.app.store.read(ws_subject("acme", "net"), min_seq=LATEST)
    return [e.event for e in envelopes if isinstance(e.event, StatePushed)]


async def _locked_workspace(tfe: Tfe) -> tuple[dict[str, str], str]:
    tokens = await tfe.org("acme")
    ws_id = await tfe.cli_workspace("acme", "net", token=tokens["admin"])
    assert (await tfe.lock(ws_id, token=tokens["operator"])).status == 200
    return tokens, ws_id


async def _current(tfe: Tfe, ws_id: str, token: str) -> dict[str, Any]:
    got = await tfe.tfe("GET", f"/api/v2/workspaces/{ws_id}/current-state-version", token=token)
    assert got.status == 200, got.body
    return dict(got.body["data"]["attributes"])


# ---------------------------------------------------------------- a run's version lost


async def test_a_runs_recorded_version_cut_short_is_what_the_cli_reads_and_continues(
    tfe: Tfe,
) -> None:
    """The executor recorded the run's version, then died before moving the head: the
    CLI's `state pull` gets that version, and a push continuing the older one is a 409
    (not a silent replacement of what the run applied)."""
    tokens = await tfe.org("acme")
    operator = tokens["operator"]
    ws_id = await tfe.cli_workspace("acme", "net", token=tokens["admin"])
    assert (await tfe.lock(ws_id, token=operator)).status == 200
    first = a_state(1)
    assert (await tfe.push(ws_id, first, token=operator)).status == 201
    unlocked = await tfe.tfe("POST", f"/api/v2/workspaces/{ws_id}/actions/unlock", token=operator)
    assert unlocked.status == 200

    # a run applies and its executor writes serial 2: sealed, pending, recorded on the
    # run; the executor dies before the head move, and the reaper fails the run
    states = _states(tfe)
    run_id = str((await tfe.app.create_run("acme", "net", "apply", "alice")).state.run_id)
    assert await tfe.app.admit_next("acme", "net") == run_id
    lease = new_id()
    claim = R.ClaimPhase(actor="executor:t", phase="plan", lease_id=lease, executor_id="t")
    await tfe.app.run_command("acme", "net", run_id, claim)
    applied = a_state(2, lineage=first["lineage"], outputs={"made": "by the run"})
    version = await states.put_version("acme", "net", json.dumps(applied).encode(), run_id)
    await states.mark_pending("acme", "net", version)
    record = R.RecordStateVersion(
        actor="executor:t",
        lease_id=lease,
        serial=version.serial,
        lineage=version.lineage,
        digest=version.digest,
        object=version.object,
        size=version.size,
    )
    await tfe.app.run_command("acme", "net", run_id, record)
    await tfe.app.run_command("acme", "net", run_id, R.FailRun(actor="reaper", reason="dead"))

    # alice's CLI: lock, state pull, then a push continuing what it pulled
    assert (await tfe.lock(ws_id, token=operator)).status == 200
    current = await _current(tfe, ws_id, operator)
    assert current["serial"] == 2  # the run's version, not the one before it
    head, _ = await states.head("acme", "net")
    assert head is not None and head.object == version.object
    stale = await tfe.push(ws_id, a_state(2, lineage=first["lineage"]), token=operator)
    assert stale.status == 409, stale.body  # serial 2 again, other content: not newer
    kept, _ = await states.head("acme", "net")
    assert kept is not None and kept.object == version.object


# ---------------------------------------------------------------- promotion


async def test_after_a_rollback_an_unrecorded_push_is_not_promoted_on_an_older_event(
    tfe: Tfe,
) -> None:
    """1 -> 2, then 2 rolled back to 1 (`push -force`): a push of 2's very state again
    that died before its event must not be promoted on the first push's event (which
    replaced 1 by 2 too)."""
    tokens, ws_id = await _locked_workspace(tfe)
    operator = tokens["operator"]
    one = a_state(1)
    two = a_state(2, lineage=one["lineage"])
    assert (await tfe.push(ws_id, one, token=operator)).status == 201
    assert (await tfe.push(ws_id, two, token=operator)).status == 201
    back = await tfe.push(ws_id, one, token=operator, force=True)
    assert back.status == 201, back.body
    assert (await _current(tfe, ws_id, operator))["serial"] == 1

    # died before its event: sealed and pending, nothing recorded
    states = _states(tfe)
    orphan = await states.put_version("acme", "net", json.dumps(two).encode())
    await states.mark_pending("acme", "net", orphan)
    assert len(await _pushes(tfe)) == 3
    assert (await _current(tfe, ws_id, operator))["serial"] == 1  # not promoted
    head, _ = await states.head("acme", "net")
    assert head is not None and head.serial == 1


async def test_a_recorded_rollback_cut_short_is_promoted(tfe: Tfe) -> None:
    """1 -> 2, then the rollback to 1 (`push -force` of 1's very state: 1's object name
    again) recorded, its head move cut short: the next read promotes it, though the
    first event naming that object replaced no state at all."""
    tokens, ws_id = await _locked_workspace(tfe)
    operator = tokens["operator"]
    one = a_state(1)
    two = a_state(2, lineage=one["lineage"])
    assert (await tfe.push(ws_id, one, token=operator)).status == 201
    assert (await tfe.push(ws_id, two, token=operator)).status == 201
    states = _states(tfe)
    head, _ = await states.head("acme", "net")
    assert head is not None and head.serial == 2
    version = await states.put_version("acme", "net", json.dumps(one).encode())
    await states.mark_pending("acme", "net", version)
    command = push_command(version, "operator-user", head.object, forced=True)
    await tfe.app.record_state_push("acme", "net", command)
    assert (await _current(tfe, ws_id, operator))["serial"] == 1
    moved, _ = await states.head("acme", "net")
    assert moved is not None and moved.object == version.object
    # and the lock's next push continues from it (the aggregate says 1 is in place)
    nxt = await tfe.push(ws_id, a_state(3, lineage=one["lineage"]), token=operator)
    assert nxt.status == 201, nxt.body


# ---------------------------------------------------------------- a refused push


async def _second_replica(tfe: Tfe) -> Tfe:
    """Another api replica: its own web app (and push gate) on the same NATS and key."""
    web_app = web_app_of(tfe.system, tfe.api.projector)
    client = TestClient(TestServer(web_app))
    await client.start_server()
    other = Tfe(client, web_app[API], tfe.app)
    other.keyring, other.system = tfe.keyring, tfe.system
    return other


async def test_two_replicas_pushing_one_state_at_once_keep_the_heads_object(tfe: Tfe) -> None:
    """Both read head 1 and seal the same state 2 (the same object); one records, the
    other is refused (`moved`) and must not delete what is now the head's object (it
    is answered as the winner's, 201: its bytes are recorded over the head it read)."""
    tokens, ws_id = await _locked_workspace(tfe)
    operator = tokens["operator"]
    one = a_state(1)
    two = a_state(2, lineage=one["lineage"])
    assert (await tfe.push(ws_id, one, token=operator)).status == 201
    other = await _second_replica(tfe)
    try:
        states = _states(other)
        put = states.put_state
        won: list[int] = []

        async def put_then_the_other_replica_pushes(*args: Any, **kw: Any) -> Any:
            version = await put(*args, **kw)
            won.append((await tfe.push(ws_id, two, token=operator)).status)
            return version

        states.put_state = put_then_the_other_replica_pushes  # type: ignore[method-assign]
        lost = await other.push(ws_id, two, token=operator)
        assert won == [201] and lost.status == 201, lost.body
    finally:
        await other.client.close()
    head, _ = await _states(tfe).head("acme", "net")
    assert head is not None and head.serial == 2
    assert json.loads(await _states(tfe).read(head)) == two  # still there
    assert (await _current(tfe, ws_id, operator))["serial"] == 2


async def test_a_refused_rollback_keeps_the_version_it_rolls_back_to(tfe: Tfe) -> None:
    """1 -> 2, then `push -force` of 1's state, refused at its record (an admin took the
    lock meanwhile): version 1 (the same object) stays readable."""
    tokens, ws_id = await _locked_workspace(tfe)
    operator = tokens["operator"]
    one = a_state(1)
    assert (await tfe.push(ws_id, one, token=operator)).status == 201
    first, _ = await _states(tfe).head("acme", "net")
    assert (await tfe.push(ws_id, a_state(2, lineage=one["lineage"]), token=operator)).status == 201
    states = _states(tfe)
    put = states.put_state

    async def put_then_unlocked(*args: Any, **kw: Any) -> Any:
        version = await put(*args, **kw)
        await tfe.app.unlock_workspace("acme", "net", "admin-user", admin=True)
        return version

    states.put_state = put_then_unlocked  # type: ignore[method-assign]
    refused = await tfe.push(ws_id, one, token=operator, force=True)
    states.put_state = put  # type: ignore[method-assign]
    assert refused.status == 409, refused.body
    assert first is not None
    assert json.loads(await states.read(first)) == one  # version 1 still opens
    head, _ = await states.head("acme", "net")
    assert head is not None and head.serial == 2


class _RefusedPhase:
    """A run's phase whose reports the real App refuses (its run is gone: any refusal of
    a state version's record takes the same path as a fenced lease's)."""

    def __init__(self, app: App) -> None:
        self.app, self.org, self.ws = app, "acme", "net"
        self.run_id, self.lease_id, self.executor_id = "r-gone", "lease-lost", "exec-old"

    @property
    def actor(self) -> str:
        return f"executor:{self.executor_id}"

    async def report(self, command: R.RunCommand) -> None:
        await self.app.run_command(self.org, self.ws, self.run_id, command)


async def test_a_runs_refused_state_write_keeps_an_object_the_head_names(tfe: Tfe) -> None:
    """A run's state write of the very bytes that are the head already (the same serial,
    lineage and content: the object's name), refused at its record, must leave the
    head's object in place (the executor dropped it: the head then named nothing)."""
    tokens, ws_id = await _locked_workspace(tfe)
    one = a_state(1)
    assert (await tfe.push(ws_id, one, token=tokens["operator"])).status == 201
    states = _states(tfe)
    head, _ = await states.head("acme", "net")
    assert head is not None
    phase = _RefusedPhase(tfe.app)
    backend = StateBackend(phase, states, runs=phase.app, report=phase.report)
    answer = await backend._record(head)
    assert answer.status == 409
    assert json.loads(await states.read(head)) == one  # the head's object still opens
    assert (await states.head("acme", "net"))[0] == head
    assert await states.pending("acme", "net") is None


# ---------------------------------------------------------------- tokens made by a session


async def test_a_token_made_by_an_expiring_sessions_token_expires_with_it(tfe: Tfe) -> None:
    """A contractor's operator token expires in an hour: the tokens page (and login.v1)
    must not trade it for one that never expires."""
    await tfe.org("acme")
    made = await tfe.post(
        "/api/v1/orgs/acme/tokens", json={"user": "carol", "role": "operator", "expires_in": 3600}
    )
    assert made.status == 201, made.body
    expiring = made.body["token"]
    await _signin(tfe, expiring)
    async with tfe.client.get("/app/settings/tokens", headers=HTML) as r:
        page = await r.text()
    csrf = re.search(r'name="csrf" value="([^"]+)"', page)
    assert csrf, page
    async with tfe.client.post(
        "/app/settings/tokens", data={"csrf": csrf.group(1)}, headers=HTML
    ) as r:
        assert r.status == 200
        issued = re.search(r'<code id="new-token">([^<]+)</code>', await r.text())
    assert issued
    listed = (await tfe.get("/api/v1/orgs/acme/tokens")).body["items"]
    expiries = {t["expires_at"] for t in listed if t["user"] == "carol"}
    assert None not in expiries and len(expiries) == 1, listed  # the same end as its own

    # login.v1's exchange, from the same session
    verifier, challenge = _pkce()
    code = await _code(tfe, challenge)
    status, answer = await _exchange(tfe, code, verifier)
    assert status == 200, answer
    listed = (await tfe.get("/api/v1/orgs/acme/tokens")).body["items"]
    each_expiry = [t["expires_at"] for t in listed if t["user"] == "carol"]
    assert len(each_expiry) == 3 and None not in each_expiry and len(set(each_expiry)) == 1, listed


# ---------------------------------------------------------------- outputs of a big state


async def test_reading_outputs_builds_nothing_of_the_rest_of_the_state(tfe: Tfe) -> None:
    """An operator of one organization pushes a state of 2 million empty resources (6
    MiB); every viewer's outputs read then built all of them (`json.loads`: 24 bytes of
    state made 150 MB of objects, 2.7 s with the event loop every organization shares
    held, for a 64 MiB state 1.5 GB). Only the outputs are decoded now: 146 MiB traced
    before, 22 MiB (the state's bytes) after."""
    tokens, ws_id = await _locked_workspace(tfe)
    big = a_state(1, outputs={"shown": "yes"})
    big["resources"] = [{}] * 2_000_000
    assert (await tfe.push(ws_id, big, token=tokens["operator"])).status == 201
    del big
    path = f"/api/v2/workspaces/{ws_id}/current-state-version-outputs"
    tracemalloc.start()
    try:
        listed = await tfe.tfe("GET", path, token=tokens["viewer"])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert listed.status == 200, listed.body
    assert [o["attributes"]["value"] for o in listed.body["data"]] == ["yes"]
    assert peak < 60 * 2**20, f"{peak >> 20} MiB to read one output"


# ---------------------------------------------------------------- purge


async def test_a_workspace_created_again_after_a_purge_inherits_no_pending_state(
    tfe: Tfe,
) -> None:
    """The old workspace's push was recorded and its head move cut short (pending);
    the admin deletes and purges it, which removes its head and lock: a workspace
    created again under the name must start from no state, not promote the old one's
    pending version (its event is still on the workspace's subject)."""
    tokens, ws_id = await _locked_workspace(tfe)
    operator = tokens["operator"]
    states = _states(tfe)
    old = a_state(1, outputs={"owner": "the old team"})
    version = await states.put_version("acme", "net", json.dumps(old).encode())
    await states.mark_pending("acme", "net", version)
    command = push_command(version, "operator-user")
    await tfe.app.record_state_push("acme", "net", command)
    unlocked = await tfe.tfe("POST", f"/api/v2/workspaces/{ws_id}/actions/unlock", token=operator)
    assert unlocked.status == 200
    assert (await tfe.call("DELETE", "/api/v1/orgs/acme/workspaces/net")).status == 204
    assert (await tfe.post("/api/v1/orgs/acme/workspaces/net/purge")).status == 204

    again = await tfe.cli_workspace("acme", "net", token=tokens["admin"])
    path = f"/api/v2/workspaces/{again}/current-state-version"
    got = await asyncio.wait_for(tfe.tfe("GET", path, token=tokens["admin"]), 20)
    assert got.status == 404, got.body  # no state: the old team's is not inherited
    assert await states.pending("acme", "net") is None
    head, _ = await states.head("acme", "net")
    assert head is None


async def test_a_workspace_created_again_after_a_purge_takes_a_push(tfe: Tfe) -> None:
    """The purge leaves a purge marker on the head's key: the new workspace's first head
    move must expect that revision, not none (else every state write of it is refused,
    a run's applied state as much as a push, and the push's event lies)."""
    tokens, ws_id = await _locked_workspace(tfe)
    operator = tokens["operator"]
    assert (await tfe.push(ws_id, a_state(1), token=operator)).status == 201
    unlocked = await tfe.tfe("POST", f"/api/v2/workspaces/{ws_id}/actions/unlock", token=operator)
    assert unlocked.status == 200
    assert (await tfe.call("DELETE", "/api/v1/orgs/acme/workspaces/net")).status == 204
    assert (await tfe.post("/api/v1/orgs/acme/workspaces/net/purge")).status == 204

    again = await tfe.cli_workspace("acme", "net", token=tokens["admin"])
    assert (await tfe.lock(again, token=operator)).status == 200
    fresh = a_state(1, outputs={"owner": "the new team"})
    pushed = await tfe.push(again, fresh, token=operator)
    assert pushed.status == 201, pushed.body
    head, _ = await _states(tfe).head("acme", "net")
    assert head is not None and json.loads(await _states(tfe).read(head)) == fresh
