"""The `runplane` client against servers that lie, break or are not there, and its
credentials file: the real `runplane` process throughout, no NATS needed.

A server is trusted with a token, not with the user's terminal or memory: escape
sequences it sends are printed as text, a huge or non-JSON answer is one error line,
TLS is verified (a self-signed server is refused unless its CA is given).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import ssl
import stat
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from services.surfaces.client.credentials import Credentials, Login
from tests.cli_client_support import ESC, Cli, self_signed, serve
from tests.procs import RUNPLANE, free_port

TOKEN = "hostile-token"
TITLE = f"{ESC}]0;pwned{ESC}\\"  # retitles a terminal (OSC 0)
CLEAR = f"{ESC}[2J{ESC}[H"  # clears it
CSI_C1 = "\x9b31m"  # the 8-bit CSI: red, on terminals that take C1 controls
EVIL = f"web{TITLE}{CLEAR}{CSI_C1}"
WHO = {"user": f"eve{TITLE}", "role": "admin", "org": "acme", "token_id": "t1"}


def _hostile_app() -> web.Application:
    async def whoami(request: web.Request) -> web.Response:
        if request.headers.get("Authorization") != f"Bearer {TOKEN}":
            body = {
                "type": "https://runplane.dev/problems/unauthorized",
                "title": "x",
                "status": 401,
                "detail": f"no{CLEAR}",
            }
            return web.json_response(body, status=401, content_type="application/problem+json")
        return web.json_response(WHO)

    async def workspaces(_: web.Request) -> web.Response:
        row = {"org": "acme", "name": EVIL, "repository": f"https://x/{CLEAR}", "branch": "main"}
        return web.json_response({"items": [row]})

    async def run(request: web.Request) -> web.StreamResponse:
        match request.match_info["run"]:
            case "huge":  # 20 MiB of JSON, streamed
                resp = web.StreamResponse(headers={"Content-Type": "application/json"})
                await resp.prepare(request)
                await resp.write(b'{"id": "')
                for _ in range(20 * 16):
                    await resp.write(b"a" * 65536)
                await resp.write(b'"}')
                return resp
            case "html":
                return web.Response(text="<html>proxy</html>", content_type="text/html")
            case "refused":
                body = {"type": f"https://runplane.dev/problems/{CLEAR}", "detail": f"x{TITLE}"}
                return web.json_response(body, status=409)
            case _:
                return web.json_response(
                    {
                        "id": "r1",
                        "org": "acme",
                        "workspace": EVIL,
                        "status": f"done{CLEAR}",
                        "message": TITLE,
                        "error_message": f"boom{CSI_C1}",
                    }
                )

    app = web.Application()
    app.router.add_get("/api/v1/whoami", whoami)
    app.router.add_get("/api/v1/orgs/acme/workspaces", workspaces)
    app.router.add_get("/api/v1/orgs/acme/runs/{run}", run)
    return app


async def _whoami(_: web.Request) -> web.Response:
    return web.json_response(WHO)


@pytest.fixture
async def hostile() -> AsyncIterator[str]:
    async with serve(_hostile_app()) as url:
        yield url


def _no_control(text: str) -> None:
    assert ESC not in text and "\x07" not in text and "\x9b" not in text, repr(text)


async def test_escape_sequences_from_the_server_are_printed_as_text(
    hostile: str, tmp_path: Path
) -> None:
    cli = Cli(tmp_path)
    done = await cli.login(hostile, TOKEN)
    _no_control(done.out)
    assert "\\x1b]0;pwned" in done.out
    for args in (["workspace", "list"], ["run", "show", "r1"]):
        done = await cli(*args)
        assert done.code == 0, done.err
        _no_control(done.out)
        assert "\\x1b[2J" in done.out, done.out
    assert "\\x9b31m" in done.out  # the C1 CSI too
    listed = await cli("workspace", "list", "--json")
    _no_control(listed.out)
    assert json.loads(listed.out)["items"][0]["name"] == EVIL  # the data, intact


async def test_a_refusal_with_escape_sequences_is_one_escaped_line(
    hostile: str, tmp_path: Path
) -> None:
    cli = Cli(tmp_path)
    await cli.login(hostile, TOKEN)
    line = (await cli("run", "show", "refused")).one_error("(409 ")
    _no_control(line)
    wrong = await Cli(tmp_path / "other")("login", hostile, "--token-stdin", stdin="nope\n")
    _no_control(wrong.one_error("(401 unauthorized)"))
    assert not (tmp_path / "other" / "runplane" / "credentials.json").exists()


async def test_a_huge_answer_or_one_not_json_is_one_line_not_a_crash(
    hostile: str, tmp_path: Path
) -> None:
    cli = Cli(tmp_path)
    await cli.login(hostile, TOKEN)
    (await cli("run", "show", "huge")).one_error("more than 16 MiB")
    (await cli("run", "show", "html")).one_error("not JSON")


async def test_an_unreachable_server_is_one_line(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    done = await Cli(tmp_path)("login", url, "--token-stdin", stdin="t\n")
    done.one_error("cannot reach", url)
    done = await Cli(tmp_path)("run", "list", "--server", url, env={"RUNPLANE_TOKEN": "t"})
    done.one_error("cannot reach")
    (await Cli(tmp_path)("run", "list")).one_error("not logged in")
    (await Cli(tmp_path)("login", "ftp://x", "--token-stdin", stdin="t\n")).one_error("http(s)")


async def test_tls_is_verified_and_a_given_ca_is_honoured(tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(cert, key)
    async with serve(_hostile_app(), tls) as url:
        cli = Cli(tmp_path / "home")
        refused = await cli("login", url, "--token-stdin", stdin=TOKEN + "\n")
        refused.one_error("TLS", "certificate verify failed")
        assert not cli.credentials.exists()
        await cli.login(url, TOKEN, "--ca-file", str(cert))
        assert (await cli("workspace", "list", "--ca-file", str(cert))).code == 0
        # SSL_CERT_FILE, as OpenSSL reads it, works too
        by_env = await cli("workspace", "list", env={"SSL_CERT_FILE": str(cert)})
        assert by_env.code == 0, by_env.err
        (await cli("workspace", "list")).one_error("certificate verify failed")
        (await cli("workspace", "list", "--ca-file", str(tmp_path))).one_error("--ca-file")


async def test_ctrl_c_while_waiting_is_one_line_and_exit_130(tmp_path: Path) -> None:
    """A run that never moves: --wait is interrupted with SIGINT."""

    pending = {"id": "r1", "org": "acme", "workspace": "web", "status": "pending"}

    async def create(_: web.Request) -> web.Response:
        return web.json_response(pending, status=201)

    async def get(_: web.Request) -> web.Response:
        return web.json_response(pending)

    app = web.Application()
    app.router.add_get("/api/v1/whoami", _whoami)
    app.router.add_post("/api/v1/orgs/acme/workspaces/web/runs", create)
    app.router.add_get("/api/v1/orgs/acme/runs/r1", get)
    async with serve(app) as url:
        cli = Cli(tmp_path)
        await cli.login(url, TOKEN)
        proc = await cli.start("run", "create", "web", "--wait")
        done = await cli.interrupted(proc, "pending")
    assert done.code == 130, done.err
    assert "Traceback" not in done.err
    assert done.err.strip() == "runplane: interrupted"


# ------------------------------------------------------------ the credentials file


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


async def test_login_stores_the_token_owner_only_even_with_umask_0(
    hostile: str, tmp_path: Path
) -> None:
    home = tmp_path / "cfg"
    (home / "runplane").mkdir(parents=True, mode=0o755)  # a directory made too wide
    os.chmod(home / "runplane", 0o755)
    cli = Cli(home)
    done = await cli("login", hostile + "/", "--token-stdin", stdin=TOKEN + "\n", umask=0)
    assert done.code == 0, done.err
    assert _mode(cli.credentials) == 0o600
    assert _mode(cli.credentials.parent) == 0o700
    stored = json.loads(cli.credentials.read_text())
    assert stored["default"] == hostile  # no trailing slash
    assert stored["servers"][hostile]["token"] == TOKEN
    assert stored["servers"][hostile]["org"] == "acme"
    assert [p.name for p in cli.credentials.parent.iterdir()] == ["credentials.json"]


def test_the_file_is_never_readable_by_others_even_before_its_rename(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The new file is 0600 when created, not chmod-ed after: caught at the rename,
    with umask 0 (the worst a user may have)."""
    seen: list[int] = []
    replace = os.replace

    def spy(src: Any, dst: Any) -> None:
        seen.append(_mode(Path(src)))
        replace(src, dst)

    monkeypatch.setattr(os, "replace", spy)
    old = os.umask(0)
    try:
        creds = Credentials.load(tmp_path / "rp")
        creds.add("https://a", Login(token="t"))
        creds.save()
        creds.add("https://b", Login(token="u"))
        creds.save()
    finally:
        os.umask(old)
    assert seen == [0o600, 0o600]
    assert _mode(tmp_path / "rp" / "credentials.json") == 0o600


