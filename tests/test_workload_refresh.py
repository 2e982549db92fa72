"""Workload identity in a phase longer than its token: the token file is replaced by a
fresh token at half the token's life, and a command the phase starts after that gets the
fresh token in its environment (executor/workload.py). Verified as a cloud does, against
the published JWKS (tests/test_workload_identity.py `verify`).

The ttl is the shortest the setting allows (`MIN_TTL`, 60 s: a refresh every 30 s). The
apply phase is made to outlive a refresh twice over, with nothing but what a tenant's
configuration can do: its `terraform init` fetches a module from an HTTP server the test
holds for a while (so `terraform apply` starts after the first refresh), and the apply's
`local-exec` reads the file, sleeps past the next refresh and reads it again.
"""

from __future__ import annotations

import asyncio
import io
import os
import re
import time
import zipfile
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from events import wire
from events.wire import SecretsReply, secrets_subject
from events.workload_rules import MIN_TTL
from executor.isolation import sandbox_problem
from executor.uids import DEFAULT_UIDS
from executor.workload import MIN_REFRESH_S
from services.root import bootstrap
from services.surfaces.api.context import API
from tests.api_support import ADMIN_TOKEN, Http
from tests.bootstrap_support import built, git_snapshots
from tests.builders import api_workspace
from tests.executor_support import git
from tests.helpers import eventually
from tests.plane_support import (  # noqa: F401  # registers the fixtures
    Plane,
    commit,
    plane_fixture,
)
from tests.workload_support import verify

V1 = "/api/v1/orgs/acme"

pytestmark = [pytest.mark.slow, pytest.mark.terraform]

AUDIENCE = "sts.example.com"
HALF = MIN_TTL / 2  # the refresh period of a MIN_TTL token
HOLD_S = HALF + 4  # the module download in the apply's init: past the first refresh
SLEEP_S = int(HALF) + 4  # the local-exec's sleep between its reads: past the next one

APPLY_TF = r"""
variable "runplane_workload_identity_token_file" { type = string }
module "slow" { source = "MODULE" }
resource "null_resource" "t" {
  provisioner "local-exec" {
    command = <<-EOT
      printf 'ENV=%s\n' "$(printf %s "$TFC_WORKLOAD_IDENTITY_TOKEN" | rev)"
      printf 'FILE1=%s\n' "$(cat "${var.runplane_workload_identity_token_file}" | rev)"
      printf 'AT1=%s\n' "$(date +%s)"
      sleep SLEEP
      printf 'FILE2=%s\n' "$(cat "${var.runplane_workload_identity_token_file}" | rev)"
      printf 'AT2=%s\n' "$(date +%s)"
    EOT
  }
}
"""
REVERSED_JWT = r"([A-Za-z0-9_-]+\.[A-Za-z0-9_-]+\.[A-Za-z0-9_-]*Jye)"


class ModuleServer:
    """Serves a module as a zip archive over HTTP; once `hold` is set, a GET of it waits
    `HOLD_S` first (a slow registry, as a tenant's configuration may name one)."""

    def __init__(self) -> None:
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w") as z:
            z.writestr("main.tf", 'output "ok" { value = true }\n')
        self.archive = buf.getvalue()
        self.hold = False
        self.held_at: list[float] = []  # unix seconds at which each held GET arrived
        self.url = ""

    async def get(self, request: web.Request) -> web.Response:
        if self.hold and request.method == "GET":
            self.held_at.append(time.time())
            await asyncio.sleep(HOLD_S)
        return web.Response(body=self.archive, content_type="application/zip")


@pytest.fixture
async def modules() -> AsyncIterator[ModuleServer]:
    server = ModuleServer()
    app = web.Application()
    app.router.add_get("/mod.zip", server.get)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]  # started
    server.url = f"http://127.0.0.1:{port}/mod.zip"
    try:
        yield server
    finally:
        await runner.cleanup()


@pytest.fixture
def sandboxed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Jobs in the sandbox (what `auto` picks as root), set before the plane is built: the
    file is renamed over in a directory bound into the job's mount namespace."""
    if os.geteuid() != 0:
        pytest.skip("the sandbox needs root")
    if why := sandbox_problem(DEFAULT_UIDS[-1]):
        pytest.skip(f"no sandbox here: {why}")
    monkeypatch.setenv("RUNPLANE_ISOLATION", "sandbox")


