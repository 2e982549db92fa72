"""Domain errors. Every error knows whether retrying could help."""

from __future__ import annotations


class DomainError(Exception):
    """Root of every error the core raises."""

    retryable = False
    code = "domain-error"


class Invalid(DomainError):
    """A command is malformed or refers to something that does not make sense."""

    code = "invalid-command"


class NotFound(DomainError):
    """The aggregate does not exist."""

    code = "not-found"


class AlreadyExists(DomainError):
    """The aggregate was created already."""

    code = "already-exists"


class IllegalTransition(DomainError):
    """The command is not allowed in the aggregate's current status."""

    code = "illegal-transition"

    def __init__(self, message: str, *, status: str) -> None:
        super().__init__(message)
        self.status = status


class StaleLease(DomainError):
    """A report came from an executor whose lease is no longer current (fencing)."""

    code = "stale-lease"


class Forbidden(DomainError):
    """The actor may not do this to the aggregate (e.g. unlock someone else's lock)."""

    code = "forbidden"


class Conflict(DomainError):
    """Someone appended to the aggregate first; reload and decide again."""

    retryable = True
    code = "conflict"


class QuotaExceeded(DomainError):
    """A tenant reached one of the deployment's quotas (open runs, ...): nothing was
    written; it may be tried again once something it holds has ended."""

    code = "quota-exceeded"


class SnapshotFailed(DomainError):
    """A run's admission snapshot cannot be taken (its branch cannot be resolved: the
    shell's `git ls-remote`, services/app/snapshot.py); the run fails."""

    code = "checkout-failed"


class Deleted(IllegalTransition):
    """The aggregate was deleted: it keeps its history, but takes no new command (a
    workspace's name is free again only once it is purged)."""

    code = "workspace-deleted"

    def __init__(self, message: str) -> None:
        super().__init__(message, status="deleted")


class RepositoryRefused(Exception):
    """A workspace's repository is not one this deployment takes; `rule` says which
    (the rules: `events.workspace.repository_problem`, services/app/repositories.py).

    Not a DomainError: no command decided it. Here, below the API and the executor,
    which both catch it."""

    retryable = False

    def __init__(self, rule: str, message: str) -> None:
        super().__init__(f"{message} (rule: {rule})")
        self.rule = rule
        self.message = message
