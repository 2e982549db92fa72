"""`runplane login | logout | run ... | workspace ...`: the API's client for people and
scripts.

`runplane login URL` checks a token (from `--token-stdin`, RUNPLANE_TOKEN or a prompt)
with `GET /api/v1/whoami` and stores it (services/surfaces/client/credentials.py). Every other
command talks to `--server` (else RUNPLANE_URL, else the last server logged in to) with
RUNPLANE_TOKEN if set, else the stored token, in `--org` (else the token's
organization). `--json` prints the API's JSON; otherwise a line per thing, in the style
of the people's log (infra/logs.py).

Exit status:
  0  the command did what it was asked; with --wait, the run ended well
     (applied, planned, no_changes, drifted)
  1  with --wait: the run failed (a policy failure too), was canceled or discarded
  2  an error, after one `runplane: ...` line on stderr: bad input, not logged in, the
     server unreachable, TLS refused, the API refused the request (its detail and type),
     a bad answer
  3  with --wait: the run awaits approval (`runplane run approve ID` or `discard ID`)
  130 interrupted (Ctrl-C); a run being waited for goes on
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Awaitable, Callable
from typing import Any

from events.codec import valid_id
from events.run import SUCCEEDED  # the core's: a run that ended well
from services.surfaces.client import login, output, stacks
from services.surfaces.client.credentials import Login
from services.surfaces.client.errors import ClientError
from services.surfaces.client.http import Api
from services.surfaces.client.output import short

COMMANDS = frozenset({"login", "logout", "run", "workspace", "stack"})
OK, RUN_FAILED, ERROR, NEEDS_APPROVAL, INTERRUPTED = 0, 1, 2, 3, 130
UNSUCCESSFUL = frozenset({"failed", "canceled", "discarded"})
ATTENTION = frozenset({"awaiting_approval"})
RUN_TYPES = ("plan", "apply", "destroy", "drift")
POLL_FIRST, POLL_MAX, POLL_GROWTH = 0.2, 3.0, 1.5  # seconds between reads of a run
RETRIES = 8  # failed reads in a row that --wait rides out (a restarting API, a 503)

Handler = Callable[["Session", argparse.Namespace], Awaitable[int]]


# ------------------------------------------------------------ the parser


def _common(p: argparse.ArgumentParser, *, org: bool = True) -> None:
    g = p.add_argument_group("connection")
    g.add_argument(
        "--server",
        default=os.environ.get("RUNPLANE_URL", ""),
        help="the API's URL (also RUNPLANE_URL); default: the last `runplane login`",
    )
    g.add_argument(
        "--ca-file",
        default="",
        help="verify the server's certificate with these CAs only (PEM); default: the "
        "system's (SSL_CERT_FILE and SSL_CERT_DIR are honoured)",
    )
    if org:
        g.add_argument("--org", default="", help="default: the token's organization")
    p.add_argument("--json", action="store_true", help="print the API's JSON")


def _leaf(sub: Any, name: str, handler: Handler, help: str, *, org: bool = True) -> Any:
    p = sub.add_parser(name, help=help, description=help)
    _common(p, org=org)
    p.set_defaults(handler=handler)
    return p


def add_parsers(sub: Any) -> None:
    """Add `login`, `logout`, `run` and `workspace` to the subcommands of `runplane`."""
    login = sub.add_parser(
        "login",
        help="check a token with a server and store both (0600) for the commands below",
        description="Store URL and a token in $XDG_CONFIG_HOME/runplane/credentials.json. "
        "The token: --token-stdin, else RUNPLANE_TOKEN, else asked for (not echoed); or, "
        "with --sso ORG, signed in through the browser with the organization's identity "
        "provider (authorization code with PKCE, the browser sent back to this machine's "
        "localhost:10000-10010); or, with --device --org ORG on a machine without a "
        "browser, by the device flow: open the page it prints in a browser on any machine, "
        "enter the code, sign in and approve (runplane's own device authorization grant, "
        "RFC 8628).",
    )
    login.add_argument("url", help="the API's URL, e.g. https://runplane.example.com")
    login.add_argument("--token-stdin", action="store_true", help="read the token from stdin")
    how = login.add_mutually_exclusive_group()
    how.add_argument(
        "--sso",
        default="",
        metavar="ORG",
        help="sign in to ORG through the browser with its identity provider (single sign-on)",
    )
    how.add_argument(
        "--device",
        action="store_true",
        help="with --org ORG: print a page and a code to approve in a browser on any "
        "machine (the device flow), and wait for the approval",
    )
    login.add_argument(
        "--org", default="", metavar="ORG", help="with --device: the organization to log in to"
    )
    login.add_argument(
        "--no-browser",
        action="store_true",
        help="with --sso: print the URL to open instead of starting a browser",
    )
    login.add_argument("--ca-file", default="", help="verify the server with these CAs (PEM)")
    login.add_argument("--json", action="store_true", help="print who the token is as JSON")
    login.set_defaults(handler=None)
    logout = sub.add_parser("logout", help="forget a server's token (default: the default's)")
    logout.add_argument("url", nargs="?", default="", help="the server to forget")
    logout.set_defaults(handler=None)
    _run_parsers(sub.add_parser("run", help="create, show, approve, discard, cancel, list runs"))
    ws = sub.add_parser("workspace", help="list or show workspaces")
    wsub = ws.add_subparsers(dest="action", required=True, metavar="{list,show}")
    _leaf(wsub, "list", workspace_list, "the organization's workspaces")
    _leaf(wsub, "show", workspace_show, "one workspace").add_argument("workspace")
    stacks.add_parsers(sub, _leaf)


def _run_parsers(run: argparse.ArgumentParser) -> None:
    rsub = run.add_subparsers(dest="action", required=True, metavar="ACTION")
    create = _leaf(rsub, "create", run_create, "queue a run on a workspace")
    create.add_argument("workspace")
    create.add_argument("--type", choices=RUN_TYPES, default="apply")
    create.add_argument("--message", default="", help="what the run is for")
    create.add_argument(
        "--template",
        default="",
        help="the template to run (default: the workspace's for the run type)",
    )
    create.add_argument(
        "--wait",
        action="store_true",
        help="follow the run, a line per status, until it ends or awaits approval "
        "(exit 0 ended well, 1 failed/canceled/discarded, 3 awaits approval)",
    )
    _leaf(rsub, "show", run_show, "one run").add_argument("run")
    approve = _leaf(rsub, "approve", run_approve, "approve a run awaiting approval")
    approve.add_argument("run")
    approve.add_argument(
        "--wait", action="store_true", help="then follow the run until it ends, as create's"
    )
    approve.add_argument(
        "--ack",
        action="append",
        default=[],
        metavar="ADDR",
        help="a resource address to delete or replace that you confirm (repeatable; "
        "needed when the workspace sets confirm_destructive)",
    )
    for name, handler, what in (
        ("discard", run_discard, "discard a run awaiting approval"),
        ("cancel", run_cancel, "cancel a run before it changes anything"),
    ):
        p = _leaf(rsub, name, handler, what)
        p.add_argument("run")
        p.add_argument("--reason", default="", help="why (recorded on the run)")
    ls = _leaf(rsub, "list", run_list, "runs, newest first")
    ls.add_argument("--workspace", default="", help="only this workspace's")
    ls.add_argument("--status", default="", help="only these statuses (comma separated)")
    ls.add_argument("--limit", type=int, default=20, help="at most this many (1-1000)")


# ------------------------------------------------------------ running a command


def main(ns: argparse.Namespace) -> int:
    """Run one client command; return the exit status. Never a traceback."""
    try:
        if ns.command == "login":
            return asyncio.run(login.login(ns))
        if ns.command == "logout":
            return login.logout(ns)
        return asyncio.run(_with_session(ns))
    except ClientError as e:
        print(f"runplane: {short(e, 1000)}", file=sys.stderr)
        return ERROR
    except KeyboardInterrupt:
        print("runplane: interrupted", file=sys.stderr)
        return INTERRUPTED
    except BrokenPipeError:
        # The reader went away (`runplane run list | head`): stop quietly, like other tools.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141


class Session:
    """A command's server, token, organization and output."""

    def __init__(self, api: Api, stored: Login | None, org: str, ns: argparse.Namespace) -> None:
        self.api = api
        self.stored = stored
        self.org_flag = org
        self.json = bool(ns.json)

    async def org(self) -> str:
        """--org, else the token's organization (stored at login, or asked)."""
        org = self.org_flag
        if not org and self.stored is not None:
            org = self.stored.org or ""
        if not org:
            who = await self.api.get("/api/v1/whoami")
            org = (who.get("org") or "") if isinstance(who, dict) else ""
        if not org:
            raise ClientError(
                "the token belongs to no organization (the admin token): pass --org",
                kind="no-org",
            )
        return _checked("organization", org)

    def show(self, data: Any, lines: list[str]) -> None:
        if self.json:
            output.dump(sys.stdout, data)
        else:
            for line in lines:
                print(line, flush=True)


