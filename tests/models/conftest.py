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
def tiny_gemma2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Attention logit soft-capping, alternating sliding/global layers, scaled embeddings, (1 + w) norms."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny-gemma2"), "gemma2", seed=5)


@pytest.fixture(scope="session")
def tiny_gemma3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """q/k norms, alternating sliding/global layers with their own rotary bases."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny-gemma3"), "gemma3_text", seed=6)


@pytest.fixture(scope="session")
def tiny_phi3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Fused qkv and gate/up projections, sliding window."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny-phi3"), "phi3", seed=7)


# The newer families, by architecture: SmolLM3 (a layer without rotary positions), OLMo 2 (norms after the
# sublayers, q/k norms over whole projections), OLMo 3 (the same with sliding layers), GLM-4 (partial
# rotary, four norms, one gate_up projection).
NEWER_FAMILIES = {"smollm3": 21, "olmo2": 22, "olmo3": 23, "glm4": 24}


@pytest.fixture(scope="session")
def newer_family_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {
        name: write_tiny_model(tmp_path_factory.mktemp(f"tiny-{name}"), name, seed=seed)
        for name, seed in NEWER_FAMILIES.items()
    }


@pytest.fixture(scope="session")
def tiny_qwen3_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """8 experts, 2 a token; a dense middle layer among the sparse ones."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny-qwen3-moe"), "qwen3_moe", seed=8)


@pytest.fixture(scope="session")
def tiny_qwen3_5_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Hybrid: three Gated DeltaNet layers, then full attention with a gated output and partial rotary."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny-qwen3_5"), "qwen3_5_text", seed=9)


@pytest.fixture(scope="session")
def tiny_qwen3_next_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Hybrid like Qwen3.5, with sparse MoE blocks (HF's) in place of the dense MLPs."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny-qwen3_next"), "qwen3_next", seed=10)


@pytest.fixture(scope="session")
def three_label_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama-3labels"), "llama", seed=4, num_labels=3)


@pytest.fixture(scope="session")
def model_dirs(
    tiny_llama_dir: Path,
    tiny_qwen3_dir: Path,
    tiny_qwen2_dir: Path,
    tiny_mistral_dir: Path,
    tiny_gemma2_dir: Path,
    tiny_gemma3_dir: Path,
    tiny_phi3_dir: Path,
    newer_family_dirs: dict[str, Path],
    tiny_qwen3_moe_dir: Path,
    tiny_qwen3_5_dir: Path,
    tiny_qwen3_next_dir: Path,
) -> dict[str, Path]:
    return {
        "llama": tiny_llama_dir,
        "qwen3": tiny_qwen3_dir,
        "qwen2": tiny_qwen2_dir,
        "mistral": tiny_mistral_dir,
        "gemma2": tiny_gemma2_dir,
        "gemma3_text": tiny_gemma3_dir,
        "phi3": tiny_phi3_dir,
        **newer_family_dirs,
        "qwen3_moe": tiny_qwen3_moe_dir,
        "qwen3_5_text": tiny_qwen3_5_dir,
        "qwen3_next": tiny_qwen3_next_dir,
    }
