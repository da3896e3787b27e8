"""Round trips of every request and result field, every tensor dtype, and the headers."""

from __future__ import annotations

import math
import pickle
from typing import Any

import msgpack
import numpy as np
import pytest
import torch

from schemas import (
    HEADER_CONTENT_TYPE,
    HEADER_REQUEST_ID,
    HEADER_SCHEMA_VERSION,
    SCHEMA_VERSION,
    ChatMessage,
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
    header_request_id,
    headers_to_dict,
    request_headers,
    result_headers,
    result_size_bound,
)
from schemas.codec import _HEADER, _INT, _REQUEST_FIELDS, _RESULT_FIELDS
from schemas.request import REQUEST_FIELDS

NESTED_METADATA = {
    "trace": {"spans": [1, -2, 2**63 - 1, -(2**63), 2**64 - 1], "ok": True, "none": None},
    "blob": b"\x00\xff\x10",
    "ratio": 0.125,
    "text": "héllo ✓",
    "deep": [[[[{"k": []}]]]],
}


def roundtrip_request(request: ScoreRequest) -> ScoreRequest:
    return decode_request(encode_request(request))


def roundtrip_result(result: ScoreResult) -> ScoreResult:
    return decode_result(encode_result(result))


def test_text_request_every_field_round_trips() -> None:
    request = ScoreRequest(
        request_id="req-1",
        items=("first item", "", "third ✓"),
        query="What is the capital of France?",
        item_first=True,
        apply_softmax=True,
        return_pooled_hidden_states=True,
        hidden_states_dtype=HiddenDType.FLOAT16,
        metadata=NESTED_METADATA,
    )
    decoded = roundtrip_request(request)
    assert decoded == request
    assert decoded.items == ("first item", "", "third ✓")
    assert decoded.hidden_states_dtype is HiddenDType.FLOAT16
    assert decoded.metadata == NESTED_METADATA


def test_token_request_round_trips_and_normalises_to_tuples() -> None:
    request = ScoreRequest("r", items=[[1, 2, 3], [], [2**31 - 1]], query=[0, 7])  # type: ignore[arg-type]
    assert request.items == ((1, 2, 3), (), (2**31 - 1,))
    assert request.query == (0, 7)
    assert roundtrip_request(request) == request


def test_numpy_token_ids_become_plain_ints() -> None:
    request = ScoreRequest("r", items=(np.array([5, 6], dtype=np.int64),))  # type: ignore[arg-type]
    assert request.items == ((5, 6),)
    assert all(type(token) is int for token in request.items[0])


@pytest.mark.parametrize("dtype", list(HiddenDType))
def test_every_hidden_states_dtype_round_trips(dtype: HiddenDType) -> None:
    # The wire spelling is accepted too and normalised to the enum.
    wire_name: Any = dtype.value
    request = ScoreRequest("r", items=("a",), return_pooled_hidden_states=True, hidden_states_dtype=wire_name)
    assert request.hidden_states_dtype is dtype
    assert roundtrip_request(request).hidden_states_dtype is dtype


def test_empty_items_and_defaults_round_trip() -> None:
    request = ScoreRequest("only-id", items=())
    decoded = roundtrip_request(request)
    assert decoded == request
    assert (decoded.query, decoded.item_first, decoded.apply_softmax) == (None, False, False)
    assert decoded.return_pooled_hidden_states is False
    assert decoded.hidden_states_dtype is HiddenDType.FLOAT32
    assert decoded.metadata is None and decoded.version == SCHEMA_VERSION


