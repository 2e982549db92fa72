"""Secret variables: stored only sealed, handed to an executor only under its current lease.

Values live in the KV bucket `rp-secrets`, one key per variable (`<org>.<ws>.<name>`), each
sealed with the key ring and bound to its key name, so a value copied under another key does
not open. Events carry the names only.

An executor asks at the start of a phase with a request to `rp.secrets.<org>.<ws>` carrying
`{"run_id", "lease_id"}` (`events.wire.SecretsRequest`; the reply is a `SecretsReply`).
The `SecretsResponder` (run beside the scheduler, which holds the key) answers only if that
lease is the run's current one, with the values of the secret variables the run was pinned
to (its snapshot), sealed again for that run and lease. No stream captures `rp.secrets.>`:
the request and its answer are never stored.
"""

from __future__ import annotations

import re
from types import TracebackType

import nats.errors
import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from events import vcs, wire
from events.codec import valid_id
from events.run import RunState, secret_names
from events.wire import SECRETS_PREFIX, GitSecret, SecretsReply, reply_context
from events.workload import WorkloadRefused
from infra.crypto import CryptoError, KeyRing
from infra.kv import SECRETS_BUCKET, last_values
from services.app.aggregates import VCS_CONNECTION
from services.app.commands import App
from services.app.execute import Repository
from services.app.workload import Minter

log = structlog.get_logger(__name__)

QUEUE = "rp-secrets"
NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]{0,127}$")
MAX_VALUE = 64 * 1024


class SecretError(Exception):
    """A secret could not be stored, read or handed over."""

    retryable = False


def valid_name(name: str) -> bool:
    """A Terraform variable name (letters, digits, `_`, `-`; not starting with a digit)."""
    return NAME_RE.fullmatch(name) is not None


class SecretStore:
    """Sealed secret values in KV, read and written by the api and the scheduler."""

    def __init__(self, nc: NATS, keyring: KeyRing) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.keyring = keyring

    @staticmethod
    def key(org: str, ws: str, name: str) -> str:
        return f"{org}.{ws}.{name}"

    async def put(self, org: str, ws: str, name: str, value: str) -> None:
        key = self.key(org, ws, name)
        kv = await self.js.key_value(SECRETS_BUCKET)
        await kv.put(key, self.keyring.seal(value.encode(), key))

    async def delete(self, org: str, ws: str, name: str) -> bool:
        """Remove a secret variable; False if there was none."""
        if name not in await self.names(org, ws):
            return False
        kv = await self.js.key_value(SECRETS_BUCKET)
        await kv.purge(self.key(org, ws, name))
        return True

    async def names(self, org: str, ws: str) -> list[str]:
        return sorted(await self._sealed(org, ws))

    async def values(self, org: str, ws: str, names: list[str]) -> dict[str, str]:
        """The clear values of `names`; SecretError if one is missing or does not open."""
        sealed = await self._sealed(org, ws)
        missing = sorted(set(names) - set(sealed))
        if missing:
            raise SecretError(f"secret variable(s) {', '.join(missing)} no longer exist")
        try:
            return {n: self.keyring.open(sealed[n], self.key(org, ws, n)).decode() for n in names}
        except CryptoError as e:
            raise SecretError(f"a secret variable of {org}/{ws} does not open: {e}") from e

    async def _sealed(self, org: str, ws: str) -> dict[str, bytes]:
        found = await last_values(self.nc, SECRETS_BUCKET, f"{org}.{ws}.*")
        return {k.rsplit(".", 1)[1]: v for k, v in found.items() if v}


TOKEN, DEPLOY_KEY = "token", "deploy_key"
# The user name each provider takes with a token over https.
USERNAMES = {"github": "x-access-token", "gitlab": "oauth2"}


def sealed_key(org: str, connection_id: str, which: str) -> str:
    """Where a connection's sealed value lives in the secrets bucket."""
    return f"{org}._vcs.{connection_id}.{which}"


