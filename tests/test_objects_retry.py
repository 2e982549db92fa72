"""A saved plan's download outlasts a bucket that cannot answer for a while (a cluster's
leader election), and gives up with a clear error once its patience is spent."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from nats.aio.client import Client as NATS
from nats.js.api import ObjectStoreConfig

from executor.errors import ObjectStoreError
from executor.objects import Objects


async def test_a_download_waits_out_a_bucket_that_cannot_answer_yet(
    nc: NATS, tmp_path: Path
) -> None:
    js = nc.jetstream()
    objects = Objects(js)
    dest = tmp_path / "plan.tfplan"
    download = asyncio.create_task(objects.download("rp-late", "p", dest, patience=20))
    await asyncio.sleep(0.6)  # the download has failed at least once by now
    assert not download.done()
    store = await js.create_object_store("rp-late", config=ObjectStoreConfig())
    await store.put("p", b"the saved plan")
    assert await download is True
    assert dest.read_bytes() == b"the saved plan"


async def test_a_download_gives_up_after_its_patience_and_leaves_no_file(
    nc: NATS, tmp_path: Path
) -> None:
    dest = tmp_path / "plan.tfplan"
    with pytest.raises(ObjectStoreError, match="rp-never/p"):
        await Objects(nc.jetstream()).download("rp-never", "p", dest, patience=0.5)
    assert not dest.exists() and not dest.with_name(".plan.tfplan.part").exists()


async def test_a_missing_object_is_false_at_once(nc: NATS, tmp_path: Path) -> None:
    js = nc.jetstream()
    await js.create_object_store("rp-empty", config=ObjectStoreConfig())
    assert await Objects(js).download("rp-empty", "p", tmp_path / "x", patience=30) is False
