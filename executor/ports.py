"""The ports the executor reaches the rest of runplane through.

The executor reaches the application layer only through ports the root injects
(ARCHITECTURE.md, "Layers"): what it needs of that layer is named here, and the
composition root (services/root/processes.py, and every test harness) passes the real
things, which fit these shapes structurally:

- `RunReader` and `RunWriter` (together `RunLedger`): the runs and their events, read
  and commanded; `services.app.commands.App` is one.
- `RepositoryRules`: which repositories a phase may check out, and with whose git
  credentials;
  `services.app.repositories.Sources` is one. It refuses with
  `events.errors.RepositoryRefused`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import datetime
from pathlib import Path
from typing import Protocol

from nats.aio.client import Client as NATS

from events.run import RunCommand, RunState
from infra.eventstore import Envelope


class RunRecord(Protocol):
    """A run as loaded, or as a command left it."""

    @property
    def state(self) -> RunState: ...


class EventLog(Protocol):
    """The event stream as the executor reads it (an `infra.eventstore.EventStore`)."""

    @property
    def nc(self) -> NATS:
        """The connection the reports go through; the live step logs share it."""
        ...

    async def read(self, subject: str, after: int = 0, *, min_seq: int = 0) -> list[Envelope]:
        """Every event on `subject` above `after`, as of a stream at least at `min_seq`."""
        ...


class RunReader(Protocol):
    """Runs and their events, read."""

    @property
    def store(self) -> EventLog: ...

    async def load_run(self, org: str, ws: str | None, run: str, *, min_seq: int = 0) -> RunRecord:
        """A run; with `ws` None its subject is found by wildcard. `min_seq`: the stream
        sequence the read must be at least as new as (`infra.eventstore.LATEST`: the
        leader's)."""
        ...


class RunWriter(Protocol):
    """Runs, commanded: the claim, the step reports, the failures."""

    def clock(self) -> datetime:
        """Now, as the writer stamps its events."""
        ...

    def run_command(
        self,
        org: str,
        ws: str | None,
        run_id: str,
        command: RunCommand,
        *,
        guard: Callable[[RunState], None] | None = None,
        release: bool = True,
    ) -> Awaitable[RunRecord]:
        """Decide `command` on the run and append what it decided; a DomainError if it is
        refused (`StaleLease` once the command's lease is not current). `guard` sees the
        state it is decided on and may refuse it too. `release`: a run the command ends
        gives its workspace back now (False: the scheduler does, on the run's end)."""
        ...


class RunLedger(RunReader, RunWriter, Protocol):
    """Runs read and commanded: what a phase and a restart need."""


class RepositoryRules(Protocol):
    """Which repositories a phase may check out."""

    def guarding(self, path: Path, what: str) -> RepositoryRules:
        """These rules, also refusing anything inside `path` (`what` names it)."""
        ...

    def check(self, repository: str, *, org: str) -> str:
        """What git is given for `repository` (a local path: resolved, and safe to read
        as resolved); `events.errors.RepositoryRefused` unless it is allowed for a
        workspace of `org`."""
        ...

    def host_credentials(self, org: str) -> bool:
        """Whether `org`'s checkouts may use the executor host's git credentials."""
        ...
