"""Image-text judges (Qwen2.5-VL, Qwen3-VL, Qwen3.5) and reward models (Qwen3.5's classifier, TRL value heads
on the Qwen judges) on the GPU against HuggingFace on the CPU: float32 and bfloat16, each with packed_images
on (all three packed: the exact path in float32, the varlen kernel in bfloat16, Qwen3.5's Gated DeltaNet
layers on the project's packed layer) and off.

Marked `gpu` and skipped without a CUDA device (tests/models/test_vision_judge.py is the CPU suite's side).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from tolerances import forward_atol
from vision_testkit import (
    judge_requests,
    load_judge_reference,
    mixed_judge_requests,
    token_judge_alone,
    value_head_of,
)

from models import Scorer, ScorerConfig
from models.tiny_vision import add_value_head, write_tiny_qwen_vl_judge
from models.vision_packed import PACKED_VISION_FAMILIES
from schemas import ScoreRequest

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# (architecture, head): a judge on label tokens, Qwen3.5's classifier, a TRL value head in the checkpoint
# or in value_head.safetensors beside it (Skywork-VL-Reward's layout).
CASES = [
    ("qwen2_5_vl", "judge"),
    ("qwen3_vl", "judge"),
    ("qwen3_5", "judge"),
    ("qwen3_5", "classifier"),
    ("qwen2_5_vl", "beside"),
    ("qwen3_vl", "trl"),
    ("qwen3_5", "trl"),
]


@pytest.fixture(scope="module", params=CASES, ids=["-".join(case) for case in CASES])
def judge_dir(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Path:
    architecture, head = request.param
    target = tmp_path_factory.mktemp(f"gpu-{architecture}-{head}")
    if head == "classifier":
        return write_tiny_qwen_vl_judge(target, 13, architecture, num_labels=2)
    model_dir = write_tiny_qwen_vl_judge(target, 13, architecture)
    return model_dir if head == "judge" else add_value_head(model_dir, 5, beside=head == "beside")


@pytest.fixture(scope="module")
def reference(judge_dir: Path) -> tuple[Any, Any]:
    return load_judge_reference(judge_dir)


def _requests(judge_dir: Path) -> list[ScoreRequest]:
    """The judges' requests and the packed tests' mixed batch (five image shapes, one-token items); a reward
    model's without their label tokens."""
    config = json.loads((judge_dir / "config.json").read_text())
    judge = config["architectures"][0].endswith("ForConditionalGeneration") and not value_head_of(judge_dir)
    requests = [*judge_requests(), *mixed_judge_requests()]
    if judge:
        return requests
    return [replace(one, label_token_ids=None, apply_softmax=False) for one in requests]


def _path(judge_dir: Path, packed_images: bool, half: bool) -> str:
    """The attention path the scorer takes: packed (the varlen kernel in half precision, the exact path in
    float32) for the families that pack images, with the setting on; HF's padded forward otherwise."""
    model_type = json.loads((judge_dir / "config.json").read_text())["model_type"]
    if not (packed_images and model_type in PACKED_VISION_FAMILIES):
        return "plain"
    return "varlen" if half else "reference"


@pytest.mark.parametrize("packed_images", [True, False])
def test_float32_on_the_gpu_matches_hf_float32(
    judge_dir: Path, reference: Any, strict_float32: None, packed_images: bool
) -> None:
    scorer = Scorer(judge_dir, ScorerConfig(device="cuda", dtype="float32", packed_images=packed_images))
    assert scorer.attention == _path(judge_dir, packed_images, half=False)
    requests, head = _requests(judge_dir), value_head_of(judge_dir)
    for result, request in zip(scorer.score(requests), requests, strict=True):
        assert result.ok, result.error
        want, _, longest = token_judge_alone(reference, request, value_head=head)
        # Two float32 computations of the same sums in other orders (forward_bound, tests/tolerances.py).
        atol = forward_atol(judge_dir, want, longest=longest)
        np.testing.assert_allclose(np.asarray(result.scores), want, atol=atol, rtol=0)


@pytest.mark.parametrize("packed_images", [True, False])
def test_bfloat16_on_the_gpu_is_as_close_to_float32_as_hf_bfloat16(
    judge_dir: Path, reference: Any, packed_images: bool
) -> None:
    """bfloat16 rounds every layer: the bound is HF's own bfloat16 forward's distance from float32 on the same
    requests, doubled (two bfloat16 computations, each that far), plus 5% of the score scale (the
    self-check's bfloat16 floor, docs/models.md). Packed, the text model runs the varlen kernel over one
    row of every item, images of five shapes among them."""
    scorer = Scorer(judge_dir, ScorerConfig(device="cuda", dtype="bfloat16", packed_images=packed_images))
    assert scorer.attention == _path(judge_dir, packed_images, half=True)
    half_model, processor = load_judge_reference(judge_dir, torch.bfloat16)
    requests, head = _requests(judge_dir), value_head_of(judge_dir)
    for result, request in zip(scorer.score(requests), requests, strict=True):
        assert result.ok, result.error
        want, _, _ = token_judge_alone(reference, request, value_head=head)
        hf_half, _, _ = token_judge_alone((half_model, processor), request, torch.bfloat16, value_head=head)
        bound = 2 * float(np.abs(hf_half - want).max()) + 0.05 * max(1.0, float(np.abs(want).max()))
        assert float(np.abs(np.asarray(result.scores) - want).max()) <= bound
