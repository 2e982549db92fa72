"""Point-in-time read models: an organization's read model as it was at a stream sequence.

`?as_of=` (services/surfaces/api/asof.py) and nothing else reads them. The answer "as of
S" is what the API answered once its projector had folded sequence S: the same
projection code (`apply_batch`) folds the organization's own events (`rp.org.<org>`,
`rp.ws.<org>.>`, `rp.run.<org>.>`: `subjects`) up to S into a scratch SQLite file, and
the same read functions (`ReadModel`) answer from it. No row of an organization's
answers comes from another organization's events (the reads ask for the organization's
rows, `WHERE org = ?`, and the fold of an event writes rows of the event's own
organization), so leaving the others out changes nothing but the cost; nor does one
of the organization's answers read a row folded from its other subjects
(`rp.org.<org>.>`), left out too.

A workspace's answers (the workspace, its queue and lock, its state versions, its runs
and their list) read rows only its own events write: `workspaces` and `ws_queue` from
`rp.ws.<org>.<ws>`, `runs`, `steps`, the run's `events` rows, `state_versions` and
`removed_runs` from its runs' subjects (`rp.run.<org>.<ws>.>`) and its own, and the
organization's row from `rp.org.<org>` (whose folders, teams, grants and settings write
none). Nothing on the organization's other subjects (run triggers, schedules,
notifications, VCS, chat, token uses: their folds write other tables, or none) nor
another workspace's writes one of those rows, so
a model of that workspace (`subjects(org, ws)`) answers them as the whole
organization's does, at a fraction of the cost (tests/test_as_of_narrow.py).

- A time is the last sequence whose stream timestamp is at or before it: one request to
  the stream's leader (`STREAM.MSG.GET` with `start_time`: the first message stored after
  the time, minus one), never a scan.
- Scratch models, the organization's and its workspaces', are cached (at most
  `max_models`, and at most `max_held` events folded in all; the least recently used of
  the organization holding the most goes first out, so one organization's requests never
  close the model another's answer goes on from); a request at S2 advances the newest
  cached model of its scope at S1 <= S2 instead of starting over, and a model is never
  moved back (S2 < S1 starts from the cached model nearest below, or from sequence 1).
  The organization's model serves a workspace's request when it is at S2, or at most
  `_NEAR` sequences below.
- Work is capped: a request folds at most `max_events` events. Past that it stops,
  keeps what it folded (the next request goes on from there) and raises `TooCostly`; an
  organization's answers never hold the api for more than that.
- The events are read through an ordered consumer (projections/ordered.py) of the
  organization's subjects, which the stream's leader serves whichever server the client
  reaches, up to S; S itself is checked against the leader's last sequence. A replica
  that lags never answers half a state: nothing here is read from a replica
  (tests/test_as_of_cluster.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import shutil
import tempfile
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import NamedTuple

import aiosqlite
import structlog
from nats.aio.client import Client as NATS

from infra.directget import as_raw, leader_get
from infra.streams import EVENTS
from projections import schema
from projections.asof_time import AsOfError, bounds, parse_time, resolve
from projections.batch import apply_batch
from projections.fill import Filler, Writer
from projections.ordered import Delivered, OrderedReader
from projections.readmodel import ReadModel

log = structlog.get_logger(__name__)

__all__ = ["AsOfError", "bounds", "parse_time", "resolve"]  # (projections/asof_time.py)

MAX_MODELS = 16  # scratch models kept
MAX_EVENTS = 20_000  # events one request may fold (~2 s of one core)
MAX_HELD = 1_000_000  # events folded into the cached models, all together
PER_MINUTE = 100_000  # events one organization's requests may fold a minute (~10 s)
_WINDOW = 60.0
_BATCH = 200  # events folded at a time: the event loop serves others between
_NEAR = _BATCH  # sequences an organization's model may be moved for a workspace's answer
_FETCH_TIMEOUT = 5.0
_TRIES = 20  # reads of a replica behind the leader before 503 stale-read
_PAUSE = 0.1  # seconds between them


class Bounds(NamedTuple):
    """What the scratch models may hold and one request may do (the api's
    `--as-of-models`, `--as-of-max-events`)."""

    models: int = MAX_MODELS
    events: int = MAX_EVENTS
    held: int = MAX_HELD
    per_minute: int = PER_MINUTE  # 0: no bound


class Behind(AsOfError):
    """The replica that served the organization's events stayed behind the leader."""

    slug = "stale-read"


