"""A read cancelled part way (a browser that goes, a request that times out) leaves the
shared read connection as it found it: no transaction left open, every later read fresh."""

from __future__ import annotations

import asyncio
from pathlib import Path

from projections import schema
from projections.readmodel import ReadModel


async def test_a_read_cancelled_at_any_await_leaves_no_transaction_open(tmp_path: Path) -> None:
    path = tmp_path / "read.db"
    writer = await schema.connect(path)
    read = await ReadModel.open(path)
    try:
        for round_ in range(300):
            spins = round_ // 2 % 6  # cancel at the lock, at BEGIN, within, at COMMIT, after
            # a snapshot read (two tables, one transaction) and a plain one
            read_of = read.list_workspaces("acme") if round_ % 2 else read.get_org("o0")
            task = asyncio.create_task(read_of)
            for _ in range(spins):
                await asyncio.sleep(0)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            name = f"o{round_}"
            await writer.execute(
                "INSERT INTO orgs (name, created_at, created_by) VALUES (?, '', 'a')", (name,)
            )
            # A read transaction left open would pin this connection to an older snapshot
            # (the new org unseen) and refuse the next BEGIN.
            assert await read.get_org(name) is not None, f"round {round_}: a stale read"
            assert await read.list_workspaces("acme") == []
            assert not read.db.in_transaction, f"round {round_}: a transaction left open"
    finally:
        await read.close()
        await writer.close()
