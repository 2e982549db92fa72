"""The OAuth device authorization grant (RFC 8628) of `runplane login --device`, with
runplane as the authorization server: the grants, in the `rp-device-grants` bucket.

A grant is made for an organization and a client (`create`): a device code (32 random
bytes, url-safe: the client's secret) and a user code (8 letters of `ALPHABET`, shown
`XXXX-XXXX`, what a person types in a browser on any machine). It is stored under a
digest of the device code (a copy of the bucket redeems nothing), and a second key under
a digest of the user code names that first key. It holds no token: the token is minted
when the grant is redeemed, by whoever redeems it first.

Every change is a compare-and-set on the revision read from the stream's leader
(`update(last=revision)`), which the leader grants to one writer: a grant is approved
or denied once, and redeemed once, whichever api replicas the browser and the polls
reach and wherever a process is killed (a grant taken and not answered is used: the
client starts again, and no token exists twice). A pending poll within the interval
since the last one is told `slow_down` and the interval grows by 5 s (RFC 8628 3.5).

Wrong user codes are counted per signed-in person (`note_wrong`), across replicas, in
the same bucket: past `MAX_WRONG` the person may enter none until `DEVICE_GRANTS_KEPT_S`
after the last one (the bucket's own expiry), so no session, replica or token of theirs
guesses faster.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from collections.abc import Callable
from typing import Literal

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.js.kv import KV_DEL, KV_OP, KV_PURGE, KeyValue

from infra.directget import as_raw, leader_get
from infra.kv import DEVICE_GRANTS_BUCKET, KvError

ALPHABET = "BCDFGHJKLMNPQRSTVWXZ"  # no vowels (no words), no look-alikes (RFC 8628 6.1)
USER_CODE_LEN = 8
GRANT_TTL_S = 600.0  # `expires_in`
INTERVAL_S = 5.0  # `interval`: the least time between two polls
SLOW_DOWN_S = 5.0  # what `slow_down` adds to the interval
POLL_SLACK_S = 1.0  # a poll this early (at most a fifth of the interval) is in time
MAX_WRONG = 10  # wrong user codes a person may enter before a pause
MAX_CLIENT_ID = 100
Status = Literal["pending", "approved", "denied", "redeemed"]
_STREAM = f"KV_{DEVICE_GRANTS_BUCKET}"


class DeviceError(Exception):
    """A grant that cannot be acted on; `error` is RFC 8628's / RFC 6749's code."""

    retryable = False

    def __init__(self, error: str, detail: str) -> None:
        super().__init__(detail)
        self.error = error


class Grant(msgspec.Struct, frozen=True, kw_only=True):
    """One device grant. The approver's fields are set when approved: the token minted
    at redemption acts as them with these, and never more."""

    org: str
    client_id: str
    user_code: str
    created: float
    expires: float
    address: str  # the requesting client's
    interval: float
    last_poll: float = 0.0
    status: Status = "pending"
    user: str = ""
    role: str = ""
    token_expires: str = ""
    kind: str = ""
    owner: str = ""
    level: str = ""
    decided_at: float = 0.0
    decided_from: str = ""  # the approving browser's address


class Approver(msgspec.Struct, frozen=True, kw_only=True):
    """Who approves, as the token they get acts (services/surfaces/tfe/login.py token_kind)."""

    org: str
    user: str
    role: str
    token_expires: str
    kind: str
    owner: str
    level: str
    address: str


class Found(msgspec.Struct, frozen=True, kw_only=True):
    grant: Grant
    key: str
    revision: int


def normal_user_code(typed: str) -> str:
    """A typed user code as stored: upper case, no dashes or spaces ("" if it cannot be one)."""
    code = "".join(c for c in typed.upper() if c not in "- \t")
    if len(code) != USER_CODE_LEN or any(c not in ALPHABET for c in code):
        return ""
    return code


def shown(user_code: str) -> str:
    return f"{user_code[:4]}-{user_code[4:]}"


def _device_key(device_code: str) -> str:
    return "d." + hashlib.sha256(b"rp-device-code\0" + device_code.encode()).hexdigest()


def _user_key(user_code: str) -> str:
    return "u." + hashlib.sha256(b"rp-user-code\0" + user_code.encode()).hexdigest()


def _wrong_key(org: str, user: str) -> str:
    return "w." + hashlib.sha256(f"rp-device-wrong\0{org}\0{user}".encode()).hexdigest()


class DeviceGrants:
    """The grants of every api replica. `now`, `ttl` and `interval` for tests."""

    def __init__(
        self,
        nc: NATS,
        *,
        now: Callable[[], float] = time.time,
        ttl: float = GRANT_TTL_S,
        interval: float = INTERVAL_S,
        timeout: float = 5.0,
    ) -> None:
        self.nc = nc
        self.now = now
        self.ttl = ttl
        self.interval = interval
        self.timeout = timeout
        self._kv: KeyValue | None = None

    async def _bucket(self) -> KeyValue:
        if self._kv is None:
            self._kv = await self.nc.jetstream(timeout=self.timeout).key_value(DEVICE_GRANTS_BUCKET)
        return self._kv

    async def create(self, org: str, client_id: str, address: str) -> tuple[str, Grant]:
        """A new grant: (device code, grant). The user code is unique among live grants
        (its key is written expecting none: a collision draws another)."""
        device_code = secrets.token_urlsafe(32)
        key = _device_key(device_code)
        now = self.now()
        for _ in range(8):
            user_code = "".join(secrets.choice(ALPHABET) for _ in range(USER_CODE_LEN))
            grant = Grant(
                org=org, client_id=client_id, user_code=user_code, created=now,
                expires=now + self.ttl, address=address, interval=self.interval,
            )  # fmt: skip
            if await self._write(_user_key(user_code), key.encode(), last=0):
                await self._write(key, msgspec.json.encode(grant), last=0)
                return device_code, grant
        raise KvError("no free user code after 8 draws")

    async def _write(self, key: str, value: bytes, *, last: int) -> bool:
        """Write `key` expecting its revision `last` (0: none); False if it moved."""
        try:
            await (await self._bucket()).update(key, value, last=last)
        except nats.js.errors.KeyWrongLastSequenceError:
            return False
        except (TimeoutError, nats.errors.Error) as e:
            raise KvError(f"writing a device grant: {e!r}") from e
        return True

    async def _read(self, key: str) -> tuple[bytes, int] | None:
        raw = await leader_get(
            self.nc,
            _STREAM,
            as_raw,
            subject=f"$KV.{DEVICE_GRANTS_BUCKET}.{key}",
            what="a device grant",
            error=KvError,
            timeout=self.timeout,
        )
        if raw is None or raw.headers.get(KV_OP) in (KV_DEL, KV_PURGE) or not raw.data:
            return None
        return raw.data, raw.seq

    async def _grant(self, key: str) -> Found | None:
        found = await self._read(key)
        if found is None:
            return None
        try:
            grant = msgspec.json.decode(found[0], type=Grant)
        except msgspec.DecodeError:
            return None
        return Found(grant=grant, key=key, revision=found[1])

    async def by_user_code(self, typed: str) -> Found | None:
        """The live, pending grant a typed user code names, or None."""
        code = normal_user_code(typed)
        if not code:
            return None
        pointer = await self._read(_user_key(code))
        if pointer is None:
            return None
        found = await self._grant(pointer[0].decode())
        if found is None or found.grant.user_code != code:
            return None
        if found.grant.status != "pending" or self.now() >= found.grant.expires:
            return None
        return found

    async def decide(self, typed: str, approver: Approver, *, approve: bool) -> Grant:
        """Approve (as `approver`) or deny the pending grant of a user code, once; a
        grant of another organization is refused (DeviceError `wrong-organization`)."""
        found = await self.by_user_code(typed)
        if found is None:
            raise DeviceError("invalid-code", "this code is wrong, expired or used already")
        if found.grant.org != approver.org:
            raise DeviceError(
                "wrong-organization", f"this code is for organization {found.grant.org}"
            )
        fields = {
            "status": "approved" if approve else "denied",
            "decided_at": self.now(),
            "decided_from": approver.address,
        }
        if approve:
            fields |= {
                "user": approver.user, "role": approver.role,
                "token_expires": approver.token_expires, "kind": approver.kind,
                "owner": approver.owner, "level": approver.level,
            }  # fmt: skip
        decided = msgspec.structs.replace(found.grant, **fields)
        if not await self._write(found.key, msgspec.json.encode(decided), last=found.revision):
            raise DeviceError("invalid-code", "this code was answered already")
        return decided

    async def poll(self, device_code: str, client_id: str) -> Grant:
        """The approved grant, taken (once: the caller mints its token), or DeviceError
        with RFC 8628's `authorization_pending`, `slow_down`, `access_denied`,
        `expired_token` or `invalid_grant`."""
        found = await self._grant(_device_key(device_code)) if device_code else None
        if found is None:
            raise DeviceError("invalid_grant", "unknown device code")
        grant, now = found.grant, self.now()
        if not secrets.compare_digest(grant.client_id.encode(), client_id.encode()):
            raise DeviceError("invalid_grant", "the device code was issued to another client")
        if grant.status == "redeemed":
            raise DeviceError("invalid_grant", "the device code was used already")
        if grant.status == "denied":
            raise DeviceError("access_denied", "the request was denied")
        if now >= grant.expires:
            raise DeviceError("expired_token", "the device code has expired: start again")
        if grant.status == "approved":
            taken = msgspec.structs.replace(grant, status="redeemed", last_poll=now)
            if not await self._write(found.key, msgspec.json.encode(taken), last=found.revision):
                raise DeviceError("invalid_grant", "the device code was used already")
            return grant
        early = now - grant.last_poll < grant.interval - min(POLL_SLACK_S, grant.interval / 5)
        polled = msgspec.structs.replace(
            grant, last_poll=now, interval=grant.interval + (SLOW_DOWN_S if early else 0)
        )
        if not await self._write(found.key, msgspec.json.encode(polled), last=found.revision):
            early = True  # another poll at the same moment: too fast by definition
        if early:
            raise DeviceError("slow_down", f"poll at most every {polled.interval:.0f} s")
        raise DeviceError("authorization_pending", "not approved yet")

    async def wrong_count(self, org: str, user: str) -> int:
        found = await self._read(_wrong_key(org, user))
        return int(found[0]) if found and found[0].isdigit() else 0

    async def note_wrong(self, org: str, user: str) -> int:
        """Count a wrong user code of `user`; the count now (every replica's)."""
        key = _wrong_key(org, user)
        for _ in range(5):
            found = await self._read(key)
            count = int(found[0]) if found and found[0].isdigit() else 0
            if await self._write(key, str(count + 1).encode(), last=found[1] if found else 0):
                return count + 1
        return MAX_WRONG  # raced five times: count it as the limit
