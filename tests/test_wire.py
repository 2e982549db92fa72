"""The wire contracts (events/wire.py) across a rolling upgrade: the literal bytes the
previous version put on the wire decode with the new Structs, and what the new writers
send decodes with the previous version's readers (their types and code, copied here as
they were), so old and new schedulers, executors and secrets responders mix."""

from __future__ import annotations

import base64
import json
from datetime import UTC, datetime

import msgspec
import pytest

from events import wire
from events.run import RunState
from events.wire import Dispatch, Heartbeat, SecretsReply, SecretsRequest
from executor.worker import parse_dispatch
from infra.heartbeats import body, parse
from services.processes.scheduler import watch

AT = datetime(2026, 12, 1, 11, 36, 1, 123456, tzinfo=UTC)


# ------------------------------------------------------- the previous version's readers


class OldDispatch(msgspec.Struct, frozen=True, kw_only=True):
    """executor/worker.py's `Dispatch` before events/wire.py."""

    org: str
    workspace: str
    run_id: str
    phase: str


class OldBody(msgspec.Struct, frozen=True, kw_only=True):
    """infra/heartbeats.py's `Body` before events/wire.py."""

    lease_id: str = ""
    executor_id: str = ""
    kind: str = ""
    org: str = ""
    workspace: str = ""
    timeout: int = -1
    pool: str = ""
    recheck: int = 0
    dispatched_at: datetime | None = None
    run_deadline: datetime | None = None
    approval_deadline: datetime | None = None
    version: int = 0


class OldSecretsRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """services/app/secrets.py's request before events/wire.py (unknown fields refused)."""

    run_id: str
    lease_id: str


def old_executor_reads_reply(data: bytes) -> bytes | str:
    """executor/secrets.py's reading of a reply before events/wire.py: the sealed bytes,
    or the error."""
    answer = json.loads(data)
    if "error" in answer:
        return f"refused: {answer['error']}"
    return base64.b64decode(answer["sealed"])


# ------------------------------------------------------- dispatch


OLD_DISPATCH = b'{"org": "acme", "workspace": "net", "run_id": "r-1", "phase": "plan"}'


def test_an_old_schedulers_dispatch_decodes_in_the_new_executor() -> None:
    assert parse_dispatch(OLD_DISPATCH) == Dispatch(
        org="acme", workspace="net", run_id="r-1", phase="plan"
    )


def test_a_new_schedulers_dispatch_is_the_same_object_and_decodes_in_the_old_executor() -> None:
    run = RunState(org="acme", workspace="net", run_id="r-1")
    new = watch.dispatch_message(run, "custom-2")
    assert json.loads(new) == {
        "org": "acme",
        "workspace": "net",
        "run_id": "r-1",
        "phase": "custom-2",
    }
    assert msgspec.json.decode(new, type=OldDispatch) == OldDispatch(
        org="acme", workspace="net", run_id="r-1", phase="custom-2"
    )


def test_a_newer_schedulers_added_field_is_ignored() -> None:
    newer = b'{"org":"acme","workspace":"net","run_id":"r-1","phase":"apply","priority":3}'
    assert parse_dispatch(newer).phase == "apply"


@pytest.mark.parametrize(
    "data",
    [
        b"not json",
        b'{"org": "acme", "workspace": "net", "run_id": "r-1"}',
        b'{"org": "ACME.>", "workspace": "net", "run_id": "r-1", "phase": "plan"}',
        b'{"org": "acme", "workspace": "net", "run_id": "r-1", "phase": "destroy"}',
        b'{"org": 1, "workspace": "net", "run_id": "r-1", "phase": "plan"}',
    ],
)
def test_what_is_not_a_dispatch_is_a_permanent_value_error(data: bytes) -> None:
    with pytest.raises(ValueError) as info:
        parse_dispatch(data)
    assert isinstance(info.value, wire.WireError) and info.value.retryable is False


# ------------------------------------------------------- heartbeats


OLD_BEAT = (
    b'{"lease_id": "l-1", "executor_id": "ex-1", "at": "2026-12-01T11:36:01.123456+00:00",'
    b' "org": "acme", "workspace": "net", "timeout": 60}'
)
OLD_MARKER = (
    b'{"lease_id": "", "kind": "dispatched", "org": "acme", "workspace": "net", "timeout": 0,'
    b' "pool": "default", "recheck": 60, "dispatched_at": null}'
)
OLD_DEADLINE = (
    b'{"kind": "deadline", "org": "acme", "workspace": "net",'
    b' "run_deadline": "2026-12-01T12:36:01.123456+00:00", "approval_deadline": null,'
    b' "version": 7, "pool": "default"}'
)
# The reaper's rewrite of a marker (msgspec, every field, even the defaults).
OLD_REWRITE = (
    b'{"lease_id":"","executor_id":"","kind":"dispatched","org":"acme","workspace":"net",'
    b'"timeout":0,"pool":"default","recheck":60,"dispatched_at":"2026-12-01T11:36:01.123456Z",'
    b'"run_deadline":null,"approval_deadline":null,"version":0}'
)


