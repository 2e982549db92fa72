"""Inherited settings: organization -> folders (nested) -> workspace.

Each level stores only what it sets. The effective value of a setting is the one set at
the nearest level, or the default, and it records where it came from (its origin).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from events import workload_rules as workload
from events.errors import Invalid


def _bool(v: Any) -> str:
    return "" if isinstance(v, bool) else "must be true or false"


def _seconds(v: Any) -> str:
    ok = isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 30 * 24 * 3600
    return "" if ok else "must be a whole number of seconds from 0 to 2592000"


def _positive_seconds(v: Any) -> str:
    return _seconds(v) or ("" if v >= 1 else "must be at least 1 second")


def _name(v: Any) -> str:
    ok = isinstance(v, str) and 0 < len(v) <= 63 and v.replace("-", "").isalnum() and v.islower()
    return "" if ok else "must be a lowercase name of letters, digits and dashes"


def _binary(v: Any) -> str:
    """An absolute path, or a bare name looked up on the executor's PATH (empty: the
    executor's own). A relative path would depend on the executor's working directory
    or run a file of the checked-out repository (the executor refuses it at run time
    too: executor/terraform.py `resolve_binary`)."""
    if not isinstance(v, str) or len(v) > 4096 or not v.isprintable():
        return "must be an absolute path or a bare name"
    if not v or ("/" not in v and v not in (".", "..")):
        return ""
    if not v.startswith("/"):
        return f"must be an absolute path or a bare name, not the relative path {v!r}"
    if ".." in v.split("/"):
        return f"must be an absolute path without '..' components, not {v!r}"
    return ""


def _templates(v: Any) -> str:
    """A default template per run type: {"apply": "with-lint", "plan": "quick"}."""
    if not isinstance(v, dict):
        return "must be an object of run type to template name"
    for key, name in v.items():
        if key not in ("plan", "apply", "destroy", "drift"):
            return f"has an unknown run type {key!r} (plan, apply, destroy or drift)"
        if _name(name):
            return f"names an invalid template {name!r}"
    return ""


def _principals(v: Any) -> str:
    """People are plain user names (or emails); groups are written `group:<name>`, teams
    `team:<name>`."""
    if not isinstance(v, list) or len(v) > 1000:
        return "must be a list of user names, group:<name> and team:<name> entries"
    for item in v:
        kind, _, rest = item.partition(":") if isinstance(item, str) else ("", "", item)
        name = rest if kind in ("group", "team") else item
        if kind not in ("group", "team") and isinstance(item, str) and "@" in item:
            name = item.replace("@", "-").replace(".", "-").replace("_", "-").casefold()
        if _name(name):
            return f"has an invalid entry {item!r}"
    return ""


def days_problem(v: Any) -> str:
    ok = isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_DAYS
    return "" if ok else f"must be a whole number of days from 0 to {MAX_DAYS}"


MAX_DAYS = 36500
# Retention (services/processes/retention.py): the organization's alone, never inherited
# from or set by a folder or a workspace (their admins do not decide what the org keeps).
LOG_RETENTION = "log_retention_days"
RECORD_RETENTION = "record_retention_days"  # 0: never (the deployment's default)
ORG_ONLY = frozenset({LOG_RETENTION, RECORD_RETENTION})


class Spec(NamedTuple):
    default: Any
    check: Callable[[Any], str]
    doc: str


SPECS: dict[str, Spec] = {
    "require_approval": Spec(True, _bool, "a person must approve before apply"),
    "confirm_destructive": Spec(False, _bool, "approval lists every delete and replace"),
    "four_eyes": Spec(False, _bool, "the run's creator may not approve it"),
    "approvers": Spec([], _principals, "who may approve or discard (empty: anyone with write)"),
    "heartbeat_timeout": Spec(600, _positive_seconds, "seconds of executor silence"),
    "dispatch_timeout": Spec(0, _seconds, "seconds a step may wait for an executor (0: ever)"),
    "approval_timeout": Spec(0, _seconds, "seconds a run may await approval (0: no limit)"),
    "run_timeout": Spec(0, _seconds, "seconds a run may stay open (0: no limit)"),
    "executor_pool": Spec("default", _name, "the executor pool that runs the steps"),
    "terraform_binary": Spec(
        "",
        _binary,
        "terraform or tofu binary: an absolute path or a name on the executor's "
        "PATH (empty: the executor's own)",
    ),
    "speculative_plans": Spec(False, _bool, "plan-only runs bypass the workspace queue"),
    "templates": Spec({}, _templates, "default template per run type (empty: built-in)"),
    "auto_apply_run_triggers": Spec(
        False, _bool, "a run a run trigger started applies without waiting for approval"
    ),
    # events/workload.py: each plan and apply phase gets a JWT runplane signs
    workload.ENABLED: Spec(False, _bool, "each plan and apply phase gets a workload identity JWT"),
    workload.AUDIENCE: Spec(
        workload.DEFAULT_AUDIENCE, workload.audience_problem, "the workload token's `aud`"
    ),
    RECORD_RETENTION: Spec(
        None,
        days_problem,
        "days after a run ended that its whole record (rows, logs, plan) is kept; 0: for "
        "ever (null: the deployment's default, 0 unless set); the organization's setting only",
    ),
    LOG_RETENTION: Spec(
        None,
        days_problem,
        "days after a run ended that its stored logs are kept (null: the deployment's "
        "default, 90 unless set); the organization's setting only",
    ),
    workload.TTL: Spec(
        workload.DEFAULT_TTL,
        workload.ttl_problem,
        "seconds a workload token lives (60 to 43200; never past the run's run_timeout)",
    ),
}

DEFAULT_ORIGIN = "default"


def validate(patch: Mapping[str, Any], *, org: bool = False) -> dict[str, Any]:
    """Check a partial settings object; `None` unsets a value at that level. `org`: the
    organization's own level (the only one that may set ORG_ONLY settings)."""
    errors = []
    for key, value in patch.items():
        spec = SPECS.get(key)
        if spec is None:
            errors.append(f"unknown setting {key!r}")
        elif key in ORG_ONLY and not org:
            errors.append(f"{key} is an organization setting only")
        elif value is not None and (problem := spec.check(value)):
            errors.append(f"{key} {problem}")
    if errors:
        raise Invalid("; ".join(errors))
    return dict(patch)


def merge(current: Mapping[str, Any], patch: Mapping[str, Any]) -> dict[str, Any]:
    """Apply a validated patch to one level's own settings (None removes a key)."""
    out = dict(current)
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = value
    return out


def effective(levels: Sequence[tuple[str, Mapping[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Resolve settings along the path, outermost level first: [("org", {...}),
    ("folder:platform", {...}), ("workspace", {...})]. Every known setting gets a value
    and the origin of that value."""
    out = {name: {"value": spec.default, "origin": DEFAULT_ORIGIN} for name, spec in SPECS.items()}
    for origin, values in levels:
        for name, value in values.items():
            if name in out:
                out[name] = {"value": value, "origin": origin}
    return out


def values(resolved: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """Just the values of resolved settings."""
    return {name: entry["value"] for name, entry in resolved.items()}
