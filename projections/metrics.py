"""The figures of `GET /metrics` (Prometheus text format), gathered at each scrape.

- `runplane_runs{status}`: runs by status, from this replica's read model (every status
  listed, 0 included, so a series never disappears);
- `runplane_queue_depth`: runs waiting behind their workspace's active run, in all;
  `runplane_queue_depth_max`: the longest one workspace's queue; `runplane_queues`: the
  workspaces with a queue;
- `runplane_consumer_pending{stream,consumer}` and `runplane_consumer_ack_pending{...}`:
  how far behind the durable consumers are (JetStream's `num_pending`, `num_ack_pending`):
  the scheduler's `rp-scheduler` and the subscribers' `rp-sub-*` on the event log;
- `runplane_dispatch_waiting`: phases dispatched and not yet claimed, every pool's and
  organization's (executors read the dispatch queue organizations in turn, through no
  consumer);
- `runplane_notification_attempts_total{outcome}`: delivery attempts of notifications
  by outcome, from the read model's `notify_attempts` table when this deployment's read
  model has one (the notifications part); else the family is left out;
- `runplane_step_cpu_seconds_total{phase}`, `runplane_step_wall_seconds_total{phase}`,
  `runplane_steps_measured_total{phase}` and `runplane_step_peak_memory_bytes_max{phase}`:
  what the executors' steps used (executor/usage.py), summed (the peak: the highest one
  step had) over the steps this read model holds; `phase` is `plan`, `apply` or `custom`
  (a custom step's number is the template's, so not a label);
- `runplane_audit_destinations_failing`: audit stream destinations whose last tries
  failed (`failing_since` set; their records wait and are tried again), all
  organizations' in one count;
- `runplane_metrics_ok{part}`: 1 if the part was read at this scrape, 0 if it failed
  (the rest is still answered);
- the process's own `process_*` and `python_*` figures.

No label names an organization, a workspace, a run or anything a tenant chose: label
values are runplane's own (statuses, outcomes, the deployment's consumers). The figures
are the deployment's, and even totals tell one tenant how busy the others are, so the
api answers them only to the admin token or the metrics token (services/surfaces/api/metrics.py).
A scrape's result is kept `CACHE_S`: several scrapers (or a hasty one) cost one read.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
from nats.aio.client import Client as NATS
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from events.run_events import Status
from infra import streams
from projections.readmodel import ReadModel

log = structlog.get_logger(__name__)

CACHE_S = 2.0
CONSUMER_PAGE = 256  # consumers the server lists per request
MAX_PAGES = 40
OUTCOMES = ("delivered", "retry", "failed", "gave_up")  # else counted as "other"
# The durables reported, by stream: the deployment's own, never an ephemeral one.
_DURABLES = {  # stream: (exact names, name prefixes)
    streams.EVENTS: ((streams.SCHEDULER_CONSUMER,), ("rp-sub-",)),
}


@dataclass
class Figures:
    """One scrape's figures (None: that part could not be read)."""

    runs: dict[str, int] | None = None
    queue: tuple[int, int, int] | None = None  # total, longest, workspaces with one
    consumers: list[tuple[str, str, int, int]] | None = None  # stream, name, pending, acks
    waiting: int | None = None  # dispatched phases not yet claimed
    attempts: dict[str, int] | None = None  # None also: the read model has no such table
    steps: dict[str, tuple[int, float, float, int]] | None = None  # phase: n, cpu, wall, peak
    failing: int | None = None  # audit destinations whose last tries failed
    ok: dict[str, bool] = field(default_factory=dict)

    def collect(self) -> Iterator[Metric]:
        if self.runs is not None:
            runs = GaugeMetricFamily("runplane_runs", "Runs by status", labels=["status"])
            for status in Status:
                runs.add_metric([str(status)], self.runs.get(str(status), 0))
            yield runs
        if self.queue is not None:
            total, longest, queues = self.queue
            yield GaugeMetricFamily(
                "runplane_queue_depth", "Runs waiting behind their workspace's active run", total
            )
            yield GaugeMetricFamily(
                "runplane_queue_depth_max", "The longest queue of one workspace", longest
            )
            yield GaugeMetricFamily("runplane_queues", "Workspaces with runs waiting", queues)
        if self.consumers is not None:
            labels = ["stream", "consumer"]
            pending = GaugeMetricFamily(
                "runplane_consumer_pending", "Messages not yet delivered", labels=labels
            )
            acks = GaugeMetricFamily(
                "runplane_consumer_ack_pending", "Messages delivered, not yet acked", labels=labels
            )
            for stream, name, p, a in self.consumers:
                pending.add_metric([stream, name], p)
                acks.add_metric([stream, name], a)
            yield pending
            yield acks
        if self.waiting is not None:
            yield GaugeMetricFamily(
                "runplane_dispatch_waiting", "Phases waiting for an executor", self.waiting
            )
        if self.attempts is not None:
            attempts = CounterMetricFamily(
                "runplane_notification_attempts",
                "Notification delivery attempts by outcome",
                labels=["outcome"],
            )
            for outcome in (*OUTCOMES, "other"):
                attempts.add_metric([outcome], self.attempts.get(outcome, 0))
            yield attempts
        if self.steps is not None:
            yield from _step_families(self.steps)
        if self.failing is not None:
            yield GaugeMetricFamily(
                "runplane_audit_destinations_failing",
                "Audit stream destinations whose last tries failed (their records wait)",
                self.failing,
            )
        ok = GaugeMetricFamily("runplane_metrics_ok", "Part read at this scrape", labels=["part"])
        for part, fine in sorted(self.ok.items()):
            ok.add_metric([part], 1 if fine else 0)
        yield ok


