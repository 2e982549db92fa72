"""The plan and apply phases: checkout, init, then plan or apply, with state kept safe.

State lives in `rp-state` as `<org>/<ws>/terraform.tfstate` and is used through
Terraform's default local backend: downloaded into the working directory before plan or
apply, and uploaded again after an apply, whether it succeeded or not (a half-failed apply
has still changed real infrastructure, and its state is the only record of that).
"""

from __future__ import annotations

import asyncio
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import structlog

from events.run import FailRun, FinishApply, FinishPlan, PlanSummary
from executor import git, process
from executor import terraform as tf
from executor.errors import ObjectStoreError, StepFailed
from executor.job import Job, step
from executor.objects import (
    PLANS_BUCKET,
    STATE_BUCKET,
    plan_object,
    sha256_file,
    state_object,
)
from executor.output import Masker, Output, drift_summary
from executor.process import StepLog

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class PlanOutcome:
    has_changes: bool
    summary: PlanSummary
    plan_object: str = ""
    plan_digest: str = ""


async def run_phase(job: Job) -> None:
    """Run the job's phase and report how it ended; its directory is removed in any case."""
    job.root.mkdir(parents=True, exist_ok=True)
    try:
        await (_plan_phase(job) if job.phase == "plan" else _apply_phase(job))
    except StepFailed as e:
        job.finishing = True
        log.info("phase_failed", step=e.step, reason=e.reason)
        await job.report(
            FailRun(actor=job.actor, lease_id=job.lease_id, reason=e.reason, message=e.message)
        )
    finally:
        await asyncio.to_thread(shutil.rmtree, job.root, ignore_errors=True)


async def _plan_phase(job: Job) -> None:
    commit = await step(job, "checkout", lambda lg: _checkout(job, lg))
    await step(job, "init", lambda lg: _init(job, lg))
    outcome = await step(job, "plan", lambda lg: _plan(job, lg))
    job.finishing = True
    await job.report(
        FinishPlan(
            actor=job.actor,
            lease_id=job.lease_id,
            commit=commit,
            has_changes=outcome.has_changes,
            summary=outcome.summary,
            plan_object=outcome.plan_object,
            plan_digest=outcome.plan_digest,
            require_approval=True,
        )
    )


async def _apply_phase(job: Job) -> None:
    await step(job, "checkout", lambda lg: _checkout(job, lg, pinned=True))
    await step(job, "init", lambda lg: _init(job, lg))
    summary = await step(job, "apply", lambda lg: _apply(job, lg))
    job.finishing = True
    await job.report(FinishApply(actor=job.actor, lease_id=job.lease_id, summary=summary))


# ---------------------------------------------------------------- steps


async def _checkout(job: Job, step_log: StepLog, *, pinned: bool = False) -> str:
    """Clone the repository: at its branch for a plan, at the planned commit (`pinned`)."""
    cfg = job.config
    if pinned and not job.run.commit:
        raise StepFailed("checkout", "the run has no planned commit to apply")
    sha = await git.checkout(
        cfg.repository,
        job.src,
        branch=cfg.branch,
        commit=job.run.commit if pinned else "",
        step_log=step_log,
        grace=job.grace,
    )
    workdir = job.workdir.resolve()
    if not workdir.is_relative_to(job.src.resolve()):
        raise StepFailed("checkout", f"directory {cfg.directory!r} is outside the repository")
    if not workdir.is_dir():
        raise StepFailed("checkout", f"directory {cfg.directory!r} does not exist at {sha}")
    step_log.note(f"checked out {sha}")
    return sha


async def _init(job: Job, step_log: StepLog) -> None:
    out = Output()
    code = await _terraform(job, step_log, tf.init_args(), out)
    if code != 0:
        raise StepFailed("init", out.error_text() or f"terraform init failed (exit {code})")


async def _plan(job: Job, step_log: StepLog) -> PlanOutcome:
    await _download_state(job, step_log)
    out = Output()
    args = tf.plan_args(job.run.run_type, job.config.variables)
    code = await _terraform(job, step_log, args, out)
    if code not in (0, 2):  # -detailed-exitcode: 0 no changes, 2 changes, 1 error
        raise StepFailed("plan", out.error_text() or f"terraform plan failed (exit {code})")
    if job.run.run_type == "drift":
        summary, has_changes = await _drift(job, step_log)
    else:
        summary, has_changes = out.summary(), code == 2
    if not has_changes:
        return PlanOutcome(has_changes=False, summary=summary)
    path = job.workdir / tf.PLAN_FILE
    digest = sha256_file(path)
    name = plan_object(job.run_id)
    await job.objects.upload(PLANS_BUCKET, name, path)
    step_log.note(f"plan stored as {PLANS_BUCKET}/{name}, sha256 {digest}")
    return PlanOutcome(True, summary, name, digest)


