"""A create's answer carries its last write's sequence (read-your-writes)."""

from __future__ import annotations

from events.codec import run_subject, ws_subject
from events.run import Workspace
from services.app.commands import App


async def test_a_create_answers_with_the_sequence_of_its_enqueue(app: App) -> None:
    """A run is created (`run.created`), then enqueued on its workspace
    (`ws.run_enqueued`, a later append): the answer's sequence is the enqueue's, so a
    read at or past it shows the run on its workspace's queue (the UI's workspace page
    right after a start once did not: it read at the create's sequence)."""
    await app.create_org("acme", "t")
    await app.create_workspace("acme", "net", Workspace(repository="/repo"), "t")
    done = await app.create_run("acme", "net", "plan", "t")
    created, _ = await app.store.last(run_subject("acme", "net", done.state.run_id))
    enqueued = await app.store.last_seq_of(ws_subject("acme", "net"))
    assert created < enqueued == done.seq


async def test_a_speculative_plan_answers_with_its_own_sequence(app: App) -> None:
    """A speculative plan is never enqueued: its answer is its `run.created`'s."""
    await app.create_org("acme", "t")
    await app.create_workspace("acme", "net", Workspace(repository="/repo"), "t")
    done = await app.create_run("acme", "net", "plan", "t", speculative=True)
    created, _ = await app.store.last(run_subject("acme", "net", done.state.run_id))
    assert done.seq == created
