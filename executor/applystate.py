"""Per-resource apply states, read live from `terraform apply -json`.

Each resource the plan changes moves `applying` -> `done` or `failed` as Terraform's hooks
say; a replacement reports each of its two stages (delete, create, in the order they
ran). When Terraform has ended, every planned resource it never started is `not_applied`.
`pending` is not reported: the projection derives it from the plan when the run is
approved.

Terraform 1.0 prints an apply's error diagnostics only when the whole apply has ended, so
a resource whose `apply_errored` hook arrived waits for its diagnostic (matched by
`address`) to be reported `failed` with Terraform's error; at the end, one still waiting
gets the hook's own message. Errors that name no resource become the run's error.

Reports go through a queue to a background task, in order, so the apply never waits for
NATS; `track()` sends the last of them before it returns, hence before the phase's
`FinishApply` or `FailRun`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import structlog

from events.codec import run_subject
from events.errors import DomainError
from events.run import PlanFinished, ReportResource
from executor.job import Job
from executor.output import MAX_MESSAGE, Output, format_diagnostic

log = structlog.get_logger(__name__)

UNFINISHED = "the apply ended before this change finished"
_HOOKS = ('"type":"apply_', '"type":"diagnostic"')
_REPORT_ATTEMPTS = 3


@dataclass(frozen=True)
class Report:
    address: str
    action: str
    state: str
    error: str = ""


@dataclass
class Tracker:
    """What the apply did to each planned resource; `take` and `finish` return reports.

    `planned` maps each address to its planned action (create, update, delete, replace).
    """

    planned: dict[str, str]
    stages: dict[str, list[str]] = field(default_factory=dict)  # actions started, in order
    running: dict[str, str] = field(default_factory=dict)  # address -> action in flight
    errored: dict[str, tuple[str, str]] = field(default_factory=dict)  # -> (action, message)
    errors: dict[str, list[str]] = field(default_factory=dict)  # Terraform's, per address
    failed: set[str] = field(default_factory=set)
    run_errors: list[str] = field(default_factory=list)

    def take(self, record: dict[str, Any]) -> list[Report]:
        """Reports for one line of `apply -json` output."""
        kind = record.get("type")
        if kind == "diagnostic":
            return self._diagnostic(record.get("diagnostic") or {})
        hook = record.get("hook") or {}
        address = str((hook.get("resource") or {}).get("addr", ""))
        action = str(hook.get("action", ""))
        if not address or kind not in ("apply_start", "apply_complete", "apply_errored"):
            return []
        if kind == "apply_start":
            self.stages.setdefault(address, []).append(action)
            self.running[address] = action
            return [Report(address, action, "applying")]
        self.running.pop(address, None)
        if kind == "apply_complete":
            return [Report(address, action, "done")]
        self.errored[address] = (action, str(record.get("@message", "")))
        return self._fail_if_explained(address)

    def _diagnostic(self, diagnostic: dict[str, Any]) -> list[Report]:
        if diagnostic.get("severity") != "error":
            return []
        text = format_diagnostic(diagnostic)
        address = str(diagnostic.get("address") or "")
        if address not in self.planned and address not in self.stages:
            self.run_errors.append(text)
            return []
        self.errors.setdefault(address, []).append(text)
        if address in self.errored:
            return self._fail_if_explained(address)
        if address in self.running or address in self.failed:
            return []  # its apply_errored hook follows, or it is reported already
        # Not in flight: it failed after completing, or before it could start.
        started = self.stages.get(address)
        action = started[-1] if started else self.planned[address]
        self.errored[address] = (action, "")
        return self._fail_if_explained(address)

    def _fail_if_explained(self, address: str) -> list[Report]:
        if address not in self.errors:
            return []
        action, _ = self.errored.pop(address)
        self.failed.add(address)
        return [Report(address, action, "failed", self.error_of(address))]

    def error_of(self, address: str) -> str:
        return clip("\n\n".join(self.errors.get(address, [])))

    def finish(self) -> list[Report]:
        """Reports once Terraform has ended: failures never explained, changes in flight,
        and what never started (`not_applied`)."""
        reports = [
            Report(address, action, "failed", message or UNFINISHED)
            for address, (action, message) in self.errored.items()
        ]
        self.failed.update(self.errored)
        self.errored.clear()
        reports += [Report(a, act, "failed", UNFINISHED) for a, act in self.running.items()]
        self.failed.update(self.running)
        self.running.clear()
        for address, action in self.planned.items():
            missing = self._never_started(address, action)
            reports += [Report(address, m, "not_applied") for m in missing]
        return reports

    def _never_started(self, address: str, planned: str) -> list[str]:
        """The planned actions of `address` that never started (one stage of a replace)."""
        started = self.stages.get(address)
        if address in self.failed:
            return []
        if not started:
            return [planned]
        if planned == "replace" and len(started) == 1:
            return ["create" if started[0] == "delete" else "delete"]
        return []

    def run_error(self) -> str:
        """The run's error: errors that belong to no resource, else each resource's own."""
        if self.run_errors:
            return clip("\n\n".join(self.run_errors))
        return clip("\n\n".join(f"{a}: {self.error_of(a)}" for a in self.errors if self.errors[a]))


def clip(text: str) -> str:
    if len(text) <= MAX_MESSAGE:
        return text
    return text[: MAX_MESSAGE - 20] + "\n... (truncated)"


# ---------------------------------------------------------------- reporting


class Reporter:
    """Sends reports to the run in order from a background task; `close` waits for all.

    A refused report (the lease is gone) ends reporting: every later one would be refused
    too. Any other failure is retried a few times, then that report is dropped, logged.
    """

    def __init__(self, job: Job) -> None:
        self.job = job
        self.queue: asyncio.Queue[Report | None] = asyncio.Queue()
        self.refused = False
        self.task = asyncio.create_task(self._run(), name=f"{job.ctx.run_id}-resource-reports")

    def send(self, reports: list[Report]) -> None:
        for report in reports:
            self.queue.put_nowait(report)

    async def close(self) -> None:
        self.queue.put_nowait(None)
        await asyncio.shield(self.task)

    async def _run(self) -> None:
        while (report := await self.queue.get()) is not None:
            if not self.refused:
                await self._send(report)

    async def _send(self, report: Report) -> None:
        job = self.job
        command = ReportResource(
            actor=job.ctx.actor,
            lease_id=job.ctx.lease_id,
            address=report.address,
            action=report.action,
            state=report.state,
            error=report.error,
        )
        for attempt in range(1, _REPORT_ATTEMPTS + 1):
            try:
                await job.report(command)
                return
            except DomainError as e:
                log.warning("resource_reports_refused", address=report.address, why=str(e))
                self.refused = True
                return
            except Exception as e:  # noqa: BLE001  # NATS hiccup: retry, then drop this one
                log.warning("resource_report_failed", address=report.address, error=repr(e))
                if attempt < _REPORT_ATTEMPTS:
                    await asyncio.sleep(0.2 * attempt)


# ---------------------------------------------------------------- the apply's output


class ApplyOutput(Output):
    """`Output` that also follows the resources through the apply and reports them."""

    def __init__(
        self, tracker: Tracker, reporter: Reporter, planned: asyncio.Future[dict[str, str]]
    ) -> None:
        super().__init__()
        self.tracker = tracker
        self.reporter = reporter
        # The plan's changes, read while Terraform starts: until they are known, a
        # diagnostic (which may name a planned resource) waits, in order, for them.
        self.planned = planned
        self._held: list[dict[str, Any]] | None = []

    def feed(self, line: str) -> None:
        super().feed(line)
        if line.startswith("{") and any(hook in line for hook in _HOOKS):
            try:
                record = json.loads(line)
            except ValueError:
                return
            if isinstance(record, dict):
                self._take(record)

    def _take(self, record: dict[str, Any]) -> None:
        if self._held is not None and self.planned.done():
            self.known(self.planned.result())
        if self._held is not None and (self._held or record.get("type") == "diagnostic"):
            self._held.append(record)
            return
        self.reporter.send(self.tracker.take(record))

    def known(self, planned: dict[str, str]) -> None:
        """The plan's changes are known: what waited for them is taken now."""
        if self._held is None:
            return
        held, self._held = self._held, None
        self.tracker.planned = planned
        for record in held:
            self.reporter.send(self.tracker.take(record))

    def error_text(self) -> str:
        """Errors that belong to no resource, else the failed resources' errors."""
        return self.tracker.run_error() or super().error_text()


