"""Strict JSON: what every body, and every JSON text inside one, is read with.

Python's `json.loads` takes two things a server must not: duplicate keys (the last one wins,
so a gateway that reads the first sees another request than the engine runs) and any nesting
(past ~1000 levels it raises RecursionError, and a few hundred levels inside a field reach
recursion limits later, in pydantic, jinja or json.dumps); and an integer longer than Python
converts (sys.get_int_max_str_digits, a guard against quadratic conversion) raises a bare
ValueError. `loads` refuses all three with a JSONError that names the problem; MAX_DEPTH is far
above what any real body needs (a tool's schema nested ten objects deep is ~25 levels).

`media_type_is_json` is the Content-Type check: a JSON route refuses any other media type
(a 415), so a browser's "simple" cross-site POST (text/plain, form-encoded, multipart), which
needs no CORS preflight, never reaches a route.
"""
from __future__ import annotations

import json
import sys

MAX_DEPTH = 64


class JSONError(ValueError):
    """A JSON text that is not valid, or that a server must not read: the message says why."""


def loads(text: str):
    """`text` decoded, with no duplicate key in any object and at most MAX_DEPTH levels of
    arrays and objects. Raises JSONError. Cost grows with the text: run it off the event loop
    for large ones."""
    try:
        value = json.loads(text, object_pairs_hook=_unique_keys, parse_int=_integer)
    except _TooLong as exc:
        raise JSONError(f"An integer of {exc.digits} digits is longer than this server reads "
                        f"({sys.get_int_max_str_digits()} digits at most).") from None
    except _DuplicateKey as exc:
        raise JSONError(f"The key {exc.key!r} appears twice in one object; send each key once.") from None
    except RecursionError:
        raise _too_deep() from None
    except json.JSONDecodeError as exc:
        raise JSONError(f"Not valid JSON: {exc}") from None
    if depth(value) > MAX_DEPTH:
        raise _too_deep()
    return value


def depth(value) -> int:
    """Levels of arrays and objects in decoded JSON (a scalar: 0), walked without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, level)
        if level > MAX_DEPTH:
            break  # already too deep: nothing below changes the answer
        stack.extend((child, level + 1) for child in children if isinstance(child, (dict, list)))
    return deepest


def media_type_is_json(content_type: str | None) -> bool:
    """`application/json` or a `+json` type such as `application/merge-patch+json`, with or
    without parameters (`; charset=utf-8`)."""
    if not content_type:
        return False
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


class _DuplicateKey(Exception):
    def __init__(self, key: str):
        self.key = key


class _TooLong(Exception):
    def __init__(self, digits: int):
        self.digits = digits


def _integer(text: str) -> int:
    limit = sys.get_int_max_str_digits()
    if limit and len(text.lstrip("-")) > limit:
        raise _TooLong(len(text.lstrip("-")))
    return int(text)


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen = set()
        for key, _ in pairs:
            if key in seen:
                raise _DuplicateKey(key)
            seen.add(key)
    return obj


def _too_deep() -> JSONError:
    return JSONError(f"The JSON is nested more than {MAX_DEPTH} levels deep; this server reads at most {MAX_DEPTH}.")
