"""Attack review of issue 14 / 15 (run causes, VCS, run triggers, rerun, TFE): each test
is an attack by a hostile organization that worked on the tree before its fix."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from typing import Any

import pytest
from aiohttp import web

from services.vcs import gitlab as gitlab_module
from services.vcs import matching
from services.vcs.client import Policy, VcsError
from services.vcs.github import GitHubClient
from services.vcs.gitlab import GitLabClient
from tests.helpers import eventually

# ---------------------------------------------------------------- trigger globs


def test_a_tenants_trigger_glob_cannot_hold_the_api_on_one_path() -> None:
    """Org A's admin saves trigger_paths ["**a**a**a**a**a**a**a**a**b"] (27 characters,
    within the body's 256) and signs a push naming one path of 300 "a"s: a
    backtracking regex took hours on it inside the API's event loop, every
    organization's requests waiting. Matched in a child process, so the old code fails
    this test at its deadline instead of hanging it."""
    code = (
        "from services.vcs import matching;"
        "print(matching.glob_match('**a' * 8 + '**b', 'a' * 300),"
        " matching.glob_match('**a' * 80 + 'b', 'a' * 4096))"
    )
    started = time.monotonic()
    try:
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=10
        )
    except subprocess.TimeoutExpired:
        raise AssertionError("matching one glob against one path took over 10 s") from None
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"]
    assert time.monotonic() - started < 10


def test_trigger_globs_keep_their_meaning() -> None:
    cases = [
        ("**/", "", True),
        ("**/a", "a", True),
        ("**/a", "x/y/a", True),
        ("**/a", "ba", False),
        ("a/**", "a/b/c", True),
        ("a**b", "a/x/b", True),
        ("a*b", "a/b", False),
        ("?**/", ".", True),
        ("[]]x", "]x", True),
        ("[]", "[]", True),  # no class: was a ValueError out of the webhook
        ("[z-a]", "[z-a]", True),  # no class: was a re.error out of the webhook
        ("**a" * 8 + "**", "a" * 8, True),
    ]
    for pattern, path, hit in cases:
        assert matching.glob_match(pattern, path) is hit, (pattern, path)


# ---------------------------------------------------------------- VCS answers


class _Flood:
    """A tenant's VCS answering every call 200 with a JSON body of `size` bytes (a list
    padded with spaces: cheap to parse, so only the reading costs), counting what it
    managed to send before the client hung up."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.sent = 0
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def __aenter__(self) -> _Flood:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self.runner = web.AppRunner(app, handle_signals=False)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        assert site._server is not None
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.runner is not None
        await self.runner.cleanup()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.content_length = self.size
        await resp.prepare(request)
        chunk = b" " * (1024 * 1024)
        try:
            await resp.write(b"[")
            while self.sent < self.size - 2 - len(chunk):
                await resp.write(chunk)
                self.sent += len(chunk)
            await resp.write(b" " * (self.size - 2 - self.sent) + b"]")
            self.sent = self.size
        except (ConnectionError, RuntimeError):
            pass  # the client hung up
        return resp


@pytest.mark.parametrize("client", [GitHubClient, GitLabClient])
async def test_a_tenants_vcs_cannot_fill_the_reporters_memory(client: type[Any]) -> None:
    """Org A's api_url answers the comment lookup with a 48 MiB body: the reporter (one
    process for every organization's reports) read all of it into memory, as fast as
    the tenant sent it, for as long as a call may take. It now stops at MAX_ANSWER."""
    async with _Flood(48 * 1024 * 1024) as vcs:
        c = client(vcs.url + "/api/v4", "t", Policy(allow=frozenset({"loopback"}), timeout=5))
        try:
            with pytest.raises(VcsError, match="more than") as caught:
                await c.find_comment("acme/net", 7, "<!-- m -->")
        finally:
            await c.aclose()
        assert not caught.value.retryable
        assert vcs.sent < 24 * 1024 * 1024


def _black_holes(count: int) -> tuple[list[str], int, list[socket.socket]]:
    """`count` loopback addresses on one port where a connect hangs (each listener's
    queue filled by one connection it never accepts: further SYNs are dropped)."""
    held: list[socket.socket] = []
    addresses = [f"127.0.0.{i}" for i in range(2, 2 + count)]
    port = 0
    for address in addresses:
        listener = socket.socket()
        listener.bind((address, port))
        listener.listen(0)
        port = listener.getsockname()[1]
        held += [listener, socket.create_connection((address, port), 1)]
    return addresses, port, held


async def test_a_tenants_many_addressed_gitlab_frees_its_thread_at_the_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Org A's api_url names a host of many addresses that never answer a SYN (their
    DNS is theirs): each call's worker thread tried every address, a timeout each, long
    after the call was given up at its deadline. 16 threads serve every organization's
    GitLab calls, so org A's reports (8 at once) kept them all and B's waited. The
    thread now stops at the first connect that ends past the deadline."""
    addresses, port, held = _black_holes(6)
    real = socket.getaddrinfo

    def resolve(host: Any, *a: Any, **kw: Any) -> Any:
        if host == "vcs.tenant-a.test":
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port)) for ip in addresses]
        return real(host, *a, **kw)

    ended: list[float] = []
    connect = gitlab_module._guarded_connect

    def recorded(*a: Any, **kw: Any) -> Any:
        try:
            return connect(*a, **kw)
        finally:
            ended.append(time.monotonic())

    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    monkeypatch.setattr(gitlab_module, "_guarded_connect", recorded)
    policy = Policy(allow=frozenset({"loopback"}), timeout=1.0)
    client = GitLabClient(f"http://vcs.tenant-a.test:{port}/api/v4", "t", policy)
    started = time.monotonic()
    try:
        with pytest.raises(VcsError, match="no answer in time"):
            await client.find_comment("acme/net", 7, "<!-- m -->")

        async def thread_done() -> bool:
            return bool(ended)

        await eventually(thread_done, timeout=15, what="the worker thread's connect")
        # one connect may run past the deadline, never all six (6 s)
        assert ended[0] - started < 3.0
    finally:
        for s in held:
            s.close()
