"""The work a Slack request asks for, done after Slack had its answer.

The api records each signed request (`chat.slack_request_received`) before it answers,
and this worker, a subscriber on those subjects, does what it asks: as the runplane user
the Slack user is mapped to, through the same App methods and the same core rules as the
API (services/surfaces/api/approvals.py), with `via` "slack" and the Slack user, channel and
message in `via_detail`. What came of it is posted to the request's `response_url` and
recorded (`chat.slack_request_done`); a redelivered request that is done is not worked
again. A run the request created or acted on is linked to the message
(`chat.slack_message_linked`), which the run updater (services/processes/chat/updates.py) keeps
current as the run moves.

A run created from Slack gets an id derived from the request (a ULID of the request's
time and id), so a request redelivered after its run was created (the worker died before
recording it done) finds that run instead of creating a second one.
"""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec
import structlog
from ulid import ULID

from events import approval
from events import chat as chat_agg
from events.access import PLAN_ONLY, run_action
from events.codec import valid_id
from events.errors import DomainError, Invalid, NotFound
from events.run import ApproveRun, CancelRun, Cause, DiscardRun, RunState
from infra import origin
from infra.eventstore import Append
from services.app.commands import App
from services.processes.chat import text as tx
from services.processes.chat.config import ChatConfig, ChatError, Who
from services.processes.chat.poster import Poster

log = structlog.get_logger(__name__)

VIA = "slack"


class Outcome(Exception):
    """The reply to a request and its outcome slug, raised from deep in the work."""

    def __init__(self, message: tx.Message, slug: str) -> None:
        super().__init__(message.get("text", ""))
        self.message = message
        self.slug = slug


