"""The delivery engine against real local receivers and a real NATS: a run's events
become signed deliveries with stable ids, retried on 500 / 429 (its Retry-After
honoured) and timeouts, given up after the bound, never retried on other 4xx; a hanging
receiver delays no other destination; a redelivered event or a recovery sends nothing
twice under distinct ids; and no payload carries a variable's value."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import pytest

from events import notification as nt
from services.processes.notifications import formats, outbox
from services.processes.notifications.delivery import Dispatcher, Job, Policy
from services.processes.notifications.subscriber import Notifier
from tests.helpers import eventually
from tests.notify_support import (  # noqa: F401  # the fixtures
    PLAIN_VALUE,
    TOKEN,
    Receiver,
    Rig,
    _policy,
    policy_fixture,
    rig_fixture,
)

SECRET_VALUE = "hunter2-secret-value-9f8e7d"


async def test_a_run_event_is_delivered_signed_with_its_stable_id(rig: Rig) -> None:
    async with Receiver(token=TOKEN) as r:
        cfg = await rig.config(r.url)
        seq, state = await rig.notify_created()
        await eventually(lambda: _n(r, 1), what="the delivery")
        got = r.got[0]
        assert got.delivery == nt.delivery_id(cfg.id, seq, "run:created")
        assert got.tfe_ok and got.rp_ok
        p = got.json
        for key in (
            "payload_version",
            "notification_configuration_id",
            "run_url",
            "run_id",
            "run_message",
            "run_created_at",
            "run_created_by",
            "workspace_id",
            "workspace_name",
            "organization_name",
            "notifications",
        ):
            assert key in p, key
        assert p["payload_version"] == 1 and p["run_id"] == state.run_id
        assert (p["run_message"], p["run_created_by"], p["workspace_name"]) == (
            "deploy",
            "alice",
            "net",
        )
        note = p["notifications"][0]
        assert set(note) == {"message", "trigger", "run_status", "run_updated_at", "run_updated_by"}
        assert (note["trigger"], note["run_status"]) == ("run:created", "pending")
        assert p["run_url"].endswith(f"/orgs/acme/workspaces/net/runs/{state.run_id}")
        rows = await eventually(lambda: rig.attempts(cfg, got.delivery))
        assert [(a.attempt, a.status_code, a.outcome) for a in rows] == [(1, 200, "delivered")]


async def _n(r: Receiver, n: int) -> bool:
    return len(r.got) >= n


async def test_500_and_429_are_retried_with_the_same_id_honouring_retry_after(
    rig: Rig,
) -> None:
    async with Receiver(token=TOKEN, answers=[500, 429], retry_after="1") as r:
        cfg = await rig.config(r.url)
        await rig.notify_created()
        await eventually(lambda: _n(r, 3), what="three attempts")
        assert len(r.deliveries()) == 1  # one RP-Delivery for all three
        assert all(g.tfe_ok and g.rp_ok for g in r.got)
        # the 429 asked for 1 s; the schedule's own second delay is 0.1 s
        assert r.got[2].at - r.got[1].at >= 0.95
        assert r.got[1].at - r.got[0].at < 0.9
        did = r.got[0].delivery
        rows = await eventually(lambda: _done(rig, cfg, did))
        assert [(a.status_code, a.outcome) for a in rows] == [
            (500, "retry"),
            (429, "retry"),
            (200, "delivered"),
        ]
        assert rows[0].next_retry_at is not None and rows[2].next_retry_at is None


async def _done(rig: Rig, cfg: nt.NotificationConfig, did: str) -> list[nt.DeliveryAttempted]:
    rows = await rig.attempts(cfg, did)
    return rows if rows and rows[-1].outcome in nt.FINAL else []


async def test_another_4xx_is_permanent(rig: Rig) -> None:
    async with Receiver(token=TOKEN, then=404) as r:
        cfg = await rig.config(r.url)
        await rig.notify_created()
        rows = await eventually(lambda: _r_done(rig, cfg, r))
        assert [(a.status_code, a.outcome) for a in rows] == [(404, "failed")]
        assert rig.dispatcher.busy() == 0 and len(r.got) == 1


async def _r_done(rig: Rig, cfg: nt.NotificationConfig, r: Receiver) -> list[Any]:
    return await _done(rig, cfg, r.got[0].delivery) if r.got else []


@pytest.mark.parametrize("policy", [_policy(give_up_after=timedelta(seconds=0.3), schedule=(0.1,))])
async def test_a_receiver_failing_throughout_is_given_up_after_the_bound(rig: Rig) -> None:
    async with Receiver(token=TOKEN, then=503) as r:
        cfg = await rig.config(r.url)
        await rig.notify_created()
        rows = await eventually(lambda: _r_done(rig, cfg, r), timeout=10)
        assert rows[-1].outcome == "gave_up" and len(rows) >= 2
        assert all(a.outcome == "retry" for a in rows[:-1])
        assert len(r.deliveries()) == 1


@pytest.mark.parametrize("policy", [_policy(timeout=6.0)])
async def test_a_hanging_receiver_delays_no_other_destination(rig: Rig) -> None:
    async with Receiver(token=TOKEN, then=0) as hung, Receiver(token=TOKEN) as ok:
        await rig.config(hung.url, name="hung")
        await rig.config(ok.url, name="ok")
        t0 = time.monotonic()
        for _ in range(5):
            await rig.notify_created()
        await eventually(lambda: _n(ok, 5), what="the good receiver's five")
        assert time.monotonic() - t0 < 3  # not behind the hanging one's 6 s timeouts
        await eventually(lambda: _n(hung, 4), what="the hanging lane's four")
        assert len(hung.got) == 4  # its own lane: per_destination attempts at a time


async def test_a_redelivered_event_sends_nothing_twice(rig: Rig, policy: Policy) -> None:
    """The triggering event handled again (redelivery, another replica) schedules the
    same delivery: nothing new is sent once it is delivered, and any copy carries the
    same RP-Delivery."""
    async with Receiver(token=TOKEN) as r:
        cfg = await rig.config(r.url)
        seq, subject, state = await rig.create_run()
        event = (await rig.store.read(subject))[0].event
        await rig.notifier.on_event(seq, subject, event, state)
        await eventually(lambda: _r_done(rig, cfg, r))
        assert await rig.notifier.on_event(seq, subject, event, state) == 0
        other = Dispatcher(policy, _no_token, outbox.recorder(rig.store))
        async with other:
            again = Notifier(rig.store, other)
            assert await again.on_event(seq, subject, event, state) == 0
            assert await again.recover(rig.store.nc) == 0
        assert len(r.got) == 1


async def _no_token(org: str, config_id: str) -> str:
    return ""


async def test_what_a_crash_left_scheduled_is_recovered_with_its_id(
    rig: Rig, policy: Policy
) -> None:
    """Scheduled in the log but never sent (the process died right after): a new
    process's recovery sends it, under the id derived from its event."""
    async with Receiver(token=TOKEN) as r:
        cfg = await rig.config(r.url)
        seq, _, state = await rig.create_run()
        view = formats.view_of(state, at=state.created_at or rig.app.clock(), actor="alice")
        job = await outbox.schedule(rig.store, cfg, view, "run:created", seq, rig.app.clock())
        assert job is not None and r.got == []
        assert await rig.notifier.recover(rig.store.nc) == 1
        await eventually(lambda: _n(r, 1))
        assert r.got[0].delivery == nt.delivery_id(cfg.id, seq, "run:created")


