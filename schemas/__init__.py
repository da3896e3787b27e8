"""The wire contract of score-worker (version 1): message types, validation, msgpack codec, headers."""

from schemas._checks import Input
from schemas.codec import decode_request, decode_result, encode_request, encode_result, result_size_bound
from schemas.compare import Compare
from schemas.errors import ErrorCode, SchemaError
from schemas.headers import (
    HEADER_CONTENT_TYPE,
    HEADER_CORRELATION_ID,
    HEADER_ERROR_CODE,
    HEADER_ERROR_MESSAGE,
    HEADER_REPLY_TOPIC,
    HEADER_REQUEST_ID,
    HEADER_SCHEMA_VERSION,
    HEADER_SOURCE_LAST_OFFSET,
    HEADER_SOURCE_OFFSET,
    HEADER_SOURCE_PARTITION,
    HEADER_SOURCE_TOPIC,
    HEADER_UNDECODABLE_CAUSE,
    REQUEST_CONTENT_TYPE,
    RESULT_CONTENT_TYPE,
    Headers,
    header_request_id,
    header_value,
    headers_to_dict,
    request_headers,
    result_headers,
)
from schemas.images import (
    MAX_IMAGE_BYTES,
    MAX_IMAGE_PIXELS,
    MAX_IMAGES,
    ContentPart,
    ImageFormat,
    sniff_format,
)
from schemas.request import ChatMessage, ScoreRequest, TokenOutputs, Truncation
from schemas.result import ErrorInfo, ResultStatus, ScoreResult
from schemas.tensor import HiddenDType, Tensor
from schemas.topics import DLQ_TOPIC, REQUESTS_TOPIC, RESULTS_TOPIC
from schemas.version import SCHEMA_VERSION

__all__ = [
    "DLQ_TOPIC",
    "HEADER_CONTENT_TYPE",
    "HEADER_CORRELATION_ID",
    "HEADER_ERROR_CODE",
    "HEADER_ERROR_MESSAGE",
    "HEADER_REPLY_TOPIC",
    "HEADER_REQUEST_ID",
    "HEADER_SCHEMA_VERSION",
    "HEADER_SOURCE_LAST_OFFSET",
    "HEADER_SOURCE_OFFSET",
    "HEADER_SOURCE_PARTITION",
    "HEADER_SOURCE_TOPIC",
    "HEADER_UNDECODABLE_CAUSE",
    "MAX_IMAGES",
    "MAX_IMAGE_BYTES",
    "MAX_IMAGE_PIXELS",
    "REQUESTS_TOPIC",
    "REQUEST_CONTENT_TYPE",
    "RESULTS_TOPIC",
    "RESULT_CONTENT_TYPE",
    "SCHEMA_VERSION",
    "ChatMessage",
    "Compare",
    "ContentPart",
    "ErrorCode",
    "ErrorInfo",
    "Headers",
    "HiddenDType",
    "ImageFormat",
    "Input",
    "ResultStatus",
    "SchemaError",
    "ScoreRequest",
    "ScoreResult",
    "Tensor",
    "TokenOutputs",
    "Truncation",
    "decode_request",
    "decode_result",
    "encode_request",
    "encode_result",
    "header_request_id",
    "header_value",
    "headers_to_dict",
    "request_headers",
    "result_headers",
    "result_size_bound",
    "sniff_format",
]
