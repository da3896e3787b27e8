"""Each defect of a message gets its own stable code, a corrective sentence and, where readable, the id."""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np
import pytest

from schemas import (
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
    ],
    ids=["request-dtype", "result-status", "result-error-code"],
)
def test_messages_quote_user_input_briefly(body: dict[str, Any]) -> None:
    # An error result echoes its message: quoting a 100 KB field whole would make that result too large
    # to publish, and the producer would lose the precise code. The sentence still says what to change.
    decode = decode_request if "items" in body else decode_result
    with pytest.raises(SchemaError) as caught:
        decode(msgpack.packb(body))
    assert len(caught.value.message) < 400, caught.value.message[:200]
    assert "send" in caught.value.message
