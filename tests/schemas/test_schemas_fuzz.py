"""Property-based checks: decoding only ever raises SchemaError, and valid messages round-trip exactly."""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas import (
    ChatMessage,
    ContentPart,
    ErrorCode,
    ErrorInfo,
    HiddenDType,
    ResultStatus,
    SchemaError,
    ScoreRequest,
    ScoreResult,
    Tensor,
    Truncation,
    decode_request,
    decode_result,
    encode_request,
    encode_result,
)
from schemas.images import image_parts

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
ROUND_TRIP = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

REQUEST_KEYS = [
    "version", "request_id", "query", "items", "item_first", "apply_softmax",
    "return_pooled_hidden_states", "hidden_states_dtype", "metadata", "label_token_ids", "messages",
    "truncate", "requires", "images",
]  # fmt: skip
RESULT_KEYS = [
    "version", "request_id", "status", "scores", "pooled_hidden_states", "prompt_tokens", "model",
    "timings", "error", "metadata", "truncated_tokens",
]  # fmt: skip

msgpack_ints = st.integers(min_value=-(2**63), max_value=2**64 - 1)
scalars = (
    st.none() | st.booleans() | msgpack_ints | st.floats() | st.text(max_size=20) | st.binary(max_size=20)
)
# Arbitrary msgpack values, maps with string keys (what strict_map_key lets through) and some with bytes keys.
msgpack_values = st.recursive(
    scalars,
    lambda children: (
        st.lists(children, max_size=5)
        | st.dictionaries(st.text(max_size=10) | st.binary(max_size=4), children, max_size=5)
    ),
    max_leaves=10,
)
# Values for a mutated field: arbitrary ones plus near-misses that exercise boundaries.
near_misses = st.sampled_from(
    [
        -1, 2**31, 0, 1, 2, True, False, "", "x" * 257, "float64", "bfloat16", "ok", "error", [], [[]],
        [[-1]], [["a"], [1]], [1.5], {"dtype": "float32", "shape": [1], "data": b"\x00" * 3},
        {"code": "NOPE"}, {"code": "MODEL_ERROR", "message": 1}, [3, 3], list(range(257)), "none",
        "query_left", "item_right", ["messages"], ["pooling"], [["messages"]], ["query", 1],
        [{"role": "user", "content": "hi"}], [{"role": "", "content": "hi"}], [{"role": "user"}],
        [{"role": "user", "content": "hi", "name": "x"}], [{"role": "user", "content": None}], [[1, 2]],
        [{b"role": "user", "content": "c"}],
    ]
)  # fmt: skip
mutations = msgpack_values | near_misses


def assert_only_schema_errors(payload: bytes) -> None:
    for decode in (decode_request, decode_result):
        try:
            decode(payload)
        except SchemaError as error:
            # INTERNAL_ERROR would mean a defect reached the decoder's last-resort guard.
            assert error.code in (
                ErrorCode.MALFORMED_MESSAGE,
                ErrorCode.UNSUPPORTED_SCHEMA_VERSION,
                ErrorCode.INVALID_REQUEST,
            )
            assert error.message.endswith(".") and len(error.message) > 20
            assert error.request_id is None or isinstance(error.request_id, str)


@FUZZ
@given(st.binary(max_size=200))
def test_random_bytes_only_raise_schema_error(payload: bytes) -> None:
    assert_only_schema_errors(payload)


@FUZZ
@given(msgpack_values)
def test_random_msgpack_values_only_raise_schema_error(value: object) -> None:
    assert_only_schema_errors(msgpack.packb(value))


@FUZZ
@given(
    st.dictionaries(st.sampled_from(REQUEST_KEYS + RESULT_KEYS) | st.text(max_size=8), mutations, max_size=8)
)
def test_random_maps_with_known_keys_only_raise_schema_error(value: dict[str, Any]) -> None:
    assert_only_schema_errors(msgpack.packb(value))


@FUZZ
@given(st.binary(min_size=1, max_size=60), st.integers(min_value=0, max_value=10_000))
def test_truncated_or_spliced_valid_messages_only_raise_schema_error(noise: bytes, cut: int) -> None:
    valid = encode_request(ScoreRequest("r", items=((1, 2), (3,)), query=(4,), metadata={"k": [1, "v"]}))
    cut %= len(valid)
    assert_only_schema_errors(valid[:cut])
    assert_only_schema_errors(valid[:cut] + noise + valid[cut:])


def _valid_request_map() -> dict[str, Any]:
    return {
        "version": 1, "request_id": "near-1", "query": [1, 2], "items": [[3], [4, 5]], "item_first": True,
        "apply_softmax": False, "return_pooled_hidden_states": True, "hidden_states_dtype": "float16",
        "metadata": {"a": 1}, "label_token_ids": [7, 9], "truncate": "item_right",
        "requires": ["truncate", "label_token_ids"],
    }  # fmt: skip


