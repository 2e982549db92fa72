"""Test helpers: never sleep and hope, poll with a bound."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import nats.js.errors
from nats.aio.client import Client as NATS

from infra.kv import stored_keys

T = TypeVar("T")


async def eventually(
    probe: Callable[[], Awaitable[T | None]],
    *,
    timeout: float = 30.0,
    interval: float = 0.05,
    what: str = "condition",
) -> T:
    """Call `probe` until it returns a truthy value or raises no AssertionError; return it."""
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while True:
        try:
            value = await probe()
            if value:
                return value
        except AssertionError as e:
            last = e
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}") from last
        await asyncio.sleep(interval)


def shared_file(path: Path) -> Path:
    """An empty file every job may append to. Jobs run as a uid of their own per phase
    (executor/isolation.py): a file the first job creates (umask 077) the next could not
    write, so a file that several phases' processes write (a marker, a wrapper's record)
    is made here first."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch()
    path.chmod(0o666)
    return path


async def kv_keys(nc: NATS, bucket: str) -> list[str]:
    """The keys a KV bucket holds a value for now, sorted: those its stream's leader
    holds (`stored_keys`), less the deleted ones (a deleted key keeps a marker)."""
    kv = await nc.jetstream().key_value(bucket)
    out = []
    for key in await stored_keys(nc.jetstream(), bucket):
        with contextlib.suppress(nats.js.errors.KeyNotFoundError):
            entry = await kv.get(key)
            if entry.value is not None:
                out.append(key)
    return out
