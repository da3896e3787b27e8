"""What a call that fails is answered with: an HTTP status, a stable code, a sentence, and when to retry."""

from __future__ import annotations

from enum import StrEnum

from schemas import ErrorCode


class GatewayCode(StrEnum):
    """Codes of failures the gateway itself finds (beside the workers' ErrorCode, which it passes on)."""

    UNAUTHORIZED = "UNAUTHORIZED"
    NOT_FOUND = "NOT_FOUND"
    BODY_TOO_LARGE = "BODY_TOO_LARGE"
    READ_TIMEOUT = "READ_TIMEOUT"
    TOO_MANY_CALLS = "TOO_MANY_CALLS"
    NO_WORKER = "NO_WORKER"
    BROKER_UNAVAILABLE = "BROKER_UNAVAILABLE"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"


class GatewayError(Exception):
    """A call answered with an error: `status` for HTTP, `code` stable for programs, `message` for people."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        retry_after_s: float | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s
        self.param = param

    def body(self) -> dict[str, object]:
        """The OpenAI error shape (vLLM and SGLang answer in it too), `code` the stable code."""
        kind = _TYPES.get(self.status, "error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def invalid(message: str, param: str | None = None) -> GatewayError:
    """A request body the gateway refuses before it reaches Kafka."""
    return GatewayError(400, ErrorCode.INVALID_REQUEST.value, message, param=param)


_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    408: "RequestTimeoutError",
    413: "RequestTooLargeError",
    429: "RateLimitError",
    500: "InternalServerError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "TimeoutError",
}

# A worker's error result as an HTTP status: limits are 413, a lapsed deadline 504, the worker's own failure
# 500, a reply topic the workers refuse 502 (the gateway's configuration, not the caller's request); every
# other code is something the caller can change in the request: 400.
_STATUS_OF_CODE: dict[ErrorCode, int] = {
    ErrorCode.TOO_MANY_ITEMS: 413,
    ErrorCode.REQUEST_TOO_LONG: 413,
    ErrorCode.RESULT_TOO_LARGE: 413,
    ErrorCode.IMAGE_TOO_LARGE: 413,
    ErrorCode.TOO_MANY_IMAGES: 413,
    ErrorCode.EXPIRED: 504,
    ErrorCode.MODEL_ERROR: 500,
    ErrorCode.INTERNAL_ERROR: 500,
    ErrorCode.UNDECODABLE_RECORDS: 500,
    ErrorCode.REPLY_TOPIC_NOT_ALLOWED: 502,
}


def status_of(code: ErrorCode) -> int:
    """The HTTP status a worker's error code is answered with."""
    return _STATUS_OF_CODE.get(code, 400)
