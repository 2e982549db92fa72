"""The executor process: take dispatched phases of a pool, claim them, run them, heartbeat.

A dispatch message only says "this phase of this run waits"; the claim (`ClaimPhase`, an
optimistic append on the run) decides who runs it. Organizations take turns
(executor/intake.py, executor/turns.py). The message is deleted once the claim is decided
either way, so a claimed phase is never handed to a second executor and an
apply runs at most once. An executor that dies mid-phase stops heartbeating; the reaper
fails the run with `executor_unavailable`.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import os
import shutil
import signal
import socket
import tempfile
from pathlib import Path
from types import TracebackType

import structlog
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

from events import wire
from events.codec import valid_id
from events.run import RunState, Status
from events.wire import Dispatch
from executor import recovery, sweep
from executor import terraform as tf
from executor.context import PhaseContext
from executor.custody import Custody, Vault
from executor.git import GitCache
from executor.intake import Intake, Taken
from executor.isolation import Isolation, Jail
from executor.job import RELEASED, STOPPED, Job, Tools, releasable
from executor.jobfiles import private_dir, remove_tree
from executor.logstream import LogBudget
from executor.objects import Objects
from executor.ports import RepositoryRules, RunLedger
from executor.runner import PhaseRunner
from executor.turns import Slots, Turns
from executor.warm import Facts, WarmSettings, WarmStore
from infra import tracing
from infra.crypto import KeyRing
from infra.heartbeats import Board
from infra.ids import new_id
from infra.policy.sandbox import PolicySandbox
from infra.quotas import Quotas

log = structlog.get_logger(__name__)

TerraformSettings = tf.TerraformConfig  # the name the composition root uses
MAX_REMOVALS = 4  # finished phases' directories removed in the background at once
WARM_PRUNE_S = 30.0  # seconds between looks at whether a kept checkout's run moved on


def parse_dispatch(data: bytes) -> Dispatch:
    """Decode and validate a dispatch body; ValueError (`WireError`) if it is not one."""
    return wire.decode_dispatch(data)


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
    `org_weights`: an organization's turns per round (default 1 each); `org_max_phases`:
    the most of its slots one organization holds (0: all but one while another
    organization is active, see executor/turns.py `Slots`).
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
        org_weights: dict[str, int] | None = None,
        org_max_phases: int = 0,
        quotas: Quotas | None = None,
        warm: WarmSettings | None = None,
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
        self.grace_period = grace_period
        self.apply_grace_period = apply_grace_period
        self.objects = Objects(self.js)
        self.git_cache = GitCache(self.work_dir / "git")  # shared with siblings on work_dir
        self.sources = repositories.guarding(self.work_dir, "the executor's work directory")
        self.quotas = quotas or Quotas()  # the deployment's bounds on state and logs
        self.vault = Vault.create(nc, keyring, self.objects, self.work_dir, self.quotas)
        self.policy_sandbox = policy_sandbox or PolicySandbox()  # the deployment's caps
        self._slots = asyncio.Semaphore(concurrency)
        self._stopping = asyncio.Event()
        turns, slots = Turns(org_weights), Slots(concurrency, org_max_phases)
        self.intake = Intake(  # taking work, organizations in turn, and claiming it
            self.js, app, pool, self.executor_id, self._stopping, fetch_timeout, nc, turns, slots
        )
        self.runner = PhaseRunner(  # running what was claimed: heartbeats, reports
            self.js, self.executor_id, self._stopping, heartbeat_interval=heartbeat_interval
        )
        self._warm(warm or WarmSettings())
        self._task: asyncio.Task[None] | None = None
        self._terraform: tf.Terraform | None = None
        self._hold: int | None = None  # the work directory's shared lock (executor/sweep.py)
        self._life: recovery.Incarnation | None = None  # this life's incarnation file

    def _warm(self, settings: WarmSettings) -> None:
        """Plans' checkouts kept for their applies (executor/warm.py); a wait of 0: none."""
        store = self.jobs_root / "warm"
        self.warm = WarmStore(store, self.executor_id, max_bytes=settings.max_bytes)
        self.intake.warm_wait = settings.wait
        self.runner.warm = self.warm if settings.wait > 0 else None

    # ------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> Executor:
        """Prepare Terraform, bind the pool's consumer and start taking work."""
        self.isolation = await asyncio.to_thread(self._isolation)
        # What a killed executor left here (providers still running, job directories).
        scope = self.jobs_root.name  # what its phases' groups are named under
        self._hold = await asyncio.to_thread(
            sweep.hold,
            self.work_dir,
            [self.jobs_dir, self.tmp_dir],
            self.isolation.reclaim,
            lambda: self.isolation.sweep(scope),
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
        await asyncio.to_thread(self.warm.open)
        await self.intake.open()
        self._task = asyncio.create_task(self._loop(), name=f"executor-{self.executor_id}")
        log.info(
            "executor_ready",
            executor_id=self.executor_id,
            pool=self.pool,
            terraform=version,
            isolation=self.isolation.mode,
            jobs_dir=str(self.jobs_dir),
        )
        if said := self.isolation.caps_said():  # which mechanism holds each cap
            loud = log.warning if self.isolation.mode == "bwrap" else log.info
            loud("job_caps", caps=said, network=self.isolation.network)
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
        # The warm store too (executor/warm.py): in the bwrap mode every job is this
        # uid, whom its 0700 does not stop, and the jobs directory is not always under a
        # temporary directory the sandbox mounts empty (TMPDIR elsewhere).
        warm = private_dir(self.jobs_root / "warm", 0o700)
        hidden = (self.work_dir, self.jobs_dir, self.tmp_dir, warm)
        shown = [self.jobs_root / "tools"]
        cache = self.terraform_config.provider_cache_dir
        if cache is not None:  # the host's provider cache (made by `prepare`): read-only
            shown.append(Path(cache))
        return isolation.hiding(*hidden, shown=shown)

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
            await self.runner.removed(0)
        finally:
            await self.intake.close()
            await asyncio.to_thread(self.warm.close)
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
            self.isolation.sweep(self.jobs_root.name)  # and its phases' groups
        finally:
            os.close(fd)

    def drain(self) -> None:
        """Stop taking work; give back to the pool at once every phase that may run again
        (a plan, an apply before its `apply` step, a custom step before its command:
        `job.releasable`), which another executor then claims; let the others (an apply
        under way) run to their end. `run()` returns once they have."""
        if self._stopping.is_set():
            return
        running = list(self.runner.jobs)
        given = [job for job in running if releasable(job)]
        log.info(
            "executor_draining",
            executor_id=self.executor_id,
            running=len(running),
            given_back=len(given),
        )
        self._stopping.set()
        for job in given:
            job.cancel(RELEASED)

    async def drained(self, timeout: float = 0) -> None:
        """Drain (`drain()`) until every phase ended: what SIGTERM does to `runplane
        executor`. A second SIGTERM or SIGINT, or `timeout` seconds (0: none), stop hard
        (`stop()`): Terraform interrupted, the phases fail `executor_stopped`."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop)
        try:
            self.drain()
            try:
                await asyncio.wait_for(self.run(), timeout or None)
            except TimeoutError:
                log.warning("executor_drain_timeout", executor_id=self.executor_id, after=timeout)
                self.stop()
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)

    def stop(self) -> None:
        """Stop taking work; interrupt running phases, which fail with `executor_stopped`."""
        if not self.runner.hard:
            log.info(
                "executor_stopping", executor_id=self.executor_id, running=len(self.runner.jobs)
            )
        self.runner.hard = True
        self._stopping.set()
        for job in list(self.runner.jobs):
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
                pruning = tg.create_task(self._prune_warm())
                while not self._stopping.is_set():
                    await self._slots.acquire()
                    msg = await self.intake.next()
                    if msg is None:
                        self._slots.release()
                        continue
                    tg.create_task(self._traced(msg))
                pruning.cancel()
        finally:
            log.info("executor_stopped", executor_id=self.executor_id)

    # ------------------------------------------------------------ taking work

    async def _traced(self, msg: Taken) -> None:
        """`_handle` in the phase's span, a child of the dispatch's trace: the claim, the
        steps and every event the phase appends carry it."""
        with tracing.span_from_headers("phase", msg.headers, executor=self.executor_id):
            await self._handle(msg)

    async def _handle(self, msg: Taken) -> None:
        """Claim and run one dispatched phase; never raises (it would end the TaskGroup)."""
        try:
            try:
                d = parse_dispatch(msg.data)
            except ValueError as e:
                log.error("dispatch_malformed", error=str(e))
                await self.intake.drop(msg)
                return
            with structlog.contextvars.bound_contextvars(
                org=d.org, workspace=d.workspace, run_id=d.run_id, phase=d.phase
            ):
                if (ending := self.runner.ending.get(d.run_id)) is not None:
                    # its plan is still ending here (its checkout being kept): wait for it
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(ending.wait(), self.grace_period)
                job = await self.intake.claim(msg, d, self._job)
                while job is not None:
                    await self.runner.execute(job)
                    job = await self._next_phase(job)
        except Exception:
            log.exception("dispatch_handling_failed")
        finally:
            self.intake.finished(msg)
            try:  # a slot per phase still being removed beyond the first few: disk bounded
                await self.runner.removed(MAX_REMOVALS)
            finally:
                self._slots.release()

    async def _next_phase(self, job: Job) -> Job | None:
        """The apply of the plan that just ended here, claimed at once in the same slot if
        the plan left the run waiting for it (no approval needed) and its checkout was
        kept warm (executor/intake.py `claim_next`); else None: it is dispatched."""
        after, ctx = job.after, job.ctx
        if ctx.phase != "plan" or job.warm is None or after is None or self.runner.warm is None:
            return None
        if after.status != Status.APPLY_QUEUED or after.waiting_phase != "apply":
            return None
        if all(kept.run_id != ctx.run_id for kept in self.runner.warm.runs()):
            return None  # not kept (refused): the apply goes cold, anywhere
        d = Dispatch(org=ctx.org, workspace=ctx.ws, run_id=ctx.run_id, phase="apply")
        with structlog.contextvars.bound_contextvars(phase="apply"):
            return await self.intake.claim_next(d, self._job)

    def _warm_start(self, d: Dispatch, run: RunState, root: Path) -> bool:
        """Move the checkout its plan left here into the apply's directory, if it was
        planned for exactly this run's organization, workspace, commit, plan and
        configuration and is as it was left (executor/warm.py); else the apply is cold."""
        store = self.runner.warm
        return store is not None and store.take(Facts.of(d.org, d.workspace, run), root / "src")

    async def _prune_warm(self) -> None:
        """Remove a kept checkout once its run ended, applied or is applying elsewhere."""
        while self.runner.warm is not None:
            await asyncio.sleep(WARM_PRUNE_S)
            for facts in self.runner.warm.runs():
                try:
                    loaded = await self.app.load_run(facts.org, facts.ws, facts.run_id)
                except Exception as e:  # looked at again next time
                    log.warning("warm_prune_failed", error=repr(e))
                    continue
                run: RunState = loaded.state
                waiting = run.status in (Status.AWAITING_APPROVAL, Status.APPLY_QUEUED)
                if not waiting or run.plan_digest != facts.plan_digest:
                    await asyncio.to_thread(self.runner.warm.discard, facts.run_id)

    def _job(self, d: Dispatch, lease_id: str, run: RunState) -> Job:
        """The phase's directory and identity (`Jail`: its uid, held until
        `PhaseRunner.execute` ends). No uid to be had is an error of the phase like any
        other."""
        assert self._terraform is not None
        root = tempfile.mkdtemp(prefix=f"{d.run_id}-{d.phase}-", dir=self.jobs_dir)
        try:
            jail: Jail = self.isolation.enter(Path(root), self.tmp_dir)
        except BaseException:
            shutil.rmtree(root, ignore_errors=True)
            raise
        warm = d.phase == "apply" and self._warm_start(d, run, Path(root))
        ctx = PhaseContext(
            warm=warm,
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
        return Job(ctx=ctx, tools=tools, log_budget=LogBudget(self.quotas.log_max_bytes))


def install_signal_handlers(executor: Executor) -> None:
    """SIGTERM and SIGINT stop the executor cleanly (running phases fail, state is kept)."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, executor.stop)
