"""Attacks on the audit log (issue 24's review): what a tenant, or someone with NATS
access, could do to another organization's chain or to the auditor of every one.
Each test failed on the code before its fix (said in its docstring)."""

from __future__ import annotations

import asyncio
import json
import time
from datetime import UTC, datetime
from typing import Any

import msgspec
import pytest
from nats.aio.client import Client as NATS

from events.audit import CHECKPOINT, Facts, Record, after, encode
from events.audit_chain import Chain
from infra.auditkeys import AuditKeys
from infra.auditlog import AuditLog
from infra.kv import AUDIT_BUCKET
from services.processes.audit import read_cursor
from services.root.bootstrap import Plane
from services.surfaces.api import audit as audit_api
from tests.api_support import Http, http_fixture  # noqa: F401  # `http`
from tests.audit_support import recorded, records, verify
from tests.helpers import eventually

V1 = "/api/v1/orgs"


async def _readable(nc: NATS, org: str) -> list[dict[str, Any]]:
    """The records of `org`'s chain that are JSON (a foreign message left out)."""
    audit, start, out = AuditLog(nc), 1, []
    while page := await audit.page(org, start):
        for raw in page:
            try:
                out.append(json.loads(raw.data))
            except ValueError:
                continue
        start = page[-1].seq + 1
    return out


def _refusal(org: str, *, src: int = 0) -> Facts:
    return Facts(
        org=org, at=datetime.now(UTC), actor="v", actor_kind="token", via="api",
        action="refused POST x", thing=f"organization {org}", outcome="refused", status=403,
        src=src,
    )  # fmt: skip


async def test_an_organization_named_ckpt_dash_b_cannot_swallow_b_s_checkpoint(
    nc: NATS, system: Plane
) -> None:
    """Org names are letters, digits and dashes, so `ckpt-b` is one. Its record of event
    3 had the dedupe id `audit-ckpt-b-3`, which is also the id of org b's checkpoint at
    place 3: JetStream took b's checkpoint for a duplicate and dropped it, and the
    auditor believed b signed (on main: b's chain ended unsigned)."""
    audit = AuditLog(nc)
    await audit.append(_refusal("b"))
    await audit.append(_refusal("b"))
    await audit.append(_refusal("ckpt-b", src=3))  # the attacker's record of its event 3
    await audit.checkpoint("b", AuditKeys(nc, system.keyring), datetime.now(UTC))
    chain = [r for _, r in await records(nc, "b")]
    assert [r["n"] for r in chain] == [1, 2, 3]
    assert chain[-1]["kind"] == CHECKPOINT
    code, out = await verify(nc, org="b")
    assert code == 0 and "1 checkpoints verified, 0 after the last one" in out, out


async def test_a_refusal_after_the_auditor_s_own_checkpoint_is_signed(
    nc: NATS, system: Plane
) -> None:
    """The api (another process) appends a refusal after the auditor's checkpoint. On
    main the auditor's checkpoint took its own cached head (its last checkpoint) for the
    chain's, found it signed and signed nothing: refusals after it stayed unsigned until
    the organization's next command, for ever in a chain of refusals alone."""
    keys = AuditKeys(nc, system.keyring)
    auditor, api = AuditLog(nc), AuditLog(nc)
    await auditor.append(_refusal("b"))
    await auditor.checkpoint("b", keys, datetime.now(UTC))
    await api.append(_refusal("b"))
    assert await auditor.checkpoint("b", keys, datetime.now(UTC))
    chain = [r for _, r in await records(nc, "b")]
    assert [(r["n"], r.get("kind", "record")) for r in chain] == [
        (1, "record"), (2, CHECKPOINT), (3, "record"), (4, CHECKPOINT),
    ]  # fmt: skip
    code, out = await verify(nc, org="b")
    assert code == 0 and "0 after the last one" in out, out


