"""Ctrl-C in the real Terraform 1.0.3 (`backend "remote"`) against `runplane up --tls`.

Terraform 1.0.3 runs under panicwrap: the process started is a parent that ignores
SIGINT and runs the real CLI as its child, trusting the terminal to deliver SIGINT to the
whole foreground process group. A SIGINT sent to the parent's pid alone never reaches
the CLI (it kept polling its pending run in an earlier attempt at this test), so these
tests signal the group, as a terminal does.

On the first SIGINT the CLI stops following its run, reads it, and if `actions
.is-cancelable` asks "Do you want to cancel the remote operation?" (not with
-auto-approve): "yes" POSTs the cancel action, anything else leaves the run alone.
The TFE side of it (`is-cancelable` per status, cancel / force-cancel answering 409
exactly when not allowed, a held log read ending when its reader goes away) is tested
here too, without Terraform.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
from collections.abc import AsyncIterator, Awaitable, Collection
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from yarl import URL

from events.run import ApproveRun, CancelRun, ClaimPhase, FinishPlan, PlanSummary
from executor.terraform import default_binary
from infra.steplogs import log_subject
from services.surfaces.tfe import logs
from tests.api_support import web_app_of
from tests.helpers import eventually
from tests.tfe_cli_support import (
    BACKEND,
    CLOUD_HCL,
    Cli,
    _newer_terraform,
    cli_fixture,
    ok,
    resources,
)
from tests.tfe_support import Terminal, Tfe, new_run, tfe_fixture, uploaded

__all__ = ["cli_fixture", "tfe_fixture"]


ASK = rb"Do you want to cancel the remote operation\?[\s\S]*?Enter a value:"
QUEUED = rb"Waiting for \d+ run\(s\) to finish before being queued"


def apply(work: Path, cli: Cli, *args: str) -> Terminal:
    """`terraform apply` in `work` on a pseudo-terminal, in a session (group) of its own."""
    argv = [str(default_binary()), f"-chdir={work}", "apply", "-no-color", *args]
    return Terminal(argv, cli.env)


def interrupt(term: Terminal) -> None:
    """Ctrl-C as a terminal sends it: SIGINT to the foreground process group."""
    os.killpg(term.proc.pid, signal.SIGINT)


def copy_of(cli: Cli, work: Path, ws: str, name: str, body: str) -> Path:
    """Another working directory of `work`'s workspace `ws`, initialized as `work` is."""
    other = cli.root / name
    shutil.copytree(work, other)
    (other / "main.tf").write_text(BACKEND.format(host=cli.host, ws=ws) + body)
    return other


async def expect(term: Terminal, pattern: bytes, timeout: float = 90) -> None:
    await asyncio.to_thread(term.expect, pattern, timeout)


async def newest(cli: Cli, ws: str, status: str, *, besides: Collection[str] = ()) -> Any:
    """The workspace's newest run not in `besides`, once it is `status`."""

    async def probe() -> Any:
        for r in await cli.runs(ws):
            if r["id"] not in besides:
                return r if r["status"] == status else {}
        return {}

    return await eventually(probe, timeout=60, interval=0.1, what=f"{ws}'s new run {status}")


# ---------------------------------------------------------------- the TFE side


async def _cli_run(tfe: Tfe) -> tuple[str, str]:
    """A CLI apply run of acme/net (pending): its TFE id and runplane id."""
    ws_id = await tfe.cli_workspace("acme", "net")
    cv, _ = await uploaded(tfe, ws_id, speculative=False)
    tfe_id = (await new_run(tfe, ws_id, cv)).body["data"]["id"]
    return tfe_id, tfe_id.removeprefix("run-").split(".")[2]


async def _actions(tfe: Tfe, tfe_id: str) -> tuple[str, dict[str, bool]]:
    read = await tfe.tfe("GET", f"/api/v2/runs/{tfe_id}")
    attrs = read.body["data"]["attributes"]
    return attrs["status"], {
        k: attrs["actions"][k] for k in ("is-cancelable", "is-force-cancelable")
    }


async def _post(tfe: Tfe, tfe_id: str, action: str, token: str | None = None) -> Any:
    kw: dict[str, Any] = {"token": token} if token else {}
    return await tfe.tfe("POST", f"/api/v2/runs/{tfe_id}/actions/{action}", json={}, **kw)


async def _claim(tfe: Tfe, run_id: str, phase: str, lease: str) -> None:
    claim = ClaimPhase(actor="executor", phase=phase, lease_id=lease, executor_id="exec-1")
    await tfe.app.run_command("acme", "net", run_id, claim)


