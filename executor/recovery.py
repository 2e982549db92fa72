"""A restart tells the truth: what an executor's previous life left is settled at start.

Each executor life holds an exclusive `flock` on its own incarnation file,
`<work>/incarnations/<incarnation>` (the file holds its executor id). A file whose lock
can be taken belongs to a life that ended, however it ended (kill -9 included). Before an
executor on that work directory takes new work (`restart`):

1. every lease of a dead life still on the heartbeat board (executors' beats and the
   scheduler's `claimed` beats carry the executor id) is failed at once,
   `executor_unavailable`, "executor restarted", guarded by that very lease, so the
   workspace moves on now and not after the heartbeat timeout;
2. every state left in `<work>/unsaved-state/` (a state the backend received and could
   not record, or Terraform's `errored.tfstate` that `executor.sweep` collected) is
   sealed, stored and recorded on its run as a state version marked `recovered`, and
   becomes the workspace's head if it is newer than the head; recorded files are
   renamed `*.recorded` (kept, never deleted). A file that can never be recorded is
   deleted or set aside in a bounded quarantine (`record_unsaved`), never tried forever.

A recovery that cannot reach NATS raises: the executor does not start without it, and
the next start tries again (the files and dead incarnation files stay). A state the
store cannot take (`StateStoreError`) is left for the next start, logged, and the start
goes on: one file never holds every start back.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
from pathlib import Path

import structlog

from events.codec import run_subject
from events.errors import DomainError, IllegalTransition
from events.run import FailRun, RecoverStateVersion, RunState, StateVersionCreated
from executor.ports import RunLedger, RunReader, RunWriter
from executor.statefile import StateFile, StateQuotaExceeded, StateRefused, StateTooLarge
from executor.statestore import HeadMoved, StateStore, StateStoreError
from infra.heartbeats import DEADLINE, Board
from infra.ids import new_id

log = structlog.get_logger(__name__)

INCARNATIONS = "incarnations"
UNSAVED = "unsaved-state"
RECORDED = ".recorded"
REFUSED = "refused"  # kept files that will never be recorded, a few of them
QUARANTINE = 8
REASON = "executor_unavailable"


class Incarnation:
    """This life's incarnation file, locked for as long as the executor lives."""

    def __init__(self, work_dir: Path, executor_id: str) -> None:
        folder = work_dir / INCARNATIONS
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / new_id()
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        os.write(self.fd, executor_id.encode())

    def close(self) -> None:
        """A clean end: nothing to settle at the next start."""
        self.path.unlink(missing_ok=True)
        os.close(self.fd)


def dead_lives(work_dir: Path) -> dict[Path, str]:
    """The incarnation files of lives that ended, with their executor ids."""
    found: dict[Path, str] = {}
    folder = work_dir / INCARNATIONS
    for path in sorted(folder.iterdir()) if folder.is_dir() else []:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue  # a live sibling on the same work directory
        try:
            found[path] = os.read(fd, 4096).decode(errors="replace").strip()
        finally:
            os.close(fd)
    return found


async def restart(
    app: RunLedger, board: Board, store: StateStore, work_dir: Path, actor: str
) -> None:
    """Settle what dead lives on `work_dir` left (module docstring), before new work."""
    dead = dead_lives(work_dir)
    ids = {executor_id for executor_id in dead.values() if executor_id}
    if ids:
        await fail_leases(app, board, ids, actor)
    await record_unsaved(app, store, work_dir / UNSAVED, actor)
    for path in dead:
        path.unlink(missing_ok=True)


async def fail_leases(app: RunWriter, board: Board, executor_ids: set[str], actor: str) -> int:
    """Fail every run still running under a lease of one of `executor_ids`."""
    _, beats = await board.snapshot()
    failed = 0
    for beat in beats:
        if beat.phase == DEADLINE or not beat.lease_id:
            continue
        if beat.body.executor_id not in executor_ids:
            continue
        if await _fail(app, beat.body.org or "*", beat.body.workspace, beat.run_id, beat, actor):
            failed += 1
    return failed


async def _fail(app: RunWriter, org: str, ws: str, run_id: str, beat: object, actor: str) -> bool:
    lease_id = getattr(beat, "lease_id", "")
    phase = getattr(beat, "phase", "")
    executor_id = getattr(getattr(beat, "body", None), "executor_id", "")

    def guard(run: RunState) -> None:
        if run.lease_id != lease_id or run.phase != phase:
            raise IllegalTransition("the run moved on", status=str(run.status))

    message = f"executor restarted: executor {executor_id} died during the {phase} phase"
    cmd = FailRun(actor=actor, reason=REASON, message=message)
    try:
        await app.run_command(org, ws or None, run_id, cmd, guard=guard)
    except DomainError as e:
        log.info("restart_lease_left", run_id=run_id, why=str(e))
        return False
    log.warning("restart_lease_failed", run_id=run_id, phase=phase, lease_id=lease_id)
    return True


