"""Images in requests on the wire: the field, the content parts that place them, and their error codes."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest

from schemas import (
    MAX_IMAGE_BYTES,
    MAX_IMAGES,
    ChatMessage,
    ContentPart,
    ErrorCode,
    ImageFormat,
    SchemaError,
    ScoreRequest,
    decode_request,
    encode_request,
    sniff_format,
)

PNG = b"\x89PNG\r\n\x1a\n" + b"\x00" * 16
JPEG = b"\xff\xd8\xff\xe0" + b"\x00" * 16
WEBP = b"RIFF\x10\x00\x00\x00WEBPVP8 " + b"\x00" * 8


def _wire(**fields: Any) -> bytes:
    return msgpack.packb({"version": 1, "request_id": "img-1", "items": ["a"], **fields}, use_bin_type=True)


def _refused(**fields: Any) -> SchemaError:
    with pytest.raises(SchemaError) as caught:
        decode_request(_wire(**fields))
    assert caught.value.request_id == "img-1"
    assert caught.value.message.endswith(".") and "send" in caught.value.message.lower()
    return caught.value


def test_formats_are_told_by_their_first_bytes() -> None:
    assert [sniff_format(data) for data in (PNG, JPEG, WEBP)] == [
        ImageFormat.PNG,
        ImageFormat.JPEG,
        ImageFormat.WEBP,
    ]
    # GIF, BMP, TIFF, a RIFF that is not WebP, nothing at all.
    for other in (b"GIF89a....", b"BM......", b"II*\x00....", b"RIFF\x00\x00\x00\x00WAVE", b""):
        assert sniff_format(other) is None


def test_images_and_parts_round_trip() -> None:
    parts = (ContentPart("image"), ContentPart("text", "Which answer fits?"), ContentPart("image"))
    request = ScoreRequest(
        "img-1",
        items=("yes", "no"),
        messages=(ChatMessage("system", "Judge."), ChatMessage("user", parts)),
        images=(PNG, WEBP),
        requires=("images", "messages"),
    )
    payload = encode_request(request)
    assert decode_request(payload) == request
    wire = msgpack.unpackb(payload)
    assert wire["images"] == [PNG, WEBP]
    assert wire["messages"][1]["content"] == [
        {"type": "image"},
        {"type": "text", "text": "Which answer fits?"},
        {"type": "image"},
    ]


def test_parts_may_come_as_maps_and_images_without_messages() -> None:
    content = [{"type": "text", "text": "Describe"}, {"type": "image"}]
    decoded = decode_request(_wire(messages=[{"role": "user", "content": content}], images=[JPEG]))
    assert decoded.messages is not None and decoded.messages[0].content == (
        ContentPart("text", "Describe"),
        ContentPart("image"),
    )
    assert decode_request(_wire(query="Caption: ", images=[PNG, JPEG])).images == (PNG, JPEG)


def test_a_request_without_images_is_as_before() -> None:
    assert decode_request(_wire()).images is None


def test_too_many_images() -> None:
    assert _refused(images=[PNG] * (MAX_IMAGES + 1)).code is ErrorCode.TOO_MANY_IMAGES
    assert decode_request(_wire(images=[PNG] * MAX_IMAGES)).images == (PNG,) * MAX_IMAGES


def test_too_large_image_names_the_limit() -> None:
    error = _refused(images=[PNG, JPEG + b"\x00" * (MAX_IMAGE_BYTES - len(JPEG) + 1)])
    assert error.code is ErrorCode.IMAGE_TOO_LARGE and "images[1]" in error.message
    assert str(MAX_IMAGE_BYTES) in error.message
    exact = JPEG + b"\x00" * (MAX_IMAGE_BYTES - len(JPEG))
    assert decode_request(_wire(images=[exact])).images == (exact,)


@pytest.mark.parametrize("data", [b"GIF89a\x01\x00\x01\x00", b"<svg/>", b"", b"\x89PN"])
def test_unsupported_format(data: bytes) -> None:
    error = _refused(images=[PNG, data])
    assert error.code is ErrorCode.IMAGE_FORMAT_NOT_SUPPORTED and "images[1]" in error.message


@pytest.mark.parametrize(
    ("fields", "fragment"),
    [
        ({"images": "https://example.com/cat.png"}, "images must be nil or an array of binary"),
        ({"images": ["https://example.com/cat.png"]}, "images[0] must be binary"),
        ({"images": []}, "images is an empty array"),
        ({"query": [1, 2], "items": [[3]], "images": [PNG]}, "token-id inputs"),
        ({"images": [PNG], "truncate": "item_right"}, "truncate is set on a request with images"),
        ({"messages": [{"role": "user", "content": [{"type": "image"}]}]}, "images is nil"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image"}]}], "images": [PNG, PNG]},
            "place 1 image(s)",
        ),
        ({"messages": [{"role": "user", "content": [{"type": "video"}]}]}, "content[0]: a content part"),
        ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "content[0]: a content part"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "url": "x"}]}]}, "the key 'url'"),
        ({"messages": [{"role": "user", "content": []}]}, "content has 0 parts"),
    ],
)
def test_misplaced_or_mistyped_images_are_invalid(fields: dict[str, Any], fragment: str) -> None:
    error = _refused(**fields)
    assert error.code is ErrorCode.INVALID_REQUEST
    assert fragment in error.message, error.message
