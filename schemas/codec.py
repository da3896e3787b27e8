"""msgpack encoding and decoding of requests and results; decoding raises SchemaError and nothing else."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

import msgpack

from schemas._checks import check_metadata, describe, invalid, is_valid_request_id
from schemas.errors import ErrorCode, SchemaError
from schemas.request import ScoreRequest, Truncation, check_version
from schemas.result import ErrorInfo, ResultStatus, ScoreResult, check_error_code
from schemas.tensor import ITEMSIZE, HiddenDType, Tensor, check_tensor_parts
from schemas.version import SCHEMA_VERSION

Buffer = bytes | bytearray | memoryview
_T = TypeVar("_T")
_REQUIRED = object()  # marks a field with no default
_MISSING_HINTS = {
    "request_id": "send a unique string id of 1 to 256 characters",
    "items": "send an array (it may be empty) of strings or of token-id arrays",
    "status": 'send "ok" or "error"',
}
_DETAIL_CHARS = 200

_REQUEST_FIELDS: dict[str, object] = {
    "request_id": _REQUIRED,
    "items": _REQUIRED,
    "query": None,
    "item_first": False,
    "apply_softmax": False,
    "return_pooled_hidden_states": False,
    "hidden_states_dtype": HiddenDType.FLOAT32,
    "metadata": None,
    "label_token_ids": None,
    "messages": None,
    "truncate": Truncation.NONE,
    "requires": None,
    "deadline_ms": None,
    "ttl_ms": None,
    "token_outputs": None,
    "step_separator": None,
    "token_range": None,
    "return_token_scores": True,
    "return_token_hidden_states": False,
    "adapter": None,
    "heads": None,
    "images": None,
    "compare": None,
    "reward_column": None,
}
_RESULT_FIELDS: dict[str, object] = {
    "request_id": _REQUIRED,
    "status": _REQUIRED,
    "scores": (),
    "pooled_hidden_states": None,
    "prompt_tokens": 0,
    "model": "",
    "timings": {},
    "error": None,
    "metadata": None,
    "truncated_tokens": None,
    "token_positions": None,
    "token_scores": None,
    "token_hidden_states": None,
    "head_scores": None,
    "rewards": None,
    "preference": None,
    "ranking": None,
    "best_probability": None,
}


def _reject_ext(code: int, data: bytes) -> NoReturn:
    # Extension types are how msgpack-numpy and friends smuggle pickles; the contract has none.
    raise ValueError(f"msgpack extension type {code} is not allowed")


def _malformed(detail: str) -> SchemaError:
    return SchemaError(
        ErrorCode.MALFORMED_MESSAGE,
        f"The message is not a valid msgpack map ({detail[:_DETAIL_CHARS]}); send one msgpack map with "
        f"string keys that uses only nil, booleans, integers, floats, strings, binary, arrays and maps "
        f"(no extension types).",
    )


def _unpack(data: object) -> dict[Any, Any]:
    """The top-level map; any other outcome is MALFORMED_MESSAGE."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise _malformed(f"the record value is {describe(data)}, not bytes")
    size = memoryview(data).nbytes
    try:
        # Every element costs at least one byte, so the input size bounds every length (no huge allocations);
        # max_ext_len=0 also refuses the timestamp extension, which msgpack decodes without calling ext_hook.
        message = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            ext_hook=_reject_ext,
            max_ext_len=0,
            max_str_len=size,
            max_bin_len=size,
            max_array_len=size,
            max_map_len=size,
        )
    except Exception as exc:
        raise _malformed(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__) from None
    if not isinstance(message, dict):
        raise _malformed(f"its top level is {describe(message)}")
    return message


def _read_fields(message: dict[Any, Any], fields: dict[str, object]) -> dict[str, Any]:
    """Known fields only (unknown keys are ignored: forward compatibility); nil means "use the default"."""
    values: dict[str, Any] = {}
    for name, default in fields.items():
        value = message.get(name)
        if value is None:
            if default is _REQUIRED:
                raise invalid(f"{name} is missing; {_MISSING_HINTS[name]}.")
            value = default
        values[name] = value
    return values


def _read_version(message: dict[Any, Any]) -> int:
    """Checked before any other field: a message of another version may be shaped differently."""
    if message.get("version") is None:
        raise invalid(f"version is missing; send version {SCHEMA_VERSION}.")
    return check_version(message["version"])


