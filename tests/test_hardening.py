"""Hardening: the event store on a real JetStream (atomic batches, retries that landed), what
child processes inherit, and masking of multi-line secrets."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from events.errors import Conflict
from events.workspace import RunEnqueued
from infra.childenv import child_env, git_env
from infra.eventstore import Append, EventStore

AT = datetime(2026, 1, 1, tzinfo=UTC)


def _enqueue(subject: str, expected: int, run: str, msg_id: str) -> Append:
    event = RunEnqueued(at=AT, actor="t", run_id=run)
    return Append(subject=subject, event=event, expected=expected, msg_id=msg_id)


async def test_a_batch_lands_whole_or_not_at_all(store: EventStore) -> None:
    seq = await store.append(
        [_enqueue("rp.ws.a.x", 0, "r1", "m1"), _enqueue("rp.ws.a.y", 0, "r1", "m2")]
    )
    assert seq == 2
    with pytest.raises(Conflict):  # the second item's expectation is wrong: nothing lands
        await store.append(
            [_enqueue("rp.ws.a.x", 1, "r2", "m3"), _enqueue("rp.ws.a.y", 0, "r2", "m4")]
        )
    assert [e.msg_id for e in await store.read("rp.ws.a.>")] == ["m1", "m2"]


async def test_a_retried_append_whose_first_try_landed_is_not_a_conflict_even_after_others_wrote(
    store: EventStore,
) -> None:
    batch = [_enqueue("rp.ws.a.run", 0, "r1", "first"), _enqueue("rp.ws.a.ws", 0, "r1", "second")]
    landed = await store.append(batch)
    # Someone moves the batch's last subject on before the retry (the scheduler does).
    await store.append([_enqueue("rp.ws.a.ws", landed, "r2", "other")])
    assert await store.append(batch) == landed, "the retry finds its own first try"


async def test_a_real_conflict_is_still_a_conflict(store: EventStore) -> None:
    await store.append([_enqueue("rp.ws.a.x", 0, "r1", "m1")])
    with pytest.raises(Conflict):
        await store.append([_enqueue("rp.ws.a.x", 0, "r2", "m2")])


async def test_a_batch_may_hold_two_events_of_one_subject(store: EventStore) -> None:
    """A plan that fails a hard-mandatory policy appends run.plan_finished and run.failed
    (and the workspace's release) at once: only a subject's first event carries the
    expectation, which still guards the subject."""
    await store.append([_enqueue("rp.ws.a.x", 0, "r1", "m1")])
    await store.append([_enqueue("rp.ws.a.other", 0, "r1", "m2")])  # the stream moves on
    two = [_enqueue("rp.ws.a.x", 1, "r1", "m3"), _enqueue("rp.ws.a.x", 2, "r1", "m4")]
    assert await store.append([*two, _enqueue("rp.ws.a.y", 0, "r1", "m5")]) == 5
    assert [e.msg_id for e in await store.read("rp.ws.a.x")] == ["m1", "m3", "m4"]
    with pytest.raises(Conflict):  # a stale first expectation refuses the whole batch
        await store.append(
            [_enqueue("rp.ws.a.x", 1, "r2", "m6"), _enqueue("rp.ws.a.x", 0, "r2", "m7")]
        )
    assert await store.append(two) == 4, "a retry that landed is still recognised"


def test_children_never_inherit_runplanes_own_secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RUNPLANE_ADMIN_TOKEN", "adm")
    monkeypatch.setenv("RUNPLANE_ENCRYPTION_KEY", "key")
    monkeypatch.setenv("NATS_CREDS", "creds")
    monkeypatch.setenv("AWS_PROFILE", "prod")
    for env in (child_env(), git_env()):
        assert not [k for k in env if k.startswith(("RUNPLANE_", "NATS_"))]
        assert env["AWS_PROFILE"] == "prod", "providers still find the host's credentials"
    assert git_env()["GIT_TERMINAL_PROMPT"] == "0"


def test_every_line_of_a_multi_line_secret_is_masked() -> None:
    from executor.output import Masker

    pem = "\n".join(
        [
            "-----BEGIN KEY-----",
            "MIIEvQIBADANBgkqhkiG9w0BAQEFAASC",
            "BKcwggSjAgEAAoIBAQC7",
            "-----END KEY-----",
        ]
    )
    mask = Masker([pem])
    assert "MIIEvQ" not in mask("key line: MIIEvQIBADANBgkqhkiG9w0BAQEFAASC")
    assert "BKcwgg" not in mask('{"@message":"out: BKcwggSjAgEAAoIBAQC7"}')
    assert mask("}") == "}", "short common lines are left alone"
