"""The one way a JSON body from the network is decoded: `decode`.

Every route that reads a JSON body (the HTTP API, the TFE API, Slack's interactions, the
VCS webhook's payloads) decodes it here, so two kinds of body no honest client sends are
refused the same way everywhere, each as that route's bad body, before anything acts:

- nested deeper than MAX_DEPTH arrays and objects. A JSON decoder recurses once per level,
  and msgspec's and the json module's raise RecursionError (an internal error, a 500 with
  a traceback) somewhere below 1000 levels, fewer the deeper the caller's own stack is:
  a body of a few KiB of `[` did that before any authentication. No body runplane takes
  comes near the bound (JSON:API documents, Slack's payloads and GitHub's and GitLab's
  nest at most about 10 deep), and any code that later walks a value is as safe.
- an object naming one key twice (`{"role": "viewer", "role": "admin"}`), at any depth,
  however the key is spelled (`"a"` and `"\\u0061"` are one key). A decoder keeps the last;
  a proxy, a firewall rule or an audit of the raw body may read the first, and the two
  would act on different requests.

Both are checked without recursion, in C passes over the bytes and a Python step per
megabyte (a body may be 96 MiB, on the event loop every organization shares), at a cost
of the order of msgspec's own decoding (from a tenth of it to three times it, on 96 MiB
of the worst shapes for each: nested arrays, empty strings, small objects). The body's
skeleton comes first (`_skeleton`: its brackets, colons and commas outside strings): its
brackets give the depth (`_too_deep`), before msgspec recurses, and its colons count the
keys written, one each. msgspec decodes the body, and the keys its objects hold
(`_kept`) are as many as were written unless one was written twice. `check_depth` is the
depth alone, with another bound, for a document whose keys are not read (a Terraform
state: executor/statestore.py).

Anything else about a body is msgspec's to say, exactly as before: malformed JSON raises
msgspec.DecodeError, a value of the wrong shape msgspec.ValidationError (a subclass),
with msgspec's own messages. A good body decodes to what msgspec alone decodes it to.
"""

from __future__ import annotations

from itertools import accumulate
from typing import Any, TypeVar, overload

import msgspec

T = TypeVar("T")

MAX_DEPTH = 64  # arrays and objects inside one another; `[]` is 1, `{"a": []}` 2

_MARKS = bytes(sorted(set(range(256)) - set(b'[]{}:,"')))  # dropped: all but these
_NESTING = bytes.maketrans(b"[{]}", b"(())")  # each kind of bracket as one, each way
_SIGNS = bytes.maketrans(b"()", b"\x01\xff")  # +1 and -1 as signed bytes
_CHUNK = 1 << 20  # bytes taken at a time where a step may make an object per piece
_PASSES = 4  # most of a body's brackets are its innermost pairs: drop them first
_WALK = 16 * 1024  # skeleton bytes (about as many values) walked, not encoded again


class BodyError(ValueError):
    """A JSON body refused whatever it says; its text says why, for the answer."""


class TooDeep(BodyError):
    """Arrays and objects nest deeper than the bound."""


class DuplicateKey(BodyError):
    """An object names a key more than once."""


@overload
def decode(raw: bytes) -> Any: ...


@overload
def decode(raw: bytes, kind: type[T]) -> T: ...


def decode(raw: bytes, kind: Any = None) -> Any:
    """`raw` decoded by msgspec (into `kind` if given), once it nests no deeper than
    MAX_DEPTH (else TooDeep) and no object repeats a key (else DuplicateKey). Malformed
    JSON and a wrong shape raise msgspec's errors, as msgspec alone does."""
    skeleton = _skeleton(raw)
    if _too_deep(skeleton, MAX_DEPTH):
        raise TooDeep(f"the body nests arrays and objects deeper than {MAX_DEPTH} levels")
    value = msgspec.json.decode(raw)
    written = skeleton.count(b":")
    if written > 1 and _kept(value, len(skeleton)) != written:
        raise DuplicateKey("an object in the body names the same key more than once")
    return value if kind is None else msgspec.json.decode(raw, type=kind)


def check_depth(raw: bytes, bound: int) -> None:
    """TooDeep if `raw` nests arrays and objects deeper than `bound`: a decoder of what
    passes recurses at most `bound` levels, whether it is JSON or not (`_too_deep`)."""
    if _too_deep(_skeleton(raw), bound):
        raise TooDeep(f"the document nests arrays and objects deeper than {bound} levels")


