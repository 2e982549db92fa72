"""Single sign-on: an organization's OpenID Connect configuration. Pure.

One aggregate per organization on `rp.org.<org>.sso` (`config_subject`; the stream takes
`rp.org.>`, and the organization's own subject does not grow with it): the issuer, the
client id, the email domains allowed to sign in, the claim that carries a person's groups
and the rules from a group to a team (identity applies them at each sign-in). The client
secret is sealed apart (services/app/sso.py): an event says only that it changed.

Every rule here is a check of what an organization's admin, who may be hostile, writes:
an issuer is `https://` (or `http://` on a loopback host, for a provider on the same
machine), with no credentials, query or fragment; names are short and printable.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import assert_never
from urllib.parse import urlsplit

import msgspec

from events.base import Command, Event
from events.errors import Invalid, NotFound

MAX_ISSUER = 512
MAX_DOMAINS = 50
MAX_RULES = 200
MAX_GROUP = 256
DEFAULT_GROUPS_CLAIM = "groups"
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
CLIENT_ID_RE = re.compile(r"^[\x21-\x7e]{1,255}$")  # printable ASCII, no blank
CLAIM_RE = re.compile(r"^[A-Za-z0-9_:./-]{1,64}$")
DOMAIN_RE = re.compile(r"^(?=.{1,253}$)([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?\.)+[a-z]{2,63}$")
TEAM_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")


def config_subject(org: str) -> str:
    return f"rp.org.{org}.sso"


class GroupRule(msgspec.Struct, frozen=True, kw_only=True):
    """Members of the identity provider's `group` are members of runplane's `team`."""

    group: str
    team: str


# ---------------------------------------------------------------- events


class SsoConfigured(Event, frozen=True, kw_only=True, tag="org.sso_configured"):
    """The organization's identity provider as its admin (`actor`) set it. Never the
    client secret: `secret_changed` says a new one was sealed with this change."""

    issuer: str
    client_id: str
    display_name: str = ""
    allowed_domains: list[str] = []
    groups_claim: str = DEFAULT_GROUPS_CLAIM
    group_rules: list[GroupRule] = []
    secret_changed: bool = False
    # refuse an ID token without `email_verified: true` (events of before: False, which
    # refuses only an explicit false)
    require_email_verified: bool = False


class SsoRemoved(Event, frozen=True, kw_only=True, tag="org.sso_removed"):
    """Single sign-on was turned off for the organization (its secret purged)."""


SsoEvent = SsoConfigured | SsoRemoved


# ---------------------------------------------------------------- commands and state


class ConfigureSso(Command, frozen=True, kw_only=True):
    issuer: str
    client_id: str
    display_name: str = ""
    allowed_domains: list[str] = []
    groups_claim: str = DEFAULT_GROUPS_CLAIM
    group_rules: list[GroupRule] = []
    secret_changed: bool = False
    require_email_verified: bool = False


class RemoveSso(Command, frozen=True, kw_only=True):
    pass


SsoCommand = ConfigureSso | RemoveSso


class SsoState(msgspec.Struct, frozen=True, kw_only=True):
    issuer: str = ""  # "": single sign-on is off
    client_id: str = ""
    display_name: str = ""
    allowed_domains: list[str] = []
    groups_claim: str = DEFAULT_GROUPS_CLAIM
    group_rules: list[GroupRule] = []
    require_email_verified: bool = False
    configured_at: datetime | None = None
    configured_by: str = ""
    version: int = 0

    @property
    def configured(self) -> bool:
        return bool(self.issuer)

    @property
    def label(self) -> str:
        """What the sign-in button names: the display name, else the issuer's host."""
        return self.display_name or (urlsplit(self.issuer).hostname or self.issuer)


INITIAL = SsoState()


def evolve(state: SsoState, event: SsoEvent) -> SsoState:
    s = msgspec.structs.replace(state, version=state.version + 1)
    match event:
        case SsoConfigured():
            return msgspec.structs.replace(
                s,
                issuer=event.issuer,
                client_id=event.client_id,
                display_name=event.display_name,
                allowed_domains=list(event.allowed_domains),
                groups_claim=event.groups_claim,
                group_rules=list(event.group_rules),
                require_email_verified=event.require_email_verified,
                configured_at=event.at,
                configured_by=event.actor,
            )
        case SsoRemoved():
            return msgspec.structs.replace(INITIAL, version=s.version)
        case _:
            assert_never(event)


def fold(events: Sequence[SsoEvent], state: SsoState = INITIAL) -> SsoState:
    for e in events:
        state = evolve(state, e)
    return state


