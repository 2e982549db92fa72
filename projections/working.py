"""What a batch of folds works on: an event's place in the stream (`Meta`) and the rows
the batch reads and writes (`Working`, with the runs it folded as `RunView`s).

The folds (`projections/project.py` and its sub-projectors) import this module; it imports
none of them.
"""

from __future__ import annotations

from collections import defaultdict
from datetime import UTC, datetime, timedelta
from functools import lru_cache
from typing import Any

import msgspec

from events.run import RunState
from projections.schema import BY_NAME, Key, Row

# The tables of a run's rows, keyed by its id first, that a workspace's purge removes.
PURGED_BY_RUN = ("runs", "steps", "changes", "resource_states")
_state_decoder = msgspec.json.Decoder(RunState)
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_ZERO = timedelta(0)


class Unprojectable(Exception):
    """The event decoded but cannot be folded (e.g. it names a run that was never created)."""


class Meta(msgspec.Struct, frozen=True):
    """Where an event sits in the stream, and the aggregate its subject names."""

    seq: int
    subject: str
    stored_at: str
    kind: str = ""  # "run" | "ws" | "org" | "" for a subject we do not know
    org: str | None = None
    workspace: str | None = None
    run_id: str | None = None


def meta_of(seq: int, subject: str, time_ns: int) -> Meta:
    """Parse `rp.run.<org>.<ws>.<run>`, `rp.ws.<org>.<ws>` or `rp.org.<org>`."""
    us = time_ns // 1000
    stored = f"{_iso_second(us // 1_000_000)}.{us % 1_000_000:06d}Z"
    return Meta(seq, subject, stored, *_aggregate_of(subject))


@lru_cache(maxsize=4096)
def _aggregate_of(subject: str) -> tuple[str, str | None, str | None, str | None]:
    """(kind, org, workspace, run) of a subject: a run's events share one (replays parse
    hundreds of thousands of subjects, each a few dozen times)."""
    match subject.split("."):
        case ["rp", "run", org, ws, run]:
            return ("run", org, ws, run)
        case ["rp", "ws", org, ws]:
            return ("ws", org, ws, None)
        case ["rp", "org", org] | ["rp", "org", org, "uses", _]:  # a token's uses: events/org.py
            return ("org", org, None, None)
        case ["rp", "org", org, "notify", *_]:  # events/notification.py
            return ("org", org, None, None)
        case ["rp", "org", org, "vcs", *_]:  # VCS connections: events/vcs.py
            return ("org", org, None, None)
        case ["rp", "org", org, "chat", *_]:  # chat-ops: events/chat.py
            return ("chat", org, None, None)
        case ["rp", "org", org, "run_triggers"]:  # events/run_triggers.py
            return ("triggers", org, None, None)
        case ["rp", "org", org, "stack", _]:  # events/stacks.py
            return ("stack", org, None, None)
        case ["rp", "org", org, "stack_run", _]:  # events/stack_run_events.py
            return ("stack_run", org, None, None)
        case _:
            return ("", None, None, None)


@lru_cache(maxsize=256)
def _iso_second(second: int) -> str:
    """`iso` of a whole second since the epoch, without its fraction and Z (replays format
    hundreds of thousands of server timestamps, nearly all in a few distinct seconds)."""
    return (_EPOCH + timedelta(seconds=second)).replace(tzinfo=None).isoformat()


_json = msgspec.json.encode


def iso(dt: datetime) -> str:
    """ISO 8601 UTC with microseconds and a Z: fixed width, so text order is time order."""
    if dt.tzinfo is UTC:  # the usual case (decoded "Z" times): no conversion to make
        # msgspec writes a UTC time as RFC 3339 with a Z, the fraction in six digits or
        # none when it is zero: the same text at a tenth of `isoformat`'s cost (a replay
        # formats every event's time: 3 us of its 29 us per event were this).
        text = _json(dt)
        if dt.microsecond:
            return text[1:-1].decode()
        return text[1:-2].decode() + ".000000Z"
    if dt.utcoffset() != _ZERO:
        dt = dt.astimezone(UTC)
    return dt.replace(tzinfo=None).isoformat(timespec="microseconds") + "Z"


def opt(value: str) -> str | None:
    """The core uses "" for "not set"; the read model says null."""
    return value or None


# ---------------------------------------------------------------- the working set


