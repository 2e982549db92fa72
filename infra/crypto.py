"""AES-256-GCM envelopes for what runplane keeps at rest: plan files, state versions, secrets.

An envelope is `RPE` | version (1 byte) | key id (8 bytes) | nonce (12 bytes) | ciphertext
| tag (16 bytes). The nonce is random per envelope. The associated data is the header's
first 12 bytes (so the version and key id cannot be swapped) and a *context* the caller
names, such as the object's bucket and name: an envelope moved under another name, or a
secret's value copied to another key, no longer opens.

Keys rotate: a `KeyRing` seals with its current key and opens with any key it holds, found
by the key id in the header. Keys come from configuration (`RUNPLANE_ENCRYPTION_KEY`, the
base64 of 32 bytes; a comma-separated list puts the current key first and older keys after)
or from `<data-dir>/encryption.key` (one key a line, the current one first), which
`runplane up` generates once with mode 0600.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import secrets
from dataclasses import dataclass
from io import BufferedWriter
from pathlib import Path
from typing import BinaryIO

import structlog
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers import (
    AEADDecryptionContext,
    Cipher,
    algorithms,
    modes,
)
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

log = structlog.get_logger(__name__)

MAGIC = b"RPE"
VERSION = 1
KEY_BYTES = 32
KEY_ID_BYTES = 8
NONCE_BYTES = 12
TAG_BYTES = 16
_BOUND = len(MAGIC) + 1 + KEY_ID_BYTES  # the header bytes bound into the associated data
HEADER_BYTES = _BOUND + NONCE_BYTES
OVERHEAD = HEADER_BYTES + TAG_BYTES
KEY_FILE = "encryption.key"
ENV_VAR = "RUNPLANE_ENCRYPTION_KEY"
_CHUNK = 1024 * 1024


class CryptoError(Exception):
    """Root of the errors of this module."""

    retryable = False


class KeyConfigError(CryptoError):
    """No usable key: missing, malformed, or the key file cannot be read or made."""


class UnknownKey(CryptoError):
    """The envelope was sealed with a key this process does not hold."""


class Tampered(CryptoError):
    """The envelope is not one, or it was altered, or it belongs to another context."""


def key_id(key: bytes) -> bytes:
    """A key's public name: the first 8 bytes of a hash of it (never the key itself)."""
    return hashlib.sha256(b"runplane-key-id\0" + key).digest()[:KEY_ID_BYTES]


@dataclass(frozen=True)
class KeyRing:
    """The current key (sealing) and every key that may still open old envelopes."""

    current: bytes
    older: tuple[bytes, ...] = ()

    def __post_init__(self) -> None:
        for key in (self.current, *self.older):
            if len(key) != KEY_BYTES:
                raise KeyConfigError(f"an encryption key must be {KEY_BYTES} bytes")

    @classmethod
    def generate(cls) -> KeyRing:
        return cls(secrets.token_bytes(KEY_BYTES))

    @property
    def current_id(self) -> str:
        return key_id(self.current).hex()

    def _key(self, kid: bytes) -> bytes:
        for key in (self.current, *self.older):
            if key_id(key) == kid:
                return key
        raise UnknownKey(f"sealed with key {kid.hex()}, which this process does not hold")

    # ------------------------------------------------------------ in memory

    def seal(self, plaintext: bytes, context: str) -> bytes:
        """Encrypt `plaintext`, bound to `context` (e.g. the object's bucket and name)."""
        header = _header(self.current)
        nonce = secrets.token_bytes(NONCE_BYTES)
        sealed = AESGCM(self.current).encrypt(nonce, plaintext, _ad(header, context))
        return header + nonce + sealed

    def open(self, envelope: bytes, context: str) -> bytes:
        """Decrypt an envelope sealed for `context`; Tampered or UnknownKey if it cannot."""
        bound = _parse_header(envelope[:HEADER_BYTES], len(envelope))
        key = self._key(bound[len(MAGIC) + 1 :])
        nonce = envelope[_BOUND:HEADER_BYTES]
        try:
            return AESGCM(key).decrypt(nonce, envelope[HEADER_BYTES:], _ad(bound, context))
        except InvalidTag as e:
            raise Tampered(f"the envelope for {context} failed authentication") from e

    # ------------------------------------------------------------ files, streamed

    def seal_file(self, src: Path, dest: Path, context: str) -> None:
        """Encrypt file `src` into `dest` in chunks (plan files can be large)."""
        with src.open("rb") as fin, _private(dest) as fout:
            self.seal_stream(fin, fout, context)

    def seal_stream(self, fin: BinaryIO, fout: BinaryIO, context: str) -> None:
        """Encrypt what `fin` holds from where it is into `fout`, a chunk at a time."""
        header = _header(self.current)
        nonce = secrets.token_bytes(NONCE_BYTES)
        enc = Cipher(algorithms.AES(self.current), modes.GCM(nonce)).encryptor()
        enc.authenticate_additional_data(_ad(header, context))
        fout.write(header + nonce)
        while chunk := fin.read(_CHUNK):
            fout.write(enc.update(chunk))
        fout.write(enc.finalize() + enc.tag)

    def open_file(self, src: Path, dest: Path, context: str) -> None:
        """Decrypt file `src` into `dest`; `dest` appears only once the tag has verified."""
        size = src.stat().st_size
        part = dest.with_name(f".{dest.name}.part")
        with src.open("rb") as fin:
            bound = _parse_header(fin.read(HEADER_BYTES), size)
            key = self._key(bound[len(MAGIC) + 1 :])
            fin.seek(_BOUND)
            nonce = fin.read(NONCE_BYTES)
            fin.seek(size - TAG_BYTES)
            tag = fin.read(TAG_BYTES)
            fin.seek(HEADER_BYTES)
            dec = Cipher(algorithms.AES(key), modes.GCM(nonce, tag)).decryptor()
            dec.authenticate_additional_data(_ad(bound, context))
            try:
                _stream(fin, size - OVERHEAD, dec, part)
            except InvalidTag as e:
                part.unlink(missing_ok=True)
                raise Tampered(f"the envelope for {context} failed authentication") from e
        os.replace(part, dest)


