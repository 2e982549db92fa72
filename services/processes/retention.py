"""Retention: the stored logs of runs that ended long enough ago are removed; the runs'
rows, steps, changes and events remain.

A pass (every `interval`, in the scheduler process beside the reaper) lists the stored
step logs (`rp-logs`, named `<run>/<phase>/<step>.log`) and judges each run that has any:

- a run not ended (any status but a terminal one) is left alone, whatever its age;
- a run that ended more than its organization's `log_retention_days` ago (the setting,
  else the deployment's `--log-retention-days`, 90 by default) first gets `run.log_pruned`
  on its own subject, naming every object it removes with its SHA-256: the intent is on
  the record (and, through the auditor, in the organization's audit chain) before
  anything is deleted. Then the objects are deleted and the run's live lines purged;
- a run that has the event and still objects (a pass killed between the two, or a
  replica that lost the race to record it) has them deleted again: deletion is
  idempotent, so a kill at any line leaves either nothing done or the deletion to finish.

The objects go only `grace` (GRACE_S) after the event: a log reader checks the event on
the stream's leader before its first byte and may read for READ_DEADLINE_S
(services/surfaces/api/runlog.py), so a read that began before the record answers the
whole log and one after it 410; none finds an object gone halfway (that answered 500
and hung its client). With the default interval, the objects go one pass later.

Two replicas racing record the event once: the append expects the run's last sequence,
and the core refuses a second `LogPruned` (events/run_decide.py `_prune_log`). Each
organization's setting applies to its own runs only: a run's organization is the one its
subject names. A chunk is purged before its object's meta is marked deleted, so an object
that is still listed always has its deletion to finish, never a chunk left behind.
"""

from __future__ import annotations

import asyncio
import time
from datetime import datetime, timedelta
from types import TracebackType

import msgspec
import nats.errors
import nats.js.errors
import structlog
from nats.aio.client import Client as NATS
from nats.js.api import ObjectInfo

from events.run import PrunedObject, PruneLog, RunState
from events.settings import LOG_RETENTION, days_problem
from infra.directget import InfraError
from infra.steplogs import READ_DEADLINE_S, log_subject
from infra.streams import LOGS, LOGS_BUCKET
from infra.tasks import cancel_and_wait
from services.app.commands import App
from services.processes.removal import Removals, delete_objects, hex_digest, record_once

log = structlog.get_logger(__name__)

ACTOR = "retention"
DEFAULT_DAYS = 90
INTERVAL_S = 3600.0
CONCURRENCY = 16
GRACE_S = READ_DEADLINE_S + 300.0  # a margin for the api's and the scheduler's clocks


class Report(msgspec.Struct, kw_only=True):
    """What one pass did: the runs whose logs it recorded as removed, the objects it
    deleted (its own and those a killed pass left), and how long it took."""

    pruned: list[str] = []
    deleted: int = 0
    kept: int = 0  # runs with stored logs it left (not ended, or not old enough)
    waiting: int = 0  # runs recorded whose objects wait out the readers' grace
    removed: list[str] = []  # runs whose whole record it recorded removed
    removed_objects: int = 0  # objects of removed runs it deleted
    referenced: int = 0  # runs due for removal but still referenced: kept
    seconds: float = 0.0


async def stored_logs(nc: NATS) -> dict[str, list[ObjectInfo]]:
    """Every stored step log not deleted, by run id."""
    store = await nc.jetstream().object_store(LOGS_BUCKET)
    try:
        infos = await store.list(ignore_deletes=True)
    except nats.js.errors.NotFoundError:
        return {}
    out: dict[str, list[ObjectInfo]] = {}
    for info in infos:
        if info.deleted or "/" not in info.name:
            continue
        out.setdefault(info.name.split("/", 1)[0], []).append(info)
    return out