class Working:
    """The rows one batch reads and writes.

    `rows` holds what was prefetched or written so far (the current truth for the batch);
    `dirty` the last write per key (None = delete), flushed in table order at commit.
    """

    def __init__(self) -> None:
        self.rows: dict[str, dict[Key, Row]] = defaultdict(dict)
        self.dirty: dict[str, dict[Key, Row | None]] = defaultdict(dict)
        self._groups: dict[str, dict[Any, set[Key]]] = defaultdict(lambda: defaultdict(set))
        self.runs: dict[str, RunView] = {}  # runs folded in this batch, by id
        # The batch's audit rows (`events`), as tuples in column order: one per event, none
        # read back, so they skip the dicts of `dirty`.
        self.audit: list[tuple[Any, ...]] = []
        # Workspaces purged in this batch: their stored run rows go first at the flush.
        self.purged: list[tuple[str, str]] = []
        # Runs whose record retention removed in this batch: their stored rows go first too.
        self.removed: list[str] = []

    def load(self, table: str, row: Row) -> None:
        key = BY_NAME[table].key(row)
        self.rows[table][key] = row
        self._groups[table][key[0]].add(key)

    def get(self, table: str, key: Key) -> Row | None:
        return self.rows[table].get(key)

    def put(self, table: str, row: Row) -> None:
        key = BY_NAME[table].key(row)
        self.rows[table][key] = row
        self._groups[table][key[0]].add(key)
        self.dirty[table][key] = row

    def insert(self, table: str, row: Row) -> None:
        """Write a row no fold will read back in this batch (audit, tokens, ...)."""
        self.dirty[table][BY_NAME[table].key(row)] = row

    def delete(self, table: str, key: Key) -> None:
        self.rows[table].pop(key, None)
        self._groups[table][key[0]].discard(key)
        self.dirty[table][key] = None

    def purge_runs(self, org: str, ws: str) -> None:
        """Forget what the batch holds of a purged workspace's runs (their rows, steps,
        changes, resource states) and state versions, and have the flush delete the stored
        ones (`purged`) before it writes anything: a later event of such a run finds no
        row (skipped), and runs of a workspace created again under the name are kept."""
        runs = self.rows["runs"]
        gone = {k[0] for k, r in runs.items() if (r["org"], r["workspace"]) == (org, ws)}
        gone |= {i for i, v in self.runs.items() if (v.state.org, v.state.workspace) == (org, ws)}
        for run_id in gone:
            self.runs.pop(run_id, None)
        for table in PURGED_BY_RUN:
            for held in (self.rows[table], self.dirty[table]):
                for key in [k for k in held if k[0] in gone]:
                    del held[key]
            for run_id in gone:
                self._groups[table].pop(run_id, None)
        for held in (self.rows["state_versions"], self.dirty["state_versions"]):
            for key in [k for k in held if k[:2] == (org, ws)]:
                del held[key]
                self._groups["state_versions"][org].discard(key)
        self.purged.append((org, ws))

    def remove_run(self, run_id: str) -> None:
        """Forget what the batch holds of a removed run (its rows, steps, changes, resource
        states: events.run REMOVED_ROWS) and have the flush delete the stored ones
        (`removed`) before it writes anything; a later event of it finds no row."""
        self.runs.pop(run_id, None)
        for table in PURGED_BY_RUN:
            for held in (self.rows[table], self.dirty[table]):
                for key in [k for k in held if k[0] == run_id]:
                    del held[key]
            self._groups[table].pop(run_id, None)
        self.removed.append(run_id)

    def rows_of(self, table: str, first: Any) -> list[Row]:
        """Known rows whose first key column is `first` (e.g. the steps of one run)."""
        return [self.rows[table][k] for k in sorted(self._groups[table][first])]

    def run(self, run_id: str) -> RunView | None:
        """The run as of the last event folded, from its prefetched row the first time."""
        view = self.runs.get(run_id)
        if view is None:
            row = self.get("runs", (run_id,))
            if row is None:
                return None
            state = _state_decoder.decode(row["state_json"])
            view = RunView(state, row["message"], row["error_message"], row["last_seq"])
            self.runs[run_id] = view
        return view


class RunView(msgspec.Struct):
    """A run while a batch folds it; its row is written once, from the last of these."""

    state: RunState
    message: str  # the run's own; RunState.message is overwritten by run.failed
    error_message: str | None
    last_seq: int
    dirty: bool = False
