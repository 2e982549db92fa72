"""Every kind of aggregate the shell writes, as `Repository.execute` drives it: the core's
`fold` and `decide` of each, adapted to one shape (`decide(state, command, now, new_id)`).

A new aggregate is one entry here and its subject function in its events/ module.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, get_args

from events import chat as chat_agg
from events import notification as nt
from events import org as org_agg
from events import run as run_agg
from events import run_triggers as rt
from events import schedule as sc
from events import sso, stacks, vcs
from events import stack_run_events as sre
from events import stack_runs as sr
from events import workspace as ws_agg
from services.app.execute import Aggregate

_CHAT = get_args(chat_agg.ChatEvent)
_TRIGGERS = get_args(rt.RunTriggerEvent)


def _only(kinds: tuple[type, ...], events: Sequence[Any]) -> list[Any]:
    """The events of the aggregate's own kinds (a subject may carry others: the run
    triggers' subject is under the organization's)."""
    return [e for e in events if isinstance(e, kinds)]


RUN: Aggregate[run_agg.RunState, run_agg.RunCommand] = Aggregate(
    name="run",
    initial=run_agg.INITIAL,
    fold=run_agg.fold,
    decide=lambda s, c, now, new_id: run_agg.decide(s, c, now=now, new_id=new_id),
)
WORKSPACE: Aggregate[ws_agg.WorkspaceState, ws_agg.WorkspaceCommand] = Aggregate(
    name="workspace",
    initial=ws_agg.INITIAL,
    fold=ws_agg.fold,
    decide=lambda s, c, now, new_id: ws_agg.decide(s, c, now=now, new_id=new_id),
)
ORG: Aggregate[org_agg.OrgState, org_agg.OrgCommand] = Aggregate(
    name="org",
    initial=org_agg.INITIAL,
    fold=org_agg.fold,
    decide=lambda s, c, now, new_id: org_agg.decide(s, c, now=now, new_id=new_id),
)
CHAT: Aggregate[chat_agg.SlackState, chat_agg.ChatCommand] = Aggregate(
    name="chat",
    initial=chat_agg.INITIAL,
    fold=lambda events, s: chat_agg.fold(_only(_CHAT, events), s),
    decide=lambda s, c, now, new_id: chat_agg.decide(s, c, now=now, new_id=new_id),
)
RUN_TRIGGERS: Aggregate[rt.TriggerGraph, rt.RunTriggerCommand] = Aggregate(
    name="run_triggers",
    initial=rt.INITIAL,
    fold=lambda events, s: rt.fold(_only(_TRIGGERS, events), s),
    decide=lambda s, c, now, new_id: rt.decide(s, c, now=now, new_id=new_id),
)
SCHEDULES: Aggregate[sc.SchedulesState, sc.SaveSchedule | sc.DeleteSchedule] = Aggregate(
    name="schedules",
    initial=sc.fold([]),
    fold=sc.fold,
    decide=lambda s, c, now, new_id: sc.decide(s, c, now=now),
)
NOTIFICATION: Aggregate[nt.ConfigState, nt.SaveConfig | nt.DeleteConfig] = Aggregate(
    name="notification",
    initial=nt.fold([]),
    fold=nt.fold,
    decide=lambda s, c, now, new_id: nt.decide(s, c, now=now),
)
VCS_CONNECTION: Aggregate[vcs.ConnectionState, vcs.SaveConnection | vcs.DeleteConnection] = (
    Aggregate(
        name="vcs_connection",
        initial=vcs.fold([]),
        fold=vcs.fold,
        decide=lambda s, c, now, new_id: vcs.decide(s, c, now=now),
    )
)
SSO: Aggregate[sso.SsoState, sso.SsoCommand] = Aggregate(
    name="sso",
    initial=sso.INITIAL,
    fold=sso.fold,
    decide=lambda s, c, now, new_id: sso.decide(s, c, now=now, new_id=new_id),
)
STACK: Aggregate[stacks.StackState, stacks.StackCommand] = Aggregate(
    name="stack",
    initial=stacks.INITIAL,
    fold=stacks.fold,
    decide=lambda s, c, now, new_id: stacks.decide(s, c, now=now, new_id=new_id),
)
STACK_RUN: Aggregate[sre.StackRunState, sr.StackRunCommand] = Aggregate(
    name="stack_run",
    initial=sre.INITIAL,
    fold=sr.fold,
    decide=lambda s, c, now, new_id: sr.decide(s, c, now=now, new_id=new_id),
)
