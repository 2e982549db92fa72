"""Slack's side, played for real: requests signed with the app's signing secret exactly as
Slack signs them (form bodies for slash commands, `payload=` JSON for buttons), and a
local HTTP server standing in for `response_url`. Over the real API, App, projector and
nats-server. Holds no tests itself."""

from __future__ import annotations

import json
import time
import urllib.parse
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from events import chat as chat_agg
from events.run import (
    ClaimPhase,
    FinishPlan,
    FinishStep,
    PlanSummary,
    ResourceChange,
    RunState,
    Snapshot,
    StartStep,
)
from services.app.commands import App
from services.processes.chat import signing
from services.processes.chat.config import ChatConfig
from services.processes.chat.poster import Poster
from services.processes.chat.updates import Updater
from services.processes.chat.worker import Worker
from services.root.bootstrap import Plane
from services.surfaces.api.context import API
from tests.api_support import Answer, Http, served
from tests.bootstrap_support import built, pinned_by

STEPS = ("checkout", "init", "plan")


@dataclass
class Receiver:
    """What Slack's response_url endpoint was sent, per hook path."""

    posts: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    base: str = ""

    def url(self, name: str) -> str:
        return f"{self.base}/hook/{name}"

    def to(self, name: str) -> list[dict[str, Any]]:
        return [m for path, m in self.posts if path == f"/hook/{name}"]

    async def handle(self, request: web.Request) -> web.Response:
        self.posts.append((request.path, await request.json()))
        return web.Response(text="ok")


@dataclass
class Slack:
    http: Http
    app: App
    scheduler: App  # the scheduler's: it pins each admitted run to `_snapshot`
    config: ChatConfig
    receiver: Receiver
    worker: Worker
    updater: Updater
    stack: AsyncExitStack
    hooks: int = 0

    # ------------------------------------------------------------ setup

    async def org(self, org: str, team: str, secret: str) -> dict[str, str]:
        """An organization with workspace `net`, tokens of alice (approver), bob
        (operator) and vera (viewer), its Slack app, and their Slack ids mapped."""
        assert (await self.http.post("/api/v1/orgs", json={"name": org})).status == 201
        await self.http.workspace(org, "net")
        tokens = {}
        for user, role in (("alice", "approver"), ("bob", "operator"), ("vera", "viewer")):
            a = await self.http.post(
                f"/api/v1/orgs/{org}/tokens", json={"user": user, "role": role}
            )
            assert a.status == 201, a.body
            tokens[user] = a.body["token"]
        body = {"team_id": team, "signing_secret": secret}
        a = await self.http.call("PUT", f"/api/v1/orgs/{org}/chat/slack", json=body)
        assert a.status == 200, a.body
        for user in ("alice", "bob", "vera"):
            await self.map(org, slack_id(org, user), user)
        return tokens

    async def map(self, org: str, slack_user: str, user: str) -> Answer:
        path = f"/api/v1/orgs/{org}/chat/slack/users/{slack_user}"
        a = await self.http.call("PUT", path, json={"user": user})
        assert a.status == 200, a.body
        return a

    # ------------------------------------------------------------ Slack's requests

    def hook(self) -> str:
        self.hooks += 1
        return f"h{self.hooks}"

    async def signed(
        self,
        path: str,
        body: bytes,
        secret: str,
        *,
        ts: int | None = None,
        headers: dict[str, str] | None = None,
    ) -> Answer:
        stamp = str(int(time.time()) if ts is None else ts)
        hdrs = {
            "X-Slack-Request-Timestamp": stamp,
            "X-Slack-Signature": signing.signature(secret, stamp, body),
            "Content-Type": "application/x-www-form-urlencoded",
        }
        hdrs.update(headers or {})
        return await self.http.call("POST", path, token=None, data=body, headers=hdrs)

    async def command(
        self, text: str, *, team: str, user: str, secret: str, hook: str = "", **kw: Any
    ) -> Answer:
        body = command_body(text, team=team, user=user, url=self.receiver.url(hook or "x"))
        return await self.signed("/api/v1/chat/slack/commands", body, secret, **kw)

    async def click(
        self, action_id: str, value: str, *, team: str, user: str, secret: str, hook: str
    ) -> Answer:
        body = click_body(action_id, value, team=team, user=user, url=self.receiver.url(hook))
        return await self.signed("/api/v1/chat/slack/interactions", body, secret)

    async def work(self, org: str) -> int:
        """Play the subscriber: work every recorded request not done yet; how many."""
        events = await self.requests(org)
        done = {e.request_id for e in events if isinstance(e, chat_agg.SlackRequestDone)}
        todo = [
            e
            for e in events
            if isinstance(e, chat_agg.SlackRequestReceived) and e.request_id not in done
        ]
        for event in todo:
            await self.worker.handle(org, event)
        return len(todo)

    async def requests(self, org: str) -> list[Any]:
        envs = await self.app.store.read(f"rp.org.{org}.chat.slack.req.*")
        return [e.event for e in envs]

    # ------------------------------------------------------------ runs

    async def awaiting(
        self, org: str, run_id: str, *, changes: list[ResourceChange] | None = None
    ) -> RunState:
        """Drive a run to awaiting_approval as the scheduler and an executor would, its
        snapshot holding the workspace's effective settings."""
        assert await self.scheduler.admit_next(org, "net") == run_id
        assert await self.scheduler.pin_run(org, "net", run_id)
        lease = "lease-1"
        claim = ClaimPhase(actor="executor", phase="plan", lease_id=lease, executor_id="e1")
        await self.app.run_command(org, "net", run_id, claim)
        for step in STEPS:
            await self.app.run_command(
                org, "net", run_id, StartStep(actor="executor", lease_id=lease, step=step)
            )
            finish = FinishStep(
                actor="executor", lease_id=lease, step=step, ok=True, started_at=datetime.now(UTC)
            )
            await self.app.run_command(org, "net", run_id, finish)
        changes = changes or []
        plan = FinishPlan(
            actor="executor",
            lease_id=lease,
            commit="abc123",
            has_changes=True,
            summary=PlanSummary(add=1, change=0, destroy=len(changes)),
            plan_digest="d1",
            changes=changes,
        )
        done = await self.app.run_command(org, "net", run_id, plan)
        state: RunState = done.state
        assert str(state.status) == "awaiting_approval", state.status
        return state


