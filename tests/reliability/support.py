"""An event loop in a thread, for synchronous drivers (hypothesis state machines,
schemathesis over HTTP) of the async control plane. Holds no tests itself."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")


class ThreadLoop:
    """Runs coroutines on one event loop that lives in its own thread until `close()`.

    Child processes (nats-server) started from it are tied to that thread's life
    (PR_SET_PDEATHSIG), which lasts until `close()`."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 60) -> T:
        fut: Future[T] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return fut.result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()
