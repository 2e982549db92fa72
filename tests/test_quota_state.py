"""Attack F8 (issue 23, item 6): what a tenant pushes as state is bounded, streamed and
must be a Terraform state of the workspace's lineage.

The review's attack: tenant code in a phase PUT 150 MB fake states (serial 999, lineage
"x") through its own phase's state backend; the shared process grew 165 -> 472 MB and
JetStream 228 MB. Here the same bodies, through the phase's backend and through the TFE
API the CLI pushes to: refused (413 `state-too-large`; 409 `lineage-mismatch`,
`serial-not-newer`; 400 `not-a-state`), the object store unchanged, and the process's
heap not grown by the body. A state under the bound is taken, streamed: the heap does not
grow by its size either. On the old code the backend took every one of them (200), read
whole into memory, and the TFE API held the whole document and state.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import aiohttp
from nats.aio.client import Client as NATS

from events.run import StateVersionCreated
from executor.statebackend import USER
from infra.quotas import Quotas
from services.app.commands import App
from tests.lock_support import Client, FakeJob
from tests.quota_support import (
    MIB,
    peak_memory,
    push_document,
    served,
    state_blocks,
    stored_bytes,
    streamed,
)
from tests.tfe_support import Tfe, a_state, tfe_fixture

__all__ = ["tfe_fixture"]


async def _post_stream(client: Client, blocks: AsyncIterator[bytes]) -> int:
    """POST a streamed body as tenant code would; the status, or 0 if the server cut
    the connection while the body was still being sent."""
    auth = aiohttp.encode_basic_auth(USER, client.backend.password)
    try:
        async with client.session.post(
            client.backend.url + "?ID=L", data=blocks, headers={"Authorization": auth}
        ) as resp:
            await resp.read()
            return resp.status
    except aiohttp.ClientError:
        return 0


async def _versions(app: App, job: FakeJob) -> list[int]:
    envs = await app.store.read(f"rp.run.acme.net.{job.run_id}")
    return [e.event.serial for e in envs if isinstance(e.event, StateVersionCreated)]


async def test_a_150_mb_fake_state_through_the_phase_backend_is_refused_unheld(
    nc: NATS, app: App
) -> None:
    """The review's body (150 MB, serial 999, lineage "x") through the phase's own
    backend: refused at the deployment's bound (64 MiB), never stored, never whole in
    memory (the heap grows by a few chunks, not by the body)."""
    async with served(nc, app) as client:
        before = await stored_bytes(nc)
        with peak_memory() as mem:
            status = await _post_stream(client, streamed(state_blocks(150 * MIB)))
        assert status in (413, 0)
        assert any("state-too-large" in p for p in client.backend.problems)
        assert mem.grown < 24 * MIB, f"the heap grew {mem.grown / MIB:.0f} MiB"
        assert await stored_bytes(nc) == before
        assert await _versions(app, client.job) == []


async def test_a_state_under_the_bound_is_streamed_to_the_store_not_held(
    nc: NATS, app: App
) -> None:
    """A 48 MiB state (under 64 MiB) is taken: received into a file, judged there, sealed
    and stored a chunk at a time. The heap grows far less than the state (the old code
    held it whole, twice: the body and its sealed copy)."""
    async with served(nc, app) as client:
        with peak_memory() as mem:
            status = await _post_stream(client, streamed(state_blocks(48 * MIB, lineage="l")))
        assert status == 200, client.backend.problems
        assert mem.grown < 24 * MIB, f"the heap grew {mem.grown / MIB:.0f} MiB"
        assert await _versions(app, client.job) == [999]


async def test_the_phase_backend_takes_only_a_state_that_continues_the_workspaces(
    nc: NATS, app: App
) -> None:
    """As Terraform's remote backends check: once the workspace has a state, another
    lineage is refused (409 lineage-mismatch), and so is a serial not above the current
    one with other content (409 serial-not-newer); a body that is not a format 4 state
    is 400 not-a-state. None of them reaches the object store."""
    async with served(nc, app) as client:
        first = await client.post({"version": 4, "serial": 1, "lineage": "l"}, "L")
        assert first.status == 200, first.body
        before = await stored_bytes(nc)
        refused = {
            "lineage-mismatch": {"version": 4, "serial": 999, "lineage": "x"},
            "serial-not-newer": {"version": 4, "serial": 1, "lineage": "l", "outputs": {}},
            "not-a-state": {"version": 3, "serial": 5, "lineage": "l"},
        }
        for kind, state in refused.items():
            answer = await client.post(state, "L")
            assert kind in answer.body, (kind, answer)
            assert answer.status == (400 if kind == "not-a-state" else 409)
        assert (await client.post({"serial": 5, "lineage": "l"}, "L")).status == 400
        assert await stored_bytes(nc) == before
        assert (await client.post({"version": 4, "serial": 2, "lineage": "l"}, "L")).status == 200
        assert await _versions(app, client.job) == [1, 2]


# ---------------------------------------------------------------- the TFE API


async def _locked_workspace(tfe: Tfe) -> tuple[str, str]:
    """A CLI workspace of acme, locked by its admin: (its id, the admin's token)."""
    token = (await tfe.org("acme"))["admin"]
    ws_id = await tfe.cli_workspace("acme", "net", token=token)
    assert (await tfe.lock(ws_id, token=token)).status == 200
    return ws_id, token


async def _tfe_push(tfe: Tfe, ws_id: str, token: str, size: int, **kw: object) -> tuple[int, str]:
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/vnd.api+json"}
    path = f"/api/v2/workspaces/{ws_id}/state-versions"
    try:
        async with tfe.client.post(path, data=push_document(size, **kw), headers=headers) as r:  # type: ignore[arg-type]
            return r.status, await r.text()
    except aiohttp.ClientError:
        return 0, ""


async def test_a_huge_state_pushed_through_the_tfe_api_is_refused_unheld(tfe: Tfe) -> None:
    """`terraform state push` of a 70 MiB state (its document, 93 MiB, under the old
    96 MiB body bound, which took it): 413 `state too large`, nothing stored, the heap
    not grown by it; a wrong lineage over a state is 409 as before."""
    ws_id, token = await _locked_workspace(tfe)
    nc = tfe.system.nc
    before = await stored_bytes(nc)
    with peak_memory() as mem:
        status, body = await _tfe_push(tfe, ws_id, token, 70 * MIB)
    assert status in (413, 0), body
    assert status == 0 or "state too large" in body
    assert mem.grown < 24 * MIB, f"the heap grew {mem.grown / MIB:.0f} MiB"
    assert await stored_bytes(nc) == before

    assert (await tfe.push(ws_id, a_state(3, "l"), token=token)).status == 201
    wrong = await tfe.push(ws_id, a_state(999, "x"), token=token)
    assert wrong.status == 409 and "lineage" in json.dumps(wrong.body)


async def test_a_large_state_pushed_through_the_tfe_api_is_streamed(tfe: Tfe) -> None:
    """A 40 MiB state through the TFE API is taken without the API holding its document
    (53 MiB of base64) or the state: the heap grows far less than either."""
    ws_id, token = await _locked_workspace(tfe)
    with peak_memory() as mem:
        status, body = await _tfe_push(tfe, ws_id, token, 40 * MIB, serial=4, lineage="l")
    assert status == 201, body
    assert mem.grown < 24 * MIB, f"the heap grew {mem.grown / MIB:.0f} MiB"


async def test_an_announced_length_past_the_bound_is_refused_before_the_body(
    nc: NATS, app: App
) -> None:
    """A Content-Length past the bound is refused at once: not a byte is read."""
    async with served(nc, app, Quotas(state_max_mb=1)) as client:
        auth = aiohttp.encode_basic_auth(USER, client.backend.password)
        body = b" " * (2 * MIB)
        async with client.session.post(
            client.backend.url + "?ID=L", data=body, headers={"Authorization": auth}
        ) as resp:
            assert resp.status == 413
            assert "state-too-large" in await resp.text()
