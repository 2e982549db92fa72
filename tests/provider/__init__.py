"""A filesystem mirror holding the `fake` test provider (see `tests/provider/fake.py`).

`fake_provider_mirror(tmp_path)` builds the mirror and returns its directory; pass it to
the executor as `TerraformConfig(provider_mirrors=[mirror])` and require the provider as

    terraform {
      required_providers {
        fake = { source = "runplane.test/test/fake" }
      }
    }

The provider is the source of `fake.py` behind a `#!` line naming this interpreter, so it
runs with the test environment's `tf` package and needs no build step and no network.
"""

from __future__ import annotations

import os
import sys
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
    source = (Path(__file__).parent / "fake.py").read_text()
    script.write_text(f"#!{sys.executable}\n{source}")
    os.chmod(script, 0o755)
    return mirror
