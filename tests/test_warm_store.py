"""The warm store's rules (executor/warm.py), on disk alone: a kept checkout goes only to
the apply it was planned for, only as it was left, only if it held nothing a job should
not leave, within its bounds, and not past its executor's life."""

from __future__ import annotations

import fcntl
import os
import stat
from pathlib import Path

import pytest

from executor.warm import Facts, WarmStore, custody

JOB_UID = 64123  # a job's uid: the plan's files are its own (the tests run as root)
FACTS = Facts("acme", "net", "01run", "c0ffee", "d1gest", "c0nfig")

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="hands files to another uid")


def _checkout(root: Path, name: str = "src", size: int = 10) -> Path:
    """A plan's checkout as its job leaves it: its files the job's uid's."""
    src = root / name
    (src / ".terraform").mkdir(parents=True)
    (src / "main.tf").write_text("resource x {}\n")
    (src / "plan.tfplan").write_bytes(b"p" * size)
    (src / ".terraform" / "provider").symlink_to("/usr/bin/true")
    for here, dirs, files in os.walk(src):
        for name_ in (*dirs, *files):
            os.chown(Path(here) / name_, JOB_UID, JOB_UID, follow_symlinks=False)
    return src


def _store(tmp_path: Path, max_bytes: int = 1 << 30, name: str = "e1") -> WarmStore:
    store = WarmStore(tmp_path / "warm", name, max_bytes=max_bytes)
    store.open()
    return store


@pytest.mark.parametrize(
    "other",
    [
        Facts("beta", "net", "01run", "c0ffee", "d1gest", "c0nfig"),  # another org
        Facts("acme", "db", "01run", "c0ffee", "d1gest", "c0nfig"),  # another workspace
        Facts("acme", "net", "01run", "bad", "d1gest", "c0nfig"),  # another commit
        Facts("acme", "net", "01run", "c0ffee", "other", "c0nfig"),  # another plan
        Facts("acme", "net", "01run", "c0ffee", "d1gest", "other"),  # another config
    ],
)
def test_a_kept_checkout_goes_to_no_apply_but_the_one_it_was_planned_for(
    tmp_path: Path, other: Facts
) -> None:
    """The same run id with anything else different (an org B run naming org A's, a
    moved commit, another plan or configuration): refused, and the kept tree removed."""
    store = _store(tmp_path)
    assert store.keep(FACTS, _checkout(tmp_path), JOB_UID)
    assert not store.take(other, tmp_path / "into")
    assert not (tmp_path / "into").exists()
    assert not (store.dir / FACTS.run_id).exists()
    assert not store.take(FACTS, tmp_path / "into")  # nothing left to give


def test_the_planned_apply_takes_it_and_the_tree_is_the_executors_alone(tmp_path: Path) -> None:
    store = _store(tmp_path)
    assert store.keep(FACTS, _checkout(tmp_path), JOB_UID)
    assert store.take(FACTS, tmp_path / "into")
    for here, dirs, files in os.walk(tmp_path / "into"):
        for name in (".", *dirs, *files):
            assert os.lstat(Path(here) / name).st_uid == 0, name
    assert not (store.dir / FACTS.run_id).exists()


def test_a_tree_changed_after_the_plan_is_refused(tmp_path: Path) -> None:
    store = _store(tmp_path)
    assert store.keep(FACTS, _checkout(tmp_path), JOB_UID)
    (store.dir / FACTS.run_id / "src" / "main.tf").write_text("resource y {}\n")
    assert not store.take(FACTS, tmp_path / "into")


def test_custody_strips_set_id_bits_and_others_write(tmp_path: Path) -> None:
    src = _checkout(tmp_path)
    (src / "suid").write_bytes(b"#!/bin/sh\n")
    os.chown(src / "suid", JOB_UID, JOB_UID)
    os.chmod(src / "suid", 0o6777)
    os.chmod(src / ".terraform", 0o1777)
    custody(src, JOB_UID)
    assert stat.S_IMODE(os.lstat(src / "suid").st_mode) == 0o755
    assert stat.S_IMODE(os.lstat(src / ".terraform").st_mode) == 0o755


@pytest.mark.parametrize("planted", ["hard link", "fifo", "third uid"])
def test_a_tree_holding_what_a_job_should_not_leave_is_not_kept(
    tmp_path: Path, planted: str
) -> None:
    """A hard link of the job's (its other name may be anywhere it could write), a FIFO,
    a file of another uid: the checkout is not kept (the apply goes cold)."""
    src = _checkout(tmp_path)
    if planted == "hard link":
        os.link(src / "main.tf", src / "again.tf")
    elif planted == "fifo":
        os.mkfifo(src / "pipe")
    else:
        (src / "theirs").write_text("x")
        os.chown(src / "theirs", JOB_UID + 1, JOB_UID + 1)
    store = _store(tmp_path)
    assert not store.keep(FACTS, src, JOB_UID)
    assert FACTS.run_id not in store.kept


