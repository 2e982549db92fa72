"""infra/jsonbody.py, the one decoder of JSON bodies: what nests deeper than MAX_DEPTH or
names a key twice is refused, however it is written (strings holding brackets, quotes
and colons; escapes; a key spelled two ways); anything else decodes to exactly what
msgspec decodes it to, with msgspec's own errors. Its tests over HTTP, route by route:
tests/test_body_reader.py."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any
from unittest import mock

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from infra import jsonbody
from infra.jsonbody import MAX_DEPTH, DuplicateKey, TooDeep


def _arrays(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def _objects(depth: int) -> bytes:
    return b'{"a":' * depth + b"1" + b"}" * depth


# 64 levels, an empty array beside the top one: no 65 brackets ever open in a row, and
# its innermost pairs go last, after the bound's passes
_TALL = b"[[]," + b"[" * 63 + b"0" + b"]" * 63 + b"]"


def test_the_bound_is_64_levels_of_arrays_and_objects_alike() -> None:
    assert MAX_DEPTH == 64
    for nested in (_arrays, _objects):
        assert jsonbody.decode(nested(MAX_DEPTH)) == msgspec.json.decode(nested(MAX_DEPTH))
        with pytest.raises(TooDeep, match="deeper than 64 levels"):
            jsonbody.decode(nested(MAX_DEPTH + 1))
    mixed = b'{"a":[' * 32 + b"0" + b"]}" * 32
    assert jsonbody.decode(mixed) == msgspec.json.decode(mixed)
    with pytest.raises(TooDeep):
        jsonbody.decode(b"[" + mixed + b"]")


@pytest.mark.parametrize(
    "body",
    [
        b"[" * 100_000,  # the review's: cut short, never closed
        _arrays(100_000),
        _objects(100_000),
        b"[1," * 100_000,
        b"[[]," * 100_000,  # each level beside an empty one: no run of brackets in the text
        b'{"a":"[{",' + b'"b":[' * 100,
        (b"[" + _TALL + b",") * (MAX_DEPTH + 1),  # cut short: 65 left open, never in a row
    ],
)
def test_a_deep_body_is_refused_before_a_decoder_recurses(body: bytes) -> None:
    """msgspec alone raised RecursionError (a 500) on each."""
    with pytest.raises(TooDeep):
        jsonbody.decode(body)


def _at_depth(frames: int, work: Callable[[], Any]) -> Any:
    return work() if frames <= 0 else _at_depth(frames - 1, work)


def _stack() -> int:
    frame, frames = sys._getframe(), 0
    while frame is not None:
        frame, frames = frame.f_back, frames + 1  # type: ignore[assignment]  # None ends it
    return frames


def test_the_bound_holds_however_deep_the_caller_already_is() -> None:
    """msgspec's limit is what is left of the interpreter's (a level a frame): a caller
    with little more than MAX_DEPTH frames left still decodes what the bound allows, and
    refuses the rest without a RecursionError."""
    frames = sys.getrecursionlimit() - _stack() - MAX_DEPTH - 16
    allowed = _arrays(MAX_DEPTH)
    assert _at_depth(frames, lambda: jsonbody.decode(allowed)) == msgspec.json.decode(allowed)
    with pytest.raises(TooDeep):
        _at_depth(frames, lambda: jsonbody.decode(b"[" * 100_000))


def test_the_depth_alone_takes_its_own_bound_and_reads_no_keys() -> None:
    """`check_depth`, for a document that is not a request's body (a state): its bound,
    and a key written twice is not its concern."""
    jsonbody.check_depth(_arrays(512), 512)
    jsonbody.check_depth(b'{"a": 1, "a": 2}', 1)
    with pytest.raises(TooDeep, match="deeper than 512 levels"):
        jsonbody.check_depth(_objects(513), 512)
    with pytest.raises(TooDeep):
        jsonbody.check_depth(b"[" * 100_000, 512)


@pytest.mark.parametrize(
    "body",
    [
        b'"' + b"[" * 1000 + b'"',
        b'["' + b"{" * 1000 + b'", 1]',
        b'["\\"' + b"[" * 1000 + b'\\"", "\\\\", "]"]',
        b'{"[[[[": "\\\\\\"{{{{", "b": [' + b'"[",' * 1000 + b'"]"]}',
    ],
)
def test_brackets_inside_strings_are_no_nesting(body: bytes) -> None:
    assert jsonbody.decode(body) == msgspec.json.decode(body)


@pytest.mark.parametrize(
    "body",
    [
        b'{"role": "viewer", "role": "admin"}',
        b'{"a": 1, "\\u0061": 2}',  # one key, spelled two ways
        b'{"x": [{"ok": 1}, {"b": 1, "c": {"d": 1, "d": 1}}]}',
        b'[1, {"k\\"": 1, "k\\"": 2}]',
        b'{"a": {"b": 1}, "a": {"b": 1}}',
    ],
)
def test_a_key_named_twice_in_one_object_is_refused_at_any_depth(body: bytes) -> None:
    """msgspec alone kept the last of them."""
    with pytest.raises(DuplicateKey):
        jsonbody.decode(body)


@pytest.mark.parametrize(
    "body",
    [
        b'[{"a": 1}, {"a": 2}]',
        b'{"a": {"a": {"a": 1}}}',
        b'{"a:b": 1, "a": "x:y", "c": ":", "d": "\\":"}',
        b'{"a": 1, "A": 2, "a ": 3}',
    ],
)
def test_the_same_key_in_other_objects_or_colons_in_strings_are_no_repeat(body: bytes) -> None:
    assert jsonbody.decode(body) == msgspec.json.decode(body)


@pytest.mark.parametrize("body", [b"{not json", b"", b"[1, 2", b'{"a": 1,}', b"nul", b"[1] 2"])
def test_malformed_json_is_msgspecs_error_as_before(body: bytes) -> None:
    with pytest.raises(msgspec.DecodeError) as expected:
        msgspec.json.decode(body)
    with pytest.raises(msgspec.DecodeError) as seen:
        jsonbody.decode(body)
    assert str(seen.value) == str(expected.value)
    assert not isinstance(seen.value, jsonbody.BodyError)


class _Body(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    tags: dict[str, str] = {}


@pytest.mark.parametrize(
    "body", [b'{"name": 3}', b'{"name": "x", "tags": {"a": 1}}', b'{"nom": "x"}', b"[]"]
)
def test_a_wrong_shape_is_msgspecs_validation_error_as_before(body: bytes) -> None:
    with pytest.raises(msgspec.ValidationError) as expected:
        msgspec.json.decode(body, type=_Body)
    with pytest.raises(msgspec.ValidationError) as seen:
        jsonbody.decode(body, _Body)
    assert str(seen.value) == str(expected.value)


def test_a_good_body_decodes_into_its_type() -> None:
    body = b'{"name": "x", "tags": {"a": "b"}}'
    assert jsonbody.decode(body, _Body) == _Body(name="x", tags={"a": "b"})
    assert jsonbody.decode(body, dict[str, Any]) == {"name": "x", "tags": {"a": "b"}}


# ---------------------------------------------------------------- every body


@contextmanager
def _small_pieces() -> Iterator[None]:
    """The paths of big bodies taken by small ones: strings split and depth counted a
    few bytes at a time, after one pass at most, values counted by encoding them again."""
    with (
        mock.patch.object(jsonbody, "_CHUNK", 3),
        mock.patch.object(jsonbody, "_PASSES", 1),
        mock.patch.object(jsonbody, "_WALK", 0),
    ):
        yield


_TEXT = st.text(st.characters(codec="utf-8"), max_size=8) | st.sampled_from(
    ['"', "\\", '\\"', "[", "{", ":", "]}", '":', "\\\\", "\u2028", "\x00"]
)
_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | _TEXT
)
# A tree as written: an object is its pairs in order, so a key may come twice.
_TREES = st.recursive(
    _SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4).map(lambda v: ("array", v))
        | st.lists(st.tuples(_TEXT, inner), max_size=4).map(lambda v: ("object", v))
    ),
    max_leaves=20,
)


def _write(tree: Any, *, ascii_only: bool, spaced: bool) -> str:
    """`tree` as JSON text, strings escaped as json.dumps escapes them."""
    gap = " " if spaced else ""
    if isinstance(tree, tuple) and tree[0] == "array":
        return (
            "["
            + f",{gap}".join(_write(v, ascii_only=ascii_only, spaced=spaced) for v in tree[1])
            + "]"
        )
    if isinstance(tree, tuple):
        pairs = (
            json.dumps(k, ensure_ascii=ascii_only)
            + f":{gap}"
            + _write(v, ascii_only=ascii_only, spaced=spaced)
            for k, v in tree[1]
        )
        return "{" + f",{gap}".join(pairs) + "}"
    return json.dumps(tree, ensure_ascii=ascii_only)


def _repeats(tree: Any) -> bool:
    if isinstance(tree, tuple) and tree[0] == "array":
        return any(_repeats(v) for v in tree[1])
    if isinstance(tree, tuple):
        keys = [k for k, _ in tree[1]]
        return len(set(keys)) < len(keys) or any(_repeats(v) for _, v in tree[1])
    return False


@pytest.mark.parametrize("pieces", ["whole", "small"])
@settings(max_examples=300, deadline=None)
@given(tree=_TREES, ascii_only=st.booleans(), spaced=st.booleans())
def test_a_body_is_refused_exactly_when_an_object_repeats_a_key(
    pieces: str, tree: Any, ascii_only: bool, spaced: bool
) -> None:
    """However its strings are written, a body decodes to msgspec's value unless an
    object in it names a key twice, and is refused if one does."""
    body = _write(tree, ascii_only=ascii_only, spaced=spaced).encode()
    with _small_pieces() if pieces == "small" else nullcontext():
        if _repeats(tree):
            with pytest.raises(DuplicateKey):
                jsonbody.decode(body)
        else:
            assert jsonbody.decode(body) == msgspec.json.decode(body)


# What goes first in each level, and how deep it nests itself.
FILLERS = {"": 0, '"[{",': 0, "1,": 0, "[],": 1, '{"a":[]},': 2}


def _levels(arrays: int, filler: str) -> tuple[bytes, int]:
    """`arrays` arrays, `filler` first in each (an empty array beside each level keeps
    the text from showing the levels' brackets in a row), and how deep that nests."""
    body = ("[" + filler) * arrays + "0" + "]" * arrays
    return body.encode(), arrays + FILLERS[filler] * (arrays > 0)


def _refused_exactly_past_the_bound(body: bytes, depth: int) -> None:
    if depth > MAX_DEPTH:
        with pytest.raises(TooDeep):
            jsonbody.decode(body)
    else:
        assert jsonbody.decode(body) == msgspec.json.decode(body)


@pytest.mark.parametrize("filler", FILLERS)
@pytest.mark.parametrize("pieces", ["whole", "small"])
def test_one_level_past_the_bound_is_refused_however_the_levels_are_spaced(
    pieces: str, filler: str
) -> None:
    with _small_pieces() if pieces == "small" else nullcontext():
        for depth in (MAX_DEPTH, MAX_DEPTH + 1):
            _refused_exactly_past_the_bound(*_levels(depth - FILLERS[filler], filler))
            # an empty array beside the levels halfway down: MAX_DEPTH + 1 brackets never
            # open in a row, yet a pair is left around the others after MAX_DEPTH passes
            half = depth // 2
            inner, below = _levels(depth - half - FILLERS[filler], filler)
            body = b"[" * half + b"[]," + inner + b"]" * half
            _refused_exactly_past_the_bound(body, half + below)


@pytest.mark.parametrize("pieces", ["whole", "small"])
@settings(max_examples=200, deadline=None)
@given(arrays=st.integers(1, 3 * MAX_DEPTH), filler=st.sampled_from(sorted(FILLERS)))
def test_a_body_is_refused_exactly_when_it_nests_past_the_bound(
    pieces: str, arrays: int, filler: str
) -> None:
    with _small_pieces() if pieces == "small" else nullcontext():
        _refused_exactly_past_the_bound(*_levels(arrays, filler))