class Worker:
    """Works recorded Slack requests; one per subscriber process."""

    def __init__(self, app: App, config: ChatConfig, poster: Poster) -> None:
        self.app = app
        self.config = config
        self.poster = poster

    async def handle(self, org: str, event: chat_agg.SlackRequestReceived) -> None:
        """Work the request unless it is done already; post and record what came of it."""
        subject = chat_agg.request_subject(org, event.request_id)
        envs = await self.app.store.read(subject)
        if any(isinstance(e.event, chat_agg.SlackRequestDone) for e in envs):
            return  # redelivered: done before
        run_id, user = "", ""
        # the audit log's origin of what the request appends (infra/origin.py)
        here = origin.Origin(request_id=event.request_id, client="slack", via="chat")
        token = origin.current.set(here)
        try:
            who = await self.config.who(org, event.slack_user)
            user = who.caller.user
            here.actor_kind = "user"
            message, run_id = await self.work(org, event, who)
            slug = "ok"
        except Outcome as o:
            message, slug = o.message, o.slug
        except (DomainError, ChatError, tx.BadCommand) as e:
            message, slug = tx.reply(tx.escape(str(e))), _slug(e)
        finally:
            origin.current.reset(token)
        url = self.config.open_url(org, event.request_id, event.response_url)
        await self.poster.post(url, message)
        await self._done(org, event, envs[-1].seq if envs else 0, slug, user, run_id)
        log.info(
            "slack_request_worked", org=org, request_id=event.request_id, outcome=slug, user=user
        )

    async def expire(self, org: str, event: chat_agg.SlackRequestReceived) -> None:
        """Record a request too old to work as done (`expired`), unless it is done."""
        subject = chat_agg.request_subject(org, event.request_id)
        envs = await self.app.store.read(subject)
        if not any(isinstance(e.event, chat_agg.SlackRequestDone) for e in envs):
            await self._done(org, event, envs[-1].seq if envs else 0, "expired", "", "")
            log.warning("slack_request_expired", org=org, request_id=event.request_id)

    async def _done(
        self,
        org: str,
        event: chat_agg.SlackRequestReceived,
        seq: int,
        slug: str,
        user: str,
        run_id: str,
    ) -> None:
        done = chat_agg.SlackRequestDone(
            at=self.app.clock(),
            actor=user or event.slack_user,
            request_id=event.request_id,
            outcome=slug,
            user=user,
            run_id=run_id,
        )
        subject = chat_agg.request_subject(org, event.request_id)
        append = Append(subject=subject, event=done, expected=seq, msg_id=self.app.ids())
        await self.app.store.append([append])

    async def work(
        self, org: str, event: chat_agg.SlackRequestReceived, who: Who
    ) -> tuple[tx.Message, str]:
        """The reply, and the id of the run acted on ("" if none)."""
        if event.kind == "interaction":
            return await self._interaction(org, event, who)
        parsed = tx.parse(event.text)
        match parsed.verb:
            case "plan" | "apply":
                return await self._create(org, event, who, parsed.verb, parsed.arg)
            case "approve":
                run = await self._run(org, None, parsed.arg)
                return await self._approve(org, event, who, run, [])
            case "discard":
                run = await self._run(org, None, parsed.arg)
                return await self._discard(org, event, who, run, parsed.reason)
            case "cancel":
                run = await self._run(org, None, parsed.arg)
                cancel_as = "run.cancel_plan" if run.run_type in PLAN_ONLY else "run.cancel"
                who = await self.config.allow(org, who, cancel_as, run.workspace)
                cancel = CancelRun(actor=who.caller.user, reason="canceled from Slack")
                done = await self.app.run_command(org, run.workspace, run.run_id, cancel)
                return await self._linked(org, event, done.state, "canceled from Slack"), run.run_id
            case _:  # queries are answered by the api at once
                raise Invalid(f"{parsed.verb} is answered at once, not worked")

    # ------------------------------------------------------------ commands

    async def _create(
        self, org: str, event: chat_agg.SlackRequestReceived, who: Who, run_type: str, ws: str
    ) -> tuple[tx.Message, str]:
        who = await self.config.allow(org, who, run_action(run_type), ws)
        run_id = run_id_of(event)
        existing = (await self.app.load_run(org, ws, run_id)).state
        if existing.exists:  # redelivered after the create: the run is there
            return await self._linked(org, event, existing, ""), run_id
        if not (await self.app.load_ws(org, ws)).state.exists:
            raise NotFound(f"workspace {ws} not found")
        message = f"from Slack by {who.caller.user}"
        cause = Cause(kind="chat", user=who.caller.user)
        done = await self.app.create_run(
            org, ws, run_type, who.caller.user, message=message, cause=cause, run_id=run_id
        )
        return await self._linked(org, event, done.state, ""), run_id

    async def _approve(
        self,
        org: str,
        event: chat_agg.SlackRequestReceived,
        who: Who,
        run: RunState,
        acknowledged: list[str],
    ) -> tuple[tx.Message, str]:
        who = await self.config.allow(org, who, "run.approve", run.workspace)
        command = ApproveRun(
            actor=who.caller.user,
            acknowledged=acknowledged,
            caller=who.caller,
            via=VIA,
            via_detail=_detail(event),
        )
        try:
            done = await self.app.run_command(org, run.workspace, run.run_id, command)
        except approval.Unacknowledged as e:
            value = f"{org}/{run.workspace}/{run.run_id}"
            confirm = tx.confirmation(value, run.run_id, e.missing, digest_of(e.missing))
            raise Outcome(confirm, "confirm-destructive") from e
        return await self._linked(org, event, done.state, ""), run.run_id

    async def _discard(
        self, org: str, event: chat_agg.SlackRequestReceived, who: Who, run: RunState, reason: str
    ) -> tuple[tx.Message, str]:
        who = await self.config.allow(org, who, "run.approve", run.workspace)
        command = DiscardRun(
            actor=who.caller.user,
            reason=reason or "discarded from Slack",
            caller=who.caller,
            via=VIA,
            via_detail=_detail(event),
        )
        done = await self.app.run_command(org, run.workspace, run.run_id, command)
        return await self._linked(org, event, done.state, ""), run.run_id

    # ------------------------------------------------------------ buttons

    async def _interaction(
        self, org: str, event: chat_agg.SlackRequestReceived, who: Who
    ) -> tuple[tx.Message, str]:
        parts = event.value.split("/")
        if len(parts) not in (3, 4) or not all(valid_id(p) for p in parts[:3]):
            raise Invalid(f"the button's value {tx.shown(event.value)} is not <org>/<ws>/<run>")
        if parts[0] != org:
            raise NotFound("that run is not one of this Slack app's organization")
        run = await self._run(org, parts[1], parts[2])
        match event.action_id, parts[3:]:
            case tx.APPROVE, []:
                return await self._approve(org, event, who, run, [])
            case tx.DISCARD, []:
                return await self._discard(org, event, who, run, "")
            case tx.CONFIRM, [digest]:
                # Acknowledge what the confirmation listed, if it is what the run deletes
                # or replaces still; else nothing (the core asks again).
                shown = run.destructive if digest == digest_of(run.destructive) else []
                return await self._approve(org, event, who, run, list(shown))
            case _:
                raise Invalid(f"unknown button {tx.shown(event.action_id)}")

    # ------------------------------------------------------------ helpers

    async def _run(self, org: str, ws: str | None, run_id: str) -> RunState:
        state: RunState = (await self.app.load_run(org, ws, run_id)).state
        if not state.exists:
            raise NotFound(f"run {run_id} not found")
        return state

    async def _linked(
        self, org: str, event: chat_agg.SlackRequestReceived, run: RunState, note: str
    ) -> tx.Message:
        """Link the run to the request's message (kept current as the run moves) and
        render it."""
        link = chat_agg.SlackMessageLinked(
            at=self.app.clock(),
            actor=event.slack_user,
            run_id=run.run_id,
            request_id=event.request_id,
            response_url=event.response_url,
            channel=event.channel,
            message_ts=event.message_ts,
        )
        subject = chat_agg.run_link_subject(org, run.run_id)
        seq, _ = await self.app.store.last(subject)
        await self.app.store.append(
            [Append(subject=subject, event=link, expected=seq, msg_id=self.app.ids())]
        )
        return tx.run_card(org, run_view(run), note, replace=event.kind == "interaction")


