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
import fcntl
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

    The child also holds the read ends of its own output pipes (never reading them): when
    the executor dies, its parent death signal makes Terraform stop gracefully and write
    `errored.tfstate`, and on the way it prints; with no reader left, that print would
    kill it with SIGPIPE first (Go's rule for stdout and stderr) and what it applied would
    be recorded nowhere. With the pipes held it may print up to a pipe's buffer.
    """
    proc, outputs = await _start(argv, cwd=cwd, env=env, jail=jail)
    reaped = asyncio.ensure_future(_reap(proc, jail))
    try:
        await _pump(outputs, step_log, on_line)
        return await reaped
    except BaseException:
        reaped.cancel()
        await _interrupt(proc, outputs, step_log, on_line, grace)
        raise
    finally:
        outputs.close()


async def _reap(proc: asyncio.subprocess.Process, jail: Jail | None) -> int:
    """The child's exit code, told to `jail` as soon as it ends, even while what it
    started still holds its output open: a job that killed its own init (the uid mode:
    the same uid) has the rest of its processes killed at once, for nothing else would
    bring them down with the executor."""
    code = await proc.wait()
    if jail is not None and jail.ended(code):
        await asyncio.to_thread(jail.kill)
    return code


class _Outputs:
    """The child's stdout and stderr as stream readers, over pipes runplane made."""

    def __init__(self) -> None:
        self.readers: list[tuple[str, asyncio.StreamReader]] = []
        self._transports: list[asyncio.BaseTransport] = []

    async def attach(self, name: str, fd: int) -> None:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=_LINE_LIMIT, loop=loop)
        pipe = os.fdopen(fd, "rb", buffering=0)
        transport, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader, loop=loop), pipe
        )
        self.readers.append((name, reader))
        self._transports.append(transport)

    def close(self) -> None:
        for transport in self._transports:
            transport.close()


_F_SETPIPE_SZ = 1031  # fcntl.F_SETPIPE_SZ (Linux), named in fcntl only from Python 3.10 on
_PIPE_SIZE = 1024 * 1024  # what a dying Terraform may still print (the default maximum)


def _pipe() -> tuple[int, int]:
    read, write = os.pipe()
    try:
        fcntl.fcntl(write, _F_SETPIPE_SZ, _PIPE_SIZE)
    except OSError:
        pass  # the default 64 KiB then: still room for a graceful stop's last words
    return read, write


async def _start(
    argv: Sequence[str], *, cwd: Path, env: Mapping[str, str], jail: Jail | None
) -> tuple[asyncio.subprocess.Process, _Outputs]:
    pipes = [_pipe(), _pipe()]
    held = tuple(read for read, _ in pipes)
    try:
        proc = await spawn(
            argv,
            cwd=cwd,
            env=env,
            jail=jail,
            stdout=pipes[0][1],
            stderr=pipes[1][1],
            pass_fds=held,
        )
    except BaseException:
        for read, write in pipes:
            os.close(read)
            os.close(write)
        raise
    outputs = _Outputs()
    for (read, write), name in zip(pipes, ("stdout", "stderr"), strict=True):
        os.close(write)  # the child has it: EOF once the child and what it started are done
        await outputs.attach(name, read)
    return proc, outputs


async def spawn(
    argv: Sequence[str],
    *,
    cwd: Path,
    env: Mapping[str, str],
    jail: Jail | None,
    stderr: int,
    stdout: int = asyncio.subprocess.PIPE,
    pass_fds: Sequence[int] = (),
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
            stdout=stdout,
            stderr=stderr,
            start_new_session=True,
            limit=_LINE_LIMIT,
            pass_fds=tuple(pass_fds),
        )
    how = jail.spawn(argv, env, cwd)
    return await asyncio.create_subprocess_exec(
        *how.argv,
        cwd=how.cwd,
        env=how.env,
        stdin=how.stdin if how.stdin >= 0 else asyncio.subprocess.DEVNULL,
        stdout=stdout,
        stderr=stderr,
        limit=_LINE_LIMIT,
        pass_fds=(*pass_fds, *how.keep_fds),
        **how.options,
    )


async def _pump(
    outputs: _Outputs, step_log: StepLog, on_line: Callable[[str], None] | None
) -> None:
    """Copy stdout and stderr, each line by line, until both end."""
    copies = [
        asyncio.ensure_future(_copy(reader, name, step_log, on_line))
        for name, reader in outputs.readers
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
    outputs: _Outputs,
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
        await asyncio.wait_for(_pump_and_wait(proc, outputs, step_log, on_line), grace)
    except (TimeoutError, ValueError):
        pass
    finally:
        # Also reached when we are cancelled again while waiting: never leave it running.
        if proc.returncode is None:
            step_log.note("killing (SIGKILL)")
            _signal_group(proc, signal.SIGKILL)
            await proc.wait()


async def _pump_and_wait(
    proc: asyncio.subprocess.Process,
    outputs: _Outputs,
    step_log: StepLog,
    on_line: Callable[[str], None] | None,
) -> None:
    await _pump(outputs, step_log, on_line)
    await proc.wait()


def _signal_group(proc: asyncio.subprocess.Process, sig: signal.Signals) -> None:
    try:
        os.killpg(proc.pid, sig)  # start_new_session: the child leads its own group
    except ProcessLookupError:
        pass
