"""Policy sets: OPA Rego modules attached to an organization, a folder or a workspace,
checked against the plan. Pure (compiling and evaluating Rego lives in
infra/policy/evaluate.py, the only module that imports regopy).

Enforcement levels:

- `advisory`: the result is recorded, nothing else;
- `soft-mandatory`: a failure makes the run wait for approval even where approval is
  off, and the approval records that it overrode the policy;
- `hard-mandatory`: a failure fails the run with the policy's messages.

A policy set is a Rego module whose `deny` rule (a set of messages) is evaluated with the
plan's JSON (`terraform show -json`) as `input`: it passes when `deny` is empty.

Policy sets are stored on the organization (`org.policy_set`, `org.policy_deleted`),
each with its scope: "org", "folder:<name>" or "workspace:<name>". A workspace is checked
against the sets of its organization, of every folder on its path and its own; the run
pins them at admission (its snapshot), so a policy changed later changes no run.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime

import msgspec

from events.base import Command, Event
from events.errors import Invalid, NotFound

ENFORCEMENTS = ("advisory", "soft-mandatory", "hard-mandatory")
MAX_SOURCE = 256 * 1024
_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")


class PolicySet(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    enforcement: str
    source: str
    scope: str = "org"  # org | folder:<name> | workspace:<name>
    description: str = ""


class PolicyResult(msgspec.Struct, frozen=True, kw_only=True):
    """One policy set's verdict on one plan; `messages` are its `deny` messages, or the
    error that kept it from being evaluated (which counts as a failure)."""

    name: str
    enforcement: str
    scope: str
    passed: bool
    messages: list[str] = []


class PolicySaved(Event, frozen=True, kw_only=True, tag="org.policy_set"):
    policy: PolicySet


class PolicyDeleted(Event, frozen=True, kw_only=True, tag="org.policy_deleted"):
    name: str


class SavePolicy(Command, frozen=True, kw_only=True):
    """Create or replace a policy set; the caller has compiled its source first."""

    policy: PolicySet


class DeletePolicy(Command, frozen=True, kw_only=True):
    name: str


def check(policy: PolicySet, folders: Iterable[str]) -> None:
    """Invalid (or NotFound for a missing folder) unless the set is well formed."""
    if not _NAME.fullmatch(policy.name):
        raise Invalid("a policy name is 1-63 lowercase letters, digits and dashes")
    if policy.enforcement not in ENFORCEMENTS:
        raise Invalid(f"enforcement must be one of {', '.join(ENFORCEMENTS)}")
    if not policy.source.strip():
        raise Invalid("a policy needs its Rego source")
    if len(policy.source.encode()) > MAX_SOURCE:
        raise Invalid(f"a policy's source is at most {MAX_SOURCE} bytes")
    if len(policy.description) > 1000:
        raise Invalid("a description is at most 1000 characters")
    kind, _, target = policy.scope.partition(":")
    if policy.scope == "org":
        return
    if kind not in ("folder", "workspace") or not _NAME.fullmatch(target):
        raise Invalid("scope must be org, folder:<name> or workspace:<name>")
    if kind == "folder" and target not in set(folders):
        raise NotFound(f"folder {target} does not exist")


def save(
    policies: Mapping[str, PolicySet], cmd: SavePolicy, folders: Iterable[str], now: datetime
) -> list[PolicySaved]:
    check(cmd.policy, folders)
    if policies.get(cmd.policy.name) == cmd.policy:
        return []  # the same set saved again changes nothing
    return [PolicySaved(at=now, actor=cmd.actor, policy=cmd.policy)]


def delete(
    policies: Mapping[str, PolicySet], cmd: DeletePolicy, now: datetime
) -> list[PolicyDeleted]:
    if cmd.name not in policies:
        raise NotFound(f"policy {cmd.name} does not exist")
    return [PolicyDeleted(at=now, actor=cmd.actor, name=cmd.name)]


def applied(
    policies: Mapping[str, PolicySet], event: PolicySaved | PolicyDeleted
) -> dict[str, PolicySet]:
    out = dict(policies)
    if isinstance(event, PolicySaved):
        out[event.policy.name] = event.policy
    else:
        out.pop(event.name, None)
    return out


def for_workspace(
    policies: Mapping[str, PolicySet], folder_path: Sequence[str], workspace: str
) -> list[PolicySet]:
    """The sets a workspace is checked against, outermost scope first: the
    organization's, each folder's on its path (outermost first), its own."""
    scopes = ["org", *(f"folder:{f}" for f in folder_path), f"workspace:{workspace}"]
    rank = {s: i for i, s in enumerate(scopes)}
    chosen = [p for p in policies.values() if p.scope in rank]
    return sorted(chosen, key=lambda p: (rank[p.scope], p.name))


def hard_failures(results: Iterable[PolicyResult]) -> list[PolicyResult]:
    return [r for r in results if not r.passed and r.enforcement == "hard-mandatory"]


def soft_failures(results: Iterable[PolicyResult]) -> list[PolicyResult]:
    return [r for r in results if not r.passed and r.enforcement == "soft-mandatory"]


def failure_message(failed: Iterable[PolicyResult]) -> str:
    lines = []
    for r in failed:
        for m in r.messages or ["denied"]:
            lines.append(f"{r.name}: {m}")
    return "\n".join(lines)
