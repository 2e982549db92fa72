"""The body of `POST /workspaces/:id/state-versions`, read without holding it: the CLI
sends the state inline, base64 in a JSON:API document (up to 4/3 of the state, and newer
clients add `json-state` and `json-state-outputs` of about its size each).

The document is written to a file as it arrives (bounded: `document_limit`), judged
there as every JSON body is (infra/jsonbody.py: nesting past MAX_DEPTH and a key named
twice are refused, here a chunk at a time), and decoded from a read-only map of the file
into its few small values, a long string left where it is (`msgspec.Raw`, a view of the
map). The `state` is then decoded from base64 a chunk at a time into a file of its own
(executor/statefile.py), its md5 taken on the way: nothing here holds more than a chunk.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import mmap
from pathlib import Path
from typing import Any

import msgspec

from executor.statefile import NotAState, StateFile, StateRefused, StateTooLarge
from infra import jsonbody
from services.surfaces.tfe.jsonapi import TfeError, attributes

_SMALL = 64 * 1024  # a value this long or shorter is decoded; a longer string is not
_VALUES = 10_000  # keys, items and brackets a state version's document may hold
_STATE_CHUNK = 4 * 256 * 1024  # base64 characters decoded at a time (a multiple of 4)


def document_limit(state_max: int) -> int:
    """The bytes a document may have: the state in base64 and two JSON renderings of
    about its size, and the envelope."""
    return 3 * (4 * state_max // 3 + 4) + 1024 * 1024


def tfe_refusal(e: StateRefused) -> TfeError:
    """A state refused, as the TFE API answers it (its title is the refusal's kind)."""
    return TfeError(e.status if e.status != 400 else 422, e.kind.replace("-", " "), str(e))


async def read_state(document: StateFile, folder: Path, state_max: int) -> tuple[StateFile, Any]:
    """The state a document carries, in a file (0600, in `folder`), and its attributes
    (the state's own one left out). TfeError for a body that is not a good document."""
    return await asyncio.to_thread(_read_state, document, folder, state_max)


def _read_state(document: StateFile, folder: Path, state_max: int) -> tuple[StateFile, Any]:
    written = _judge(document)
    with document.open() as f:
        # Not closed here: views of it (msgspec.Raw) may live on in an error's traceback;
        # it goes with the last of them.
        view = memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
    try:
        tree = _tree(view)
    except msgspec.DecodeError as e:
        raise TfeError(422, "invalid body", f"the body is not JSON: {e}") from e
    if _keys(tree) != written:
        raise TfeError(
            422, "invalid body", "an object in the body names the same key more than once"
        )
    attrs = attributes(tree, "state-versions")
    state = _decode(attrs.get("state"), folder, state_max)
    # What else the CLI sent that is long (`json-state`, ...) runplane does not read.
    return state, {k: v for k, v in attrs.items() if not isinstance(v, msgspec.Raw)}


def _judge(document: StateFile) -> int:
    """Nesting (jsonbody.MAX_DEPTH) and how many values the document holds, a chunk at
    a time; the keys written in it."""
    gauge = jsonbody.DepthGauge(jsonbody.MAX_DEPTH)
    try:
        with document.open() as f:
            while chunk := f.read(1024 * 1024):
                gauge.feed(chunk, last=f.tell() >= document.size)
                if gauge.marks > _VALUES:
                    raise TfeError(
                        422, "invalid body", "a state version's document holds a few values only"
                    )
    except jsonbody.TooDeep as e:
        raise TfeError(422, "invalid body", str(e)) from e
    return gauge.keys


def _tree(raw: memoryview) -> Any:
    """The value `raw` holds, its objects and arrays walked; a long string is left as
    `msgspec.Raw` (a view of `raw`, never copied)."""
    if len(raw) <= _SMALL:
        return msgspec.json.decode(raw)
    first = raw[:1].tobytes()
    if first == b"{":
        items = msgspec.json.decode(raw, type=dict[str, msgspec.Raw])
        return {k: _tree(memoryview(v)) for k, v in items.items()}
    if first == b"[":
        return [_tree(memoryview(v)) for v in msgspec.json.decode(raw, type=list[msgspec.Raw])]
    return msgspec.Raw(raw)


def _keys(value: Any) -> int:
    """How many keys the objects of `value` hold."""
    if isinstance(value, dict):
        return len(value) + sum(_keys(v) for v in value.values())
    if isinstance(value, list):
        return sum(_keys(v) for v in value)
    return 0


def _decode(state: Any, folder: Path, state_max: int) -> StateFile:
    """The base64 `state` (a short str, or a long string's raw JSON) in a file."""
    if state is None:
        # go-tfe (>= 1.x) reads this very phrase as "upload URLs not supported" and the
        # CLI then sends the state inline
        raise TfeError(
            422,
            "state required",
            "param is missing or the value is empty: state (send it inline, base64: "
            "this server does not hand out state upload URLs yet)",
        )
    if isinstance(state, str):
        state = msgspec.Raw(msgspec.json.encode(state))
    raw = memoryview(state) if isinstance(state, msgspec.Raw) else None
    if raw is None or len(raw) < 2 or raw[:1].tobytes() != b'"' or raw[-1:].tobytes() != b'"':
        raise TfeError(422, "invalid attribute", "state must be a base64 string")
    out = StateFile.create(folder, state_max)
    try:
        _unbase64(raw[1:-1], out)
        out.close()
    except StateTooLarge as e:
        out.discard()
        raise tfe_refusal(e) from e
    except (binascii.Error, ValueError) as e:
        out.discard()
        raise TfeError(422, "invalid attribute", "state is not valid base64") from e
    except BaseException:
        out.discard()
        raise
    if out.size == 0:
        out.discard()
        raise tfe_refusal(NotAState("not a Terraform state: the state is empty"))
    return out


def _unbase64(text: memoryview, out: StateFile) -> None:
    """Decode base64 `text` (a JSON string's inside: `\\/` is `/`, no other escape is
    base64) into `out`, a chunk at a time."""
    rest = b""
    for start in range(0, len(text), _STATE_CHUNK):
        piece = rest + text[start : start + _STATE_CHUNK].tobytes()
        if piece.endswith(b"\\") and start + _STATE_CHUNK < len(text):
            piece, rest = piece[:-1], b"\\"
        else:
            rest = b""
        piece = piece.replace(b"\\/", b"/")
        if b"\\" in piece:
            raise ValueError("an escape in base64")
        whole = len(piece) - len(piece) % 4 if start + _STATE_CHUNK < len(text) else len(piece)
        piece, rest = piece[:whole], piece[whole:] + rest
        out.write(base64.b64decode(piece, validate=True))
    if rest:
        raise ValueError("base64 cut short")
