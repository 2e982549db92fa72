"""State through the TFE API: who may read the whole state, and every CLI push recorded.

- a viewer reads a version's metadata and the outputs (their detailed types; a
  sensitive value null), never the whole state: `current-state-version` answers it 403
  and no download URL is minted for it; an operator reads all, sensitive values too;
- a push is recorded as `ws.state_pushed` (user, serial, lineage, digest, size, the
  version it replaced, `-force`) before the head moves; a refused push records nothing;
  a crash between the event and the head move is repaired by the next read, and a
  version whose event never landed is never promoted;
- the workspace aggregate takes a push only from the lock's holder, with no run active,
  continuing the last push of the lock (given / when / then).
"""

from __future__ import annotations

import hashlib
import json
from datetime import timedelta

import msgspec
from yarl import URL

from events import workspace as ws_agg
from events.errors import IllegalTransition, NotFound
from events.run import Workspace
from events.workspace import (
    RecordStatePush,
    RunAdmitted,
    RunEnqueued,
    StatePushed,
    WorkspaceCreated,
    WorkspaceLocked,
    WorkspaceUnlocked,
)
from services.surfaces.tfe.state_push import push_command
from tests.gwt import NOW, Aggregate, given
from tests.tfe_support import Tfe, _pushes, _states, _with_state, a_state, tfe_fixture
from tests.ui.support import Browser

__all__ = ["tfe_fixture"]

WS = Aggregate(initial=ws_agg.INITIAL, decide=ws_agg.decide, evolve=ws_agg.evolve)
EARLIER = NOW - timedelta(hours=1)
CREATED = WorkspaceCreated(
    at=EARLIER, actor="admin", org="acme", name="net", config=Workspace(repository="r")
)
LOCKED = WorkspaceLocked(at=EARLIER, actor="alice", reason="Locked by Terraform")


def _push(previous: str = "", obj: str = "acme/net/2-aa", actor: str = "alice") -> RecordStatePush:
    return RecordStatePush(
        actor=actor,
        serial=2,
        lineage="l",
        digest="aa" * 32,
        object=obj,
        size=10,
        previous=previous,
    )


def _pushed(previous: str = "", obj: str = "acme/net/2-aa") -> StatePushed:
    return StatePushed(
        at=NOW,
        actor="alice",
        serial=2,
        lineage="l",
        digest="aa" * 32,
        object=obj,
        size=10,
        previous=previous,
    )


# ---------------------------------------------------------------- the core


def test_the_locks_holder_records_a_push_with_what_it_replaced() -> None:
    state = given(WS, CREATED, LOCKED).when(_push("acme/net/1-00")).then(_pushed("acme/net/1-00"))
    assert state.pushed == "acme/net/2-aa"


def test_a_push_without_the_lock_or_under_anothers_lock_is_refused() -> None:
    unlocked = given(WS, CREATED).when(_push()).then_error(IllegalTransition)
    assert "lock the workspace" in str(unlocked) and unlocked.status == "unlocked"
    other = given(WS, CREATED, LOCKED).when(_push(actor="bob")).then_error(IllegalTransition)
    assert other.status == "locked"
    given(WS).when(_push()).then_error(NotFound)


def test_a_push_while_a_run_is_active_is_refused() -> None:
    history = [
        CREATED,
        RunEnqueued(at=EARLIER, actor="a", run_id="r1"),
        RunAdmitted(at=EARLIER, actor="s", run_id="r1"),
        LOCKED,
    ]
    error = given(WS, *history).when(_push()).then_error(IllegalTransition)
    assert "r1" in str(error) and error.status == "busy"


def test_a_second_push_must_continue_the_first_of_the_same_lock() -> None:
    """Two pushes decided on one head (two api replicas) cannot both be recorded: the
    second names a version that is no longer the one in place."""
    first = _pushed("acme/net/1-00")
    error = (
        given(WS, CREATED, LOCKED, first)
        .when(_push("acme/net/1-00", obj="acme/net/2-bb"))
        .then_error(IllegalTransition)
    )
    assert error.status == "moved"
    given(WS, CREATED, LOCKED, first).when(_push("acme/net/2-aa", obj="acme/net/3-cc")).then(
        _pushed("acme/net/2-aa", obj="acme/net/3-cc")
    )


