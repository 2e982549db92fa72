"""The phase of a template's custom step: a command run in the checked-out repository.

A `custom` step of a run's template (`events/templates.py`) is dispatched as its own
phase, `custom-<number>`. The executor checks out the run's commit (pinned at admission;
else the branch head), then runs the step's command with `/bin/sh -c` in the workspace's
directory of the checkout, through the same process runner as Terraform: logged live and
masked, interrupted (SIGINT to its process group) when the run is stopped or the executor
stops. Its environment is the host's without runplane's own variables
(`infra/childenv.py`), the run's variables as `TF_VAR_<name>` (secret ones too,
masked in the log), and `RUNPLANE_RUN_ID`, `RUNPLANE_STEP` (the step's number),
`RUNPLANE_STEP_NAME`, `RUNPLANE_ORG`, `RUNPLANE_WORKSPACE`, and `RUNPLANE_APPLIED` (`true`
once the run's apply or destroy step ran, else `false`: for a step that says `always`).

Exit 0 reports `FinishCustomStep`; anything else fails the run with `step_failed`, the exit
code and the output's last lines.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Awaitable, Callable

from events.run import FinishCustomStep
from events.templates import TemplateStep, phase_of
from executor import git, process
from executor.errors import StepFailed
from executor.job import Job, step
from executor.process import StepLog
from infra.childenv import child_env

REASON = "step_failed"
SHELL = "/bin/sh"
TAIL_LINES = 20
_LINE_MAX = 500

Checkout = Callable[..., Awaitable[git.Commit]]


def is_custom(phase: str) -> bool:
    return phase.startswith("custom-")


def step_name(s: TemplateStep) -> str:
    """The executor step's name (a subject-safe token): the step's label as a slug."""
    slug = re.sub(r"[^a-z0-9]+", "-", s.label.lower()).strip("-")[:63].strip("-")
    if not slug or slug in ("checkout", "init", "plan", "apply"):
        return f"custom-{s.number}"
    return slug


def template_step(job: Job) -> TemplateStep:
    """The custom step the job's phase runs, from the run's recorded steps."""
    ctx = job.ctx
    for s in ctx.run.steps:
        if s.kind == "custom" and phase_of(s) == ctx.phase:
            return s
    raise StepFailed(ctx.phase, f"the run has no custom step for phase {ctx.phase}", reason=REASON)


async def custom_phase(job: Job, checkout: Checkout) -> None:
    """Checkout, run the step's command, report it finished (or raise StepFailed)."""
    ctx = job.ctx
    ts = template_step(job)
    pinned = bool(ctx.run.commit)
    await step(job, "checkout", lambda lg: _own_checkout(job, lg, checkout, pinned=pinned))
    await step(job, step_name(ts), lambda lg: _command(job, ts, lg))
    job.finishing = True
    await job.report(FinishCustomStep(actor=ctx.actor, lease_id=ctx.lease_id, number=ts.number))


async def _own_checkout(
    job: Job, step_log: StepLog, checkout: Checkout, *, pinned: bool
) -> git.Commit:
    """The checkout, with every object its own: the command may run git as the job."""
    found = await checkout(job, step_log, pinned=pinned)
    await git.dissociate(job.ctx.src, step_log=step_log, grace=job.ctx.grace)
    return found


def command_env(job: Job, ts: TemplateStep) -> dict[str, str]:
    """What the command's process sees (see the module's docstring)."""
    ctx = job.ctx
    extra = {f"TF_VAR_{k}": v for k, v in ctx.config.variables.items()}
    # Secret variables: fetched under the lease by `executor.custody.guarded`.
    extra.update(
        {k: v for k, v in job.tools.terraform.extra_env.items() if k.startswith("TF_VAR_")}
    )
    extra.update(
        RUNPLANE_RUN_ID=ctx.run_id,
        RUNPLANE_STEP=str(ts.number),
        RUNPLANE_STEP_NAME=ts.label,
        RUNPLANE_ORG=ctx.org,
        RUNPLANE_WORKSPACE=ctx.ws,
        # A step that says `always` runs after an apply that did not run too: say which.
        RUNPLANE_APPLIED="true" if ctx.run.apply_done else "false",
    )
    return child_env(extra)


async def _command(job: Job, ts: TemplateStep, step_log: StepLog) -> None:
    tail: deque[str] = deque(maxlen=TAIL_LINES)

    def keep(line: str) -> None:  # already masked
        text = line.rstrip("\r\n")
        tail.append(text if len(text) <= _LINE_MAX else text[:_LINE_MAX] + "...")

    step_log.note(f"running step {ts.number} ({ts.label}): {SHELL} -c {ts.command!r}")
    code = await process.run(
        [SHELL, "-c", ts.command],
        cwd=job.ctx.workdir,
        env=command_env(job, ts),
        step_log=step_log,
        on_line=keep,
        grace=job.ctx.grace,
        jail=job.tools.jail,
    )
    if code == 0:
        return
    how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
    message = f"custom step {ts.number} ({ts.label}) {how}"
    last = "\n".join(tail).strip()
    if last:
        message += f"; its last lines:\n{last}"
    raise StepFailed(step_name(ts), job.tools.masker(message), reason=REASON)
