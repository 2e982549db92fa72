"""Whose turn it is: weighted round robin over the organizations with waiting phases.

Pure. An executor keeps one `Turns` and asks it, each time it has room for a phase, in
which order to look at the organizations whose phases wait in its pool (`order`), then
says which one it served (`served`). Each organization has a virtual clock that a served
phase advances by `1 / weight`; the earliest clock goes first (ties by name). An
organization that had nothing waiting comes back at the earliest clock of those waiting,
so it cannot save up turns while idle, and one that floods is served no more often than
its weight allows: with two organizations of weight 1 the executor alternates, whatever
the length of either queue. Within an organization phases go first in, first out (the
caller's part: the oldest message of its subject).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import msgspec


class Turns:
    """Weighted round robin state of one executor (see the module's docstring)."""

    def __init__(self, weights: Mapping[str, int] | None = None) -> None:
        self.weights = dict(weights or {})
        self._clock: dict[str, float] = {}

    def weight(self, org: str) -> int:
        return max(1, self.weights.get(org, 1))

    def order(self, waiting: Iterable[str]) -> list[str]:
        """The organizations with waiting phases, in the order to try them."""
        orgs = sorted(set(waiting))
        if not orgs:
            return []
        known = [self._clock[o] for o in orgs if o in self._clock]
        start = min(known) if known else 0.0
        for o in orgs:  # idle ones come back at the front, with no credit saved up
            self._clock[o] = max(self._clock.get(o, start), start)
        for o in [o for o in self._clock if o not in orgs]:
            del self._clock[o]  # forgotten while idle: bounded by the waiting ones
        return sorted(orgs, key=lambda o: (self._clock[o], o))

    def served(self, org: str) -> None:
        self._clock[org] = self._clock.get(org, 0.0) + 1.0 / self.weight(org)


# How long an organization counts as active here after it last had a phase waiting.
ACTIVE_FOR = 600.0


class Slots:
    """How many of an executor's slots each organization holds, and whether it may take
    one more. `max_phases` > 0: at most that many at once, always. 0 (the default): all
    of them while no other organization has been active here for ACTIVE_FOR seconds, and
    all but one while another has, so a flood leaves a slot for the next organization's
    phase instead of making it wait for one to end. An executor of one slot keeps none
    back: there the next organization waits for at most the phase in hand."""

    def __init__(self, concurrency: int = 1, max_phases: int = 0) -> None:
        self.concurrency = max(1, concurrency)
        self.max_phases = max(0, max_phases)
        self.running: dict[str, int] = {}
        self._seen: dict[str, float] = {}  # organization -> when it last had a phase waiting

    def saw(self, orgs: Iterable[str], now: float) -> None:
        for org in orgs:
            self._seen[org] = now
        for org in [o for o, t in self._seen.items() if now - t > ACTIVE_FOR]:
            del self._seen[org]

    def room(self, org: str, now: float) -> bool:
        held = self.running.get(org, 0)
        if self.max_phases:
            return held < self.max_phases
        others = any(o != org and now - t <= ACTIVE_FOR for o, t in self._seen.items())
        return held < (
            self.concurrency - 1 if others and self.concurrency > 1 else self.concurrency
        )

    def took(self, org: str) -> None:
        self.running[org] = self.running.get(org, 0) + 1

    def gave_back(self, org: str) -> None:
        left = self.running.get(org, 0) - 1
        if left > 0:
            self.running[org] = left
        else:
            self.running.pop(org, None)


def parse_weights(text: str) -> dict[str, int]:
    """`org=weight,...` (the `--org-weights` setting); ValueError on anything else."""
    weights: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        org, sep, value = part.partition("=")
        if not sep or not org.strip() or not value.strip().isdigit():
            raise ValueError(f"{part!r} is not org=weight")
        weight = int(value)
        if not 1 <= weight <= 1000:
            raise ValueError(f"{part!r}: a weight is from 1 to 1000")
        weights[org.strip()] = weight
    return weights


class Waiting(msgspec.Struct, frozen=True):
    """A pool's waiting phases by organization, as the stream's subjects count them."""

    counts: dict[str, int]

    @classmethod
    def of(cls, subjects: Mapping[str, int], prefix: str) -> Waiting:
        """From a stream's subject counts: `<prefix>.<org>` is that organization's, and
        `<prefix>` alone (a dispatch of a version before fair share) counts as org ""."""
        counts: dict[str, int] = {}
        for subject, n in subjects.items():
            if subject == prefix:
                counts[""] = counts.get("", 0) + n
            elif subject.startswith(prefix + ".") and n > 0:
                org = subject[len(prefix) + 1 :]
                if "." not in org:
                    counts[org] = counts.get(org, 0) + n
        return cls(counts)