def _valid_chat_request_map() -> dict[str, Any]:
    return {
        "version": 1, "request_id": "near-1", "items": ["4", ""], "apply_softmax": True,
        "messages": [{"role": "system", "content": "Judge."}, {"role": "user", "content": "2 + 2?"}],
        "label_token_ids": [1], "truncate": "query_left", "requires": ["messages"],
    }  # fmt: skip


def _valid_image_request_map() -> dict[str, Any]:
    parts = [{"type": "image"}, {"type": "text", "text": "What is shown?"}, {"type": "image"}]
    return {
        "version": 1, "request_id": "near-1", "items": ["a cat", "a dog"],
        "messages": [{"role": "user", "content": parts}],
        "images": [b"\x89PNG\r\n\x1a\n" + b"\x00" * 8, b"\xff\xd8\xff\xe0"], "requires": ["images"],
    }  # fmt: skip


REQUEST_TEMPLATES = {
    "tokens": _valid_request_map, "chat": _valid_chat_request_map, "images": _valid_image_request_map,
}  # fmt: skip


def _valid_result_map() -> dict[str, Any]:
    tensor = {"dtype": "bfloat16", "shape": [2], "data": b"\x80\x3f\x20\xc0"}
    return {
        "version": 1, "request_id": "near-2", "status": "ok", "scores": [[0.5], [1.5]],
        "pooled_hidden_states": [tensor, dict(tensor)], "prompt_tokens": 7, "model": "m",
        "timings": {"total": 0.1}, "error": None, "metadata": None, "truncated_tokens": [0, 3],
    }  # fmt: skip


def test_near_valid_templates_are_valid() -> None:
    # The mutation tests below only mean something if the unmutated messages decode.
    for template in REQUEST_TEMPLATES.values():
        assert decode_request(msgpack.packb(template())).request_id == "near-1"
    assert decode_result(msgpack.packb(_valid_result_map())).request_id == "near-2"


@FUZZ
@given(st.sampled_from(sorted(REQUEST_TEMPLATES)), st.sampled_from(REQUEST_KEYS), mutations, st.booleans())
def test_near_valid_request_with_one_field_mutated(
    template: str, key: str, value: object, delete: bool
) -> None:
    body = REQUEST_TEMPLATES[template]()
    if delete:
        body.pop(key, None)
    else:
        body[key] = value
    try:
        decode_request(msgpack.packb(body))
    except SchemaError as error:
        if key != "request_id":
            assert error.request_id == "near-1"
        # The images' own codes are for the images field alone.
        image_codes = (
            (ErrorCode.TOO_MANY_IMAGES, ErrorCode.IMAGE_FORMAT_NOT_SUPPORTED) if key == "images" else ()
        )
        assert error.code in (ErrorCode.INVALID_REQUEST, ErrorCode.UNSUPPORTED_SCHEMA_VERSION, *image_codes)


@FUZZ
@given(
    st.sampled_from([*RESULT_KEYS, "tensor.dtype", "tensor.shape", "tensor.data"]), mutations, st.booleans()
)
def test_near_valid_result_with_one_field_mutated(key: str, value: object, delete: bool) -> None:
    body = _valid_result_map()
    target, name = (body["pooled_hidden_states"][1], key.split(".")[1]) if "." in key else (body, key)
    if delete:
        del target[name]
    else:
        target[name] = value
    try:
        decode_result(msgpack.packb(body))
    except SchemaError as error:
        if key != "request_id":
            assert error.request_id == "near-2"
        assert error.code in (ErrorCode.INVALID_REQUEST, ErrorCode.UNSUPPORTED_SCHEMA_VERSION)


# Valid messages. NaN is left out of metadata so that dataclass equality can be used as the oracle.
clean_text = st.text(alphabet=st.characters(exclude_categories=["Cs"]), max_size=30)
token_ids = st.integers(min_value=0, max_value=2**31 - 1)
token_lists = st.lists(token_ids, max_size=20).map(tuple)
label_ids = st.none() | st.lists(token_ids, min_size=1, max_size=8, unique=True).map(tuple)
chat_messages = st.builds(
    ChatMessage,
    role=st.text(alphabet=st.characters(exclude_categories=["Cs"]), min_size=1, max_size=32),
    content=clean_text
    | st.lists(
        st.builds(ContentPart, type=st.just("text"), text=clean_text) | st.just(ContentPart("image")),
        min_size=1,
        max_size=4,
    ).map(tuple),
)
image_bytes = st.sampled_from([b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"RIFF\x00\x00\x00\x00WEBP"]).flatmap(
    lambda magic: st.binary(max_size=16).map(lambda tail: magic + tail)
)
request_field_names = st.sampled_from(REQUEST_KEYS)
metadata_values = st.recursive(
    st.none()
    | st.booleans()
    | msgpack_ints
    | st.floats(allow_nan=False)
    | clean_text
    | st.binary(max_size=10),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(clean_text, children, max_size=4),
    max_leaves=15,
)