async def _with_session(ns: argparse.Namespace) -> int:
    url, token, stored = login.credentials(ns.server)
    async with Api(url, token, ca_file=ns.ca_file) as api:
        handler: Handler = ns.handler
        session = Session(api, stored, ns.org if hasattr(ns, "org") else "", ns)
        return await handler(session, ns)


def _checked(what: str, value: str) -> str:
    if not valid_id(value):
        raise ClientError(f"{what} {value!r} is not a valid name", kind="bad-input")
    return value


# ------------------------------------------------------------ runs


def _runs(org: str) -> str:
    return f"/api/v1/orgs/{org}/runs"


async def run_create(s: Session, ns: argparse.Namespace) -> int:
    org, ws = await s.org(), _checked("workspace", ns.workspace)
    body = {"type": ns.type, "message": ns.message, "template": ns.template}
    answer = await s.api.post(f"/api/v1/orgs/{org}/workspaces/{ws}/runs", body)
    run = answer.body
    if not isinstance(run, dict) or not isinstance(run.get("id"), str):
        raise ClientError("bad answer: the created run has no id", kind="bad-answer")
    if not ns.wait:
        s.show(run, [output.run_line(run)])
        return OK
    return await wait(s, org, run, answer.seq)


async def wait(s: Session, org: str, run: dict[str, Any], seq: int) -> int:
    """Follow the run until it ends or awaits approval, a line per status change.

    The API has no status feed (a log follow, `GET .../logs?follow=1`, ends only with
    the run and says nothing of a wait for approval): the run is read again, every
    POLL_FIRST seconds at first, then less often up to POLL_MAX, and at once more often
    after a change. Reads carry RP-Min-Seq, so no replica answers from before the
    create. A failed read is retried (a restarting API); RETRIES in a row end it.
    """
    run_id = _checked("run", str(run["id"]))
    if not s.json:
        print(output.run_line(run), flush=True)
    last, delay, failures = run.get("status"), POLL_FIRST, 0
    while last not in SUCCEEDED | UNSUCCESSFUL | ATTENTION:
        await asyncio.sleep(delay)
        try:
            run = await s.api.get(f"{_runs(org)}/{run_id}", min_seq=seq)
        except ClientError as e:
            failures += 1
            if not e.retryable or failures > RETRIES:
                raise
            delay = min(delay * 2, POLL_MAX)
            continue
        failures = 0
        if not isinstance(run, dict):
            raise ClientError("bad answer: a run is a JSON object", kind="bad-answer")
        seen = run.get("seq")
        seq = max(seq, seen if isinstance(seen, int) else 0)
        if run.get("status") != last:
            last, delay = run.get("status"), POLL_FIRST
            if not s.json:
                print(output.run_line(run), flush=True)
        else:
            delay = min(delay * POLL_GROWTH, POLL_MAX)
    return _outcome(s, run, str(last))


