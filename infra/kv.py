"""The key-value buckets of managed state and secrets, and reading many keys at once.

- `rp-state-head`: `<org>.<ws>` -> the workspace's current state version (JSON), moved
  with optimistic concurrency (`update(..., last=revision)`);
- `rp-state-locks`: `<org>.<ws>` -> the Terraform lock held on the workspace's state,
  taken with `create` so that only one holder can exist;
- `rp-secrets`: `<org>.<ws>.<name>` -> one secret variable's value, sealed (never clear);
- `rp-ui-sessions`: the web UI's browser sessions (services/surfaces/ui/sessions.py), keyed by a
  digest of the cookie's id, sealed with a key only that id gives; a key not written for
  `UI_SESSION_IDLE_S` is dropped by the bucket itself;
- `rp-idempotency`: the API's answers to POSTs with an Idempotency-Key
  (services/surfaces/api/idempotency.py), keyed by a digest of (organization, token, key), sealed
  with a key only the token gives; each is dropped `IDEMPOTENCY_TTL_S` after its last write;
- `rp-login-codes`: `terraform login`'s codes already exchanged (services/surfaces/tfe/login.py),
  keyed by a digest of the code, each written expecting no earlier value
  (`update(last=0)`: so by one replica only) and
  dropped `LOGIN_CODES_KEPT_S` after, once the code has expired anyway;
- `rp-sso-flows`: single sign-on's flows under way (services/app/sso_flows.py): each
  started flow's `state`, sealed with a key only its browser's cookie gives, taken once
  (`update(last=revision)`), and each ID token's nonce once used (`update(last=0)`);
  dropped `SSO_FLOWS_KEPT_S` after, when no flow is still alive anyway;
- `rp-device-grants`: `runplane login --device`'s grants (services/app/device.py, RFC 8628),
  keyed by a digest of the device code, another key by a digest of the user code, and
  wrong-code counts per signer; approved and redeemed with `update(last=revision)`, so
  once; dropped `DEVICE_GRANTS_KEPT_S` after their last write;
- `rp-tfe-configs`: `<org>` -> the organization's ledger of configuration versions in
  `rp-plans` (services/surfaces/tfe/quota.py), moved with optimistic concurrency;
- `rp-open-runs`: `<org>` -> the organization's ledger of open runs, its quota
  (services/app/openruns.py), moved with optimistic concurrency;
- `rp-signing-keys`: `keys` -> the workload identity signing keys (infra/signing.py), each
  private key sealed, rotated with optimistic concurrency and read from the leader;
- `rp-audit`: `key` -> the audit checkpoints' Ed25519 keys (infra/auditkeys.py), each
  private key sealed like the signing keys; `cursor` -> how far the auditor has read
  the event log (services/processes/audit.py).
"""

from __future__ import annotations

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StorageType
from nats.js.kv import KV_DEL, KV_OP, KV_PURGE

from infra import replicas as rep
from infra.directget import DirectReader, InfraError, as_raw, leader_get, leader_last_seq

STATE_HEAD_BUCKET = "rp-state-head"
STATE_LOCKS_BUCKET = "rp-state-locks"
SECRETS_BUCKET = "rp-secrets"
UI_SESSIONS_BUCKET = "rp-ui-sessions"
UI_SESSION_IDLE_S = 8 * 3600.0  # a session unused this long is gone
IDEMPOTENCY_BUCKET = "rp-idempotency"
IDEMPOTENCY_TTL_S = 24 * 3600.0  # how long a POST's answer is given again
LOGIN_CODES_BUCKET = "rp-login-codes"
# A login code lives 60 s (services/surfaces/tfe/login.py CODE_TTL_S); its mark is kept as long
# again, for replicas whose clocks are apart: a code no replica still takes is forgotten.
LOGIN_CODES_KEPT_S = 120.0
SSO_FLOWS_BUCKET = "rp-sso-flows"
SSO_FLOWS_KEPT_S = 900.0  # a flow lives 10 minutes (services/app/sso_flows.py FLOW_TTL_S)
DEVICE_GRANTS_BUCKET = "rp-device-grants"
# A grant lives 10 minutes (services/app/device.py GRANT_TTL_S); its key is kept 5 more,
# so a poll just after the end is told `expired_token` rather than `invalid_grant`.
DEVICE_GRANTS_KEPT_S = 900.0
TFE_CONFIGS_BUCKET = "rp-tfe-configs"
OPEN_RUNS_BUCKET = "rp-open-runs"
STATE_LEDGER_BUCKET = "rp-state-ledger"  # versions kept per org (executor/stateledger.py)
SIGNING_KEYS_BUCKET = "rp-signing-keys"  # workload identity's keys (infra/signing.py)
AUDIT_BUCKET = "rp-audit"  # the audit key (sealed) and the auditor's cursor (infra/auditlog.py)
BUCKETS = (
    STATE_HEAD_BUCKET,
    STATE_LOCKS_BUCKET,
    SECRETS_BUCKET,
    UI_SESSIONS_BUCKET,
    IDEMPOTENCY_BUCKET,
    LOGIN_CODES_BUCKET,
    SSO_FLOWS_BUCKET,
    DEVICE_GRANTS_BUCKET,
    TFE_CONFIGS_BUCKET,
    OPEN_RUNS_BUCKET,
    STATE_LEDGER_BUCKET,
    SIGNING_KEYS_BUCKET,
    AUDIT_BUCKET,
)
# The others keep their keys forever.
_TTL = {
    UI_SESSIONS_BUCKET: UI_SESSION_IDLE_S,
    IDEMPOTENCY_BUCKET: IDEMPOTENCY_TTL_S,
    LOGIN_CODES_BUCKET: LOGIN_CODES_KEPT_S,
    SSO_FLOWS_BUCKET: SSO_FLOWS_KEPT_S,
    DEVICE_GRANTS_BUCKET: DEVICE_GRANTS_KEPT_S,
}
_BATCH = 1000


