"""`runplane audit verify`'s rate: N audit records over K organizations, checkpointed every
1,000 records per organization as the auditor does, verified from the stream.

    .venv/bin/python -m bench.audit_verify --records 1000000 --orgs 100   # JSON on stdout

The records are built here (events/audit.py, each linked to the one before, ~400 bytes,
a checkpoint signed with an Ed25519 key every 1,000 of an organization) and published
pipelined (`Firehose`) into RP_AUDIT of a private nats-server: the auditor's own appends
(one checked round trip each) would take ~20 minutes for a million. Then
`services/surfaces/audit_verify.verify` reads the whole stream with its ordered consumer,
recomputes every chain, checks every signature and every sequence: timed alone. The
issue's target: 1,000,000 records in under 60 s.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import time
from datetime import UTC, datetime, timedelta

import msgspec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from events.audit import Facts, Record, after, checkpoint, checkpoint_message, encode
from events.audit import subject as audit_subject
from infra.auditkeys import kid_of, raw_public
from services.surfaces.audit_verify import verify

from .common import Firehose, connected, private_server

EVERY = 1000


def _facts(org: str, i: int, at: datetime) -> Facts:
    return Facts(
        org=org, at=at, actor="alice@example.com", actor_kind="user", via="api",
        action="run.approved", thing=f"run network/{i:026d}", request_id=f"{i:032x}",
        client="10.1.2.3", src=i + 1, src_hash=f"{i:064x}",
    )  # fmt: skip


async def build(nc: object, records: int, orgs: int, key: Ed25519PrivateKey, kid: str) -> int:
    """Publish `records` records (checkpoints included) round robin over `orgs`."""
    heads: dict[str, tuple[Record | None, bytes]] = {f"org-{o}": (None, b"") for o in range(orgs)}
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    async with Firehose(nc) as hose:  # type: ignore[arg-type]  # a NATS client
        for i in range(records):
            org = f"org-{i % orgs}"
            head, data = heads[org]
            at = t0 + timedelta(milliseconds=i)
            if head is not None and head.n % EVERY == EVERY - 1:
                record = msgspec.structs.replace(checkpoint(head, data, org, at), kid=kid)
                record = msgspec.structs.replace(
                    record, sig=key.sign(checkpoint_message(record)).hex()
                )
            else:
                made = after(head, data, _facts(org, i, at))
                assert made is not None
                record = made
            encoded = encode(record)
            heads[org] = (record, encoded)
            await hose.put(audit_subject(org), encoded)
        await hose.drain(timeout=600)
    return records


async def main(records: int, orgs: int) -> dict[str, object]:
    key = Ed25519PrivateKey.generate()
    kid = kid_of(raw_public(key.public_key()))
    async with private_server("audit") as server, connected(server.url) as nc:
        started = time.perf_counter()
        await build(nc, records, orgs, key, kid)
        built_s = time.perf_counter() - started
        out = io.StringIO()
        started = time.perf_counter()
        code = await verify(nc, out, keys={kid: key.public_key()})
        verify_s = time.perf_counter() - started
    assert code == 0, out.getvalue()
    return {
        "records": records,
        "orgs": orgs,
        "build_s": round(built_s, 2),
        "verify_s": round(verify_s, 2),
        "verify_per_s": round(records / verify_s),
        "extrapolated_1m_s": round(1_000_000 * verify_s / records, 1),
        "target_1m_s": 60,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--orgs", type=int, default=100)
    args = parser.parse_args()
    print(json.dumps(asyncio.run(main(args.records, args.orgs))))
