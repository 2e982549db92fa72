"""A local VCS for the reporter's tests: GitHub's and GitLab's REST shapes, every call kept.

`FakeVcs` serves, on 127.0.0.1 and an optional path prefix (GitHub Enterprise's
`/api/v3`, GitLab's `/api/v4`):
- GitHub: `POST /repos/{o}/{r}/statuses/{sha}`, `GET|POST /repos/{o}/{r}/issues/{n}/comments`,
  `PATCH /repos/{o}/{r}/issues/comments/{id}`;
- GitLab: `POST /projects/{id}/statuses/{sha}`, `GET|POST
  /projects/{id}/merge_requests/{iid}/notes`, `PUT .../notes/{note_id}`.
Faults for the next requests (`fail`: statuses to answer, in order), a hanging mode
(`hang`: never answers) and a trickling one (`trickle`: headers, then a byte at a time).
"""

from __future__ import annotations

import asyncio
import json
import random
import re
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from aiohttp import web


class OutsideConnects:
    """Connects to anything but loopback, refused before a packet leaves (and recorded):
    a test of the guard that regressed would otherwise send traffic to a metadata or
    private address. Patches httpcore's asyncio backend (githubkit's path) and urllib3's
    and the socket module's `create_connection` (python-gitlab's)."""

    def __init__(self, monkeypatch: Any) -> None:
        import ipaddress
        import socket

        import httpcore
        import urllib3.util.connection

        self.tried: list[str] = []

        def refuse(host: str) -> None:
            try:
                local = ipaddress.ip_address(host.strip("[]")).is_loopback
            except ValueError:
                local = host == "localhost"
            if not local:
                self.tried.append(host)
                raise OSError(f"test: no connect outside loopback ({host})")

        real_tcp = httpcore.AnyIOBackend.connect_tcp

        async def tcp(backend: Any, host: str, port: int, *a: Any, **kw: Any) -> Any:
            refuse(host)
            return await real_tcp(backend, host, port, *a, **kw)

        def wrap(real: Any) -> Any:
            def create(address: tuple[str, int], *a: Any, **kw: Any) -> Any:
                refuse(address[0])
                return real(address, *a, **kw)

            return create

        monkeypatch.setattr(httpcore.AnyIOBackend, "connect_tcp", tcp)
        monkeypatch.setattr(socket, "create_connection", wrap(socket.create_connection))
        monkeypatch.setattr(
            urllib3.util.connection,
            "create_connection",
            wrap(urllib3.util.connection.create_connection),
        )


@dataclass(frozen=True)
class Call:
    method: str
    path: str  # raw (percent-encoded) path, the prefix taken off
    auth: str  # the Authorization header, or GitLab's PRIVATE-TOKEN
    body: Any


@dataclass
class Comment:
    id: int
    pr: str  # "<repo>#<n>"
    body: str


_GH_STATUS = re.compile(r"^/repos/([^/]+)/([^/]+)/statuses/([0-9a-f]+)$")
_GH_COMMENTS = re.compile(r"^/repos/([^/]+)/([^/]+)/issues/(\d+)/comments$")
_GH_COMMENT = re.compile(r"^/repos/([^/]+)/([^/]+)/issues/comments/(\d+)$")
_GL_STATUS = re.compile(r"^/projects/([^/]+)/statuses/([0-9a-f]+)$")
_GL_NOTES = re.compile(r"^/projects/([^/]+)/merge_requests/(\d+)/notes$")
_GL_NOTE = re.compile(r"^/projects/([^/]+)/merge_requests/(\d+)/notes/(\d+)$")


@dataclass
class FakeVcs:
    prefix: str = ""
    calls: list[Call] = field(default_factory=list)
    comments: dict[int, Comment] = field(default_factory=dict)
    fail: list[int] = field(default_factory=list)
    fail_body: str = '{"message": "nope"}'
    hang: bool = False
    trickle: bool = False
    redirect_to: str = ""
    # Edits applied after a random pause up to this long: concurrent edits land out of
    # the order they were sent in, as they may on a real VCS behind a load balancer.
    edit_jitter: float = 0.0
    next_id: int = 1000
    _runner: web.AppRunner | None = None
    _released: asyncio.Event = field(default_factory=asyncio.Event)
    port: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}{self.prefix}"

    async def __aenter__(self) -> FakeVcs:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        server = site._server
        assert server is not None
        self.port = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._released.set()
        if self._runner is not None:
            await self._runner.cleanup()

    # ------------------------------------------------------------ what tests read

    def of(self, method: str, pattern: str = "") -> list[Call]:
        return [c for c in self.calls if c.method == method and re.search(pattern, c.path)]

    def statuses(self) -> list[Call]:
        return [c for c in self.calls if c.method == "POST" and "/statuses/" in c.path]

    def created(self) -> list[Call]:
        return [
            c
            for c in self.calls
            if c.method == "POST" and (c.path.endswith("/comments") or c.path.endswith("/notes"))
        ]

    # ------------------------------------------------------------ serving

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        path = request.raw_path.split("?", 1)[0]
        if self.prefix and path.startswith(self.prefix):
            path = path[len(self.prefix) :]
        raw = await request.read()
        body = json.loads(raw) if raw else None
        auth = request.headers.get("Authorization", "") or request.headers.get("PRIVATE-TOKEN", "")
        self.calls.append(Call(request.method, path, auth, body))
        if self.hang:
            await self._released.wait()
        if self.trickle:
            return await self._trickle(request)
        if self.redirect_to:
            raise web.HTTPFound(self.redirect_to)
        if self.fail:
            return web.Response(status=self.fail.pop(0), text=self.fail_body)
        if self.edit_jitter and request.method in ("PATCH", "PUT"):
            await asyncio.sleep(random.uniform(0, self.edit_jitter))
        return self._answer(request, path, body)

    async def _trickle(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        while not self._released.is_set():
            await resp.write(b" ")
            try:
                await asyncio.wait_for(self._released.wait(), 0.2)
            except TimeoutError:
                continue
        return resp

    def _answer(self, request: web.Request, path: str, body: Any) -> web.Response:
        m = request.method
        if m == "POST" and (_GH_STATUS.match(path) or _GL_STATUS.match(path)):
            return web.json_response({"id": self._id(), **(body or {})}, status=201)
        if hit := _GH_COMMENTS.match(path) or _GL_NOTES.match(path):
            pr = (
                f"{hit.group(1)}/{hit.group(2)}#{hit.group(3)}"
                if hit.re is _GH_COMMENTS
                else (f"{hit.group(1)}#{hit.group(2)}")
            )
            if m == "GET":
                page = int(request.query.get("page", "1"))
                per = int(request.query.get("per_page", "30"))
                mine = [c for c in self.comments.values() if c.pr == pr]
                chunk = mine[(page - 1) * per : page * per]
                return web.json_response([{"id": c.id, "body": c.body} for c in chunk])
            if m == "POST":
                c = Comment(self._id(), pr, str((body or {}).get("body", "")))
                self.comments[c.id] = c
                return web.json_response({"id": c.id, "body": c.body}, status=201)
        if hit := _GH_COMMENT.match(path) or _GL_NOTE.match(path):
            cid = int(hit.group(3))
            if m in ("PATCH", "PUT") and cid in self.comments:
                self.comments[cid].body = str((body or {}).get("body", ""))
                return web.json_response({"id": cid, "body": self.comments[cid].body})
            return web.json_response({"message": "Not Found"}, status=404)
        return web.json_response({"message": f"no route {m} {path}"}, status=404)

    def _id(self) -> int:
        self.next_id += 1
        return self.next_id
