"""The composition root (services/root/bootstrap.py): one graph per process, every
component over its one `App`, key ring and secret store; the scheduler's admissions pinned
to a snapshot by that same `App`."""

from __future__ import annotations

from contextlib import AsyncExitStack
from pathlib import Path

import pytest
from nats.aio.client import Client as NATS

from events.run import RunState, Workspace
from infra.crypto import KeyRing
from infra.options import ConfigError
from services.app.snapshot import Snapshotter
from services.root import bootstrap
from services.surfaces.api.context import API
from tests.bootstrap_support import options_for
from tests.helpers import eventually
from tests.plane_support import commit


async def test_every_component_of_a_process_shares_its_one_app_key_ring_and_secret_store(
    nc: NATS, tmp_path: Path
) -> None:
    keyring = KeyRing.generate()
    async with AsyncExitStack() as stack:
        plane = bootstrap.build(options_for(tmp_path), nc, stack, keyring=keyring)
        assert plane.keyring is keyring and plane.secrets.keyring is keyring
        assert plane.app.store is plane.store
        # the production App pins admissions, its snapshots naming the secret store's names
        assert isinstance(plane.app.snapshot, Snapshotter)
        assert plane.app.snapshot.secrets is plane.secrets
        web_app = plane.web_app(plane.projector(tmp_path / "rm.sqlite"), admin_token="t")
        assert web_app[API].app is plane.app
        assert plane.scheduler().app is plane.app
        assert plane.reaper().app is plane.app
        assert plane.schedule_loop().app is plane.app
        responder = plane.secrets_responder()
        assert responder.app is plane.app and responder.store is plane.secrets
        ex = plane.executor(work_dir=tmp_path / "exec", isolation="none")
        assert ex.app is plane.app and ex.vault.keyring is keyring
        host = plane.subscribers()
        assert host.ctx.app is plane.app and host.ctx.keys() is keyring
        # the options' data directory has no key: chat-ops run on the process's key ring
        assert {"chat-slack-requests", "chat-slack-updates"} <= set(host.names)


async def test_the_scheduler_of_a_plane_pins_each_admitted_run_to_its_commit(
    nc: NATS, repo: Path, tmp_path: Path
) -> None:
    """Started by `start_scheduler` (with the responder, reaper and schedule loop), the
    scheduler admits over the plane's App, which queues the run `pinning` and records
    its snapshot: the branch head's commit."""
    head = commit(repo, {"main.tf": ""})
    async with AsyncExitStack() as stack:
        plane = bootstrap.build(options_for(tmp_path), nc, stack, keyring=KeyRing.generate())
        await plane.start_scheduler()
        await plane.app.create_org("acme", "test")
        await plane.app.create_workspace("acme", "net", Workspace(repository=str(repo)), "test")
        run_id = (await plane.app.create_run("acme", "net", "plan", "test")).state.run_id

        async def pinned() -> bool:
            run: RunState = (await plane.app.load_run("acme", "net", run_id)).state
            assert run.snapshot is not None and not run.pinning, run.status
            return run.snapshot.commit == head

        assert await eventually(pinned, what="the run pinned to the branch head")


async def test_a_malformed_list_of_repository_sources_is_a_config_error(
    nc: NATS, tmp_path: Path
) -> None:
    opts = options_for(tmp_path, allowed_repos="https://,not a source")
    async with AsyncExitStack() as stack:
        with pytest.raises(ConfigError, match="allowed-repos"):
            bootstrap.build(opts, nc, stack, keyring=KeyRing.generate())
