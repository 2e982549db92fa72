"""One repository of aggregates as folded: per aggregate and subject, the last few
`(seq, state)` pairs this process read, folded or wrote. A load fetches only the events
after the newest pair and folds only those; the stream denies delete and purge, so what a
subject held through a sequence never changes, and a pair once right stays right.

Every reader of state in a process goes through the one `States` its bootstrap builds:
the application's commands load the latest state and remember what they appended (a run
this process wrote last is commanded with no read at all: the append's expected sequence
proves it current), and a consumer folds an aggregate through the event it delivers
(`through`), which may be behind what a writer of the same process has appended since;
the short trail of pairs lets it fold on from the nearest one instead of from scratch.
A conflict on an append forgets the subject: whatever this process knew of it is read
again whole.

The subscribers process runs several consumers over the same run events, each folding
the run through each event: the first reads, the others take the state it kept at that
very event (or wait for its read when it is under way) and read nothing. A run event
cost the process a direct get per subscription; it costs one.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

from infra.eventstore import EventStore

S = TypeVar("S")
Fold = Callable[[Sequence[Any], S], S]

KEPT = 10_000  # aggregates kept, least recently used dropped first
TRAIL = 4  # (seq, state) pairs kept per aggregate, newest last


class States:
    """Aggregates as last folded, loaded from one event store. An aggregate is named by
    its kind (`kind`: two kinds may fold events of one subject) and subject."""

    def __init__(self, store: EventStore, *, kept: int = KEPT, trail: int = TRAIL) -> None:
        self.store = store
        self.kept = kept
        self.trail = trail
        # (kind, subject) -> (the real subject: a wildcard's match, [(seq, state)] ascending)
        self._kept: OrderedDict[tuple[str, str], tuple[str, list[tuple[int, Any]]]] = OrderedDict()
        # (kind, subject, seq) -> the state through seq, while one `through` reads it
        self._folding: dict[tuple[str, str, int], asyncio.Future[Any]] = {}

    def peek(self, kind: str, subject: str) -> tuple[str, int, Any] | None:
        """The newest `(real subject, seq, state)` kept of an aggregate, with no read."""
        found = self._kept.get((kind, subject))
        if found is None:
            return None
        real, pairs = found
        return real, pairs[-1][0], pairs[-1][1]

    def remember(self, kind: str, subject: str, seq: int, state: Any, *, real: str = "") -> None:
        """Note an aggregate at `seq` (as just written, read or folded)."""
        if ">" in subject or seq <= 0:
            return
        key = (kind, subject)
        found = self._kept.get(key)
        pairs = found[1] if found is not None else []
        if any(s == seq for s, _ in pairs):
            self._kept.move_to_end(key)
            return
        pairs = sorted([*pairs, (seq, state)], key=lambda p: p[0])[-self.trail :]
        self._kept[key] = (real or (found[0] if found else subject), pairs)
        self._kept.move_to_end(key)
        while len(self._kept) > self.kept:
            self._kept.popitem(last=False)

    def forget(self, subject: str) -> None:
        """Drop every kind kept of `subject` (after a conflict: read it whole next time)."""
        for key in [k for k in self._kept if k[1] == subject or self._kept[k][0] == subject]:
            del self._kept[key]

    async def load(
        self, kind: str, subject: str, fold: Fold[S], initial: S, *, min_seq: int = 0
    ) -> tuple[str, int, S]:
        """The aggregate's `(real subject, last seq, state)`, as of a stream at least at
        `min_seq` (wildcards allowed: the first match's subject is answered)."""
        found = self._kept.get((kind, subject))
        real, since, state = subject, 0, initial
        if found is not None:
            real, pairs = found
            since, state = pairs[-1][0], cast(S, pairs[-1][1])
        envs = await self.store.read(subject, after=since, min_seq=min_seq)
        if envs:
            real = envs[-1].subject
            state = fold([e.event for e in envs], state)
            self.remember(kind, subject, envs[-1].seq, state, real=real)
            since = envs[-1].seq
        elif (kind, subject) in self._kept:  # evicted or forgotten during the read: gone
            self._kept.move_to_end((kind, subject))
        return real, since, state

    async def through(
        self, kind: str, subject: str, seq: int, fold: Fold[S], initial: S, *, reuse: bool = False
    ) -> tuple[S, int]:
        """The aggregate folded through `seq` (not later) and the last sequence on its
        subject now known; folded on from the newest pair kept at or before `seq`.

        `reuse`: a state kept at `seq` itself (folded through this very event already, e.g.
        by another consumer of the process) is answered with no read, and so is one another
        `through` of the same event is reading; the last sequence is then 0, not known (no
        read now said what is latest: a caller that needs it, the scheduler, reads)."""
        if not reuse:
            return await self._through(kind, subject, seq, fold, initial)
        found = self._kept.get((kind, subject))
        for s, st in found[1] if found is not None else ():
            if s == seq:
                return cast(S, st), 0
        key = (kind, subject, seq)
        if (reading := self._folding.get(key)) is not None:
            shared = await asyncio.shield(reading)
            if shared is not None:
                return cast(S, shared), 0
            return await self._through(kind, subject, seq, fold, initial)
        mine: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._folding[key] = mine
        try:
            at, last = await self._through(kind, subject, seq, fold, initial)
        except BaseException:
            mine.set_result(None)  # those waiting read for themselves
            raise
        finally:
            del self._folding[key]
        mine.set_result(at)
        return at, last

    async def _through(
        self, kind: str, subject: str, seq: int, fold: Fold[S], initial: S
    ) -> tuple[S, int]:
        found = self._kept.get((kind, subject))
        since, state = 0, initial
        for s, st in found[1] if found is not None else ():
            if s <= seq:
                since, state = s, cast(S, st)
        envs = await self.store.read(subject, after=since, min_seq=seq)
        upto = [e for e in envs if e.seq <= seq]
        at = fold([e.event for e in upto], state) if upto else state
        if upto:  # kept at the subject's own sequence: a writer's expected one
            self.remember(kind, subject, upto[-1].seq, at)
        later = [e.event for e in envs if e.seq > seq]
        if later:
            self.remember(kind, subject, envs[-1].seq, fold(later, at))
        return at, envs[-1].seq if envs else since
