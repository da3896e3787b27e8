"""Image-text classifiers (Gemma 3) against HF float32: images and text mixed; every image error."""

from __future__ import annotations

import io
import json
import struct
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from scoring_testkit import hidden_of, scores_of
from tolerances import forward_atol
from transformers import AutoModelForSequenceClassification, Gemma3Processor

from models import ModelLoadError, Scorer, ScorerConfig, write_tiny_model
from models.tiny_vision import TOKENS_PER_IMAGE, write_tiny_vision_model
from schemas import MAX_IMAGE_PIXELS, ChatMessage, ContentPart, ErrorCode, ScoreRequest


@pytest.fixture(scope="module")
def vision_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_vision_model(tmp_path_factory.mktemp("tiny-gemma3-vision"), seed=11)


@pytest.fixture(scope="module")
def vision_scorer(vision_dir: Path) -> Scorer:
    return Scorer(vision_dir, ScorerConfig(device="cpu"))


@pytest.fixture(scope="module")
def reference(vision_dir: Path) -> tuple[Any, Any]:
    model = AutoModelForSequenceClassification.from_pretrained(
        str(vision_dir), attn_implementation="eager", dtype=torch.float32
    ).eval()
    return model, Gemma3Processor.from_pretrained(str(vision_dir))


def encoded(fmt: str, seed: int, size: tuple[int, int] = (20, 30)) -> bytes:
    """A random RGB picture of `size` (width, height) as a file of `fmt` (lossless where it can be)."""
    rng = np.random.default_rng(seed)
    pixels = (rng.random((size[1], size[0], 3)) * 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, fmt, **({"lossless": True} if fmt == "WEBP" else {}))
    return buffer.getvalue()


def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def png_claiming(width: int, height: int) -> bytes:
    """A small, valid PNG header that claims a canvas of width x height (a decompression bomb's shape)."""
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    data = zlib.compress(b"\x00" * 64)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", data) + _chunk(b"IEND", b"")


def _texts(request: ScoreRequest, processor: Any) -> tuple[list[str], bool]:
    """Each item's prompt text as the contract defines it (schemas/README.md, Images)."""
    if request.messages is not None:
        turns = [m.as_template_turn() for m in request.messages]
        texts = [
            processor.tokenizer.apply_chat_template(
                [*turns, {"role": "assistant", "content": item}], tokenize=False
            )
            for item in request.items
        ]
        return texts, False
    marks = processor.boi_token * len(request.images or ())
    return [marks + f"{request.query or ''}{item}" for item in request.items], True


def hf_alone(reference: tuple[Any, Any], request: ScoreRequest, *, bidirectional: bool = True) -> Any:
    """HF float32 on each item alone: the processor's ids, token types and pixel values, the model's own
    forward. Returns (scores [N, L], pooled hidden states [N, H], longest prompt)."""
    model, processor = reference
    images = [Image.open(io.BytesIO(data)).convert("RGB") for data in request.images or ()]
    texts, specials = _texts(request, processor)
    scores, hidden, longest = [], [], 0
    for text in texts:
        inputs = processor(
            text=[text], images=[images] if images else None, add_special_tokens=specials, return_tensors="pt"
        )
        types = inputs.get("token_type_ids")
        if types is not None and not bidirectional:
            types = torch.zeros_like(types)
        with torch.inference_mode():
            out = model(
                input_ids=inputs["input_ids"],
                attention_mask=inputs["attention_mask"],
                pixel_values=inputs.get("pixel_values"),
                token_type_ids=types,
                output_hidden_states=True,
            )
        scores.append(out.logits[0].numpy())
        hidden.append(out.hidden_states[-1][0, -1].numpy())
        longest = max(longest, int(inputs["input_ids"].shape[1]))
    return np.stack(scores), np.stack(hidden), longest


def _requests() -> list[ScoreRequest]:
    chat = ChatMessage(
        "user", (ContentPart("image"), ContentPart("text", "Which fits? "), ContentPart("image"))
    )
    return [
        ScoreRequest(
            "picture-query", items=("a cat", " a dog on a mat"), query="Which animal? ",
            images=(encoded("PNG", 1),), return_pooled_hidden_states=True,
        ),
        ScoreRequest("text-only", items=("The quick brown fox", "jumps"), return_pooled_hidden_states=True),
        ScoreRequest(
            "chat-two-images", items=("the left one", "neither"),
            messages=(ChatMessage("system", "Judge."), chat),
            images=(encoded("JPEG", 2, (40, 12)), encoded("WEBP", 3, (16, 16))),
            return_pooled_hidden_states=True,
        ),
        ScoreRequest("text-chat", items=("yes",), messages=(ChatMessage("user", "Is it fine?"),),
                     return_pooled_hidden_states=True),
    ]  # fmt: skip


def _assert_matches(result: Any, expected: tuple[np.ndarray, np.ndarray, int], vision_dir: Path) -> None:
    scores, hidden, longest = expected
    # Float32 on both sides, the same sums in other orders (a padded batch's matmuls against one row's):
    # within forward_bound of the vision tower's and the text model's sums in series (tests/tolerances.py).
    np.testing.assert_allclose(
        scores_of(result), scores, atol=forward_atol(vision_dir, scores, longest=longest), rtol=0
    )
    np.testing.assert_allclose(
        hidden_of(result), hidden, atol=forward_atol(vision_dir, hidden, longest=longest), rtol=0
    )


