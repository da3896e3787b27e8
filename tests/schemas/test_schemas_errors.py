"""Each defect of a message gets its own stable code, a corrective sentence and, where readable, the id."""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np
import pytest

from schemas import (
    ChatMessage,
    ErrorCode,
    ErrorInfo,
    ResultStatus,
    SchemaError,
    ScoreRequest,
    ScoreResult,
    Tensor,
    decode_request,
    decode_result,
    encode_request,
)


def request_map(**changes: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"version": 1, "request_id": "req-7", "query": "q", "items": ["a", "b"]}
    body.update(changes)
    return body


def result_map(**changes: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"version": 1, "request_id": "res-7", "status": "ok", "scores": [[1.0]]}
    body.update(changes)
    return body


def request_error(body: object) -> SchemaError:
    with pytest.raises(SchemaError) as caught:
        decode_request(msgpack.packb(body))
    return caught.value


def result_error(body: object) -> SchemaError:
    with pytest.raises(SchemaError) as caught:
        decode_result(msgpack.packb(body))
    return caught.value


def assert_sentence(error: SchemaError, *fragments: str) -> None:
    """A full sentence that names what is wrong and says what to send instead."""
    assert error.message.endswith("."), error.message
    assert "send" in error.message.lower() or "use " in error.message.lower(), error.message
    for fragment in fragments:
        assert fragment in error.message, error.message


@pytest.mark.parametrize("payload", [b"", b"\xc1", b"\x92\x01", b"\x81\xa1a", b"\xa2\xff\xfe", b"\x01\x02"])
def test_malformed_bytes(payload: bytes) -> None:
    for decode in (decode_request, decode_result):
        with pytest.raises(SchemaError) as caught:
            decode(payload)
        assert caught.value.code is ErrorCode.MALFORMED_MESSAGE and caught.value.request_id is None
        assert_sentence(caught.value)


@pytest.mark.parametrize("top", [[1, 2], "text", 5, None, True, b"bin"])
def test_non_map_top_level(top: object) -> None:
    error = request_error(top)
    assert error.code is ErrorCode.MALFORMED_MESSAGE
    assert_sentence(error, "top level")


def test_non_bytes_record_value_is_malformed() -> None:
    for value in (None, "text", 12):
        with pytest.raises(SchemaError) as caught:
            decode_request(value)  # type: ignore[arg-type]
        assert caught.value.code is ErrorCode.MALFORMED_MESSAGE


@pytest.mark.parametrize(
    "ext",
    [
        msgpack.ExtType(5, b"pickle?"),
        msgpack.ExtType(0, b""),
        msgpack.Timestamp(10, 5),
        msgpack.Timestamp(2**40, 1),
    ],
)
def test_extension_types_are_refused_anywhere(ext: object) -> None:
    for body in (request_map(metadata={"x": [ext]}), request_map(unknown_key=ext), ext):
        error = request_error(body)
        assert error.code is ErrorCode.MALFORMED_MESSAGE
        assert_sentence(error, "extension")
    assert result_error(result_map(metadata=ext)).code is ErrorCode.MALFORMED_MESSAGE


def test_non_string_map_keys_are_malformed() -> None:
    assert request_error({1: "x", "version": 1}).code is ErrorCode.MALFORMED_MESSAGE


@pytest.mark.parametrize("version", [2, 0, 99])
def test_other_version_is_unsupported_and_keeps_request_id(version: int) -> None:
    # A newer message may be shaped differently: its other fields must not be judged.
    error = request_error({"version": version, "request_id": "future-1", "payload": {"v2": True}})
    assert error.code is ErrorCode.UNSUPPORTED_SCHEMA_VERSION
    assert error.request_id == "future-1"
    assert_sentence(error, "send version 1")
    result = result_error({"version": version, "request_id": "future-2"})
    assert (result.code, result.request_id) == (ErrorCode.UNSUPPORTED_SCHEMA_VERSION, "future-2")


@pytest.mark.parametrize("version", [None, "1", 1.0, True])
def test_missing_or_non_integer_version_is_invalid(version: object) -> None:
    error = request_error(request_map(version=version))
    assert error.code is ErrorCode.INVALID_REQUEST and error.request_id == "req-7"
    assert_sentence(error, "version")