class TooCostly(AsOfError):
    """The request would fold more than its cap; what was folded is kept for the next."""

    slug = "as-of-too-costly"


def subjects(org: str, ws: str | None = None) -> list[str]:
    """What an organization's answers are folded from (events/codec.py), no other's: the
    organization aggregate's subject (its row), its workspaces' and their runs'; with
    `ws`, that workspace's and its runs' alone. None of the organization's other subjects
    (`rp.org.<org>.>`: notifications and their deliveries, VCS connections and
    deliveries, chat, schedules, run triggers, token uses) writes a row these answers
    read, nor does a workspace's write one of another workspace's answers."""
    if ws is not None:
        return [f"rp.org.{org}", f"rp.ws.{org}.{ws}", f"rp.run.{org}.{ws}.>"]
    return [f"rp.org.{org}", f"rp.ws.{org}.>", f"rp.run.{org}.>"]


@dataclass
class Scratch:
    """One organization's read model folded up to `upto` (every event of its at or below
    `upto` is in, none above); with `ws`, that workspace's (`subjects(org, ws)`) only."""

    org: str
    ws: str | None
    path: Path
    db: aiosqlite.Connection  # the writer
    read: ReadModel
    upto: int = 0  # the sequence the model is as of
    folded: int = 0  # the last sequence of the organization's folded (its checkpoint)
    events: int = 0  # events folded into it
    used: float = field(default_factory=time.monotonic)
    broken: bool = False  # a fill failed half-written: closed, never answered from

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.read.close()
        with contextlib.suppress(Exception):
            await self.db.close()
        for suffix in ("", "-wal", "-shm"):
            Path(f"{self.path}{suffix}").unlink(missing_ok=True)


