"""Image-text classifiers (Gemma 3) against HF float32: images and text mixed; every image error."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from scoring_testkit import hidden_of, scores_of
from tolerances import forward_atol
from vision_testkit import encoded, hf_alone, image_and_text_requests, load_reference, png_claiming

from models import ModelLoadError, Scorer, ScorerConfig, write_tiny_model
from models.tiny_vision import TOKENS_PER_IMAGE, write_tiny_vision_model
from schemas import MAX_IMAGE_PIXELS, ErrorCode, ScoreRequest, ScoreResult


@pytest.fixture(scope="module")
def vision_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_vision_model(tmp_path_factory.mktemp("tiny-gemma3-vision"), seed=11)


@pytest.fixture(scope="module")
def vision_scorer(vision_dir: Path) -> Scorer:
    return Scorer(vision_dir, ScorerConfig(device="cpu"))


@pytest.fixture(scope="module")
def reference(vision_dir: Path) -> tuple[Any, Any]:
    return load_reference(vision_dir)


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
    requests = image_and_text_requests()
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
    request = image_and_text_requests()[0]
    result = vision_scorer.score([request])[0]
    causal, _, longest = hf_alone(reference, request, bidirectional=False)
    atol = forward_atol(vision_dir, causal, longest=longest)
    assert np.abs(scores_of(result) - causal).max() > 10 * atol


def test_the_deterministic_setting_scores_images_item_by_item(reference: Any, vision_dir: Path) -> None:
    scorer = Scorer(vision_dir, ScorerConfig(device="cpu", deterministic=True))
    requests = image_and_text_requests()
    for request, result in zip(requests, scorer.score(requests), strict=True):
        _assert_matches(result, hf_alone(reference, request), vision_dir)


def _assert_alike(got: Any, request: ScoreRequest, scorer: Scorer) -> None:
    """A request's scores in a batch with others and alone: two float32 computations of the same sums in
    other orders (the batch's padded width changes the products' shapes), within forward_bound."""
    alone = scorer.score([request])[0]
    assert got.ok and alone.ok, (got.error, alone.error)
    prepared = scorer.prepare(request)
    assert not isinstance(prepared, ScoreResult)
    longest = max(len(prompt) for prompt in prepared.prompts)
    want = np.asarray(alone.scores)
    atol = forward_atol(Path(scorer.hf_model.name_or_path), want, longest=longest)
    np.testing.assert_allclose(got.scores, want, atol=atol, rtol=0)


def _error(scorer: Scorer, images: Sequence[bytes]) -> Any:
    good = ScoreRequest("good", items=("a cat",), images=(encoded("PNG", 1),))
    bad = ScoreRequest("bad", items=("a cat",), images=tuple(images))
    results = scorer.score([good, bad, good])
    # One bad image fails its own request only; the others score as they do alone.
    for other in (results[0], results[2]):
        _assert_alike(other, good, scorer)
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


def test_image_marks_and_image_tokens_outside_images_are_refused(vision_scorer: Scorer) -> None:
    """A begin mark typed in the text would take no image; an image token outside an image would make the
    model's count of features and tokens differ (and fail the batch it shares): each its request's error."""
    image_id = vision_scorer.model.tokenizer.convert_tokens_to_ids("<image_soft_token>")
    requests = [
        ScoreRequest("mark", items=("<start_of_image>",), images=(encoded("PNG", 1),)),
        ScoreRequest("token-with-image", items=("a <image_soft_token>",), images=(encoded("PNG", 1),)),
        ScoreRequest("token-in-text", items=("a <image_soft_token> b",)),
    ]
    good = ScoreRequest("good", items=("a cat",), images=(encoded("PNG", 2),))
    # Token ids are taken as sent: beside an image request they split the batch, and both score as alone.
    token_ids = ScoreRequest("token-id", items=((5, image_id, 7),))
    *refused, scored, as_sent = vision_scorer.score([*requests, good, token_ids])
    for result in refused:
        assert result.error is not None and result.error.code is ErrorCode.INVALID_REQUEST, result
    assert "image token" in refused[1].error.message  # type: ignore[union-attr]
    _assert_alike(scored, good, vision_scorer)
    _assert_alike(as_sent, token_ids, vision_scorer)


def test_qwen2_vl_is_refused_by_name(tmp_path: Path) -> None:
    config = {"model_type": "qwen2_vl", "architectures": ["Qwen2VLForConditionalGeneration"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="M-RoPE"):
        Scorer(tmp_path, ScorerConfig(device="cpu"))


def test_the_images_change_the_scores(vision_scorer: Scorer, vision_dir: Path) -> None:
    """Two images under one text score apart, by far more than the tolerance: the features reach the text."""
    requests = [ScoreRequest(f"r{seed}", items=("a cat",), images=(encoded("PNG", seed),)) for seed in (1, 2)]
    first, second = (scores_of(result) for result in vision_scorer.score(requests))
    prepared = vision_scorer.prepare(requests[0])
    assert not isinstance(prepared, ScoreResult)
    longest = len(prepared.prompts[0])
    assert np.abs(first - second).max() > 10 * forward_atol(vision_dir, first, longest=longest)


def test_make_tiny_model_writes_the_image_text_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from worker import cli

    target = tmp_path / "vl"
    assert (
        cli.main(["make-tiny-model", str(target), "--architecture", "gemma3", "--images", "--seed", "3"]) == 0
    )
    assert "image-text" in capsys.readouterr().out
    scorer = Scorer(target, ScorerConfig(device="cpu"))
    assert scorer.score([ScoreRequest("r", items=("a",), images=(encoded("PNG", 1),))])[0].ok
    # The flag and the architecture go together.
    assert cli.main(["make-tiny-model", str(tmp_path / "x"), "--architecture", "gemma3"]) == 2
    assert cli.main(["make-tiny-model", str(tmp_path / "y"), "--images"]) == 2
