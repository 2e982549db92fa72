"""What a phase holds in trust: its secret variables, its managed state, its sealed plan.

`Vault` is executor-wide (NATS, the key ring, the state store). `guarded(job)`
(executor/phase_custody.py) wraps one phase: it fetches the run's secret variables under
the phase's lease (masked from every log, handed to Terraform's environment only), and
serves the workspace's managed state on loopback (`executor/statebackend.py`) until the
phase ends. Plan files travel sealed.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

import structlog
from nats.aio.client import Client as NATS

from executor.objects import Objects
from executor.statebackend import StateBackend
from executor.statestore import StateStore
from infra.crypto import KeyRing, load_keyring
from infra.quotas import Quotas

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class Vault:
    """NATS and the keys: everything an executor needs to keep plans, state and secrets."""

    nc: NATS
    keyring: KeyRing
    objects: Objects
    state: StateStore

    @classmethod
    def create(
        cls,
        nc: NATS,
        keyring: KeyRing | None,
        objects: Objects,
        work_dir: Path,
        quotas: Quotas | None = None,
    ) -> Vault:
        """Without a key ring, one generated once in `work_dir` (a lone executor, tests)."""
        keys = keyring or load_keyring("", work_dir, create=True)
        return cls(nc, keys, objects, StateStore(nc.jetstream(), keys, quotas))

    async def upload_sealed(self, bucket: str, name: str, path: Path) -> None:
        """Seal `path` (bound to `bucket/name`) and store it; the clear file stays local."""
        sealed = path.with_name(f".{path.name}.sealed")
        try:
            await asyncio.to_thread(self.keyring.seal_file, path, sealed, f"{bucket}/{name}")
            await self.objects.upload(bucket, name, sealed)
        finally:
            sealed.unlink(missing_ok=True)

    async def download_sealed(self, bucket: str, name: str, dest: Path) -> bool:
        """Fetch and open object `name` into `dest`; False if there is no such object.

        Raises `infra.crypto.Tampered` or `UnknownKey` if it does not open.
        """
        sealed = dest.with_name(f".{dest.name}.sealed")
        try:
            if not await self.objects.download(bucket, name, sealed):
                return False
            await asyncio.to_thread(self.keyring.open_file, sealed, dest, f"{bucket}/{name}")
            return True
        finally:
            sealed.unlink(missing_ok=True)


@dataclass
class Custody:
    """One phase's share of the vault, and the state backend serving it."""

    vault: Vault
    backend: StateBackend | None = None

    def problems(self) -> str:
        """Why the state backend refused Terraform something, for the run's error."""
        if self.backend is None or not self.backend.problems:
            return ""
        return "runplane state backend: " + "; ".join(dict.fromkeys(self.backend.problems))
