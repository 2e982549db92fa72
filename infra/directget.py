"""Direct gets: the one reader of messages stored in JetStream streams, and the root error
of the infrastructure adapters.

The event store, the KV buckets, the step logs and the heartbeat board all read by direct
get (`$JS.API.DIRECT.GET.<stream>`): any replica of a stream with `allow_direct` answers,
no consumer is made. A batched one (`batch`, `multi_last`) is one request and many replies
ended by a status message (`204` end of batch, `404` nothing), whose `Nats-UpTo-Sequence`
says how far the answering replica had read; a single one (`last_by_subj`, or a subject
in the API subject) is one reply. The replies of every read of a `DirectReader` come to
one wildcard inbox subscription, routed by the reply subject's last token: no SUB, UNSUB,
subscription object or task per read, and no reply dropped as a slow consumer (pending
limits off: a dropped reply would leave a hole in a history).

A direct get may be answered by a follower that is behind. What each reader does about
it is its own (the event store's floor, the KV's up-to sequence, the board's clock
message); the leader's word, where needed, is `leader_get` (`$JS.API.STREAM.MSG.GET`,
which only the stream's leader answers), parsed by the same function as a direct get's
reply.

Errors: `InfraError` is the root of what infra raises, with `retryable`; each
adapter raises its own subclass (`StoreError`, `KvError`, `LogError`, `BoardError`), which
a reader here is told (`error=`).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from datetime import datetime
from typing import Any, NamedTuple, TypeVar
from weakref import WeakKeyDictionary

import msgspec
import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.errors import NotFoundError

T = TypeVar("T")
# A reply's headers and body as what the reader wants (called once per message, in order).
Parse = Callable[[dict[str, str], bytes], T]


class InfraError(RuntimeError):
    """NATS could not do what was asked (unreachable, timed out, refused); `retryable`
    says whether trying again may succeed. The root of infra's errors."""

    retryable = True


class ReadError(InfraError):
    """A direct get failed (error status, time-out, connection lost)."""


class Raw(NamedTuple):
    """One message of a stream as a direct get answers it."""

    seq: int
    subject: str
    data: bytes
    headers: dict[str, str]


def as_raw(hdrs: dict[str, str], data: bytes) -> Raw:
    """The `Parse` that keeps the message as it is."""
    return Raw(int(hdrs["Nats-Sequence"]), hdrs["Nats-Subject"], data, hdrs)


def api(stream: str) -> str:
    return f"$JS.API.DIRECT.GET.{stream}"


class _Read:
    """A read in flight: what its replies gave so far, done at its end."""

    __slots__ = ("done", "items", "parse", "single", "upto")

    def __init__(self, done: asyncio.Future[None], parse: Parse[Any], single: bool) -> None:
        self.done = done
        self.parse = parse
        self.single = single
        self.items: list[Any] = []
        self.upto = 0

    def time_out(self) -> None:
        if not self.done.done():
            self.done.set_exception(TimeoutError())


_shared: WeakKeyDictionary[NATS, DirectReader] = WeakKeyDictionary()