def test_a_new_lock_starts_from_whatever_head_runs_left() -> None:
    unlocked = WorkspaceUnlocked(at=EARLIER, actor="alice", holder="alice")
    state = WS.fold([CREATED, LOCKED, _pushed(), unlocked, LOCKED])
    assert state.pushed == ""
    given(WS, CREATED, LOCKED, _pushed(), unlocked, LOCKED).when(_push("acme/net/9-ff")).then(
        _pushed("acme/net/9-ff")
    )


def test_a_push_decided_under_an_earlier_lock_is_refused() -> None:
    """A push that read the head under one lock and reaches the record after an unlock,
    a run and a new lock of the same holder: its `previous` is from before that run,
    so it is refused (`relocked`), not recorded as replacing a head it never saw."""
    unlocked = WorkspaceUnlocked(at=EARLIER, actor="alice", holder="alice")
    again = WorkspaceLocked(at=NOW, actor="alice", reason="Locked by Terraform")
    history = [CREATED, LOCKED, unlocked, again]
    stale = msgspec.structs.replace(_push("acme/net/1-00"), lock_since=LOCKED.at)
    error = given(WS, *history).when(stale).then_error(IllegalTransition)
    assert error.status == "relocked" and "locked again" in str(error)
    fresh = msgspec.structs.replace(stale, lock_since=again.at)
    given(WS, *history).when(fresh).then(_pushed("acme/net/1-00"))


# ---------------------------------------------------------------- reading


SECRET = {"value": "hunter2", "type": "string", "sensitive": True}
OUTPUTS = {
    "plain": {"value": "shown", "type": "string"},
    "listed": {"value": ["a", "b"], "type": ["list", "string"]},
    "secret": SECRET,
}


async def test_a_viewer_never_gets_the_whole_state_but_reads_metadata_and_outputs(
    tfe: Tfe,
) -> None:
    tokens, ws_id, sv = await _with_state(tfe, OUTPUTS)
    viewer, operator = tokens["viewer"], tokens["operator"]
    # an operator's current version carries the URL, which opens the whole state
    mine = await tfe.tfe("GET", f"/api/v2/workspaces/{ws_id}/current-state-version", token=operator)
    url = mine.body["data"]["attributes"]["hosted-state-download-url"]
    status, raw = await tfe.raw(URL(url).path)
    assert status == 200 and b"hunter2" in raw
    # a viewer's: 403 in JSON:API, saying what it may read instead
    got = await tfe.tfe("GET", f"/api/v2/workspaces/{ws_id}/current-state-version", token=viewer)
    assert got.status == 403, got.body
    detail = got.body["errors"][0]["detail"]
    assert "operator" in detail and "outputs" in detail and "hunter2" not in json.dumps(got.body)
    # the workspace says so in go-tfe's permissions
    shown = await tfe.tfe("GET", f"/api/v2/workspaces/{ws_id}", token=viewer)
    assert shown.body["data"]["attributes"]["permissions"]["can-read-state-versions"] is False
    # the version's metadata, without a download URL
    read = await tfe.tfe("GET", f"/api/v2/state-versions/{sv['id']}", token=viewer)
    assert read.status == 200 and read.body["data"]["attributes"]["serial"] == 1
    assert read.body["data"]["attributes"]["hosted-state-download-url"] is None
    # the outputs with their types; the sensitive one's value in no list
    listed = await tfe.tfe(
        "GET", f"/api/v2/workspaces/{ws_id}/current-state-version-outputs", token=viewer
    )
    assert listed.status == 200 and "hunter2" not in json.dumps(listed.body)
    outs = {o["attributes"]["name"]: o for o in listed.body["data"]}
    assert outs["plain"]["attributes"]["value"] == "shown"
    assert outs["listed"]["attributes"]["detailed-type"] == ["list", "string"]
    assert outs["listed"]["attributes"]["type"] == "array"
    assert outs["secret"]["attributes"]["sensitive"] is True
    # one sensitive output: its value only to those who may read state
    path = f"/api/v2/state-version-outputs/{outs['secret']['id']}"
    as_viewer = await tfe.tfe("GET", path, token=viewer)
    assert as_viewer.status == 200 and as_viewer.body["data"]["attributes"]["value"] is None
    assert "hunter2" not in json.dumps(as_viewer.body)
    as_operator = await tfe.tfe("GET", path, token=operator)
    assert as_operator.body["data"]["attributes"]["value"] == "hunter2"


