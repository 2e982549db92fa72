"""Value types carried inside run events: workspace snapshot, plan changes, resource states."""

from __future__ import annotations

import re
from datetime import datetime
from typing import Any

import msgspec

from events.policies import PolicySet

SENSITIVE = "(sensitive)"

# The order the change review lists groups in, and each group's heading.
CHANGE_GROUPS = (
    ("delete", "will be deleted"),
    ("replace", "will be replaced"),
    ("update", "will be updated"),
    ("create", "will be created"),
)
RESOURCE_STATES = ("pending", "applying", "done", "failed", "not_applied")


class Workspace(msgspec.Struct, frozen=True, kw_only=True):
    """What the run needs to know of its workspace, snapshotted at creation.

    `secret_variables` holds names only: secret values never enter an event.
    """

    repository: str
    branch: str = "main"
    directory: str = "."
    variables: dict[str, str] = {}
    secret_variables: list[str] = []
    heartbeat_timeout: int = 600
    dispatch_timeout: int = 0
    managed_state: bool = True
    # Which webhooks start its runs (services/processes/vcs): the connection, and what must change.
    vcs_connection: str = ""  # "" none
    trigger_paths: list[str] = []  # globs on repository paths; [] anything under `directory`
    trigger_any_change: bool = False  # any changed file of the repository triggers it
    trigger_tags: list[str] = []  # tag name globs whose push starts a run; [] none
    vcs_run_type: str = "apply"  # what a push starts: plan or apply


# Every way a run starts (`Cause.kind`).
CAUSE_KINDS = (
    "api", "cli", "ui", "vcs", "schedule", "run_trigger", "chat", "rerun", "stack_run",
)  # fmt: skip


