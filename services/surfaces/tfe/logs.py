"""Plan and apply logs as go-tfe's LogReader reads them: `log-read-url`.

The URL is a capability (services/surfaces/tfe/capability.py) for one phase's log of one run,
fetched without an Authorization header. Its answer is the bytes of the log from
`offset`, at most `limit` of them: the log starts with STX (0x02) and, once the phase
is over and every line of it is in, ends with ETX (0x03); the reader polls (backing off
from 0.5 s to 2 s while nothing new comes) until it has read ETX or the plan / apply is
final. The text is runplane's own step log of the phase (checkout, init, plan or
apply, policy), already masked by the executor: finished steps from their objects in
`rp-logs`, the running step's lines from RP_LOGS as they are written
(services/surfaces/api/runlog.py). A read with nothing new is held (up to `HOLD_S`) until a
line is published on the phase's live subject or an event on the run's subject (the
phase's end), so a line and the log's end reach the CLI as they are written, not at its
next poll. A held read whose client went away (the CLI's Ctrl-C cancels its read) ends
within `STATUS_EVERY_S`: aiohttp does not cancel a handler when its client disconnects,
and a read held on for its whole `HOLD_S` would keep its subscriptions and its run reads
going for nobody.

The CLI drops the first three lines of an apply log (TFE repeats the plan's header
there), so an apply log opens with a three-line preamble of ours. STX and ETX inside a
line are dropped: a tenant's output must not end the CLI's reading early.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Callable

from aiohttp import web
from nats.aio.msg import Msg

from events import approval
from events.codec import run_subject
from events.run import RunState, Status
from infra.eventstore import LATEST
from infra.steplogs import LogError, log_subject
from services.surfaces.api.context import Api
from services.surfaces.api.logs import is_removed
from services.surfaces.api.removed import removed_detail
from services.surfaces.api.runlog import Lines, Target
from services.surfaces.tfe.capability import MAX_TTL_S, CapabilityError
from services.surfaces.tfe.context import api_of, tfe_of
from services.surfaces.tfe.holders import holder_of, still_may
from services.surfaces.tfe.jsonapi import TfeError, not_found
from services.surfaces.tfe.statuses import is_final_apply, is_final_plan

READ_PATH = "/api/v2/capabilities/logs/"
KINDS = {"plan": "plan-log", "apply": "apply-log"}
STX, ETX = b"\x02", b"\x03"
DEFAULT_LIMIT = 64 * 1024
MAX_LIMIT = 1024 * 1024
_FRAMING = str.maketrans("", "", "\x02\x03")
HOLD_S = 5.0  # a read with nothing new waits this long for a line (well inside timeouts)
STATUS_EVERY_S = 0.5  # and looks at the run this often meanwhile (its phase may end)


def read_url(request: web.Request, phase: str, s: RunState) -> str:
    signer = tfe_of(request).need_signer()
    token = signer.sign(
        KINDS[phase], s.org, f"{s.workspace}.{s.run_id}", MAX_TTL_S, holder=holder_of(request)
    )
    return f"{request.url.origin()}{READ_PATH}{phase}/{token}"


def _int(request: web.Request, name: str, default: int) -> int:
    raw = request.query.get(name, "")
    if raw == "":
        return default
    if not (raw.isascii() and raw.isdigit()) or len(raw) > 18:  # "²": a ValueError to int
        raise TfeError(422, "invalid query", f"{name} must be a non-negative integer")
    return int(raw)


async def read_log(request: web.Request) -> web.Response:
    """GET <log-read-url>?offset=N&limit=M."""
    phase = request.match_info["phase"]
    if phase not in KINDS:
        raise not_found("no such log")
    is_final = is_final_plan if phase == "plan" else is_final_apply
    signer = tfe_of(request).need_signer()
    try:
        org, object_id, holder = signer.verify_held(request.match_info["token"], KINDS[phase])
    except CapabilityError as e:
        raise not_found("no such log") from e
    ws, _, run_id = object_id.partition(".")
    if not await still_may(request, org, holder, "workspace.read", ws):
        raise not_found("no such log")
    offset = _int(request, "offset", 0)
    limit = min(_int(request, "limit", DEFAULT_LIMIT), MAX_LIMIT)
    api = api_of(request)
    nc = api.app.store.nc
    woken = asyncio.Event()

    async def wake(_: Msg) -> None:
        woken.set()

    # Subscribed before the first read: a line written between the read and the wait
    # wakes the wait, so it is never missed for a whole poll; so does the run's event
    # that ends the phase (ETX goes out then, not at the next look at the run).
    subs = [
        await nc.subscribe(log_subject(run_id, phase, "*"), cb=wake),
        await nc.subscribe(run_subject(org, ws, run_id), cb=wake),
    ]
    try:
        deadline = asyncio.get_running_loop().time() + HOLD_S
        while True:
            woken.clear()
            body, whole = await _body(api, org, ws, run_id, phase, is_final)
            left = deadline - asyncio.get_running_loop().time()
            if len(body) > offset or whole or left <= 0 or _gone(request):
                break
            # Nothing new: held until a line comes (or the phase ends), so the CLI
            # prints it at once rather than at its next poll (0.5 to 2 s apart).
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(woken.wait(), timeout=min(left, STATUS_EVERY_S))
    finally:
        for sub in subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
    return web.Response(body=body[offset : offset + limit], content_type="text/plain")


def _gone(request: web.Request) -> bool:
    """Whether the client closed its connection (aiohttp drops the transport then)."""
    transport = request.transport
    return transport is None or transport.is_closing()


async def _body(
    api: Api, org: str, ws: str, run_id: str, phase: str, is_final: Callable[[RunState], bool]
) -> tuple[bytes, bool]:
    loaded = await api.app.load_run(org, ws, run_id, min_seq=LATEST)
    s = loaded.state
    if not s.exists:
        raise not_found("no such log")
    if s.removed_at is not None:
        raise TfeError(410, "run removed", removed_detail(s))
    # Every step of a final phase in the read model before its log is called whole.
    whole = is_final(s) and await api.projector.wait_for(loaded.seq)
    text = await _text(api, s, phase, ended=whole)
    if whole and phase == "plan":
        text += _waiting_note(s)
    return STX + text + (ETX if whole else b""), whole


def _waiting_note(s: RunState) -> bytes:
    """Said at the end of a finished plan whose apply the CLI cannot approve, so the
    user learns why the CLI stops there (the run waits in runplane)."""
    if s.status != Status.AWAITING_APPROVAL:
        return b""
    lines = []
    if approval.unacknowledged(s.snapshot, s.destructive, s.acknowledged):
        lines.append(
            "runplane: confirm_destructive is on and this plan deletes or replaces "
            f"{', '.join(s.destructive[:10])}: the CLI cannot acknowledge them; approve "
            "the run in runplane, acknowledging them"
        )
    if s.options is not None and not s.options.confirm and not s.speculative:
        lines.append(
            "runplane: the workspace requires an approval before apply (require_approval): "
            "-auto-approve is not one; approve the run in runplane"
        )
    if approval.setting(s.snapshot, "four_eyes"):
        lines.append(
            f"runplane: four_eyes is on: the run's creator ({s.created_by}) may not approve "
            "it; another approver must, in runplane"
        )
    return ("\n".join(lines) + "\n").encode() if lines else b""


async def _text(api: Api, s: RunState, phase: str, *, ended: bool) -> bytes:
    target = Target(org=s.org, ws=s.workspace, run_id=s.run_id, phase=phase)
    # A read racing retention's removal is a 503 (the client's next try: 410), never a
    # log cut short that passes for whole (services/surfaces/api/logs.py, the same check).
    gone = functools.partial(is_removed, api, target)
    lines = Lines(api.app.store.nc, api.read, target, ended=ended, removed=gone)
    out: list[str] = []
    if phase == "apply":
        out += [f"runplane: apply of run {s.run_id}", f"workspace {s.org}/{s.workspace}", ""]
    if s.log_removed_at is not None:  # services/processes/retention.py: nothing to read
        removed = f"runplane: log removed by retention on {s.log_removed_at.date().isoformat()}"
        return ("\n".join([*out, removed]) + "\n").encode()
    try:
        async for batch in lines.batches():
            out += [line.text.rstrip("\n").translate(_FRAMING) for line in batch]
    except LogError as e:
        raise TfeError(503, "unavailable", f"the log store is unavailable: {e}") from e
    return ("\n".join(out) + "\n").encode() if out else b""
