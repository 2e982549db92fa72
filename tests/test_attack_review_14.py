"""Attack review of issue 14 / 15 (run causes, VCS, run triggers, rerun, TFE): each test
is an attack by a hostile organization that worked on the tree before its fix."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import pytest
from aiohttp import web
from yarl import URL

from executor.statestore import parse_state
from services.processes.vcs import gitlab as gitlab_module
from services.processes.vcs import matching
from services.processes.vcs.client import Policy, VcsError
from services.processes.vcs.connections import Connection
from services.processes.vcs.github import GitHubClient
from services.processes.vcs.gitlab import GitLabClient
from services.processes.vcs.report import make_client
from tests.helpers import eventually
from tests.tfe_support import Tfe, a_state, tfe_fixture
from tests.vcs_report_support import FakeVcs

__all__ = ["tfe_fixture"]

# ---------------------------------------------------------------- trigger globs


def test_a_tenants_trigger_glob_cannot_hold_the_api_on_one_path() -> None:
    """Org A's admin saves trigger_paths ["**a**a**a**a**a**a**a**a**b"] (27 characters,
    within the body's 256) and signs a push naming one path of 300 "a"s: a
    backtracking regex took hours on it inside the API's event loop, every
    organization's requests waiting. Matched in a child process, so the old code fails
    this test at its deadline instead of hanging it."""
    code = (
        "from services.processes.vcs import matching;"
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


# ---------------------------------------------------------------- TFE state pushes


def test_a_pushed_states_bulk_is_checked_not_built_into_objects() -> None:
    """Org A's operator pushes (TFE `state-versions`, or its Terraform's http backend on
    an executor) a state whose serial and lineage are right and whose resources are 24
    MiB of `{}`s: reading the serial built 8 million dicts, about 630 MB of the API
    process (every organization's) and 1.4 s of its event loop per request, with up to
    96 MiB a body. Measured in a child process: its peak memory over the state's own."""
    code = (
        "import resource\n"
        "from executor.statestore import parse_state\n"
        "n = 24 * 1024 * 1024 // 3\n"
        'data = b\'{"serial": 7, "lineage": "l", "resources": [\' + b\'{},\' * n + b\'{}]}\'\n'
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "print(parse_state(data), (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)"
        " // 1024)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    *head, grown_mb = out.stdout.split()
    assert " ".join(head) == "(7, 'l')"
    assert int(grown_mb) < 100, f"parsing grew the process by {grown_mb} MB"


def test_a_state_is_still_read_as_before() -> None:
    assert parse_state(b'{"version": 4, "serial": 3, "lineage": "abc", "x": [1]}') == (3, "abc")
    assert parse_state(b'{"serial": 0}') == (0, "")
    for bad in (b"[]", b'{"serial": "1"}', b'{"lineage": "x"}', b"{", b'{"serial": 1.5}'):
        with pytest.raises(ValueError):
            parse_state(bad)


async def _raw_post(tfe: Tfe, path: str, token: str, length: int, sent: bytes) -> Any:
    """A POST announcing `length` body bytes of which only `sent` arrive (for now)."""
    server = tfe.client.server
    reader, writer = await asyncio.open_connection(server.host, server.port)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n"
        f"Content-Type: application/vnd.api+json\r\nContent-Length: {length}\r\n\r\n"
    )
    writer.write(head.encode() + sent)
    await writer.drain()
    return reader, writer


async def test_a_push_without_the_lock_is_refused_before_its_body_is_read(tfe: Tfe) -> None:
    """Org A's operator announces a 90 MiB state to a workspace it has not locked: the
    API read, decoded and parsed all of it before saying 409. Now the 409 comes with
    not one byte of the body sent."""
    tokens = await tfe.org("acme")
    ws_id = await tfe.cli_workspace("acme", "net", token=tokens["admin"])
    path = f"/api/v2/workspaces/{ws_id}/state-versions"
    reader, writer = await _raw_post(tfe, path, tokens["operator"], 90 << 20, b"")
    try:
        status = await asyncio.wait_for(reader.readline(), 10)
    except TimeoutError:
        raise AssertionError("the API waited for the body of an unlocked push") from None
    finally:
        writer.close()
    assert b" 409 " in status


async def test_one_organizations_pushes_are_read_one_at_a_time(tfe: Tfe) -> None:
    """While one of org A's pushes is still arriving, A's next waits (each may hold
    hundreds of MB in the API process); org B's does not."""
    a, b = await tfe.org("acme"), await tfe.org("beta")
    a1 = await tfe.cli_workspace("acme", "one", token=a["admin"])
    a2 = await tfe.cli_workspace("acme", "two", token=a["admin"])
    b1 = await tfe.cli_workspace("beta", "one", token=b["admin"])
    for ws_id, token in ((a1, a["operator"]), (a2, a["operator"]), (b1, b["operator"])):
        assert (await tfe.lock(ws_id, token=token)).status == 200
    state = a_state(1)
    raw = json.dumps(state).encode()
    body = json.dumps(
        {
            "data": {
                "type": "state-versions",
                "attributes": {
                    "serial": 1,
                    "lineage": state["lineage"],
                    "md5": hashlib.md5(raw).hexdigest(),
                    "state": base64.b64encode(raw).decode(),
                },
            }
        }
    ).encode()
    path = f"/api/v2/workspaces/{a1}/state-versions"
    reader, writer = await _raw_post(tfe, path, a["operator"], len(body), body[:10])
    try:
        assert (await tfe.push(b1, a_state(1), token=b["operator"])).status == 201
        second = asyncio.create_task(tfe.push(a2, a_state(1), token=a["operator"]))
        done, _ = await asyncio.wait({second}, timeout=1.0)
        assert not done, "org A's second push was read beside its first"
        writer.write(body[10:])
        await writer.drain()
        assert b" 201 " in await asyncio.wait_for(reader.readline(), 10)
        assert (await asyncio.wait_for(second, 10)).status == 201
    finally:
        writer.close()


async def test_tfe_numbers_that_are_not_ascii_digits_are_a_clear_error(tfe: Tfe) -> None:
    """`page[size]=²` and a state version id of serial `²` (digits to str.isdigit,
    ValueErrors to int) were 500s with a traceback in the API's log; a 5,000-digit
    page number too (int's digit limit)."""
    tokens = await tfe.org("acme")
    ws_id = await tfe.cli_workspace("acme", "net", token=tokens["admin"])
    lister = "/api/v2/organizations/acme/workspaces"
    assert (await tfe.tfe("GET", lister, token=tokens["viewer"])).status == 200
    for query in ("page[size]=²", "page[number]=" + "9" * 5_000, "page[number]=\u0661"):
        a = await tfe.tfe("GET", f"{lister}?{query}", token=tokens["viewer"])
        assert a.status == 422, (query, a.status, a.body)
    _, org_ws = ws_id.split("-", 1)
    a = await tfe.tfe(
        "GET", f"/api/v2/state-versions/sv-{org_ws}.².{'0' * 16}", token=tokens["viewer"]
    )
    assert a.status == 404, (a.status, a.body)


@pytest.mark.parametrize("provider", ["github", "gitlab"])
async def test_a_tenants_silent_dns_holds_no_thread_another_needs(
    provider: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Org A's api_url host is on a name server that never answers: each lookup holds a
    thread however soon its call is given up (getaddrinfo cannot be interrupted), and
    the reporter's lanes count calls, not threads, so A's successive reports piled up
    stuck lookups in the threads every organization's calls share (GitHub's: the
    process's default executor; GitLab's: its 16). Here 40 of A's calls at once stand
    for that pile; org B's status, to a VCS whose name resolves, then found no thread."""
    answer = threading.Event()
    real = socket.getaddrinfo

    def resolve(host: Any, *a: Any, **kw: Any) -> Any:
        if host == "slow.tenant-a.test":
            answer.wait(30)  # a name server that does not answer
            raise socket.gaierror(socket.EAI_AGAIN, "no answer")
        return real(host, *a, **kw)

    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    policy = Policy(allow=frozenset({"loopback"}), timeout=1.0)
    prefix = "/api/v4" if provider == "gitlab" else ""
    a = Connection("c-a", "acme", "a", provider, f"http://slow.tenant-a.test:9{prefix}")
    try:
        async with FakeVcs(prefix=prefix) as vcs:
            b = Connection("c-b", "beta", "b", provider, f"http://localhost:{vcs.port}{prefix}")

            async def status(conn: Connection) -> None:
                client = make_client(conn, "t", policy)
                try:
                    await client.set_status(
                        "acme/net", "0" * 40, state="pending", context="c", description="", url=""
                    )
                finally:
                    await client.aclose()

            tries = await asyncio.gather(*(status(a) for _ in range(40)), return_exceptions=True)
            odd = [repr(t) for t in tries if not isinstance(t, VcsError)]
            assert not odd, odd[:3]
            await status(b)  # B's status is posted: a thread was there for it
            assert len(vcs.statuses()) == 1
    finally:
        answer.set()


def test_one_deliverys_glob_matching_is_bounded_whatever_the_globs_and_paths() -> None:
    """Linear matching is still 256 pattern positions x 2,800 characters x 2,999 paths x
    50 globs x each workspace: org A's globs `*?*?...[b]` on 20 workspaces and a signed
    push of 2,999 long paths held the loop for hours, one step at a time. One delivery
    now matches for a bounded budget; what is left counts as changed (a run too many)."""
    code = (
        "from services.processes.vcs import matching, payloads\n"
        "glob = '*?' * 127 + '[b]'\n"
        "rows = [dict(workspace=f'w{i}', run_type='plan', branch='main', directory='.',\n"
        "             trigger_any_change=False, trigger_paths=[glob] * 50) for i in range(20)]\n"
        "files = [f'{i:04d}' + 'a' * 2796 for i in range(2999)]\n"
        "change = payloads.Change(kind='push', branch='main', files=files)\n"
        "print(len(matching.targets(change, rows)))\n"
    )
    try:
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=30
        )
    except subprocess.TimeoutExpired:
        raise AssertionError("matching one delivery took over 30 s") from None
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["20"]


