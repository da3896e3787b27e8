"""Decoding a request's images with Pillow: the announced format only, the pixel limit before decoding."""

from __future__ import annotations

import io
import warnings
from typing import Any

from schemas import MAX_IMAGE_PIXELS, ErrorCode, ImageFormat, sniff_format

# Pillow's names of the formats the contract admits; Image.open tries only the one the bytes announce, so a
# file cannot reach one of Pillow's many other decoders.
_PILLOW_FORMATS = {ImageFormat.PNG: "PNG", ImageFormat.JPEG: "JPEG", ImageFormat.WEBP: "WEBP"}


class ImageError(Exception):
    """An image of a request cannot be used; carries the outward error code."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def _undecodable(field: str, announced: str, exc: BaseException) -> ImageError:
    detail = f"{type(exc).__name__}: {str(exc)[:120]}"
    return ImageError(
        ErrorCode.IMAGE_UNDECODABLE,
        f"{field} announces {announced} but does not decode ({detail}); send the whole, valid file.",
    )


def decode_image(data: bytes, field: str, max_pixels: int = MAX_IMAGE_PIXELS) -> Any:
    """The image as an RGB PIL image; ImageError for a format outside the contract, a canvas larger than
    `max_pixels` (read from the header, before any pixel is decoded) or a file that does not decode."""
    from PIL import Image

    announced = sniff_format(data)
    if announced is None:  # the schema refuses these; a request built in code may not have passed it
        raise ImageError(
            ErrorCode.IMAGE_FORMAT_NOT_SUPPORTED,
            f"{field} is not a PNG, JPEG or WebP file; send it converted to one of those formats.",
        )
    name = _PILLOW_FORMATS[announced]
    try:
        with warnings.catch_warnings():
            # Pillow warns above its own bomb limit and raises above twice it; ours is lower and checked next.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=[name])  # reads the header only
    except Image.DecompressionBombError:
        raise _too_many_pixels(field, None, max_pixels) from None
    except Exception as exc:  # any decoder failure on a file's header is the file's fault
        raise _undecodable(field, name, exc) from None
    width, height = image.size
    if width * height > max_pixels:
        raise _too_many_pixels(field, (width, height), max_pixels)
    try:
        image.load()
        return image.convert("RGB")
    except Exception as exc:  # truncated or damaged data surfaces when the pixels are read
        raise _undecodable(field, name, exc) from None


def _too_many_pixels(field: str, size: tuple[int, int] | None, max_pixels: int) -> ImageError:
    shown = "a canvas beyond Pillow's own limit" if size is None else f"{size[0]} x {size[1]} pixels"
    return ImageError(
        ErrorCode.IMAGE_TOO_MANY_PIXELS,
        f"{field} has {shown}, more than the limit of {max_pixels} pixels; send it resized (the model sees "
        f"it resized anyway).",
    )
