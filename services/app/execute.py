"""One way to write: load an aggregate at its subject, decide, append at the sequence it
was loaded at; a conflict decides again on a fresh load, under one retry policy.

An `Aggregate` is the core's pure pair for one kind of subject (`fold` and `decide`, with
the state it starts from); services/app/aggregates.py lists them all. `Repository.execute`
is the load-decide-append loop every single-aggregate command goes through, the
application's own (org, workspace) and the processes' (chat-ops, schedules, run triggers,
notification and VCS configurations) alike. Flows that span two aggregates
(services/app/commands.py: create and enqueue, admit, pin, release) use its `load`,
`appends` and `retrying` and order their appends so that a crash between them is healed.

A retry after a conflict loads as the stream's leader has it (`LATEST`): the conflict
proved that someone wrote past what was read, and a follower that was behind could
answer the same stale read again.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Generic, TypeVar

import msgspec

from events.errors import Conflict
from infra.eventstore import LATEST, Append, EventStore
from infra.folds import States

S = TypeVar("S")
C = TypeVar("C")
T = TypeVar("T")

ATTEMPTS = 20  # conflicts one command may meet before the last one is raised


class Loaded(msgspec.Struct, Generic[S], frozen=True, kw_only=True):
    """An aggregate as read: its subject (the real one, when read by wildcard), the last
    sequence on it (0 if none) and its state folded through every event there."""

    subject: str
    seq: int
    state: S


class Result(msgspec.Struct, Generic[S], frozen=True, kw_only=True):
    """What a command did: the new state of the aggregate and the last stream sequence."""

    state: S
    seq: int
    events: list[Any] = []
    existed: bool = False  # nothing was written: the (derived) id's run was there already


Decide = Callable[[S, C, datetime, Callable[[], str]], Sequence[Any]]


@dataclass(frozen=True)
class Aggregate(Generic[S, C]):
    """The core's functions for one kind of aggregate, as the shell drives them."""

    name: str
    initial: S
    fold: Callable[[Sequence[Any], S], S]
    decide: Decide[S, C]


class Repository:
    """Loads and appends aggregates on one event store, through the process's one
    repository of folded states (infra/folds.py: a load folds only what is new); `clock`
    and `ids` are injected so tests can pin them."""

    def __init__(
        self,
        store: EventStore,
        *,
        clock: Callable[[], datetime],
        ids: Callable[[], str],
        attempts: int = ATTEMPTS,
        states: States | None = None,
    ) -> None:
        self.store = store
        self.states = states or States(store)
        self.clock = clock
        self.ids = ids
        self.attempts = attempts

    async def load(self, agg: Aggregate[S, Any], subject: str, *, min_seq: int = 0) -> Loaded[S]:
        """The aggregate at `subject` (wildcards allowed: the first match's subject is
        answered), as of a stream at least at `min_seq` (`LATEST`: as its leader has it)."""
        real, seq, state = await self.states.load(
            agg.name, subject, agg.fold, agg.initial, min_seq=min_seq
        )
        return Loaded(subject=real, seq=seq, state=state)

    async def append(self, appends: list[Append]) -> int:
        """Append (`EventStore.append`); a conflict forgets what this process kept of the
        subjects, which are read whole next time."""
        try:
            return await self.store.append(appends)
        except Conflict:
            for a in appends:
                self.states.forget(a.subject)
            raise

    def appends(self, subject: str, seq: int, events: Sequence[Any]) -> list[Append]:
        """Checked appends of `events` after sequence `seq` of `subject`."""
        return [
            Append(subject=subject, event=e, expected=seq + i, msg_id=self.ids())
            for i, e in enumerate(events)
        ]

    async def retrying(self, attempt: Callable[[], Awaitable[T]]) -> T:
        """Run `attempt` until it does not meet a Conflict, at most `attempts` times, with
        a short random pause between (writers that collided do not collide again)."""
        for i in range(self.attempts):
            try:
                return await attempt()
            except Conflict:
                if i == self.attempts - 1:
                    raise
                await asyncio.sleep(random.uniform(0, 0.002 * (2 ** min(i, 6))))
        raise AssertionError("unreachable")

    async def execute(
        self,
        agg: Aggregate[S, C],
        subject: str,
        command: C,
        *,
        guard: Callable[[S], None] | None = None,
    ) -> Result[S]:
        """Load, decide and append one command; a decision of nothing appends nothing and
        answers the state as loaded. `guard` sees the state the command is decided on (on
        every try) and may raise a DomainError to refuse it."""
        tries = 0

        async def attempt() -> Result[S]:
            nonlocal tries
            tries += 1
            cur = await self.load(agg, subject, min_seq=LATEST if tries > 1 else 0)
            if guard is not None:
                guard(cur.state)
            evs = list(agg.decide(cur.state, command, self.clock(), self.ids))
            if not evs:
                return Result(state=cur.state, seq=cur.seq)
            seq = await self.append(self.appends(cur.subject, cur.seq, evs))
            state = agg.fold(evs, cur.state)
            self.states.remember(agg.name, subject, seq, state, real=cur.subject)
            return Result(state=state, seq=seq, events=evs)

        return await self.retrying(attempt)
