"""Change review and per-resource apply states end to end: real Terraform with the fake
provider (tests/provider), a real executor, nats-server, projector and HTTP API."""

from __future__ import annotations

import io
import json
import secrets
from pathlib import Path
from typing import Any

import nats.js.errors
import pytest
from nats.aio.client import Client as NATS

from events.run import Workspace
from executor import Executor
from projections import ReadModel, replay
from services.app.commands import App
from tests.api_support import Http, http_fixture  # noqa: F401  # registers the `http` fixture
from tests.changes_support import DRIFT_TF, applied_run, commit_files
from tests.changes_support import executor as executor  # conftest's, with the fake provider
from tests.executor_support import Harness
from tests.helpers import eventually
from tests.provider import REQUIRED_PROVIDERS

pytestmark = pytest.mark.terraform

V1 = "/api/v1/orgs/acme"


def main_tf(canary: str, version: int) -> str:
    """Version 1 builds the state; version 2, planned against it, deletes `old`, replaces
    `rep` (its name forces it), updates `web` and `db`, creates `new` and `net.extra`."""
    v2 = version == 2
    return REQUIRED_PROVIDERS + (
        f'variable "token" {{\n  type      = string\n  sensitive = true\n'
        f'  default   = "{canary}-var-{version}"\n}}\n'
        + ("" if v2 else 'resource "fake_thing" "old" { name = "old" }\n')
        + f'resource "fake_thing" "rep" {{\n  name  = "rep-{version}"\n  value = "kept"\n}}\n'
        + 'resource "fake_thing" "web" {\n  name  = "web"\n'
        + f'  value = "v{version}"\n'
        + f'  tags  = {{ env = "{"prod" if v2 else "dev"}", team = "a" }}\n}}\n'
        + 'resource "fake_thing" "db" {\n  name   = "db"\n  value  = var.token\n'
        + f'  secret = "{canary}-attr-{version}"\n}}\n'
        + ('resource "fake_thing" "new" { name = "new" }\n' if v2 else "")
        + 'module "net" {\n  source = "./net"\n'
        + f"  extra  = {'true' if v2 else 'false'}\n}}\n"
    )


NET_TF = REQUIRED_PROVIDERS + (
    'variable "extra" { type = bool }\n'
    'resource "fake_thing" "edge" { name = "edge" }\n'
    'resource "fake_thing" "extra" {\n  count = var.extra ? 1 : 0\n  name  = "extra"\n}\n'
)

FAILING_TF = (
    REQUIRED_PROVIDERS
    + """
resource "fake_thing" "first" { name = "first" }
resource "fake_thing" "second" {
  name       = "second"
  fail       = true
  depends_on = [fake_thing.first]
}
resource "fake_thing" "third" {
  name       = "third"
  depends_on = [fake_thing.second]
}
resource "fake_thing" "slow" {
  name          = "slow"
  sleep_seconds = 2
}
"""
)


@pytest.fixture
def h(nc: NATS, app: App) -> Harness:
    return Harness(nc, app)


async def read(http: Http, path: str) -> Any:
    """GET once the projection holds everything written so far."""
    seq = await http.app.store.last_seq()
    answer = await http.get(path, headers={"RP-Min-Seq": str(seq)})
    assert answer.status == 200, answer.body
    return answer.body


async def two_runs(h: Harness, repo: Path, canary: str) -> str:
    """Apply version 1, then plan version 2; the second run, awaiting approval."""
    commit_files(repo, {"main.tf": main_tf(canary, 1), "net/main.tf": NET_TF})
    await h.workspace("net", Workspace(repository=str(repo)))
    await applied_run(h, "net")
    commit_files(repo, {"main.tf": main_tf(canary, 2)})
    run_id = await h.start_run("net")
    await h.reaches("net", run_id, "awaiting_approval")
    return run_id


def _group(review: dict[str, Any], action: str) -> dict[str, Any]:
    groups: list[dict[str, Any]] = [g for g in review["groups"] if g["action"] == action]
    assert len(groups) == 1, review["groups"]
    return groups[0]


