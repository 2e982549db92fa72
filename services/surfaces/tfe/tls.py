"""HTTPS for the API: the Terraform CLI discovers services over HTTPS only.

`runplane up --tls` serves the certificate and key it is given (`--tls-cert` /
`--tls-key`), or, without them, one of its own: a local CA made once in the data
directory (`tls/ca.pem`, key `tls/ca-key.pem`) and a server certificate it signs for
localhost, 127.0.0.1, ::1 and each `--tls-name` (`tls/server.pem`, `tls/server-key.pem`),
made again when a name is added or it nears its end. Keys are written 0600 and never
leave the directory; the CA's path is printed so a user can trust it (`SSL_CERT_FILE`
for Terraform). `runplane api` serves only a certificate it is given.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import ssl
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CA_DAYS = 3650
SERVER_DAYS = 397  # the longest a browser takes
RENEW_BEFORE = dt.timedelta(days=30)
DEFAULT_NAMES = ("localhost", "127.0.0.1", "::1")


class TlsError(Exception):
    """A certificate or key cannot be read, made or used; the message says which."""

    retryable = False


@dataclass(frozen=True)
class Served:
    """What the API serves: its certificate and key, and the local CA if it made one."""

    cert: Path
    key: Path
    ca: Path | None = None

    def context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            ctx.load_cert_chain(self.cert, self.key)
        except (OSError, ssl.SSLError) as e:
            raise TlsError(f"cannot use certificate {self.cert} with key {self.key}: {e}") from e
        return ctx


def given(cert: str, key: str) -> Served:
    """A certificate and key the operator gave: both, readable."""
    if bool(cert) != bool(key):
        raise TlsError("--tls-cert and --tls-key go together")
    for path in (cert, key):
        if not Path(path).is_file():
            raise TlsError(f"no such file: {path}")
    served = Served(Path(cert), Path(key))
    served.context()  # a pair that does not load is an error now, not at the first client
    return served


def _write_private(path: Path, data: bytes) -> None:
    """Write a key 0600 whatever the umask, replacing the file atomically."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(data)
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


def _write_public(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _ca(directory: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    cert_path, key_path = directory / "ca.pem", directory / "ca-key.pem"
    if cert_path.is_file() and key_path.is_file():
        try:
            cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
            key = serialization.load_pem_private_key(key_path.read_bytes(), None)
        except (OSError, ValueError) as e:
            raise TlsError(f"cannot read the local CA in {directory}: {e}") from e
        if isinstance(key, ec.EllipticCurvePrivateKey) and cert.not_valid_after_utc > _now():
            return cert, key
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "runplane local CA")])
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=CA_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    _write_private(key_path, _pem_key(key))
    _write_public(cert_path, cert.public_bytes(serialization.Encoding.PEM))
    return cert, key


def _alt_name(name: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)


def _current(path: Path, names: list[str], ca: x509.Certificate) -> bool:
    """Whether the server certificate there covers `names`, is the CA's and not ending."""
    try:
        cert = x509.load_pem_x509_certificate(path.read_bytes())
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (OSError, ValueError, x509.ExtensionNotFound):
        return False
    wanted = {_alt_name(n) for n in names}
    fresh = cert.not_valid_after_utc - RENEW_BEFORE > _now()
    return cert.issuer == ca.subject and wanted <= set(sans) and fresh


def local(data_dir: Path, names: list[str] | tuple[str, ...] = ()) -> Served:
    """The local CA and a server certificate it signed for localhost and `names`, made
    (or made again) in `<data_dir>/tls`."""
    for name in names:
        if not name or len(name) > 253 or any(c.isspace() for c in name):
            raise TlsError(f"--tls-name {name!r} is not a host name or address")
    directory = data_dir / "tls"
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    all_names = list(dict.fromkeys([*DEFAULT_NAMES, *names]))
    ca_cert, ca_key = _ca(directory)
    cert_path, key_path = directory / "server.pem", directory / "server-key.pem"
    if not (key_path.is_file() and _current(cert_path, all_names, ca_cert)):
        key = ec.generate_private_key(ec.SECP256R1())
        now = _now()
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, all_names[0])]))
            .issuer_name(ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=SERVER_DAYS))
            .add_extension(
                x509.SubjectAlternativeName([_alt_name(n) for n in all_names]), critical=False
            )
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                critical=False,
            )
            .sign(ca_key, hashes.SHA256())
        )
        _write_private(key_path, _pem_key(key))
        _write_public(cert_path, cert.public_bytes(serialization.Encoding.PEM))
    return Served(cert_path, key_path, ca=directory / "ca.pem")