def _stream(fin: BinaryIO, length: int, dec: AEADDecryptionContext, part: Path) -> None:
    """Decrypt `length` ciphertext bytes from `fin` into `part`; finalize checks the tag."""
    with _private(part) as fout:
        left = length
        while left > 0:
            chunk = fin.read(min(_CHUNK, left))
            if not chunk:
                raise InvalidTag()
            left -= len(chunk)
            fout.write(dec.update(chunk))
        fout.write(dec.finalize())


def _header(key: bytes) -> bytes:
    return MAGIC + bytes([VERSION]) + key_id(key)


def _ad(bound: bytes, context: str) -> bytes:
    return bound + b"\0" + context.encode()


def _parse_header(head: bytes, total: int) -> bytes:
    """The bound part of a header (magic, version, key id); Tampered if it is not one."""
    if total < OVERHEAD or len(head) < HEADER_BYTES or not head.startswith(MAGIC):
        raise Tampered("not a runplane envelope (bad header or truncated)")
    if head[len(MAGIC)] != VERSION:
        raise Tampered(f"unknown envelope version {head[len(MAGIC)]}")
    return head[:_BOUND]


def _private(path: Path) -> BufferedWriter:
    """A file only its owner may read (plaintext plans pass through here too)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    return os.fdopen(fd, "wb")


# ---------------------------------------------------------------- loading keys


def parse_keys(text: str, where: str) -> KeyRing:
    """Keys given as base64, separated by commas or newlines, the current one first."""
    tokens = [t.strip() for t in text.replace(",", "\n").splitlines() if t.strip()]
    if not tokens:
        raise KeyConfigError(f"{where} holds no key")
    keys = [_decode_key(t, where) for t in tokens]
    return KeyRing(keys[0], tuple(keys[1:]))


def _decode_key(token: str, where: str) -> bytes:
    try:
        key = base64.b64decode(token + "=" * (-len(token) % 4), altchars=b"-_", validate=False)
    except (binascii.Error, ValueError) as e:
        raise KeyConfigError(f"{where}: a key is not valid base64") from e
    if len(key) != KEY_BYTES:
        raise KeyConfigError(
            f"{where}: a key must be the base64 of {KEY_BYTES} bytes, got {len(key)} bytes"
        )
    return key


def encode_key(key: bytes) -> str:
    return base64.b64encode(key).decode()


def load_keyring(configured: str, data_dir: Path, *, create: bool = False) -> KeyRing:
    """The keys from configuration, else from `<data_dir>/encryption.key`.

    With `create` (runplane up) a missing key file is generated once; without it a missing
    key is a KeyConfigError saying how to provide one.
    """
    if configured.strip():
        return parse_keys(configured, ENV_VAR)
    path = data_dir / KEY_FILE
    if not path.exists():
        if not create:
            raise KeyConfigError(
                f"no encryption key: set {ENV_VAR} (base64 of 32 bytes) or put one in {path}"
            )
        _create_key_file(path)
    return _read_key_file(path)


def _read_key_file(path: Path) -> KeyRing:
    try:
        mode = path.stat().st_mode
        text = path.read_text()
    except OSError as e:
        raise KeyConfigError(f"cannot read the encryption key {path}: {e.strerror}") from e
    if mode & 0o077:
        log.warning("key_file_permissions", path=str(path), mode=oct(mode & 0o777))
    return parse_keys(text, str(path))


def _create_key_file(path: Path) -> None:
    """Write a new key where no process can see half of it, never replacing one.

    The key is written to a private temporary file, then hard-linked into place: the link
    fails if another process made the key first, and theirs is kept.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(encode_key(KeyRing.generate().current) + "\n")
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
            log.info("encryption_key_created", path=str(path))
        except FileExistsError:
            pass
    except OSError as e:
        raise KeyConfigError(f"cannot create the encryption key {path}: {e.strerror}") from e
    finally:
        tmp.unlink(missing_ok=True)
