"""Reads through a follower that is behind, on a real cluster (tests/cluster_support.py):
`Lagging` holds a writer on a stream's leader and a reader on one of its followers, and
stops the follower around a burst of writes; `trials` reads each write back through the
old path and the new ones until the old path came out stale `MIN_STALE` times, and
tallies what each saw (`Tally`; a read that fails, one of `NO_ANSWER`, is counted
apart). Used by tests/test_stale_reads.py and tests/ui/test_ui_sessions.py. Holds no
tests itself."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

import nats
from nats.aio.client import Client as NATS

from executor.statestore import StateStoreError
from infra import kv
from infra.eventstore import StoreError
from infra.heartbeats import BoardError
from tests.cluster_support import NatsCluster, Node

BURST = 500  # writes before the one that matters: the follower has them all to catch up
PAYLOAD = b"x" * 1000
MIN_STALE = 3  # old-path stale reads wanted before a reader's trials stop
MAX_TRIALS = 200
# A read that fails decides nothing: counted apart, never as stale or fresh.
NO_ANSWER = (BoardError, StoreError, kv.KvError, StateStoreError, TimeoutError)


@dataclass
class Tally:
    trials: int = 0
    old_stale: int = 0
    old_failed: int = 0
    new_stale: dict[str, int] = field(default_factory=dict)
    new_failed: dict[str, int] = field(default_factory=dict)

    def line(self, name: str) -> str:
        return (
            f"{name}: old path stale {self.old_stale}/{self.trials} "
            f"({100 * self.old_stale / max(self.trials, 1):.0f}%, {self.old_failed} unanswered), "
            "new path stale "
            f"{self.new_stale}, refused {self.new_failed}"
        )


class Lagging:
    """A writer on the leader of `stream`, a reader on one of its followers only."""

    def __init__(self, cluster: NatsCluster, stream: str) -> None:
        self.cluster = cluster
        self.stream = stream

    async def __aenter__(self) -> Lagging:
        leader = await self.cluster.stream_leader(self.stream)
        self.follower: Node = next(n for n in self.cluster.nodes if n is not leader)
        auth = self.cluster.auth.connect_options()
        self.writer: NATS = await nats.connect(leader.url, **auth)
        self.reader: NATS = await nats.connect(self.follower.url, **auth)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.writer.close()
        await self.reader.close()

    async def behind(
        self, burst: Callable[[int], Awaitable[object]], write: Callable[[], Awaitable[int]]
    ) -> int:
        """Stop the follower, write a burst and then `write` on the leader, resume it."""
        proc = self.follower.proc
        assert proc is not None
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            await asyncio.gather(*(burst(j) for j in range(BURST)))
            return await write()
        finally:
            os.kill(proc.pid, signal.SIGCONT)


async def trials(
    lag: Lagging,
    burst: Callable[[int], Awaitable[object]],
    write: Callable[[int], Awaitable[int]],
    old: Callable[[int], Awaitable[bool]],
    new: Mapping[str, Callable[[int, int], Awaitable[bool]]],
) -> Tally:
    """Until the old path was stale MIN_STALE times (or MAX_TRIALS): each read returns
    whether it saw trial i's write."""
    tally = Tally(new_stale=dict.fromkeys(new, 0), new_failed=dict.fromkeys(new, 0))
    while tally.old_stale < MIN_STALE and tally.trials < MAX_TRIALS:
        i = tally.trials
        seq = await lag.behind(burst, lambda i=i: write(i))  # type: ignore[misc]
        reads = [old(i), *(read(i, seq) for read in new.values())]
        seen = await asyncio.gather(*reads, return_exceptions=True)
        tally.trials += 1
        if isinstance(seen[0], NO_ANSWER):
            tally.old_failed += 1
        elif isinstance(seen[0], BaseException):
            raise seen[0]
        else:
            tally.old_stale += not seen[0]
        for name, result in zip(new, seen[1:], strict=True):
            if isinstance(result, NO_ANSWER):
                tally.new_failed[name] += 1
            elif isinstance(result, BaseException):
                raise result
            else:
                tally.new_stale[name] += not result
    return tally