async def test_output_ids_are_scoped_to_their_organization_and_parsed_strictly(tfe: Tfe) -> None:
    tokens, ws_id, _ = await _with_state(tfe, OUTPUTS)
    b_tokens = await tfe.org("beta")
    listed = await tfe.tfe(
        "GET", f"/api/v2/workspaces/{ws_id}/current-state-version-outputs", token=tokens["admin"]
    )
    secret_id = next(o["id"] for o in listed.body["data"] if o["attributes"]["name"] == "secret")
    own = await tfe.tfe("GET", f"/api/v2/state-version-outputs/{secret_id}", token=tokens["admin"])
    assert own.status == 200 and own.body["data"]["attributes"]["value"] == "hunter2"
    theirs = await tfe.tfe(
        "GET", f"/api/v2/state-version-outputs/{secret_id}", token=b_tokens["admin"]
    )
    assert theirs.status == 404 and "hunter2" not in json.dumps(theirs.body)
    for bad in (
        secret_id.rsplit(".", 1)[0] + ".missing",  # no such output
        secret_id.replace("wsout-", "sv-"),
        secret_id + ".x.y",
        secret_id.rsplit(".", 1)[0] + ".has%20space",
        "wsout-",
        "wsout-acme.net.1.0000000000000000.plain",  # no such version
    ):
        got = await tfe.tfe("GET", f"/api/v2/state-version-outputs/{bad}", token=tokens["admin"])
        assert got.status == 404, (bad, got.body)


async def test_a_viewer_gets_no_download_url_minted_on_any_route(tfe: Tfe) -> None:
    """Neither the current version nor one read by id hands a viewer a capability."""
    tokens, ws_id, sv = await _with_state(tfe, {"x": {"value": "y", "type": "string"}})
    for path in (
        f"/api/v2/workspaces/{ws_id}/current-state-version",
        f"/api/v2/state-versions/{sv['id']}",
    ):
        got = await tfe.tfe("GET", path, token=tokens["viewer"])
        assert "/capabilities/state/" not in json.dumps(got.body), path


# ---------------------------------------------------------------- pushes recorded


async def test_a_push_is_recorded_with_its_user_serial_digest_and_force(tfe: Tfe) -> None:
    tokens, ws_id, _ = await _with_state(tfe, {"x": {"value": "1", "type": "string"}})
    [first] = await _pushes(tfe)
    assert (first.actor, first.serial, first.previous, first.forced) == (
        "operator-user",
        1,
        "",
        False,
    )
    assert first.cause == "cli" and first.object.startswith("acme/net/1-")
    forced_state = a_state(1)  # another lineage, the same serial: only with -force
    raw = json.dumps(forced_state).encode()
    again = await tfe.push(ws_id, forced_state, token=tokens["operator"], force=True)
    assert again.status == 201, again.body
    second = (await _pushes(tfe))[-1]
    assert second.forced and second.previous == first.object
    assert second.digest == hashlib.sha256(raw).hexdigest() and second.size == len(raw)
    assert second.lineage == forced_state["lineage"]
    # runplane's own list of versions shows both, newest first, with who pushed them
    listed = (await tfe.get("/api/v1/orgs/acme/workspaces/net/state-versions")).body["items"]
    assert [(v["pushed_by"], v["forced"], v["run_id"]) for v in listed] == [
        ("operator-user", True, None),
        ("operator-user", False, None),
    ]
    # and so does the workspace's page in the web UI
    browser = Browser(tfe.client.server)
    try:
        await browser.signin(tokens["viewer"])
        page = await browser.get("/orgs/acme/workspaces/net")
        assert page.status == 200 and "pushed by operator-user (CLI, -force)" in page.text
    finally:
        await browser.close()
    # the version's time is its event's
    current = await tfe.tfe(
        "GET", f"/api/v2/workspaces/{ws_id}/current-state-version", token=tokens["operator"]
    )
    at = second.at.strftime("%Y-%m-%dT%H:%M:%SZ")
    assert current.body["data"]["attributes"]["created-at"] == at


