"""Field checks shared by the message types and the decoder: one place decides what a valid value is."""

from __future__ import annotations

from collections.abc import Collection, Iterable
from enum import StrEnum
from typing import Any, TypeGuard, TypeVar

import numpy as np

from schemas.errors import ErrorCode, SchemaError

Input = str | tuple[int, ...]
_E = TypeVar("_E", bound=StrEnum)

MAX_REQUEST_ID_CHARS = 256
TOKEN_ID_LIMIT = 2**31
# Deep enough for any sensible metadata, shallow enough that msgpack's packer (limit 511) and Python's
# recursion never trip on a value we accepted.
MAX_METADATA_DEPTH = 64
_INT_MIN, _INT_LIMIT = -(2**63), 2**64  # msgpack's integer range
PLAIN_INT_TYPES = frozenset({int})
PLAIN_FLOAT_TYPES = frozenset({float})  # bool and numpy scalars are other types


def invalid(message: str) -> SchemaError:
    """An INVALID_REQUEST error (also used for invalid result fields: the code means "a field is wrong")."""
    return SchemaError(ErrorCode.INVALID_REQUEST, message)


def quoted(value: object, limit: int = 64) -> str:
    """repr() of a value for an error sentence, cut to `limit` characters: messages quote user input, and a
    200 KB string echoed back would make the error result itself too large to publish."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 5]}...{text[-2:]}"


def describe(value: object) -> str:
    """The msgpack name of a value's type, for error sentences a non-Python producer understands."""
    if value is None:
        return "nil"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | np.integer):
        return "an integer"
    if isinstance(value, float):
        return "a float"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, bytes | bytearray | memoryview):
        return "binary"
    if isinstance(value, list | tuple):
        return "an array"
    if isinstance(value, dict):
        return "a map"
    return f"a Python {type(value).__name__}"


def is_valid_request_id(value: object) -> bool:
    """Whether a value can serve as a request id (a string of 1 to 256 characters)."""
    return isinstance(value, str) and 1 <= len(value) <= MAX_REQUEST_ID_CHARS


def check_request_id(value: object) -> str:
    """The request id, or INVALID_REQUEST naming what to send instead."""
    if not isinstance(value, str):
        raise invalid(f"request_id must be a string, not {describe(value)}; send a unique string id.")
    if not 1 <= len(value) <= MAX_REQUEST_ID_CHARS:
        raise invalid(
            f"request_id has {len(value)} characters; send a unique string id of 1 to "
            f"{MAX_REQUEST_ID_CHARS} characters."
        )
    return value


def check_choice(value: object, kind: type[_E], field: str, hint: str) -> _E | None:
    """nil, or one of a string enum's members (by its exact wire spelling); `hint` says what to send."""
    if value is None or isinstance(value, kind):
        return value
    if isinstance(value, str) and value in {member.value for member in kind}:
        return kind(value)
    shown = quoted(value) if isinstance(value, str) else describe(value)
    raise invalid(f"{field} is {shown}; {hint}")


def check_bool(value: object, field: str) -> bool:
    """A strict boolean: 0/1 or "true" are refused so that a producer's bug does not flip a flag silently."""
    if not isinstance(value, bool):
        raise invalid(f"{field} must be a boolean, not {describe(value)}; send true or false.")
    return value


