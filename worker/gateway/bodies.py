"""Request and response bodies: JSON (orjson) or msgpack both ways, the size cap, hidden states as float
lists or base64 (little-endian float32, as OpenAI's embeddings API encodes them)."""

from __future__ import annotations

import base64
from typing import Any

import msgpack
import numpy as np
import orjson
from starlette.requests import Request
from starlette.responses import Response

from schemas import ErrorCode, Tensor
from worker.gateway.errors import GatewayCode, GatewayError, invalid

MSGPACK_TYPES = ("application/msgpack", "application/x-msgpack")
JSON_TYPE = "application/json"
ENCODINGS = ("float", "base64")


def wants_msgpack(header: str | None) -> bool:
    """Whether an Accept or Content-Type header names msgpack."""
    return header is not None and any(kind in header for kind in MSGPACK_TYPES)


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, refused with 413 as soon as it is known to pass `limit` bytes (declared or sent)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(size, limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(size: int, limit: int) -> GatewayError:
    return GatewayError(
        413, GatewayCode.BODY_TOO_LARGE, f"the body has {size} bytes or more; send at most {limit} bytes"
    )


def parse_body(raw: bytes, content_type: str | None) -> dict[str, Any]:
    """The body as a map: msgpack when its Content-Type says so, else JSON."""
    try:
        body = msgpack.unpackb(raw, raw=False) if wants_msgpack(content_type) else orjson.loads(raw)
    except (orjson.JSONDecodeError, ValueError, msgpack.UnpackException) as error:
        kind = "msgpack" if wants_msgpack(content_type) else "JSON"
        why = str(error) or type(error).__name__
        raise GatewayError(
            400, ErrorCode.MALFORMED_MESSAGE.value, f"the body is not valid {kind}: {why}"
        ) from None
    if not isinstance(body, dict):
        raise invalid(f"the body must be an object, not {type(body).__name__}")
    return body


def render(
    payload: object, accept: str | None, status: int = 200, headers: dict[str, str] | None = None
) -> Response:
    """The payload as msgpack when the caller accepts it, else as JSON."""
    if wants_msgpack(accept):
        content = msgpack.packb(payload, use_bin_type=True)
        return Response(content, status, headers, media_type=MSGPACK_TYPES[0])
    return Response(orjson.dumps(payload), status, headers, media_type=JSON_TYPE)


def encoding_format(body: dict[str, Any]) -> str:
    value = body.get("encoding_format") or "float"
    if value not in ENCODINGS:
        raise invalid(f'encoding_format is {value!r}; send "float" or "base64"', "encoding_format")
    return str(value)


def vector(tensor: Tensor, encoding: str) -> list[float] | str:
    """A pooled hidden state as floats, or as base64 of its little-endian float32 bytes."""
    values = tensor.to_numpy().astype(np.float32, copy=False)
    if encoding == "base64":
        return base64.b64encode(values.astype("<f4", copy=False).tobytes()).decode("ascii")
    return values.tolist()  # type: ignore[no-any-return]
