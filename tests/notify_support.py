"""Real local receivers for the notification tests, an API fixture with the sealed store
(tokens are stored like secret variables), and the delivery engine's rig (`Rig`, the
`rig` and `policy` fixtures: a Dispatcher and Notifier over acme/net). Holds no tests
itself."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest
from aiohttp import web
from nats.aio.client import Client as NATS

from events import notification as nt
from events import run as R
from events.codec import run_subject
from infra.eventstore import EventStore
from services.app.commands import App
from services.processes.notifications import outbox, signing
from services.processes.notifications.delivery import Dispatcher, Policy
from services.processes.notifications.subscriber import Notifier
from services.root.bootstrap import Plane
from services.surfaces.api.context import API
from tests.api_support import Http, served
from tests.builders import workspace


@dataclass
class Got:
    delivery: str
    body: bytes
    headers: dict[str, str]
    tfe_ok: bool
    rp_ok: bool
    at: float

    @property
    def json(self) -> Any:
        return msgspec.json.decode(self.body)


@dataclass
class Receiver:
    """An HTTP server on 127.0.0.1 that checks both signatures and counts deliveries.

    `answers`: status codes to answer, in turn, before answering `then` for good; a
    code of 0 hangs (never answers); 429 carries `Retry-After: retry_after`."""

    token: str = ""
    answers: list[int] = field(default_factory=list)
    then: int = 200
    retry_after: str = "1"
    delay: float = 0.0  # seconds before each answer
    got: list[Got] = field(default_factory=list)
    url: str = ""
    _runner: web.AppRunner | None = None

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        h = dict(request.headers)
        tfe = h.get(signing.TFE_HEADER, "")
        rp = h.get(signing.RP_HEADER, "")
        self.got.append(
            Got(
                delivery=h.get(signing.DELIVERY_HEADER, ""),
                body=body,
                headers=h,
                tfe_ok=bool(self.token) and signing.check_tfe(self.token, body, tfe),
                rp_ok=bool(self.token) and signing.check_rp(self.token, body, rp, time.time()),
                at=time.monotonic(),
            )
        )
        code = self.answers.pop(0) if self.answers else self.then
        if self.delay:
            await asyncio.sleep(self.delay)
        if code == 0:
            await asyncio.Event().wait()  # hang until the client gives up
        headers = {"Retry-After": self.retry_after} if code == 429 else {}
        return web.Response(status=code, text=f"answer {code}", headers=headers)

    async def __aenter__(self) -> Receiver:
        app = web.Application()
        app.router.add_post("/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}/hook"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._runner is not None
        await self._runner.cleanup()

    def deliveries(self) -> set[str]:
        return {g.delivery for g in self.got}


@pytest.fixture(name="nhttp")
async def nhttp_fixture(
    system: Plane, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Http]:
    """The API with the sealed store, loopback destinations allowed (the receivers)."""
    monkeypatch.setenv("RUNPLANE_NOTIFY_ALLOW", "loopback")
    async with served(system, tmp_path / "rm.sqlite", "notify-fixture") as (web_app, client):
        yield Http(client, web_app[API], system.app)


# ---------------------------------------------------------------- the delivery engine's rig

TOKEN = "tok-delivery-test-0123456789"
FAST = (0.05, 0.1, 0.2)
PLAIN_VALUE = "plain-value-7a6b5c"


@dataclass
class Rig:
    app: App
    store: EventStore
    notifier: Notifier
    dispatcher: Dispatcher
    tokens: dict[str, str]

    async def config(self, url: str, **fields: Any) -> nt.NotificationConfig:
        token = fields.pop("token", TOKEN)
        cmd = nt.SaveConfig(
            actor="alice",
            config_id=self.app.ids(),
            org="acme",
            create=True,
            name=fields.pop("name", "ops"),
            destination=fields.pop("destination", "generic"),
            url=url,
            triggers=fields.pop("triggers", ["run:created"]),
            has_token=bool(token),
            **fields,
        )
        state, _ = await outbox.command(self.app, "acme", cmd)
        self.tokens[cmd.config_id] = token
        assert state.config is not None
        return state.config

    async def create_run(self) -> tuple[int, str, R.RunState]:
        """A run of acme/net: (seq of its run.created, subject, state through it)."""
        created = await self.app.create_run("acme", "net", "apply", "alice", message="deploy")
        run: R.RunState = created.state
        subject = run_subject("acme", "net", run.run_id)
        envs = await self.store.read(subject)
        first = envs[0].event
        assert isinstance(first, R.RunCreated)
        return envs[0].seq, subject, R.fold([first])

    async def notify_created(self) -> tuple[int, R.RunState]:
        seq, subject, state = await self.create_run()
        envs = await self.store.read(subject)
        await self.notifier.on_event(seq, subject, envs[0].event, state)
        return seq, state

    async def attempts(self, cfg: nt.NotificationConfig, did: str) -> list[nt.DeliveryAttempted]:
        envs = await self.store.read(nt.delivery_subject("acme", cfg.id, did))
        return [e.event for e in envs if isinstance(e.event, nt.DeliveryAttempted)]


def _policy(**kw: Any) -> Policy:
    defaults: dict[str, Any] = {"allow": frozenset({"loopback"}), "schedule": FAST, "timeout": 2.0}
    return Policy(**{**defaults, **kw})


@pytest.fixture(name="policy")
def policy_fixture() -> Policy:
    return _policy()


@pytest.fixture(name="rig")
async def rig_fixture(nc: NATS, app: App, store: EventStore, policy: Policy) -> AsyncIterator[Rig]:
    await workspace(
        app,
        "net",
        actor="alice",
        repository="https://example.com/r.git",
        variables={"region": PLAIN_VALUE},
        secret_variables=["db_password"],
    )
    tokens: dict[str, str] = {}

    async def token_of(org: str, config_id: str) -> str:
        return tokens.get(config_id, "")

    record, current = outbox.recorder(store), outbox.current(store)
    async with Dispatcher(policy, token_of, record, current) as dispatcher:
        yield Rig(app, store, Notifier(store, dispatcher), dispatcher, tokens)
