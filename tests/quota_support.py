"""Helpers of the quota attack tests: fake Terraform states streamed as they are made (the
test never holds one either), the process's peak anonymous memory while something runs,
and what the object store holds. Holds no tests."""

from __future__ import annotations

import base64
import hashlib
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass

import aiohttp
from nats.aio.client import Client as NATS

from events.run import Workspace
from executor.statebackend import StateBackend
from executor.statestore import StateStore
from infra.crypto import KeyRing
from infra.quotas import Quotas
from infra.streams import STATE_BUCKET
from services.app.commands import App
from tests.lock_support import Client, FakeJob, _job

MIB = 1024 * 1024
_FILLER = b'{"a":"' + b"x" * (3 * 1000) + b'"},'  # 3009 bytes: base64 chunks join cleanly


def state_blocks(size: int, *, serial: int = 999, lineage: str = "x") -> Iterator[bytes]:
    """A Terraform state (format 4) of about `size` bytes, in blocks of a multiple of 3
    bytes but the last."""
    head = f'{{"version": 4, "serial": {serial}, "lineage": "{lineage}", "resources": ['.encode()
    head += b" " * (-len(head) % 3)
    yield head
    block = _FILLER * 300  # ~0.9 MB
    made = len(head)
    while made + len(block) < size:
        yield block
        made += len(block)
    yield b'{"a": "end"}]}'


def state_md5(size: int, **kw: object) -> str:
    h = hashlib.md5(usedforsecurity=False)
    for block in state_blocks(size, **kw):  # type: ignore[arg-type]
        h.update(block)
    return h.hexdigest()


async def streamed(blocks: Iterator[bytes]) -> AsyncIterator[bytes]:
    for block in blocks:
        yield block


async def push_document(
    size: int, *, serial: int = 999, lineage: str = "x"
) -> AsyncIterator[bytes]:
    """The TFE API's state-version document of such a state, base64 inline, streamed."""
    md5 = state_md5(size, serial=serial, lineage=lineage)
    yield (
        '{"data": {"type": "state-versions", "attributes": '
        f'{{"serial": {serial}, "lineage": "{lineage}", "md5": "{md5}", "state": "'
    ).encode()
    for block in state_blocks(size, serial=serial, lineage=lineage):
        yield base64.b64encode(block)
    yield b'"}}}'


def rss_anon() -> int:
    """This process's anonymous resident memory (heap, not file pages), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/self/status")


@dataclass
class Peak:
    before: int
    peak: int = 0

    @property
    def grown(self) -> int:
        return self.peak - self.before


@contextmanager
def peak_memory() -> Iterator[Peak]:
    """The peak of `rss_anon` while the block runs, sampled every millisecond."""
    peak = Peak(rss_anon())
    peak.peak = peak.before
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak.peak = max(peak.peak, rss_anon())
            time.sleep(0.001)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        yield peak
    finally:
        done.set()
        sampler.join()


@asynccontextmanager
async def served(nc: NATS, app: App, quotas: Quotas | None = None) -> AsyncIterator[Client]:
    """A planning run's phase backend on acme/net, its lock taken as Terraform takes it."""
    await app.create_org("acme", "alice")
    await app.create_workspace("acme", "net", Workspace(repository="/nowhere"), "alice")
    store = StateStore(nc.jetstream(), KeyRing.generate(), quotas)
    job: FakeJob = await _job(app, "a", claim=True)
    async with (
        StateBackend(job, store, runs=app, report=job.report) as backend,
        aiohttp.ClientSession() as session,
    ):
        client = Client(backend, job, session)
        assert (await client.call("LOCK", {"ID": "L", "Who": "tf"})).status == 200
        yield client


async def stored_bytes(nc: NATS, bucket: str = STATE_BUCKET) -> tuple[int, int]:
    """(messages, bytes) the object store's stream holds."""
    info = await nc.jetstream().stream_info(f"OBJ_{bucket}")
    return info.state.messages, info.state.bytes