async def test_several_servers_the_last_login_is_the_default(tmp_path: Path) -> None:
    async with serve(_hostile_app()) as one, serve(_hostile_app()) as two:
        cli = Cli(tmp_path)
        await cli.login(one, TOKEN)
        await cli.login(two, TOKEN)
        assert json.loads(cli.credentials.read_text())["default"] == two
        assert (await cli("workspace", "list", "--server", one)).code == 0
        assert (await cli("workspace", "list", env={"RUNPLANE_URL": one})).code == 0
        (await cli("workspace", "list", "--server", "http://elsewhere")).one_error(
            "not logged in to http://elsewhere"
        )
        assert (await cli("logout")).code == 0  # the default: two
        stored = json.loads(cli.credentials.read_text())
        assert stored["default"] == one and list(stored["servers"]) == [one]
        (await cli("logout", two)).one_error("not logged in")
    assert _mode(cli.credentials) == 0o600


async def test_a_broken_credentials_file_is_one_line(tmp_path: Path) -> None:
    cli = Cli(tmp_path)
    cli.credentials.parent.mkdir(parents=True)
    cli.credentials.write_text("{not json")
    (await cli("run", "list")).one_error("is not a credentials file")


@pytest.mark.parametrize(
    "args",
    [
        ["login"],
        ["logout"],
        ["run"],
        *[["run", a] for a in ("create", "show", "approve", "discard", "cancel", "list")],
        ["workspace"],
        ["workspace", "list"],
        ["workspace", "show"],
    ],
)
async def test_every_command_has_help(args: list[str], tmp_path: Path) -> None:
    done = await Cli(tmp_path)(*args, "--help")
    assert done.code == 0 and "usage: runplane" in done.out, done.err