async def test_a_refused_push_records_nothing_and_moves_nothing(tfe: Tfe) -> None:
    tokens, ws_id, _ = await _with_state(tfe, {})
    operator = tokens["operator"]
    before = await _pushes(tfe)
    assert len(before) == 1
    stale = await tfe.push(ws_id, a_state(1), token=operator)  # another lineage, no force
    assert stale.status == 409
    lied = await tfe.push(ws_id, a_state(2), token=operator, md5="0" * 32)
    assert lied.status == 422
    admin = await tfe.push(ws_id, a_state(3), token=tokens["admin"], force=True)  # not holder
    assert admin.status == 409 and "lock" in admin.body["errors"][0]["detail"]
    unlocked = await tfe.tfe("POST", f"/api/v2/workspaces/{ws_id}/actions/unlock", token=operator)
    assert unlocked.status == 200
    no_lock = await tfe.push(ws_id, a_state(4), token=operator, force=True)
    assert no_lock.status == 409
    assert await _pushes(tfe) == before
    head, _ = await _states(tfe).head("acme", "net")
    assert head is not None and head.object == before[0].object


async def test_a_crash_between_the_event_and_the_head_is_repaired_by_the_next_read(
    tfe: Tfe,
) -> None:
    """The push's event landed, its head move did not (the api died between them): the
    next read promotes the pending version its event names. A pending version whose
    event never landed (died before the append) is never promoted."""
    tokens, ws_id, _ = await _with_state(tfe, {})
    states = _states(tfe)
    first = (await _pushes(tfe))[0]
    head, _ = await states.head("acme", "net")
    assert head is not None

    # died before the event: a sealed version marked pending, nothing recorded
    orphan_state = a_state(2, lineage=head.lineage)
    orphan = await states.put_version("acme", "net", json.dumps(orphan_state).encode())
    await states.mark_pending("acme", "net", orphan)
    got = await tfe.tfe(
        "GET", f"/api/v2/workspaces/{ws_id}/current-state-version", token=tokens["operator"]
    )
    assert got.body["data"]["attributes"]["serial"] == 1  # not promoted

    # died after the event: the same steps as the handler's, but the head move
    version = await states.put_version(
        "acme", "net", json.dumps(a_state(3, lineage=head.lineage)).encode()
    )
    await states.mark_pending("acme", "net", version)
    command = push_command(version, "operator-user", first.object)
    await tfe.app.record_state_push("acme", "net", command)
    got = await tfe.tfe(
        "GET", f"/api/v2/workspaces/{ws_id}/current-state-version", token=tokens["operator"]
    )
    assert got.body["data"]["attributes"]["serial"] == 3
    moved, _ = await states.head("acme", "net")
    assert moved is not None and moved.object == version.object
    assert await states.pending("acme", "net") is None
    # and the CLI's next push continues from it
    nxt = await tfe.push(ws_id, a_state(4, lineage=head.lineage), token=tokens["operator"])
    assert nxt.status == 201, nxt.body
    assert (await _pushes(tfe))[-1].previous == version.object
