"""Running a claimed phase: its task beside its heartbeat, its report at the end, and the
removal of its directory.

The phase runs in a task of its own, so that `stop()` can interrupt it. Its heartbeat
beats until the phase is over and interrupts it once the run's lease is no longer ours
or someone asked to stop it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import structlog
from nats.js import JetStreamContext

from events import wire
from events.errors import DomainError, StaleLease
from events.run import CancelRun, FailRun, ReleasePhase
from events.wire import Heartbeat
from executor.caps import WATCH_S
from executor.custom import is_custom
from executor.job import RELEASED, STOP_REQUESTED, STOPPED, Job
from executor.jobfiles import remove_tree
from executor.phases import run_phase
from executor.warm import WarmStore
from infra import tracing
from infra.heartbeats import beat_interval

log = structlog.get_logger(__name__)


def heartbeat_subject(run_id: str, phase: str) -> str:
    return f"rp.hb.{run_id}.{phase}"


async def _watch(job: Job) -> None:
    """Look at the phase's disk and CPU time every `WATCH_S`; past a cap, kill its
    processes (its step then fails with the cap: executor/job.py)."""
    jail = job.tools.jail
    if jail is None or jail.limits is None:
        return
    wait = WATCH_S
    while True:
        await asyncio.sleep(wait)
        began = time.monotonic()
        over = await asyncio.to_thread(jail.check)
        # A slow look (a large tree, many processes) waits longer before the next: the
        # watch takes at most a tenth of a core, whatever the job makes.
        wait = max(WATCH_S, 9 * (time.monotonic() - began))
        if over is not None:
            log.warning("job_over_cap", cap=over.cap, message=over.message)
            await asyncio.to_thread(jail.kill)
            return


async def _in_thread(work: Callable[[], None]) -> None:
    """`work` in a thread, waited for to its end even if we are cancelled meanwhile (the
    phase's directory is removed only after its jail closed)."""
    done = asyncio.ensure_future(asyncio.to_thread(work))
    try:
        await asyncio.shield(done)
    except asyncio.CancelledError:
        await asyncio.wait([done])
        raise


class PhaseRunner:
    """Runs an executor's claimed phases, each beside its heartbeat, and removes their
    directories in the background. `jobs` are the phases running now; once `stopping`
    is set, a phase that starts is given back to its pool at once (or interrupted, once
    `hard`: the executor stops rather than drains)."""

    def __init__(
        self,
        js: JetStreamContext,
        executor_id: str,
        stopping: asyncio.Event,
        *,
        heartbeat_interval: float,
    ) -> None:
        self.js = js
        self.executor_id = executor_id
        self.heartbeat_interval = heartbeat_interval
        self._stopping = stopping
        self.jobs: set[Job] = set()
        self.hard = False  # stopping interrupts every phase (else it drains: executor/worker.py)
        self._removals: set[asyncio.Future[bool]] = set()  # phase directories being removed
        self.warm: WarmStore | None = None  # where plans' checkouts wait for their applies
        self.ending: dict[str, asyncio.Event] = {}  # by run: a phase here not yet over

    async def execute(self, job: Job) -> None:
        """Run the phase in its own task (so stop() can interrupt it) beside its heartbeat."""
        ctx = job.ctx
        self.jobs.add(job)
        ending = self.ending.setdefault(ctx.run_id, asyncio.Event())
        tracing.annotate(
            f"phase {ctx.phase}", org=ctx.org, workspace=ctx.ws, run_id=ctx.run_id, phase=ctx.phase
        )
        job.task = asyncio.create_task(run_phase(job), name=f"{ctx.run_id}-{ctx.phase}")
        beat = asyncio.create_task(self._heartbeat(job), name=f"{ctx.run_id}-{ctx.phase}-beat")
        watch = asyncio.create_task(_watch(job), name=f"{ctx.run_id}-{ctx.phase}-caps")
        try:
            if self._stopping.is_set():  # drain() or stop() came while we were claiming
                job.cancel(STOPPED if self.hard else RELEASED)
            await asyncio.wait([job.task])
        finally:
            beat.cancel()
            watch.cancel()
            if not job.task.done():  # we were cancelled from outside: take the phase down
                job.cancel(STOPPED)
                await asyncio.wait([job.task])
            self.jobs.discard(job)
            try:
                if job.tools.jail is not None:  # every process of the job, escaped daemons too
                    # off the loop: its kills, rm -rf and ipcrm may take seconds, and every
                    # other phase's heartbeat would wait for them
                    await _in_thread(job.tools.jail.close)
                await self._keep(job)  # only once no process of the job is left
            finally:
                self._remove(ctx.root)  # beside the final report, not before it
                if self.ending.get(ctx.run_id) is ending:
                    del self.ending[ctx.run_id]
                ending.set()
                await self._conclude(job)

    async def _keep(self, job: Job) -> None:
        """Keep a plan's checkout for its run's apply (executor/warm.py), if the plan
        ended well and said it may be."""
        store, facts, task = self.warm, job.warm, job.task
        if store is None or facts is None or task is None or task.cancelled():
            return
        if task.exception() is not None:
            return
        uid = job.tools.jail.uid if job.tools.jail is not None else None
        try:
            kept = await asyncio.to_thread(store.keep, facts, job.ctx.src, uid)
        except Exception:
            log.exception("warm_not_kept")
            return
        log.info("warm_kept" if kept else "warm_not_kept", run_id=facts.run_id)

    def _remove(self, root: Path) -> None:
        """Remove a finished phase's directory in the background: deleting a Terraform
        directory takes a while, and neither the run's report nor the next phase waits."""
        task = asyncio.create_task(asyncio.to_thread(remove_tree, root))
        self._removals.add(task)
        task.add_done_callback(self._removals.discard)

    async def removed(self, most: int) -> None:
        """Wait until at most `most` directories are still being removed."""
        while len(self._removals) > most:
            await asyncio.wait(self._removals, return_when=asyncio.FIRST_COMPLETED)

    async def _conclude(self, job: Job) -> None:
        """Log how the phase ended; report `executor_stopped` if we interrupted it."""
        ctx = job.ctx
        assert job.task is not None
        if job.task.cancelled():
            if job.cancel_reason == STOP_REQUESTED:
                await self._cancel(job)
            elif job.cancel_reason == RELEASED:
                await self._release(job)
            elif job.cancel_reason == STOPPED:
                await self._fail(
                    job,
                    "executor_stopped",
                    f"executor {self.executor_id} stopped during the {job.step or ctx.phase} step",
                )
            else:
                log.warning("phase_abandoned", why="the run's lease is no longer ours")
            return
        exc = job.task.exception()
        if exc is None:
            log.info("phase_ended", step=job.step)
        elif isinstance(exc, DomainError):
            log.warning("phase_abandoned", why=str(exc), code=exc.code)
        else:
            log.error("phase_crashed", exc_info=exc)
            reason = "step_failed" if is_custom(ctx.phase) else f"{job.step or ctx.phase}_failed"
            await self._fail(job, reason, f"executor error: {exc!r}")

    async def _fail(self, job: Job, reason: str, message: str) -> None:
        """Best effort: the lease may be gone (StaleLease) or NATS unreachable."""
        cmd = FailRun(
            actor=job.ctx.actor, lease_id=job.ctx.lease_id, reason=reason, message=message
        )
        try:
            await job.report(cmd)
            log.info("phase_failed", reason=reason)
        except DomainError as e:
            log.info("phase_failure_not_reported", reason=reason, why=str(e))
        except Exception:
            log.exception("phase_failure_not_reported", reason=reason)

    async def _release(self, job: Job) -> None:
        """Give the interrupted phase back to its pool (the run waits for an executor
        again: a retry, recorded as `run.phase_released`). Refused (it began what runs
        once, which `releasable` should have seen), it fails as a stop always did."""
        cmd = ReleasePhase(actor=job.ctx.actor, lease_id=job.ctx.lease_id, reason=RELEASED)
        try:
            await job.report(cmd)
            log.info("phase_released", step=job.step)
            return
        except StaleLease as e:
            log.info("phase_release_not_reported", why=str(e))
            return
        except DomainError as e:
            log.warning("phase_release_refused", why=str(e))
        except Exception:
            log.exception("phase_release_not_reported")
        step = job.step or job.ctx.phase
        await self._fail(
            job, STOPPED, f"executor {self.executor_id} stopped during the {step} step"
        )

    async def _cancel(self, job: Job) -> None:
        """Report the stopped phase: the run ends `canceled` (fenced by the lease)."""
        cmd = CancelRun(actor=job.ctx.actor, lease_id=job.ctx.lease_id)
        try:
            await job.report(cmd)
            log.info("phase_stopped")
        except DomainError as e:
            log.info("phase_stop_not_reported", why=str(e))
        except Exception:
            log.exception("phase_stop_not_reported")

    async def _heartbeat(self, job: Job) -> None:
        """Beat every interval; interrupt the phase once the run's lease is no longer ours,
        or once someone asked to stop it (checked on every beat)."""
        ctx = job.ctx
        subject = heartbeat_subject(ctx.run_id, ctx.phase)
        # Until its phase is over, even if the cancel that ends it is lost (Python 3.11's
        # wait_for, which nats-py's requests use, can swallow one that meets an answer).
        while job.task is None or not job.task.done():
            await self._beat(subject, job)
            timeout = ctx.config.heartbeat_timeout
            await asyncio.sleep(beat_interval(self.heartbeat_interval, timeout))
            why = await job.interruption()
            if why:
                log.warning(why, lease_id=ctx.lease_id)
                job.cancel(why)
                return

    async def _beat(self, subject: str, job: Job) -> None:
        ctx = job.ctx
        body = Heartbeat(
            lease_id=ctx.lease_id,
            executor_id=self.executor_id,
            at=job.now(),
            # So the reaper needs no lookup to judge the beat (infra/heartbeats.py).
            org=ctx.org,
            workspace=ctx.ws,
            timeout=ctx.config.heartbeat_timeout,
        )
        try:
            await self.js.publish(subject, wire.encode(body))
        except Exception as e:  # a missed beat is survivable; the next one may land
            log.warning("heartbeat_failed", error=repr(e))
