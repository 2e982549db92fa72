"""GitHub (and GitHub Enterprise, whose API is at `https://host/api/v3`) through githubkit.

githubkit takes the connection's `api_url` as its base URL and an httpx transport of
ours: `GuardedTransport` is httpx's own with its connection pool built on
`GuardedBackend`, an httpcore network backend that resolves the host itself, judges
every address (services/processes/notifications/guard.py) and connects to the judged address
only, so a name that resolves elsewhere between two calls (rebinding) is judged again
at the connect. TLS still verifies against the host name (httpcore's `server_hostname`
is the origin's host, not the address). Redirects are not followed, proxies from the
environment are not used, githubkit's own retries are off (the reporter retries,
with its backoff, by putting the event back).

Only an answer's status and the created comment's `id` are read: githubkit's response
models are never parsed, so a VCS answering a shape of its own (an old Enterprise) costs
nothing but what we read.
"""

from __future__ import annotations

import asyncio
import typing

import httpcore
import httpx
from githubkit import GitHub, TokenAuthStrategy
from githubkit.exception import RequestError, RequestFailed, RequestTimeout

from services.processes.notifications import Refused, guard
from services.processes.vcs.client import USER_AGENT, Policy, VcsError, error_for, resolve

MAX_PAGES = 10  # of 100 comments each, looked through for our comment's marker
MAX_ANSWER = 8 * 1024 * 1024  # bytes of one answer read, at most (a page of 100 comments)


class GuardedBackend(httpcore.AsyncNetworkBackend):
    """httpcore's network backend, connecting only to addresses the guard allows."""

    def __init__(self, allow: frozenset[str], *, timeout: float = 5.0, owner: str = "") -> None:
        self.allow = allow
        self.timeout = timeout
        self.owner = owner  # whose lookups hold the VCS clients' threads (client.resolve)
        self._inner = httpcore.AnyIOBackend()

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: typing.Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        addresses = await resolve(host, port, timeout=self.timeout, owner=self.owner)
        for ip in addresses:  # one bad address refuses the name whole
            guard.judge(ip, self.allow, host)
        last: Exception | None = None
        for ip in addresses:
            try:
                return await self._inner.connect_tcp(
                    str(ip), port, timeout, local_address, socket_options
                )
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as e:
                last = e
        assert last is not None
        raise last

    async def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,
        socket_options: typing.Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        raise Refused("a VCS is reached over TCP only")

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


class GuardedTransport(httpx.AsyncHTTPTransport):
    """httpx's transport, its pool on `GuardedBackend` (httpx takes no network backend
    of its own, so the pool it built is replaced by one built the same way).

    githubkit opens an httpx client per request outside `async with github:` and closes
    it after, transport too: the pool is closed only by `close` (GitHubClient.aclose),
    so concurrent calls of one client share it.
    """

    def __init__(self, allow: frozenset[str], *, timeout: float = 5.0, owner: str = "") -> None:
        super().__init__(trust_env=False, retries=0)
        self._pool = httpcore.AsyncConnectionPool(
            ssl_context=httpx.create_ssl_context(trust_env=False),
            max_connections=10,
            max_keepalive_connections=2,
            keepalive_expiry=5.0,
            network_backend=GuardedBackend(allow, timeout=timeout, owner=owner),
        )

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        """The answer, its body read up to MAX_ANSWER bytes: the tenant's server could
        otherwise fill the reporter's memory (every organization's) within one call's
        timeout. Uncompressed only, so the bytes counted are the bytes kept."""
        request.headers["Accept-Encoding"] = "identity"
        response = await super().handle_async_request(request)
        if response.headers.get("Content-Encoding", "identity").lower() != "identity":
            await response.aclose()
            raise Refused("the VCS answered a compressed body, which was not asked for")
        response.stream = _Capped(response.stream, MAX_ANSWER)
        return response

    async def __aexit__(self, *exc: typing.Any) -> None:
        return None

    async def aclose(self) -> None:
        return None

    async def close(self) -> None:
        await self._pool.aclose()