class KvError(InfraError):
    """A bucket read failed; NATS may be back in a moment."""


async def declare_buckets(nc: NATS, js: JetStreamContext, *, replicas: int) -> None:
    """Create the buckets unless they exist, and raise an existing one to `replicas`
    (never lower it). Safe from every process at every start."""
    for bucket in BUCKETS:
        try:
            await js.key_value(bucket)
        except nats.js.errors.BucketNotFoundError:
            await js.create_key_value(
                KeyValueConfig(
                    bucket=bucket,
                    history=1,
                    storage=StorageType.FILE,
                    replicas=replicas,
                    direct=True,
                    ttl=_TTL.get(bucket),
                )
            )
        else:
            await rep.raise_stream(nc, f"KV_{bucket}", replicas)


async def stored_keys(js: JetStreamContext, bucket: str) -> list[str]:
    """The keys `bucket`'s stream holds a message for (a deleted key's marker included),
    sorted, as the stream's leader has them: stream info's subjects, at or past every
    acknowledged write. Not nats-py's `kv.keys()`: it lists with a consumer and can end
    before the first message arrives, answering "no keys" for a bucket that has some
    (seen about 1 listing in 300). The server names at most 100,000 subjects in one
    answer, which nats-py does not page."""
    prefix = f"$KV.{bucket}."
    try:
        info = await js.stream_info(f"KV_{bucket}", subjects_filter=prefix + ">")
    except nats.js.errors.NotFoundError:
        return []
    return sorted(s[len(prefix) :] for s in info.state.subjects or {})


async def last_values(
    nc: NATS, bucket: str, pattern: str, *, timeout: float = 5.0
) -> dict[str, bytes]:
    """The current value of every key matching `pattern` (e.g. `acme.net.*`), at least as
    new as every write acknowledged before the call. Deleted keys are left out.

    A batched direct get of the last message per subject (one request, no consumer, no
    scan of the bucket), which any replica may answer: its answer counts only if the
    sequence it was read at (`Nats-UpTo-Sequence`) is at or past the stream's last
    sequence as its leader had it just before. Otherwise the keys are read from the
    leader: a follower that is behind would hand a dispatch an old secret, or none.
    """
    need = await leader_last_seq(nc, f"KV_{bucket}", error=KvError, timeout=timeout)
    found, upto = await direct_last_values(nc, bucket, pattern, timeout=timeout)
    if upto >= need:
        return found
    return await _leader_last_values(nc, bucket, pattern, timeout)


async def leader_last_values(
    nc: NATS, bucket: str, pattern: str, *, timeout: float = 5.0
) -> dict[str, bytes]:
    """The keys matching `pattern` read from the stream's leader alone: no follower is
    asked (one stopped or behind costs nothing), one get per key."""
    return await _leader_last_values(nc, bucket, pattern, timeout)


async def _leader_last_values(
    nc: NATS, bucket: str, pattern: str, timeout: float
) -> dict[str, bytes]:
    """The keys matching `pattern` from the stream's leader, one message get each (the
    buckets keep one revision per key, so each key's message is its current value)."""
    prefix = f"$KV.{bucket}."
    found: dict[str, bytes] = {}
    seq = 1
    while True:
        msg = await leader_get(
            nc,
            f"KV_{bucket}",
            as_raw,
            subject=prefix + pattern,
            seq=seq,
            what=bucket,
            error=KvError,
            timeout=timeout,
        )
        if msg is None:
            return found
        key = msg.subject[len(prefix) :]
        if msg.headers.get(KV_OP) in (KV_DEL, KV_PURGE):
            found.pop(key, None)
        else:
            found[key] = msg.data
        seq = msg.seq + 1


async def direct_last_values(
    nc: NATS, bucket: str, pattern: str, *, timeout: float = 5.0
) -> tuple[dict[str, bytes], int]:
    """The batched direct get alone, from whichever replica answers, and the sequence
    that replica read at (0 if it did not say)."""
    prefix = f"$KV.{bucket}."
    req = {"multi_last": [prefix + pattern], "batch": _BATCH}
    msgs, upto = await DirectReader.of(nc).batch(
        f"KV_{bucket}", req, as_raw, what=bucket, error=KvError, timeout=timeout
    )
    live = (m for m in msgs if m.headers.get(KV_OP) not in (KV_DEL, KV_PURGE))
    return {m.subject[len(prefix) :]: m.data for m in live}, upto
