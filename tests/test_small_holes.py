"""The smaller holes, closed at the API with problem details of a stable `type`: a plain
variable never shadows a secret one (nor the reverse) on any path; the `templates`
setting names templates that exist and suit their run type; `terraform_binary` is an
absolute path or a bare name; user names are printable. Each is a 422 `invalid-command`,
the type such refusals always had, with the reason in `detail`."""

from __future__ import annotations

import pytest

from events.errors import Invalid
from events.users import check_user, user_problem
from tests.builders import api_workspace
from tests.plane_support import (  # noqa: F401  # registers the fixtures
    Plane,
    plane_fixture,
)

V1 = "/api/v1/orgs/acme"


# ---------------------------------------------------------------- variables and secrets


async def test_a_plain_variable_never_takes_a_secret_variables_name(plane: Plane) -> None:
    """PATCH of the variables over a secret's name is refused 422 `invalid-command`,
    and the variables stay as they were; other names are fine."""
    await api_workspace(
        plane.http, "/r", variables={"n": "1"}, secret_variables={"token": "s3cret"}
    )
    patch = {"variables": {"n": "2", "token": "plain"}}
    a = await plane.http.call("PATCH", f"{V1}/workspaces/net", json=patch)
    assert "'token'" in a.problem("invalid-command", 422)["detail"]
    shown = await plane.http.get(f"{V1}/workspaces/net")
    assert shown.body["variables"] == {"n": "1"}
    ok = await plane.http.call("PATCH", f"{V1}/workspaces/net", json={"variables": {"n": "2"}})
    assert ok.status == 200, ok.body


async def test_a_secret_variable_never_takes_a_plain_variables_name(plane: Plane) -> None:
    """PUT of a secret over a plain variable's name is refused 422 `invalid-command`,
    also right after the PATCH that made it (checked on the aggregate, not the read
    model); so is a new workspace that names one variable both ways."""
    await api_workspace(plane.http, "/r")
    patched = await plane.http.call("PATCH", f"{V1}/workspaces/net", json={"variables": {"k": "v"}})
    assert patched.status == 200, patched.body
    put = await plane.http.call(
        "PUT", f"{V1}/workspaces/net/secret-variables/k", json={"value": "s3cret"}
    )
    assert "'k'" in put.problem("invalid-command", 422)["detail"]
    assert await plane.secrets.names("acme", "net") == []
    body = {"name": "other", "repository": "/r", "variables": {"k": "1"}}
    both = await plane.http.post(f"{V1}/workspaces", json={**body, "secret_variables": {"k": "2"}})
    both.problem("invalid-command", 422)


# ---------------------------------------------------------------- settings

SETTINGS_PATHS = (f"{V1}/settings", f"{V1}/folders/infra/settings", f"{V1}/workspaces/net/settings")


async def _with_levels(plane: Plane) -> None:
    await api_workspace(plane.http, "/r")
    folder = await plane.http.post(f"{V1}/folders", json={"name": "infra"})
    assert folder.status == 201, folder.body


@pytest.mark.parametrize("path", SETTINGS_PATHS)
async def test_the_templates_setting_names_templates_that_exist_and_fit(
    plane: Plane, path: str
) -> None:
    """At every level: a template that does not exist, or does not suit its run type, is
    refused 422 `invalid-command` (`reasons` naming it); a saved or built-in one is taken."""
    await _with_levels(plane)
    missing = await plane.http.call("PATCH", path, json={"templates": {"apply": "nope"}})
    assert "'nope'" in missing.problem("invalid-command", 422)["detail"]
    unfit = await plane.http.call("PATCH", path, json={"templates": {"plan": "apply"}})
    assert "changes nothing" in unfit.problem("invalid-command", 422)["detail"]
    steps = {
        "steps": [
            {"number": 100, "kind": "plan"},
            {"number": 150, "kind": "approval"},
            {"number": 200, "kind": "apply"},
        ]
    }
    saved = await plane.http.call("PUT", f"{V1}/templates/careful", json=steps)
    assert saved.status == 201, saved.body
    ok = await plane.http.call(
        "PATCH", path, json={"templates": {"apply": "careful", "plan": "plan"}}
    )
    assert ok.status == 200, ok.body


@pytest.mark.parametrize("path", SETTINGS_PATHS)
@pytest.mark.parametrize(
    "binary", ["../../bin/sh", "bin/sh", "./terraform", "/usr/../bin/sh", ".."]
)
async def test_terraform_binary_is_an_absolute_path_or_a_bare_name(
    plane: Plane, path: str, binary: str
) -> None:
    await _with_levels(plane)
    a = await plane.http.call("PATCH", path, json={"terraform_binary": binary})
    assert "terraform_binary" in a.problem("invalid-command", 422)["detail"]


@pytest.mark.parametrize("binary", ["tofu", "/opt/tofu/bin/tofu", "terraform-1.5", ""])
async def test_absolute_paths_and_bare_names_are_taken(plane: Plane, binary: str) -> None:
    await _with_levels(plane)
    a = await plane.http.call("PATCH", f"{V1}/settings", json={"terraform_binary": binary})
    assert a.status == 200, a.body


# ---------------------------------------------------------------- user names

UNPRINTABLE = ["\x1b[31mroot", "bob\n", "bo\tb", " bob", "bob ", "\u202eevil", "a\u2028b", ""]


@pytest.mark.parametrize("name", UNPRINTABLE)
def test_a_user_name_is_printable(name: str) -> None:
    assert user_problem(name)
    with pytest.raises(Invalid):
        check_user(name)


def test_printable_user_names_are_taken() -> None:
    for name in ("alice", "Alice Smith", "bob@example.com", "zoë", "x" * 200):
        assert check_user(name) == name
    assert user_problem("x" * 201)


@pytest.mark.parametrize("name", UNPRINTABLE[:-1])
async def test_group_members_with_unprintable_names_are_refused(plane: Plane, name: str) -> None:
    body = {"name": "ops", "members": ["alice", name]}
    a = await plane.http.post(f"{V1}/groups", json=body)
    assert (
        "printable" in a.problem("invalid-command", 422)["detail"] or "blanks" in a.body["detail"]
    )
    ok = await plane.http.post(f"{V1}/groups", json={"name": "ops", "members": ["Alice Smith"]})
    assert ok.status == 201, ok.body
    put = await plane.http.call("PUT", f"{V1}/groups/ops/members", json={"members": [name]})
    put.problem("invalid-command", 422)


@pytest.mark.parametrize("name", UNPRINTABLE)
async def test_a_token_for_an_unprintable_user_name_is_refused(plane: Plane, name: str) -> None:
    a = await plane.http.post(f"{V1}/tokens", json={"user": name, "role": "viewer"})
    assert a.status == (400 if name == "" else 422), a.body  # "": refused by the body's schema
    ok = await plane.http.post(f"{V1}/tokens", json={"user": "Alice Smith", "role": "viewer"})
    assert ok.status == 201, ok.body
