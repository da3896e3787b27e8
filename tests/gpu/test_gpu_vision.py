"""Image-text classifiers on the GPU against HuggingFace float32 on the CPU: float32 and bfloat16.

Marked `gpu` and skipped without a CUDA device (tests/models/test_vision.py is the CPU suite's side).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from tolerances import forward_atol
from vision_testkit import hf_alone, image_and_text_requests, load_reference

from models import Scorer, ScorerConfig
from models.tiny_vision import write_tiny_vision_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module")
def vision_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_vision_model(tmp_path_factory.mktemp("gpu-gemma3-vision"), seed=12)


@pytest.fixture(scope="module")
def reference(vision_dir: Path) -> tuple[Any, Any]:
    return load_reference(vision_dir)


def _scored(scorer: Scorer) -> list[tuple[np.ndarray, np.ndarray]]:
    results = scorer.score(image_and_text_requests())
    out = []
    for result in results:
        assert result.ok, result.error
        scores = np.asarray(result.scores, dtype=np.float64)
        hidden = np.stack([t.to_numpy().astype(np.float64) for t in result.pooled_hidden_states or ()])
        out.append((scores, hidden))
    return out


def test_float32_on_the_gpu_matches_hf_float32(
    vision_dir: Path, reference: Any, strict_float32: None
) -> None:
    scorer = Scorer(vision_dir, ScorerConfig(device="cuda", dtype="float32"))
    for (scores, hidden), request in zip(_scored(scorer), image_and_text_requests(), strict=True):
        want_scores, want_hidden, longest = hf_alone(reference, request)
        # Two float32 computations of the same sums in other orders (forward_bound, tests/tolerances.py).
        for got, want in ((scores, want_scores), (hidden, want_hidden)):
            atol = forward_atol(vision_dir, want, longest=longest)
            np.testing.assert_allclose(got, want, atol=atol, rtol=0)


def test_bfloat16_on_the_gpu_is_as_close_to_float32_as_hf_bfloat16(vision_dir: Path, reference: Any) -> None:
    """bfloat16 rounds every layer: the bound is HF's own bfloat16 forward's distance from float32 on the same
    requests, doubled (two bfloat16 computations, each that far), plus 5% of the score scale (the
    self-check's bfloat16 floor, docs/models.md)."""
    scorer = Scorer(vision_dir, ScorerConfig(device="cuda", dtype="bfloat16"))
    half_model, _ = load_reference(vision_dir, torch.bfloat16)
    for (scores, _), request in zip(_scored(scorer), image_and_text_requests(), strict=True):
        want, _, _ = hf_alone(reference, request)
        hf_half, _, _ = hf_alone((half_model, reference[1]), request, dtype=torch.bfloat16)
        bound = 2 * float(np.abs(hf_half - want).max()) + 0.05 * max(1.0, float(np.abs(want).max()))
        assert float(np.abs(scores - want).max()) <= bound
