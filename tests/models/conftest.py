"""Fixtures for the engine tests: scorers over the shared tiny models, and the extra architectures."""

from __future__ import annotations

from pathlib import Path

import pytest

from models import Scorer, ScorerConfig, write_tiny_model


@pytest.fixture(scope="session")
def llama_scorer(tiny_llama_dir: Path) -> Scorer:
    return Scorer(tiny_llama_dir, ScorerConfig(device="cpu"))


@pytest.fixture(scope="session")
def qwen3_scorer(tiny_qwen3_dir: Path) -> Scorer:
    return Scorer(tiny_qwen3_dir, ScorerConfig(device="cpu"))


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2", seed=2)


@pytest.fixture(scope="session")
def tiny_mistral_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Sliding window 16: the test prompts are longer, so the window matters."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny-mistral"), "mistral", seed=3)


@pytest.fixture(scope="session")
def three_label_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama-3labels"), "llama", seed=4, num_labels=3)


@pytest.fixture(scope="session")
def model_dirs(
    tiny_llama_dir: Path, tiny_qwen3_dir: Path, tiny_qwen2_dir: Path, tiny_mistral_dir: Path
) -> dict[str, Path]:
    return {
        "llama": tiny_llama_dir,
        "qwen3": tiny_qwen3_dir,
        "qwen2": tiny_qwen2_dir,
        "mistral": tiny_mistral_dir,
    }
