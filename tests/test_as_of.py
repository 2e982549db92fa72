"""`?as_of=` (issue 25, item 3): a run, a workspace, its state versions and the
organization's runs as the API answered them at a moment; real NATS, the real API and
projector, states pushed as the Terraform CLI pushes them.

- answers recorded after each of a sequence of changes (runs created and queued, a lock
  and an unlock, a setting changed, a state version pushed, a run ended) are answered
  again, as of each recorded sequence and each recorded time, byte for byte but for the
  request's own fields (`as_of_seq`, `as_of_omitted`) and what is named omitted;
- a bad as_of (unparseable, naive, in the future, past the stream's last, before its
  first) is 422 `invalid-as-of`;
- org B never reads org A's past: as_of on A's path is 404 to B, as is A's run or
  workspace on B's own path (B's model holds B's events alone), and a caller's access is
  today's, not the one it had at the moment;
- a request folds at most its cap of events: 503 `as-of-too-costly`, and the next goes
  on from where it stopped;
- a cached model is moved forward, not rebuilt.

On main every one of these fails: as_of was ignored (the live answer came back).
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from events.run import RemoveRun
from infra.streams import EVENTS
from projections.asof import Bounds
from services.root.bootstrap import Plane
from services.surfaces.api.asof import PAST
from services.surfaces.api.context import API
from tests.api_support import Answer, Http, served
from tests.tfe_support import Tfe, a_state, tfe_fixture

__all__ = ["tfe_fixture"]

ORG = "/api/v1/orgs/acme"
WS = ORG + "/workspaces/net"
OWN = ("as_of_seq", "as_of_omitted")  # the request's own fields


async def _last_seq(http: Http) -> int:
    return (await http.app.store.nc.jetstream().stream_info(EVENTS)).state.last_seq


def _paths(runs: list[str]) -> list[str]:
    return [
        WS,
        WS + "/settings",
        WS + "/state-versions",
        ORG + "/runs",
        ORG + "/runs?limit=2",
        WS + "/runs?status=pending,queued",
        *(f"{ORG}/runs/{r}" for r in runs),
    ]


def _shape(a: Answer) -> Any:
    """What must be equal: the body, or a problem's status and type."""
    if a.status != 200:
        return a.status, a.body["type"]
    return a.body


def _without(body: Any, omitted: list[str]) -> Any:
    if isinstance(body, dict):
        return {k: _without(v, omitted) for k, v in body.items() if k not in omitted}
    if isinstance(body, list):
        return [_without(v, omitted) for v in body]
    return body


class Recorder:
    def __init__(self, tfe: Tfe) -> None:
        self.tfe = tfe
        self.points: list[tuple[int, datetime, dict[str, Any]]] = []
        self.runs: list[str] = []

    async def record(self) -> None:
        seq = await _last_seq(self.tfe)
        assert await self.tfe.api.projector.wait_for(seq, timeout=5)
        answers = {p: _shape(await self.tfe.get(p)) for p in _paths(self.runs)}
        self.points.append((seq, datetime.now(UTC), answers))


async def _history(tfe: Tfe) -> Recorder:
    rec = Recorder(tfe)
    await tfe.org("acme")
    await tfe.workspace("acme", "net")
    await rec.record()
    for kind in ("apply", "plan", "apply"):  # queued behind each other
        rec.runs.append((await tfe.run("acme", "net", kind))["id"])
        await rec.record()
    assert (await tfe.post(WS + "/lock", json={"reason": "maintenance"})).status == 200
    await rec.record()
    a = await tfe.call("PATCH", WS + "/settings", json={"heartbeat_timeout": 120})
    assert a.status == 200, a.body
    await rec.record()
    lineage = str(uuid.uuid4())
    pushed = await tfe.push("ws-acme.net", a_state(1, lineage, {"v": "one"}))
    assert pushed.status == 201, pushed.body
    await rec.record()
    assert (await tfe.post(WS + "/unlock")).status == 200
    await rec.record()
    canceled = await tfe.post(f"{ORG}/runs/{rec.runs[1]}/cancel", json={"reason": "no"})
    assert canceled.status == 200, canceled.body
    await rec.record()
    rec.runs.append((await tfe.run("acme", "net", "plan"))["id"])
    await rec.record()
    return rec


async def _as_of(tfe: Tfe, path: str, as_of: str) -> Answer:
    sep = "&" if "?" in path else "?"
    return await tfe.get(f"{path}{sep}as_of={as_of.replace('+', '%2B')}")


