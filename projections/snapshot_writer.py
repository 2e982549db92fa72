"""The api replica's snapshot loop: every `--snapshot-interval` seconds, a snapshot of its
read model into `rp-snapshots` (projections/snapshots.py) unless it is not caught up yet,
or another replica wrote one recently (newest wins by sequence; two at once are harmless:
their objects have different names)."""

from __future__ import annotations

import asyncio
import random
from datetime import UTC, datetime
from types import TracebackType
from typing import Self

import structlog

from infra.tasks import cancel_and_wait
from projections.projector import Projector
from projections.snapshots import Manifest, Snapshots

log = structlog.get_logger(__name__)


class SnapshotWriter:
    """Writes snapshots of `projector`'s read model while the context lasts."""

    def __init__(
        self, snapshots: Snapshots, projector: Projector, *, interval: float, writer: str
    ) -> None:
        self.snapshots = snapshots
        self.projector = projector
        self.interval = interval
        self.writer = writer
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Self:
        if self.interval > 0:
            self._task = asyncio.create_task(self._loop(), name="snapshot-writer")
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await cancel_and_wait(self._task)

    async def _loop(self) -> None:
        while True:
            # Jittered, so replicas started together do not all copy at the same moment.
            await asyncio.sleep(self.interval * random.uniform(0.8, 1.2))
            try:
                await self.write_once()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - the next interval tries again
                log.warning("snapshot_failed", error=repr(e))

    async def write_once(self, *, force: bool = False) -> Manifest | None:
        """A snapshot now, unless this replica has not caught up with the stream as of
        its start, or (without `force`) another was written within half an interval."""
        p = self.projector
        if p.start_target is None or p.seq < p.start_target:
            return None
        if not force and await self._recent():
            return None
        return await self.snapshots.write(p.db_path, self.writer)

    async def _recent(self) -> bool:
        # Only a snapshot whose manifest opens: an object anyone with NATS access put
        # under the prefix again and again would otherwise stop every writer.
        newest = await self.snapshots.sealed()
        if not newest or not newest[0][0].mtime:
            return False
        age = datetime.now(UTC) - datetime.fromisoformat(newest[0][0].mtime)
        return age.total_seconds() < self.interval / 2