async def _awaiting_approval(plane: Plane, tmp_path: Path, tf: str) -> str:
    """The workspace `net` (tokens of `MIN_TTL`) with `tf`, an apply run of it planned."""
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    commit(repo, {"main.tf": tf})
    settings = {
        "workload_identity": True,
        "workload_identity_audience": AUDIENCE,
        "workload_identity_ttl": MIN_TTL,
    }
    await api_workspace(plane.http, repo, "net", settings=settings)
    await plane.executor("ex1")
    run_id = await plane.start("net")
    await plane.reaches("net", run_id, "awaiting_approval")
    return run_id


async def _applied(plane: Plane, run_id: str, *, timeout: float) -> str:
    """The apply phase's log once the run is applied."""

    async def ended() -> Any:
        state = await plane.run("net", run_id)
        assert str(state.status) in ("applied", "failed"), str(state.status)
        return state

    done = await eventually(ended, timeout=timeout, what="the apply")
    assert str(done.status) == "applied", done.error_message
    seq = await plane.app.store.last_seq()
    logs = await plane.http.get(
        f"{V1}/runs/{run_id}/logs?phase=apply&limit=10000", headers={"RP-Min-Seq": str(seq)}
    )
    return "\n".join(str(i["text"]) for i in logs.body["items"])


def _found(log: str, name: str) -> str:
    match = re.search(rf"\(local-exec\): {name}=(\S*)", log)
    assert match, f"{name} not in the log: {log[-3000:]}"
    return match.group(1).strip()


def _token(log: str, name: str) -> str:
    value = _found(log, name)
    assert re.fullmatch(REVERSED_JWT, value), f"{name}: no token ({value[:40]!r})"
    return value[::-1]


async def test_a_phase_longer_than_its_token_reads_a_fresh_live_one(
    sandboxed: None, plane: Plane, modules: ModuleServer, tmp_path: Path
) -> None:
    """ttl 60 s: the apply's `terraform apply` starts after the phase's first refresh
    and has the refreshed token in its environment and file; 34 s later its file holds a
    newer one (iat and jti differ), unexpired when read; all three verify against the
    JWKS with the run's subject."""
    tf = APPLY_TF.replace("MODULE", modules.url).replace("SLEEP", str(SLEEP_S))
    run_id = await _awaiting_approval(plane, tmp_path, tf)
    modules.hold = True  # the plan's init fetched it at once; the apply's waits
    await plane.approve(run_id)
    log = await _applied(plane, run_id, timeout=HOLD_S + SLEEP_S + 90)
    jwks = (await plane.http.get("/.well-known/jwks.json", token=None)).body

    env, first, second = (_token(log, n) for n in ("ENV", "FILE1", "FILE2"))
    at1, at2 = int(_found(log, "AT1")), int(_found(log, "AT2"))
    claims = [verify(t, jwks, AUDIENCE) for t in (env, first, second)]
    for c in claims:
        assert c["sub"] == "organization:acme:workspace:net:run_phase:apply"
        assert c["terraform_run_id"] == run_id and c["exp"] - c["iat"] == MIN_TTL
    c_env, c1, c2 = claims
    assert len(modules.held_at) == 1, modules.held_at
    assert c_env["iat"] > modules.held_at[0], "terraform apply started with a refreshed token"
    assert env == first, "a command started after a refresh has the file's token"
    assert c1["exp"] > at1 and c2["exp"] > at2, "not expired when read"
    assert c2["jti"] != c1["jti"] and c2["iat"] > c1["iat"], "the file was refreshed"
    delay = c2["iat"] - c1["iat"]
    assert HALF - 2 <= delay <= HALF + 3, f"a refresh every half ttl, not {delay} s"
    print(f"workload token refresh: every {delay} s at ttl {MIN_TTL} s")


# ---------------------------------------------------------------- a failed refresh

