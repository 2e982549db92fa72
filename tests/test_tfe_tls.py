"""HTTPS for the API (services/surfaces/tfe/tls.py): the local CA and its certificate, a given
pair, and the flags' errors as one line."""

from __future__ import annotations

import ssl
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
from cryptography import x509

from infra.natsserver import EmbeddedNats
from services.surfaces.tfe import tls
from tests.helpers import eventually
from tests.procs import ROOT, TEST_KEY, Proc, free_port


def _sans(path: Path) -> list[str]:
    cert = x509.load_pem_x509_certificate(path.read_bytes())
    ext = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return [str(n.value) for n in ext]


def test_the_local_ca_signs_a_certificate_for_localhost_and_the_names_given(
    tmp_path: Path,
) -> None:
    served = tls.local(tmp_path, ["runplane.internal"])
    assert served.ca is not None
    for key in (served.key, served.ca.parent / "ca-key.pem"):
        assert key.stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "tls").stat().st_mode & 0o777 == 0o700
    assert {"localhost", "127.0.0.1", "runplane.internal"} <= set(_sans(served.cert))
    # a client trusting the CA verifies the served certificate for each name, no other
    client = ssl.create_default_context(cafile=str(served.ca))
    server = served.context()
    for name in ("localhost", "127.0.0.1", "runplane.internal"):
        assert _handshake(client, server, name) is not None, name
    with pytest.raises(ssl.SSLCertVerificationError):
        _handshake(client, server, "elsewhere.example")


def _handshake(client: ssl.SSLContext, server: ssl.SSLContext, name: str) -> str | None:
    """A TLS handshake in memory; the client's protocol version once it completes."""
    c_in, c_out, s_in, s_out = (ssl.MemoryBIO() for _ in range(4))
    c = client.wrap_bio(c_in, c_out, server_hostname=name)
    s = server.wrap_bio(s_in, s_out, server_side=True)
    for _ in range(10):
        for side in (c, s):
            try:
                side.do_handshake()
            except ssl.SSLWantReadError:
                pass
        s_in.write(c_out.read())
        c_in.write(s_out.read())
    return c.version()


def test_the_ca_is_kept_and_the_certificate_made_again_only_for_a_new_name(
    tmp_path: Path,
) -> None:
    first = tls.local(tmp_path)
    assert first.ca is not None
    ca, cert = first.ca.read_bytes(), first.cert.read_bytes()
    again = tls.local(tmp_path)
    assert (again.cert.read_bytes(), again.ca and again.ca.read_bytes()) == (cert, ca)
    named = tls.local(tmp_path, ["ci.example"])
    assert named.cert.read_bytes() != cert and named.ca and named.ca.read_bytes() == ca
    assert "ci.example" in _sans(named.cert)


def test_a_given_pair_must_be_whole_and_match(tmp_path: Path) -> None:
    a = tls.local(tmp_path / "a")
    b = tls.local(tmp_path / "b")
    assert tls.given(str(a.cert), str(a.key)).cert == a.cert
    with pytest.raises(tls.TlsError, match="go together"):
        tls.given(str(a.cert), "")
    with pytest.raises(tls.TlsError, match="no such file"):
        tls.given(str(a.cert), str(tmp_path / "missing.pem"))
    with pytest.raises(tls.TlsError, match="cannot use"):
        tls.given(str(a.cert), str(b.key))


def test_runplane_api_with_half_a_pair_says_so_in_one_line(tmp_path: Path) -> None:
    cert = tls.local(tmp_path).cert
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.root.cli",
            "api",
            "--nats-url",
            "nats://127.0.0.1:1",
            "--data-dir",
            str(tmp_path / "d"),
            "--tls-cert",
            str(cert),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PYTHONPATH": str(ROOT), "RUNPLANE_ENCRYPTION_KEY": TEST_KEY, "PATH": "/usr/bin:/bin"},
        check=False,
    )
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == ["runplane: --tls-cert and --tls-key go together"]


async def test_runplane_api_serves_a_given_pair_over_https_only(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    served = tls.local(tmp_path / "certs", ["api.test"])
    assert served.ca is not None
    port = free_port()
    proc = await Proc(
        [
            "api",
            "--nats-url",
            nats_server.url,
            "--data-dir",
            str(tmp_path / "d"),
            "--listen",
            f"127.0.0.1:{port}",
            "--tls-cert",
            str(served.cert),
            "--tls-key",
            str(served.key),
        ],
        tmp_path / "api.log",
        env={"RUNPLANE_ADMIN_TOKEN": "t0ken"},
    ).start()
    trusted = aiohttp.TCPConnector(ssl=ssl.create_default_context(cafile=str(served.ca)))
    try:
        async with aiohttp.ClientSession(connector=trusted) as session:

            async def discovered() -> dict[str, str]:
                try:
                    url = f"https://localhost:{port}/.well-known/terraform.json"
                    async with session.get(url) as r:
                        found: dict[str, str] = await r.json() if r.status == 200 else {}
                        return found
                except aiohttp.ClientConnectionError:
                    return {}

            found = await eventually(discovered, timeout=60, what="runplane api over https")
            assert found["tfe.v2.1"] == "/api/v2/"
            assert f"https://127.0.0.1:{port}" in proc.output()
            async with aiohttp.ClientSession() as plain:
                with pytest.raises(aiohttp.ClientError):
                    async with plain.get(f"http://127.0.0.1:{port}/healthz") as r:
                        await r.read()
    finally:
        assert await proc.stop() == 0, proc.output()[-2000:]
