"""The policy step of a plan phase: the run's pinned policy sets (its snapshot) checked
against the plan's JSON (`terraform show -json`), each result written to the step's log.

The verdict is the core's (events/run.py on `FinishPlan.policies`): a hard-mandatory
failure fails the run `policy_failed`, a soft-mandatory one makes it wait for approval.
The step itself fails only if the policies could not be checked at all: the sets run in
the policy sandbox (infra/policy/sandbox.py), and one that passes its memory or time cap
fails the run `policy_limit_exceeded`, naming the set and the cap, whatever its
enforcement (the plan was not checked).

Policy messages may quote the plan, which carries sensitive values in clear: before they
leave the executor (log and event) they are masked like every log line, and also hide the
values the plan marks sensitive.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

from events import policies as po
from events.policies import PolicyResult
from executor.errors import StepFailed
from executor.job import Job
from executor.process import StepLog
from infra.policy.sandbox import PolicyLimitExceeded, SandboxError

_MIN_SENSITIVE = 4  # shorter sensitive strings ("true", "1") would hide too much
LIMIT_EXCEEDED = "policy_limit_exceeded"


def pinned_policies(job: Job) -> list[po.PolicySet]:
    snapshot = job.ctx.run.snapshot
    return list(snapshot.policies) if snapshot is not None else []


async def check_policies(job: Job, step_log: StepLog, show: dict[str, Any]) -> list[PolicyResult]:
    sets = pinned_policies(job)
    names = ", ".join(f"{p.name} ({p.enforcement}, {p.scope})" for p in sets)
    step_log.note(f"checking the plan against {len(sets)} policy set(s): {names}")
    started = time.perf_counter()
    mask = job.tools.masker.with_values(sensitive_strings(show))
    try:
        results = await job.tools.policy_sandbox.evaluate(sets, show)
    except SandboxError as e:
        message = mask(str(e))  # the names are the tenant's, not secret; masked all the same
        step_log.note(f"the policies could not be checked: {message}")
        reason = LIMIT_EXCEEDED if isinstance(e, PolicyLimitExceeded) else ""
        raise StepFailed("policy", message, reason=reason) from e
    took = time.perf_counter() - started
    results = [msgspec.structs.replace(r, messages=[mask(m) for m in r.messages]) for r in results]
    for r in results:
        verdict = "passed" if r.passed else "failed"
        step_log.write(f"{r.name} ({r.enforcement}, {r.scope}): {verdict}\n")
        for message in r.messages:
            step_log.write(f"  - {message}\n")
    hard, soft = po.hard_failures(results), po.soft_failures(results)
    advisory = [r for r in results if not r.passed and r.enforcement == "advisory"]
    if hard:
        step_log.note(f"hard-mandatory failed ({_names(hard)}): the run fails")
    elif soft:
        step_log.note(f"soft-mandatory failed ({_names(soft)}): the run needs an approval")
    if advisory:
        step_log.note(f"advisory failed ({_names(advisory)}): recorded only")
    step_log.note(
        f"{sum(r.passed for r in results)} of {len(results)} passed in {took * 1000:.0f} ms"
    )
    return results


def _names(results: list[PolicyResult]) -> str:
    return ", ".join(r.name for r in results)


def sensitive_strings(show: dict[str, Any]) -> list[str]:
    """The strings a JSON plan marks sensitive (`before_sensitive` / `after_sensitive` of
    each resource change and drift, sensitive outputs)."""
    found: list[str] = []

    def collect(value: Any) -> None:
        if isinstance(value, str):
            if len(value) >= _MIN_SENSITIVE:
                found.append(value)
        elif isinstance(value, dict):
            for v in value.values():
                collect(v)
        elif isinstance(value, list):
            for v in value:
                collect(v)

    def walk(value: Any, marks: Any) -> None:
        if marks is True:
            collect(value)
        elif isinstance(marks, dict) and isinstance(value, dict):
            for key, m in marks.items():
                walk(value.get(key), m)
        elif isinstance(marks, list) and isinstance(value, list):
            for v, m in zip(value, marks, strict=False):
                walk(v, m)

    items = [*(show.get("resource_changes") or []), *(show.get("resource_drift") or [])]
    changes = [item.get("change") or {} for item in items if isinstance(item, dict)]
    outputs = show.get("output_changes") or {}
    changes += [c for c in outputs.values() if isinstance(c, dict)]
    for change in changes:
        walk(change.get("before"), change.get("before_sensitive"))
        walk(change.get("after"), change.get("after_sensitive"))
    return found