async def _snapshot(run: RunState) -> Snapshot:
    return Snapshot(commit="abc123")


def slack_id(org: str, user: str) -> str:
    """A Slack user id per organization and user (upper case, as Slack's)."""
    return f"U{org.upper().replace('-', '')}{user.upper()}"


def command_body(text: str, *, team: str, user: str, url: str) -> bytes:
    """A slash command as Slack posts it (application/x-www-form-urlencoded)."""
    fields = {
        "token": "deprecated-verification-token",
        "team_id": team,
        "team_domain": "example",
        "channel_id": "C0CHAN",
        "channel_name": "ops",
        "user_id": user,
        "user_name": "someone",
        "command": "/runplane",
        "text": text,
        "api_app_id": "A0APP",
        "response_url": url,
        "trigger_id": "1.2.3",
    }
    return urllib.parse.urlencode(fields).encode()


def click_body(action_id: str, value: str, *, team: str, user: str, url: str) -> bytes:
    """A block_actions interaction as Slack posts it: `payload=<JSON>`."""
    payload = {
        "type": "block_actions",
        "team": {"id": team, "domain": "example"},
        "user": {"id": user, "username": "someone", "team_id": team},
        "api_app_id": "A0APP",
        "container": {"type": "message", "message_ts": "1700000000.000100", "channel_id": "C0CHAN"},
        "channel": {"id": "C0CHAN", "name": "ops"},
        "message": {"ts": "1700000000.000100", "text": "run awaiting approval"},
        "response_url": url,
        "trigger_id": "1.2.3",
        "actions": [
            {
                "type": "button",
                "action_id": action_id,
                "block_id": "b1",
                "value": value,
                "action_ts": "1700000001.000200",
            }
        ],
    }
    return urllib.parse.urlencode({"payload": json.dumps(payload)}).encode()


@pytest.fixture(name="slack")
async def slack_fixture(system: Plane, tmp_path: Path) -> AsyncIterator[Slack]:
    app = system.app
    receiver = Receiver()
    hooks = web.Application()
    hooks.router.add_post("/hook/{name}", receiver.handle)
    async with AsyncExitStack() as stack:
        server = await stack.enter_async_context(TestServer(hooks))
        receiver.base = str(server.make_url("")).rstrip("/")
        served_api = served(system, tmp_path / "rm.sqlite", "slack-fixture")
        web_app, client = await stack.enter_async_context(served_api)
        poster = await stack.enter_async_context(Poster((receiver.base + "/hook/",)))
        config = ChatConfig(system.nc, app, system.keyring)
        # the scheduler's graph over the same store (a process of the same deployment)
        scheduler = built(system.nc, stack, tmp_path, store=app.store, pinning=pinned_by(_snapshot))
        yield Slack(
            http=Http(client, web_app[API], app),
            app=app,
            scheduler=scheduler.app,
            config=config,
            receiver=receiver,
            worker=Worker(app, config, poster),
            updater=Updater(app, config, poster),
            stack=stack,
        )