async def test_a_broken_head_of_one_chain_does_not_stop_the_auditor_for_everyone(
    http: Http, system: Plane, nc: NATS
) -> None:
    """Someone with NATS access publishes a message that is no record on `audit.b`. On
    main the auditor's start made every chain due, the checkpoint of b read a head that
    did not decode and raised, every pass: the auditor's cursor was never saved again
    (each pass read the whole log from the old one: a restart's work, every second), and
    no record could be appended to b any more (the api's refusals, b's commands). Now
    the auditor goes on (a is recorded and signed), b's chain
    goes on after the foreign message (linked to it, numbered past it: verify names the
    message alone), and b is checkpointed again."""
    audit = AuditLog(nc)
    await audit.append(_refusal("b"))
    await nc.jetstream().publish("audit.b", b"not a record")
    await system.start_auditor(checkpoint_s=0.05)
    await http.org("a")
    await http.workspace("a", "w1")
    await recorded(nc, "a", "ws.created")

    async def a_signed() -> bool:
        return (await records(nc, "a"))[-1][1].get("kind") == CHECKPOINT

    await eventually(a_signed, timeout=10, what="a's chain signed")
    await audit.append(_refusal("b"))  # the api's next refusal in b links on too

    async def signed() -> list[dict[str, Any]] | None:
        chain = await _readable(nc, "b")
        return chain if chain[-1].get("kind") == CHECKPOINT else None

    chain = await eventually(signed, timeout=10, what="b's chain signed after the break")
    places = [r["n"] for r in chain]  # the foreign message holds place 2
    assert places == [1, *range(3, len(places) + 2)], places
    assert [r["outcome"] for r in chain].count("refused") == 2
    code, out = await verify(nc, org="b")
    assert code == 1, out
    assert "not an audit record" in out and out.count("org b: seq") == 1, out


async def test_a_forged_high_water_mark_that_hides_later_commands_is_named(
    http: Http, system: Plane, nc: NATS
) -> None:
    """Someone with NATS access appends to a's chain one record linked as the auditor
    would (the head is readable) whose event `src`, and so `hw`, is far past the event
    log: the auditor then takes every later command of a for recorded already and
    records none, and its next checkpoint signs the forgery. On main `audit verify` said
    OK. Now it names the record (its event is past the event log's last sequence)."""
    await system.start_auditor(checkpoint_s=0.05)
    await http.org("a")
    await http.workspace("a", "w1")
    await recorded(nc, "a", "ws.created")
    head = await AuditLog(nc).head("a")
    far = 2**40
    facts = msgspec.structs.replace(_refusal("a", src=far), action="ws.created", outcome="ok")
    forged = after(head[2], head[1], facts)
    assert forged is not None
    await nc.jetstream().publish("audit.a", encode(forged))
    await http.workspace("a", "w2")

    async def signed_after_forgery() -> bool:
        chain = await records(nc, "a")
        return chain[-1][1].get("kind") == CHECKPOINT and chain[-1][1]["n"] > forged.n

    await eventually(signed_after_forgery, timeout=10, what="a checkpoint over the forgery")
    code, out = await verify(nc, org="a")
    assert code == 1, out
    assert f"describes event {far}, past the event log's last" in out, out


def test_a_high_water_mark_above_the_chain_s_is_named_even_without_an_event() -> None:
    """A forged refusal (no event: `src` 0) carrying a high `hw` hides later commands
    just as well; its mark is not the chain's highest `src`, which verify checks."""
    datas: list[bytes] = []
    head: Record | None = None
    for src in (1, 2, 3):
        made = after(head, datas[-1] if datas else b"", _refusal("a", src=src))
        assert made is not None
        head = made
        datas.append(encode(made))
    forged = after(head, datas[-1], _refusal("a"))
    assert forged is not None
    forged = msgspec.structs.replace(forged, hw=2**40)
    chain = Chain("a", lambda kid, message, sig: False, events_last=10)
    for seq, data in enumerate([*datas, encode(forged)], start=1):
        chain.add(seq, data)
    assert [(f.seq, f.what) for f in chain.findings] == [
        (4, f"record 4's high-water mark {2**40} is not the chain's 3 (forged)")
    ]


