"""The contract of the TFE remote operations: configuration versions, runs, plans,
applies and their logs, as go-tfe v0.15.0 (Terraform 1.0.3's) calls them and reads their
answers (`configuration_version.go`, `run.go`, `plan.go`, `apply.go`, `logreader.go`).
No executor here: runs stay where their creation leaves them (docs/tfe-api.md)."""

from __future__ import annotations

import asyncio
import hashlib

import pytest
from yarl import URL

from events.run import Status
from infra.steplogs import live_headers, log_subject
from services.surfaces.tfe import configs
from services.surfaces.tfe.context import TFE
from tests.helpers import eventually
from tests.tfe_support import (
    JSONAPI,
    Tfe,
    archive,
    new_config,
    new_run,
    new_run_as,
    put,
    tfe_fixture,
    uploaded,
)

__all__ = ["tfe_fixture"]

RUN_ACTIONS = {"is-cancelable", "is-confirmable", "is-discardable", "is-force-cancelable"}
RUN_PERMISSIONS = {
    "can-apply",
    "can-cancel",
    "can-discard",
    "can-force-cancel",
    "can-force-execute",
}
RUN_STATUSES = {  # go-tfe v0.15.0 run.go
    "applied", "apply_queued", "applying", "canceled", "confirmed", "cost_estimated",
    "cost_estimating", "discarded", "errored", "pending", "plan_queued", "planned",
    "planned_and_finished", "planning", "policy_checked", "policy_checking",
    "policy_override", "policy_soft_failed",
}  # fmt: skip


async def test_a_configuration_version_is_created_uploaded_without_a_token_and_polled(
    tfe: Tfe,
) -> None:
    await tfe.org("acme")
    ws_id = await tfe.cli_workspace("acme", "net")
    cv = await new_config(tfe, ws_id, speculative=True)
    assert cv["type"] == "configuration-versions"
    attrs = cv["attributes"]
    assert (attrs["status"], attrs["speculative"], attrs["source"]) == ("pending", True, "tfe-api")
    url = URL(attrs["upload-url"])
    assert url.is_absolute() and url.path.startswith(configs.UPLOAD_PATH)

    read = await tfe.tfe("GET", f"/api/v2/configuration-versions/{cv['id']}")
    assert read.status == 200 and read.content_type == JSONAPI
    assert read.body["data"]["attributes"]["status"] == "pending"
    assert "upload-url" not in read.body["data"]["attributes"]  # only in the create's answer

    assert (await put(tfe, str(url), archive()))[0] == 200
    read = await tfe.tfe("GET", f"/api/v2/configuration-versions/{cv['id']}")
    assert read.body["data"]["attributes"]["status"] == "uploaded"
    again, body = await put(tfe, str(url), archive({"main.tf": b"# other\n"}))
    assert again == 409 and body["errors"][0]["status"] == "409"


async def test_an_upload_url_altered_or_of_another_kind_opens_nothing(tfe: Tfe) -> None:
    await tfe.org("acme")
    ws_id = await tfe.cli_workspace("acme", "net")
    cv = await new_config(tfe, ws_id, speculative=True)
    url = cv["attributes"]["upload-url"]
    payload, mac = url.rsplit("/", 1)[1].split(".")
    tampered = url.rsplit("/", 1)[0] + f"/{payload}.{mac[:-2]}{'AA' if mac[-2:] != 'AA' else 'BB'}"
    assert (await put(tfe, tampered, archive()))[0] == 404
    # a capability of another kind (a log's) for the very same version
    other_kind = tfe.client.app[TFE].need_signer().sign("plan-log", "acme", cv["id"], 60)
    assert (await put(tfe, configs.UPLOAD_PATH + other_kind, archive()))[0] == 404
    read = await tfe.tfe("GET", f"/api/v2/configuration-versions/{cv['id']}")
    assert read.body["data"]["attributes"]["status"] == "pending"


