"""`runplane subscribers` as a real process: it runs what is registered, and a host killed
mid-handling has the event handled again after its restart (its durable keeps it)."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from nats.aio.client import Client as NATS
from nats.js.api import DeliverPolicy

from events import run as R
from infra import streams
from infra.natsserver import EmbeddedNats
from infra.options import ConfigError, Options
from services.app.commands import App
from services.processes.subscribers import registry
from services.processes.subscribers.context import SubscriberContext
from services.processes.subscribers.host import MODULES_ENV, Host, all_subscriptions
from tests.helpers import eventually
from tests.procs import Proc

MODULE = "tests.subscriber_support"


def _lines(path: Path) -> list[list[str]]:
    return [line.split() for line in path.read_text().splitlines()] if path.exists() else []


def _host(tmp_path: Path, server: EmbeddedNats, log: Path, *, hang: bool, name: str) -> Proc:
    return Proc(
        ["subscribers", "--nats-url", server.url, "--data-dir", str(tmp_path / "data")],
        tmp_path / f"{name}.log",
        env={
            "RUNPLANE_SUBSCRIBER_MODULES": MODULE,
            "RP_TEST_SUB_LOG": str(log),
            "RP_TEST_SUB_HANG": "1" if hang else "0",
        },
    )


async def test_a_host_killed_mid_handling_has_the_event_handled_after_its_restart(
    nats_server: EmbeddedNats, nc: NATS, app: App, tmp_path: Path
) -> None:
    log = tmp_path / "deliveries.txt"
    first = await _host(tmp_path, nats_server, log, hang=True, name="first").start()
    try:
        await eventually(
            lambda: _contains(first, "test-probe)"),  # after the registry's own
            what="the host up",
        )
        await app.create_org("acme", "admin")
        await app.create_workspace("acme", "net", R.Workspace(repository="/nowhere"), "admin")
        await app.create_run("acme", "net", "apply", "alice")

        async def got() -> bool:
            return any(line[0] == "got" for line in _lines(log))

        await eventually(got, what="the first host handling the event")
    finally:
        first.kill()  # SIGKILL, mid-handling: no ack, no nak
        await first.stop(signal.SIGKILL)
    second = await _host(tmp_path, nats_server, log, hang=False, name="second").start()
    try:

        async def done() -> list[str] | None:
            return next((line for line in _lines(log) if line[0] == "done"), None)

        finished = await eventually(done, timeout=40, what="redelivered and handled")
    finally:
        await second.stop()
    (got_line,) = [line for line in _lines(log) if line[0] == "got" and line[3] != finished[3]]
    assert finished[1] == got_line[1]  # the same event (stream sequence)
    assert int(finished[2]) >= 2  # a redelivery
    assert finished[3] != got_line[3]  # by the restarted process


async def _contains(proc: Proc, text: str) -> bool:
    return text in proc.output()


async def test_the_registry_and_extra_modules_make_the_hosts_list(
    nc: NATS, app: App, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Its own data directory: the clone's .runplane/ is `./dev up`'s, and its key there
    # would give these options the chat-ops subscriptions.
    opts = Options(data_dir=tmp_path)
    ctx = SubscriberContext(nc=nc, app=app, opts=opts, readmodel_path=tmp_path / "rm.sqlite")
    names = [s.name for s in registry.subscriptions(ctx)]
    assert names == ["notifications", "run-triggers", "stack-runs"]
    monkeypatch.setenv(MODULES_ENV, f"{MODULE},{MODULE}")
    with pytest.raises(ConfigError, match="share a name"):
        all_subscriptions(ctx)
    monkeypatch.setenv(MODULES_ENV, "tests.no_such_module")
    with pytest.raises(ConfigError, match="cannot import"):
        all_subscriptions(ctx)
    monkeypatch.setenv(MODULES_ENV, "tests.helpers")
    with pytest.raises(ConfigError, match="has no subscriptions"):
        all_subscriptions(ctx)
    monkeypatch.setenv(MODULES_ENV, MODULE)
    async with Host(ctx) as host:
        # chat-ops' subscriptions need the encryption key, which these options lack
        assert host.names == ["notifications", "run-triggers", "stack-runs", "test-probe"]
        await host.consumers[-1].ready.wait()
    info = await nc.jetstream().consumer_info(streams.EVENTS, "rp-sub-test-probe")
    assert info.config.filter_subjects == ["rp.run.>"]
    assert info.config.deliver_policy == DeliverPolicy.NEW


async def test_runplane_subscribers_without_a_nats_url_says_so_in_one_line(
    tmp_path: Path,
) -> None:
    proc = await Proc(
        ["subscribers", "--data-dir", str(tmp_path / "data")], tmp_path / "out.log"
    ).start()
    assert proc.proc is not None
    assert await proc.proc.wait() == 2
    out = proc.output().strip().splitlines()
    assert out == ["runplane: runplane subscribers needs --nats-url (or RUNPLANE_NATS_URL)"]
