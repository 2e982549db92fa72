"""The executor host's provider cache (executor/providers.py): a package a lock file names
is unpacked once from the operator's packed mirror, checked against the lock file's
hashes, never used changed, and no job can write it.

The first tests drive `ProviderCache` and real Terraform directly; the last ones drive
`runplane up` (the uid mode and the sandbox): a plan fills the cache, the next plan of
the same lock file unpacks nothing (the entry's inode unchanged), a tenant's custom step
cannot write into the cache, and a lock file naming other hashes fails `init`.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from executor.isolation import sandbox_problem
from executor.providers import HASH_MISMATCH, ProviderCache, ProviderMismatch, use_cache
from executor.provpackages import h1_of
from executor.terraform import cli_config_text, default_binary
from executor.uids import uid_range
from tests.executor_support import git
from tests.procs import Client, Proc, free_port, wait_healthy
from tests.provider_cache_support import Packed, packed_provider

TOKEN = "admin-canary-provider-cache-7d2a"


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> Packed:
    top = tmp_path_factory.mktemp("packed-mirror")
    os.chmod(top.parent, 0o711)
    return packed_provider(top / "mirror", padding=1024 * 1024)


def _phase(tmp_path: Path, packed: Packed, lock: str, name: str = "phase") -> Path:
    root = tmp_path / name
    (root / "src").mkdir(parents=True)
    (root / "src" / "main.tf").write_text(packed.main_tf())
    (root / "src" / ".terraform.lock.hcl").write_text(lock)
    return root


def _entry_file(cache: ProviderCache) -> Path:
    [entry] = [p for p in (cache.root / "entries").iterdir() if p.is_dir()]
    [exe] = (entry / "package").iterdir()
    return exe


def _init(root: Path) -> subprocess.CompletedProcess[str]:
    """`terraform init` then `plan` in the phase's source, as the executor would run it."""
    (root / "terraform.rc").write_text(cli_config_text([root / "providers"]))
    env = {"PATH": os.environ["PATH"], "TF_CLI_CONFIG_FILE": str(root / "terraform.rc")}
    tf = str(default_binary())
    done = subprocess.run(
        [tf, "init", "-input=false", "-no-color"],
        cwd=root / "src",
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode:
        return done
    return subprocess.run(
        [tf, "plan", "-input=false", "-no-color"],
        cwd=root / "src",
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )


@pytest.mark.terraform
def test_a_locked_package_is_unpacked_once_and_terraform_runs_it(
    tmp_path: Path, packed: Packed
) -> None:
    """Two phases of the same lock file: the first unpacks the package (one fill), the
    second finds it (no fill, the same inode); Terraform installs and runs it in both.
    The directories it made are crossable by all (a job's uid reads the entries)."""
    umask = os.umask(0o077)  # runplane's processes run with it
    try:
        cache = ProviderCache(tmp_path / "made" / "for" / "cache", [packed.mirror]).open()
    finally:
        os.umask(umask)
    for made in (cache.root, cache.root.parent, cache.root.parent.parent, cache.root / "entries"):
        assert made.stat().st_mode & 0o777 == 0o755, made
    first = _phase(tmp_path, packed, packed.lock(), "one")
    served = use_cache(cache, first / "src", first / "src", first)
    assert list(served) == [packed.source] and served[packed.source].h1 == packed.h1
    assert cache.fills == 1
    inode = _entry_file(cache).stat().st_ino
    done = _init(first)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 to add" in done.stdout
    second = _phase(tmp_path, packed, packed.lock(), "two")
    assert use_cache(cache, second / "src", second / "src", second)
    assert cache.fills == 1, "the second phase unpacked the package again"
    assert _entry_file(cache).stat().st_ino == inode
    done = _init(second)
    assert done.returncode == 0, done.stdout + done.stderr
    st = os.stat(_entry_file(cache))
    assert st.st_uid == os.geteuid() and not st.st_mode & 0o022


def test_a_changed_entry_is_never_used_but_filled_again(tmp_path: Path, packed: Packed) -> None:
    """Bytes of a filled entry changed (its size and mtime kept): the next phase finds it
    changed, removes it and unpacks the package again; what it serves is the genuine one."""
    cache = ProviderCache(tmp_path / "cache", [packed.mirror]).open()
    root = _phase(tmp_path, packed, packed.lock(), "one")
    use_cache(cache, root / "src", root / "src", root)
    exe = _entry_file(cache)
    genuine = hashlib.sha256(exe.read_bytes()).hexdigest()
    st = exe.stat()
    with open(exe, "r+b") as f:
        f.seek(st.st_size - 100)
        f.write(b"POISON")
    os.utime(exe, ns=(st.st_atime_ns, st.st_mtime_ns))
    later = ProviderCache(tmp_path / "cache", [packed.mirror]).open()  # a restart, too
    root = _phase(tmp_path, packed, packed.lock(), "two")
    served = use_cache(later, root / "src", root / "src", root)
    assert later.fills == 1, "the changed entry was used"
    fresh = _entry_file(later)
    assert hashlib.sha256(fresh.read_bytes()).hexdigest() == genuine
    assert served[packed.source].h1 == packed.h1
    # and within one life: the stat check alone finds it
    with open(fresh, "r+b") as f:
        f.seek(10)
        f.write(b"X")
    root = _phase(tmp_path, packed, packed.lock(), "three")
    use_cache(later, root / "src", root / "src", root)
    assert later.fills == 2
    assert hashlib.sha256(_entry_file(later).read_bytes()).hexdigest() == genuine


def test_a_lock_file_with_other_hashes_is_refused_though_the_package_is_cached(
    tmp_path: Path, packed: Packed
) -> None:
    """The package is cached under its right hash; a lock file naming other hashes for
    the same provider and version is refused (no link to the entry, the lock file as it
    was; the zip not unpacked again to learn its hashes), and the entry stays as it was."""
    cache = ProviderCache(tmp_path / "cache", [packed.mirror]).open()
    root = _phase(tmp_path, packed, packed.lock(), "one")
    use_cache(cache, root / "src", root / "src", root)
    before = _entry_file(cache).stat()
    wrong = packed.lock(h1="h1:" + "A" * 43 + "=", zh="zh:" + "0" * 64)
    root = _phase(tmp_path, packed, wrong, "two")
    with pytest.raises(ProviderMismatch) as refused:
        use_cache(cache, root / "src", root / "src", root)
    assert refused.value.reason == HASH_MISMATCH
    assert packed.source in refused.value.message and packed.h1 in refused.value.message
    assert cache.unpacks == 1, "the zip was unpacked again to refuse it"
    fresh = ProviderCache(tmp_path / "cache", [packed.mirror]).open()  # a new life: unpacks
    with pytest.raises(ProviderMismatch):
        use_cache(fresh, root / "src", root / "src", root)
    assert not (root / "providers").exists()
    assert (root / "src" / ".terraform.lock.hcl").read_text() == wrong
    after = _entry_file(cache).stat()
    assert (after.st_ino, after.st_ctime_ns) == (before.st_ino, before.st_ctime_ns)


def test_a_lock_file_cannot_lead_the_fill_out_of_the_operators_mirrors(
    tmp_path: Path, packed: Packed
) -> None:
    """Attack: a lock file naming a source (or a version) with `..` so that the path under
    the mirror lands in a directory the tenant could write (here beside the mirror, with
    a package whose hash the lock names): nothing is served or filled from it."""
    evil = packed.mirror.parent / "evil" / "x" / "1.0.0" / "linux_amd64"
    evil.mkdir(parents=True)
    exe = evil / "terraform-provider-x_v1.0.0"
    exe.write_text("#!/bin/sh\necho PLANTED\n")
    exe.chmod(0o755)
    h1 = h1_of({exe.name: exe})
    lock = "".join(
        f'provider "{source}" {{\n  version = "{version}"\n  hashes = [\n    "{h1}",\n  ]\n}}\n'
        for source, version in (
            ("../evil/x", "1.0.0"),
            ("registry.example/test/x", "../../../../evil/x/1.0.0"),
        )
    )
    cache = ProviderCache(tmp_path / "cache", [packed.mirror]).open()
    root = _phase(tmp_path, packed, lock)
    try:
        assert use_cache(cache, root / "src", root / "src", root) == {}
        assert cache.fills == 0 and not list((cache.root / "entries").iterdir())
    finally:
        shutil.rmtree(evil.parent.parent.parent)


def test_over_its_bound_the_least_recently_used_entry_no_phase_holds_goes(
    tmp_path: Path,
) -> None:
    """Room for two and a half entries: a third fill while the first two phases live
    evicts nothing (both held); once they ended, a fourth fill removes the least recently
    used entries until the cache is within its bound again."""
    mirror = tmp_path / "four"
    versions = [
        packed_provider(mirror, source="registry.example/test/evict", version=f"1.0.{i}")
        for i in range(4)
    ]
    cache = ProviderCache(tmp_path / "cache", [mirror]).open()
    roots = [_phase(tmp_path, p, p.lock(), f"p{i}") for i, p in enumerate(versions)]
    use_cache(cache, roots[0] / "src", roots[0] / "src", roots[0])
    cache.max_bytes = cache.size() * 5 // 2
    for root in roots[1:3]:
        use_cache(cache, root / "src", root / "src", root)
    assert _versions(cache) == {"1.0.0", "1.0.1", "1.0.2"}, "a held entry was evicted"
    for root in roots[:3]:
        shutil.rmtree(root)  # their phases ended
    use_cache(cache, roots[3] / "src", roots[3] / "src", roots[3])
    assert _versions(cache) == {"1.0.2", "1.0.3"}
    assert cache.size() <= cache.max_bytes


def _versions(cache: ProviderCache) -> set[str]:
    return {str(m["version"]) for m in _manifests(cache)}


def _manifests(cache: ProviderCache) -> list[dict[str, Any]]:
    import json

    return [
        json.loads((e / "manifest.json").read_text())
        for e in (cache.root / "entries").iterdir()
        if e.is_dir()
    ]


# ---------------------------------------------------------------- through runplane


@dataclass
class Plane:
    client: Client
    cache: Path


MODES = ["user", "sandbox"]


@pytest.fixture(params=MODES)
async def plane(
    request: pytest.FixtureRequest, tmp_path: Path, packed: Packed
) -> AsyncIterator[Plane]:
    mode = str(request.param)
    if os.geteuid() != 0:
        pytest.skip("jobs run as uids of their own only as root")
    if mode == "sandbox" and (why := sandbox_problem(uid_range()[-1])):
        pytest.skip(f"no sandbox here: {why}")
    data, port, cache = tmp_path / "data", free_port(), tmp_path / "provider-cache"
    args = ["up", "--no-demo", "--data-dir", str(data), "--listen", f"127.0.0.1:{port}"]
    args += ["--isolation", mode, "--provider-mirror", str(packed.mirror)]
    args += ["--provider-cache", str(cache)]
    proc = await Proc(
        args,
        tmp_path / "up.log",
        env={"RUNPLANE_ADMIN_TOKEN": TOKEN, "RUNPLANE_ENCRYPTION_KEY": ""},
    ).start()
    base = f"http://127.0.0.1:{port}"
    client = Client(base, TOKEN)
    try:
        await wait_healthy(base)
        for org in ("acme", "other"):
            await client.ok("POST", "/api/v1/orgs", {"name": org})
        yield Plane(client, cache)
    finally:
        await client.close()
        await proc.stop(signal.SIGTERM)


def _repo(path: Path, main_tf: str, lock: str) -> Path:
    path.mkdir(parents=True)
    os.chmod(path.parent, 0o755)
    git(path, "init", "-q", "-b", "main")
    (path / "main.tf").write_text(main_tf)
    (path / ".terraform.lock.hcl").write_text(lock)
    git(path, "add", "main.tf", ".terraform.lock.hcl")
    git(path, "commit", "-q", "-m", "locked")
    return path


async def _run(plane: Plane, org: str, ws: str, body: dict[str, Any]) -> dict[str, Any]:
    run = await plane.client.ok("POST", f"/api/v1/orgs/{org}/workspaces/{ws}/runs", body)
    return await plane.client.wait_status(
        org, run["id"], {"failed", "planned", "awaiting_approval", "applied"}, timeout=120
    )


async def _log(plane: Plane, org: str, run: str, phase: str) -> list[str]:
    got = await plane.client.ok("GET", f"/api/v1/orgs/{org}/runs/{run}/logs?phase={phase}")
    return [str(item["text"]).rstrip("\n") for item in got["items"]]


def _digest(top: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(p for p in top.rglob("*") if p.is_file() and p.parent.name != "locks"):
        if path.name == "manifest.json":  # its mtime says when it was used last
            h.update(path.read_bytes())
            continue
        h.update(str(path.relative_to(top)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def _attack(cache: Path) -> str:
    """Shell that tries every way into the cache: new files in each of its directories,
    the package and the launcher overwritten, an entry renamed or removed."""
    return (
        "echo uid=$(id -u); "
        f"for d in {cache} {cache}/entries {cache}/entries/* {cache}/entries/*/package "
        f"{cache}/entries/*/launcher; do "
        '  (echo x > "$d/planted") 2>/dev/null && echo PLANTED-IN-$d; done; '
        f"for f in {cache}/entries/*/package/* {cache}/entries/*/launcher/* "
        f"{cache}/entries/*.key {cache}/entries/*/manifest.json; do "
        "  (printf '#!/bin/sh\\nexit 1\\n' > \"$f\") 2>/dev/null && echo WROTE-$f; "
        '  chmod 777 "$f" 2>/dev/null && echo CHMOD-$f; done; '
        f"for e in {cache}/entries/*; do "
        '  mv "$e" "$e.moved" 2>/dev/null && echo MOVED-$e; done; '
        f"ls {cache}/entries >/dev/null && echo LISTED; "
        "exit 0"
    )


@pytest.mark.terraform
async def test_through_runplane_the_cache_serves_checks_and_resists_a_tenant(
    plane: Plane, tmp_path: Path, packed: Packed
) -> None:
    """Org `other`'s plan fills the cache from the packed mirror; its second plan of the
    same lock file unpacks nothing (the log says so, the entry's inode is the same).
    Org `acme`'s custom step then attacks the cache as its job's uid: it can read it
    but nothing it tries writes, and `other`'s next plan is planned on the same bytes.
    `acme`'s lock file naming other hashes for the cached provider fails `init`
    (provider_hash_mismatch) before Terraform runs."""
    good = _repo(tmp_path / "repos" / "good", packed.main_tf(), packed.lock())
    wrong = packed.lock(h1="h1:" + "B" * 43 + "=", zh="zh:" + "1" * 64)
    bad = _repo(tmp_path / "repos" / "bad", packed.main_tf(), wrong)
    for org, repo in (("other", good), ("acme", good)):
        body = {"name": "net", "repository": str(repo)}
        await plane.client.ok("POST", f"/api/v1/orgs/{org}/workspaces", body)
    body = {"name": "bad", "repository": str(bad)}
    await plane.client.ok("POST", "/api/v1/orgs/acme/workspaces", body)

    first = await _run(plane, "other", "net", {"type": "plan"})
    assert first["status"] == "planned", first
    lines = await _log(plane, "other", first["id"], "plan")
    assert any(
        "providers from the executor's cache" in ln and "1 unpacked now" in ln for ln in lines
    ), lines
    [exe] = plane.cache.glob("entries/*/package/*")
    inode = exe.stat().st_ino
    second = await _run(plane, "other", "net", {"type": "plan"})
    assert second["status"] == "planned", second
    lines = await _log(plane, "other", second["id"], "plan")
    assert any("(all cached)" in ln and packed.h1 in ln for ln in lines), lines
    assert exe.stat().st_ino == inode, "the package was unpacked again"

    before = _digest(plane.cache)
    steps = [{"number": 50, "kind": "custom", "name": "attack", "command": _attack(plane.cache)}]
    steps.append({"number": 100, "kind": "plan"})
    await plane.client.ok("PUT", "/api/v1/orgs/acme/templates/attack", {"steps": steps})
    attacked = await _run(plane, "acme", "net", {"type": "plan", "template": "attack"})
    lines = await _log(plane, "acme", attacked["id"], "custom-50")
    assert any(ln.startswith("uid=") and ln != "uid=0" for ln in lines), lines
    assert "LISTED" in lines, lines  # it reached the cache: the refusals are the modes'
    assert not [ln for ln in lines if ln.startswith(("PLANTED-", "WROTE-", "CHMOD-", "MOVED-"))]
    assert attacked["status"] == "planned", attacked
    assert _digest(plane.cache) == before, "the cache changed"
    victim = await _run(plane, "other", "net", {"type": "plan"})
    assert victim["status"] == "planned", victim
    assert exe.stat().st_ino == inode

    refused = await _run(plane, "acme", "bad", {"type": "plan"})
    assert refused["status"] == "failed", refused
    assert refused["reason"] == HASH_MISMATCH, refused
    lines = await _log(plane, "acme", refused["id"], "plan")
    assert not any("terraform init" in ln.lower() and "installed" in ln.lower() for ln in lines)
    assert _digest(plane.cache) == before


@pytest.mark.terraform
async def test_an_apply_after_a_plan_served_from_the_cache_applies(
    plane: Plane, tmp_path: Path, packed: Packed
) -> None:
    """A plan whose providers came from the cache leaves links into its own phase's
    mirror in `.terraform`, gone with that phase: its checkout is not kept warm, and the
    apply (on the same executor) checks out and inits again, its providers served from
    the cache too, and applies. A warm apply of that checkout failed: `no package for
    ... cached in .terraform/providers`."""
    good = _repo(tmp_path / "repos" / "good", packed.main_tf(), packed.lock())
    await plane.client.ok(
        "POST", "/api/v1/orgs/acme/workspaces", {"name": "net", "repository": str(good)}
    )
    await plane.client.ok(
        "PATCH", "/api/v1/orgs/acme/workspaces/net/settings", {"require_approval": False}
    )
    run = await _run(plane, "acme", "net", {"type": "apply"})
    assert run["status"] == "applied", run
    listed = await plane.client.ok("GET", f"/api/v1/orgs/acme/runs/{run['id']}/steps")
    items = listed["items"] if isinstance(listed, dict) else listed
    assert [s["step"] for s in items if s["phase"] == "apply"] == ["checkout", "init", "apply"]
    lines = await _log(plane, "acme", run["id"], "apply")
    assert any("providers from the executor's cache" in ln for ln in lines), lines