async def test_answers_as_of_each_recorded_sequence_and_time_equal_the_answers_then(
    tfe: Tfe,
) -> None:
    rec = await _history(tfe)
    # the history changed the answers: equal answers at every point would prove nothing
    assert len({repr(p[2][WS]) for p in rec.points}) >= 6
    assert len({repr(p[2][WS + "/settings"]) for p in rec.points}) == 2
    now = rec.points[-1][2]
    for seq, when, then in rec.points:
        for as_of in (str(seq), when.isoformat(), when.isoformat().replace("+00:00", "Z")):
            for path, expected in then.items():
                a = await _as_of(tfe, path, as_of)
                if a.status != 200:
                    assert _shape(a) == expected, (path, as_of, a.body)
                    continue
                assert a.headers["RP-As-Of-Seq"] == str(seq), (path, as_of)
                assert a.body["as_of_seq"] == seq
                omitted = a.body["as_of_omitted"]
                assert _without(a.body, [*OWN]) == _without(expected, omitted), (path, as_of)
        if seq != rec.points[-1][0]:  # an earlier answer is not today's
            assert then[WS] != now[WS]
    past = tfe.client.app[PAST]
    # asked in order, one model per organization moved forward (each time 3 asks: cached)
    assert past.built == 1, past.built


async def test_a_run_as_of_before_it_existed_is_404_and_the_queue_is_as_it_was(
    tfe: Tfe,
) -> None:
    rec = await _history(tfe)
    first_seq = rec.points[0][0]
    got = await _as_of(tfe, f"{ORG}/runs/{rec.runs[0]}", str(first_seq))
    got.problem("not-found", 404)
    queue_then = rec.points[3][2][WS]["queue"]
    ws = await _as_of(tfe, WS, str(rec.points[3][0]))
    assert ws.body["queue"] == queue_then
    assert ws.body["as_of_omitted"] == ["secret_variables"]
    assert "secret_variables" not in ws.body


async def test_a_bad_as_of_is_a_422_problem(tfe: Tfe) -> None:
    await tfe.org("acme")
    await tfe.workspace("acme", "net")
    last = await _last_seq(tfe)
    future = (datetime.now(UTC) + timedelta(hours=1)).isoformat()
    long_ago = "2001-01-01T00:00:00Z"
    for bad in ("yesterday", "2026-12-07", "2026-12-07T10:00:00", future, long_ago, "0"):
        (await _as_of(tfe, WS, bad)).problem("invalid-as-of", 422)
    (await _as_of(tfe, WS, str(last + 1))).problem("invalid-as-of", 422)
    (await _as_of(tfe, WS, "9" * 40)).problem("invalid-as-of", 422)
    (await _as_of(tfe, ORG + "/runs", "nope")).problem("invalid-as-of", 422)
    assert (await _as_of(tfe, WS, str(last))).status == 200


async def test_org_b_never_reads_org_a_past(tfe: Tfe) -> None:
    """As of any moment, B's admin and viewer get 404 for A's run and workspace, on A's
    path (the access check, today's rule) and on B's own (B's model has B's events only),
    and a list of B's runs never names A's."""
    a_tokens = await tfe.org("acme")
    b_tokens = await tfe.org("bravo")
    await tfe.workspace("acme", "net")
    await tfe.workspace("bravo", "web")
    run_a = (await tfe.run("acme", "net"))["id"]
    run_b = (await tfe.run("bravo", "web"))["id"]
    seq = await _last_seq(tfe)
    when = datetime.now(UTC).isoformat()
    for token in (b_tokens["admin"], b_tokens["viewer"]):
        for as_of in (str(seq), when):
            for path in (f"{ORG}/runs/{run_a}", WS, WS + "/settings", ORG + "/runs"):
                got = await tfe.get(f"{path}?as_of={as_of.replace('+', '%2B')}", token=token)
                got.problem("not-found", 404)
            bravo = "/api/v1/orgs/bravo"
            ws_b = f"{bravo}/workspaces/net"
            for path in (
                f"{bravo}/runs/{run_a}",
                ws_b,
                ws_b + "/settings",
                ws_b + "/state-versions",
            ):
                got = await tfe.get(f"{path}?as_of={seq}", token=token)
                got.problem("not-found", 404)
            listed = await tfe.get(f"{bravo}/runs?as_of={seq}", token=token)
            assert [r["id"] for r in listed.body["items"]] == [run_b]
            assert listed.body["as_of_seq"] == seq
    # A's own viewer reads it (the positive twin of the refusals above)
    mine = await tfe.get(f"{ORG}/runs/{run_a}?as_of={seq}", token=a_tokens["viewer"])
    assert mine.status == 200 and mine.body["id"] == run_a
    assert mine.body["as_of_seq"] == seq


