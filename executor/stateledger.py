"""How many state versions, and how many bytes of them, an organization keeps in `rp-state`.

`rp-state` is one bucket for every tenant, and every apply (every push of a CLI) adds a
version to it: without a bound one organization's history fills the store for all. So
each organization has a ledger, one key `<org>` in the KV bucket `rp-state-ledger`,
naming every version it has in the store (workspace, object, bytes), oldest first.

A new version is admitted to the ledger before its object is stored, by compare-and-set
on the ledger's revision (writers on any executor or api replica never both take the
last place). Past the deployment's quotas (`--state-versions-per-workspace`,
`--state-mb-per-workspace`, `--state-versions-per-org`, `--state-mb-per-org`) the
oldest versions that are no workspace's current state are let go: removed from the
ledger in the same write, then their objects deleted. A workspace's current state is
never let go: the version being written, the head its writer read, each workspace's
newest version in the ledger (one being written), and each workspace's head and pending
version as `rp-state-head` has them are kept whatever the quotas say. (The newest is not
always the head: a version stored and then refused at record, one that lost its head
move to a concurrent push, a recovered state older than the head; the head is read for
each workspace a write would let a version of go, so only when something goes.) Only
when what must be kept alone passes a quota is the new version refused
(`StateQuotaExceeded`), and then nothing is stored. Before an object is deleted the
ledger and its workspace's head are read again: one admitted again meanwhile (the same
state written anew, same object) or become a head is left.

Why prune rather than refuse: a state write refused in the middle of an apply leaves
resources made and recorded nowhere but in `errored.tfstate` on one executor's disk,
the worst outcome there is; old versions are what S3's lifecycle rules
(`NoncurrentVersionExpiration` with `NewerNoncurrentVersions`) and HCP Terraform's data
retention policies let go, keeping the current state. Their record stays in the event
log (`GET .../state-versions` lists them); their objects are gone.

A crash between the ledger's write and the deletes leaves the let-go objects in the store
uncounted (at most one write's); a crash between the ledger's write and the new object's
store leaves an entry counted for nothing, the oldest to go next. Versions stored before
the ledger existed are not counted.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import msgspec
import nats.errors
import nats.js.errors
import structlog
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from executor.statefile import StateQuotaExceeded
from infra.kv import STATE_LEDGER_BUCKET
from infra.quotas import MIB, Quotas

log = structlog.get_logger(__name__)

_NATS_ERRORS = (nats.errors.Error, nats.js.errors.Error, TimeoutError, OSError)
_CAS_ATTEMPTS = 20

# The objects a workspace's current state is in (`rp-state-head`: its head and pending).
Current = Callable[[str], Awaitable[frozenset[str]]]


class Entry(msgspec.Struct, frozen=True, array_like=True):
    ws: str
    object: str
    size: int


class Ledger(msgspec.Struct):
    entries: list[Entry] = msgspec.field(default_factory=list)


class LedgerUnavailable(Exception):
    """The ledger could not be read or written; NATS may be back in a moment."""

    retryable = True


def admit(
    ledger: Ledger, entry: Entry, quotas: Quotas, keep: frozenset[str]
) -> tuple[Ledger, list[Entry]]:
    """The ledger with `entry` in it (as the newest, once), and the entries let go to
    stay within `quotas`; `StateQuotaExceeded` if what must be kept alone passes one."""
    entries = [e for e in ledger.entries if e.object != entry.object] + [entry]
    newest = {e.ws: e.object for e in entries}  # in order: the last of each workspace
    kept = keep | {entry.object} | set(newest.values())
    gone: list[Entry] = []

    def over(mine: list[Entry], count: int, size: int) -> bool:
        return len(mine) > count or sum(e.size for e in mine) > size

    def let_go(scope: str | None, count: int, size: int, what: str) -> None:
        while over([e for e in entries if scope in (None, e.ws)], count, size):
            old = next((e for e in entries if scope in (None, e.ws) and e.object not in kept), None)
            if old is None:
                raise StateQuotaExceeded(
                    f"the state versions {what} keeps pass this deployment's quota "
                    f"({count} versions, {size // MIB} MiB) with only current states left"
                )
            entries.remove(old)
            gone.append(old)

    let_go(
        entry.ws,
        quotas.state_versions_per_workspace,
        quotas.state_bytes_per_workspace,
        "the workspace",
    )
    let_go(None, quotas.state_versions_per_org, quotas.state_bytes_per_org, "the organization")
    return Ledger(entries), gone


async def record(
    js: JetStreamContext,
    quotas: Quotas,
    org: str,
    entry: Entry,
    keep: frozenset[str],
    current: Current,
) -> list[Entry]:
    """Admit `entry` to `org`'s ledger (compare-and-set), keeping every workspace's
    `current` state; the entries let go, whose objects the caller deletes (`still_gone`
    first)."""
    kv = await _bucket(js)
    for _ in range(_CAS_ATTEMPTS):
        ledger, revision = await _load(kv, org)
        updated, gone = await _admit_current(ledger, entry, quotas, keep, current)
        try:
            data = msgspec.json.encode(updated)
            if revision:
                await kv.update(org, data, last=revision)
            else:
                await kv.create(org, data)
        except nats.js.errors.KeyWrongLastSequenceError:
            continue
        except _NATS_ERRORS as e:
            raise LedgerUnavailable(f"writing the state ledger of {org}: {e!r}") from e
        return gone
    raise LedgerUnavailable(f"the state ledger of {org} keeps changing")


async def _admit_current(
    ledger: Ledger, entry: Entry, quotas: Quotas, keep: frozenset[str], current: Current
) -> tuple[Ledger, list[Entry]]:
    """`admit`, keeping each workspace's current state as `rp-state-head` has it, read
    for the workspaces a version of would go (none while nothing goes)."""
    heads: dict[str, frozenset[str]] = {}
    while True:
        updated, gone = admit(ledger, entry, quotas, keep.union(*heads.values()))
        unread = {e.ws for e in gone} - heads.keys()
        if not unread:
            return updated, gone
        for ws in sorted(unread):
            heads[ws] = await current(ws)


async def still_gone(
    js: JetStreamContext, org: str, gone: list[Entry], current: Current
) -> list[Entry]:
    """Of the entries a write let go, those still out of the ledger and no workspace's
    current state, read again just before their objects are deleted."""
    ledger, _ = await _load(await _bucket(js), org)
    listed = {e.object for e in ledger.entries}
    out = []
    for entry in gone:
        if entry.object not in listed and entry.object not in await current(entry.ws):
            out.append(entry)
    return out


async def _bucket(js: JetStreamContext) -> KeyValue:
    try:
        return await js.key_value(STATE_LEDGER_BUCKET)
    except _NATS_ERRORS as e:
        raise LedgerUnavailable(f"opening {STATE_LEDGER_BUCKET}: {e!r}") from e


async def _load(kv: KeyValue, org: str) -> tuple[Ledger, int]:
    try:
        got = await kv.get(org)
    except nats.js.errors.KeyNotFoundError as e:
        # A deleted key still has a revision: a create after it is refused, an update works.
        revision = getattr(getattr(e, "entry", None), "revision", 0) or 0
        return Ledger(), int(revision)
    except _NATS_ERRORS as e:
        raise LedgerUnavailable(f"reading the state ledger of {org}: {e!r}") from e
    if not got.value:
        return Ledger(), int(got.revision or 0)
    return msgspec.json.decode(got.value, type=Ledger), int(got.revision or 0)
