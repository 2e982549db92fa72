"""Workload identity: what a phase's token says, decided from the run's own aggregate. Pure.

A workspace that sets `workload_identity` gives each plan and apply phase a short-lived
JWT (signed by the deployment: infra/signing.py, minted by the secrets responder:
services/app/workload.py) that a cloud verifies with runplane's published keys alone. Its
subject and claims come from the run as recorded (organization, workspace, run, phase,
type, commit, cause) and the workspace's folder path, never from anything a request or a
tenant's file says; names are subject-safe ids (`[a-z0-9-]`), so no `:` of a name can
shift the subject's fields, and every one is checked again here before it is signed.

Claims are named as HCP Terraform names them where it has them (`terraform_*` of its
workload identity tokens), and `terraform_run_type`, `terraform_folder`,
`terraform_vcs_ref` and `terraform_commit` in the same namespace for what it has not.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from events.codec import valid_id
from events.run_state import RunState
from events.workload_rules import (
    AUDIENCE,
    DEFAULT_AUDIENCE,
    DEFAULT_TTL,
    ENABLED,
    PHASES,
    TTL,
    audience_problem,
    ttl_problem,
)

__all__ = ["TOKEN_ENV", "TOKEN_FILE_ENV", "TOKEN_FILE_VAR", "claims", "lifetime", "subject"]

# What the job is given: HCP agents' variable for the token, and the file refreshed in
# long phases (its path also as a Terraform variable a configuration may declare).
TOKEN_ENV = "TFC_WORKLOAD_IDENTITY_TOKEN"
TOKEN_FILE_ENV = "RUNPLANE_WORKLOAD_IDENTITY_TOKEN_FILE"
TOKEN_FILE_VAR = "TF_VAR_runplane_workload_identity_token_file"
CLAIMS = (
    "iss",
    "sub",
    "aud",
    "iat",
    "nbf",
    "exp",
    "jti",
    "terraform_organization_name",
    "terraform_workspace_name",
    "terraform_workspace_id",
    "terraform_full_workspace",
    "terraform_run_id",
    "terraform_run_phase",
    "terraform_run_type",
    "terraform_folder",
    "terraform_vcs_ref",
    "terraform_commit",
)


class WorkloadRefused(ValueError):
    """No token for this phase: off, not a plan or apply, or a name that is not an id."""

    retryable = False


def pinned(run: RunState, name: str, default: Any) -> Any:
    """A setting as the run was pinned to it (`{"value", "origin"}` entries)."""
    if run.snapshot is None:
        return default
    entry = run.snapshot.settings.get(name, default)
    return entry.get("value", default) if isinstance(entry, dict) else entry


def enabled(run: RunState) -> bool:
    return pinned(run, ENABLED, False) is True


def subject(org: str, ws: str, phase: str) -> str:
    return f"organization:{org}:workspace:{ws}:run_phase:{phase}"


def lifetime(run: RunState, now: datetime) -> int:
    """Seconds the phase's token lives: the workspace's ttl, never past the run's own
    `run_timeout` (when it has one); 0 if that has passed."""
    ttl = pinned(run, TTL, DEFAULT_TTL)
    ttl = ttl if not ttl_problem(ttl) else DEFAULT_TTL
    limit = pinned(run, "run_timeout", 0)
    if isinstance(limit, int) and limit > 0 and run.created_at is not None:
        left = (run.created_at + timedelta(seconds=limit) - now).total_seconds()
        ttl = min(ttl, int(left))
    return max(ttl, 0)


def claims(
    run: RunState, *, phase: str, folders: list[str], issuer: str, now: datetime, jti: str
) -> dict[str, Any]:
    """The token's claims for `phase` of `run`; WorkloadRefused when it gets none."""
    if not enabled(run):
        raise WorkloadRefused("workload identity is off for this run's workspace")
    if phase not in PHASES:
        raise WorkloadRefused(f"phase {phase!r} gets no workload identity token")
    if not all(valid_id(x) for x in (run.org, run.workspace, run.run_id, *folders)):
        raise WorkloadRefused("a name of the run is not a subject-safe id")
    ttl = lifetime(run, now)
    if ttl <= 0:
        raise WorkloadRefused("the run is past its run_timeout")
    audience = pinned(run, AUDIENCE, DEFAULT_AUDIENCE)
    if audience_problem(audience):
        raise WorkloadRefused("the run's workload_identity_audience is not one")
    org, ws = run.org, run.workspace
    issued = int(now.timestamp())
    return {
        "iss": issuer,
        "sub": subject(org, ws, phase),
        "aud": audience,
        "iat": issued,
        "nbf": issued,
        "exp": issued + ttl,
        "jti": jti,
        "terraform_organization_name": org,
        "terraform_workspace_name": ws,
        "terraform_workspace_id": f"ws-{org}.{ws}",  # as the TFE API names it
        "terraform_full_workspace": f"organization:{org}:workspace:{ws}",
        "terraform_run_id": run.run_id,
        "terraform_run_phase": phase,
        "terraform_run_type": run.run_type,
        "terraform_folder": "/".join(folders),
        "terraform_vcs_ref": _ref(run),
        "terraform_commit": run.snapshot.commit if run.snapshot is not None else run.commit,
    }


def _ref(run: RunState) -> str:
    """The ref the run's commit came from: a webhook's, else the workspace's branch."""
    if run.cause is not None and run.cause.ref:
        return run.cause.ref
    if run.config is not None and run.config.branch and run.source is None:
        return f"refs/heads/{run.config.branch}"
    return ""