def _guarded(decode: Callable[[dict[Any, Any]], _T], data: object) -> _T:
    """Run a decoder so that only SchemaError leaves, tagged with the request id whenever one is readable."""
    request_id: str | None = None
    message: dict[Any, Any] | None = None
    try:
        message = _unpack(data)
        candidate = message.get("request_id")
        request_id = candidate if is_valid_request_id(candidate) else None
        return decode(message)
    except SchemaError as error:
        # Only a refused message needs its metadata read apart: a valid one's is checked by the decoder.
        metadata = None if message is None else _readable_metadata(message.get("metadata"))
        raise error.with_request_id(request_id, metadata) from None
    except Exception as exc:
        # A defect of ours met by a strange message must still surface as the contract's error type.
        raise SchemaError(
            ErrorCode.INTERNAL_ERROR,
            f"The decoder failed on this message ({type(exc).__name__}); report it with the request id and "
            f"keep the dead-lettered copy.",
            request_id,
        ) from exc


def _readable_metadata(value: object) -> object:
    """The metadata of a message whose map could be read, if it is valid metadata itself (else None)."""
    try:
        check_metadata(value)
    except SchemaError:
        return None
    return value


def _request_from_map(message: dict[Any, Any]) -> ScoreRequest:
    version = _read_version(message)
    fields = _read_fields(message, _REQUEST_FIELDS)
    return ScoreRequest(version=version, **fields)


def _tensor_from_wire(value: object, field: str) -> Tensor:
    if not isinstance(value, dict):
        raise invalid(f"{field} must be a map {{dtype, shape, data}}, not {describe(value)}.")
    dtype, shape, data = check_tensor_parts(value.get("dtype"), value.get("shape"), value.get("data"), field)
    return Tensor(dtype, shape, data)


def _error_from_wire(value: object) -> ErrorInfo:
    if not isinstance(value, dict):
        raise invalid(f"error must be nil or a map {{code, message}}, not {describe(value)}.")
    code, message = value.get("code"), value.get("message")
    if not isinstance(message, str):
        raise invalid(f"error.message must be a string, not {describe(message)}.")
    if isinstance(code, str) and code not in ErrorCode.__members__:
        # A newer worker may add codes; keep the result readable and the new code visible to a person.
        return ErrorInfo(ErrorCode.INTERNAL_ERROR, f"[{code}] {message}")
    return ErrorInfo(check_error_code(code, "error.code"), message)


def _result_from_map(message: dict[Any, Any]) -> ScoreResult:
    version = _read_version(message)
    fields = _read_fields(message, _RESULT_FIELDS)
    pooled = fields["pooled_hidden_states"]
    if isinstance(pooled, list):
        fields["pooled_hidden_states"] = [
            _tensor_from_wire(tensor, f"pooled_hidden_states[{index}]") for index, tensor in enumerate(pooled)
        ]
    for name in ("token_scores", "token_hidden_states"):
        if isinstance(fields[name], list):
            fields[name] = [
                _tensor_from_wire(tensor, f"{name}[{i}]") for i, tensor in enumerate(fields[name])
            ]
    if fields["error"] is not None:
        fields["error"] = _error_from_wire(fields["error"])
    return ScoreResult(version=version, **fields)


def decode_request(data: Buffer) -> ScoreRequest:
    """A request from a record value; raises SchemaError (and nothing else) for any defect."""
    return _guarded(_request_from_map, data)


def decode_result(data: Buffer) -> ScoreResult:
    """A result from a record value; raises SchemaError (and nothing else) for any defect."""
    return _guarded(_result_from_map, data)


def _pack(body: dict[str, Any], request_id: str) -> bytes:
    try:
        # Floats always as float64: scores round-trip exactly.
        packed: bytes = msgpack.packb(body, use_bin_type=True, use_single_float=False, datetime=False)
    except Exception as exc:
        raise invalid(
            f"The message could not be encoded ({type(exc).__name__}: {str(exc)[:_DETAIL_CHARS]}); "
            f"use only msgpack-representable values and valid UTF-8 strings."
        ).with_request_id(request_id) from None
    return packed


def encode_request(request: ScoreRequest) -> bytes:
    """A request as a msgpack map (every field written, defaults included)."""
    messages = request.messages
    body = {
        "version": request.version,
        "request_id": request.request_id,
        "query": request.query,
        "items": request.items,
        "item_first": request.item_first,
        "apply_softmax": request.apply_softmax,
        "return_pooled_hidden_states": request.return_pooled_hidden_states,
        "hidden_states_dtype": request.hidden_states_dtype.value,
        "metadata": request.metadata,
        "label_token_ids": request.label_token_ids,
        "messages": None if messages is None else [m.as_template_turn() for m in messages],
        "truncate": request.truncate.value,
        "requires": request.requires,
        "deadline_ms": request.deadline_ms,
        "ttl_ms": request.ttl_ms,
        "token_outputs": None if request.token_outputs is None else request.token_outputs.value,
        "step_separator": request.step_separator,
        "token_range": request.token_range,
        "return_token_scores": request.return_token_scores,
        "return_token_hidden_states": request.return_token_hidden_states,
        "adapter": request.adapter,
        "heads": request.heads,
        "images": None if request.images is None else list(request.images),
        "compare": None if request.compare is None else request.compare.value,
        "reward_column": request.reward_column,
    }
    return _pack(body, request.request_id)


