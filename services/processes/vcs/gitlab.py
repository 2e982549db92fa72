"""GitLab (gitlab.com or self-hosted) through python-gitlab.

The connection's `api_url` is GitLab's API root (`https://host/api/v4`); python-gitlab
wants the instance URL and adds `/api/v4` itself, so the suffix is taken off.

python-gitlab is synchronous (requests), so each call runs in a worker thread of this
module's pool. Two things keep a tenant's GitLab from holding those threads:
- its `requests` session mounts `GuardedAdapter`, whose urllib3 connections resolve the
  host themselves, judge every address (services/processes/notifications/guard.py) and connect to
  the judged address only; redirects are followed by nobody (a 3xx is an error here);
- every socket a call opens is registered with the call, and when the call's deadline
  passes the asyncio side shuts those sockets down: a server that trickles one byte a
  second (which a per-read timeout never ends) frees the thread at the deadline.
python-gitlab's own waiting is off: no sleeping on a 429 (`obey_rate_limit=False`), no
retries of transient errors; the reporter retries with its backoff.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import gitlab
import gitlab.exceptions
import requests
import requests.adapters
import urllib3.connection
import urllib3.connectionpool
import urllib3.exceptions

from services.processes.notifications import Refused, guard
from services.processes.vcs.client import HELD, USER_AGENT, Policy, VcsError, error_for

T = TypeVar("T")
THREADS = 16  # every GitLab call of the process; a connection has `per_connection` of them
_POOL = ThreadPoolExecutor(max_workers=THREADS, thread_name_prefix="vcs-gitlab")
_NO_WAIT: dict[str, Any] = {"obey_rate_limit": False, "retry_transient_errors": False}
MAX_PAGES = 10
MAX_ANSWER = 8 * 1024 * 1024  # bytes of one answer read, at most (a page of 100 notes)


class _Sockets:
    """The sockets one call opened, to shut down at its deadline."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.open: list[socket.socket] = []
        self.closed = False

    def add(self, sock: socket.socket) -> None:
        with self.lock:
            self.open.append(sock)
            if not self.closed:
                return
        _shut(sock)

    def shut_all(self) -> None:
        with self.lock:
            self.closed = True
            socks = list(self.open)
        for sock in socks:
            _shut(sock)


def _shut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


def _abandoned(future: asyncio.Future[Any]) -> None:
    """A call given up at its deadline ends with the error its shut socket made: read,
    so it is not reported as never retrieved."""
    if not future.cancelled():
        future.exception()


def _guarded_connect(conn: Any, allow: frozenset[str], sockets: _Sockets) -> socket.socket:
    """urllib3's `_new_conn`, connecting only to judged addresses."""
    host, port = conn._dns_host, conn.port
    try:
        infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as e:
        raise urllib3.exceptions.NewConnectionError(conn, f"{host} does not resolve") from e
    ips = list(dict.fromkeys(ipaddress.ip_address(str(i[4][0]).split("%")[0]) for i in infos))
    for ip in ips:
        guard.judge(ip, allow, host)  # Refused: no urllib3 error, so nobody retries it
    last: OSError | None = None
    for ip in ips:
        if sockets.closed:  # the call is over (its deadline): no thread kept for the rest
            break
        try:
            sock = socket.create_connection((str(ip), port), conn.timeout, conn.source_address)
        except OSError as e:
            last = e
            continue
        sockets.add(sock)
        return sock
    raise urllib3.exceptions.NewConnectionError(conn, f"cannot connect: {last}")


def _pools(allow: frozenset[str], sockets: _Sockets) -> dict[str, type[Any]]:
    """urllib3 pool classes whose connections are guarded (per session: its sockets)."""

    class HTTP(urllib3.connection.HTTPConnection):
        def _new_conn(self) -> socket.socket:
            return _guarded_connect(self, allow, sockets)

    class HTTPS(urllib3.connection.HTTPSConnection):
        def _new_conn(self) -> socket.socket:
            return _guarded_connect(self, allow, sockets)

    class HTTPPool(urllib3.connectionpool.HTTPConnectionPool):
        ConnectionCls = HTTP

    class HTTPSPool(urllib3.connectionpool.HTTPSConnectionPool):
        ConnectionCls = HTTPS

    return {"http": HTTPPool, "https": HTTPSPool}


class GuardedAdapter(requests.adapters.HTTPAdapter):
    """requests' adapter over guarded urllib3 pools; no retries of its own."""

    def __init__(self, allow: frozenset[str], sockets: _Sockets) -> None:
        self._classes = _pools(allow, sockets)
        super().__init__(max_retries=0)

    def init_poolmanager(
        self, connections: int, maxsize: int, block: bool = False, **kw: Any
    ) -> None:
        super().init_poolmanager(connections, maxsize, block, **kw)
        self.poolmanager.pool_classes_by_scheme = self._classes

    def send(  # type: ignore[override]  # stream is always True below, whatever asked
        self, request: requests.PreparedRequest, stream: bool = False, **kw: Any
    ) -> requests.Response:
        """The answer, its body read here up to MAX_ANSWER bytes (decoded: a small gzip
        counts as what it inflates to), so the tenant's server cannot fill the
        reporter's memory within one call's timeout."""
        response = super().send(request, stream=True, **kw)
        body, size = [], 0
        try:
            for chunk in response.iter_content(64 * 1024):
                size += len(chunk)
                if size > MAX_ANSWER:
                    raise Refused(f"the VCS answered more than {MAX_ANSWER} bytes")
                body.append(chunk)
        finally:
            response.close()
        response._content = b"".join(body)
        return response


