"""The start-up self-check: packed path against HF's own forward on a fixed input, for every architecture."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

from models import ModelLoadError, Scorer, ScorerConfig, write_tiny_model
from models import attention as attention_module
from models.selfcheck import run_self_check
from models.tiny import ARCHITECTURES
from schemas import ScoreRequest


@pytest.fixture(scope="module")
def tiny_dirs() -> dict[str, Path]:
    root = Path(tempfile.mkdtemp(prefix="self-check-"))
    return {arch: write_tiny_model(root / arch, arch, seed=11, num_labels=2) for arch in ARCHITECTURES}


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_every_architecture_passes_its_self_check(architecture: str, tiny_dirs: dict[str, Path]) -> None:
    scorer = Scorer(tiny_dirs[architecture], ScorerConfig(device="cpu"))
    report = run_self_check(scorer)
    assert report.items == 3 and report.max_score_diff < 1e-4 * report.score_scale
    assert report.min_hidden_cosine > 0.9999
    # The plain forward borrowed HF's attention; the packed path must have ours back.
    result = scorer.score([ScoreRequest(request_id="after", items=((5, 6, 7), (8, 9)))])[0]
    assert result.ok


def test_another_pooling_than_the_heads_is_checked_through_the_head(tiny_dirs: dict[str, Path]) -> None:
    scorer = Scorer(tiny_dirs["qwen3"], ScorerConfig(device="cpu", pooling="mean"))
    assert run_self_check(scorer).max_score_diff < 1e-4


def test_a_wrong_packed_path_stops_the_start(
    tiny_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    scorer = Scorer(tiny_dirs["llama"], ScorerConfig(device="cpu"))
    original = attention_module.attend_causal

    def off_by_a_little(*args: object, **kwargs: object) -> torch.Tensor:
        return original(*args, **kwargs) * 1.05  # type: ignore[arg-type]

    monkeypatch.setattr(attention_module, "attend_causal", off_by_a_little)
    with pytest.raises(ModelLoadError, match="self-check failed"):
        run_self_check(scorer)
