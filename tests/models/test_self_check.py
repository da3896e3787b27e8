"""The start-up self-check: packed path against HF's own forward on a fixed input, for every architecture."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from scoring_testkit import self_check_atol, self_check_cosine_floor

from models import ModelLoadError, Scorer, ScorerConfig, write_tiny_model
from models import attention as attention_module
from models.selfcheck import run_self_check
from models.tiny import ARCHITECTURES
from schemas import ScoreRequest


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("self-check")  # pytest's temporary root: removed with old runs
    return {arch: write_tiny_model(root / arch, arch, seed=11, num_labels=2) for arch in ARCHITECTURES}


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_every_architecture_passes_its_self_check(architecture: str, tiny_dirs: dict[str, Path]) -> None:
    scorer = Scorer(tiny_dirs[architecture], ScorerConfig(device="cpu"))
    report = run_self_check(scorer)
    # Packed vs HF's plain forward, both float32: the model's chain of sums for the check's prompts at the
    # scores' scale, and the cosine that chain's elementwise bound allows (scoring_testkit).
    assert report.items == 3 and report.max_score_diff < self_check_atol(tiny_dirs[architecture], report)
    assert report.min_hidden_cosine >= self_check_cosine_floor(scorer, tiny_dirs[architecture])
    # The plain forward borrowed HF's attention; the packed path must have ours back.
    labels = (4,) if scorer.model.judge else None  # Gemma 4's text model is a judge only
    result = scorer.score([ScoreRequest("after", items=((5, 6, 7), (8, 9)), label_token_ids=labels)])[0]
    assert result.ok


def test_another_pooling_than_the_heads_is_checked_through_the_head(tiny_dirs: dict[str, Path]) -> None:
    scorer = Scorer(tiny_dirs["qwen3"], ScorerConfig(device="cpu", pooling="mean"))
    report = run_self_check(scorer)
    # Two float32 forwards, the mean one more sum over the tokens (self_check_atol).
    assert report.max_score_diff < self_check_atol(tiny_dirs["qwen3"], report, mean_pooled=True)


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


def test_a_model_that_is_no_hybrid_starts_without_flash_linear_attention(tiny_llama_dir: Path) -> None:
    """The self-check's reference runs the hybrids' HF functions in torch (models.linear_attention); for any
    other model it must not import their modules, which import flash-linear-attention: seconds of every
    worker's start on the CPU, and a warning about Triton in its log. A fresh interpreter, as a worker's."""
    import subprocess
    import sys

    script = (
        "import sys\n"
        "from models import Scorer, ScorerConfig\n"
        "from models.selfcheck import run_self_check\n"
        f"run_self_check(Scorer({str(tiny_llama_dir)!r}, ScorerConfig(device='cpu')))\n"
        "hybrids = [f'transformers.models.{n}.modeling_{n}' for n in ('qwen3_5', 'qwen3_next')]\n"
        "print(sorted(m for m in sys.modules if m in ('fla', *hybrids)))\n"
    )
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[]", done.stdout