async def test_workspace_and_org_configurations_add_up_and_triggers_filter(rig: Rig) -> None:
    async with Receiver() as r:
        await rig.config(r.url, name="org", token="")
        await rig.config(r.url, name="ws", workspace="net", token="")
        await rig.config(r.url, name="other-ws", workspace="db", token="")
        await rig.config(r.url, name="wrong-trigger", triggers=["run:errored"], token="")
        await rig.config(r.url, name="disabled", enabled=False, token="")
        await rig.notify_created()
        await eventually(lambda: _n(r, 2))
        assert len(r.deliveries()) == 2


@pytest.mark.parametrize("destination", ["generic", "slack", "teams"])
async def test_no_payload_carries_a_variable_value_or_the_token(rig: Rig, destination: str) -> None:
    """Attack: the workspace has a plain variable and a secret one; no payload of any
    format, for any trigger, carries a value (nor the token it is signed with)."""
    async with Receiver(token=TOKEN) as r:
        await rig.config(r.url, destination=destination, triggers=list(nt.TRIGGERS))
        seq, subject, state = await rig.create_run()
        await rig.notifier.on_event(seq, subject, (await rig.store.read(subject))[0].event, state)
        await eventually(lambda: _n(r, 1))
        for g in r.got:
            for needle in (SECRET_VALUE, PLAIN_VALUE, TOKEN, "db_password"):
                assert needle.encode() not in g.body, needle
        assert r.got[0].json  # a JSON body