def decide(
    state: SsoState, command: SsoCommand, *, now: datetime, new_id: Callable[[], str]
) -> list[SsoEvent]:
    """The events of a command on the organization's single sign-on (the shell checks the
    organization exists). A configuration that changes nothing records nothing."""
    match command:
        case ConfigureSso():
            check_configuration(command)
            event = SsoConfigured(
                at=now,
                actor=command.actor,
                issuer=command.issuer,
                client_id=command.client_id,
                display_name=command.display_name,
                allowed_domains=sorted(set(command.allowed_domains)),
                groups_claim=command.groups_claim,
                group_rules=command.group_rules,
                secret_changed=command.secret_changed,
                require_email_verified=command.require_email_verified,
            )
            if not command.secret_changed and _same(state, event):
                return []
            return [event]
        case RemoveSso():
            if not state.configured:
                raise NotFound("the organization has no single sign-on")
            return [SsoRemoved(at=now, actor=command.actor)]
        case _:
            assert_never(command)


def _same(state: SsoState, e: SsoConfigured) -> bool:
    return (
        state.issuer,
        state.client_id,
        state.display_name,
        state.allowed_domains,
        state.groups_claim,
        state.group_rules,
        state.require_email_verified,
    ) == (
        e.issuer,
        e.client_id,
        e.display_name,
        e.allowed_domains,
        e.groups_claim,
        e.group_rules,
        e.require_email_verified,
    )


# ---------------------------------------------------------------- the checks


def issuer_problem(issuer: str) -> str:
    """Why `issuer` cannot be an organization's issuer, or ""."""
    if not 0 < len(issuer) <= MAX_ISSUER or not issuer.isprintable() or " " in issuer:
        return f"an issuer is a URL of 1 to {MAX_ISSUER} printable characters"
    try:
        parts = urlsplit(issuer)
        _ = parts.port  # a port that is no number raises
    except ValueError:
        return "the issuer is not a URL"
    if parts.scheme not in ("https", "http") or not parts.hostname:
        return "the issuer is an https:// URL"
    if parts.scheme == "http" and parts.hostname not in LOOPBACK_HOSTS:
        return "the issuer is an https:// URL (http:// only on a loopback host)"
    if parts.username is not None or parts.password is not None:
        return "the issuer carries no credentials"
    if parts.query or parts.fragment or "?" in issuer or "#" in issuer:
        return "the issuer has no query or fragment"
    return ""


def check_configuration(c: ConfigureSso) -> None:
    """Invalid naming the first field that breaks a rule."""
    checks: list[tuple[bool, str]] = [
        (not issuer_problem(c.issuer), issuer_problem(c.issuer)),
        (bool(CLIENT_ID_RE.fullmatch(c.client_id)), "client_id is 1 to 255 printable ASCII"),
        (
            len(c.display_name) <= 64 and c.display_name.isprintable(),
            "display_name is at most 64 printable characters",
        ),
        (bool(CLAIM_RE.fullmatch(c.groups_claim)), "groups_claim is 1 to 64 of [A-Za-z0-9_:./-]"),
        (len(c.allowed_domains) <= MAX_DOMAINS, f"at most {MAX_DOMAINS} allowed_domains"),
        (len(c.group_rules) <= MAX_RULES, f"at most {MAX_RULES} group_rules"),
    ]
    for ok, why in checks:
        if not ok:
            raise Invalid(why)
    for domain in c.allowed_domains:
        if not DOMAIN_RE.fullmatch(domain):
            raise Invalid(f"allowed_domains: {domain[:64]!r} is no lower-case domain name")
    for rule in c.group_rules:
        if not (0 < len(rule.group) <= MAX_GROUP and rule.group.isprintable()):
            raise Invalid(f"group_rules: a group is 1 to {MAX_GROUP} printable characters")
        if not TEAM_RE.fullmatch(rule.team):
            raise Invalid(f"group_rules: team {rule.team[:64]!r} is no team name ([a-z0-9-])")


def email_unverified(claims: Mapping[str, object], *, required: bool) -> bool:
    """Whether an ID token's `email_verified` refuses its sign-in: false (the boolean, or
    the string "false" some providers send) always; missing (many providers leave it
    out) or anything but true only when the configuration `required` it."""
    verified = claims.get("email_verified")
    if isinstance(verified, str):
        verified = {"true": True, "false": False}.get(verified.strip().lower(), verified)
    if verified is False:
        return True
    return required and verified is not True


def email_allowed(email: str, domains: Sequence[str]) -> bool:
    """Whether `email`'s domain is one of `domains` (exactly: no subdomain, case folded);
    any domain when `domains` is empty."""
    local, at, domain = email.rpartition("@")
    if not (local and at and domain):
        return False
    return not domains or domain.lower() in domains
