"""Bodies nobody has proven yet: read few at a time, bounded, and hashed as they arrive.

The webhook routes (GitHub's and GitLab's deliveries, services/surfaces/webhooks/vcs.py;
Slack's calls, slack.py) take requests from anyone, so what such a request may cost is
fixed before a byte of its body is read:

- whatever can be refused from its path and headers is refused first (an unknown
  connection, a signature header that is not one, a Slack timestamp out of its window):
  no body is read at all;
- a body is read only inside one of `concurrent` slots per route family and process;
  a request that finds them all taken is answered 503 with Retry-After at once, its body
  unread (`slot`);
- at most `max_body` bytes of it: a Content-Length over that is 413 before reading, a
  body that passes it as it streams (chunked) is 413 as soon as it does (`read`);
- within `deadline_s`: a body trickled slower keeps no slot longer (408);
- each chunk goes to the signature's HMAC as it arrives (`read`'s `sink`), so the check
  is done when the last byte is, and a mismatch drops the bytes.

An unverified body held in memory is so at most `concurrent` x `max_body` per family and
process (16 MiB for the VCS deliveries with the defaults). A refusal that leaves the body
unread says `Connection: close` (`closes_unread`): the connection is not kept for another
request, and what its client still sends is discarded by aiohttp for a bounded lingering
time (never buffered), so that the client reads its answer rather than a reset.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field

import structlog
from aiohttp import web

from infra.options import WEBHOOK_CONCURRENCY, WEBHOOK_MAX_BODY
from services.surfaces.api.problems import Problem

log = structlog.get_logger(__name__)

MAX_BODY = WEBHOOK_MAX_BODY  # 1 MiB; a real push or pull request is a few KiB to a few hundred
CONCURRENT = WEBHOOK_CONCURRENCY  # 16 unproven bodies read at once, per route family and process
DEADLINE_S = 10.0  # GitHub itself gives up on a delivery after 10 s
RETRY_AFTER_S = 1


@dataclass(frozen=True)
class Limits:
    """What an unproven request may cost (the deployment's `--webhook-max-body` and
    `--webhook-concurrency`, infra/options.py)."""

    max_body: int = MAX_BODY
    concurrent: int = CONCURRENT
    deadline_s: float = DEADLINE_S


@dataclass
class Intake:
    """The process's limits and, per route family ("vcs", "slack"), its slots: one
    family's callers never take another's (Slack's routes need no id to be called)."""

    limits: Limits = field(default_factory=Limits)
    _busy: dict[str, int] = field(default_factory=dict)

    def in_flight(self, family: str) -> int:
        """How many of the family's bodies are being read and checked now."""
        return self._busy.get(family, 0)

    @contextlib.contextmanager
    def slot(self, family: str) -> Iterator[None]:
        """One of the family's slots, or 503 at once: never a wait, since a queue of
        unread bodies would cost the same memory, only later."""
        busy = self._busy.get(family, 0)
        if busy >= self.limits.concurrent:
            log.warning("webhook_bodies_busy", family=family, limit=self.limits.concurrent)
            raise Problem(
                "unavailable",
                f"{busy} webhook bodies are being read; deliver again shortly",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        self._busy[family] = busy + 1
        try:
            yield
        finally:
            self._busy[family] -= 1

    async def read(
        self,
        request: web.Request,
        *,
        cap: int | None = None,
        sink: Callable[[bytes], object] | None = None,
    ) -> bytes:
        """The body, at most `cap` bytes (default `max_body`), each chunk given to `sink`
        as it arrives; 413 before reading when the declared length is over the cap, or
        as soon as the bytes pass it; 408 when it takes longer than the deadline."""
        cap = self.limits.max_body if cap is None else cap
        if (request.content_length or 0) > cap:
            raise too_large(cap)
        chunks: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(self.limits.deadline_s):
                async for chunk in request.content.iter_any():
                    size += len(chunk)
                    if size > cap:
                        raise too_large(cap)
                    if sink is not None:
                        sink(chunk)
                    chunks.append(chunk)
        except TimeoutError as e:
            raise Problem(
                "request-timeout", f"the body did not arrive within {self.limits.deadline_s} s"
            ) from e
        return b"".join(chunks)


def too_large(cap: int) -> Problem:
    return Problem("body-too-large", f"a webhook body is at most {cap} bytes")


INTAKE: web.AppKey[Intake] = web.AppKey("runplane.webhook_intake", Intake)


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def closes_unread(handler: Handler) -> Handler:
    """`handler`, whose refusals (a Problem) that leave the body unread close the
    connection after the answer (see the module docstring)."""

    @functools.wraps(handler)
    async def closing(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except Problem as p:
            if request.content.is_eof():
                raise
            response = p.response()
            response.force_close()
            return response

    return closing
