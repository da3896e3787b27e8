"""Images in a request: encoded bytes (PNG, JPEG, WebP), their limits, and the chat parts that place them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

from schemas._checks import describe, invalid, quoted
from schemas.errors import ErrorCode, SchemaError

# The contract's limits. Bytes bound what one record carries; pixels bound what decoding may allocate (a
# 1 MB PNG of one colour can claim 50,000 x 50,000 pixels, 7.5 GB decoded): the worker reads the size from
# the image's header and refuses it before decoding. 4096 x 4096 is far above what vision towers look at
# (Gemma 3 resizes to 896 x 896), and 64 MiB of RGB when decoded.
MAX_IMAGES = 16
MAX_IMAGE_BYTES = 8 * 1024 * 1024
MAX_IMAGE_PIXELS = 4096 * 4096
MAX_CONTENT_PARTS = 256


class ImageFormat(StrEnum):
    """The encodings a request's image may have, told apart by their first bytes."""

    PNG = "png"
    JPEG = "jpeg"
    WEBP = "webp"


def sniff_format(data: bytes) -> ImageFormat | None:
    """The image format its leading bytes announce (the files' magic numbers), or None for anything else."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return ImageFormat.PNG
    if data.startswith(b"\xff\xd8\xff"):
        return ImageFormat.JPEG
    if len(data) >= 12 and data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return ImageFormat.WEBP
    return None


def check_image(value: object, field: str) -> bytes:
    """One encoded image: binary of at most MAX_IMAGE_BYTES whose leading bytes are PNG, JPEG or WebP."""
    if not isinstance(value, bytes | bytearray | memoryview):
        raise invalid(
            f"{field} must be binary (the encoded PNG, JPEG or WebP file), not {describe(value)}; send the "
            f"file's bytes as msgpack binary, never a URL."
        )
    data = bytes(value)
    if len(data) > MAX_IMAGE_BYTES:
        raise SchemaError(
            ErrorCode.IMAGE_TOO_LARGE,
            f"{field} has {len(data)} bytes, more than the limit of {MAX_IMAGE_BYTES}; send a smaller or "
            f"more compressed image (the model sees it resized anyway).",
        )
    if sniff_format(data) is None:
        raise SchemaError(
            ErrorCode.IMAGE_FORMAT_NOT_SUPPORTED,
            f"{field} is not a PNG, JPEG or WebP file (its first bytes are {data[:8].hex() or 'none'}); "
            f"send it converted to one of those formats.",
        )
    return data


def check_images(value: object) -> tuple[bytes, ...] | None:
    """nil, or 1 to MAX_IMAGES encoded images."""
    if value is None:
        return None
    if not isinstance(value, list | tuple):
        raise invalid(
            f"images must be nil or an array of binary, not {describe(value)}; send the encoded PNG, JPEG or "
            f"WebP files' bytes."
        )
    if len(value) > MAX_IMAGES:
        raise SchemaError(
            ErrorCode.TOO_MANY_IMAGES,
            f"images has {len(value)} images, more than the limit of {MAX_IMAGES}; split the request or "
            f"send fewer images.",
        )
    if not value:
        raise invalid("images is an empty array; send nil when the request has no images.")
    return tuple(check_image(image, f"images[{index}]") for index, image in enumerate(value))


@dataclass(frozen=True, slots=True)
class ContentPart:
    """One part of a chat message's content, in the chat templates' shape: text, or where an image goes
    (the image itself is the request's next entry of `images`)."""

    type: str  # "text" or "image"
    text: str | None = None

    def __post_init__(self) -> None:
        if self.type == "text" and isinstance(self.text, str):
            return
        if self.type == "image" and self.text is None:
            return
        raise invalid(
            f"a content part has type {quoted(self.type, 40)} and text {describe(self.text)}; send "
            f'{{"type": "text", "text": <string>}} or {{"type": "image"}}.'
        )

    def as_template_part(self) -> dict[str, str]:
        """The part as chat templates read it."""
        return {"type": "image"} if self.type == "image" else {"type": "text", "text": self.text or ""}


def check_content_parts(value: list[object] | tuple[object, ...], field: str) -> tuple[ContentPart, ...]:
    """A message's content given as parts: 1 to MAX_CONTENT_PARTS maps {type, text}."""
    if not 1 <= len(value) <= MAX_CONTENT_PARTS:
        raise invalid(
            f"{field} has {len(value)} parts; send 1 to {MAX_CONTENT_PARTS}, or the text as a string."
        )
    parts = []
    for index, part in enumerate(value):
        name = f"{field}[{index}]"
        if isinstance(part, ContentPart):
            parts.append(part)
            continue
        if not isinstance(part, Mapping):
            raise invalid(
                f'{name} must be a map, not {describe(part)}; send maps such as {{"type": "image"}}.'
            )
        extra = [key for key in part if key not in ("type", "text")]
        if extra:
            raise invalid(
                f"{name} has the key {quoted(extra[0], 40)}; send only type and text in a content part."
            )
        try:
            parts.append(ContentPart(part.get("type"), part.get("text")))  # type: ignore[arg-type]
        except SchemaError as error:
            raise invalid(f"{name}: {error.message}") from None
    return tuple(parts)


def image_parts(content: str | tuple[ContentPart, ...]) -> int:
    """How many images a message's content places."""
    return 0 if isinstance(content, str) else sum(part.type == "image" for part in content)
