"""`App.run_command` tries the run as that App last wrote it, with no read; the append's
expected sequence proves it current. Whatever another writer did meanwhile, the outcome
is the one a fresh load would give."""

from __future__ import annotations

from typing import Any

import pytest

from events import run as R
from events.errors import IllegalTransition
from infra.eventstore import EventStore
from services.app.commands import App
from tests.builders import workspace

ORG = "acme"


def _count_reads(monkeypatch: pytest.MonkeyPatch, store: EventStore) -> list[str]:
    reads: list[str] = []
    real = store.read

    async def read(subject: str, after: int = 0, **floor: Any) -> Any:
        reads.append(subject)
        return await real(subject, after, **floor)

    monkeypatch.setattr(store, "read", read)
    return reads


def _claim(lease: str) -> R.ClaimPhase:
    return R.ClaimPhase(actor="ex", phase="plan", lease_id=lease, executor_id="ex")


async def test_a_run_this_app_wrote_last_is_commanded_without_a_read(
    nc: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = App(EventStore(nc))
    await workspace(app, "net")
    run_id = (await app.create_run(ORG, "net", "apply", "alice")).state.run_id
    await app.admit_next(ORG, "net")
    reads = _count_reads(monkeypatch, app.store)
    await app.run_command(ORG, "net", run_id, _claim("l1"))
    await app.run_command(ORG, "net", run_id, R.StartStep(actor="ex", lease_id="l1", step="init"))
    assert reads == []
    assert (await app.load_run(ORG, "net", run_id)).state.status == R.Status.PLANNING


async def test_a_run_moved_on_by_another_writer_is_reloaded_on_the_conflict(nc: Any) -> None:
    mine, other = App(EventStore(nc)), App(EventStore(nc))
    await workspace(mine, "net")
    run_id = (await mine.create_run(ORG, "net", "apply", "alice")).state.run_id
    await mine.admit_next(ORG, "net")
    await mine.run_command(ORG, "net", run_id, _claim("l1"))
    await other.run_command(ORG, "net", run_id, R.CancelRun(actor="bob"))  # a stop request
    # decided on what `mine` knows (no stop requested), the append conflicts, and the
    # command is decided again on the fresh run: the stop was requested already
    again = await mine.run_command(ORG, "net", run_id, R.CancelRun(actor="alice"))
    assert again.events == []
    assert again.state.stop_requested_by == "bob"
    events = [e.event for e in await mine.store.read(f"rp.run.{ORG}.net.{run_id}")]
    assert sum(isinstance(e, R.RunStopRequested) for e in events) == 1


async def test_a_refusal_on_what_this_app_knows_is_checked_on_a_fresh_load(nc: Any) -> None:
    """`mine` knows the run pending (it created it); another writer admitted it: the claim
    refused on the known state goes through on the fresh one."""
    mine, scheduler = App(EventStore(nc)), App(EventStore(nc))
    await workspace(mine, "net")
    run_id = (await mine.create_run(ORG, "net", "apply", "alice")).state.run_id
    assert await scheduler.admit_next(ORG, "net") == run_id
    claimed = await mine.run_command(ORG, "net", run_id, _claim("l1"))
    assert claimed.state.status == R.Status.PLANNING


async def test_a_refusal_that_holds_on_a_fresh_load_is_raised(nc: Any) -> None:
    mine, other = App(EventStore(nc)), App(EventStore(nc))
    await workspace(mine, "net")
    run_id = (await mine.create_run(ORG, "net", "apply", "alice")).state.run_id
    await mine.admit_next(ORG, "net")
    await other.run_command(ORG, "net", run_id, R.CancelRun(actor="bob"))  # canceled
    with pytest.raises(IllegalTransition):
        await mine.run_command(ORG, "net", run_id, _claim("l1"))


async def test_a_decision_of_nothing_on_what_this_app_knows_is_made_again_fresh(
    nc: Any,
) -> None:
    """`mine` knows the run planning with a stop requested; another writer's executor
    reported the stop (canceled). A second stop request decides nothing on the known
    state; on the fresh one it is refused: the run is canceled."""
    mine, other = App(EventStore(nc)), App(EventStore(nc))
    await workspace(mine, "net")
    run_id = (await mine.create_run(ORG, "net", "apply", "alice")).state.run_id
    await mine.admit_next(ORG, "net")
    await mine.run_command(ORG, "net", run_id, _claim("l1"))
    await mine.run_command(ORG, "net", run_id, R.CancelRun(actor="alice"))
    await other.run_command(ORG, "net", run_id, R.CancelRun(actor="ex", lease_id="l1"))
    with pytest.raises(IllegalTransition):
        await mine.run_command(ORG, "net", run_id, R.CancelRun(actor="alice"))