def test_mixed_text_query_and_token_item() -> None:
    error = request_error(request_map(items=["a", [1, 2]]))
    assert (error.code, error.request_id) == (ErrorCode.INVALID_REQUEST, "req-7")
    assert_sentence(error, "query is text", "items[1] is an array of token ids", "all of them")


def test_mixed_items_without_query() -> None:
    error = request_error(request_map(query=None, items=[[1], "b"]))
    assert error.code is ErrorCode.INVALID_REQUEST
    assert_sentence(error, "items[0] is an array of token ids", "items[1] is text")


def test_token_query_with_text_items() -> None:
    with pytest.raises(SchemaError) as caught:
        ScoreRequest("r", items=("a",), query=(1, 2))
    assert caught.value.code is ErrorCode.INVALID_REQUEST and caught.value.request_id == "r"


@pytest.mark.parametrize(
    ("tokens", "fragment"),
    [
        ([-1], "items[0][0] is -1"),
        ([5, 2**31], "items[0][1] is 2147483648"),
        ([1, True], "items[0][1]"),
        ([1, 2.0], "items[0][1]"),
        ([1, "2"], "items[0][1]"),
        ([1, None], "items[0][1]"),
    ],
)
def test_bad_token_ids(tokens: list[object], fragment: str) -> None:
    error = request_error(request_map(query=None, items=[tokens]))
    assert (error.code, error.request_id) == (ErrorCode.INVALID_REQUEST, "req-7")
    assert_sentence(error, fragment, "[0, 2**31)")


def test_negative_token_id_in_query() -> None:
    error = request_error(request_map(query=[3, -5], items=[[1]]))
    assert_sentence(error, "query[1] is -5")


@pytest.mark.parametrize("dtype", ["float64", "FLOAT32", "bf16", "", 32, True])
def test_bad_hidden_states_dtype(dtype: object) -> None:
    error = request_error(request_map(hidden_states_dtype=dtype))
    assert (error.code, error.request_id) == (ErrorCode.INVALID_REQUEST, "req-7")
    assert_sentence(error, "hidden_states_dtype", '"bfloat16"')


@pytest.mark.parametrize(
    ("changes", "fragment"),
    [
        ({"request_id": None}, "request_id is missing"),
        ({"request_id": ""}, "1 to 256 characters"),
        ({"request_id": "x" * 257}, "257 characters"),
        ({"request_id": 17}, "request_id must be a string"),
        ({"items": None}, "items is missing"),
        ({"items": "abc"}, "items must be an array"),
        ({"items": [{"t": 1}]}, "items[0] must be a string"),
        ({"query": 3}, "query must be a string"),
        ({"item_first": 1}, "item_first must be a boolean"),
        ({"apply_softmax": "true"}, "apply_softmax must be a boolean"),
        ({"return_pooled_hidden_states": 0}, "return_pooled_hidden_states must be a boolean"),
    ],
)
def test_bad_request_fields_name_the_field(changes: dict[str, Any], fragment: str) -> None:
    error = request_error(request_map(**changes))
    assert error.code is ErrorCode.INVALID_REQUEST
    assert_sentence(error, fragment)
    recoverable = "request_id" not in changes
    assert error.request_id == ("req-7" if recoverable else None)


def test_constructor_validates_like_the_decoder() -> None:
    with pytest.raises(SchemaError) as caught:
        ScoreRequest("r", items=(), metadata={"bad": object()})
    assert caught.value.code is ErrorCode.INVALID_REQUEST and "metadata" in caught.value.message
    with pytest.raises(SchemaError):
        ScoreRequest("r", items=(), metadata={1: "integer key"})
    with pytest.raises(SchemaError):
        ScoreRequest("r", items=(), metadata=2**64)
    deep: list[object] = []
    for _ in range(100):
        deep = [deep]
    with pytest.raises(SchemaError, match="nested deeper"):
        ScoreRequest("r", items=(), metadata=deep)
    with pytest.raises(SchemaError) as caught:
        ScoreRequest("r", items=(), version=2)
    assert caught.value.code is ErrorCode.UNSUPPORTED_SCHEMA_VERSION


