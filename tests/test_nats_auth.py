"""NATS takes only runplane's credentials: the embedded server refuses a bare CONNECT,
every runplane process authenticates, the secret is never in argv or a log line, and
`--nats-url` takes several servers and fails on one line naming each."""

from __future__ import annotations

import asyncio
import os
import stat
import subprocess
import sys
from pathlib import Path

import nats
import nats.errors
import pytest

from infra.childenv import child_env
from infra.natsclient import NatsAuth, NatsSettingError, client_env, server_list
from infra.natsserver import CREDENTIALS_FILE, EmbeddedNats
from services.root.cli import options, parser
from tests.procs import ROOT, TEST_KEY, Proc, descendants, free_port, wait_healthy


async def _bare_connect(port: int, connect: bytes) -> bytes:
    """Speak the NATS protocol by hand: INFO, then `connect`, then PING."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        info = await asyncio.wait_for(reader.readline(), 5)
        assert info.startswith(b"INFO"), info
        assert b'"auth_required":true' in info
        writer.write(connect + b"\r\nPING\r\n")
        await writer.drain()
        return await asyncio.wait_for(reader.readline(), 5)
    finally:
        writer.close()


async def test_a_bare_connect_to_the_embedded_server_is_refused(
    nats_server: EmbeddedNats,
) -> None:
    answer = await _bare_connect(nats_server.port, b'CONNECT {"verbose":false}')
    assert b"Authorization Violation" in answer, answer
    wrong = b'CONNECT {"verbose":false,"user":"runplane","pass":"guess"}'
    assert b"Authorization Violation" in await _bare_connect(nats_server.port, wrong)
    with pytest.raises(nats.errors.Error, match="Authorization Violation"):
        await nats.connect(nats_server.url, allow_reconnect=False)


async def test_the_credentials_are_made_once_0600_and_reused(tmp_path: Path) -> None:
    async with EmbeddedNats(tmp_path / "nats") as first:
        made = first.auth
        conn = await first.connect()
        await conn.close()
    path = tmp_path / "nats" / CREDENTIALS_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "nats" / "nats-server.conf").stat().st_mode) == 0o600
    async with EmbeddedNats(tmp_path / "nats") as again:
        assert again.auth == made and made.password
        conn = await again.connect()
        await conn.close()


async def test_the_password_is_in_no_argv_and_no_log_line(nats_server: EmbeddedNats) -> None:
    secret = nats_server.auth.password
    assert nats_server.pid is not None
    assert secret.encode() not in Path(f"/proc/{nats_server.pid}/cmdline").read_bytes()
    assert secret not in nats_server.url and secret not in repr(nats_server.auth)


def test_jobs_get_no_nats_credentials(nats_server: EmbeddedNats) -> None:
    """The fixture put the credentials in this process's environment, as a deployment
    does: what git and Terraform inherit has none of them."""
    assert os.environ["RUNPLANE_NATS_PASSWORD"] == nats_server.auth.password
    env = child_env()
    assert not [k for k in env if k.startswith(("RUNPLANE_", "NATS_"))]
    assert nats_server.auth.password not in "".join(env.values())


async def test_runplane_up_connects_and_its_data_dir_is_private(tmp_path: Path) -> None:
    data = tmp_path / "data"
    port = free_port()
    up = Proc(["up", "--data-dir", str(data), "--listen", f"127.0.0.1:{port}"], tmp_path / "up.log")
    await up.start()
    try:
        await wait_healthy(f"http://127.0.0.1:{port}")
        assert up.proc is not None
        password = (data / "nats" / CREDENTIALS_FILE).read_text()
        for pid in descendants(up.proc.pid):  # runplane up and its nats-server
            argv = Path(f"/proc/{pid}/cmdline").read_bytes()
            assert b"password" not in argv and password.encode() not in argv
        wide = _not_private(data)
        assert (data / "readmodel.sqlite-wal").exists()
        assert not wide, wide
    finally:
        assert await up.stop() == 0, up.output()[-3000:]
    log = up.output()
    assert "nats_started" in log
    secret = password.split('"password": "')[1].split('"')[0]
    assert secret not in log


def _not_private(root: Path) -> list[str]:
    """Everything under `root` that a group or other user may read, write or enter."""
    found = []
    for path in [root, *root.rglob("*")]:
        mode = path.lstat().st_mode
        if not stat.S_ISLNK(mode) and mode & 0o077:
            found.append(f"{path.relative_to(root)} {oct(stat.S_IMODE(mode))}")
    return found


# ---------------------------------------------------------------- --nats-url deployments


def _runplane(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("RUNPLANE_NATS_")}
    return subprocess.run(
        [sys.executable, "-m", "services.root.cli", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
        env={**base, "RUNPLANE_CONNECT_TIMEOUT": "2", "RUNPLANE_ENCRYPTION_KEY": TEST_KEY, **env},
    )


def _one_line(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode != 0
    assert "Traceback" not in done.stderr, done.stderr
    lines = [ln for ln in done.stderr.splitlines() if ln.startswith("runplane:")]
    assert len(lines) == 1, done.stderr
    return lines[0]


def test_an_unreachable_cluster_is_one_line_naming_each_url(tmp_path: Path) -> None:
    a, b = free_port(), free_port()
    urls = f"nats://127.0.0.1:{a},nats://127.0.0.1:{b}"
    done = _runplane("executor", "--nats-url", urls, "--data-dir", str(tmp_path), env={})
    line = _one_line(done)
    for port in (a, b):
        assert f"nats://127.0.0.1:{port} (ConnectionRefusedError" in line, line
    assert "invalid connect url" not in line


def test_wrong_credentials_are_one_line_saying_so(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    env = {"RUNPLANE_NATS_USER": "runplane", "RUNPLANE_NATS_PASSWORD": "wrong"}
    args = ("scheduler", "--nats-url", nats_server.url, "--data-dir", str(tmp_path))
    line = _one_line(_runplane(*args, env=env))
    assert f"{nats_server.url} (Error: Authorization Violation)" in line, line
    assert "wrong" not in line
    line = _one_line(_runplane(*args, env={}))  # none at all
    assert "Authorization Violation" in line, line


async def test_a_process_authenticates_with_a_password_file(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    secret = tmp_path / "nats-password"
    secret.write_text(nats_server.auth.password + "\n")
    args = [
        "replay",
        f"--nats-url={nats_server.url}",
        "--nats-url",
        f"127.0.0.1:{free_port()}",  # a dead second server changes nothing
        "--nats-user",
        "runplane",
        "--nats-password-file",
        str(secret),
        "--data-dir",
        str(tmp_path / "replay"),
    ]
    done = await asyncio.to_thread(_runplane, *args, env={})
    assert done.returncode == 0, done.stderr
    assert "replayed" in done.stdout


def test_nats_url_takes_several_servers_comma_separated_and_repeated() -> None:
    ns = parser().parse_args(
        ["executor", "--nats-url", "nats://a:4222,b:4223", "--nats-url", "tls://c:4224"]
    )
    assert options(ns).nats_servers() == ["nats://a:4222", "nats://b:4223", "tls://c:4224"]
    assert server_list([" nats://a:1 , ,nats://b:2"]) == ["nats://a:1", "nats://b:2"]


@pytest.mark.parametrize(
    ("url", "needle"),
    [
        ("nats://runplane:hunter2@a:4222", "not in the URL"),
        ("http://a:4222", "scheme"),
        ("nats://a:port", "bad NATS URL"),
        ("nats://:4222", "no host"),
    ],
)
def test_a_bad_nats_url_is_refused(url: str, needle: str) -> None:
    with pytest.raises(NatsSettingError, match=needle) as caught:
        server_list([url])
    assert "hunter2" not in str(caught.value)


def test_credentials_come_from_the_environment_and_files_never_flags(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("t0ken-x\n")
    auth = NatsAuth.from_env(
        {"RUNPLANE_NATS_USER": "u", "RUNPLANE_NATS_PASSWORD": "pa55-x"}, token_file=str(token)
    )
    assert auth.connect_options() == {"user": "u", "password": "pa55-x", "token": "t0ken-x"}
    auth = NatsAuth.from_env({"RUNPLANE_NATS_TOKEN": "t0ken-y"}, user="u", password_file="")
    assert auth.connect_options() == {"user": "u", "password": "", "token": "t0ken-y"}
    assert "t0ken" not in repr(auth)
    assert client_env(NatsAuth(user="u", password="p")) == {
        "RUNPLANE_NATS_USER": "u",
        "RUNPLANE_NATS_PASSWORD": "p",
    }
    with pytest.raises(NatsSettingError, match="needs a user"):
        NatsAuth(password="p").connect_options()
    with pytest.raises(NatsSettingError, match="cannot read NATS token"):
        NatsAuth(token_file=tmp_path / "missing").connect_options()
    with pytest.raises(NatsSettingError, match="go together"):
        NatsAuth(tls_cert=tmp_path / "c.pem").connect_options()
    with pytest.raises(SystemExit):  # no flag takes a secret's value
        parser().parse_args(["executor", "--nats-password", "p"])
