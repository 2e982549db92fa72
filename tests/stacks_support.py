"""Helpers for the stack tests (tests/test_stacks.py, tests/test_stack_runs_api.py):
the stack of four, and an event store that lines up concurrent deciders. Holds no
tests itself."""

from __future__ import annotations

import asyncio
from typing import Any

from infra.eventstore import Envelope, EventStore
from tests.api_support import Http

# A diamond: a first; b and c on a; d on b and c (issue 27's stack of four)
DIAMOND: dict[str, Any] = {
    "name": "prod",
    "workspaces": ["a", "b", "c", "d"],
    "edges": [
        {"source": "a", "target": "b"},
        {"source": "a", "target": "c"},
        {"source": "b", "target": "d"},
        {"source": "c", "target": "d"},
    ],
}


class Gate(EventStore):
    """An event store whose first read of a subject holding `part` in each of `parties`
    tasks waits for the others' (so each decides on the same state), once."""

    def __init__(self, nc: Any, parties: int, part: str) -> None:
        super().__init__(nc)
        self.barrier = asyncio.Barrier(parties)
        self.part = part
        self.waited: set[int] = set()

    async def read(self, subject: str, after: int = 0, *, min_seq: int = 0) -> list[Envelope]:
        envs = await super().read(subject, after, min_seq=min_seq)
        task = id(asyncio.current_task())
        if self.part in subject and task not in self.waited:
            self.waited.add(task)
            await asyncio.wait_for(self.barrier.wait(), 10)
        return envs


async def diamond_stack(http: Http, org: str) -> dict[str, str]:
    """Organization `org` with workspaces a, b, c and d and the stack `prod` of DIAMOND
    (made by its admin): the organization's tokens."""
    tokens = await http.org(org)
    for ws in ("a", "b", "c", "d"):
        await http.workspace(org, ws)
    made = await http.post(f"/api/v1/orgs/{org}/stacks", json=DIAMOND, token=tokens["admin"])
    assert made.status == 201, made.body
    return tokens