async def connection_secret(
    repo: Repository, secrets: SecretStore, org: str, connection_id: str
) -> GitSecret:
    """The token (with its user name) and deploy key of `org`'s connection; empty for no
    connection (or one deleted). SecretError if a sealed value does not open."""
    if not connection_id or not valid_id(org) or not valid_id(connection_id):
        return GitSecret()
    found = await repo.load(VCS_CONNECTION, vcs.connection_subject(org, connection_id))
    conn = found.state.connection
    if not found.state.exists or conn is None or conn.org != org:
        return GitSecret()
    keys = [sealed_key(org, connection_id, w) for w in (TOKEN, DEPLOY_KEY)]
    sealed = await last_values(secrets.nc, SECRETS_BUCKET, f"{org}._vcs.{connection_id}.*")
    try:
        token, key = (
            secrets.keyring.open(sealed[k], k).decode() if sealed.get(k) else "" for k in keys
        )
    except CryptoError as e:
        raise SecretError(f"a credential of VCS connection {connection_id} does not open") from e
    return GitSecret(token=token, username=USERNAMES.get(conn.provider, ""), ssh_key=key)


class SecretsResponder:
    """Answers executors' secret requests; an async context manager, one or many replicas."""

    def __init__(
        self, nc: NATS, app: App, store: SecretStore, minter: Minter | None = None
    ) -> None:
        self.nc = nc
        self.app = app
        self.store = store
        self.minter = minter  # None: no workload identity tokens (no signing keys)
        self._sub: Subscription | None = None

    async def __aenter__(self) -> SecretsResponder:
        self._sub = await self.nc.subscribe(f"{SECRETS_PREFIX}.*.*", queue=QUEUE, cb=self._on)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()
            self._sub = None

    async def _on(self, msg: Msg) -> None:
        _, _, org, ws = msg.subject.split(".")
        try:
            reply = await self.answer(org, ws, msg.data)
        except Exception as e:  # an answer is owed whatever failed; the cause is logged
            log.exception("secrets_request_failed", org=org, workspace=ws)
            reply = SecretsReply(error=f"the secrets responder failed: {type(e).__name__}")
        try:
            await msg.respond(wire.encode(reply))
        except nats.errors.Error as e:
            log.warning("secrets_reply_failed", error=repr(e))

    async def answer(self, org: str, ws: str, data: bytes) -> SecretsReply:
        """The reply: the values sealed for the current lease, else why not."""
        try:
            req = wire.decode_secrets_request(data)
        except wire.WireError as e:
            return SecretsReply(error=str(e))
        if not all(valid_id(x) for x in (org, ws, req.run_id)):
            return SecretsReply(error="ids are not subject-safe tokens")
        run: RunState = (await self.app.load_run(org, ws, req.run_id)).state
        if not run.exists or run.terminal or not run.lease_id or run.lease_id != req.lease_id:
            log.warning("secrets_refused", org=org, workspace=ws, run_id=req.run_id)
            return SecretsReply(
                error=f"lease {req.lease_id} is not the current lease of run {req.run_id}"
            )
        if req.git:
            return await self._git(org, ws, run, req.lease_id)
        if req.workload:
            return await self._workload(run, req.lease_id)
        try:
            values = await self.store.values(org, ws, secret_names(run))
        except SecretError as e:
            return SecretsReply(error=str(e))
        sealed = self.store.keyring.seal(
            wire.encode(values), reply_context(req.run_id, req.lease_id)
        )
        log.info("secrets_handed_over", org=org, workspace=ws, run_id=req.run_id, n=len(values))
        return SecretsReply(sealed=sealed)

    async def _git(self, org: str, ws: str, run: RunState, lease_id: str) -> SecretsReply:
        """The git credential of the run's VCS connection (of the run's organization)."""
        connection = run.config.vcs_connection if run.config is not None else ""
        try:
            secret = await connection_secret(self.app, self.store, org, connection)
        except SecretError as e:
            return SecretsReply(error=str(e))
        sealed = self.store.keyring.seal(
            wire.encode(secret), reply_context(run.run_id, lease_id, git=True)
        )
        given = [k for k in ("token", "ssh_key") if getattr(secret, k)]
        log.info(
            "git_credential_handed_over", org=org, workspace=ws, run_id=run.run_id, given=given
        )
        return SecretsReply(sealed=sealed)

    async def _workload(self, run: RunState, lease_id: str) -> SecretsReply:
        """The token of the run's claimed phase (services/app/workload.py)."""
        if self.minter is None:
            return SecretsReply(error="this deployment issues no workload identity tokens")
        try:
            token = await self.minter.mint(run)
        except WorkloadRefused as e:
            log.warning("workload_token_refused", run_id=run.run_id, why=str(e))
            return SecretsReply(error=str(e))
        context = reply_context(run.run_id, lease_id, workload=True)
        return SecretsReply(sealed=self.store.keyring.seal(token.encode(), context))
