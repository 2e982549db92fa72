"""Sizes as people write them (`2GiB`, `512M`, `65536`) and as runplane says them back."""

from __future__ import annotations

import re

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1024,
    "kb": 1000,
    "kib": 1024,
    "m": 1024**2,
    "mb": 1000**2,
    "mib": 1024**2,
    "g": 1024**3,
    "gb": 1000**3,
    "gib": 1024**3,
    "t": 1024**4,
    "tb": 1000**4,
    "tib": 1024**4,
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*")


def parse_size(text: str) -> int:
    """Bytes of `text`: a number with an optional unit (K, M, G, T: powers of 1024, as
    are KiB, MiB...; KB, MB, GB, TB: of 1000). ValueError if it is none."""
    found = _SIZE.fullmatch(str(text))
    unit = found.group(2).lower() if found else ""
    if found is None or unit not in _UNITS:
        raise ValueError(f"{text!r} is not a size (e.g. 2GiB, 512MiB, 1048576)")
    return int(float(found.group(1)) * _UNITS[unit])


def say_size(n: int) -> str:
    """`n` bytes as the largest binary unit that divides it (`2 GiB`, `1536 MiB`)."""
    for unit, size in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} bytes"
