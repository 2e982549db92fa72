"""Given / when / then for the pure core: given past events, when a command, then new
events or a domain error. Synchronous, no I/O.

    given(RUN, created, queued).when(ClaimPhase(...)).then(PhaseStarted(...))
    given(RUN, created).when(ApproveRun(...)).then_error(IllegalTransition)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Generic, TypeVar

from events.errors import DomainError

S = TypeVar("S")
X = TypeVar("X", bound=DomainError)

NOW = datetime(2025, 1, 2, 3, 4, 5, tzinfo=UTC)


class Ids:
    """A deterministic `new_id`: prefix-0001, prefix-0002, ..."""

    def __init__(self, prefix: str = "id") -> None:
        self.prefix = prefix
        self.count = 0

    def __call__(self) -> str:
        self.count += 1
        return f"{self.prefix}-{self.count:04d}"


@dataclass(frozen=True)
class Aggregate(Generic[S]):
    """The pure pieces of one aggregate module."""

    initial: S
    decide: Callable[..., list[Any]]
    evolve: Callable[[S, Any], S]

    def fold(self, events: Sequence[Any], state: S | None = None) -> S:
        s = self.initial if state is None else state
        for e in events:
            s = self.evolve(s, e)
        return s


@dataclass(frozen=True)
class Given(Generic[S]):
    aggregate: Aggregate[S]
    history: tuple[Any, ...]

    @property
    def state(self) -> S:
        return self.aggregate.fold(self.history)

    def when(
        self, command: Any, *, now: datetime = NOW, new_id: Callable[[], str] | None = None
    ) -> Outcome[S]:
        """Decide `command` against the folded history; capture events or a domain error."""
        state = self.state
        try:
            events = self.aggregate.decide(state, command, now=now, new_id=new_id or Ids())
        except DomainError as e:
            return Outcome(self.aggregate, state, None, e)
        return Outcome(self.aggregate, state, events, None)


@dataclass(frozen=True)
class Outcome(Generic[S]):
    aggregate: Aggregate[S]
    before: S
    events: list[Any] | None
    error: DomainError | None

    def then(self, *expected: Any) -> S:
        """Assert exactly `expected` was decided; return the state after folding it."""
        assert self.error is None, f"expected events, got {self.error!r}"
        assert self.events == list(expected)
        return self.aggregate.fold(self.events, self.before)

    def then_nothing(self) -> S:
        """Assert the command decided no events (and raised nothing)."""
        return self.then()

    def then_error(self, kind: type[X]) -> X:
        """Assert the command was refused with `kind`; return the error for more checks."""
        assert self.events is None, f"expected {kind.__name__}, got events {self.events!r}"
        assert isinstance(self.error, kind), f"expected {kind.__name__}, got {self.error!r}"
        return self.error


def given(aggregate: Aggregate[S], *history: Any) -> Given[S]:
    return Given(aggregate, tuple(history))