def test_tensor_data_length_mismatch() -> None:
    tensor = {"dtype": "float32", "shape": [2, 3], "data": b"\x00" * 20}
    error = result_error(result_map(pooled_hidden_states=[tensor]))
    assert (error.code, error.request_id) == (ErrorCode.INVALID_REQUEST, "res-7")
    assert_sentence(error, "pooled_hidden_states[0].data has 20 bytes", "needs 24")
    with pytest.raises(SchemaError, match="needs 6"):
        Tensor("bfloat16", (3,), b"\x00" * 5)


@pytest.mark.parametrize(
    ("tensor", "fragment"),
    [
        ({"dtype": "float64", "shape": [1], "data": b"\x00" * 8}, "dtype"),
        ({"dtype": "float32", "shape": [-1], "data": b""}, "shape[0]"),
        ({"dtype": "float32", "shape": 4, "data": b"\x00" * 16}, "shape"),
        ({"dtype": "float32", "shape": [1], "data": "abcd"}, "data must be binary"),
        ([1, 2], "must be a map"),
    ],
)
def test_bad_tensor_parts(tensor: object, fragment: str) -> None:
    error = result_error(result_map(pooled_hidden_states=[tensor]))
    assert error.code is ErrorCode.INVALID_REQUEST and fragment in error.message


def test_tensor_constructors_refuse_wrong_numpy_dtypes() -> None:
    with pytest.raises(SchemaError, match="float32 or float16"):
        Tensor.from_numpy(np.zeros(3, dtype=np.float64))
    with pytest.raises(SchemaError, match="uint16 or int16"):
        Tensor.from_bfloat16_bits(np.zeros(3, dtype=np.float16))


@pytest.mark.parametrize(
    ("changes", "fragment"),
    [
        ({"status": "done"}, "status"),
        ({"status": None}, "status is missing"),
        ({"scores": [1.0]}, "scores[0]"),
        ({"scores": [["x"]]}, "scores[0][0]"),
        ({"prompt_tokens": -1}, "prompt_tokens"),
        ({"timings": {"a": "slow"}}, "timings"),
        ({"error": {"code": "MODEL_ERROR", "message": "m"}}, "ok"),
        ({"status": "error", "scores": []}, "no error"),
        ({"status": "error", "error": {"code": 5, "message": "m"}}, "error.code"),
        ({"status": "error", "error": {"code": "MODEL_ERROR"}}, "error.message"),
        ({"pooled_hidden_states": []}, "one tensor per item"),
    ],
)
def test_bad_result_fields(changes: dict[str, Any], fragment: str) -> None:
    error = result_error(result_map(**changes))
    assert (error.code, error.request_id) == (ErrorCode.INVALID_REQUEST, "res-7")
    assert fragment in error.message and error.message.endswith(".")


def test_error_result_with_scores_or_states_is_refused() -> None:
    error = ErrorInfo(ErrorCode.MODEL_ERROR, "The forward pass failed; retry the request.")
    with pytest.raises(SchemaError, match="carries scores"):
        ScoreResult("r", ResultStatus.ERROR, scores=((1.0,),), error=error)
    with pytest.raises(SchemaError, match="carries scores"):
        ScoreResult("r", ResultStatus.ERROR, pooled_hidden_states=(), error=error)


def test_unencodable_string_raises_schema_error_on_encode() -> None:
    request = ScoreRequest("r", items=("lone surrogate \ud800",))
    with pytest.raises(SchemaError) as caught:
        encode_request(request)
    assert caught.value.code is ErrorCode.INVALID_REQUEST and caught.value.request_id == "r"


def test_a_decoder_defect_still_surfaces_as_schema_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(value: object, field: str) -> Tensor:
        raise KeyError(field)

    monkeypatch.setattr("schemas.codec._tensor_from_wire", broken)
    tensor = {"dtype": "float32", "shape": [1], "data": b"\x00" * 4}
    error = result_error(result_map(pooled_hidden_states=[tensor]))
    assert (error.code, error.request_id) == (ErrorCode.INTERNAL_ERROR, "res-7")
    assert isinstance(error.__cause__, KeyError)


