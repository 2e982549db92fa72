"""A saved plan's download outlasts a bucket that cannot answer for a while (a cluster's
leader election), and gives up with a clear error once its patience is spent."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from nats.aio.client import Client as NATS
from nats.js.api import ObjectStoreConfig
from nats.js.object_store import OBJ_CHUNKS_PRE_TEMPLATE, OBJ_STREAM_TEMPLATE, ObjectStore

from executor import objects as objects_module
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


async def _chunks_purged(nc: NATS, bucket: str, name: str) -> ObjectStore:
    """An object whose chunks are gone while its meta stays: where an object deleted
    between nats-py's read of the meta and its subscription to the chunks leaves a read."""
    js = nc.jetstream()
    store = await js.create_object_store(bucket, config=ObjectStoreConfig())
    await store.put(name, b"x" * 300_000)
    nuid = (await store.get_info(name)).nuid
    stream = OBJ_STREAM_TEMPLATE.format(bucket=bucket)
    await js.purge_stream(stream, subject=OBJ_CHUNKS_PRE_TEMPLATE.format(bucket=bucket, obj=nuid))
    return store


async def test_a_read_whose_chunks_vanished_ends_with_an_error_not_a_hang(
    nc: NATS, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(objects_module, "STALL_S", 0.3)
    await _chunks_purged(nc, "rp-stall", "p")
    dest = tmp_path / "p"
    with pytest.raises(ObjectStoreError, match="rp-stall/p"):
        await asyncio.wait_for(
            Objects(nc.jetstream()).download("rp-stall", "p", dest, patience=0.2), 5
        )
    assert not dest.exists()


async def test_an_object_deleted_under_its_read_is_not_found(
    nc: NATS, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sweep deleting a TFE configuration version while the CLI polls it: the poll
    hung for good (a GET answered 499 after 300 s), it is a 404 now."""
    monkeypatch.setattr(objects_module, "STALL_S", 0.5)
    store = await _chunks_purged(nc, "rp-gone", "p")
    read = asyncio.create_task(Objects(nc.jetstream()).download("rp-gone", "p", tmp_path / "p"))
    await asyncio.sleep(0.2)  # reading: the meta read, waiting for chunks
    await store.delete("p")
    assert await asyncio.wait_for(read, 5) is False
    assert not (tmp_path / "p").exists()
