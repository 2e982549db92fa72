"""The organization aggregate, given / when / then: creation and token issue."""

from __future__ import annotations

from datetime import timedelta

import pytest

from events import org
from events.errors import AlreadyExists, Invalid, NotFound
from events.org import CreateOrg, IssueToken, OrgCreated, TokenIssued
from tests.gwt import NOW, Aggregate, given

ORG = Aggregate(initial=org.INITIAL, decide=org.decide, evolve=org.evolve)
CREATED = OrgCreated(at=NOW - timedelta(days=1), actor="alice", name="acme")


def issue(role: str = "operator", token_id: str = "tok-1") -> IssueToken:
    return IssueToken(
        actor="alice", token_id=token_id, token_hash="sha256:feed", user="bob", role=role
    )


def test_create_records_the_organization() -> None:
    state = (
        given(ORG)
        .when(CreateOrg(actor="alice", name="acme"))
        .then(OrgCreated(at=NOW, actor="alice", name="acme"))
    )
    assert (state.name, state.created_at, state.tokens) == ("acme", NOW, ())


def test_creating_an_organization_that_exists_is_refused_as_already_exists() -> None:
    given(ORG, CREATED).when(CreateOrg(actor="bob", name="acme")).then_error(AlreadyExists)


@pytest.mark.parametrize("role", org.ROLES)
def test_a_token_with_a_known_role_is_issued_storing_only_its_hash(role: str) -> None:
    state = (
        given(ORG, CREATED)
        .when(issue(role))
        .then(
            TokenIssued(
                at=NOW,
                actor="alice",
                token_id="tok-1",
                token_hash="sha256:feed",
                user="bob",
                role=role,
            )
        )
    )
    assert state.tokens == ("tok-1",)


def test_a_token_issued_without_a_role_is_an_admin_token() -> None:
    outcome = given(ORG, CREATED).when(
        IssueToken(actor="alice", token_id="tok-1", token_hash="sha256:feed", user="bob")
    )
    assert [e.role for e in outcome.events or []] == ["admin"]


@pytest.mark.parametrize("role", ["", "root", "Admin", "owner"])
def test_a_token_with_an_unknown_role_is_refused_as_invalid(role: str) -> None:
    given(ORG, CREATED).when(issue(role)).then_error(Invalid)


def test_a_token_for_a_missing_organization_is_refused_as_not_found() -> None:
    given(ORG).when(issue()).then_error(NotFound)


def test_issued_tokens_are_kept_in_issue_order() -> None:
    first = TokenIssued(
        at=NOW, actor="alice", token_id="tok-1", token_hash="h1", user="bob", role="viewer"
    )
    state = (
        given(ORG, CREATED, first)
        .when(issue(token_id="tok-2"))
        .then(
            TokenIssued(
                at=NOW,
                actor="alice",
                token_id="tok-2",
                token_hash="sha256:feed",
                user="bob",
                role="operator",
            )
        )
    )
    assert state.tokens == ("tok-1", "tok-2")
    assert state.version == 3