# The request keys added to version 1 after its first encoder (OLD_REQUEST_MAP), as the encoder writes
# their defaults.
ADDED_KEYS = {
    "label_token_ids": None,
    "messages": None,
    "truncate": "none",
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


def test_wire_form_is_a_plain_map_with_every_field() -> None:
    request = ScoreRequest("r", items=((1, 2),), query=(3,), hidden_states_dtype=HiddenDType.BFLOAT16)
    assert msgpack.unpackb(encode_request(request)) == {
        "version": 1,
        "request_id": "r",
        "query": [3],
        "items": [[1, 2]],
        "item_first": False,
        "apply_softmax": False,
        "return_pooled_hidden_states": False,
        "hidden_states_dtype": "bfloat16",
        "metadata": None,
        **ADDED_KEYS,
    }


def test_deadline_is_the_earlier_of_deadline_and_time_to_live() -> None:
    assert ScoreRequest("r", items=("a",)).expires_at_ms(1_000) is None
    assert ScoreRequest("r", items=("a",)).expires_at_ms(1_000, default_ttl_ms=500) == 1_500
    assert ScoreRequest("r", items=("a",), ttl_ms=200).expires_at_ms(1_000, default_ttl_ms=500) == 1_200
    assert ScoreRequest("r", items=("a",), deadline_ms=1_100, ttl_ms=200).expires_at_ms(1_000) == 1_100
    assert ScoreRequest("r", items=("a",), deadline_ms=9_000).expires_at_ms(1_000, 500) == 1_500
    request = decode_request(encode_request(ScoreRequest("r", items=("a",), deadline_ms=5, ttl_ms=7)))
    assert (request.deadline_ms, request.ttl_ms) == (5, 7)
    for bad in ({"ttl_ms": 0}, {"deadline_ms": -1}, {"ttl_ms": 1.5}, {"deadline_ms": True}):
        with pytest.raises(SchemaError) as error:
            ScoreRequest("r", items=("a",), **bad)  # type: ignore[arg-type]
        assert error.value.code is ErrorCode.INVALID_REQUEST


# The map the encoder wrote before label_token_ids, messages, truncate and requires existed.
OLD_REQUEST_MAP = {
    "version": 1,
    "request_id": "old-1",
    "query": "Is this helpful?",
    "items": ["Yes.", "No."],
    "item_first": False,
    "apply_softmax": True,
    "return_pooled_hidden_states": True,
    "hidden_states_dtype": "float16",
    "metadata": {"k": 1},
}


def test_request_without_the_new_keys_decodes_exactly_as_before() -> None:
    decoded = decode_request(msgpack.packb(OLD_REQUEST_MAP))
    assert decoded == ScoreRequest(
        "old-1",
        items=("Yes.", "No."),
        query="Is this helpful?",
        apply_softmax=True,
        return_pooled_hidden_states=True,
        hidden_states_dtype=HiddenDType.FLOAT16,
        metadata={"k": 1},
    )
    assert (decoded.label_token_ids, decoded.messages, decoded.requires) == (None, None, None)
    assert decoded.truncate is Truncation.NONE
    # Nil is the default too, so a producer that writes every key as nil gets the same request.
    nils = dict.fromkeys(ADDED_KEYS)
    assert decode_request(msgpack.packb({**OLD_REQUEST_MAP, **nils})) == decoded
    # Re-encoding adds the new keys with their defaults and changes nothing else.
    wire = msgpack.unpackb(encode_request(decoded))
    assert {key: wire[key] for key in OLD_REQUEST_MAP} == OLD_REQUEST_MAP
    assert {key: wire[key] for key in wire.keys() - OLD_REQUEST_MAP.keys()} == ADDED_KEYS


def test_judge_request_round_trips() -> None:
    request = ScoreRequest(
        "judge-1", items=("4", "5"), query="2 + 2 = ", apply_softmax=True, label_token_ids=(7566, 2360)
    )
    decoded = roundtrip_request(request)
    assert decoded == request and decoded.label_token_ids == (7566, 2360)
    assert msgpack.unpackb(encode_request(request))["label_token_ids"] == [7566, 2360]


def test_label_token_ids_normalise_to_a_tuple_of_plain_ints() -> None:
    ids: Any = np.array([0, 5, 2**31 - 1], dtype=np.int64)
    request = ScoreRequest("r", items=("a",), label_token_ids=ids)
    assert request.label_token_ids == (0, 5, 2**31 - 1)
    assert all(type(token) is int for token in request.label_token_ids)
    most: Any = list(range(256))
    assert ScoreRequest("r", items=(), label_token_ids=most).label_token_ids == tuple(range(256))


def test_chat_request_round_trips() -> None:
    conversation = (
        ChatMessage("system", "Reply Yes if the answer is correct, else No."),
        ChatMessage("user", "What is 2 + 2?"),
        ChatMessage("assistant", ""),
        ChatMessage("r" * 32, "✓ é"),
    )
    request = ScoreRequest("chat-1", items=("4", ""), messages=conversation, label_token_ids=(1, 2))
    decoded = roundtrip_request(request)
    assert decoded == request and decoded.messages == conversation
    assert msgpack.unpackb(encode_request(request))["messages"] == [
        {"role": m.role, "content": m.content} for m in conversation
    ]


def test_messages_may_be_given_as_maps() -> None:
    maps: Any = [{"role": "user", "content": "Hi"}, {"content": "Hello", "role": "assistant"}]
    request = ScoreRequest("r", items=("a",), messages=maps)
    assert request.messages == (ChatMessage("user", "Hi"), ChatMessage("assistant", "Hello"))
    assert ScoreRequest("r", items=(), messages=[ChatMessage("user", "x")] * 256).messages is not None


@pytest.mark.parametrize("truncation", list(Truncation))
def test_every_truncation_round_trips(truncation: Truncation) -> None:
    wire_name: Any = truncation.value
    request = ScoreRequest("r", items=("a",), query="q", truncate=wire_name)
    assert request.truncate is truncation
    assert roundtrip_request(request).truncate is truncation
    assert msgpack.unpackb(encode_request(request))["truncate"] == truncation.value


def test_requires_with_every_known_field_round_trips() -> None:
    names = tuple(sorted(REQUEST_FIELDS))
    request = ScoreRequest("r", items=("a",), requires=names)
    assert roundtrip_request(request).requires == names
    for name in names:
        one: Any = [name]
        assert roundtrip_request(ScoreRequest("r", items=("a",), requires=one)).requires == (name,)
    assert roundtrip_request(ScoreRequest("r", items=(), requires=())).requires == ()
    most: Any = ["messages"] * 64
    assert ScoreRequest("r", items=(), requires=most).requires == ("messages",) * 64


def test_requires_knows_exactly_the_wire_keys() -> None:
    # The decoder's table, the dataclass and what requires accepts must not drift apart.
    assert set(_REQUEST_FIELDS) | {"version"} == REQUEST_FIELDS
    assert set(msgpack.unpackb(encode_request(ScoreRequest("r", items=())))) == REQUEST_FIELDS
    assert set(_RESULT_FIELDS) | {"version"} == set(ScoreResult.__dataclass_fields__)
    ok = ScoreResult("r", ResultStatus.OK)
    assert set(msgpack.unpackb(encode_result(ok))) == set(ScoreResult.__dataclass_fields__)


def test_minimal_foreign_request_with_unknown_keys_and_nils_decodes_to_defaults() -> None:
    body = {
        "version": 1,
        "request_id": "from-js",
        "items": ["x"],
        "query": None,
        "apply_softmax": None,
        "hidden_states_dtype": None,
        "priority": "high",  # unknown: ignored
        "future": {"nested": [1, 2]},
    }
    decoded = decode_request(msgpack.packb(body))
    assert decoded == ScoreRequest("from-js", items=("x",))


def test_bytearray_and_memoryview_inputs_decode() -> None:
    payload = encode_request(ScoreRequest("r", items=("a",)))
    assert decode_request(bytearray(payload)) == decode_request(memoryview(payload))


def _all_bfloat16_bits() -> np.ndarray:
    return np.arange(2**16, dtype=np.uint32).astype(np.uint16)


def test_bfloat16_tensor_is_bit_exact_for_every_pattern() -> None:
    bits = _all_bfloat16_bits()
    tensor = Tensor.from_bfloat16_bits(bits.reshape(256, 256))
    assert tensor.shape == (256, 256) and len(tensor.data) == 2 * 2**16
    result = ScoreResult("r", ResultStatus.OK, scores=((0.5,),), pooled_hidden_states=(tensor,))
    decoded = roundtrip_result(result).pooled_hidden_states
    assert decoded is not None and decoded[0] == tensor
    widened = decoded[0].to_numpy()
    assert widened.dtype == np.float32
    # Exact widening: the float32 bit pattern is the bfloat16 pattern shifted up, NaN payloads included.
    assert np.array_equal(widened.reshape(-1).view(np.uint32), bits.astype(np.uint32) << 16)
    # And it agrees with torch's own bfloat16 -> float32 conversion on every non-NaN value.
    reference = torch.from_numpy(bits.view(np.int16).copy()).view(torch.bfloat16).float().numpy()
    finite = ~np.isnan(reference)
    assert np.array_equal(widened.reshape(-1)[finite], reference[finite])


def test_bfloat16_from_torch_int16_view_and_big_endian_bits() -> None:
    values = torch.tensor([1.0, -2.5, 3.140625, 0.0], dtype=torch.bfloat16)
    tensor = Tensor.from_bfloat16_bits(values.view(torch.int16).numpy())
    assert tensor.data == bytes.fromhex("803f20c049400000")
    assert tensor.to_numpy().tolist() == [1.0, -2.5, 3.140625, 0.0]
    big_endian = np.array([0x3F80, 0xC020], dtype=">u2")
    assert Tensor.from_bfloat16_bits(big_endian).data == bytes.fromhex("803f20c0")


def test_float16_tensor_round_trips_every_value() -> None:
    values = np.arange(2**16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    tensor = Tensor.from_numpy(values)
    assert tensor.dtype == "float16" and tensor.data == values.astype("<f2").tobytes()
    decoded = roundtrip_result(
        ScoreResult("r", ResultStatus.OK, scores=((1.0,),), pooled_hidden_states=(tensor,))
    )
    assert decoded.pooled_hidden_states is not None
    back = decoded.pooled_hidden_states[0].to_numpy()
    assert back.dtype == np.float16
    assert np.array_equal(back.view(np.uint16), values.view(np.uint16))


def test_float32_tensor_from_big_endian_non_contiguous_array() -> None:
    matrix = np.arange(12, dtype=">f4").reshape(3, 4).T  # [4, 3], Fortran-ordered, big-endian
    tensor = Tensor.from_numpy(matrix)
    assert tensor.shape == (4, 3)
    assert tensor.data == np.ascontiguousarray(matrix, dtype="<f4").tobytes()
    back = tensor.to_numpy()
    assert back.dtype == np.float32 and back.flags.writeable
    assert np.array_equal(back, matrix)


def test_zero_size_tensor_round_trips() -> None:
    tensor = Tensor("float32", (0, 8), b"")
    assert tensor.to_numpy().shape == (0, 8)
    result = ScoreResult("r", ResultStatus.OK, scores=((),), pooled_hidden_states=(tensor,))
    assert roundtrip_result(result) == result


def test_ok_result_every_field_round_trips() -> None:
    pooled = (
        Tensor.from_numpy(np.array([0.25, -1.5], dtype=np.float32)),
        Tensor.from_numpy(np.array([3.0, 4.0], dtype=np.float32)),
    )
    result = ScoreResult(
        request_id="req-9",
        status=ResultStatus.OK,
        scores=((0.1, 0.9), (-3.0e38, 5e-324)),  # msgpack's float64 carries any double exactly
        pooled_hidden_states=pooled,
        prompt_tokens=42,
        model="tiny-llama",
        timings={"queue": 0.001, "compute": 0.25},
        metadata=NESTED_METADATA,
    )
    assert roundtrip_result(result) == result


def test_truncated_tokens_round_trip() -> None:
    result = ScoreResult(
        "r", ResultStatus.OK, scores=((0.5,), (1.5,), (2.5,)), truncated_tokens=(0, 17, 2**40)
    )
    decoded = roundtrip_result(result)
    assert decoded == result and decoded.truncated_tokens == (0, 17, 2**40)
    assert msgpack.unpackb(encode_result(result))["truncated_tokens"] == [0, 17, 2**40]
    empty = ScoreResult("r", ResultStatus.OK, truncated_tokens=())
    assert roundtrip_result(empty).truncated_tokens == ()


def test_result_without_truncated_tokens_reads_as_nil() -> None:
    # What a worker from before the field writes.
    body = {"version": 1, "request_id": "r", "status": "ok", "scores": [[1.0]], "metadata": None}
    result = decode_result(msgpack.packb(body))
    assert result.truncated_tokens is None
    assert msgpack.unpackb(encode_result(result))["truncated_tokens"] is None
    failure = ScoreResult.failure("r", ErrorCode.MODEL_ERROR, "Retry the request.")
    assert failure.truncated_tokens is None
    assert msgpack.unpackb(encode_result(failure))["truncated_tokens"] is None


def test_non_finite_scores_survive() -> None:
    result = ScoreResult("r", ResultStatus.OK, scores=((math.nan, math.inf, -math.inf, -0.0),))
    scores = roundtrip_result(result).scores[0]
    assert math.isnan(scores[0]) and scores[1:3] == (math.inf, -math.inf)
    assert math.copysign(1.0, scores[3]) == -1.0


def test_integer_scores_and_timings_are_widened_to_float() -> None:
    body = {"version": 1, "request_id": "r", "status": "ok", "scores": [[1, 2.5]], "timings": {"t": 3}}
    result = decode_result(msgpack.packb(body))
    assert result.scores == ((1.0, 2.5),) and type(result.scores[0][0]) is float
    assert result.timings == {"t": 3.0} and type(result.timings["t"]) is float
    assert (result.pooled_hidden_states, result.prompt_tokens, result.model, result.error) == (
        None,
        0,
        "",
        None,
    )


def test_failure_result_round_trips() -> None:
    result = ScoreResult.failure(
        "req-3",
        ErrorCode.INPUT_TOO_LONG,
        "items[0] has 9000 tokens; shorten it to at most 4096 tokens.",
        model="m",
        metadata={"user": 7},
        timings={"total": 0.5},
    )
    assert result.status is ResultStatus.ERROR and not result.ok
    assert result.scores == () and result.pooled_hidden_states is None and result.prompt_tokens == 0
    decoded = roundtrip_result(result)
    assert decoded == result
    assert decoded.error == ErrorInfo(ErrorCode.INPUT_TOO_LONG, result.error.message)  # type: ignore[union-attr]
    wire = msgpack.unpackb(encode_result(result))
    assert wire["status"] == "error"
    assert wire["error"] == {"code": "INPUT_TOO_LONG", "message": result.error.message}  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "code",
    [
        ErrorCode.LABEL_IDS_NOT_SUPPORTED,
        ErrorCode.LABEL_IDS_REQUIRED,
        ErrorCode.LABEL_ID_OUT_OF_RANGE,
        ErrorCode.CHAT_TEMPLATE_MISSING,
    ],
)
def test_judge_and_chat_error_codes_round_trip(code: ErrorCode) -> None:
    result = ScoreResult.failure("r", code, "Send label_token_ids nil to this model.")
    assert code.value == code.name
    assert roundtrip_result(result).error == ErrorInfo(code, "Send label_token_ids nil to this model.")
    assert msgpack.unpackb(encode_result(result))["error"]["code"] == code.name


def test_error_code_from_a_newer_worker_stays_readable() -> None:
    body = {
        "version": 1,
        "request_id": "r",
        "status": "error",
        "error": {"code": "QUOTA_EXCEEDED", "message": "Slow down."},
    }
    result = decode_result(msgpack.packb(body))
    assert result.error == ErrorInfo(ErrorCode.INTERNAL_ERROR, "[QUOTA_EXCEEDED] Slow down.")


def test_result_wire_form_of_a_tensor() -> None:
    tensor = Tensor.from_bfloat16_bits(np.array([0x3F80, 0xC020, 0x4049], dtype=np.uint16))
    result = ScoreResult("r", ResultStatus.OK, scores=((1.0,),), pooled_hidden_states=(tensor,))
    wire = msgpack.unpackb(encode_result(result))
    assert wire["pooled_hidden_states"] == [
        {"dtype": "bfloat16", "shape": [3], "data": bytes.fromhex("803f20c04940")}
    ]
    # The exact bytes the README shows for this tensor map.
    assert msgpack.packb(wire["pooled_hidden_states"][0]).hex() == (
        "83a56474797065a862666c6f61743136a573686170659103a464617461c406803f20c04940"
    )


def test_request_and_result_headers() -> None:
    headers = request_headers("req-ü")
    assert headers == [
        (HEADER_REQUEST_ID, "req-ü".encode()),
        (HEADER_CONTENT_TYPE, b"application/vnd.score-worker.request.v1+msgpack"),
        (HEADER_SCHEMA_VERSION, b"1"),
    ]
    as_dict = headers_to_dict(result_headers("r"))
    assert as_dict[HEADER_CONTENT_TYPE] == b"application/vnd.score-worker.result.v1+msgpack"
    assert as_dict["x-request-id"] == b"r" and as_dict["x-schema-version"] == b"1"


def test_headers_to_dict_reads_aiokafka_tuples() -> None:
    raw = (("X-Request-ID", b"a"), ("x-request-id", b"b"), ("empty", None))
    assert headers_to_dict(raw) == {"x-request-id": b"b", "empty": b""}
    assert headers_to_dict(None) == {}


def test_header_request_id_is_read_whatever_the_name_case() -> None:
    # The worker (to address an error result) and the client (to skip others' results) read it alike.
    assert header_request_id(request_headers("req-ü")) == "req-ü"
    assert header_request_id([("trace", b"t"), ("X-Request-Id", b"a"), ("x-request-id", b"b")]) == "a"
    assert header_request_id([("x-request-id", b"")]) is None
    assert header_request_id([("x-request-id", None)]) is None
    assert header_request_id([("x-request-id", b"\xff\xfe")]) is None  # not UTF-8: no usable id
    assert header_request_id([("x-request-id", "é".encode() * 256)]) == "é" * 256  # 256 characters
    assert header_request_id([("x-request-id", b"x" * 257)]) is None  # as long as no map id may be
    assert header_request_id(None) is None


def test_schema_error_pickles_and_reads_as_its_message() -> None:
    error = SchemaError(ErrorCode.INVALID_REQUEST, "items is missing; send an array.", "r1")
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.code, copy.message, copy.request_id) == (error.code, error.message, "r1")
    assert str(error) == "items is missing; send an array."
    assert str(ErrorCode.MODEL_ERROR) == "MODEL_ERROR" and str(HiddenDType.BFLOAT16) == "bfloat16"