RETRY_SLEEP_S = 48  # the local-exec's wait: past the retry, short of the first token's exp
RETRY_TF = r"""
variable "runplane_workload_identity_token_file" { type = string }
resource "null_resource" "t" {
  provisioner "local-exec" {
    command = <<-EOT
      printf 'FILE1=%s\n' "$(cat "${var.runplane_workload_identity_token_file}" | rev)"
      sleep SLEEP
      printf 'FILE2=%s\n' "$(cat "${var.runplane_workload_identity_token_file}" | rev)"
      printf 'AT2=%s\n' "$(date +%s)"
    EOT
  }
}
""".replace("SLEEP", str(RETRY_SLEEP_S))


@dataclass
class Responder:
    """The plane's secrets responder, which the test stops and starts again."""

    system: bootstrap.Plane
    stack: AsyncExitStack | None = None

    async def start(self) -> None:
        self.stack = AsyncExitStack()
        await self.stack.enter_async_context(self.system.secrets_responder())

    async def stop(self) -> None:
        assert self.stack is not None
        await self.stack.aclose()
        self.stack = None


@pytest.fixture
async def stoppable(nc: NATS, tmp_path: Path) -> AsyncIterator[tuple[Plane, Responder]]:
    """tests/plane_support.py's plane, its secrets responder the test's to stop."""
    async with AsyncExitStack() as stack:
        system = built(nc, stack, tmp_path, pinning=git_snapshots)
        projector = await stack.enter_async_context(system.projector(tmp_path / "rm.sqlite"))
        web_app = system.web_app(projector, admin_token=ADMIN_TOKEN, repositories=None)
        client = await stack.enter_async_context(TestClient(TestServer(web_app)))
        await stack.enter_async_context(system.scheduler())
        responder = Responder(system)
        await responder.start()
        stack.push_async_callback(lambda: responder.stop() if responder.stack else _nothing())
        http = Http(client, web_app[API], system.app)
        assert (await http.post("/api/v1/orgs", json={"name": "acme"})).status == 201
        plane = Plane(http, system.app, nc, system.keyring, system.secrets, tmp_path, stack, system)
        yield plane, responder


async def _nothing() -> None:
    return None


async def test_a_failed_refresh_is_tried_again_before_the_token_expires(
    sandboxed: None, stoppable: tuple[Plane, Responder], tmp_path: Path
) -> None:
    """The secrets responder is away (refusing) when the apply's token is due for its refresh (a
    NATS blip, a restart) and back 5 s later: the refresh is tried again within
    `MIN_REFRESH_S`, not after another half life (at 30 + 10 + 30 s, when a 60 s token
    has expired), so the file read 48 s into the phase holds a new, live token."""
    plane, responder = stoppable
    asked: list[float] = []  # when the apply phase asked for a token

    async def seen(msg: Msg) -> None:
        if wire.decode_secrets_request(msg.data).workload:
            asked.append(time.monotonic())
        if responder.stack is None:  # away: what a NATS without responders answers, at once
            await msg.respond(wire.encode(SecretsReply(error="no responders")))

    sub = await plane.nc.subscribe(secrets_subject("acme", "net"), cb=seen)
    run_id = await _awaiting_approval(plane, tmp_path, RETRY_TF)
    asked.clear()
    await plane.approve(run_id)
    await eventually(lambda: _at_least(asked, 1), timeout=60, what="the apply's first token")
    await asyncio.sleep(1)  # its answer is on its way
    await responder.stop()
    await eventually(lambda: _at_least(asked, 2), timeout=HALF + 10, what="the refresh")
    await asyncio.sleep(5)
    await responder.start()
    log = await _applied(plane, run_id, timeout=RETRY_SLEEP_S + 90)
    await sub.unsubscribe()
    jwks = (await plane.http.get("/.well-known/jwks.json", token=None)).body

    first, second = _token(log, "FILE1"), _token(log, "FILE2")
    c1, c2 = verify(first, jwks, AUDIENCE), verify(second, jwks, AUDIENCE)
    assert c2["jti"] != c1["jti"], "the file still held the token the refresh failed to replace"
    assert c2["exp"] > int(_found(log, "AT2")), "not expired when read"
    late = c2["iat"] - c1["iat"]
    assert late <= HALF + 5 + MIN_REFRESH_S + 3, f"tried again {late} s after the first token"
    print(f"workload token refresh with the responder away 5 s: new token after {late} s")


async def _at_least(items: list[float], n: int) -> bool:
    return len(items) >= n
