"""One claimed phase of one run, and the step protocol every step follows.

A step reports `StartStep`, runs, stores its log in `rp-logs`, and reports `FinishStep`.
Every report carries the phase's lease: once the run has moved on (failed by the reaper,
canceled), the report raises `StaleLease` and the executor abandons the phase.

A `Job` is one phase being run: its `PhaseContext` (frozen: which run, phase and lease,
and the phase's directories), its `Tools` (what the executor hands it: the runs, the
object store, Terraform, custody, the repository rules, the sandbox, the jail, the
masker) and where it has got to (its step, its task).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, TypeVar

import structlog

from events.errors import DomainError
from events.run import STOPPABLE, FinishStep, RunCommand, RunState, StartStep, running_status
from events.run_decide import RELEASABLE
from executor.caps import REASON as CAP_REASON
from executor.changes import show_plan
from executor.context import PhaseContext
from executor.custody import Custody
from executor.errors import ObjectStoreError, StepFailed
from executor.git import GitCache
from executor.isolation import Jail
from executor.logstream import LiveStepLog, LogBudget, open_step_log
from executor.objects import LOGS_BUCKET, Objects, log_object
from executor.output import Masker, masked_command
from executor.ports import RepositoryRules, RunLedger
from executor.process import StepLog
from executor.terraform import Terraform
from executor.usage import StepMeter
from executor.warm import Facts
from infra import tracing
from infra.eventstore import LATEST
from infra.policy.sandbox import PolicySandbox

log = structlog.get_logger(__name__)

T = TypeVar("T")

STOPPED = "executor_stopped"
LEASE_LOST = "lease_lost"
STOP_REQUESTED = "stop_requested"  # someone asked to stop the phase (run.stop_requested)
RELEASED = "executor_draining"  # the executor drains: the phase goes back to its pool


@dataclass(kw_only=True)
class Tools:
    """What the executor hands a phase to work with (one set per phase)."""

    app: RunLedger  # the runs: read, and reported to
    objects: Objects
    terraform: Terraform  # the phase's: custody adds secrets and the state backend to its env
    custody: Custody  # secrets, managed state and sealed plans (executor/custody.py)
    sources: RepositoryRules  # the repositories it may check out
    git_cache: GitCache | None = None  # the executor's mirrors (executor/git.py); None: clone
    policy_sandbox: PolicySandbox = field(default_factory=PolicySandbox)  # executor/policy.py
    jail: Jail | None = None  # the identity its processes run as (executor/isolation.py)
    masker: Masker = field(default_factory=Masker)


@dataclass(kw_only=True, eq=False)  # identity: jobs are kept in a set
class Job:
    """One phase being run: its context, its tools, and where it has got to."""

    ctx: PhaseContext
    tools: Tools
    step: str = ""  # the step running now, for failure reasons
    finishing: bool = False  # the phase's final report is under way: do not cancel it
    cancel_reason: str = ""
    task: asyncio.Task[None] | None = None
    log_budget: LogBudget = field(default_factory=LogBudget)  # the phase's steps' logs
    meter: StepMeter | None = None  # what the running step uses (executor/usage.py)
    # A plan's: what its checkout was planned for, set as its end is reported, if it may
    # be kept for the run's apply (executor/warm.py)
    warm: Facts | None = None
    # The phase's providers came from the host's cache (executor/providerphase.py): its
    # `.terraform` links into the phase's own mirror, gone with the phase
    providers_cached: bool = False
    after: RunState | None = None  # the run as the phase's last report left it

    def now(self) -> datetime:
        return self.tools.app.clock()

    async def report(self, command: RunCommand) -> None:
        """Append a command to the run; raises StaleLease once the lease is not current.

        Its free text is masked on the way (`executor.output.masked_command`): every
        report of the executor goes through here, so nothing reaches an event unmasked.
        A report that ends the run leaves its workspace to the scheduler, whose admission
        attempt on the run's end releases it (`release=False`): the executor's own
        release raced that one and mostly lost (a conflict, two more reads)."""
        ctx = self.ctx
        masked = masked_command(self.tools.masker, command)
        done = await self.tools.app.run_command(ctx.org, ctx.ws, ctx.run_id, masked, release=False)
        self.after = done.state

    async def show_plan(self) -> dict[str, Any]:
        """`terraform show -json` of the phase's saved plan (executor/changes.py)."""
        tools = self.tools
        return await show_plan(tools.terraform, tools.jail, tools.masker, self.ctx.workdir)

    async def interruption(self) -> str:
        """Why the phase must stop now (LEASE_LOST, STOP_REQUESTED), or "": asked on
        every heartbeat (executor/runner.py)."""
        if self.finishing:
            return ""
        ctx = self.ctx
        try:
            loaded = await self.tools.app.load_run(ctx.org, ctx.ws, ctx.run_id)
        except Exception as e:  # noqa: BLE001  # a failed check is no verdict: beat on
            log.warning("lease_check_failed", error=repr(e))
            return ""
        run: RunState = loaded.state
        if run.lease_id != ctx.lease_id:  # or a follower is behind our claim: ask the leader
            return await self._lease_lost()
        if run.stop_requested_by and run.status in STOPPABLE:
            return STOP_REQUESTED
        return ""

    async def _lease_lost(self) -> str:
        ctx = self.ctx
        try:
            loaded = await self.tools.app.load_run(ctx.org, ctx.ws, ctx.run_id, min_seq=LATEST)
        except Exception as e:  # noqa: BLE001  # a failed check is no verdict: beat on
            log.warning("lease_check_failed", error=repr(e))
            return ""
        return LEASE_LOST if loaded.state.lease_id != ctx.lease_id else ""

    def cancel(self, reason: str) -> None:
        """Interrupt the phase (its Terraform gets SIGINT), unless it is already reporting."""
        if self.task is None or self.task.done() or self.finishing:
            return
        self.cancel_reason = self.cancel_reason or reason
        self.task.cancel(reason)


