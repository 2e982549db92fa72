"""Running a child process with its output teed to a step log, and stopping it gently.

Children run in their own session (process group): a Ctrl-C or SIGTERM meant for the
executor never reaches Terraform directly, and when we do interrupt, the whole group
(Terraform and its provider plugins) gets the signal, as it would in a terminal. A job's
processes (anything running tenant code) are started through the phase's `Jail`
(`executor/isolation.py`): as the job's own identity, with a parent death signal; git
and the executor's own commands run without one.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import BinaryIO

import structlog

from executor.isolation import Jail
from executor.output import Masker

log = structlog.get_logger(__name__)

# Terraform's -json lines can be long (a diagnostic quoting a large value).
_LINE_LIMIT = 16 * 1024 * 1024


class StepLog:
    """The combined, masked output of one step, written to a file as it comes."""

    def __init__(self, path: Path, masker: Masker) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.mask = masker
        self._file: BinaryIO = path.open("ab")

    def write(self, text: str, stream: str = "stdout") -> str:
        """Mask and append a line; return the masked text. This plain log keeps no
        `stream`; `executor.logstream.LiveStepLog` keeps stdout and stderr apart."""
        masked = self.mask(text)
        self._file.write(masked.encode())
        self._file.flush()
        return masked

    def note(self, text: str) -> None:
        """A line from runplane itself (not from the child), marked so readers can tell."""
        self.write(f"[runplane] {text}\n")

    async def drain(self) -> None:
        """Wait until the log can take more lines (a live log whose send buffer is full)."""

    def close(self) -> None:
        self._file.close()


async def run(
    argv: Sequence[str],
    *,
    cwd: Path,
    env: Mapping[str, str],
    step_log: StepLog,
    on_line: Callable[[str], None] | None = None,
    grace: float = 20.0,
    jail: Jail | None = None,
) -> int:
    """Run `argv`, tee its stdout and stderr (separate pipes) into `step_log`, return
    its exit code.

    If the calling task is cancelled, the child is interrupted with SIGINT (Terraform then
    finishes in-flight operations and writes its state), killed after `grace` seconds,
    and the cancellation propagates. `jail`: run it as that job (None: as the executor).
    """
    proc = await spawn(argv, cwd=cwd, env=env, jail=jail, stderr=asyncio.subprocess.PIPE)
    try:
        await _pump(proc, step_log, on_line)
        return await proc.wait()
    except BaseException:
        await _interrupt(proc, step_log, on_line, grace)
        raise


async def spawn(
    argv: Sequence[str],
    *,
    cwd: Path,
    env: Mapping[str, str],
    jail: Jail | None,
    stderr: int,
) -> asyncio.subprocess.Process:
    """Start `argv` (stdin empty, stdout piped) in a process group of its own, as `jail`'s
    job if given. Called from the event loop's thread only: a parent death signal fires
    when the thread that forked the child ends."""
    if jail is None:
        return await asyncio.create_subprocess_exec(
            *argv,
            cwd=cwd,
            env=dict(env),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=stderr,
            start_new_session=True,
            limit=_LINE_LIMIT,
        )
    how = jail.spawn(argv, env, cwd)
    return await asyncio.create_subprocess_exec(
        *how.argv,
        cwd=how.cwd,
        env=how.env,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=stderr,
        limit=_LINE_LIMIT,
        **how.options,
    )


async def _pump(
    proc: asyncio.subprocess.Process, step_log: StepLog, on_line: Callable[[str], None] | None
) -> None:
    """Copy stdout and stderr, each line by line, until both end."""
    assert proc.stdout is not None and proc.stderr is not None
    copies = [
        asyncio.ensure_future(_copy(proc.stdout, "stdout", step_log, on_line)),
        asyncio.ensure_future(_copy(proc.stderr, "stderr", step_log, on_line)),
    ]
    try:
        await asyncio.gather(*copies)
    finally:
        # Both readers must be gone before anyone reads these pipes again (`_interrupt`).
        for copy in copies:
            copy.cancel()
        await asyncio.wait(copies)


async def _copy(
    reader: asyncio.StreamReader,
    stream: str,
    step_log: StepLog,
    on_line: Callable[[str], None] | None,
) -> None:
    while raw := await _readline(reader, step_log):
        masked = step_log.write(raw.decode(errors="replace"), stream)
        if on_line is not None:
            on_line(masked)
        await step_log.drain()


async def _readline(reader: asyncio.StreamReader, step_log: StepLog) -> bytes:
    """The next line (b"" at the end); a line over `_LINE_LIMIT` is left out whole.

    `StreamReader.readline` would drop such a line's first part and hand its rest over as
    a line of its own: a secret cut in two there would be masked in neither half.
    """
    skipping = False
    while True:
        try:
            line = await reader.readuntil(b"\n")
        except asyncio.IncompleteReadError as e:
            line = e.partial  # the last line, without its newline
        except asyncio.LimitOverrunError as e:
            await reader.read(e.consumed)  # the line's start; its end is read next
            skipping = True
            continue
        if not skipping:
            return line
        step_log.note(f"a line over {_LINE_LIMIT} bytes was left out")
        skipping = False
        if not line.endswith(b"\n"):
            return b""


async def _interrupt(
    proc: asyncio.subprocess.Process,
    step_log: StepLog,
    on_line: Callable[[str], None] | None,
    grace: float,
) -> None:
    """SIGINT the child's group, keep its last words in the log, SIGKILL after `grace`."""
    if proc.returncode is not None:
        return
    step_log.note(f"interrupting (SIGINT), killing in {grace:g}s if still running")
    _signal_group(proc, signal.SIGINT)
    try:
        await asyncio.wait_for(_pump_and_wait(proc, step_log, on_line), grace)
    except (TimeoutError, ValueError):
        pass
    finally:
        # Also reached when we are cancelled again while waiting: never leave it running.
        if proc.returncode is None:
            step_log.note("killing (SIGKILL)")
            _signal_group(proc, signal.SIGKILL)
            await proc.wait()


async def _pump_and_wait(
    proc: asyncio.subprocess.Process, step_log: StepLog, on_line: Callable[[str], None] | None
) -> None:
    await _pump(proc, step_log, on_line)
    await proc.wait()


def _signal_group(proc: asyncio.subprocess.Process, sig: signal.Signals) -> None:
    try:
        os.killpg(proc.pid, sig)  # start_new_session: the child leads its own group
    except ProcessLookupError:
        pass
