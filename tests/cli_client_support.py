"""Helpers for the `runplane` client's tests: the real `runplane` process, its own config
directory, and TLS material. Holds no tests itself."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import ipaddress
import os
import signal
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from tests.procs import ROOT, RUNPLANE

ESC = "\x1b"


@dataclass
class Done:
    code: int
    out: str
    err: str

    def one_error(self, *needles: str) -> str:
        """Assert a failure told in one `runplane:` line holding every needle; return it."""
        assert self.code == 2, (self.code, self.out, self.err)
        assert "Traceback" not in self.err, self.err
        lines = self.err.splitlines()
        assert len(lines) == 1 and lines[0].startswith("runplane: "), self.err
        for needle in needles:
            assert needle in lines[0], (needle, lines[0])
        return lines[0]


class Cli:
    """Runs the real `runplane` with a config directory (XDG_CONFIG_HOME) of its own."""

    def __init__(self, home: Path, **env: str) -> None:
        self.home = home
        self.env = {
            k: v for k, v in os.environ.items() if k not in ("RUNPLANE_TOKEN", "RUNPLANE_URL")
        }
        self.env |= {"PYTHONPATH": str(ROOT), "XDG_CONFIG_HOME": str(home), **env}
        self.env.setdefault("PYTHONFAULTHANDLER", "1")  # a hung CLI's stacks, on SIGABRT

    @property
    def credentials(self) -> Path:
        return self.home / "runplane" / "credentials.json"

    async def start(
        self, *args: str, env: dict[str, str] | None = None, umask: int | None = None
    ) -> asyncio.subprocess.Process:
        def preexec() -> None:
            # Ctrl-C reaches the CLI as it does a terminal's foreground job: a suite started
            # in the background (`cmd &` without job control) has SIGINT ignored, which its
            # children inherit, and the CLI keeps an ignored SIGINT ignored, as it should.
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            if umask is not None:
                os.umask(umask)

        return await asyncio.create_subprocess_exec(
            *RUNPLANE,
            *args,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env={**self.env, **(env or {})},
            cwd=str(ROOT),
            preexec_fn=preexec,
        )

    async def __call__(
        self,
        *args: str,
        stdin: str = "",
        env: dict[str, str] | None = None,
        umask: int | None = None,
        timeout: float = 120,
    ) -> Done:
        proc = await self.start(*args, env=env, umask=umask)
        out, err = await asyncio.wait_for(proc.communicate(stdin.encode()), timeout)
        assert proc.returncode is not None
        return Done(proc.returncode, out.decode(errors="replace"), err.decode(errors="replace"))

    async def interrupted(self, proc: asyncio.subprocess.Process, after: str) -> Done:
        """Wait for a line holding `after` on stdout, send SIGINT (Ctrl-C), collect."""
        assert proc.stdout and proc.stderr
        seen: list[str] = []
        while after not in "".join(seen):
            line = await asyncio.wait_for(proc.stdout.readline(), 60)
            assert line, f"ended before {after!r}: {seen}"
            seen.append(line.decode())
        proc.send_signal(signal.SIGINT)
        collect = asyncio.ensure_future(proc.communicate())
        done, _ = await asyncio.wait([collect], timeout=60)
        if not done:  # hung: faulthandler (PYTHONFAULTHANDLER) prints where, on SIGABRT
            proc.send_signal(signal.SIGABRT)
            out, err = await asyncio.wait_for(collect, 30)
            raise AssertionError(f"still running 60 s after SIGINT: {err.decode()[-4000:]}")
        out, err = collect.result()
        assert proc.returncode is not None
        return Done(proc.returncode, "".join(seen) + out.decode(), err.decode())

    async def login(self, url: str, token: str, *args: str) -> Done:
        done = await self("login", url, "--token-stdin", *args, stdin=token + "\n")
        assert done.code == 0, (done.out, done.err)
        return done


def self_signed(directory: Path, host: str = "127.0.0.1") -> tuple[Path, Path]:
    """A certificate for `host` (its own CA) and its key, as PEM files."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(host))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


@contextlib.asynccontextmanager
async def serve(app: web.Application, tls: ssl.SSLContext | None = None) -> AsyncIterator[str]:
    """Serve `app` on a free port of 127.0.0.1; yield its URL."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=tls)
    await site.start()
    server = site._server
    assert isinstance(server, asyncio.base_events.Server)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"{'https' if tls else 'http'}://127.0.0.1:{port}"
    finally:
        await runner.cleanup()
