"""A read cancelled part way (a browser that goes, a request that times out) leaves the
shared read connection as it found it: no transaction left open, every later read fresh."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime
from pathlib import Path

from events.codec import encode, org_subject
from events.org import OrgCreated
from projections import schema
from projections.batch import apply_batch
from projections.ordered import Delivered
from projections.readmodel import ReadModel


async def test_a_read_cancelled_at_any_await_leaves_no_transaction_open(tmp_path: Path) -> None:
    path = tmp_path / "read.db"
    writer = await schema.connect(path)
    read = await ReadModel.open(path)
    try:
        for round_ in range(400):
            # a snapshot read (two tables, one transaction) and a plain one
            read_of = read.workspaces.find("acme") if round_ % 2 else read.orgs.get("o0")
            task = asyncio.create_task(read_of)
            if round_ < 200:  # at the lock, at BEGIN, within, at COMMIT, after: by turns
                for _ in range(round_ // 2 % 6):
                    await asyncio.sleep(0)
            else:  # once the connection's thread has answered some of it
                await asyncio.sleep(0.0002 * (round_ % 10))
            task.cancel()
            if round_ % 3 == 0:  # and again, in its COMMIT or its way out
                await asyncio.sleep(0)
                task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            name = f"o{round_}"
            await writer.execute(
                "INSERT INTO orgs (name, created_at, created_by) VALUES (?, '', 'a')", (name,)
            )
            # A read transaction left open would pin this connection to an older snapshot
            # (the new org unseen) and refuse the next BEGIN.
            assert await read.orgs.get(name) is not None, f"round {round_}: a stale read"
            assert await read.workspaces.find("acme") == []
            assert not read.db.in_transaction, f"round {round_}: a transaction left open"
    finally:
        await read.close()
        await writer.close()


async def test_a_batch_cancelled_at_any_await_leaves_the_writer_free(tmp_path: Path) -> None:
    """The projector's writer, cancelled (a process stopping, a projector restarted) at
    any await of a batch, commits nothing half and takes the next batch."""
    path = tmp_path / "read.db"
    writer = await schema.connect(path)
    read = await ReadModel.open(path)
    now = datetime.now(UTC)

    def created(seq: int) -> Delivered:
        event = OrgCreated(name=f"o{seq}", at=now, actor="admin")
        return Delivered(seq, org_subject(f"o{seq}"), encode(event), time.time_ns())

    try:
        seq = 0
        for round_ in range(120):
            seq += 1
            task = asyncio.create_task(apply_batch(writer, [created(seq)], after=seq - 1))
            for _ in range(round_ % 8):
                await asyncio.sleep(0)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            at = await schema.checkpoint(writer)
            assert at in (seq - 1, seq), f"round {round_}"
            # all or nothing: the org is there if and only if the checkpoint moved
            assert (await read.orgs.get(f"o{seq}") is not None) == (at == seq), f"round {round_}"
            assert not writer.in_transaction, f"round {round_}: the writer's BEGIN left open"
            seq += 1
            after = await apply_batch(writer, [created(seq)], after=at)
            assert after.last_seq == seq and await read.orgs.get(f"o{seq}") is not None
    finally:
        await read.close()
        await writer.close()


async def test_a_read_waits_for_another_callers_snapshot(tmp_path: Path) -> None:
    """A query never runs inside another caller's read transaction: it would answer from
    that snapshot, older than what the caller waited for (RP-Min-Seq)."""
    path = tmp_path / "read.db"
    writer = await schema.connect(path)
    read = await ReadModel.open(path)
    try:
        async with read.snapshot():  # another caller's two-table read, under way
            assert await read.orgs.get("late") is None  # its snapshot begins here
            await writer.execute(
                "INSERT INTO orgs (name, created_at, created_by) VALUES ('late', '', 'a')"
            )
            fresh = asyncio.create_task(read.orgs.get("late"))  # asked after the commit
            await asyncio.sleep(0.05)
        assert await fresh is not None
    finally:
        await read.close()
        await writer.close()
