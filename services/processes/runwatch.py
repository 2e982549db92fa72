"""One log line per run transition: what `runplane up` shows a person as runs move.

Follows the run subjects of RP_EVENTS from the stream's end (what happened before the
start is in the API), folds each event into the run's state with the core's `evolve` and
logs `run_transition` (org, workspace, run, the new status, and why a run failed) when
the status changes. Only open runs are kept, at most `MAX_RUNS` of them: a run first seen
mid-way is folded from that event on, which its status (each moving event carries it)
needs and nothing else. A reading failure logs a warning and reads on from where it was.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from types import TracebackType
from typing import Self

import msgspec
import structlog
from nats.aio.client import Client as NATS

from events import run as R
from infra.logs import TRANSITION
from infra.streams import EVENTS
from infra.tasks import cancel_and_wait
from projections.ordered import Delivered, OrderedReader

log = structlog.get_logger("runplane.runs")

MAX_RUNS = 10_000
_decoder: msgspec.json.Decoder[R.RunEvent] = msgspec.json.Decoder(R.RunEvent)


class RunWatch:
    """Log each run transition of `stream` while the context lasts."""

    def __init__(self, nc: NATS, *, stream: str = EVENTS) -> None:
        self.nc = nc
        self.stream = stream
        self.runs: OrderedDict[str, R.RunState] = OrderedDict()
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Self:
        info = await self.nc.jetstream().stream_info(self.stream)
        self._task = asyncio.create_task(self._run(info.state.last_seq + 1), name="runwatch")
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await cancel_and_wait(self._task)

    async def _run(self, start: int) -> None:
        while True:
            try:
                async with OrderedReader(
                    self.nc, self.stream, start_seq=start, filter_subject="rp.run.>"
                ) as reader:
                    while True:
                        for message in await reader.next_batch(500):
                            self.see(message)
                            start = message.seq + 1
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - a watcher for people never stops `up`
                log.warning("run_watch_restarting", error=repr(e))
                await asyncio.sleep(1.0)

    def see(self, message: Delivered) -> None:
        """Fold one stored run event; log the run's new status if it changed."""
        try:
            event = _decoder.decode(message.data)
        except msgspec.DecodeError:
            return  # a newer writer's event: the projector records it as skipped
        run_id = message.subject.rsplit(".", 1)[-1]
        before = self.runs.pop(run_id, R.INITIAL)
        try:
            after = R.evolve(before, event)
        except Exception:  # noqa: BLE001 - a run first seen mid-way may not fold: forget it
            return
        if after.status is not None and after.status != before.status:
            _log(run_id, message.subject, after)
        if not after.terminal:
            self.runs[run_id] = after
            while len(self.runs) > MAX_RUNS:
                self.runs.popitem(last=False)


def _log(run_id: str, subject: str, state: R.RunState) -> None:
    _, _, org, ws, _ = subject.split(".", 4)
    why = {"reason": state.reason, "error": state.error_message} if state.reason else {}
    log.info(TRANSITION, org=org, workspace=ws, run_id=run_id, status=str(state.status), **why)
