"""`runplane logs [-f] RUN --org ORG`: print a run's log through the API, or follow it.

Lines the step wrote on stdout go to stdout, stderr lines to stderr, with a
`==> phase/step <==` header on stdout when the step changes; `--phase` and `--step` pick
one phase (plan, apply, custom-<number>) or step. Without `-f` the log is read a page
(10,000 lines) at a time. With `-f` the log is
followed (server-sent events) until the run ends; a dropped connection is resumed,
skipping lines already printed (they are numbered per step).

Exit status: 0 when the run ended well (applied, planned, no_changes, drifted) or,
without `-f`, has not ended yet; 1 when it failed, was canceled or discarded; 2 for bad
input, an unreachable server or a refused request, after one `runplane: ...` line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, TextIO

import aiohttp

from events.codec import valid_id
from events.templates import valid_phase

UNSUCCESSFUL = frozenset({"failed", "canceled", "discarded"})
RESUMES = 5  # reconnections of one `-f` before giving up
PAGE = 10_000  # lines asked for at a time without -f (the API's largest page)
_READ_BUFFER = 1 << 20  # an event carries a line of up to 32K characters


class CliError(Exception):
    """Something the user can fix or retry; printed as one line."""


def add_parser(sub: Any) -> None:
    """Add `logs` to the subcommands of `runplane`."""
    p = sub.add_parser("logs", help="print a run's log; -f follows it until the run ends")
    p.add_argument("run", help="run id")
    p.add_argument("--org", required=True, help="the run's organization")
    p.add_argument("-f", "--follow", action="store_true", help="follow until the run ends")
    p.add_argument("--phase", help="only this phase: plan, apply or custom-<number>")
    p.add_argument("--step", help="only this step (checkout, init, plan, apply, ...)")
    p.add_argument("--url", default=os.environ.get("RUNPLANE_URL", "http://127.0.0.1:8080"))
    p.add_argument("--token", default=os.environ.get("RUNPLANE_TOKEN", ""))
    p.add_argument(
        "--data-dir",
        type=Path,
        default=Path(os.environ.get("RUNPLANE_DATA_DIR", ".runplane")),
        help="where to find admin-token when no token is given",
    )


def main(ns: argparse.Namespace) -> int:
    """Run `runplane logs`; return the exit status."""
    try:
        return asyncio.run(_logs(ns))
    except CliError as e:
        print(f"runplane: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (`runplane logs RUN | head`): stop quietly, like other tools.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141


def exit_status(status: str) -> int:
    return 1 if status in UNSUCCESSFUL else 0


def token_of(ns: argparse.Namespace) -> str:
    """--token, else RUNPLANE_TOKEN (the option's default), else the data directory's."""
    if ns.token:
        return str(ns.token)
    path: Path = ns.data_dir / "admin-token"
    try:
        return path.read_text().strip()
    except OSError as e:
        raise CliError(
            f"no token: pass --token, set RUNPLANE_TOKEN, or point --data-dir at a "
            f"directory with admin-token ({path}: {e.strerror})"
        ) from e


def _query(ns: argparse.Namespace) -> dict[str, str]:
    for what, value in (("run", ns.run), ("org", ns.org), ("step", ns.step or "x")):
        if not valid_id(value):
            raise CliError(f"{what} {value!r} is not a valid id")
    if ns.phase is not None and not valid_phase(ns.phase):
        raise CliError(f"phase {ns.phase!r} is not plan, apply or custom-<number>")
    query = {"phase": ns.phase, "step": ns.step}
    return {k: v for k, v in query.items() if v}


async def _logs(ns: argparse.Namespace) -> int:
    query = _query(ns)
    headers = {"Authorization": f"Bearer {token_of(ns)}"}
    base = f"{ns.url.rstrip('/')}/api/v1/orgs/{ns.org}/runs/{ns.run}"
    printer = Printer(sys.stdout, sys.stderr)
    timeout = aiohttp.ClientTimeout(total=None, connect=10, sock_read=None)
    try:
        async with aiohttp.ClientSession(
            headers=headers, timeout=timeout, read_bufsize=_READ_BUFFER
        ) as http:
            if ns.follow:
                return exit_status(await _follow(http, base, query, printer))
            await _print_pages(http, base + "/logs", query, printer)
            run = await _get(http, base, {})
            return exit_status(str(run["status"]))
    except aiohttp.InvalidURL as e:
        raise CliError(f"bad --url {ns.url!r}") from e
    except (aiohttp.ClientConnectionError, TimeoutError) as e:
        raise CliError(f"cannot reach {ns.url} ({_reason(e)})") from e
    except (aiohttp.ClientError, ValueError) as e:
        raise CliError(f"unexpected answer from {ns.url}: {e}") from e


async def _print_pages(
    http: aiohttp.ClientSession, url: str, query: dict[str, str], printer: Printer
) -> None:
    """The whole log, a page at a time: neither side holds more than a page of it."""
    offset: int | None = 0
    while offset is not None:
        page = await _get(http, url, {**query, "offset": str(offset), "limit": str(PAGE)})
        for item in page["items"]:
            printer.line(item)
        more = page.get("next_offset")
        offset = int(more) if more is not None and len(page["items"]) == PAGE else None


async def _get(http: aiohttp.ClientSession, url: str, query: dict[str, str]) -> Any:
    async with http.get(url, params=query) as resp:
        await _check(resp)
        return await resp.json()


async def _check(resp: aiohttp.ClientResponse) -> None:
    """A refused request: say what the API said (problem details), in one line."""
    if resp.status == 200:
        return
    try:
        detail = (await resp.json(content_type=None)).get("detail", "")
    except (ValueError, AttributeError, aiohttp.ContentTypeError):
        detail = ""
    raise CliError(f"{resp.status} {resp.reason}" + (f": {detail}" if detail else ""))


async def _follow(
    http: aiohttp.ClientSession, url: str, query: dict[str, str], printer: Printer
) -> str:
    """Print lines as they come until `end`; return the run's terminal status."""
    params = {**query, "follow": "1"}
    for attempt in range(RESUMES + 1):
        try:
            async with http.get(url + "/logs", params=params) as resp:
                await _check(resp)
                async for name, data in sse_events(resp):
                    if name == "line":
                        printer.line(data)
                    elif name == "end":
                        return str(data["status"])
        except aiohttp.ClientPayloadError:
            pass  # the stream broke off: resume below
        if attempt < RESUMES:
            await asyncio.sleep(min(0.5 * 2**attempt, 5))
    raise CliError("the log stream kept breaking off before the run ended")


async def sse_events(resp: aiohttp.ClientResponse) -> AsyncIterator[tuple[str, Any]]:
    """The server-sent events of a response: (event name, data decoded from JSON)."""
    name, data = "message", list[str]()
    async for raw in resp.content:
        line = raw.decode(errors="replace").rstrip("\r\n")
        if not line:
            if data:
                yield name, json.loads("\n".join(data))
            name, data = "message", []
        elif not line.startswith(":"):
            field, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if field == "event":
                name = value
            elif field == "data":
                data.append(value)


class Printer:
    """Prints each line once, stdout and stderr apart, a header when the step changes."""

    def __init__(self, out: TextIO, err: TextIO) -> None:
        self.out = out
        self.err = err
        self.printed: dict[tuple[str, str], int] = {}
        self.step: tuple[str, str] | None = None

    def line(self, item: dict[str, Any]) -> None:
        key = (str(item["phase"]), str(item["step"]))
        number = int(item["line"])
        if number <= self.printed.get(key, 0):
            return  # already printed before a reconnection
        self.printed[key] = number
        if key != self.step:
            self.step = key
            print(f"==> {key[0]}/{key[1]} <==", file=self.out, flush=True)
        stream = self.err if item["stream"] == "stderr" else self.out
        print(item["text"], file=stream, flush=True)


def _reason(e: BaseException) -> str:
    os_error = getattr(e, "os_error", None)
    if isinstance(os_error, OSError) and os_error.strerror:
        return str(os_error.strerror)
    return type(e).__name__