async def planned_changes(job: Job) -> dict[str, str]:
    """Address -> action of each resource the run's plan changes, from its plan event.

    Without it (NATS hiccup) the apply still runs: only `not_applied` goes unreported,
    and the projection marks what was still pending `not_applied` when the run ends.
    """
    ctx = job.ctx
    try:
        envelopes = await job.tools.app.store.read(run_subject(ctx.org, ctx.ws, ctx.run_id))
    except Exception as e:  # noqa: BLE001  # reporting states must never stop an apply
        log.warning("planned_changes_unread", error=repr(e))
        return {}
    plans = [e.event for e in envelopes if isinstance(e.event, PlanFinished)]
    if not plans:
        return {}
    return {c.address: c.action for c in plans[-1].changes if c.action != "read"}


@asynccontextmanager
async def track(job: Job) -> AsyncIterator[ApplyOutput]:
    """An `ApplyOutput` for the apply; on the way out, the final reports are sent. The
    plan's changes are read while Terraform starts, not before it (they are needed only
    for a diagnostic, which Terraform 1.0 prints once the apply has ended, and for what
    never started: both wait for them)."""
    planned = asyncio.ensure_future(planned_changes(job))  # never raises
    tracker = Tracker({})
    reporter = Reporter(job)
    out = ApplyOutput(tracker, reporter, planned)
    try:
        yield out
    finally:
        out.known(await asyncio.shield(planned))
        reporter.send(tracker.finish())
        await reporter.close()
