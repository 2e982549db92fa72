"""A filesystem mirror holding the `fake` test provider (see `tests/provider/fake.py`).

`fake_provider_mirror(tmp_path)` builds the mirror and returns its directory; pass it to
the executor as `TerraformConfig(provider_mirrors=[mirror])` and require the provider as

    terraform {
      required_providers {
        fake = { source = "runplane.test/test/fake" }
      }
    }

The provider is a `#!/bin/sh` line starting `fake.py`, beside it, with an interpreter of
this Python version and the test environment's packages (`tf`) on PYTHONPATH: no build
step and no network. Jobs run as a uid of their own (executor/isolation.py), which may
not reach this interpreter (a pyenv under /root): then the system's python of the same
version is named, which any uid may run.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import site
import stat
import sys
import tempfile
from pathlib import Path

HOST, NAMESPACE, TYPE, VERSION = "runplane.test", "test", "fake", "1.0.0"
SOURCE = f"{HOST}/{NAMESPACE}/{TYPE}"
PLATFORM = "linux_amd64"
REQUIRED_PROVIDERS = (
    "terraform {\n"
    "  required_providers {\n"
    f'    fake = {{ source = "{SOURCE}", version = "{VERSION}" }}\n'
    "  }\n"
    "}\n"
)


def fake_provider_mirror(tmp_path: Path) -> Path:
    """Build a filesystem mirror (unpacked layout) with the fake provider under `tmp_path`."""
    mirror = tmp_path / "provider-mirror"
    target = mirror / HOST / NAMESPACE / TYPE / VERSION / PLATFORM
    target.mkdir(parents=True, exist_ok=True)
    script = target / f"terraform-provider-{TYPE}_v{VERSION}"
    (target / "fake.py").write_text((Path(__file__).parent / "fake.py").read_text())
    os.chmod(target / "fake.py", 0o644)
    packages = ":".join(_packages_open_to_all())
    script.write_text(
        "#!/bin/sh\n"
        f"PYTHONPATH={shlex.quote(packages)} exec {shlex.quote(interpreter())} "
        '"$(dirname "$0")/fake.py" "$@"\n'
    )
    os.chmod(script, 0o755)
    return mirror


# What `fake.py` imports, with what those import (tf's requirements and theirs).
_NEEDED = (
    "tf",
    "grpc",
    "msgpack",
    "cryptography",
    "google",
    "cffi",
    "_cffi_backend",
    "typing_extensions",
)


def _packages_open_to_all() -> list[str]:
    """This environment's site-packages if every uid may read them; else (a checkout
    under a private home) a copy of what the provider needs, made once per environment
    in the system's temporary directory, open to all."""
    places = site.getsitepackages()
    if all(_open_to_all(Path(p)) for p in places):
        return places
    key = hashlib.sha256(":".join(places).encode()).hexdigest()[:16]
    copy = Path(tempfile.gettempdir()) / f"rp-tests-packages-{key}"
    if not (copy / ".whole").exists():
        staging = Path(tempfile.mkdtemp(prefix=f"{copy.name}.", dir=copy.parent))
        for place in map(Path, places):
            for entry in place.iterdir():
                if entry.name.split(".")[0] in _NEEDED or entry.stem in _NEEDED:
                    target = staging / entry.name
                    if entry.is_dir():
                        shutil.copytree(entry, target, dirs_exist_ok=True)
                    else:
                        shutil.copy2(entry, target)
        (staging / ".whole").touch()
        for path in [staging, *staging.rglob("*")]:
            path.chmod(0o755 if path.is_dir() else 0o644)
        staging.chmod(0o755)
        try:
            staging.rename(copy)
        except OSError:  # another session made it meanwhile
            shutil.rmtree(staging, ignore_errors=True)
    return [str(copy)]


def interpreter() -> str:
    """This interpreter if any uid may run it, else the system's of the same version."""
    mine = Path(sys.executable).resolve()
    system = Path(f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}")
    if not _open_to_all(mine) and system.is_file() and _open_to_all(system):
        return str(system)
    return str(mine)


def _open_to_all(path: Path) -> bool:
    """Whether every uid may run `path`: it and each directory above it open to others."""
    if path.stat().st_mode & stat.S_IXOTH == 0:
        return False
    return all(p.stat().st_mode & stat.S_IXOTH for p in path.parents)