class DirectReader:
    """Direct gets over one connection, their replies on one wildcard inbox subscription."""

    def __init__(self, nc: NATS, *, timeout: float = 5.0) -> None:
        self.nc = nc
        self.timeout = timeout
        # Reads in flight by the last token of their reply subject.
        self._reads: dict[str, _Read] = {}
        self._tokens = itertools.count(1)
        self._sub: Subscription | None = None
        self._prefix = ""
        self._subscribing = asyncio.Lock()

    @classmethod
    def of(cls, nc: NATS) -> DirectReader:
        """The connection's shared reader (one inbox subscription for every such read)."""
        reader = _shared.get(nc)
        if reader is None:
            reader = _shared[nc] = cls(nc)
        return reader

    async def batch(
        self,
        stream: str,
        request: dict[str, Any],
        parse: Parse[T],
        *,
        what: str,
        error: type[InfraError] = ReadError,
        timeout: float | None = None,
    ) -> tuple[list[T], int]:
        """One batched direct get: what `parse` made of each message, in stream order,
        and the `Nats-UpTo-Sequence` of its end (0 if the server did not say)."""
        read = await self._ask(
            api(stream), msgspec.json.encode(request), parse, False, what, error, timeout
        )
        return read.items, read.upto

    async def one(
        self,
        subject: str,
        payload: bytes,
        parse: Parse[T],
        *,
        what: str,
        error: type[InfraError] = ReadError,
        timeout: float | None = None,
    ) -> T | None:
        """One single direct get on API subject `subject` (`api(stream)`, or with a
        subject after it); None when the stream has no such message."""
        read = await self._ask(subject, payload, parse, True, what, error, timeout)
        return read.items[0] if read.items else None

    async def last(
        self, stream: str, subject: str, parse: Parse[T], *, what: str, **kw: Any
    ) -> T | None:
        """The last message on an exact subject, from whichever replica answers."""
        req = msgspec.json.encode({"last_by_subj": subject})
        return await self.one(api(stream), req, parse, what=what, **kw)

    async def _ask(
        self,
        subject: str,
        payload: bytes,
        parse: Parse[Any],
        single: bool,
        what: str,
        error: type[InfraError],
        timeout: float | None,
    ) -> _Read:
        loop = asyncio.get_running_loop()
        try:
            prefix = await self._inbox()
            token = str(next(self._tokens))
            read = _Read(loop.create_future(), parse, single)
            self._reads[token] = read
        except nats.errors.Error as e:
            raise error(f"reading {what}: {e!r}") from e
        timer = loop.call_later(self.timeout if timeout is None else timeout, read.time_out)
        try:
            await self.nc.publish(subject, payload, reply=prefix + token)
            await read.done
            return read
        except TimeoutError as e:
            raise error(f"reading {what} timed out") from e
        except nats.errors.Error as e:
            raise error(f"reading {what}: {e!r}") from e
        except _Failed as e:
            raise error(f"reading {what}: direct get failed: {e}") from e
        finally:
            timer.cancel()
            del self._reads[token]

    async def _inbox(self) -> str:
        """The prefix of this reader's reply subjects, subscribed once (again if lost)."""
        sub = self._sub
        if sub is not None and self.nc._subs.get(sub._id) is sub:
            return self._prefix
        async with self._subscribing:  # many first reads at once: one subscription
            sub = self._sub
            if sub is None or self.nc._subs.get(sub._id) is not sub:
                # (A connection that reconnects keeps its subscriptions; one closed and
                # connected again has lost them.)
                self._prefix = self.nc.new_inbox() + "."
                self._sub = await self.nc.subscribe(
                    self._prefix + "*",
                    cb=self._received,
                    pending_msgs_limit=0,
                    pending_bytes_limit=0,
                )
            return self._prefix

    async def _received(self, msg: Msg) -> None:
        """Hand a reply to the read its subject's last token names (late ones: dropped)."""
        read = self._reads.get(msg.subject[len(self._prefix) :])
        if read is None or read.done.done():
            return
        hdrs = msg.headers or {}
        status = hdrs.get("Status")
        if status:
            if status in ("204", "404"):
                read.upto = int(hdrs.get("Nats-UpTo-Sequence") or 0)
                read.done.set_result(None)
            else:
                read.done.set_exception(_Failed(f"{status} {hdrs.get('Description', '')}"))
            return
        try:
            read.items.append(read.parse(hdrs, msg.data))
        except Exception as e:  # noqa: BLE001 - handed to the reader, who raises it
            read.done.set_exception(e)
            return
        if read.single:
            read.done.set_result(None)


class _Failed(Exception):
    """An error status in a reply (turned into the caller's error class)."""


async def leader_get(
    nc: NATS,
    stream: str,
    parse: Parse[T],
    *,
    subject: str,
    seq: int = 0,
    what: str,
    error: type[InfraError] = ReadError,
    timeout: float = 5.0,
) -> T | None:
    """A message as the stream's leader has it: with `seq`, the first on `subject` at or
    after it (wildcards allowed), else the last on `subject`; None if there is none.
    Parsed from the headers a direct get would have (`Nats-Subject`, `Nats-Sequence`,
    `Nats-Time-Stamp`, and the message's own)."""
    js = nc.jetstream(timeout=timeout)
    try:
        if seq:
            got = await js.get_msg(stream, seq=seq, subject=subject, next=True)
        else:
            got = await js.get_msg(stream, subject=subject)
    except NotFoundError:
        return None
    except (TimeoutError, nats.errors.Error) as e:
        raise error(f"reading {what} from the stream leader: {e!r}") from e
    hdrs = {
        **(got.headers or {}),
        "Nats-Subject": str(got.subject),
        "Nats-Sequence": str(got.seq),
        "Nats-Time-Stamp": _stamp(got.time),
    }
    return parse(hdrs, got.data or b"")


def _stamp(value: object) -> str:
    if isinstance(value, datetime):
        return value.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    return str(value or "")


async def leader_last_seq(
    nc: NATS, stream: str, *, error: type[InfraError] = ReadError, timeout: float = 5.0
) -> int:
    """A stream's last sequence as its leader has it (who alone answers stream info): at
    or past every acknowledged write."""
    try:
        resp = await nc.request(f"$JS.API.STREAM.INFO.{stream}", b"", timeout=timeout)
    except (TimeoutError, nats.errors.Error) as e:
        raise error(f"reading {stream}'s last sequence: {e!r}") from e
    try:
        info = msgspec.json.decode(resp.data, type=_StreamInfo)
    except msgspec.ValidationError as e:  # DecodeError included
        raise error(f"reading {stream}: unreadable stream info ({e})") from e
    if info.error is not None:
        raise error(f"reading {stream}: {info.error.description}")
    return info.state.last_seq


class _ApiError(msgspec.Struct, frozen=True):
    code: int = 0
    err_code: int = 0
    description: str = ""


class _StreamState(msgspec.Struct, frozen=True):
    last_seq: int = 0


class _StreamInfo(msgspec.Struct, frozen=True):
    state: _StreamState = _StreamState()
    error: _ApiError | None = None
