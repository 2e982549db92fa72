"""The chain check `runplane audit verify` runs (events/audit_chain.py), synchronously:
given records, when they are read in some order, then the first broken link is named."""

from __future__ import annotations

from datetime import UTC, datetime

import msgspec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from events.audit import Facts, after, checkpoint, checkpoint_message, decode, encode
from events.audit_chain import Chain, Gaps
from infra.auditkeys import verifier

KEY = Ed25519PrivateKey.generate()
CHECK = verifier({"k1": KEY.public_key()})
AT = datetime(2026, 1, 1, tzinfo=UTC)


def chain_of(n: int, *, signed_at: int = 0) -> list[bytes]:
    """`n` records of org `a` (a checkpoint as record `signed_at` if given)."""
    out: list[bytes] = []
    head = None
    for i in range(1, n + 1):
        if i == signed_at:
            assert head is not None
            record = msgspec.structs.replace(checkpoint(head, out[-1], "a", AT), kid="k1")
            record = msgspec.structs.replace(record, sig=KEY.sign(checkpoint_message(record)).hex())
        else:
            facts = Facts(org="a", at=AT, actor="x", actor_kind="user", via="api",
                          action="run.created", thing="run w/r", src=i)  # fmt: skip
            made = after(head, out[-1] if out else b"", facts)
            assert made is not None
            record = made
        out.append(encode(record))
        head = record
    return out


def check(datas: list[bytes], seqs: list[int] | None = None) -> Chain:
    chain = Chain("a", CHECK)
    for seq, data in zip(seqs or range(1, len(datas) + 1), datas, strict=True):
        chain.add(seq, data)
    return chain


def test_a_clean_chain_has_no_finding_and_its_checkpoint_covers_what_precedes() -> None:
    chain = check(chain_of(6, signed_at=4))
    assert chain.findings == [] and chain.checkpoints == 1 and chain.unsigned == 2


def test_two_records_swapped_are_named_at_the_first_out_of_place() -> None:
    datas = chain_of(5)
    datas[1], datas[2] = datas[2], datas[1]
    first, second = check(datas).findings
    assert (first.seq, first.what) == (
        2,
        "record 2 missing after seq 1 (deleted); this is record 3",
    )
    assert second.seq == 3 and second.what.startswith("record 2 comes after record 3")


def test_an_event_already_in_the_chain_makes_no_second_record() -> None:
    datas = chain_of(3)
    head = msgspec.json.decode(datas[-1])
    facts = Facts(org="a", at=AT, actor="x", actor_kind="user", via="api",
                  action="run.created", thing="run w/r", src=2)  # fmt: skip
    assert after(decode(datas[-1]), datas[-1], facts) is None and head["hw"] == 3


def test_a_checkpoint_edited_after_signing_is_named() -> None:
    """What the signature does not cover is covered by the next record's link; what it
    covers (here the key id) fails the signature."""
    datas = chain_of(4, signed_at=3)
    datas[2] = datas[2].replace(b'"actor":"runplane"', b'"actor":"mallory"')
    (broken,) = check(datas).findings
    assert broken.seq == 4 and "prev is not the hash of record 3" in broken.what
    datas = chain_of(4, signed_at=3)
    datas[2] = datas[2].replace(b'"kid":"k1"', b'"kid":"k2"')
    found = [f.what for f in check(datas).findings]
    assert "checkpoint signature does not verify (key 'k2')" in found


def test_gaps_name_what_is_missing_inside_and_at_the_tail() -> None:
    gaps = Gaps()
    for seq in (1, 2, 4, 5):
        gaps.add(seq)
    gaps.end(7)
    assert [f.line() for f in gaps.findings] == [
        "stream: seq 3: sequence 3 missing (deleted or purged)",
        "stream: seq 6: sequence 6-7 missing (deleted or purged)",
    ]
