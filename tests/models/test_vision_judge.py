"""Qwen2.5-VL, Qwen3-VL and Qwen3.5 as image-text judges against HF float32: label-token logits at the last
token, image and text requests mixed in one batch (packed by default: tests/models/test_vision_packed.py
has the packed path's own cases, Qwen3.5's Gated DeltaNet layers among them, and the padded fallback), 3-D
rotary positions (M-RoPE) as HF's own forward gives them."""

from __future__ import annotations

import io
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from scoring_testkit import hidden_of, scores_of
from tolerances import forward_atol
from vision_testkit import (
    JUDGE_LABELS,
    MARK_QWEN,
    encoded,
    item_texts,
    judge_alone,
    judge_requests,
    load_judge_reference,
)

from models import ModelLoadError, Scorer, ScorerConfig
from models.tiny_vision import QWEN_VL_TOKENS, write_tiny_qwen_vl_judge
from schemas import ErrorCode, ScoreRequest, ScoreResult


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl", "qwen3_5"])
def judge_dir(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Path:
    return write_tiny_qwen_vl_judge(tmp_path_factory.mktemp(f"tiny-{request.param}"), 5, request.param)


@pytest.fixture(scope="module")
def judge(judge_dir: Path) -> Scorer:
    return Scorer(judge_dir, ScorerConfig(device="cpu"))


@pytest.fixture(scope="module")
def reference(judge_dir: Path) -> tuple[Any, Any]:
    return load_judge_reference(judge_dir)


def _assert_matches(result: Any, expected: tuple[np.ndarray, np.ndarray, int], judge_dir: Path) -> None:
    scores, hidden, longest = expected
    assert result.ok, result.error
    # Float32 on both sides, the same sums in other orders (a packed row against one unpadded row, SDPA
    # against eager): within forward_bound of the vision tower's and the text model's sums in series.
    # A softmax over the labels is 1-Lipschitz in the max norm, so the logits' bound holds for it.
    atol = forward_atol(judge_dir, scores, longest=longest)
    np.testing.assert_allclose(scores_of(result), scores, atol=atol, rtol=0)
    if result.pooled_hidden_states is not None:
        atol = forward_atol(judge_dir, hidden, longest=longest)
        np.testing.assert_allclose(hidden_of(result), hidden, atol=atol, rtol=0)


def test_mixed_batch_matches_hf_float32(judge: Scorer, reference: Any, judge_dir: Path) -> None:
    requests = judge_requests()
    results = judge.score(requests)
    for request, result in zip(requests, results, strict=True):
        _assert_matches(result, judge_alone(reference, request), judge_dir)
    assert results[0].pooled_hidden_states is not None and results[3].pooled_hidden_states is None
    # Softmax over the labels where asked: each item's probabilities sum to one.
    np.testing.assert_allclose(scores_of(results[2]).sum(-1), 1.0, atol=1e-6)


def test_each_request_alone_matches_hf(judge: Scorer, reference: Any, judge_dir: Path) -> None:
    for request in judge_requests()[::2]:
        _assert_matches(judge.score([request])[0], judge_alone(reference, request), judge_dir)


def test_the_deterministic_setting_scores_item_by_item(reference: Any, judge_dir: Path) -> None:
    scorer = Scorer(judge_dir, ScorerConfig(device="cpu", deterministic=True))
    requests = judge_requests()
    for request, result in zip(requests, scorer.score(requests), strict=True):
        _assert_matches(result, judge_alone(reference, request), judge_dir)


def test_image_positions_are_3d(judge: Scorer, reference: Any, judge_dir: Path) -> None:
    """HF's forward gives an image's tokens (time, row, column) positions and the text after it positions
    past the image's largest side, not one a token: with 1-D positions the scores differ by far more than
    the tolerance, so the comparisons above would see an M-RoPE left out."""
    model, processor = reference
    request = judge_requests()[0]
    expected, _, longest = judge_alone(reference, request)
    texts, _ = item_texts(request, processor, MARK_QWEN)
    images = [Image.open(io.BytesIO(data)).convert("RGB") for data in request.images or ()]
    inputs = processor(text=texts[:1], images=[images], return_tensors="pt")
    flat = torch.arange(inputs["input_ids"].shape[1]).view(1, 1, -1).expand(3, 1, -1)
    with torch.inference_mode():
        out = model(**inputs, position_ids=flat)
    flat_scores = out.logits[0, -1, list(JUDGE_LABELS)].double().numpy()
    assert np.abs(flat_scores - expected[0]).max() > 10 * forward_atol(judge_dir, expected, longest=longest)


def test_the_images_change_the_scores(judge: Scorer, judge_dir: Path) -> None:
    requests = [
        ScoreRequest(
            f"r{seed}", items=("a cat",), images=(encoded("PNG", seed),), label_token_ids=JUDGE_LABELS
        )
        for seed in (1, 2)
    ]
    first, second = (scores_of(result) for result in judge.score(requests))
    prepared = judge.prepare(requests[0])
    assert not isinstance(prepared, ScoreResult)
    longest = len(prepared.prompts[0])
    assert np.abs(first - second).max() > 10 * forward_atol(judge_dir, first, longest=longest)


def test_typed_image_pads_are_refused_and_token_ids_taken_as_sent(judge: Scorer) -> None:
    """An image pad in the text would take no image (and break the model's count of features and tokens):
    its request's error; the good request beside it scores as alone. Token ids are taken as sent: beside
    an image request they split the batch, and both score as alone."""
    pad = QWEN_VL_TOKENS["image_token"]
    pad_id = judge.model.tokenizer.convert_tokens_to_ids(pad)
    requests = [
        ScoreRequest("pad-with-image", items=(f"a {pad}",), images=(encoded("PNG", 1),)),
        ScoreRequest("pad-in-text", items=(f"a {pad} b",)),
        ScoreRequest("good", items=("a cat",), images=(encoded("PNG", 2),)),
        ScoreRequest("token-ids", items=((5, pad_id, 7),)),
    ]
    requests = [replace(one, label_token_ids=JUDGE_LABELS) for one in requests]
    *refused, good, as_sent = judge.score(requests)
    for result in refused:
        assert result.error is not None and result.error.code is ErrorCode.INVALID_REQUEST, result
    for got, request in ((good, requests[2]), (as_sent, requests[3])):
        alone = judge.score([request])[0]
        assert got.ok and alone.ok, (got.error, alone.error)
        prepared = judge.prepare(request)
        assert not isinstance(prepared, ScoreResult)
        # The same float32 sums in a batch and alone, in other orders (forward_bound).
        want = scores_of(alone)
        atol = forward_atol(Path(judge.hf_model.name_or_path), want, longest=len(prepared.prompts[0]))
        np.testing.assert_allclose(scores_of(got), want, atol=atol, rtol=0)


def test_requests_without_label_tokens_are_refused(judge: Scorer) -> None:
    result = judge.score([ScoreRequest("r", items=("a",), images=(encoded("PNG", 1),))])[0]
    assert result.error is not None and result.error.code is ErrorCode.LABEL_IDS_REQUIRED, result


def test_a_qwen2_5_vl_classifier_is_refused(tmp_path: Path) -> None:
    import json

    config = {"model_type": "qwen2_5_vl", "architectures": ["Qwen2_5_VLForSequenceClassification"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="judge only"):
        Scorer(tmp_path, ScorerConfig(device="cpu"))


@pytest.mark.parametrize("architecture", ["qwen2_5_vl", "qwen3_vl", "qwen3_5"])
def test_make_tiny_model_writes_the_image_text_judge(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], architecture: str
) -> None:
    from worker import cli

    target = tmp_path / "vl"
    command = [
        "make-tiny-model", str(target), "--architecture", architecture, "--images", "--seed", "3", "--judge",
    ]  # fmt: skip
    assert cli.main(command) == 0
    assert "image-text judge" in capsys.readouterr().out
    scorer = Scorer(target, ScorerConfig(device="cpu"))
    request = ScoreRequest("r", items=("a",), images=(encoded("PNG", 1),), label_token_ids=JUDGE_LABELS)
    assert scorer.score([request])[0].ok
    assert cli.main(["make-tiny-model", str(tmp_path / "x"), "--architecture", architecture]) == 2
    assert cli.main([*command, "--prm", "head"]) == 2


def test_the_start_up_self_check_passes(judge: Scorer) -> None:
    """The worker's start-up check (text prompts through the engine and through HF's own forward) accepts
    the judge: its label logits agree within the check's float32 bound."""
    from models.selfcheck import run_self_check

    report = run_self_check(judge)
    assert report.items > 0 and report.max_score_diff <= report.score_bound
