"""Task helpers."""

from __future__ import annotations

import asyncio
import contextlib


async def cancel_and_wait(task: asyncio.Task[object] | None) -> None:
    """Cancel a task and wait until it has really ended.

    On Python 3.11 `asyncio.wait_for` can swallow a cancellation that arrives just as its
    inner future completes, so one `cancel()` is not enough: keep cancelling until done.
    """
    if task is None:
        return
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=1)
    with contextlib.suppress(asyncio.CancelledError, Exception):
        task.result()