CANCELABLE = {"is-cancelable": True, "is-force-cancelable": False}
STOPPING = {"is-cancelable": True, "is-force-cancelable": True}
NEITHER = {"is-cancelable": False, "is-force-cancelable": False}


async def test_a_planning_cli_run_is_cancelable_then_force_cancelable_while_it_stops(
    tfe: Tfe,
) -> None:
    await tfe.org("acme")
    tfe_id, run_id = await _cli_run(tfe)
    assert await _actions(tfe, tfe_id) == ("pending", CANCELABLE)
    # force-cancel is for a run already asked to stop: 409 before, the run untouched
    early = await _post(tfe, tfe_id, "force-cancel")
    assert early.status == 409, early.body
    assert early.body["errors"][0]["detail"] == "cancel the run first"
    assert await tfe.app.admit_next("acme", "net") == run_id
    assert await _actions(tfe, tfe_id) == ("plan_queued", CANCELABLE)
    await _claim(tfe, run_id, "plan", "lease-1")
    assert await _actions(tfe, tfe_id) == ("planning", CANCELABLE)

    assert (await _post(tfe, tfe_id, "cancel")).status == 202  # the CLI's "yes"
    state = (await tfe.app.load_run("acme", "net", run_id)).state
    assert state.stop_requested_by == "admin" and state.status == "planning"
    assert await _actions(tfe, tfe_id) == ("planning", STOPPING)
    # asked again, or forced: taken, nothing more recorded (the executor's stop is under way)
    seq = (await tfe.app.load_run("acme", "net", run_id)).seq
    assert (await _post(tfe, tfe_id, "cancel")).status == 202
    assert (await _post(tfe, tfe_id, "force-cancel")).status == 202
    assert (await tfe.app.load_run("acme", "net", run_id)).seq == seq

    # the executor interrupted Terraform and reports it: canceled, nothing left to cancel
    stopped = CancelRun(actor="executor:exec-1", lease_id="lease-1")
    await tfe.app.run_command("acme", "net", run_id, stopped)
    assert await _actions(tfe, tfe_id) == ("canceled", NEITHER)
    for action in ("cancel", "force-cancel"):
        refused = await _post(tfe, tfe_id, action)
        assert refused.status == 409, (action, refused.body)
        assert refused.body["errors"][0]["detail"] == "the run is canceled: nothing to cancel"
    plan_id = (await tfe.tfe("GET", f"/api/v2/runs/{tfe_id}")).body["data"]["relationships"]
    plan = await tfe.tfe("GET", f"/api/v2/plans/{plan_id['plan']['data']['id']}")
    assert plan.body["data"]["attributes"]["status"] == "canceled"


async def test_an_applying_cli_run_is_not_cancelable_and_a_cancel_is_409(tfe: Tfe) -> None:
    """runplane never interrupts an apply; the CLI, told `is-cancelable` false, does not
    ask (its header says an apply it stops following keeps running)."""
    await tfe.org("acme")
    tfe_id, run_id = await _cli_run(tfe)
    assert await tfe.app.admit_next("acme", "net") == run_id
    await _claim(tfe, run_id, "plan", "lease-1")
    finished = FinishPlan(
        actor="executor",
        lease_id="lease-1",
        commit="",
        has_changes=True,
        summary=PlanSummary(add=1),
        plan_digest="d1",
    )
    await tfe.app.run_command("acme", "net", run_id, finished)
    assert await _actions(tfe, tfe_id) == ("planned", NEITHER)
    waiting = await _post(tfe, tfe_id, "cancel")
    assert waiting.status == 409
    assert "discard it instead" in waiting.body["errors"][0]["detail"]
    await tfe.app.run_command("acme", "net", run_id, ApproveRun(actor="admin"))
    assert await _actions(tfe, tfe_id) == ("apply_queued", CANCELABLE)
    await _claim(tfe, run_id, "apply", "lease-2")
    assert await _actions(tfe, tfe_id) == ("applying", NEITHER)
    seq = (await tfe.app.load_run("acme", "net", run_id)).seq
    for action in ("cancel", "force-cancel"):
        refused = await _post(tfe, tfe_id, action)
        assert refused.status == 409, (action, refused.body)
        assert "never interrupts an apply" in refused.body["errors"][0]["detail"]
    after = await tfe.app.load_run("acme", "net", run_id)
    assert after.seq == seq and after.state.status == "applying"