def releasable(job: Job) -> bool:
    """Whether a draining executor may give the phase back (events/run_decide.py
    RELEASABLE): a plan until its final report, an apply until its `apply` step, a custom
    step until its command. Judged on the loop, between the job's awaits: `job.step` is
    set before its `StartStep` goes out, so a step not yet named here was not reported."""
    if job.finishing:
        return False
    steps = RELEASABLE.get(running_status(job.ctx.phase), frozenset())
    return steps is None or job.step in steps


async def step(job: Job, name: str, body: Callable[[StepLog], Awaitable[T]]) -> T:
    """Run one step under the step protocol (in a span of its own, inside the phase's);
    a failure becomes StepFailed for this step."""
    with tracing.span(f"step {name}", run_id=job.ctx.run_id, phase=job.ctx.phase, step=name):
        return await _step(job, name, body)


async def _step(job: Job, name: str, body: Callable[[StepLog], Awaitable[T]]) -> T:
    job.step = name
    started = job.now()
    await job.report(StartStep(actor=job.ctx.actor, lease_id=job.ctx.lease_id, step=name))
    step_log = open_step_log(
        job.ctx, job.tools.app.store.nc, job.tools.masker, name, job.log_budget
    )
    job.meter = StepMeter(job.tools.jail)
    log.info("step_started", step=name)
    try:
        result = await body(step_log)
    except StepFailed as e:
        failure = await _over_cap(job, name, step_log) or e
        await _finish(job, name, started, step_log, ok=False, error=failure.error)
        if failure is e:
            raise
        raise failure from e
    except asyncio.CancelledError:
        await _finish_interrupted(job, name, started, step_log)
        raise
    except Exception as e:
        # An unexpected error inside the step (object store down, disk full): the step
        # fails like any other, with the error as its message.
        failure = await _over_cap(job, name, step_log) or StepFailed(
            name, f"{type(e).__name__}: {job.tools.masker(str(e))}"
        )
        log.exception("step_error", step=name)
        await _finish(job, name, started, step_log, ok=False, error=failure.error)
        raise failure from e
    over = await _over_cap(job, name, step_log)  # also when the job shrugged it off
    if over is not None:
        await _finish(job, name, started, step_log, ok=False, error=over.error)
        raise over
    await _finish(job, name, started, step_log, ok=True)
    return result


async def _over_cap(job: Job, name: str, step_log: StepLog) -> StepFailed | None:
    """The step's failure if the phase went over one of its caps (executor/caps.py)."""
    jail = job.tools.jail
    over = None if jail is None else await asyncio.to_thread(jail.check)
    if over is None:
        return None
    step_log.note(f"{over.message}: the job's processes were stopped")
    log.warning("job_over_cap", step=name, cap=over.cap, message=over.message)
    return StepFailed(name, over.message, reason=CAP_REASON)


async def _finish(
    job: Job, name: str, started: datetime, step_log: LiveStepLog, *, ok: bool, error: str = ""
) -> None:
    step_log.close()  # the file is whole: store it while the live stream's last lines go
    used = job.meter.usage() if job.meter is not None else None
    _, obj = await asyncio.gather(step_log.finish(), _store_log(job, name, step_log))
    await job.report(
        FinishStep(
            actor=job.ctx.actor,
            lease_id=job.ctx.lease_id,
            step=name,
            ok=ok,
            started_at=started,
            log_object=obj,
            error=error,
            metrics=step_log.metrics(),
            cpu_seconds=used.cpu_seconds if used else None,
            peak_memory_bytes=used.peak_memory_bytes if used else None,
            wall_seconds=used.wall_seconds if used else None,
        )
    )
    log.info("step_finished", step=name, ok=ok)


async def _finish_interrupted(
    job: Job, name: str, started: datetime, step_log: LiveStepLog
) -> None:
    """Best effort: keep the log and mark the step failed; the lease may be gone already."""
    try:
        await _finish(
            job,
            name,
            started,
            step_log,
            ok=False,
            error=f"interrupted ({job.cancel_reason or 'cancelled'})",
        )
    except DomainError as e:
        log.info("interrupted_step_not_reported", step=name, why=str(e))
    except Exception:
        log.exception("interrupted_step_not_reported", step=name)


async def _store_log(job: Job, name: str, step_log: StepLog) -> str:
    """Upload the step's log; a log that cannot be stored must not lose the step's report."""
    obj = log_object(job.ctx.run_id, job.ctx.phase, name)
    try:
        # Fresh: the name is the run's, phase's and step's, and a step runs once. (Were it
        # not, the older object's chunks would stay in the bucket, unread, not misread.)
        await job.tools.objects.upload(LOGS_BUCKET, obj, step_log.path, fresh=True)
    except ObjectStoreError:
        log.exception("log_not_stored", step=name, object=obj)
        return ""
    return obj