class Retention:
    """`async with Retention(nc, app):` a pass every `interval` seconds until left."""

    def __init__(
        self,
        nc: NATS,
        app: App,
        *,
        default_days: int = DEFAULT_DAYS,
        interval: float = INTERVAL_S,
        concurrency: int = CONCURRENCY,
        grace: float = GRACE_S,
        record_days: int = 0,
    ) -> None:
        self.nc = nc
        self.app = app
        self.default_days = default_days
        self.interval = interval
        self.grace = timedelta(seconds=grace)
        self._slots = asyncio.Semaphore(concurrency)
        self.removals = Removals(
            nc, app, default_days=record_days, grace=self.grace, slots=self._slots
        )
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Retention:
        self._task = asyncio.create_task(self._loop(), name="retention")
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await cancel_and_wait(self._task)

    async def _loop(self) -> None:
        while True:
            try:
                report = await self.pass_once()
                log.info(
                    "retention_pass", pruned=len(report.pruned), deleted=report.deleted,
                    kept=report.kept, waiting=report.waiting, removed=len(report.removed),
                    removed_objects=report.removed_objects, referenced=report.referenced,
                    seconds=round(report.seconds, 3),
                )  # fmt: skip
            except (InfraError, nats.errors.Error, TimeoutError) as e:
                log.warning("retention_retry", error=repr(e))
            await asyncio.sleep(self.interval)

    async def pass_once(self) -> Report:
        """One pass over every run that has stored logs (see the module's docstring)."""
        started = time.monotonic()
        report = Report()
        now = self.app.clock()
        days: dict[str, int] = {}
        r = self.removals
        await r.pass_once(now)  # first: a run removed whole needs no log pass
        report.removed, report.removed_objects, report.referenced = (
            r.removed,
            r.deleted,
            r.referenced,
        )
        report.waiting += r.waiting
        by_run = await stored_logs(self.nc)

        async def one(run_id: str) -> None:
            async with self._slots:
                await self._judge(run_id, by_run[run_id], now, days, report)

        await asyncio.gather(*(one(r) for r in sorted(by_run)))
        report.seconds = time.monotonic() - started
        return report

    async def _judge(
        self, run_id: str, infos: list[ObjectInfo], now: datetime, days: dict[str, int],
        report: Report,
    ) -> None:  # fmt: skip
        run = (await self.app.load_run("*", None, run_id)).state
        if not run.exists or run.removed_at is not None:
            return  # objects of no run (a foreign name), or of one removed whole (above)
        recorded = run.log_removed_at
        if recorded is None:
            keep = await self._days(run.org, days)
            cutoff = now - timedelta(days=keep)
            if not run.terminal or run.ended_at is None or run.ended_at > cutoff:
                report.kept += 1
                return
            if await self._record(run, infos, cutoff, keep):
                report.pruned.append(run_id)
            recorded = now
        if now - recorded < self.grace:
            report.waiting += 1
            return
        deleted = await delete_objects(
            self.nc, LOGS_BUCKET, infos
        )  # (not `+= await`: passes interleave)
        report.deleted += deleted
        await self.nc.jetstream().purge_stream(LOGS, subject=log_subject(run_id, "*", "*"))

    async def _record(
        self, run: RunState, infos: list[ObjectInfo], cutoff: datetime, keep: int
    ) -> bool:
        """Append `run.log_pruned` (the intent); False if another pass recorded it."""
        objects = [PrunedObject(name=i.name, sha256=hex_digest(i), size=i.size or 0) for i in infos]
        command = PruneLog(actor=ACTOR, objects=objects, ended_before=cutoff, days=keep)
        return await record_once(self.app, run, command, lambda r: r.log_removed_at, "retention")

    async def _days(self, org: str, cache: dict[str, int]) -> int:
        """The organization's log retention in days (its setting, else the default)."""
        if org not in cache:
            value = (await self.app.load_org(org)).state.settings.get(LOG_RETENTION)
            # (the core checked it; an event that bypassed it must not stop every org's pass)
            ok = isinstance(value, int) and not days_problem(value)
            cache[org] = int(value) if ok and value is not None else self.default_days
        return cache[org]