class _Capped(httpx.AsyncByteStream):
    """A response body that refuses to be more than `limit` bytes."""

    def __init__(self, inner: typing.Any, limit: int) -> None:
        self.inner = inner
        self.limit = limit

    async def __aiter__(self) -> typing.AsyncIterator[bytes]:
        size = 0
        async for chunk in self.inner:
            size += len(chunk)
            if size > self.limit:
                raise Refused(f"the VCS answered more than {self.limit} bytes")
            yield chunk

    async def aclose(self) -> None:
        await self.inner.aclose()


class GitHubClient:
    """One connection's GitHub: statuses and issue comments (a PR is an issue)."""

    def __init__(self, api_url: str, token: str, policy: Policy, *, owner: str = "") -> None:
        guard.parse(api_url)  # an http(s) URL with a host, no credentials in it
        self.policy = policy
        self._transport = GuardedTransport(policy.allow, timeout=policy.timeout, owner=owner)
        self._gh = GitHub(
            TokenAuthStrategy(token),
            base_url=api_url,
            user_agent=USER_AGENT,
            follow_redirects=False,
            timeout=policy.timeout,
            trust_env=False,
            async_transport=self._transport,
            http_cache=False,
            auto_retry=False,
        )

    async def aclose(self) -> None:
        await self._transport.close()

    async def set_status(
        self, repo: str, sha: str, *, state: str, context: str, description: str, url: str
    ) -> None:
        owner, name = _split(repo)
        await self._call(
            "status",
            self._gh.rest.repos.async_create_commit_status(
                owner,
                name,
                sha,
                state=typing.cast(typing.Any, state),
                context=context,
                description=description,
                target_url=url or None,
            ),
        )

    async def find_comment(self, repo: str, number: int, marker: str) -> int:
        owner, name = _split(repo)
        for page in range(1, MAX_PAGES + 1):
            resp = await self._call(
                "list comments",
                self._gh.rest.issues.async_list_comments(
                    owner, name, number, per_page=100, page=page
                ),
            )
            items = resp.json()
            for item in items if isinstance(items, list) else []:
                if isinstance(item, dict) and marker in str(item.get("body") or ""):
                    return int(item["id"])
            if not isinstance(items, list) or len(items) < 100:
                return 0
        return 0

    async def create_comment(self, repo: str, number: int, body: str) -> int:
        owner, name = _split(repo)
        resp = await self._call(
            "create comment",
            self._gh.rest.issues.async_create_comment(owner, name, number, body=body),
        )
        return _id_of(resp.json())

    async def edit_comment(self, repo: str, number: int, comment_id: int, body: str) -> None:
        owner, name = _split(repo)
        await self._call(
            "edit comment",
            self._gh.rest.issues.async_update_comment(owner, name, comment_id, body=body),
        )

    async def _call(self, what: str, call: typing.Awaitable[typing.Any]) -> typing.Any:
        """The call's response within the policy's timeout, as a VcsError if not 2xx."""
        try:
            async with asyncio.timeout(self.policy.timeout):
                resp = await call
        except RequestFailed as e:
            raise error_for(e.response.status_code, what) from e
        except RequestTimeout as e:
            raise VcsError(f"{what}: no answer in time", retryable=True) from e
        except TimeoutError as e:
            raise VcsError(f"{what}: no answer in time", retryable=True) from e
        except RequestError as e:
            raise _unwrapped(what, e.exc) from e
        if not 200 <= resp.status_code < 300:  # a 3xx: never followed, never ours
            raise error_for(resp.status_code, what)
        return resp


def _unwrapped(what: str, exc: BaseException) -> VcsError:
    """githubkit wraps everything but a timeout and an HTTP status in RequestError."""
    if isinstance(exc, Refused):
        return VcsError(f"{what}: {exc}", retryable="does not resolve" in str(exc))
    return VcsError(f"{what}: {type(exc).__name__}", retryable=True)


def _split(repo: str) -> tuple[str, str]:
    owner, _, name = repo.partition("/")
    if not owner or not name or "/" in name:
        raise VcsError(f"not a GitHub repository's full name: {repo!r}")
    return owner, name


def _id_of(body: typing.Any) -> int:
    if isinstance(body, dict) and isinstance(body.get("id"), int) and body["id"] > 0:
        return int(body["id"])
    raise VcsError("the VCS answered a comment without an id", retryable=True)
