"""Shared test fixtures: tiny random-weight models generated once per test session (no downloads)."""

from __future__ import annotations

from pathlib import Path

import pytest

from models import write_tiny_model


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny LlamaForSequenceClassification (1 label) with its tokenizer."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama", seed=0, num_labels=1)


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3ForSequenceClassification (head_dim != hidden/heads, q/k norms) with its tokenizer."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"), "qwen3", seed=1, num_labels=1)