async def test_no_token_on_a_pipe_is_one_line(tmp_path: Path) -> None:
    done = await Cli(tmp_path)("login", "http://127.0.0.1:1")
    done.one_error("no token")


async def test_the_prompted_token_is_not_echoed(hostile: str, tmp_path: Path) -> None:
    """On a terminal (a pty here, in a session of its own so that getpass uses it and no
    one's real /dev/tty) the token is asked for with echo off."""
    cli = Cli(tmp_path)
    leader, follower = os.openpty()
    proc = await asyncio.create_subprocess_exec(
        *RUNPLANE,
        "login",
        hostile,
        stdin=follower,
        stdout=asyncio.subprocess.PIPE,
        stderr=follower,
        env=cli.env,
        start_new_session=True,
    )
    os.close(follower)
    try:
        shown = await asyncio.wait_for(asyncio.to_thread(_read_until, leader, b"Token: "), 60)
        os.write(leader, TOKEN.encode() + b"\n")
        out, _ = await asyncio.wait_for(proc.communicate(), 60)
        shown += await asyncio.to_thread(_drain, leader)
    finally:
        os.close(leader)
    assert proc.returncode == 0, shown
    assert b"Logged in to" in out
    assert TOKEN.encode() not in shown, shown
    assert json.loads(cli.credentials.read_text())["servers"][hostile]["token"] == TOKEN


def _read_until(fd: int, needle: bytes) -> bytes:
    seen = b""
    while needle not in seen:
        chunk = os.read(fd, 1024)
        assert chunk, seen
        seen += chunk
    return seen


def _drain(fd: int) -> bytes:
    """What is left on the pty once its other side closed (EIO at its end)."""
    seen = b""
    os.set_blocking(fd, False)
    with contextlib.suppress(OSError):
        while chunk := os.read(fd, 1024):
            seen += chunk
    return seen


async def test_a_redirect_is_refused_and_the_token_goes_nowhere_else(tmp_path: Path) -> None:
    elsewhere: list[str] = []

    async def catch(request: web.Request) -> web.Response:
        elsewhere.append(request.headers.get("Authorization", ""))
        return web.json_response(WHO)

    trap = web.Application()
    trap.router.add_get("/api/v1/whoami", catch)
    async with serve(trap) as other:

        async def moved(_: web.Request) -> web.Response:
            raise web.HTTPFound(other + "/api/v1/whoami")

        app = web.Application()
        app.router.add_get("/api/v1/whoami", moved)
        async with serve(app) as url:
            done = await Cli(tmp_path)("login", url, "--token-stdin", stdin=TOKEN + "\n")
    done.one_error("redirects to", other)
    assert elsewhere == []


async def test_wait_rides_out_a_restarting_api_and_prints_each_change_once(
    tmp_path: Path,
) -> None:
    """Two 503s and a dropped connection between reads: the wait goes on to the end."""
    answers: list[Any] = [
        {"status": "queued"},
        503,
        "drop",
        {"status": "queued"},
        503,
        {"status": "planning"},
        {"status": "applied"},
    ]

    async def create(_: web.Request) -> web.Response:
        return web.json_response({"id": "r1", "org": "acme", "status": "pending"}, status=201)

    async def get(request: web.Request) -> web.StreamResponse:
        answer = answers.pop(0) if answers else {"status": "applied"}
        if answer == 503:
            body = {"type": "https://runplane.dev/problems/unavailable", "detail": "restarting"}
            return web.json_response(body, status=503)
        if answer == "drop":
            assert request.transport is not None
            request.transport.close()
            return web.Response()
        return web.json_response({"id": "r1", "org": "acme", "workspace": "web", **answer})

    app = web.Application()
    app.router.add_get("/api/v1/whoami", _whoami)
    app.router.add_post("/api/v1/orgs/acme/workspaces/web/runs", create)
    app.router.add_get("/api/v1/orgs/acme/runs/r1", get)
    async with serve(app) as url:
        cli = Cli(tmp_path)
        await cli.login(url, TOKEN)
        done = await cli("run", "create", "web", "--wait")
    assert done.code == 0, (done.out, done.err)
    statuses = [line.split("  ")[2] for line in done.out.splitlines()]
    assert statuses == ["pending", "queued", "planning", "applied"], done.out
    assert answers == []
