"""What the reporter asks of a VCS (services/vcs/github.py, gitlab.py), and how.

A `Client` posts a commit status and keeps one comment of a pull request (a merge
request's note on GitLab). Every call is made to the connection's `api_url`, which the
tenant chose: the address actually connected to is judged by the notifications' SSRF
guard (services/notifications/guard.py) inside each client's transport, and redirects
are never followed, so neither a name resolving to 127.0.0.1 nor a 3xx to the metadata
service reaches anything. `RUNPLANE_VCS_ALLOW` (same kinds as `RUNPLANE_NOTIFY_ALLOW`,
which it defaults to) lets a deployment reach a GitHub Enterprise or GitLab on its own
network.

Errors are `VcsError`s: `retryable` for 429, 5xx and no answer (timeout, connection
refused), permanent for any other 4xx and for a refused address.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Protocol

from services.notifications import guard

ALLOW_ENV = "RUNPLANE_VCS_ALLOW"
TIMEOUT_ENV = "RUNPLANE_VCS_TIMEOUT"  # seconds one call may take, from connect to answer
SCHEDULE_ENV = "RUNPLANE_VCS_RETRY"  # seconds between tries, comma separated
USER_AGENT = "runplane-vcs/1"
PENDING, SUCCESS, FAILURE = "pending", "success", "failure"


class VcsError(Exception):
    """Root of the errors of the VCS side; `retryable` says whether trying again helps."""

    retryable = False

    def __init__(self, message: str, *, status: int = 0, retryable: bool | None = None) -> None:
        super().__init__(message)
        self.status = status
        if retryable is not None:
            self.retryable = retryable


class Gone(VcsError):
    """The comment to edit is not there (deleted by someone, or never ours): post anew."""


def error_for(status: int, what: str) -> VcsError:
    """The error an HTTP answer `status` to `what` is: retryable for 429 and 5xx."""
    retry = status == 429 or status >= 500
    cls = Gone if status in (403, 404) and what.startswith("edit") else VcsError
    return cls(f"{what}: the VCS answered {status}", status=status, retryable=retry)


@dataclass(frozen=True)
class Policy:
    """How calls are made; tests shorten the schedule and allow loopback."""

    allow: frozenset[str] = frozenset()  # guard.KINDS the deployment allows
    timeout: float = 10.0  # one call, connecting to the end of the answer
    # Seconds before each retry of a report (its event put back), then it is given up.
    schedule: tuple[float, ...] = (2, 10, 30, 120, 600, 1800)
    per_connection: int = 4  # reports in flight to one connection's VCS
    per_org: int = 8  # calls in flight for one organization, all its connections
    waiting: int = 64  # reports waiting for a connection before the next are put back

    def backoff(self, delivered: int) -> float | None:
        """The delay before the next try of a report tried `delivered` times (None: give
        up: the VCS has failed for the whole schedule)."""
        return self.schedule[delivered - 1] if 0 < delivered <= len(self.schedule) else None


def allowed_from_env() -> frozenset[str]:
    raw = os.environ.get(ALLOW_ENV)
    if raw is None:
        return guard.allowed_from_env()
    return frozenset(k.strip() for k in raw.split(",") if k.strip() in guard.KINDS)


def policy_from_env() -> Policy:
    """The deployment's policy: allowed ranges, and (for tests) a shorter schedule."""
    try:
        raw = os.environ.get(SCHEDULE_ENV, "")
        schedule = tuple(float(x) for x in raw.split(",") if x.strip()) or Policy.schedule
        timeout = float(os.environ.get(TIMEOUT_ENV, "") or Policy.timeout)
    except ValueError as e:
        raise VcsError(f"{SCHEDULE_ENV} / {TIMEOUT_ENV}: not seconds: {e}") from e
    return Policy(allow=allowed_from_env(), schedule=schedule, timeout=timeout)


class Client(Protocol):
    """One connection's VCS, as the reporter uses it (repository = its full path)."""

    async def set_status(
        self, repo: str, sha: str, *, state: str, context: str, description: str, url: str
    ) -> None: ...

    async def find_comment(self, repo: str, number: int, marker: str) -> int:
        """The id of the pull request's comment holding `marker` (0: none)."""
        ...

    async def create_comment(self, repo: str, number: int, body: str) -> int: ...

    async def edit_comment(self, repo: str, number: int, comment_id: int, body: str) -> None:
        """Raises `Gone` when the comment is not there to edit."""
        ...

    async def aclose(self) -> None: ...