@st.composite
def valid_requests(draw: st.DrawFn) -> ScoreRequest:
    text = draw(st.booleans())
    inputs: st.SearchStrategy[Any] = clean_text if text else token_lists
    # A conversation replaces the query and puts every (text) item after it.
    messages = (
        draw(st.lists(chat_messages, min_size=1, max_size=4).map(tuple))
        if text and draw(st.booleans())
        else None
    )
    placed = sum(image_parts(message.content) for message in messages or ())
    images = tuple(draw(st.lists(image_bytes, min_size=placed, max_size=placed))) if placed else None
    return ScoreRequest(
        request_id=draw(st.text(alphabet=st.characters(exclude_categories=["Cs"]), min_size=1, max_size=256)),
        images=images,
        items=tuple(draw(st.lists(inputs, max_size=6))),
        query=None if messages else draw(st.none() | inputs),
        item_first=False if messages else draw(st.booleans()),
        apply_softmax=draw(st.booleans()),
        return_pooled_hidden_states=draw(st.booleans()),
        hidden_states_dtype=draw(st.sampled_from(list(HiddenDType))),
        metadata=draw(metadata_values),
        label_token_ids=draw(label_ids),
        messages=messages,
        truncate=Truncation.NONE if images else draw(st.sampled_from(list(Truncation))),
        requires=draw(st.none() | st.lists(request_field_names, max_size=5).map(tuple)),
    )


@ROUND_TRIP
@given(valid_requests())
def test_valid_requests_round_trip_exactly(request: ScoreRequest) -> None:
    payload = encode_request(request)
    decoded = decode_request(payload)
    assert decoded == request
    assert encode_request(decoded) == payload


@FUZZ
@given(st.lists(request_field_names | st.text(max_size=12), max_size=8))
def test_requires_accepts_exactly_the_request_fields(names: list[str]) -> None:
    body = {**_valid_request_map(), "requires": names}
    try:
        decoded = decode_request(msgpack.packb(body))
    except SchemaError as error:
        assert error.code is ErrorCode.INVALID_REQUEST and "does not understand" in error.message
        assert not set(names) <= set(REQUEST_KEYS)
    else:
        assert set(names) <= set(REQUEST_KEYS) and decoded.requires == tuple(names)


@st.composite
def tensors(draw: st.DrawFn) -> Tensor:
    dtype = draw(st.sampled_from(["float32", "float16", "bfloat16"]))
    shape = tuple(draw(st.lists(st.integers(min_value=0, max_value=4), max_size=3)))
    itemsize = 4 if dtype == "float32" else 2
    size = int(np.prod(shape, dtype=np.int64)) * itemsize
    return Tensor(dtype, shape, draw(st.binary(min_size=size, max_size=size)))


@st.composite
def valid_results(draw: st.DrawFn) -> ScoreResult:
    request_id = draw(st.text(alphabet=st.characters(exclude_categories=["Cs"]), min_size=1, max_size=64))
    timings = draw(st.dictionaries(clean_text, st.floats(allow_nan=False), max_size=4))
    metadata = draw(metadata_values)
    if draw(st.booleans()):
        code = draw(st.sampled_from(list(ErrorCode)))
        return ScoreResult.failure(request_id, code, draw(clean_text), timings=timings, metadata=metadata)
    scores = draw(st.lists(st.lists(st.floats(allow_nan=False), max_size=3).map(tuple), max_size=5))
    pooled = draw(st.none() | st.lists(tensors(), min_size=len(scores), max_size=len(scores)).map(tuple))
    counts = st.integers(min_value=0, max_value=2**40)
    truncated = draw(st.none() | st.lists(counts, min_size=len(scores), max_size=len(scores)).map(tuple))
    return ScoreResult(
        request_id=request_id,
        status=ResultStatus.OK,
        scores=tuple(scores),
        pooled_hidden_states=pooled,
        prompt_tokens=draw(st.integers(min_value=0, max_value=2**40)),
        model=draw(clean_text),
        timings=timings,
        metadata=metadata,
        truncated_tokens=truncated,
    )


@ROUND_TRIP
@given(valid_results())
def test_valid_results_round_trip_exactly(result: ScoreResult) -> None:
    payload = encode_result(result)
    decoded = decode_result(payload)
    assert decoded == result
    assert encode_result(decoded) == payload
    if result.error is not None:
        assert decoded.error == ErrorInfo(result.error.code, result.error.message)
