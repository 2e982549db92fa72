"""`runplane audit verify` against a real stream tampered with as someone with NATS access
would: a message deleted through JetStream's API (in the middle, at the tail), one
republished edited, a subject purged, a record or a checkpoint forged. Each is named (its
sequence, the first broken link) with exit 1; the clean stream verifies with exit 0."""

from __future__ import annotations

import asyncio
import json
import sys
from datetime import UTC, datetime
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from nats.aio.client import Client as NATS

from events.audit import CHECKPOINT, Record, checkpoint_message, digest, encode
from infra.natsserver import EmbeddedNats
from services.root.bootstrap import Plane
from services.surfaces import audit_verify
from tests.api_support import Http, http_fixture  # noqa: F401  # `http`
from tests.audit_support import delete, purge, recorded, records, republish_edited, verify
from tests.helpers import eventually


async def _chain(http: Http, system: Plane, nc: NATS, n: int = 6) -> list[tuple[int, dict]]:
    """Organization `a` with `n` workspaces, their records and a checkpoint after them."""
    await system.start_auditor(checkpoint_s=0.05)
    await http.org("a")
    for i in range(n):
        await http.workspace("a", f"w{i}")
    await recorded(nc, "a", "ws.created", n)

    async def signed() -> list[tuple[int, dict]] | None:
        chain = await records(nc, "a")
        return chain if chain and chain[-1][1].get("kind") == CHECKPOINT else None

    return await eventually(signed, what="a checkpoint at the chain's head")


async def test_a_clean_stream_verifies_with_a_pinned_key(
    http: Http, system: Plane, nc: NATS, tmp_path: Path
) -> None:
    await _chain(http, system, nc)
    keys = await http.get("/api/v1/audit/keys", token=None)
    pin = tmp_path / "audit-keys.json"
    pin.write_text(json.dumps(keys.body))
    code, out = await verify(nc, keys=audit_verify.pinned(pin))
    assert code == 0, out
    assert "audit verify: OK" in out and "keys pinned" in out and "0 after the last one" in out


async def test_a_message_deleted_in_the_middle_is_named(
    http: Http, system: Plane, nc: NATS
) -> None:
    chain = await _chain(http, system, nc)
    victim = chain[3][0]
    await delete(nc, victim)
    code, out = await verify(nc)
    assert code == 1, out
    assert f"seq {victim}: sequence {victim} missing" in out
    assert f"record 4 missing after seq {chain[2][0]} (deleted)" in out
    assert f"first broken link at seq {victim}" in out
    code, out = await verify(nc, org="a")  # one chain alone names it too
    assert code == 1 and "record 4 missing" in out, out


async def test_the_last_message_deleted_is_named(http: Http, system: Plane, nc: NATS) -> None:
    chain = await _chain(http, system, nc)
    last = chain[-1][0]
    await delete(nc, last)
    code, out = await verify(nc)
    assert code == 1, out
    assert f"seq {last}: sequence {last} missing (deleted or purged)" in out


async def test_a_record_republished_edited_is_named(http: Http, system: Plane, nc: NATS) -> None:
    chain = await _chain(http, system, nc)
    seq, original = chain[2]
    new_seq = await republish_edited(nc, seq, actor="someone-else")
    code, out = await verify(nc)
    assert code == 1, out
    assert f"seq {seq}: sequence {seq} missing" in out
    assert f"seq {new_seq}: record {original['n']} comes after record" in out
    assert f"first broken link at seq {seq}" in out


async def test_a_purged_subject_is_named(http: Http, system: Plane, nc: NATS) -> None:
    chain = await _chain(http, system, nc)
    await purge(nc, "audit.a")
    code, out = await verify(nc)
    assert code == 1, out
    first, last = chain[0][0], chain[-1][0]
    assert "missing (deleted or purged)" in out and f"seq {first}" in out
    assert str(last) in out


async def test_a_forged_record_and_a_forged_checkpoint_are_named(
    http: Http, system: Plane, nc: NATS
) -> None:
    """A record whose prev is not its predecessor's hash (an insert), then a checkpoint
    after it signed with a key of the attacker's under the real key's id."""
    chain = await _chain(http, system, nc)
    head_seq, head = chain[-1]
    forged = Record(
        org="a", n=head["n"] + 1, prev=digest(b"something else"), at=datetime.now(UTC),
        actor="admin", actor_kind="admin", via="api", action="run.approved",
        thing="run w0/r-1", outcome="ok",
    )  # fmt: skip
    ack = await nc.jetstream().publish("audit.a", encode(forged))
    code, out = await verify(nc)
    assert code == 1, out
    assert f"seq {ack.seq}: record {forged.n}'s prev is not the hash of record {head['n']}" in out
    got = await nc.jetstream().get_msg("RP_AUDIT", ack.seq)
    assert got.data is not None
    fake = Record(
        org="a", n=forged.n + 1, prev=digest(got.data), at=datetime.now(UTC),
        kind=CHECKPOINT, kid=head["kid"],
    )  # fmt: skip
    sig = Ed25519PrivateKey.generate().sign(checkpoint_message(fake))
    fake_ack = await nc.jetstream().publish("audit.a", encode(fake.__class__(
        **{**{f: getattr(fake, f) for f in fake.__struct_fields__}, "sig": sig.hex()}
    )))  # fmt: skip
    code, out = await verify(nc)
    assert code == 1 and f"seq {fake_ack.seq}: checkpoint signature does not verify" in out, out
    assert head_seq < ack.seq


async def test_the_command_line_exits_1_and_names_the_deleted_record(
    http: Http, system: Plane, nc: NATS, nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    """`runplane audit verify --nats-url URL --org a` (the CLI itself, in a process of its
    own with the deployment's NATS credentials): exit 1, the deleted record named."""
    chain = await _chain(http, system, nc)
    await delete(nc, chain[1][0])
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "services.root.cli", "audit", "verify", "--nats-url",
        nats_server.url, "--org", "a", "--data-dir", str(tmp_path / "cli"),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await proc.communicate()
    assert proc.returncode == 1, (out, err)
    assert b"record 2 missing" in out, out


async def test_a_head_deleted_under_the_writer_is_still_named_for_one_org(
    http: Http, system: Plane, nc: NATS
) -> None:
    """The chain's head deleted, then more commands: the writer links its next record to
    the record before the deleted one (it cannot know), so the org's chain reads whole;
    `verify --org a` still names the missing sequence."""
    chain = await _chain(http, system, nc)
    head_seq = chain[-1][0]
    await delete(nc, head_seq)
    await http.workspace("a", "late")
    await recorded(nc, "a", "ws.created", 7)
    code, out = await verify(nc, org="a")
    assert code == 1, out
    assert f"stream: seq {head_seq}: sequence {head_seq} missing" in out


async def test_from_a_sequence_verifies_what_follows_and_names_a_later_break(
    http: Http, system: Plane, nc: NATS
) -> None:
    """`--from SEQ`: the record there is taken as it links (what precedes is not read), a
    deletion before it is not this run's to see, one after it is named."""
    chain = await _chain(http, system, nc)
    await delete(nc, chain[1][0])
    start = chain[3][0]
    code, out = await verify(nc, from_seq=start)
    assert code == 0, out
    await delete(nc, chain[5][0])
    code, out = await verify(nc, from_seq=start)
    assert code == 1 and f"seq {chain[5][0]}: sequence {chain[5][0]} missing" in out, out
