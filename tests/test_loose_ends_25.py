"""Issue 25's loose ends from the attacker's review, each a test that failed on main
(c771187): as_of's reads again of a replica behind charged to the request's budget; the
egress guard judging the IPv4 address an IPv6 one embeds (6to4, NAT64, Teredo).

The attacker is an organization's admin (its own token, its own organization's
endpoints only)."""

from __future__ import annotations

import ipaddress
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from nats.aio.client import Client as NATS

from events import folder as fo
from events.values import Workspace
from infra.ids import utcnow
from infra.streams import EVENTS
from projections.asof import PastModels, TooCostly
from services.app.commands import App
from services.processes.notifications import Refused, guard
from services.processes.retention import Retention
from tests.api_support import ADMIN_TOKEN, Http
from tests.audit_stream_support import shttp_fixture  # noqa: F401  # `shttp`
from tests.lograce_support import finished_run, text_of
from tests.notify_support import nhttp_fixture  # noqa: F401  # `nhttp`
from tests.ui.support import Browser, Ui, ui_fixture  # noqa: F401  # `ui`

V1 = "/api/v1/orgs"

# ---------------------------------------------------------------- as_of's budget

LAG = 6  # sequences a lagging replica's read reaches past what the model holds


class Lagging(PastModels):
    """As served by a replica behind the leader: each read of the organization's events
    reaches only LAG sequences past what the model holds (the rest comes on the reads
    again, as the replica catches up); the leader (`_missed`) has them all."""

    reads = 0

    async def _read(self, s: Any, seq: int, *rest: Any) -> None:
        self.reads += 1
        await super()._read(s, min(seq, s.upto + LAG), *rest)


async def test_as_of_reads_again_of_a_lagging_replica_spend_the_requests_one_budget(
    nc: Any, app: App, tmp_path: Path
) -> None:
    """Attack (the fold cap, through a lagging replica): each read again after the
    leader said the replica was behind got a fresh `max_events`, so one request folded up
    to 21 times its cap (here 31 events under a cap of 10, in 6 reads). Now the reads
    again spend the request's one budget: TooCostly once 10 are folded, the model kept
    there; and the events folded are charged to the organization's minute."""
    await app.create_org("lagorg", "admin")
    for i in range(30):
        await app.create_workspace("lagorg", f"w{i}", Workspace(repository="/r"), "alice")
    last = (await nc.jetstream().stream_info(EVENTS)).state.last_seq
    past = Lagging(nc, max_events=10, per_minute=1000, directory=tmp_path)
    try:
        with pytest.raises(TooCostly):
            async with past.at("lagorg", last):
                pass
        folded = [m.events for m in past._models.values()]
        assert folded == [10], (folded, past.reads)
        assert past._spent["lagorg"][1] == 10
    finally:
        await past.close()


async def test_as_of_a_request_folds_no_more_than_is_left_of_its_minute(
    nc: Any, app: App, tmp_path: Path
) -> None:
    """The minute's budget bounds a request too: with 4 events left of it, a request
    under a cap of 10 folds 4 and is refused, not 10."""
    await app.create_org("lagorg", "admin")
    for i in range(30):
        await app.create_workspace("lagorg", f"w{i}", Workspace(repository="/r"), "alice")
    last = (await nc.jetstream().stream_info(EVENTS)).state.last_seq
    past = PastModels(nc, max_events=10, per_minute=14, directory=tmp_path)
    try:
        with pytest.raises(TooCostly):
            async with past.at("lagorg", last):
                pass
        with pytest.raises(TooCostly):
            async with past.at("lagorg", last):
                pass
        assert past._spent["lagorg"][1] == 14
    finally:
        await past.close()


# ---------------------------------------------------------------- the egress guard

EMBEDDED = [
    ("2002:a9fe:a9fe::1", "link-local"),  # 6to4 of the metadata service
    ("2002:7f00:1::1", "loopback"),  # 6to4 of 127.0.0.1
    ("2002:a00:7::1", "private"),  # 6to4 of 10.0.0.7
    ("64:ff9b::a9fe:a9fe", "link-local"),  # NAT64 (RFC 6052) of the metadata service
    ("64:ff9b::7f00:1", "loopback"),
    ("64:ff9b:1::a9fe:a9fe", "link-local"),  # local-use NAT64 (RFC 8215), /96
    ("64:ff9b:1:a9fe:a9:fe00::", "link-local"),  # the same prefix used as a /48
    ("2001:0:4136:e378:8000:63bf:5601:fefe", "link-local"),  # Teredo, client 169.254.1.1
]


@pytest.mark.parametrize(("address", "kind"), EMBEDDED)
def test_an_embedded_ipv4_address_is_judged_by_the_ipv4_rules(address: str, kind: str) -> None:
    """6to4 was public whatever it embedded; NAT64 and Teredo were refused for what they
    are, never for the address they reach, so a deployment allowing `private` let a
    Teredo address of the metadata service through. Now each is the embedded address's
    kind, refused even where loopback and private are allowed unless it is one of them."""
    ip = ipaddress.ip_address(address)
    assert guard.kind_of(ip) == kind
    with pytest.raises(Refused):
        guard.judge(ip, frozenset())
    if kind == "link-local":
        with pytest.raises(Refused):
            guard.judge(ip, frozenset({"loopback", "private"}))


