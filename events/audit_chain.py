"""Checking audit chains: what `runplane audit verify` computes, given the stream. Pure.

`Chain` takes one organization's records in stream order (sequence and stored bytes) and
names every broken link: a record missing (deleted: its place `n` skipped), one out of
order or inserted (a place already passed, or a `prev` that is not the hash of the record
before it), one that does not decode or names another organization, a checkpoint whose
signature does not verify. After a break it goes on from the record it found, so one
tampering is named once, and the first finding is the first broken link.

`Gaps` takes every sequence the stream delivered (all organizations) and the stream's
first and last sequence: the audit stream is append-only (no deletes, no purges), so any
sequence missing in between is a deleted record, whatever organization it was.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from events.audit import CHECKPOINT, GENESIS, Record, checkpoint_message, decode, digest

# (key id, message, signature) -> whether the signature verifies
CheckSig = Callable[[str, bytes, bytes], bool]


@dataclass(frozen=True)
class Finding:
    org: str  # "" for the stream as a whole
    seq: int  # the stream sequence where the break shows
    what: str

    def line(self) -> str:
        where = f"org {self.org}: " if self.org else "stream: "
        return f"{where}seq {self.seq}: {self.what}"


@dataclass
class Chain:
    """One organization's chain, fed record by record (`add`)."""

    org: str
    check_sig: CheckSig
    count: int = 0  # records read (checkpoints included)
    checkpoints: int = 0  # checkpoints whose signature verified
    signed_upto: int = 0  # the highest place a verified checkpoint attests
    last_n: int = 0
    last_hash: str = GENESIS
    last_seq: int = 0
    trust_first: bool = False  # verifying from a later sequence: the first record's link
    events_last: int = 0  # the event log's last sequence (0: not checked)
    last_hw: int = 0
    findings: list[Finding] = field(default_factory=list)

    def add(self, seq: int, data: bytes) -> None:
        self.count += 1
        try:
            record = decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            self._broken(seq, "not an audit record (modified or inserted)")
            self._move(seq, self.last_n + 1, data)
            return
        if self.trust_first and self.count == 1:
            self.last_n, self.last_hash, self.signed_upto = record.n - 1, record.prev, record.n - 1
            self.last_hw = record.hw
        if record.org != self.org:
            self._broken(seq, f"a record of organization {record.org!r} (inserted)")
        expected = self.last_n + 1
        if record.n > expected:
            missing = f"{expected}" if record.n == expected + 1 else f"{expected}-{record.n - 1}"
            self._broken(
                seq, f"record {missing} missing after seq {self.last_seq} (deleted); this is "
                f"record {record.n}",
            )  # fmt: skip
        elif record.n < expected:
            self._broken(
                seq, f"record {record.n} comes after record {self.last_n} (reordered, "
                "inserted or republished)",
            )  # fmt: skip
            return  # out of place: the chain goes on from the record before it
        elif record.prev != self.last_hash:
            self._broken(
                seq, f"record {record.n}'s prev is not the hash of record {self.last_n} at "
                f"seq {self.last_seq} (modified or inserted)",
            )  # fmt: skip
        self._high_water(seq, record, gap=record.n > expected)
        if record.kind == CHECKPOINT:
            self._checkpoint(seq, record)
        self._move(seq, record.n, data)

    def _high_water(self, seq: int, record: Record, *, gap: bool) -> None:
        """A record's `src` is an event the log has had, and its `hw` the chain's highest
        `src`: a larger one, linked as a writer would, makes the auditor skip every later
        command of the organization (taken for recorded) and still links. After records
        missing (named already) the mark may have grown with them."""
        if self.events_last and record.src > self.events_last:
            self._broken(
                seq, f"record {record.n} describes event {record.src}, past the event log's "
                f"last sequence {self.events_last} (forged)",
            )  # fmt: skip
        wanted = max(self.last_hw, record.src)
        if record.hw != wanted and not (gap and record.hw > wanted):
            self._broken(
                seq, f"record {record.n}'s high-water mark {record.hw} is not the chain's "
                f"{wanted} (forged)",
            )  # fmt: skip
        self.last_hw = record.hw

    def _checkpoint(self, seq: int, record: msgspec.Struct) -> None:
        kid, sig = getattr(record, "kid", ""), getattr(record, "sig", "")
        try:
            raw = bytes.fromhex(sig)
        except ValueError:
            raw = b""
        if raw and self.check_sig(kid, checkpoint_message(record), raw):  # type: ignore[arg-type]  # a Record
            self.checkpoints += 1
            self.signed_upto = max(self.signed_upto, getattr(record, "n", 0))  # itself too
        else:
            self._broken(seq, f"checkpoint signature does not verify (key {kid!r})")

    def _move(self, seq: int, n: int, data: bytes) -> None:
        self.last_n, self.last_hash, self.last_seq = n, digest(data), seq

    def _broken(self, seq: int, what: str) -> None:
        self.findings.append(Finding(self.org, seq, what))

    @property
    def unsigned(self) -> int:
        """Records after the last verified checkpoint (not yet attested by a signature)."""
        return max(0, self.last_n - self.signed_upto)


@dataclass
class Gaps:
    """Sequences missing from an append-only stream."""

    expect: int = 1  # nothing is ever removed: the first sequence is 1
    findings: list[Finding] = field(default_factory=list)

    def add(self, seq: int) -> None:
        if seq > self.expect:
            self._missing(self.expect, seq - 1)
        self.expect = max(self.expect, seq + 1)

    def end(self, last_seq: int) -> None:
        """The stream's own last sequence, once everything was read: what is missing at
        the tail (a purge moves the first sequence: `add` saw that gap already)."""
        if last_seq >= self.expect:
            self._missing(self.expect, last_seq)
            self.expect = last_seq + 1

    def _missing(self, lo: int, hi: int) -> None:
        seqs = f"{lo}" if lo == hi else f"{lo}-{hi}"
        self.findings.append(Finding("", lo, f"sequence {seqs} missing (deleted or purged)"))
