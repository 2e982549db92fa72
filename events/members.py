"""The people of an organization: its users, the pieces the organization's `decide` and
`evolve` delegate to (events/org.py). Pure.

A user is one person across organizations: their id derives from their email, case-folded
(`user_id_of`), so the same address is the same user everywhere and an email is unique by
construction. Each organization keeps its own record of the person (name, state,
the single sign-on identity it saw), in its own aggregate, for two reasons:

- an organization's admin is a tenant: suspending, renaming or re-linking a user in one
  organization must never touch the person's standing in another;
- every access decision reads one aggregate, the organization's, at or past its last
  event as the stream's leader has it (services/surfaces/api/auth.py): a suspension, a
  team change or a revoked grant holds on every replica from its acknowledgement.

A user comes by an admin's invitation (`via` "invitation") or at first single sign-on
(`via` "sso", services/app/identity.py). Suspension is an event; with it every personal
token of the user is revoked (events/org.py: a reactivation brings none back), so their
tokens and sessions are refused at their next use, and nothing they sign in with works.
Team and organization tokens they made stay: they are their team's and organization's,
not the person's (as HCP Terraform's team and organization tokens outlive a member).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from datetime import datetime
from typing import Literal

import msgspec

from events.base import Command, Event
from events.errors import AlreadyExists, Forbidden, Invalid, NotFound

MAX_EMAIL = 254
MAX_NAME = 200
MAX_SUBJECT = 255
State = Literal["active", "suspended"]


class Suspended(Forbidden):
    """The user is suspended in this organization: nothing of theirs works here."""

    code = "user-suspended"


class IdentityMismatch(Forbidden):
    """A sign-in names a user whose single sign-on identity (issuer, subject) differs from
    the one the organization first recorded: the email was reassigned, or another issuer
    claims it."""

    code = "identity-mismatch"


class Member(msgspec.Struct, frozen=True, kw_only=True):
    user_id: str
    email: str
    name: str
    state: State = "active"
    via: str = "invitation"
    issuer: str = ""  # the single sign-on identity first seen, "" before any
    subject: str = ""

    @property
    def active(self) -> bool:
        return self.state == "active"


class UserAdded(Event, frozen=True, kw_only=True, tag="org.user_added"):
    user_id: str
    email: str
    name: str
    via: str = "invitation"


class UserSuspended(Event, frozen=True, kw_only=True, tag="org.user_suspended"):
    user_id: str
    reason: str = ""


class UserReactivated(Event, frozen=True, kw_only=True, tag="org.user_reactivated"):
    user_id: str


class UserLinked(Event, frozen=True, kw_only=True, tag="org.user_linked"):
    """The user's single sign-on identity, recorded at their first sign-in."""

    user_id: str
    issuer: str
    subject: str


MemberEvent = UserAdded | UserSuspended | UserReactivated | UserLinked


class InviteUser(Command, frozen=True, kw_only=True):
    email: str
    name: str = ""


class SuspendUser(Command, frozen=True, kw_only=True):
    user_id: str
    reason: str = ""


class ReactivateUser(Command, frozen=True, kw_only=True):
    user_id: str


def normal_email(email: object) -> str:
    """The email, case-folded and checked (Invalid saying why). ASCII only: the user id
    derives from the folded address, and Unicode folds other letters into ASCII ones
    (LONG S to `s`, KELVIN SIGN to `k`, ligatures to their letters), so `\u017fam@x` would
    be sam@x's user; an internationalized domain comes as its ASCII (punycode) form."""
    if not isinstance(email, str) or not 3 <= len(email) <= MAX_EMAIL:
        raise Invalid(f"an email is 3 to {MAX_EMAIL} characters")
    if not email.isascii():
        raise Invalid("an email is ASCII (a domain in its punycode form)")
    folded = email.strip().casefold()
    local, at, domain = folded.rpartition("@")
    if not at or not local or "." not in domain or domain.startswith("."):
        raise Invalid(f"not an email address: {email!r}")
    if not folded.isprintable() or any(c.isspace() for c in folded):
        raise Invalid("an email has no blanks or control characters")
    return folded


