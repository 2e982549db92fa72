"""A state version as it comes in: received into a file, a chunk at a time, and judged
there before a byte of it reaches the object store.

Three ways bring a state: a phase's Terraform POSTs it to the phase's own backend
(executor/statebackend.py), a user's CLI pushes it through the TFE API
(services/surfaces/tfe/state_push.py), and a restart records one a dead executor left on
disk (executor/recovery.py). Each is the tenant's to write: a phase's backend is also
reachable by any code the phase runs (a provisioner, an external data source), which is
how a review pushed 150 MB fake states (serial 999, lineage "x") and grew the executor by
300 MB and JetStream by 228 MB. So every one of them goes through here:

- the body is written to a file (0600, in a directory of runplane's) as it arrives, its
  sha256 and md5 taken on the way; past the deployment's `--state-max-mb` it is refused
  (`StateTooLarge`) and the rest is never read. Nothing holds more than a chunk;
- the file is judged in place: nesting bounded (infra/jsonbody.py `DepthGauge`, a chunk
  at a time), then decoded by msgspec from a read-only map of the file into the few
  fields runplane reads (the rest is checked as JSON and skipped, never built), so what
  the process holds is the page cache's, not its heap's. It must be a Terraform state:
  a JSON object with `version` 4, an integer `serial` and a `lineage` (`NotAState`);
- it must continue the workspace's state (`continues`), as Terraform's own remote
  backends check: the current state's lineage, and a serial above the current one unless
  it is the very same state (`LineageMismatch`, `SerialNotNewer`).

Every refusal names a stable `kind` (the TFE and HTTP answers' type) and the status a
backend answers it with.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import tempfile
from collections.abc import AsyncIterable
from pathlib import Path
from types import TracebackType
from typing import BinaryIO

import msgspec

from executor.errors import ExecutorError
from infra import jsonbody
from infra.quotas import MIB

CHUNK = 256 * 1024
# A state holds the tenant's values, which nest as deep as their configuration made them:
# far above a request body's bound, and below where decoding one would run out of stack.
MAX_STATE_DEPTH = 512
STATE_FORMAT = 4  # the state file format Terraform >= 0.12 and OpenTofu write


class StateRefused(ExecutorError):
    """A state runplane will not keep; `kind` is its stable name, `status` the answer."""

    retryable = False
    kind = "state-refused"
    status = 422


class StateTooLarge(StateRefused):
    kind = "state-too-large"
    status = 413


class NotAState(StateRefused):
    kind = "not-a-state"
    status = 400


class LineageMismatch(StateRefused):
    kind = "lineage-mismatch"
    status = 409


class SerialNotNewer(StateRefused):
    kind = "serial-not-newer"
    status = 409


class StateQuotaExceeded(StateRefused):
    kind = "state-quota-exceeded"
    status = 422


def too_large(limit: int) -> StateTooLarge:
    return StateTooLarge(
        f"the state passes this deployment's bound of {limit // MIB} MiB "
        "(--state-max-mb): refused, nothing stored"
    )


class _StateHead(msgspec.Struct):
    serial: int
    lineage: str = ""
    version: int = 0


_decode_head = msgspec.json.Decoder(_StateHead).decode


class StateFile:
    """A state being received into a file of its own in `folder` (0600): its size,
    sha256 and md5 taken as it comes. Removed on exit unless it was `moved` elsewhere."""

    def __init__(self, path: Path, limit: int, out: BinaryIO | None) -> None:
        self.path = path
        self._out = out
        self.limit = limit
        self.size = 0
        self._sha = hashlib.sha256()
        self._md5 = hashlib.md5(usedforsecurity=False)
        self._moved = out is None  # a file that was there before is never removed here

    @classmethod
    def create(cls, folder: Path, limit: int) -> StateFile:
        """A new, empty file in `folder` to receive a state into."""
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd, name = tempfile.mkstemp(prefix=".incoming-", suffix=".part", dir=folder)
        return cls(Path(name), limit, os.fdopen(fd, "wb"))

    @classmethod
    def existing(cls, path: Path, limit: int) -> StateFile:
        """A state already on disk (one a dead executor left), hashed in place;
        `StateTooLarge` past `limit`. The file stays where it is."""
        state = cls(path, limit, None)
        if path.stat().st_size > limit:
            raise too_large(limit)
        with path.open("rb") as f:
            while chunk := f.read(CHUNK):
                state.size += len(chunk)
                state._sha.update(chunk)
                state._md5.update(chunk)
        return state

    @classmethod
    async def receive(
        cls, chunks: AsyncIterable[bytes], folder: Path, limit: int, *, announced: int | None
    ) -> StateFile:
        """The whole of `chunks` in a file; `StateTooLarge` as soon as they pass `limit`
        (or at once, if the length `announced` does)."""
        if announced is not None and announced > limit:
            raise too_large(limit)
        state = cls.create(folder, limit)
        try:
            async for chunk in chunks:
                state.write(chunk)
            state.close()
        except BaseException:
            state.discard()
            raise
        return state

    def write(self, chunk: bytes) -> None:
        self.size += len(chunk)
        if self.size > self.limit:
            raise too_large(self.limit)
        self._sha.update(chunk)
        self._md5.update(chunk)
        assert self._out is not None, "an existing state is not written to"
        self._out.write(chunk)

    def close(self) -> None:
        if self._out is not None and not self._out.closed:
            self._out.flush()
            os.fsync(self._out.fileno())
            self._out.close()

    @property
    def digest(self) -> str:
        return self._sha.hexdigest()

    @property
    def md5(self) -> str:
        return self._md5.hexdigest()

    def parse(self) -> tuple[int, str]:
        """The state's serial and lineage; `NotAState` unless it is a Terraform state of
        format 4. Blocking (a pass over the file): run it in a thread."""
        if self.size == 0:
            raise NotAState("not a Terraform state: the body is empty")
        gauge = jsonbody.DepthGauge(MAX_STATE_DEPTH)
        try:
            with self.path.open("rb") as f:
                while chunk := f.read(1024 * 1024):
                    gauge.feed(chunk, last=f.tell() >= self.size)
                with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                    view = memoryview(mapped)
                    try:
                        head = _decode_head(view)
                    finally:
                        view.release()
        except (msgspec.DecodeError, jsonbody.TooDeep) as e:
            raise NotAState(f"not a Terraform state: {e}") from e
        if head.version != STATE_FORMAT:
            raise NotAState(
                f"not a Terraform state of format {STATE_FORMAT} (its version is {head.version})"
            )
        if not head.lineage:
            raise NotAState("not a Terraform state: it has no lineage")
        return head.serial, head.lineage

    def open(self) -> BinaryIO:
        return self.path.open("rb")

    def move(self, dest: Path) -> None:
        """Keep the file as `dest` (0600); it is no longer removed on exit."""
        os.replace(self.path, dest)
        self.path = dest
        self._moved = True

    def discard(self) -> None:
        if self._out is not None:
            self._out.close()
        if not self._moved:
            self.path.unlink(missing_ok=True)

    def __enter__(self) -> StateFile:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.discard()


def continues(current: tuple[int, str, str] | None, serial: int, lineage: str, digest: str) -> None:
    """Refuse a state that does not continue `current` (serial, lineage, digest; None:
    the workspace has no state yet, and any lineage starts it), as Terraform's remote
    backends do: another lineage is another state, and a serial not above the current
    one is an older state, unless it is the current state itself."""
    if current is None:
        return
    serial_now, lineage_now, digest_now = current
    if lineage != lineage_now:
        raise LineageMismatch(
            f"the state's lineage {lineage!r} is not the workspace's ({lineage_now!r})"
        )
    if serial <= serial_now and digest != digest_now:
        raise SerialNotNewer(
            f"the state's serial {serial} is not above the workspace's ({serial_now})"
        )