@pytest.mark.parametrize("dtype", list(HiddenDType))
@pytest.mark.parametrize("items", [0, 1, 7, 300])
def test_result_size_bound_is_an_upper_bound_and_a_close_one(dtype: HiddenDType, items: int) -> None:
    hidden, labels = 96, 3
    request = ScoreRequest(
        "bound-" + "x" * 200,
        items=("a",) * max(items, 1),
        return_pooled_hidden_states=True,
        hidden_states_dtype=dtype,
        truncate=Truncation.ITEM_LEFT,
        metadata={"trace": "y" * 500, "n": [1, 2.5, None]},
    )
    rng = np.random.default_rng(items)
    states = tuple(Tensor.from_numpy(rng.standard_normal(hidden).astype(np.float32)) for _ in range(items))
    if dtype is not HiddenDType.FLOAT32:
        states = tuple(Tensor.from_numpy(t.to_numpy().astype(np.float16)) for t in states)
        if dtype is HiddenDType.BFLOAT16:
            states = tuple(
                Tensor.from_bfloat16_bits(np.zeros(hidden, dtype=np.uint16) + 0x3F80) for _ in range(items)
            )
    result = ScoreResult(
        request.request_id,
        ResultStatus.OK,
        scores=tuple(tuple(rng.standard_normal(labels).tolist()) for _ in range(items)),
        pooled_hidden_states=states,
        prompt_tokens=2**40,
        model="some/model",
        timings={"tokenize_s": 0.123456789, "forward_s": 1e-300, "copy_s": 3.0},
        metadata=request.metadata,
        truncated_tokens=(2**33,) * items,
    )
    actual = len(encode_result(result))
    bound = result_size_bound(request, "some/model", items, labels, hidden)
    assert actual <= bound <= actual + 64 + 40 * items


