"""`runplane subscribers` killed with SIGKILL mid-delivery: after its restart every
notification is delivered, and no notification reaches the receiver under a second,
distinct RP-Delivery (a copy of one already sent carries the same id)."""

from __future__ import annotations

import base64
import signal
from pathlib import Path
from typing import Any

from nats.aio.client import Client as NATS

from events import notification as nt
from events import run as R
from events.codec import run_subject
from infra.crypto import parse_keys
from infra.natsserver import EmbeddedNats
from services.app.commands import App
from services.processes.notifications import outbox
from services.processes.notifications.tokens import TokenStore
from tests.helpers import eventually
from tests.notify_support import Receiver
from tests.procs import TEST_KEY, Proc

TOKEN = "tok-crash-test-5e4d3c2b1a"
RUNS = 12


def _host(tmp_path: Path, server: EmbeddedNats, name: str) -> Proc:
    return Proc(
        ["subscribers", "--nats-url", server.url, "--data-dir", str(tmp_path / "data")],
        tmp_path / f"{name}.log",
        env={
            "RUNPLANE_NOTIFY_ALLOW": "loopback",
            "RUNPLANE_NOTIFY_SCHEDULE": "0.2,0.5,1",
            "RUNPLANE_NOTIFY_TIMEOUT": "5",
        },
    )


async def _up(proc: Proc) -> bool:
    return "runplane subscribers running (notifications" in proc.output()


async def test_a_killed_subscriber_delivers_everything_after_restart_under_stable_ids(
    nats_server: EmbeddedNats, nc: NATS, app: App, tmp_path: Path
) -> None:
    assert base64.b64decode(TEST_KEY)
    await app.create_org("acme", "admin")
    await app.create_workspace("acme", "net", R.Workspace(repository="/nowhere"), "admin")
    async with Receiver(token=TOKEN, delay=0.25) as slow, Receiver(token=TOKEN) as fast:
        configs = []
        for name, r in (("slow", slow), ("fast", fast)):
            cmd = nt.SaveConfig(
                actor="admin",
                config_id=app.ids(),
                org="acme",
                create=True,
                name=name,
                destination="generic",
                url=r.url,
                triggers=["run:created"],
                has_token=True,
            )
            await TokenStore(nc, parse_keys(TEST_KEY, "test")).put("acme", cmd.config_id, TOKEN)
            state, _ = await outbox.command(app, "acme", cmd)
            assert state.config is not None
            configs.append(state.config)
        first = await _host(tmp_path, nats_server, "first").start()
        try:
            await eventually(lambda: _up(first), what="the first host up")
            runs = [await app.create_run("acme", "net", "plan", "alice") for _ in range(RUNS)]
            await eventually(lambda: _got(slow, 3), what="the slow receiver mid-way")
        finally:
            first.kill()  # SIGKILL mid-delivery: lanes, timers and acks all lost
            await first.stop(signal.SIGKILL)
        before = len(slow.deliveries())
        assert before < RUNS, "the kill came too late to be mid-delivery"
        second = await _host(tmp_path, nats_server, "second").start()
        try:
            await eventually(
                lambda: _all(slow, fast), timeout=60, what="every notification delivered"
            )
            wanted = await _expected(app, runs, configs)
            await eventually(
                lambda: _recorded(app, wanted), timeout=30, what="every delivery recorded"
            )
        finally:
            await second.stop()
    expected = {did for did, _ in wanted}
    got = slow.deliveries() | fast.deliveries()
    assert got == expected  # every one, and no distinct id beyond them
    for r in (slow, fast):
        ids_per_run: dict[str, set[str]] = {}
        for g in r.got:
            ids_per_run.setdefault(g.json["run_id"], set()).add(g.delivery)
        assert set(ids_per_run) == {run.state.run_id for run in runs}
        assert all(len(ids) == 1 for ids in ids_per_run.values())
        assert all(g.tfe_ok and g.rp_ok for g in r.got)
    copies = len(slow.got) + len(fast.got) - len(expected)
    print(f"killed after {before} of {RUNS} slow deliveries; {copies} same-id copies resent")


async def _expected(
    app: App, runs: list[Any], configs: list[nt.NotificationConfig]
) -> list[tuple[str, str]]:
    """(delivery id, config id) of every notification the runs' run.created make."""
    out = []
    for run in runs:
        subject = run_subject("acme", "net", run.state.run_id)
        seq = (await app.store.read(subject))[0].seq
        out += [(nt.delivery_id(c.id, seq, "run:created"), c.id) for c in configs]
    return out


async def _recorded(app: App, wanted: list[tuple[str, str]]) -> bool:
    """Every delivery's last attempt in the log says delivered."""
    for did, config_id in wanted:
        envs = await app.store.read(nt.delivery_subject("acme", config_id, did))
        if nt.delivery_fold([e.event for e in envs]).outcome != nt.DELIVERED:
            return False
    return True


async def _got(r: Receiver, n: int) -> bool:
    return len(r.got) >= n


async def _all(slow: Receiver, fast: Receiver) -> bool:
    return len(slow.deliveries()) >= RUNS and len(fast.deliveries()) >= RUNS