def guarded_session(allow: frozenset[str], sockets: _Sockets) -> requests.Session:
    session = requests.Session()
    session.trust_env = False  # no proxy nor netrc from the environment
    session.max_redirects = 0
    adapter = GuardedAdapter(allow, sockets)
    session.mount("http://", adapter)
    session.mount("https://", adapter)
    return session


def instance_url(api_url: str) -> str:
    """The instance URL python-gitlab wants, from the API root the connection names."""
    url = api_url.rstrip("/")
    return url[: -len("/api/v4")] if url.endswith("/api/v4") else url


class GitLabClient:
    """One connection's GitLab: commit statuses and a merge request's notes."""

    def __init__(self, api_url: str, token: str, policy: Policy, *, owner: str = "") -> None:
        guard.parse(api_url)
        self.api_url = api_url
        self.token = token
        self.policy = policy
        self.owner = owner  # whose calls hold the pool's threads (client.HELD)

    async def aclose(self) -> None:
        return None

    async def set_status(
        self, repo: str, sha: str, *, state: str, context: str, description: str, url: str
    ) -> None:
        data = {"state": "failed" if state == "failure" else state, "name": context}
        data["description"] = description
        if url:
            data["target_url"] = url

        def call(gl: gitlab.Gitlab) -> None:
            commit = gl.projects.get(repo, lazy=True).commits.get(sha, lazy=True)
            try:
                commit.statuses.create(data, **_NO_WAIT)
            except gitlab.exceptions.GitlabCreateError as e:
                # GitLab refuses to "move" a status to the state it is in (a redelivered
                # event posts it again): it is in the state we want.
                if e.response_code == 400 and "Cannot transition status" in str(e):
                    return
                raise

        await self._run("status", call)

    async def find_comment(self, repo: str, number: int, marker: str) -> int:
        def call(gl: gitlab.Gitlab) -> int:
            mr = gl.projects.get(repo, lazy=True).mergerequests.get(number, lazy=True)
            for page in range(1, MAX_PAGES + 1):
                notes = mr.notes.list(page=page, per_page=100, get_all=False, **_NO_WAIT)
                for note in notes:
                    if marker in str(getattr(note, "body", "") or ""):
                        return int(note.get_id() or 0)
                if len(notes) < 100:
                    break
            return 0

        return await self._run("list notes", call)

    async def create_comment(self, repo: str, number: int, body: str) -> int:
        def call(gl: gitlab.Gitlab) -> int:
            mr = gl.projects.get(repo, lazy=True).mergerequests.get(number, lazy=True)
            note = mr.notes.create({"body": body}, **_NO_WAIT)
            note_id = note.get_id()
            if not isinstance(note_id, int) or note_id <= 0:
                raise VcsError("the VCS answered a note without an id", retryable=True)
            return note_id

        return await self._run("create comment", call)

    async def edit_comment(self, repo: str, number: int, comment_id: int, body: str) -> None:
        def call(gl: gitlab.Gitlab) -> None:
            mr = gl.projects.get(repo, lazy=True).mergerequests.get(number, lazy=True)
            mr.notes.update(comment_id, {"body": body}, **_NO_WAIT)

        await self._run("edit comment", call)

    async def _run(self, what: str, call: Callable[[gitlab.Gitlab], T]) -> T:
        """`call` in a worker thread on a fresh guarded session, within the timeout; at
        the deadline its sockets are shut down, which ends the thread's wait too."""
        sockets = _Sockets()
        timeout = self.policy.timeout
        release = HELD.hold(self.owner)  # until the thread ends, not the call

        def work() -> T:
            try:
                return session_call()
            finally:
                release()

        def session_call() -> T:
            session = guarded_session(self.policy.allow, sockets)
            gl = gitlab.Gitlab(
                instance_url(self.api_url),
                private_token=self.token,
                timeout=timeout,
                user_agent=USER_AGENT,
                keep_base_url=True,
                session=session,
            )
            try:
                return call(gl)
            finally:
                session.close()

        try:
            future = asyncio.get_running_loop().run_in_executor(_POOL, work)
        except BaseException:
            release()
            raise
        try:
            async with asyncio.timeout(timeout):
                return await asyncio.shield(future)
        except TimeoutError as e:
            sockets.shut_all()
            future.add_done_callback(_abandoned)
            raise VcsError(f"{what}: no answer in time", retryable=True) from e
        except gitlab.exceptions.GitlabError as e:
            if e.response_code:
                raise error_for(e.response_code, what) from e
            raise VcsError(f"{what}: {type(e).__name__}", retryable=True) from e
        except Refused as e:
            raise VcsError(f"{what}: {e}", retryable="does not resolve" in str(e)) from e
        except requests.exceptions.TooManyRedirects as e:
            raise VcsError(f"{what}: the VCS answered a redirect", retryable=False) from e
        except requests.RequestException as e:
            raise VcsError(f"{what}: {type(e).__name__}", retryable=True) from e