@pytest.mark.parametrize("id_chars", [1, 31, 32, 255, 256])
@pytest.mark.parametrize(
    "metadata", [None, {}, {"trace": "é" * 40, "n": [1, 2.5, None, True], b"raw": b"\x00" * 300}]
)
@pytest.mark.parametrize("pooled", [False, True])
def test_result_size_bound_counts_each_requests_id_and_metadata_exactly(
    id_chars: int, metadata: dict[Any, Any] | None, pooled: bool
) -> None:
    """The bound reuses one encoded skeleton per model; the id and metadata (whose msgpack headers grow
    with their size) must come out as if that request's own skeleton had been encoded."""
    request = ScoreRequest(
        "ü" * id_chars, items=("a",), return_pooled_hidden_states=pooled, metadata=metadata
    )
    skeleton = ScoreResult(
        request.request_id,
        ResultStatus.OK,
        pooled_hidden_states=() if pooled else None,
        model="org/model-" + "m" * 40,
        timings={"tokenize_s": 0.0, "forward_s": 0.0, "copy_s": 0.0},
        metadata=metadata,
    )
    expected = len(encode_result(skeleton)) + _INT + 3 * _HEADER
    assert result_size_bound(request, skeleton.model, 0, 1, 8) == expected


def test_token_output_fields_round_trip_and_go_together() -> None:
    request = ScoreRequest(
        "steps",
        items=("a",),
        token_outputs="steps",
        step_separator="<extra_0>",
        return_token_hidden_states=True,
    )
    assert roundtrip_request(request) == request
    ranged = ScoreRequest("range", items=((1, 2, 3),), token_outputs="tokens", token_range=[-2, None])
    assert roundtrip_request(ranged).token_range == (-2, None)
    bad: list[dict[str, Any]] = [
        {"token_outputs": "words"},
        {"token_outputs": "steps", "step_separator": -1},
        {"token_outputs": "steps", "step_separator": ""},
        {"token_outputs": "tokens", "token_range": [0]},
        {"token_outputs": "tokens", "token_range": [0, 1.5]},
        {"step_separator": 5},  # without "steps"
        {"token_range": [0, 1]},  # without "tokens"
        {"return_token_hidden_states": True},  # at no token
        {"token_outputs": "tokens", "return_token_scores": False},  # asks for nothing
    ]
    for fields in bad:
        with pytest.raises(SchemaError) as error:
            ScoreRequest("r", items=("a",), **fields)
        assert error.value.code is ErrorCode.INVALID_REQUEST, fields