def _skeleton(raw: bytes) -> bytes:
    """The brackets, colons and commas of `raw` outside its strings. Escaped backslashes
    and quotes go first (`\\\\`, then `\\"`), so that every quote left opens or closes a
    string; all but those marks and the quotes go next (a string's text with them); then
    what is between quotes, split a chunk at a time (a piece is an object). Of valid
    JSON this is one colon per key written, and a bracket per array or object; of
    anything else, whatever it holds is refused one way or another."""
    bare = raw.replace(b"\\\\", b"").replace(b'\\"', b"") if b"\\" in raw else raw
    marks = bare.translate(None, _MARKS)
    kept = []
    inside = 0  # whether the chunk starts inside a string
    for start in range(0, len(marks), _CHUNK):
        pieces = marks[start : start + _CHUNK].split(b'"')
        kept.append(b"".join(pieces[inside::2]))
        inside = (inside + len(pieces) - 1) % 2
    return b"".join(kept)


def _too_deep(skeleton: bytes, bound: int) -> bool:
    """Whether the brackets of `skeleton` nest deeper than `bound`, or leave more than
    `bound` open (a body cut short that deep). The innermost pairs, `()`, go first, a
    level a pass, while a pass halves what is left; then the depth is counted bracket by
    bracket, a megabyte at a time (a pass drops a level of every nest it touches: what
    is left is as many levels shallower). Of valid JSON this is exact; of a body that is
    not, its part before the first fault is counted exactly, so a decoder, which stops
    there, never goes deeper than `bound` either."""
    nest = skeleton.translate(_NESTING, b":,")
    if nest.count(b"(") <= bound:
        return False
    if b"(" * (bound + 1) in nest:
        return True
    passes = 0
    while nest and passes < _PASSES:
        inner = nest.replace(b"()", b"")
        passes += 1  # every pair left encloses one more level than it shows
        halved = 2 * len(inner) <= len(nest)
        nest = inner
        if not halved:
            break
    depth = 0
    for start in range(0, len(nest), _CHUNK):
        chunk = nest[start : start + _CHUNK]
        levels = accumulate(memoryview(chunk.translate(_SIGNS)).cast("b"), initial=depth)
        if max(levels) + passes > bound:
            return True
        depth += 2 * chunk.count(b"(") - len(chunk)
    return False


def _kept(value: Any, skeleton_size: int) -> int:
    """How many keys the objects of `value` hold. A value of few numbers, objects and
    arrays besides its strings (a short skeleton: no more values than its bytes) is
    walked; a larger one is encoded again and its colons counted, in C."""
    if skeleton_size > _WALK:
        return _skeleton(msgspec.json.encode(value)).count(b":")
    keys, todo = 0, [value]
    while todo:
        item = todo.pop()
        if isinstance(item, dict):
            keys += len(item)
            todo.extend(item.values())
        elif isinstance(item, list):
            todo.extend(item)
    return keys


class DepthGauge:
    """`check_depth` of a document read a chunk at a time (a Terraform state received
    into a file: executor/statefile.py), never holding more than a chunk of it.

    Each chunk's skeleton is judged with the levels left open before it in front (as
    many `[`); a run of backslashes at a chunk's end goes on to the next chunk as its
    parity (pairs escape each other), and whether the chunk ends inside a string goes
    on too, so that the chunks' skeletons are the document's. At a chunk's edge a nest
    may count a few levels more than it has (`_too_deep`'s passes): never fewer."""

    def __init__(self, bound: int) -> None:
        self.bound = bound
        self.depth = 0
        self.keys = 0  # colons outside strings: the keys written
        self.marks = 0  # brackets, colons and commas outside strings: about the values
        self._carry = b""
        self._inside = 0

    def feed(self, chunk: bytes, *, last: bool = False) -> None:
        """Judge the next chunk; TooDeep past the bound."""
        data = self._carry + chunk
        self._carry = b""
        if not last:
            stripped = data.rstrip(b"\\")
            run = len(data) - len(stripped)
            data, self._carry = stripped, b"\\" * (run % 2)
        bare = data.replace(b"\\\\", b"").replace(b'\\"', b"") if b"\\" in data else data
        pieces = bare.translate(None, _MARKS).split(b'"')
        skeleton = b"".join(pieces[self._inside :: 2])
        self._inside = (self._inside + len(pieces) - 1) % 2
        if _too_deep(b"[" * self.depth + skeleton, self.bound):
            raise TooDeep(f"the document nests arrays and objects deeper than {self.bound} levels")
        self.keys += skeleton.count(b":")
        self.marks += len(skeleton)
        opened = skeleton.count(b"[") + skeleton.count(b"{")
        self.depth = max(0, self.depth + opened - skeleton.count(b"]") - skeleton.count(b"}"))