def test_nat64_and_6to4_of_a_public_address_stay_public() -> None:
    """DNS64 synthesizes 64:ff9b::/96 addresses for IPv4-only hosts: a public one is
    sent to (it was refused as reserved); 6to4 of a public address too."""
    for address in ("64:ff9b::808:808", "2002:808:808::1"):
        assert guard.kind_of(ipaddress.ip_address(address)) == "public"


ATTACKS = ["2002:a9fe:a9fe::1", "64:ff9b::a9fe:a9fe"]


@pytest.mark.parametrize("address", ATTACKS)
async def test_an_org_admin_cannot_point_a_notification_at_an_embedded_address(
    nhttp: Http, address: str
) -> None:
    """Attack (SSRF through an IPv6 literal): a notification URL at 6to4 / NAT64 of
    169.254.169.254 is 422 destination-refused, nothing written (6to4 was saved: 201),
    on a deployment allowing loopback."""
    await nhttp.org("evil")
    url = f"https://[{address}]/latest/meta-data"
    body = {"name": "x", "url": url, "triggers": ["run:errored"]}
    (await nhttp.post(f"{V1}/evil/notifications", json=body)).problem("destination-refused", 422)
    assert (await nhttp.get(f"{V1}/evil/notifications")).body["items"] == []


@pytest.mark.parametrize("address", ATTACKS)
async def test_an_org_admin_cannot_point_a_siem_destination_at_an_embedded_address(
    shttp: Http, address: str
) -> None:
    """The same through the audit stream's destination (its URL passes the same guard)."""
    await shttp.org("evil")
    body = {"name": "x", "url": f"https://[{address}]/hec", "secret": "s"}
    siem = await shttp.post(f"{V1}/evil/audit/destinations", json=body)
    siem.problem("destination-refused", 422)
    assert (await shttp.get(f"{V1}/evil/audit/destinations")).body["items"] == []


# ---------------------------------------------------------------- the UI's log


async def _shown_whole(ui: Ui, nc: NATS, tmp_path: Path) -> tuple[str, Browser]:
    """A finished run with stored logs, its log page whole in a signed-in browser."""
    run_id = await finished_run(ui.http, nc, tmp_path)
    browser = ui.browser()
    await browser.signin(ADMIN_TOKEN, "acme")
    whole = await browser.get(f"/orgs/acme/runs/{run_id}/log")
    assert text_of("checkout", 1) in whole.text and "Log removed" not in whole.text
    return run_id, browser


async def _set(app: App, **settings: int) -> None:
    await app.org_command("acme", fo.SetOrgSettings(actor="admin", changes=settings))


async def test_the_ui_log_page_and_live_view_say_the_log_was_removed_while_the_read_model_lags(
    ui: Ui, nc: NATS, tmp_path: Path
) -> None:
    """Attack on the review's race, in the UI: the log page read the lines with no
    removal check, so once retention had deleted the stored logs (the replica's read
    model not yet holding `run.log_pruned`) it showed an empty log as if whole; the live
    view likewise sent no line and `end`. Now both ask the event log's leader as the
    API's log read does and say "Log removed by retention on <date>"."""
    app = ui.http.app
    run_id, browser = await _shown_whole(ui, nc, tmp_path)
    async with ui.http.api.projector._writing:  # this replica's read model lags
        await _set(app, log_retention_days=0)
        assert (await Retention(nc, app, grace=0).pass_once()).pruned == [run_id]
        page = await browser.get(f"/orgs/acme/runs/{run_id}/log")
        assert page.status == 200, page.text[:300]
        assert "Log removed by retention on 20" in page.text, page.text[-600:]
        assert text_of("checkout", 1) not in page.text
        live = await browser.get(f"/orgs/acme/runs/{run_id}/live")
        assert "Log removed by retention on 20" in live.text, live.text[-600:]
        assert "event: end" in live.text


async def test_the_ui_log_page_of_a_run_removed_whole_while_the_read_model_lags_is_410(
    ui: Ui, nc: NATS, tmp_path: Path
) -> None:
    """The same with the whole record removed: the log page was an empty 200 (the rows
    still there, the objects gone); now the removed run's 410 page, as once projected."""
    app = ui.http.app
    run_id, browser = await _shown_whole(ui, nc, tmp_path)
    async with ui.http.api.projector._writing:
        await _set(app, record_retention_days=1)
        app.clock = lambda: utcnow() + timedelta(days=2)  # type: ignore[method-assign]
        assert (await Retention(nc, app, grace=0).pass_once()).removed == [run_id]
        page = await browser.get(f"/orgs/acme/runs/{run_id}/log")
        assert page.status == 410 and "removed by retention on 20" in page.text, page.text[:600]
        live = await browser.get(f"/orgs/acme/runs/{run_id}/live")
        assert live.status == 410, live.text[:300]