async def _drift(job: Job, step_log: StepLog) -> tuple[PlanSummary, bool]:
    """A refresh-only plan drifted if `show -json` lists resource drift.

    Not the exit code: Terraform 1.0 exits 2 on a refresh-only plan even without drift.
    """
    show_path = job.root / "show.json"
    show_log = StepLog(show_path, Masker())
    try:
        code = await _terraform(job, show_log, tf.show_args(), None)
    finally:
        show_log.close()
    if code != 0:
        raise StepFailed("plan", f"terraform show failed (exit {code})")
    summary = drift_summary(json.loads(show_path.read_bytes()))
    drifted = summary.add + summary.change + summary.destroy > 0
    step_log.note(
        f"drift: {summary.add} created, {summary.change} changed, "
        f"{summary.destroy} deleted outside Terraform"
    )
    return summary, drifted


async def _apply(job: Job, step_log: StepLog) -> PlanSummary:
    before = await _download_state(job, step_log)
    await _download_plan(job, step_log)
    out = Output()
    try:
        code = await _terraform(job, step_log, tf.apply_args(), out)
    finally:
        # Also after a failure or an interruption: the state records what was changed.
        await _save_state(job, step_log, before)
    if code != 0:
        raise StepFailed("apply", out.error_text() or f"terraform apply failed (exit {code})")
    return out.summary()


# ---------------------------------------------------------------- helpers


async def _terraform(job: Job, step_log: StepLog, args: list[str], out: Output | None) -> int:
    return await process.run(
        job.terraform.argv(*args),
        cwd=job.workdir,
        env=job.terraform.env(),
        step_log=step_log,
        on_line=out.feed if out else None,
        grace=job.grace,
    )


async def _download_state(job: Job, step_log: StepLog) -> str:
    """Put the workspace's state in the working directory; return its digest ("" if none)."""
    name = state_object(job.org, job.ws)
    path = job.workdir / tf.STATE_FILE
    if not await job.objects.download(STATE_BUCKET, name, path):
        step_log.note(f"no state stored at {STATE_BUCKET}/{name}: starting empty")
        return ""
    digest = sha256_file(path)
    step_log.note(f"state {STATE_BUCKET}/{name} sha256 {digest}")
    return digest


async def _download_plan(job: Job, step_log: StepLog) -> None:
    """Fetch the saved plan and check it is byte for byte the one that was approved."""
    path = job.workdir / tf.PLAN_FILE
    name = job.run.plan_object or plan_object(job.run_id)
    if not await job.objects.download(PLANS_BUCKET, name, path):
        raise StepFailed("apply", f"the saved plan {PLANS_BUCKET}/{name} is missing")
    digest = sha256_file(path)
    if digest != job.run.plan_digest:
        raise StepFailed(
            "apply",
            f"the saved plan's sha256 {digest} differs from the approved plan's "
            f"{job.run.plan_digest}: refusing to apply",
            reason="plan_digest_mismatch",
        )
    step_log.note(f"plan {PLANS_BUCKET}/{name} verified, sha256 {digest}")


async def _save_state(job: Job, step_log: StepLog, before: str) -> None:
    """Upload the state if apply changed it; if that fails, keep a copy on this host."""
    path = job.workdir / tf.STATE_FILE
    if not path.exists() or sha256_file(path) == before:
        step_log.note("state unchanged")
        return
    name = state_object(job.org, job.ws)
    try:
        await job.objects.upload(STATE_BUCKET, name, path, attempts=5)
    except ObjectStoreError as e:
        kept = _keep(job, path)
        log.error("state_not_stored", object=name, kept=str(kept))
        raise StepFailed(
            "apply",
            f"the new state could not be stored ({e}); a copy is kept at {kept} "
            f"on executor {job.executor_id}",
        ) from e
    step_log.note(f"state stored as {STATE_BUCKET}/{name}")


def _keep(job: Job, path: Path) -> Path:
    job.keep_dir.mkdir(parents=True, exist_ok=True)
    kept = job.keep_dir / f"{job.org}.{job.ws}.{job.run_id}.tfstate"
    shutil.copy2(path, kept)
    return kept