def user_id_of(email: str) -> str:
    """The user's id: the same for the same (case-folded) email in every organization."""
    digest = hashlib.sha256(b"rp-user\0" + normal_email(email).encode()).hexdigest()
    return "u-" + digest[:20]


def check_name(name: str, email: str) -> str:
    """A display name (the email's local part when none is given)."""
    name = name.strip() or email.partition("@")[0]
    if len(name) > MAX_NAME or not name.isprintable():
        raise Invalid(f"a user's name is printable and at most {MAX_NAME} characters")
    return name


def invite(members: Mapping[str, Member], cmd: InviteUser, now: datetime) -> UserAdded:
    """Decide an invitation: a new user of the organization (409 if already one)."""
    email = normal_email(cmd.email)
    user_id = user_id_of(email)
    if user_id in members:
        raise AlreadyExists(f"{email} is already a user of this organization ({user_id})")
    name = check_name(cmd.name, email)
    return UserAdded(at=now, actor=cmd.actor, user_id=user_id, email=email, name=name)


def known(members: Mapping[str, Member], user_id: str) -> Member:
    """The member, or NotFound (another organization's users are not found here)."""
    member = members.get(user_id)
    if member is None:
        raise NotFound(f"user {user_id} not found")
    return member


def suspend(members: Mapping[str, Member], cmd: SuspendUser, now: datetime) -> list[MemberEvent]:
    member = known(members, cmd.user_id)
    if not member.active:
        return []  # suspended already: a retried request changes nothing
    if len(cmd.reason) > 500:
        raise Invalid("a reason is at most 500 characters")
    return [UserSuspended(at=now, actor=cmd.actor, user_id=cmd.user_id, reason=cmd.reason)]


def reactivate(
    members: Mapping[str, Member], cmd: ReactivateUser, now: datetime
) -> list[MemberEvent]:
    if known(members, cmd.user_id).active:
        return []
    return [UserReactivated(at=now, actor=cmd.actor, user_id=cmd.user_id)]


def signed_in(
    members: Mapping[str, Member], *, email: str, name: str, issuer: str, subject: str,
    actor: str, now: datetime,
) -> list[MemberEvent]:  # fmt: skip
    """What a single sign-on adds to the people: the user (first time), their identity
    (first time); a suspended user or another identity for the same email is refused."""
    email = normal_email(email)
    user_id = user_id_of(email)
    if not 0 < len(issuer) <= MAX_SUBJECT or not 0 < len(subject) <= MAX_SUBJECT:
        raise Invalid(f"issuer and subject are 1 to {MAX_SUBJECT} characters")
    out: list[MemberEvent] = []
    member = members.get(user_id)
    if member is None:
        name = check_name(name, email)
        out.append(
            UserAdded(at=now, actor=actor, user_id=user_id, email=email, name=name, via="sso")
        )
    elif not member.active:
        raise Suspended(f"{email} is suspended in this organization")
    if member is None or not member.issuer:
        out.append(UserLinked(at=now, actor=actor, user_id=user_id, issuer=issuer, subject=subject))
    elif (member.issuer, member.subject) != (issuer, subject):
        raise IdentityMismatch(
            f"{email} signed in before as another identity (of {member.issuer}): "
            "this organization keeps the first"
        )
    return out


def applied(members: Mapping[str, Member], event: MemberEvent) -> dict[str, Member]:
    """The members after `event`."""
    out = dict(members)
    match event:
        case UserAdded():
            out[event.user_id] = Member(
                user_id=event.user_id, email=event.email, name=event.name, via=event.via
            )
        case UserSuspended():
            out[event.user_id] = msgspec.structs.replace(out[event.user_id], state="suspended")
        case UserReactivated():
            out[event.user_id] = msgspec.structs.replace(out[event.user_id], state="active")
        case UserLinked():
            member = out[event.user_id]
            out[event.user_id] = msgspec.structs.replace(
                member, issuer=event.issuer, subject=event.subject
            )
    return out