def test_token_outputs_of_a_result_round_trip_and_are_checked() -> None:
    scores = (Tensor.from_numpy(np.ones((2, 2), np.float32)), Tensor.from_numpy(np.zeros((0, 2), np.float32)))
    hidden = (Tensor.from_numpy(np.ones((2, 4), np.float16)), Tensor.from_numpy(np.zeros((0, 4), np.float16)))
    fields: dict[str, Any] = {
        "scores": ((0.5,), (0.25,)),
        "token_positions": ((3, 9), ()),
        "token_scores": scores,
        "token_hidden_states": hidden,
    }
    result = ScoreResult("r", ResultStatus.OK, **fields)
    assert roundtrip_result(result) == result
    wrong: list[dict[str, Any]] = [
        {**fields, "token_positions": ((3, 9),)},  # one entry for two items
        {**fields, "token_scores": scores[::-1]},  # rows that do not match the positions
        {**fields, "token_positions": None},  # tensors without positions
    ]
    for bad in wrong:
        with pytest.raises(SchemaError):
            ScoreResult("r", ResultStatus.OK, **bad)
    with pytest.raises(SchemaError):
        ScoreResult("r", ResultStatus.ERROR, error=ErrorInfo(ErrorCode.MODEL_ERROR, "x"), token_positions=())


def test_heads_and_adapter_fields_round_trip_and_are_checked() -> None:
    request = ScoreRequest("h", items=("a",), heads=["helpful", "safety"], adapter="tuned")
    assert roundtrip_request(request) == request and request.heads == ("helpful", "safety")
    for fields in ({"heads": []}, {"heads": ["a", "a"]}, {"heads": [""]}, {"heads": "a"}, {"adapter": ""}):
        with pytest.raises(SchemaError) as error:
            ScoreRequest("r", items=("a",), **fields)
        assert error.value.code is ErrorCode.INVALID_REQUEST, fields
    result = ScoreResult("h", ResultStatus.OK, scores=((0.5,),), head_scores={"safety": ((0.1, 0.9),)})
    assert roundtrip_result(result) == result
    with pytest.raises(SchemaError):
        ScoreResult("h", ResultStatus.OK, scores=((0.5,),), head_scores={"safety": ()})  # no array per item
