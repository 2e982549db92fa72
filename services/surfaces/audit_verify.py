"""`runplane audit verify`: recompute every organization's audit chain from the stream.

Threat model: the auditor has NATS access (it reads RP_AUDIT itself, with the
deployment's NATS credentials or a read-only user of its own), and so may the attacker:
someone who can delete, purge or publish on the stream. Nothing the api answers is
trusted. What it proves: every record from the first (or `--from`) on is there, in order,
unmodified, each linked to the one before (events/audit_chain.py); every checkpoint's
Ed25519 signature verifies with a pinned public key (`--pubkey FILE`, the JSON of `GET
/api/v1/audit/keys` saved earlier; without it, the keys stored in NATS, which an attacker
with NATS access could replace: said in the output); and, over the whole stream (with
`--org` too: a record deleted under a writer is linked over by its next record, and only
the stream's sequences show it), that no sequence is missing (the stream is append-only:
any gap is a deleted or purged record). What it cannot prove: records appended after the
last checkpoint by someone with NATS access who links them correctly (they are counted
as unsigned), nor a whole stream replaced with keys of the attacker's when no key is
pinned.

Exit 0: everything verifies; 1: something is broken (each finding on a line, the first
broken link of each chain first); 2: the stream cannot be read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TextIO

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from nats.aio.client import Client as NATS

from events.audit_chain import Chain, Finding, Gaps
from infra import auditkeys
from infra.auditlog import stream_state
from infra.streams import AUDIT, EVENTS
from projections.ordered import OrderedReader

IDLE_S = 2.0  # nothing more arriving this long: the stream's tail was read
BATCH = 5000


def pinned(path: Path) -> dict[str, Ed25519PublicKey]:
    """The public keys of a file saved from `GET /api/v1/audit/keys`."""
    body = json.loads(path.read_text())
    found = auditkeys.KeySet(
        keys=[
            auditkeys.StoredKey(kid=k["kid"], created=int(k.get("created", 0)), public=k["public"])
            for k in body["keys"]
        ]
    )
    return auditkeys.public_keys(found)


class Report:
    """What a verification found, and how it is told."""

    def __init__(self) -> None:
        self.chains: dict[str, Chain] = {}
        self.gaps = Gaps()
        self.read = 0

    def findings(self) -> list[Finding]:
        out = list(self.gaps.findings)
        for chain in self.chains.values():
            out.extend(chain.findings)
        return out

    def tell(self, out: TextIO, *, keys_from: str) -> int:
        for org in sorted(self.chains):
            c = self.chains[org]
            print(
                f"org {org}: {c.count} records read (through record {c.last_n}), "
                f"{c.checkpoints} checkpoints verified, {c.unsigned} after the last one",
                file=out,
            )
        found = self.findings()
        for f in found:
            print(f.line(), file=out)
        if found:
            first = min(found, key=lambda f: f.seq)
            print(f"audit verify: FAILED, {len(found)} findings; first broken link at "
                  f"seq {first.seq}: {first.what}", file=out)  # fmt: skip
            return 1
        print(f"audit verify: OK, {self.read} records ({keys_from})", file=out)
        return 0


async def verify(
    nc: NATS,
    out: TextIO,
    *,
    org: str = "",
    from_seq: int = 1,
    keys: dict[str, Ed25519PublicKey] | None = None,
) -> int:
    """Verify the audit stream (one organization's chain with `org`); the exit status."""
    keys_from = "keys pinned"
    if keys is None:
        stored, _ = await auditkeys.read(nc)
        keys, keys_from = auditkeys.public_keys(stored), "keys read from NATS, not pinned"
    check = auditkeys.verifier(keys)
    report = Report()
    report.gaps.expect = from_seq
    # what a record may describe: an event the log has had (a later one is forged, and
    # its high-water mark would hide the organization's next commands from the auditor)
    events_last = (await stream_state(nc, stream=EVENTS))[1]
    last = (await stream_state(nc))[1]
    if last >= from_seq:
        await _read(
            nc, report, check, org=org, from_seq=from_seq, last=last, events_last=events_last
        )
    report.gaps.end(last)
    return report.tell(out, keys_from=keys_from)


async def _read(
    nc: NATS,
    report: Report,
    check: auditkeys.CheckSig,
    *,
    org: str,
    from_seq: int,
    last: int,
    events_last: int,
) -> None:
    trust_first = from_seq > 1
    async with OrderedReader(nc, AUDIT, start_seq=from_seq) as reader:
        while reader.last < last:
            try:
                batch = await reader.next_batch(BATCH, timeout=IDLE_S)
            except TimeoutError:
                return  # the tail was deleted: `Gaps.end` names it
            for d in batch:
                report.gaps.add(d.seq)  # with --org too: a gap is the whole stream's
                name = d.subject.removeprefix("audit.")
                if org and name != org:
                    continue
                report.read += 1
                chain = report.chains.get(name)
                if chain is None:
                    chain = report.chains[name] = Chain(
                        name, check, trust_first=trust_first, events_last=events_last
                    )
                chain.add(d.seq, d.data)