async def test_an_upload_past_the_cap_is_a_clear_422(
    tfe: Tfe, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(configs, "MAX_UPLOAD", 64 * 1024)
    await tfe.org("acme")
    ws_id = await tfe.cli_workspace("acme", "net")
    cv = await new_config(tfe, ws_id, speculative=True)
    status, body = await put(tfe, cv["attributes"]["upload-url"], bytes(64 * 1024 + 1))
    assert status == 422
    assert body["errors"][0]["title"] == "configuration too large"
    read = await tfe.tfe("GET", f"/api/v2/configuration-versions/{cv['id']}")
    assert read.body["data"]["attributes"]["status"] == "pending"


async def test_a_run_of_an_upload_records_cause_source_digest_and_options(tfe: Tfe) -> None:
    await tfe.org("acme")
    ws_id = await tfe.cli_workspace("acme", "net")
    cv, body = await uploaded(tfe, ws_id, speculative=False)
    a = await new_run(
        tfe,
        ws_id,
        cv,
        **{
            "message": "from the CLI",
            "refresh-only": False,
            "target-addrs": ["null_resource.a"],
            "replace-addrs": ['module.m["k"].null_resource.b[0]'],
        },
    )
    assert a.status == 201, a.body
    run = a.body["data"]
    assert run["type"] == "runs" and run["id"].startswith("run-acme.net.")
    attrs = run["attributes"]
    assert attrs["status"] in RUN_STATUSES and attrs["status"] == "pending"
    assert set(attrs["actions"]) == RUN_ACTIONS and set(attrs["permissions"]) == RUN_PERMISSIONS
    assert attrs["target-addrs"] == ["null_resource.a"]
    assert attrs["is-destroy"] is False and attrs["message"] == "from the CLI"
    rels = run["relationships"]
    assert rels["workspace"]["data"] == {"type": "workspaces", "id": ws_id}
    assert rels["configuration-version"]["data"]["id"] == cv
    assert rels["plan"]["data"]["type"] == "plans" and rels["apply"]["data"]["type"] == "applies"
    assert rels["policy-checks"]["data"] == [] and rels["cost-estimate"]["data"] is None

    _, ws, run_id = run["id"].removeprefix("run-").split(".")
    state = (await tfe.app.load_run("acme", ws, run_id)).state
    assert state.run_type == "apply" and not state.speculative
    assert state.cause is not None and (state.cause.kind, state.cause.user) == ("cli", "admin")
    assert state.source is not None and state.source.id == cv
    assert state.source.digest == hashlib.sha256(body).hexdigest()
    assert state.source.size == len(body)
    assert state.options is not None and state.options.confirm  # waits for the CLI's yes
    assert state.options.replaces == ['module.m["k"].null_resource.b[0]']


async def test_a_speculative_upload_makes_a_plan_and_is_destroy_a_destroy(tfe: Tfe) -> None:
    await tfe.org("acme")
    ws_id = await tfe.cli_workspace("acme", "net")
    cv, _ = await uploaded(tfe, ws_id, speculative=True)
    plan = (await new_run(tfe, ws_id, cv, **{"is-destroy": True})).body["data"]
    _, _, run_id = plan["id"].removeprefix("run-").split(".")
    state = (await tfe.app.load_run("acme", "net", run_id)).state
    assert (state.run_type, state.speculative) == ("plan", True)
    assert state.options is not None and state.options.destroy and not state.options.confirm
    assert plan["attributes"]["is-destroy"] is True

    cv2, _ = await uploaded(tfe, ws_id, speculative=False)
    destroy = (await new_run(tfe, ws_id, cv2, **{"is-destroy": True})).body["data"]
    _, _, run2 = destroy["id"].removeprefix("run-").split(".")
    assert (await tfe.app.load_run("acme", "net", run2)).state.run_type == "destroy"


async def test_a_run_is_refused_for_a_pending_foreign_or_bad_request(tfe: Tfe) -> None:
    await tfe.org("acme")
    ws_id = await tfe.cli_workspace("acme", "net")
    other_id = await tfe.cli_workspace("acme", "other")
    pending = (await new_config(tfe, ws_id, speculative=True))["id"]
    assert (await new_run(tfe, ws_id, pending)).status == 409
    cv, _ = await uploaded(tfe, other_id)
    assert (await new_run(tfe, ws_id, cv)).status == 404  # another workspace's upload
    mine, _ = await uploaded(tfe, ws_id)
    for bad in (["-destroy"], ["a.b -lock=false"], ["a.b\n-auto-approve"]):
        a = await new_run(tfe, ws_id, mine, **{"target-addrs": bad})
        assert a.status == 422, (bad, a.body)
        assert a.body["errors"][0]["status"] == "422"
    assert (await new_run(tfe, ws_id, mine, **{"refresh-only": "yes"})).status == 422


async def test_read_actions_and_run_events_of_a_waiting_run(tfe: Tfe) -> None:
    await tfe.org("acme")
    ws_id = await tfe.cli_workspace("acme", "net")
    cv, _ = await uploaded(tfe, ws_id, speculative=False)
    run_id = (await new_run(tfe, ws_id, cv)).body["data"]["id"]
    # the CLI asks for includes; unknown ones are ignored
    read = await tfe.tfe("GET", f"/api/v2/runs/{run_id}?include=workspace,plan,nonsense")
    assert read.status == 200 and read.body["data"]["attributes"]["status"] == "pending"
    assert read.body["data"]["attributes"]["actions"]["is-cancelable"] is True
    assert read.body["data"]["attributes"]["actions"]["is-confirmable"] is False
    events = await tfe.tfe("GET", f"/api/v2/runs/{run_id}/run-events")
    assert events.status == 200 and events.body["data"] == []

    # apply and discard are not allowed on a pending run: 409, as go-tfe expects
    for action in ("apply", "discard"):
        a = await tfe.tfe("POST", f"/api/v2/runs/{run_id}/actions/{action}", json={})
        assert a.status == 409, (action, a.body)
        assert a.body["errors"][0]["status"] == "409"
    cancel = await tfe.tfe(
        "POST", f"/api/v2/runs/{run_id}/actions/cancel", json={"comment": "stop it"}
    )
    assert cancel.status == 202, cancel.body
    read = await tfe.tfe("GET", f"/api/v2/runs/{run_id}")
    assert read.body["data"]["attributes"]["status"] == "canceled"
    assert read.body["data"]["attributes"]["actions"]["is-cancelable"] is False
    _, _, rid = run_id.removeprefix("run-").split(".")
    assert (await tfe.app.load_run("acme", "net", rid)).state.status == Status.CANCELED
    again = await tfe.tfe("POST", f"/api/v2/runs/{run_id}/actions/cancel", json={})
    assert again.status == 409


async def test_plan_apply_and_their_log_urls(tfe: Tfe) -> None:
    await tfe.org("acme")
    ws_id = await tfe.cli_workspace("acme", "net")
    cv, _ = await uploaded(tfe, ws_id, speculative=False)
    run = (await new_run(tfe, ws_id, cv)).body["data"]
    plan_id = run["relationships"]["plan"]["data"]["id"]
    apply_id = run["relationships"]["apply"]["data"]["id"]
    plan = await tfe.tfe("GET", f"/api/v2/plans/{plan_id}")
    assert plan.status == 200 and plan.body["data"]["type"] == "plans"
    pattrs = plan.body["data"]["attributes"]
    assert pattrs["status"] == "pending"
    assert {"resource-additions", "resource-changes", "resource-destructions"} <= set(pattrs)
    apply = await tfe.tfe("GET", f"/api/v2/applies/{apply_id}")
    assert apply.body["data"]["attributes"]["status"] == "pending"

    url = URL(pattrs["log-read-url"])
    assert url.is_absolute()
    status, raw = await tfe.raw(f"{url.path}?offset=0&limit=1024")  # no Authorization
    assert (status, raw) == (200, b"\x02")  # started, not over: no ETX yet
    status, raw = await tfe.raw(f"{url.path}?offset=1&limit=1024")
    assert (status, raw) == (200, b"")
    # the apply log opens with the three lines the CLI drops
    aurl = URL(apply.body["data"]["attributes"]["log-read-url"])
    status, raw = await tfe.raw(f"{aurl.path}?offset=0&limit=65536")
    assert raw.startswith(b"\x02") and raw.count(b"\n") == 3 and not raw.endswith(b"\x03")

    # a canceled run's plan is over: its log ends with ETX
    await tfe.tfe("POST", f"/api/v2/runs/{run['id']}/actions/cancel", json={})
    status, raw = await tfe.raw(f"{url.path}?offset=0&limit=1024")
    assert raw == b"\x02\x03"
    # a log URL altered, or one run's pointed at by another's path, opens nothing
    assert (await tfe.raw(str(url.path)[:-3] + "abc"))[0] == 404
    assert (await tfe.raw(str(url.path).replace("/plan/", "/apply/")))[0] == 404


async def test_the_workspace_runs_queue_and_capacity_the_cli_waits_with(tfe: Tfe) -> None:
    await tfe.org("acme")
    ws_id = await tfe.cli_workspace("acme", "net")
    ids = []
    for _ in range(2):
        cv, _ = await uploaded(tfe, ws_id, speculative=False)
        ids.append((await new_run(tfe, ws_id, cv)).body["data"]["id"])
    await tfe.api.after_write(await tfe.app.store.last_seq())
    listed = await tfe.tfe("GET", f"/api/v2/workspaces/{ws_id}/runs")
    assert listed.status == 200
    assert [r["id"] for r in listed.body["data"]] == ids[::-1]  # newest first
    assert listed.body["meta"]["pagination"]["current-page"] == 1
    second = await tfe.tfe("GET", f"/api/v2/runs/{ids[1]}")
    assert second.body["data"]["attributes"]["position-in-queue"] == 1  # one ahead of it
    queue = await tfe.tfe("GET", "/api/v2/organizations/acme/runs/queue")
    assert queue.status == 200 and queue.body["data"] == []
    assert queue.body["meta"]["pagination"]["total-pages"] == 1
    cap = await tfe.tfe("GET", "/api/v2/organizations/acme/capacity")
    assert cap.status == 200 and set(cap.body["data"]["attributes"]) == {"pending", "running"}


async def test_another_organizations_token_sees_no_run(tfe: Tfe) -> None:
    await tfe.org("acme")
    others = await tfe.org("evil")
    ws_id = await tfe.cli_workspace("acme", "net")
    cv, _ = await uploaded(tfe, ws_id)
    run = (await new_run(tfe, ws_id, cv)).body["data"]
    plan_id = run["relationships"]["plan"]["data"]["id"]
    token = others["admin"]
    for path in (f"/api/v2/runs/{run['id']}", f"/api/v2/plans/{plan_id}"):
        assert (await tfe.tfe("GET", path, token=token)).status == 404
    assert (await tfe.tfe("GET", f"/api/v2/configuration-versions/{cv}", token=token)).status == 404
    a = await tfe.tfe("POST", f"/api/v2/runs/{run['id']}/actions/cancel", token=token, json={})
    assert a.status == 404
    assert (await new_run_as(tfe, ws_id, cv, token)).status == 404


async def test_a_log_read_with_nothing_new_is_answered_when_a_line_is_written(tfe: Tfe) -> None:
    """The CLI polls 0.5 to 2 s apart; a read at the log's end is held until the next
    line, so the line reaches the CLI as it is written (target: within 1 s)."""
    await tfe.org("acme")
    ws_id = await tfe.cli_workspace("acme", "net")
    cv, _ = await uploaded(tfe, ws_id)
    run = (await new_run(tfe, ws_id, cv)).body["data"]
    _, _, run_id = run["id"].removeprefix("run-").split(".")
    plan_id = run["relationships"]["plan"]["data"]["id"]
    url = URL(
        (await tfe.tfe("GET", f"/api/v2/plans/{plan_id}")).body["data"]["attributes"][
            "log-read-url"
        ]
    )
    loop = asyncio.get_running_loop()
    reading = asyncio.create_task(tfe.raw(f"{url.path}?offset=1&limit=1024"))
    nc = tfe.app.store.nc  # the API's own connection here
    subject = log_subject(run_id, "plan", "*")

    async def held() -> bool:  # the read waits at the log's end, subscribed to its lines
        return any(sub.subject == subject for sub in nc._subs.values())

    await eventually(held, what="the log read to wait")
    assert not reading.done()
    js = tfe.app.store.nc.jetstream()
    written = loop.time()
    await js.publish(
        log_subject(run_id, "plan", "plan"),
        b"null_resource.a: Plan to create",
        headers=live_headers("stdout", 1),
    )
    status, raw = await asyncio.wait_for(reading, timeout=5)
    latency = loop.time() - written
    assert (status, raw) == (200, b"null_resource.a: Plan to create\n")
    assert latency < 1.0, latency
