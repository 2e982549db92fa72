"""Helpers for the audit tests (tests/test_audit*.py): run `audit verify`, tamper with the
stream as someone with NATS access would. Holds no tests itself."""

from __future__ import annotations

import io
import json
from typing import Any

from nats.aio.client import Client as NATS

from events.audit import decode, encode
from infra.auditlog import AuditLog
from infra.streams import AUDIT
from services.surfaces import audit_verify
from tests.helpers import eventually


async def verify(nc: NATS, **kw: Any) -> tuple[int, str]:
    """`runplane audit verify`'s exit status and output."""
    out = io.StringIO()
    code = await audit_verify.verify(nc, out, **kw)
    return code, out.getvalue()


async def records(nc: NATS, org: str) -> list[tuple[int, dict[str, Any]]]:
    """Every record of `org`'s chain: (stream sequence, record as JSON)."""
    audit, start = AuditLog(nc), 1
    out: list[tuple[int, dict[str, Any]]] = []
    while page := await audit.page(org, start):
        out.extend((r.seq, json.loads(r.data)) for r in page)
        start = page[-1].seq + 1
    return out


async def recorded(nc: NATS, org: str, action: str, count: int = 1) -> list[dict[str, Any]]:
    """Wait until `org`'s chain has `count` records of `action`; those records."""

    async def probe() -> list[dict[str, Any]] | None:
        found = [r for _, r in await records(nc, org) if r.get("action") == action]
        return found if len(found) >= count else None

    return await eventually(probe, timeout=15, what=f"{count} {action} records of {org}")


async def _api(nc: NATS, verb: str, body: dict[str, Any]) -> dict[str, Any]:
    reply = await nc.request(f"$JS.API.{verb}", json.dumps(body).encode(), timeout=5)
    answer: dict[str, Any] = json.loads(reply.data)
    assert "error" not in answer, answer
    return answer


async def delete(nc: NATS, seq: int) -> None:
    await _api(nc, f"STREAM.MSG.DELETE.{AUDIT}", {"seq": seq, "no_erase": True})


async def purge(nc: NATS, subject: str) -> None:
    await _api(nc, f"STREAM.PURGE.{AUDIT}", {"filter": subject})


async def republish_edited(nc: NATS, seq: int, **changes: Any) -> int:
    """Delete record `seq` and publish it again with `changes` (e.g. another actor): what
    an edit is on an append-only stream. The new record's sequence."""
    got = await nc.jetstream().get_msg(AUDIT, seq)
    assert got.data is not None and got.subject is not None
    edited = encode(decode(got.data).__class__(**{**_fields(got.data), **changes}))
    await delete(nc, seq)
    ack = await nc.jetstream().publish(got.subject, edited)
    return ack.seq


def _fields(data: bytes) -> dict[str, Any]:
    record = decode(data)
    return {f: getattr(record, f) for f in record.__struct_fields__}