def _tensor_to_wire(tensor: Tensor) -> dict[str, Any]:
    return {"dtype": tensor.dtype, "shape": tensor.shape, "data": tensor.data}


def encode_result(result: ScoreResult) -> bytes:
    """A result as a msgpack map (every field written)."""
    pooled = result.pooled_hidden_states
    error = result.error
    body = {
        "version": result.version,
        "request_id": result.request_id,
        "status": result.status.value,
        "scores": result.scores,
        "pooled_hidden_states": None if pooled is None else [_tensor_to_wire(t) for t in pooled],
        "prompt_tokens": result.prompt_tokens,
        "model": result.model,
        "timings": result.timings,
        "error": None if error is None else {"code": error.code.value, "message": error.message},
        "metadata": result.metadata,
        "truncated_tokens": result.truncated_tokens,
        "token_positions": result.token_positions,
        "token_scores": _tensors_to_wire(result.token_scores),
        "token_hidden_states": _tensors_to_wire(result.token_hidden_states),
        "head_scores": result.head_scores,
        "rewards": result.rewards,
        "preference": result.preference,
        "ranking": result.ranking,
        "best_probability": result.best_probability,
    }
    return _pack(body, result.request_id)


def _tensors_to_wire(tensors: tuple[Tensor, ...] | None) -> list[dict[str, Any]] | None:
    return None if tensors is None else [_tensor_to_wire(t) for t in tensors]


# Per-part upper bounds of msgpack encodings (bytes): an array or bin header, a float64, an integer, and a
# tensor map's keys, dtype name and shape around its data.
_HEADER, _FLOAT, _INT, _TENSOR_MAP = 5, 9, 9, 48


_SKELETON_ID = "x"


@functools.lru_cache(maxsize=64)
def _skeleton_size(model: str, pooled: bool) -> int:
    """Encoded size of an OK result of `model` with no items, the id `_SKELETON_ID` and no metadata."""
    skeleton = ScoreResult(
        _SKELETON_ID,
        ResultStatus.OK,
        pooled_hidden_states=() if pooled else None,
        model=model,
        timings={"tokenize_s": 0.0, "forward_s": 0.0, "copy_s": 0.0},
    )
    return len(encode_result(skeleton))


def _packed_size(value: object) -> int:
    """Bytes of one value as `_pack` writes it inside a message."""
    return len(msgpack.packb(value, use_bin_type=True, use_single_float=False, datetime=False))


def result_size_bound(
    request: ScoreRequest,
    model: str,
    items: int,
    floats_per_item: int,
    hidden_size: int,
    token_positions: int = 0,
    head_floats: int = 0,
) -> int:
    """An upper bound of the encoded size of `request`'s OK result, computed without scoring it.

    `items` prompts, `floats_per_item` scores each and, when the request asks for them, pooled hidden states
    of `hidden_size` values in its dtype. The metadata and ids are encoded for real; only the parts that
    grow with the items are bounded. Lets a worker refuse a result that cannot fit its record limit before
    spending model time on it. `token_positions`: the positions of all items the request's token_outputs
    read (each a position, a score row and a hidden state where asked); `head_floats`: the floats per item
    of the extra heads it names.
    """
    # Every field of a result is always written, so swapping one value changes the encoding by exactly the
    # difference of that value's own encodings: the skeleton of this model is encoded once, not per request.
    size = _skeleton_size(model, request.return_pooled_hidden_states)
    size += _packed_size(request.request_id) - _packed_size(_SKELETON_ID)
    if request.metadata is not None:
        size += _packed_size(request.metadata) - _packed_size(None)
    size += _INT + 3 * _HEADER  # prompt_tokens; the arrays' own headers
    size += items * (_HEADER + floats_per_item * _FLOAT)
    if request.return_pooled_hidden_states:
        size += items * (_TENSOR_MAP + hidden_size * ITEMSIZE[request.hidden_states_dtype.value])
    if request.truncate is not Truncation.NONE:
        size += items * _INT
    if request.heads:
        size += _HEADER + sum(_packed_size(name) + _HEADER for name in request.heads)
        size += items * (len(request.heads) * _HEADER + head_floats * _FLOAT)
    if request.token_outputs is not None:
        size += 3 * _HEADER + items * _HEADER + token_positions * _INT  # token_positions
        if request.return_token_scores:
            size += items * _TENSOR_MAP + token_positions * floats_per_item * ITEMSIZE["float32"]
        if request.return_token_hidden_states:
            width = ITEMSIZE[request.hidden_states_dtype.value]
            size += items * _TENSOR_MAP + token_positions * hidden_size * width
    if request.compare is not None:
        # rewards and best_probability (floats), ranking (integers), the preference
        size += 3 * _HEADER + items * (2 * _FLOAT + _INT) + _FLOAT
    return size
