"""Image-text judges (Qwen2.5-VL, Qwen3-VL) on the GPU against HuggingFace on the CPU: float32 and bfloat16.

Marked `gpu` and skipped without a CUDA device (tests/models/test_vision_judge.py is the CPU suite's side).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from tolerances import forward_atol
from vision_testkit import judge_alone, judge_requests, load_judge_reference

from models import Scorer, ScorerConfig
from models.tiny_vision import write_tiny_qwen_vl_judge

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def judge_dir(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Path:
    return write_tiny_qwen_vl_judge(tmp_path_factory.mktemp(f"gpu-{request.param}"), 13, request.param)


@pytest.fixture(scope="module")
def reference(judge_dir: Path) -> tuple[Any, Any]:
    return load_judge_reference(judge_dir)


def test_float32_on_the_gpu_matches_hf_float32(judge_dir: Path, reference: Any, strict_float32: None) -> None:
    scorer = Scorer(judge_dir, ScorerConfig(device="cuda", dtype="float32"))
    requests = judge_requests()
    for result, request in zip(scorer.score(requests), requests, strict=True):
        assert result.ok, result.error
        want, _, longest = judge_alone(reference, request)
        # Two float32 computations of the same sums in other orders (forward_bound, tests/tolerances.py).
        atol = forward_atol(judge_dir, want, longest=longest)
        np.testing.assert_allclose(np.asarray(result.scores), want, atol=atol, rtol=0)


def test_bfloat16_on_the_gpu_is_as_close_to_float32_as_hf_bfloat16(judge_dir: Path, reference: Any) -> None:
    """bfloat16 rounds every layer: the bound is HF's own bfloat16 forward's distance from float32 on the same
    requests, doubled (two bfloat16 computations, each that far), plus 5% of the score scale (the
    self-check's bfloat16 floor, docs/models.md)."""
    scorer = Scorer(judge_dir, ScorerConfig(device="cuda", dtype="bfloat16"))
    half_model, processor = load_judge_reference(judge_dir, torch.bfloat16)
    requests = judge_requests()
    for result, request in zip(scorer.score(requests), requests, strict=True):
        assert result.ok, result.error
        want, _, _ = judge_alone(reference, request)
        hf_half, _, _ = judge_alone((half_model, processor), request, torch.bfloat16)
        bound = 2 * float(np.abs(hf_half - want).max()) + 0.05 * max(1.0, float(np.abs(want).max()))
        assert float(np.abs(np.asarray(result.scores) - want).max()) <= bound
