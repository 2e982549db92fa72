"""The `fake` Terraform provider: resources that change in every way Terraform can show.

Written with the `tf` framework (plugin protocol 6) and run as a script, straight from a
filesystem mirror (see `tests/provider/__init__.py`). One resource type, `fake_thing`:

- `name` forces a replacement when it changes; `value` and `tags` update in place;
- `secret` is sensitive; `id` is known only after apply;
- `fail = true` makes create and update fail with an error naming the resource;
- `sleep_seconds` makes create, update and delete take that long.

With the provider's `store` directory set, each thing is also kept as a JSON file there
(secret excluded), and refresh reads it back: editing or removing the file is drift.
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import Any

from tf import runner, schema, types  # type: ignore[import-untyped]  # tf ships no types
from tf.iface import (  # type: ignore[import-untyped]  # tf ships no types
    CreateContext,
    DeleteContext,
    Provider,
    ReadContext,
    Resource,
    UpdateContext,
)
from tf.utils import Diagnostics  # type: ignore[import-untyped]  # tf ships no types

FULL_NAME = "runplane.test/test/fake"
_NOT_STORED = ("secret",)


class FakeProvider(Provider):  # type: ignore[misc]  # tf's base classes are untyped
    """The provider: one resource type and an optional store directory."""

    def __init__(self) -> None:
        self.store: Path | None = None

    def full_name(self) -> str:
        return FULL_NAME

    def get_model_prefix(self) -> str:
        return "fake_"

    def get_provider_schema(self, diags: Diagnostics) -> Any:
        return schema.Schema(attributes=[schema.Attribute("store", types.String(), optional=True)])

    def validate_config(self, diags: Diagnostics, config: dict[str, Any]) -> None:
        pass

    def configure_provider(self, diags: Diagnostics, config: dict[str, Any]) -> None:
        store = (config or {}).get("store")
        self.store = Path(store) if store else None

    def get_data_sources(self) -> list[type]:
        return []

    def get_resources(self) -> list[type]:
        return [Thing]

    def new_resource(self, klass: type) -> Any:
        return klass(self)


class Thing(Resource):  # type: ignore[misc]  # tf's base classes are untyped
    """`fake_thing`: see the module docstring."""

    def __init__(self, provider: FakeProvider) -> None:
        self.provider = provider

    @classmethod
    def get_name(cls) -> str:
        return "thing"

    @classmethod
    def get_schema(cls) -> Any:
        a = schema.Attribute
        return schema.Schema(
            version=1,
            attributes=[
                a("id", types.String(), computed=True),
                a("name", types.String(), required=True, requires_replace=True),
                a("value", types.String(), optional=True),
                a("tags", types.Map(types.String()), optional=True),
                a("secret", types.String(), optional=True, sensitive=True),
                a("fail", types.Bool(), optional=True),
                a("sleep_seconds", types.Number(), optional=True),
            ],
        )

    def create(self, ctx: CreateContext, planned: dict[str, Any]) -> dict[str, Any] | None:
        if not _work(ctx.diagnostics, planned):
            return None
        state = {**planned, "id": planned["name"]}
        self._save(state)
        return state

    def read(self, ctx: ReadContext, current: dict[str, Any]) -> dict[str, Any] | None:
        if self.provider.store is None:
            return current
        path = self.provider.store / f"{current['id']}.json"
        if not path.exists():
            return None  # deleted outside Terraform
        return {**current, **json.loads(path.read_text())}

    def upgrade(self, ctx: Any, version: int, old: dict[str, Any]) -> dict[str, Any]:
        return old  # one schema version so far

    def update(
        self, ctx: UpdateContext, current: dict[str, Any], planned: dict[str, Any]
    ) -> dict[str, Any]:
        if not _work(ctx.diagnostics, planned):
            return current
        self._save(planned)
        return planned

    def delete(self, ctx: DeleteContext, current: dict[str, Any]) -> None:
        _sleep(current)
        if self.provider.store is not None:
            (self.provider.store / f"{current['id']}.json").unlink(missing_ok=True)

    def _save(self, state: dict[str, Any]) -> None:
        if self.provider.store is None:
            return
        if not self.provider.store.is_dir():
            # Terraform applies resources in parallel: two may make it at once.
            self.provider.store.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(PermissionError):  # the other one's
                self.provider.store.chmod(0o777)  # the next phase is another job uid
        kept = {k: v for k, v in state.items() if k not in _NOT_STORED}
        path = self.provider.store / f"{state['id']}.json"
        path.write_text(json.dumps(kept))
        # Readable and writable by the next phase, which runs as another job uid.
        with contextlib.suppress(PermissionError):
            path.chmod(0o666)


def _sleep(state: dict[str, Any]) -> None:
    seconds = state.get("sleep_seconds")
    if isinstance(seconds, int | float) and seconds > 0:
        time.sleep(seconds)


def _work(diags: Diagnostics, planned: dict[str, Any]) -> bool:
    """Sleep if asked to; fail if asked to. False when the change failed."""
    _sleep(planned)
    if planned.get("fail"):
        diags.add_error(
            f"fake_thing {planned['name']} failed on purpose",
            "The resource sets fail = true.",
        )
        return False
    return True


def main() -> None:
    runner.run_provider(FakeProvider())


if __name__ == "__main__":
    main()