async def test_a_log_urls_offset_that_is_not_ascii_digits_is_a_clear_error(tfe: Tfe) -> None:
    """`?offset=²` on a run's log-read-url (public: the URL is the authority) was a 500
    with a traceback in the API's log."""
    from tests.tfe_support import new_run, uploaded

    await tfe.org("acme")
    ws_id = await tfe.cli_workspace("acme", "net")
    cv, _ = await uploaded(tfe, ws_id, speculative=False)
    run = (await new_run(tfe, ws_id, cv)).body["data"]
    plan_id = run["relationships"]["plan"]["data"]["id"]
    plan = await tfe.tfe("GET", f"/api/v2/plans/{plan_id}")
    path = URL(plan.body["data"]["attributes"]["log-read-url"]).path
    assert (await tfe.raw(f"{path}?offset=0&limit=1024"))[0] == 200
    for query in ("offset=²", "limit=\u0661", "offset=" + "9" * 5_000):
        status, _ = await tfe.raw(f"{path}?{query}")
        assert status == 422, (query, status)


async def test_an_operator_cannot_apply_an_upload_in_a_workspace_of_a_repository(
    tfe: Tfe,
) -> None:
    """`prod` takes its code from a repository (reviewed there, pull request by pull
    request), and an operator may start its runs but change none of its settings. A
    TFE upload run put any code the operator likes in place of the repository's and
    applied it with prod's variables and credentials. As in HCP Terraform ("Apply not
    allowed for workspaces with a VCS connection"), such a workspace takes the CLI's
    speculative plans only; a CLI workspace still applies its uploads."""
    from tests.tfe_support import uploaded

    tokens = await tfe.org("acme")
    await tfe.workspace("acme", "prod", repository="https://example.com/infra.git")
    prod, cli = "ws-acme.prod", await tfe.cli_workspace("acme", "cli", token=tokens["admin"])
    for ws_id, speculative, destroy, status in (
        (prod, False, False, 422),
        (prod, False, True, 422),
        (prod, True, False, 201),
        (cli, False, False, 201),
    ):
        cv, _ = await uploaded(tfe, ws_id, speculative=speculative)
        rels = {
            "workspace": {"data": {"type": "workspaces", "id": ws_id}},
            "configuration-version": {"data": {"type": "configuration-versions", "id": cv}},
        }
        body = {"type": "runs", "attributes": {"is-destroy": destroy}, "relationships": rels}
        a = await tfe.tfe("POST", "/api/v2/runs", token=tokens["operator"], json={"data": body})
        assert a.status == status, (ws_id, speculative, destroy, a.status, a.body)
    runs = await tfe.get("/api/v1/orgs/acme/workspaces/prod/runs")
    assert [r["type"] for r in runs.body["items"]] == ["plan"]
