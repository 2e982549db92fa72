"""State versions kept per workspace and per organization are bounded (issue 23, item 6):
past the deployment's quotas the oldest versions that are no workspace's current state
are let go (their objects deleted), and a write whose current states alone would pass a
quota is refused with `state-quota-exceeded`, nothing stored (executor/stateledger.py).

On the old code every version of every workspace stayed in `rp-state` forever, and a
phase could write any number of them.
"""

from __future__ import annotations

import json

import nats.js.errors
import pytest
from nats.aio.client import Client as NATS

from events.run import Workspace
from executor.statefile import StateQuotaExceeded
from executor.stateledger import Entry, Ledger, admit
from executor.statestore import StateStore
from infra.crypto import KeyRing
from infra.quotas import Quotas
from infra.streams import STATE_BUCKET
from services.app.commands import App
from tests.quota_support import served, stored_bytes

TIGHT = Quotas(state_versions_per_workspace=3, state_versions_per_org=5)


def _state(serial: int, lineage: str = "l") -> bytes:
    return json.dumps({"version": 4, "serial": serial, "lineage": lineage}).encode()


def test_a_workspace_lets_its_oldest_versions_go_never_its_newest() -> None:
    """Given 3 versions of net (the quota), when a 4th comes, then the oldest goes."""
    ledger = Ledger([Entry("net", f"o{i}", 10) for i in range(3)])
    after, gone = admit(ledger, Entry("net", "o3", 10), TIGHT, keep=frozenset({"o2"}))
    assert [e.object for e in gone] == ["o0"]
    assert [e.object for e in after.entries] == ["o1", "o2", "o3"]


def test_an_organization_lets_the_oldest_go_across_workspaces_keeping_each_current() -> None:
    """Given 5 versions over two workspaces (the org's quota), a 6th lets the org's
    oldest non-current version go, whichever workspace it is of; each workspace's
    newest stays."""
    ledger = Ledger(
        [
            Entry("a", "a0", 1),
            Entry("b", "b0", 1),
            Entry("a", "a1", 1),
            Entry("b", "b1", 1),
            Entry("c", "c0", 1),
        ]
    )
    after, gone = admit(ledger, Entry("c", "c1", 1), TIGHT, keep=frozenset({"c0"}))
    assert [e.object for e in gone] == ["a0"]
    assert {"a1", "b1", "c0", "c1"} <= {e.object for e in after.entries}


def test_current_states_alone_past_a_quota_refuse_the_new_version() -> None:
    """Every version left is some workspace's current: nothing may go, so the new one
    is refused."""
    ledger = Ledger([Entry(ws, f"{ws}0", 1) for ws in "abcde"])
    with pytest.raises(StateQuotaExceeded, match="quota"):
        admit(ledger, Entry("f", "f0", 1), TIGHT, keep=frozenset())


def test_bytes_count_too() -> None:
    """Bytes per workspace: a big new version lets older ones go to fit."""
    quotas = Quotas(state_mb_per_workspace=3)
    mib = 1024 * 1024
    ledger = Ledger([Entry("net", f"o{i}", mib) for i in range(3)])
    _, gone = admit(ledger, Entry("net", "big", 2 * mib), quotas, keep=frozenset())
    assert [e.object for e in gone] == ["o0", "o1"]


async def test_old_versions_objects_are_deleted_past_the_workspace_quota(nc: NATS) -> None:
    """Six versions of acme/net, a quota of 3: the three oldest objects are gone from
    `rp-state`, the three newest (the head among them) are there."""
    store = StateStore(nc.jetstream(), KeyRing.generate(), TIGHT)
    names = [(await store.put_version("acme", "net", _state(i))).object for i in range(1, 7)]
    bucket = await nc.jetstream().object_store(STATE_BUCKET)
    for name in names[:3]:
        with pytest.raises(nats.js.errors.NotFoundError):
            await bucket.get_info(name)
    for name in names[3:]:
        assert (await bucket.get_info(name)).size


async def test_a_phase_past_its_organizations_quota_is_refused_nothing_stored(
    nc: NATS, app: App
) -> None:
    """An organization whose other workspaces' current states fill its quota: a phase's
    first state is refused (422 state-quota-exceeded) and the store is unchanged."""
    quotas = Quotas(state_versions_per_org=2)
    async with served(nc, app, quotas) as client:
        store = StateStore(nc.jetstream(), KeyRing.generate(), quotas)
        for ws in ("a", "b"):
            await app.create_workspace("acme", ws, Workspace(repository="/nowhere"), "alice")
            await store.put_version("acme", ws, _state(1))
        before = await stored_bytes(nc)
        answer = await client.post({"version": 4, "serial": 1, "lineage": "l"}, "L")
        assert answer.status == 422, answer
        assert "state-quota-exceeded" in answer.body
        assert await stored_bytes(nc) == before
