"""The executor process: pull dispatched phases of a pool, claim them, run them, heartbeat.

A dispatch message only says "this phase of this run waits"; the claim (`ClaimPhase`, an
optimistic append on the run) decides who runs it. The message is acked once the claim
is decided either way, so a claimed phase is never handed to a second executor and an
apply runs at most once. An executor that dies mid-phase stops heartbeating; the reaper
fails the run with `executor_unavailable`.
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import os
import shutil
import signal
import socket
import tempfile
from pathlib import Path
from types import TracebackType

import nats.errors
import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from events import wire
from events.codec import valid_id
from events.errors import DomainError
from events.run import CancelRun, ClaimPhase, FailRun, RunState
from events.wire import Dispatch, Heartbeat
from executor import recovery, sweep
from executor import terraform as tf
from executor.context import PhaseContext
from executor.custody import Custody, Vault
from executor.custom import is_custom
from executor.git import GitCache
from executor.isolation import Isolation, Jail
from executor.job import STOP_REQUESTED, STOPPED, Job, Tools
from executor.jobfiles import private_dir, remove_tree
from executor.objects import Objects
from executor.phases import run_phase
from executor.ports import RepositoryRules, RunLedger
from infra import tracing
from infra.crypto import KeyRing
from infra.heartbeats import Board, beat_interval
from infra.ids import new_id
from infra.policy.sandbox import PolicySandbox
from infra.streams import DISPATCH, ensure_executor_consumer, executor_consumer

log = structlog.get_logger(__name__)

TerraformSettings = tf.TerraformConfig  # the name the composition root uses
MAX_REMOVALS = 4  # finished phases' directories removed in the background at once


def parse_dispatch(data: bytes) -> Dispatch:
    """Decode and validate a dispatch body; ValueError (`WireError`) if it is not one."""
    return wire.decode_dispatch(data)


def heartbeat_subject(run_id: str, phase: str) -> str:
    return f"rp.hb.{run_id}.{phase}"


def default_jobs_dir(work_dir: Path) -> Path:
    """Where an executor on `work_dir` keeps its phase directories and the tools its jobs
    run: under the system's temporary directory, one per work directory. Not in the work
    directory: that is the executor's alone (0700), and a job must cross to its own."""
    key = hashlib.sha256(str(Path(work_dir).resolve()).encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"runplane-{key}"


def default_executor_id() -> str:
    host = "".join(c if c.isalnum() or c == "-" else "-" for c in socket.gethostname().lower())
    return f"{host or 'executor'}-{new_id()[-8:]}"


class Executor:
    """Runs the phases dispatched to one pool until `stop()`; an async context manager.

    `work_dir` (0700) holds the provider mirror, Terraform's CLI config, a mirror of each
    repository checked out (`git/`, see executor/git.py) and, should the object store
    refuse a new state, the copy kept so that it is not lost. `jobs_dir` (default
    `default_jobs_dir(work_dir)`, 0711) holds one fresh directory per phase under `jobs/`
    (removed when it ends) and what the jobs run under `tools/`. `isolation` (a mode of
    executor/isolation.py, or an `Isolation`) is who the jobs' processes run as; "auto"
    refuses to start where no isolation can be had. `concurrency` phases run at once.
    `repositories` (an `executor.ports.RepositoryRules`: the deployment's allowed sources)
    are what its phases may check out; it adds its own directories to what they refuse.
    `keyring` seals plans and state and opens secrets; every executor, api and scheduler
    of a deployment shares it (None: a key generated once in `work_dir`, for a lone one).

    Stopping interrupts Terraform with SIGINT and kills it after `grace_period` seconds,
    `apply_grace_period` during an apply: an interrupted apply finishes the operations in
    flight and writes their state, which can take minutes, and killing it earlier leaves
    infrastructure that no state records. Give the process manager's stop timeout more.
    """

    def __init__(
        self,
        nc: NATS,
        app: RunLedger,
        *,
        pool: str = "default",
        work_dir: Path,
        terraform: tf.TerraformConfig | None = None,
        executor_id: str | None = None,
        heartbeat_interval: float = 5.0,
        grace_period: float = 20.0,
        apply_grace_period: float = 600.0,
        concurrency: int = 1,
        fetch_timeout: float = 2.0,
        keyring: KeyRing | None = None,
        repositories: RepositoryRules,
        policy_sandbox: PolicySandbox | None = None,
        isolation: Isolation | str = "auto",
        jobs_dir: Path | None = None,
    ) -> None:
        if not valid_id(pool):
            raise ValueError(f"pool {pool!r} is not a subject-safe token")
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream()
        self.app = app
        self.pool = pool
        self.work_dir = Path(work_dir)
        self.jobs_root = Path(jobs_dir) if jobs_dir else default_jobs_dir(self.work_dir)
        self.jobs_dir = self.jobs_root / "jobs"
        self.tmp_dir = self.jobs_root / "tmp"  # each job's TMPDIR
        self.isolation_setting = isolation
        self.isolation = Isolation(mode="none")  # decided at start (__aenter__)
        self.terraform_config = terraform or tf.TerraformConfig()
        self.executor_id = executor_id or default_executor_id()
        self.heartbeat_interval = heartbeat_interval
        self.grace_period = grace_period
        self.apply_grace_period = apply_grace_period
        self.fetch_timeout = fetch_timeout
        self.objects = Objects(self.js)
        self.git_cache = GitCache(self.work_dir / "git")  # shared with siblings on work_dir
        # The repositories it checks out: never one of its own directories (its mirrors).
        self.sources = repositories.guarding(self.work_dir, "the executor's work directory")
        self.vault = Vault.create(nc, keyring, self.objects, self.work_dir)
        self.policy_sandbox = policy_sandbox or PolicySandbox()  # the deployment's caps
        self._slots = asyncio.Semaphore(concurrency)
        self._stopping = asyncio.Event()
        self._jobs: set[Job] = set()
        self._task: asyncio.Task[None] | None = None
        self._terraform: tf.Terraform | None = None
        self._sub: JetStreamContext.PullSubscription | None = None
        self._hold: int | None = None  # the work directory's shared lock (executor/sweep.py)
        self._life: recovery.Incarnation | None = None  # this life's incarnation file
        self._removals: set[asyncio.Future[bool]] = set()  # phase directories being removed

    # ------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> Executor:
        """Prepare Terraform, bind the pool's consumer and start taking work."""
        self.isolation = await asyncio.to_thread(self._isolation)
        # What a killed executor left here (providers still running, job directories).
        self._hold = await asyncio.to_thread(
            sweep.hold, self.work_dir, [self.jobs_dir, self.tmp_dir], self.isolation.reclaim
        )
        # A restart tells the truth (executor/recovery.py): a dead life's leases fail and
        # the state it left is recorded, before this one takes any work.
        self._life = recovery.Incarnation(self.work_dir, self.executor_id)
        await recovery.restart(
            self.app,
            Board(self.nc),
            self.vault.state,
            self.work_dir,
            f"executor:{self.executor_id}",
        )
        tools = None if self.isolation.mode == "none" else self.jobs_root / "tools"
        self._terraform = await asyncio.to_thread(
            tf.prepare, self.terraform_config, self.work_dir / "terraform", tools
        )
        version = await tf.check_version(self._terraform)
        await ensure_executor_consumer(self.js, self.pool)
        self._sub = await self.js.pull_subscribe_bind(
            durable=executor_consumer(self.pool), stream=DISPATCH
        )
        self._task = asyncio.create_task(self._loop(), name=f"executor-{self.executor_id}")
        log.info(
            "executor_ready",
            executor_id=self.executor_id,
            pool=self.pool,
            terraform=version,
            isolation=self.isolation.mode,
            jobs_dir=str(self.jobs_dir),
        )
        return self

    def _isolation(self) -> Isolation:
        """Decide the isolation and make the directories it relies on: the work directory
        the executor's alone, the jobs' directories crossable, their tools readable."""
        wanted = self.isolation_setting
        isolation = Isolation.choose(wanted) if isinstance(wanted, str) else wanted
        self.work_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.work_dir, 0o700)
        for path in (self.jobs_root, self.jobs_dir, self.tmp_dir):
            private_dir(path, 0o711)
        private_dir(self.jobs_root / "tools", 0o755)
        if self.terraform_config.plugin_cache_dir is not None and isolation.mode != "none":
            log.warning("plugin_cache_ignored", why="isolated jobs may not share a cache")
        hidden = (self.work_dir, self.jobs_dir, self.tmp_dir)
        return isolation.hiding(*hidden, shown=[self.jobs_root / "tools"])

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Stop: running phases are interrupted and fail with `executor_stopped`."""
        self.stop()
        try:
            await self.run()
            await self._removed(0)
        finally:
            if self._sub is not None:
                await self._sub.unsubscribe()
                self._sub = None
            if self._hold is not None:
                os.close(self._hold)
                self._hold = None
                await asyncio.to_thread(self._remove_jobs_root)
            if self._life is not None:
                self._life.close()
                self._life = None

    def _remove_jobs_root(self) -> None:
        """The last executor of the work directory to stop removes the jobs directory
        (its tools too: they are published again at the next start)."""
        fd = os.open(self.work_dir / sweep.LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return  # a sibling lives on
        else:
            remove_tree(self.jobs_root)  # what jobs left may be deeper than rmtree goes
        finally:
            os.close(fd)

    def stop(self) -> None:
        """Stop taking work; interrupt running phases, which fail with `executor_stopped`."""
        if not self._stopping.is_set():
            log.info("executor_stopping", executor_id=self.executor_id, running=len(self._jobs))
        self._stopping.set()
        for job in list(self._jobs):
            job.cancel(STOPPED)

    async def run(self) -> None:
        """Wait while the executor works, until `stop()` (or SIGTERM) has wound it down.

        The work loop starts when the context is entered, so a composition root may just
        enter it and wait for a signal; `run()` is for callers that want to block here.
        """
        if self._task is None:
            raise RuntimeError("use `async with Executor(...)` before run()")
        # Shielded: cancelling one waiter must not kill the loop under the others.
        await asyncio.shield(self._task)

    async def _loop(self) -> None:
        try:
            async with asyncio.TaskGroup() as tg:
                while not self._stopping.is_set():
                    await self._slots.acquire()
                    msg = await self._next()
                    if msg is None:
                        self._slots.release()
                        continue
                    tg.create_task(self._traced(msg))
        finally:
            log.info("executor_stopped", executor_id=self.executor_id)

    # ------------------------------------------------------------ taking work

    async def _next(self) -> Msg | None:
        """One dispatch message, or None when there was none (or we are stopping)."""
        if self._stopping.is_set():
            return None
        assert self._sub is not None
        try:
            msgs = await self._sub.fetch(1, timeout=self.fetch_timeout)
        except nats.errors.TimeoutError:
            return None
        except Exception as e:  # keep taking work through broker hiccups
            log.warning("fetch_failed", error=repr(e))
            await asyncio.sleep(1)
            return None
        if self._stopping.is_set():
            for m in msgs:  # hand it straight to another executor
                await m.nak()
            return None
        return msgs[0] if msgs else None

    async def _traced(self, msg: Msg) -> None:
        """`_handle` in the phase's span, a child of the dispatch's trace: the claim, the
        steps and every event the phase appends carry it."""
        with tracing.span_from_headers("phase", msg.headers, executor=self.executor_id):
            await self._handle(msg)

    async def _handle(self, msg: Msg) -> None:
        """Claim and run one dispatched phase; never raises (it would end the TaskGroup)."""
        try:
            try:
                d = parse_dispatch(msg.data)
            except ValueError as e:
                log.error("dispatch_malformed", error=str(e))
                await msg.term()
                return
            with structlog.contextvars.bound_contextvars(
                org=d.org, workspace=d.workspace, run_id=d.run_id, phase=d.phase
            ):
                job = await self._claim(msg, d)
                if job is not None:
                    await self._execute(job)
        except Exception:
            log.exception("dispatch_handling_failed")
        finally:
            try:  # a slot per phase still being removed beyond the first few: disk bounded
                await self._removed(MAX_REMOVALS)
            finally:
                self._slots.release()

    async def _claim(self, msg: Msg, d: Dispatch) -> Job | None:
        """Claim the phase under a fresh lease; ack the message whatever the claim decided."""
        lease_id = new_id()
        claim = ClaimPhase(
            actor=f"executor:{self.executor_id}",
            phase=d.phase,
            lease_id=lease_id,
            executor_id=self.executor_id,
        )
        try:
            result = await self.app.run_command(d.org, d.workspace, d.run_id, claim)
        except DomainError as e:
            if e.retryable:
                await msg.nak(delay=1)
                return None
            log.info("dispatch_dropped", why=e.code, detail=str(e))
            await msg.ack()
            return None
        except Exception as e:
            log.warning("claim_failed_will_retry", error=repr(e))
            await msg.nak(delay=2)
            return None
        await _ack(msg)  # the claim is ours even if this ack is lost: run the phase
        log.info("phase_claimed", lease_id=lease_id)
        try:
            return self._job(d, lease_id, result.state)
        except Exception as e:  # no directory or identity for it: the claimed run fails now
            log.exception("phase_not_started", lease_id=lease_id)
            cmd = FailRun(
                actor=claim.actor,
                lease_id=lease_id,
                reason="executor_unavailable",
                message=f"executor {self.executor_id} could not start the phase: {e}",
            )
            try:
                await self.app.run_command(d.org, d.workspace, d.run_id, cmd)
            except Exception:
                log.exception("phase_failure_not_reported")
            return None

    def _job(self, d: Dispatch, lease_id: str, run: RunState) -> Job:
        """The phase's directory and identity (`Jail`: its uid, held until `_execute`
        ends). No uid to be had is an error of the phase like any other."""
        assert self._terraform is not None
        root = tempfile.mkdtemp(prefix=f"{d.run_id}-{d.phase}-", dir=self.jobs_dir)
        try:
            jail: Jail = self.isolation.enter(Path(root), self.tmp_dir)
        except BaseException:
            shutil.rmtree(root, ignore_errors=True)
            raise
        ctx = PhaseContext(
            org=d.org,
            ws=d.workspace,
            run_id=d.run_id,
            phase=d.phase,
            lease_id=lease_id,
            executor_id=self.executor_id,
            run=run,
            root=Path(root),
            keep_dir=self.work_dir / "unsaved-state",
            grace=self.apply_grace_period if d.phase == "apply" else self.grace_period,
        )
        tools = Tools(
            app=self.app,
            objects=self.objects,
            terraform=self._terraform,
            custody=Custody(self.vault),
            sources=self.sources,
            git_cache=self.git_cache,
            policy_sandbox=self.policy_sandbox,
            jail=jail,
        )
        return Job(ctx=ctx, tools=tools)

    # ------------------------------------------------------------ running a phase

    async def _execute(self, job: Job) -> None:
        """Run the phase in its own task (so stop() can interrupt it) beside its heartbeat."""
        ctx = job.ctx
        self._jobs.add(job)
        tracing.annotate(
            f"phase {ctx.phase}", org=ctx.org, workspace=ctx.ws, run_id=ctx.run_id, phase=ctx.phase
        )
        job.task = asyncio.create_task(run_phase(job), name=f"{ctx.run_id}-{ctx.phase}")
        beat = asyncio.create_task(self._heartbeat(job), name=f"{ctx.run_id}-{ctx.phase}-beat")
        try:
            if self._stopping.is_set():  # stop() came while we were claiming
                job.cancel(STOPPED)
            await asyncio.wait([job.task])
        finally:
            beat.cancel()
            if not job.task.done():  # we were cancelled from outside: take the phase down
                job.cancel(STOPPED)
                await asyncio.wait([job.task])
            self._jobs.discard(job)
            try:
                if job.tools.jail is not None:  # every process of the job, escaped daemons too
                    job.tools.jail.close()
            finally:
                self._remove(ctx.root)  # beside the final report, not before it
                await self._conclude(job)

    def _remove(self, root: Path) -> None:
        """Remove a finished phase's directory in the background: deleting a Terraform
        directory takes a while, and neither the run's report nor the next phase waits."""
        task = asyncio.create_task(asyncio.to_thread(remove_tree, root))
        self._removals.add(task)
        task.add_done_callback(self._removals.discard)

    async def _removed(self, most: int) -> None:
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


async def _ack(msg: Msg) -> None:
    try:
        await msg.ack()
    except Exception as e:  # redelivery is harmless: a second claim is refused
        log.warning("ack_failed", error=repr(e))


def install_signal_handlers(executor: Executor) -> None:
    """SIGTERM and SIGINT stop the executor cleanly (running phases fail, state is kept)."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, executor.stop)
