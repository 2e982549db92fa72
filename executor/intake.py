"""Taking work: a pool's dispatch messages, fetched one at a time, and the claim of each.

The claim (`ClaimPhase`, an optimistic append on the run) decides who runs a phase; the
message is acked once the claim is decided either way (executor/worker.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import nats.errors
import structlog
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from events.errors import DomainError
from events.run import ClaimPhase, FailRun, RunState
from events.wire import Dispatch
from executor.job import Job
from executor.ports import RunLedger
from infra.ids import new_id
from infra.streams import DISPATCH, ensure_executor_consumer, executor_consumer

log = structlog.get_logger(__name__)

# A claimed phase's Job: its directory and identity (the executor's `_job`).
StartJob = Callable[[Dispatch, str, RunState], Job]


class Intake:
    """The dispatched phases of one pool, taken one at a time: fetched from the pool's
    consumer (`open()` binds it) and claimed under a fresh lease. Once `stopping` is set,
    nothing more is taken."""

    def __init__(
        self,
        js: JetStreamContext,
        app: RunLedger,
        pool: str,
        executor_id: str,
        stopping: asyncio.Event,
        *,
        fetch_timeout: float,
    ) -> None:
        self.js = js
        self.app = app
        self.pool = pool
        self.executor_id = executor_id
        self._stopping = stopping
        self.fetch_timeout = fetch_timeout
        self._sub: JetStreamContext.PullSubscription | None = None

    async def open(self) -> None:
        """Bind the pool's shared pull consumer (`infra.streams`), added first."""
        await ensure_executor_consumer(self.js, self.pool)
        self._sub = await self.js.pull_subscribe_bind(
            durable=executor_consumer(self.pool), stream=DISPATCH
        )

    async def close(self) -> None:
        """Unbind it (nothing if it was never bound)."""
        if self._sub is not None:
            await self._sub.unsubscribe()
            self._sub = None

    async def next(self) -> Msg | None:
        """One dispatch message, or None when there was none (or we are stopping)."""
        if self._stopping.is_set():
            return None
        assert self._sub is not None
        try:
            msgs = await self._sub.fetch(1, timeout=self.fetch_timeout)
        except nats.errors.TimeoutError:
            return None
        except Exception as e:  # keep taking work through broker hiccups
            log.warning("fetch_failed", error=repr(e))
            await asyncio.sleep(1)
            return None
        if self._stopping.is_set():
            for m in msgs:  # hand it straight to another executor
                await m.nak()
            return None
        return msgs[0] if msgs else None

    async def claim(self, msg: Msg, d: Dispatch, start: StartJob) -> Job | None:
        """Claim the phase under a fresh lease; ack the message whatever the claim decided.
        `start` makes the claimed phase's Job."""
        lease_id = new_id()
        claim = ClaimPhase(
            actor=f"executor:{self.executor_id}",
            phase=d.phase,
            lease_id=lease_id,
            executor_id=self.executor_id,
        )
        try:
            result = await self.app.run_command(d.org, d.workspace, d.run_id, claim)
        except DomainError as e:
            if e.retryable:
                await msg.nak(delay=1)
                return None
            log.info("dispatch_dropped", why=e.code, detail=str(e))
            await msg.ack()
            return None
        except Exception as e:
            log.warning("claim_failed_will_retry", error=repr(e))
            await msg.nak(delay=2)
            return None
        await _ack(msg)  # the claim is ours even if this ack is lost: run the phase
        log.info("phase_claimed", lease_id=lease_id)
        try:
            return start(d, lease_id, result.state)
        except Exception as e:  # no directory or identity for it: the claimed run fails now
            log.exception("phase_not_started", lease_id=lease_id)
            cmd = FailRun(
                actor=claim.actor,
                lease_id=lease_id,
                reason="executor_unavailable",
                message=f"executor {self.executor_id} could not start the phase: {e}",
            )
            try:
                await self.app.run_command(d.org, d.workspace, d.run_id, cmd)
            except Exception:
                log.exception("phase_failure_not_reported")
            return None


async def _ack(msg: Msg) -> None:
    try:
        await msg.ack()
    except Exception as e:  # redelivery is harmless: a second claim is refused
        log.warning("ack_failed", error=repr(e))