def _run_of(name: str) -> tuple[str, str, str]:
    """(org, ws, run) from a kept file's name: `<org>.<ws>.<run>[...].tfstate` (the
    backend's and custody's) or `<run>-<phase>-<tmp>.errored.tfstate` (the sweep's)."""
    parts = name.split(".")
    if len(parts) >= 4 and parts[-1] == "tfstate" and "-" not in parts[2]:
        return parts[0], parts[1], parts[2]
    return "*", "", name.split("-", 1)[0]


async def record_unsaved(app: RunLedger, store: StateStore, keep: Path, actor: str) -> int:
    """Record every state kept in `keep` as a recovered version of its run; how many.

    None stands in the way of the executor's start, and none is copied past the
    deployment's bounds (each with an error logged):
    - one past `--state-max-mb` is deleted: it can never be stored, and such a file is a
      tenant's (a sparse `errored.tfstate` costs its job nothing);
    - one that is no Terraform state, is of no run, or is refused by `_recover`
      otherwise goes to `keep/refused/` (the newest `QUARANTINE` files stay there);
    - one the organization's quotas refuse, or that the store could not take (NATS away,
      a ledger that cannot be written), stays for the next start.
    """
    recorded = 0
    for path in sorted(keep.glob("*.tfstate")) if keep.is_dir() else []:
        try:
            recorded += await _record_one(app, store, path, actor)
        except StateStoreError as e:
            log.error("unsaved_state_not_recorded", path=str(path), error=str(e))
    return recorded


async def _record_one(app: RunLedger, store: StateStore, path: Path, actor: str) -> bool:
    try:
        state = await asyncio.to_thread(StateFile.existing, path, store.quotas.state_max_bytes)
        parsed = await asyncio.to_thread(state.parse)
    except StateTooLarge as e:
        log.error("unsaved_state_deleted", path=str(path), why=f"{e.kind}: {e}")
        path.unlink(missing_ok=True)
        return False
    except StateRefused as e:
        _quarantine(path, f"{e.kind}: {e}")
        return False
    org, ws, run_id = _run_of(path.name)
    run: RunState = (await app.load_run(org, ws or None, run_id)).state
    if not run.exists:
        _quarantine(path, f"no run {run_id}")
        return False
    if not await _known(app, run, state.digest):  # (died after recording: not twice)
        try:
            await _recover(app, store, run, state, parsed, path, actor)
        except StateQuotaExceeded as e:  # the organization's to make room: tried again
            log.error("unsaved_state_refused", path=str(path), why=f"{e.kind}: {e}")
            return False
        except StateRefused as e:
            _quarantine(path, f"{e.kind}: {e}")
            return False
    path.rename(path.with_name(path.name + RECORDED))
    return True


def _quarantine(path: Path, why: str) -> None:
    """Move a kept file runplane will not record to `refused/` beside it, keeping only
    the newest `QUARANTINE` files there (each at most `--state-max-mb`)."""
    folder = path.parent / REFUSED
    folder.mkdir(mode=0o700, exist_ok=True)
    path.rename(folder / path.name)
    log.error("unsaved_state_refused", path=str(folder / path.name), why=why)
    held = sorted(folder.iterdir(), key=lambda p: p.lstat().st_mtime, reverse=True)
    for old in held[QUARANTINE:]:
        old.unlink(missing_ok=True)
        log.error("unsaved_state_deleted", path=str(old), why="quarantine full")


async def _known(app: RunReader, run: RunState, digest: str) -> bool:
    envs = await app.store.read(run_subject(run.org, run.workspace, run.run_id))
    return any(isinstance(e.event, StateVersionCreated) and e.event.digest == digest for e in envs)


async def _recover(
    app: RunWriter,
    store: StateStore,
    run: RunState,
    state: StateFile,
    parsed: tuple[int, str],
    path: Path,
    actor: str,
) -> None:
    head, revision = await store.head(run.org, run.workspace)
    version = await store.put_state(
        run.org, run.workspace, state, parsed, head=head, run_id=run.run_id
    )
    newer = head is None or (version.lineage == head.lineage and version.serial > head.serial)
    if head is not None and head.digest == version.digest:
        newer = False
    what = "the workspace's state" if newer else "kept beside a newer state"
    message = f"state left on disk by a dead executor ({path.name}), recovered at restart: {what}"
    cmd = RecoverStateVersion(
        actor=actor,
        serial=version.serial,
        lineage=version.lineage,
        digest=version.digest,
        object=version.object,
        size=version.size,
        message=message,
    )
    await app.run_command(run.org, run.workspace, run.run_id, cmd)
    if newer:
        try:
            await store.move_head(run.org, run.workspace, version, revision)
        except HeadMoved:
            log.error("recovered_state_not_head", object=version.object)
    log.warning("state_recovered", run_id=run.run_id, object=version.object, head=newer)
