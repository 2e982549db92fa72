"""Attacks on the executor host's provider cache (executor/providers.py) through what a
tenant controls: its lock file. Each test is a way one organization's lock file made the
shared executor do work or hold resources outside any job's caps, at every other
organization's expense.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from executor.providers import MAX_SERVED, ProviderCache, ProviderMismatch, use_cache
from executor.provpackages import MAX_LOCK_BYTES, h1_of
from tests.provider_cache_support import Packed, packed_provider

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> Packed:
    top = tmp_path_factory.mktemp("packed-mirror-attacks")
    os.chmod(top.parent, 0o711)
    return packed_provider(top / "mirror")


def _phase(tmp_path: Path, lock: str, name: str = "phase") -> Path:
    root = tmp_path / name
    (root / "src").mkdir(parents=True)
    (root / "src" / ".terraform.lock.hcl").write_text(lock)
    return root


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


# Lock files of a megabyte (Python making each, run in a child with M the most the
# executor reads), shaped so that the former lock-file expressions backtracked.
PAYLOADS = {
    # a block header per line, none ever closed: each header's `.*?` ran to the end
    "unclosed-blocks": "'provider \"a\" {\\n' * (M // 15)",
    # one block whose body is blank lines: `^\\s*version` from each line to the end
    "blank-body": "'provider \"registry.terraform.io/a/b\" {\\n' + '\\n' * M + '}\\n'",
    # a list opened on every line, never closed
    "unclosed-lists": (
        '\'provider "registry.terraform.io/a/b" {\\n  version = "1.0.0"\\n\''
        " + '  hashes = [\\n' * (M // 13) + '}\\n'"
    ),
}


@pytest.mark.parametrize("payload", PAYLOADS.values(), ids=PAYLOADS.keys())
def test_a_lock_file_made_to_backtrack_is_read_in_linear_time(payload: str) -> None:
    """Attack: a lock file (at most MAX_LOCK_BYTES, which the executor reads) shaped so
    that the lock-file regular expressions backtrack: 150 kB took 18 s, 300 kB 110 s of
    the executor's own CPU, with the GIL held (`use_cache` runs in a thread, `re` never
    lets go of it), so every phase of every organization on the executor stalled (leases,
    logs, state). Each payload, read and rewritten, must take well under a second; the
    limit here is generous for a loaded machine."""
    code = textwrap.dedent(
        f"""
        from executor.provpackages import read_lock, rewrite_lock
        M = {MAX_LOCK_BYTES}
        text = {payload}
        assert M - 64 <= len(text.encode()) <= M + 64, len(text)
        read_lock(text)
        rewrite_lock(text, {{"registry.terraform.io/a/b": "h1:x"}})
        """
    )
    try:
        done = subprocess.run(
            [sys.executable, "-c", code], cwd=REPO, timeout=20, capture_output=True, text=True
        )
    except subprocess.TimeoutExpired:
        pytest.fail("a megabyte of lock file kept the executor's CPU (and its GIL) over 20 s")
    assert done.returncode == 0, done.stderr


def test_a_provider_locked_many_times_holds_nothing_per_block(
    tmp_path: Path, packed: Packed
) -> None:
    """Attack: the same provider's block repeated (a lock file of a megabyte holds
    thousands): each block took a shared lock on the entry, a descriptor of the executor
    held until the phase's directory is gone and the next phase is served. A few
    thousand put the executor past its descriptor limit (1024 by default): every other
    organization's phase on it failed to open a log, a pipe, a socket. Another version
    of the same provider in a block of its own filled and held a second entry past the
    cache's bound (every version the mirrors hold, in one lock file). Terraform refuses
    a lock file that locks a provider twice: the cache serves none of it."""
    other = packed_provider(packed.mirror, source=packed.source, version="1.0.1")
    cache = ProviderCache(tmp_path / "cache", [packed.mirror]).open()
    lock = packed.lock() * 300 + other.lock()
    root = _phase(tmp_path, lock)
    before = _fds()
    served = use_cache(cache, root / "src", root / "src", root)
    held = _fds() - before
    assert held <= 1, f"one lock file held {held} descriptors of the executor"
    assert served == {} and cache.fills == 0
    assert (root / "src" / ".terraform.lock.hcl").read_text() == lock


def test_a_directory_package_is_not_copied_again_for_each_wrong_lock(tmp_path: Path) -> None:
    """Attack: a lock file naming hashes no package has, for a provider of an unpacked
    (directory) mirror, e.g. the bundled one: a zip's hashes are remembered by its stat,
    but each init of this lock file copied the whole package into the cache and hashed
    it again, as the executor (its CPU and disk, no job's caps), under the fill lock that
    every other organization's fill of that provider waits on."""
    platform = tmp_path / "mirror" / "registry.example" / "test" / "dir" / "1.0.0" / "linux_amd64"
    platform.mkdir(parents=True)
    exe = platform / "terraform-provider-dir_v1.0.0"
    exe.write_bytes(b"#!/bin/sh\n" + b"#" * 4096)
    exe.chmod(0o755)
    cache = ProviderCache(tmp_path / "cache", [tmp_path / "mirror"]).open()
    lock = (
        'provider "registry.example/test/dir" {\n  version = "1.0.0"\n'
        f'  hashes = [\n    "h1:{"A" * 43}=",\n  ]\n}}\n'
    )
    for n in range(3):
        root = _phase(tmp_path, lock, f"phase{n}")
        with pytest.raises(ProviderMismatch):
            use_cache(cache, root / "src", root / "src", root)
    assert cache.unpacks == 1, f"the directory package was copied and hashed {cache.unpacks} times"
    exe.write_bytes(b"#!/bin/sh\n")  # the operator's package changed: learnt again
    root = _phase(tmp_path, lock, "changed")
    with pytest.raises(ProviderMismatch):
        use_cache(cache, root / "src", root / "src", root)
    assert cache.unpacks == 2


def test_phases_served_at_once_never_fail_each_other(tmp_path: Path, packed: Packed) -> None:
    """Attack: an organization floods inits while another's run: the executor serves each
    phase's init in a thread of its own (`asyncio.to_thread`), and one thread walked the
    holds of every phase while another added its own ("dictionary changed size during
    iteration"): about one init in thirty of 8 at once failed, whoever's it was."""
    cache = ProviderCache(tmp_path / "cache", [packed.mirror]).open()
    errors: list[BaseException] = []

    def phases(n: int) -> None:
        for i in range(120):
            root = _phase(tmp_path, packed.lock(), f"p{n}-{i}")
            try:
                assert use_cache(cache, root / "src", root / "src", root)
            except BaseException as e:  # noqa: BLE001 (collected, asserted below)
                errors.append(e)
            shutil.rmtree(root)

    threads = [threading.Thread(target=phases, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, f"{len(errors)} of 960 inits failed: {errors[0]!r}"


@pytest.mark.skipif(os.geteuid() != 0, reason="another user's directory needs root")
def test_the_cache_is_refused_under_a_directory_another_may_rename_in(
    tmp_path: Path, packed: Packed
) -> None:
    """Attack (uid mode: jobs share the host's file system): `--provider-cache` under a
    directory a job's uid made (`/tmp/rp/cache`, /tmp/rp not there yet) or may write. The
    cache's own directories were the executor's, so `open` took them; but whoever owns
    the parent renames the cache away and puts a copy in its place, its package swapped
    and its manifest recording the new files' stat: an entry this executor life had
    verified is then checked by stat only, and the next organization's run executes the
    planted binary. The cache refuses to open there (a sticky directory, /tmp, is fine)."""
    job_uid = 64000
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, job_uid, job_uid)
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    os.chmod(sticky, 0o1777)
    os.chmod(tmp_path, 0o755)
    for parent in (theirs, shared):
        with pytest.raises(OSError, match="above the provider cache"):
            ProviderCache(parent / "cache", [packed.mirror]).open()
        assert not (parent / "cache").exists()
    squatted = sticky / "cache"  # a job's uid made it first
    squatted.mkdir()
    os.chown(squatted, job_uid, job_uid)
    with pytest.raises(OSError, match="another"):
        ProviderCache(squatted / "deeper", [packed.mirror]).open()
    cache = ProviderCache(sticky / "mine" / "cache", [packed.mirror]).open()
    root = _phase(tmp_path, packed.lock())
    assert use_cache(cache, root / "src", root / "src", root)


def test_a_lock_file_linked_within_the_checkout_is_left_to_terraform(
    tmp_path: Path, packed: Packed
) -> None:
    """Not an attack, a regression the cache brought: a lock file that is a link staying
    inside the checkout (a monorepo's shared one; the checkout check allows it, Terraform
    follows it) failed `init` (unsafe_file) before Terraform ran. It is left to Terraform
    as it was: nothing served, the link as it was."""
    cache = ProviderCache(tmp_path / "cache", [packed.mirror]).open()
    root = _phase(tmp_path, packed.lock())
    src = root / "src"
    (src / "shared.lock.hcl").write_text(packed.lock())
    (src / ".terraform.lock.hcl").unlink()
    (src / ".terraform.lock.hcl").symlink_to("shared.lock.hcl")
    assert use_cache(cache, src, src, root) == {}
    assert os.readlink(src / ".terraform.lock.hcl") == "shared.lock.hcl"
    assert cache.fills == 0


def test_an_entry_is_served_only_while_the_mirrors_hold_its_package(tmp_path: Path) -> None:
    """Attack: a lock file naming a package this executor's mirrors do not hold (any
    more) but the cache does. (1) The operator withdrew a build from the mirror (a
    compromised provider): a lock file that pinned its hash kept getting it from the
    cache until evicted, where Terraform's own install refuses it. (2) Executors with
    other mirrors share the cache (`--provider-cache`, one host): an organization of the
    second got the first's private provider by naming its hashes. Neither is served."""
    mirror = tmp_path / "mirror"
    packed = packed_provider(mirror, source="registry.example/test/pulled")
    cache = ProviderCache(tmp_path / "cache", [mirror]).open()
    root = _phase(tmp_path, packed.lock(), "filled")
    assert use_cache(cache, root / "src", root / "src", root)
    other = ProviderCache(tmp_path / "cache", [tmp_path / "other-mirror"]).open()
    root = _phase(tmp_path, packed.lock(), "other-executor")
    assert use_cache(other, root / "src", root / "src", root) == {}
    [zip_file] = mirror.rglob("*.zip")
    zip_file.rename(tmp_path / "withdrawn.zip")
    root = _phase(tmp_path, packed.lock(), "withdrawn")
    assert use_cache(cache, root / "src", root / "src", root) == {}
    assert (root / "src" / ".terraform.lock.hcl").read_text() == packed.lock()
    (tmp_path / "withdrawn.zip").rename(zip_file)  # back (its ctime changed: checked again)
    root = _phase(tmp_path, packed.lock(), "back")
    assert use_cache(cache, root / "src", root / "src", root)


def test_a_lock_file_naming_every_provider_of_the_mirrors_holds_a_bounded_few(
    tmp_path: Path,
) -> None:
    """Attack: one block each (no duplicates) for every provider a large mirror holds
    (an operator mirroring the registry holds thousands), each with its right hash:
    every one was unpacked and held by the phase (past the cache's bound, which evicts
    only what no phase holds) with a descriptor of the executor's each. The phase is
    served MAX_SERVED at most; the rest are Terraform's own install, their hashes as
    the lock file has them."""
    mirror = tmp_path / "mirror"
    blocks = []
    for i in range(MAX_SERVED + 6):
        name = f"p{i}"
        platform = mirror / "registry.example" / "many" / name / "1.0.0" / "linux_amd64"
        platform.mkdir(parents=True)
        exe = platform / f"terraform-provider-{name}_v1.0.0"
        exe.write_text("#!/bin/sh\n")
        exe.chmod(0o755)
        h1 = h1_of({exe.name: exe})
        blocks.append(
            f'provider "registry.example/many/{name}" {{\n  version = "1.0.0"\n'
            f'  hashes = [\n    "{h1}",\n  ]\n}}\n'
        )
    cache = ProviderCache(tmp_path / "cache", [mirror]).open()
    root = _phase(tmp_path, "".join(blocks))
    before = _fds()
    served = use_cache(cache, root / "src", root / "src", root)
    assert len(served) == MAX_SERVED and _fds() - before <= MAX_SERVED
    assert cache.fills == MAX_SERVED
    rewritten = (root / "src" / ".terraform.lock.hcl").read_text()
    assert blocks[-1] in rewritten, "a provider not served lost its own hashes"
