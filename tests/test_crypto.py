"""AES-GCM envelopes and key loading: what is sealed opens only as what it was sealed for."""

from __future__ import annotations

import base64
import os
import stat
from pathlib import Path

import pytest

from infra.crypto import (
    HEADER_BYTES,
    KEY_FILE,
    KeyConfigError,
    KeyRing,
    Tampered,
    UnknownKey,
    encode_key,
    load_keyring,
    parse_keys,
)


def test_an_envelope_opens_to_its_plaintext_and_hides_it() -> None:
    """Sealing hides the bytes, draws a new nonce each time, and opens back."""
    ring = KeyRing.generate()
    one = ring.seal(b"PK\x03\x04 a plan", "rp-plans/r1.tfplan")
    two = ring.seal(b"PK\x03\x04 a plan", "rp-plans/r1.tfplan")
    assert one != two, "a fresh nonce per envelope"
    assert not one.startswith(b"PK") and b"a plan" not in one
    assert ring.open(one, "rp-plans/r1.tfplan") == b"PK\x03\x04 a plan"


def test_an_envelope_does_not_open_under_another_name() -> None:
    """The context (object name) is bound: a swapped object is refused."""
    ring = KeyRing.generate()
    sealed = ring.seal(b"state", "rp-state/acme/net/1-aa")
    with pytest.raises(Tampered):
        ring.open(sealed, "rp-state/acme/net/2-bb")


@pytest.mark.parametrize("where", [0, 4, HEADER_BYTES - 1, HEADER_BYTES, -1])
def test_a_flipped_byte_anywhere_is_detected(where: int) -> None:
    """Header, nonce, ciphertext or tag: one flipped bit and the envelope is refused."""
    ring = KeyRing.generate()
    sealed = bytearray(ring.seal(b"x" * 100, "c"))
    sealed[where] ^= 0x01
    with pytest.raises((Tampered, UnknownKey)):
        ring.open(bytes(sealed), "c")


def test_rotation_opens_old_envelopes_and_seals_with_the_new_key() -> None:
    """A ring with the new key first still opens what the old key sealed."""
    old = KeyRing.generate()
    sealed = old.seal(b"v1", "c")
    rotated = KeyRing(KeyRing.generate().current, (old.current,))
    assert rotated.open(sealed, "c") == b"v1"
    assert rotated.seal(b"v2", "c")[4:12] != sealed[4:12], "the header names the new key"
    with pytest.raises(UnknownKey):
        KeyRing.generate().open(sealed, "c")


def test_files_are_sealed_and_opened_in_chunks(tmp_path: Path) -> None:
    """A file larger than a chunk round-trips; a tampered file leaves no output behind."""
    ring = KeyRing.generate()
    clear = tmp_path / "plan"
    clear.write_bytes(os.urandom(3 * 1024 * 1024 + 7))
    ring.seal_file(clear, tmp_path / "sealed", "ctx")
    ring.open_file(tmp_path / "sealed", tmp_path / "opened", "ctx")
    assert (tmp_path / "opened").read_bytes() == clear.read_bytes()
    assert stat.S_IMODE((tmp_path / "opened").stat().st_mode) == 0o600
    data = bytearray((tmp_path / "sealed").read_bytes())
    data[len(data) // 2] ^= 0x80
    (tmp_path / "sealed").write_bytes(bytes(data))
    with pytest.raises(Tampered):
        ring.open_file(tmp_path / "sealed", tmp_path / "again", "ctx")
    assert not any(p.name.startswith((".again", "again")) for p in tmp_path.iterdir())


def test_the_key_file_is_made_once_private_and_then_reused(tmp_path: Path) -> None:
    """`create` writes a 0600 key once; later loads (with or without create) read it."""
    first = load_keyring("", tmp_path, create=True)
    path = tmp_path / KEY_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_keyring("", tmp_path, create=True) == first
    assert load_keyring("", tmp_path) == first
    assert [p.name for p in tmp_path.iterdir()] == [KEY_FILE], "no temporary file left"


def test_a_missing_key_is_a_config_error_saying_how_to_fix_it(tmp_path: Path) -> None:
    with pytest.raises(KeyConfigError, match="RUNPLANE_ENCRYPTION_KEY"):
        load_keyring("", tmp_path)


def test_configured_keys_come_first_and_must_be_32_bytes(tmp_path: Path) -> None:
    """The configured value wins over the file; current key first, older ones after."""
    a, b = KeyRing.generate().current, KeyRing.generate().current
    ring = load_keyring(f"{encode_key(a)},{encode_key(b)}", tmp_path, create=True)
    assert (ring.current, ring.older) == (a, (b,))
    assert not (tmp_path / KEY_FILE).exists()
    short = base64.b64encode(b"x" * 16).decode()
    with pytest.raises(KeyConfigError, match="32 bytes"):
        parse_keys(short, "RUNPLANE_ENCRYPTION_KEY")
    with pytest.raises(KeyConfigError):
        parse_keys("not base64 at all!!", "RUNPLANE_ENCRYPTION_KEY")