async def test_a_dead_replicas_overdue_delivery_is_taken_over_not_a_live_ones(
    rig: Rig, policy: Policy
) -> None:
    """The periodic rescan takes a delivery whose retry has been due for longer than
    the bound (its replica died holding it), not one due a moment ago (a live replica
    will send it), and sends it under its own id."""
    async with Receiver(token=TOKEN) as r:
        cfg = await rig.config(r.url)
        now = rig.app.clock()
        for seq, due in ((1001, now - timedelta(minutes=5)), (1002, now + timedelta(seconds=5))):
            view = formats.RunView(org="acme", workspace="net", run_id=f"r{seq}")
            job = await outbox.schedule(rig.store, cfg, view, "run:created", seq, now)
            assert job is not None
            attempt = nt.DeliveryAttempted(
                at=now,
                actor="other-replica",
                delivery_id=job.delivery_id,
                config_id=cfg.id,
                attempt=1,
                trigger="run:created",
                run_id=job.run_id,
                status_code=503,
                outcome="retry",
                next_retry_at=due,
            )
            assert await outbox.recorder(rig.store)(job, attempt)
        assert await rig.notifier.recover(rig.store.nc, overdue=timedelta(seconds=60)) == 1
        await eventually(lambda: _n(r, 1))
        assert r.got[0].delivery == nt.delivery_id(cfg.id, 1001, "run:created")
        assert r.got[0].json["run_id"] == "r1001"


@pytest.mark.parametrize("policy", [_policy(schedule=(0.5,))])
async def test_a_configuration_deleted_while_its_delivery_waits_gets_no_more_tries(
    rig: Rig,
) -> None:
    async with Receiver(token=TOKEN, then=503) as r:
        cfg = await rig.config(r.url)
        await rig.notify_created()
        await eventually(lambda: _n(r, 1))
        delete = nt.DeleteConfig(actor="alice", config_id=cfg.id)
        await outbox.command(rig.app, "acme", delete)

        async def dropped() -> bool:
            return rig.dispatcher.busy() == 0

        await eventually(dropped, what="the retry dropped")
        assert len(r.got) == 1


async def test_the_unfinished_list_is_kept_by_reading_only_what_is_new(rig: Rig) -> None:
    cfg = await rig.config("http://127.0.0.1:9/never")
    now = rig.app.clock()
    jobs = []
    for seq in (2001, 2002):
        view = formats.RunView(org="acme", workspace="net", run_id=f"r{seq}")
        job = await outbox.schedule(rig.store, cfg, view, "run:created", seq, now)
        assert job is not None
        jobs.append(job)
    pending = outbox.Unfinished(rig.store.nc)
    assert {d for _, _, d in await pending.refresh()} == {j.delivery_id for j in jobs}
    first_cursor = pending.cursor
    done = nt.DeliveryAttempted(
        at=now,
        actor="n",
        delivery_id=jobs[0].delivery_id,
        config_id=cfg.id,
        attempt=1,
        trigger="run:created",
        run_id=jobs[0].run_id,
        status_code=200,
        outcome="delivered",
    )
    assert await outbox.recorder(rig.store)(jobs[0], done)
    assert [d for _, _, d in await pending.refresh()] == [jobs[1].delivery_id]
    assert pending.cursor > first_cursor
    assert [d for _, _, d in await pending.refresh()] == [jobs[1].delivery_id]  # nothing new


async def test_one_organizations_hanging_receivers_delay_no_other_organization() -> None:
    """Org A's 4 hanging destinations, 4 deliveries each, could hold every attempt slot of
    the deployment (8 here) for their whole timeout; its own slots (`per_org`, 3) bound
    them, so org B's delivery goes at once."""
    policy = _policy(concurrency=8, per_org=3, per_destination=4, timeout=6.0)
    sent: list[str] = []

    async def record(job: Job, event: nt.DeliveryAttempted) -> int:
        sent.append(job.org)
        return 0  # not recorded: the job is done with

    def job(org: str, config_id: str, n: int, url: str) -> Job:
        did = f"{config_id}-{n}"
        return Job(org, config_id, did, url, "run:created", "r", b"{}")

    async with (
        Receiver(then=0) as hung,
        Receiver() as ok,
        Dispatcher(policy, _no_token, record) as dispatcher,
    ):
        for c in range(4):
            for n in range(4):
                assert dispatcher.submit(job("orga", f"a{c}", n, hung.url))
        await eventually(lambda: _n(hung, 3), what="org A's attempts under way")
        t0 = time.monotonic()
        assert dispatcher.submit(job("orgb", "b0", 0, ok.url))
        await eventually(lambda: _n(ok, 1), what="org B's delivery")
        assert time.monotonic() - t0 < 3, "not behind org A's 6 s timeouts"
        assert len(hung.got) == 3, "org A holds its own slots only"