class Metrics:
    """Gathers the figures of one api replica: its read model (on a read-only connection
    of its own, so a scrape's counts never queue the api's reads behind them) and the
    JetStream consumers' state."""

    def __init__(
        self,
        nc: NATS,
        db_path: Path,
        *,
        cache_s: float = CACHE_S,
        audit_failing: Callable[[], Awaitable[int]] | None = None,
    ) -> None:
        self.nc = nc
        self.audit_failing = audit_failing  # the root's port: failing audit destinations
        self.db_path = db_path
        self.cache_s = cache_s
        self._db: ReadModel | None = None
        self._lock = asyncio.Lock()
        self._body = b""
        self._at = -cache_s

    async def close(self) -> None:
        if self._db is not None:
            await self._db.close()
            self._db = None

    async def render(self) -> bytes:
        """The Prometheus text of the figures now (or of the last scrape, `cache_s`)."""
        async with self._lock:
            if time.monotonic() - self._at >= self.cache_s:
                figures = await self.gather()
                self._body = generate_latest(_Both(figures))
                self._at = time.monotonic()
            return self._body

    async def gather(self) -> Figures:
        f = Figures()
        f.runs = await self._part(f, "runs", self._runs())
        f.queue = await self._part(f, "queue", self._queue())
        f.consumers = await self._part(f, "consumers", self._consumers())
        f.waiting = await self._part(f, "dispatch", self._waiting())
        f.attempts = await self._part(f, "notifications", self._attempts())
        f.steps = await self._part(f, "steps", self._steps())
        if self.audit_failing is not None:
            f.failing = await self._part(f, "audit_stream", self.audit_failing())
        return f

    async def _part(self, f: Figures, name: str, read: Any) -> Any:
        try:
            value = await read
        except Exception as e:  # noqa: BLE001 - NATS, sqlite3: one part lost, not the scrape
            log.warning("metrics_part_failed", part=name, error=repr(e))
            f.ok[name] = False
            return None
        f.ok[name] = True
        return value

    async def _rows(self, sql: str) -> list[Any]:
        if self._db is None:
            self._db = await ReadModel.open(self.db_path)
        return list(await self._db.db.execute_fetchall(sql))  # whole, even if cancelled

    async def _runs(self) -> dict[str, int]:
        rows = await self._rows("SELECT status, COUNT(*) FROM runs GROUP BY status")
        return {str(r[0]): int(r[1]) for r in rows}

    async def _queue(self) -> tuple[int, int, int]:
        rows = await self._rows(
            "SELECT COALESCE(SUM(n), 0), COALESCE(MAX(n), 0), COUNT(*) FROM"
            " (SELECT COUNT(*) AS n FROM ws_queue GROUP BY org, workspace)"
        )
        total, longest, queues = rows[0]
        return int(total), int(longest), int(queues)

    async def _attempts(self) -> dict[str, int] | None:
        tables = await self._rows(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name = 'notify_attempts'"
        )
        if not tables:
            return None  # no notifications in this deployment's read model: no family
        rows = await self._rows("SELECT outcome, COUNT(*) FROM notify_attempts GROUP BY outcome")
        out: dict[str, int] = {}
        for outcome, n in rows:
            key = outcome if outcome in OUTCOMES else "other"
            out[key] = out.get(key, 0) + int(n)
        return out

    async def _steps(self) -> dict[str, tuple[int, float, float, int]]:
        rows = await self._rows(
            "SELECT CASE WHEN phase IN ('plan', 'apply') THEN phase ELSE 'custom' END AS p,"
            " COUNT(*), COALESCE(SUM(json_extract(metrics_json, '$.cpu_seconds')), 0),"
            " COALESCE(SUM(json_extract(metrics_json, '$.wall_seconds')), 0),"
            " COALESCE(MAX(json_extract(metrics_json, '$.peak_memory_bytes')), 0)"
            " FROM steps WHERE json_extract(metrics_json, '$.wall_seconds') IS NOT NULL"
            " GROUP BY p"
        )
        return {str(r[0]): (int(r[1]), float(r[2]), float(r[3]), int(r[4])) for r in rows}

    async def _waiting(self) -> int:
        info = await self.nc.jetstream().stream_info(streams.DISPATCH)
        return int(info.state.messages)

    async def _consumers(self) -> list[tuple[str, str, int, int]]:
        out: list[tuple[str, str, int, int]] = []
        jsm = self.nc.jsm()
        for stream, (names, prefixes) in _DURABLES.items():
            for page in range(MAX_PAGES):
                infos = await jsm.consumers_info(stream, offset=page * CONSUMER_PAGE)
                for info in infos:
                    name = info.name or ""
                    if name in names or name.startswith(prefixes):
                        pending, acks = int(info.num_pending or 0), int(info.num_ack_pending or 0)
                        out.append((stream, name, pending, acks))
                if len(infos) < CONSUMER_PAGE:
                    break
        return sorted(out)