def test_mixed_batch_matches_hf_float32(vision_scorer: Scorer, reference: Any, vision_dir: Path) -> None:
    requests = _requests()
    results = vision_scorer.score(requests)
    for request, result in zip(requests, results, strict=True):
        assert result.ok, result.error
        _assert_matches(result, hf_alone(reference, request), vision_dir)
    # Every image becomes its begin and end marks around TOKENS_PER_IMAGE soft tokens.
    text_alone = vision_scorer.score([ScoreRequest("t", items=("a cat",), query="Which animal? ")])[0]
    assert results[0].prompt_tokens > 2 * text_alone.prompt_tokens + 2 * TOKENS_PER_IMAGE


def test_an_image_request_alone_matches_hf(vision_scorer: Scorer, reference: Any, vision_dir: Path) -> None:
    request = ScoreRequest(
        "alone", items=("red",), images=(encoded("PNG", 9, (64, 48)), encoded("JPEG", 10)),
        return_pooled_hidden_states=True,
    )  # fmt: skip
    _assert_matches(vision_scorer.score([request])[0], hf_alone(reference, request), vision_dir)


def test_image_tokens_attend_both_ways(vision_scorer: Scorer, reference: Any, vision_dir: Path) -> None:
    """HF's model attends both ways inside each image's tokens; a causal mask there gives other scores, by
    far more than the tolerance, so the comparisons above would see it."""
    request = _requests()[0]
    result = vision_scorer.score([request])[0]
    causal, _, longest = hf_alone(reference, request, bidirectional=False)
    atol = forward_atol(vision_dir, causal, longest=longest)
    assert np.abs(scores_of(result) - causal).max() > 10 * atol


def test_the_deterministic_setting_scores_images_item_by_item(reference: Any, vision_dir: Path) -> None:
    scorer = Scorer(vision_dir, ScorerConfig(device="cpu", deterministic=True))
    requests = _requests()
    for request, result in zip(requests, scorer.score(requests), strict=True):
        _assert_matches(result, hf_alone(reference, request), vision_dir)


def _error(scorer: Scorer, images: Sequence[bytes]) -> Any:
    good = ScoreRequest("good", items=("a cat",), images=(encoded("PNG", 1),))
    bad = ScoreRequest("bad", items=("a cat",), images=tuple(images))
    good_alone = scorer.score([good])[0]
    results = scorer.score([good, bad, good])
    # One bad image fails its own request only; the others score as they do alone.
    for other in (results[0], results[2]):
        assert other.ok and other.scores == good_alone.scores
    assert not results[1].ok and results[1].error is not None
    return results[1].error


def test_a_canvas_over_the_pixel_limit_is_refused_before_decoding(vision_scorer: Scorer) -> None:
    side = int(MAX_IMAGE_PIXELS**0.5)
    error = _error(vision_scorer, [encoded("PNG", 1), png_claiming(side + 1, side)])
    assert error.code is ErrorCode.IMAGE_TOO_MANY_PIXELS and "images[1]" in error.message
    assert f"{side + 1} x {side}" in error.message
    # Beyond Pillow's own bomb limit too (it would raise before the size could be read).
    assert _error(vision_scorer, [png_claiming(100_000, 100_000)]).code is ErrorCode.IMAGE_TOO_MANY_PIXELS


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP"])
def test_a_damaged_file_is_undecodable(vision_scorer: Scorer, fmt: str) -> None:
    whole = encoded(fmt, 4, (64, 64))
    for damaged in (whole[: len(whole) // 2], whole[:16] + bytes(len(whole) - 16)):
        error = _error(vision_scorer, [damaged])
        assert error.code is ErrorCode.IMAGE_UNDECODABLE, error
        assert "images[0]" in error.message and "send" in error.message


def test_a_text_model_refuses_images(tmp_path: Path) -> None:
    scorer = Scorer(write_tiny_model(tmp_path / "llama", "llama"), ScorerConfig(device="cpu"))
    result = scorer.score([ScoreRequest("r", items=("a",), images=(encoded("PNG", 1),))])[0]
    assert result.error is not None and result.error.code is ErrorCode.IMAGES_NOT_SUPPORTED


def test_image_marks_typed_in_the_text_are_refused(vision_scorer: Scorer) -> None:
    request = ScoreRequest("r", items=("<start_of_image>",), images=(encoded("PNG", 1),))
    result = vision_scorer.score([request])[0]
    assert result.error is not None and result.error.code is ErrorCode.INVALID_REQUEST


def test_qwen_vision_language_models_are_refused_by_name(tmp_path: Path) -> None:
    config = {"model_type": "qwen2_5_vl", "architectures": ["Qwen2_5_VLForSequenceClassification"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="M-RoPE"):
        Scorer(tmp_path, ScorerConfig(device="cpu"))


def test_the_images_change_the_scores(vision_scorer: Scorer, vision_dir: Path) -> None:
    """Two images under one text score apart, by far more than the tolerance: the features reach the text."""
    requests = [ScoreRequest(f"r{seed}", items=("a cat",), images=(encoded("PNG", seed),)) for seed in (1, 2)]
    first, second = (scores_of(result) for result in vision_scorer.score(requests))
    assert np.abs(first - second).max() > 10 * forward_atol(vision_dir, first, longest=16)
