"""User names: the `user` of a token, a group's members, an approver. Pure.

A user name is shown in events, answers, logs and the UI, and compared as is: it must be
printable (no control or format characters, no line or paragraph separators, no other
blank than the plain space) and carry no surrounding blanks, so what a person reads is
what the code compares. Token creation, groups and anything else that accepts a user
name call `user_problem` / `check_user`.
"""

from __future__ import annotations

from events.errors import Invalid

MAX_USER = 200  # the longest user name a token may carry


def user_problem(name: object) -> str:
    """Why `name` is not a valid user name, or ""."""
    if not isinstance(name, str) or not 0 < len(name) <= MAX_USER:
        return f"a user name is 1 to {MAX_USER} characters"
    if not name.isprintable():
        return "a user name is printable: no control characters, line breaks or tabs"
    if name != name.strip():
        return "a user name has no blanks at its start or end"
    return ""


def check_user(name: str) -> str:
    """`name`, or Invalid naming it and what is wrong with it."""
    problem = user_problem(name)
    if problem:
        raise Invalid(f"{problem}; got {name!r}")
    return name