def run_view(run: RunState) -> dict[str, Any]:
    """The fields of a run a Slack message shows, named as the read model's row."""
    plan = run.plan_summary
    return {
        "id": run.run_id,
        "workspace": run.workspace,
        "type": run.run_type,
        "status": str(run.status),
        "created_by": run.created_by,
        "message": run.message,
        "approved_by": run.approved_by,
        "reason": run.reason,
        "plan_summary": msgspec.structs.asdict(plan) if plan else None,
    }


def run_id_of(event: chat_agg.SlackRequestReceived) -> str:
    """The id of the run a request creates: a ULID of its time and its id."""
    millis = int(event.at.timestamp() * 1000)
    tail = hashlib.sha256(event.request_id.encode()).digest()[:10]
    return str(ULID.from_bytes(millis.to_bytes(6, "big") + tail)).lower()


def digest_of(addresses: list[str]) -> str:
    """A short digest of a list of addresses: a confirmation acknowledges exactly these."""
    return hashlib.sha256("\n".join(addresses).encode()).hexdigest()[:16]


def _detail(event: chat_agg.SlackRequestReceived) -> dict[str, str]:
    detail = {"user": event.slack_user, "team": event.team_id, "channel": event.channel}
    if event.message_ts:
        detail["message"] = event.message_ts
    detail["request"] = event.request_id
    return {k: v for k, v in detail.items() if v}


def _slug(error: Exception) -> str:
    return str(getattr(error, "slug", "") or getattr(error, "code", "") or "error")