@pytest.mark.parametrize(
    "body",
    [
        request_map(hidden_states_dtype="é" * 100_000),
        result_map(status="x" * 100_000),
        result_map(status="error", error={"code": "Z" * 100_000, "message": "m"}),
        request_map(truncate="é" * 100_000),
        request_map(requires=["é" * 100_000, *(f"unknown_{n}" * 1000 for n in range(63))]),
        request_map(query=None, messages=[{"role": "user", "content": "c", "k" * 100_000: 1}]),
        request_map(query=None, messages=[{"role": "r" * 100_000, "content": "c"}]),
    ],
    ids=[
        "request-dtype",
        "result-status",
        "result-error-code",
        "request-truncate",
        "request-requires",
        "request-message-key",
        "request-message-role",
    ],
)
def test_messages_quote_user_input_briefly(body: dict[str, Any]) -> None:
    # An error result echoes its message: quoting a 100 KB field whole would make that result too large
    # to publish, and the producer would lose the precise code. The sentence still says what to change.
    decode = decode_request if "items" in body else decode_result
    with pytest.raises(SchemaError) as caught:
        decode(msgpack.packb(body))
    assert len(caught.value.message) < 400, caught.value.message[:200]
    assert "send" in caught.value.message


CHAT = [{"role": "system", "content": "Judge the reply."}, {"role": "user", "content": "2 + 2?"}]


def chat_map(**changes: Any) -> dict[str, Any]:
    return request_map(**{"query": None, "messages": CHAT, **changes})


def test_chat_template_request_is_valid() -> None:
    # The error cases below only mean something if the unchanged chat request decodes.
    request = decode_request(msgpack.packb(chat_map()))
    assert request.messages == (ChatMessage("system", "Judge the reply."), ChatMessage("user", "2 + 2?"))


@pytest.mark.parametrize(
    ("changes", "fragments"),
    [
        ({"label_token_ids": 5}, ["label_token_ids must be nil or an array", "1 to 256 distinct"]),
        ({"label_token_ids": "Yes"}, ["label_token_ids must be nil or an array", "not a string"]),
        ({"label_token_ids": []}, ["label_token_ids has 0 ids", "send nil"]),
        ({"label_token_ids": list(range(257))}, ["label_token_ids has 257 ids", "1 to 256"]),
        ({"label_token_ids": [3, 9, 3]}, ["label_token_ids[2] repeats 3 (label_token_ids[0])", "once"]),
        ({"label_token_ids": [1, -1]}, ["label_token_ids[1] is -1", "[0, 2**31)"]),
        ({"label_token_ids": [2**31]}, ["label_token_ids[0] is 2147483648", "[0, 2**31)"]),
        ({"label_token_ids": [1, True]}, ["label_token_ids[1] must be an integer token id", "[0, 2**31)."]),
        ({"label_token_ids": [1.0]}, ["label_token_ids[0] must be an integer token id, not a float"]),
        ({"label_token_ids": ["Yes"]}, ["label_token_ids[0] must be an integer token id, not a string"]),
        ({"truncate": "left"}, ["truncate is 'left'", '"query_left"', '"item_right"']),
        ({"truncate": "QUERY_LEFT"}, ["truncate is 'QUERY_LEFT'", '"query_left"']),
        ({"truncate": ""}, ["truncate is ''", '"none"']),
        ({"truncate": True}, ["truncate is a boolean", '"none"']),
        ({"truncate": ["item_left"]}, ["truncate is an array", '"item_left"']),
        ({"requires": "messages"}, ["requires must be nil or an array", "not a string"]),
        ({"requires": [["messages"]]}, ["requires[0] must be a string, not an array", '"messages"']),
        ({"requires": ["messages", None]}, ["requires[1] must be a string, not nil"]),
        ({"requires": ["messages"] * 65}, ["requires has 65 names", "at most 64"]),
        ({"messages": "hello"}, ["messages must be nil or an array of maps {role, content}", "not a string"]),
        ({"messages": []}, ["messages has 0 messages", "send nil (no conversation)"]),
        ({"messages": CHAT * 129}, ["messages has 258 messages", "1 to 256"]),
        ({"messages": ["hi"]}, ["messages[0] must be a map {role, content}", "not a string"]),
        ({"messages": [*CHAT, ["user", "hi"]]}, ["messages[2] must be a map", "not an array"]),
        ({"messages": [{"role": "user", "content": "c", "name": "x"}]}, ["messages[0] has the key 'name'"]),
        ({"messages": [{"role": "user", "contents": "c"}]}, ["messages[0] has the key 'contents'"]),
        ({"messages": [{"role": "user", "content": "c", b"x": 1}]}, ["messages[0] has the key b'x'"]),
        ({"messages": [{"content": "c"}]}, ["messages[0].role is missing", '"user"']),
        ({"messages": [{"role": None, "content": "c"}]}, ["messages[0].role is missing"]),
        ({"messages": [{"role": "", "content": "c"}]}, ["messages[0].role has 0 characters", "1 to 32"]),
        ({"messages": [{"role": "r" * 33, "content": "c"}]}, ["messages[0].role has 33 characters"]),
        ({"messages": [{"role": 1, "content": "c"}]}, ["messages[0].role must be a string, not an integer"]),
        ({"messages": [*CHAT, {"role": "user"}]}, ["messages[2].content is missing", "may be empty"]),
        (
            {"messages": [{"role": "user", "content": b"c"}]},
            ["messages[0].content must be a string or an array of parts, not binary"],
        ),
        ({"messages": [{"role": "user", "content": ["c"]}]}, ["messages[0].content[0] must be a map"]),
    ],
)
def test_bad_new_request_fields_name_the_field(changes: dict[str, Any], fragments: list[str]) -> None:
    body = chat_map(**changes) if "messages" not in changes else request_map(query=None, **changes)
    error = request_error(body)
    assert (error.code, error.request_id) == (ErrorCode.INVALID_REQUEST, "req-7")
    assert_sentence(error, *fragments)