async def test_a_flood_of_refusals_is_recorded_as_a_count_not_a_record_each(
    http: Http, nc: NATS, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A viewer (or any token of the organization) asks for what it may not, fast. On
    main each 403 was a record: the chain and the stream every organization shares grew
    with the flood without bound (no deny, no limit), each one an append under the
    chain's lock, racing the auditor's. Now at most the limit is recorded a window, and
    the next one recorded says how many were not."""
    monkeypatch.setattr(audit_api, "FLOOD_LIMIT", 5, raising=False)
    monkeypatch.setattr(audit_api, "FLOOD_WINDOW_S", 2.0, raising=False)
    tokens = await http.org("a")
    await http.workspace("a", "net")
    path, body = f"{V1}/a/workspaces/net/runs", {"type": "apply"}
    started = time.monotonic()
    for _ in range(15):
        (await http.post(path, json=body, token=tokens["viewer"])).problem("forbidden", 403)
    assert time.monotonic() - started < 2.0, "too slow to flood within the window"
    action = "refused POST /api/v1/orgs/{org}/workspaces/{ws}/runs"
    await asyncio.sleep(2.0)
    (await http.post(path, json=body, token=tokens["viewer"])).problem("forbidden", 403)
    refusals = await recorded(nc, "a", action, 6)
    assert len(refusals) == 6
    assert [r.get("more", 0) for r in refusals] == [0, 0, 0, 0, 0, 10]


async def test_a_checkpoint_that_cannot_be_signed_does_not_hold_the_auditor_s_cursor(
    http: Http, system: Plane, nc: NATS
) -> None:
    """Someone with NATS access replaces the audit key with one that does not open. On
    main each pass of the auditor appended its records, then raised at the first
    checkpoint before its cursor was saved, and began again from the old cursor: every
    pass read the whole log since (a restart's work, every second, growing). Now the
    checkpoints stay due (retried each pass, logged) and the cursor moves on."""
    kv = await nc.jetstream().key_value(AUDIT_BUCKET)
    await kv.put("key", b'{"keys":[{"kid":"x","created":0,"public":"00","sealed":"AA=="}]}')
    await system.start_auditor(checkpoint_s=0.05)
    await http.org("a")
    await http.workspace("a", "w1")
    await recorded(nc, "a", "ws.created")
    await asyncio.sleep(0.5)  # a's chain is due: its checkpoint fails from now on
    await http.workspace("a", "w2")
    last = (await recorded(nc, "a", "ws.created", 2))[-1]["src"]

    async def moved() -> bool:
        return (await read_cursor(nc))[0] >= last

    await eventually(moved, timeout=10, what="the auditor's cursor past w2's event")
    chain = [r for _, r in await records(nc, "a")]
    assert all(r.get("kind", "record") != CHECKPOINT for r in chain)  # none could be signed


async def test_an_admin_s_many_tokens_share_the_organization_s_flood_limit(
    http: Http, nc: NATS, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An organization's admin mints callers at will (a token per made-up user): each
    under the caller's limit, together they are held to the organization's."""
    monkeypatch.setattr(audit_api, "FLOOD_LIMIT", 5, raising=False)
    monkeypatch.setattr(audit_api, "ORG_FLOOD_LIMIT", 8, raising=False)
    tokens = await http.org("a")
    await http.workspace("a", "net")
    path, body = f"{V1}/a/workspaces/net/runs", {"type": "apply"}
    viewers = [tokens["viewer"]]
    for i in range(2):
        made = await http.post(f"{V1}/a/tokens", json={"user": f"v{i}", "role": "viewer"})
        viewers.append(made.body["token"])
    for token in viewers:
        for _ in range(4):
            (await http.post(path, json=body, token=token)).problem("forbidden", 403)
    action = "refused POST /api/v1/orgs/{org}/workspaces/{ws}/runs"
    await recorded(nc, "a", action, 8)
    await asyncio.sleep(0.3)
    assert len(await recorded(nc, "a", action, 8)) == 8