def check_int(value: object, field: str, minimum: int) -> int:
    """An integer (not a boolean) no smaller than minimum."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise invalid(f"{field} must be an integer, not {describe(value)}; send an integer >= {minimum}.")
    if value < minimum:
        raise invalid(f"{field} is {value}; send an integer >= {minimum}.")
    return int(value)


def check_str(value: object, field: str) -> str:
    """A string."""
    if not isinstance(value, str):
        raise invalid(f"{field} must be a string, not {describe(value)}; send a string.")
    return value


def check_float(value: object, field: str) -> float:
    """A float; integers are widened (some encoders write 1.0 as the integer 1), booleans are refused."""
    if type(value) is float:
        return value
    if isinstance(value, bool) or not isinstance(value, float | int | np.floating | np.integer):
        raise invalid(f"{field} must be a float, not {describe(value)}; send a number.")
    return float(value)


def _token_id_error(ids: Iterable[object], field: str, text_allowed: bool) -> SchemaError:
    """The sentence for the first bad token id (the slow path, taken only once a defect is known)."""
    for index, token in enumerate(ids):
        where = f"{field}[{index}]"
        if isinstance(token, bool) or not isinstance(token, int | np.integer):
            alternative = ", or send the input as a string" if text_allowed else ""
            return invalid(
                f"{where} must be an integer token id, not {describe(token)}; send token ids as integers "
                f"in [0, 2**31){alternative}."
            )
        if not 0 <= token < TOKEN_ID_LIMIT:
            return invalid(f"{where} is {token}; send token ids as integers in [0, 2**31).")
    raise AssertionError("_token_id_error called for valid token ids")


def check_token_ids(value: Iterable[Any], field: str, *, text_allowed: bool = True) -> tuple[int, ...]:
    """Token ids as a tuple of plain ints in [0, 2**31); text_allowed says whether a string could stand in."""
    ids: tuple[Any, ...] = tuple(value)
    # Fast path in C: exact ints (bool is a different type) and range by min/max; inputs may be 100k+ ids.
    if set(map(type, ids)) <= PLAIN_INT_TYPES:
        if ids and (min(ids) < 0 or max(ids) >= TOKEN_ID_LIMIT):
            raise _token_id_error(ids, field, text_allowed)
        return ids
    # numpy integers (e.g. straight from a tokenizer) are accepted and turned into plain ints.
    if all(isinstance(token, int | np.integer) and not isinstance(token, bool) for token in ids):
        converted = tuple(int(token) for token in ids)
        if converted and (min(converted) < 0 or max(converted) >= TOKEN_ID_LIMIT):
            raise _token_id_error(converted, field, text_allowed)
        return converted
    raise _token_id_error(ids, field, text_allowed)


def is_array(value: object) -> TypeGuard[Collection[Any]]:
    """Whether a value is an array on the wire (a list or tuple, or a 1-D numpy array from a tokenizer)."""
    return isinstance(value, list | tuple) or (isinstance(value, np.ndarray) and value.ndim == 1)


def check_input(value: object, field: str) -> Input:
    """One input: a text, or a sequence of token ids."""
    if isinstance(value, str):
        return value
    if is_array(value):
        return check_token_ids(value, field)
    raise invalid(
        f"{field} must be a string (text) or an array of integer token ids, not {describe(value)}; "
        f"send one of those."
    )


def _check_map_key(key: object, where: str) -> None:
    if not isinstance(key, str | bytes):
        raise invalid(f"{where} has a map key that is {describe(key)}; use string keys in metadata maps.")


def check_metadata(value: object, field: str = "metadata") -> None:
    """Refuse what msgpack cannot carry faithfully: other types, odd map keys, huge ints, deep nesting."""
    stack: list[tuple[object, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_METADATA_DEPTH:
            raise invalid(f"{field} is nested deeper than {MAX_METADATA_DEPTH} levels; flatten it.")
        if item is None or isinstance(item, bool | float | str | bytes):
            continue
        if isinstance(item, int):
            if not _INT_MIN <= item < _INT_LIMIT:
                raise invalid(
                    f"{field} holds the integer {item}, outside msgpack's range; send it as a string."
                )
            continue
        if isinstance(item, list | tuple):
            stack.extend((child, depth + 1) for child in item)
            continue
        if isinstance(item, dict):
            for key, child in item.items():
                _check_map_key(key, field)
                stack.append((child, depth + 1))
            continue
        raise invalid(
            f"{field} holds {describe(item)}; use only nil, booleans, integers, floats, strings, binary, "
            f"arrays and maps."
        )
