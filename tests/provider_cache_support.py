"""A provider in a packed filesystem mirror (zip layout) with its lock file, built from the
real null provider the tests' Terraform uses: what tests/test_provider_cache.py and
bench/provider.py serve through the executor's provider cache (executor/providers.py).

The package is the null provider's binary with `padding` bytes of random data appended
(a Go binary runs with data appended), under a source address of its own, so that the
configuration requires it as `null` and its resources are `null_resource`s.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import zipfile
from dataclasses import dataclass
from pathlib import Path

from executor.provpackages import h1_of
from executor.terraform import bundled_null_provider


@dataclass(frozen=True)
class Packed:
    mirror: Path  # the packed mirror's root
    source: str
    version: str
    h1: str
    zh: str

    def lock(self, *, h1: str = "", zh: str = "") -> str:
        """The lock file naming this package (or the hashes given instead)."""
        return (
            f'provider "{self.source}" {{\n'
            f'  version     = "{self.version}"\n'
            f'  constraints = "{self.version}"\n'
            "  hashes = [\n"
            f'    "{h1 or self.h1}",\n'
            f'    "{zh or self.zh}",\n'
            "  ]\n"
            "}\n"
        )

    def main_tf(self, resources: int = 1) -> str:
        return (
            "terraform {\n  required_providers {\n"
            f'    null = {{ source = "{self.source}", version = "{self.version}" }}\n'
            "  }\n}\n"
            f'resource "null_resource" "r" {{\n  count = {resources}\n}}\n'
        )


def packed_provider(
    top: Path,
    *,
    source: str = "registry.example/test/small",
    version: str = "1.0.0",
    padding: int = 0,
) -> Packed:
    """Build `top/<host>/<ns>/<type>/terraform-provider-<type>_<version>_linux_amd64.zip`."""
    name = source.rsplit("/", 1)[1]
    exe = f"terraform-provider-{name}_v{version}"
    work = top.with_name(f"{top.name}-build")
    work.mkdir(parents=True, exist_ok=True)
    binary = work / exe
    shutil.copyfile(bundled_null_provider(), binary)
    with open(binary, "ab") as f:
        left = padding
        while left > 0:
            chunk = min(left, 16 * 1024 * 1024)
            f.write(os.urandom(chunk))
            left -= chunk
    os.chmod(binary, 0o755)
    target = top / source
    target.mkdir(parents=True, exist_ok=True)
    archive = target / f"terraform-provider-{name}_{version}_linux_amd64.zip"
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as zf:
        info = zipfile.ZipInfo(exe, date_time=(2026, 1, 1, 0, 0, 0))
        info.external_attr = 0o100755 << 16
        info.compress_type = zipfile.ZIP_DEFLATED
        with open(binary, "rb") as src, zf.open(info, "w", force_zip64=True) as out:
            shutil.copyfileobj(src, out, 1024 * 1024)
    h1 = h1_of({exe: binary})
    zh = "zh:" + _sha256(archive)
    binary.unlink()
    for path in (top, *[p for p in top.rglob("*") if p.is_dir()]):
        os.chmod(path, 0o755)
    os.chmod(archive, 0o644)
    return Packed(top, source, version, h1, zh)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1024 * 1024):
            h.update(chunk)
    return h.hexdigest()
