"""The plan and apply phases: checkout, init, then plan or apply, with state kept safe.

A plan checks out the commit the run was pinned to at admission (its snapshot), else the
branch head. Unless the workspace brings its own backend, state is runplane's: served to
Terraform for the whole phase by the executor's `http` backend (`executor/statebackend.py`),
versions sealed in `rp-state`; a state Terraform could not store (`errored.tfstate`) is
kept on this host. Plan files travel sealed (AES-GCM), checked by digest before apply.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import structlog

from events import approval
from events.errors import RepositoryRefused
from events.policies import PolicyResult
from events.run import FailRun, FinishApply, FinishPlan, PlanSummary
from events.values import ResourceChange
from executor import git, gitaccess, linksafe, process
from executor import terraform as tf
from executor.applystate import track
from executor.binary import BINARY_NOT_FOUND, NOT_RUNNABLE, find_as_job
from executor.changes import plan_changes
from executor.custom import custom_phase
from executor.errors import StepFailed
from executor.job import Job, step
from executor.objects import PLANS_BUCKET, plan_object, sha256_file
from executor.output import Output, drift_summary
from executor.phase_custody import guarded, mask_planned_secrets, rescue_errored_state
from executor.policy import check_policies, pinned_policies
from executor.process import StepLog
from executor.providerphase import cached_providers
from executor.statebackend import write_override
from executor.upload import unpack_source
from executor.warm import Facts, config_digest
from infra.crypto import CryptoError, Tampered
from infra.gitenv import git_access

log = structlog.get_logger(__name__)

REPOSITORY_REFUSED = "repository_not_allowed"


@dataclass(frozen=True)
class PlanOutcome:
    has_changes: bool
    summary: PlanSummary
    plan_object: str = ""
    plan_digest: str = ""
    changes: tuple[ResourceChange, ...] = ()
    show: dict[str, Any] = field(default_factory=dict, repr=False)  # the JSON plan, if read


async def run_phase(job: Job) -> None:
    """Run the job's phase and report how it ended. Its directory is the caller's to
    remove (executor/runner.py removes it once the phase's task is over)."""
    ctx = job.ctx
    ctx.root.mkdir(parents=True, exist_ok=True)
    try:
        async with guarded(job):  # secret variables, managed state (executor/custody.py)
            if ctx.phase == "plan":
                await _plan_phase(job)
            elif ctx.phase == "apply":
                await _apply_phase(job)
            else:  # custom-<number>: a template's command step (executor/custom.py)
                await custom_phase(job, _checkout)
    except StepFailed as e:
        job.finishing = True
        log.info("phase_failed", step=e.step, reason=e.reason)
        await job.report(
            FailRun(actor=ctx.actor, lease_id=ctx.lease_id, reason=e.reason, message=e.message)
        )


async def _plan_phase(job: Job) -> None:
    # At the snapshot's commit when admission took one, however far the branch has moved.
    ctx = job.ctx
    pinned = bool(ctx.run.commit)
    commit = await step(job, "checkout", lambda lg: _checkout(job, lg, pinned=pinned))
    await step(job, "init", lambda lg: _init(job, lg))
    outcome = await step(job, "plan", lambda lg: _plan(job, lg))
    # The run's pinned policy sets checked on the plan (executor/policy.py); none: no step.
    policies: list[PolicyResult] = []
    if pinned_policies(job):
        policies = await step(job, "policy", lambda lg: check_policies(job, lg, outcome.show))
    job.finishing = True
    # Its checkout may serve the apply, warm; not one whose `.terraform` links into this
    # phase's mirror of the provider cache, removed with the phase (the apply's `init`
    # is served by the cache: cheap)
    if outcome.has_changes and _applies(job) and not job.providers_cached:
        job.warm = Facts(
            ctx.org, ctx.ws, ctx.run_id, commit.sha, outcome.plan_digest, config_digest(ctx.run)
        )
    await job.report(
        FinishPlan(
            actor=ctx.actor,
            lease_id=ctx.lease_id,
            commit=commit.sha,
            commit_author=commit.author,
            commit_message=commit.message,
            has_changes=outcome.has_changes,
            summary=outcome.summary,
            plan_object=outcome.plan_object,
            plan_digest=outcome.plan_digest,
            require_approval=_requires_approval(job),
            changes=list(outcome.changes),
            policies=policies,
        )
    )


def _applies(job: Job) -> bool:
    """Whether the run goes on to an apply (or destroy) after this plan."""
    run = job.ctx.run
    return not run.speculative and any(s.kind in ("apply", "destroy") for s in run.steps)


def _requires_approval(job: Job) -> bool:
    """The workspace's require_approval, or the run's own ask (a CLI run's plan waits
    for the CLI's "yes", which is an approval: services/surfaces/tfe/runs.py)."""
    ctx = job.ctx
    asked = ctx.run.options is not None and ctx.run.options.confirm
    return asked or bool(approval.setting(ctx.run.snapshot, "require_approval"))


async def _apply_phase(job: Job) -> None:
    if job.ctx.warm:  # the plan's checkout and .terraform, kept here: no clone, no init
        await step(job, "warm", lambda lg: _warm(job, lg))
    else:
        await step(job, "checkout", lambda lg: _checkout(job, lg, pinned=True))
        await step(job, "init", lambda lg: _init(job, lg))
    summary = await step(job, "apply", lambda lg: _apply(job, lg))
    job.finishing = True
    await job.report(FinishApply(actor=job.ctx.actor, lease_id=job.ctx.lease_id, summary=summary))


# ---------------------------------------------------------------- steps


async def _checkout(job: Job, step_log: StepLog, *, pinned: bool = False) -> git.Commit:
    """Clone the repository at the run's commit (`pinned`), else at its branch's head;
    a run of an uploaded configuration unpacks its archive instead (executor/upload.py)."""
    ctx = job.ctx
    cfg = ctx.config
    if ctx.run.source is not None:
        unpacked = await unpack_source(job, step_log)
        check_workdir(job, "in the uploaded configuration")
        return unpacked
    if pinned and not ctx.run.commit:
        raise StepFailed("checkout", "the run has no planned commit to apply")
    # git reads the path as checked, resolved: never the workspace's string again.
    target = _allowed(job, cfg.repository)
    commit = ctx.run.commit if pinned else ""
    with git_access(await gitaccess.credential(job), cfg.repository) as env:
        if job.tools.git_cache is None:
            found = await git.checkout(
                target,
                ctx.src,
                branch=cfg.branch,
                commit=commit,
                step_log=step_log,
                grace=ctx.grace,
                env=env,
            )
        else:
            found = await job.tools.git_cache.checkout(
                target,
                ctx.src,
                org=ctx.org,
                branch=cfg.branch,
                commit=commit,
                step_log=step_log,
                grace=ctx.grace,
                env=env,
            )
    # Before anything reads the checkout: no link in it may lead out (executor/linksafe.py).
    await asyncio.to_thread(linksafe.check_checkout, ctx.src)
    check_workdir(job, f"at {found.sha}")
    step_log.note(f"checked out {found.sha}")
    return found


def check_workdir(job: Job, at: str) -> None:
    """The workspace's directory is a directory inside the checkout."""
    ctx = job.ctx
    directory = ctx.config.directory
    workdir = ctx.workdir.resolve()
    if not workdir.is_relative_to(ctx.src.resolve()):
        raise StepFailed("checkout", f"directory {directory!r} is outside the repository")
    if not workdir.is_dir():
        raise StepFailed("checkout", f"directory {directory!r} does not exist {at}")


def _allowed(job: Job, repository: str) -> str:
    """What git is given for the repository (a local one: its path resolved, which no one
    but root can change, services/app/repopaths.py). Refuse one the deployment does not
    take for the run's organization, or one inside this executor's own directories or
    the kernel's (services/app/repositories.py), before git touches it: the API checked
    it when it was set, this holds for a run whose configuration came past it (an old
    event, another API's rules) and for a path that changed since."""
    sources = job.tools.sources.guarding(job.ctx.root.parent, "the executor's job directories")
    try:
        return sources.check(repository, org=job.ctx.org)
    except RepositoryRefused as e:
        raise StepFailed("checkout", str(e), reason=REPOSITORY_REFUSED) from e


async def _init(job: Job, step_log: StepLog) -> None:
    ctx = job.ctx
    await _use_binary(job, step_log)
    out = Output()
    if ctx.config.managed_state:
        write_override(ctx.workdir, within=ctx.src)
        step_log.note("state: runplane-managed (http backend served by this executor)")
    await cached_providers(job, step_log)  # executor/providerphase.py
    code = await _terraform(job, step_log, [*tf.init_args(), "-reconfigure"], out)
    if code != 0:
        raise StepFailed("init", out.error_text() or f"terraform init failed (exit {code})")


async def _plan(job: Job, step_log: StepLog) -> PlanOutcome:
    ctx = job.ctx
    out = Output()
    _write_variables(job, step_log)
    # A speculative plan takes no state lock: it must not contend with an apply's.
    args = tf.plan_args(ctx.run.run_type, lock=not ctx.run.speculative, options=ctx.run.options)
    code = await _terraform(job, step_log, args, out)
    if code not in (0, 2):  # -detailed-exitcode: 0 no changes, 2 changes, 1 error
        raise StepFailed("plan", out.error_text() or f"terraform plan failed (exit {code})")
    drift = ctx.run.run_type == "drift"
    # Policies check the JSON plan, also one with nothing to change. Read once, while
    # the plan file is sealed and stored when the exit code says there are changes.
    needed = drift or code == 2 or bool(pinned_policies(job))
    showing = asyncio.ensure_future(job.show_plan()) if needed else None
    try:
        if drift:
            assert showing is not None
            summary, has_changes = _drift(await showing, step_log)
        else:
            summary, has_changes = out.summary(), code == 2
        if not has_changes:
            return PlanOutcome(False, summary, show=await showing if showing else {})
        name, digest = await _store_plan(job, step_log)
        assert showing is not None
        show = await showing
    finally:
        if showing is not None and not showing.done():  # the upload failed: stop the show
            showing.cancel()
            await asyncio.wait([showing])
    changes = tuple(plan_changes(show, drift=drift))
    return PlanOutcome(True, summary, name, digest, changes, show=show)


async def _store_plan(job: Job, step_log: StepLog) -> tuple[str, str]:
    """Seal the plan file into the object store: (its object, its sha256)."""
    ctx = job.ctx
    name = plan_object(ctx.run_id)
    with linksafe.scratch_dir(ctx.root) as scratch:
        # Sealed from a copy of ours: Terraform's file is read once, never through a link.
        path = scratch / tf.PLAN_FILE
        await asyncio.to_thread(
            linksafe.copy_out, ctx.workdir / tf.PLAN_FILE, path, within=ctx.src, step="plan"
        )
        digest = sha256_file(path)
        await job.tools.custody.vault.upload_sealed(PLANS_BUCKET, name, path)
    step_log.note(f"plan stored sealed as {PLANS_BUCKET}/{name}, sha256 {digest}")
    return name, digest


def _drift(show: dict[str, Any], step_log: StepLog) -> tuple[PlanSummary, bool]:
    """A refresh-only plan drifted if `show -json` lists resource drift.

    Not the exit code: Terraform 1.0 exits 2 on a refresh-only plan even without drift.
    """
    summary = drift_summary(show)
    drifted = summary.add + summary.change + summary.destroy > 0
    step_log.note(
        f"drift: {summary.add} created, {summary.change} changed, "
        f"{summary.destroy} deleted outside Terraform"
    )
    return summary, drifted


async def _warm(job: Job, step_log: StepLog) -> None:
    """The apply in the plan's own checkout (executor/warm.py checked it was planned for
    this run's commit, plan and configuration, and left as it was), with the binary the
    plan's init had. The plan applied is still the sealed one, fetched and checked
    against the approved digest as a cold apply does (`_download_plan`)."""
    ctx = job.ctx
    check_workdir(job, f"at {ctx.run.commit}")
    await _use_binary(job, step_log)
    step_log.note(f"warm: the plan's checkout at {ctx.run.commit} and its .terraform, kept here")


async def _apply(job: Job, step_log: StepLog) -> PlanSummary:
    await _download_plan(job, step_log)
    await mask_planned_secrets(job)  # the plan's own values, which today's may not be
    async with track(job) as out:  # per-resource states, all reported on the way out
        try:
            code = await _terraform(job, step_log, tf.apply_args(), out)
        finally:
            # Also after a failure or an interruption: a state Terraform could not store
            # records what was changed, and must not be lost with the directory.
            rescued = await rescue_errored_state(job)
    if code != 0:
        raise StepFailed("apply", _apply_error(job, out, code, rescued))
    return out.summary()


def _apply_error(job: Job, out: Output, code: int, rescued: str) -> str:
    parts = [out.error_text() or f"terraform apply failed (exit {code})"]
    parts.append(job.tools.custody.problems())
    parts.append(rescued)  # what became of errored.tfstate
    return "\n\n".join(p for p in parts if p)


# ---------------------------------------------------------------- helpers


async def _use_binary(job: Job, step_log: StepLog) -> None:
    """Run the phase with the binary the run's `terraform_binary` setting names, if any
    (pinned at admission; empty: the executor's own), found as the job finds it and
    only among the deployment's `--terraform-binaries` when it lists them
    (executor/binary.py). Any failure is one error, `terraform_binary_not_found`: never
    a word on whether or what some path is."""
    ctx = job.ctx
    tools = job.tools
    wanted = str(approval.setting(ctx.run.snapshot, "terraform_binary") or "")
    if not wanted:
        return
    entry = ctx.run.snapshot.settings.get("terraform_binary") if ctx.run.snapshot else None
    origin = entry.get("origin", "") if isinstance(entry, dict) else ""
    source = f"setting terraform_binary{f' (from {origin})' if origin else ''}"
    found = await find_as_job(
        wanted,
        allowed=tools.terraform.allowed_binaries,
        jail=tools.jail,
        env=tools.terraform.env(),
        cwd=ctx.workdir,
    )
    if found is None:
        raise StepFailed(
            "init",
            f"terraform binary {wanted!r} of the {source} cannot be run: {NOT_RUNNABLE}",
            reason=BINARY_NOT_FOUND,
        )
    tools.terraform = replace(tools.terraform, binary=found)
    step_log.note(f"terraform binary: {found} ({source})")


async def _terraform(job: Job, step_log: StepLog, args: list[str], out: Output | None) -> int:
    tools = job.tools
    return await process.run(
        tools.terraform.argv(*args),
        cwd=job.ctx.workdir,
        env=tools.terraform.env(),
        step_log=step_log,
        on_line=out.feed if out else None,
        grace=job.ctx.grace,
        jail=tools.jail,
    )


def _write_variables(job: Job, step_log: StepLog) -> None:
    """The plain variables, as `VARS_FILE` (0600) in the working directory: never argv.

    Always written, also with no variables: the name is runplane's, and a repository's
    file of that name is replaced (not written through, executor/linksafe.py), so that
    nothing of the repository passes for the workspace's variables. JSON strings are
    taken literally by Terraform (no `${...}` templates are evaluated in them)."""
    ctx = job.ctx
    tools = job.tools
    path = ctx.workdir / tf.VARS_FILE
    replaced = path.exists() or path.is_symlink()
    plain, expressions = split_variables(ctx.config.variables)
    data = json.dumps(plain, ensure_ascii=False).encode()
    linksafe.write_new(path, data, within=ctx.src, step="plan", mode=0o600)
    if replaced:
        step_log.note(f"the repository's {tf.VARS_FILE} was replaced by the workspace's")
    options = ctx.run.options
    if options is not None and options.variables:  # the CLI's -var (executor/terraform.py)
        run_vars = tf.run_variables_file(options.variables)
        linksafe.write_new(
            ctx.workdir / tf.RUN_VARS_FILE, run_vars, within=ctx.src, step="plan", mode=0o600
        )
        step_log.note(f"run variables: {', '.join(sorted(options.variables))}")
    if expressions:
        env = {f"TF_VAR_{name}": value for name, value in expressions.items()}
        tools.terraform = replace(tools.terraform, extra_env={**tools.terraform.extra_env, **env})
        step_log.note(f"variables given as list or object values: {', '.join(sorted(expressions))}")


def split_variables(variables: Mapping[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """(literal strings for `VARS_FILE`, values for `TF_VAR_<name>`).

    A value that opens with `[` or `{` may be meant for a `list`, `map` or `object`
    variable: Terraform parses a `-var` or `TF_VAR_` value as an expression when the
    variable's declared type is a collection and takes it literally otherwise, while a
    JSON tfvars string is always a string ("list of string required"). Such values go
    through the environment (never argv), which keeps `-var`'s reading whatever the
    declared type; every other value is a literal string in the file."""
    plain: dict[str, str] = {}
    expressions: dict[str, str] = {}
    for name, value in variables.items():
        target = expressions if value.lstrip()[:1] in ("[", "{") else plain
        target[name] = value
    return plain, expressions


async def _download_plan(job: Job, step_log: StepLog) -> None:
    """Fetch and open the saved plan, and check it is byte for byte the approved one.

    It is opened in a directory of ours and renamed into the working directory once
    checked: a `plan.tfplan` of the repository (a link) is replaced, never written
    through."""
    ctx = job.ctx
    with linksafe.scratch_dir(ctx.root) as scratch:
        path = scratch / tf.PLAN_FILE
        await _fetch_plan(job, path)
        digest = sha256_file(path)
        if digest != ctx.run.plan_digest:
            raise StepFailed(
                "apply",
                f"the saved plan's sha256 {digest} differs from the approved plan's "
                f"{ctx.run.plan_digest}: refusing to apply",
                reason="plan_digest_mismatch",
            )
        linksafe.move_in(path, ctx.workdir / tf.PLAN_FILE, within=ctx.src, step="apply")
    name = ctx.run.plan_object or plan_object(ctx.run_id)
    step_log.note(f"plan {PLANS_BUCKET}/{name} verified, sha256 {digest}")


async def _fetch_plan(job: Job, path: Path) -> None:
    name = job.ctx.run.plan_object or plan_object(job.ctx.run_id)
    try:
        found = await job.tools.custody.vault.download_sealed(PLANS_BUCKET, name, path)
    except Tampered as e:
        raise StepFailed(
            "apply",
            f"the saved plan {PLANS_BUCKET}/{name} failed authentication ({e}): it was "
            "altered after the plan; refusing to apply",
            reason="plan_digest_mismatch",
        ) from e
    except CryptoError as e:
        raise StepFailed("apply", f"the saved plan {PLANS_BUCKET}/{name}: {e}") from e
    if not found:
        raise StepFailed("apply", f"the saved plan {PLANS_BUCKET}/{name} is missing")