@pytest.mark.parametrize(
    ("changes", "fragments"),
    [
        ({"query": "Q: "}, ["query is set together with messages", "query nil"]),
        ({"query": [1, 2], "items": [[3]]}, ["query is set together with messages", "query nil"]),
        ({"item_first": True}, ["item_first is true together with messages", "send item_first false"]),
        (
            {"items": [[1, 2]]},
            ["items[0] is an array of token ids but messages is set", "every item as text"],
        ),
        ({"items": [[]]}, ["items[0] is an array of token ids but messages is set"]),
    ],
)
def test_messages_rules(changes: dict[str, Any], fragments: list[str]) -> None:
    error = request_error(chat_map(**changes))
    assert (error.code, error.request_id) == (ErrorCode.INVALID_REQUEST, "req-7")
    assert_sentence(error, *fragments)


def test_messages_allow_no_items_and_empty_replies() -> None:
    assert decode_request(msgpack.packb(chat_map(items=[]))).items == ()
    assert decode_request(msgpack.packb(chat_map(items=["", "4"]))).items == ("", "4")


def test_requires_with_one_unknown_name() -> None:
    error = request_error(request_map(requires=["messages", "pooling"]))
    assert (error.code, error.request_id) == (ErrorCode.INVALID_REQUEST, "req-7")
    assert error.message.startswith("requires names 'pooling', which this worker does not understand")
    assert_sentence(error, "schema version 1", "remove it from requires")


def test_requires_with_several_unknown_names_names_them_once_each() -> None:
    error = request_error(request_map(requires=["pooling", "truncate", "pooling", "Messages"]))
    assert error.message.startswith("requires names 'pooling', 'Messages', which")
    assert_sentence(error, "remove them from requires")
    many = request_error(request_map(requires=[f"field_{n}" for n in range(10)]))
    assert_sentence(many, "'field_0', 'field_1', 'field_2' and 7 more")


@pytest.mark.parametrize("name", ["", "Query", "query ", "x-request-id", "scores", "truncated_tokens"])
def test_requires_refuses_names_that_are_not_request_fields(name: str) -> None:
    # Result fields and headers are not request fields: a producer cannot require them.
    error = request_error(request_map(requires=[name]))
    assert error.code is ErrorCode.INVALID_REQUEST and "does not understand" in error.message


def test_requires_is_checked_before_the_other_fields() -> None:
    # A field this worker lacks may be what makes the others valid, so "not understood" must win.
    error = request_error(request_map(items=["a", [1]], requires=["mixed_inputs"]))
    assert "requires names 'mixed_inputs'" in error.message
    assert request_error(request_map(requires=["mixed_inputs"], version=2)).code is (
        ErrorCode.UNSUPPORTED_SCHEMA_VERSION
    )