def test_an_old_executors_beat_decodes_with_its_clock_kept_apart() -> None:
    beat = wire.decode_heartbeat(OLD_BEAT)
    assert beat == Heartbeat(
        lease_id="l-1", executor_id="ex-1", at=AT, org="acme", workspace="net", timeout=60
    )


@pytest.mark.parametrize("old", [OLD_BEAT, OLD_MARKER, OLD_DEADLINE, OLD_REWRITE])
def test_old_board_entries_read_the_same_with_the_new_and_the_old_types(old: bytes) -> None:
    new = wire.decode_heartbeat(old)
    was = msgspec.json.decode(old, type=OldBody)
    assert msgspec.structs.asdict(was) == {
        k: v for k, v in msgspec.structs.asdict(new).items() if k != "at"
    }
    # and written again by a new writer, the old reader reads the same entry
    assert msgspec.json.decode(wire.encode(new), type=OldBody) == was


def test_new_entries_carry_only_what_the_old_writers_sent() -> None:
    """Defaults are left out: an executor's beat is the fields it always sent, and a
    marker without `dispatched_at` leaves it out rather than sending null."""
    beat = Heartbeat(
        lease_id="l-1", executor_id="ex-1", at=AT, org="acme", workspace="net", timeout=60
    )
    assert set(json.loads(wire.encode(beat))) == set(json.loads(OLD_BEAT))
    marker = body(
        lease_id="",
        kind="dispatched",
        org="acme",
        workspace="net",
        timeout=0,
        pool="default",
        recheck=60,
        dispatched_at=None,
    )
    assert json.loads(marker) == {
        "kind": "dispatched",
        "org": "acme",
        "workspace": "net",
        "timeout": 0,
        "pool": "default",
        "recheck": 60,
    }


def test_an_unreadable_entry_is_kept_as_unreadable_not_dropped() -> None:
    hdrs = {
        "Nats-Subject": "rp.hb.r-1.plan",
        "Nats-Sequence": "9",
        "Nats-Time-Stamp": "2026-12-01T11:36:01.123456789Z",
    }
    beat = parse(hdrs, b'{"timeout": "sixty"}')
    assert beat is not None and beat.body.kind == "unreadable" and beat.seq == 9
    assert parse(hdrs, b"") is not None  # an empty body: all defaults


# ------------------------------------------------------- secrets


def test_an_old_executors_request_decodes_in_the_new_responder() -> None:
    old = b'{"run_id": "r-1", "lease_id": "l-1"}'
    assert wire.decode_secrets_request(old) == SecretsRequest(run_id="r-1", lease_id="l-1")


def test_a_new_executors_request_is_accepted_by_an_old_responder() -> None:
    new = wire.encode(SecretsRequest(run_id="r-1", lease_id="l-1"))
    assert msgspec.json.decode(new, type=OldSecretsRequest) == OldSecretsRequest(
        run_id="r-1", lease_id="l-1"
    )


def test_an_old_responders_replies_decode_in_the_new_executor() -> None:
    sealed = bytes(range(256))
    old = json.dumps({"sealed": base64.b64encode(sealed).decode()}).encode()
    assert wire.decode_secrets_reply(old) == SecretsReply(sealed=sealed)
    refused = b'{"error": "lease l-1 is not the current lease of run r-1"}'
    assert wire.decode_secrets_reply(refused).error.startswith("lease l-1")
    values = json.dumps({"TOKEN": 's3cr\u00e9t "q"', "B": ""}).encode()
    assert wire.decode_secret_values(values) == {"TOKEN": 's3cr\u00e9t "q"', "B": ""}


def test_a_new_responders_replies_read_as_before_in_the_old_executor() -> None:
    sealed = bytes(range(256))
    assert old_executor_reads_reply(wire.encode(SecretsReply(sealed=sealed))) == sealed
    refused = wire.encode(SecretsReply(error="no such lease"))
    assert old_executor_reads_reply(refused) == "refused: no such lease"
    values = wire.encode({"TOKEN": "s3cr\u00e9t", "B": ""})
    assert json.loads(values) == {"TOKEN": "s3cr\u00e9t", "B": ""}


def test_a_reply_that_is_not_a_set_of_secret_values_is_malformed() -> None:
    for data in (b'{"sealed": "not base64!"}', b"[]", b'{"sealed": 3}'):
        with pytest.raises(wire.WireError):
            wire.decode_secrets_reply(data)
    with pytest.raises(wire.WireError):
        wire.decode_secret_values(b'{"TOKEN": 3}')
