"""The scoring request: what a producer asks for, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass

from schemas._checks import (
    Input,
    check_bool,
    check_input,
    check_metadata,
    check_request_id,
    describe,
    invalid,
)
from schemas.errors import ErrorCode, SchemaError
from schemas.tensor import HiddenDType, check_dtype
from schemas.version import SCHEMA_VERSION


def check_version(value: object) -> int:
    """The schema version: an integer, and one this code speaks."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(f"version must be an integer, not {describe(value)}; send version {SCHEMA_VERSION}.")
    if value != SCHEMA_VERSION:
        raise SchemaError(
            ErrorCode.UNSUPPORTED_SCHEMA_VERSION,
            f"Schema version {value} is not supported by this worker; send version {SCHEMA_VERSION}.",
        )
    return value


def _kind(value: Input) -> str:
    return "text" if isinstance(value, str) else "an array of token ids"


def check_items(value: object, query: Input | None) -> tuple[Input, ...]:
    """Items as a tuple of inputs, all of the same kind as each other and as the query."""
    if not isinstance(value, list | tuple):
        raise invalid(
            f"items must be an array of inputs, not {describe(value)}; send an array (it may be empty) of "
            f"strings or of token-id arrays."
        )
    items = tuple(check_input(item, f"items[{index}]") for index, item in enumerate(value))
    # Text and token ids cannot be joined faithfully (re-tokenizing shifts boundary tokens), so refuse a mix.
    first_name, first = ("query", query) if query is not None else ("items[0]", items[0] if items else None)
    if first is None:
        return items
    for index, item in enumerate(items):
        if isinstance(item, str) != isinstance(first, str):
            raise invalid(
                f"{first_name} is {_kind(first)} but items[{index}] is {_kind(item)}; send the query and "
                f"every item as text, or all of them as arrays of token ids."
            )
    return items


@dataclass(frozen=True, slots=True)
class ScoreRequest:
    """One scoring request: a prompt per item (query + item, or item + query), scored by the model."""

    request_id: str
    items: tuple[Input, ...]
    query: Input | None = None
    item_first: bool = False
    apply_softmax: bool = False
    return_pooled_hidden_states: bool = False
    hidden_states_dtype: HiddenDType = HiddenDType.FLOAT32
    metadata: object = None
    version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        request_id = check_request_id(self.request_id)
        try:
            self._validate()
        except SchemaError as error:
            raise error.with_request_id(request_id) from None

    def _validate(self) -> None:
        check_version(self.version)
        query = None if self.query is None else check_input(self.query, "query")
        object.__setattr__(self, "query", query)
        object.__setattr__(self, "items", check_items(self.items, query))
        for field in ("item_first", "apply_softmax", "return_pooled_hidden_states"):
            check_bool(getattr(self, field), field)
        dtype = HiddenDType(check_dtype(self.hidden_states_dtype, "hidden_states_dtype"))
        object.__setattr__(self, "hidden_states_dtype", dtype)
        check_metadata(self.metadata)