STEP_PHASES = ("plan", "apply", "custom")


def _step_families(steps: dict[str, tuple[int, float, float, int]]) -> Iterator[Metric]:
    """What the steps used, by kind of phase (every kind listed, 0 included)."""
    labels = ["phase"]
    count = CounterMetricFamily(
        "runplane_steps_measured", "Steps whose use was measured", labels=labels
    )
    cpu = CounterMetricFamily(
        "runplane_step_cpu_seconds", "CPU time the steps' processes used", labels=labels
    )
    wall = CounterMetricFamily("runplane_step_wall_seconds", "The steps' wall time", labels=labels)
    peak = GaugeMetricFamily(
        "runplane_step_peak_memory_bytes_max", "The highest memory one step had", labels=labels
    )
    for phase in STEP_PHASES:
        n, c, w, p = steps.get(phase, (0, 0.0, 0.0, 0))
        count.add_metric([phase], n)
        cpu.add_metric([phase], c)
        wall.add_metric([phase], w)
        peak.add_metric([phase], p)
    yield from (count, cpu, wall, peak)


class _Both(Collector):
    """One scrape's figures, then the process's (the default registry's collectors)."""

    def __init__(self, figures: Figures) -> None:
        self.figures = figures

    def collect(self) -> Iterator[Metric]:
        yield from self.figures.collect()
        yield from REGISTRY.collect()
