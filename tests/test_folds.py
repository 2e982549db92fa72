"""infra/folds.py: one repository of aggregates as folded, shared by a process's writers and
its consumers. A load folds only what is new; a consumer folds through its event (not
later) from the nearest state kept; a conflict forgets the subject."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import pytest

from events import org as O
from events.errors import Conflict
from infra.eventstore import Append, EventStore
from infra.folds import States
from services.app.execute import Repository

NOW = datetime(2026, 1, 1, tzinfo=UTC)
SUBJECT = "rp.org.acme"


class Counting:
    """`events.org.fold`, counting the events it is given."""

    def __init__(self) -> None:
        self.folded = 0

    def __call__(self, events: Sequence[Any], state: O.OrgState) -> O.OrgState:
        self.folded += len(events)
        return O.fold(events, state)


def _token(k: int) -> O.TokenIssued:
    return O.TokenIssued(
        at=NOW, actor="a", token_id=f"t{k}", token_hash="h", user="u", role="admin"
    )


async def _seed(store: EventStore, tokens: int) -> list[int]:
    """An organization and `tokens` tokens on SUBJECT: their sequences."""
    seqs = [
        await store.append(
            [
                Append(
                    subject=SUBJECT, event=O.OrgCreated(at=NOW, actor="a", name="acme"), expected=0
                )
            ]
        )
    ]
    for k in range(tokens):
        seqs.append(
            await store.append([Append(subject=SUBJECT, event=_token(k), expected=seqs[-1])])
        )
    return seqs


async def test_a_load_folds_only_the_events_after_the_state_it_kept(store: EventStore) -> None:
    seqs = await _seed(store, 3)
    states, fold = States(store), Counting()
    real, seq, state = await states.load("org", SUBJECT, fold, O.INITIAL)
    assert (real, seq, len(state.tokens), fold.folded) == (SUBJECT, seqs[-1], 3, 4)
    more = await store.append([Append(subject=SUBJECT, event=_token(9), expected=seqs[-1])])
    _, seq, state = await states.load("org", SUBJECT, fold, O.INITIAL)
    assert (seq, len(state.tokens), fold.folded) == (more, 4, 5)  # one more event folded
    assert states.peek("org", SUBJECT) == (SUBJECT, more, state)


async def test_through_folds_up_to_the_event_from_the_nearest_state_kept(
    store: EventStore,
) -> None:
    seqs = await _seed(store, 5)
    states, fold = States(store), Counting()
    await states.load("org", SUBJECT, fold, O.INITIAL)  # kept: the newest (5 tokens)
    at, last = await states.through("org", SUBJECT, seqs[2], fold, O.INITIAL)
    assert (len(at.tokens), last) == (2, seqs[-1])  # not later than the event
    assert fold.folded == 6 + 6  # nothing kept at or before it: from scratch
    fold.folded = 0
    at, last = await states.through("org", SUBJECT, seqs[3], fold, O.INITIAL)
    assert (len(at.tokens), last) == (3, seqs[-1])
    assert fold.folded == 1 + 2  # on from the state at seqs[2]; then on to the newest


async def test_kinds_of_one_subject_are_kept_apart(store: EventStore) -> None:
    await _seed(store, 2)
    states = States(store)
    await states.load("org", SUBJECT, O.fold, O.INITIAL)
    _, _, count = await states.load("count", SUBJECT, lambda evs, n: n + len(evs), 0)
    assert count == 3
    found = states.peek("org", SUBJECT)
    assert found is not None and isinstance(found[2], O.OrgState)


async def test_only_a_few_states_are_kept_per_subject_and_a_few_subjects(
    store: EventStore,
) -> None:
    states = States(store, kept=2, trail=2)
    for seq in (3, 1, 2):
        states.remember("org", "rp.org.a", seq, seq)
    assert states.peek("org", "rp.org.a") == ("rp.org.a", 3, 3)
    assert [s for s, _ in states._kept[("org", "rp.org.a")][1]] == [2, 3]
    states.remember("org", "rp.org.b", 1, 1)
    states.remember("org", "rp.org.c", 1, 1)
    assert states.peek("org", "rp.org.a") is None  # the least recently used went
    states.remember("org", "rp.org.>", 1, 1)  # a wildcard over many: never kept
    assert states.peek("org", "rp.org.>") is None


async def test_a_state_evicted_while_its_load_reads_is_not_an_error(store: EventStore) -> None:
    """1,000 loads at once (tests/reliability/test_concurrency.py) evict a kept state
    while another load of it waits on its read: that load answers as if nothing was
    kept, never a KeyError."""
    seqs = await _seed(store, 1)
    states = States(store, kept=1)
    await states.load("org", SUBJECT, O.fold, O.INITIAL)
    read = store.read

    async def evicting(*args: Any, **kw: Any) -> Any:
        states.remember("org", "rp.org.other", 1, O.INITIAL)  # the only room taken
        return await read(*args, **kw)

    store.read = evicting  # type: ignore[method-assign]
    _, seq, state = await states.load("org", SUBJECT, O.fold, O.INITIAL)
    assert (seq, len(state.tokens)) == (seqs[-1], 1)


async def test_a_conflict_on_a_write_forgets_the_subject(nc: Any, store: EventStore) -> None:
    seqs = await _seed(store, 1)
    repo = Repository(store, clock=lambda: NOW, ids=lambda: "x")
    await repo.states.load("org", SUBJECT, O.fold, O.INITIAL)
    with pytest.raises(Conflict):  # expects a sequence the subject is past
        await repo.append([Append(subject=SUBJECT, event=_token(7), expected=seqs[0])])
    assert repo.states.peek("org", SUBJECT) is None