def test_the_store_is_bounded_the_oldest_going_first(tmp_path: Path) -> None:
    store = _store(tmp_path)
    runs = [Facts("acme", "net", f"01run{i}", "c", "d", "e") for i in range(4)]
    for i, facts in enumerate(runs):
        assert store.keep(facts, _checkout(tmp_path, f"src{i}", size=8192), JOB_UID)
        if i == 0:
            store.max_bytes = 3 * store.kept[facts.run_id].size  # room for three
    assert [k.facts for k in store.kept.values()] == runs[1:]
    assert not (store.dir / runs[0].run_id).exists()
    assert runs[-1].run_id in store.kept
    assert sum(k.size for k in store.kept.values()) <= store.max_bytes


def test_a_dead_executors_store_goes_at_the_next_start_a_live_ones_stays(tmp_path: Path) -> None:
    dead = _store(tmp_path, name="dead")
    assert dead.keep(FACTS, _checkout(tmp_path, "a"), JOB_UID)
    os.close(dead._lock)  # as its death would: the lock goes, the files stay
    live = (tmp_path / "warm" / "live").resolve()
    live.mkdir()
    held = os.open(live / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(held, fcntl.LOCK_EX)
    try:
        store = _store(tmp_path, name="e2")
        assert not dead.dir.exists()
        assert live.exists()
        store.close()
        assert not store.dir.exists()
    finally:
        os.close(held)


def test_attack_empty_files_count_against_the_bound(tmp_path: Path) -> None:
    """A plan that leaves many empty files (or links) in its checkout: they take no
    blocks, so a bound in bytes alone kept them all, and runs left waiting for approval
    (kept until the run moves on) piled up inodes on the executor's file system, with
    every keep and take walking them. Each entry now costs at least a block's worth."""
    src = _checkout(tmp_path)
    many = src / "many"
    many.mkdir()
    for i in range(3000):
        (many / f"f{i}").touch()
        os.chown(many / f"f{i}", JOB_UID, JOB_UID)
    os.chown(many, JOB_UID, JOB_UID)
    store = _store(tmp_path, max_bytes=4 << 20)  # 4 MiB: about a thousand entries
    assert not store.keep(FACTS, src, JOB_UID)
    assert FACTS.run_id not in store.kept


def test_attack_a_bwrap_job_sees_no_kept_checkout_under_a_jobs_directory_outside_tmp(
    tmp_path: Path,
) -> None:
    """The bwrap mode (an executor that is not root) runs every organization's jobs as
    its own uid: only what its sandbox hides keeps them apart, and the store's 0700 is
    nothing to them. The jobs directory is under the system's temporary directory, a
    tmpfs in the sandbox, unless TMPDIR names another place: then the warm store (beside
    `jobs/` and `tmp/`, which are hidden) was in view, read-only, and org B's job read
    org A's kept checkout (its variables, its plan, its .terraform). Hidden like them."""
    import shutil
    import subprocess
    import tempfile

    from executor import terraform as tf
    from executor.isolation import Isolation, bwrap_problem
    from executor.worker import Executor

    if bwrap_problem():
        pytest.skip(f"no bubblewrap: {bwrap_problem()}")
    base = Path(tempfile.mkdtemp(dir="/work" if os.path.isdir("/work") else "/srv"))
    try:
        ex = Executor.__new__(Executor)
        ex.isolation_setting = Isolation(mode="bwrap", bwrap=shutil.which("bwrap") or "bwrap")
        ex.work_dir = base / "work"
        ex.jobs_root = base / "jobs-root"
        ex.jobs_dir, ex.tmp_dir = ex.jobs_root / "jobs", ex.jobs_root / "tmp"
        ex.terraform_config = tf.TerraformConfig()
        iso = ex._isolation()
        store = WarmStore(ex.jobs_root / "warm", "e1", max_bytes=1 << 30)
        store.open()
        src = _checkout(base)
        (src / "secret.auto.tfvars").write_text('token = "org-a-secret"\n')
        assert store.keep(FACTS, src, JOB_UID)
        root = Path(tempfile.mkdtemp(dir=ex.jobs_dir))
        jail = iso.enter(root, ex.tmp_dir)
        try:
            kept = store.dir / FACTS.run_id / "src" / "secret.auto.tfvars"
            script = f"cat {kept}; echo done"
            how = jail.spawn(["/bin/sh", "-c", script], {"PATH": "/usr/bin:/bin"}, jail.home)
            options = {k: v for k, v in how.options.items() if k != "preexec_fn"}
            out = subprocess.run(
                how.argv, cwd=how.cwd, env=how.env, capture_output=True, text=True, **options
            )
            assert "done" in out.stdout, out
            assert "org-a-secret" not in out.stdout, "org B's bwrap job read org A's kept checkout"
        finally:
            jail.close()
            store.close()
    finally:
        shutil.rmtree(base, ignore_errors=True)
