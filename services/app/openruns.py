"""Open runs per organization and per workspace: a quota on what a tenant keeps waiting.

Every way to start a run (the API, the Terraform CLI, webhooks, schedules, triggers,
Slack) goes through `RunFlows.create_run`, which reserves the run here first. The
ledger is one key per organization in the `rp-open-runs` bucket: the runs reserved, as
`[workspace, run, reserved at]`, moved with optimistic concurrency so that replicas
agree. A run is never taken out when it ends (that would be one more write on every
run's end); instead, when a reservation finds a limit reached, the ledger is pruned:
each run reserved more than GRACE seconds ago is looked up and dropped if it has ended
or was never created. Only if the limit is still reached is the run refused
(`QuotaExceeded`, a 429 `quota-exceeded`). A process prunes an organization's ledger at
most once per PRUNE_EVERY seconds, so refusals that keep coming cost no lookups.
Speculative plans count like the rest.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import msgspec
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from events.errors import Conflict, QuotaExceeded
from infra.kv import OPEN_RUNS_BUCKET

GRACE = 60.0  # a reservation this young may be a create still in flight: kept
PRUNE_EVERY = 2.0
ATTEMPTS = 20  # writes lost to another replica's before giving up (a 503)
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

    def full(self, ws: str, limits: Limits) -> str:
        """Which limit a new run of `ws` would pass ("" none)."""
        if len(self.runs) >= limits.org:
            return f"the organization has {len(self.runs)} open runs, the most it may"
        n = sum(1 for w, _, _ in self.runs if w == ws)
        if n >= limits.workspace:
            return f"workspace {ws} has {n} open runs, the most it may"
        return ""


_decode = msgspec.json.Decoder(Ledger).decode


class OpenRuns:
    """The ledger of open runs (see the module's docstring)."""

    def __init__(self, js: JetStreamContext, limits: Limits, is_open: IsOpen) -> None:
        self.js = js
        self._kv: KeyValue | None = None
        self.limits = limits
        self.is_open = is_open
        self._pruned: dict[str, float] = {}  # org -> when this process last pruned it
        self._locks: dict[str, asyncio.Lock] = {}  # org -> its reservations in this process

    async def reserve(self, org: str, ws: str, run_id: str) -> None:
        """Count the run as open, or raise QuotaExceeded if a limit is reached. A
        process's reservations of one organization go one at a time: racing each other
        on the key they would only retry; replicas still race, and retry."""
        lock = self._locks.setdefault(org, asyncio.Lock())
        async with lock:
            await self._reserve(org, ws, run_id)
        if not lock.locked() and self._locks.get(org) is lock:
            del self._locks[org]

    async def _reserve(self, org: str, ws: str, run_id: str) -> None:
        for _ in range(ATTEMPTS):
            ledger, revision = await self._read(org)
            if ledger.holds(run_id):
                return
            why = ledger.full(ws, self.limits)
            if why:
                ledger = await self._pruned_of(org, ledger)
                why = ledger.full(ws, self.limits)
                if why:
                    raise QuotaExceeded(f"{why}: a new run waits until one ends")
            runs = [*ledger.runs, (ws, run_id, time.time())]
            if await self._write(org, Ledger(runs), revision):
                return
        raise Conflict(f"the open-runs ledger of {org} changed {ATTEMPTS} times meanwhile")

    async def _bucket(self) -> KeyValue:
        if self._kv is None:
            self._kv = await self.js.key_value(OPEN_RUNS_BUCKET)
        return self._kv

    async def _read(self, org: str) -> tuple[Ledger, int]:
        kv = await self._bucket()
        try:
            entry = await kv.get(org)
        except nats.js.errors.KeyNotFoundError:
            return Ledger(), 0
        return (_decode(entry.value) if entry.value else Ledger()), entry.revision or 0

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
        """The ledger without the runs that ended (this process's view: written by the
        next reservation's compare-and-set)."""
        now = time.monotonic()
        if now - self._pruned.get(org, -PRUNE_EVERY) < PRUNE_EVERY:
            return ledger
        self._pruned[org] = now
        cutoff = time.time() - GRACE
        kept = [(w, r, t) for w, r, t in ledger.runs if t > cutoff or await self.is_open(org, w, r)]
        return Ledger(kept)
