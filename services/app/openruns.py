"""Open runs per organization and per workspace: a quota on what a tenant keeps waiting.

Every way to start a run (the API, the Terraform CLI, webhooks, schedules, triggers,
Slack) goes through `RunFlows.create_run`, which reserves the run here once its
workspace is known to take it, before `run.created`. The ledger is one key per
organization in the `rp-open-runs` bucket: the runs reserved, as `[workspace, run,
reserved at]`, moved with optimistic concurrency (with a jittered back-off, reading from
the stream's leader after a lost write) so that replicas agree. One process writes an
organization's ledger one write at a time, and what its callers ask meanwhile (creates
racing, the scheduler's releases of runs ending together) waits and goes in the next
write together, each reservation judged in turn against the ledger as the ones before
it left it: a burst of N creates costs a few writes of the ledger, not N (each write is
the whole ledger, ~55 bytes a run). The scheduler takes a run out when it ends
(`release`). Should a release be lost (a scheduler killed at that line), a
reservation that finds a limit reached prunes the ledger first: each run reserved more
than GRACE seconds ago is looked up (PRUNE_AT_ONCE at a time) and dropped if it has
ended or was never created, and the pruned ledger is written at once. Only if the
limit is still reached is the run refused (`QuotaExceeded`, a 429 `quota-exceeded`);
a prune that freed nothing is not tried again by this process for PRUNE_EVERY seconds,
so refusals that keep coming cost no lookups. Speculative plans count like the rest.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import msgspec
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from events.errors import Conflict, QuotaExceeded
from infra.kv import OPEN_RUNS_BUCKET

GRACE = 60.0  # a reservation this young may be a create still in flight: kept
PRUNE_EVERY = 2.0
PRUNE_AT_ONCE = 16  # runs looked up at once by a prune
ATTEMPTS = 30  # writes lost to another replica's before giving up (a 503)
ORG_MAX_OPEN_RUNS = 500
WORKSPACE_MAX_OPEN_RUNS = 100

IsOpen = Callable[[str, str, str], Awaitable[bool]]  # (org, workspace, run) -> open


@dataclass(frozen=True)
class Limits:
    org: int = ORG_MAX_OPEN_RUNS
    workspace: int = WORKSPACE_MAX_OPEN_RUNS


class Ledger(msgspec.Struct, frozen=True):
    runs: list[tuple[str, str, float]] = []

    def holds(self, run_id: str) -> bool:
        return any(r == run_id for _, r, _ in self.runs)

    def without(self, run_id: str) -> Ledger:
        return Ledger([e for e in self.runs if e[1] != run_id])

    def full(self, ws: str, limits: Limits) -> str:
        """Which limit a new run of `ws` would pass ("" none)."""
        if len(self.runs) >= limits.org:
            return f"the organization has {len(self.runs)} open runs, the most it may"
        n = sum(1 for w, _, _ in self.runs if w == ws)
        if n >= limits.workspace:
            return f"workspace {ws} has {n} open runs, the most it may"
        return ""


_decode = msgspec.json.Decoder(Ledger).decode


@dataclass(eq=False)
class _Ask:
    """One caller's change, waiting for its organization's next write."""

    run_id: str
    ws: str = ""  # a reservation's workspace; "" a release
    done: asyncio.Future[None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


class OpenRuns:
    """The ledger of open runs (see the module's docstring)."""

    def __init__(self, js: JetStreamContext, limits: Limits, is_open: IsOpen) -> None:
        self.js = js
        self._kv: KeyValue | None = None
        self.limits = limits
        self.is_open = is_open
        self._barren: dict[str, float] = {}  # org -> when a prune here last freed nothing
        self._asks: dict[str, list[_Ask]] = {}  # org -> what waits for its next write
        self._writers: dict[str, asyncio.Task[None]] = {}  # org -> its writes in this process

    async def reserve(self, org: str, ws: str, run_id: str) -> None:
        """Count the run as open, or raise QuotaExceeded if a limit is reached."""
        await self._ask(org, _Ask(run_id, ws))

    async def release(self, org: str, run_id: str) -> None:
        """Take an ended run out (nothing written if it is not in)."""
        await self._ask(org, _Ask(run_id))

    async def _ask(self, org: str, ask: _Ask) -> None:
        """`ask` in the organization's next write; its outcome. A caller cancelled
        meanwhile leaves it in (a reservation of a run never created is pruned)."""
        self._asks.setdefault(org, []).append(ask)
        if org not in self._writers:
            self._writers[org] = asyncio.create_task(self._write_asks(org))
        await asyncio.shield(ask.done)

    async def _write_asks(self, org: str) -> None:
        """Write what the organization's callers ask, a batch per write, until none waits."""
        asks: list[_Ask] = []
        try:
            while asks := self._asks.pop(org, []):
                try:
                    outcomes = await self._settle(org, asks)
                except Exception as e:  # noqa: BLE001 - each caller gets it, as from a write of its own
                    outcomes = [e] * len(asks)
                for ask, outcome in zip(asks, outcomes, strict=True):
                    if ask.done.done():
                        continue
                    if outcome is None:
                        ask.done.set_result(None)
                    else:
                        ask.done.set_exception(outcome)
        finally:  # cancelled (the process stops): no caller waits forever
            for ask in [*asks, *self._asks.pop(org, [])]:
                ask.done.cancel()
            del self._writers[org]

    async def _settle(self, org: str, asks: list[_Ask]) -> list[BaseException | None]:
        """One write of the ledger with `asks` in it, in order; each ask's outcome (a
        reservation past a limit: QuotaExceeded, and it is left out)."""
        outcomes: list[BaseException | None] = []

        async def change(ledger: Ledger) -> Ledger | None:
            outcomes.clear()
            before, pruned = ledger, False
            for ask in asks:
                if not ask.ws:
                    ledger = ledger.without(ask.run_id) if ledger.holds(ask.run_id) else ledger
                    outcomes.append(None)
                    continue
                if ledger.holds(ask.run_id):
                    outcomes.append(None)
                    continue
                if ledger.full(ask.ws, self.limits) and not pruned:
                    ledger, pruned = await self._pruned_of(org, ledger), True
                if why := ledger.full(ask.ws, self.limits):
                    outcomes.append(QuotaExceeded(f"{why}: a new run waits until one ends"))
                    continue
                ledger = Ledger([*ledger.runs, (ask.ws, ask.run_id, time.time())])
                outcomes.append(None)
            return None if ledger is before or ledger.runs == before.runs else ledger

        await self._change(org, change)
        return outcomes

    async def _change(self, org: str, change: Callable[[Ledger], Awaitable[Ledger | None]]) -> None:
        """Read, change (None: nothing to write), write if unchanged since; again after
        a lost write, from the leader, after a jittered pause."""
        for attempt in range(ATTEMPTS):
            ledger, revision = await self._read(org, leader=attempt > 0)
            changed = await change(ledger)
            if changed is None or await self._write(org, changed, revision):
                return
            await asyncio.sleep(random.uniform(0, min(0.2, 0.002 * 2**attempt)))
        raise Conflict(f"the open-runs ledger of {org} changed {ATTEMPTS} times meanwhile")

    async def _bucket(self) -> KeyValue:
        if self._kv is None:
            self._kv = await self.js.key_value(OPEN_RUNS_BUCKET)
        return self._kv

    async def _read(self, org: str, *, leader: bool = False) -> tuple[Ledger, int]:
        kv = await self._bucket()
        try:
            if leader:  # a follower may not have the write this one lost to
                raw = await self.js.get_msg(
                    f"KV_{OPEN_RUNS_BUCKET}", subject=f"$KV.{OPEN_RUNS_BUCKET}.{org}"
                )
                value, revision = raw.data, raw.seq or 0
                if raw.headers and raw.headers.get("KV-Operation") in ("DEL", "PURGE"):
                    value = b""
            else:
                entry = await kv.get(org)
                value, revision = entry.value, entry.revision or 0
        except (nats.js.errors.KeyNotFoundError, nats.js.errors.NotFoundError):
            return Ledger(), 0
        return (_decode(value) if value else Ledger()), revision

    async def _write(self, org: str, ledger: Ledger, revision: int) -> bool:
        data, kv = msgspec.json.encode(ledger), await self._bucket()
        try:
            if revision:
                await kv.update(org, data, last=revision)
            else:
                await kv.create(org, data)
        except (nats.js.errors.KeyWrongLastSequenceError, nats.js.errors.BadRequestError):
            return False  # another replica's write came first: read again
        return True

    async def _pruned_of(self, org: str, ledger: Ledger) -> Ledger:
        """The ledger without the runs that ended (written by the caller's
        compare-and-set, or read again if that loses)."""
        now = time.monotonic()
        if now - self._barren.get(org, -PRUNE_EVERY) < PRUNE_EVERY:
            return ledger
        cutoff, gate = time.time() - GRACE, asyncio.Semaphore(PRUNE_AT_ONCE)

        async def keep(entry: tuple[str, str, float]) -> bool:
            if entry[2] > cutoff:
                return True
            async with gate:
                return await self.is_open(org, entry[0], entry[1])

        kept = await asyncio.gather(*(keep(e) for e in ledger.runs))
        pruned = Ledger([e for e, k in zip(ledger.runs, kept, strict=True) if k])
        if len(pruned.runs) == len(ledger.runs):
            self._barren[org] = now
        return pruned