async def test_another_organizations_token_cancels_no_cli_run(tfe: Tfe) -> None:
    await tfe.org("acme")
    evil = await tfe.org("evil")
    tfe_id, run_id = await _cli_run(tfe)
    assert await tfe.app.admit_next("acme", "net") == run_id
    await _claim(tfe, run_id, "plan", "lease-1")
    for token in (evil["admin"], evil["operator"]):
        for action in ("cancel", "force-cancel"):
            refused = await _post(tfe, tfe_id, action, token=token)
            assert refused.status == 404, (action, refused.body)
    viewer = await tfe.post("/api/v1/orgs/acme/tokens", json={"user": "v", "role": "viewer"})
    for action in ("cancel", "force-cancel"):
        refused = await _post(tfe, tfe_id, action, token=viewer.body["token"])
        assert refused.status == 403, (action, refused.body)
    state = (await tfe.app.load_run("acme", "net", run_id)).state
    assert state.status == "planning" and not state.stop_requested_by


@asynccontextmanager
async def served_as_runplane_serves(tfe: Tfe) -> AsyncIterator[str]:
    """tfe's API on a second app run as services/root/runtime.py runs it: aiohttp's test
    server cancels a handler whose client went away, runplane's runner does not."""
    web_app = web_app_of(tfe.system, tfe.api.projector)
    runner = web.AppRunner(web_app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        port = runner.addresses[0][1]
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def test_a_held_log_read_ends_when_its_reader_goes_away(tfe: Tfe) -> None:
    """The CLI's Ctrl-C cancels its log read; a read held for nobody must not keep its
    subscription and its run reads going for the rest of HOLD_S."""
    await tfe.org("acme")
    tfe_id, run_id = await _cli_run(tfe)
    run = (await tfe.tfe("GET", f"/api/v2/runs/{tfe_id}")).body["data"]
    plan_id = run["relationships"]["plan"]["data"]["id"]
    attrs = (await tfe.tfe("GET", f"/api/v2/plans/{plan_id}")).body["data"]["attributes"]
    path = URL(attrs["log-read-url"]).path
    nc, subject = tfe.app.store.nc, log_subject(run_id, "plan", "*")

    async def holding() -> int:
        return sum(1 for sub in nc._subs.values() if sub.subject == subject)

    async with served_as_runplane_serves(tfe) as base, aiohttp.ClientSession() as client:

        async def read() -> bytes:
            async with client.get(f"{base}{path}?offset=1&limit=1024") as resp:
                return await resp.read()

        reads = [asyncio.create_task(read()) for _ in range(3)]
        await eventually(lambda: _equal(holding(), 3), what="three reads held")
        loop = asyncio.get_running_loop()
        gone_at = loop.time()
        for task in reads:
            task.cancel()
        await asyncio.gather(*reads, return_exceptions=True)
        await eventually(lambda: _equal(holding(), 0), timeout=3, what="the reads to end")
        assert loop.time() - gone_at < logs.HOLD_S / 2


async def _equal(value: Awaitable[int], wanted: int) -> bool:
    return await value == wanted


# ---------------------------------------------------------------- the real CLI


@pytest.mark.terraform
@pytest.mark.slow
async def test_ctrl_c_on_a_queued_cli_run_asks_and_only_yes_cancels_it(cli: Cli) -> None:
    """Applies wait behind one held at its prompt; Ctrl-C on each: "no" leaves its run
    in the queue (it runs later and applies), "yes" cancels its run (by the CLI's user),
    a second Ctrl-C exits at once; the queue moves past the canceled runs."""
    first = cli.workdir("queue", resources(1))
    ok(cli.tf(first, "init", "-input=false", "-no-color"))
    kept = copy_of(cli, first, "queue", "queue-kept", resources(2))
    dropped = copy_of(cli, first, "queue", "queue-dropped", resources(3))
    holder = apply(first, cli)
    terms = [holder]
    try:
        await expect(holder, rb"Enter a value:")  # its plan waits for a "yes"
        held = await newest(cli, "queue", "awaiting_approval")

        no = apply(kept, cli)
        terms.append(no)
        await expect(no, QUEUED)
        waiting = await newest(cli, "queue", "pending", besides={held["id"]})
        interrupt(no)
        await expect(no, ASK)
        no.send("no\n")
        await expect(no, rb"The remote operation was not cancelled\.")
        no_code = await asyncio.to_thread(no.finish)

        yes = apply(dropped, cli)
        terms.append(yes)
        await expect(yes, QUEUED)
        canceled = await newest(cli, "queue", "pending", besides={held["id"], waiting["id"]})
        interrupt(yes)
        await expect(yes, ASK)
        yes.send("yes\n")
        await expect(yes, rb"The remote operation was successfully cancelled\.")
        yes_code = await asyncio.to_thread(yes.finish)
        run = await cli.api.run_to(canceled["id"], {"canceled"})

        # a second Ctrl-C at the question exits at once, canceling nothing: the run of a
        # CLI gone away is canceled in runplane
        twice = apply(dropped, cli)
        terms.append(twice)
        await expect(twice, QUEUED)
        seen = {held["id"], waiting["id"], canceled["id"]}
        left = await newest(cli, "queue", "pending", besides=seen)
        interrupt(twice)
        await expect(twice, ASK)
        interrupt(twice)
        assert await asyncio.to_thread(twice.finish, 10) == 1, twice.text()
        # which of the CLI's two listeners takes the second SIGINT first is a race: one
        # says it exits at once, the other that the question was interrupted
        said = ("Two interrupts received. Exiting immediately.", "Failed asking to cancel")
        assert any(words in twice.text() for words in said), twice.text()
        assert (await cli.api.ok("GET", f"/api/v1/orgs/acme/runs/{left['id']}"))[
            "status"
        ] == "pending"
        await cli.api.ok("POST", f"/api/v1/orgs/acme/runs/{left['id']}/cancel", {})
        assert (await cli.api.ok("GET", f"/api/v1/orgs/acme/runs/{waiting['id']}"))[
            "status"
        ] == "pending"
        holder.send("yes\n")
        await expect(holder, rb"Apply complete! Resources: 1 added, 0 changed, 0 destroyed\.")
        assert await asyncio.to_thread(holder.finish) == 0, holder.text()
    finally:
        for term in terms:
            term.close()
    # Terraform's own words, and its exit status: 0, as its backend reads the run before
    # canceling it and fails the operation only for a run already canceled or errored
    # (internal/backend/remote/backend.go, Operation)
    assert no_code == 0 and "Interrupt received." in no.text(), no.text()
    assert yes_code == 0 and "Interrupt received." in yes.text(), yes.text()
    assert run["reason"] == "canceled from the Terraform CLI", run
    events = await cli.api.ok("GET", f"/api/v1/orgs/acme/runs/{canceled['id']}/events")
    last = events["items"][-1]
    assert (last["type"], last["actor"]) == ("run.canceled", "alice"), events
    # the run left in the queue plans after the first and waits for an approval (its
    # CLI is gone): approved in runplane, it applies
    await cli.api.run_to(waiting["id"], {"awaiting_approval"})
    await cli.api.ok(
        "POST", f"/api/v1/orgs/acme/runs/{waiting['id']}/approve", {"acknowledged": []}
    )
    await cli.api.run_to(waiting["id"], {"applied"})
    state = json.loads(ok(cli.tf(kept, "state", "pull")))
    assert sorted(r["name"] for r in state["resources"]) == ["r0", "r1"]
    await released(cli, "queue")


async def released(cli: Cli, ws: str) -> None:
    """No run active or queued on the workspace, and no lock left on it."""

    async def probe() -> bool:
        w = await cli.api.ok("GET", f"/api/v1/orgs/acme/workspaces/{ws}")
        return w["lock"] is None and w["active_run"] is None and w["queue"] == []

    await eventually(probe, timeout=30, interval=0.1, what=f"{ws} released")


SLOW_APPLY = """\
resource "null_resource" "slow" {
  provisioner "local-exec" {
    command = "sleep 6"
  }
}
"""


@pytest.mark.terraform
@pytest.mark.slow
async def test_ctrl_c_during_a_cli_apply_stops_the_cli_and_the_apply_completes(cli: Cli) -> None:
    """Terraform says it in its header: "If the apply started it will stop streaming the
    logs, but will not stop the apply running remotely". runplane never interrupts an
    apply: the run is not cancelable, the CLI does not ask, the apply writes its state
    and releases the workspace."""
    work = cli.workdir("slow", SLOW_APPLY)
    ok(cli.tf(work, "init", "-input=false", "-no-color"))
    term = apply(work, cli, "-auto-approve")
    try:
        await expect(term, rb"null_resource\.slow: Creating\.\.\.")  # streamed, as it runs
        run = await newest(cli, "slow", "applying")
        interrupt(term)
        code = await asyncio.to_thread(term.finish, 30)
    finally:
        term.close()
    text = term.text()
    assert code == 0 and "Interrupt received." in text, text
    assert "cancel the remote operation" not in text and "Apply complete" not in text, text
    done = await cli.api.run_to(run["id"], {"applied"})
    assert done["apply_summary"]["add"] == 1, done
    state = json.loads(ok(cli.tf(work, "state", "pull")))
    assert [r["name"] for r in state["resources"]] == ["slow"] and state["serial"] >= 1
    await released(cli, "slow")


GATE = {
    "steps": [
        {"number": 50, "kind": "custom", "name": "gate", "command": "sleep 60"},
        {"number": 100, "kind": "plan"},
        {"number": 150, "kind": "approval"},
        {"number": 200, "kind": "apply"},
    ]
}


@pytest.mark.terraform
@pytest.mark.slow
async def test_ctrl_c_while_a_cli_run_plans_stops_it_on_its_executor(cli: Cli) -> None:
    """A run its executor is working on (here a custom step before its plan, which the
    CLI sees as `planning`): "yes" asks it to stop, the executor interrupts the step and
    reports the run canceled, and the workspace is free for the next run."""
    await cli.api.ok("PUT", "/api/v1/orgs/acme/templates/gate", GATE)
    work = cli.workdir("gated", resources(1))
    ok(cli.tf(work, "init", "-input=false", "-no-color"))
    path = "/api/v1/orgs/acme/workspaces/gated/settings"
    await cli.api.ok("PATCH", path, {"templates": {"apply": "gate"}})
    term = apply(work, cli)
    try:
        run = await newest(cli, "gated", "running")
        await expect(term, rb"Waiting for the plan to start")
        interrupt(term)
        await expect(term, ASK)
        term.send("yes\n")
        await expect(term, rb"The remote operation was successfully cancelled\.")
        code = await asyncio.to_thread(term.finish, 30)
    finally:
        term.close()
    assert code == 0, term.text()
    done = await cli.api.run_to(run["id"], {"canceled"})
    assert done["reason"] == "canceled from the Terraform CLI", done
    events = await cli.api.ok("GET", f"/api/v1/orgs/acme/runs/{run['id']}/events")
    kinds = [(e["type"], e["actor"]) for e in events["items"]]
    assert ("run.stop_requested", "alice") in kinds, kinds
    assert kinds[-1][0] == "run.canceled" and kinds[-1][1].startswith("executor:"), kinds
    await released(cli, "gated")
    # the next run of the workspace runs: plain template again, applied from the CLI
    await cli.api.ok("PATCH", path, {"templates": {}})
    out = ok(await asyncio.to_thread(cli.tf, work, "apply", "-auto-approve", "-no-color"))
    assert "Apply complete! Resources: 1 added, 0 changed, 0 destroyed." in out, out


@pytest.mark.terraform
@pytest.mark.slow
async def test_ctrl_c_on_a_queued_run_of_a_cloud_block_cancels_it(cli: Cli) -> None:
    """A newer Terraform's `cloud` block (1.11 here, where the machine has one; no
    panicwrap there) asks and cancels the same way."""
    newer = _newer_terraform()
    first = cli.root / "cloudq"
    first.mkdir()
    hcl = CLOUD_HCL.format(host=cli.host, ws="cloudq").replace('output "greeting"', "# ", 1)
    (first / "main.tf").write_text(hcl + resources(1))
    init = [newer, f"-chdir={first}", "init", "-input=false", "-no-color"]
    ok(await asyncio.to_thread(subprocess.run, init, env=cli.env, capture_output=True, text=True))
    settings = {"terraform_binary": newer}
    await cli.api.ok("PATCH", "/api/v1/orgs/acme/workspaces/cloudq/settings", settings)
    second = cli.root / "cloudq-2"
    shutil.copytree(first, second)
    (second / "main.tf").write_text(hcl + resources(2))

    holder = Terminal([newer, f"-chdir={first}", "apply", "-no-color"], cli.env)
    terms = [holder]
    try:
        await expect(holder, rb"Enter a value:")
        held = await newest(cli, "cloudq", "awaiting_approval")
        term = Terminal([newer, f"-chdir={second}", "apply", "-no-color"], cli.env)
        terms.append(term)
        await expect(term, QUEUED)
        queued = await newest(cli, "cloudq", "pending", besides={held["id"]})
        interrupt(term)
        await expect(term, ASK)
        term.send("yes\n")
        await expect(term, rb"The remote operation was successfully cancelled\.")
        code = await asyncio.to_thread(term.finish)
        done = await cli.api.run_to(queued["id"], {"canceled"})
        holder.send("yes\n")
        await expect(holder, rb"Apply complete! Resources: 1 added, 0 changed, 0 destroyed\.")
        assert await asyncio.to_thread(holder.finish) == 0, holder.text()
    finally:
        for t in terms:
            t.close()
    assert code == 0 and "Interrupt received." in term.text(), term.text()
    assert (done["created_by"], done["reason"]) == ("alice", "canceled from the Terraform CLI")
    await released(cli, "cloudq")
