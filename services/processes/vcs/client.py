"""What the reporter asks of a VCS (services/processes/vcs/github.py, gitlab.py), and how.

A `Client` posts a commit status and keeps one comment of a pull request (a merge
request's note on GitLab). Every call is made to the connection's `api_url`, which the
tenant chose: the address actually connected to is judged by the notifications' SSRF
guard (services/processes/notifications/guard.py) inside each client's transport, and redirects
are never followed, so neither a name resolving to 127.0.0.1 nor a 3xx to the metadata
service reaches anything. `RUNPLANE_VCS_ALLOW` (same kinds as `RUNPLANE_NOTIFY_ALLOW`,
which it defaults to) lets a deployment reach a GitHub Enterprise or GitLab on its own
network.

Errors are `VcsError`s: `retryable` for 429, 5xx and no answer (timeout, connection
refused), permanent for any other 4xx and for a refused address.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import socket
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

from services.processes.notifications import Refused, guard

ALLOW_ENV = "RUNPLANE_VCS_ALLOW"
TIMEOUT_ENV = "RUNPLANE_VCS_TIMEOUT"  # seconds one call may take, from connect to answer
SCHEDULE_ENV = "RUNPLANE_VCS_RETRY"  # seconds between tries, comma separated
USER_AGENT = "runplane-vcs/1"
THREADS_PER_OWNER = 8  # worker threads one organization's calls may hold, given up or not
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


class _Threads:
    """Worker threads held per owner (an organization), counted until each thread ends.

    A call given up at its deadline leaves its thread behind while the thread waits on
    what the tenant controls (its DNS answering never: getaddrinfo cannot be interrupted).
    The reporter's lanes count calls, not such threads, so without this one tenant's
    abandoned lookups would take every thread the process's VCS calls (and, through the
    default executor, everything else) share."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.held: dict[str, int] = {}

    def hold(self, owner: str) -> Callable[[], None]:
        """Count a thread for `owner`; a retryable VcsError if it holds its share."""
        with self.lock:
            if self.held.get(owner, 0) >= THREADS_PER_OWNER:
                raise VcsError("too many calls to this VCS still unanswered", retryable=True)
            self.held[owner] = self.held.get(owner, 0) + 1
        done = threading.Event()

        def release() -> None:
            with self.lock:
                if done.is_set():
                    return
                done.set()
                self.held[owner] -= 1
                if not self.held[owner]:
                    del self.held[owner]

        return release


HELD = _Threads()
_DNS = ThreadPoolExecutor(max_workers=32, thread_name_prefix="vcs-dns")


def _lookup(host: str, port: int, release: Callable[[], None]) -> list[guard.IP]:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    finally:
        release()
    return list(dict.fromkeys(ipaddress.ip_address(str(i[4][0]).split("%")[0]) for i in infos))


def _retrieved(future: asyncio.Future[list[guard.IP]]) -> None:
    if not future.cancelled():
        future.exception()


async def resolve(host: str, port: int, *, timeout: float, owner: str) -> list[guard.IP]:
    """guard.resolve on the VCS clients' own threads, `owner`'s at most
    THREADS_PER_OWNER of them (a lookup given up keeps its thread until it ends)."""
    try:
        return [ipaddress.ip_address(host.strip("[]"))]
    except ValueError:
        pass
    release = HELD.hold(owner)
    loop = asyncio.get_running_loop()
    try:
        future = loop.run_in_executor(_DNS, _lookup, host, port, release)
    except BaseException:
        release()
        raise
    future.add_done_callback(_retrieved)  # a lookup given up still ends, some day
    try:
        return await asyncio.wait_for(asyncio.shield(future), timeout)
    except (OSError, TimeoutError) as e:
        raise Refused(f"the destination's host {host} does not resolve: {e}") from e
    except UnicodeError as e:
        raise Refused(f"the destination's host {host} is not a host name: {e}") from e


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
