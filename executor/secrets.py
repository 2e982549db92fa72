"""Fetching a phase's secret variables: by request-reply under the phase's lease, never stored.

The values come back sealed for this run and lease (see `services/app/secrets.py`), are opened
in memory, handed to Terraform as `TF_VAR_<name>` in its environment (never on its command
line, never in a file) and added to the masker, so no log line leaving the executor shows
them.
"""

from __future__ import annotations

from collections.abc import Callable

import nats.errors
from nats.aio.client import Client as NATS

from events import wire
from events.wire import GitSecret, SecretsRequest, reply_context, secrets_subject
from executor.errors import StepFailed
from infra.crypto import CryptoError, KeyRing

REASON = "secrets_unavailable"


async def fetch(
    nc: NATS,
    keyring: KeyRing,
    *,
    org: str,
    ws: str,
    run_id: str,
    lease_id: str,
    timeout: float = 10.0,
) -> dict[str, str]:
    """The run's secret values; StepFailed (`secrets_unavailable`) if they cannot be had."""
    request = SecretsRequest(run_id=run_id, lease_id=lease_id)
    opened = await ask(nc, keyring, org, ws, request, timeout)
    try:
        return wire.decode_secret_values(opened)
    except wire.WireError as e:
        raise _secrets_failed(f"malformed answer from the secrets responder: {e}") from e


async def fetch_git(
    nc: NATS,
    keyring: KeyRing,
    *,
    org: str,
    ws: str,
    run_id: str,
    lease_id: str,
    timeout: float = 10.0,
) -> GitSecret:
    """The run's git credential (its VCS connection's token and deploy key, of its own
    organization); StepFailed (`secrets_unavailable`) if it cannot be had."""
    request = SecretsRequest(run_id=run_id, lease_id=lease_id, git=True)
    opened = await ask(nc, keyring, org, ws, request, timeout)
    try:
        return wire.decode_git_secret(opened)
    except wire.WireError as e:
        raise _secrets_failed(f"malformed answer from the secrets responder: {e}") from e


async def ask(
    nc: NATS,
    keyring: KeyRing,
    org: str,
    ws: str,
    request: SecretsRequest,
    timeout: float,
    failed: Callable[[str], StepFailed] | None = None,
) -> bytes:
    """The opened answer to `request` (secret values, a git credential or a workload
    identity token), bound to its run, lease and kind; `failed(message)` is the step's
    error when none is had (by default the secrets'; executor/workload.py passes its
    own)."""
    _failed = failed or _secrets_failed
    try:
        msg = await nc.request(secrets_subject(org, ws), wire.encode(request), timeout=timeout)
    except nats.errors.NoRespondersError as e:
        raise _failed("no secrets responder is running (it runs beside the scheduler)") from e
    except (TimeoutError, nats.errors.TimeoutError) as e:
        raise _failed(f"the secrets responder did not answer within {timeout:g}s") from e
    context = reply_context(
        request.run_id, request.lease_id, git=request.git, workload=request.workload
    )
    try:
        answer = wire.decode_secrets_reply(msg.data)
        if answer.error:
            raise _failed(f"refused: {answer.error}")
        if not answer.sealed:
            raise wire.WireError("neither sealed values nor an error")
        return keyring.open(answer.sealed, context)
    except wire.WireError as e:
        raise _failed(f"malformed answer from the secrets responder: {e}") from e
    except CryptoError as e:
        raise _failed(f"the answer does not open with this executor's keys: {e}") from e


def terraform_env(values: dict[str, str]) -> dict[str, str]:
    """`TF_VAR_<name>` for each secret variable."""
    return {f"TF_VAR_{name}": value for name, value in values.items()}


def _secrets_failed(message: str) -> StepFailed:
    return StepFailed("secrets", f"secret variables unavailable: {message}", reason=REASON)