async def test_access_is_today_s_a_revoked_token_reads_no_past(tfe: Tfe) -> None:
    """A token that could read at the moment but is revoked now reads nothing of it."""
    tokens = await tfe.org("acme")
    await tfe.workspace("acme", "net")
    seq = await _last_seq(tfe)
    assert (await tfe.get(f"{WS}?as_of={seq}", token=tokens["viewer"])).status == 200
    listed = await tfe.get(ORG + "/tokens")
    viewer = next(t for t in listed.body["items"] if t["user"] == "viewer-user")
    assert (await tfe.call("DELETE", f"{ORG}/tokens/{viewer['token_id']}")).status in (200, 204)
    got = await tfe.get(f"{WS}?as_of={seq}", token=tokens["viewer"])
    assert got.status == 401, got.body


async def test_a_request_folds_at_most_its_cap_and_the_next_goes_on(
    system: Plane, tmp_path: Path
) -> None:
    async with served(system, tmp_path / "rm.sqlite", "acme", as_of=Bounds(events=4)) as (
        web,
        client,
    ):
        http = Http(client, web[API], system.app)
        await http.workspace("acme", "net")
        runs = [(await http.run("acme", "net"))["id"] for _ in range(4)]
        seq = await _last_seq(http)
        answers = []
        for _ in range(10):
            answers.append(await http.get(f"{ORG}/runs/{runs[-1]}?as_of={seq}"))
            if answers[-1].status == 200:
                break
        answers[0].problem("as-of-too-costly", 503)
        assert answers[0].headers["Retry-After"] == "1"
        assert answers[-1].status == 200 and answers[-1].body["id"] == runs[-1]
        assert web[PAST].built == 1  # gone on, not started over


def test_the_bounds_are_flags_and_environment_variables(monkeypatch: Any) -> None:
    from services.root.cli import options, parser

    opts = options(parser().parse_args(["api", "--as-of-models", "3"]))
    assert (opts.as_of_models, opts.as_of_max_events) == (3, 20_000)
    monkeypatch.setenv("RUNPLANE_AS_OF_MAX_EVENTS", "7")
    monkeypatch.setenv("RUNPLANE_AS_OF_MODELS", "2")
    opts = options(parser().parse_args(["up"]))
    assert (opts.as_of_models, opts.as_of_max_events) == (2, 7)
    until = options(parser().parse_args(["replay", "--until", "12", "--output", "x.db"]))
    assert (until.replay_until, until.replay_output) == ("12", "x.db")


async def test_the_cache_keeps_its_bound_and_an_evicted_model_is_built_again(
    system: Plane, tmp_path: Path
) -> None:
    async with served(system, tmp_path / "rm.sqlite", "acme", as_of=Bounds(models=2)) as (
        web,
        client,
    ):
        http = Http(client, web[API], system.app)
        for org in ("bravo", "charlie"):
            assert (await http.post("/api/v1/orgs", json={"name": org})).status == 201
        seq = await _last_seq(http)
        past = web[PAST]
        for org in ("acme", "bravo", "charlie", "acme"):
            answered = await http.get(f"/api/v1/orgs/{org}/runs?as_of={seq}")
            assert answered.status == 200, answered.body
            assert len(past._models) <= 2
        assert past.built == 4  # acme's first model was closed for charlie's


async def test_a_run_removed_by_retention_is_as_it_was_before_and_410_after(tfe: Tfe) -> None:
    http = tfe
    await http.org("acme")
    await http.workspace("acme", "net")
    run_id = (await http.run("acme", "net"))["id"]
    canceled = await http.post(f"{ORG}/runs/{run_id}/cancel", json={"reason": "no"})
    assert canceled.status == 200, canceled.body
    before_seq = await _last_seq(http)
    assert await http.api.projector.wait_for(before_seq, timeout=5)
    before = await http.get(f"{ORG}/runs/{run_id}")
    assert before.status == 200
    removal = RemoveRun(
        actor="retention", objects=[], ended_before=datetime.now(UTC) + timedelta(seconds=1), days=0
    )
    removed = await http.app.run_command("acme", "net", run_id, removal)
    assert await http.api.projector.wait_for(removed.seq, timeout=5)
    (await http.get(f"{ORG}/runs/{run_id}")).problem("run-removed", 410)
    then = await http.get(f"{ORG}/runs/{run_id}?as_of={before_seq}")
    assert _without(then.body, [*OWN]) == _without(before.body, then.body["as_of_omitted"])
    (await http.get(f"{ORG}/runs/{run_id}?as_of={removed.seq}")).problem("run-removed", 410)
    listed = await http.get(f"{ORG}/runs?as_of={removed.seq}")
    assert listed.body["items"] == []