def _attrs(item: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {a["name"]: a for a in item["attributes"]}


async def test_one_plan_that_deletes_replaces_updates_and_creates_is_reviewed_in_groups(
    h: Harness, repo: Path, executor: Executor, http: Http, tmp_path: Path
) -> None:
    """Groups in reading order with counts, replace_paths, modules, unknown and sensitive
    values; after approval each resource is done, the replacement in two stages."""
    canary = f"canary-{secrets.token_hex(8)}"
    run_id = await two_runs(h, repo, canary)

    review = await read(http, f"{V1}/runs/{run_id}/changes")
    assert review["summary"] == {"delete": 1, "replace": 1, "update": 2, "create": 2}
    assert review["summary_text"] == "1 delete · 1 replace · 2 update · 2 create"
    assert [(g["action"], g["title"], g["count"]) for g in review["groups"]] == [
        ("delete", "will be deleted", 1),
        ("replace", "will be replaced", 1),
        ("update", "will be updated", 2),
        ("create", "will be created", 2),
    ]
    (old,) = _group(review, "delete")["items"]
    assert (old["address"], old["type"], old["module"]) == ("fake_thing.old", "fake_thing", None)
    (rep,) = _group(review, "replace")["items"]
    assert rep["replace_paths"] == ["name"]
    name = _attrs(rep)["name"]
    assert (name["before"], name["after"], name["forces_replacement"]) == ("rep-1", "rep-2", True)
    assert _attrs(rep)["id"]["after"] == "(known after apply)"
    updates = {i["address"]: _attrs(i) for i in _group(review, "update")["items"]}
    assert set(updates) == {"fake_thing.web", "fake_thing.db"}
    assert updates["fake_thing.web"]["tags"]["after"] == {"env": "prod", "team": "a"}
    assert not updates["fake_thing.web"]["value"]["forces_replacement"]
    for attr in ("value", "secret"):  # a sensitive variable and a sensitive attribute
        assert updates["fake_thing.db"][attr]["before"] == "(sensitive)"
        assert updates["fake_thing.db"][attr]["after"] == "(sensitive)"
    created = {i["address"]: i for i in _group(review, "create")["items"]}
    assert set(created) == {"fake_thing.new", "module.net.fake_thing.extra[0]"}
    assert created["module.net.fake_thing.extra[0]"]["module"] == "module.net"

    await h.approve("net", run_id)
    await h.reaches("net", run_id, "applied")
    resources = {
        r["address"]: r for r in (await read(http, f"{V1}/runs/{run_id}/resources"))["items"]
    }
    assert set(resources) == {
        a for g in review["groups"] for a in (i["address"] for i in g["items"])
    }
    assert {r["state"] for r in resources.values()} == {"done"}
    assert resources["fake_thing.rep"]["stages"] == [
        {"action": "delete", "state": "done"},
        {"action": "create", "state": "done"},
    ]
    assert resources["fake_thing.old"]["stages"] == [{"action": "delete", "state": "done"}]
    assert await replay(http.app.store.nc, tmp_path / "fresh.db") == await http.app.store.last_seq()
    async with await ReadModel.open(tmp_path / "fresh.db") as fresh:
        assert await fresh.dump() == await http.api.read.dump()  # a rebuild is a replay


async def test_a_drift_run_lists_what_changed_outside_terraform(
    h: Harness, repo: Path, executor: Executor, http: Http, tmp_path: Path
) -> None:
    """A thing edited behind Terraform's back shows as an update of a drift run."""
    store = tmp_path / "things"
    provider = f'provider "fake" {{\n  store = "{store}"\n}}\n'
    commit_files(repo, {"main.tf": provider + DRIFT_TF})
    await h.workspace("net", Workspace(repository=str(repo)))
    await applied_run(h, "net")
    (store / "a.json").write_text(json.dumps({"id": "a", "name": "a", "value": "edited"}))

    run_id = await h.start_run("net", run_type="drift")
    await h.reaches("net", run_id, "drifted")
    review = await read(http, f"{V1}/runs/{run_id}/changes")
    assert review["summary_text"] == "1 update"
    (item,) = _group(review, "update")["items"]
    assert item["address"] == "fake_thing.a"
    assert _attrs(item)["value"] == {
        "name": "value",
        "before": "planned",
        "after": "edited",
        "forces_replacement": False,
    }


async def test_a_failing_resource_fails_the_run_and_stops_what_depends_on_it(
    h: Harness, repo: Path, executor: Executor, http: Http
) -> None:
    """States arrive while Terraform runs; the failed resource carries Terraform's error,
    the one after it is not_applied, and the run fails with the resource's error."""
    commit_files(repo, {"main.tf": FAILING_TF})
    await h.workspace("net", Workspace(repository=str(repo)))
    run_id = await h.start_run("net")
    await h.reaches("net", run_id, "awaiting_approval")
    pending = await read(http, f"{V1}/runs/{run_id}/resources")
    assert pending["items"] == []  # nothing is pending before approval
    await h.approve("net", run_id)

    async def mid_apply() -> dict[str, str]:
        states = await _states(http, run_id)
        assert states.get("fake_thing.slow") == "applying", states
        assert states.get("fake_thing.first") == "done", states
        assert states.get("fake_thing.third") == "pending", states
        return states

    await eventually(mid_apply, timeout=30, what="live states while slow is applying")
    failed = await h.reaches("net", run_id, "failed")
    assert failed.reason == "apply_failed"
    assert "fake_thing.second: Error: fake_thing second failed on purpose" in failed.error_message

    items = {r["address"]: r for r in (await read(http, f"{V1}/runs/{run_id}/resources"))["items"]}
    assert {a: r["state"] for a, r in items.items()} == {
        "fake_thing.first": "done",
        "fake_thing.second": "failed",
        "fake_thing.third": "not_applied",
        "fake_thing.slow": "done",
    }
    assert items["fake_thing.second"]["error"].startswith("Error: fake_thing second failed")
    assert "The resource sets fail = true." in items["fake_thing.second"]["error"]


async def _states(http: Http, run_id: str) -> dict[str, str]:
    answer = await http.get(f"{V1}/runs/{run_id}/resources")
    return {r["address"]: r["state"] for r in answer.body["items"]}


async def test_a_sensitive_value_is_found_nowhere(
    h: Harness, repo: Path, executor: Executor, http: Http, nc: NATS, tmp_path: Path
) -> None:
    """A sensitive variable's and a sensitive attribute's values, planned, changed and
    applied, are in no stream message, no object, no read-model row and no file runplane
    wrote (the repository, which holds them, aside)."""
    canary = f"canary-{secrets.token_hex(8)}"
    run_id = await two_runs(h, repo, canary)
    await h.approve("net", run_id)
    await h.reaches("net", run_id, "applied")
    await read(http, f"{V1}/runs/{run_id}")  # the projection holds every event

    needle = canary.encode()
    messages = await stream_messages(nc)
    assert all(messages[s] for s in ("RP_EVENTS", "RP_LOGS", "RP_HEARTBEATS"))
    assert [s for s, msgs in messages.items() if any(needle in m for m in msgs)] == []
    objects = await stored_objects(nc)
    assert {name.split("/")[0] for name in objects} >= {"rp-plans", "rp-state", "rp-logs"}
    assert [name for name, data in objects.items() if needle in data] == []
    rows = await http.api.read.dump()
    assert [t for t, table in rows.items() if needle in repr(table).encode()] == []
    files = [p for p in tmp_path.rglob("*") if p.is_file() and not p.is_relative_to(repo)]
    assert files and [str(p) for p in files if needle in p.read_bytes()] == []


async def stream_messages(nc: NATS) -> dict[str, list[bytes]]:
    """Every stored message (body and headers) of every stream, by stream."""
    js = nc.jetstream()
    found: dict[str, list[bytes]] = {}
    for info in await js.streams_info():
        name, state = str(info.config.name), info.state
        found[name] = []
        for seq in range(state.first_seq, state.last_seq + 1) if state.messages else ():
            try:
                msg = await js.get_msg(name, seq)
            except nats.js.errors.NotFoundError:  # deleted: an acked work-queue message
                continue
            found[name].append((msg.data or b"") + repr(msg.headers).encode())
    return found


async def stored_objects(nc: NATS) -> dict[str, bytes]:
    """Every object of every object store bucket, reassembled, by `bucket/name`."""
    js = nc.jetstream()
    found = {}
    for info in await js.streams_info():
        if not str(info.config.name).startswith("OBJ_"):
            continue
        bucket = str(info.config.name).removeprefix("OBJ_")
        store = await js.object_store(bucket)
        try:
            listed = await store.list(ignore_deletes=True)
        except nats.js.errors.NotFoundError:  # an empty bucket (rp-snapshots, at first)
            continue
        for obj in listed:
            buf = io.BytesIO()
            await store.get(obj.name, writeinto=buf)
            found[f"{bucket}/{obj.name}"] = buf.getvalue()
    return found
