"""Queries over the read model, answering plain dicts ready for JSON.

A `ReadModel` is a `Reader` (projections/reader.py: its own read-only connection, and
the lock that keeps each caller's read transaction its own) with its queries grouped by
what they ask about, each group sharing that connection:

- `orgs`: an organization, and its API tokens (projections/read_orgs.py);
- `workspaces`: one with its queue, a list, state versions, schedule fires
  (projections/read_workspaces.py);
- `runs`: one, a page, a run's events, steps, changes and resources, the runs the UI's
  pages show (projections/read_runs.py);
- `integrations`: notifications, VCS connections and bindings, Slack
  (projections/read_integrations.py).
"""

from __future__ import annotations

from typing import Any

import aiosqlite

from projections.read_integrations import Integrations
from projections.read_orgs import Orgs
from projections.read_runs import Runs
from projections.read_workspaces import Workspaces
from projections.reader import Reader
from projections.schema import TABLES


class ReadModel(Reader):
    """Read-only queries of one read-model database."""

    def __init__(self, db: aiosqlite.Connection) -> None:
        super().__init__(db)
        self.orgs = Orgs(self)
        self.workspaces = Workspaces(self)
        self.runs = Runs(self)
        self.integrations = Integrations(self)

    async def dump(self) -> dict[str, list[tuple[Any, ...]]]:
        """Every table's rows sorted by primary key: two equal dumps are equal read models."""
        async with self.snapshot():
            return {t.name: [tuple(r) for r in await self.rows(t.select_sorted)] for t in TABLES}