class PastModels:
    """The cache of scratch read models, and the mapping of times to sequences."""

    def __init__(
        self,
        nc: NATS,
        *,
        stream: str = EVENTS,
        max_models: int = MAX_MODELS,
        max_events: int = MAX_EVENTS,
        max_held: int = MAX_HELD,
        per_minute: int = 0,
        directory: Path | None = None,
    ) -> None:
        self.nc = nc
        self.stream = stream
        self.max_models = max(1, max_models)
        self.max_events = max(1, max_events)
        self.max_held = max_held
        self.per_minute = per_minute  # events an organization may fold a minute; 0: any
        self._spent: dict[str, tuple[float, int]] = {}  # org -> (its minute's start, folded)
        self._dir = Path(tempfile.mkdtemp(prefix="rp-asof-", dir=directory))
        self._models: OrderedDict[int, Scratch] = OrderedDict()  # least recently used first
        self._locks: dict[str, asyncio.Lock] = {}
        self._ids = itertools.count(1)
        self._closing: set[asyncio.Task[None]] = set()
        self.built = 0  # models started from sequence 1 (for tests and figures)
        self.advanced = 0  # models moved forward
        self.behind = 0  # reads that came from a replica behind the leader, read again

    async def close(self) -> None:
        for task in list(self._closing):
            await task
        for s in list(self._models.values()):
            await s.close()
        self._models.clear()
        shutil.rmtree(self._dir, ignore_errors=True)

    async def resolve(self, raw: str, *, now: datetime | None = None) -> int:
        """The stream sequence `raw` names (module's `resolve`)."""
        return await resolve(self.nc, raw, stream=self.stream, now=now)

    # ------------------------------------------------------------ the models

    @contextlib.asynccontextmanager
    async def at(self, org: str, seq: int, ws: str | None = None) -> AsyncIterator[ReadModel]:
        """The organization's read model as of `seq` (with `ws`: one that holds at least
        that workspace's answers), for the context's reads (the organization's other
        as_of requests wait meanwhile)."""
        lock = self._locks.setdefault(org, asyncio.Lock())
        async with lock:
            if not any(
                m.org == org and m.upto == seq and m.ws in (None, ws) for m in self._models.values()
            ):
                self._afford(org)  # (a cached answer costs nothing: always given)
            s = await self._model(org, ws, seq)
            before = s.events
            try:
                await self._advance(s, seq, self._allowance(org))
            except BaseException:
                if s.broken:
                    self._drop(s)
                raise
            finally:
                self._spend(org, s.events - before)
                s.used = time.monotonic()
                self._trim(keep=s)
            yield s.read

    def _afford(self, org: str) -> None:
        """TooCostly if the organization's requests folded `per_minute` events within
        the minute: the cap of one request does not bound a tenant asking back to back
        (each as of an earlier sequence starts a model over from sequence 1)."""
        start, spent = self._spent.get(org, (0.0, 0))
        if self.per_minute and time.monotonic() - start < _WINDOW and spent >= self.per_minute:
            raise TooCostly(
                f"organization {org}'s as_of requests folded {spent} events within the "
                f"minute (at most {self.per_minute}): ask again later"
            )

    def _allowance(self, org: str) -> int:
        """What one request of the organization may fold: `max_events`, and no more than
        is left of its minute's `per_minute` (at least 1: `_afford` let it start)."""
        start, spent = self._spent.get(org, (0.0, 0))
        if not self.per_minute or time.monotonic() - start >= _WINDOW:
            return self.max_events
        return max(1, min(self.max_events, self.per_minute - spent))

    def _spend(self, org: str, events: int) -> None:
        now = time.monotonic()
        start, spent = self._spent.get(org, (0.0, 0))
        if now - start >= _WINDOW:
            start, spent = now, 0
        self._spent[org] = (start, spent + max(0, events))

    async def _model(self, org: str, ws: str | None, seq: int) -> Scratch:
        """The cached model to move forward to `seq` (a model never goes back), or a new
        one. In order: one already at `seq` that holds the answers (the organization's
        serves a workspace's too); the nearest below of the same scope; for a workspace,
        the organization's if at most `_NEAR` sequences below (cheaper to move than a
        workspace's is to build)."""

        def pick(fits: Callable[[Scratch], bool]) -> tuple[int, Scratch] | None:
            found = [(k, s) for k, s in self._models.items() if s.org == org and fits(s)]
            return max(found, key=lambda ks: ks[1].upto, default=None)

        best = (
            pick(lambda s: s.upto == seq and s.ws in (None, ws))
            or pick(lambda s: s.ws == ws and s.upto <= seq)
            or (pick(lambda s: s.ws is None and seq - _NEAR <= s.upto <= seq) if ws else None)
        )
        if best is not None:
            self._models.move_to_end(best[0])
            return best[1]
        s = await self._new(org, ws)
        self._models[next(self._ids)] = s
        return s

    async def _new(self, org: str, ws: str | None) -> Scratch:
        path = self._dir / f"{org}-{ws or ''}-{next(self._ids)}.sqlite"
        db, read = await _open(path)
        self.built += 1
        return Scratch(org=org, ws=ws, path=path, db=db, read=read)

    async def run_workspace(self, org: str, run_id: str, seq: int) -> str | None:
        """The workspace of the organization's run `run_id` if it existed at `seq` (its
        first event's subject, `rp.run.<org>.<ws>.<run>`, as the stream's leader has it),
        else None. `run_id` is a checked id: one subject token, no wildcard."""
        first = await leader_get(
            self.nc, self.stream, as_raw, subject=f"rp.run.{org}.*.{run_id}", seq=1, what=run_id
        )
        if first is None or first.seq > seq:
            return None
        return first.subject.split(".")[3]

    async def _advance(self, s: Scratch, seq: int, allowance: int | None = None) -> None:
        """Fold the organization's events in (`s.upto`, `seq`] into `s`, at most
        `allowance` (default `max_events`) of them, the reads again of a replica behind
        included (TooCostly past that, `s` kept where it got to). A new model is filled as
        replay fills (projections/fill.py: folded on the event loop while a thread
        writes), a cached one moved on by the projector's `apply_batch`."""
        if seq <= s.upto:
            return
        self.advanced += 1
        cap = s.events + (self.max_events if allowance is None else allowance)
        if s.events == 0:
            await self._fill_new(s, seq, cap)
        else:
            await self._read(s, seq, lambda batch: self._apply(s, batch), cap)
        for _ in range(_TRIES):
            if not await self._missed(s, seq):
                s.upto = seq
                return
            # The consumer was served by a replica behind the leader (a consumer of one
            # replica is placed on any server of the stream): what it gave is a whole
            # prefix, the rest comes once that replica has it.
            self.behind += 1
            await asyncio.sleep(_PAUSE)
            await self._read(s, seq, lambda batch: self._apply(s, batch), cap)
        raise Behind(
            f"the event stream's replica serving as_of {seq} is behind its leader; "
            f"sequence {s.upto} reached, try again"
        )

    async def _missed(self, s: Scratch, seq: int) -> bool:
        """Whether the stream's leader has an event of the organization after what `s`
        holds and at or before `seq` (one question per subject filter)."""
        for subject in subjects(s.org, s.ws):
            got = await leader_get(
                self.nc, self.stream, as_raw, subject=subject, seq=s.upto + 1, what=subject
            )
            if got is not None and got.seq <= seq:
                return True
        return False

    async def _read(
        self,
        s: Scratch,
        seq: int,
        apply: Callable[[list[Delivered]], Awaitable[None]],
        cap: int,
    ) -> None:
        """Hand `apply` the organization's events after `s.upto` up to `seq`, in batches,
        until `s.events` reaches `cap` (the request's budget: a read again after a replica
        behind spends the same one). Read by an ordered consumer of the organization's
        subjects, to the first message past `seq` or the stream's end as it was when the
        consumer was made."""
        budget = cap - s.events
        reader = OrderedReader(
            self.nc, self.stream, start_seq=s.upto + 1, filter_subjects=subjects(s.org, s.ws)
        )
        async with reader:
            left = reader.pending
            while left > 0:
                msgs = await reader.next_batch(min(_BATCH, left), timeout=_FETCH_TIMEOUT)
                left -= len(msgs)
                batch = [m for m in msgs if m.seq <= seq]
                if len(batch) > budget:
                    await apply(batch[:budget])
                    raise TooCostly(
                        f"as_of {seq} needs more events of organization {s.org} folded "
                        f"than one request may fold now (at most {self.max_events}, and "
                        "what is left of the minute's); what was folded is kept: ask "
                        "again to go on"
                    )
                await apply(batch)
                budget -= len(batch)
                if len(batch) < len(msgs):  # one past `seq`
                    break

    async def _fill_new(self, s: Scratch, seq: int, cap: int) -> None:
        """Fill a new model with the replay's writer; reopen it for reads and for moving
        on. A failure but TooCostly leaves it `broken` (the writer keeps no journal)."""
        await s.read.close()
        await s.db.close()
        writer = Writer(s.path)
        filler = Filler(writer)

        async def apply(batch: list[Delivered]) -> None:
            await filler.apply(batch)
            s.events += len(batch)

        try:
            await writer.open()
            try:
                await self._read(s, seq, apply, cap)
            finally:
                await filler.drain()
                s.folded = filler.seq
                s.upto = max(s.upto, s.folded)
        except TooCostly:
            raise
        except BaseException:
            s.broken = True
            raise
        finally:
            filler.abandon()
            await writer.close()
            if not s.broken:
                s.db, s.read = await _open(s.path)

    async def _apply(self, s: Scratch, batch: list[Delivered]) -> None:
        """Fold a batch (one transaction): the model is then whole as of its last event,
        whatever fails after (`upto` never below what is folded)."""
        if batch:
            await apply_batch(s.db, batch, after=s.folded)
            s.folded = max(s.folded, batch[-1].seq)
            s.upto = max(s.upto, s.folded)
            s.events += len(batch)

    def _drop(self, s: Scratch) -> None:
        for key, model in list(self._models.items()):
            if model is s:
                del self._models[key]
        self._close_later(s)

    def _close_later(self, s: Scratch) -> None:
        self._closing.add(task := asyncio.get_running_loop().create_task(s.close()))
        task.add_done_callback(self._closing.discard)

    def _trim(self, *, keep: Scratch) -> None:
        """Close models beyond the bounds: never `keep`, nor one of another organization
        whose request is under way (it may be reading it). The victim is the least
        recently used model of the organization holding the most (models over the count,
        events over `max_held`): an organization asking as of ever earlier sequences
        (each a new model) closes its own, never the one another's answer goes on from."""
        while True:
            by_count = len(self._models) > self.max_models
            if not by_count and sum(m.events for m in self._models.values()) <= self.max_held:
                return
            share: dict[str, int] = {}
            for m in self._models.values():
                share[m.org] = share.get(m.org, 0) + (1 if by_count else m.events)
            eligible = [
                (k, v)
                for k, v in self._models.items()  # least recently used first
                if v is not keep and (v.org == keep.org or not self._locks[v.org].locked())
            ]
            if not eligible:
                return
            key, victim = max(eligible, key=lambda kv: share[kv[1].org])  # first of the most
            del self._models[key]
            self._close_later(victim)


async def _open(path: Path) -> tuple[aiosqlite.Connection, ReadModel]:
    """A model's writer (the schema made if new) and its reader."""
    db = await schema.connect(path)
    try:
        await db.execute("PRAGMA synchronous = OFF")  # scratch: thrown away at the end
        return db, await ReadModel.open(path)
    except BaseException:
        await db.close()
        raise