def _outcome(s: Session, run: dict[str, Any], status: str) -> int:
    if s.json:
        output.dump(sys.stdout, run)
    if status in ATTENTION:
        if not s.json:
            rid = short(run.get("id", ""))
            print(f"run {rid} awaits approval: runplane run approve {rid} (or discard {rid})")
        return NEEDS_APPROVAL
    return OK if status in SUCCEEDED else RUN_FAILED


async def run_show(s: Session, ns: argparse.Namespace) -> int:
    org, run_id = await s.org(), _checked("run", ns.run)
    run = await s.api.get(f"{_runs(org)}/{run_id}")
    s.show(run, output.run_detail(run) if isinstance(run, dict) else [])
    return OK


async def _command(s: Session, ns: argparse.Namespace, action: str, body: dict[str, Any]) -> int:
    org, run_id = await s.org(), _checked("run", ns.run)
    answer = await s.api.post(f"{_runs(org)}/{run_id}/{action}", body)
    run = answer.body
    if not isinstance(run, dict):
        raise ClientError(f"bad answer: {action} did not answer a run", kind="bad-answer")
    if getattr(ns, "wait", False):
        return await wait(s, org, run, answer.seq)
    s.show(run, [output.run_line(run)])
    return OK


async def run_approve(s: Session, ns: argparse.Namespace) -> int:
    return await _command(s, ns, "approve", {"acknowledged": list(ns.ack)})


async def run_discard(s: Session, ns: argparse.Namespace) -> int:
    return await _command(s, ns, "discard", {"reason": ns.reason})


async def run_cancel(s: Session, ns: argparse.Namespace) -> int:
    return await _command(s, ns, "cancel", {"reason": ns.reason})


async def run_list(s: Session, ns: argparse.Namespace) -> int:
    org = await s.org()
    query = {"limit": str(ns.limit), "fields": "summary"}
    if ns.workspace:
        query["workspace"] = _checked("workspace", ns.workspace)
    if ns.status:
        query["status"] = ns.status
    page = await s.api.get(_runs(org), query=query)
    rows = _items(page)
    s.show(page, [output.listed_run(r) for r in rows] or ["no runs"])
    return OK


# ------------------------------------------------------------ workspaces


async def workspace_list(s: Session, ns: argparse.Namespace) -> int:
    org = await s.org()
    page = await s.api.get(f"/api/v1/orgs/{org}/workspaces")
    s.show(page, [output.workspace_line(r) for r in _items(page)] or ["no workspaces"])
    return OK


async def workspace_show(s: Session, ns: argparse.Namespace) -> int:
    org, ws = await s.org(), _checked("workspace", ns.workspace)
    row = await s.api.get(f"/api/v1/orgs/{org}/workspaces/{ws}")
    s.show(row, output.workspace_detail(row) if isinstance(row, dict) else [])
    return OK


def _items(page: Any) -> list[dict[str, Any]]:
    items = page.get("items") if isinstance(page, dict) else None
    if not isinstance(items, list):
        raise ClientError("bad answer: a list has `items`", kind="bad-answer")
    return [r for r in items if isinstance(r, dict)]
