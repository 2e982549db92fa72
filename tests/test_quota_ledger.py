"""The state ledger never lets a workspace's current state go, and always fits one KV value
(executor/stateledger.py, infra/quotas.py; an attacker's review of the quotas).

- Pruning took each workspace's newest ledger entry for its current state. Not so when a
  version is stored but never becomes the head (a zombie lease's write refused at
  record, a head move lost to a concurrent push, a recovered state older than the head):
  the organization's next pruning deleted the head's object, and the workspace's state
  was gone. On the old code `test_a_head_older_than_its_workspaces_newest_version_survives`
  finds the head's object deleted.
- At the old ceiling of 8,000 versions an organization's ledger (about 246 bytes a
  version at 63-character names) grew to 2 MB, past NATS's default payload of 1 MiB:
  every write of the organization's states then failed for good. The ceiling is now what
  fits 900 KiB at the largest entry; on the old code the ceiling test fails.
"""

from __future__ import annotations

import json

import msgspec
import nats.js.errors
from nats.aio.client import Client as NATS

from executor.stateledger import Entry, Ledger
from executor.statestore import StateStore, version_object
from infra.crypto import KeyRing
from infra.quotas import LEDGER_ENTRY_BYTES, LEDGER_MAX_BYTES, RANGES, Quotas
from infra.streams import STATE_BUCKET

TIGHT = Quotas(state_versions_per_workspace=3, state_versions_per_org=5)


def _state(serial: int, lineage: str = "l") -> bytes:
    return json.dumps({"version": 4, "serial": serial, "lineage": lineage}).encode()


async def _exists(nc: NATS, name: str) -> bool:
    bucket = await nc.jetstream().object_store(STATE_BUCKET)
    try:
        await bucket.get_info(name)
    except nats.js.errors.NotFoundError:
        return False
    return True


async def test_a_head_older_than_its_workspaces_newest_version_survives(nc: NATS) -> None:
    """acme/net's head is serial 1; serial 2 is stored and never becomes the head (its
    record refused: a zombie lease). Other workspaces' writes then pass the organization's
    quota: app's older versions go, net's head never (on the old code it went first,
    the oldest entry that was not its workspace's newest). The head still reads."""
    quotas = Quotas(state_versions_per_workspace=3, state_versions_per_org=4)
    store = StateStore(nc.jetstream(), KeyRing.generate(), quotas)
    head = await store.put_version("acme", "net", _state(1))
    _, revision = await store.head("acme", "net")
    await store.move_head("acme", "net", head, revision)
    abandoned = await store.put_version("acme", "net", _state(2))  # stored, never the head

    for serial in range(1, 4):  # org quota 4: the third write lets the org's oldest go
        version = await store.put_version("acme", "app", _state(serial))
        _, revision = await store.head("acme", "app")
        await store.move_head("acme", "app", version, revision)

    assert await _exists(nc, head.object), "the workspace's head was deleted"
    now, _ = await store.head("acme", "net")
    assert now == head and json.loads(await store.read(now))["serial"] == 1
    assert await _exists(nc, abandoned.object)  # net's newest: perhaps in flight


async def test_a_version_admitted_again_is_not_deleted_by_an_earlier_let_go(nc: NATS) -> None:
    """A writer let a version go; before it deleted the object the same state was written
    again (same object, back in the ledger). The delete re-reads the ledger and leaves it."""
    store = StateStore(nc.jetstream(), KeyRing.generate(), TIGHT)
    version = await store.put_version("acme", "net", _state(1))
    let_go = [Entry("net", version.object, version.size)]
    await store._let_go("acme", let_go)  # the ledger still lists it: a stale let-go
    assert await _exists(nc, version.object)


def _largest_entry() -> bytes:
    org, ws = "o" * 63, "w" * 63  # the longest names (events/codec.py ID_RE)
    name = version_object(org, ws, -(2**63), "f" * 64)  # the longest serial: 20 characters
    return msgspec.json.encode(Entry(ws, name, RANGES["state_max_mb"][2] * 1024 * 1024))


def test_the_versions_an_organization_may_keep_fit_one_ledger_value() -> None:
    """The ceiling of --state-versions-per-org times the largest entry stays under
    LEDGER_MAX_BYTES (900 KiB, below NATS's default 1 MiB payload)."""
    assert len(_largest_entry()) + 1 <= LEDGER_ENTRY_BYTES  # and its comma
    ceiling = RANGES["state_versions_per_org"][2]
    full = Ledger([msgspec.json.decode(_largest_entry(), type=Entry)] * ceiling)
    assert len(msgspec.json.encode(full)) < LEDGER_MAX_BYTES
    assert RANGES["state_versions_per_workspace"][2] <= ceiling
    assert Quotas(state_versions_per_org=ceiling + 1).problems()