class Cause(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Why a run exists, recorded in its `run.created`: the kind, and what identifies the
    cause of that kind (members that do not apply are left out of the event and of the
    API's view)."""

    kind: str  # one of CAUSE_KINDS
    user: str = ""  # the runplane user behind it; "" for none (a schedule, a webhook)
    # vcs
    provider: str = ""  # github | gitlab
    connection: str = ""  # the VCS connection's id
    delivery: str = ""  # the webhook's delivery id
    event: str = ""  # push | tag | pull_request
    ref: str = ""  # refs/heads/main, refs/tags/v1.2
    commit: str = ""  # the commit the webhook named
    repository: str = ""  # the VCS's full name of the repository (acme/net)
    pull_request: int = 0  # the pull (merge) request's number
    # schedule
    schedule: str = ""
    fire_time: datetime | None = None
    # run_trigger
    source_workspace: str = ""
    source_run: str = ""
    # rerun
    rerun_of: str = ""
    # stack_run (events/stack_runs.py): the stack, its run, and the node's attempt
    stack: str = ""
    stack_run: str = ""
    attempt: int = 0

    def describe(self) -> str:
        """One line for people: `push of 1a2b3c4d on refs/heads/main (github)`."""
        by = f" by {self.user}" if self.user else ""
        match self.kind:
            case "vcs" if self.pull_request:
                return f"pull request #{self.pull_request} at {self.commit[:8]} ({self.provider})"
            case "vcs":
                return (
                    f"{self.event or 'push'} of {self.commit[:8]} on {self.ref} ({self.provider})"
                )
            case "schedule":
                when = self.fire_time.isoformat() if self.fire_time else ""
                return f"schedule {self.schedule} firing at {when}"
            case "run_trigger":
                return f"run trigger: run {self.source_run} of {self.source_workspace}"
            case "rerun":
                return f"rerun of {self.rerun_of}{by}"
            case "stack_run":
                return f"stack {self.stack} run {self.stack_run} (attempt {self.attempt}){by}"
            case _:
                return f"{self.kind}{by}"


class ConfigSource(msgspec.Struct, frozen=True, kw_only=True):
    """Where a run's configuration comes from when it is not the workspace's repository:
    an archive the Terraform CLI uploaded (a TFE configuration version), sealed in the
    object store. The executor fetches it, checks `digest` and extracts it
    (executor/upload.py) instead of a git checkout."""

    kind: str = "upload"  # the only kind so far
    id: str  # the configuration version's id (cv-...)
    object: str  # its object in `bucket`, sealed (AES-GCM, bound to bucket/object)
    bucket: str = "rp-plans"
    digest: str  # hex sha256 of the archive as uploaded (before sealing)
    size: int = 0  # its size in bytes


class RunOptions(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """What a run asks of its plan beyond the run type (the CLI's -refresh-only,
    -target, -replace, -var): validated at creation (events/run_decide.py), passed to
    Terraform as separate arguments by the executor (executor/terraform.py)."""

    refresh_only: bool = False
    refresh: bool = True  # False: -refresh=false
    destroy: bool = False  # a plan run that plans a destroy (`terraform plan -destroy`)
    confirm: bool = False  # the plan waits for approval whatever require_approval says
    # (the CLI's "yes" is the approval: TFE's apply action)
    targets: list[str] = []  # resource addresses for -target=
    replaces: list[str] = []  # resource addresses for -replace=
    variables: dict[str, str] = {}  # run variables (HCL expressions, as -var takes them)


# A resource address as -target= and -replace= take it: `module.m["k"].aws_instance.a[0]`.
# Narrow on purpose (no spaces, no leading dash, no control characters): it goes to
# Terraform's argv, and nothing but an address may pass for one.
_IDENT = r"[A-Za-z_][A-Za-z0-9_-]*"
_INDEX = r'(?:\[(?:[0-9]+|"[^"\\\x00-\x1f\x7f]*")\])?'
ADDRESS_RE = re.compile(rf"{_IDENT}{_INDEX}(?:\.{_IDENT}{_INDEX})*")
VARIABLE_RE = re.compile(_IDENT)
MAX_ADDRESSES = 100
MAX_ADDRESS = 512
MAX_RUN_VARIABLES = 100
MAX_RUN_VARIABLE = 64 * 1024


def options_problem(options: RunOptions) -> str:
    """Why a run's options are refused ("" when they are not)."""
    for what, addresses in (("target", options.targets), ("replace", options.replaces)):
        if len(addresses) > MAX_ADDRESSES:
            return f"at most {MAX_ADDRESSES} {what} addresses"
        for address in addresses:
            if len(address) > MAX_ADDRESS or not ADDRESS_RE.fullmatch(address):
                return f"{what} address {address[:80]!r} is not a resource address"
    if options.refresh_only and options.replaces:
        return "a refresh-only run replaces nothing"
    if options.destroy and options.refresh_only:
        return "a run is a destroy or refresh-only, not both"
    if options.refresh_only and not options.refresh:
        return "a refresh-only run must refresh"
    if len(options.variables) > MAX_RUN_VARIABLES:
        return f"at most {MAX_RUN_VARIABLES} run variables"
    for name, value in options.variables.items():
        if not VARIABLE_RE.fullmatch(name) or len(name) > 128:
            return f"run variable name {name[:80]!r} is not an identifier"
        if len(value) > MAX_RUN_VARIABLE or "\x00" in value:
            return f"run variable {name} is too long or holds a NUL"
    return ""


class PlanSummary(msgspec.Struct, frozen=True, kw_only=True):
    add: int = 0
    change: int = 0
    destroy: int = 0


class AttributeChange(msgspec.Struct, frozen=True, kw_only=True):
    """One attribute that changes; sensitive values are the string "(sensitive)"."""

    name: str
    before: Any = None
    after: Any = None
    forces_replacement: bool = False


class ResourceChange(msgspec.Struct, frozen=True, kw_only=True):
    """One resource in the plan, from `terraform show -json`'s resource_changes."""

    address: str
    type: str
    name: str = ""
    module: str = ""
    action: str  # create | update | delete | replace | read | no-op
    attributes: list[AttributeChange] = []
    replace_paths: list[str] = []


class VariableRef(msgspec.Struct, frozen=True, kw_only=True):
    """A variable's name and where its value came from; never the value of a secret."""

    name: str
    origin: str = "workspace"
    sensitive: bool = False


class Snapshot(msgspec.Struct, frozen=True, kw_only=True):
    """What the run is pinned to before any executor sees it."""

    commit: str = ""
    variables: list[VariableRef] = []
    settings: dict[str, Any] = {}
    policies: list[PolicySet] = []  # the policy sets the plan is checked against


# Settings the run's executor and reaper read from its workspace configuration.
PINNED_TIMEOUTS = ("heartbeat_timeout", "dispatch_timeout")


def pinned_config(config: Workspace | None, snapshot: Snapshot | None) -> Workspace | None:
    """The configuration a run executes under: the timeouts its snapshot's effective
    settings resolved (`{"value", "origin"}` entries; older snapshots held bare values)."""
    if config is None or snapshot is None:
        return config
    found: dict[str, int] = {}
    for name in PINNED_TIMEOUTS:
        entry = snapshot.settings.get(name)
        value = entry.get("value") if isinstance(entry, dict) else entry
        if isinstance(value, int) and not isinstance(value, bool):
            found[name] = value
    return msgspec.structs.replace(config, **found) if found else config
