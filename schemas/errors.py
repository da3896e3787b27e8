"""Stable error codes of the wire contract and the one exception the schemas package raises."""

from __future__ import annotations

from enum import StrEnum


class ErrorCode(StrEnum):
    """Outward error codes; never renamed or removed, only added (readers treat unknown codes as failures)."""

    MALFORMED_MESSAGE = "MALFORMED_MESSAGE"
    UNSUPPORTED_SCHEMA_VERSION = "UNSUPPORTED_SCHEMA_VERSION"
    INVALID_REQUEST = "INVALID_REQUEST"
    EMPTY_INPUT = "EMPTY_INPUT"
    TOKEN_ID_OUT_OF_RANGE = "TOKEN_ID_OUT_OF_RANGE"
    INPUT_TOO_LONG = "INPUT_TOO_LONG"
    LABEL_IDS_NOT_SUPPORTED = "LABEL_IDS_NOT_SUPPORTED"
    LABEL_IDS_REQUIRED = "LABEL_IDS_REQUIRED"
    LABEL_ID_OUT_OF_RANGE = "LABEL_ID_OUT_OF_RANGE"
    CHAT_TEMPLATE_MISSING = "CHAT_TEMPLATE_MISSING"
    RESULT_TOO_LARGE = "RESULT_TOO_LARGE"
    TOO_MANY_ITEMS = "TOO_MANY_ITEMS"
    REQUEST_TOO_LONG = "REQUEST_TOO_LONG"
    EXPIRED = "EXPIRED"
    REPLY_TOPIC_NOT_ALLOWED = "REPLY_TOPIC_NOT_ALLOWED"
    MODEL_ERROR = "MODEL_ERROR"
    INTERNAL_ERROR = "INTERNAL_ERROR"
    UNDECODABLE_RECORDS = "UNDECODABLE_RECORDS"
    STEP_SEPARATOR_INVALID = "STEP_SEPARATOR_INVALID"
    TOKEN_OUTPUTS_NOT_SUPPORTED = "TOKEN_OUTPUTS_NOT_SUPPORTED"
    ADAPTER_NOT_FOUND = "ADAPTER_NOT_FOUND"
    HEAD_NOT_FOUND = "HEAD_NOT_FOUND"
    TOO_MANY_IMAGES = "TOO_MANY_IMAGES"
    IMAGE_TOO_LARGE = "IMAGE_TOO_LARGE"
    IMAGE_TOO_MANY_PIXELS = "IMAGE_TOO_MANY_PIXELS"
    IMAGE_FORMAT_NOT_SUPPORTED = "IMAGE_FORMAT_NOT_SUPPORTED"
    IMAGE_UNDECODABLE = "IMAGE_UNDECODABLE"
    IMAGES_NOT_SUPPORTED = "IMAGES_NOT_SUPPORTED"
    COMPARE_INVALID = "COMPARE_INVALID"
    REWARD_COLUMN_REQUIRED = "REWARD_COLUMN_REQUIRED"
    REWARD_COLUMN_OUT_OF_RANGE = "REWARD_COLUMN_OUT_OF_RANGE"
    COMPARE_NOT_SUPPORTED = "COMPARE_NOT_SUPPORTED"


class SchemaError(Exception):
    """A message or value that breaks the wire contract; carries a stable code and a corrective sentence."""

    def __init__(
        self, code: ErrorCode, message: str, request_id: str | None = None, metadata: object = None
    ) -> None:
        super().__init__(code, message, request_id)
        self.code = code
        self.message = message
        self.request_id = request_id
        # The message's metadata when its map could be read and the metadata itself is valid: an error
        # result echoes it like any other result (None: nil, or nothing readable).
        self.metadata = metadata

    def __str__(self) -> str:
        return self.message

    def __repr__(self) -> str:
        return (
            f"SchemaError(code={self.code.value}, message={self.message!r}, request_id={self.request_id!r})"
        )

    def with_request_id(self, request_id: str | None, metadata: object = None) -> SchemaError:
        """The same error, tagged with the request id (and metadata) recovered from the message; what is
        already set is kept."""
        request_id = self.request_id if self.request_id is not None else request_id
        metadata = self.metadata if self.metadata is not None else metadata
        if request_id == self.request_id and metadata is self.metadata:
            return self
        return SchemaError(self.code, self.message, request_id, metadata)
