"""`runplane login URL` and `runplane logout [URL]`, and which server and token every
other command uses (services/surfaces/client/credentials.py keeps them)."""

from __future__ import annotations

import argparse
import getpass
import os
import sys

from events.codec import valid_id
from services.surfaces.client import device, output, sso
from services.surfaces.client.credentials import Credentials, Login, describe, normal_url
from services.surfaces.client.errors import ClientError
from services.surfaces.client.http import Api
from services.surfaces.client.output import short

OK = 0


def credentials(server: str) -> tuple[str, str, Login | None]:
    """The server, its token (RUNPLANE_TOKEN, else the stored one) and the stored login
    (None when the token is not the stored one)."""
    creds = Credentials.load()
    url, login = creds.pick(server)
    if not url:
        raise ClientError("not logged in: runplane login URL (or set RUNPLANE_URL)", kind="login")
    env_token = os.environ.get("RUNPLANE_TOKEN", "").strip()
    if env_token:
        return url, env_token, login if login and login.token == env_token else None
    if login is None:
        raise ClientError(
            f"not logged in to {url}: runplane login {url} (or set RUNPLANE_TOKEN)", kind="login"
        )
    return url, login.token, login


def _read_token(ns: argparse.Namespace) -> str:
    if ns.token_stdin:
        token = sys.stdin.readline().strip()
    elif os.environ.get("RUNPLANE_TOKEN", "").strip():
        token = os.environ["RUNPLANE_TOKEN"].strip()
    elif sys.stdin.isatty():
        token = getpass.getpass("Token: ").strip()
    else:
        raise ClientError(
            "no token: pass --token-stdin, set RUNPLANE_TOKEN, or run on a terminal",
            kind="login",
        )
    if not token:
        raise ClientError("the token is empty", kind="login")
    return token


async def login(ns: argparse.Namespace) -> int:
    """Check the token with the server, then store it: a wrong token is never stored.
    With `--sso ORG`, the token is one the browser's sign-in gives
    (services/surfaces/client/sso.py); with `--device --org ORG`, one a browser anywhere
    approves (services/surfaces/client/device.py)."""
    url = normal_url(ns.url)
    if getattr(ns, "sso", ""):
        if not valid_id(ns.sso):
            raise ClientError(f"organization {ns.sso!r} is not a valid name", kind="bad-input")
        if ns.token_stdin:
            raise ClientError("--sso takes no token: the browser's sign-in gives one", kind="login")
        token = await sso.sso_token(url, ns.sso, ca_file=ns.ca_file, browser=not ns.no_browser)
    elif getattr(ns, "device", False):
        org = getattr(ns, "org", "") or ""
        if not valid_id(org):
            raise ClientError(
                "--device needs --org ORG (a valid organization name)", kind="bad-input"
            )
        if ns.token_stdin:
            raise ClientError("--device takes no token: the approval gives one", kind="login")
        token = await device.device_token(url, org, ca_file=ns.ca_file)
    else:
        token = _read_token(ns)
    async with Api(url, token, ca_file=ns.ca_file) as api:
        who = await api.get("/api/v1/whoami")
    if not isinstance(who, dict) or not isinstance(who.get("user"), str):
        raise ClientError(f"bad answer from {url}: not a runplane API", kind="bad-answer")
    org = who.get("org")
    entry = Login(
        token=token,
        user=who["user"],
        role=str(who.get("role", "")),
        org=org if isinstance(org, str) else None,
    )
    creds = Credentials.load()
    creds.add(url, entry)
    creds.save()
    if ns.json:
        output.dump(sys.stdout, {"server": url, **describe(entry)})
    else:
        where = f"in organization {short(entry.org)}" if entry.org else "in every organization"
        print(f"Logged in to {short(url)} as {short(entry.user)} ({short(entry.role)} {where})")
    return OK


def logout(ns: argparse.Namespace) -> int:
    creds = Credentials.load()
    url = normal_url(ns.url) if ns.url else creds.default
    if not url or not creds.remove(url):
        raise ClientError(f"not logged in to {url or 'any server'}", kind="login")
    creds.save()
    print(f"Logged out of {short(url)}")
    return OK