def test_constructor_validates_new_fields_like_the_decoder() -> None:
    cases: list[tuple[dict[str, Any], str]] = [
        ({"label_token_ids": (1, 1)}, "repeats 1"),
        ({"label_token_ids": np.array([[1, 2]])}, "label_token_ids must be nil or an array"),
        ({"messages": ({"role": "user"},)}, "messages[0].content is missing"),
        ({"messages": (ChatMessage("user", "x"),), "query": "q"}, "query is set together with messages"),
        ({"truncate": "query-left"}, "truncate is 'query-left'"),
        ({"requires": ("pooling",)}, "requires names 'pooling'"),
    ]
    for changes, fragment in cases:
        with pytest.raises(SchemaError) as caught:
            ScoreRequest("r", items=("a",), **changes)
        assert (caught.value.code, caught.value.request_id) == (ErrorCode.INVALID_REQUEST, "r")
        assert fragment in caught.value.message, caught.value.message


@pytest.mark.parametrize(
    ("role", "content", "fragment"),
    [
        ("", "c", "message.role has 0 characters"),
        ("r" * 33, "c", "message.role has 33 characters"),
        (None, "c", "message.role is missing"),
        (5, "c", "message.role must be a string"),
        ("user", None, "message.content is missing"),
        ("user", 3, "message.content must be a string or an array of parts"),
    ],
)
def test_chat_message_validates_itself(role: Any, content: Any, fragment: str) -> None:
    with pytest.raises(SchemaError) as caught:
        ChatMessage(role, content)
    assert caught.value.code is ErrorCode.INVALID_REQUEST
    assert_sentence(caught.value, fragment)


@pytest.mark.parametrize(
    ("changes", "fragment"),
    [
        ({"truncated_tokens": 3}, "truncated_tokens must be nil or an array of integers"),
        ({"truncated_tokens": [-1]}, "truncated_tokens[0] is -1"),
        ({"truncated_tokens": [True]}, "truncated_tokens[0] must be an integer"),
        ({"truncated_tokens": [1.0]}, "truncated_tokens[0] must be an integer"),
        ({"truncated_tokens": []}, "truncated_tokens has 0 counts for 1 items"),
        ({"truncated_tokens": [0, 0]}, "truncated_tokens has 2 counts for 1 items"),
        ({"status": "error", "scores": [], "error": {"code": "MODEL_ERROR", "message": "m"},
          "truncated_tokens": [0]}, '"error" result carries truncated_tokens'),
    ],
)  # fmt: skip
def test_bad_truncated_tokens(changes: dict[str, Any], fragment: str) -> None:
    error = result_error(result_map(**changes))
    assert (error.code, error.request_id) == (ErrorCode.INVALID_REQUEST, "res-7")
    assert_sentence(error, fragment)


@pytest.mark.parametrize(
    ("changes", "code"),
    [
        ({"version": 2}, ErrorCode.UNSUPPORTED_SCHEMA_VERSION),
        ({"items": "not a list"}, ErrorCode.INVALID_REQUEST),
        ({"requires": ["pooling"]}, ErrorCode.INVALID_REQUEST),
        ({"request_id": "r" * 300}, ErrorCode.INVALID_REQUEST),
    ],
)
def test_a_refused_request_carries_its_metadata_for_the_error_result(
    changes: dict[str, Any], code: ErrorCode
) -> None:
    """Whenever the map could be read, the error result echoes its metadata, as any result does."""
    metadata = {"trace": "abc", "attempt": 2, b"binary-key": [1.5, None]}
    raw = msgpack.packb(request_map(metadata=metadata, **changes), use_bin_type=True)
    with pytest.raises(SchemaError) as caught:
        decode_request(raw)
    assert caught.value.code is code
    assert caught.value.metadata == metadata
    assert caught.value.request_id == (None if "request_id" in changes else "req-7")


def test_metadata_that_is_itself_invalid_or_unreadable_is_not_carried() -> None:
    deep: Any = None
    for _ in range(100):
        deep = [deep]
    with pytest.raises(SchemaError) as caught:
        decode_request(msgpack.packb(request_map(metadata=deep), use_bin_type=True))
    assert caught.value.code is ErrorCode.INVALID_REQUEST and caught.value.metadata is None
    with pytest.raises(SchemaError) as caught:
        decode_request(b"\xc1 not msgpack")
    assert caught.value.metadata is None
